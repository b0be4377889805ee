"""The node agent's heartbeat: one coordination.k8s.io/v1 Lease per node, as the kubelet keeps its node
Lease. The agent renews it; the operator reads it and stops waiting for a node whose agent went silent (a
GPU left mid-reshape by a dead agent would otherwise hold its policy's disruption budget for ever). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


def lease_body(node: str, namespace: str, now: float, duration_s: int) -> dict[str, Any]:
    """The agent's Lease as renewed at ``now``. Pure."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": lease_name(node), "namespace": namespace, "labels": {NODE_LABEL: node}},
        "spec": {"holderIdentity": node, "leaseDurationSeconds": duration_s, "renewTime": micro_time(now)},
    }


@dataclass(frozen=True, slots=True)
class Sighting:
    """An agent Lease's last counted renewal."""

    renew_time: float  # the renewTime as last counted (epoch seconds, as the agent wrote it)
    at: float  # the time it counts as renewed: renew_time, but never later than when the reader saw it


def sightings(
    leases: Iterable[Mapping[str, Any]], previous: Mapping[str, Sighting], now: float
) -> dict[str, Sighting]:
    """Agent Lease name -> its :class:`Sighting`. A Lease counts as renewed only when its renewTime moves
    forward, as kube-controller-manager's node lifecycle controller counts node Leases (pkg/controller/
    nodelifecycle, tryUpdateNodeHealth in v1.37.2), and never later than the reader's ``now``: a renewTime in
    the future (a skewed clock, or a forged ``2030-01-01``) counts once, as ``now``, and the renewals after it
    that carry earlier times do not count, so such an agent goes silent one duration later. A time in the
    past counts as written (it only makes its own node look older). Pure."""
    out: dict[str, Sighting] = {}
    for lease in leases:
        name = str((lease.get("metadata") or {}).get("name", ""))
        renewed = parse_time(str((lease.get("spec") or {}).get("renewTime") or ""))
        if not name.startswith(LEASE_PREFIX) or renewed is None:
            continue
        seen = previous.get(name)
        out[name] = (
            Sighting(renewed, min(renewed, now)) if seen is None or renewed > seen.renew_time else seen
        )
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
    the reader's sightings (:func:`sightings`); without them every Lease is seen for the first time. Pure."""
    leases = list(leases)
    seen = sightings(leases, {}, now) if seen is None else seen
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
    seen = sightings(leases, {}, now) if seen is None else seen
    out: dict[str, str] = {}
    for lease in leases:
        meta = lease.get("metadata") or {}
        name = str(meta.get("name", ""))
        sighting = seen.get(name)
        if sighting is None:
            continue
        node = (meta.get("labels") or {}).get(NODE_LABEL) or name.removeprefix(LEASE_PREFIX)
        duration = _duration(lease)
        silent_for = now - sighting.at
        if silent_for > duration + GRACE_SECONDS:
            out[node] = (
                f"the agent on {node} has not renewed its lease for {silent_for:.0f}s (lease {duration:.0f}s)"
            )
    return out
