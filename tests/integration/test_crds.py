"""The CRDs as a user meets them: ``kubectl get``, ``kubectl explain`` and refusals of invalid objects.

What runs for real: the repository's ``crds/*.yaml`` applied to the local control plane (real kube-apiserver,
OpenAPI schemas, CEL validation rules, printer columns) and the real kubectl. Nothing is simulated; the
GpuPartition status a node agent would write is patched in by the test through the status subresource.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamig.devcluster import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"


@pytest.fixture(scope="module")
def crds(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    cp = control_plane
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    cp.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/gpupartitions.dynamig.io",
        "crd/gpupartitionpolicies.dynamig.io",
    )
    yield cp


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_crds_are_structural_and_carry_descriptions() -> None:
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        assert crd["spec"]["group"] == "dynamig.io"
        for version in crd["spec"]["versions"]:
            schema = version["schema"]["openAPIV3Schema"]
            assert schema.get("description"), f"{path.name}: the kind has no description"
            assert version["subresources"] == {"status": {}}, path.name
            assert version.get("additionalPrinterColumns"), path.name
            spec = schema["properties"]["spec"]
            missing = [
                k
                for k, v in spec["properties"].items()
                if not v.get("description") and k not in ("nodeSelector", "disruptionBudget")
            ]
            assert not missing, f"{path.name}: spec fields without a description: {missing}"


def test_kubectl_get_gpupartitions_shows_node_product_layout_slices_offers_phase(crds: ControlPlane) -> None:
    cp = crds
    node = _name("gpu-node")
    name = f"{node}-gpu0"
    cp.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {
                "apiVersion": "dynamig.io/v1alpha1",
                "kind": "GpuPartition",
                "metadata": {"name": name, "labels": {"dynamig.io/node": node}},
                "spec": {"layout": [{"profile": "3g.40gb", "start": 0}, {"profile": "1g.10gb", "start": 4}]},
            }
        ),
    )
    try:
        status = {
            "status": {
                "node": node,
                "gpuIndex": 0,
                "uuid": "GPU-0000",
                "product": "NVIDIA A100-SXM4-80GB",
                "model": "A100-80GB",
                "migMode": "Enabled",
                "phase": "Stable",
                "layoutSummary": "3g.40gb@0,1g.10gb@4",
                "freeSlices": 1,
                "totalSlices": 2,
                "offeredPlacements": 3,
                "instances": [
                    {"profile": "3g.40gb", "start": 0, "deviceName": "gpu0-3g40gb-s0", "state": "allocated"},
                    {"profile": "1g.10gb", "start": 4, "deviceName": "gpu0-1g10gb-s4", "state": "free"},
                ],
                "lastReshapeTime": "2026-01-01T00:00:00Z",
                "wholeOffered": True,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "LayoutApplied",
                        "message": "GPU matches spec.layout",
                        "lastTransitionTime": "2026-01-01T00:00:00Z",
                    }
                ],
            }
        }
        cp.kubectl(
            "patch", "gpupartition", name, "--subresource=status", "--type=merge", "-p", json.dumps(status)
        )
        out = cp.kubectl("get", "gpupartitions", name).stdout
        header, row = out.splitlines()[:2]
        # OFFERED in the default row: a Partitionable GPU may have no instance yet offer every placement.
        assert header.split() == ["NAME", "FREE", "TOTAL", "OFFERED", "READY", "REASON", "AGE"]
        assert row.split()[:6] == [name, "1", "2", "3", "True", "LayoutApplied"]
        assert max(len(line) for line in out.splitlines()) <= 80  # fits a terminal
        wide = cp.kubectl("get", "gpupartitions", name, "-o", "wide").stdout.splitlines()
        columns = [
            "MODEL",
            "NODE",
            "GPU",
            "LAYOUT",
            "PRODUCT",
            "MIG",
            "INVENTORY",
            "WHOLE OFFERED",
            "LAST RESHAPE",
            "MESSAGE",
        ]
        for column in columns:
            assert column in wide[0], column
        # The product name and the message have spaces in them, so look for the cells rather than split.
        for cell in (
            "A100-80GB",
            node,
            "3g.40gb@0,1g.10gb@4",
            "NVIDIA A100-SXM4-80GB",
            "Enabled",
            " true ",  # WHOLE OFFERED
            "GPU matches spec.layout",
        ):
            assert cell in wide[1], cell
        # Short name and category work too.
        assert name in cp.kubectl("get", "gpart").stdout
        assert name in cp.kubectl("get", "dynamig").stdout
    finally:
        cp.kubectl("delete", "gpupartition", name, "--ignore-not-found")


def explain(cp: ControlPlane, field: str) -> str:
    """``kubectl explain`` output with its line wrapping undone; retried while the API server publishes the
    new kinds' OpenAPI (a moment after the CRDs are Established)."""
    deadline = time.monotonic() + 30
    while True:
        proc = cp.kubectl("explain", field, check=False)
        if proc.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert proc.returncode == 0, proc.stderr
    return re.sub(r"\n {4}(?=\S)", " ", proc.stdout)  # join description lines wrapped by kubectl


