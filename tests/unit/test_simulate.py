"""Tests of ``dynamig simulate``: the engine, the policies, the trace mapping and the bound.

What runs for real: the simulator, the geometry catalog and layout checks, and the real planner
(``dynamig.planner.plan``) inside the dynamig policy. What is simulated: the GPUs themselves (the simulator's
own cluster model, virtual time) and the workloads (small synthetic traces and the Alibaba sample that the
package carries). Everything here is deterministic and takes seconds.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import pytest

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import check_layout
from dynamig.geometry.model import GpuModel, PlacedInstance, normalize_layout
from dynamig.planner import Policy
from dynamig.simulate import alibaba, synthetic
from dynamig.simulate.allocators import StaticAllocator, WholeGpuAllocator
from dynamig.simulate.booking import FirstFitAllocator
from dynamig.simulate.bounds import served_upper_bound
from dynamig.simulate.cluster import Cluster, LogEntry
from dynamig.simulate.dynamig_policy import DynamigAllocator
from dynamig.simulate.engine import SimConfig, simulate
from dynamig.simulate.runner import DynamigSettings, run_paper_protocol, run_trace
from dynamig.simulate.static_layouts import balanced, best_fit, static_candidates
from dynamig.simulate.trace import Job, Trace, alternatives_for, profile_for_share, uniform_cluster

CFG = SimConfig(window_s=2.0, reshape_latency_s=6.0, cooldown_s=60.0)


@pytest.fixture(scope="module")
def a100() -> GpuModel:
    return load_catalog().model("A100-80GB")


def small_trace(name: str, hours: float = 8.0, nodes: int = 2) -> Trace:
    """A shipped synthetic trace shrunk to ``nodes`` nodes and ``hours`` hours, rates scaled to match."""
    from importlib import resources

    import yaml

    doc = yaml.safe_load((resources.files("dynamig.simulate") / "traces" / f"{name}.yaml").read_text())
    scale = nodes / doc["cluster"]["nodes"]
    doc["cluster"]["nodes"] = nodes
    doc["horizon_h"] = hours
    for cls in doc["classes"]:
        rate = cls.get("rate_per_h")
        if isinstance(rate, (int, float)):
            cls["rate_per_h"] = rate * scale
        elif isinstance(rate, list):
            cls["rate_per_h"] = [[a, b, r * scale] for a, b, r in rate]
        if "bursts" in cls:
            cls["bursts"]["size"] = max(1, int(cls["bursts"]["size"] * scale))
    return synthetic.build_trace(doc, name)


def replay(log: Sequence[LogEntry]) -> dict[tuple[int, int, str], str]:
    """Replays an event log; asserts nothing is destroyed while held or assigned twice; returns holders."""
    alive: dict[tuple[int, int, str], str] = {}
    for e in log:
        key = (e.gpu, e.start, e.profile)
        if e.op == "create":
            assert key not in alive, f"{e}: created twice"
            alive[key] = ""
        elif e.op == "destroy":
            assert key in alive, f"{e}: destroyed but never created"
            assert alive.pop(key) == "", f"{e}: destroyed while a job held it"
        elif e.op == "assign":
            assert alive[key] == "", f"{e}: assigned while held by {alive[key]}"
            alive[key] = e.job
        elif e.op == "release":
            assert alive[key] == e.job
            alive[key] = ""
    return alive


# -- mapping of GPU shares ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("milli", "profile"),
    [
        (50, "1g.10gb"),
        (125, "1g.10gb"),
        (126, "2g.20gb"),
        (250, "2g.20gb"),
        (320, "3g.40gb"),
        (428, "3g.40gb"),
        (460, "4g.40gb"),
        (500, "4g.40gb"),
        (550, "7g.80gb"),
        (810, "7g.80gb"),
        (1000, "7g.80gb"),
    ],
)
def test_share_maps_to_smallest_profile_holding_it(a100: GpuModel, milli: int, profile: str) -> None:
    assert profile_for_share(a100, milli / 1000).name == profile


def test_alternatives_never_fall_back_to_a_whole_gpu(a100: GpuModel) -> None:
    assert alternatives_for(a100, "1g.10gb", 1) == ("1g.10gb", "2g.20gb")
    assert alternatives_for(a100, "4g.40gb", 3) == ("4g.40gb",)
    assert alternatives_for(a100, "7g.80gb", 2) == ("7g.80gb",)


def test_sample_trace_parses_with_the_stated_mapping(a100: GpuModel) -> None:
    tasks, cluster = alibaba.load_sample(a100)
    assert len(tasks) == 264  # 302 sampled rows, 38 of them CPU-only
    assert cluster.gpu_count == 498 and len(cluster.nodes) == 102
    assert {n.model for n in cluster.nodes} == {"A100-80GB"}
    assert alibaba.mapping_counts(tasks, a100) == {
        "7g.80gb": 204,
        "4g.40gb": 31,
        "3g.40gb": 14,
        "2g.20gb": 8,
        "2x7g.80gb": 1,
        "4x7g.80gb": 1,
        "8x7g.80gb": 5,
    }
    trace = alibaba.replay_trace(tasks, cluster, a100)
    by_name = {j.name: j for j in trace.jobs}
    pod = by_name["openb-pod-0027"]  # data row 27: 1 GPU, gpu_milli 320, created 9941376, deleted 9972429
    assert pod.alternatives == ("3g.40gb",) and pod.count == 1 and pod.share == pytest.approx(0.32)
    assert pod.arrival == 9941376 and pod.duration == 9972429 - 9941376
    multi = [j for j in trace.jobs if j.count > 1]
    assert all(j.alternatives == ("7g.80gb",) for j in multi)


def test_trace_reader_names_the_bad_row() -> None:
    text = "name,num_gpu,gpu_milli,creation_time,deletion_time\np0,1,abc,0,10\n"
    with pytest.raises(alibaba.TraceFormatError, match=r"x.csv:2: column 'gpu_milli'"):
        alibaba.read_tasks(io.StringIO(text), "x.csv")


def test_missing_trace_directory_is_reported(a100: GpuModel, tmp_path: Path) -> None:
    with pytest.raises(alibaba.TraceFormatError, match="not found"):
        alibaba.load(tmp_path, a100)


# -- synthetic traces ---------------------------------------------------------------------------------------
def test_synthetic_traces_are_deterministic() -> None:
    for name in synthetic.builtin_trace_names():
        a, b = synthetic.load_builtin_trace(name), synthetic.load_builtin_trace(name)
        assert a.jobs == b.jobs and len(a.jobs) > 100


def test_diurnal_trace_shifts_from_inference_to_training() -> None:
    trace = synthetic.load_builtin_trace("diurnal-shift")
    day = [j for j in trace.jobs if 8 <= (j.arrival / 3600) % 24 < 20]
    night = [j for j in trace.jobs if not 8 <= (j.arrival / 3600) % 24 < 20]
    assert {j.kind for j in day} == {"inference"} and {j.kind for j in night} == {"training"}


def test_bad_parameter_file_names_the_field() -> None:
    doc = {
        "name": "x",
        "seed": 1,
        "horizon_h": 1,
        "cluster": {"nodes": 1, "gpus_per_node": 1, "model": "A100-80GB"},
        "classes": [{"name": "c", "profile": "9g.99gb", "duration": {"dist": "fixed", "seconds": 1}}],
    }
    with pytest.raises(synthetic.TraceSpecError, match=r"no profile '9g\.99gb'"):
        synthetic.build_trace(doc)


# -- policies -----------------------------------------------------------------------------------------------
def test_whole_gpu_policy_never_splits_a_gpu(a100: GpuModel) -> None:
    trace = small_trace("heavy-tailed")
    alloc = WholeGpuAllocator(Cluster(trace.cluster, log=True))
    result = simulate(trace, alloc, CFG)
    assert result.started > 0
    log = alloc.cluster.log or []
    assert {e.profile for e in log} == {"7g.80gb"}
    assert all(len(g.instances) == 1 for g in alloc.cluster.gpus)
    # a 1g job holds a whole GPU: held slices exceed what was asked for
    assert result.held_slice_h > result.served_slice_h


def test_the_first_start_of_every_started_job_is_reported_and_makes_its_mean(a100: GpuModel) -> None:
    """``simulate(..., starts)`` gets one entry per started job, at or after its arrival, and the time to
    running the result reports is the mean over them and the never-started jobs' waits to the horizon."""
    trace = small_trace("fragmentation")
    starts: dict[str, float] = {}
    result = simulate(trace, FirstFitAllocator(Cluster(trace.cluster), CFG.reshape_latency_s), CFG, starts)
    arrived = [j for j in trace.jobs if j.arrival <= trace.horizon]
    assert len(starts) == result.started > 0
    assert all(starts[j.name] >= j.arrival for j in arrived if j.name in starts)
    waits = [starts.get(j.name, trace.horizon) - j.arrival for j in arrived]
    assert sum(waits) / len(waits) == pytest.approx(result.wait_mean_s)


