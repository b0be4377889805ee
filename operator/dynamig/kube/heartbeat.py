"""The node agent's heartbeat: one coordination.k8s.io/v1 Lease per node, as the kubelet keeps its node
Lease. The agent renews it; the operator reads it and stops waiting for a node whose agent went silent (a
GPU left mid-reshape by a dead agent would otherwise hold its policy's disruption budget for ever). Pure.

The Lease is owned by its Node, so the garbage collector removes it with the Node; the operator also judges
only the Leases of nodes that exist (a Lease written before it had an owner stays behind). A renewal is
dated by the operator's clock when it sees renewTime move (as kube-controller-manager dates node Leases), so
an agent whose clock lags is not taken for silent. The agent renews while it makes progress: a round that
cuts bookings one after another keeps renewing, one hung in an NVML call for half the Lease does not.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dynamig.kube.names import NODE_LABEL
from dynamig.kube.times import micro_time, parse_time

LEASE_PREFIX = "dynamig-agent-"
DEFAULT_LEASE_SECONDS = 30  # renewed every 10 s; silent 35 s after the last renewal
# A lease this much past its end is silent (clock skew between the agent's node and the operator's).
GRACE_SECONDS = 5.0
MAX_LEASE_SECONDS = 300.0  # a longer leaseDurationSeconds counts as this


def lease_name(node: str) -> str:
    return f"{LEASE_PREFIX}{node}"


def lease_body(
    node: str, namespace: str, now: float, duration_s: int, owner: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The agent's Lease as renewed at ``now``; ``owner``: the ownerReference to its Node, so that the
    garbage collector deletes the Lease with the Node (kept from being written before the Node is read).
    Pure."""
    meta: dict[str, Any] = {"name": lease_name(node), "namespace": namespace, "labels": {NODE_LABEL: node}}
    if owner is not None:
        meta["ownerReferences"] = [dict(owner)]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {"holderIdentity": node, "leaseDurationSeconds": duration_s, "renewTime": micro_time(now)},
    }


def lease_node(lease: Mapping[str, Any]) -> str:
    """The node an agent Lease speaks for (its node label, else its name). Pure."""
    meta = lease.get("metadata") or {}
    name = str(meta.get("name", ""))
    return str((meta.get("labels") or {}).get(NODE_LABEL) or name.removeprefix(LEASE_PREFIX))


def agent_leases(leases: Iterable[Mapping[str, Any]], nodes: Collection[str]) -> list[Mapping[str, Any]]:
    """The agent Leases of ``nodes`` (the nodes that exist). A Lease of a node that is gone says nothing
    about a live agent: it is neither silent nor counted among the agents. Pure."""
    return [
        lease
        for lease in leases
        if str((lease.get("metadata") or {}).get("name", "")).startswith(LEASE_PREFIX)
        and lease_node(lease) in nodes
    ]


def stuck(progress_at: float | None, now: float, lease_seconds: float) -> bool:
    """Whether the agent is to stop renewing its Lease: a round is running (``progress_at`` is when it last
    got something done: started, cut, answered; None between rounds) and has done nothing for half the
    Lease, as when an NVML call hangs in the driver. A round that makes progress is never stuck, however
    long it runs. Pure."""
    return progress_at is not None and now - progress_at >= lease_seconds / 2


@dataclass(frozen=True, slots=True)
class Sighting:
    """An agent Lease's last counted renewal."""

    renew_time: float  # the renewTime as last counted (epoch seconds, as the agent wrote it)
    at: float  # when it counts as renewed, by the reader's clock: when the reader saw renewTime move


def sightings(
    leases: Iterable[Mapping[str, Any]], previous: Mapping[str, Sighting], now: float
) -> dict[str, Sighting]:
    """Agent Lease name -> its :class:`Sighting`, for a reader that reads the Leases again and again. As
    kube-controller-manager's node lifecycle controller counts node Leases (pkg/controller/nodelifecycle,
    tryUpdateNodeHealth in v1.37.2), a Lease counts as renewed at the reader's ``now`` when it is first seen
    and whenever its renewTime moves forward: the agent's clock only says whether it renewed, never when, so
    an agent whose clock lags (or leads) is judged like any other. A renewTime in the future (a skewed clock,
    or a forged ``2030-01-01``) counts once; the renewals after it that carry earlier times do not count, so
    such an agent goes silent one duration later. A reader that just started gives every Lease one duration
    (a dead agent is withdrawn that much later after a restart). Pure."""
    out: dict[str, Sighting] = {}
    for lease in leases:
        name = str((lease.get("metadata") or {}).get("name", ""))
        renewed = parse_time(str((lease.get("spec") or {}).get("renewTime") or ""))
        if not name.startswith(LEASE_PREFIX) or renewed is None:
            continue
        seen = previous.get(name)
        out[name] = Sighting(renewed, now) if seen is None or renewed > seen.renew_time else seen
    return out


def _as_written(leases: Iterable[Mapping[str, Any]], now: float) -> dict[str, Sighting]:
    """Sightings for a reader that reads once (a report): each Lease dated by its own renewTime, never later
    than ``now``. Pure."""
    out: dict[str, Sighting] = {}
    for lease in leases:
        name = str((lease.get("metadata") or {}).get("name", ""))
        renewed = parse_time(str((lease.get("spec") or {}).get("renewTime") or ""))
        if name.startswith(LEASE_PREFIX) and renewed is not None:
            out[name] = Sighting(renewed, min(renewed, now))
    return out


def _duration(lease: Mapping[str, Any]) -> float:
    """The Lease's duration, at most :data:`MAX_LEASE_SECONDS`: a Lease cannot keep a node alive for years."""
    asked = float((lease.get("spec") or {}).get("leaseDurationSeconds") or DEFAULT_LEASE_SECONDS)
    return min(max(asked, 1.0), MAX_LEASE_SECONDS)


def next_silence(
    leases: Iterable[Mapping[str, Any]], now: float, seen: Mapping[str, Sighting] | None = None
) -> float | None:
    """The wall time at which the next agent Lease that is not silent yet will count as silent, or None.
    The operator plans a round for then, so a stuck agent's node is withdrawn within seconds of it. ``seen``:
    the reader's sightings (:func:`sightings`); without them each Lease is dated by its own renewTime (a
    reader that reads once). Pure."""
    leases = list(leases)
    seen = _as_written(leases, now) if seen is None else seen
    ends = []
    for lease in leases:
        sighting = seen.get(str((lease.get("metadata") or {}).get("name", "")))
        if sighting is None:
            continue
        end = sighting.at + _duration(lease) + GRACE_SECONDS
        if end >= now:
            ends.append(end)
    return min(ends, default=None)


def silent_agents(
    leases: Iterable[Mapping[str, Any]], now: float, seen: Mapping[str, Sighting] | None = None
) -> dict[str, str]:
    """Node -> why its agent counts as silent, for every agent Lease not renewed (as the reader saw it) for
    its duration plus the grace. A node without a Lease is not listed: an agent that does not keep one is not
    judged by it. ``seen`` as for :func:`next_silence`. Pure."""
    leases = list(leases)
    seen = _as_written(leases, now) if seen is None else seen
    out: dict[str, str] = {}
    for lease in leases:
        sighting = seen.get(str((lease.get("metadata") or {}).get("name", "")))
        if sighting is None:
            continue
        node = lease_node(lease)
        duration = _duration(lease)
        silent_for = now - sighting.at
        if silent_for > duration + GRACE_SECONDS:
            out[node] = (
                f"the agent on {node} has not renewed its lease for {silent_for:.0f}s (lease {duration:.0f}s)"
            )
    return out
