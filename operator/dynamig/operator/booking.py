"""Claims the kube-scheduler books on partitionable GPUs (nothing is planned ahead for them): where an
offered placement or a free instance fits on an eligible node, whether every device of a pod fits one node
together, and the verdict that follows (``WaitingForScheduler``, ``WouldReshape`` under DryRun, or
``NoCapacity`` with the numbers). The GPUs are indexed by node and what fits is cached for the round, so a
burst of claims of one shape costs one scan. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.layout import free_starts, remaining_capacity
from dynamig.geometry.model import PlacedInstance
from dynamig.kube.policy import GpuPartitionPolicy, Mode
from dynamig.operator.demand import PendingClaim, RequestDemand
from dynamig.operator.inventory import GpuView
from dynamig.operator.verdicts import (
    ClaimVerdict,
    Reason,
    first_profile,
    no_capacity_text,
)
from dynamig.planner import plan
from dynamig.planner.model import (
    CurrentInstance,
    GpuState,
)
from dynamig.planner.model import Policy as PlannerPolicy

_TOGETHER_NODES_TRIED = 8


@dataclass(frozen=True, slots=True)
class Room:
    profile: str
    places: tuple[tuple[str, PlacedInstance], ...]  # (GPU, placement)


class Fleet:
    """GPUs of one inventory indexed by node, with what fits on each cached for the round: a burst of claims
    of one shape costs one scan, not one per claim."""

    def __init__(
        self, gpus: Sequence[GpuView], allowed: frozenset[str] | None, catalog: Catalog | None = None
    ) -> None:
        self.gpus = tuple(gpus)
        self.allowed = allowed
        self.catalog = catalog
        self.by_node: dict[str, list[GpuView]] = {}
        for g in gpus:
            if g.model is not None:
                self.by_node.setdefault(g.node, []).append(g)
        self.all_models = sorted({g.model.key for g in self.gpus if g.model is not None})
        self._fits: dict[tuple[str, str, bool], tuple[tuple[PlacedInstance, ...], int]] = {}
        self._rooms: dict[tuple[object, ...], Room | None] = {}
        self._node_models: dict[frozenset[str] | None, tuple[list[str], list[str]]] = {}
        self.verdicts: dict[tuple[object, ...], tuple[Reason, str, str, str]] = {}
        self._together: dict[tuple[object, ...], bool] = {}

    def __bool__(self) -> bool:
        return bool(self.gpus)

    def _eligible_nodes(self, claim: PendingClaim) -> tuple[list[str], list[str]]:
        """(eligible nodes, models on them) for the claim's node constraint."""
        if claim.nodes not in self._node_models:
            nodes = sorted(n for n in self.by_node if claim.nodes is None or n in claim.nodes)
            models = sorted({g.model.key for n in nodes for g in self.by_node[n] if g.model is not None})
            self._node_models[claim.nodes] = (nodes, models)
        return self._node_models[claim.nodes]

    def nodes(self, claim: PendingClaim) -> list[str]:
        return self._eligible_nodes(claim)[0]

    def eligible(self, claim: PendingClaim) -> list[GpuView]:
        return [g for n in self.nodes(claim) for g in self.by_node[n]]

    def shape(self, claim: PendingClaim) -> tuple[object, ...]:
        """What a verdict here depends on: node constraint, and per request the profiles per model."""
        per_request = tuple(
            (
                tuple((m, r.alternatives(None, frozenset({m}))) for m in self.all_models),
                r.alternative_counts(),
            )
            for r in claim.requests
        )
        return (claim.nodes, per_request, first_profile(claim))

    def can_serve(self, claim: PendingClaim) -> bool:
        """Every MIG request of the claim has an allowed profile on some GPU of an eligible node. Pure."""
        models = self._eligible_nodes(claim)[1]
        return bool(models) and all(
            any(r.alternatives(self.allowed, frozenset({m})) for m in models) for r in claim.requests
        )

    def _fit(self, g: GpuView, profile: str, existing: bool) -> tuple[tuple[PlacedInstance, ...], int]:
        """(places, how many fit at once) of ``profile`` on ``g``: its free instances (``existing``), or the
        placements beside its busy instances (free ones do not block: a booking destroys them first)."""
        key = (g.name, profile, existing)
        if key not in self._fits:
            assert g.model is not None
            if existing:
                free = tuple(i for i in g.free if i.profile == profile)
                self._fits[key] = (free, len(free))
            else:
                busy = tuple(g.busy)
                starts = free_starts(g.model, busy, profile)
                places = tuple(PlacedInstance(s, profile) for s in starts)
                self._fits[key] = (places, remaining_capacity(g.model, busy, profile) if places else 0)
        return self._fits[key]

    def room(self, claim: PendingClaim, r: RequestDemand, existing: bool) -> Room | None:
        """Where the devices of one accepted profile fit on one eligible node (as many as the alternative of
        that profile asks), or None. Pure."""
        nodes, models = self._eligible_nodes(claim)
        shape = tuple((m, r.alternatives(self.allowed, frozenset({m}))) for m in models)
        key = (shape, r.alternative_counts(), claim.nodes, existing)
        if key not in self._rooms:
            self._rooms[key] = self._find(nodes, r, existing)
        return self._rooms[key]

    def fits_together(self, group: Sequence[PendingClaim]) -> bool:
        """Whether one eligible node has room for every device of ``group`` (a claim's requests and the
        other claims of its pod) at once, beside the busy instances (free ones do not block). A single
        request is answered by :meth:`room` already; several are placed by the planner on one node at a
        time, the nodes with the most free memory slices first. Pure (cached for the round)."""
        if sum(len(c.requests) for c in group) <= 1:
            return True
        key = tuple(sorted((self.shape(c) for c in group), key=repr))
        if key not in self._together:
            self._together[key] = self._place_together(group)
        return self._together[key]

    def _place_together(self, group: Sequence[PendingClaim]) -> bool:
        nodes = set(self.by_node)
        for c in group:
            if c.nodes is not None:
                nodes &= c.nodes
        need = sum(r.min_count for c in group for r in c.requests)
        room: dict[str, int] = {}
        for node in nodes:
            free = 0
            for g in self.by_node[node]:
                assert g.model is not None
                busy = sum(g.model.profile(i.profile).placement_size for i in g.busy)
                free += g.model.memory_slices - busy
            if free >= need:  # every device takes at least one memory slice
                room[node] = free
        for node in sorted(room, key=lambda n: (-room[n], n))[:_TOGETHER_NODES_TRIED]:
            here = self.by_node[node]
            models = frozenset(g.model.key for g in here if g.model is not None)
            demands = [
                replace(d, name=f"{i}/{d.name}", nodes=frozenset({node}))  # names unique within the group
                for i, c in enumerate(group)
                for d in c.planner_demands(self.allowed, models)
            ]
            if len(demands) < sum(len(c.requests) for c in group):
                continue  # a request with no allowed profile on this node's models
            states = [
                GpuState(
                    node=node,
                    index=g.index,
                    model=g.model.key,
                    instances=tuple(CurrentInstance(i.profile, i.start, busy=True) for i in g.busy),
                )
                for g in here
                if g.model is not None
            ]
            result = plan(states, demands, PlannerPolicy(allowed_profiles=self.allowed), self.catalog)
            if not result.unsatisfied:
                return True
        return False

    def _find(self, nodes: Sequence[str], r: RequestDemand, existing: bool) -> Room | None:
        for node in nodes:
            here = self.by_node[node]
            profiles: list[str] = []
            for g in here:
                assert g.model is not None
                for p in r.alternatives(self.allowed, frozenset({g.model.key})):
                    if p not in profiles:
                        profiles.append(p)
            for p in profiles:
                places: list[tuple[str, PlacedInstance]] = []
                capacity = 0
                for g in here:
                    assert g.model is not None
                    if g.model.has_profile(p):
                        fit, n = self._fit(g, p, existing)
                        places.extend((g.name, i) for i in fit)
                        capacity += n
                if capacity >= r.count_for(p):
                    return Room(p, tuple(places))
        return None


