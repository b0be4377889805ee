"""The GPU-type-limited cells: dynamig against the best peer in every cell, and what makes a cell differ.

Run: ``python bench/gpu_type_cells.py`` (needs the openb files: ``--alibaba DIR``, default
``../shared/data/alibaba-gpu-v2023``). Each seed derives the variant of ``dynamig simulate --gpu-spec-share``
(``alibaba.with_gpu_spec(tasks, spec, share, seed)``: each task restricted, with probability ``share``, to one
GPU type drawn in proportion to that type's GPUs), replayed as ``dynamig simulate --loads`` does on every
``--stride``-th node, under each node order, with the create latency ``--create-latency-s`` (6).

Printed: per cell (seed, load, node order) each policy's mean time to running and served slice-hours,
dynamig's mean against the best peer's (first-fit, nvidia-dynamic-mig, hami-reserve) and whether the cell
meets the goals (mean <= best peer + 5%, served >= best peer - 0.5%). For a cell that misses them, the
traces say why: the job groups (restricted GPU type or ``-``, GPUs per job, profile) whose summed time to
running differs most between dynamig and that peer, and the jobs the peer started that dynamig never did
(one never started waits until the horizon, as in every mean here). Last, the same goals put to every
policy against the best of the other three in each cell: how many cells each misses, and its worst ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

from dynamig.geometry.catalog import load_catalog
from dynamig.simulate import alibaba
from dynamig.simulate.engine import RunResult, SimConfig
from dynamig.simulate.runner import DynamigSettings, run_with_starts, total_compute_slices
from dynamig.simulate.trace import Job, Trace

PEERS = ("first-fit", "nvidia-dynamic-mig", "hami-reserve")
MEAN_SLACK = 1.05  # the goal: mean time to running <= best peer's + 5%
SERVED_SLACK = 0.995  # served >= best peer's - 0.5%


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def group(job: Job) -> tuple[str, int, str]:
    """(restricted GPU type or "-", GPUs, first-choice profile)."""
    return (",".join(job.gpu_types) or "-", job.count, job.preferred)


def explain(
    trace: Trace,
    mine: dict[str, float],
    theirs: dict[str, float],
    peer: str,
    others: dict[str, dict[str, float]],
    top: int,
) -> list[str]:
    """The groups whose summed time to running differs most, and the jobs ``peer`` started that dynamig did
    not (with which ``others`` started them too)."""
    horizon = trace.horizon
    arrived = [j for j in trace.jobs if j.arrival <= horizon]
    sums: dict[tuple[str, int, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for j in arrived:
        row = sums[group(j)]
        row[0] += 1
        row[1] += mine.get(j.name, horizon) - j.arrival
        row[2] += theirs.get(j.name, horizon) - j.arrival
    lines = [f"    groups (type, GPUs, profile): jobs, summed wait dynamig / {peer}, difference / all jobs"]
    worst = sorted(sums.items(), key=lambda kv: kv[1][2] - kv[1][1])[:top]
    for key, (n, a, b) in worst:
        lines.append(f"      {key}: {n:.0f} jobs, {a:,.0f}s / {b:,.0f}s, {(a - b) / len(arrived):+.1f}s")
    only = [j for j in arrived if j.name in theirs and j.name not in mine]
    for j in sorted(only, key=lambda j: j.arrival)[:top]:
        also = [n for n, started in others.items() if j.name in started]
        lines.append(
            f"    never started under dynamig, by {peer} after {theirs[j.name] - j.arrival:,.0f}s: {j.name} "
            f"{group(j)} ({(horizon - j.arrival) / len(arrived):+.1f}s of the mean; started by "
            f"{', '.join(also) or 'no other peer'})"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alibaba", type=Path, default=Path("../shared/data/alibaba-gpu-v2023"))
    p.add_argument("--share", type=float, default=0.33)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--loads", default="1.0,1.5")
    p.add_argument("--node-orders", default="pack,spread")
    p.add_argument("--stride", type=int, default=10)
    p.add_argument("--create-latency-s", type=float, default=6.0)
    p.add_argument("--top", type=int, default=4)
    args = p.parse_args(argv)

    model = load_catalog().model("A100-80GB")
    tasks, spec = alibaba.load(args.alibaba, model)
    cluster = alibaba.every_kth_node(spec, args.stride)
    capacity = total_compute_slices(cluster)
    wall0 = time.perf_counter()
    met = cells = 0
    table: list[dict[str, RunResult]] = []
    for seed in (int(x) for x in args.seeds.split(",") if x.strip()):
        variant = alibaba.with_gpu_spec(tasks, spec, args.share, seed)
        for load in floats(args.loads):
            compress = alibaba.compression_for_load(variant, model, capacity, load)
            trace = alibaba.replay_trace(
                variant, cluster, model, name=f"gpuspec-seed{seed}-load{load:g}", compress=compress,
                until_last_arrival=True,
            )  # fmt: skip
            for order in (x.strip() for x in args.node_orders.split(",") if x.strip()):
                cfg = SimConfig(node_order=order, reshape_latency_s=args.create_latency_s)
                got = run_with_starts(trace, cfg, DynamigSettings(), (*PEERS, "dynamig"))
                table.append({n: r for n, (r, _) in got.items()})
                dyn, dyn_starts = got["dynamig"]
                peer = min(PEERS, key=lambda n: got[n][0].wait_mean_s)
                best = got[peer][0]
                top_served = max(got[n][0].served_slice_h for n in PEERS)
                ok = dyn.wait_mean_s <= best.wait_mean_s * MEAN_SLACK and dyn.served_slice_h >= (
                    top_served * SERVED_SLACK
                )
                cells += 1
                met += ok
                row = "  ".join(
                    f"{n} {r.wait_mean_s:.1f}s/{r.served_slice_h:,.0f}" for n, (r, _) in got.items()
                )
                ratio = dyn.wait_mean_s / max(best.wait_mean_s, 1e-9)
                verdict = "meets" if ok else "MISSES"
                cell = f"seed {seed} load {load:g} {order}"
                print(f"{cell}: {row}; dynamig / {peer} = {ratio:.2f}x, {verdict} the goals", flush=True)
                if not ok:
                    others = {n: got[n][1] for n in PEERS if n != peer}
                    print(
                        "\n".join(explain(trace, dyn_starts, got[peer][1], peer, others, args.top)),
                        flush=True,
                    )
    print(f"\n{met} of {cells} cells meet the goals; {time.perf_counter() - wall0:.0f}s")
    print("\nThe same goals for every policy, against the best of the other three in each cell:")
    for name in (*PEERS, "dynamig"):
        missed, worst = 0, 0.0
        for results in table:
            rivals = [r for n, r in results.items() if n != name]
            ratio = results[name].wait_mean_s / max(min(r.wait_mean_s for r in rivals), 1e-9)
            worst = max(worst, ratio)
            served = max(r.served_slice_h for r in rivals)
            missed += ratio > MEAN_SLACK or results[name].served_slice_h < served * SERVED_SLACK
        print(f"  {name}: misses {missed} of {len(table)} cells, worst mean {worst:.2f}x the best other")
    return 0


if __name__ == "__main__":
    sys.exit(main())
