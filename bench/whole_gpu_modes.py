"""Whole GPUs beside MIG: the openb replay with whole-GPU demand, every policy with GPUs in MIG mode off
against all-MIG dynamig, on the same jobs and GPUs.

Run: ``python bench/whole_gpu_modes.py`` (needs the openb files: ``--alibaba DIR``, default
``../shared/data/alibaba-gpu-v2023``). The replay is the one of ``dynamig simulate --loads`` (arrivals
compressed to each load level on every ``--stride``-th node, the horizon the last arrival), with
``whole_gpu_demand``: tasks with ``num_gpu >= 2`` ask for that many GPUs with MIG mode off on one node, tasks
asking a full GPU for one (then ``7g.80gb``, as DRA ``firstAvailable``; ``--no-single-fallback``: the whole
GPU only). Options: ``--models`` (catalog keys, one run each; A100: a switch resets the GPU, H100: it does
not), ``--loads``, ``--node-orders``, ``--policies``, ``--split-shares`` (one ``whole-split:<share>`` and one
``whole-split-nodes:<share>`` per share), ``--switch-s`` (a MIG mode switch, default 10), ``--cooldown-s``
(600), ``--max-switching`` (GPUs switching at once, the disruption budget: 1), ``--no-allow-reset``,
``--min-mig-gpus`` (the floor ``minMigGpus``: 0),
``--create-latency-s`` (6), ``--out`` (``results.json`` and ``tables.md``), ``--explain`` (each cell's served
difference between ``dynamig-modes`` and all-MIG ``dynamig``, job by job: both run once more, recording
starts).

Printed per model: one row per (node order, load, policy, job kind): jobs, started, time to running p50 /
p95 over every job that arrived (one never started waits until the horizon), served slice-hours (a whole GPU
serves its compute slices x hours, as ``whole-gpu`` charges) and mode switches per GPU-day; then the issue's
goals for ``dynamig-modes``: served >= the best fixed split and >= all-MIG ``dynamig``, the multi-GPU jobs'
p95 <= 0.5x all-MIG's, <= 2 mode switches per GPU-day.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import GpuModel
from dynamig.simulate import alibaba, report
from dynamig.simulate.engine import SimConfig
from dynamig.simulate.modes import ModeSettings
from dynamig.simulate.runner import (
    MODE_POLICIES,
    DynamigSettings,
    TraceReport,
    run_trace,
    run_with_starts,
    total_compute_slices,
)
from dynamig.simulate.trace import WHOLE_ONLY, Trace

POLICIES = ",".join(("whole-gpu", "nvidia-dynamic-mig", "dynamig", *MODE_POLICIES))


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def explain_served(trace: Trace, cfg: SimConfig, dyn: DynamigSettings, model: GpuModel) -> list[str]:
    """Where ``dynamig-modes`` serves more or less than all-MIG ``dynamig``, job by job: the jobs of several
    whole GPUs that one started before the horizon and the other did not (each charged, as served slice-h
    are, its GPUs' compute slices until it ends or the horizon does), and what the other jobs serve."""
    runs = run_with_starts(trace, cfg, dyn, ("dynamig", "dynamig-modes"))
    served = {name: result.served_slice_h for name, (result, _) in runs.items()}
    mig, modes = runs["dynamig"][1], runs["dynamig-modes"][1]
    horizon = trace.horizon

    def slice_h(job_name: str, begin: float) -> float:
        job = by_name[job_name]
        until = horizon if job.duration is None else min(horizon, begin + job.duration)
        return job.count * model.compute_slices * max(0.0, until - begin) / 3600

    by_name = {j.name: j for j in trace.jobs}
    multi = [j for j in trace.jobs if j.whole == WHOLE_ONLY and j.count > 1]
    lines = [
        f"    served slice-h: dynamig-modes {served['dynamig-modes']:,.0f}, all-MIG {served['dynamig']:,.0f} "
        f"({served['dynamig-modes'] - served['dynamig']:+,.0f})"
    ]
    gap = 0.0
    for label, ran, other in (("all-MIG", mig, modes), ("dynamig-modes", modes, mig)):
        for j in sorted((j for j in multi if j.name in ran and j.name not in other), key=lambda j: j.arrival):
            charge = slice_h(j.name, ran[j.name])
            gap += charge if label == "dynamig-modes" else -charge
            lines.append(
                f"    {j.count}-GPU job {j.name}, arrived at {j.arrival:,.0f}s of {horizon:,.0f}s: "
                f"started under {label} only, {ran[j.name] - j.arrival:,.0f}s after it arrived "
                f"({charge:,.0f} slice-h)"
            )
    both = sum(
        slice_h(j.name, modes[j.name]) - slice_h(j.name, mig[j.name])
        for j in multi
        if j.name in mig and j.name in modes
    )
    rest = served["dynamig-modes"] - served["dynamig"] - gap - both
    lines.append(
        f"    multi-GPU jobs started under both: {both:+,.0f} slice-h; every other job: {rest:+,.0f} slice-h"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alibaba", type=Path, default=Path("../shared/data/alibaba-gpu-v2023"))
    p.add_argument("--models", default="A100-80GB")
    p.add_argument("--loads", default="1.0,1.5")
    p.add_argument("--stride", type=int, default=10)
    p.add_argument("--node-orders", default="pack,spread")
    p.add_argument("--policies", default=POLICIES)
    p.add_argument("--split-shares", default="0.25,0.5,0.75")
    p.add_argument("--switch-s", type=float, default=10.0)
    p.add_argument("--cooldown-s", type=float, default=600.0)
    p.add_argument("--max-switching", type=int, default=1)
    p.add_argument("--no-allow-reset", action="store_true")
    p.add_argument("--min-mig-gpus", type=int, default=0, help="the floor of GPUs with MIG mode on")
    p.add_argument("--no-single-fallback", action="store_true")
    p.add_argument("--drain-hold-s", type=float, default=3600.0, help="migMode.drainNodeHoldSeconds")
    p.add_argument(
        "--drain-node-after-s", type=float, default=None, help="migMode.drainNodeAfterSeconds (unset: none)"
    )
    p.add_argument("--create-latency-s", type=float, default=6.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--explain", action="store_true", help="explain each cell's served difference job by job")
    args = p.parse_args(argv)

    modes = ModeSettings(
        switch_s=args.switch_s,
        cooldown_s=args.cooldown_s,
        max_switching=args.max_switching,
        allow_reset=not args.no_allow_reset,
        min_mig_gpus=args.min_mig_gpus,
        split_shares=tuple(floats(args.split_shares)),
        drain_node_after_s=args.drain_node_after_s,
        drain_hold_s=args.drain_hold_s,
    )
    dyn = DynamigSettings(modes=modes)
    policies = tuple(x.strip() for x in args.policies.split(",") if x.strip())
    orders = [x.strip() for x in args.node_orders.split(",") if x.strip()]
    catalog = load_catalog()
    reports: list[TraceReport] = []
    timings: dict[str, float] = {}
    wall0 = time.perf_counter()
    for key in (x.strip() for x in args.models.split(",") if x.strip()):
        model = catalog.model(key)
        tasks, spec = alibaba.load(args.alibaba, model)
        cluster = alibaba.every_kth_node(spec, args.stride)
        capacity = total_compute_slices(cluster)
        top = alibaba.max_load(tasks, model, capacity)
        mine: list[TraceReport] = []
        for load in floats(args.loads):
            if load > top:  # the rule of `dynamig simulate --loads`: at most half of all tasks at once
                print(
                    f"load {load:g}: above {top:.2f}, the most this cluster reaches; skipped", file=sys.stderr
                )
                continue
            compress = alibaba.compression_for_load(tasks, model, capacity, load)
            trace = alibaba.replay_trace(
                tasks,
                cluster,
                model,
                name=f"alibaba-openb-whole-{cluster.gpu_count}gpus-{key}-load{load:g}",
                compress=compress,
                until_last_arrival=True,
                whole_gpu_demand=True,
                single_fallback=not args.no_single_fallback,
            )
            for order in orders:
                cfg = SimConfig(node_order=order, reshape_latency_s=args.create_latency_s)
                t0 = time.perf_counter()
                rep = run_trace(trace, cfg, dyn, policies, load=load)
                took = timings[f"{trace.name} [{order}]"] = time.perf_counter() - t0
                print(
                    f"[{time.strftime('%H:%M:%S')}] {trace.name} [{order}]: {took:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
                mine.append(rep)
                if args.explain:
                    print("\n".join([f"  {order} @{load:g}:", *explain_served(trace, cfg, dyn, model)]))
        reports += mine
        print(
            f"\n== {key}, {cluster.gpu_count} GPUs, whole-GPU demand, switch {args.switch_s:g}s, "
            f"cooldown {args.cooldown_s:g}s, budget {args.max_switching}"
        )
        print(report.text_table(report.KIND_HEADER, report.kind_rows(mine)))
        for rep in mine:
            print(f"  {rep.node_order} @{rep.load:g}:")
            goals = [
                *report.mode_goals(rep),
                *report.mode_goals(rep, "dynamig-modes-offer"),
                *report.mode_goals(rep, "dynamig-modes-keep"),
            ]
            for line in goals + report.mode_goals(rep, "nvidia-toggle"):
                print(f"    {line}")
    print("\n== summary: all-MIG dynamig, the best fixed split, the policies that switch MIG modes")
    print(report.text_table(report.MODE_SUMMARY_HEADER, report.mode_summary_rows(reports)))
    total = time.perf_counter() - wall0
    print(f"\nrun times: total {total:.1f}s")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "config": {
                "models": args.models,
                "stride": args.stride,
                "loads": floats(args.loads),
                "node_orders": orders,
                "policies": list(policies),
                "whole_gpu_demand": True,
                "single_fallback": not args.no_single_fallback,
                "switch_s": modes.switch_s,
                "cooldown_s": modes.cooldown_s,
                "max_switching": modes.max_switching,
                "allow_reset": modes.allow_reset,
                "split_shares": list(modes.split_shares),
                "reshape_latency_s": args.create_latency_s,
            },
            "timings_s": timings,
            "total_s": total,
        }
        report.write_json(args.out / "results.json", reports, [], meta)
        parts = [
            report.markdown_table(report.MODE_SUMMARY_HEADER, report.mode_summary_rows(reports)),
            report.markdown_table(report.KIND_HEADER, report.kind_rows(reports)),
        ]
        for rep in reports:
            parts.append(
                f"### {report.heading(rep)}\n\n" + "\n".join(f"- {g}" for g in report.mode_goals(rep))
            )
        (args.out / "tables.md").write_text("\n\n".join(parts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
