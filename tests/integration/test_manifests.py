"""The install manifests: the Helm chart, the plain manifests rendered from it, RBAC, node admission policy.

What runs for real: the helm binary built from its Go module (``hack/build-helm.sh``) renders and lints the
chart; the local control plane (real kube-apiserver with RBAC, Pod Security admission and
ValidatingAdmissionPolicy) receives the rendered objects. CRDs, the namespace, service accounts, RBAC, the
admission policies and the DeviceClass are applied for real; the workloads (Deployment, DaemonSet) go through
server-side dry-run only, since no kubelet would ever run them. ``kubectl auth can-i`` asks the real RBAC
authorizer; the node identity of an agent is simulated by impersonating its service account with the
``authentication.kubernetes.io/node-name`` extra that a pod-bound token carries.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamig.agent.metrics import AgentMetrics, InstanceSample
from dynamig.demo.cluster import exactly, resource_claim
from dynamig.devcluster import ControlPlane
from dynamig.devcluster.binaries import BinariesNotFoundError, build_tool
from dynamig.devcluster.helmrelease import adopt_crds, forget_release
from dynamig.kube.heartbeat import lease_body
from dynamig.kube.slices import build_resource_slices

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "manifests" / "helm" / "dynamig"
DEPLOY = ROOT / "manifests" / "deploy"
EXAMPLES = ROOT / "manifests" / "examples"
NS = "dynamig-system"
OPERATOR_SA = f"system:serviceaccount:{NS}:dynamig-operator"
AGENT_SA = f"system:serviceaccount:{NS}:dynamig-agent"
NODE_EXTRA = "authentication.kubernetes.io/node-name"
WORKLOAD_KINDS = {"Deployment", "DaemonSet"}


# ------------------------------------------------------------------------------------------------ helpers
def render(
    helm: str, *sets: str, check: bool = True, set_json: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart with ``--set`` (and ``--set-json``) values. Side effect: runs helm."""
    args = [helm, "template", "dynamig", str(CHART), "--namespace", NS]
    for s in sets:
        args += ["--set", s]
    for s in set_json:
        args += ["--set-json", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=check)


def docs(text: str) -> list[dict[str, Any]]:
    """The YAML documents of a multi-document stream, empty ones dropped. Pure."""
    return [d for d in yaml.safe_load_all(text) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``); fails the test when it is missing. Pure."""
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def deploy_objects() -> list[dict[str, Any]]:
    return docs((DEPLOY / "dynamig.yaml").read_text())


def registered_metric_names() -> set[str]:
    """Metric family names registered in the package's metrics modules (read from their source)."""
    names: set[str] = set()
    for path in (ROOT / "operator" / "dynamig").rglob("metrics.py"):
        names |= {metric_family(n) for n in re.findall(r'"(dynamig_[a-z_]+)"', path.read_text())}
    return names


def metric_family(series: str) -> str:
    """``x_total`` / ``x_bucket`` / ``x_count`` / ``x_sum`` -> ``x``: the family a series belongs to. Pure."""
    return re.sub(r"_(total|bucket|count|sum)$", "", series)


def can_i(cp: ControlPlane, user: str, *args: str) -> bool:
    """``kubectl auth can-i`` as a service account, with the groups a real token of it carries."""
    ns = user.split(":")[2]
    proc = cp.kubectl(
        "auth",
        "can-i",
        *args,
        f"--as={user}",
        "--as-group=system:serviceaccounts",
        f"--as-group=system:serviceaccounts:{ns}",
        "--as-group=system:authenticated",
        check=False,
    )
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl auth can-i {args}: {proc.stdout} {proc.stderr}"
    return answer == "yes"