def test_first_fit_only_ever_builds_valid_layouts(a100: GpuModel) -> None:
    trace = small_trace("fragmentation")
    alloc = FirstFitAllocator(Cluster(trace.cluster, log=True), CFG.reshape_latency_s)
    simulate(trace, alloc, CFG)
    log = alloc.cluster.log or []
    assert any(e.op == "create" for e in log)
    layouts: dict[int, list[PlacedInstance]] = {}
    for e in log:  # after every create, the GPU's layout is one NVML accepts
        if e.op == "create":
            layouts.setdefault(e.gpu, []).append(PlacedInstance(e.start, e.profile))
            assert check_layout(a100, normalize_layout(layouts[e.gpu])) is None
        elif e.op == "destroy":
            layouts[e.gpu].remove(PlacedInstance(e.start, e.profile))
    assert replay(log) is not None
    # first fit destroys every instance its job released
    assert sum(e.op == "destroy" for e in log) == sum(e.op == "release" for e in log)


def test_first_fit_takes_the_lowest_free_placement(a100: GpuModel) -> None:
    cluster = Cluster(uniform_cluster(1, 2, "A100-80GB"))
    alloc = FirstFitAllocator(cluster)
    jobs = [Job(f"j{i}", 0.0, None, ("3g.40gb",)) for i in range(3)]
    placed = [alloc.place(j, 0.0) for j in jobs]
    assert [(a.instances[0].gpu.pos, a.instances[0].start) for a in placed if a] == [(0, 0), (0, 4), (1, 0)]