def test_kubectl_explain_policy_spec_describes_every_knob(crds: ControlPlane) -> None:
    out = explain(crds, "gpupartitionpolicy.spec")
    assert "KIND:       GpuPartitionPolicy" in out
    assert "GROUP:      dynamig.io" in out
    for field in (
        "allowedProfiles",
        "baseline",
        "batchWindowSeconds",
        "cooldownSeconds",
        "disruptionBudget",
        "gpuProducts",
        "mode",
        "nodeSelector",
        "strategy",
        "warmPool",
    ):
        assert f"  {field}\t" in out, f"{field} missing from kubectl explain:\n{out}"
    assert "Dynamic reshapes; DryRun only reports what it would do; Static never reshapes." in out
    assert "enum: Dynamic, Static, DryRun" in out
    assert "idle GPU returns to the baseline only after being idle this long" in out


def test_kubectl_explain_gpupartition_status(crds: ControlPlane) -> None:
    out = explain(crds, "gpupartition.status.instances.state")
    assert "free = published and not allocated; allocated = a ResourceClaim allocation names it" in out
    out = explain(crds, "gpupartition.spec.layout")
    assert "each a GPU-instance profile at an explicit placement start" in out


def test_kubectl_get_policies_columns(crds: ControlPlane) -> None:
    cp = crds
    name = _name("columns")
    cp.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {
                "apiVersion": "dynamig.io/v1alpha1",
                "kind": "GpuPartitionPolicy",
                "metadata": {"name": name},
                "spec": {"mode": "DryRun", "nodeSelector": {"matchLabels": {"pool": name}}},
            }
        ),
    )
    try:
        out = cp.kubectl("get", "gpp", name).stdout
        assert out.splitlines()[0].split() == [
            "NAME",
            "MODE",
            "GPUS",
            "PENDING",
            "READY",
            "RESHAPING",
            "LAST",
            "RESHAPE",
            "AGE",
        ]
        assert "DryRun" in out.splitlines()[1]
        # Defaults filled in by the API server.
        spec = json.loads(cp.kubectl("get", "gpp", name, "-o", "json").stdout)["spec"]
        assert spec["strategy"] == "pack" and spec["cooldownSeconds"] == 300
    finally:
        cp.kubectl("delete", "gpp", name, "--ignore-not-found")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"mode": "Sometimes"}, 'spec.mode: Unsupported value: "Sometimes"'),
        (
            {"allowedProfiles": ["1g.10gb"], "warmPool": {"2g.20gb": 1}},
            "spec.warmPool names a profile that is not in spec.allowedProfiles",
        ),
        (
            {"mode": "Static", "warmPool": {"1g.10gb": 1}},
            "spec.warmPool cannot be kept by a policy in spec.mode Static",
        ),
        ({"cooldownSeconds": -5}, "spec.cooldownSeconds: Invalid value: -5"),
        ({"allowedProfiles": ["big"]}, "spec.allowedProfiles: not a MIG profile name"),
        (
            {"nodeSelector": {"matchLabels": {"gpu pool": "a"}}},
            "spec.nodeSelector.matchLabels: every key must be",
        ),
        (
            {"nodeSelector": {"matchLabels": {"pool": "a b"}}},
            "spec.nodeSelector.matchLabels.pool: Invalid value",
        ),
        (
            {"nodeSelector": {"matchExpressions": [{"key": "-pool", "operator": "Exists"}]}},
            "spec.nodeSelector.matchExpressions[0].key: Invalid value",
        ),
    ],
)
def test_invalid_policies_are_refused_with_a_message_naming_the_field(
    crds: ControlPlane, spec: dict[str, object], message: str
) -> None:
    obj = {
        "apiVersion": "dynamig.io/v1alpha1",
        "kind": "GpuPartitionPolicy",
        "metadata": {"name": _name("bad")},
        "spec": spec,
    }
    proc = crds.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_layout_with_two_instances_at_one_start_is_refused(crds: ControlPlane) -> None:
    obj = {
        "apiVersion": "dynamig.io/v1alpha1",
        "kind": "GpuPartition",
        "metadata": {"name": _name("dup")},
        "spec": {"layout": [{"profile": "1g.10gb", "start": 0}, {"profile": "2g.20gb", "start": 0}]},
    }
    proc = crds.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert proc.returncode != 0
    assert "two instances in spec.layout start at the same memory slice" in proc.stderr


