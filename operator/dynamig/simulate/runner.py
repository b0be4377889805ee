"""Run every policy on one trace and on the paper's protocol; collect comparable results.

Each policy gets a fresh cluster built from the trace's ``ClusterSpec``; the same jobs are offered to all.
Side effects: none beyond the allocators' own state (no files, no printing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import GpuModel, Layout
from dynamig.planner import Policy, Strategy
from dynamig.planner.offerlimit import EVERY_PLACEMENT
from dynamig.planner.warmpool import WarmPoolSizing
from dynamig.simulate.allocators import (
    Allocator,
    PoolAllocator,
    StaticAllocator,
    WholeGpuAllocator,
)
from dynamig.simulate.booking import FirstFitAllocator, HamiReserveAllocator, NvidiaDynamicMigAllocator
from dynamig.simulate.bounds import served_upper_bound
from dynamig.simulate.cluster import Cluster
from dynamig.simulate.drain_policy import DrainSettings, DynamigDrainAllocator
from dynamig.simulate.dynamig_policy import DynamigAllocator
from dynamig.simulate.engine import RunResult, SimConfig, simulate
from dynamig.simulate.modes import DynamigModesAllocator, ModeSettings, NvidiaToggleAllocator
from dynamig.simulate.preempt_policies import DynamigPreemptAllocator, StaticPreemptAllocator
from dynamig.simulate.preemption import PreemptSettings
from dynamig.simulate.static_layouts import average_mix, device_mix_on, mixed_static_candidates
from dynamig.simulate.trace import ClusterSpec, Job, Trace, compute_slices_by_name, order_models

# the policies with GPUs in MIG mode off, for whole-GPU demand (dynamig.simulate.modes); opt-in:
# whole-split[-nodes] gives one policy per share of DynamigSettings.modes.split_shares
# (dynamig-modes-keep: a labelled proposal, not the operator's rules: see dynamig.simulate.modes)
MODE_POLICIES = (
    "whole-split",
    "whole-split-nodes",
    "dynamig-modes",
    "dynamig-modes-offer",
    "dynamig-modes-keep",
    "nvidia-toggle",
)
POLICIES = (
    "whole-gpu",
    "static",
    "first-fit",
    "nvidia-dynamic-mig",
    "hami-reserve",
    "hami-default",
    "dynamig",
    "dynamig-warm",
    "pool",
    "static-preempt",
    "dynamig-preempt",
    "dynamig-drain",
    *MODE_POLICIES,
)
# the policies that evict lower-priority jobs (dynamig.simulate.preempt_policies); opt-in
PREEMPTING = ("static-preempt", "dynamig-preempt")
DRAINING = ("dynamig-drain",)  # dynamig with spec.drain's holds (dynamig.simulate.drain_policy); opt-in
# every policy but those: what run_trace runs unless told otherwise
BASE_POLICIES = tuple(p for p in POLICIES if p not in MODE_POLICIES)
# what `dynamig simulate` runs unless --policies says otherwise (the labelled variants are opt-in)
DEFAULT_POLICIES = tuple(
    p for p in BASE_POLICIES if p not in ("dynamig-warm", "hami-default", *PREEMPTING, *DRAINING)
)
# the policies that create instances, whose figures depend on the create latency (the latency sweep)
CREATING = (
    "first-fit", "nvidia-dynamic-mig", "hami-reserve", "hami-default",
    "dynamig", "dynamig-warm", "dynamig-preempt", *DRAINING, *MODE_POLICIES,
)  # fmt: skip
# policies that learn from arrivals over time; the paper protocol (no clock, no departures) leaves them out
# (and those that evict: no clock, no one to evict for; and those that switch MIG modes: no clock)
ONLINE_ONLY = ("dynamig-warm", *PREEMPTING, *DRAINING, *MODE_POLICIES)


@dataclass(frozen=True, slots=True)
class DynamigSettings:
    """The dynamig policy knobs the simulation passes to the planner."""

    warm_pool: Mapping[str, int] = field(default_factory=dict)
    # idle GPUs return to this layout; None: they keep their instances. One layout applies to every model
    # that has all its profiles; a mapping gives one per model key.
    baseline: Layout | Mapping[str, Layout] | None = None
    strategy: Strategy = Strategy.PACK
    # dynamig-warm: the warm pool sized from the trace's own history (dynamig.planner.warmpool), re-sized
    # every warm_resize_s from the single-device claims of the last warm_history_s, to the warm_quantile of
    # arrivals per refill time (binding + window + create latency), at most warm_max_share of the slices
    warm_history_s: float = 6 * 3600.0
    warm_quantile: float = 0.95
    warm_resize_s: float = 300.0
    warm_max_share: float = 0.1
    warm_refill_s: float | None = None  # None: bind_rtt_s + window_s + reshape_latency_s
    # dynamig-preempt's knobs (gap, minimum run time, rate limit, GPU cooldown, ledger)
    preempt: PreemptSettings = field(default_factory=PreemptSettings)
    drain: DrainSettings = field(default_factory=DrainSettings)  # dynamig-drain's spec.drain
    # the policies with GPUs in MIG mode off (switch latency, cooldown, floors, budget, split shares)
    modes: ModeSettings = field(default_factory=ModeSettings)
    # placements to cut each GPU publishes per profile, the agent's --placements-per-profile (every dynamig
    # variant): 0 every placement, None the operator's auto choice for the simulated cluster's GPU nodes
    placements_per_profile: int | None = EVERY_PLACEMENT

    def policy(self, models: GpuModel | Iterable[GpuModel]) -> Policy:
        """The planner policy for a cluster of ``models`` (one model or several). Pure."""
        keyed = {m.key: m for m in ([models] if isinstance(models, GpuModel) else models)}
        baseline: dict[str, Layout] = {}
        if isinstance(self.baseline, Mapping):
            baseline = {k: lay for k, lay in self.baseline.items() if k in keyed}
        elif self.baseline is not None:
            layout = self.baseline
            baseline = {k: layout for k, m in keyed.items() if all(m.has_profile(i.profile) for i in layout)}
        return Policy(warm_pool=dict(self.warm_pool), baseline=baseline, strategy=self.strategy)

    def sizing(self, cfg: SimConfig) -> WarmPoolSizing:
        """The history warm pool's sizing for ``cfg``'s latencies. Pure."""
        refill = self.warm_refill_s
        if refill is None:
            refill = cfg.bind_rtt_s + cfg.window_s + cfg.reshape_latency_s
        refill = max(refill, 1e-3)  # zero latencies (the paper protocol's): any positive window will do
        return WarmPoolSizing(refill_s=refill, history_s=self.warm_history_s, quantile=self.warm_quantile)


@dataclass(slots=True)
class TraceReport:
    trace: Trace
    results: list[RunResult]
    upper_bound_slice_h: float
    static_layouts: dict[str, dict[str, tuple[Layout, ...]]]  # label -> model key -> layouts
    load: float | None = None  # target peak demand / capacity of a load-scaled replay; None: as recorded
    reached_load: float | None = None  # the peak demand / capacity the compressed replay actually has
    node_order: str = "pack"  # the scheduler's node order every booking policy had
    create_latency_s: float = 0.0  # the run's create latency

    def by_policy(self, name: str) -> RunResult | None:
        return next((r for r in self.results if r.policy == name), None)

    def best_static(self) -> RunResult | None:
        statics = [r for r in self.results if r.policy.startswith("static:")]
        return max(statics, key=lambda r: r.served_slice_h) if statics else None


def cluster_models(spec: ClusterSpec) -> tuple[GpuModel, ...]:
    """The GPU models of ``spec``, in jobs' preference order (smallest memory first). Side effect: reads
    the catalog (cached)."""
    catalog = load_catalog()
    return order_models(catalog.model(key) for key in spec.models())


def total_compute_slices(spec: ClusterSpec) -> int:
    """Compute slices of every GPU of ``spec``. Side effect: reads the catalog (cached)."""
    catalog = load_catalog()
    return sum(n.gpus * catalog.model(n.model).compute_slices for n in spec.nodes)


def allocator_factories(
    spec: ClusterSpec,
    mix: Mapping[str, Mapping[str, float]],
    cfg: SimConfig,
    dyn: DynamigSettings,
    policies: Sequence[str] = BASE_POLICIES,
    *,
    log: bool = False,
) -> tuple[list[tuple[str, Callable[[], Allocator]]], dict[str, dict[str, tuple[Layout, ...]]]]:
    """(label, factory) per policy to compare, and the static layouts used (label -> model key ->
    layouts). ``mix``: per model key, devices per profile for the best-fit static layout. Pure (factories
    are lazy)."""
    models = cluster_models(spec)
    mixes = {m.key: {p: float(n) for p, n in mix.get(m.key, {}).items() if m.has_profile(p)} for m in models}
    statics = mixed_static_candidates({m.key: m for m in models}, spec, mixes)
    total_slices = total_compute_slices(spec)
    out: list[tuple[str, Callable[[], Allocator]]] = []
    if "whole-gpu" in policies:
        out.append(("whole-gpu", lambda: WholeGpuAllocator(Cluster(spec, log=log), cfg.node_order)))
    order = cfg.node_order
    if "static" in policies:
        for label, layouts in statics.items():
            out.append((f"static:{label}", _static_factory(spec, layouts, label, log, order)))
    if "first-fit" in policies:
        out.append(
            (
                "first-fit",
                lambda: FirstFitAllocator(
                    Cluster(spec, log=log), cfg.reshape_latency_s, cfg.bind_rtt_s, node_order=order
                ),
            )
        )
    if "nvidia-dynamic-mig" in policies:
        out.append(
            (
                "nvidia-dynamic-mig",
                lambda: NvidiaDynamicMigAllocator(
                    Cluster(spec, log=log), cfg.reshape_latency_s, cfg.bind_rtt_s, node_order=order
                ),
            )
        )
    if "hami-reserve" in policies:
        out.append(
            (
                "hami-reserve",
                lambda: HamiReserveAllocator(
                    Cluster(spec, log=log), cfg.reshape_latency_s, cfg.bind_rtt_s, node_order=order
                ),
            )
        )
    if "hami-default" in policies:  # HAMi with its own scheduler's default node policy (binpack)
        out.append(
            (
                "hami-default",
                lambda: HamiReserveAllocator(
                    Cluster(spec, log=log), cfg.reshape_latency_s, cfg.bind_rtt_s, node_order="binpack"
                ),
            )
        )

    def dynamig_like(make: type[DynamigAllocator], policy: Policy, **extra: Any) -> DynamigAllocator:
        """A dynamig variant on its own cluster, with the run's clock and node order."""
        return make(
            Cluster(spec, log=log),
            policy,
            reshape_latency_s=cfg.reshape_latency_s,
            cooldown_s=cfg.cooldown_s,
            bind_rtt_s=cfg.bind_rtt_s,
            prebind_poll_s=cfg.prebind_poll_s,
            node_order=order,
            placements_per_profile=dyn.placements_per_profile,
            **extra,
        )

    if "dynamig" in policies:
        out.append(("dynamig", lambda: dynamig_like(DynamigAllocator, dyn.policy(models))))
    if "dynamig-warm" in policies:
        out.append(
            (
                "dynamig-warm",
                lambda: dynamig_like(
                    DynamigAllocator,
                    replace(dyn.policy(models), warm_pool={}),  # sized from the history as it arrives
                    warm_sizing=dyn.sizing(cfg),
                    resize_every_s=dyn.warm_resize_s,
                    warm_max_slices=int(dyn.warm_max_share * total_slices),
                ),
            )
        )
    if "pool" in policies:
        out.append(("pool", lambda: PoolAllocator(Cluster(spec, log=log), order)))
    if "static-preempt" in policies:  # the best static layout, with kube-scheduler's priority preemption
        best = statics["best-fit"]
        out.append(
            (
                "static-preempt:best-fit",
                lambda: StaticPreemptAllocator(Cluster(spec, log=log), best, "best-fit", order),
            )
        )
    if "dynamig-preempt" in policies:
        out.append(
            (
                "dynamig-preempt",
                lambda: dynamig_like(DynamigPreemptAllocator, dyn.policy(models), preempt=dyn.preempt),
            )
        )
    if "dynamig-drain" in policies:
        out.append(
            (
                "dynamig-drain",
                lambda: dynamig_like(DynamigDrainAllocator, dyn.policy(models), drain=dyn.drain),
            )
        )
    for name, by in (("whole-split", "gpu"), ("whole-split-nodes", "node")):
        if name in policies:  # a fixed share of the GPUs with MIG mode off, dynamig on the others
            for share in dyn.modes.split_shares:
                out.append((f"{name}:{share:g}", _split_factory(dynamig_like, dyn, models, share, by)))
    if "dynamig-modes" in policies:  # dynamig with the operator's MIG mode on demand
        out.append(
            (
                "dynamig-modes",
                lambda: dynamig_like(
                    DynamigModesAllocator, dyn.policy(models), modes=dyn.modes, window_s=cfg.window_s
                ),
            )
        )
    if "dynamig-modes-offer" in policies:  # and migMode.offerWhole: idle MIG GPUs offer their whole device
        out.append(
            (
                "dynamig-modes-offer",
                lambda: dynamig_like(
                    DynamigModesAllocator,
                    dyn.policy(models),
                    modes=dyn.modes,
                    window_s=cfg.window_s,
                    offer_whole=True,
                ),
            )
        )
    if "dynamig-modes-keep" in policies:  # labelled: an idle node kept per multi-GPU whole claim
        out.append(
            (
                "dynamig-modes-keep",
                lambda: dynamig_like(
                    DynamigModesAllocator,
                    dyn.policy(models),
                    modes=replace(dyn.modes, max_switching=dyn.modes.keep_budget),
                    window_s=cfg.window_s,
                    keep_whole=True,
                ),
            )
        )
    if "nvidia-toggle" in policies:  # NVIDIA's DynamicMIG, its full GPU and MIG mode toggled included
        out.append(
            (
                "nvidia-toggle",
                lambda: NvidiaToggleAllocator(
                    Cluster(spec, log=log),
                    cfg.reshape_latency_s,
                    cfg.bind_rtt_s,
                    node_order=order,
                    switch_s=dyn.modes.switch_s,
                ),
            )
        )
    return out, statics