# ------------------------------------------------------------------------------------------------ chart only
def test_chart_lints_clean(helm: str) -> None:
    proc = subprocess.run(
        [helm, "lint", "--strict", str(CHART), "--namespace", NS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


def test_plain_manifests_and_chart_crds_are_in_sync(helm: str) -> None:
    """manifests/deploy and the chart's copy of crds/ are exactly what the chart renders today."""
    proc = subprocess.run(
        ["bash", str(ROOT / "hack" / "render-manifests.sh"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"DYNAMIG_HELM": helm, "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    repo_crds = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert sorted(p.name for p in (CHART / "files" / "crds").glob("*.yaml")) == repo_crds
    for name in repo_crds:
        assert (CHART / "files" / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("logging.format=xml", 'logging.format must be "text" or "json", got "xml"'),
        ("logging.level=loud", "logging.level must be one of debug, info, warning, error"),
        ("operator.replicas=0", "operator.replicas must be between 1 and 5"),
        ("operator.metricsPort=70000", "operator.metricsPort must be a port number (1-65535), got 70000"),
        (
            "agent.kubeletDir=var/lib/kubelet",
            'agent.kubeletDir must be an absolute path, got "var/lib/kubelet"',
        ),
        ("agent.nvml.mode=magic", 'agent.nvml.mode must be "runtimeClass", "hostDriverRoot" or "simulated"'),
        (
            "agent.nvml.mode=simulated,agent.nvml.simulated.hostDir=",
            "agent.nvml.simulated.hostDir must be an absolute path when agent.nvml.mode is simulated",
        ),
        ("agent.nodeSelector=null", "agent.nodeSelector is empty"),
        ("image.digest=abc", "image.digest must be sha256: and 64 lowercase hex digits"),
        # The prefix alone is not a digest (a pull would fail on every node, long after the install).
        ("image.digest=sha256:abc", 'lowercase hex digits (the image manifest\'s digest), got "sha256:abc"'),
        ("image.digest=sha256:" + "A" * 64, "image.digest must be sha256: and 64 lowercase hex digits"),
        ("image.digest=sha256:" + "a" * 65, "image.digest must be sha256: and 64 lowercase hex digits"),
        (
            "metrics.serviceMonitor.enabled=true",
            "cluster does not serve monitoring.coreos.com/v1 ServiceMonitor",
        ),
        ("operator.peering.name=Not_A_Label", "operator.peering.name must be a DNS label"),
        ("operator.healthPort=8080", "operator.healthPort and operator.metricsPort are both 8080"),
        (
            "agent.updateStrategy.rollingUpdate.maxSurge=1",
            "agent.updateStrategy.rollingUpdate.maxSurge must be 0, got 1",
        ),
        ("agent.leaseSeconds=301", "agent.leaseSeconds must be between 1 and 300"),
        ("agent.leaseSeconds=0", "agent.leaseSeconds must be between 1 and 300"),
        (
            "agent.extraArgs={--lease-seconds=900}",
            "agent.extraArgs sets --lease-seconds=900: use agent.leaseSeconds",
        ),
    ],
)
def test_bad_values_fail_rendering_with_a_message_naming_the_key(helm: str, value: str, message: str) -> None:
    proc = render(helm, value, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_a_namespace_that_would_refuse_the_privileged_agent_is_refused(
    control_plane: ControlPlane, helm: str
) -> None:
    """The agent runs privileged: a namespace enforcing `restricted` (or `baseline`) would refuse its pods.
    Refused when the chart would create such a namespace, and when installing into an existing one (helm's
    lookup of the real namespace)."""
    made = render(helm, "namespace.create=true", "namespace.podSecurityEnforce=restricted", check=False)
    assert made.returncode != 0
    expected = 'namespace.podSecurityEnforce is "restricted": the agent runs privileged'
    assert expected in made.stderr, made.stderr
    ns = "dynamig-psa-restricted"
    control_plane.kubectl("create", "namespace", ns)
    try:
        control_plane.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=baseline")
        proc = subprocess.run(
            [helm, "install", "psa", str(CHART), "--namespace", ns, "--dry-run=server"],
            capture_output=True, text=True, timeout=120, env=control_plane.env(), check=False,
        )  # fmt: skip
        assert proc.returncode != 0
        assert f'namespace {ns} enforces the "baseline" Pod Security level' in proc.stderr, proc.stderr
    finally:
        control_plane.kubectl("delete", "namespace", ns, "--wait=false")


def test_the_default_namespace_is_refused(helm: str) -> None:
    proc = subprocess.run(
        [helm, "template", "dynamig", str(CHART), "--namespace", "default"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "the release namespace is default: install dynamig in a namespace of its own" in proc.stderr
    # A surge of 0, as the default strategy has it spelled out, is fine.
    assert render(helm, "agent.updateStrategy.rollingUpdate.maxSurge=0").returncode == 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("agent.nodeselector.a=b", "at '/agent': additional properties 'nodeselector' not allowed"),
        ("operator.replicas=two", "at '/operator/replicas': got string, want integer"),
        ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
    ],
)
def test_the_values_schema_catches_typos_and_wrong_types(helm: str, value: str, message: str) -> None:
    proc = render(helm, value, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


Grant = tuple[str, str, str, str, str]  # scope, API group, resource, verb, object name ("*": every object)


def _doc_grants(section: str) -> set[Grant]:
    """The grants a table of docs/upgrading.md lists: one row per rule, each cell's backticked names
    (`""` is the core group) multiplied out; the objects column is `all` or backticked names. Pure."""
    grants: set[Grant] = set()
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 5 or cells[0] not in ("cluster", "release namespace"):
            continue
        groups, resources, verbs, names = (re.findall(r"`([^`]*)`", c) for c in cells[1:5])
        groups = ["" if g == '""' else g for g in groups]
        for g in groups:
            for r in resources:
                for v in verbs:
                    for n in names or ["*"]:
                        grants.add((cells[0], g, r, v, n))
    return grants


def _rule_grants(scope: str, role: dict[str, Any]) -> set[Grant]:
    return {
        (scope, g, r, v, n)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
        for n in rule.get("resourceNames") or ["*"]
    }


def test_the_upgrade_guide_lists_every_grant_of_the_operator(helm: str) -> None:
    """With rbac.create=false the chart grants the operator nothing: docs/upgrading.md's table is what an
    admin binds by hand, so it must be the chart's operator ClusterRole and Role, rule for rule, both ways."""
    objs = docs(render(helm, "metrics.secure.enabled=true").stdout)
    chart = _rule_grants("cluster", find(objs, "ClusterRole", "dynamig-operator")) | _rule_grants(
        "release namespace", find(objs, "Role", "dynamig-operator-agent-leases")
    )
    operator_roles = {
        o["roleRef"]["name"]
        for o in objs
        if o["kind"] in ("ClusterRoleBinding", "RoleBinding")
        and {"kind": "ServiceAccount", "name": "dynamig-operator", "namespace": NS} in o["subjects"]
    }
    # Every role the operator is bound to is in the table, or named beside it.
    assert operator_roles == {"dynamig-operator", "dynamig-operator-agent-leases", "system:auth-delegator"}
    guide = (ROOT / "docs" / "upgrading.md").read_text()
    section = guide.split("## What the operator's ServiceAccount needs", 1)[1].split("\n## ", 1)[0]
    listed = _doc_grants(section)
    assert chart - listed == set(), (
        f"granted by the chart, missing from docs/upgrading.md: {sorted(chart - listed)}"
    )
    assert listed - chart == set(), (
        f"listed in docs/upgrading.md, not granted by the chart: {sorted(listed - chart)}"
    )
    assert "system:auth-delegator" in section and "rbac.create=false" in section
    render_off = docs(render(helm, "rbac.create=false").stdout)
    assert not [
        o
        for o in render_off
        if o["kind"] in ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding")
        and o["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"
    ]
    assert "dynamig-profile-deviceclasses" not in {o["metadata"]["name"] for o in render_off}


def test_values_switch_what_is_rendered(helm: str) -> None:
    base = docs(render(helm).stdout)
    kinds = {o["kind"] for o in base}
    assert {
        "CustomResourceDefinition",
        "DeviceClass",
        "ValidatingAdmissionPolicy",
        "Deployment",
        "DaemonSet",
        "ClusterKopfPeering",
    } <= kinds
    assert "Namespace" not in kinds  # helm install -n ... --create-namespace owns it
    assert "ServiceMonitor" not in kinds and "PrometheusRule" not in kinds
    for crd in (o for o in base if o["kind"] == "CustomResourceDefinition"):
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    lean = docs(
        render(
            helm,
            "features.nodeAdmissionPolicy=false",
            "features.deviceClass=false",
            "crds.install=false",
            "operator.enabled=false",
            "uninstall.hook=false",
        ).stdout
    )
    assert {o["kind"] for o in lean} & {
        "ValidatingAdmissionPolicy",
        "DeviceClass",
        "CustomResourceDefinition",
        "Deployment",
        "ClusterKopfPeering",
    } == set()
    # The profile-class policy follows whoever may write DeviceClasses: here the uninstall hook alone.
    hook_only = docs(render(helm, "features.nodeAdmissionPolicy=false", "operator.enabled=false").stdout)
    (policy,) = [o for o in hook_only if o["kind"] == "ValidatingAdmissionPolicy"]
    users = policy["spec"]["matchConditions"][0]["expression"]
    assert f"{NS}:dynamig-uninstall" in users and "dynamig-operator" not in users, users

    rich = docs(
        render(
            helm,
            "metrics.serviceMonitor.enabled=true",
            "metrics.serviceMonitor.skipCapabilityCheck=true",
            "metrics.prometheusRule.enabled=true",
            "metrics.prometheusRule.skipCapabilityCheck=true",
            "logging.format=json",
            "logging.level=warning",
            "features.kubeletPlugin=false",
            "agent.nvml.mode=hostDriverRoot",
            "image.digest=sha256:" + "a" * 64,
            "operator.priorityClassName=system-cluster-critical",
            "metrics.grafanaDashboard.enabled=true",
        ).stdout
    )
    assert len([o for o in rich if o["kind"] == "ServiceMonitor"]) == 2
    dashboard = find(rich, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["dynamig.json"]) == json.loads(
        (ROOT / "dashboards" / "dynamig.json").read_text()
    )
    rule = find(rich, "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 5, "the PrometheusRule has too few alerts"
    # Every dynamig series an alert uses is one the agent or the operator registers.
    registered = registered_metric_names()
    for alert in alerts:
        for series in re.findall(r"dynamig_[a-z_]+", alert["expr"]):
            assert metric_family(series) in registered, f"{alert['alert']}: {series} is not exported"
    op = find(rich, "Deployment")["spec"]["template"]["spec"]
    assert op["priorityClassName"] == "system-cluster-critical"
    assert op["containers"][0]["image"] == "dynamig/dynamig@sha256:" + "a" * 64
    assert "--log-level=WARNING" in op["containers"][0]["args"]
    agent = find(rich, "DaemonSet")["spec"]["template"]["spec"]
    assert {"--log-format=json", "--log-level=WARNING"} <= set(agent["containers"][0]["args"])
    assert "runtimeClassName" not in agent
    assert "--no-kubelet-plugin" in agent["containers"][0]["args"]
    assert any(v["name"] == "driver-root" for v in agent["volumes"])


def test_simulated_gpus_host_network_and_api_server_values(helm: str) -> None:
    """``agent.nvml.mode: simulated`` runs the agent over simulated NVML with its state and driver files in
    one host directory mounted at the same path (no host /dev or /proc), the kubelet plugin on, no runtime
    class, and a securityContext without privileges: every capability dropped but MKNOD, a read-only root.
    ``*.hostNetwork`` and ``apiServer`` reach each of the three pods. The defaults render none of it."""
    objs = docs(
        render(
            helm,
            "agent.nvml.mode=simulated",
            "agent.nvml.simulated.gpus=A100-80GB:2",
            "agent.nvml.simulated.hostDir=/srv/sim/",
            "agent.hostNetwork=true",
            "operator.hostNetwork=true",
            "uninstall.hostNetwork=true",
            "apiServer.host=10.1.2.3",
            "apiServer.port=6443",
        ).stdout
    )
    agent = find(objs, "DaemonSet")["spec"]["template"]["spec"]
    (container,) = agent["containers"]
    args = container["args"]
    assert {
        "--nvml=simulated", "--simulate-gpus=A100-80GB:2", "--state=/srv/sim/nvml-state.json",
        "--sim-char-devices", "--dev-root=/srv/sim/dev", "--proc-root=/srv/sim/proc", "--kubelet-plugin",
    } <= set(args)  # fmt: skip
    assert "--nvml=real" not in args and "--proc-root=/host/proc" not in args
    assert "runtimeClassName" not in agent
    volumes = {v["name"]: v for v in agent["volumes"]}
    assert volumes["simulated"]["hostPath"] == {"path": "/srv/sim", "type": "DirectoryOrCreate"}
    assert "dev" not in volumes and "host-proc" not in volumes
    assert {"name": "simulated", "mountPath": "/srv/sim"} in container["volumeMounts"]
    names = {e["name"] for e in container["env"]}
    assert not {n for n in names if n.startswith("NVIDIA_")} and "LD_LIBRARY_PATH" not in names
    assert container["securityContext"] == {
        "runAsUser": 0, "runAsNonRoot": False, "privileged": False, "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": ["MKNOD"]},
    }  # fmt: skip
    job = find(objs, "Job")["spec"]["template"]["spec"]
    for spec in (agent, find(objs, "Deployment")["spec"]["template"]["spec"], job):
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["KUBERNETES_SERVICE_HOST"] == "10.1.2.3" and env["KUBERNETES_SERVICE_PORT"] == "6443"

    default = docs(render(helm).stdout)
    for kind in ("DaemonSet", "Deployment", "Job"):
        spec = find(default, kind)["spec"]["template"]["spec"]
        assert "hostNetwork" not in spec and "dnsPolicy" not in spec
        assert not any(e["name"].startswith("KUBERNETES_") for e in spec["containers"][0]["env"])
    args = find(default, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--nvml=real" in args and "--proc-root=/host/proc" in args
    assert not [a for a in args if a.startswith(("--sim", "--state", "--dev-root", "--kubelet-plugin"))]


# ------------------------------------------------------------------------------------------------ cluster
@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    """CRDs and every non-workload object of manifests/deploy applied for real; removed afterwards."""
    cp = control_plane
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(DEPLOY / "crds"))
    cp.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd",
        "-l",
        "app.kubernetes.io/part-of=dynamig",
    )
    static = [o for o in deploy_objects() if o["kind"] not in WORKLOAD_KINDS]
    stream = yaml.safe_dump_all(static)
    # What other tests of the session made (the DeviceClass, say) stays: only what this fixture made goes.
    existing = set(
        cp.kubectl("get", "--ignore-not-found", "-o", "name", "-f", "-", input=stream).stdout.split()
    )
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=stream)
    try:
        yield cp
    finally:
        created = [
            o
            for o in static
            if not any(
                e.endswith("/" + o["metadata"]["name"]) and e.split("/")[0].split(".")[0] == o["kind"].lower()
                for e in existing
            )
        ]
        cp.kubectl(
            "delete",
            "--ignore-not-found",
            "--wait=false",
            "-f",
            "-",
            input=yaml.safe_dump_all(created),
            check=False,
        )


def test_rendered_manifests_pass_server_side_dry_run(installed: ControlPlane) -> None:
    proc = installed.kubectl(
        "apply", "--server-side", "--force-conflicts", "--dry-run=server", "-k", str(DEPLOY)
    )
    out = proc.stdout
    for line in (
        "deployment.apps/dynamig-operator serverside-applied (server dry run)",
        "daemonset.apps/dynamig-agent serverside-applied (server dry run)",
        "deviceclass.resource.k8s.io/mig.dynamig.io serverside-applied (server dry run)",
        "clusterkopfpeering.kopf.dev/dynamig serverside-applied (server dry run)",
    ):
        assert line in out, out
    assert "Warning" not in proc.stderr, proc.stderr


def test_metrics_network_policy_selects_the_pods_and_their_metrics_port(
    installed: ControlPlane, helm: str
) -> None:
    """Off by default; on, one NetworkPolicy per part whose selector matches that part's pods and whose port
    is the pods' named metrics port, accepted by the real API server."""
    assert not [o for o in docs(render(helm).stdout) if o["kind"] == "NetworkPolicy"]
    peer = "metrics.networkPolicy.from[0].podSelector.matchLabels.app=prometheus"
    objs = docs(render(helm, "metrics.networkPolicy.enabled=true", peer).stdout)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert len(policies) == 2
    for workload in (find(objs, "Deployment"), find(objs, "DaemonSet")):
        pod = workload["spec"]["template"]
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        selecting = [
            np
            for np in policies
            if np["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        ]
        assert len(selecting) == 1, workload["kind"]
        (rule,) = selecting[0]["spec"]["ingress"]
        assert {p["port"] for p in rule["ports"]} == {"metrics"} <= ports
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app": "prometheus"}}}]
    proc = installed.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(policies))
    assert proc.stdout.count("networkpolicy.networking.k8s.io/") == 2, proc.stdout


def test_examples_pass_server_side_dry_run(installed: ControlPlane) -> None:
    installed.kubectl("create", "namespace", "dynamig-examples", check=False)
    try:
        proc = installed.kubectl("apply", "--server-side", "--dry-run=server", "-k", str(EXAMPLES))
    finally:
        installed.kubectl("delete", "namespace", "dynamig-examples", "--wait=false", check=False)
    kinds = {line.split("/")[0].split(".")[0] for line in proc.stdout.splitlines() if "/" in line}
    assert {"gpupartitionpolicy", "resourceclaimtemplate"} <= kinds, proc.stdout


def test_namespace_pod_security_labels(installed: ControlPlane) -> None:
    ns = yaml.safe_load(installed.kubectl("get", "namespace", NS, "-o", "yaml").stdout)
    labels = ns["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"


def _pod_from(template_owner: dict[str, Any], name: str, namespace: str) -> dict[str, Any]:
    spec = copy.deepcopy(template_owner["spec"]["template"]["spec"])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "spec": spec,
        "metadata": {"name": name, "namespace": namespace},
    }


def test_operator_pod_passes_restricted_and_agent_pod_needs_privileged(
    installed: ControlPlane, namespace: str
) -> None:
    """A namespace enforcing ``restricted`` admits the operator's pod and refuses the agent's."""
    cp = installed
    cp.kubectl(
        "label",
        "namespace",
        namespace,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    )
    cp.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {
                "apiVersion": "node.k8s.io/v1",
                "kind": "RuntimeClass",
                "metadata": {"name": "nvidia"},
                "handler": "nvidia",
            }
        ),
    )
    objs = deploy_objects()
    operator_pod = _pod_from(find(objs, "Deployment"), "operator-check", namespace)
    operator_pod["spec"]["serviceAccountName"] = "default"
    proc = cp.kubectl(
        "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(operator_pod), check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "violates PodSecurity" not in proc.stderr

    agent_pod = _pod_from(find(objs, "DaemonSet"), "agent-check", namespace)
    agent_pod["spec"]["serviceAccountName"] = "default"
    proc = cp.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(agent_pod), check=False)
    assert proc.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in proc.stderr
    assert 'privileged (container "agent" must not set securityContext.privileged=true)' in proc.stderr, (
        proc.stderr
    )
    assert 'use restricted volume type "hostPath"' in proc.stderr, proc.stderr

    # In its own namespace (enforce=privileged) the agent's pod is admitted.
    agent_pod = _pod_from(find(objs, "DaemonSet"), "agent-check", NS)
    proc = cp.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(agent_pod), check=False)
    assert proc.returncode == 0, proc.stderr


OPERATOR_ALLOWED = [
    ("list", "resourceclaims.resource.k8s.io", "--all-namespaces"),
    ("watch", "pods", "--all-namespaces"),
    ("list", "resourceslices.resource.k8s.io"),
    ("get", "deviceclasses.resource.k8s.io"),
    ("list", "nodes"),
    ("patch", "gpupartitions.dynamig.io"),
    ("watch", "gpupartitionpolicies.dynamig.io"),
    ("patch", "gpupartitionpolicies.dynamig.io", "--subresource=status"),
    ("create", "events", "-n", "default"),
    ("create", "events.events.k8s.io", "-n", "team-a"),
    ("patch", "clusterkopfpeerings.kopf.dev"),
    ("patch", "gpupartitions.dynamig.io", "--subresource=status"),
    ("list", "leases.coordination.k8s.io", "-n", NS),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
    # a silent agent's node: its slices withdrawn, its waiting bookings failed
    ("delete", "resourceslices.resource.k8s.io"),
    ("update", "resourceclaims.resource.k8s.io", "--subresource=status", "-n", "default"),
    ("arbitrary-node:update", "resourceclaims.resource.k8s.io/mig.dynamig.io", "--subresource=driver"),
    # and, once fenced for a while, its bound pods that never started deleted for their controllers
    ("delete", "pods", "-n", "default"),
    # and, where served, its devices tainted NoSchedule until its agent is back
    ("create", "devicetaintrules.resource.k8s.io"),
    ("delete", "devicetaintrules.resource.k8s.io"),
    ("list", "devicetaintrules.resource.k8s.io"),
    # The DeviceClass per offered profile serving the device plugin's resource names (operator/extended.py).
    ("create", "deviceclasses.resource.k8s.io"),
    ("update", "deviceclasses.resource.k8s.io"),
    ("delete", "deviceclasses.resource.k8s.io"),
    # Preemption: which pods a PodDisruptionBudget protects, and (Evict) evicting victims through the
    # Eviction API, which honours those budgets.
    ("list", "poddisruptionbudgets.policy", "--all-namespaces"),
    ("create", "pods", "--subresource=eviction", "-n", "default"),
    # and which namespaces take part (spec.preemption.namespaceSelector)
    ("list", "namespaces"),
]
OPERATOR_DENIED = [
    ("create", "resourceslices.resource.k8s.io"),
    ("update", "resourceclaims.resource.k8s.io", "-n", "default"),
    ("update", "resourceslices.resource.k8s.io"),
    ("deletecollection", "resourceslices.resource.k8s.io"),
    ("arbitrary-node:update", "resourceclaims.resource.k8s.io/gpu.nvidia.com", "--subresource=driver"),
    ("update", "devicetaintrules.resource.k8s.io"),
    ("create", "pods", "-n", "default"),
    ("update", "pods", "-n", "default"),
    ("deletecollection", "pods", "-n", "default"),
    ("create", "gpupartitions.dynamig.io"),
    ("delete", "gpupartitions.dynamig.io"),
    ("update", "gpupartitions.dynamig.io", "--subresource=status"),
    ("delete", "gpupartitionpolicies.dynamig.io"),
    ("get", "secrets", "-n", NS),
    ("list", "secrets", "--all-namespaces"),
    ("patch", "nodes"),
    ("create", "leases.coordination.k8s.io", "-n", NS),
    ("list", "leases.coordination.k8s.io", "--all-namespaces"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io"),
    ("patch", "deviceclasses.resource.k8s.io"),
    ("deletecollection", "deviceclasses.resource.k8s.io"),
    ("update", "gpupartitions.dynamig.io"),
    ("update", "gpupartitionpolicies.dynamig.io", "--subresource=status"),
    # Budgets are only read.
    ("create", "poddisruptionbudgets.policy", "-n", "default"),
    ("get", "poddisruptionbudgets.policy", "-n", "default"),
]
AGENT_ALLOWED = [
    ("create", "events", "-n", "default"),
    ("patch", "events", "-n", "default"),
    ("update", "resourceclaims.resource.k8s.io", "--subresource=status", "-n", "default"),
    ("create", "resourceslices.resource.k8s.io"),
    ("delete", "resourceslices.resource.k8s.io"),
    ("watch", "resourceclaims.resource.k8s.io", "--all-namespaces"),
    ("create", "gpupartitions.dynamig.io"),
    ("patch", "gpupartitions.dynamig.io", "--subresource=status"),
    ("get", "nodes"),
    ("create", "leases.coordination.k8s.io", "-n", NS),
    ("patch", "leases.coordination.k8s.io", "-n", NS),
    ("list", "pods", "--all-namespaces"),  # pods in a binding cycle toward its node
    # a stranded pod given back (agent/bindings/stranded.py; the admission policy keeps it to its own node's
    # pods)
    ("get", "pods", "-n", NS),
    ("delete", "pods", "-n", NS),
]
AGENT_DENIED = [
    ("patch", "resourceslices.resource.k8s.io"),
    ("deletecollection", "resourceslices.resource.k8s.io"),
    ("update", "gpupartitions.dynamig.io", "--subresource=status"),
    ("update", "resourceclaims.resource.k8s.io", "--subresource=binding", "-n", "default"),
    ("patch", "gpupartitions.dynamig.io"),
    ("update", "gpupartitions.dynamig.io"),
    ("delete", "events", "-n", "default"),
    ("patch", "gpupartitionpolicies.dynamig.io"),
    ("update", "resourceclaims.resource.k8s.io", "-n", "default"),
    ("create", "pods", "-n", NS),
    ("update", "pods", "-n", NS),
    ("watch", "pods", "--all-namespaces"),
    ("get", "secrets", "-n", NS),
    ("list", "secrets", "--all-namespaces"),
    ("patch", "nodes"),
    ("delete", "nodes"),
    ("create", "deviceclasses.resource.k8s.io"),
    ("patch", "clusterkopfpeerings.kopf.dev"),
    ("get", "leases.coordination.k8s.io", "-n", NS),
    ("delete", "leases.coordination.k8s.io", "-n", NS),
    ("create", "leases.coordination.k8s.io", "-n", "kube-node-lease"),
]


def test_rbac_least_privilege(installed: ControlPlane) -> None:
    cases = (
        [(OPERATOR_SA, a, True) for a in OPERATOR_ALLOWED]
        + [(OPERATOR_SA, a, False) for a in OPERATOR_DENIED]
        + [(AGENT_SA, a, True) for a in AGENT_ALLOWED]
        + [(AGENT_SA, a, False) for a in AGENT_DENIED]
    )
    wrong = [
        f"{user.rsplit(':', 1)[1]} {' '.join(args)}: expected {'yes' if want else 'no'}"
        for user, args, want in cases
        if can_i(installed, user, *args) != want
    ]
    assert not wrong, "\n".join(wrong)


def _slice(node: str, name: str, driver: str = "mig.dynamig.io") -> dict[str, Any]:
    """An empty slice of ``driver`` in ``node``'s pool, named ``name``, as the slice builder makes it."""
    (made,) = build_resource_slices(node, 1, [], driver)
    made["metadata"] = {"name": name}
    return made


def _partition(node: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "dynamig.io/v1alpha1",
        "kind": "GpuPartition",
        "metadata": {"name": name, "labels": {"dynamig.io/node": node}},
        "spec": {"layout": [{"profile": "3g.40gb", "start": 0}]},
    }


def _as_agent(cp: ControlPlane, obj: dict[str, Any], node: str | None) -> subprocess.CompletedProcess[str]:
    ns = NS
    extra = [f"--as-user-extra={NODE_EXTRA}={node}"] if node else []
    return cp.kubectl(
        "create",
        "--dry-run=server",
        "-f",
        "-",
        f"--as={AGENT_SA}",
        "--as-group=system:serviceaccounts",
        f"--as-group=system:serviceaccounts:{ns}",
        "--as-group=system:authenticated",
        *extra,
        input=yaml.safe_dump(obj),
        check=False,
    )


def test_node_admission_policy_confines_each_agent_to_its_node(installed: ControlPlane) -> None:
    cp = installed
    # The policy is compiled asynchronously after it is created: wait until it denies.
    deadline = time.monotonic() + 30
    while True:
        denied = _as_agent(cp, _slice("node-b", "node-b-mig"), "node-a")
        if denied.returncode != 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert denied.returncode != 0, denied.stdout
    assert "the dynamig agent on node node-a may not write ResourceSlices of node node-b" in denied.stderr

    ok = _as_agent(cp, _slice("node-a", "node-a-mig.dynamig.io-0"), "node-a")
    assert ok.returncode == 0, ok.stderr

    no_identity = _as_agent(cp, _slice("node-a", "node-a-mig.dynamig.io-0"), None)
    assert no_identity.returncode != 0
    assert "the dynamig agent has no node identity" in no_identity.stderr

    other_driver = _as_agent(
        cp, _slice("node-a", "node-a-mig.dynamig.io-1", driver="gpu.nvidia.com"), "node-a"
    )
    assert other_driver.returncode != 0
    assert "may only write ResourceSlices of driver mig.dynamig.io" in other_driver.stderr

    ok = _as_agent(cp, _partition("node-a", "node-a-gpu0"), "node-a")
    assert ok.returncode == 0, ok.stderr
    denied = _as_agent(cp, _partition("node-b", "node-b-gpu0"), "node-a")
    assert denied.returncode != 0
    assert "may not write GpuPartition node-b-gpu0 of node node-b" in denied.stderr
    unlabelled = _partition("node-a", "node-a-gpu1")
    del unlabelled["metadata"]["labels"]
    denied = _as_agent(cp, unlabelled, "node-a")
    assert denied.returncode != 0 and "no dynamig.io/node label" in denied.stderr

    # Other users (the cluster admin here) are not matched by the policy.
    admin = cp.kubectl(
        "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(_slice("node-b", "x")), check=False
    )
    assert admin.returncode == 0, admin.stderr


def test_node_admission_policy_checks_status_updates(installed: ControlPlane) -> None:
    """An agent may not relabel, delete or report status for another node's GpuPartition."""
    cp = installed
    name = "node-b-gpu9"
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(_partition("node-b", name)))
    try:
        flags = [
            f"--as={AGENT_SA}",
            "--as-group=system:serviceaccounts",
            f"--as-group=system:serviceaccounts:{NS}",
            "--as-group=system:authenticated",
        ]
        # RBAC alone keeps the agent off the spec and labels; the policy keeps it off other nodes' objects.
        relabel = cp.kubectl(
            "label",
            "--overwrite",
            "--dry-run=server",
            "gpupartition",
            name,
            "dynamig.io/node=node-a",
            *flags,
            f"--as-user-extra={NODE_EXTRA}=node-a",
            check=False,
        )
        assert relabel.returncode != 0
        assert 'cannot patch resource "gpupartitions"' in relabel.stderr
        delete = cp.kubectl(
            "delete",
            "--dry-run=server",
            "gpupartition",
            name,
            *flags,
            f"--as-user-extra={NODE_EXTRA}=node-a",
            check=False,
        )
        assert delete.returncode != 0
        assert f"may not write GpuPartition {name} of node node-b" in delete.stderr
        delete = cp.kubectl(
            "delete",
            "--dry-run=server",
            "gpupartition",
            name,
            *flags,
            f"--as-user-extra={NODE_EXTRA}=node-b",
            check=False,
        )
        assert delete.returncode == 0, delete.stderr
        status = cp.kubectl(
            "patch",
            "gpupartition",
            name,
            "--subresource=status",
            "--type=merge",
            "--dry-run=server",
            "-p",
            '{"status":{"node":"node-b","phase":"Stable"}}',
            *flags,
            f"--as-user-extra={NODE_EXTRA}=node-b",
            check=False,
        )
        assert status.returncode == 0, status.stderr
        status = cp.kubectl(
            "patch",
            "gpupartition",
            name,
            "--subresource=status",
            "--type=merge",
            "--dry-run=server",
            "-p",
            '{"status":{"node":"node-a"}}',
            *flags,
            f"--as-user-extra={NODE_EXTRA}=node-a",
            check=False,
        )
        assert status.returncode != 0
    finally:
        cp.kubectl("delete", "gpupartition", name, "--ignore-not-found", check=False)


# ------------------------------------------------------------------------------------------------ dashboard
def test_grafana_dashboard_uses_only_exported_metrics() -> None:
    dash = json.loads((ROOT / "dashboards" / "dynamig.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]), "panel ids repeat"
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in panels}
    registered = registered_metric_names()
    used = set()
    for title, queries in exprs.items():
        for expr in queries:
            for series in re.findall(r"dynamig_[a-z_]+", expr):
                assert metric_family(series) in registered, f"panel {title!r}: {series} is not exported"
                used.add(metric_family(series))
    # What the dashboard is for: layouts, demand by profile and reason, reshape latency, NVML errors.
    assert {
        "dynamig_mig_instances",
        "dynamig_operator_pending_devices",
        "dynamig_reshape_duration_seconds",
        "dynamig_nvml_errors",
        "dynamig_reshape_operations",
    } <= used
    assert any("by (reason)" in e for q in exprs.values() for e in q)
    assert any("by (profile)" in e for q in exprs.values() for e in q)


# ------------------------------------------------------------------------------------------------ helm
HELM_RELEASE = "dynamig-helm"
HELM_NS = "dynamig-helm"
# Keep the release's pods unschedulable (no kubelet would run them) and its cluster-scoped names apart from
# the kubectl-applied install above.
HELM_VALUES = {
    "features": {"deviceClass": False},
    "operator": {
        "replicas": 1,
        "peering": {"name": "dynamig-helm"},
        "nodeSelector": {"dynamig.io/test-never": "true"},
    },
    "agent": {"nodeSelector": {"dynamig.io/test-never": "true"}},
}


def _crd_columns(cp: ControlPlane, name: str) -> list[str]:
    crd = json.loads(cp.kubectl("get", "crd", name, "-o", "json").stdout)
    return [c["name"] for c in crd["spec"]["versions"][0].get("additionalPrinterColumns", [])]


def test_helm_upgrade_updates_the_crds_and_uninstall_keeps_them(
    installed: ControlPlane, helm: str, tmp_path: Path
) -> None:
    """A real helm install, upgrade and uninstall against the API server."""
    cp = installed
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(HELM_VALUES))
    env = cp.env()

    def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [helm, *args, "--namespace", HELM_NS],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    # The CRDs already exist (applied above): mark them adoptable by the release, as a user moving from
    # the plain manifests to Helm would.
    crds = ("gpupartitions.dynamig.io", "gpupartitionpolicies.dynamig.io")
    adopt_crds(cp, crds, HELM_RELEASE, HELM_NS)
    try:
        run_helm("install", HELM_RELEASE, str(chart), "--create-namespace", "-f", str(values))
        assert "Canary" not in _crd_columns(cp, "gpupartitions.dynamig.io")
        cp.kubectl("get", "clusterrole", f"{HELM_RELEASE}-operator", f"{HELM_RELEASE}-agent")

        # A new CRD revision in the chart (an extra printer column) reaches the cluster on helm upgrade.
        crd_file = chart / "files" / "crds" / "gpupartitions.yaml"
        doc = yaml.safe_load(crd_file.read_text())
        doc["spec"]["versions"][0]["additionalPrinterColumns"].append(
            {"name": "Canary", "type": "string", "jsonPath": ".status.model"}
        )
        crd_file.write_text(yaml.safe_dump(doc))
        run_helm("upgrade", HELM_RELEASE, str(chart), "-f", str(values))
        assert "Canary" in _crd_columns(cp, "gpupartitions.dynamig.io")

        # And back to the repository's CRD.
        shutil.copy(CHART / "files" / "crds" / "gpupartitions.yaml", crd_file)
        run_helm("upgrade", HELM_RELEASE, str(chart), "-f", str(values))
        assert "Canary" not in _crd_columns(cp, "gpupartitions.dynamig.io")

        # No kubelet here runs the pre-delete hook's Job; `dynamig uninstall` itself runs on the real node.
        run_helm("uninstall", HELM_RELEASE, "--no-hooks")
        # helm.sh/resource-policy: keep leaves the CRDs (and every object of their kinds) in place.
        for crd in crds:
            cp.kubectl("get", "crd", crd)
        gone = cp.kubectl("get", "clusterrole", f"{HELM_RELEASE}-operator", check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr
    finally:
        forget_release(cp, helm, HELM_RELEASE, HELM_NS, crds, ROOT / "crds")


# ------------------------------------------------------------------------------------------------ components
def _token_kubeconfig(cp: ControlPlane, token: str, path: Path) -> Path:
    """The admin kubeconfig with its user replaced by a bearer token. Side effect: writes ``path``."""
    config = yaml.safe_load(cp.kubeconfig_path.read_text())
    config["users"] = [{"name": config["users"][0]["name"], "user": {"token": token}}]
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def _agent_token(cp: ControlPlane, node: str) -> str:
    """A token of the agent's service account bound to a pod on ``node``, as the kubelet mounts it: it carries
    the node claim the admission policies read. Side effect: creates the pod (the caller deletes it)."""
    api = cp.rest()
    pod_name = f"agent-{node}"[:63]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod_name, "namespace": NS},
        "spec": {
            "nodeName": node,
            "serviceAccountName": "dynamig-agent",
            "containers": [{"name": "agent", "image": "example.invalid/dynamig:test"}],
        },
    }
    created = api.request("POST", f"/api/v1/namespaces/{NS}/pods", pod)
    bound = {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": created["metadata"]["uid"]}
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600, "boundObjectRef": bound},
    }
    token: str = api.request("POST", f"/api/v1/namespaces/{NS}/serviceaccounts/dynamig-agent/token", request)[
        "status"
    ]["token"]
    return token


def _event(name: str, kind: str, about: str, reporter: str, host: str = "", **fields: Any) -> dict[str, Any]:
    """A core/v1 Event in ``default`` about ``kind``/``about``, reported by ``reporter``, as the agent posts
    them (dynamig.kube.events.event_body). Pure."""
    return {
        "apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": "default"},
        "involvedObject": {"kind": kind, "name": about, "namespace": "default"},
        "type": "Warning", "reason": fields.pop("reason", "AllocatedInstanceLost"), "message": "forged",
        "source": {"component": fields.pop("component", "dynamig-agent"), **({"host": host} if host else {})},
        "reportingComponent": "dynamig-agent", "reportingInstance": reporter, "count": 1, **fields,
    }  # fmt: skip