@pytest.mark.parametrize(
    ("condition", "field"),
    [
        ({"type": "Ready", "reason": "layout applied"}, "reason"),  # metav1.Condition: CamelCase, no spaces
        ({"type": "Ready", "reason": ""}, "reason"),
        ({"type": "not a type!", "reason": "LayoutApplied"}, "type"),
    ],
)
def test_conditions_follow_metav1_condition_rules(
    crds: ControlPlane, condition: dict[str, str], field: str
) -> None:
    cp = crds
    node = _name("cond-node")
    name = f"{node}-gpu0"
    body = {
        "apiVersion": "dynamig.io/v1alpha1",
        "kind": "GpuPartition",
        "metadata": {"name": name, "labels": {"dynamig.io/node": node}},
        "spec": {"layout": []},
    }
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))
    try:
        good = {"status": "True", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}
        for cond, ok in (({"type": "Ready", "reason": "LayoutApplied"}, True), (condition, False)):
            patch = json.dumps({"status": {"conditions": [{**good, **cond}]}})
            got = cp.kubectl(
                "patch",
                "gpupartition",
                name,
                "--subresource=status",
                "--type=merge",
                "-p",
                patch,
                check=False,
            )
            assert (got.returncode == 0) == ok, got.stderr
            if not ok:
                assert f"status.conditions[0].{field}" in got.stderr, got.stderr
    finally:
        cp.kubectl("delete", "gpupartition", name, "--ignore-not-found")


@contextlib.contextmanager
def _bare_policy(cp: ControlPlane, prefix: str) -> Iterator[str]:
    """A policy selecting no node, deleted afterwards: its status is the operator's to write."""
    name = _name(prefix)
    body = {
        "apiVersion": "dynamig.io/v1alpha1",
        "kind": "GpuPartitionPolicy",
        "metadata": {"name": name},
        "spec": {"nodeSelector": {"matchLabels": {f"dynamig.io/{prefix}-test": name}}},
    }
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))
    try:
        yield name
    finally:
        cp.kubectl("delete", "gpupartitionpolicy", name, "--ignore-not-found")


def _patch_status_list(
    cp: ControlPlane, name: str, key: str, good: list[dict[str, Any]], bad: list[tuple[dict[str, Any], str]]
) -> dict[str, Any]:
    """Merge-patch ``status.<key>`` with ``good``, its first entry changed by each of ``bad`` (None drops a
    field): each is refused naming its field; ``good`` itself is kept. Returns the policy as stored."""
    for entry, field in [*bad, ({}, "")]:
        item = {k: v for k, v in {**good[0], **entry}.items() if v is not None}
        patch = json.dumps({"status": {key: [item, *good[1:]]}})
        got = cp.kubectl(
            "patch", "gpupartitionpolicy", name, "--subresource=status", "--type=merge", "-p", patch,
            check=False,
        )  # fmt: skip
        assert (got.returncode == 0) == (not field), got.stderr
        if field:
            assert field in got.stderr, got.stderr
    stored: dict[str, Any] = json.loads(cp.kubectl("get", "gpupartitionpolicy", name, "-o", "json").stdout)
    assert stored["status"][key] == good
    return stored


