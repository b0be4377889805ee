"""Tests of the simulator's protocol fixes, load levels, peer policies and dynamig as it will run.

What runs for real: the simulator, the geometry catalog, the planner (``dynamig.planner.plan``) and the
offer ranking (``dynamig.planner.ranking.rank_offers``) inside the dynamig policy. What is simulated: the
GPUs (the simulator's cluster model, virtual time) and the workloads (tiny hand-made traces and pod
lists). Deterministic, a few seconds in all.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import GpuModel
from dynamig.planner import ClaimDemand, Policy
from dynamig.simulate import alibaba
from dynamig.simulate.allocators import Allocator, PoolAllocator, StaticAllocator, WholeGpuAllocator
from dynamig.simulate.booking import (
    NODE_ORDERS,
    FirstFitAllocator,
    HamiReserveAllocator,
    NvidiaDynamicMigAllocator,
    OfferAllocator,
)
from dynamig.simulate.cluster import Cluster
from dynamig.simulate.dynamig_policy import DynamigAllocator
from dynamig.simulate.engine import SimConfig, simulate
from dynamig.simulate.runner import DynamigSettings, allocator_factories, run_paper_protocol
from dynamig.simulate.static_layouts import whole
from dynamig.simulate.trace import ClusterSpec, Job, NodeSpec, Trace, uniform_cluster

CFG = SimConfig(window_s=2.0, reshape_latency_s=6.0, cooldown_s=60.0, bind_rtt_s=1.0)


@pytest.fixture(scope="module")
def a100() -> GpuModel:
    return load_catalog().model("A100-80GB")


def planning_dynamig(spec: ClusterSpec) -> DynamigAllocator:
    return DynamigAllocator(
        Cluster(spec, log=True), Policy(), reshape_latency_s=0.0, cooldown_s=0.0, plan_pending=True
    )


def whole_gpu_jobs() -> tuple[list[Job], Job]:
    singles = [Job(f"s{i}", 0.0, None, ("7g.80gb",)) for i in range(8)]
    return singles, Job("big", 0.0, None, ("7g.80gb",), count=8)


# -- fix 1: a planning round sees idle nodes for multi-GPU claims beside the single-GPU demand -------------
def test_round_shows_idle_nodes_for_multi_gpu_claims_beside_single_demand() -> None:
    alloc = planning_dynamig(uniform_cluster(2, 8, "A100-80GB"))
    singles, big = whole_gpu_jobs()
    claims = [ClaimDemand(j.name, j.alternatives, j.count) for j in [*singles, big]]
    gpus, _ = alloc.candidates(0.0, claims)
    assert len(gpus) == 16  # one node for the 8-GPU claim, one more for the eight single devices
    alloc.replan(0.0, [*singles, big])
    assert alloc.planned_claims == frozenset(j.name for j in [*singles, big])


# -- fix 2: the scheduler books what the round planned for each claim --------------------------------------
def test_single_gpu_jobs_do_not_take_instances_planned_for_a_multi_gpu_claim() -> None:
    alloc = planning_dynamig(uniform_cluster(2, 8, "A100-80GB"))
    singles, big = whole_gpu_jobs()
    alloc.replan(0.0, [*singles, big])
    alloc.on_ready(0.0)
    # arrival order puts the single-GPU jobs first; each takes its own planned instance
    for job in singles:
        assert alloc.place(job, 1.0) is not None
    late = Job("late", 1.0, None, ("7g.80gb",))
    assert alloc.place(late, 1.0) is None  # every instance is planned for someone
    got = alloc.place(big, 1.0)
    assert got is not None and len({i.gpu.node_pos for i in got.instances}) == 1
    assert alloc.cluster.destroyed_busy == 0


# -- fix 3: the paper protocol gives every policy one chance at arrival -------------------------------------
def test_paper_protocol_gives_dynamig_no_second_chance_or_look_ahead() -> None:
    spec = uniform_cluster(1, 1, "A100-80GB")
    # a whole-GPU task first: the seven 1g tasks after it fit nowhere; seeing them in advance (or retrying
    # them later as a batch) would let a planner prefer the seven over the one
    jobs = [
        Job("w", 0.0, None, ("7g.80gb",)),
        *(Job(f"s{i}", float(i + 1), None, ("1g.10gb",)) for i in range(7)),
    ]
    runs = {r.policy: r for r in run_paper_protocol(jobs, spec, 0, CFG, DynamigSettings())}
    assert runs["dynamig"].failed == runs["first-fit"].failed == runs["nvidia-dynamic-mig"].failed == 7
    assert runs["dynamig"].plan_calls == 0


# -- fix 4: waits count every job; starvation is reported on its own ----------------------------------------
def test_mean_and_p95_wait_count_jobs_that_never_started(a100: GpuModel) -> None:
    spec = uniform_cluster(1, 1, "A100-80GB")
    jobs = (
        Job("a", 0.0, 1000.0, ("7g.80gb",)),
        Job("b", 0.0, 1000.0, ("7g.80gb",)),  # starts when a ends: waits 1000 s
        Job("c", 100.0, 1000.0, ("7g.80gb",)),  # never starts: waits until the horizon, 1400 s
    )
    trace = Trace("waits", spec, jobs, horizon=1500.0)
    result = simulate(trace, StaticAllocator(Cluster(spec), (whole(a100),), "all-7g"), CFG)
    assert result.started == 2 and result.never_served == 1
    assert result.wait_mean_s == pytest.approx((0.0 + 1000.0 + 1400.0) / 3)
    assert result.wait_p95_s == pytest.approx(1400.0)
    assert result.started_wait_mean_s == pytest.approx(500.0)


# -- fix 5: the pod list's GPU type is honoured -------------------------------------------------------------
POD_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time\n"
)
NODES = "sn,cpu_milli,memory_mib,gpu,model\nn-t4,1,1,1,T4\nn-v100,1,1,1,V100M16\n"


def test_gpu_spec_restricts_a_task_to_nodes_of_that_type(a100: GpuModel) -> None:
    pods = POD_HEADER + "p0,1,1,1,1000,V100M16|V100M32,LS,Running,0,100\np1,1,1,1,300,,LS,Running,0,100\n"
    tasks = alibaba.read_tasks(io.StringIO(pods), "pods.csv")
    spec = alibaba.read_nodes(io.StringIO(NODES), "nodes.csv", a100.key)
    trace = alibaba.replay_trace(tasks, spec, a100)
    job = next(j for j in trace.jobs if j.name == "p0")
    assert job.gpu_types == ("V100M16", "V100M32")
    assert spec.nodes_for(job) == frozenset({"n-v100"})
    factories, _ = allocator_factories(spec, {"A100-80GB": {"7g.80gb": 1.0}}, CFG, DynamigSettings())
    for label, make in factories:
        alloc: Allocator = make()
        got = alloc.place(job, 0.0)
        if label in ("static:all-1g", "static:balanced"):
            assert got is None, label  # no whole-GPU instance anywhere
            continue
        assert got is not None and got.node == 1, label
        assert alloc.place(job, 0.0) is None, label  # the T4 node stays out of reach
    planned = planning_dynamig(spec)
    planned.replan(0.0, [job])
    assert planned.planned_claims == frozenset({"p0"})
    assert {i.gpu.node for inst in planned.cluster.gpus for i in inst.instances} == {"n-v100"}


# -- fix 6: a pod list without times runs the paper protocol; the replay names the missing columns ----------
def test_pod_list_without_times_runs_the_paper_protocol(a100: GpuModel) -> None:
    pods = "name,num_gpu,gpu_milli\np0,1,1000\np1,1,300\np2,2,1000\n"
    tasks = alibaba.read_tasks(io.StringIO(pods), "pods.csv")
    spec = uniform_cluster(2, 2, "A100-80GB")
    jobs = alibaba.sampled_tasks(tasks, a100, spec.gpu_count, 1.3, seed=0)
    runs = run_paper_protocol(jobs, spec, 0, CFG, DynamigSettings(), ("first-fit", "dynamig"))
    assert [r.policy for r in runs] == ["first-fit", "dynamig"] and all(r.tasks == len(jobs) for r in runs)
    with pytest.raises(alibaba.TraceFormatError, match="needs columns creation_time and deletion_time"):
        alibaba.replay_trace(tasks, spec, a100, source="pods.csv")


def test_command_reports_a_pod_list_without_times(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dynamig.cli import main

    (tmp_path / "pods.csv").write_text("name,num_gpu,gpu_milli\np0,1,1000\n")
    (tmp_path / "nodes.csv").write_text(NODES)
    args = ["simulate", "--no-synthetic", "--pod-list", str(tmp_path / "pods.csv")]
    args += [
        "--node-list",
        str(tmp_path / "nodes.csv"),
        "--protocols",
        "replay",
        "--out",
        str(tmp_path),
        "--quiet",
    ]
    assert main(args) == 2
    assert "creation_time and deletion_time" in capsys.readouterr().err


# -- load levels --------------------------------------------------------------------------------------------
def test_compression_brings_peak_demand_to_the_load(a100: GpuModel) -> None:
    tasks, full = alibaba.load_sample(a100)
    spec = alibaba.every_kth_node(full, 4)  # the whole sample at once would not fill all 498 GPUs
    capacity = spec.gpu_count * a100.compute_slices
    slices = {p.name: p.compute_slices for p in a100.profiles}
    for load in (0.6, 1.0, 1.5):
        f = alibaba.compression_for_load(tasks, a100, capacity, load)
        peak = alibaba.peak_demand(alibaba.replay_trace(tasks, spec, a100, compress=f).jobs, slices)
        below = alibaba.peak_demand(alibaba.replay_trace(tasks, spec, a100, compress=f / 1.01).jobs, slices)
        assert below < load * capacity <= peak, load  # the smallest compression that reaches the load


def test_loads_write_the_replay_rows(tmp_path: Path) -> None:
    from dynamig.cli import main

    out = tmp_path / "out"
    rc = main(
        [
            "simulate",
            "--no-synthetic",
            "--alibaba-sample",
            "--protocols",
            "replay",
            "--replay-node-stride",
            "5",
            "--loads",
            "0.8,1.2",
            "--policies",
            "first-fit,dynamig",
            "--node-orders",
            "pack",
            "--no-plots",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())["online_replay"]
    # as recorded on both clusters, then the two load levels on the smaller one
    assert [r["load"] for r in rows if r["policy"] == "dynamig"] == [None, None, 0.8, 1.2]
    rows = [r for r in rows if r["load"] is not None]
    keys = {"trace", "load", "policy", "served_slice_h", "offered_slice_h", "mean_wait_s", "p95_wait_s"}
    keys |= {"never_served", "destroyed", "destroyed_while_held", "served_by_size"}
    assert {(r["load"], r["policy"]) for r in rows} == {
        (load, p) for load in (0.8, 1.2) for p in ("first-fit", "dynamig")
    }
    for r in rows:
        assert keys <= set(r) and r["trace"].startswith("alibaba-openb-sample-replay-")
        assert r["node_order"] == "pack" and r["alloc_wait_mean_s"] <= r["mean_wait_s"]
        assert r["reached_load"] >= r["load"]
        assert r["destroyed_while_held"] == 0
        assert sum(r["served_by_size"].values()) == pytest.approx(r["served_slice_h"])


# -- peer policies ------------------------------------------------------------------------------------------
def test_nvidia_dynamic_mig_books_in_name_order_and_prepares_one_at_a_time() -> None:
    spec = uniform_cluster(1, 2, "A100-80GB")
    alloc = NvidiaDynamicMigAllocator(Cluster(spec, log=True), create_latency_s=6.0, bind_rtt_s=1.0)
    a = alloc.place(Job("a", 0.0, 10.0, ("1g.10gb",)), 0.0)
    b = alloc.place(Job("b", 0.0, 10.0, ("1g.10gb",)), 0.0)
    assert a is not None and b is not None
    assert [(i.gpu.index, i.start) for i in (*a.instances, *b.instances)] == [(0, 0), (0, 1)]
    assert (a.delay, b.delay) == (7.0, 13.0)  # the second prepare waits for the first
    alloc.release(Job("a", 0.0, 10.0, ("1g.10gb",)), a, 20.0)
    assert alloc.cluster.destroyed == 1  # destroyed at unprepare


def test_hami_spreads_over_the_gpus_of_a_node_in_its_fixed_start_order() -> None:
    spec = uniform_cluster(1, 2, "A100-80GB")
    alloc = HamiReserveAllocator(Cluster(spec), create_latency_s=3.0)
    got = [alloc.place(Job(n, 0.0, None, (p,)), 0.0) for n, p in (("a", "1g.10gb"), ("b", "1g.10gb"))]
    got.append(alloc.place(Job("c", 0.0, None, ("2g.20gb",)), 0.0))
    assert all(g is not None for g in got)
    placed = [(g.instances[0].gpu.index, g.instances[0].start) for g in got if g is not None]
    # GPU spread: the least-used GPU first (ties: lowest index); 1g from the highest start, 2g the lowest
    assert placed == [(0, 6), (1, 6), (0, 0)]
    assert {g.delay for g in got if g is not None} == {3.0}  # created at allocation, no binding wait


def test_every_booking_policy_follows_the_runs_node_order() -> None:
    spec = ClusterSpec((NodeSpec("a", 2, "A100-80GB"), NodeSpec("b", 2, "A100-80GB")))
    makers: tuple[type[OfferAllocator], ...] = (
        FirstFitAllocator,
        NvidiaDynamicMigAllocator,
        HamiReserveAllocator,
    )
    for make in makers:
        nodes = {}
        for order in ("pack", "spread"):
            alloc = make(Cluster(spec), 0.0, 0.0, node_order=order)
            first = alloc.place(Job("one", 0.0, None, ("3g.40gb",)), 0.0)
            second = alloc.place(Job("two", 0.0, None, ("3g.40gb",)), 0.0)
            assert first is not None and second is not None
            nodes[order] = (first.node, second.node)
        assert nodes == {"pack": (0, 0), "spread": (0, 1)}, make.name


def test_free_instances_bind_at_once_and_cuts_wait_for_prebind_at_every_latency() -> None:
    spec = uniform_cluster(1, 1, "A100-80GB")
    for latency, expected in ((1.5, 5.0), (3.0, 5.0), (6.0, 10.0), (5.0, 5.0)):
        alloc = DynamigAllocator(
            Cluster(spec), Policy(), reshape_latency_s=latency, cooldown_s=0.0, prebind_poll_s=5.0
        )
        job = Job("a", 0.0, 10.0, ("3g.40gb",))
        cut = alloc.place(job, 0.0)
        assert cut is not None and cut.delay == pytest.approx(expected)
        alloc.release(job, cut, 20.0)
        again = alloc.place(Job("b", 30.0, None, ("3g.40gb",)), 30.0)
        assert again is not None and again.instances[0] is cut.instances[0] and again.delay == 0.0
        # NVIDIA's driver: bound at once, running once its prepare created the instance; no poll
        nv = NvidiaDynamicMigAllocator(Cluster(spec), latency, 0.0)
        got = nv.place(Job("n", 0.0, None, ("3g.40gb",)), 0.0)
        assert got is not None and got.delay == pytest.approx(latency)


# -- dynamig as it will run ---------------------------------------------------------------------------------
def test_dynamig_books_in_the_agents_ranked_order() -> None:
    alloc = DynamigAllocator(
        Cluster(uniform_cluster(1, 1, "A100-80GB")), Policy(), reshape_latency_s=0.0, cooldown_s=0.0
    )
    starts = []
    for i in range(3):
        got = alloc.place(Job(f"j{i}", 0.0, None, ("1g.10gb",)), 0.0)
        assert got is not None
        starts.append(got.instances[0].start)
    assert starts == [6, 5, 4]  # rank_offers: small profiles fill from the top, the 4g at 0 stays placeable
    assert alloc.place(Job("big", 0.0, None, ("4g.40gb",)), 0.0) is not None


def test_dynamig_keeps_free_instances_and_consolidates_on_nodes_in_use() -> None:
    spec = ClusterSpec((NodeSpec("a", 2, "A100-80GB"), NodeSpec("b", 2, "A100-80GB")))
    alloc = DynamigAllocator(Cluster(spec), Policy(), reshape_latency_s=0.0, cooldown_s=0.0)
    first = Job("first", 0.0, 10.0, ("3g.40gb",))
    got = alloc.place(first, 0.0)
    assert got is not None
    alloc.release(first, got, 10.0)
    assert alloc.cluster.destroyed == 0  # kept for the next job of that shape
    again = alloc.place(Job("again", 11.0, None, ("3g.40gb",)), 11.0)
    assert again is not None and again.instances[0] is got.instances[0] and again.delay == 0.0
    other = alloc.place(Job("other", 12.0, None, ("2g.20gb",)), 12.0)
    assert other is not None and other.node == again.node  # the node in use, not the idle one


def test_dynamig_keeps_a_whole_idle_node_for_a_waiting_multi_gpu_claim() -> None:
    spec = ClusterSpec((NodeSpec("big", 8, "A100-80GB"), NodeSpec("small", 1, "A100-80GB")))
    alloc = DynamigAllocator(Cluster(spec), Policy(), reshape_latency_s=0.0, cooldown_s=0.0)
    multi = Job("multi", 0.0, None, ("7g.80gb",), count=8)
    alloc.set_pending([multi])
    one = alloc.place(Job("one", 0.0, None, ("7g.80gb",)), 0.0)
    assert one is not None and one.node == 1  # the small node, not the 8-GPU one
    # the kept node offers only 7g.80gb (its offeredProfiles): a small claim waits rather than split it
    assert alloc.place(Job("two", 0.0, None, ("1g.10gb", "2g.20gb")), 0.0) is None
    assert alloc.place(multi, 0.0) is not None


def test_a_kept_node_still_serves_a_single_claim_for_the_profile_it_offers() -> None:
    # as on a real node: no device selector can tell a request's count, so a one-GPU 7g.80gb claim may
    # take a device of the kept node, which then no longer holds the 8-GPU claim
    spec = ClusterSpec((NodeSpec("big", 8, "A100-80GB"),))
    alloc = DynamigAllocator(Cluster(spec), Policy(), reshape_latency_s=0.0, cooldown_s=0.0)
    multi = Job("multi", 0.0, None, ("7g.80gb",), count=8)
    alloc.set_pending([multi])
    assert alloc.place(Job("whole", 0.0, None, ("7g.80gb",)), 0.0) is not None
    assert alloc.place(multi, 0.0) is None


def test_node_order_pack_fills_a_node_in_use_and_spread_takes_the_least_busy() -> None:
    spec = ClusterSpec((NodeSpec("a", 2, "A100-80GB"), NodeSpec("b", 2, "A100-80GB")))
    nodes = {}
    for order in NODE_ORDERS:
        alloc = DynamigAllocator(
            Cluster(spec), Policy(), reshape_latency_s=0.0, cooldown_s=0.0, node_order=order
        )
        first = alloc.place(Job("one", 0.0, None, ("3g.40gb",)), 0.0)
        second = alloc.place(Job("two", 0.0, None, ("3g.40gb",)), 0.0)
        assert first is not None and second is not None
        nodes[order] = (first.node, second.node)
    assert nodes == {"pack": (0, 0), "spread": (0, 1), "binpack": (0, 0)}
    with pytest.raises(ValueError, match="node_order"):
        DynamigAllocator(Cluster(spec), Policy(), reshape_latency_s=0.0, cooldown_s=0.0, node_order="random")


def test_fixed_layouts_and_the_pool_follow_the_run_node_order(a100: GpuModel) -> None:
    # two 2-GPU nodes around a 1-GPU one; whole-GPU jobs. The lowest-numbered node with room would give
    # (0, 0, 1); pack takes the smallest idle node, then fills the node in use; spread the least busy one
    spec = ClusterSpec(
        (NodeSpec("a", 2, "A100-80GB"), NodeSpec("small", 1, "A100-80GB"), NodeSpec("b", 2, "A100-80GB"))
    )
    makers: dict[str, Callable[[str], Allocator]] = {
        "static": lambda order: StaticAllocator(Cluster(spec), (whole(a100),), "all-7g", order),
        "whole-gpu": lambda order: WholeGpuAllocator(Cluster(spec), order),
        "pool": lambda order: PoolAllocator(Cluster(spec), order),
    }
    for name, make in makers.items():
        nodes = {}
        for order in NODE_ORDERS:
            alloc = make(order)
            got = [alloc.place(Job(f"j{i}", 0.0, None, ("7g.80gb",)), 0.0) for i in range(3)]
            nodes[order] = tuple(-1 if a is None else a.node for a in got)
        assert nodes == {"pack": (1, 0, 0), "spread": (0, 1, 2), "binpack": (0, 0, 1)}, name
        # a released GPU is offered again, and the order follows what is held now
        alloc = make("spread")
        first = alloc.place(Job("x", 0.0, None, ("7g.80gb",)), 0.0)
        assert first is not None and first.node == 0
        alloc.release(Job("x", 0.0, None, ("7g.80gb",)), first, 1.0)
        again = alloc.place(Job("y", 1.0, None, ("7g.80gb",)), 1.0)
        assert again is not None and again.node == 0, name
    with pytest.raises(ValueError, match="node_order"):
        PoolAllocator(Cluster(spec), "random")


# -- dynamig with a warm pool sized from the trace's own history (dynamig-warm) ---------------------------
def waves_trace() -> Trace:
    """Every 10 minutes two 1g claims one second apart, each running past the horizon: every claim needs a
    new instance unless one was made ready before it arrived."""
    jobs = tuple(Job(f"w{w}-{k}", 600.0 * w + k, 10_000.0, ("1g.10gb",)) for w in range(6) for k in range(2))
    return Trace("waves", uniform_cluster(1, 3, "A100-80GB"), jobs, horizon=3_900.0)


def test_history_warm_pool_cuts_p50_wait_to_the_binding_round_trip() -> None:
    trace = waves_trace()
    dyn = DynamigSettings(warm_history_s=3600.0, warm_resize_s=300.0)
    runs = {
        label: simulate(trace, make(), CFG)
        for label, make in allocator_factories(
            trace.cluster, {}, CFG, dyn, ("first-fit", "dynamig", "dynamig-warm")
        )[0]
    }
    plain, warm, ff = runs["dynamig"], runs["dynamig-warm"], runs["first-fit"]
    assert warm.policy == "dynamig (history warm pool)"
    # plain dynamig cuts an instance for every claim: bound at the first PreBind check after the answer
    answered = CFG.bind_rtt_s + CFG.reshape_latency_s
    polled = CFG.prebind_poll_s * math.ceil(answered / CFG.prebind_poll_s)
    assert plain.wait_p50_by_profile["1g.10gb"] == pytest.approx(polled)
    assert ff.wait_p50_by_profile["1g.10gb"] >= CFG.reshape_latency_s
    # the history pool (2: two claims per refill time) is ready before each later wave arrives
    assert warm.wait_p50_by_profile["1g.10gb"] <= CFG.bind_rtt_s
    assert warm.wait_p50_s <= CFG.bind_rtt_s < plain.wait_p50_s
    share, mean = warm.warm_pool_coverage["1g.10gb"]
    assert share > 0.5 and 1.0 < mean <= 2.0
    # the first wave had no history: it waited for creates (no hindsight)
    assert warm.started == plain.started == 12
    assert warm.served_slice_h == pytest.approx(plain.served_slice_h, rel=0.01)
    assert warm.destroyed_busy == 0 and plain.destroyed_busy == 0


def test_history_warm_pool_sees_only_earlier_arrivals() -> None:
    spec = uniform_cluster(1, 2, "A100-80GB")
    alloc = DynamigAllocator(
        Cluster(spec),
        Policy(),
        reshape_latency_s=6.0,
        cooldown_s=60.0,
        bind_rtt_s=1.0,
        warm_sizing=DynamigSettings().sizing(CFG),
        resize_every_s=300.0,
    )
    first = Job("a", 100.0, 50.0, ("1g.10gb",))
    alloc.observe_arrival(first, 100.0)
    assert alloc.policy.warm_pool == {}  # sized before the claim at t joins the history
    alloc.observe_arrival(Job("b", 200.0, 50.0, ("2g.20gb",)), 200.0)
    assert alloc.policy.warm_pool == {}  # not re-sized within resize_every_s
    alloc.observe_arrival(Job("c", 400.0, 50.0, ("2g.20gb",), count=2), 400.0)
    assert alloc.policy.warm_pool == {"1g.10gb": 1, "2g.20gb": 1}
    assert alloc.wants_plan(400.0)


def test_history_warm_pool_rows_and_goal_line(tmp_path: Path) -> None:
    from dynamig.simulate import report
    from dynamig.simulate.runner import TraceReport

    trace = waves_trace()
    dyn = DynamigSettings(warm_history_s=3600.0)
    results = [
        simulate(trace, make(), CFG)
        for _, make in allocator_factories(
            trace.cluster, {}, CFG, dyn, ("first-fit", "dynamig", "dynamig-warm")
        )[0]
    ]
    rep = TraceReport(trace, results, 0.0, {})
    header, rows = report.profile_wait_rows(rep)
    assert header[1] == "1g.10gb" and [r[0] for r in rows][2] == "dynamig (history warm pool)"
    (line,) = report.warm_goals(rep)
    assert line.startswith("history warm pool 1g.10gb") and ": met" in line
    row = report.replay_row(rep, results[2])
    assert row["wait_p50_by_profile"]["1g.10gb"] <= 1.0
    assert row["warm_pool_coverage"]["1g.10gb"]["share_of_time"] > 0.5


def test_history_warm_pool_runs_in_online_replays_only() -> None:
    """The paper protocol has no clock and no departures: a pool learnt from arrivals has nothing to do."""
    spec = uniform_cluster(1, 1, "A100-80GB")
    jobs = [Job(f"s{i}", float(i), None, ("1g.10gb",)) for i in range(3)]
    runs = run_paper_protocol(jobs, spec, 0, CFG, DynamigSettings(), ("dynamig", "dynamig-warm"))
    assert [r.policy for r in runs] == ["dynamig"]


def test_command_rejects_a_bad_warm_quantile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dynamig.cli import main

    rc = main(
        ["simulate", "--traces", "fragmentation", "--warm-quantile", "1.5", "--out", str(tmp_path), "--quiet"]
    )
    assert rc == 2 and "--warm-quantile" in capsys.readouterr().err