def _places_text(room: Room, limit: int = 4) -> str:
    """``1g.10gb@4, 1g.10gb@5 on node-a-gpu0 (+3 more)``. Pure."""
    groups: dict[str, list[str]] = {}
    for gpu, inst in room.places[:limit]:
        groups.setdefault(gpu, []).append(f"{inst.profile}@{inst.start}")
    shown = "; ".join(f"{', '.join(items)} on {gpu}" for gpu, items in groups.items())
    more = len(room.places) - limit
    return f"{shown} (+{more} more)" if more > 0 else shown


def booking_verdict(
    claim: PendingClaim, policy: GpuPartitionPolicy, fleet: Fleet, mates: Sequence[PendingClaim] = ()
) -> ClaimVerdict:
    """The verdict on a claim the scheduler books on partitionable GPUs (nothing is planned ahead). A claim
    whose devices (with those of ``mates``, the other claims of its pod) each fit some node, but no node all
    together, is ``NoCapacity``: the scheduler binds a pod to one node with every device it asks for. Pure."""
    key = (fleet.shape(claim), tuple(sorted((fleet.shape(m) for m in mates), key=repr)))
    if key not in fleet.verdicts:
        v = _new_booking_verdict(claim, policy, fleet)
        if v.reason is Reason.WAITING_FOR_SCHEDULER and not fleet.fits_together((claim, *mates)):
            v = _apart_verdict(claim, policy, fleet, mates)
        fleet.verdicts[key] = (v.reason, v.message, v.profile, v.gpu)
    reason, message, profile, gpu = fleet.verdicts[key]
    return ClaimVerdict(claim, reason, message, profile, gpu)


