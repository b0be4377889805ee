"""Run every policy on one trace and on the paper's protocol; collect comparable results.

Each policy gets a fresh cluster built from the trace's ``ClusterSpec``; the same jobs are offered to all.
Side effects: none beyond the allocators' own state (no files, no printing).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dynamig.geometry.model import GpuModel, Layout
from dynamig.planner import Policy, Strategy
from dynamig.simulate.allocators import (
    Allocator,
    FirstFitAllocator,
    PoolAllocator,
    StaticAllocator,
    WholeGpuAllocator,
)
from dynamig.simulate.booking import HamiReserveAllocator, NvidiaDynamicMigAllocator
from dynamig.simulate.bounds import served_upper_bound
from dynamig.simulate.cluster import Cluster
from dynamig.simulate.dynamig_policy import DynamigAllocator
from dynamig.simulate.engine import RunResult, SimConfig, simulate
from dynamig.simulate.static_layouts import average_mix, static_candidates
from dynamig.simulate.trace import ClusterSpec, Job, Trace

POLICIES = ("whole-gpu", "static", "first-fit", "nvidia-dynamic-mig", "hami-reserve", "dynamig", "pool")


@dataclass(frozen=True, slots=True)
class DynamigSettings:
    """The dynamig policy knobs the simulation passes to the planner."""

    warm_pool: Mapping[str, int] = field(default_factory=dict)
    baseline: Layout | None = None  # idle GPUs return to this layout; None: they keep their instances
    strategy: Strategy = Strategy.PACK

    def policy(self, model: GpuModel) -> Policy:
        baseline = {} if self.baseline is None else {model.key: self.baseline}
        return Policy(warm_pool=dict(self.warm_pool), baseline=baseline, strategy=self.strategy)


@dataclass(slots=True)
class TraceReport:
    trace: Trace
    results: list[RunResult]
    upper_bound_slice_h: float
    static_layouts: dict[str, tuple[Layout, ...]]
    load: float | None = None  # target peak demand / capacity of a load-scaled replay; None: as recorded
    reached_load: float | None = None  # the peak demand / capacity the compressed replay actually has

    def by_policy(self, name: str) -> RunResult | None:
        return next((r for r in self.results if r.policy == name), None)

    def best_static(self) -> RunResult | None:
        statics = [r for r in self.results if r.policy.startswith("static:")]
        return max(statics, key=lambda r: r.served_slice_h) if statics else None


def single_model(spec: ClusterSpec) -> GpuModel:
    cluster = Cluster(ClusterSpec(spec.nodes[:1]))
    if len(spec.models()) != 1:
        raise ValueError(f"the simulator compares policies on one GPU model; the cluster has {spec.models()}")
    return next(iter(cluster.models.values()))


def allocator_factories(
    spec: ClusterSpec,
    mix: dict[str, float],
    cfg: SimConfig,
    dyn: DynamigSettings,
    policies: Sequence[str] = POLICIES,
    *,
    log: bool = False,
) -> tuple[list[tuple[str, Callable[[], Allocator]]], dict[str, tuple[Layout, ...]]]:
    """(label, factory) per policy to compare, and the static layouts used. Pure (factories are lazy)."""
    model = single_model(spec)
    statics = static_candidates(model, mix, spec.gpu_count)
    out: list[tuple[str, Callable[[], Allocator]]] = []
    if "whole-gpu" in policies:
        out.append(("whole-gpu", lambda: WholeGpuAllocator(Cluster(spec, log=log))))
    if "static" in policies:
        for label, layouts in statics.items():
            out.append((f"static:{label}", _static_factory(spec, layouts, label, log)))
    if "first-fit" in policies:
        out.append(("first-fit", lambda: FirstFitAllocator(Cluster(spec, log=log), cfg.reshape_latency_s)))
    if "nvidia-dynamic-mig" in policies:
        out.append(
            (
                "nvidia-dynamic-mig",
                lambda: NvidiaDynamicMigAllocator(
                    Cluster(spec, log=log), cfg.reshape_latency_s, cfg.bind_rtt_s
                ),
            )
        )
    if "hami-reserve" in policies:
        out.append(
            (
                "hami-reserve",
                lambda: HamiReserveAllocator(Cluster(spec, log=log), cfg.reshape_latency_s, cfg.bind_rtt_s),
            )
        )
    if "dynamig" in policies:
        out.append(
            (
                "dynamig",
                lambda: DynamigAllocator(
                    Cluster(spec, log=log),
                    dyn.policy(model),
                    reshape_latency_s=cfg.reshape_latency_s,
                    cooldown_s=cfg.cooldown_s,
                    bind_rtt_s=cfg.bind_rtt_s,
                ),
            )
        )
    if "pool" in policies:
        out.append(("pool", lambda: PoolAllocator(Cluster(spec, log=log))))
    return out, statics


def _static_factory(
    spec: ClusterSpec, layouts: tuple[Layout, ...], label: str, log: bool
) -> Callable[[], Allocator]:
    return lambda: StaticAllocator(Cluster(spec, log=log), layouts, label)


def run_trace(
    trace: Trace,
    cfg: SimConfig,
    dyn: DynamigSettings,
    policies: Sequence[str] = POLICIES,
    *,
    log: bool = False,
    progress: Callable[[str], None] | None = None,
    load: float | None = None,
) -> TraceReport:
    """Every policy on ``trace``, plus the slice-arithmetic upper bound. Deterministic."""
    model = single_model(trace.cluster)
    factories, statics = allocator_factories(trace.cluster, average_mix(trace), cfg, dyn, policies, log=log)
    results = []
    for label, make in factories:
        if progress:
            progress(f"{trace.name}: {label}")
        results.append(simulate(trace, make(), cfg))
    slices = {p.name: p.compute_slices for p in model.profiles}
    # first-fit starts a job one creation latency after placing it, possibly just before its patience ran out
    bound = served_upper_bound(
        trace, slices, trace.cluster.gpu_count * model.compute_slices, start_slack_s=cfg.reshape_latency_s
    )
    return TraceReport(trace, results, bound, statics, load)


# -- the paper's protocol: sampled tasks, no departures ----------------------------------------------------
@dataclass(frozen=True, slots=True)
class PaperRun:
    policy: str
    seed: int
    tasks: int
    failed: int
    rate_100: float  # GPUs' worth of requested share allocated / GPUs, once 100% of capacity has arrived
    rate_130: float  # the same at 130%
    held_130: float  # compute slices held by tasks / all slices at 130% (MIG rounding included)
    unallocated_gpus_130: float  # GPUs' worth of compute slices no task holds at 130%
    idle_gpus_130: int  # GPUs with nothing allocated at 130%
    plan_calls: int
    wall_s: float


def device_mix(jobs: Sequence[Job]) -> dict[str, float]:
    mix: dict[str, float] = {}
    for job in jobs:
        mix[job.preferred] = mix.get(job.preferred, 0.0) + job.count
    return mix


def run_paper_protocol(
    jobs: Sequence[Job],
    spec: ClusterSpec,
    seed: int,
    cfg: SimConfig,
    dyn: DynamigSettings,
    policies: Sequence[str] = POLICIES,
) -> list[PaperRun]:
    """Offer ``jobs`` (already sampled, in order) once each, no departures; a job that cannot be placed
    when it arrives fails. Every policy gets the same single chance at arrival (no clock: creates and
    re-cuts are instant, and nobody sees a later arrival). Deterministic."""
    model = single_model(spec)
    capacity = spec.gpu_count
    instant = SimConfig(window_s=0.0, reshape_latency_s=0.0, cooldown_s=0.0, bind_rtt_s=0.0)
    factories, _ = allocator_factories(spec, device_mix(jobs), instant, dyn, policies)
    runs = []
    for _, make in factories:
        wall0 = time.perf_counter()
        alloc = make()
        arrived = 0.0
        rate_100: float | None = None
        failed = 0
        for i, job in enumerate(jobs):
            if alloc.place(job, float(i)) is None:
                failed += 1
            arrived += job.count * job.share
            if rate_100 is None and arrived >= capacity:
                rate_100 = _allocated_share(alloc, jobs[: i + 1]) / capacity
        allocated = _allocated_share(alloc, jobs)
        runs.append(
            PaperRun(
                policy=alloc.name,
                seed=seed,
                tasks=len(jobs),
                failed=failed,
                rate_100=rate_100 if rate_100 is not None else allocated / capacity,
                rate_130=allocated / capacity,
                held_130=alloc.busy_slices() / alloc.total_slices,
                unallocated_gpus_130=(alloc.total_slices - alloc.busy_slices()) / model.compute_slices,
                idle_gpus_130=capacity - _busy_gpus(alloc),
                plan_calls=alloc.plan_calls,
                wall_s=time.perf_counter() - wall0,
            )
        )
    return runs


def _allocated_share(alloc: Allocator, jobs: Sequence[Job]) -> float:
    placed = alloc.placed_jobs()
    return sum(j.count * j.share for j in jobs if j.name in placed)


def _busy_gpus(alloc: Allocator) -> int:
    if isinstance(alloc, PoolAllocator):
        return alloc.busy_gpus_estimate()
    return sum(1 for g in alloc.cluster.gpus if g.busy_slices)