def test_dynamig_never_destroys_a_busy_instance_and_layouts_stay_valid(a100: GpuModel) -> None:
    trace = small_trace("diurnal-shift", hours=30.0)
    alloc = DynamigAllocator(
        Cluster(trace.cluster, log=True),
        Policy(warm_pool={"1g.10gb": 2}),
        reshape_latency_s=CFG.reshape_latency_s,
        cooldown_s=CFG.cooldown_s,
    )
    result = simulate(trace, alloc, CFG)
    assert result.reshapes > 0 and result.destroyed > 0  # it did re-cut GPUs
    assert result.destroyed_busy == 0
    log = alloc.cluster.log or []
    replay(log)
    for gpu in alloc.cluster.gpus:
        assert check_layout(a100, gpu.layout()) is None


def test_dynamig_charges_the_cut_until_the_next_prebind_check() -> None:
    """A job that books a placement to be cut runs when kube-scheduler's PreBind, checking every 5 s,
    first sees the agent's answer (given after the watch delay plus the create latency)."""
    spec = uniform_cluster(1, 1, "A100-80GB")
    trace = Trace("one", spec, (Job("j", 10.0, 100.0, ("3g.40gb",)),), horizon=1000.0)
    alloc = DynamigAllocator(
        Cluster(spec), Policy(), reshape_latency_s=6.0, cooldown_s=0.0, bind_rtt_s=1.0, prebind_poll_s=5.0
    )
    result = simulate(trace, alloc, CFG)
    assert result.started == 1 and result.wait_mean_s == pytest.approx(10.0)  # answer at 7 s, seen at 10 s
    assert result.alloc_wait_mean_s == pytest.approx(0.0)  # allocated on arrival
    assert result.served_slice_h == pytest.approx(3 * 100 / 3600)


def test_static_layouts(a100: GpuModel) -> None:
    assert [i.profile for i in balanced(a100)] == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    layouts = best_fit(a100, {"1g.10gb": 14.0, "7g.80gb": 2.0}, 4)
    counts = sorted(len(lay) for lay in layouts)
    assert counts == [1, 1, 7, 7]  # two GPUs of 7 x 1g, two whole GPUs
    cands = static_candidates(a100, {"3g.40gb": 1.0}, 2)
    assert set(cands) == {"all-1g", "balanced", "all-7g", "best-fit"}
    for layouts in cands.values():
        assert all(check_layout(a100, lay) is None for lay in layouts)


def test_static_never_reshapes(a100: GpuModel) -> None:
    trace = small_trace("bursty-inference")
    alloc = StaticAllocator(Cluster(trace.cluster, log=True), (balanced(a100),), "balanced")
    simulate(trace, alloc, CFG)
    assert alloc.cluster.destroyed == 0 and alloc.reshapes == 0


@pytest.mark.parametrize("name", ["diurnal-shift", "fragmentation"])
def test_upper_bound_is_at_least_every_policy(name: str) -> None:
    trace = small_trace(name, hours=12.0)
    report = run_trace(trace, CFG, DynamigSettings())
    assert {r.policy for r in report.results} >= {"whole-gpu", "first-fit", "dynamig", "static:best-fit"}
    for r in report.results:
        assert r.served_slice_h <= report.upper_bound_slice_h + 1e-6, r.policy
        assert r.served_slice_h <= r.offered_slice_h + 1e-6
        assert r.destroyed_busy == 0
    assert report.upper_bound_slice_h <= report.results[0].capacity_slice_h + 1e-6


