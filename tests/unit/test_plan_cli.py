"""``dynamig plan``: scenario files in, plans out, invalid scenarios refused with one line and status 2.

Real: the CLI entry point (``dynamig.cli.main``), YAML parsing, scenario validation, the planner and the
packaged geometry catalog, run in-process; the scenario files are the ones in ``examples/scenarios`` plus
small files written to a temporary directory. Nothing is simulated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamig.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "scenarios"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    return str(path)


def test_issue_example_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "-f", str(EXAMPLES / "issue-example.yaml"), "-o", "json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert set(doc) == {"gpus", "assignments", "unsatisfied"}
    (g,) = doc["gpus"]
    assert set(g) == {"node", "index", "model", "layout", "changed", "reason"}
    assert (g["node"], g["index"], g["model"], g["changed"]) == ("node-a", 0, "A100-80GB", True)
    assert {"profile": "3g.40gb", "start": 0} in g["layout"]
    assert all(set(i) == {"profile", "start"} for i in g["layout"])
    (a,) = doc["assignments"]
    assert set(a) == {"claim", "node", "index", "profile", "start"}
    assert (a["claim"], a["profile"]) == ("infer-1", "1g.10gb")
    assert {"profile": a["profile"], "start": a["start"]} in g["layout"]
    assert doc["unsatisfied"] == []


def test_mixed_cluster_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-f", str(EXAMPLES / "mixed-cluster.yaml"))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["GPU", "MODEL", "LAYOUT", "CHANGED", "REASON"]
    assert any(line.startswith("node-b-gpu0") and "3g.40gb@0" in line and " no " in line for line in lines)
    assert any(line.startswith("unsatisfied:") for line in lines)


def test_mixed_cluster_json_keeps_busy_instances_and_budget(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-f", str(EXAMPLES / "mixed-cluster.yaml"), "-o", "json")
    doc = json.loads(out)
    assert code == 0
    gpus = {(g["node"], g["index"]): g for g in doc["gpus"]}
    assert {"profile": "4g.40gb", "start": 0} in gpus[("node-a", 0)]["layout"]
    assert gpus[("node-b", 0)]["layout"] == [
        {"profile": "3g.40gb", "start": 0},
        {"profile": "2g.20gb", "start": 4},
    ]
    assert sum(g["changed"] for g in doc["gpus"]) <= 3
    assert all(g["reason"] for g in doc["gpus"] if g["changed"])
    pair = [a for a in doc["assignments"] if a["claim"] == "infer-pair"]
    assert len(pair) == 2 and {a["node"] for a in pair} == {"node-b"}


def test_invalid_layout_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "-f", str(EXAMPLES / "invalid-overlap.yaml"))
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert "gpu node-a-gpu0" in err and "instance 1g.10gb@3" in err and "overlap" in err


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("gpus: [{node: a, index: 0, model: Z100}]", ["gpu a-gpu0", "unknown GPU model 'Z100'"]),
        (
            "gpus: [{node: a, index: 0, model: A100-80GB, instances: [{profile: 9g.1gb, start: 0}]}]",
            ["gpu a-gpu0", "instance 9g.1gb@0", "unknown-profile"],
        ),
        (
            "gpus: [{node: a, index: 0, model: A100-80GB, instances: [{profile: 3g.40gb, start: 2}]}]",
            ["gpu a-gpu0", "instance 3g.40gb@2", "disallowed-start"],
        ),
        (
            "gpus: [{node: a, index: 0, model: A100-80GB, instances: [{profile: 1g.10gb+me, start: 0},"
            " {profile: 1g.10gb+me, start: 1}]}]",
            ["gpu a-gpu0", "instance 1g.10gb+me@1", "max-instances"],
        ),
        (
            "gpus: [{node: a, index: 0, model: A100-80GB}]\nclaims: [{name: x, alternatives: [1g.5gb]}]",
            ["claim x", "1g.5gb", "unknown-profile"],
        ),
        (
            "gpus: [{node: a, index: 0, model: A100-80GB}]\npolicy: {allowedProfiles: [2g.99gb]}",
            ["allowedProfiles", "2g.99gb", "unknown-profile"],
        ),
        ("gpus: [{node: a, index: 0, model: A100-80GB, colour: red}]", ["gpus.0.colour", "Extra inputs"]),
        (
            "gpus: [{node: a, index: 0, model: A100-80GB}]\n"
            "claims: [{name: x, count: 0, alternatives: [1g.10gb]}]",
            ["claims.0.count"],
        ),
        (
            "gpus: [{node: a, index: 0, model: A100-80GB}]\n"
            "policy: {baseline: {A100-80GB: [{profile: 7g.80gb, start: 0}, {profile: 1g.10gb, start: 0}]}}",
            ["baseline A100-80GB", "overlap"],
        ),
        ("gpus: [", ["not valid YAML"]),
    ],
)
def test_invalid_scenarios_exit_2_with_one_precise_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], scenario: str, expected: list[str]
) -> None:
    code, out, err = run(capsys, "-f", write(tmp_path, scenario))
    assert code == 2 and out == ""
    assert err.count("\n") == 1, err
    for part in expected:
        assert part in err, (part, err)


def test_policy_fields_reach_the_planner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        tmp_path,
        """
gpus:
- {node: a, index: 0, model: H100-80GB}
- {node: a, index: 1, model: H100-80GB, instances: [{profile: 1g.10gb, start: 0}]}
policy:
  warmPool: {1g.10gb: 3}
  baseline: {H100-80GB: [{profile: 7g.80gb, start: 0}]}
  maxGpusReshaped: 1
  strategy: spread
""",
    )
    code, out, _ = run(capsys, "-f", path, "-o", "json")
    doc = json.loads(out)
    assert code == 0
    changed = [g for g in doc["gpus"] if g["changed"]]
    assert len(changed) == 1 and "return to baseline" in changed[0]["reason"]