def _allocated_claim(name: str, node: str, device: str = "gpu0-1g10gb-s0") -> dict[str, Any]:
    """A claim whose status allocates one of this driver's devices on ``node``, as the scheduler writes it."""
    claim = resource_claim(name, exactly('device.attributes["mig.dynamig.io"].profile == "1g.10gb"'))
    claim["metadata"]["namespace"] = "default"
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": "mig.dynamig.io", "pool": node, "device": device}]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        }
    }
    return claim


def _device_status(
    node: str, driver: str = "mig.dynamig.io", device: str = "gpu0-1g10gb-s0"
) -> dict[str, Any]:
    return {
        "driver": driver,
        "pool": node,
        "device": device,
        "conditions": [
            {
                "type": "mig.dynamig.io/ready",
                "status": "True",
                "reason": "Ready",
                "message": "cut",
                "lastTransitionTime": "2026-12-01T00:00:00Z",
            }
        ],
    }


def test_an_agents_own_token_cannot_write_another_nodes_objects(
    installed: ControlPlane, make_node: Callable[..., str], tmp_path: Path
) -> None:
    """Every write an agent can attempt on another node's objects, with its own node-bound token against the
    real API server: each denied, with the policy's message; its own node's objects stay writable."""
    cp = installed
    a, b = make_node("vap-a"), make_node("vap-b")
    kc = _token_kubeconfig(cp, _agent_token(cp, a), tmp_path / "agent.kubeconfig")
    try:
        _agent_cannot_write_another_nodes_objects(cp, kc, a, b)
    finally:
        cp.kubectl("delete", "pod", "-n", NS, f"agent-{a}"[:63], "--ignore-not-found", "--wait=false")
        cp.kubectl("delete", "resourceslice", f"{b}-mig.dynamig.io-0", "--ignore-not-found")
        cp.kubectl("delete", "gpupartition", f"{b}-gpu0", "--ignore-not-found")
        cp.kubectl("delete", "lease", "-n", NS, f"dynamig-agent-{b}", "--ignore-not-found")
        cp.kubectl("delete", "event", "-n", "default", f"sched-{a}", "--ignore-not-found")
        for node in (a, b):
            cp.kubectl("delete", "resourceclaim", "-n", "default", f"claim-{node}", "--ignore-not-found")


