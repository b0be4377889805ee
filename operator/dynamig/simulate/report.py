"""Tables (text, Markdown), a JSON dump and PNG plots of simulation results.

Formatting functions are pure. ``write_plots`` and ``write_json`` write files; matplotlib is imported
inside ``write_plots`` only, with the Agg backend, so the simulator itself does not need it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dynamig.geometry.layout import format_layout
from dynamig.simulate.engine import RunResult
from dynamig.simulate.runner import PREEMPTING, PaperRun, TraceReport
from dynamig.simulate.trace import gpus_per_model
from dynamig.textable import align


def _h(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def trace_rows(rep: TraceReport) -> list[list[str]]:
    """One row per policy plus the upper bound. Pure."""
    rows = []
    offered = rep.results[0].offered_slice_h if rep.results else 0.0
    for r in rep.results:
        rows.append(
            [
                r.policy,
                f"{r.served_slice_h:,.0f}",
                f"{100 * r.served_slice_h / offered:.1f}%" if offered else "-",
                f"{100 * r.utilization:.1f}%",
                f"{_h(r.wait_mean_s)} / {_h(r.wait_p50_s)} / {_h(r.wait_p95_s)}",
                f"{_h(r.alloc_wait_mean_s)} / {_h(r.alloc_wait_p95_s)}",
                f"{r.never_served}",
                f"{r.reshapes}",
                f"{r.destroyed}",
                f"{r.destroyed / r.started:.2f}" if r.started else "-",
                f"{r.wall_s:.1f}s",
            ]
        )
    rows.append(
        [
            "upper bound (slice arithmetic)",
            f"{rep.upper_bound_slice_h:,.0f}",
            f"{100 * rep.upper_bound_slice_h / offered:.1f}%" if offered else "-",
            f"{100 * rep.upper_bound_slice_h / rep.results[0].capacity_slice_h:.1f}%" if rep.results else "-",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
        ]
    )
    return rows


TRACE_HEADER = [
    "policy",
    "served slice-h",
    "of offered",
    "slice util",
    "to running mean / p50 / p95",
    "to allocation mean / p95",
    "never served",
    "reshapes",
    "destroyed",
    "destroyed per started job",
    "run time",
]


def heading(rep: TraceReport) -> str:
    """A trace's name with its node order and create latency. Pure."""
    return f"{rep.trace.name} [{rep.node_order} node order, create {rep.create_latency_s:g}s]"


def goals(rep: TraceReport) -> list[str]:
    """dynamig against best static, first-fit, the placement-free pool and the bound. Pure."""
    dyn = rep.by_policy("dynamig")
    if dyn is None:
        return []
    out = []
    best = rep.best_static()
    if best is not None and best.served_slice_h:
        out.append(f"dynamig / best static ({best.policy}) = {dyn.served_slice_h / best.served_slice_h:.2f}x")
    ff = rep.by_policy("first-fit")
    if ff is not None and ff.served_slice_h:
        out.append(f"dynamig / first-fit = {dyn.served_slice_h / ff.served_slice_h:.2f}x")
    pool = rep.by_policy("pool (no placement rules)")
    if pool is not None and pool.served_slice_h:
        out.append(
            f"dynamig / pool without placement rules = {100 * dyn.served_slice_h / pool.served_slice_h:.1f}%"
        )
    if rep.upper_bound_slice_h:
        out.append(f"dynamig / upper bound = {100 * dyn.served_slice_h / rep.upper_bound_slice_h:.1f}%")
    out.append(f"instances destroyed while held: {dyn.destroyed_busy}")
    out += warm_goals(rep)
    return out


HISTORY_WARM = "dynamig (history warm pool)"


