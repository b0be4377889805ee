"""``dynamig simulate`` runs what its flags ask for, or refuses them before simulating anything.

Real: the command's entry point (``dynamig.cli.main``), the simulator and the Alibaba sample the package
carries; nothing is simulated beyond the simulator itself. Deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamig.cli import main
from dynamig.geometry.catalog import load_catalog
from dynamig.simulate import alibaba
from dynamig.simulate.runner import total_compute_slices

QUICK = ["--no-synthetic", "--alibaba-sample", "--seeds", "1", "--policies", "first-fit"]
QUICK += ["--node-orders", "pack", "--no-plots", "--quiet"]


@pytest.mark.parametrize(
    ("protocols", "paper", "replay"),
    [("both", True, True), ("paper", True, False), ("replay", False, True), ("replay,paper", True, True)],
)
def test_each_protocol_value_runs_what_it_names(
    protocols: str, paper: bool, replay: bool, tmp_path: Path
) -> None:
    assert main(["simulate", *QUICK, "--protocols", protocols, "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert bool(doc["paper_protocol"]) is paper
    assert bool(doc["online_replay"]) is replay


def test_an_unknown_protocol_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *QUICK, "--protocols", "all", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--protocols" in err and "paper, replay or both" in err and err.count("\n") == 1


def _nearest_stride(load: float) -> int:
    """The smallest node stride whose cluster the sample reaches ``load`` on, found here from max_load."""
    model = load_catalog().model("A100-80GB")
    tasks, spec = alibaba.load_sample(model)
    return next(
        k
        for k in range(2, len(spec.nodes))
        if load <= alibaba.max_load(tasks, model, total_compute_slices(alibaba.every_kth_node(spec, k)))
    )


def test_a_load_the_cluster_cannot_reach_is_refused_with_the_stride_that_reaches_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    rc = main(["simulate", *QUICK, "--protocols", "replay", "--loads", "0.6,1.0", "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    stride = _nearest_stride(1.0)
    assert stride > 2  # the sample's 498 GPUs are far from load 1.0: a smaller cluster is named
    assert err.count("\n") == 1 and err.startswith("dynamig simulate: --loads 1:")
    assert f"--replay-node-stride {stride} " in err
    assert not out.exists()  # refused before anything ran or was written


def test_a_load_reachable_on_the_strided_cluster_runs(tmp_path: Path) -> None:
    stride = _nearest_stride(1.0)
    args = ["--protocols", "replay", "--replay-node-stride", str(stride), "--loads", "1.0"]
    assert main(["simulate", *QUICK, *args, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["online_replay"]
    loaded = [r for r in rows if r["load"] == 1.0]
    assert loaded and all(r["reached_load"] >= 1.0 and r["served_slice_h"] > 0 for r in loaded)


def test_the_full_cluster_reaches_at_most_half_of_all_tasks_at_once() -> None:
    model = load_catalog().model("A100-80GB")
    tasks, spec = alibaba.load_sample(model)
    capacity = total_compute_slices(spec)
    top = alibaba.max_load(tasks, model, capacity)
    everything = alibaba.replay_trace(tasks, spec, model, compress=1e9).jobs  # every task at once
    slices = {p.name: p.compute_slices for p in model.profiles}
    assert top == pytest.approx(alibaba.peak_demand(everything, slices) / capacity / alibaba.LOAD_HEADROOM)