def _split_factory(
    dynamig_like: Callable[..., DynamigAllocator],
    dyn: DynamigSettings,
    models: Sequence[GpuModel],
    share: float,
    by: str,
) -> Callable[[], Allocator]:
    return lambda: dynamig_like(
        DynamigModesAllocator, dyn.policy(models), modes=dyn.modes, dynamic=False, split=(share, by)
    )


def _static_factory(
    spec: ClusterSpec, layouts: Mapping[str, tuple[Layout, ...]], label: str, log: bool, node_order: str
) -> Callable[[], Allocator]:
    return lambda: StaticAllocator(Cluster(spec, log=log), layouts, label, node_order)


def run_trace(
    trace: Trace,
    cfg: SimConfig,
    dyn: DynamigSettings,
    policies: Sequence[str] = BASE_POLICIES,
    *,
    log: bool = False,
    progress: Callable[[str], None] | None = None,
    load: float | None = None,
) -> TraceReport:
    """Every policy on ``trace``, plus the slice-arithmetic upper bound. Deterministic."""
    models = cluster_models(trace.cluster)
    mixes = {m.key: average_mix(trace, m) for m in models}
    factories, statics = allocator_factories(trace.cluster, mixes, cfg, dyn, policies, log=log)
    results = []
    for label, make in factories:
        if progress:
            progress(f"{trace.name}: {label}")
        results.append(simulate(trace, make(), cfg))
    slices = compute_slices_by_name(models)
    # a job may start after its allocation, possibly placed just before its patience ran out: the watch delay
    # and the create, and for a cut the wait until the next PreBind check
    slack = cfg.bind_rtt_s + cfg.reshape_latency_s
    if cfg.prebind_poll_s > 0 and slack > 0:
        slack = cfg.prebind_poll_s * math.ceil(slack / cfg.prebind_poll_s - 1e-9)
    bound = served_upper_bound(trace, slices, total_compute_slices(trace.cluster), start_slack_s=slack)
    return TraceReport(
        trace,
        results,
        bound,
        statics,
        load,
        node_order=cfg.node_order,
        create_latency_s=cfg.reshape_latency_s,
    )


