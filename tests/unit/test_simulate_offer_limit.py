"""The simulator's dynamig nodes publish what an agent with ``--placements-per-profile`` publishes.

What runs for real: the agent's inventory builder (``dynamig.kube.inventory.offered_devices``, which applies
the limit in the agent), the operator's auto rule (``dynamig.planner.offerlimit``) and the ``dynamig
simulate`` entry point. What is simulated: the node states, built by booking and ending seeded random jobs
on a simulated 4-GPU A100-80GB node, kept free instances included. Deterministic, about a second.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dynamig.cli import main
from dynamig.kube.inventory import GpuInventory, Instance, Occupancy, offered_devices
from dynamig.planner import Policy
from dynamig.planner.offerlimit import EVERY_PLACEMENT_UP_TO
from dynamig.planner.ranking import OfferKind, RankedOffer
from dynamig.simulate.allocators import Allocation
from dynamig.simulate.cluster import Cluster
from dynamig.simulate.dynamig_policy import DynamigAllocator
from dynamig.simulate.engine import SimConfig
from dynamig.simulate.runner import DynamigSettings, allocator_factories
from dynamig.simulate.trace import Job, uniform_cluster

PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
Published = tuple[int, str, int, str]  # GPU index, profile, placement start, kind


def _allocator(nodes: int, gpus: int, limit: int | None) -> DynamigAllocator:
    return DynamigAllocator(
        Cluster(uniform_cluster(nodes, gpus, "A100-80GB")),
        Policy(),
        reshape_latency_s=0.0,
        cooldown_s=0.0,
        placements_per_profile=limit,
    )


def _agent_publishes(alloc: DynamigAllocator, limit: int, profile: str) -> list[Published]:
    """What the agent's inventory builder publishes of ``profile`` for the simulated node 0's state, its
    held instances allocated and its kept ones free."""
    gpus = [
        GpuInventory(
            index=g.index,
            model=g.model,
            parent_uuid=f"GPU-{g.index}",
            instances=tuple(
                Instance(i.profile, i.start, Occupancy.ALLOCATED if alloc._kept(i) else Occupancy.FREE)
                for i in g.instances
            ),
            allowed_profiles=alloc._model_profiles[g.model.key],
            placements_per_profile=limit,
        )
        for g in alloc.cluster.nodes[0]
    ]
    return [
        (d.device.gpu_index, d.device.profile.name, d.device.placement_start, d.kind)
        for d in offered_devices(gpus)
        if d.kind != Occupancy.ALLOCATED.value and d.device.profile.name == profile
    ]


def _simulator_publishes(alloc: DynamigAllocator, profile: str) -> tuple[RankedOffer, ...]:
    alloc._published.pop(0, None)  # read the node's current state, as a republish would
    return alloc._publish(0, profile)


def _as_published(ranked: tuple[RankedOffer, ...]) -> list[Published]:
    return [(r.gpu_index, r.profile, r.start, r.kind.value) for r in ranked]


@pytest.mark.parametrize("limit", [1, 2])
def test_the_limit_publishes_what_the_agent_publishes_on_many_node_states(limit: int) -> None:
    rng = random.Random(11)
    limited = _allocator(1, 4, limit)
    every = _allocator(1, 4, 0)
    running: list[tuple[Job, Allocation]] = []
    compared = cut = frees = 0
    for step in range(120):
        if running and rng.random() < 0.45:
            job, got = running.pop(rng.randrange(len(running)))
            limited.release(job, got, float(step))
        else:
            job = Job(f"j{step}", float(step), None, (rng.choice(PROFILES),))
            placed = limited.place(job, float(step))
            if placed is not None:
                running.append((job, placed))
        for g_every, g_limited in zip(every.cluster.nodes[0], limited.cluster.nodes[0], strict=True):
            g_every.instances = g_limited.instances  # the same state, published without a limit
        every._reserved, every._not_ready = limited._reserved, limited._not_ready
        for profile in PROFILES:
            mine = _simulator_publishes(limited, profile)
            assert _as_published(mine) == _agent_publishes(limited, limit, profile)
            full = _simulator_publishes(every, profile)
            # every free instance, and of the placements to cut the first ``limit`` of each GPU, in rank order
            expected: list[RankedOffer] = []
            to_cut: dict[int, int] = {}  # GPU index -> its placements to cut kept so far
            for r in full:
                if r.kind is not OfferKind.FREE:
                    to_cut[r.gpu_index] = to_cut.get(r.gpu_index, 0) + 1
                    if to_cut[r.gpu_index] > limit:
                        continue
                expected.append(r)
            assert mine == tuple(expected)
            compared += 1
            cut += len(full) - len(mine)
            frees += sum(1 for r in mine if r.kind is OfferKind.FREE)
    assert compared == 600 and cut > 0 and frees > 0  # the limit bit, and free instances were published


def test_auto_follows_the_gpu_node_count_as_the_operator_chooses() -> None:
    assert _allocator(EVERY_PLACEMENT_UP_TO, 1, None).placements_per_profile == 0
    assert _allocator(EVERY_PLACEMENT_UP_TO + 1, 1, None).placements_per_profile == 1
    assert _allocator(EVERY_PLACEMENT_UP_TO + 1, 1, 0).placements_per_profile == 0  # a number is kept
    assert _allocator(2, 1, 3).placements_per_profile == 3


@pytest.mark.parametrize(("limit", "expected"), [(None, 1), (0, 0), (2, 2)])
def test_the_runner_hands_the_limit_to_every_dynamig_variant(limit: int | None, expected: int) -> None:
    spec = uniform_cluster(EVERY_PLACEMENT_UP_TO + 1, 1, "A100-80GB")
    dyn = DynamigSettings(placements_per_profile=limit)
    factories, _ = allocator_factories(spec, {}, SimConfig(), dyn, ("dynamig", "dynamig-preempt"))
    made = [make() for _, make in factories]
    assert len(made) == 2
    assert all(isinstance(a, DynamigAllocator) and a.placements_per_profile == expected for a in made)


@pytest.mark.parametrize(("limit", "second_on"), [(1, 1), (0, 0)])
def test_a_node_whose_one_placement_was_booked_is_passed_over(limit: int, second_on: int) -> None:
    """Two claims in one pass, packing order: with one placement per profile the first node's only
    published 1g.10gb placement is booked by the first, so the scheduler filters that node out for the
    second (its list is not republished until the instance exists); with every placement it books a second
    placement of that node."""
    alloc = DynamigAllocator(
        Cluster(uniform_cluster(2, 1, "A100-80GB")),
        Policy(),
        reshape_latency_s=6.0,
        cooldown_s=0.0,
        placements_per_profile=limit,
    )
    first = alloc.place(Job("a", 0.0, None, ("1g.10gb",)), 0.0)
    second = alloc.place(Job("b", 0.0, None, ("1g.10gb",)), 0.0)
    assert first is not None and second is not None
    assert first.node == 0
    assert second.node == second_on


@pytest.mark.parametrize("value", ["-1", "one", "1.5"])
def test_the_cli_refuses_a_value_that_is_not_auto_or_a_whole_number(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["simulate", "--no-synthetic", "--alibaba-sample", "--placements-per-profile", value])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--placements-per-profile" in err and repr(value) in err and err.count("\n") == 1


def test_the_cli_runs_auto_and_records_it(tmp_path: Path) -> None:
    args = [
        "simulate",
        "--no-synthetic",
        "--alibaba-sample",
        "--protocols",
        "replay",
        "--policies",
        "dynamig",
    ]
    args += ["--node-orders", "pack", "--no-plots", "--quiet", "--placements-per-profile", "auto"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["config"]["placements_per_profile"] == "auto"
