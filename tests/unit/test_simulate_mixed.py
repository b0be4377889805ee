"""Tests of the simulator on a mixed-model cluster (A100-40GB + H100-80GB + H200-141GB nodes).

What runs for real: the simulator, the geometry catalog and layout checks, the offer ranking and the
planner inside the dynamig policy. What is simulated: the GPUs (the simulator's cluster model, virtual
time) and the workloads (small synthetic traces and the Alibaba sample the package carries). Deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import check_layout
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance
from dynamig.simulate import alibaba, synthetic
from dynamig.simulate.allocators import Allocator, StaticAllocator
from dynamig.simulate.cluster import Cluster
from dynamig.simulate.engine import SimConfig, simulate
from dynamig.simulate.runner import (
    BASE_POLICIES,
    DynamigSettings,
    allocator_factories,
    cluster_models,
    run_paper_protocol,
    run_trace,
)
from dynamig.simulate.static_layouts import average_mix, mixed_static_candidates
from dynamig.simulate.trace import (
    ClusterSpec,
    Job,
    NodeSpec,
    Trace,
    alternatives_for,
    assign_models,
    gpus_per_model,
    mixed_alternatives,
    order_models,
    parse_model_weights,
    plain_profiles,
    preferred_on,
    profile_for_share,
    uniform_cluster,
)

CFG = SimConfig(window_s=2.0, reshape_latency_s=6.0, cooldown_s=60.0, bind_rtt_s=1.0)
MIX = (("A100-40GB", 1.0), ("H100-80GB", 1.0), ("H200-141GB", 1.0))


@pytest.fixture(scope="module")
def models() -> tuple[GpuModel, ...]:
    catalog = load_catalog()
    return order_models(catalog.model(k) for k in ("H200-141GB", "A100-40GB", "H100-80GB"))


def mixed_doc(hours: float = 6.0) -> dict[str, object]:
    """Three nodes of two GPUs (one per model), every job size, fallbacks, a two-GPU class."""
    return {
        "name": "mixed-small",
        "seed": 5,
        "horizon_h": hours,
        "cluster": {"nodes": 3, "gpus_per_node": 2, "model": "A100-80GB"},
        "classes": [
            {
                "name": "small",
                "profiles": {"1g.10gb": 0.6, "2g.20gb": 0.4},
                "fallbacks": 1,
                "rate_per_h": 14,
                "duration": {"dist": "exponential", "mean_s": 1800},
                "patience_h": 0.5,
            },
            {
                "name": "medium",
                "profiles": {"3g.40gb": 0.5, "4g.40gb": 0.5},
                "rate_per_h": 4,
                "duration": {"dist": "lognormal", "median_s": 2400, "sigma": 0.5},
                "patience_h": 0.5,
            },
            {
                "name": "whole",
                "profile": "7g.80gb",
                "rate_per_h": 0.6,
                "duration": {"dist": "fixed", "seconds": 3600},
                "patience_h": 1,
            },
            {
                "name": "pair",
                "profile": "7g.80gb",
                "count": 2,
                "rate_per_h": 0.3,
                "duration": {"dist": "fixed", "seconds": 1800},
                "patience_h": 1,
            },
        ],
    }


# -- the mapping of one share to per-model alternatives ----------------------------------------------------
def test_models_are_ordered_smallest_memory_first(models: tuple[GpuModel, ...]) -> None:
    assert [m.key for m in models] == ["A100-40GB", "H100-80GB", "H200-141GB"]


def test_one_share_maps_to_each_models_profile_then_fallbacks(models: tuple[GpuModel, ...]) -> None:
    assert mixed_alternatives(models, 0.1, 0) == ("1g.5gb", "1g.10gb", "1g.18gb")
    assert mixed_alternatives(models, 0.1, 1) == (
        "1g.5gb",
        "1g.10gb",
        "1g.18gb",
        "2g.10gb",
        "2g.20gb",
        "2g.35gb",
    )
    assert mixed_alternatives(models, 0.2, 0) == ("2g.10gb", "2g.20gb", "2g.35gb")
    assert mixed_alternatives(models, 0.3, 0) == ("3g.20gb", "3g.40gb", "3g.71gb")
    assert mixed_alternatives(models, 0.5, 0) == ("4g.20gb", "4g.40gb", "4g.71gb")
    # never a fallback past 7g
    assert mixed_alternatives(models, 0.6, 2) == ("7g.40gb", "7g.80gb", "7g.141gb")
    for m in models:  # each model's own entry is its profile_for_share
        for share in (0.05, 0.125, 0.2, 0.3, 0.45, 0.5, 0.75):
            assert profile_for_share(m, share).name in mixed_alternatives(models, share, 0)
    one = models[1]
    for share in (0.1, 0.3, 0.5):  # one model: exactly the single-model alternatives
        pref = profile_for_share(one, share).name
        assert mixed_alternatives((one,), share, 1) == alternatives_for(one, pref, 1)


def test_alibaba_task_maps_to_mixed_alternatives(models: tuple[GpuModel, ...]) -> None:
    small = alibaba.Task("t", 1, 100, "BE", 0.0, 10.0)
    big = alibaba.Task("b", 2, 1000, "LS", 0.0, 10.0)
    job = alibaba.task_job(small, list(models), 0, arrival=0.0, duration=10.0)
    assert job.alternatives == ("1g.5gb", "1g.10gb", "1g.18gb") and job.share == pytest.approx(0.1)
    pair = alibaba.task_job(big, list(models), 0, arrival=0.0, duration=10.0)
    assert pair.alternatives == ("7g.40gb", "7g.80gb", "7g.141gb") and pair.count == 2
    # a single model keeps the single-model mapping
    assert alibaba.task_job(small, models[0], 1, arrival=0.0, duration=1.0).alternatives == (
        "1g.5gb",
        "2g.10gb",
    )


def test_preferred_on_each_model_ignores_the_other_models_names(models: tuple[GpuModel, ...]) -> None:
    job = Job("j", 0.0, 1.0, mixed_alternatives(models, 0.1, 1))
    # the A100-40GB has a profile named 1g.10gb (its double-memory 1g) but does not offer it as a share
    assert [preferred_on(job, m) for m in models] == ["1g.5gb", "1g.10gb", "1g.18gb"]
    assert preferred_on(Job("k", 0.0, 1.0, ("1g.18gb",)), models[0]) is None


# -- model assignment ----------------------------------------------------------------------------------------
def test_models_are_assigned_round_robin_by_weight() -> None:
    spec = uniform_cluster(6, 2, "A100-80GB")
    got = assign_models(spec, MIX)
    assert [n.model for n in got.nodes] == ["A100-40GB", "H100-80GB", "H200-141GB"] * 2
    assert [n.name for n in got.nodes] == [n.name for n in spec.nodes]
    weighted = assign_models(uniform_cluster(6, 1, "A100-80GB"), (("A100-40GB", 2.0), ("H200-141GB", 1.0)))
    assert gpus_per_model(weighted) == {"A100-40GB": 4, "H200-141GB": 2}
    assert assign_models(spec, MIX) == got  # deterministic


def test_model_weights_parse_and_reject() -> None:
    assert parse_model_weights("A100-40GB=1,H100-80GB=2.5, H200-141GB") == (
        ("A100-40GB", 1.0),
        ("H100-80GB", 2.5),
        ("H200-141GB", 1.0),
    )
    for bad in ("", "A100-40GB=x", "A100-40GB=0", "A100-40GB=1,A100-40GB=2"):
        with pytest.raises(ValueError):
            parse_model_weights(bad)


def test_synthetic_trace_on_a_mixed_cluster_keeps_its_draws() -> None:
    single = synthetic.build_trace(mixed_doc(), "m")
    mixed = synthetic.build_trace(mixed_doc(), "m", MIX)
    assert gpus_per_model(mixed.cluster) == {"A100-40GB": 2, "H100-80GB": 2, "H200-141GB": 2}
    assert [(j.name, j.arrival, j.duration, j.count) for j in single.jobs] == [
        (j.name, j.arrival, j.duration, j.count) for j in mixed.jobs
    ]
    by_name = {j.name: j for j in mixed.jobs}
    for j in single.jobs:  # the same compute size on every model, smallest memory first
        alts = by_name[j.name].alternatives
        assert {int(a.split("g.")[0]) for a in alts[:3]} == {int(j.preferred.split("g.")[0])}
        assert alts[0] in {p.name for p in plain_profiles(load_catalog().model("A100-40GB"))}


# -- every policy on a mixed cluster ------------------------------------------------------------------------
def run_logged(trace: Trace) -> list[Allocator]:
    models = cluster_models(trace.cluster)
    mixes = {m.key: average_mix(trace, m) for m in models}
    factories, _ = allocator_factories(trace.cluster, mixes, CFG, DynamigSettings(), log=True)
    out = []
    for _, make in factories:
        alloc = make()
        simulate(trace, alloc, CFG)
        out.append(alloc)
    return out


def test_every_policy_runs_and_places_only_its_models_profiles() -> None:
    trace = synthetic.build_trace(mixed_doc(), "mixed-small", MIX)
    allocs = run_logged(trace)
    names = {a.name for a in allocs}
    assert {"whole-gpu", "first-fit", "nvidia-dynamic-mig", "hami-reserve", "dynamig"} <= names
    assert {"static:all-1g", "static:balanced", "static:all-7g", "static:best-fit"} <= names
    assert any(n.startswith("pool") for n in names)
    for alloc in allocs:
        cluster = alloc.cluster
        assert cluster.destroyed_busy == 0, alloc.name
        log = cluster.log
        assert log is not None
        if alloc.name.startswith("pool"):
            continue  # no instances
        creates = [e for e in log if e.op == "create"]
        assert creates, alloc.name
        for e in creates:
            model = cluster.gpus[e.gpu].model
            assert e.profile in {p.name for p in plain_profiles(model)}, (alloc.name, model.key, e.profile)
        # replay: no instance is destroyed while a job holds it, every assign is to an instance that exists
        live: dict[tuple[int, int, str], str] = {}
        used_models: set[str] = set()
        for e in log:
            key = (e.gpu, e.start, e.profile)
            if e.op == "create":
                assert key not in live
                live[key] = ""
            elif e.op == "assign":
                assert live[key] == "", (alloc.name, e)
                live[key] = e.job
                used_models.add(cluster.gpus[e.gpu].model.key)
            elif e.op == "release":
                live[key] = ""
            elif e.op == "destroy":
                assert live.pop(key) == "", (alloc.name, e)
        if not alloc.name.startswith("static:all-"):  # (a one-size layout serves one class only)
            assert len(used_models) == 3, (alloc.name, used_models)  # the load spills onto every model


def test_served_stays_under_the_bound_on_a_mixed_cluster() -> None:
    trace = synthetic.build_trace(mixed_doc(), "mixed-small", MIX)
    rep = run_trace(trace, CFG, DynamigSettings())
    assert len(rep.results) == len(BASE_POLICIES) + 3  # four static layouts
    capacity = rep.results[0].capacity_slice_h
    assert capacity == pytest.approx(6 * 7 * trace.horizon / 3600)
    assert rep.upper_bound_slice_h <= capacity + 1e-6
    for r in rep.results:
        assert 0 < r.served_slice_h <= rep.upper_bound_slice_h + 1e-6, r.policy
        assert r.served_slice_h <= r.offered_slice_h + 1e-6
        assert r.destroyed_busy == 0
    assert set(rep.static_layouts["best-fit"]) == {"A100-40GB", "H100-80GB", "H200-141GB"}
    again = run_trace(trace, CFG, DynamigSettings(), ("first-fit", "dynamig"))
    assert [r.served_slice_h for r in again.results] == [
        r.served_slice_h for r in rep.results if r.policy in ("first-fit", "dynamig")
    ]


def test_static_layouts_are_valid_per_model() -> None:
    trace = synthetic.build_trace(mixed_doc(), "mixed-small", MIX)
    models = {m.key: m for m in cluster_models(trace.cluster)}
    mixes = {k: average_mix(trace, m) for k, m in models.items()}
    assert set(mixes["H200-141GB"]) <= {p.name for p in plain_profiles(models["H200-141GB"])}
    cands = mixed_static_candidates(models, trace.cluster, mixes)
    assert set(cands) == {"all-1g", "balanced", "all-7g", "best-fit"}
    for label, per_model in cands.items():
        assert set(per_model) == set(models), label
        for key, layouts in per_model.items():
            assert layouts, (label, key)
            for lay in layouts:
                assert check_layout(models[key], lay) is None, (label, key, lay)
                assert {i.profile for i in lay} <= {p.name for p in plain_profiles(models[key])}
    assert len(cands["best-fit"]["A100-40GB"]) == 2  # one layout per GPU of that model
    alloc = StaticAllocator(Cluster(trace.cluster, log=True), cands["all-7g"], "all-7g")
    assert sorted(i.profile for g in alloc.cluster.gpus for i in g.instances) == sorted(
        ["7g.40gb"] * 2 + ["7g.80gb"] * 2 + ["7g.141gb"] * 2
    )


def test_a_profile_name_of_another_model_does_not_match() -> None:
    # 1g.10gb is the H100's smallest profile and also the A100-40GB's double-memory 1g: the A100-40GB
    # GPU never offers it, so once the H100 is full the job waits
    spec = ClusterSpec((NodeSpec("a", 1, "A100-40GB"), NodeSpec("h", 1, "H100-80GB")))
    jobs = tuple(Job(f"j{i}", float(i), None, ("1g.10gb",)) for i in range(9))
    trace = Trace("collide", spec, jobs, horizon=100.0)
    # dynamig-warm left out: its planner pools "1g.10gb" by name, and the A100-40GB's double-memory 1g.10gb
    # is a profile that GPU really has (the simulator's jobs never prefer it on a mixed cluster)
    policies = tuple(p for p in BASE_POLICIES if p != "dynamig-warm")
    for label, make in allocator_factories(
        spec, {key: {"1g.10gb": 1.0} for key in spec.models()}, CFG, DynamigSettings(), policies, log=True
    )[0]:
        alloc = make()
        result = simulate(trace, alloc, CFG)
        expected = {"whole-gpu": 1, "static:all-1g": 7, "static:balanced": 2, "static:all-7g": 0}
        assert result.started == expected.get(label, 7), label
        for e in alloc.cluster.log or []:
            if e.op == "assign":
                assert alloc.cluster.gpus[e.gpu].model.key == "H100-80GB", label


def test_dynamig_policy_for_several_models_keeps_baselines_per_model(models: tuple[GpuModel, ...]) -> None:
    lay: Layout = (PlacedInstance(0, "7g.80gb"),)
    policy = DynamigSettings(baseline=lay).policy(models)
    assert set(policy.baseline) == {"H100-80GB"}  # only the model that has the layout's profiles
    per = {"A100-40GB": (PlacedInstance(0, "7g.40gb"),), "H200-141GB": (PlacedInstance(0, "7g.141gb"),)}
    assert set(DynamigSettings(baseline=per).policy(models).baseline) == {"A100-40GB", "H200-141GB"}
    assert DynamigSettings(baseline=lay).policy(models[1]).baseline == {"H100-80GB": lay}


def test_paper_protocol_and_replay_run_on_a_mixed_sample(models: tuple[GpuModel, ...]) -> None:
    tasks, spec = alibaba.load_sample(models[0])
    spec = assign_models(spec, MIX)
    jobs = alibaba.sampled_tasks(tasks, list(models), spec.gpu_count, 1.3, seed=0)
    runs = {r.policy: r for r in run_paper_protocol(jobs, spec, 0, CFG, DynamigSettings())}
    for r in runs.values():
        assert 0.0 <= r.rate_100 <= r.rate_130 <= 1.0
    assert runs["whole-gpu"].rate_130 < runs["first-fit"].rate_130


def test_command_runs_a_mixed_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dynamig.cli import main

    params = tmp_path / "tiny.yaml"
    params.write_text(
        "name: tiny\nseed: 3\nhorizon_h: 3\ncluster: {nodes: 3, gpus_per_node: 2, model: A100-80GB}\n"
        "classes:\n- name: small\n  profile: 1g.10gb\n  fallbacks: 1\n  rate_per_h: 30\n"
        "  duration: {dist: exponential, mean_s: 1800}\n"
    )
    out = tmp_path / "out"
    rc = main(
        [
            "simulate",
            "--traces",
            str(params),
            "--alibaba-sample",
            "--protocols",
            "replay",
            "--replay-node-stride",
            "5",
            "--loads",
            "1.0",
            "--mixed",
            "A100-40GB=1,H100-80GB=1,H200-141GB=1",
            "--no-plots",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert (
        "== tiny [pack node order, create 6s]: " in text
        and "2 x A100-40GB + 2 x H100-80GB + 2 x H200-141GB" in text
    )
    assert "Alibaba share -> H200-141GB profile" in text and "(0.125, 0.250] -> 2g.35gb" in text
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["config"]["mixed"] == {"A100-40GB": 1.0, "H100-80GB": 1.0, "H200-141GB": 1.0}
    rows = doc["online_replay"]
    assert {r["policy"] for r in rows} >= {"dynamig", "first-fit", "whole-gpu", "hami-reserve"}
    assert all(set(r["models"]) == {"A100-40GB", "H100-80GB", "H200-141GB"} for r in rows)
    assert all(r["destroyed_while_held"] == 0 for r in rows)
    assert main(["simulate", "--mixed", "A100-40GB=1,NO-SUCH=1", "--out", str(out), "--quiet"]) == 2
