"""What the chart's admission policies keep dynamig's own service accounts to, where RBAC grants more.

Against the real local kube-apiserver, with the chart (helm template, default values) applied for real and
each component's own token: the agent's bound to a pod on its node (the node claim the policies read), the
operator's and the uninstall hook's from the TokenRequest API. Every forbidden write is refused and an allowed
one goes through, so each test fails both when the confinement is missing and when it is too tight.

- ``update resourceclaims/status`` reaches every claim. Kubernetes 1.36 authorizes it per driver and node
  (resourceclaims/driver, resourceclaims/binding); 1.34 and 1.35 do not, and there the policy
  ``<release>-agent-node-resourceclaims`` alone keeps an agent to status.devices entries of its own pool.
  The tests run once with the chart's RBAC, and once with the checks 1.36 adds granted away, as the older API
  servers authorize: the policy's own refusal must then show (marked ``matrix``: also run on 1.35).
- DeviceClasses: the operator and the hook may write every one by RBAC; the policy keeps them to dynamig's
  profile classes (and the whole-GPU class ``gpu.dynamig.io``, kept the same way).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamig import DRIVER_NAME
from dynamig.devcluster import ControlPlane
from dynamig.kube.devices import profile_device_class, whole_device_class

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "manifests" / "helm" / "dynamig"
DEPLOY = ROOT / "manifests" / "deploy"
# A namespace of its own: another test's uninstall can leave dynamig-system Terminating for the rest of the
# session (pods bound to nodes without a kubelet never finish), and nothing can be created in it then.
NS = "dynamig-confinement"
CLAIMS_NS = "default"
FOREIGN_DRIVER = "nic.example.com"
# What Kubernetes 1.34 and 1.35 authorize with `update resourceclaims/status` alone: no per-driver, per-node
# or binding check. Granting these on 1.36+ takes those checks out, so only the admission policy is left.
AS_BEFORE_1_36 = "dynamig-test-claims-as-before-1-36"

Kubectl = Callable[..., subprocess.CompletedProcess[str]]
# kubectl as the agent of node A, node A, node B, and the claims allocated on each ("on-a", "on-b").
AgentAndClaims = tuple[Kubectl, str, str, dict[str, dict[str, Any]]]


def _kubectl_as(cp: ControlPlane, kubeconfig: Path) -> Kubectl:
    def run(*args: str, obj: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        # The later --kubeconfig wins over the admin one cp.kubectl sets.
        return cp.kubectl(*args, f"--kubeconfig={kubeconfig}", input=yaml.safe_dump(obj) if obj else None,
                          check=False)  # fmt: skip

    return run


def _token_kubeconfig(cp: ControlPlane, token: str, path: Path) -> Path:
    config = yaml.safe_load(cp.kubeconfig_path.read_text())
    config["users"] = [{"name": config["users"][0]["name"], "user": {"token": token}}]
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def _token(cp: ControlPlane, sa: str, bound_pod: dict[str, Any] | None = None) -> str:
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    if bound_pod is not None:
        meta = bound_pod["metadata"]
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
    token: str = cp.rest().request("POST", f"/api/v1/namespaces/{NS}/serviceaccounts/{sa}/token", body)[
        "status"
    ]["token"]
    return token


def _wait_until_denied(probe: Callable[[], subprocess.CompletedProcess[str]], what: str) -> None:
    """Policies and bindings take effect a moment after they are created."""
    deadline = time.monotonic() + 30
    while probe().returncode == 0:
        assert time.monotonic() < deadline, f"{what}: never refused"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def chart(control_plane: ControlPlane, helm: str) -> Iterator[list[dict[str, Any]]]:
    """The chart's CRDs, namespace, service accounts (the uninstall hook's too), RBAC and admission policies,
    applied for real (no workloads: no kubelet would run them); what this fixture made is removed after."""
    cp = control_plane
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(DEPLOY / "crds"))
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "-l",
               "app.kubernetes.io/part-of=dynamig")  # fmt: skip
    rendered = subprocess.run(
        [helm, "template", "dynamig", str(CHART), "--namespace", NS, "--set", "namespace.create=true"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    skip = {"Deployment", "DaemonSet", "Job", "CustomResourceDefinition"}
    objs = [o for o in yaml.safe_load_all(rendered) if o and o["kind"] not in skip]
    stream = yaml.safe_dump_all(objs)
    existing = set(
        cp.kubectl("get", "--ignore-not-found", "-o", "name", "-f", "-", input=stream).stdout.split()
    )
    applied = cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=stream, check=False)
    assert applied.returncode == 0, applied.stderr
    try:
        yield objs
    finally:

        def pre_existing(o: dict[str, Any]) -> bool:
            kind, name = o["kind"].lower(), o["metadata"]["name"]
            return any(e.endswith("/" + name) and e.split("/")[0].split(".")[0] == kind for e in existing)

        made = [o for o in objs if not pre_existing(o)]
        cp.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=yaml.safe_dump_all(made),
                   check=False)  # fmt: skip


# ------------------------------------------------------------------------------------------------ claims
def _claim(name: str, node: str) -> dict[str, Any]:
    """A claim allocated on ``node``: one MIG device of this driver and one device of another driver."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": CLAIMS_NS},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": DRIVER_NAME}},
            {"name": "nic", "exactly": {"deviceClassName": FOREIGN_DRIVER}},
        ]}},
    }  # fmt: skip