def _apart_verdict(
    claim: PendingClaim, policy: GpuPartitionPolicy, fleet: Fleet, mates: Sequence[PendingClaim]
) -> ClaimVerdict:
    """NoCapacity for a claim whose pod's devices fit no single node together. Pure."""
    group = (claim, *mates)
    devices = sum(r.min_count for c in group for r in c.requests)
    what = f"its {len(claim.requests)} requests" if not mates else f"the {len(group)} claims of its pod"
    eligible = fleet.eligible(claim) or list(fleet.gpus)
    return ClaimVerdict(
        claim,
        Reason.NO_CAPACITY,
        no_capacity_text(claim, policy, eligible, "partitionable ")
        + f"; {what} need {devices} devices on one node, and no eligible node has room for all of them "
        "beside its allocated instances (each alone would fit)",
        first_profile(claim),
    )


def _new_booking_verdict(claim: PendingClaim, policy: GpuPartitionPolicy, fleet: Fleet) -> ClaimVerdict:
    dry = policy.spec.mode == Mode.DRY_RUN
    free = [fleet.room(claim, r, existing=True) for r in claim.requests] if dry else []
    if free and all(free) and free[0] is not None:
        room = free[0]
        return ClaimVerdict(
            claim,
            Reason.WAITING_FOR_SCHEDULER,
            f"free {'instances' if len(room.places) > 1 else 'instance'} {_places_text(room)} can serve the "
            "claim; waiting for kube-scheduler to allocate one",
            room.profile,
            room.places[0][0],
        )
    cut = [fleet.room(claim, r, existing=False) for r in claim.requests]
    if all(cut) and cut[0] is not None:
        room = cut[0]
        if dry:
            return ClaimVerdict(
                claim,
                Reason.WOULD_RESHAPE,
                f"policy {policy.name} is DryRun and offers only existing instances; it would offer "
                f"{_places_text(room)}, which could serve the claim",
                room.profile,
                room.places[0][0],
            )
        return ClaimVerdict(
            claim,
            Reason.WAITING_FOR_SCHEDULER,
            f"offered placements {_places_text(room)} can serve the claim; waiting for kube-scheduler to "
            "book one (the node agent cuts it before the pod binds)",
            room.profile,
            room.places[0][0],
        )
    eligible = fleet.eligible(claim) or list(fleet.gpus)
    return ClaimVerdict(
        claim,
        Reason.NO_CAPACITY,
        no_capacity_text(claim, policy, eligible, "partitionable ")
        + "; no offered placement fits beside them",
        first_profile(claim),
    )
