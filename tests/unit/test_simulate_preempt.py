"""Tests of preemption in the simulator: priorities from the traces, the eviction ledger, and the two
policies that evict (``dynamig-preempt`` and ``static-preempt``) against the ones that do not.

What runs for real: the simulator's engine, the geometry catalog, the planner and the victim search
(``dynamig.planner.victims.find_victims``) inside ``dynamig-preempt``. What is simulated: the GPUs (the
simulator's cluster model, virtual time) and the workloads (tiny hand-made traces). Deterministic.
"""

from __future__ import annotations

import dataclasses

import pytest

from dynamig.planner import Policy
from dynamig.simulate.allocators import Allocator
from dynamig.simulate.cluster import Cluster
from dynamig.simulate.dynamig_policy import DynamigAllocator
from dynamig.simulate.engine import RunResult, SimConfig, simulate
from dynamig.simulate.preempt_policies import DynamigPreemptAllocator, StaticPreemptAllocator
from dynamig.simulate.preemption import EvictionLedger, PingPong, PreemptSettings
from dynamig.simulate.priority import CLASSES, class_of, kind_priority, qos_priority
from dynamig.simulate.trace import ClusterSpec, Job, Trace, uniform_cluster

CFG = SimConfig(window_s=2.0, reshape_latency_s=6.0, cooldown_s=60.0, prebind_poll_s=5.0)
LS, BE = CLASSES["LS"], CLASSES["BE"]
ONE_GPU = uniform_cluster(1, 1, "A100-80GB")


def dynamig(spec: ClusterSpec, preempt: PreemptSettings | None = None) -> Allocator:
    kw = {"reshape_latency_s": CFG.reshape_latency_s, "cooldown_s": CFG.cooldown_s, "prebind_poll_s": 5.0}
    if preempt is None:
        return DynamigAllocator(Cluster(spec), Policy(), **kw)  # type: ignore[arg-type]
    return DynamigPreemptAllocator(Cluster(spec), Policy(), preempt=preempt, **kw)


def static_preempt(spec: ClusterSpec, layout: list[tuple[str, int]]) -> StaticPreemptAllocator:
    from dynamig.geometry.catalog import load_catalog
    from dynamig.geometry.model import PlacedInstance

    model = load_catalog().model("A100-80GB")
    placed = tuple(PlacedInstance(s, model.profile(p).name) for p, s in layout)
    return StaticPreemptAllocator(Cluster(spec), [placed], "sevens")


def started_at(result: RunResult, cls: str) -> float:
    return result.by_priority[cls]["p50_s"]


def squatter_and_server(server_at: float) -> Trace:
    """A best-effort job holding the whole GPU (7g.80gb, runs past the horizon) from 0, and a serving
    pod (LS) asking for a 1g.10gb at ``server_at`` for 100 s."""
    jobs = (
        Job("train", 0.0, None, ("7g.80gb",), priority=BE),
        Job("serve", server_at, 100.0, ("1g.10gb",), priority=LS),
    )
    return Trace("squat", ONE_GPU, jobs, horizon=4000.0)


# -- where priorities come from ---------------------------------------------------------------------------
def test_openb_qos_maps_to_priority_classes_and_unknown_is_best_effort() -> None:
    assert qos_priority("LS") == qos_priority("Guaranteed") == LS
    assert qos_priority("Burstable") == CLASSES["Burstable"]
    assert qos_priority("BE") == qos_priority("") == qos_priority("whatever") == BE
    assert [class_of(p) for p in (1000, 999, 500, 1, 0, -5)] == [
        "LS",
        "Burstable",
        "Burstable",
        "BE",
        "BE",
        "BE",
    ]


def test_synthetic_class_priority_defaults_by_kind_and_rejects_unknown_names() -> None:
    assert kind_priority("inference") == LS
    assert kind_priority("training") == kind_priority("batch") == BE
    assert kind_priority("training", "Burstable") == CLASSES["Burstable"]
    with pytest.raises(ValueError, match="priority must be one of"):
        kind_priority("inference", "urgent")


