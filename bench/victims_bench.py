"""Victim search benchmark: one round of ``dynamig.planner.victims.find_victims`` at fleet size.

Run: ``python bench/victims_bench.py`` (defaults: 1,000 nodes x 8 A100-80GB, 20,000 running pods,
2,000 waiting preemptors). Options: ``--nodes``, ``--running``, ``--pending``, ``--seed``, ``--repeat``.

The cluster: every GPU cut into a random valid layout of 1g.10gb to 7g.80gb instances, ``--running`` of those
instances held by one pod each (priority 0 for 60%, 500 for 25%, 1000 for 15%; a tenth protected, as by a
PodDisruptionBudget; started 0-10 h ago), the rest free. Waiting: ``--pending`` pods at priority 0, 500, 1000
or 2000, asking for one of 1g.10gb..7g.80gb with up to two ``firstAvailable`` fallbacks, a fifth restricted to
three nodes. Printed: CPU seconds of one round (``time.process_time``, best of ``--repeat``), the evictions it
chose, and, as the in-run baseline, the same preemptors searched one by one by brute force (every GPU, every
alternative, every placement: what the index saves), timed on the first ``--baseline-pending`` preemptors and
scaled to all of them.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import is_valid
from dynamig.geometry.model import GpuModel, PlacedInstance
from dynamig.planner.model import GpuKey
from dynamig.planner.victims import GpuHolding, HeldInstance, Preemptor, Rules, RunningPod, find_victims

MODEL = "A100-80GB"
PROFILES = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
NOW = 100_000.0


def cluster(
    rng: random.Random, model: GpuModel, nodes: int, running: int
) -> tuple[list[GpuHolding], dict[str, RunningPod]]:
    layouts: list[list[PlacedInstance]] = []
    for _ in range(nodes * 8):
        layout: list[PlacedInstance] = []
        for _ in range(8):
            profile = rng.choice(PROFILES)
            starts = [
                s for s in model.profile(profile).placement_starts
                if is_valid(model, [*layout, PlacedInstance(s, profile)])
            ]  # fmt: skip
            if starts:
                layout.append(PlacedInstance(rng.choice(starts), profile))
        layouts.append(layout)
    slots = [(g, inst) for g, layout in enumerate(layouts) for inst in layout]
    held = set(rng.sample(range(len(slots)), min(running, len(slots))))
    pods: dict[str, RunningPod] = {}
    gpus = []
    i = 0
    for g, layout in enumerate(layouts):
        instances = []
        for inst in layout:
            holders: tuple[str, ...] = ()
            if i in held:
                name = f"ns/pod-{i}"
                priority = rng.choices([0, 500, 1000], [60, 25, 15])[0]
                protected = "PodDisruptionBudget allows no disruption" if rng.random() < 0.1 else ""
                pods[name] = RunningPod(name, priority, NOW - rng.uniform(0, 36_000), protected=protected)
                holders = (name,)
            instances.append(HeldInstance(inst, holders))
            i += 1
        gpus.append(GpuHolding(GpuKey(f"node-{g // 8:04d}", g % 8), MODEL, tuple(instances)))
    return gpus, pods


def waiting(rng: random.Random, nodes: int, pending: int) -> list[Preemptor]:
    out = []
    for i in range(pending):
        first = rng.randrange(len(PROFILES))
        alts = tuple(PROFILES[first : first + rng.randint(1, 3)][::-1])  # the largest first
        where = (
            frozenset(f"node-{rng.randrange(nodes):04d}" for _ in range(3)) if rng.random() < 0.2 else None
        )
        out.append(Preemptor(f"ns/wait-{i}", rng.choice([0, 500, 1000, 2000]), alts, where))
    return out


def brute_force_one(
    pre: Preemptor, gpus: list[GpuHolding], pods: dict[str, RunningPod], model: GpuModel, gap: int
) -> tuple[object, ...] | None:
    """The best eviction for one preemptor, trying every GPU, alternative and placement."""
    for profile in pre.alternatives:
        best: tuple[object, ...] | None = None
        for g, start in itertools.product(gpus, model.profile(profile).placement_starts):
            if pre.nodes is not None and g.key.node not in pre.nodes:
                continue
            need = model.profile(profile).mask(start)
            gone = [i for i in g.instances if model.profile(i.placed.profile).mask(i.placed.start) & need]
            victims = [pods[h] for i in gone for h in i.holders]
            if not victims or any(v.protected or v.priority > pre.priority - gap for v in victims):
                continue
            rest = [i.placed for i in g.instances if i not in gone]
            if not is_valid(model, [*rest, PlacedInstance(start, profile)]):
                continue
            top = max(v.priority for v in victims)
            key = (top, sum(v.priority for v in victims), len(victims), g.key)
            if best is None or key < best:
                best = key
        if best is not None:
            return best
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--running", type=int, default=20_000)
    ap.add_argument("--pending", type=int, default=2_000)
    ap.add_argument("--baseline-pending", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    for flag in ("nodes", "running", "pending", "repeat"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1")
    rng = random.Random(args.seed)
    model = load_catalog().model(MODEL)
    gpus, pods = cluster(rng, model, args.nodes, args.running)
    pres = waiting(rng, args.nodes, args.pending)
    rules = Rules(gap=1, min_run_s=300, now=NOW)
    best = float("inf")
    for _ in range(args.repeat):
        t0 = time.process_time()
        plan = find_victims(pres, gpus, pods, rules, {MODEL: model})
        best = min(best, time.process_time() - t0)
    victims = sum(len(e.victims) for e in plan.evictions)
    print(
        f"{len(gpus)} GPUs, {len(pods)} running pods, {len(pres)} waiting: one round {best:.3f} s CPU "
        f"(best of {args.repeat}); {len(plan.evictions)} preemptors served evicting {victims} pods, "
        f"{len(plan.refused)} refused"
    )
    sample = pres[: args.baseline_pending]
    t0 = time.process_time()
    for pre in sample:
        if not pre.never:
            brute_force_one(pre, gpus, pods, model, rules.gap)
    per = (time.process_time() - t0) / len(sample)
    print(
        f"baseline, brute force one preemptor at a time: {per:.3f} s CPU each, about {per * len(pres):.0f} s "
        f"for all {len(pres)} ({per * len(pres) / best:.0f}x the round)"
    )
    print(f"goal: one round <= 1 s CPU: {'met' if best <= 1.0 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