def warm_goals(rep: TraceReport, min_share: float = 0.5) -> list[str]:
    """For each profile the history warm pool covers (target > 0 for at least ``min_share`` of the
    horizon): its p50 time to running against binding at once (plus ``bind_rtt_s``), beside plain dynamig
    and first-fit. Pure."""
    warm = rep.by_policy(HISTORY_WARM)
    if warm is None:
        return []
    dyn, ff = rep.by_policy("dynamig"), rep.by_policy("first-fit")
    covered = {p: c for p, c in warm.warm_pool_coverage.items() if c[0] >= min_share}
    if not covered:
        return [f"history warm pool: covers no profile for >= {100 * min_share:.0f}% of the time"]
    out = []
    for profile, (share, mean) in covered.items():
        p50 = warm.wait_p50_by_profile.get(profile)
        if p50 is None:
            continue
        met = "met" if p50 <= warm.bind_rtt_s + 1e-9 else "NOT met"
        others = ", ".join(
            f"{r.policy} {r.wait_p50_by_profile[profile]:.1f}s"
            for r in (dyn, ff)
            if r is not None and profile in r.wait_p50_by_profile
        )
        out.append(
            f"history warm pool {profile} (target > 0 for {100 * share:.0f}% of the time, mean "
            f"{mean:.1f}): p50 time to running {p50:.1f}s vs {warm.bind_rtt_s:g}s (a free instance binds at "
            f"once): {met}" + (f" ({others})" if others else "")
        )
    return out


def profile_wait_rows(
    rep: TraceReport, policies: Sequence[str] | None = None
) -> tuple[list[str], list[list[str]]]:
    """p50 / p95 wait of single-device jobs per first-choice profile (every arrived job, never-started
    ones waiting until the horizon), one row per policy (``policies``: those only). Pure."""
    results = [r for r in rep.results if policies is None or r.policy in policies]
    profiles = sorted({p for r in results for p in r.wait_p50_by_profile}, key=_profile_order)
    header = ["policy (p50 / p95 wait)", *profiles, "warm pool (mean target)"]
    rows = []
    for r in results:
        cells = [r.policy]
        for p in profiles:
            if p in r.wait_p50_by_profile:
                cells.append(f"{_h(r.wait_p50_by_profile[p])} / {_h(r.wait_p95_by_profile[p])}")
            else:
                cells.append("-")
        pool = ", ".join(f"{p} {c[1]:.1f}" for p, c in r.warm_pool_coverage.items() if c[1] > 0)
        cells.append(pool or "-")
        rows.append(cells)
    return header, rows


def priority_rows(rep: TraceReport) -> tuple[list[str], list[list[str]]] | None:
    """Per priority class, one row per policy: jobs, started, time to running p50 / p95 (every arrived job),
    served slice-h; and per policy its evictions (per hour of the horizon), distinct jobs evicted, GPU-hours
    of work the victims lost, ping-pong. None when no policy of ``rep`` preempts (priorities play no part).
    Pure."""
    if not any(r.policy.split(":")[0] in PREEMPTING for r in rep.results):
        return None
    header = [
        "policy", "class", "jobs", "started", "to running p50 / p95", "served slice-h",
        "evictions (/h)", "evicted jobs", "work lost GPU-h", "ping-pong",
    ]  # fmt: skip
    hours = rep.trace.horizon / 3600.0
    rows = []
    for r in rep.results:
        for i, (cls, t) in enumerate(r.by_priority.items()):
            rows.append(
                [
                    r.policy if i == 0 else "",
                    cls,
                    f"{t['jobs']:.0f}",
                    f"{t['started']:.0f}",
                    f"{_h(t['p50_s'])} / {_h(t['p95_s'])}",
                    f"{t['served_slice_h']:,.0f}",
                    f"{r.evictions} ({r.evictions / hours:.1f})" if i == 0 and hours else "",
                    f"{r.evicted_jobs}" if i == 0 else "",
                    f"{r.evicted_work_gpu_s / 3600:.1f}" if i == 0 else "",
                    f"{r.thrash}" if i == 0 else "",
                ]
            )
    return header, rows


def _profile_order(name: str) -> tuple[int, str]:
    head = name.split("g.", 1)[0]
    return (int(head) if head.isdigit() else 99, name)


def size_rows(rep: TraceReport) -> tuple[list[str], list[list[str]]]:
    """Served demand by job size (GPUs per job), as a share of what jobs of that size asked for. Pure."""
    sizes = sorted({k for r in rep.results for k in r.offered_by_size})
    header = ["policy", *(f"{k}-GPU jobs" for k in sizes)]
    rows = []
    for r in rep.results:
        cells = [r.policy]
        for k in sizes:
            offered = r.offered_by_size.get(k, 0.0)
            cells.append(f"{100 * r.served_by_size.get(k, 0.0) / offered:.1f}%" if offered else "-")
        rows.append(cells)
    return header, rows


