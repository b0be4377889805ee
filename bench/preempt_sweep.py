"""Preemption knob sweep: the openb replay at load 1.5 on 626 GPUs, ``dynamig-preempt`` under each setting of
its knobs, against the policies that do not preempt and static MIG with kube-scheduler's preemption, all in
the same run.

Run: ``python bench/preempt_sweep.py`` (needs the openb files: ``--alibaba DIR``, default
``../shared/data/alibaba-gpu-v2023``). Options: ``--load``, ``--stride``, ``--node-orders``,
``--create-latency-s``, ``--gaps``, ``--min-runs`` (seconds), ``--rates`` (evictions per hour),
``--cooldowns`` and ``--spares`` (seconds).

Printed per node order, one row per policy or setting: latency-sensitive (LS) time to running p95 and its
ratio to the best policy that does not preempt; best-effort (BE) work lost by victims as a share of BE served
GPU-hours; jobs evicted at least once as a share of all jobs; ping-pong; served slice-hours against
``dynamig`` without preemption. The issue's goals: LS p95 <= 0.2x the best non-preempting policy and <= static
with preemption; work lost <= 2%; evicted jobs <= 1%; ping-pong 0; served >= 0.99x.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from dynamig.geometry.catalog import load_catalog
from dynamig.simulate import alibaba
from dynamig.simulate.engine import RunResult, SimConfig
from dynamig.simulate.preemption import PreemptSettings
from dynamig.simulate.runner import DynamigSettings, run_trace
from dynamig.textable import align

MODEL = "A100-80GB"
BASELINES = ("static", "first-fit", "nvidia-dynamic-mig", "hami-reserve", "dynamig", "static-preempt")


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def row(r: RunResult, label: str, best_ls_p95: float, dynamig_served: float, gpu_slices: int) -> list[str]:
    ls = r.by_priority.get("LS", {})
    be = r.by_priority.get("BE", {})
    be_gpu_h = be.get("served_slice_h", 0.0) / gpu_slices
    lost = r.evicted_work_gpu_s / 3600.0
    p95 = ls.get("p95_s", 0.0)
    return [
        label,
        f"{p95:,.0f}s",
        f"{p95 / best_ls_p95:.2f}x" if best_ls_p95 else "-",
        f"{lost:.1f} ({100 * lost / be_gpu_h:.1f}%)" if be_gpu_h else f"{lost:.1f}",
        f"{r.evicted_jobs} ({100 * r.evicted_jobs / r.jobs:.2f}%)",
        f"{r.thrash}",
        f"{r.served_slice_h / dynamig_served:.3f}x",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alibaba", type=Path, default=Path("../shared/data/alibaba-gpu-v2023"))
    p.add_argument("--load", type=float, default=1.5)
    p.add_argument("--stride", type=int, default=10)
    p.add_argument("--node-orders", default="pack,spread")
    p.add_argument("--create-latency-s", type=float, default=6.0)
    p.add_argument("--gaps", default="1")
    p.add_argument("--min-runs", default="0,60,600")
    p.add_argument("--rates", default="60,600,6000")
    p.add_argument("--cooldowns", default="300", help="per-GPU cooldowns after an eviction's cut (seconds)")
    p.add_argument("--spares", default="3600", help="how long an evicted job is not a victim again (seconds)")
    args = p.parse_args()

    model = load_catalog().model(MODEL)
    tasks, full = alibaba.load(args.alibaba, model)
    small = alibaba.every_kth_node(full, args.stride)
    capacity = sum(n.gpus for n in small.nodes) * model.compute_slices
    compress = alibaba.compression_for_load(tasks, model, capacity, args.load)
    trace = alibaba.replay_trace(
        tasks, small, model, compress=compress, until_last_arrival=True, name=f"openb-load{args.load:g}"
    )
    knobs = itertools.product(
        floats(args.gaps),
        floats(args.min_runs),
        floats(args.rates),
        floats(args.cooldowns),
        floats(args.spares),
    )
    settings = [
        PreemptSettings(gap=int(g), min_run_s=m, rate_per_h=r, gpu_cooldown_s=c, spare_s=sp)
        for g, m, r, c, sp in knobs
    ]
    header = [
        "policy", "LS p95", "/ best non-preempting", "BE work lost GPU-h (of BE served)",
        "evicted jobs", "ping-pong", "served / dynamig",
    ]  # fmt: skip
    print(f"{trace.name}: {len(trace.jobs)} jobs, {small.gpu_count} GPUs, {trace.horizon / 3600:.1f} h")
    for order in [o.strip() for o in args.node_orders.split(",") if o.strip()]:
        cfg = SimConfig(reshape_latency_s=args.create_latency_s, node_order=order)
        base = run_trace(trace, cfg, DynamigSettings(), BASELINES).results
        by_name = {r.policy: r for r in base}
        plain = [r for r in base if not r.policy.startswith("static-preempt")]
        best = min(r.by_priority["LS"]["p95_s"] for r in plain)
        served = by_name["dynamig"].served_slice_h
        rows = [row(r, r.policy, best, served, model.compute_slices) for r in base]
        for s in settings:
            dyn = DynamigSettings(preempt=s)
            (r,) = run_trace(trace, cfg, dyn, ("dynamig-preempt",)).results
            rows.append(row(r, f"dynamig-preempt ({s.label()})", best, served, model.compute_slices))
        print(f"\n== {order} node order, create {args.create_latency_s:g}s")
        print("\n".join(align([header, *rows], rule=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
