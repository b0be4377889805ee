"""``kubectl dynamig must-gather`` against the real API server: the archive holds every file that
docs/operations.md ("What support needs: must-gather") lists, with what support reads in it, and no secret
data but the Helm release's values.

Real: kubectl runs the plugin; kube-apiserver, kube-scheduler (which marks the pending claim's pod
Unschedulable) and helm, which installs a small chart and writes its release Secret as it always does. Played
by the test: an agent's heartbeat Lease, dynamig's admission policy and binding, an allocation as
kube-scheduler writes it, and pods labelled like the chart's that no kubelet runs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.demo.cluster import ScenarioApi, claim_pod, first_available, unplaceable_operator_pod
from dynamig.devcluster import ControlPlane, eventually
from dynamig.kube.heartbeat import lease_body

pytestmark = pytest.mark.controlplane
ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# Strings that must never reach the archive: another Secret's data, the release's rendered manifest and its
# chart's defaults (Helm keeps both in the release Secret), and a container's environment.
OTHER_SECRET = "hunter2-other-secret-5e1d"
MANIFEST_ONLY = "manifest-only-9d2b"
CHART_DEFAULT = "chart-default-4c1e"
POD_ENV = "env-value-0b7e"
SET_VALUE = "value-set-7a1f"  # a value given at install: the one thing of the Secret support gets


def _kubectl(cp: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    env = cp.env()
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env["PATH"]])
    assert shutil.which("kubectl-dynamig", path=env["PATH"]), f"kubectl-dynamig is not in {VENV_BIN}"
    return subprocess.run(
        [str(cp.binaries.kubectl), *args], env=env, capture_output=True, text=True, timeout=120
    )


def _tiny_chart(root: Path) -> Path:
    chart = root / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\nappVersion: '1'\n")
    (chart / "values.yaml").write_text(f"defaultOnly: {CHART_DEFAULT}\ntoken: ''\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: tiny\n"
        f"data:\n  marker: {MANIFEST_ONLY}\n  token: {{{{ .Values.token | quote }}}}\n"
    )
    return chart


def _support_files(release_ns: str, release: str, pod_ns: str, pod: str) -> list[str]:
    """The files docs/operations.md lists, placeholders filled in. Pure but for reading the doc."""
    doc = (ROOT / "docs" / "operations.md").read_text()
    section = doc.split("## What support needs: must-gather", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    names = [n for row in rows for n in re.findall(r"`([^`]+)`", row)]
    fill = {
        "<namespace>": release_ns,
        "<release>": release,
        "<ns>": pod_ns,
        "<pod>": pod,
        "<container>": "main",
    }
    out = []
    for name in names:
        for k, v in fill.items():
            name = name.replace(k, v)
        out.append(name)
    return out


async def test_must_gather_holds_what_support_needs_and_no_secret(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Any,
    helm: str,
    tmp_path: Path,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    adm = client.AdmissionregistrationV1Api(kube_api)
    tag = uuid.uuid4().hex[:6]
    ours, theirs = f"dynamig-mg-{tag}", f"other-mg-{tag}"
    try:
        await _scenario_and_checks(crds, k, adm, make_node, helm, namespace, tag, ours, theirs, tmp_path)
    finally:
        for delete in (
            adm.delete_validating_admission_policy_binding,
            adm.delete_validating_admission_policy,
        ):
            for name in (ours, theirs):
                with contextlib.suppress(ApiException):
                    await delete(name)


async def _scenario_and_checks(
    cp: ControlPlane,
    k: ScenarioApi,
    adm: client.AdmissionregistrationV1Api,
    make_node: Any,
    helm: str,
    namespace: str,
    tag: str,
    ours: str,
    theirs: str,
    tmp_path: Path,
) -> None:
    release = f"dyn-{tag}"
    node = make_node("mg", labels={"dynamig.io/managed": "true"})
    installed = await asyncio.to_thread(
        subprocess.run,
        [helm, "install", release, str(_tiny_chart(tmp_path)), "--namespace", namespace,
         "--set", f"token={SET_VALUE}", "--kubeconfig", str(cp.kubeconfig_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    await k.core.create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": "other"},
            "data": {"password": base64.b64encode(OTHER_SECRET.encode()).decode()},
        },
    )
    lease = lease_body(node, namespace, 1_800_000_000.0, 30)
    await client.CoordinationV1Api(k.core.api_client).create_namespaced_lease(namespace, lease)
    part_of = {"app.kubernetes.io/part-of": "dynamig", "app.kubernetes.io/name": "dynamig"}
    for name, labels in ((ours, part_of), (theirs, {})):
        await adm.create_validating_admission_policy(
            {
                "metadata": {"name": name, "labels": labels},
                "spec": {
                    "matchConstraints": {
                        "resourceRules": [
                            {"apiGroups": ["dynamig.io"], "apiVersions": ["*"], "operations": ["CREATE"],
                             "resources": ["gpupartitions"]}
                        ]
                    },
                    "validations": [{"expression": "true"}],
                },
            }
        )  # fmt: skip
        await adm.create_validating_admission_policy_binding(
            {
                "metadata": {"name": name, "labels": labels},
                "spec": {"policyName": name, "validationActions": ["Deny"]},
            }
        )

    # Workloads: one claim pending (its pod Unschedulable), one allocated a dynamig device.
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "infer"},
        "spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": first_available(["1g.10gb"])}]}},
    }
    await k.custom.create_namespaced_custom_object(
        "resource.k8s.io", "v1", namespace, "resourceclaims", claim
    )
    held = claim | {"metadata": {"name": "held"}}
    await k.custom.create_namespaced_custom_object("resource.k8s.io", "v1", namespace, "resourceclaims", held)
    allocation = {"devices": {"results": [
        {"request": "gpu/c0", "driver": "mig.dynamig.io", "pool": node, "device": "gpu0-1g10gb-s6"}
    ]}}  # fmt: skip
    await k.custom.patch_namespaced_custom_object_status(
        "resource.k8s.io", "v1", namespace, "resourceclaims", "held", {"status": {"allocation": allocation}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip
    infer_pod = claim_pod("infer", {"kubernetes.io/hostname": node}, claim="infer")
    infer_pod["spec"]["containers"][0]["env"] = [{"name": "TOKEN", "value": POD_ENV}]
    await k.core.create_namespaced_pod(namespace, infer_pod)
    bystander = claim_pod("bystander", {"no-such-label": "x"}, claim="infer")
    del bystander["spec"]["resourceClaims"], bystander["spec"]["containers"][0]["resources"]
    bystander["spec"]["containers"][0]["env"] = [{"name": "TOKEN", "value": POD_ENV}]
    await k.core.create_namespaced_pod(namespace, bystander)
    # The chart's operator pod of that release; it never runs, so its log is empty and its metrics fail.
    chart_labels = {
        "app.kubernetes.io/name": "dynamig",
        "app.kubernetes.io/component": "operator",
        "app.kubernetes.io/instance": release,
    }
    await k.core.create_namespaced_pod(namespace, unplaceable_operator_pod(chart_labels))

    await eventually(
        functools.partial(k.unschedulable, "infer"),
        "the scheduler to mark the claim's pod Unschedulable",
        within_s=30,
    )

    async def served() -> bool | None:  # a CRD just established answers 429 until its storage is ready
        try:
            for plural in ("gpupartitions", "gpupartitionpolicies"):
                await k.custom.list_cluster_custom_object("dynamig.io", "v1alpha1", plural)
        except ApiException:
            return None
        return True

    await eventually(served, "the API server to serve dynamig's custom resources", within_s=30)

    archive = tmp_path / "gather.tar.gz"
    gathered = await asyncio.to_thread(
        _kubectl, cp, "dynamig", "must-gather", "-n", namespace, "-o", str(archive)
    )
    assert gathered.returncode == 0, gathered.stderr
    with tarfile.open(archive) as tar:
        files: dict[str, bytes] = {}
        for member in tar.getmembers():
            data = tar.extractfile(member)
            assert data is not None
            files[member.name.split("/", 1)[1]] = data.read()

    def items(name: str) -> list[dict[str, Any]]:
        return list(yaml.safe_load(io.BytesIO(files[name]))["items"])

    # Every file support needs is there: the list is docs/operations.md's, and it keeps at least these
    # (issue 41: Leases, workload status, the admission policies, Helm values, the server version).
    needed = _support_files(namespace, release, namespace, "dynamig-operator-x")
    assert {
        "version.json",
        "gpupartitionpolicies.yaml",
        "gpupartitions.yaml",
        "verify.txt",
        "resourceslices.yaml",
        "deviceclasses.yaml",
        "resourceclaims.yaml",
        "workloads/resourceclaims.yaml",
        "workloads/pods.yaml",
        "events.yaml",
        "nodes.yaml",
        "leases.yaml",
        "validatingadmissionpolicies.yaml",
        "validatingadmissionpolicybindings.yaml",
        f"helm/{namespace}/{release}.values.yaml",
        "pods.yaml",
        f"pods/{namespace}/dynamig-operator-x/main.log",
        f"pods/{namespace}/dynamig-operator-x/metrics.txt",
        "summary.txt",
    } <= set(needed), needed
    missing = [
        n for n in needed if n not in files and n != f"pods/{namespace}/dynamig-operator-x/metrics.txt"
    ]
    assert missing == [], files["summary.txt"].decode()
    # The pod never runs, so the proxy to its metrics fails; the summary says so.
    assert f"metrics of {namespace}/dynamig-operator-x: 400" in files["summary.txt"].decode()

    version = yaml.safe_load(files["version.json"])
    assert re.match(r"v1\.\d+\.\d+", version["gitVersion"]), version
    leases = items("leases.yaml")
    assert (namespace, lease["metadata"]["name"]) in {
        (x["metadata"]["namespace"], x["metadata"]["name"]) for x in leases
    }
    assert {p["metadata"]["name"] for p in items("validatingadmissionpolicies.yaml")} >= {ours}
    assert theirs not in {p["metadata"]["name"] for p in items("validatingadmissionpolicies.yaml")}
    bindings = {b["metadata"]["name"]: b for b in items("validatingadmissionpolicybindings.yaml")}
    assert ours in bindings and theirs not in bindings and bindings[ours]["spec"]["policyName"] == ours

    claims = {c["metadata"]["name"]: c for c in items("workloads/resourceclaims.yaml")}
    assert set(claims) == {"infer", "held"}
    assert claims["held"]["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu0-1g10gb-s6"
    pods = {p["metadata"]["name"]: p for p in items("workloads/pods.yaml")}
    assert set(pods) == {"infer"}, set(pods)  # the bystander uses no dynamig claim
    conditions = {c["type"]: c for c in pods["infer"]["status"]["conditions"]}
    assert conditions["PodScheduled"]["reason"] == "Unschedulable"
    assert pods["infer"]["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimName": "infer"}]

    values = yaml.safe_load(files[f"helm/{namespace}/{release}.values.yaml"])
    assert values["values"] == {"token": SET_VALUE}
    assert (values["release"], values["revision"], values["status"], values["chart"]) == (
        release, 1, "deployed", "tiny-0.1.0",
    )  # fmt: skip
    # Nothing else of any Secret, of the release's manifest and chart, or of a container's env.
    for name, content in files.items():
        for needle in (OTHER_SECRET, MANIFEST_ONLY, CHART_DEFAULT, POD_ENV):
            assert needle.encode() not in content, (needle, name)
        assert b"sh.helm.release" not in content, name
