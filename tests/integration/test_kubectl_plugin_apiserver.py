"""``kubectl dynamig`` through the real kubectl binary, against the local control plane.

Real: kubectl finds ``kubectl-dynamig`` on PATH (the entry point this package installs, next to the test's
Python) and runs it; the plugin logs in from $KUBECONFIG or ``--kubeconfig`` like kubectl; kube-apiserver
(with the CRDs' schemas and CEL rules) and kube-scheduler (which marks the claim's pod Unschedulable) answer.
Played by the test: the node agent's part, i.e. two GpuPartitions with the status an agent reports (one at its
spec, one whose agent kept an allocated instance), and a pod labelled like the chart's operator pod that no
kubelet ever runs, so its log and metrics cannot be gathered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.demo.cluster import ScenarioApi, claim_pod, first_available, unplaceable_operator_pod
from dynamig.devcluster import ControlPlane, eventually
from dynamig.kube.names import GROUP, VERSION
from dynamig.kube.slices import build_resource_slices

pytestmark = pytest.mark.controlplane
VENV_BIN = Path(sys.executable).parent
MERGE_PATCH = "application/merge-patch+json"


def plugin_env(cp: ControlPlane) -> dict[str, str]:
    """kubectl's environment with this package's scripts first on PATH, so kubectl discovers the plugin."""
    env = cp.env()
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env["PATH"]])
    if shutil.which("kubectl-dynamig", path=env["PATH"]) is None:
        pytest.fail(f"kubectl-dynamig is not in {VENV_BIN}: run `pip install -e .`")
    return env


def kubectl(cp: ControlPlane, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cp.binaries.kubectl), *args],
        input=stdin, env=plugin_env(cp), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


async def akubectl(
    cp: ControlPlane, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(kubectl, cp, *args, stdin=stdin)


def test_kubectl_finds_the_plugin_and_its_help(control_plane: ControlPlane) -> None:
    listed = kubectl(control_plane, "plugin", "list")
    assert "kubectl-dynamig" in listed.stdout, listed.stderr
    version = kubectl(control_plane, "dynamig", "--version")
    assert version.returncode == 0 and version.stdout.startswith("kubectl-dynamig "), version.stderr
    top = kubectl(control_plane, "dynamig", "--help")
    assert top.returncode == 0
    assert all(command in top.stdout for command in ("plan", "verify", "export", "must-gather")), top.stdout
    assert "--context" in top.stdout and "--namespace" in top.stdout
    usage = kubectl(control_plane, "dynamig", "export")
    assert usage.returncode == 2 and "--as" in usage.stderr
    wrong = kubectl(control_plane, "dynamig", "verify", "--context", "no-such-context")
    assert wrong.returncode == 1 and "no-such-context" in wrong.stderr and "Traceback" not in wrong.stderr


def a100_status(node: str, index: int, gen: int, instances: list[tuple[str, int, str]]) -> dict[str, Any]:
    return {
        "node": node,
        "gpuIndex": index,
        "uuid": f"GPU-{uuid.uuid4()}",
        "product": "NVIDIA A100-SXM4-80GB",
        "model": "A100-80GB",
        "migMode": "Enabled",
        "phase": "Stable",
        "observedGeneration": gen,
        "instances": [
            {"profile": p, "start": s, "deviceName": f"gpu{index}-{p.replace('.', '')}-s{s}", "state": state}
            for p, s, state in instances
        ],
    }


async def gpu(
    custom: client.CustomObjectsApi,
    node: str,
    index: int,
    spec: list[tuple[str, int]],
    instances: list[tuple[str, int, str]],
    ready: tuple[str, str, str],
    made: list[tuple[str, str, str, str]],
) -> str:
    """A GpuPartition whose spec.layout is ``spec``, reported by 'its agent' with ``instances`` and Ready."""
    name = f"{node}-gpu{index}"
    made.append((GROUP, VERSION, "gpupartitions", name))
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GpuPartition",
        "metadata": {"name": name, "labels": {"dynamig.io/node": node, "dynamig.io/gpu-index": str(index)}},
        "spec": {"layout": [{"profile": p, "start": s} for p, s in spec]},
    }
    gen = int((await custom.create_cluster_custom_object(GROUP, VERSION, "gpupartitions", body))["metadata"][
        "generation"
    ])  # fmt: skip
    status = a100_status(node, index, gen, instances)
    status["conditions"] = [
        {"type": "Ready", "status": ready[0], "reason": ready[1], "message": ready[2],
         "lastTransitionTime": "2026-12-01T00:00:00Z", "observedGeneration": gen}
    ]  # fmt: skip
    await custom.patch_cluster_custom_object_status(
        GROUP,
        VERSION,
        "gpupartitions",
        name,
        {"status": status},
        _content_type=MERGE_PATCH,
    )
    return name


def slice_body(name: str, driver: str, node: str) -> dict[str, Any]:
    """An empty slice of ``driver`` in ``node``'s pool, named ``name``, as the slice builder makes it."""
    (made,) = build_resource_slices(node, 1, [], driver)
    made["metadata"] = {"name": name}
    return made