def load_rows(reports: Sequence[TraceReport]) -> tuple[list[str], list[list[str]]]:
    """Served share of offered demand per policy (rows) and node order and load (columns), per replayed
    cluster. Pure."""
    scaled = [rep for rep in reports if rep.load is not None]
    columns = sorted({(_base(rep), rep.node_order, rep.load or 0.0) for rep in scaled})
    one_base = len({c[0] for c in columns}) == 1
    header = [
        "policy",
        *(f"{'' if one_base else base + ' '}{order} @{load:g}" for base, order, load in columns),
    ]
    policies: list[str] = []
    for rep in scaled:
        policies += [r.policy for r in rep.results if r.policy not in policies]
    rows = []
    for policy in policies:
        cells = [policy]
        for base, order, load in columns:
            rep = next(x for x in scaled if _base(x) == base and x.node_order == order and x.load == load)
            r = rep.by_policy(policy)
            cells.append(
                f"{100 * r.served_slice_h / r.offered_slice_h:.1f}%" if r and r.offered_slice_h else "-"
            )
        rows.append(cells)
    return header, rows


def _base(rep: TraceReport) -> str:
    name = rep.trace.name
    return name.rsplit("-load", 1)[0] if rep.load is not None else name


def sensitivity_rows(reports: Sequence[TraceReport]) -> tuple[list[str], list[list[str]]]:
    """Per node order, load and creating policy: served slice-h and time to running (p50 / mean / p95)
    at every create latency run, and the served range over them. Pure."""
    scaled = [rep for rep in reports if rep.load is not None]
    latencies = sorted({rep.create_latency_s for rep in scaled})
    header = ["order", "load", "policy"]
    header += [f"served @{x:g}s" for x in latencies]
    header += [f"to running p50 / mean / p95 @{x:g}s" for x in latencies]
    header.append("served range")
    groups = sorted({(rep.node_order, rep.load or 0.0) for rep in scaled})
    rows = []
    for order, load in groups:
        at = {rep.create_latency_s: rep for rep in scaled if rep.node_order == order and rep.load == load}
        swept = [x for x in latencies if x in at]
        policies = [r.policy for r in at[swept[0]].results] if swept else []
        for policy in policies:
            runs = {x: at[x].by_policy(policy) for x in swept}
            if any(r is None for r in runs.values()) or len(runs) < len(latencies):
                continue  # not run at every latency (a policy that creates nothing)
            served = [r.served_slice_h for r in runs.values() if r is not None]
            cells = [order, f"{load:g}", policy]
            cells += [f"{r.served_slice_h:,.0f}" if r else "-" for r in runs.values()]
            cells += [
                f"{_h(r.wait_p50_s)} / {_h(r.wait_mean_s)} / {_h(r.wait_p95_s)}" if r else "-"
                for r in runs.values()
            ]
            lo, hi = min(served), max(served)
            cells.append(f"{hi - lo:,.0f} ({100 * (hi - lo) / hi:.2f}%)" if hi else "0")
            rows.append(cells)
    return header, rows


def replay_row(rep: TraceReport, r: RunResult) -> dict[str, Any]:
    """One online-replay row of ``results.json`` (the schema docs/benchmarks.md lists). Pure."""
    return {
        "trace": _base(rep),
        "node_order": rep.node_order,
        "create_latency_s": rep.create_latency_s,
        "alloc_wait_mean_s": r.alloc_wait_mean_s,
        "alloc_wait_p50_s": r.alloc_wait_p50_s,
        "alloc_wait_p95_s": r.alloc_wait_p95_s,
        "destroyed_per_started_job": r.destroyed / r.started if r.started else None,
        "load": rep.load,
        "reached_load": rep.reached_load,
        "policy": r.policy,
        "served_slice_h": r.served_slice_h,
        "offered_slice_h": r.offered_slice_h,
        "mean_wait_s": r.wait_mean_s,
        "p95_wait_s": r.wait_p95_s,
        "never_served": r.never_served,
        "destroyed": r.destroyed,
        "destroyed_while_held": r.destroyed_busy,
        "jobs": r.jobs,
        "gpus": rep.trace.cluster.gpu_count,
        "models": gpus_per_model(rep.trace.cluster),
        "served_by_size": {str(k): v for k, v in r.served_by_size.items()},
        "offered_by_size": {str(k): v for k, v in r.offered_by_size.items()},
        "reshapes": r.reshapes,
        "created": r.created,
        "wall_s": r.wall_s,
        "p50_wait_s": r.wait_p50_s,
        "wait_p50_by_profile": dict(r.wait_p50_by_profile),
        "wait_p95_by_profile": dict(r.wait_p95_by_profile),
        "warm_pool_coverage": {
            p: {"share_of_time": c[0], "mean_target": c[1]} for p, c in r.warm_pool_coverage.items()
        },
        "by_priority": {c: dict(t) for c, t in r.by_priority.items()},
        "evictions": r.evictions,
        "evicted_jobs": r.evicted_jobs,
        "evicted_work_gpu_s": r.evicted_work_gpu_s,
        "thrash": r.thrash,
        "by_kind": {k: dict(t) for k, t in r.by_kind.items()},
        "mode_switches": r.mode_switches,
        "mode_switches_per_gpu_day": r.mode_switches_per_gpu_day,
        "switched_while_busy": r.switched_busy,
    }


