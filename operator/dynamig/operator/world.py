"""The operator's view of the cluster: a snapshot parsed into policies, GPUs, which policy governs each GPU,
the pending claims and which policy serves each claim. Pure; the reconciler, teardown and the kubectl plugin
read the cluster through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dynamig import DRIVER_NAME
from dynamig.geometry.catalog import Catalog
from dynamig.kube.heartbeat import Sighting, agent_leases, silent_agents
from dynamig.kube.policy import GpuPartitionPolicy, Ownership, parse_policies, resolve_ownership
from dynamig.operator.demand import PendingClaim, extract_demand, parse_device_classes
from dynamig.operator.inventory import GpuView, allocated_devices, nvlink_by_model, parse_inventory
from dynamig.operator.kubeio import Snapshot
from dynamig.operator.verdicts import serves_whole


@dataclass(frozen=True, slots=True)
class World:
    """A parsed snapshot: policies, GPUs, ownership, pending claims and which policy serves each claim."""

    policies: tuple[GpuPartitionPolicy, ...]
    gpus: tuple[GpuView, ...]
    node_labels: Mapping[str, Mapping[str, str]]
    ownership: Ownership
    pending: tuple[PendingClaim, ...]
    claim_owner: Mapping[str, str]  # claim key -> policy name
    allocated: frozenset[str]
    silent: Mapping[str, str] = field(default_factory=dict)  # node -> why its agent counts as gone


def assign_claims(
    policies: tuple[GpuPartitionPolicy, ...],
    gpus: tuple[GpuView, ...],
    ownership: Ownership,
    pending: tuple[PendingClaim, ...],
) -> dict[str, str]:
    """Each pending claim goes to the first policy (oldest, then by name) with a GPU on an allowed node whose
    model has a profile the claim accepts (for a claim of whole GPUs: a GPU with MIG mode off whose whole GPU
    it accepts, its NVLink facts included, else any GPU whose whole GPU it would accept); a claim none can
    serve goes to the oldest policy, which reports why. Pure."""
    ordered = sorted(policies, key=lambda p: p.precedence)
    out: dict[str, str] = {}
    if not ordered:
        return out
    for claim in pending:
        chosen = ordered[0].name
        if claim.whole and not claim.requests:
            candidates = [
                (pol.name, g)
                for pol in ordered
                for g in gpus
                if ownership.owner.get(g.name) == pol.name
                and serves_whole(claim, g)
                and (claim.nodes is None or g.node in claim.nodes)
            ]
            fallback = candidates[0][0] if candidates else chosen
            out[claim.claim.key] = next((p for p, g in candidates if g.whole), fallback)
            continue
        for pol in ordered:
            mine = [g for g in gpus if ownership.owner.get(g.name) == pol.name and g.model is not None]
            if any(
                (claim.nodes is None or g.node in claim.nodes)
                and any(r.alternatives(None, frozenset({g.model.key})) for r in claim.requests if g.model)
                for g in mine
            ):
                chosen = pol.name
                break
        out[claim.claim.key] = chosen
    return out


def parse_world(
    snap: Snapshot, catalog: Catalog, now: float | None = None, seen: Mapping[str, Sighting] | None = None
) -> World:
    """Parse a snapshot into a :class:`World`; with ``now`` (epoch seconds), GPUs of nodes whose agent
    Lease ran out are unusable, judged by ``seen`` (when the reader saw each Lease renewed; without it, by
    the Leases' own times, bounded by ``now``). Leases of nodes that no longer exist are not judged. Pure."""
    policies = parse_policies(snap.policies)
    node_labels = {
        str(n["metadata"]["name"]): dict(n["metadata"].get("labels") or {})
        for n in snap.nodes
        if n.get("metadata")
    }
    leases = agent_leases(snap.leases, node_labels)
    silent = silent_agents(leases, now, seen) if now is not None else {}
    gpus = parse_inventory(snap.partitions, catalog, allocated_devices(snap.claims, DRIVER_NAME), silent)
    ownership = resolve_ownership(policies, [g.identity(node_labels.get(g.node, {})) for g in gpus])
    governed = [g for g in gpus if g.name in ownership.owner and g.model is not None]
    models: dict[str, Any] = {}
    products: dict[str, str] = {}
    for g in governed:
        assert g.model is not None
        models.setdefault(g.model.key, g.model)
        if g.product:
            products.setdefault(g.model.key, g.product)
    gpu_nodes = {g.node: node_labels.get(g.node, {}) for g in governed}
    demand = extract_demand(
        snap.claims,
        snap.pods,
        parse_device_classes(snap.device_classes),
        tuple(models.values()),
        gpu_nodes,
        products,
        nvlink_by_model(governed),
    )
    owner = assign_claims(tuple(policies), gpus, ownership, demand.pending)
    return World(
        tuple(policies), gpus, node_labels, ownership, demand.pending, owner, demand.allocated, silent
    )
