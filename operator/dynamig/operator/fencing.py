"""What the operator does for a node whose agent went silent (heartbeat Lease expired), so that no pod waits
for an agent that cannot answer. Pure.

A silent agent cannot answer a booking (the scheduler would hold the pod for its whole ``bindingTimeout``,
600 s by default, then may book the same node again) and its kubelet plugin, in the same process, cannot
prepare a claim. So the node stops offering anything: the operator deletes the node's ResourceSlices of the
driver, and fails every booking of the node's pool still waiting for an answer, which makes the scheduler
release it and book elsewhere (kube-scheduler's PreBind reads the failure condition, dynamicresources.go
``isClaimReadyForBinding``). Nothing on the GPUs changes: allocated instances stay allocated, running pods
run on. When the agent is back, its next round publishes the node again (its publisher recreates missing
slices), and it renews its Lease. The operator runs this with or without a GpuPartitionPolicy (its agent
watchdog, operator/reconciler.py ``Reconciler.watch_agents``).

A pod the scheduler bound to the node's devices before the fence (its booking answered in the window before
the Lease ran out) waits for a plugin that cannot prepare its claim, for as long as the agent stays away. Once
the node has been fenced for a bound (``stranded_after_s``, 60 s), such a pod that never started is given
back as the agent gives back a pod it cannot prepare (kube/pods.py ``verdict``): deleted for its controller
to create again elsewhere, or, with no controller, told why in a Warning Event.

Where the API server serves DRA device taints (resource.k8s.io/v1 DeviceTaintRule: Kubernetes 1.37 on, by
default), the node's devices are also tainted ``NoSchedule`` while it is fenced (one DeviceTaintRule
selecting the driver and the node's pool), so that no new booking lands on them even from a slice the
scheduler still has in its cache or one published again before the operator sees the agent back; the rule
is deleted when the agent is back. Pods already running there are untouched (not ``NoExecute``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynamig import API_GROUP
from dynamig.kube.answers import Pending, answer_entry, unanswered
from dynamig.kube.pods import verdict

REASON_AGENT_SILENT = "AgentSilent"
TAINT_KEY = f"{API_GROUP}/agent-silent"
TAINT_RULE_PREFIX = "dynamig-agent-silent-"
# On the DeviceTaintRules the operator keeps (each names its node as the pool it selects: a node name may be
# longer than a label value).
FENCE_LABEL = f"{API_GROUP}/fence"
FENCE_AGENT_SILENT = "agent-silent"


@dataclass(frozen=True, slots=True)
class Fence:
    """What to withdraw and fail for one silent node."""

    node: str
    why: str
    slices: tuple[str, ...]  # names of the node's ResourceSlices of the driver, to delete
    bookings: tuple[Pending, ...]  # allocations of the node's pool waiting for an answer, to fail

    @property
    def empty(self) -> bool:
        return not (self.slices or self.bookings)


def fences(
    silent: Mapping[str, str],
    slices: Sequence[Mapping[str, Any]],
    claims: Sequence[Mapping[str, Any]],
    driver: str,
    ready: str,
    failed: str,
) -> list[Fence]:
    """One Fence per silent node (node -> why, from the Leases), from the slices of those nodes and all
    claims. The pool of a node's devices is named after the node. Pure."""
    out = []
    for node, why in sorted(silent.items()):
        names = tuple(
            sorted(
                str((s.get("metadata") or {}).get("name", ""))
                for s in slices
                if (s.get("spec") or {}).get("driver") == driver
                and (s.get("spec") or {}).get("nodeName") == node
            )
        )
        out.append(Fence(node, why, names, tuple(unanswered(claims, driver, node, ready, failed))))
    return out


def disrupted(silent: Mapping[str, str], agents: int) -> bool:
    """Whether the silent agents are every agent, and more than one: then the API server or the network is
    to blame, not the agents, and no node is withdrawn (as kube-controller-manager stops evicting from a
    fully disrupted zone). ``agents``: how many agents keep a Lease, counting only nodes that exist (a Lease
    left by a removed node would otherwise keep this from ever holding, or make it hold for one live
    agent). Pure."""
    return len(silent) > 1 and len(silent) >= agents


