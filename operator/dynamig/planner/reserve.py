"""Whole idle nodes kept for waiting multi-GPU claims. Pure, deterministic, no I/O.

A claim for several devices needs all of them on one node. kube-scheduler puts a single-device claim on any
node where a device matches, idle nodes included (its default score, NodeResourcesFit ``LeastAllocated``,
even spreads pods: pkg/scheduler/apis/config/v1/defaults.go in v1.36.3 and v1.37.2), so single claims can
take the last idle node a waiting 8-GPU claim needs. Keeping it matters when small claims reach the scheduler
first; how much multi-GPU claims get under load depends mostly on the node order the scheduler packs with
(docs/benchmarks.md measures every policy under both the packing and the spreading order).

So while multi-device claims wait, one idle node is kept for each: largest claim first (it has the fewest
nodes that can hold it), the smallest eligible idle node that holds it (bigger nodes stay for bigger
claims), ties by name. On a kept node only the profiles that claim accepts are offered, which keeps
single claims for other profiles off it; a single claim for one of those profiles may still take a device
there (no device selector can tell a request's count), and any claim is free to use the other idle nodes.
The operator writes the restriction to the kept node's GpuPartitions (``spec.offeredProfiles``); the
simulator applies the same function to its node choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class IdleNode:
    """A node none of whose GPUs holds an allocated or busy instance."""

    name: str
    gpus: tuple[frozenset[str], ...]  # per GPU of the node, the profiles it can offer

    def holds(self, claim: WaitingClaim) -> bool:
        """Whether enough of its GPUs offer a profile the claim accepts."""
        return sum(1 for offers in self.gpus if offers & claim.profiles) >= claim.count


@dataclass(frozen=True, slots=True)
class WaitingClaim:
    """A pending claim that needs ``count`` devices on one node."""

    name: str
    count: int
    profiles: frozenset[str]  # profiles it accepts (any model)
    nodes: frozenset[str] | None = None  # nodes it may run on; None: any


def keep_idle_nodes(idle: Sequence[IdleNode], waiting: Sequence[WaitingClaim]) -> Mapping[str, WaitingClaim]:
    """Node name -> the waiting multi-device claim it is kept for (claims of one device keep nothing)."""
    kept: dict[str, WaitingClaim] = {}
    for claim in sorted((c for c in waiting if c.count > 1), key=lambda c: (-c.count, c.name)):
        fits = [
            n
            for n in idle
            if n.name not in kept and (claim.nodes is None or n.name in claim.nodes) and n.holds(claim)
        ]
        if fits:
            kept[min(fits, key=lambda n: (len(n.gpus), n.name)).name] = claim
    return kept
