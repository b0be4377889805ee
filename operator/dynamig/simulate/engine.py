"""Discrete-event engine: replays a trace against one allocator in virtual time, single-threaded.

Events at one instant are handled in a fixed order (departures, reshapes finishing, arrivals, give-ups,
planning rounds), then one scheduling pass walks the queue in arrival order and starts every job that
fits (backfilling: a job that does not fit does not block later ones). An allocator that re-plans
(dynamig) gets a planning round ``window_s`` after demand or inventory changed, as the operator batches
demand; the instances a round creates become usable ``reshape_latency_s`` later. The allocator is told of
every arrival as it happens (``observe_arrival``, before its scheduling pass), so that a policy can learn
from the past only (dynamig's history warm pool).

Everything is deterministic: no wall clock, no randomness (traces carry their own seeds).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dynamig.simulate.allocators import Allocation, Allocator
from dynamig.simulate.preemption import PingPong, PriorityTally
from dynamig.simulate.trace import JOB_KINDS, Job, Trace, compute_slices_by_name, job_kind, percentile

DEPART, READY, ARRIVE, ABANDON, PLAN, PREEMPT = 0, 1, 2, 3, 4, 5


@dataclass(frozen=True, slots=True)
class SimConfig:
    window_s: float = 2.0  # demand is batched this long before a planning round (operator default)
    reshape_latency_s: float = 6.0  # per GPU reshaped on a node, until its new instances are allocatable
    cooldown_s: float = 300.0  # a reshaped GPU is not reshaped again for this long (operator default)
    # from a booking to the node starting the create (the agent's or the kubelet's watch), charged alike to
    # every policy that creates an instance; 0 by default (sub-second on a real cluster, the same for all)
    bind_rtt_s: float = 0.0
    # kube-scheduler's PreBind check of binding conditions: at once, then every 5 s
    # (``wait.PollUntilContextTimeout(ctx, 5*time.Second, pl.bindingTimeout, true, ...)`` in
    # pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go, v1.36.3 and v1.37.2). Only a
    # device with binding conditions waits it: in dynamig, a placement the agent must cut.
    prebind_poll_s: float = 5.0
    # the scheduler's node order, the same for every policy that books devices ("pack" or "spread", see
    # ``dynamig.simulate.booking.NODE_ORDERS``)
    node_order: str = "pack"
    timeline_points: int = 288


@dataclass(slots=True)
class RunResult:
    policy: str
    trace: str
    jobs: int
    started: int
    never_served: int
    abandoned: int
    offered_slice_h: float  # what the jobs asked for, clipped to the horizon
    served_slice_h: float  # asked-for slices x hours actually run before the horizon
    held_slice_h: float  # slices the jobs' instances occupied x hours (>= served when rounded up)
    capacity_slice_h: float
    wait_mean_s: float  # over every job that arrived; one never started waits until the horizon
    wait_p95_s: float
    reshapes: int
    created: int
    destroyed: int
    destroyed_busy: int
    plan_calls: int
    wall_s: float
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (hour, busy fraction)
    served_by_size: dict[int, float] = field(default_factory=dict)  # GPUs per job -> served slice-h
    offered_by_size: dict[int, float] = field(default_factory=dict)  # GPUs per job -> offered slice-h
    started_wait_mean_s: float = 0.0  # over the jobs that started only (the former figure)
    wait_p50_s: float = 0.0  # over every job that arrived, as wait_mean_s
    # per first-choice profile of single-device jobs, over every such job that arrived (as wait_mean_s)
    wait_p50_by_profile: dict[str, float] = field(default_factory=dict)
    wait_p95_by_profile: dict[str, float] = field(default_factory=dict)
    wait_mean_by_profile: dict[str, float] = field(default_factory=dict)
    # warm pool per profile: (share of the horizon with a target > 0, time-mean target); empty: none
    warm_pool_coverage: dict[str, tuple[float, float]] = field(default_factory=dict)
    bind_rtt_s: float = 0.0  # the run's booking-to-create delay (what a warm-pool hit should wait at most)
    # wait to allocation: from arrival until the scheduler allocated the job's devices (every arrived job;
    # one never allocated waits until the horizon). wait_mean_s & co. are the time to running.
    alloc_wait_mean_s: float = 0.0
    alloc_wait_p50_s: float = 0.0
    alloc_wait_p95_s: float = 0.0
    node_order: str = ""
    create_latency_s: float = 0.0
    # per priority class (``dynamig.simulate.priority``): jobs, started, p50_s / p95_s to running (every
    # job that arrived, as wait_mean_s, from its arrival to its first start), served_slice_h
    by_priority: dict[str, dict[str, float]] = field(default_factory=dict)
    evictions: int = 0  # pods evicted to make room for higher-priority ones
    evicted_jobs: int = 0  # distinct jobs evicted at least once
    evicted_work_gpu_s: float = 0.0  # GPU-seconds the victims had run, lost (no MIG checkpointing)
    thrash: int = 0  # ping-pong: a job evicted that then evicted its evictor
    # per job kind (``trace.job_kind``: whole-multi, whole-single, mig), only when the trace has whole-GPU
    # demand: jobs, started, p50_s / p95_s to running (every job that arrived, as wait_mean_s),
    # served_slice_h, served_whole_slice_h (of it, on GPUs with MIG mode off), offered_slice_h
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    mode_switches: int = 0  # MIG mode switches (``dynamig.simulate.modes``)
    mode_switches_per_gpu_day: float = 0.0  # mode_switches / (GPUs x horizon in days)
    switched_busy: int = 0  # GPUs switched while something was on them: must stay 0

    @property
    def utilization(self) -> float:
        """Useful slice utilization: asked-for slice-hours served over capacity."""
        return self.served_slice_h / self.capacity_slice_h if self.capacity_slice_h else 0.0

    @property
    def held_utilization(self) -> float:
        return self.held_slice_h / self.capacity_slice_h if self.capacity_slice_h else 0.0


def demand_slices(job: Job, slices_of: Callable[[str], int]) -> int:
    return job.count * slices_of(job.preferred)


def _timeline(
    points: list[tuple[float, int]], horizon: float, total: int, n: int
) -> list[tuple[float, float]]:
    """Time-average of a step function (time, busy) over ``n`` equal buckets. Pure."""
    if horizon <= 0 or total <= 0 or n <= 0:
        return []
    width = horizon / n
    acc = [0.0] * n
    for (t0, busy), (t1, _) in zip(points, [*points[1:], (horizon, 0)], strict=False):
        t0, t1 = min(t0, horizon), min(t1, horizon)
        while t0 < t1:
            b = min(int(t0 / width), n - 1)
            end = min(t1, (b + 1) * width)
            acc[b] += busy * (end - t0)
            t0 = end if end > t0 else t1
    return [((b + 0.5) * width / 3600.0, acc[b] / (width * total)) for b in range(n)]


# alternatives, count, GPU types, priority, whole-GPU demand
Shape = tuple[tuple[str, ...], int, tuple[str, ...], int, str]


def _shape(job: Job) -> Shape:
    return (job.alternatives, job.count, job.gpu_types, job.priority, job.whole)


def _kind_table(
    jobs: Sequence[Job],
    horizon: float,
    waits: dict[str, float],
    served: dict[str, float],
    whole: dict[str, float],
    offered: dict[str, float],
) -> dict[str, dict[str, float]]:
    """Per job kind (``trace.JOB_KINDS`` that occur): jobs, started, p50_s / p95_s to running over every
    job that arrived (one never started waits until the horizon), served_slice_h (and of it
    served_whole_slice_h, on GPUs with MIG mode off), offered_slice_h. Pure."""
    out: dict[str, dict[str, float]] = {}
    for kind in JOB_KINDS:
        mine = [j for j in jobs if job_kind(j) == kind]
        if not mine:
            continue
        arrived = [j for j in mine if j.arrival <= horizon]
        w = [waits.get(j.name, horizon - j.arrival) for j in arrived]
        out[kind] = {
            "jobs": float(len(mine)),
            "started": float(sum(1 for j in arrived if j.name in waits)),
            "p50_s": percentile(w, 50),
            "p95_s": percentile(w, 95),
            "served_slice_h": served.get(kind, 0.0) / 3600.0,
            "served_whole_slice_h": whole.get(kind, 0.0) / 3600.0,
            "offered_slice_h": offered.get(kind, 0.0) / 3600.0,
        }
    return out


def simulate(
    trace: Trace,
    allocator: Allocator,
    config: SimConfig | None = None,
    starts: dict[str, float] | None = None,
) -> RunResult:
    """Replay ``trace`` on ``allocator``'s cluster until the horizon. Side effect: mutates the allocator, and
    fills ``starts`` (when given) with each started job's first start time."""
    cfg = config or SimConfig()
    wall0 = time.perf_counter()
    horizon = trace.horizon
    # asked-for compute slices by profile name over every model of the cluster (on a mixed cluster the
    # preferred profile is one model's; its compute size is the same on every model)
    slices = compute_slices_by_name(allocator.cluster.models.values())

    seq = itertools.count()
    events: list[tuple[float, int, int, Job | None]] = []
    for job in trace.jobs:
        if job.arrival <= horizon:
            events.append((job.arrival, ARRIVE, next(seq), job))
    heapq.heapify(events)

    pending: dict[str, Job] = {}  # in arrival order
    queues: dict[Shape, dict[str, Job]] = {}  # the same, per shape
    order: dict[str, int] = {}
    running: dict[str, tuple[Job, Allocation]] = {}
    # per running job: (its DEPART event's sequence number, when it was allocated, when it began, the
    # served and held slice-seconds credited for its whole run): an eviction takes them back
    credit: dict[str, tuple[int, float, float, float, float]] = {}
    tally = PriorityTally()
    pingpong = PingPong()
    evicted: set[str] = set()
    evictions = 0
    lost_gpu_s = 0.0
    preempt_at: float | None = None
    priority_first = allocator.preempts
    abandon_token: dict[str, int] = {}  # the ABANDON event of a job's latest time in the queue
    waits: list[float] = []
    alloc_waits: list[float] = []
    profile_waits: dict[str, list[float]] = {}  # single-device jobs, by first-choice profile
    served = held = offered = 0.0
    served_by: dict[int, float] = {}
    started: set[str] = set()
    offered_by: dict[int, float] = {}
    abandoned = 0
    plan_at: float | None = None
    points: list[tuple[float, int]] = [(0.0, allocator.busy_slices())]

    # per job kind, only when the trace has whole-GPU demand
    kinds = any(job.whole for job in trace.jobs)
    kind_wait: dict[str, float] = {}  # job -> time to its first start
    kind_served: dict[str, float] = {}
    kind_whole: dict[str, float] = {}  # of it, served on GPUs with MIG mode off
    kind_offered: dict[str, float] = {}
    for job in trace.jobs:
        tally.arrived(job, waits=job.arrival <= horizon)
        run = horizon - job.arrival if job.duration is None else min(job.duration, horizon - job.arrival)
        asked = demand_slices(job, slices.__getitem__) * max(0.0, run)
        offered += asked
        offered_by[job.count] = offered_by.get(job.count, 0.0) + asked
        if kinds:
            kind_offered[job_kind(job)] = kind_offered.get(job_kind(job), 0.0) + asked

    def schedule_pass(now: float) -> None:
        """Jobs in arrival order; once one of a shape does not fit, later ones of that shape are skipped
        (same outcome as trying them all). Per-shape queues keep a pass cheap with thousands waiting."""
        nonlocal served, held
        allocator.set_pending([j for shape, q in queues.items() if shape[1] > 1 for j in q.values()])
        # kube-scheduler's PrioritySort (highest priority first) where priorities matter, else arrival
        heads = [(head_key(shape, q), shape) for shape, q in queues.items()]
        heapq.heapify(heads)
        while heads:
            _, shape = heapq.heappop(heads)
            q = queues[shape]
            name, job = next(iter(q.items()))
            alloc = allocator.place(job, now)
            if alloc is None:
                continue
            del q[name]
            if q:
                heapq.heappush(heads, (head_key(shape, q), shape))
            else:
                del queues[shape]
            del pending[name]
            running[name] = (job, alloc)
            begin = now + alloc.delay
            if name not in started:  # time to running: to the first start (a victim's restart is not one)
                started.add(name)
                if starts is not None:
                    starts[name] = begin
                waits.append(begin - job.arrival)
                alloc_waits.append(now - job.arrival)
                tally.started(job, begin - job.arrival)
                if job.count == 1:
                    profile_waits.setdefault(job.preferred, []).append(begin - job.arrival)
                if kinds:
                    kind_wait[name] = begin - job.arrival
            run = max(0.0, horizon - begin if job.duration is None else min(job.duration, horizon - begin))
            got = demand_slices(job, slices.__getitem__) * run
            served += got
            served_by[job.count] = served_by.get(job.count, 0.0) + got
            if kinds:
                kind_served[job_kind(job)] = kind_served.get(job_kind(job), 0.0) + got
                if alloc.gpus:
                    kind_whole[job_kind(job)] = kind_whole.get(job_kind(job), 0.0) + got
            tally.served(job, got)
            kept = alloc.slices * (run + min(alloc.delay, horizon - now))
            held += kept
            token = next(seq)
            credit[name] = (token, now, begin, got, kept)
            if job.duration is not None and begin + job.duration <= horizon:
                heapq.heappush(events, (begin + job.duration, DEPART, token, job))

    def head_key(shape: Shape, q: dict[str, Job]) -> tuple[int, int]:
        return (-shape[3] if priority_first else 0, order[next(iter(q))])

    def enqueue(job: Job, now: float) -> None:
        pending[job.name] = job
        order[job.name] = len(order)
        queues.setdefault(_shape(job), {})[job.name] = job
        patience = trace.patience if job.patience is None else job.patience
        if patience is not None:
            abandon_token[job.name] = token = next(seq)
            heapq.heappush(events, (now + patience, ABANDON, token, job))

    def evict(name: str, now: float, by: str) -> None:
        """``name`` is evicted for ``by``: its instances released, the work it did lost (not served), and
        it queues again as a new pod (it restarts from zero)."""
        nonlocal served, held, evictions, lost_gpu_s
        job, alloc = running.pop(name)
        _, at, begin, got, kept = credit.pop(name)
        allocator.release(job, alloc, now)
        served -= got
        served_by[job.count] -= got
        if kinds:
            kind_served[job_kind(job)] -= got
            if alloc.gpus:
                kind_whole[job_kind(job)] -= got
        tally.served(job, -got)
        held += alloc.slices * (min(now, horizon) - at) - kept
        gpus = sum(i.slices / i.gpu.model.compute_slices for i in alloc.instances) + len(alloc.gpus)
        lost_gpu_s += max(0.0, now - begin) * gpus
        evictions += 1
        evicted.add(name)
        pingpong.evicted(name, by)
        enqueue(job, now)

    allocator.evictor = evict

    def preempt_pass(now: float) -> None:
        nonlocal preempt_at
        if not (allocator.preempts or allocator.drains) or not pending:
            return
        waiting = sorted(pending.values(), key=lambda j: (-j.priority, order[j.name]))
        before = evictions
        outcome = allocator.preempt(now, waiting)
        for ready in sorted(set(outcome.ready_times)):
            heapq.heappush(events, (ready, READY, next(seq), None))
        retry = outcome.retry_at  # asked again later, never at this instant (that would loop)
        if retry is not None and now < retry and (preempt_at is None or retry < preempt_at):
            preempt_at = retry
            heapq.heappush(events, (retry, PREEMPT, next(seq), None))
        if evictions > before:
            schedule_pass(now)

    while events and events[0][0] <= horizon:
        now = events[0][0]
        changed = False
        plan_now = False
        preempt_now = False
        while events and events[0][0] == now:
            _, kind, token, item = heapq.heappop(events)
            if kind == DEPART and item is not None:
                if item.name not in credit or credit[item.name][0] != token:
                    continue  # the run this departure ended was evicted
                del credit[item.name]
                _, alloc = running.pop(item.name)
                allocator.release(item, alloc, now)
                changed = True
            elif kind == READY:
                allocator.on_ready(now)
                changed = True
            elif kind == ARRIVE and item is not None:
                allocator.observe_arrival(item, now)
                enqueue(item, now)
                changed = True
            elif kind == ABANDON and item is not None:
                if abandon_token.get(item.name) != token:
                    continue  # an evicted job queued again: its patience counts from then
                if pending.pop(item.name, None) is not None:
                    q = queues[_shape(item)]
                    del q[item.name]
                    if not q:
                        del queues[_shape(item)]
                    abandoned += 1
                    allocator.withdraw(item, now)
            elif kind == PLAN:
                plan_at = None
                plan_now = True
            elif kind == PREEMPT and preempt_at == now:
                preempt_at = None
                preempt_now = True
        if changed:
            schedule_pass(now)
        if changed or preempt_now:
            preempt_pass(now)
        if plan_now and allocator.replans:
            outcome = allocator.replan(now, list(pending.values()))
            for ready in sorted(set(outcome.ready_times)):
                heapq.heappush(events, (ready, READY, next(seq), None))
            if outcome.retry_at is not None and plan_at is None:
                plan_at = outcome.retry_at
                heapq.heappush(events, (plan_at, PLAN, next(seq), None))
        if allocator.replans and changed and plan_at is None and (pending or allocator.wants_plan(now)):
            plan_at = now + cfg.window_s
            heapq.heappush(events, (plan_at, PLAN, next(seq), None))
        points.append((now, allocator.busy_slices()))

    capacity = allocator.total_slices * horizon
    cluster = allocator.cluster
    # every job counts: one that never started (gave up, or still waiting) waited until the horizon
    never = [
        horizon - job.arrival for job in trace.jobs if job.arrival <= horizon and job.name not in started
    ]
    all_waits = waits + never
    all_alloc = alloc_waits + never
    for job in trace.jobs:
        if job.count == 1 and job.arrival <= horizon and job.name not in started:
            profile_waits.setdefault(job.preferred, []).append(horizon - job.arrival)
    return RunResult(
        policy=allocator.name,
        trace=trace.name,
        jobs=len(trace.jobs),
        started=len(waits),
        never_served=sum(1 for job in trace.jobs if job.arrival <= horizon and job.name not in started),
        abandoned=abandoned,
        offered_slice_h=offered / 3600.0,
        served_slice_h=served / 3600.0,
        held_slice_h=held / 3600.0,
        capacity_slice_h=capacity / 3600.0,
        wait_mean_s=sum(all_waits) / len(all_waits) if all_waits else 0.0,
        wait_p95_s=percentile(all_waits, 95),
        reshapes=allocator.reshapes,
        created=cluster.created,
        destroyed=cluster.destroyed,
        destroyed_busy=cluster.destroyed_busy,
        plan_calls=allocator.plan_calls,
        wall_s=time.perf_counter() - wall0,
        timeline=_timeline(points, horizon, allocator.total_slices, cfg.timeline_points),
        served_by_size={k: v / 3600.0 for k, v in sorted(served_by.items())},
        offered_by_size={k: v / 3600.0 for k, v in sorted(offered_by.items())},
        started_wait_mean_s=sum(waits) / len(waits) if waits else 0.0,
        wait_p50_s=percentile(all_waits, 50),
        wait_p50_by_profile={p: percentile(w, 50) for p, w in sorted(profile_waits.items())},
        wait_p95_by_profile={p: percentile(w, 95) for p, w in sorted(profile_waits.items())},
        wait_mean_by_profile={p: sum(w) / len(w) for p, w in sorted(profile_waits.items())},
        warm_pool_coverage=allocator.warm_pool_coverage(horizon),
        bind_rtt_s=cfg.bind_rtt_s,
        alloc_wait_mean_s=sum(all_alloc) / len(all_alloc) if all_alloc else 0.0,
        alloc_wait_p50_s=percentile(all_alloc, 50),
        alloc_wait_p95_s=percentile(all_alloc, 95),
        node_order=getattr(allocator, "node_order", ""),
        create_latency_s=cfg.reshape_latency_s,
        by_priority=tally.table(horizon),
        evictions=evictions,
        evicted_jobs=len(evicted),
        evicted_work_gpu_s=lost_gpu_s,
        thrash=pingpong.count,
        by_kind=_kind_table(trace.jobs, horizon, kind_wait, kind_served, kind_whole, kind_offered)
        if kinds
        else {},
        mode_switches=cluster.switches,
        mode_switches_per_gpu_day=(
            cluster.switches / (len(cluster.gpus) * horizon / 86400.0)
            if cluster.gpus and horizon > 0
            else 0.0
        ),
        switched_busy=cluster.switched_busy,
    )
