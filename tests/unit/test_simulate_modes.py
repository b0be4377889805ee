"""Whole GPUs beside MIG in the simulator (dynamig.simulate.modes): the MIG mode switch model, whole-GPU
demand from the openb replay, and the key rules of whole-split, dynamig-modes and nvidia-toggle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamig.planner import Policy
from dynamig.simulate import alibaba, report
from dynamig.simulate.alibaba import Task
from dynamig.simulate.cluster import WHOLE, Cluster
from dynamig.simulate.engine import RunResult, SimConfig, simulate
from dynamig.simulate.modes import (
    DynamigModesAllocator,
    ModeSettings,
    NvidiaToggleAllocator,
    split_whole_gpus,
)
from dynamig.simulate.runner import (
    BASE_POLICIES,
    MODE_POLICIES,
    POLICIES,
    DynamigSettings,
    allocator_factories,
    run_trace,
)
from dynamig.simulate.trace import (
    WHOLE_FIRST,
    WHOLE_ONLY,
    ClusterSpec,
    Job,
    NodeSpec,
    Trace,
    job_kind,
    uniform_cluster,
)

# no PreBind poll: a cut runs once created, so every wait below is a sum of the stated latencies
CFG = SimConfig(window_s=2.0, reshape_latency_s=6.0, prebind_poll_s=0.0)
SWITCH = 10.0


def modes_alloc(
    spec: ClusterSpec, settings: ModeSettings | None = None, **kw: object
) -> DynamigModesAllocator:
    return DynamigModesAllocator(
        Cluster(spec, log=True),
        Policy(),
        reshape_latency_s=CFG.reshape_latency_s,
        cooldown_s=CFG.cooldown_s,
        prebind_poll_s=CFG.prebind_poll_s,
        window_s=CFG.window_s,
        modes=settings or ModeSettings(switch_s=SWITCH),
        **kw,  # type: ignore[arg-type]
    )


def whole(name: str, at: float, dur: float, count: int = 1, kind: str = WHOLE_ONLY) -> Job:
    return Job(name, at, dur, ("7g.80gb",), count=count, whole=kind)


def mig(name: str, at: float, dur: float, profile: str = "1g.10gb") -> Job:
    return Job(name, at, dur, (profile,))


def run(spec: ClusterSpec, jobs: list[Job], alloc: object, horizon: float = 5000.0) -> RunResult:
    trace = Trace("t", spec, tuple(sorted(jobs, key=lambda j: (j.arrival, j.name))), horizon=horizon)
    return simulate(trace, alloc, CFG)  # type: ignore[arg-type]


def wait_of(result: RunResult, kind: str) -> float:
    return result.by_kind[kind]["p50_s"]


def assert_no_switch_under_a_job(alloc: object) -> None:
    """Replay the event log: a GPU is never switched while an instance or a whole job is on it, and a whole
    job is only ever assigned a GPU with MIG mode off."""
    cluster: Cluster = alloc.cluster  # type: ignore[attr-defined]
    live: dict[int, set[tuple[str, int]]] = {}
    held: dict[int, str] = {}
    mode = {g.pos: True for g in cluster.gpus}
    for e in cluster.log or []:
        if e.op in ("mig-on", "mig-off"):
            assert not live.get(e.gpu) and not held.get(e.gpu), e
            mode[e.gpu] = e.op == "mig-on"
        elif e.op == "create":
            live.setdefault(e.gpu, set()).add((e.profile, e.start))
        elif e.op == "destroy":
            live[e.gpu].discard((e.profile, e.start))
        elif e.op == "assign" and e.profile == WHOLE:
            assert not live.get(e.gpu) and not held.get(e.gpu), e
            held[e.gpu] = e.job
        elif e.op == "release" and e.profile == WHOLE:
            held.pop(e.gpu)
    assert cluster.switched_busy == 0


# -- the model -----------------------------------------------------------------------------------------------
def test_a_switch_counts_and_flags_a_busy_gpu() -> None:
    cluster = Cluster(uniform_cluster(1, 2, "A100-80GB"), log=True)
    a, b = cluster.gpus
    cluster.set_mode(a, False, 5.0, 15.0, "j")
    assert (a.mig, a.switching, a.switches, a.mode_at, cluster.switches) == (False, True, 1, 5.0, 1)
    cluster.mode_done(a)
    cluster.assign_whole(a, "j", 16.0)
    assert a.busy_slices == 7 and cluster.busy_slices == 7
    cluster.set_mode(a, True, 17.0, 17.0)  # under a whole job: counted as a violation
    assert cluster.switched_busy == 1
    cluster.release_whole(a, 18.0)
    assert cluster.busy_slices == 0
    cluster.create(b, "1g.10gb", 0, 0.0, 0.0)
    cluster.set_mode(b, False, 19.0, 19.0)  # an instance still on it
    assert cluster.switched_busy == 2 and not b.switching
    assert [e.op for e in cluster.log or []] == [
        "mig-off",
        "assign",
        "mig-on",
        "release",
        "create",
        "mig-off",
    ]


def test_whole_demand_of_the_openb_tasks() -> None:
    task = Task("t", 1, 1000, "BE", 0.0, 10.0)
    assert alibaba.whole_demand(task) == WHOLE_FIRST
    assert alibaba.whole_demand(task, single_fallback=False) == WHOLE_ONLY
    assert alibaba.whole_demand(Task("t", 8, 1000, "BE", 0.0, 10.0)) == WHOLE_ONLY
    assert alibaba.whole_demand(Task("t", 1, 999, "BE", 0.0, 10.0)) == ""
    spec = uniform_cluster(1, 8, "A100-80GB")
    from dynamig.geometry.catalog import load_catalog

    model = load_catalog().model("A100-80GB")
    tasks = [
        Task("a", 2, 1000, "", 0.0, 10.0),
        Task("b", 1, 1000, "", 1.0, 10.0),
        Task("c", 1, 300, "", 2.0, 9.0),
    ]
    plain = alibaba.replay_trace(tasks, spec, model)
    with_whole = alibaba.replay_trace(tasks, spec, model, whole_gpu_demand=True)
    assert [j.whole for j in plain.jobs] == ["", "", ""]  # the default replay is unchanged
    assert [(j.whole, job_kind(j)) for j in with_whole.jobs] == [
        (WHOLE_ONLY, "whole-multi"),
        (WHOLE_FIRST, "whole-single"),
        ("", "mig"),
    ]
    # the same jobs otherwise: MIG alternatives, counts, times
    assert [(j.alternatives, j.count, j.arrival) for j in plain.jobs] == [
        (j.alternatives, j.count, j.arrival) for j in with_whole.jobs
    ]


# -- dynamig-modes -------------------------------------------------------------------------------------------
def test_a_whole_gpu_job_waits_for_the_round_and_the_switch() -> None:
    spec = uniform_cluster(1, 1, "A100-80GB")
    alloc = modes_alloc(spec)
    result = run(spec, [whole("w", 0.0, 100.0)], alloc)
    assert wait_of(result, "whole-single") == pytest.approx(CFG.window_s + SWITCH)  # 12 s
    assert result.mode_switches == 1 and result.started == 1
    # served as a whole GPU: 7 compute slices x 100 s, all of it with MIG mode off
    assert result.by_kind["whole-single"]["served_slice_h"] == pytest.approx(7 * 100 / 3600)
    assert result.by_kind["whole-single"]["served_whole_slice_h"] == pytest.approx(7 * 100 / 3600)
    assert_no_switch_under_a_job(alloc)


def test_a_whole_first_job_takes_the_largest_profile_and_no_switch() -> None:
    spec = uniform_cluster(1, 1, "A100-80GB")
    alloc = modes_alloc(spec)
    result = run(spec, [whole("w", 0.0, 100.0, kind=WHOLE_FIRST)], alloc)
    # MIG demand as the operator sorts it: a 7g.80gb cut, no switch
    assert wait_of(result, "whole-single") == pytest.approx(CFG.reshape_latency_s)
    assert result.mode_switches == 0


def test_no_switch_while_a_mig_job_runs_on_the_gpu() -> None:
    spec = uniform_cluster(1, 1, "A100-80GB")
    alloc = modes_alloc(spec)
    # the 1g job runs 6..106 (its cut), the whole job arrives at 1: switched at 108 (round), runs at 118
    result = run(spec, [mig("m", 0.0, 100.0), whole("w", 1.0, 50.0)], alloc)
    assert wait_of(result, "whole-single") == pytest.approx(106.0 + CFG.window_s + SWITCH - 1.0)
    assert result.mode_switches == 1 and result.switched_busy == 0
    assert result.destroyed == 1  # the kept free 1g instance, destroyed by the switch
    assert_no_switch_under_a_job(alloc)


@pytest.mark.parametrize(
    ("cooldown", "expected"), [(600.0, 602.0 + SWITCH + 6.0), (0.0, 32.0 + SWITCH + 6.0)]
)
def test_a_gpu_is_not_switched_back_within_its_cooldown(cooldown: float, expected: float) -> None:
    spec = uniform_cluster(1, 1, "A100-80GB")
    alloc = modes_alloc(spec, ModeSettings(switch_s=SWITCH, cooldown_s=cooldown))
    # w: switched off at 2, runs 12..22; m (MIG) at 30: the GPU goes back on when the cooldown allows
    result = run(spec, [whole("w", 0.0, 10.0), mig("m", 30.0, 10.0)], alloc)
    assert result.started == 2 and result.mode_switches == 2
    assert wait_of(result, "mig") == pytest.approx(expected - 30.0)
    assert_no_switch_under_a_job(alloc)


def test_floors_are_never_crossed() -> None:
    spec = uniform_cluster(1, 1, "A100-80GB")
    keep_mig = modes_alloc(spec, ModeSettings(switch_s=SWITCH, min_mig_gpus=1))
    result = run(spec, [whole("w", 0.0, 10.0)], keep_mig, horizon=1000.0)
    assert result.started == 0 and result.mode_switches == 0
    # the one GPU starts with MIG mode off; a floor of one whole GPU keeps it off for a MIG job
    keep_whole = modes_alloc(spec, ModeSettings(switch_s=SWITCH, min_whole_gpus=1), split=(1.0, "gpu"))
    result = run(spec, [mig("m", 0.0, 10.0)], keep_whole, horizon=1000.0)
    assert result.started == 0 and result.mode_switches == 0
    free = modes_alloc(spec, ModeSettings(switch_s=SWITCH), split=(1.0, "gpu"))
    result = run(spec, [mig("m", 0.0, 10.0)], free, horizon=1000.0)
    assert result.started == 1 and result.mode_switches == 1


def test_a_reset_the_policy_forbids_stops_ampere_not_hopper() -> None:
    no_reset = ModeSettings(switch_s=SWITCH, allow_reset=False)
    for model, started in (("A100-80GB", 0), ("H100-80GB", 1)):
        spec = uniform_cluster(1, 1, model)
        result = run(spec, [whole("w", 0.0, 10.0)], modes_alloc(spec, no_reset), horizon=1000.0)
        assert result.started == started, model


def test_a_multi_gpu_claim_gets_the_node_that_completes_it_with_fewest_switches() -> None:
    # node a: 2 GPUs, one busy with a long MIG job; node b: 2 idle GPUs. A 2-GPU whole claim: switches on b
    spec = ClusterSpec((NodeSpec("a", 2, "A100-80GB"), NodeSpec("b", 2, "A100-80GB")))
    alloc = modes_alloc(spec, ModeSettings(switch_s=SWITCH, max_switching=2))
    result = run(spec, [mig("m", 0.0, 4000.0), whole("w", 1.0, 100.0, count=2)], alloc)
    switched = [e.gpu for e in alloc.cluster.log or [] if e.op == "mig-off"]
    assert switched == [2, 3]  # node b's GPUs
    # both in one round, as the operator switches a claim's GPUs on its node together (the budget allows
    # two at once): 3 -> 13
    assert wait_of(result, "whole-multi") == pytest.approx(CFG.window_s + SWITCH)
    assert [e.time for e in alloc.cluster.log or [] if e.op == "mig-off"] == [3.0, 3.0]
    assert_no_switch_under_a_job(alloc)


def test_a_free_whole_gpu_is_not_switched_on_while_a_whole_claim_could_take_it() -> None:
    # two nodes of one GPU, both off; node a's GPU is held by w1 until 500; a 2-GPU whole claim never fits
    # (one GPU per node) but waits; the MIG job must not get node b's free whole GPU switched on for it
    spec = ClusterSpec((NodeSpec("a", 1, "A100-80GB"), NodeSpec("b", 1, "A100-80GB")))
    alloc = modes_alloc(spec, split=(1.0, "gpu"))
    jobs = [whole("w1", 0.0, 500.0), whole("multi", 1.0, 10.0, count=2), mig("m", 2.0, 10.0)]
    result = run(spec, jobs, alloc, horizon=400.0)
    assert result.by_kind["mig"]["started"] == 0 and result.mode_switches == 0
    # without the waiting claim, node b is switched on for it
    alloc = modes_alloc(spec, split=(1.0, "gpu"))
    result = run(spec, [whole("w1", 0.0, 500.0), mig("m", 2.0, 10.0)], alloc, horizon=400.0)
    assert result.by_kind["mig"]["started"] == 1 and result.mode_switches == 1


def test_the_offer_variant_books_an_idle_mig_gpu_whole_at_once_outside_the_budget() -> None:
    spec = uniform_cluster(1, 2, "A100-80GB")
    jobs = [mig("m", 0.0, 1.0), whole("w1", 10.0, 100.0), whole("w2", 10.5, 100.0)]
    offer = modes_alloc(spec, offer_whole=True)
    result = run(spec, jobs, offer)
    # booked when they arrive: each runs once its GPU's switch is done, no round, no budget between them
    assert offer.name == "dynamig-modes-offer"
    assert wait_of(result, "whole-single") == pytest.approx(SWITCH)
    assert result.mode_switches == 2 and result.by_kind["whole-single"]["started"] == 2
    assert result.destroyed == 1  # the 1g instance m left, destroyed for the booking
    assert_no_switch_under_a_job(offer)
    # the operator's switches instead: a round after the batch window, one at a time under a budget of one
    plain = modes_alloc(spec)
    result = run(spec, jobs, plain)
    assert result.by_kind["whole-single"]["p95_s"] == pytest.approx(CFG.window_s + 2 * SWITCH + 0.5, abs=2.0)
    assert wait_of(result, "whole-single") > SWITCH


def test_the_offer_keeps_the_policy_s_limits() -> None:
    spec = uniform_cluster(1, 1, "A100-80GB")
    # no reset allowed on an Ampere GPU: not offered, and not switched either
    no_reset = modes_alloc(spec, ModeSettings(switch_s=SWITCH, allow_reset=False), offer_whole=True)
    assert run(spec, [whole("w", 0.0, 10.0)], no_reset, horizon=1000.0).started == 0
    # the floor of MIG GPUs: the one GPU stays MIG
    floor = modes_alloc(spec, ModeSettings(switch_s=SWITCH, min_mig_gpus=1), offer_whole=True)
    assert run(spec, [whole("w", 0.0, 10.0)], floor, horizon=1000.0).started == 0
    # switched on for a MIG job at 2 (cooldown 600): a whole job at 30 is offered the GPU only at 602,
    # when the operator's round switches it off (12 s after the round); with cooldown 0 it books it at once
    on = ModeSettings(switch_s=SWITCH, cooldown_s=600.0)
    cooled = modes_alloc(spec, on, offer_whole=True, split=(1.0, "gpu"))
    result = run(spec, [mig("m", 0.0, 10.0), whole("w", 30.0, 10.0)], cooled)
    assert wait_of(result, "whole-single") >= 600.0 - 30.0
    free = modes_alloc(
        spec, ModeSettings(switch_s=SWITCH, cooldown_s=0.0), offer_whole=True, split=(1.0, "gpu")
    )
    result = run(spec, [mig("m", 0.0, 10.0), whole("w", 30.0, 10.0)], free)
    assert wait_of(result, "whole-single") == pytest.approx(SWITCH)
    assert_no_switch_under_a_job(free)


def test_a_free_whole_gpu_is_switched_on_where_the_waiting_whole_claim_could_not_complete() -> None:
    # two nodes of one GPU, both off and free; a 2-GPU whole claim waits (counted on node a) and can complete
    # on neither node: node b's GPU is switched on for the MIG job (the operator's _could_host)
    spec = ClusterSpec((NodeSpec("a", 1, "A100-80GB"), NodeSpec("b", 1, "A100-80GB")))
    alloc = modes_alloc(spec, split=(1.0, "gpu"))
    jobs = [whole("multi", 1.0, 10.0, count=2), mig("m", 2.0, 10.0)]
    result = run(spec, jobs, alloc, horizon=400.0)
    assert result.by_kind["mig"]["started"] == 1 and result.mode_switches == 1
    assert [e.gpu for e in alloc.cluster.log or [] if e.op == "mig-on"] == [1]
    assert_no_switch_under_a_job(alloc)


def test_the_keep_variant_keeps_an_idle_node_and_switches_it_at_once() -> None:
    # node a full with two 7g jobs; a 2-GPU whole claim at 1, a 1g job at 1.5 that would land on node b
    spec = ClusterSpec((NodeSpec("a", 2, "A100-80GB"), NodeSpec("b", 2, "A100-80GB")))
    jobs = [
        mig("m1", 0.0, 1000.0, "7g.80gb"),
        mig("m2", 0.5, 1000.0, "7g.80gb"),
        whole("w", 1.0, 100.0, count=2),
        mig("m3", 1.5, 100.0),
    ]
    keep = modes_alloc(spec, ModeSettings(switch_s=SWITCH, max_switching=2), keep_whole=True)
    assert keep.name == "dynamig-modes-keep"
    result = run(spec, jobs, keep)
    # node b kept for w: m3 is not offered it; both its GPUs are switched in the first round (3 -> 13)
    assert wait_of(result, "whole-multi") == pytest.approx(3.0 + SWITCH - 1.0)
    assert [(e.time, e.gpu) for e in keep.cluster.log or [] if e.op == "mig-off"] == [(3.0, 2), (3.0, 3)]
    assigned = {e.job: e.gpu for e in keep.cluster.log or [] if e.op == "assign"}
    assert assigned["m3"] in (2, 3)  # on node b, once w is done and its GPU is back on (cooldown)
    assert_no_switch_under_a_job(keep)
    # the operator's rules: m3 takes a GPU of node b first, and w waits until m3 is done
    plain = modes_alloc(spec, ModeSettings(switch_s=SWITCH, max_switching=2))
    result = run(spec, jobs, plain)
    assert wait_of(result, "whole-multi") > 100.0
    assert_no_switch_under_a_job(plain)


# -- whole-split ---------------------------------------------------------------------------------------------
def test_split_shares_per_gpu_and_per_node() -> None:
    spec = ClusterSpec(
        (
            NodeSpec("a", 8, "A100-80GB"),
            NodeSpec("b", 2, "A100-80GB"),
            NodeSpec("c", 2, "A100-80GB"),
            NodeSpec("d", 1, "A100-80GB"),
        )
    )
    cluster = Cluster(spec)
    # per GPU: cumulative rounding, the lowest GPUs of each node: 4 of a, 1 of b, 1 of c, 1 of d (7 of 13)
    assert split_whole_gpus(cluster, 0.5, "gpu") == frozenset({0, 1, 2, 3, 8, 10, 12})
    # per node: half of the nodes of each size: a, b (the first of two 2-GPU nodes), d
    assert split_whole_gpus(cluster, 0.5, "node") == frozenset({*range(8), 8, 9, 12})
    assert split_whole_gpus(cluster, 0.0, "gpu") == frozenset()
    assert len(split_whole_gpus(cluster, 1.0, "node")) == 13
    with pytest.raises(ValueError):
        split_whole_gpus(cluster, 0.5, "rack")


def test_a_fixed_split_keeps_whole_and_mig_apart() -> None:
    spec = uniform_cluster(1, 2, "A100-80GB")  # GPU 0 off, GPU 1 MIG
    alloc = modes_alloc(spec, split=(0.5, "gpu"), dynamic=False)
    assert alloc.name == "whole-split:0.5"
    jobs = [
        whole("w1", 0.0, 1000.0),  # takes GPU 0 whole at once
        whole("w2", 1.0, 1000.0),  # whole only: waits, never on the MIG GPU
        whole("f", 2.0, 1000.0, kind=WHOLE_FIRST),  # falls back to 7g.80gb on GPU 1
        mig("m", 3.0, 100.0),  # GPU 1 is full, GPU 0 is whole: waits
    ]
    result = run(spec, jobs, alloc, horizon=500.0)
    assert result.mode_switches == 0
    assigned = {e.job: (e.gpu, e.profile) for e in alloc.cluster.log or [] if e.op == "assign"}
    assert assigned == {"w1": (0, WHOLE), "f": (1, "7g.80gb")}
    assert_no_switch_under_a_job(alloc)


# -- nvidia-toggle -------------------------------------------------------------------------------------------
def nvidia(spec: ClusterSpec) -> NvidiaToggleAllocator:
    return NvidiaToggleAllocator(
        Cluster(spec, log=True), CFG.reshape_latency_s, node_order="pack", switch_s=SWITCH
    )


def test_nvidia_toggles_mig_mode_per_allocation_on_hopper() -> None:
    spec = uniform_cluster(1, 1, "H100-80GB")
    alloc = nvidia(spec)
    assert not alloc.cluster.gpus[0].mig  # disabled at start: no MIG device
    # m: MIG enabled in its prepare (10 s) then created (6 s): runs at 16, ends 116, MIG disabled (10 s under
    # the node's lock); w at 120 takes the whole GPU at once (the lock is free again at 126: it waits 6 s)
    result = run(spec, [mig("m", 0.0, 100.0), whole("w", 120.0, 10.0)], alloc)
    assert wait_of(result, "mig") == pytest.approx(SWITCH + CFG.reshape_latency_s)
    assert wait_of(result, "whole-single") == pytest.approx(116.0 + SWITCH - 120.0)
    assert result.mode_switches == 2 and alloc.cluster.gpus[0].switches == 2
    assert_no_switch_under_a_job(alloc)


def test_nvidia_publishes_no_whole_gpu_on_ampere_with_mig_on() -> None:
    spec = uniform_cluster(1, 1, "A100-80GB")
    alloc = nvidia(spec)
    result = run(spec, [whole("w", 0.0, 10.0), whole("f", 1.0, 10.0, kind=WHOLE_FIRST)], alloc, horizon=500.0)
    assert result.mode_switches == 0
    assert result.by_kind["whole-single"]["started"] == 1  # f, on 7g.80gb
    assigned = [(e.job, e.profile) for e in alloc.cluster.log or [] if e.op == "assign"]
    assert assigned == [("f", "7g.80gb")]  # w never runs


def test_nvidia_whole_gpu_blocks_mig_and_mig_blocks_whole() -> None:
    spec = uniform_cluster(1, 1, "H100-80GB")
    alloc = nvidia(spec)
    result = run(spec, [whole("w", 0.0, 100.0), mig("m", 1.0, 10.0)], alloc)
    assert wait_of(result, "mig") == pytest.approx(100.0 - 1.0 + SWITCH + CFG.reshape_latency_s)
    assert_no_switch_under_a_job(alloc)


# -- the runner and the report -------------------------------------------------------------------------------
def test_mode_policies_are_listed_and_opt_in() -> None:
    assert set(MODE_POLICIES) <= set(POLICIES)
    assert not set(MODE_POLICIES) & set(BASE_POLICIES)
    spec = uniform_cluster(2, 4, "A100-80GB")
    dyn = DynamigSettings(modes=ModeSettings(split_shares=(0.25, 0.75)))
    labels = [label for label, _ in allocator_factories(spec, {}, CFG, dyn, MODE_POLICIES)[0]]
    assert labels == [
        "whole-split:0.25",
        "whole-split:0.75",
        "whole-split-nodes:0.25",
        "whole-split-nodes:0.75",
        "dynamig-modes",
        "dynamig-modes-offer",
        "dynamig-modes-keep",
        "nvidia-toggle",
    ]
    made = [make().name for _, make in allocator_factories(spec, {}, CFG, dyn, MODE_POLICIES)[0]]
    assert made == labels


def test_report_rows_goals_and_results_json(tmp_path: Path) -> None:
    spec = uniform_cluster(2, 2, "A100-80GB")
    jobs = [whole("m2", 0.0, 300.0, count=2), whole("s", 5.0, 300.0, kind=WHOLE_FIRST), mig("g", 6.0, 300.0)]
    jobs += [mig(f"x{i}", 10.0 + i, 200.0, "3g.40gb") for i in range(3)]
    trace = Trace("t", spec, tuple(jobs), horizon=2000.0)
    pols = ("dynamig", "whole-split-nodes", "dynamig-modes")
    rep = run_trace(trace, CFG, DynamigSettings(modes=ModeSettings(switch_s=SWITCH)), pols)
    base = rep.by_policy("dynamig")
    assert base is not None and set(base.by_kind) == {"whole-multi", "whole-single", "mig"}
    assert base.mode_switches == 0
    assert all(t["served_whole_slice_h"] == 0.0 for t in base.by_kind.values())  # all-MIG: nothing whole
    for r in rep.results:
        assert sum(t["served_slice_h"] for t in r.by_kind.values()) == pytest.approx(r.served_slice_h)
        assert r.switched_busy == 0 and r.destroyed_busy == 0
    rows = report.kind_rows([rep])
    assert [(row[2], row[3]) for row in rows[:4]] == [
        ("dynamig", "all"),
        ("dynamig", "whole-multi"),
        ("dynamig", "whole-single"),
        ("dynamig", "mig"),
    ]
    lines = report.mode_goals(rep)
    assert any(line.startswith("dynamig-modes / best split (whole-split-nodes:0.5)") for line in lines)
    assert any("goal <= 2" in line for line in lines)
    summary = report.mode_summary_rows([rep])
    assert [row[3] for row in summary] == ["dynamig", "whole-split-nodes:0.5 (best split)", "dynamig-modes"]
    assert summary[0][6] == "1.0000" and summary[2][-1] == f"{rep.results[-1].mode_switches_per_gpu_day:.2f}"
    report.write_json(tmp_path / "results.json", [rep], [], {})
    row = json.loads((tmp_path / "results.json").read_text())["online_replay"][-1]
    assert row["policy"] == "dynamig-modes"
    assert set(row["by_kind"]) == {"whole-multi", "whole-single", "mig"}
    assert row["mode_switches"] >= 1 and row["switched_while_busy"] == 0
    assert row["mode_switches_per_gpu_day"] == pytest.approx(row["mode_switches"] / (4 * 2000.0 / 86400.0))


def test_the_command_replays_whole_gpu_demand_and_reports_each_job_kind(tmp_path: Path) -> None:
    """``dynamig simulate --whole-gpu-demand``: the replay's rows carry per-kind figures and mode switches."""
    from dynamig.cli import main

    out = tmp_path / "out"
    argv = ["simulate", "--alibaba-sample", "--whole-gpu-demand", "--policies", "dynamig,dynamig-modes",
            "--no-synthetic", "--no-plots", "--quiet", "--seeds", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["online_replay"]
    modes = [r for r in rows if r["policy"] == "dynamig-modes"]
    assert modes and all(set(r["by_kind"]) == {"whole-multi", "whole-single", "mig"} for r in modes)
    assert all(r["switched_while_busy"] == 0 for r in modes)
    assert all(r["by_kind"]["whole-multi"]["jobs"] > 0 for r in modes)


def test_gpus_switched_for_a_multi_gpu_claim_are_kept_whole_for_it() -> None:
    # one node, gpu0 with MIG off and free, gpu1 with MIG on and idle: a 2-GPU whole claim at 1 gets gpu1
    # switched (3 -> 13) and both kept for it, as the operator's holds of kind Whole keep them; a 1-GPU whole
    # claim at 5 cannot take gpu0 meanwhile, and runs once the pair has ended (113)
    spec = ClusterSpec((NodeSpec("a", 2, "A100-80GB"),))
    alloc = modes_alloc(spec, ModeSettings(switch_s=SWITCH, max_switching=2))
    alloc.cluster.gpus[0].mig = False  # the starting mode, not a switch
    alloc._recount_all()
    result = run(spec, [whole("pair", 1.0, 100.0, count=2), whole("single", 5.0, 100.0)], alloc)
    assert wait_of(result, "whole-multi") == pytest.approx(CFG.window_s + SWITCH)
    assert wait_of(result, "whole-single") == pytest.approx(113.0 - 5.0)
    assert [e.gpu for e in alloc.cluster.log or [] if e.op == "mig-off"] == [1]
    assert alloc._whole_held == {}  # released once the pair started
    assert_no_switch_under_a_job(alloc)


def test_a_multi_gpu_claim_gets_its_node_s_gpus_switched_together_as_one_change_of_the_budget() -> None:
    # node a's one GPU runs a long 7g job; node b's two GPUs are idle. A 2-GPU whole claim at 1, a budget of
    # one: b0 and b1 are switched in the round at 3, together (the operator counts a claim's switches on a
    # node as one change: dynamig.operator.inventory.switch_changes), both kept whole for the claim, so the 1g
    # job at 5 gets no slice of either; the pair runs when they are done (3 + the switch), not one switch and
    # a batch window later (one after the other: 25)
    spec = ClusterSpec((NodeSpec("a", 1, "A100-80GB"), NodeSpec("b", 2, "A100-80GB")))
    jobs = [mig("m1", 0.0, 5000.0, "7g.80gb"), whole("w", 1.0, 100.0, count=2), mig("m3", 5.0, 100.0)]
    alloc = modes_alloc(spec, ModeSettings(switch_s=SWITCH, max_switching=1))
    result = run(spec, jobs, alloc)
    offs = [(e.time, e.gpu) for e in alloc.cluster.log or [] if e.op == "mig-off"]
    assert offs == [(3.0, 1), (3.0, 2)], offs
    assert wait_of(result, "whole-multi") == pytest.approx(3.0 + SWITCH - 1.0)
    assigned = [(e.job, e.gpu) for e in alloc.cluster.log or [] if e.op == "assign"]
    assert ("m3", 2) not in assigned[: assigned.index(("w", 1)) + 1], assigned  # not before the pair
    assert_no_switch_under_a_job(alloc)


def test_a_claim_s_switches_spend_the_budget_for_another_claim() -> None:
    # two idle nodes of two GPUs; two 2-GPU whole claims at 1 and 1.5, a budget of one: w1's two switches at 3
    # are one change, which spends the budget, so w2's wait for their end (3 + the switch) before its own
    spec = ClusterSpec((NodeSpec("a", 2, "A100-80GB"), NodeSpec("b", 2, "A100-80GB")))
    jobs = [whole("w1", 1.0, 100.0, count=2), whole("w2", 1.5, 100.0, count=2)]
    alloc = modes_alloc(spec, ModeSettings(switch_s=SWITCH, max_switching=1))
    run(spec, jobs, alloc)
    offs = [(e.time, e.gpu) for e in alloc.cluster.log or [] if e.op == "mig-off"]
    assert [t for t, _ in offs[:2]] == [3.0, 3.0], offs
    assert len(offs) == 4 and all(t >= 3.0 + SWITCH for t, _ in offs[2:]), offs
    assert_no_switch_under_a_job(alloc)


def test_an_idle_node_is_kept_for_a_multi_gpu_claim_whose_switch_waits_for_the_budget() -> None:
    # one whole GPU for x and two for w wait at the first round: node b, the smallest idle node that holds w,
    # is kept for it (both GPUs held) before the round's one switch goes to x, which gets node c's GPU; w's
    # switches wait for that budget, and the 1g job at 5 (node a is full) gets no slice of node b before w
    # runs there. Without the keep, x's switch took node b's first GPU and w waited for x to end (1024 s)
    spec = ClusterSpec(
        (NodeSpec("a", 1, "A100-80GB"), NodeSpec("b", 2, "A100-80GB"), NodeSpec("c", 1, "A100-80GB"))
    )
    jobs = [
        mig("m1", 0.0, 5000.0, "7g.80gb"),
        whole("x", 0.5, 1000.0),
        whole("w", 1.0, 100.0, count=2),
        mig("m3", 5.0, 100.0),
    ]
    alloc = modes_alloc(spec, ModeSettings(switch_s=SWITCH, max_switching=1))
    run(spec, jobs, alloc)
    assigned = [(e.job, e.gpu) for e in alloc.cluster.log or [] if e.op == "assign"]
    w_at = next(e.time for e in alloc.cluster.log or [] if e.op == "assign" and e.job == "w")
    m3 = [e for e in alloc.cluster.log or [] if e.op == "assign" and e.job == "m3"]
    assert all(e.time > w_at for e in m3), (assigned, w_at)
    assert sorted(g for j, g in assigned if j == "w") == [1, 2]
    assert_no_switch_under_a_job(alloc)
