"""``kubectl dynamig``: its command line, and the reports it makes from API objects (no cluster here; the
live commands are tested against the control plane in tests/integration/test_kubectl_plugin_apiserver.py).

Snapshots are built from API-shaped dicts and go through the operator's own parsing and round; exported
documents are checked by the readers that consume them (``parse_scenario``, ``parse_policy`` and the
catalog check the operator applies)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamig import __version__
from dynamig.cli import render
from dynamig.cli.kubectl_plugin import build_parser
from dynamig.cli.kubectl_plugin.gather import dynamig_labelled
from dynamig.cli.kubectl_plugin.report import (
    ReportError,
    export_policy_baseline,
    export_scenario,
    off_spec,
    plan_report,
    plan_table,
    verify_report,
    verify_table,
)
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.devices import device_class
from dynamig.kube.gpupartition import parse_gpu_partition
from dynamig.kube.policy import check_spec_against_catalog, parse_policy
from dynamig.operator.kubeio import Snapshot
from dynamig.planner.scenario import parse_scenario

CATALOG = load_catalog()
NOW = 1_800_000_000.0
HALVES = [("3g.40gb", 0), ("3g.40gb", 4)]

# ------------------------------------------------------------------------------------------ command line


def test_connection_flags_go_before_or_after_the_command() -> None:
    parse = build_parser().parse_args
    before = parse(["--context", "prod", "-n", "team", "--kubeconfig", "/k", "plan"])
    assert (before.context, before.namespace, before.kubeconfig) == ("prod", "team", Path("/k"))
    after = parse(["verify", "--context", "prod", "--namespace", "team"])
    assert (after.context, after.namespace, after.kubeconfig) == ("prod", "team", None)
    # a flag given before the command is kept when the command's parser does not see it again
    mixed = parse(["--context", "prod", "export", "--as", "scenario", "-n", "team"])
    assert (mixed.context, mixed.namespace, mixed.shape) == ("prod", "team", "scenario")
    assert parse(["-A", "must-gather"]).namespace is None
    assert parse(["plan"]).namespace is None  # all namespaces unless -n


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["export"],
        ["export", "--as", "chart"],
        ["plan", "-n", "a", "-A"],
        ["verify", "-o", "wide"],
        ["nope"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kubectl dynamig") and err.count("\n") == 1 and "--help" in err


def test_installed_entry_point_prints_version_and_help() -> None:
    script = Path(sys.executable).parent / "kubectl-dynamig"
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.strip() == f"kubectl-dynamig {__version__}"
    helped = subprocess.run(
        [str(script), "must-gather", "--help"], capture_output=True, text=True, timeout=30
    )
    assert helped.returncode == 0 and "summary.txt" in helped.stdout and "``" not in helped.stdout


# ------------------------------------------------------------------------------------------ API objects


def partition(
    node: str,
    index: int,
    spec: list[tuple[str, int]],
    instances: list[tuple[str, int, str]],
    *,
    generation: int = 1,
    observed: int | None = 1,
    ready: tuple[str, str, str] | None = ("True", "LayoutApplied", "GPU matches spec.layout"),
    inventory: str | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "node": node,
        "gpuIndex": index,
        "product": "NVIDIA A100-SXM4-80GB",
        "model": "A100-80GB",
        "migMode": "Enabled",
        "phase": "Stable",
        "instances": [
            {"profile": p, "start": s, "deviceName": f"gpu{index}-{p.replace('.', '')}-s{s}", "state": st}
            for p, s, st in instances
        ],
    }
    if observed is not None:
        status["observedGeneration"] = observed
    if inventory is not None:
        status["inventory"] = inventory
    if ready is not None:
        status["conditions"] = [
            {"type": "Ready", "status": ready[0], "reason": ready[1], "message": ready[2],
             "observedGeneration": generation}
        ]  # fmt: skip
    return {
        "metadata": {"name": f"{node}-gpu{index}", "generation": generation, "labels": {}},
        "spec": {"layout": [{"profile": p, "start": s} for p, s in spec]},
        "status": status,
    }


def policy(name: str, mode: str = "Dynamic", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "generation": 1,
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {"mode": mode, "cooldownSeconds": 0, "nodeSelector": {"matchLabels": {"pool": "a"}}, **spec},
    }


def claim_and_pod(
    namespace: str, name: str, profile: str, node: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pending claim for ``profile`` and its pod, marked Unschedulable as kube-scheduler marks it."""
    expression = f'device.attributes["mig.dynamig.io"].profile == "{profile}"'
    claim = {
        "metadata": {"namespace": namespace, "name": name, "uid": f"uid-{name}", "creationTimestamp": "t"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "mig.dynamig.io", "selectors": [{"cel": {"expression": expression}}]}}]}},
    }  # fmt: skip
    pod = {
        "metadata": {"namespace": namespace, "name": name, "uid": f"pod-{name}"},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]},
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
    }  # fmt: skip
    return claim, pod


