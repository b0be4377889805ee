"""Planner benchmark: planning time per cluster size, and quality against exhaustive search.

Run: ``python bench/planner_bench.py`` (``make bench``). Options: ``--repeat N`` (timing runs per size, best
kept), ``--cases N`` (small rounds for the quality check), ``--sizes 8x10,64x500`` (nodes x claims).

Clusters are ``dynamig.planner.synthetic.large_round``: nodes of 8 GPUs, one model per node, models mixed
over the cluster (A100 80GB, H100 80GB, H200, A100 40GB), about half the GPUs partly cut with some busy
instances, claims with 1-3 alternatives, counts 1-3, a fifth restricted to 1-3 nodes. Every round is also
planned by a naive first-fit (claims in input order, first alternative and first node that fit, existing
free instances first, then free space; never re-cuts), so the printed ratios compare the two on the same
input in the same run. Times are CPU seconds of this process (``time.process_time``) on one core, best of
``--repeat`` runs, plus wall seconds.

Quality: ``small_round`` seeds 0..cases-1 (up to 4 GPUs, up to 10 claims), claims satisfied by the planner and
by first-fit compared with ``dynamig.planner.exhaustive.best_plan``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from dynamig.geometry.catalog import Catalog, load_catalog
from dynamig.geometry.layout import free_starts
from dynamig.geometry.model import Layout, PlacedInstance, normalize_layout
from dynamig.planner import ClaimDemand, GpuState, PlanResult, Policy, plan
from dynamig.planner.exhaustive import best_plan
from dynamig.planner.synthetic import Round, large_round, small_round

T = TypeVar("T")

DEFAULT_SIZES = "8x10,8x100,64x100,64x500,64x1000,1000x1000,1000x5000"


def first_fit(
    gpus: Sequence[GpuState], claims: Sequence[ClaimDemand], policy: Policy, catalog: Catalog
) -> int:
    """Naive baseline: claims satisfied by first-fit without re-cutting. Pure; returns the count."""
    layouts: dict[tuple[str, int], Layout] = {}
    free: dict[tuple[str, int], list[PlacedInstance]] = {}
    by_node: dict[str, list[GpuState]] = {}
    for g in gpus:
        layouts[(g.node, g.index)] = normalize_layout([i.placed for i in g.instances])
        free[(g.node, g.index)] = [i.placed for i in g.instances if not i.busy]
        by_node.setdefault(g.node, []).append(g)
    satisfied = 0
    for claim in claims:
        done = False
        for alt in claim.alternatives:
            for node in by_node if claim.nodes is None else sorted(claim.nodes):
                picks: list[tuple[tuple[str, int], PlacedInstance, bool]] = []
                trial = {k: layouts[k] for k in ((g.node, g.index) for g in by_node.get(node, []))}
                trial_free = {k: list(free[k]) for k in trial}
                for g in by_node.get(node, []):
                    k = (g.node, g.index)
                    model = catalog.model(g.model)
                    if not model.has_profile(alt):
                        continue
                    while len(picks) < claim.count:
                        same = [i for i in trial_free[k] if i.profile == alt]
                        if same:
                            trial_free[k].remove(same[0])
                            picks.append((k, same[0], False))
                            continue
                        if policy.allowed_profiles is not None and alt not in policy.allowed_profiles:
                            break
                        starts = free_starts(model, trial[k], alt)
                        if not starts:
                            break
                        inst = PlacedInstance(starts[0], alt)
                        trial[k] = normalize_layout([*trial[k], inst])
                        picks.append((k, inst, True))
                    if len(picks) == claim.count:
                        break
                if len(picks) == claim.count:
                    layouts.update(trial)
                    free.update(trial_free)
                    satisfied += 1
                    done = True
                    break
            if done:
                break
    return satisfied


def timed(fn: Callable[[], T], repeat: int) -> tuple[float, float, T]:
    """Best CPU and wall seconds of ``repeat`` calls, and the last result. Side effects: those of ``fn``."""
    best_cpu, best_wall = float("inf"), float("inf")
    for _ in range(max(1, repeat)):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        best_cpu = min(best_cpu, time.process_time() - c0)
        best_wall = min(best_wall, time.perf_counter() - w0)
    return best_cpu, best_wall, out


def bench_sizes(sizes: list[tuple[int, int]], repeat: int, catalog: Catalog) -> None:
    print("planning time per size (plan = dynamig planner, ff = naive first-fit on the same round;")
    print("time ratio = plan cpu / ff cpu, sat ratio = plan satisfied / ff satisfied)")
    print(
        f"{'nodes':>6} {'gpus':>6} {'claims':>6} | {'plan cpu s':>10} {'wall s':>7} {'satisfied':>9} "
        f"{'changed':>7} | {'ff cpu s':>8} {'ff sat':>6} | {'time ratio':>10} {'sat ratio':>9}"
    )
    for nodes, n_claims in sizes:
        r = large_round(random.Random(nodes * 100_003 + n_claims), catalog, nodes, 8, n_claims)

        def run_plan(r: Round = r) -> PlanResult:
            return plan(r.gpus, r.claims, r.policy, catalog)

        def run_ff(r: Round = r) -> int:
            return first_fit(r.gpus, r.claims, r.policy, catalog)

        cpu, wall, result = timed(run_plan, repeat)
        sat = len(r.claims) - len(result.unsatisfied)
        changed = sum(g.changed for g in result.gpus)
        ff_cpu, _, ff_sat = timed(run_ff, repeat)
        print(
            f"{nodes:>6} {len(r.gpus):>6} {n_claims:>6} | {cpu:>10.3f} {wall:>7.3f} {sat:>9} {changed:>7} | "
            f"{ff_cpu:>8.3f} {ff_sat:>6} | {cpu / max(ff_cpu, 1e-6):>10.2f} {sat / max(ff_sat, 1):>9.2f}"
        )


def bench_quality(cases: int, catalog: Catalog) -> None:
    agree = ff_agree = 0
    total_best = total_plan = total_ff = 0
    exh_cpu = plan_cpu = 0.0
    for seed in range(cases):
        r = small_round(random.Random(seed), catalog)
        c0 = time.process_time()
        got = len(r.claims) - len(plan(r.gpus, r.claims, r.policy, catalog).unsatisfied)
        c1 = time.process_time()
        best = best_plan(r.gpus, r.claims, r.policy, catalog).satisfied
        c2 = time.process_time()
        ff = first_fit(r.gpus, r.claims, r.policy, catalog)
        plan_cpu += c1 - c0
        exh_cpu += c2 - c1
        agree += got == best
        ff_agree += ff == best
        total_best, total_plan, total_ff = total_best + best, total_plan + got, total_ff + ff
    print(
        f"\nquality on {cases} small rounds (<= 4 GPUs, <= 10 claims), claims satisfied vs exhaustive search:"
    )
    print(
        f"  planner    as many as exhaustive in {agree}/{cases} = {agree / cases:.1%}; "
        f"{total_plan}/{total_best} claims = {total_plan / max(total_best, 1):.1%}; {plan_cpu:.2f} cpu s"
    )
    print(
        f"  first-fit  as many as exhaustive in {ff_agree}/{cases} = {ff_agree / cases:.1%}; "
        f"{total_ff}/{total_best} claims = {total_ff / max(total_best, 1):.1%}"
    )
    print(f"  exhaustive {exh_cpu:.2f} cpu s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated NODESxCLAIMS")
    args = parser.parse_args(argv)
    catalog = load_catalog()
    sizes = []
    for item in args.sizes.split(","):
        nodes, claims = item.split("x")
        sizes.append((int(nodes), int(claims)))
    bench_sizes(sizes, args.repeat, catalog)
    if args.cases:
        bench_quality(args.cases, catalog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