def _allocation(node: str) -> dict[str, Any]:
    return {
        "devices": {"results": [
            {"request": "gpu", "driver": DRIVER_NAME, "pool": node, "device": "gpu0-1g10gb-s0"},
            {"request": "nic", "driver": FOREIGN_DRIVER, "pool": node, "device": "nic0"},
        ]},
        "nodeSelector": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        ]},
    }  # fmt: skip


def _entry(driver: str, pool: str, device: str, message: str = "cut") -> dict[str, Any]:
    return {
        "driver": driver, "pool": pool, "device": device,
        "conditions": [{"type": f"{DRIVER_NAME}/ready", "status": "True", "reason": "Ready",
                        "message": message, "lastTransitionTime": "2026-12-01T00:00:00Z"}],
    }  # fmt: skip


@pytest.fixture
def agent_and_claims(
    chart: list[dict[str, Any]], control_plane: ControlPlane, make_node: Callable[..., str], tmp_path: Path
) -> Iterator[AgentAndClaims]:
    """The agent of node A with its own pod-bound token; claims allocated on A and on B, each with the other
    driver's answer already in status.devices (and B's claim with B's agent's answer)."""
    cp = control_plane
    a, b = make_node("confine-a"), make_node("confine-b")
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"agent-{a}"[:63], "namespace": NS},
        "spec": {"nodeName": a, "serviceAccountName": "dynamig-agent",
                 "containers": [{"name": "agent", "image": "example.invalid/dynamig:test"}]},
    }  # fmt: skip
    pod = cp.rest().request("POST", f"/api/v1/namespaces/{NS}/pods", pod)
    kc = _token_kubeconfig(cp, _token(cp, "dynamig-agent", pod), tmp_path / "agent.kubeconfig")
    claims: dict[str, dict[str, Any]] = {}
    for which, node in (("on-a", a), ("on-b", b)):
        claim = _claim(f"claim-{node}"[:63], node)
        cp.kubectl("create", "-f", "-", input=yaml.safe_dump(claim))
        claim = json.loads(cp.kubectl("get", "resourceclaim", "-n", CLAIMS_NS, claim["metadata"]["name"],
                                      "-o", "json").stdout)  # fmt: skip
        devices = [_entry(FOREIGN_DRIVER, node, "nic0", "link up")]
        if which == "on-b":
            devices.append(_entry(DRIVER_NAME, node, "gpu0-1g10gb-s0"))
        claim["status"] = {"allocation": _allocation(node), "devices": devices}
        out = cp.kubectl(
            "replace", "--subresource=status", "-o", "json", "-f", "-", input=yaml.safe_dump(claim)
        )
        claims[which] = json.loads(out.stdout)
    try:
        yield _kubectl_as(cp, kc), a, b, claims
    finally:
        cp.kubectl("delete", "pod", "-n", NS, pod["metadata"]["name"], "--ignore-not-found", "--wait=false")
        for claim in claims.values():
            cp.kubectl(
                "delete", "resourceclaim", "-n", CLAIMS_NS, claim["metadata"]["name"], "--ignore-not-found"
            )
        cp.kubectl("delete", "clusterrolebinding", AS_BEFORE_1_36, "--ignore-not-found")
        cp.kubectl("delete", "clusterrole", AS_BEFORE_1_36, "--ignore-not-found")