def failed_answer(fence: Fence, booking: Pending, driver: str, failed: str, now: str) -> dict[str, Any]:
    """The ``status.devices[]`` entry that fails ``booking`` because its node's agent is silent. Pure."""
    message = f"{booking.device} on node {fence.node}: {fence.why}; the scheduler books again"
    return answer_entry(
        driver, fence.node, booking.device, failed, REASON_AGENT_SILENT, message, now, booking.generation
    )


@dataclass(frozen=True, slots=True)
class StrandedPod:
    """A pod bound to a fenced node through claims of the node's pool, to give back or tell."""

    node: str
    namespace: str
    name: str
    uid: str
    action: str  # "delete" (a controller owns it) or "event" (none does)
    detail: str  # the owning controller, or why it is only told
    claims: tuple[str, ...]  # names of its claims allocated in the node's pool


def stranded_pods(
    node: str, pods: Sequence[Mapping[str, Any]], claims: Sequence[Mapping[str, Any]], driver: str
) -> list[StrandedPod]:
    """The pods bound to ``node`` that a claim allocating ``driver`` devices of the node's pool is reserved
    for, and that :func:`~dynamig.kube.pods.verdict` does not leave alone (never started, not going), by
    namespace and name. Pure."""
    users: dict[tuple[str, str], list[str]] = {}  # (namespace, pod uid) -> claim names
    for claim in claims:
        meta = claim.get("metadata") or {}
        status = claim.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        if not any(r.get("driver") == driver and r.get("pool") == node for r in results):
            continue
        for ref in status.get("reservedFor") or []:
            if ref.get("resource") == "pods" and not ref.get("apiGroup"):
                key = (str(meta.get("namespace", "")), str(ref.get("uid", "")))
                users.setdefault(key, []).append(str(meta.get("name", "")))
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("uid", "")))
        if key not in users:
            continue
        action, detail = verdict(pod, node)
        if action == "leave":
            continue
        out.append(
            StrandedPod(
                node, key[0], str(meta.get("name", "")), key[1], action, detail, tuple(sorted(users[key]))
            )
        )
    return sorted(out, key=lambda p: (p.namespace, p.name))


def to_give_back(
    fenced_since: Mapping[str, float],
    now: float,
    after_s: float,
    pods: Sequence[Mapping[str, Any]],
    claims: Sequence[Mapping[str, Any]],
    driver: str,
) -> list[StrandedPod]:
    """The stranded pods (:func:`stranded_pods`) of the nodes fenced since at least ``after_s`` before
    ``now`` (``fenced_since``: node -> when it was first fenced, while it stays fenced). Pure."""
    return [
        p
        for node, since in sorted(fenced_since.items())
        if now - since >= after_s
        for p in stranded_pods(node, pods, claims, driver)
    ]


def taint_rule_name(node: str) -> str:
    """The DeviceTaintRule's name for ``node``: a DNS subdomain of at most 253 characters. Pure."""
    name = f"{TAINT_RULE_PREFIX}{node}"
    if len(name) <= 253:
        return name
    return f"{name[:240]}-{hashlib.sha256(node.encode()).hexdigest()[:12]}"


def taint_rule(node: str, driver: str, now: str) -> dict[str, Any]:
    """The resource.k8s.io/v1 DeviceTaintRule that keeps new bookings off ``node``'s devices of ``driver``
    (its pool is named after it) while its agent is silent: ``NoSchedule``, so allocated devices stay
    allocated. Pure."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": taint_rule_name(node), "labels": {FENCE_LABEL: FENCE_AGENT_SILENT}},
        "spec": {
            "deviceSelector": {"driver": driver, "pool": node},
            "taint": {"key": TAINT_KEY, "effect": "NoSchedule", "timeAdded": now},
        },
    }


def taint_changes(fenced: Collection[str], rules: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """``(nodes to taint, rule names to delete)``: a rule for each fenced node that has none, and the
    operator's rules (its label; the node is the pool they select) of nodes no longer fenced. Pure."""
    have: dict[str, str] = {}
    for rule in rules:
        meta = rule.get("metadata") or {}
        if (meta.get("labels") or {}).get(FENCE_LABEL) != FENCE_AGENT_SILENT:
            continue
        node = ((rule.get("spec") or {}).get("deviceSelector") or {}).get("pool")
        if node:
            have[str(node)] = str(meta.get("name", ""))
    create = sorted(n for n in fenced if n not in have)
    delete = sorted(name for node, name in have.items() if node not in fenced)
    return create, delete