# -- the ledger --------------------------------------------------------------------------------------------
def test_settings_refuse_equal_priorities_evicting_and_negative_knobs() -> None:
    with pytest.raises(ValueError, match="gap must be at least 1"):
        PreemptSettings(gap=0)
    with pytest.raises(ValueError, match="min_run_s must not be negative"):
        PreemptSettings(min_run_s=-1)
    with pytest.raises(ValueError, match="retry_s must be positive"):
        PreemptSettings(retry_s=0)


def test_ledger_rate_limit_refills_at_its_rate_and_cooldown_and_spare_expire() -> None:
    ledger = EvictionLedger(PreemptSettings(rate_per_h=60.0, burst=2.0, gpu_cooldown_s=300.0, spare_s=3600.0))
    assert ledger.tokens(0.0) == 2.0  # a full bucket after a quiet spell
    ledger.record(gpu=3, victims=["a", "b"], now=0.0)
    assert ledger.tokens(0.0) == 0.0
    assert ledger.next_token_at(0.0) == pytest.approx(60.0)  # 60 per hour: one a minute
    assert ledger.tokens(90.0) == pytest.approx(1.5)
    assert ledger.tokens(10_000.0) == 2.0  # never above the burst
    assert not ledger.gpu_ready(3, 299.0) and ledger.gpu_ready(3, 300.0) and ledger.gpu_ready(4, 0.0)
    assert not ledger.spared("a", 10.0)  # evicted once: still a victim
    ledger.record(gpu=4, victims=["a"], now=1000.0)
    assert ledger.spared("a", 3599.0)  # twice within the hour: spared
    assert not ledger.spared("a", 3600.0) and not ledger.spared("c", 0.0)  # the older one is an hour old
    assert EvictionLedger(PreemptSettings(rate_per_h=0.0)).next_token_at(0.0) is None  # no evictions at all


def test_ping_pong_counts_a_victim_that_evicts_its_evictor() -> None:
    pp = PingPong()
    pp.evicted("low", by="high")
    pp.evicted("other", by="high")
    assert pp.count == 0
    pp.evicted("high", by="low")
    assert pp.count == 1


# -- the policies -----------------------------------------------------------------------------------------
def test_without_preemption_a_serving_pod_waits_behind_a_best_effort_job_holding_the_gpu() -> None:
    result = simulate(squatter_and_server(1000.0), dynamig(ONE_GPU), CFG)
    assert result.evictions == 0
    assert result.by_priority["LS"]["started"] == 0  # waits until the horizon
    assert started_at(result, "LS") == pytest.approx(3000.0)


def test_dynamig_preempt_evicts_the_best_effort_job_recuts_and_the_victim_restarts_after() -> None:
    settings = PreemptSettings(min_run_s=600.0)
    result = simulate(squatter_and_server(1000.0), dynamig(ONE_GPU, settings), CFG)
    assert (result.evictions, result.evicted_jobs, result.thrash) == (1, 1, 0)
    # the 7g.80gb ran on one whole GPU from its first start (its wait: a cut, then a PreBind check) to 1000 s
    assert result.evicted_work_gpu_s == pytest.approx(1000.0 - started_at(result, "BE"))
    assert result.by_priority["LS"]["started"] == 1
    # evicted on arrival, the GPU re-cut (6 s), bound at the first PreBind check after it (0, 5, 10 s)
    assert started_at(result, "LS") == pytest.approx(10.0)
    # the victim queues again and takes the GPU back once the serving pod has left (its first start counts)
    assert result.by_priority["BE"]["started"] == 1 and result.reshapes >= 2


def test_dynamig_preempt_spares_a_victim_that_has_run_less_than_the_minimum() -> None:
    settings = PreemptSettings(min_run_s=600.0, retry_s=60.0)
    result = simulate(squatter_and_server(100.0), dynamig(ONE_GPU, settings), CFG)
    assert result.evictions == 1
    # the victim began at 10 s, a victim from 610 s; asked again every 60 s from 100 s, it is evicted at
    # 640 s, and the preemptor binds at the first PreBind check after the 6 s cut: 650 s, 550 s after arrival
    assert started_at(result, "LS") == pytest.approx(550.0)


def test_dynamig_preempt_never_evicts_an_equal_priority_job() -> None:
    trace = squatter_and_server(1000.0)
    same = dataclasses.replace(trace, jobs=tuple(dataclasses.replace(j, priority=BE) for j in trace.jobs))
    result = simulate(same, dynamig(ONE_GPU, PreemptSettings(min_run_s=0.0)), CFG)
    assert result.evictions == 0 and result.by_priority["BE"]["started"] == 1


