"""Tests of ``dynamig-drain`` in the simulator: a GPU drained for a large job that a stream of small ones
starves, at equal priority, evicting nobody.

What runs for real: the simulator's engine, the geometry catalog and the drain choice
(``dynamig.planner.drain.choose_drains``) inside ``dynamig-drain``. What is simulated: the GPUs (the
simulator's cluster model, virtual time) and the workloads (a tiny hand-made trace). Deterministic.
"""

from __future__ import annotations

from dynamig.planner import Policy
from dynamig.simulate.allocators import Allocator
from dynamig.simulate.cluster import Cluster
from dynamig.simulate.drain_policy import DrainSettings, DynamigDrainAllocator
from dynamig.simulate.dynamig_policy import DynamigAllocator
from dynamig.simulate.engine import RunResult, SimConfig, simulate
from dynamig.simulate.runner import POLICIES, DynamigSettings, allocator_factories
from dynamig.simulate.trace import Job, Trace, uniform_cluster

CFG = SimConfig(window_s=2.0, reshape_latency_s=6.0, cooldown_s=60.0, prebind_poll_s=5.0)
TWO_GPUS = uniform_cluster(1, 2, "A100-80GB")
KW = {"reshape_latency_s": CFG.reshape_latency_s, "cooldown_s": CFG.cooldown_s, "prebind_poll_s": 5.0}
LARGE_AT = 1000.0
SMALL_RUN_S = 700.0


def stream() -> Trace:
    """A 1g.10gb job every minute for 100 minutes, 700 s each (about 12 at a time on 14 slices: both GPUs
    stay partly busy), and one 7g.80gb job at 1000 s."""
    jobs = [Job(f"small{i:03d}", 60.0 * i, SMALL_RUN_S, ("1g.10gb",)) for i in range(100)]
    jobs.append(Job("large", LARGE_AT, 600.0, ("7g.80gb",)))
    return Trace("stream", TWO_GPUS, tuple(sorted(jobs, key=lambda j: j.arrival)), horizon=10_000.0)


def drain(after_s: float, max_gpus: int = 1, hold_s: float = 3600.0) -> DynamigDrainAllocator:
    cluster = Cluster(TWO_GPUS, log=True)
    settings = DrainSettings(after_s=after_s, max_gpus=max_gpus, hold_s=hold_s)
    return DynamigDrainAllocator(cluster, Policy(), drain=settings, **KW)


def large_wait(result: RunResult) -> float:
    return result.wait_p95_by_profile["7g.80gb"]


def test_plain_dynamig_starves_the_large_job_while_the_stream_lasts() -> None:
    alloc: Allocator = DynamigAllocator(Cluster(TWO_GPUS), Policy(), **KW)  # type: ignore[arg-type]
    result = simulate(stream(), alloc, CFG)
    assert large_wait(result) > 4000.0  # until the stream ends and a GPU empties


def test_drain_serves_the_large_job_once_the_drained_gpus_instances_end_and_evicts_nobody() -> None:
    alloc = drain(after_s=60.0, max_gpus=1)
    result = simulate(stream(), alloc, CFG)
    # drained at 1060 s: the small jobs there end within their 700 s, then the cut and its PreBind check
    assert 60.0 < large_wait(result) <= 60.0 + SMALL_RUN_S + 20.0
    assert result.evictions == 0 and result.evicted_jobs == 0
    assert result.destroyed_busy == 0
    assert result.never_served == 0


def test_the_drained_gpu_takes_no_new_small_booking_until_the_large_job_has_it() -> None:
    trace = stream()
    alloc = drain(after_s=60.0, max_gpus=1)
    simulate(trace, alloc, CFG)
    log = alloc.cluster.log or []
    large_gpu = next(e.gpu for e in log if e.op == "assign" and e.job == "large")
    large_at = next(e.time for e in log if e.op == "assign" and e.job == "large")
    drained_at = LARGE_AT + 60.0
    booked = [e for e in log if e.op == "assign" and e.gpu == large_gpu and drained_at <= e.time < large_at]
    assert large_at > drained_at + 60.0  # the drain had to wait for the small jobs there
    assert booked == []


def test_a_hold_ends_after_hold_s_and_the_job_is_drained_for_again() -> None:
    alloc = drain(after_s=60.0, max_gpus=1, hold_s=120.0)
    simulate(stream(), alloc, CFG)
    assert alloc.drains_expired >= 1
    assert alloc.drains_started > alloc.drains_expired
    kept = drain(after_s=60.0, max_gpus=1, hold_s=3600.0)
    simulate(stream(), kept, CFG)
    assert kept.drains_expired == 0


def test_no_drain_before_after_s() -> None:
    alloc = drain(after_s=20_000.0, max_gpus=1)
    result = simulate(stream(), alloc, CFG)
    assert alloc.drains_started == 0
    assert large_wait(result) > 4000.0


def test_dynamig_drain_is_a_named_policy_of_the_runner_with_spec_drains_knobs() -> None:
    assert "dynamig-drain" in POLICIES
    dyn = DynamigSettings(drain=DrainSettings(after_s=60.0, max_gpus=2, hold_s=900.0))
    ((label, make),), _ = allocator_factories(TWO_GPUS, {}, CFG, dyn, ("dynamig-drain",))
    alloc = make()
    assert label == "dynamig-drain" and isinstance(alloc, DynamigDrainAllocator)
    assert alloc.settings == DrainSettings(60.0, 2, 900.0)
