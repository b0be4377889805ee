"""Random planning rounds for the planner's property tests and benchmark.

Every function takes a seeded ``random.Random`` and returns plain planner inputs; the same seed always gives
the same round. Pure apart from advancing the generator passed in. Current layouts are built by adding
random instances at placements the geometry check accepts, so they are always valid.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.layout import free_starts
from dynamig.geometry.model import GpuModel, PlacedInstance, normalize_layout
from dynamig.planner.model import ClaimDemand, CurrentInstance, GpuState, Policy

SMALL_MODELS = ("A100-80GB", "A100-40GB", "H100-80GB", "A30-24GB", "RTXPRO6000-96GB")
MIXED_MODELS = ("A100-80GB", "H100-80GB", "H200-141GB", "A100-40GB")


@dataclass(frozen=True, slots=True)
class Round:
    gpus: tuple[GpuState, ...]
    claims: tuple[ClaimDemand, ...]
    policy: Policy


def _plain_profiles(model: GpuModel) -> list[str]:
    """Profiles without media-engine suffixes: what most claims ask for."""
    return [p.name for p in model.profiles if "+" not in p.name and "-" not in p.name]


def random_instances(
    rng: random.Random, model: GpuModel, fill: float, busy: float
) -> tuple[CurrentInstance, ...]:
    """A valid random layout, about ``fill`` of the GPU; each instance busy with probability ``busy``."""
    layout: list[PlacedInstance] = []
    names = [p.name for p in model.profiles]
    for _ in range(int(fill * model.memory_slices) + 1):
        if rng.random() > fill:
            continue
        name = rng.choice(names)
        starts = free_starts(model, normalize_layout(layout), name)
        if starts:
            layout.append(PlacedInstance(rng.choice(starts), name))
    return tuple(CurrentInstance(i.profile, i.start, rng.random() < busy) for i in normalize_layout(layout))


def random_claims(
    rng: random.Random,
    n: int,
    profiles: Sequence[str],
    nodes: Sequence[str],
    prefix: str = "c",
    restrict: float = 0.2,
) -> tuple[ClaimDemand, ...]:
    claims = []
    for i in range(n):
        k = rng.choice((1, 1, 1, 2, 3)) if len(profiles) > 1 else 1
        alternatives = tuple(rng.sample(list(profiles), min(k, len(profiles))))
        count = rng.choice((1, 1, 1, 1, 1, 1, 2, 2, 3))
        only = None
        if nodes and rng.random() < restrict:
            only = frozenset(rng.sample(list(nodes), rng.randint(1, min(3, len(nodes)))))
        claims.append(ClaimDemand(f"{prefix}{i:05d}", alternatives, count, only))
    return tuple(claims)


def small_round(rng: random.Random, catalog: Catalog, max_gpus: int = 4, max_claims: int = 10) -> Round:
    """A tiny cluster (1..max_gpus GPUs on 1..3 nodes, one or two models) and 0..max_claims claims."""
    keys = [k for k in SMALL_MODELS if k in catalog]
    chosen = rng.sample(keys, rng.choice((1, 1, 2)))
    n_gpus = rng.randint(1, max_gpus)
    n_nodes = rng.randint(1, min(3, n_gpus))
    gpus = []
    for i in range(n_gpus):
        model = catalog.model(rng.choice(chosen))
        node = f"n{i % n_nodes}"
        fill, busy = rng.choice((0.0, 0.3, 0.6, 0.9)), rng.choice((0.0, 0.4, 0.8))
        inst = random_instances(rng, model, fill=fill, busy=busy)
        gpus.append(GpuState(node, i // n_nodes, model.key, inst))
    models = [catalog.model(k) for k in chosen]
    profiles = sorted({p for m in models for p in _plain_profiles(m)})
    nodes = sorted({g.node for g in gpus})
    claims = random_claims(rng, rng.randint(0, max_claims), profiles, nodes)
    allowed = None
    if rng.random() < 0.25:
        allowed = frozenset(rng.sample(profiles, max(1, len(profiles) - 2)))
    budget = rng.choice((None, None, None, 1, 2))
    return Round(tuple(gpus), claims, Policy(allowed_profiles=allowed, max_gpus_reshaped=budget))


def large_round(rng: random.Random, catalog: Catalog, nodes: int, gpus_per_node: int, claims: int) -> Round:
    """``nodes`` x ``gpus_per_node`` GPUs (one model per node, mixed over the cluster), about half the GPUs
    partly cut with some busy instances, and ``claims`` pending claims (a fifth restricted to 1-3 nodes)."""
    keys = [k for k in MIXED_MODELS if k in catalog]
    gpus = []
    for n in range(nodes):
        model = catalog.model(keys[n % len(keys)])
        for i in range(gpus_per_node):
            inst: tuple[CurrentInstance, ...] = ()
            if rng.random() < 0.5:
                inst = random_instances(rng, model, fill=rng.choice((0.3, 0.6, 0.9)), busy=0.5)
            gpus.append(GpuState(f"node-{n:04d}", i, model.key, inst))
    models = [catalog.model(k) for k in keys]
    profiles = sorted({p for m in models for p in _plain_profiles(m)})
    names = sorted({g.node for g in gpus})
    demand = random_claims(rng, claims, profiles, names)
    return Round(tuple(gpus), demand, Policy())