def test_dynamig_preempt_with_a_zero_rate_evicts_nothing() -> None:
    result = simulate(squatter_and_server(1000.0), dynamig(ONE_GPU, PreemptSettings(rate_per_h=0.0)), CFG)
    assert result.evictions == 0 and result.by_priority["LS"]["started"] == 0


def test_static_preempt_evicts_the_latest_started_lowest_priority_holder_of_a_profile_it_accepts() -> None:
    sevens = [("1g.10gb", s) for s in range(7)]
    jobs = [Job(f"be{i}", float(i), None, ("1g.10gb",), priority=BE) for i in range(7)]
    jobs.append(Job("serve", 50.0, 100.0, ("1g.10gb",), priority=LS))
    alloc = static_preempt(ONE_GPU, sevens)
    result = simulate(Trace("sevens", ONE_GPU, tuple(jobs), horizon=1000.0), alloc, CFG)
    assert result.evictions == 1 and result.by_priority["LS"]["started"] == 1
    assert started_at(result, "LS") == pytest.approx(0.0)  # no minimum run, no cut: the slice is there
    assert result.evicted_work_gpu_s == pytest.approx(44.0 / 7.0)  # be6 began at 6 s: 44 s on 1/7 GPU


def test_policies_that_do_not_preempt_ignore_priorities() -> None:
    """Arrival order, not priority, for every policy that does not evict: the same trace with all
    priorities zeroed gives the same run."""
    jobs = [Job(f"j{i}", float(i), 300.0, ("3g.40gb",), priority=LS if i % 2 else BE) for i in range(12)]
    spec = uniform_cluster(1, 2, "A100-80GB")
    trace = Trace("mixed", spec, tuple(jobs), horizon=3000.0)
    flat = dataclasses.replace(trace, jobs=tuple(dataclasses.replace(j, priority=BE) for j in jobs))
    a, b = simulate(trace, dynamig(spec), CFG), simulate(flat, dynamig(spec), CFG)
    assert (a.wait_mean_s, a.served_slice_h, a.reshapes) == (b.wait_mean_s, b.served_slice_h, b.reshapes)


def test_ledger_never_asks_again_at_the_same_instant_for_a_rounding_hair() -> None:
    """A bucket refilled in small steps can end a hair below a whole token: that counts as the token, and a
    bucket truly short names a time at least a second ahead (a retry at the same instant would loop)."""
    ledger = EvictionLedger(PreemptSettings(rate_per_h=3600.0, burst=1.0))  # one a second
    ledger.record(gpu=0, victims=["a"], now=0.0)
    assert ledger.next_token_at(0.0) == pytest.approx(1.0)
    assert ledger.next_token_at(0.75) == pytest.approx(1.75)  # 0.25 s short: asked again a second later
    assert not ledger.allows(0.9) and ledger.allows(1.0 - 1e-12)


def test_report_shows_priority_classes_only_where_a_policy_preempts_and_results_json_carries_them() -> None:
    from dynamig.simulate import report
    from dynamig.simulate.runner import TraceReport

    trace = squatter_and_server(1000.0)
    plain = simulate(trace, dynamig(ONE_GPU), CFG)
    preempting = simulate(trace, dynamig(ONE_GPU, PreemptSettings(min_run_s=600.0)), CFG)
    assert report.priority_rows(TraceReport(trace, [plain], 0.0, {})) is None
    rep = TraceReport(trace, [plain, preempting], 0.0, {})
    by_class = report.priority_rows(rep)
    assert by_class is not None
    header, rows = by_class
    assert [r[:2] for r in rows] == [["dynamig", "LS"], ["", "BE"], ["dynamig-preempt", "LS"], ["", "BE"]]
    assert rows[2][header.index("evictions (/h)")] == "1 (0.9)"  # one in the 4000 s horizon
    row = report.replay_row(rep, preempting)
    assert row["evictions"] == 1 and row["evicted_jobs"] == 1 and row["thrash"] == 0
    assert row["by_priority"]["LS"]["started"] == 1 and row["evicted_work_gpu_s"] > 0
