"""The node agent's heartbeat: one coordination.k8s.io/v1 Lease per node, as the kubelet keeps its node
Lease. The agent renews it; the operator reads it and stops waiting for a node whose agent went silent (a
GPU left mid-reshape by a dead agent would otherwise hold its policy's disruption budget for ever). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dynamig.kube.names import NODE_LABEL
from dynamig.kube.times import micro_time, parse_time

LEASE_PREFIX = "dynamig-agent-"
DEFAULT_LEASE_SECONDS = 30  # renewed every 10 s; silent 35 s after the last renewal
# A lease this much past its end is silent (clock skew between the agent's node and the operator's).
GRACE_SECONDS = 5.0


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


def next_silence(leases: Iterable[Mapping[str, Any]], now: float) -> float | None:
    """The wall time at which the next agent Lease that is not silent yet will count as silent, or None.
    The operator plans a round for then, so a stuck agent's node is withdrawn within seconds of it. Pure."""
    ends = []
    for lease in leases:
        if not str((lease.get("metadata") or {}).get("name", "")).startswith(LEASE_PREFIX):
            continue
        spec = lease.get("spec") or {}
        renewed = parse_time(str(spec.get("renewTime") or ""))
        if renewed is None:
            continue
        end = renewed + float(spec.get("leaseDurationSeconds") or DEFAULT_LEASE_SECONDS) + GRACE_SECONDS
        if end >= now:
            ends.append(end)
    return min(ends, default=None)


def silent_agents(leases: Iterable[Mapping[str, Any]], now: float) -> dict[str, str]:
    """Node -> why its agent counts as silent, for every agent Lease past its end (plus the grace). A node
    without a Lease is not listed: an agent that does not keep one is not judged by it. Pure."""
    out: dict[str, str] = {}
    for lease in leases:
        meta = lease.get("metadata") or {}
        name = str(meta.get("name", ""))
        node = (meta.get("labels") or {}).get(NODE_LABEL) or name.removeprefix(LEASE_PREFIX)
        spec = lease.get("spec") or {}
        renewed = parse_time(str(spec.get("renewTime") or ""))
        duration = float(spec.get("leaseDurationSeconds") or DEFAULT_LEASE_SECONDS)
        if not name.startswith(LEASE_PREFIX) or renewed is None:
            continue
        silent_for = now - renewed
        if silent_for > duration + GRACE_SECONDS:
            out[node] = (
                f"the agent on {node} has not renewed its lease for {silent_for:.0f}s (lease {duration:.0f}s)"
            )
    return out