def run_with_starts(
    trace: Trace, cfg: SimConfig, dyn: DynamigSettings, policies: Sequence[str]
) -> dict[str, tuple[RunResult, dict[str, float]]]:
    """Each of ``policies`` on ``trace`` (by its result's name): its result and each started job's first
    start, for the benches that explain a difference job by job. Deterministic."""
    mixes = {m.key: average_mix(trace, m) for m in cluster_models(trace.cluster)}
    factories, _ = allocator_factories(trace.cluster, mixes, cfg, dyn, policies)
    out: dict[str, tuple[RunResult, dict[str, float]]] = {}
    for _, make in factories:
        starts: dict[str, float] = {}
        result = simulate(trace, make(), cfg, starts)
        out[result.policy] = (result, starts)
    return out


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


def run_paper_protocol(
    jobs: Sequence[Job],
    spec: ClusterSpec,
    seed: int,
    cfg: SimConfig,
    dyn: DynamigSettings,
    policies: Sequence[str] = BASE_POLICIES,
) -> list[PaperRun]:
    """Offer ``jobs`` (already sampled, in order) once each, no departures; a job that cannot be placed
    when it arrives fails. Every policy gets the same single chance at arrival (no clock: creates and
    re-cuts are instant, and nobody sees a later arrival). Deterministic."""
    models = cluster_models(spec)
    capacity = spec.gpu_count
    instant = SimConfig(
        window_s=0.0,
        reshape_latency_s=0.0,
        cooldown_s=0.0,
        bind_rtt_s=0.0,
        prebind_poll_s=0.0,
        node_order=cfg.node_order,
    )
    mixes = {m.key: device_mix_on(jobs, m) for m in models}
    once = tuple(p for p in policies if p not in ONLINE_ONLY)
    factories, _ = allocator_factories(spec, mixes, instant, dyn, once)
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
                # GPUs' worth: compute slices per GPU averaged over the cluster (7 on every model here)
                unallocated_gpus_130=(alloc.total_slices - alloc.busy_slices())
                / (alloc.total_slices / capacity),
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