async def test_plan_verify_export_and_must_gather_on_a_live_cluster(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    tmp_path: Path,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    pool = uuid.uuid4().hex[:8]
    made: list[tuple[str, str, str, str]] = []  # cluster-scoped (group, version, plural, name) to delete
    try:
        await _scenario_and_checks(crds, k, make_node, namespace, pool, made, tmp_path)
    finally:
        for group, version, plural, name in reversed(made):
            with contextlib.suppress(ApiException):
                await k.custom.delete_cluster_custom_object(group, version, plural, name)


async def _scenario_and_checks(
    crds: ControlPlane,
    k: ScenarioApi,
    make_node: Callable[..., str],
    namespace: str,
    pool: str,
    made: list[tuple[str, str, str, str]],
    tmp_path: Path,
) -> None:
    custom = k.custom
    node = make_node("kp", labels={"dynamig.io/managed": "true", "test-pool": pool})
    two_halves = [("3g.40gb", 0), ("3g.40gb", 4)]
    at_spec = await gpu(
        custom, node, 0, two_halves, [("3g.40gb", 0, "free"), ("3g.40gb", 4, "free")],
        ("True", "LayoutApplied", "GPU matches spec.layout"), made,
    )  # fmt: skip
    off_spec = await gpu(
        custom, node, 1, [("7g.80gb", 0)], [("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "free")],
        ("False", "InstanceBusy", "kept gpu1-3g40gb-s0 (3g.40gb@0): allocated to a claim"), made,
    )  # fmt: skip
    policy = f"kp-{pool}"
    made.append((GROUP, VERSION, "gpupartitionpolicies", policy))
    await k.create_policy(
        policy,
        {
            "nodeSelector": {"matchLabels": {"test-pool": pool}},
            "gpuProducts": ["A100-80GB"],
            "mode": "Dynamic",
            "baseline": {"A100-80GB": [{"profile": p, "start": s} for p, s in two_halves]},
            "cooldownSeconds": 0,
            "disruptionBudget": {"maxGpusReshaping": 1},
        },
    )
    ours, theirs = f"kp-{pool}-mig", f"kp-{pool}-other"
    for name, driver in ((ours, "mig.dynamig.io"), (theirs, "other.example.com")):
        made.append(("resource.k8s.io", "v1", "resourceslices", name))
        await custom.create_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", slice_body(name, driver, node)
        )
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "infer"},
        "spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": first_available(["1g.10gb"])}]}},
    }
    await custom.create_namespaced_custom_object("resource.k8s.io", "v1", namespace, "resourceclaims", claim)
    await k.core.create_namespaced_pod(
        namespace, claim_pod("infer", {"kubernetes.io/hostname": node}, claim="infer")
    )
    # Labelled like the chart's operator pod; it never runs (no node matches), so it has no log or metrics.
    chart_labels = {"app.kubernetes.io/name": "dynamig", "app.kubernetes.io/component": "operator"}
    await k.core.create_namespaced_pod(namespace, unplaceable_operator_pod(chart_labels))

    await eventually(
        functools.partial(k.unschedulable, "infer"),
        "the scheduler to mark the claim's pod Unschedulable",
        within_s=30,
    )
    before = await custom.get_cluster_custom_object(GROUP, VERSION, "gpupartitions", at_spec)
    archive = tmp_path / "gather.tar.gz"
    exported = f"{policy}-b"

    verify, verify_json, plan, scenario, baseline, gather = await asyncio.gather(
        akubectl(crds, "dynamig", "verify"),
        akubectl(crds, "dynamig", "verify", "-o", "json", "--kubeconfig", str(crds.kubeconfig_path)),
        akubectl(crds, "dynamig", "plan", "-n", namespace, "--policy", policy, "-o", "json"),
        akubectl(crds, "dynamig", "export", "--as", "scenario", "--policy", policy),
        akubectl(
            crds, "dynamig", "export", "--as", "policy-baseline", "--policy", policy, "--name", exported
        ),
        akubectl(crds, "dynamig", "must-gather", "-n", namespace, "-o", str(archive)),
    )

    # verify: exit 1, the off-spec GPU with the agent's reason, the other at spec
    assert verify.returncode == 1, verify.stdout + verify.stderr
    lines = {line.split()[0]: line for line in verify.stdout.splitlines() if line.strip()}
    assert "at spec" in lines[at_spec]
    assert "InstanceBusy" in lines[off_spec] and "missing 7g.80gb@0" in lines[off_spec], lines[off_spec]
    assert verify_json.returncode == 1, verify_json.stderr
    rows = {r["gpu"]: r for r in json.loads(verify_json.stdout)}
    assert rows[at_spec]["atSpec"] and not rows[off_spec]["atSpec"]

    # plan: the pending claim re-cuts the free GPU; the free 3g.40gb that goes is named; nothing is written
    assert plan.returncode == 0, plan.stderr
    (report,) = json.loads(plan.stdout)["policies"]
    (verdict,) = report["claims"]
    assert verdict["claim"] == f"{namespace}/infer" and verdict["reason"] == "ReshapeScheduled", verdict
    (recut,) = [r for r in report["reshapes"] if f"{namespace}/infer" in r["claims"]]
    assert recut["gpu"] == at_spec and recut["action"] == "write", recut
    assert recut["removes"] and set(recut["removes"]) <= {"3g.40gb@0", "3g.40gb@4"}
    assert "1g.10gb" in recut["to"]
    after = await custom.get_cluster_custom_object(GROUP, VERSION, "gpupartitions", at_spec)
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"] == before["spec"]

    # export --as scenario: `dynamig plan -f` accepts it and places the claim
    assert scenario.returncode == 0, scenario.stderr
    planned = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "dynamig", "plan", "-f", "-", "-o", "json"],
        input=scenario.stdout, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr + scenario.stdout
    assert [a["claim"] for a in json.loads(planned.stdout)["assignments"]] == [f"{namespace}/infer"]

    # export --as policy-baseline: the API server (schema and CEL rules) accepts it
    assert baseline.returncode == 0, baseline.stderr
    exported = yaml.safe_load(baseline.stdout)
    assert exported["spec"]["baseline"] == {"A100-80GB": [{"profile": p, "start": s} for p, s in two_halves]}
    applied = await akubectl(crds, "apply", "--dry-run=server", "-f", "-", stdin=baseline.stdout)
    assert applied.returncode == 0, applied.stderr

    # must-gather: the objects, filtered; what could not be gathered is in the summary
    assert gather.returncode == 0, gather.stderr
    with tarfile.open(archive) as tar:
        files = {m.name.split("/", 1)[1]: m for m in tar.getmembers()}

        def items(name: str) -> list[dict[str, Any]]:
            member = tar.extractfile(files[name])
            assert member is not None
            return list(yaml.safe_load(io.TextIOWrapper(member))["items"])

        def text(name: str) -> str:
            member = tar.extractfile(files[name])
            assert member is not None
            return member.read().decode()

        assert {at_spec, off_spec} <= {o["metadata"]["name"] for o in items("gpupartitions.yaml")}
        assert policy in {o["metadata"]["name"] for o in items("gpupartitionpolicies.yaml")}
        slices = {o["metadata"]["name"] for o in items("resourceslices.yaml")}
        assert ours in slices and theirs not in slices
        claims = items("resourceclaims.yaml")
        assert [(c["metadata"]["namespace"], c["metadata"]["name"]) for c in claims] == [(namespace, "infer")]
        events = items("events.yaml")
        assert events and {e["metadata"]["namespace"] for e in events} == {namespace}
        assert node in {n["metadata"]["name"] for n in items("nodes.yaml")}
        assert "mig.dynamig.io" in {d["metadata"]["name"] for d in items("deviceclasses.yaml")}
        assert f"{namespace}/dynamig-operator-x" in {
            f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in items("pods.yaml")
        }
        assert off_spec in text("verify.txt")
        summary = text("summary.txt")
        # The API server answers an empty log for a pod on no node, and refuses to proxy to it.
        assert f"pods/{namespace}/dynamig-operator-x/main.log" in files
    missing = summary.split("not gathered:", 1)[1]
    assert f"metrics of {namespace}/dynamig-operator-x: 400" in missing, summary
    for name in ("gpupartitions.yaml", "resourceclaims.yaml", "events.yaml"):
        assert name not in missing