KIND_HEADER = [
    "order",
    "load",
    "policy",
    "job kind",
    "jobs",
    "started",
    "to running p50 / p95",
    "served slice-h (of offered)",
    "of it on whole GPUs",
    "mode switches per GPU-day",
]


def kind_rows(reports: Sequence[TraceReport]) -> list[list[str]]:
    """Per run with whole-GPU demand, per policy and job kind (``trace.JOB_KINDS``): jobs, started, time
    to running p50 / p95 (every job that arrived), served slice-h and the share of it served on GPUs with
    MIG mode off, and the policy's MIG mode switches per GPU-day (on its "all" row). Pure."""
    rows = []
    for rep in reports:
        for r in rep.results:
            if not r.by_kind:
                continue
            total = sum(t["served_slice_h"] for t in r.by_kind.values())
            whole = sum(t.get("served_whole_slice_h", 0.0) for t in r.by_kind.values())
            offered = sum(t["offered_slice_h"] for t in r.by_kind.values())
            load = "-" if rep.load is None else f"{rep.load:g}"
            rows.append(
                [
                    rep.node_order,
                    load,
                    r.policy,
                    "all",
                    f"{r.jobs}",
                    f"{r.started}",
                    f"{_h(r.wait_p50_s)} / {_h(r.wait_p95_s)}",
                    f"{total:,.0f} ({100 * total / offered:.1f}%)" if offered else "0",
                    f"{100 * whole / total:.1f}%" if total else "-",
                    f"{r.mode_switches_per_gpu_day:.2f}",
                ]
            )
            for kind, t in r.by_kind.items():
                share = (
                    f"{100 * t['served_slice_h'] / t['offered_slice_h']:.1f}%"
                    if t["offered_slice_h"]
                    else "-"
                )
                rows.append(
                    [
                        rep.node_order,
                        load,
                        r.policy,
                        kind,
                        f"{t['jobs']:.0f}",
                        f"{t['started']:.0f}",
                        f"{_h(t['p50_s'])} / {_h(t['p95_s'])}",
                        f"{t['served_slice_h']:,.0f} ({share})",
                        f"{100 * t.get('served_whole_slice_h', 0.0) / t['served_slice_h']:.1f}%"
                        if t["served_slice_h"]
                        else "-",
                        "",
                    ]
                )
    return rows


MODE_SUMMARY_HEADER = [
    "model",
    "order",
    "load",
    "policy",
    "served slice-h",
    "/ best split",
    "/ all-MIG",
    "multi-GPU started",
    "multi-GPU p50 / p95",
    "p95 / all-MIG",
    "whole-single p95",
    "MIG p95",
    "on whole GPUs",
    "switches per GPU-day",
]