def _agent_cannot_write_another_nodes_objects(cp: ControlPlane, kc: Path, a: str, b: str) -> None:

    def as_agent(*args: str, obj: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        return cp.kubectl(
            *args, f"--kubeconfig={kc}", input=yaml.safe_dump(obj) if obj else None, check=False
        )  # the later --kubeconfig wins

    # B's objects, as B's agent and the scheduler would have written them.
    b_slice = _slice(b, f"{b}-mig.dynamig.io-0")
    b_part = _partition(b, f"{b}-gpu0")
    b_lease = lease_body(b, NS, time.time(), 60)
    # The scheduler's Event on some pod, as kube-scheduler reports it.
    sched_event = _event(f"sched-{a}", "Pod", "unrelated", "default-scheduler-abc", reason="FailedScheduling",
                         component="default-scheduler", reportingComponent="default-scheduler")  # fmt: skip
    for obj in (b_slice, b_part, b_lease, sched_event):
        cp.kubectl("create", "-f", "-", input=yaml.safe_dump(obj))
    claims = {"on-b": _allocated_claim(f"claim-{b}", b), "on-a": _allocated_claim(f"claim-{a}", a)}
    for claim in claims.values():
        status = claim.pop("status")
        cp.kubectl("create", "-f", "-", input=yaml.safe_dump(claim))
        claim["status"] = status
        cp.kubectl("replace", "--subresource=status", "-f", "-", input=yaml.safe_dump(claim))

    def answered(which: str, entry: dict[str, Any], keep_allocation: bool = True) -> dict[str, Any]:
        name = claims[which]["metadata"]["name"]
        got: dict[str, Any] = yaml.safe_load(
            cp.kubectl("get", "resourceclaim", "-n", "default", name, "-o", "yaml").stdout
        )
        got["status"]["devices"] = [entry]
        if not keep_allocation:
            del got["status"]["allocation"]
        return got

    def moved(obj: dict[str, Any], **spec: Any) -> dict[str, Any]:
        got: dict[str, Any] = yaml.safe_load(
            cp.kubectl("get", obj["kind"].lower(), obj["metadata"]["name"], "-o", "yaml").stdout
        )
        got["spec"] = {**got["spec"], **spec}
        return got

    a_lease_held_as_b = lease_body(a, NS, time.time(), 60)
    a_lease_held_as_b["spec"]["holderIdentity"] = b
    other_pool = _slice(a, f"{a}-mig.dynamig.io-7")
    other_pool["spec"]["pool"]["name"] = b
    mine = f"the dynamig agent on node {a}"
    posing = (
        f"{mine} may only post and change Events it reports as {a} (reportingInstance, source.host), not as"
    )
    denied = [
        ("a slice on B", ("create", "-f", "-"), _slice(b, f"{b}-mig.dynamig.io-9"),
         f"{mine} may not write ResourceSlices of node {b}"),
        ("a slice on A in B's pool", ("create", "-f", "-"), other_pool,
         f"{mine} may not write ResourceSlices of pool {b}"),
        ("a slice on A under B's slice names", ("create", "-f", "-"), _slice(a, f"{b}-mig.dynamig.io-8"),
         f"{mine} may only write ResourceSlices named {a}-mig.dynamig.io-*, not {b}-mig.dynamig.io-8"),
        ("B's slice republished", ("replace", "-f", "-"),
         moved(b_slice, pool={**b_slice["spec"]["pool"], "generation": 1000}),
         f"{mine} may not write ResourceSlices of node {b}"),
        ("B's slice deleted", ("delete", "resourceslice", b_slice["metadata"]["name"]), None,
         f"{mine} may not write ResourceSlices of node {b}"),
        ("a GpuPartition for B", ("create", "-f", "-"), _partition(b, f"{b}-gpu1"),
         f"{mine} may not write GpuPartition {b}-gpu1 of node {b}"),
        ("a GpuPartition named for B, labelled A", ("create", "-f", "-"), _partition(a, f"{b}-gpu2"),
         f"{mine} may only write GpuPartitions named {a}-gpu<index>, not {b}-gpu2"),
        ("B's GpuPartition deleted", ("delete", "gpupartition", f"{b}-gpu0"), None,
         f"{mine} may not write GpuPartition {b}-gpu0 of node {b}"),
        ("B's GpuPartition status", ("patch", "gpupartition", f"{b}-gpu0", "--subresource=status",
         "--type=merge", "-p", '{"status":{"phase":"Stable"}}'), None,
         f"{mine} may not write GpuPartition {b}-gpu0 of node {b}"),
        # A patch, as the agent renews (kubectl patch would GET first, which RBAC refuses).
        ("B's Lease renewed",
         ("apply", "--server-side", "--force-conflicts", "--field-manager=agent", "-f", "-"),
         lease_body(b, NS, time.time(), 60),
         f"{mine} may only write Lease dynamig-agent-{a}, not dynamig-agent-{b}"),
        ("a Lease for B", ("create", "-f", "-"), lease_body(b, NS, time.time(), 60) | {"metadata": {
            "name": f"dynamig-agent-{b}x", "namespace": NS}},
         f"{mine} may only write Lease dynamig-agent-{a}, not dynamig-agent-{b}x"),
        ("its own Lease held as B", ("create", "-f", "-"), a_lease_held_as_b,
         f"{mine} may only hold its Lease as {a} (holderIdentity and the dynamig.io/node label)"),
        ("its own Lease for decades", ("create", "-f", "-"), lease_body(a, NS, time.time(), 2_000_000_000),
         f"{mine} may not hold its Lease for more than 300s, not 2000000000s"),
        # Claims: the API server's own granular status authorization (1.36) decides, per driver and node.
        ("an answer on a claim allocated on B", ("replace", "--subresource=status", "-f", "-"),
         answered("on-b", _device_status(b)),
         'cannot arbitrary-node:update resource "resourceclaims/driver"'),
        ("an answer for another driver", ("replace", "--subresource=status", "-f", "-"),
         answered("on-a", _device_status(a, driver="gpu.nvidia.com")),
         'resourceclaims.resource.k8s.io "gpu.nvidia.com" is forbidden'),
        ("an answer in B's pool", ("replace", "--subresource=status", "-f", "-"),
         answered("on-a", _device_status(b)), "must be an allocated device in the claim"),
        ("a claim's allocation dropped", ("replace", "--subresource=status", "-f", "-"),
         answered("on-a", _device_status(a), keep_allocation=False),
         'cannot update resource "resourceclaims/binding"'),
        # Events people debug with: none about another node, none posing as another node, none rewritten.
        ("an Event on B's claim posing as B", ("create", "-f", "-"),
         _event(f"lost-{b}", "ResourceClaim", f"claim-{b}", b, host=b),
         f"{posing} {b}"),
        ("an Event from A's agent under B's host", ("create", "-f", "-"),
         _event(f"host-{b}", "ResourceClaim", f"claim-{b}", a, host=b),
         f"{posing} {b}"),
        ("AgentSilent about node B", ("create", "-f", "-"),
         _event(f"silent-{b}", "Node", b, a, host=a, reason="AgentSilent"),
         f"{mine} may only post Events about its Node, its GpuPartitions and ResourceClaims, not Node {b}"),
        ("an Event on B's GpuPartition", ("create", "-f", "-"),
         _event(f"gpu-{b}", "GpuPartition", f"{b}-gpu0", a, host=a),
         f"{mine} may only post Events about its Node, its GpuPartitions and ResourceClaims, "
         f"not GpuPartition {b}-gpu0"),
        # Node A's name is a prefix of node <A>-gpu-1's GpuPartition names: only <A>-gpu<index> are A's.
        ("an Event on the GpuPartition of node <A>-gpu-1", ("create", "-f", "-"),
         _event(f"gpu-prefix-{a}", "GpuPartition", f"{a}-gpu-1-gpu0", a, host=a),
         f"{mine} may only post Events about its Node, its GpuPartitions and ResourceClaims, "
         f"not GpuPartition {a}-gpu-1-gpu0"),
        ("the scheduler's Event rewritten",
         ("apply", "--server-side", "--force-conflicts", "--field-manager=agent", "-f", "-"),
         {**sched_event, "message": "forged", "count": 9, "reportingInstance": a, "source": {"host": a}},
         f"{posing} default-scheduler-abc"),
    ]  # fmt: skip
    # A policy takes effect a moment after it is created: wait until the first case is denied.
    deadline = time.monotonic() + 30
    while as_agent("create", "--dry-run=server", "-f", "-", obj=denied[0][2]).returncode == 0:
        assert time.monotonic() < deadline, "the node admission policy never took effect"
        time.sleep(0.5)
    wrong = []
    for what, args, body, message in denied:
        got = as_agent(*args, "--dry-run=server", obj=body)
        if got.returncode == 0 or message not in got.stderr:
            wrong.append(f"{what}: rc={got.returncode} {got.stderr.strip() or got.stdout.strip()}")
    assert not wrong, "\n".join(wrong)

    # Its own node's objects: every one of these writes goes through.
    allowed: list[tuple[tuple[str, ...], dict[str, Any]]] = [
        (("create", "-f", "-"), _slice(a, f"{a}-mig.dynamig.io-0")),
        (("create", "-f", "-"), _partition(a, f"{a}-gpu0")),
        (("create", "-f", "-"), lease_body(a, NS, time.time(), 60)),
        (("replace", "--subresource=status", "-f", "-"), answered("on-a", _device_status(a))),
        (("create", "-f", "-"), _event(f"own-{a}", "Node", a, a, host=a, reason="NvmlUnavailable")),
        (("create", "-f", "-"), _event(f"gpu-{a}", "GpuPartition", f"{a}-gpu0", a, host=a)),
        (("create", "-f", "-"), _event(f"claim-{a}", "ResourceClaim", f"claim-{a}", a, host=a)),
    ]
    for args, body in allowed:
        got = as_agent(*args, "--dry-run=server", obj=body)
        assert got.returncode == 0, f"{args}: {got.stderr}"


def _wait_for(what: str, check: Callable[[], bool], proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, f"the process exited while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def test_agent_and_operator_run_with_exactly_the_rbac_the_manifests_grant(
    installed: ControlPlane, make_node: Callable[..., str], tmp_path: Path
) -> None:
    """The real agent (simulated GPUs) and operator, each with its service account's own token.

    The agent's token is bound to a pod assigned to its node, as the kubelet would mount it, so it carries
    the node claim the admission policy checks.
    """
    cp = installed
    node = make_node("rbac", labels={"dynamig.io/managed": "true"})
    pod_name = f"agent-{node}"[:63]
    # As in their pods: the namespace from the downward API (the heartbeat Leases live there).
    pod_env = {**os.environ, "POD_NAMESPACE": NS}
    api = cp.rest()
    token = _agent_token(cp, node)
    policy = f"rbac-{node}"[:63]
    agent = operator = None
    try:
        agent_kc = _token_kubeconfig(cp, token, tmp_path / "agent.kubeconfig")

        # The policy holds for the real token too: another node's slice is refused. (A policy takes effect
        # a moment after it is created, hence the retries.)
        deadline = time.monotonic() + 30
        while True:
            denied = subprocess.run(
                [
                    str(cp.binaries.kubectl),
                    f"--kubeconfig={agent_kc}",
                    "create",
                    "--dry-run=server",
                    "-f",
                    "-",
                ],
                input=yaml.safe_dump(_slice("some-other-node", "x")),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            if denied.returncode != 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert denied.returncode != 0
        assert f"the dynamig agent on node {node} may not write ResourceSlices of node some-other-node" in (
            denied.stderr
        )

        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dynamig",
                "agent",
                f"--node={node}",
                "--nvml=simulated",
                "--simulate-gpus=A100-80GB:1",
                f"--kubeconfig={agent_kc}",
                "--metrics-port=-1",
                "--interval=1",
                "--settle-seconds=0.5",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=pod_env,
        )

        def published() -> bool:
            proc = cp.kubectl(
                "get", "resourceslices", "--field-selector", f"spec.nodeName={node}", "-o", "name"
            )
            part = cp.kubectl(
                "get", "gpupartition", f"{node}-gpu0", "-o", "jsonpath={.status.phase}", check=False
            )
            return bool(proc.stdout.strip()) and part.stdout.strip() == "Stable"

        _wait_for("the agent to publish its GPU", published, agent)
        # Its heartbeat, written with its own token and the chart's Role, where the operator reads it.
        lease = json.loads(cp.kubectl("get", "lease", "-n", NS, f"dynamig-agent-{node}", "-o", "json").stdout)
        assert lease["spec"]["holderIdentity"] == node

        # Owned by its Node (the garbage collector removes it with the Node), which the agent may write.
        def owned() -> bool:
            got = cp.kubectl("get", "lease", "-n", NS, f"dynamig-agent-{node}", "-o", "json").stdout
            return [o["kind"] for o in json.loads(got)["metadata"].get("ownerReferences") or []] == ["Node"]

        _wait_for("the agent's Lease to be owned by its Node", owned, agent, timeout=30)

        cp.kubectl(
            "apply",
            "-f",
            "-",
            input=yaml.safe_dump(
                {
                    "apiVersion": "dynamig.io/v1alpha1",
                    "kind": "GpuPartitionPolicy",
                    "metadata": {"name": policy},
                    "spec": {
                        "mode": "DryRun",
                        "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node}},
                    },
                }
            ),
        )
        op_token = api.request(
            "POST",
            f"/api/v1/namespaces/{NS}/serviceaccounts/dynamig-operator/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": 3600},
            },
        )["status"]["token"]
        op_kc = _token_kubeconfig(cp, op_token, tmp_path / "operator.kubeconfig")
        operator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dynamig",
                "operator",
                f"--kubeconfig={op_kc}",
                "--peering=dynamig",
                "--metrics-port=0",
                "--resync-seconds=2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=pod_env,
        )

        def governed() -> bool:
            proc = cp.kubectl("get", "gpp", policy, "-o", "jsonpath={.status.matchedGpus}", check=False)
            return proc.stdout.strip() == "1"

        _wait_for("the operator to report the policy's GPU", governed, operator)
        peers = json.loads(cp.kubectl("get", "clusterkopfpeering", "dynamig", "-o", "json").stdout)
        assert peers.get("status"), "the operator did not record itself in the peering object"
    finally:
        # The operator removes its finalizer from the policy, so delete the policy while it still runs.
        cp.kubectl("delete", "gpp", policy, "--ignore-not-found", "--wait=false", check=False)
        if operator is not None and operator.poll() is None:
            with contextlib.suppress(AssertionError):
                _wait_for(
                    "the policy to go",
                    lambda: cp.kubectl("get", "gpp", policy, check=False).returncode != 0,
                    operator,
                    timeout=20,
                )
        logs = {name: _stop(p) for name, p in (("agent", agent), ("operator", operator)) if p is not None}
        cp.kubectl(
            "patch", "gpp", policy, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
        )
        cp.kubectl("delete", "pod", "-n", NS, pod_name, "--grace-period=0", "--force", check=False)
    for name, log in logs.items():
        assert "forbidden" not in log.lower(), f"{name} was refused something:\n{log[-4000:]}"