def test_policy_status_keeps_the_eviction_ledger_within_bounds(crds: ControlPlane) -> None:
    """``status.recentEvictions`` (the ledger a new operator process reads back) as the operator writes it is
    kept by the API server, field for field; a malformed time, a missing GPU or more owners than the schema
    allows is refused naming the field."""
    from dynamig.operator.holds import Ledger

    with _bare_policy(crds, "ledger") as name:
        ledger = Ledger()
        ledger.record(name, 1_800_000_000.25, "n1-gpu0", ["ReplicaSet ml/web", "Pod ml/x"])
        bad: list[tuple[dict[str, Any], str]] = [
            ({"time": "yesterday"}, "status.recentEvictions[0].time"),
            ({"gpu": None}, "status.recentEvictions[0].gpu"),
            ({"owners": ["Pod ml/x"] * 257}, "status.recentEvictions[0].owners"),
        ]
        stored = _patch_status_list(crds, name, "recentEvictions", ledger.stored(name), bad)
        back = Ledger()
        assert back.restore(name, stored["status"]["recentEvictions"]) == 1
        assert back.count(name, 1_800_000_100.0) == 2 and back.last_hold("n1-gpu0") == 1_800_000_000.25


def test_policy_status_keeps_the_drained_claims_a_new_operator_reads_back(crds: ControlPlane) -> None:
    """``status.drainedClaims`` as the operator writes it is kept by the API server and read back to the same
    claims and times; a malformed time or a missing claim is refused naming the field."""
    from dynamig.operator.policy_status import drained_claims, read_drained_claims

    with _bare_policy(crds, "drained") as name:
        good = drained_claims({"ml/train": 1_800_000_000.0, "ml/other": 1_800_000_060.0})
        bad: list[tuple[dict[str, Any], str]] = [
            ({"time": "yesterday"}, "status.drainedClaims[0].time"),
            ({"claim": None}, "status.drainedClaims[0].claim"),
        ]
        stored = _patch_status_list(crds, name, "drainedClaims", good, bad)
        assert read_drained_claims(stored["status"]["drainedClaims"]) == {
            "ml/train": 1_800_000_000.0,
            "ml/other": 1_800_000_060.0,
        }


def test_gpupartition_status_keeps_the_nvlink_facts_the_agent_writes(crds: ControlPlane) -> None:
    """The NVLink facts of a GPU (whatever its MIG mode) as the agent's merge patch writes them are kept field
    for field and read back by the operator; a patch of the same GPU once NVML no longer gives them removes
    them; a negative link count is refused naming the field."""
    from dynamig.kube.devices import NvlinkFacts
    from dynamig.kube.gpupartition import GpuPartitionStatus, parse_gpu_partition

    cp = crds
    name = f"{_name('nvlink-node')}-gpu0"
    body = {"apiVersion": "dynamig.io/v1alpha1", "kind": "GpuPartition", "metadata": {"name": name}}
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump({**body, "spec": {"layout": []}}))

    def patch(status: dict[str, Any]) -> Any:
        return cp.kubectl(
            "patch", "gpupartition", name, "--subresource=status", "--type=merge", "-p",
            json.dumps({"status": status}), check=False,
        )  # fmt: skip

    def stored() -> dict[str, Any]:
        obj: dict[str, Any] = json.loads(cp.kubectl("get", "gpupartition", name, "-o", "json").stdout)
        return obj

    try:
        facts = NvlinkFacts(18, "2f4d1c3e-8a8b-5d0c-9e1f-0a1b2c3d4e5f", 4_000_000_000)  # a uint32 clique
        written = GpuPartitionStatus(
            nvlink_active_links=facts.active_links,
            fabric_cluster_uuid=facts.fabric_cluster_uuid,
            fabric_clique_id=facts.fabric_clique_id,
        )
        got = patch(written.to_api())
        assert got.returncode == 0, got.stderr
        status = stored()["status"]
        assert (status["nvlinkActiveLinks"], status["fabricClusterUuid"], status["fabricCliqueId"]) == (
            18, facts.fabric_cluster_uuid, 4_000_000_000,
        )  # fmt: skip
        assert parse_gpu_partition(stored()).status.nvlink() == facts
        assert patch(GpuPartitionStatus().to_api()).returncode == 0  # NVML no longer gives them
        assert not {"nvlinkActiveLinks", "fabricClusterUuid", "fabricCliqueId"} & set(stored()["status"])
        refused = patch({"nvlinkActiveLinks": -1})
        assert refused.returncode != 0 and "status.nvlinkActiveLinks" in refused.stderr, refused.stderr
    finally:
        cp.kubectl("delete", "gpupartition", name, "--ignore-not-found")