def _grant_as_before_1_36(cp: ControlPlane) -> None:
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": AS_BEFORE_1_36},
        "rules": [
            {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/binding"], "verbs": ["update"]},
            {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/driver"],
             "verbs": ["associated-node:update", "arbitrary-node:update"]},
        ],
    }  # fmt: skip
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": AS_BEFORE_1_36},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": AS_BEFORE_1_36},
        "subjects": [{"kind": "ServiceAccount", "name": "dynamig-agent", "namespace": NS}],
    }  # fmt: skip
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role, binding]))


@pytest.mark.matrix
def test_an_agent_may_answer_claims_only_in_its_own_pool(
    control_plane: ControlPlane,
    agent_and_claims: AgentAndClaims,
) -> None:
    as_agent, a, b, claims = agent_and_claims

    def changed(which: str, edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        claim: dict[str, Any] = json.loads(json.dumps(claims[which]))
        edit(claim["status"])
        return claim

    def answer(pool: str, driver: str = DRIVER_NAME, device: str = "gpu0-1g10gb-s0") -> Callable[..., None]:
        def edit(status: dict[str, Any]) -> None:
            key = (driver, pool, device)
            others = [d for d in status["devices"] if (d["driver"], d["pool"], d["device"]) != key]
            status["devices"] = [*others, _entry(driver, pool, device, "forged")]

        return edit

    def drop(driver: str) -> Callable[..., None]:
        def edit(status: dict[str, Any]) -> None:
            status["devices"] = [d for d in status["devices"] if d["driver"] != driver]

        return edit

    def reserve(status: dict[str, Any]) -> None:
        status["reservedFor"] = [
            {"resource": "pods", "name": "p", "uid": "4f3c2b1a-0000-4000-8000-000000000001"}
        ]

    def deallocate(status: dict[str, Any]) -> None:
        status.clear()

    mine = f"the dynamig agent on node {a}"
    others = (
        f"{mine} may only change status.devices entries of driver {DRIVER_NAME} in pool {a} of ResourceClaim"
    )
    binding = f"{mine} may not change the allocation or reservedFor of ResourceClaim"
    denied = [
        ("an answer on B's claim, in B's pool", changed("on-b", answer(b)), others),
        ("B's agent's answer removed", changed("on-b", drop(DRIVER_NAME)), others),
        (
            "another driver's answer on its own claim",
            changed("on-a", answer(a, FOREIGN_DRIVER, "nic0")),
            others,
        ),
        ("another driver's answer removed", changed("on-a", drop(FOREIGN_DRIVER)), others),
        ("its own claim reserved for a pod", changed("on-a", reserve), binding),
        ("its own claim deallocated", changed("on-a", deallocate), binding),
        ("B's claim deallocated", changed("on-b", deallocate), binding),
    ]
    allowed = changed("on-a", answer(a))

    def attempt(claim: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return as_agent("replace", "--subresource=status", "--dry-run=server", "-f", "-", obj=claim)

    _wait_until_denied(lambda: attempt(denied[0][1]), "an answer on another node's claim")
    # The chart's RBAC: each refused, by the API server's own checks (1.36+) or the policy.
    wrong = [
        f"{what}: {got.stdout.strip()}"
        for what, claim, _ in denied
        if (got := attempt(claim)).returncode == 0
    ]
    got = attempt(allowed)
    if got.returncode != 0:
        wrong.append(f"its own answer refused: {got.stderr.strip()}")
    assert not wrong, "\n".join(wrong)

    # As 1.34 and 1.35 authorize: nothing but the policy stands in the way, and it refuses each one itself.
    _grant_as_before_1_36(control_plane)
    deadline = time.monotonic() + 30
    while binding not in attempt(denied[-1][1]).stderr and time.monotonic() < deadline:
        time.sleep(0.5)  # RBAC takes effect when the authorizer's informer sees the binding
    wrong = []
    for what, claim, message in denied:
        got = attempt(claim)
        if got.returncode == 0 or message not in got.stderr:
            wrong.append(f"{what}: rc={got.returncode} {got.stderr.strip() or got.stdout.strip()}")
    got = attempt(allowed)
    if got.returncode != 0:
        wrong.append(f"its own answer refused: {got.stderr.strip()}")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------------------------------------ classes
def _device_class(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": name, **({"labels": labels} if labels else {})},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{FOREIGN_DRIVER}"'}}]},
    }  # fmt: skip


def test_the_operator_and_the_uninstall_hook_write_only_dynamigs_profile_classes(
    chart: list[dict[str, Any]], control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = control_plane
    accounts = [o["metadata"]["name"] for o in chart if o["kind"] == "ServiceAccount"]
    hook_sa = next(name for name in accounts if name.endswith("-uninstall"))
    operator = _kubectl_as(
        cp, _token_kubeconfig(cp, _token(cp, "dynamig-operator"), tmp_path / "op.kubeconfig")
    )
    hook = _kubectl_as(cp, _token_kubeconfig(cp, _token(cp, hook_sa), tmp_path / "hook.kubeconfig"))
    foreign = _device_class(FOREIGN_DRIVER)
    ours = profile_device_class("1g.10gb")
    lookalike = {**ours, "metadata": {"name": "mig-7g.80gb.dynamig.io"}}  # our name, not our label
    usurped = {
        **foreign,
        "metadata": {"name": "nic-usurped.example.com", "labels": {"dynamig.io/profile-class": "true"}},
    }
    # A person's class under dynamig's suffix: the label is what makes a class dynamig's, and only dynamig
    # sets it at creation.
    unlabelled = _device_class("mig-mine.dynamig.io")
    made = [foreign, ours, unlabelled]
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(made))
    try:
        relabelled = json.loads(cp.kubectl("get", "deviceclass", "mig-mine.dynamig.io", "-o", "json").stdout)
        relabelled["metadata"].setdefault("labels", {})["dynamig.io/profile-class"] = "true"
        dry = ("--dry-run=server",)

        def says(who: str, verb: str, name: str) -> str:
            return (f"system:serviceaccount:{NS}:{who} may only {verb} the dynamig profile DeviceClasses "
                    f"(named *.dynamig.io, labelled dynamig.io/profile-class=true), not {name}")  # fmt: skip

        denied = [
            ("the operator deletes another driver's class", operator,
             ("delete", "deviceclass", FOREIGN_DRIVER), None,
             says("dynamig-operator", "delete", FOREIGN_DRIVER)),
            ("the operator deletes the chart's class", operator, ("delete", "deviceclass", DRIVER_NAME), None,
             says("dynamig-operator", "delete", DRIVER_NAME)),
            ("the operator creates a foreign class", operator, ("create", "-f", "-"), usurped,
             says("dynamig-operator", "create", "nic-usurped.example.com")),
            ("the operator creates an unlabelled *.dynamig.io class", operator, ("create", "-f", "-"),
             lookalike, says("dynamig-operator", "create", "mig-7g.80gb.dynamig.io")),
            ("the operator labels a person's class its own", operator, ("replace", "-f", "-"), relabelled,
             says("dynamig-operator", "update", "mig-mine.dynamig.io")),
            ("the hook deletes a person's class", hook, ("delete", "deviceclass", "mig-mine.dynamig.io"),
             None, says(hook_sa, "delete", "mig-mine.dynamig.io")),
            ("the hook deletes another driver's class", hook, ("delete", "deviceclass", FOREIGN_DRIVER), None,
             says(hook_sa, "delete", FOREIGN_DRIVER)),
            ("the hook deletes the chart's class", hook, ("delete", "deviceclass", DRIVER_NAME), None,
             says(hook_sa, "delete", DRIVER_NAME)),
        ]  # fmt: skip
        if cp.kubectl("get", "deviceclass", DRIVER_NAME, check=False).returncode != 0:
            denied = [d for d in denied if d[2][-1] != DRIVER_NAME]  # features.deviceClass made none here
        _wait_until_denied(
            lambda: operator(*denied[0][2], *dry), "a foreign DeviceClass deleted by the operator"
        )
        wrong = []
        for what, who, args, body, message in denied:
            got = who(*args, *dry, obj=body)
            if got.returncode == 0 or message not in got.stderr:
                wrong.append(f"{what}: rc={got.returncode} {got.stderr.strip() or got.stdout.strip()}")
        # dynamig's own profile classes stay theirs to keep and remove.
        other_profile = profile_device_class("2g.20gb")
        whole = whole_device_class()  # gpu.dynamig.io, nvidia.com/gpu: kept like a profile class
        own = ours["metadata"]["name"]
        current = json.loads(cp.kubectl("get", "deviceclass", ours["metadata"]["name"], "-o", "json").stdout)
        current["spec"]["selectors"].append({"cel": {"expression": "true"}})
        for what, who, args, body in [
            ("the operator creates a profile class", operator, ("create", "-f", "-"), other_profile),
            ("the operator creates the whole-GPU class", operator, ("create", "-f", "-"), whole),
            ("the operator updates a profile class", operator, ("replace", "-f", "-"), current),
            ("the operator deletes a profile class", operator, ("delete", "deviceclass", own), None),
            ("the hook deletes a profile class", hook, ("delete", "deviceclass", own), None),
        ]:  # fmt: skip
            got = who(*args, *dry, obj=body)
            if got.returncode != 0:
                wrong.append(f"{what}: refused: {got.stderr.strip()}")
        assert not wrong, "\n".join(wrong)
    finally:
        for obj in made:
            with contextlib.suppress(subprocess.CalledProcessError):
                cp.kubectl("delete", "deviceclass", obj["metadata"]["name"], "--ignore-not-found")


# ---------------------------------------------------------------------------------------------------- pods
def test_an_agent_may_delete_only_owned_pods_bound_to_its_node(
    control_plane: ControlPlane, agent_and_claims: AgentAndClaims
) -> None:
    """The agent gives back a pod whose device stays unpreparable (agent/bindings/stranded.py) by deleting it;
    RBAC grants delete on every pod, the policy keeps it to pods on its own node that a controller owns."""
    cp = control_plane
    agent, a, b, _ = agent_and_claims
    owner = json.loads(
        cp.kubectl("create", "configmap", f"owner-{a}"[:63], "-n", CLAIMS_NS, "-o", "json").stdout
    )
    controller = {
        "apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"], "controller": True,
    }  # fmt: skip

    def pod(name: str, node: str, owned: bool) -> str:
        meta: dict[str, Any] = {"name": name, "namespace": CLAIMS_NS}
        if owned:
            meta["ownerReferences"] = [controller]
        spec = {"nodeName": node, "containers": [{"name": "c", "image": "example.invalid/x:1"}]}
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
        cp.kubectl("create", "-f", "-", input=yaml.safe_dump(body))
        return name

    others = pod(f"on-b-{b}"[:63], b, owned=True)
    unowned = pod(f"unowned-{a}"[:63], a, owned=False)
    mine = pod(f"mine-{a}"[:63], a, owned=True)
    try:
        # A dry run is admitted like the real thing and deletes nothing while the policy is not in force yet.
        _wait_until_denied(
            lambda: agent("delete", "pod", "-n", CLAIMS_NS, others, "--dry-run=server"), "another node's pod"
        )
        denied = agent("delete", "pod", "-n", CLAIMS_NS, others, "--wait=false")
        assert denied.returncode != 0 and f"may only delete pods bound to it, not {others}" in denied.stderr
        denied = agent("delete", "pod", "-n", CLAIMS_NS, unowned, "--wait=false")
        assert denied.returncode != 0 and "may only delete pods a controller owns" in denied.stderr
        allowed = agent("delete", "pod", "-n", CLAIMS_NS, mine, "--wait=false")
        assert allowed.returncode == 0, allowed.stderr
    finally:
        cp.kubectl("delete", "pod", "-n", CLAIMS_NS, others, unowned, mine, "--ignore-not-found",
                   "--wait=false", "--grace-period=0", "--force")  # fmt: skip
        cp.kubectl("delete", "configmap", "-n", CLAIMS_NS, owner["metadata"]["name"], "--ignore-not-found")