def test_workload_arguments_parse_with_the_real_cli(helm: str) -> None:
    """The chart passes only arguments `dynamig operator` and `dynamig agent` accept (no flag drift)."""
    from dynamig.cli import build_parser

    parser = build_parser()
    for sets in ((), ("logging.format=json", "logging.level=debug", "features.kubeletPlugin=false")):
        objs = docs(render(helm, *sets).stdout)
        for kind, command in (("Deployment", "operator"), ("DaemonSet", "agent")):
            args = find(objs, kind)["spec"]["template"]["spec"]["containers"][0]["args"]
            assert args[0] == command
            argv = [a.replace("$(NODE_NAME)", "gpu-node-1") for a in args]
            try:
                parsed = parser.parse_args(argv)
            except SystemExit as exc:  # argparse exits on an unknown flag
                raise AssertionError(f"{kind} args rejected by `dynamig {command}`: {argv}") from exc
            assert parsed.command == command
            assert parsed.log_level.upper() in ("DEBUG", "INFO")
    agent = parser.parse_args(
        [
            a.replace("$(NODE_NAME)", "n")
            for a in find(docs(render(helm, "features.kubeletPlugin=false").stdout), "DaemonSet")["spec"][
                "template"
            ]["spec"]["containers"][0]["args"]
        ]
    )
    assert agent.kubelet_plugin is False and agent.nvml == "real" and agent.node == "n"