def mode_summary_rows(reports: Sequence[TraceReport]) -> list[list[str]]:
    """Per run with whole-GPU demand: all-MIG ``dynamig``, the best fixed split (of every ``whole-split*``
    share, by served slice-h) and the policies that switch MIG modes, each against the best split and
    all-MIG: served slice-h, the multi-GPU jobs' start count and p50 / p95 to running, the p95 of the other
    kinds, the share of served slice-h on GPUs with MIG mode off, switches per GPU-day. Pure."""
    rows = []
    for rep in reports:
        base = rep.by_policy("dynamig")
        if base is None or not base.by_kind:
            continue
        splits = [r for r in rep.results if r.policy.startswith("whole-split")]
        best = max(splits, key=lambda r: r.served_slice_h) if splits else None
        shown = [base, *([best] if best else [])]
        shown += [
            r
            for r in rep.results
            if r.policy in ("dynamig-modes", "dynamig-modes-offer", "dynamig-modes-keep", "nvidia-toggle")
        ]
        ref = base.by_kind.get("whole-multi", {})
        for r in shown:
            multi = r.by_kind.get("whole-multi", {})
            whole = sum(t.get("served_whole_slice_h", 0.0) for t in r.by_kind.values())
            label = f"{r.policy} (best split)" if best is not None and r is best else r.policy
            rows.append(
                [
                    "+".join(rep.trace.cluster.models()),
                    rep.node_order,
                    "-" if rep.load is None else f"{rep.load:g}",
                    label,
                    f"{r.served_slice_h:,.0f}",
                    f"{r.served_slice_h / best.served_slice_h:.4f}" if best and best.served_slice_h else "-",
                    f"{r.served_slice_h / base.served_slice_h:.4f}" if base.served_slice_h else "-",
                    f"{multi.get('started', 0):.0f}/{multi.get('jobs', 0):.0f}",
                    f"{_h(multi.get('p50_s', 0.0))} / {_h(multi.get('p95_s', 0.0))}",
                    f"{multi['p95_s'] / ref['p95_s']:.2f}x" if multi and ref.get("p95_s") else "-",
                    _h(r.by_kind.get("whole-single", {}).get("p95_s", 0.0)),
                    _h(r.by_kind.get("mig", {}).get("p95_s", 0.0)),
                    f"{100 * whole / r.served_slice_h:.1f}%" if r.served_slice_h else "-",
                    f"{r.mode_switches_per_gpu_day:.2f}",
                ]
            )
    return rows


def mode_goals(rep: TraceReport, policy: str = "dynamig-modes") -> list[str]:
    """``policy`` against the best fixed split (``whole-split*``) and all-MIG dynamig: served, the
    multi-GPU jobs' p95 time to running, mode switches per GPU-day; each with whether the goal is met
    (served >= both, multi-GPU p95 <= 0.5x all-MIG's, <= 2 switches per GPU-day). Pure."""
    mine = rep.by_policy(policy)
    base = rep.by_policy("dynamig")
    splits = [r for r in rep.results if r.policy.startswith("whole-split")]
    if mine is None:
        return []
    out = []
    best = max(splits, key=lambda r: r.served_slice_h) if splits else None
    if best is not None and best.served_slice_h:
        ratio = mine.served_slice_h / best.served_slice_h
        met = "met" if mine.served_slice_h >= best.served_slice_h else "not met"
        out.append(f"{policy} / best split ({best.policy}) served = {ratio:.4f}x ({met})")
    if base is not None and base.served_slice_h:
        ratio = mine.served_slice_h / base.served_slice_h
        met = "met" if mine.served_slice_h >= base.served_slice_h else "not met"
        out.append(f"{policy} / all-MIG dynamig served = {ratio:.4f}x ({met})")
    multi, ref = mine.by_kind.get("whole-multi"), base.by_kind.get("whole-multi") if base else None
    if multi is not None and ref is not None:
        times = f"{multi['p95_s'] / ref['p95_s']:.2f}x" if ref["p95_s"] else "-"
        met = "met" if multi["p95_s"] <= 0.5 * ref["p95_s"] else "not met"
        out.append(
            f"{policy} multi-GPU p95 to running {_h(multi['p95_s'])} vs all-MIG {_h(ref['p95_s'])} = {times} "
            f"(goal <= 0.5x: {met})"
        )
    met = "met" if mine.mode_switches_per_gpu_day <= 2.0 else "not met"
    out.append(f"{policy} mode switches per GPU-day {mine.mode_switches_per_gpu_day:.2f} (goal <= 2: {met})")
    out.append(f"GPUs switched while busy: {mine.switched_busy}")
    return out