def test_upper_bound_is_exact_when_capacity_binds() -> None:
    spec = uniform_cluster(1, 1, "A100-80GB")  # 7 slices
    jobs = tuple(Job(f"j{i}", 0.0, 3600.0, ("7g.80gb",)) for i in range(3))
    trace = Trace("t", spec, jobs, horizon=3600.0)
    assert served_upper_bound(trace, {"7g.80gb": 7}, 7) == pytest.approx(7.0)


def test_simulation_is_deterministic() -> None:
    trace = small_trace("heavy-tailed")
    a = run_trace(trace, CFG, DynamigSettings(), ("first-fit", "dynamig"))
    b = run_trace(trace, CFG, DynamigSettings(), ("first-fit", "dynamig"))
    key = [(r.policy, r.served_slice_h, r.wait_mean_s, r.reshapes, r.destroyed) for r in a.results]
    assert key == [(r.policy, r.served_slice_h, r.wait_mean_s, r.reshapes, r.destroyed) for r in b.results]


def test_paper_protocol_on_the_sample(a100: GpuModel) -> None:
    tasks, spec = alibaba.load_sample(a100)
    jobs = alibaba.sampled_tasks(tasks, a100, spec.gpu_count, 1.3, seed=0)
    arrived = sum(j.count * j.share for j in jobs)
    assert 1.3 * spec.gpu_count <= arrived < 1.3 * spec.gpu_count + 8
    runs = {r.policy: r for r in run_paper_protocol(jobs, spec, 0, CFG, DynamigSettings())}
    for r in runs.values():
        assert 0.0 <= r.rate_100 <= r.rate_130 <= 1.0
        assert 0.0 <= r.held_130 <= 1.0
    # every fractional task holds a whole GPU, so no-MIG allocates less of the requested share
    assert runs["whole-gpu"].rate_130 < runs["first-fit"].rate_130
    assert {"nvidia-dynamic-mig", "hami-reserve", "dynamig"} <= set(runs)


def test_command_prints_tables_and_writes_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dynamig.cli import main

    params = tmp_path / "tiny.yaml"
    params.write_text(
        "name: tiny\nseed: 3\nhorizon_h: 4\ncluster: {nodes: 1, gpus_per_node: 4, model: A100-80GB}\n"
        "classes:\n- name: small\n  profile: 1g.10gb\n  fallbacks: 1\n  rate_per_h: 40\n"
        "  duration: {dist: exponential, mean_s: 1800}\n"
        "- name: big\n  profile: 7g.80gb\n  rate_per_h: 1\n  duration: {dist: fixed, seconds: 3600}\n"
    )
    out = tmp_path / "out"
    rc = main(
        [
            "simulate",
            "--traces",
            str(params),
            "--alibaba-sample",
            "--seeds",
            "1",
            "--replay-node-stride",
            "5",
            "--loads",
            "0.8,1.2",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert (
        "== tiny [pack node order, create 6s]:" in text
        and "upper bound (slice arithmetic)" in text
        and "paper protocol" in text
    )
    assert "(0.125, 0.250] -> 2g.20gb" in text
    plots = ("served.png", "timeline-tiny.png", "paper-allocation.png", "load.png")  # load: --loads given
    for name in ("results.json", "tables.md", *plots):
        assert (out / name).stat().st_size > 0, name
    assert (out / "served.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_rejects_an_unknown_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dynamig.cli import main

    assert main(["simulate", "--traces", "no-such-trace", "--out", str(tmp_path), "--quiet"]) == 2
    assert "no built-in trace 'no-such-trace'" in capsys.readouterr().err


def test_simulator_imports_nothing_from_kubernetes_nvml_or_asyncio() -> None:
    import subprocess
    import sys

    code = (
        "import sys, dynamig.simulate.runner, dynamig.simulate.report, dynamig.cli.simulate\n"
        "bad = [m for m in ('kubernetes_asyncio', 'kopf', 'asyncio', 'pynvml', 'grpc', 'matplotlib') "
        "if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_command_rejects_an_unknown_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dynamig.cli import main

    assert main(["simulate", "--policies", "first-fit,magic", "--out", str(tmp_path), "--quiet"]) == 2
    assert "unknown magic" in capsys.readouterr().err