def snapshot(
    partitions: list[dict[str, Any]],
    policies: list[dict[str, Any]],
    claims_and_pods: list[tuple[dict[str, Any], dict[str, Any]]] = (),  # type: ignore[assignment]
) -> Snapshot:
    nodes = sorted({p["status"]["node"] for p in partitions})
    return Snapshot(
        policies=tuple(policies),
        partitions=tuple(partitions),
        nodes=tuple(
            {"metadata": {"name": n, "labels": {"pool": "a", "kubernetes.io/hostname": n}}} for n in nodes
        ),
        pods=tuple(p for _, p in claims_and_pods),
        claims=tuple(c for c, _ in claims_and_pods),
        device_classes=(device_class(),),
    )


# ------------------------------------------------------------------------------------------------ verify


def test_at_spec_means_generation_seen_ready_and_the_same_instances() -> None:
    free = [("3g.40gb", 0, "free"), ("3g.40gb", 4, "free")]
    assert off_spec(parse_gpu_partition(partition("n", 0, HALVES, free))) == ""
    behind = off_spec(parse_gpu_partition(partition("n", 0, HALVES, free, generation=3, observed=2)))
    assert "generation 2 of 3" in behind
    busy = partition(
        "n", 1, [("7g.80gb", 0)], [("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "free")],
        ready=("False", "InstanceBusy", "kept gpu1-3g40gb-s0"),
    )  # fmt: skip
    why = off_spec(parse_gpu_partition(busy))
    assert "missing 7g.80gb@0" in why and "not in spec 3g.40gb@0,3g.40gb@4" in why
    assert "Ready=False InstanceBusy: kept gpu1-3g40gb-s0" in why
    assert (
        off_spec(parse_gpu_partition(partition("n", 2, HALVES, [], observed=None)))
        == "no status from its agent yet"
    )
    assert "no Ready condition" in off_spec(parse_gpu_partition(partition("n", 0, HALVES, free, ready=None)))


def test_partitionable_gpus_may_hold_booked_instances_beyond_their_spec() -> None:
    booked = [("3g.40gb", 0, "free"), ("1g.10gb", 4, "allocated")]
    part = partition("n", 0, [("3g.40gb", 0)], booked, inventory="Partitionable")
    assert off_spec(parse_gpu_partition(part)) == ""
    instances = partition("n", 0, [("3g.40gb", 0)], booked)
    assert off_spec(parse_gpu_partition(instances)) == "not in spec 1g.10gb@4"


def test_verify_table_counts_what_is_off() -> None:
    rows = verify_report(
        [
            partition("n", 1, HALVES, [("3g.40gb", 0, "free")], ready=("False", "Reshaping", "creating")),
            partition("n", 0, HALVES, [("3g.40gb", 0, "free"), ("3g.40gb", 4, "free")]),
        ]
    )
    assert [r["gpu"] for r in rows] == ["n-gpu0", "n-gpu1"]
    text = verify_table(rows)
    assert text.splitlines()[1].split()[-2:] == ["at", "spec"]
    assert "missing 3g.40gb@4; Ready=False Reshaping: creating" in text.splitlines()[2]
    assert text.endswith("1 of 2 GPU(s) at spec, 1 off spec")


# -------------------------------------------------------------------------------------------------- plan


def test_plan_shows_the_recut_for_a_pending_claim_and_the_free_instance_that_goes() -> None:
    free = [("3g.40gb", 0, "free"), ("3g.40gb", 4, "free")]
    snap = snapshot(
        [partition("n", 0, HALVES, free)],
        [policy("p")],
        [claim_and_pod("team", "infer", "1g.10gb", "n"), claim_and_pod("other", "train", "1g.10gb", "n")],
    )
    report = plan_report(snap, CATALOG, NOW, namespace="team")
    (p,) = report["policies"]
    assert [c["claim"] for c in p["claims"]] == ["team/infer"]  # the other namespace is planned, not listed
    assert p["claims"][0]["reason"] == "ReshapeScheduled"
    (recut,) = p["reshapes"]
    assert recut["gpu"] == "n-gpu0" and recut["action"] == "write"
    assert sorted(recut["claims"]) == ["other/train", "team/infer"]
    kept = [i for i in ("3g.40gb@0", "3g.40gb@4") if i in recut["to"]]
    assert recut["removes"] == [i for i in ("3g.40gb@0", "3g.40gb@4") if i not in kept] != []
    text = plan_table(report)
    assert "FREE INSTANCES THAT GO" in text and "write now" in text and "ReshapeScheduled" in text


def test_plan_in_dry_run_holds_the_recut_and_says_why() -> None:
    free = [("3g.40gb", 0, "free"), ("3g.40gb", 4, "free")]
    snap = snapshot(
        [partition("n", 0, HALVES, free)], [policy("p", "DryRun")], [claim_and_pod("t", "c", "1g.10gb", "n")]
    )
    (p,) = plan_report(snap, CATALOG, NOW)["policies"]
    assert p["claims"][0]["reason"] == "WouldReshape"
    (recut,) = p["reshapes"]
    assert recut["action"] == "held" and "DryRun" in recut["held"]


def test_json_and_yaml_show_null_where_the_tables_show_a_dash() -> None:
    """What `-o json` and `-o yaml` print (dynamig.cli.render) of the same rows the tables are made of."""
    rows = verify_report(
        [
            partition("n", 0, HALVES, [("3g.40gb", 0, "free"), ("3g.40gb", 4, "free")]),
            partition("n", 1, [], []),
        ]
    )
    assert [(r["spec"], r["actual"], r["reason"]) for r in rows][1] == ("-", "-", "")
    assert verify_table(rows).splitlines()[2].split()[2:4] == ["-", "-"]
    shown = json.loads(render(rows, "json"))
    assert shown[0]["reason"] is None and shown[0]["spec"] == "3g.40gb@0,3g.40gb@4"
    assert (shown[1]["spec"], shown[1]["actual"], shown[1]["reason"]) == (None, None, None)
    free = [("3g.40gb", 0, "free"), ("3g.40gb", 4, "free")]
    snap = snapshot(
        [partition("n", 0, HALVES, free)], [policy("p")], [claim_and_pod("t", "c", "1g.10gb", "n")]
    )
    report = plan_report(snap, CATALOG, NOW)
    assert report["policies"][0]["reshapes"][0]["held"] == ""  # written now: nothing holds it
    for output in ("json", "yaml"):
        text = render(report, output)
        (recut,) = (json.loads(text) if output == "json" else yaml.safe_load(text))["policies"][0]["reshapes"]
        assert recut["action"] == "write" and recut["held"] is None, output


def test_plan_of_an_unknown_policy_is_an_error() -> None:
    with pytest.raises(ReportError, match="no GpuPartitionPolicy named q"):
        plan_report(snapshot([], [policy("p")]), CATALOG, NOW, only_policy="q")
    empty = plan_report(snapshot([], []), CATALOG, NOW)
    assert "no GpuPartitionPolicy" in plan_table(empty)


# ------------------------------------------------------------------------------------------------ export


def test_baseline_export_takes_the_most_common_layout_and_names_the_others() -> None:
    halves = [("3g.40gb", 0, "free"), ("3g.40gb", 4, "free")]
    whole = [("7g.80gb", 0, "free")]
    snap = snapshot(
        [partition("a", 0, [], whole), partition("b", 0, [], halves), partition("c", 0, [], halves)],
        [policy("p")],
    )
    doc, notes = export_policy_baseline(snap, CATALOG, NOW, "from-cluster")
    assert doc["spec"]["baseline"] == {
        "A100-80GB": [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]
    }
    assert "A100-80GB: 2 of 3 GPU(s) have 3g.40gb@0,3g.40gb@4" in notes
    assert "  a-gpu0 differs: 7g.80gb@0" in notes
    exported = parse_policy(doc)
    assert exported.name == "from-cluster" and exported.spec.mode.value == "DryRun"
    assert check_spec_against_catalog(exported.spec, CATALOG) == []


def test_scenario_export_is_what_dynamig_plan_reads() -> None:
    snap = snapshot(
        [partition("n", 0, HALVES, [("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "free")])],
        [policy("p", allowedProfiles=["1g.10gb", "3g.40gb"], warmPool={"1g.10gb": 1})],
        [claim_and_pod("t", "c", "1g.10gb", "n")],
    )
    doc = export_scenario(snap, CATALOG, NOW)
    assert doc["gpus"][0]["instances"] == [
        {"profile": "3g.40gb", "start": 0, "busy": True},
        {"profile": "3g.40gb", "start": 4},
    ]
    assert doc["claims"] == [{"name": "t/c", "count": 1, "alternatives": ["1g.10gb"], "nodes": ["n"]}]
    scenario = parse_scenario(doc, CATALOG)
    assert scenario.policy.allowed_profiles == frozenset({"1g.10gb", "3g.40gb"})
    assert scenario.policy.warm_pool == {"1g.10gb": 1}
    with pytest.raises(ReportError):
        export_scenario(snapshot([], []), CATALOG, NOW)


def test_must_gather_keeps_only_nodes_dynamig_labels() -> None:
    assert dynamig_labelled({"metadata": {"labels": {"dynamig.io/managed": "true"}}})
    assert not dynamig_labelled(
        {"metadata": {"labels": {"dynamig.iox/managed": "true", "app": "dynamig.io/"}}}
    )
    assert not dynamig_labelled({"metadata": {}})
