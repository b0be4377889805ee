"""The GpuPartitionPolicy CRD on a real API server.

Real: etcd and kube-apiserver from the local control plane; the CRD's OpenAPI schema, defaults and CEL
``x-kubernetes-validations`` are enforced by the API server itself; kubectl prints the printer columns.
Nothing is simulated, and no operator runs here: what is checked is what the API server refuses by itself.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamig.devcluster import ControlPlane

CRD = Path(__file__).resolve().parents[2] / "crds" / "gpupartitionpolicies.yaml"


@pytest.fixture(scope="module")
def policy_crd(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    control_plane.kubectl("apply", "-f", str(CRD))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = control_plane.kubectl("get", "crd", "gpupartitionpolicies.dynamig.io", "-o", "json").stdout
        conds = {c["type"]: c["status"] for c in json.loads(out).get("status", {}).get("conditions", [])}
        if conds.get("Established") == "True":
            break
        time.sleep(0.2)
    yield control_plane


def _policy(spec: dict[str, Any]) -> tuple[str, str]:
    name = f"gpp-{uuid.uuid4().hex[:8]}"
    doc = {
        "apiVersion": "dynamig.io/v1alpha1",
        "kind": "GpuPartitionPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }
    return name, yaml.safe_dump(doc)


def _create(cp: ControlPlane, spec: dict[str, Any]) -> tuple[str, subprocess.CompletedProcess[str]]:
    name, text = _policy(spec)
    proc = cp.kubectl("create", "-f", "-", input=text, check=False)
    return name, proc


VALID: dict[str, Any] = {
    "nodeSelector": {"matchLabels": {"dynamig.io/managed": "true"}},
    "gpuProducts": ["A100-80GB"],
    "mode": "Dynamic",
    "allowedProfiles": ["1g.10gb", "2g.20gb", "3g.40gb"],
    "baseline": {"A100-80GB": [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]},
    "warmPool": {"1g.10gb": 1},
    "strategy": "pack",
    "batchWindowSeconds": 2,
    "cooldownSeconds": 60,
    "disruptionBudget": {"maxGpusReshaping": 1},
}


def test_valid_spec_is_accepted_and_defaults_are_filled(policy_crd: ControlPlane) -> None:
    name, proc = _create(policy_crd, VALID)
    assert proc.returncode == 0, proc.stderr
    try:
        obj = json.loads(policy_crd.kubectl("get", "gpp", name, "-o", "json").stdout)
        assert obj["spec"]["baseline"]["A100-80GB"][1] == {"profile": "3g.40gb", "start": 4}
        minimal_name, minimal = _create(policy_crd, {})
        assert minimal.returncode == 0, minimal.stderr
        defaults = json.loads(policy_crd.kubectl("get", "gpp", minimal_name, "-o", "json").stdout)["spec"]
        policy_crd.kubectl("delete", "gpp", minimal_name)
        assert defaults["mode"] == "Dynamic"
        assert defaults["strategy"] == "pack"
        assert defaults["cooldownSeconds"] == 300
        assert defaults["disruptionBudget"] == {"maxGpusReshaping": 1}
        assert defaults["preemption"] == {
            "mode": "Off", "priorityGap": 1, "minRunSeconds": 300, "spareKueueWorkloads": True,
            "maxEvictionsPerHour": 60, "gpuCooldownSeconds": 300, "holdSeconds": 600,
            "spareAfterEvictions": 2,
        }  # fmt: skip
        assert defaults["migMode"] == {
            "policy": "Fixed", "allowReset": False, "minMigGpus": 0, "minWholeGpus": 0,
            "cooldownSeconds": 600, "gpusWithoutMig": "Ignore", "offerWhole": False,
            "drainNodeHoldSeconds": 3600,
        }  # fmt: skip
        table = policy_crd.kubectl("get", "gpupartitionpolicies", name).stdout
        header = table.splitlines()[0].split()
        assert header[:3] == ["NAME", "MODE", "GPUS"], table
        assert "Dynamic" in table.splitlines()[1]
    finally:
        policy_crd.kubectl("delete", "gpp", name, check=False)


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"allowedProfiles": ["1g.10gb", "tiny"]}, "spec.allowedProfiles[1]", "not a MIG profile name"),
        ({"mode": "Sometimes"}, "spec.mode", "Unsupported value"),
        ({"cooldownSeconds": -5}, "spec.cooldownSeconds", "greater than or equal to 0"),
        ({"batchWindowSeconds": 100000}, "spec.batchWindowSeconds", "less than or equal to 600"),
        ({"disruptionBudget": {"maxGpusReshaping": 0}}, "spec.disruptionBudget.maxGpusReshaping", "1"),
        ({"warmPool": {"1g.10gb": -1}}, "spec.warmPool", "greater than or equal to 0"),
        ({"warmPool": {"7g.80gb": 1}}, "spec.warmPool", "not in spec.allowedProfiles"),
        (
            {"baseline": {"A100-80GB": [{"profile": "7g.80gb", "start": 0}]}},
            "spec.baseline",
            "not in spec.allowedProfiles",
        ),
        (
            {
                "baseline": {
                    "A100-80GB": [{"profile": "3g.40gb", "start": 0}, {"profile": "1g.10gb", "start": 0}]
                }
            },
            "spec.baseline",
            "share a placement start",
        ),
        (
            {"baseline": {"A100-80GB": [{"profile": "3g.40gb", "start": 9000}]}},
            "spec.baseline",
            "less than or equal to 11",
        ),
        ({"baseline": {"not a model!": []}}, "spec.baseline", "catalog keys"),
        ({"mode": "Static"}, "spec.warmPool", "Static"),
        (
            {"nodeSelector": {"matchExpressions": [{"key": "gpu", "operator": "In"}]}},
            "spec.nodeSelector.matchExpressions[0]",
            "need values",
        ),
        # Preemption: Off, DryRun and Evict exist; a gap under 1 would let equal priorities evict.
        ({"preemption": {"mode": "Enabled"}}, "spec.preemption.mode", "Unsupported value"),
        ({"preemption": {"mode": False}}, "spec.preemption.mode", "string"),  # `mode: Off` unquoted
        ({"preemption": {"priorityGap": 0}}, "spec.preemption.priorityGap", "greater than or equal to 1"),
        ({"preemption": {"priorityGap": -5}}, "spec.preemption.priorityGap", "greater than or equal to 1"),
        (
            {"preemption": {"minRunSeconds": -1}},
            "spec.preemption.minRunSeconds",
            "greater than or equal to 0",
        ),
        ({"preemption": {"spareKueueWorkloads": "yes"}}, "spec.preemption.spareKueueWorkloads", "boolean"),
        # Evict: an hour with no eviction budget, or a hold shorter than a scheduler's retry, is a mistake.
        (
            {"preemption": {"maxEvictionsPerHour": 0}},
            "spec.preemption.maxEvictionsPerHour",
            "greater than or equal to 1",
        ),
        ({"preemption": {"holdSeconds": 10}}, "spec.preemption.holdSeconds", "greater than or equal to 30"),
        (
            {"preemption": {"maxEvictionsPerHourPerNamespace": 0}},
            "spec.preemption.maxEvictionsPerHourPerNamespace",
            "greater than or equal to 1",
        ),
        (
            {"preemption": {"namespaceSelector": {"matchLabels": {"bad key!": "x"}}}},
            "spec.preemption.namespaceSelector.matchLabels",
            "every key must be a label key",
        ),
        (
            {"preemption": {"spareAfterEvictions": 0}},
            "spec.preemption.spareAfterEvictions",
            "greater than or equal to 1",
        ),
        # MIG mode: Fixed or Dynamic; floors and cooldown are counts; Dynamic cannot go with Static.
        ({"migMode": {"policy": "Sometimes"}}, "spec.migMode.policy", "Unsupported value"),
        ({"migMode": {"allowReset": "yes"}}, "spec.migMode.allowReset", "boolean"),
        ({"migMode": {"minMigGpus": -1}}, "spec.migMode.minMigGpus", "greater than or equal to 0"),
        ({"migMode": {"minWholeGpus": -1}}, "spec.migMode.minWholeGpus", "greater than or equal to 0"),
        ({"migMode": {"gpusWithoutMig": "Some"}}, "spec.migMode.gpusWithoutMig", "Unsupported value"),
        ({"migMode": {"offerWhole": True}}, "spec.migMode.offerWhole", "needs spec.migMode.policy Dynamic"),
        (
            {"migMode": {"policy": "Fixed", "offerWhole": True}},
            "spec.migMode.offerWhole",
            "needs spec.migMode.policy Dynamic",
        ),
        (
            {"migMode": {"drainNodeAfterSeconds": 300}},
            "spec.migMode.drainNodeAfterSeconds",
            "needs spec.migMode.policy Dynamic",
        ),
        (
            {"migMode": {"policy": "Dynamic", "drainNodeAfterSeconds": -1}},
            "spec.migMode.drainNodeAfterSeconds",
            "greater than or equal to 0",
        ),
        (
            {"migMode": {"policy": "Dynamic", "drainNodeHoldSeconds": 59}},
            "spec.migMode.drainNodeHoldSeconds",
            "greater than or equal to 60",
        ),
        (
            {"migMode": {"cooldownSeconds": 10_000_000}},
            "spec.migMode.cooldownSeconds",
            "less than or equal to 604800",
        ),
        (
            {"mode": "Static", "warmPool": {}, "migMode": {"policy": "Dynamic"}},
            "spec.migMode.policy",
            "cannot be used with spec.mode Static",
        ),
    ],
)
def test_invalid_spec_is_refused_naming_the_field(
    policy_crd: ControlPlane, change: dict[str, Any], field: str, words: str
) -> None:
    spec = {**VALID, **change}
    name, proc = _create(policy_crd, spec)
    if proc.returncode == 0:
        policy_crd.kubectl("delete", "gpp", name, check=False)
    assert proc.returncode != 0, f"accepted: {spec}"
    assert field in proc.stderr, proc.stderr
    assert words in proc.stderr, proc.stderr


def test_a_dynamic_mig_mode_is_accepted_as_written(policy_crd: ControlPlane) -> None:
    mig_mode = {
        "policy": "Dynamic", "allowReset": True, "minMigGpus": 1, "minWholeGpus": 2, "cooldownSeconds": 0,
        "gpusWithoutMig": "Whole", "offerWhole": True, "drainNodeAfterSeconds": 300,
        "drainNodeHoldSeconds": 1200,
    }  # fmt: skip
    name, proc = _create(policy_crd, {**VALID, "migMode": mig_mode})
    assert proc.returncode == 0, proc.stderr
    try:
        obj = json.loads(policy_crd.kubectl("get", "gpp", name, "-o", "json").stdout)
        assert obj["spec"]["migMode"] == mig_mode
    finally:
        policy_crd.kubectl("delete", "gpp", name, check=False)
