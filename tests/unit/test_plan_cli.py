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


def test_offers_table_ranks_free_instances_first_and_skips_busy_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "-f", str(EXAMPLES / "issue-example.yaml"), "--offers")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["NODE", "RANK", "DEVICE", "PROFILE", "START", "KIND", "DESTROYS", "COUNTERS"]
    # The free 3g.40gb@4 is offered first, as it is; everything else on the GPU must destroy it first.
    assert lines[1].split() == [
        "node-a",
        "1",
        "gpu0-3g40gb-s4",
        "3g.40gb",
        "4",
        "free",
        "-",
        "gpu0:",
        "mem-4..7",
    ]
    assert lines[2].split() == [
        "node-a",
        "2",
        "gpu0-1g10gb-s6",
        "1g.10gb",
        "6",
        "recut",
        "3g.40gb@4",
        "gpu0:",
        "mem-6",
    ]
    assert all(" recut " in line and "3g.40gb@4" in line for line in lines[2:])
    # The busy 3g.40gb@0 holds slices 0-3: nothing there is offered, and the policy allows no 4g or 7g.
    assert not any(" 0 " in line or "4g.40gb" in line or "7g.80gb" in line for line in lines[1:])


def test_offers_json_lists_each_node_in_rank_order(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-f", str(EXAMPLES / "mixed-cluster.yaml"), "--offers", "-o", "json")
    assert code == 0
    offers = json.loads(out)["offers"]
    assert set(offers[0]) == {
        "node", "rank", "device", "gpu", "profile", "start", "kind", "destroys", "counterSet", "counters",
    }  # fmt: skip
    for node in ("node-a", "node-b"):
        ranks = [o["rank"] for o in offers if o["node"] == node]
        assert ranks == list(range(1, len(ranks) + 1))
    a = [o for o in offers if o["node"] == "node-a"]
    assert [(o["device"], o["kind"]) for o in a[:3]] == [
        ("gpu0-1g10gb-s5", "free"),
        ("gpu0-1g10gb-s4", "free"),
        ("gpu1-7g80gb-s0", "free"),
    ]
    assert a[3]["device"] == "gpu0-1g10gb-s6" and a[3]["kind"] == "new"
    assert a[3]["counterSet"] == "gpu0" and a[3]["counters"] == {"mem-6": 1}
    recut = next(o for o in a if o["profile"] == "1g.20gb" and o["gpu"] == 1)
    assert recut["destroys"] == [{"profile": "7g.80gb", "start": 0}]
    # The busy 3g@0 + 2g@4 on node-b gpu0 leave only memory slices 6-7 there.
    b0 = [(o["profile"], o["start"]) for o in offers if o["node"] == "node-b" and o["gpu"] == 0]
    assert b0 == [("1g.10gb", 6), ("1g.20gb", 6)]


def test_offers_of_an_invalid_scenario_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "-f", str(EXAMPLES / "invalid-overlap.yaml"), "--offers")
    assert code == 2 and out == "" and "overlap" in err


def test_json_and_yaml_scenarios_plan_the_same(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from dynamig.cli.plan import load_document

    text = (EXAMPLES / "issue-example.yaml").read_text()
    doc = yaml.safe_load(text)
    assert load_document(text) == doc
    as_json = tmp_path / "scenario.json"
    as_json.write_text(json.dumps(doc))
    _, from_yaml, _ = run(capsys, "-f", str(EXAMPLES / "issue-example.yaml"), "-o", "json")
    code, from_json, err = run(capsys, "-f", str(as_json), "-o", "json")
    assert code == 0 and err == "" and json.loads(from_json) == json.loads(from_yaml)


def test_yaml_flow_mapping_still_parses_as_yaml() -> None:
    from dynamig.cli.plan import load_document

    assert load_document("{gpus: [], claims: []}") == {"gpus": [], "claims": []}