def paper_rows(runs: Sequence[PaperRun]) -> list[list[str]]:
    """Mean (and standard deviation) over seeds per policy. Pure."""
    by: dict[str, list[PaperRun]] = {}
    for r in runs:
        by.setdefault(r.policy, []).append(r)

    def ms(values: list[float], pct: bool = True) -> str:
        mean = statistics.fmean(values)
        sd = statistics.pstdev(values) if len(values) > 1 else 0.0
        return f"{100 * mean:.2f}% ± {100 * sd:.2f}" if pct else f"{mean:.1f} ± {sd:.1f}"

    rows = []
    for policy, rs in by.items():
        rows.append(
            [
                policy,
                ms([r.rate_100 for r in rs]),
                ms([r.rate_130 for r in rs]),
                ms([r.held_130 for r in rs]),
                ms([r.unallocated_gpus_130 for r in rs], pct=False),
                ms([float(r.idle_gpus_130) for r in rs], pct=False),
                ms([float(r.failed) / r.tasks for r in rs]),
                f"{statistics.fmean(r.wall_s for r in rs):.1f}s",
            ]
        )
    return rows


PAPER_HEADER = [
    "policy",
    "alloc @100%",
    "alloc @130%",
    "slices held @130%",
    "unallocated GPUs @130%",
    "idle GPUs @130%",
    "tasks failed",
    "run time/seed",
]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``header`` and ``rows`` aligned, a rule of dashes under the header, every column padded. Pure."""
    return "\n".join(align([header, *rows], rule=True, trim=False))


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def static_summary(rep: TraceReport) -> str:
    """The hindsight best-fit layout as counts of distinct layouts (per model on a mixed cluster). Pure."""
    per_model = rep.static_layouts.get("best-fit", {})
    parts = []
    for key, layouts in sorted(per_model.items()):
        counts: dict[str, int] = {}
        for lay in layouts:
            text = format_layout(lay)
            counts[text] = counts.get(text, 0) + 1
        summary = "; ".join(f"{n} x [{k}]" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        parts.append(summary if len(per_model) == 1 else f"{key}: {summary}")
    return " | ".join(parts)


def _result_json(r: RunResult) -> dict[str, Any]:
    d = asdict(r)
    d["utilization"] = r.utilization
    d["destroyed_while_held"] = r.destroyed_busy
    d["served_by_size"] = {str(k): v for k, v in r.served_by_size.items()}
    d["offered_by_size"] = {str(k): v for k, v in r.offered_by_size.items()}
    d.pop("timeline")
    return d


def write_json(
    path: Path,
    reports: Sequence[TraceReport],
    paper: Sequence[PaperRun],
    meta: dict[str, Any],
    sweep: Sequence[TraceReport] = (),
) -> None:
    """Dump every figure to ``path``. Side effect: writes the file."""
    doc = {
        "meta": meta,
        "traces": [
            {
                "trace": rep.trace.name,
                "node_order": rep.node_order,
                "create_latency_s": rep.create_latency_s,
                "load": rep.load,
                "jobs": len(rep.trace.jobs),
                "gpus": rep.trace.cluster.gpu_count,
                "models": gpus_per_model(rep.trace.cluster),
                "upper_bound_slice_h": rep.upper_bound_slice_h,
                "best_fit_layouts": static_summary(rep),
                "results": [_result_json(r) for r in rep.results],
                "goals": goals(rep),
            }
            for rep in reports
        ],
        "online_replay": [replay_row(rep, r) for rep in reports for r in rep.results],
        "latency_sweep": [replay_row(rep, r) for rep in sweep for r in rep.results],
        "paper_protocol": [asdict(r) for r in paper],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def write_plots(out: Path, reports: Sequence[TraceReport], paper: Sequence[PaperRun]) -> list[Path]:
    """PNG plots into ``out``; returns the paths written. Side effect: writes files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    if reports:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        policies = [r.policy for r in reports[0].results]
        width = 0.8 / max(1, len(policies) + 1)
        for i, policy in enumerate(policies):
            vals = []
            for rep in reports:
                r = rep.by_policy(policy)
                vals.append(100 * r.served_slice_h / r.offered_slice_h if r and r.offered_slice_h else 0.0)
            ax.bar([x + i * width for x in range(len(reports))], vals, width, label=policy)
        ub = [
            100 * rep.upper_bound_slice_h / rep.results[0].offered_slice_h
            if rep.results[0].offered_slice_h
            else 0.0
            for rep in reports
        ]
        ax.bar(
            [x + len(policies) * width for x in range(len(reports))],
            ub,
            width,
            label="upper bound",
            color="lightgrey",
            edgecolor="black",
        )
        ax.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(reports))],
            [rep.trace.name for rep in reports],
            rotation=15,
            ha="right",
            fontsize=8,
        )
        ax.set_ylabel("demand served (% of offered slice-hours)")
        ax.set_ylim(0, 125)
        ax.legend(fontsize=7, ncol=5, loc="upper center")
        ax.set_title("Demand served per policy and trace")
        fig.tight_layout()
        path = out / "served.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

        for rep in reports:
            fig, ax = plt.subplots(figsize=(10, 3.5))
            best = rep.best_static()
            show = [
                r
                for r in rep.results
                if r.policy in ("dynamig", "first-fit", "pool (no placement rules)")
                or (best and r.policy == best.policy)
            ]
            for r in show:
                ax.plot([t for t, _ in r.timeline], [100 * b for _, b in r.timeline], label=r.policy, lw=1.2)
            ax.set_xlabel("hours")
            ax.set_ylabel("slices held (%)")
            ax.set_ylim(0, 118)
            ax.set_title(f"{rep.trace.name}: compute slices held by running jobs")
            ax.legend(fontsize=8, ncol=4, loc="upper left")
            fig.tight_layout()
            path = out / f"timeline-{rep.trace.name}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)

    loaded = [rep for rep in reports if rep.load is not None]
    if loaded:
        written.append(_load_plot(out, loaded, plt))

    if paper:
        by: dict[str, list[PaperRun]] = {}
        for run in paper:
            by.setdefault(run.policy, []).append(run)
        fig, ax = plt.subplots(figsize=(10, 4))
        names = list(by)
        for j, (attr, label) in enumerate((("rate_100", "100% arrived"), ("rate_130", "130% arrived"))):
            means = [100 * statistics.fmean(getattr(x, attr) for x in by[n]) for n in names]
            sds = [100 * statistics.pstdev([getattr(x, attr) for x in by[n]]) for n in names]
            ax.bar([i + j * 0.4 for i in range(len(names))], means, 0.4, yerr=sds, label=label, capsize=3)
        ax.axhline(95.23, color="black", ls="--", lw=0.8, label="FGD (paper, no MIG) @100%")
        ax.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("GPU allocation rate (%)")
        ax.set_ylim(0, 118)
        ax.legend(fontsize=8, ncol=3, loc="upper left")
        ax.set_title("Alibaba openb, paper protocol (sampled tasks, no departures), mean ± sd over seeds")
        fig.tight_layout()
        path = out / "paper-allocation.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _load_plot(out: Path, reports: Sequence[TraceReport], plt: Any) -> Path:
    """Served share and mean wait against load, one line per policy (the fixed layouts that serve almost
    nothing left out). Side effect: writes ``load.png``."""
    reports = sorted(reports, key=lambda r: r.load or 0.0)
    loads = [rep.load for rep in reports]
    skip = ("static:all-1g", "static:balanced")
    fig, (served_ax, wait_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in [r.policy for r in reports[0].results if r.policy not in skip]:
        runs = [rep.by_policy(policy) for rep in reports]
        served = [
            100 * r.served_slice_h / r.offered_slice_h if r and r.offered_slice_h else 0.0 for r in runs
        ]
        waits = [r.wait_mean_s if r else 0.0 for r in runs]
        style = {"lw": 2.2} if policy.startswith("dynamig") else {"lw": 1.0}
        served_ax.plot(loads, served, marker="o", label=policy, **style)
        wait_ax.plot(loads, waits, marker="o", label=policy, **style)
    served_ax.set_xlabel("load (peak demand / capacity)")
    served_ax.set_ylabel("demand served (% of offered slice-hours)")
    wait_ax.set_xlabel("load (peak demand / capacity)")
    wait_ax.set_ylabel("mean time to running, every job (s)")
    wait_ax.set_yscale("symlog", linthresh=1.0)  # 0 s waits (pre-cut layouts) stay on the plot
    served_ax.legend(fontsize=7, loc="lower left")
    name = reports[0].trace.name.rsplit("-load", 1)[0]  # one cluster, every load level
    fig.suptitle(
        f"{name}: served demand and time to running against load ({reports[0].node_order} node order)"
    )
    fig.tight_layout()
    path = out / "load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