def test_secure_metrics_switch_both_parts_to_tls_and_token_review(helm: str) -> None:
    """metrics.secure: each part gets the TLS pair and --metrics-authorize (as the real CLI parses them), its
    probes still answer without a token, and nothing of it renders when off."""
    from dynamig.cli import build_parser
    from dynamig.cli._metrics import metrics_tls_files

    objs = docs(render(helm, "metrics.secure.enabled=true").stdout)
    for kind in ("Deployment", "DaemonSet"):
        pod = find(objs, kind)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        args = build_parser().parse_args([a.replace("$(NODE_NAME)", "n") for a in container["args"]])
        pair = metrics_tls_files(args)
        assert args.metrics_authorize and pair is not None
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "metrics-tls"]
        assert all(str(p.parent) == mount["mountPath"] for p in pair)
        (volume,) = [v for v in pod["volumes"] if v["name"] == "metrics-tls"]
        assert volume["secret"]["secretName"] == "dynamig-metrics-tls"
        probes = [container[p] for p in ("startupProbe", "livenessProbe", "readinessProbe") if p in container]
        for probe in probes:
            assert "tcpSocket" in probe or probe["httpGet"]["path"] != "/metrics", probe
            if probe.get("httpGet", {}).get("port") == "metrics":
                assert probe["httpGet"]["scheme"] == "HTTPS", probe
    assert find(objs, "Secret", "dynamig-metrics-tls")["type"] == "kubernetes.io/tls"
    for name in ("dynamig-operator-auth-delegator", "dynamig-agent-auth-delegator"):
        assert find(objs, "ClusterRoleBinding", name)["roleRef"]["name"] == "system:auth-delegator"
    rules = find(objs, "ClusterRole", "dynamig-metrics-reader")["rules"]
    assert rules == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]

    plain = docs(render(helm).stdout)
    assert not [
        o
        for o in plain
        if "metrics-tls" in o["metadata"]["name"] or "auth-delegator" in o["metadata"]["name"]
    ]
    assert (
        "--metrics-authorize"
        not in find(plain, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_the_lease_bound_is_the_operators_in_the_chart_the_cli_and_the_policy(helm: str) -> None:
    """One number: the longest Lease the operator counts is what agent.leaseSeconds, `dynamig agent
    --lease-seconds` and the Lease admission policy accept; the chart's default is the agent's."""
    from dynamig.cli import build_parser
    from dynamig.kube.heartbeat import DEFAULT_LEASE_SECONDS, MAX_LEASE_SECONDS

    top = int(MAX_LEASE_SECONDS)
    objs = docs(render(helm, f"agent.leaseSeconds={top}").stdout)
    args = find(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert build_parser().parse_args(args).lease_seconds == top
    policy = find(objs, "ValidatingAdmissionPolicy", "dynamig-agent-node-leases")
    limits = [
        v["expression"] for v in policy["spec"]["validations"] if "leaseDurationSeconds" in v["expression"]
    ]
    assert limits == [f"variables.obj.spec.?leaseDurationSeconds.orValue(0) <= {top}"], limits
    default = find(docs(render(helm).stdout), "DaemonSet")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert f"--lease-seconds={DEFAULT_LEASE_SECONDS}" in default
    assert render(helm, f"agent.leaseSeconds={top + 1}", check=False).returncode != 0


# ------------------------------------------------------------------------------------------------ examples
@pytest.mark.parametrize(
    ("template", "model", "expected"),
    [
        ("claimtemplate-inference.yaml", "A100-80GB", [{"1g.10gb"}, {"2g.20gb"}]),
        ("claimtemplate-inference.yaml", "H100-80GB", [{"1g.10gb"}, {"2g.20gb"}]),
        ("claimtemplate-training.yaml", "A100-80GB", [{"3g.40gb"}, {"3g.40gb", "4g.40gb", "7g.80gb"}]),
        ("claimtemplate-training.yaml", "H100-80GB", [{"3g.40gb"}, {"3g.40gb", "4g.40gb", "7g.80gb"}]),
    ],
)
def test_example_claims_accept_the_profiles_their_comments_promise(
    template: str, model: str, expected: list[set[str]]
) -> None:
    """Each firstAvailable alternative, evaluated with the same CEL code and device builder the operator
    uses against every profile of the model, accepts exactly the profiles the example says."""
    from dynamig.geometry.catalog import load_catalog
    from dynamig.kube.cel import device_view, evaluate_selector
    from dynamig.kube.devices import MigDevice

    gpu = load_catalog().model(model)
    deviceclass = find(deploy_objects(), "DeviceClass")["spec"]["selectors"][0]["cel"]["expression"]
    doc = yaml.safe_load((EXAMPLES / template).read_text())
    alternatives = doc["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"]
    accepted = []
    for alt in alternatives:
        assert alt["deviceClassName"] == "mig.dynamig.io"
        exprs = [deviceclass] + [s["cel"]["expression"] for s in alt["selectors"]]
        ok = set()
        for profile in gpu.profiles:
            view = device_view(MigDevice(0, profile, profile.placement_starts[0], gpu.product_name, "GPU-x"))
            results = [evaluate_selector(e, view) for e in exprs]
            assert not [r.error for r in results if r.error], results
            if all(r.matched for r in results):
                ok.add(profile.name)
        accepted.append(ok)
    assert accepted == expected


def test_the_agent_goes_only_to_nodes_with_an_nvidia_gpu(helm: str) -> None:
    objs = docs(render(helm).stdout)
    agent = find(objs, "DaemonSet")
    terms = agent["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert keys == {"feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present"}
    assert agent["spec"]["template"]["spec"]["nodeSelector"] == {"dynamig.io/managed": "true"}


# ------------------------------------------------------------------------------------------------ removal
def test_the_uninstall_hook_renders_for_helm_only_and_its_job_parses(helm: str) -> None:
    """A pre-delete hook in the chart (off with uninstall.hook=false), never in the plain manifests (kubectl
    would run it at once), whose Job passes only arguments `dynamig uninstall` accepts."""
    from dynamig.cli import build_parser

    objs = docs(render(helm, "uninstall.leave=empty", "uninstall.timeoutSeconds=60").stdout)
    hooks = [o for o in objs if "helm.sh/hook" in (o["metadata"].get("annotations") or {})]
    assert {o["kind"] for o in hooks} == {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Job",
    }  # fmt: skip
    assert {o["metadata"]["annotations"]["helm.sh/hook"] for o in hooks} == {"pre-delete"}
    job = find(hooks, "Job")
    weights = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in hooks}
    assert all(weights[k] < weights["Job"] for k in weights if k != "Job"), "RBAC exists before the Job"
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = build_parser().parse_args(args)
    assert (parsed.command, parsed.leave, parsed.timeout, parsed.allow_unreported, parsed.yes) == (
        "uninstall",
        "empty",
        60,
        True,
        True,
    )
    assert parsed.operator_deployment == find(objs, "Deployment")["metadata"]["name"]
    assert not [o for o in docs(render(helm, "uninstall.hook=false").stdout) if o["kind"] == "Job"]
    assert not [o for o in deploy_objects() if "helm.sh/hook" in (o["metadata"].get("annotations") or {})]


def test_the_uninstall_hook_runs_with_exactly_its_rbac(
    installed: ControlPlane, helm: str, make_node: Callable[..., str], tmp_path: Path
) -> None:
    """`dynamig uninstall` as the hook's service account, against the real API server: its RBAC is enough
    (a 403 would fail it) and no broader than the table below; a node whose agent is gone does not block."""
    cp = installed
    hooks = [
        o for o in docs(render(helm).stdout)
        if "helm.sh/hook" in (o["metadata"].get("annotations") or {}) and o["kind"] != "Job"
    ]  # fmt: skip
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(hooks))
    sa = find(hooks, "ServiceAccount")["metadata"]["name"]
    who = f"system:serviceaccount:{NS}:{sa}"
    allowed = [
        ("patch", "deployments.apps/dynamig-operator", "--subresource=scale", "-n", NS),
        ("list", "leases.coordination.k8s.io", "-n", NS),
        ("delete", "gpupartitions.dynamig.io"),
        ("delete", "resourceslices.resource.k8s.io"),
    ]
    denied = [
        ("patch", "deployments.apps/other", "--subresource=scale", "-n", NS),
        ("delete", "gpupartitionpolicies.dynamig.io"),
        ("create", "resourceslices.resource.k8s.io"),
        ("get", "secrets", "-n", NS),
        ("patch", "nodes"),
    ]
    for verbs, expect in ((allowed, "yes"), (denied, "no")):
        for args in verbs:
            got = cp.kubectl("auth", "can-i", *args, f"--as={who}", check=False).stdout.strip()
            assert got == expect, (args, got)

    node = make_node("uninstall-rbac")
    part = _partition(node, f"{node}-gpu0")
    cp.kubectl("create", "-f", "-", input=yaml.safe_dump(part))
    token = json.loads(cp.kubectl("create", "token", sa, "-n", NS, "-o", "json").stdout)["status"]["token"]
    kubeconfig = _token_kubeconfig(cp, token, tmp_path / "hook.kubeconfig")
    done = subprocess.run(
        [sys.executable, "-m", "dynamig", "uninstall", f"--kubeconfig={kubeconfig}", f"--namespace={NS}",
         "--operator-deployment=dynamig-operator", f"--node={node}", "--timeout=3", "--yes"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr  # the agent never reported: listed, not fatal
    assert f"{node}-gpu0: left with" in done.stdout and "NOT reported" in done.stdout, done.stdout
    gone = cp.kubectl("get", "gpupartition", f"{node}-gpu0", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    cp.kubectl("delete", "-f", "-", "--ignore-not-found", input=yaml.safe_dump_all(hooks))


# ------------------------------------------------------------------------------------------ uninstall timing
HELM_DEFAULT_TIMEOUT_S = 300  # `helm uninstall --timeout` unless given


def test_the_uninstall_hook_ends_within_helms_default_timeout(helm: str) -> None:
    """A hook that outlasts helm's --timeout leaves the release `uninstalling` with its RBAC gone: by default
    the wait and the Job's deadline fit in helm's 5 minutes with a minute to spare, a wait that does not fit
    its deadline is refused, every hook object is replaced on a retry and removed on success, and a failed
    Job does not stay forever."""
    from dynamig.cli import build_parser

    objs = docs(render(helm).stdout)
    hooks = [o for o in objs if "helm.sh/hook" in (o["metadata"].get("annotations") or {})]
    for obj in hooks:
        policy = obj["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
        assert set(policy.split(",")) == {"before-hook-creation", "hook-succeeded"}, obj["kind"]
    job = find(hooks, "Job")["spec"]
    wait = build_parser().parse_args(job["template"]["spec"]["containers"][0]["args"]).timeout
    assert wait + 60 <= job["activeDeadlineSeconds"] <= HELM_DEFAULT_TIMEOUT_S - 60, (wait, job)
    assert job["ttlSecondsAfterFinished"] > 0

    refused = render(helm, "uninstall.timeoutSeconds=200", check=False)
    assert refused.returncode != 0
    assert (
        "uninstall.timeoutSeconds (200) does not fit in uninstall.activeDeadlineSeconds (240)"
        in refused.stderr
    )
    roomy = find(
        docs(render(helm, "uninstall.timeoutSeconds=600", "uninstall.activeDeadlineSeconds=900").stdout),
        "Job",
    )
    assert roomy["spec"]["activeDeadlineSeconds"] == 900
    assert "--timeout=600" in roomy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert render(helm, "uninstall.hook=false", "uninstall.timeoutSeconds=600").returncode == 0


# -------------------------------------------------------------------------------------------- metrics wiring
MONITORING = (
    "metrics.serviceMonitor.enabled=true",
    "metrics.serviceMonitor.skipCapabilityCheck=true",
    "metrics.prometheusRule.enabled=true",
    "metrics.prometheusRule.skipCapabilityCheck=true",
)


def _agent_exposition() -> str:
    """What an agent serves with one instance held by one pod and one shared by two pods of one claim."""
    metrics = AgentMetrics(CollectorRegistry(), "gpu-node-a")
    gpu = "GPU-7c4f0e2a-1b3d-4e5f-8a9b-0c1d2e3f4a5b"
    metrics.snapshot(
        (
            InstanceSample(
                0, gpu, "1g.10gb", 9, "MIG-aaaa", "gpu0-1g10gb-s6", "in-use", (("ml/infer", "infer-0"),),
            ),
            InstanceSample(
                0, gpu, "3g.40gb", 2, "MIG-bbbb", "gpu0-3g40gb-s0", "in-use",
                (("ml/shared", "shared-0"), ("ml/shared", "shared-1")),
            ),
        ),
        (),
    )  # fmt: skip
    return generate_latest(metrics.registry).decode()


def _claim_info(text: str) -> list[dict[str, str]]:
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "dynamig_mig_instance_claim_info"
    ]
    return [dict(s.labels) for s in family.samples]


def _selector(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def test_the_agent_scrape_keeps_the_claims_namespace_and_pod(helm: str) -> None:
    """The claim info series name the claim's namespace and pod; Prometheus would rename them exported_*
    (the target's own namespace and pod win) unless the agent's endpoint honours the scraped labels."""
    text = _agent_exposition()
    with_pod = {
        f.name
        for f in text_string_to_metric_families(text)
        if any({"namespace", "pod"} <= s.labels.keys() for s in f.samples)
    }
    assert with_pod == {"dynamig_mig_instance_claim_info"}
    objs = docs(render(helm, *MONITORING).stdout)
    monitors = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o
        for o in objs
        if o["kind"] == "ServiceMonitor"
    }
    (agent,) = monitors["agent"]["spec"]["endpoints"]
    assert agent["honorLabels"] is True
    (operator,) = monitors["operator"]["spec"]["endpoints"]
    assert not operator.get("honorLabels"), "the operator's series carry no namespace or pod of their own"


def test_the_documented_dcgm_join_attributes_mig_instances_to_pods(tmp_path: Path) -> None:
    """docs/operations.md's joins, evaluated by Prometheus' engine (promtool) over what the agent serves and
    dcgm-exporter series that name the host `hostname` (its label after 4.x) with another value: the join
    needs only UUID and GPU_I_ID, and its reversed form gives one series per pod of a shared instance."""
    try:
        promtool = str(build_tool("build-promtool.sh"))
    except BinariesNotFoundError as exc:
        pytest.fail(f"promtool could not be built from its Go module (make promtool): {exc}")
    doc = (ROOT / "docs" / "operations.md").read_text()
    section = doc.split("### Joining with dcgm-exporter", 1)[1].split("\n### ", 1)[0]
    join = " ".join(re.search(r"```\n(.*?)```", section, re.S).group(1).split())  # type: ignore[union-attr]
    assert "on(UUID, GPU_I_ID) group_left(namespace, pod) dynamig_mig_instance_claim_info" in join, join
    (reversed_join,) = re.findall(
        r"`(dynamig_mig_instance_claim_info \* on\(UUID, GPU_I_ID\)[^`]*)`", section
    )
    assert "honorLabels: true" in section

    claims = _claim_info(_agent_exposition())
    single = [c for c in claims if c["GPU_I_ID"] == "9"]
    shared = [c for c in claims if c["GPU_I_ID"] == "2"]
    assert len(single) == 1 and len(shared) == 2
    dcgm = {
        "hostname": "nvidia-dcgm-exporter-x7k2p",
        "UUID": single[0]["UUID"],
        "gpu": "0",
        "device": "nvidia0",
        "modelName": "NVIDIA A100-SXM4-80GB",
    }
    util = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"

    def case(
        claim: list[dict[str, str]], gi: str, profile: str, expr: str, want: list[dict[str, str]]
    ) -> Any:
        exporter = dcgm | {"GPU_I_ID": gi, "GPU_I_PROFILE": profile}
        return {
            "interval": "1m",
            "input_series": [
                *(
                    {"series": "dynamig_mig_instance_claim_info" + _selector(c), "values": "1x5"}
                    for c in claim
                ),
                {"series": util + _selector(exporter), "values": "0.75x5"},
                {"series": util + _selector(exporter | {"GPU_I_ID": "5"}), "values": "0.5x5"},
            ],
            "promql_expr_test": [
                {
                    "expr": expr,
                    "eval_time": "3m",
                    "exp_samples": [{"labels": _selector(w), "value": 0.75} for w in want],
                }
            ],
        }

    by_pod = dcgm | {"GPU_I_ID": "9", "GPU_I_PROFILE": "1g.10gb", "namespace": "ml", "pod": "infer-0"}
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            case(single, "9", "1g.10gb", join, [by_pod]),
            case(shared, "2", "3g.40gb", reversed_join, shared),
        ],
    }
    path = tmp_path / "dcgm_join_test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_runbook_url_is_absolute(helm: str) -> None:
    """Alertmanager and its receivers cannot follow a relative link: each runbook_url is the absolute base
    plus the alert's own anchor in docs/operations.md, none is rendered without a base, a relative one is
    refused."""
    base = "https://docs.example.org/dynamig/operations.md"
    rule = find(
        docs(render(helm, *MONITORING, f"metrics.prometheusRule.runbookBaseURL={base}").stdout),
        "PrometheusRule",
    )
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    runbooks = (ROOT / "docs" / "operations.md").read_text()
    for alert in alerts:
        url = alert["annotations"]["runbook_url"]
        parts = urlsplit(url)
        assert parts.scheme in ("http", "https") and parts.netloc, url
        assert url == f"{base}#{alert['alert'].lower()}" and f"#### {alert['alert']}\n" in runbooks, url
    plain = find(docs(render(helm, *MONITORING).stdout), "PrometheusRule")
    assert not [r for g in plain["spec"]["groups"] for r in g["rules"] if "runbook_url" in r["annotations"]]
    for bad in ("docs/operations.md", "//docs.example.org/ops.md", f"{base}#top"):
        proc = render(helm, *MONITORING, f"metrics.prometheusRule.runbookBaseURL={bad}", check=False)
        assert proc.returncode != 0
        assert "runbookBaseURL must be an absolute http(s) URL" in proc.stderr, proc.stderr


def test_metrics_network_policy_refuses_null_and_spells_out_nobody_and_everyone(
    installed: ControlPlane, helm: str
) -> None:
    """`from: null` used to render a rule without peers, which admits every source: it is refused. `[]`
    admits nobody (no ingress rule at all); allowAll is the explicit way to admit everyone."""
    on = "metrics.networkPolicy.enabled=true"
    for refused in (
        render(helm, on, "metrics.networkPolicy.from=null", check=False),
        render(helm, on, set_json=("metrics.networkPolicy.from=null",), check=False),
    ):
        assert refused.returncode != 0
        assert "metrics.networkPolicy.from is null, which would admit every source" in refused.stderr

    def policies(*sets: str, set_json: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        made = [
            o for o in docs(render(helm, on, *sets, set_json=set_json).stdout) if o["kind"] == "NetworkPolicy"
        ]
        assert len(made) == 2
        return made

    nobody = policies(set_json=("metrics.networkPolicy.from=[]",))
    for np in nobody:
        assert np["spec"]["policyTypes"] == ["Ingress"] and np["spec"]["ingress"] == []
    everyone = policies("metrics.networkPolicy.allowAll=true")
    for np in everyone:
        (rule,) = np["spec"]["ingress"]
        assert "from" not in rule and [p["port"] for p in rule["ports"]] == ["metrics"]
    for made in (nobody, everyone):
        proc = installed.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(made))
        assert proc.stdout.count("networkpolicy.networking.k8s.io/") == 2, proc.stdout


# ----------------------------------------------------------------------------------------- enterprise values
CLUSTER_SCOPED = {
    "Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding", "DeviceClass", "ClusterKopfPeering",
}  # fmt: skip


def test_namespace_override_moves_every_namespaced_object(helm: str) -> None:
    other = "gpu-infra"
    text = render(
        helm,
        f"namespaceOverride={other}",
        "namespace.create=true",
        "metrics.networkPolicy.enabled=true",
        "metrics.grafanaDashboard.enabled=true",
        *MONITORING,
    ).stdout
    objs = docs(text)
    namespaced = [o for o in objs if o["kind"] not in CLUSTER_SCOPED]
    assert {
        "ServiceAccount", "Role", "RoleBinding", "Deployment", "DaemonSet", "Service", "Job",
        "ServiceMonitor", "PrometheusRule", "NetworkPolicy", "ConfigMap",
    } <= {o["kind"] for o in namespaced}  # fmt: skip
    assert {o["metadata"].get("namespace") for o in namespaced} == {other}
    assert find(objs, "Namespace")["metadata"]["name"] == other
    subjects = [s for o in objs if o["kind"] in ("ClusterRoleBinding", "RoleBinding") for s in o["subjects"]]
    assert {s["namespace"] for s in subjects} == {other}
    # Nothing still names the release namespace: the admission policies' agent identity, alert texts.
    assert NS not in text
    bad = render(helm, "namespaceOverride=Not_A_Namespace", check=False)
    assert bad.returncode != 0
    assert 'namespaceOverride must be a namespace name (a DNS label), got "Not_A_Namespace"' in bad.stderr


def test_service_account_annotations_extra_volumes_and_security_contexts(
    installed: ControlPlane, helm: str
) -> None:
    """Each value lands on its object; securityContext overrides merge over the chart's defaults (the
    operator keeps passing restricted, the agent stays privileged); the API server accepts the result."""
    default = docs(render(helm).stdout)
    for name in ("dynamig-agent", "dynamig-operator"):
        assert "annotations" not in find(default, "ServiceAccount", name)["metadata"]
    agent_default = find(default, "DaemonSet")["spec"]["template"]["spec"]
    assert "securityContext" not in agent_default
    assert agent_default["containers"][0]["securityContext"] == {
        "privileged": True, "runAsUser": 0, "runAsNonRoot": False,
    }  # fmt: skip

    objs = docs(
        render(
            helm,
            "operator.securityContext.runAsUser=65533",
            "operator.podSecurityContext.fsGroup=65532",
            set_json=(
                'agent.serviceAccount.annotations={"iam.example.com/role":"dynamig-agent"}',
                'operator.serviceAccount.annotations={"iam.example.com/role":"dynamig-operator"}',
                'agent.extraVolumes=[{"name":"etc-cdi","hostPath":{"path":"/etc/cdi","type":"DirectoryOrCreate"}}]',
                'agent.extraVolumeMounts=[{"name":"etc-cdi","mountPath":"/etc/cdi","readOnly":true}]',
                'operator.extraVolumes=[{"name":"corp-ca","configMap":{"name":"corp-ca","optional":true}}]',
                'operator.extraVolumeMounts=[{"name":"corp-ca","mountPath":"/etc/ssl/corp","readOnly":true}]',
                'agent.securityContext={"seLinuxOptions":{"type":"spc_t"}}',
                'agent.podSecurityContext={"seccompProfile":{"type":"Unconfined"}}',
            ),
        ).stdout
    )
    accounts = {
        o["metadata"]["name"]: o["metadata"].get("annotations") for o in objs if o["kind"] == "ServiceAccount"
    }
    assert accounts["dynamig-agent"] == {"iam.example.com/role": "dynamig-agent"}
    assert accounts["dynamig-operator"] == {"iam.example.com/role": "dynamig-operator"}
    agent = find(objs, "DaemonSet")["spec"]["template"]["spec"]
    assert {"name": "etc-cdi", "hostPath": {"path": "/etc/cdi", "type": "DirectoryOrCreate"}} in agent[
        "volumes"
    ]
    assert {"name": "etc-cdi", "mountPath": "/etc/cdi", "readOnly": True} in agent["containers"][0][
        "volumeMounts"
    ]
    assert agent["securityContext"] == {"seccompProfile": {"type": "Unconfined"}}
    assert agent["containers"][0]["securityContext"] == {
        "privileged": True, "runAsUser": 0, "runAsNonRoot": False, "seLinuxOptions": {"type": "spc_t"},
    }  # fmt: skip
    op = find(objs, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "corp-ca", "configMap": {"name": "corp-ca", "optional": True}} in op["volumes"]
    assert {"name": "tmp", "emptyDir": {}} in op["volumes"]
    mounts = op["containers"][0]["volumeMounts"]
    assert {"name": "corp-ca", "mountPath": "/etc/ssl/corp", "readOnly": True} in mounts
    assert {"name": "tmp", "mountPath": "/tmp"} in mounts
    assert op["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip
    assert op["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
        "runAsUser": 65533,
    }  # fmt: skip
    workloads = [o for o in objs if o["kind"] in WORKLOAD_KINDS | {"ServiceAccount"}]
    proc = installed.kubectl(
        "apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f", "-",
        input=yaml.safe_dump_all(workloads),
    )  # fmt: skip
    assert "Warning" not in proc.stderr, proc.stderr
    assert proc.stdout.count("serverside-applied (server dry run)") == len(workloads), proc.stdout


def test_aggregated_roles_extend_view_and_edit(installed: ControlPlane, helm: str) -> None:
    """People bound cluster-wide to Kubernetes' view role read policies and GpuPartitions; those bound to edit
    also write policies, never GpuPartitions (the agents' and the operator's). Asked of the real RBAC
    authorizer, after the controller manager aggregated the chart's rules."""
    objs = docs(render(helm).stdout)
    view, edit = find(objs, "ClusterRole", "dynamig-view"), find(objs, "ClusterRole", "dynamig-edit")
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    for off in ("rbac.aggregateToDefaultRoles=false", "rbac.create=false"):
        names = {o["metadata"]["name"] for o in docs(render(helm, off).stdout) if o["kind"] == "ClusterRole"}
        assert not names & {"dynamig-view", "dynamig-edit"}, off

    cp = installed
    users = {"view": "dynamig-test-viewer", "edit": "dynamig-test-editor"}
    for role, user in users.items():
        cp.kubectl("create", "clusterrolebinding", user, f"--clusterrole={role}", f"--user={user}")
    try:
        expect = [
            ("view", ("list", "gpupartitions.dynamig.io"), True),
            ("view", ("watch", "gpupartitionpolicies.dynamig.io"), True),
            ("view", ("create", "gpupartitionpolicies.dynamig.io"), False),
            ("edit", ("get", "gpupartitions.dynamig.io"), True),
            ("edit", ("create", "gpupartitionpolicies.dynamig.io"), True),
            ("edit", ("delete", "gpupartitionpolicies.dynamig.io"), True),
            ("edit", ("patch", "gpupartitions.dynamig.io"), False),
            ("edit", ("create", "gpupartitions.dynamig.io"), False),
        ]

        def wrong() -> list[str]:
            return [
                f"{role} {' '.join(args)}: expected {want}"
                for role, args, want in expect
                if (
                    cp.kubectl("auth", "can-i", *args, f"--as={users[role]}", check=False).stdout.strip()
                    == "yes"
                )
                != want
            ]

        deadline = time.monotonic() + 30
        while (left := wrong()) and time.monotonic() < deadline:
            time.sleep(1)
        assert not left, "\n".join(left)
    finally:
        for user in users.values():
            cp.kubectl("delete", "clusterrolebinding", user, "--ignore-not-found", check=False)
