"""What the agent says about one GPU, decided without I/O: whether it refuses the GPU, the instances it
publishes and how, the GpuPartition status and its conditions. Pure functions of what a round observed."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamig.agent.layout.reconcile import GpuPlan
from dynamig.agent.nvml.device import GpuInfo, MigInstance
from dynamig.geometry.model import PlacedInstance, device_name
from dynamig.kube.devices import MigDevice
from dynamig.kube.gpupartition import (
    ConditionType,
    GpuPartition,
    GpuPartitionStatus,
    InstanceState,
    InstanceStatus,
    Inventory,
    MigMode,
    Phase,
    Reason,
    layout_summary,
    set_condition,
)
from dynamig.kube.inventory import GpuInventory, Instance, InventoryError, Occupancy, offered_devices

Claims = Mapping[str, Sequence[str]]  # device name -> "namespace/name" of the claims allocating it
Problem = tuple[str, str]  # (reason, message)


@dataclass(slots=True)
class GpuOutcome:
    """What one GPU contributes to a round: devices to publish and the status to write."""

    name: str
    devices: list[dict[str, Any]] = field(default_factory=list)
    published: set[PlacedInstance] = field(default_factory=set)
    status: GpuPartitionStatus | None = None
    busy: bool = False  # still reshaping: poll again soon
    instances: list[MigInstance] = field(default_factory=list)
    inventory: GpuInventory | None = None  # partitionable inventory: what to publish for this GPU
    whole: dict[str, Any] | None = None  # MIG mode off: the whole GPU's device, in either inventory
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)


def mig_mode(gpu: GpuInfo) -> MigMode:
    if gpu.mig_current != gpu.mig_pending:
        return MigMode.ENABLE_PENDING if gpu.mig_pending == 1 else MigMode.DISABLE_PENDING
    return MigMode.ENABLED if gpu.mig_current == 1 else MigMode.DISABLED


def refusal(gpu: GpuInfo, part: GpuPartition, owner: str | None) -> Problem | None:
    """Why the agent must leave this GPU alone (change nothing, offer nothing), or None."""
    recorded = part.status.uuid
    if recorded and recorded != gpu.uuid:
        # The index now names another physical GPU: its GpuPartition's layout is not for this one.
        return (
            Reason.GPU_REPLACED,
            f"this GpuPartition describes GPU {recorded}, but index {gpu.index} is now {gpu.uuid}; "
            "nothing is changed or offered until the GpuPartition is deleted (it is then re-created "
            "adopting the GPU as it is)",
        )
    if owner is not None:
        return Reason.FOREIGN_MIG_OWNER, f"not managing this GPU: {owner}"
    if gpu.model is None:
        return Reason.UNKNOWN_MODEL, (
            f"GPU product {gpu.product!r} is not in the MIG catalog (served whole only where its "
            "GpuPartition asks spec.migMode Disabled)"
        )
    if gpu.mig_current != gpu.mig_pending:
        return Reason.MIG_MODE_PENDING, "MIG mode change pending; the GPU needs a reset"
    if not gpu.mig_enabled:
        return Reason.MIG_DISABLED, "MIG mode is disabled on this GPU; the agent does not enable it"
    return None


def instance_state(dev: str, i: MigInstance, claims: Claims, prepared: Collection[str]) -> InstanceState:
    if i.processes > 0 or dev in prepared or i.partitioned:
        return InstanceState.IN_USE
    return InstanceState.ALLOCATED if claims.get(dev) else InstanceState.FREE


def gpu_status(
    node: str,
    inventory: Inventory | None,
    gpu: GpuInfo,
    part: GpuPartition,
    instances: Sequence[MigInstance],
    claims: Claims,
    prepared: Collection[str],
    published: Collection[PlacedInstance],
    phase: Phase,
    message: str,
) -> GpuPartitionStatus:
    """The GpuPartition status for the GPU as observed (conditions as they were), its NVLink facts included
    whatever its MIG mode."""
    items = []
    for i in instances:
        dev = device_name(i.gpu_index, i.profile, i.start)
        items.append(
            InstanceStatus(
                profile=i.profile,
                start=i.start,
                size=i.size,
                device_name=dev,
                mig_uuid=i.mig_uuid,
                gpu_instance_id=i.gi_id,
                compute_instance_id=i.ci_id,
                state=instance_state(dev, i, claims, prepared),
                published=i.placed in published,
                claims=sorted(set(claims.get(dev, []))),
            )
        )
    free = sum(1 for s in items if s.state == InstanceState.FREE and s.published)
    return part.status.model_copy(
        update={
            "node": node,
            "gpu_index": gpu.index,
            "uuid": gpu.uuid,
            "product": gpu.product,
            "model": gpu.model.key if gpu.model is not None else "",
            "mig_mode": mig_mode(gpu),
            "instances": items,
            "whole_gpu": None,
            "nvlink_active_links": gpu.nvlink.active_links,
            "fabric_cluster_uuid": gpu.nvlink.fabric_cluster_uuid or None,
            "fabric_clique_id": gpu.nvlink.fabric_clique_id,
            "layout_summary": layout_summary([i.placed for i in instances]),
            "free_slices": free,
            "total_slices": len(items),
            "observed_generation": part.metadata.generation,
            "phase": phase,
            "message": message,
            "inventory": inventory,
        }
    )


def refused_status(
    status: GpuPartitionStatus, part: GpuPartition, problem: Problem, stamp: str
) -> GpuPartitionStatus:
    """``status`` of a refused GPU: Managed and Ready False with the refusal; a replaced GPU keeps the UUID
    its GpuPartition was made for until a person deletes it."""
    reason, message = problem
    conds = status.conditions
    for ctype in (ConditionType.MANAGED, ConditionType.READY):
        conds = set_condition(conds, ctype, False, reason, message, part.metadata.generation, stamp)
    update: dict[str, Any] = {"conditions": conds}
    if reason == Reason.GPU_REPLACED:
        update["uuid"] = part.status.uuid
    return status.model_copy(update=update)


def degraded_status(
    part: GpuPartition, why: str, reason: str, conditions: Sequence[str], stamp: str
) -> GpuPartitionStatus:
    """A GPU the round could not act on: Degraded, ``conditions`` False with ``reason``, offering nothing."""
    conds = part.status.conditions
    for ctype in conditions:
        conds = set_condition(conds, ctype, False, reason, why, part.metadata.generation, stamp)
    return part.status.model_copy(
        update={"phase": Phase.DEGRADED, "message": why, "conditions": conds, "free_slices": 0}
    )


def lost_status(part: GpuPartition, why: str, stamp: str) -> GpuPartitionStatus:
    return degraded_status(part, why, Reason.GPU_LOST, (ConditionType.HEALTHY, ConditionType.READY), stamp)


def readiness(
    index: int, plan: GpuPlan, blocker: Problem | None, notes: Sequence[str]
) -> tuple[str, bool, str]:
    """(message, Ready status, reason) for the Ready condition of a GPU the agent manages."""
    if plan.violation is not None:
        return f"spec.layout rejected, GPU left as is: {plan.violation}", False, Reason.INVALID_LAYOUT
    if blocker is not None:
        return blocker[1], False, blocker[0]
    parts: list[str] = list(notes)

    def name(p: PlacedInstance) -> str:
        return f"{device_name(index, p.profile, p.start)} ({p.profile}@{p.start})"

    parts += [f"kept {name(w.placed)}: {w.reason}" for w in plan.kept_busy]
    if plan.draining:
        parts += [f"draining {name(w.placed)}: {w.reason}" for w in plan.draining]
        return "; ".join(parts), False, Reason.DRAINING
    if plan.blocked:
        parts += [f"waiting to create {name(w.placed)}: {w.reason}" for w in plan.blocked]
        reason = Reason.INSTANCE_BUSY if plan.kept_busy else Reason.RESHAPING
        return "; ".join(parts), False, reason
    if plan.kept_busy or notes:
        return "; ".join(parts), False, Reason.INSTANCE_BUSY
    return "GPU matches spec.layout", True, Reason.LAYOUT_APPLIED


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def floor_kept(status: GpuPartitionStatus, part: GpuPartition, offered_placements: int) -> str:
    """The Ready message of a partitionable GPU with nothing left to do: what exists, what is booked, what
    is offered, and the floor (spec.layout) it keeps."""
    busy = sum(1 for i in status.instances if i.state != InstanceState.FREE)
    floor = part.spec.desired()
    kept = (
        f"floor spec.layout ({_count(len(floor), 'instance')}) kept" if floor else "floor spec.layout empty"
    )
    return (
        f"{_count(len(status.instances), 'instance')} ({busy} booked or in use), "
        f"{_count(offered_placements, 'placement')} offered to cut; {kept}"
    )


def floor_held(
    status: GpuPartitionStatus, plan: GpuPlan, ready: tuple[str, bool, str], offered_placements: int
) -> tuple[str, bool, str] | None:
    """The Ready of a partitionable GPU whose floor (spec.layout) waits only for bookings, else None.

    In the partitionable inventory the scheduler books placements over the floor's slices at any time, so a
    floor instance waiting for a booking to end is the expected state, not a fault: Ready stays True (the GPU
    serves bookings) with reason ``FloorHeld``. Anything else that holds the floor (a process or a split
    outside dynamig, a claim that won a race against a destroy, an NVML refusal) keeps its own reason."""
    if status.inventory is not Inventory.PARTITIONABLE or ready[2] != Reason.INSTANCE_BUSY:
        return None
    if not plan.blocked or plan.draining or plan.violation is not None:
        return None
    if ready != readiness(status.gpu_index or 0, plan, None, ()):
        return None  # notes of the round (a race, NVML in use) or a blocker: not the floor alone
    booked = {PlacedInstance(i.start, i.profile) for i in status.instances if i.claims}
    if any(w.placed not in booked for w in plan.kept_busy):
        return None  # held by processes or a split outside DRA: someone else's doing
    offered = f"{_count(offered_placements, 'placement')} offered to cut"
    return (
        f"floor spec.layout held by bookings, created once they end: {ready[0]}; {offered}",
        True,
        Reason.FLOOR_HELD,
    )


def managed_status(
    status: GpuPartitionStatus,
    part: GpuPartition,
    model_key: str,
    plan: GpuPlan,
    ready: tuple[str, bool, str],
    stamp: str,
    *,
    reshape_finished: bool,
    offered_placements: int,
    placements_per_profile: tuple[int, str] | None = None,
) -> GpuPartitionStatus:
    """``status`` of a GPU the agent manages, with its Managed, Healthy, LayoutValid and Ready conditions;
    ``placements_per_profile``: the partitionable offer's limit and how it was chosen (None: not offered)."""
    gen = part.metadata.generation
    ready = floor_held(status, plan, ready, offered_placements) or ready
    message, is_ready, reason = ready
    changes: dict[str, Any] = {"offered_placements": offered_placements}
    limit, choice = placements_per_profile or (None, None)
    changes["placements_per_profile"], changes["placements_per_profile_choice"] = limit, choice
    if reason == Reason.FLOOR_HELD:
        changes["message"] = message
    if reason == Reason.LAYOUT_APPLIED and status.inventory is Inventory.PARTITIONABLE:
        # spec.layout is only the floor here (pods book the rest): "matches spec.layout" would not be true.
        message = changes["message"] = floor_kept(status, part, offered_placements)
    conds = set_condition(
        status.conditions, ConditionType.MANAGED, True, Reason.MANAGED, "managed by dynamig", gen, stamp
    )
    conds = set_condition(
        conds, ConditionType.HEALTHY, True, Reason.GPU_PRESENT, "NVML reports the GPU", gen, stamp
    )
    if plan.violation is not None:
        text = f"spec.layout is invalid for {model_key}: {plan.violation}; nothing changed"
        conds = set_condition(
            conds, ConditionType.LAYOUT_VALID, False, Reason.INVALID_LAYOUT, text, gen, stamp
        )
    else:
        text = f"spec.layout is valid for {model_key}"
        conds = set_condition(conds, ConditionType.LAYOUT_VALID, True, Reason.VALID, text, gen, stamp)
    conds = set_condition(conds, ConditionType.READY, is_ready, reason, message, gen, stamp)
    changes["conditions"] = conds
    if reshape_finished:
        changes["last_reshape_time"] = stamp
    return status.model_copy(update=changes)


@dataclass(frozen=True, slots=True)
class Offer:
    """One GPU's partitionable inventory and what it means for the GpuPartition status."""

    inventory: GpuInventory | None  # None: nothing can be published (``problem`` says why)
    unguarded: frozenset[PlacedInstance]  # existing instances published without binding conditions
    placements: int  # placements offered to cut
    problem: str = ""


def partitionable_offer(
    gpu: GpuInfo,
    part: GpuPartition,
    instances: Sequence[MigInstance],
    claims: Claims,
    prepared: Collection[str],
    retiring: Collection[PlacedInstance],
    guard_free: bool,
    placements_per_profile: int = 0,
    held: Sequence[PlacedInstance] = (),
    whole: Mapping[str, Any] | None = None,
) -> Offer:
    """This GPU's partitionable inventory: free instances bookable at once unless ``retiring``, not yet
    listed by NVML as a MIG device (no UUID to answer with), or all of them with ``guard_free``: those are
    published guarded; allocated ones counted; busy ones unbookable; the best ``placements_per_profile``
    placements of each offered profile (0: all). Over the ``held`` placements nothing is offered but they
    themselves: allocated instances there count as busy, free ones are not offered. ``whole``: the whole
    GPU's device, offered beside (``GpuInventory.whole``)."""
    assert gpu.model is not None
    model = gpu.model
    over_held = {
        i.placed
        for i in instances
        for h in held
        if i.placed != h and model.profile(h.profile).mask(h.start) & model.profile(i.profile).mask(i.start)
    }
    items = []
    for i in instances:
        dev = device_name(i.gpu_index, i.profile, i.start)
        if i.partitioned or not i.has_compute_instance:
            occupancy = Occupancy.BUSY  # not a whole instance: nobody may book its slices
        elif claims.get(dev):
            occupancy = Occupancy.ALLOCATED  # published: the scheduler counts its counters as used
        elif i.processes > 0 or dev in prepared:
            occupancy = Occupancy.BUSY
        else:
            occupancy = Occupancy.FREE
        if occupancy is Occupancy.ALLOCATED and i.placed in over_held:
            # Not published, its counters taken out: when its pod lets go, the scheduler cannot hand it to
            # the next pod from a slice that still shows it (free instances over a hold are not offered).
            occupancy = Occupancy.BUSY
        guarded = occupancy is Occupancy.FREE and (i.placed in retiring or guard_free or not i.mig_uuid)
        items.append(
            Instance(i.profile, i.start, occupancy, i.mig_uuid, i.memory_bytes, i.multiprocessors, guarded)
        )
    offered = frozenset(p for p in part.spec.offered_profiles or () if gpu.model.has_profile(p))
    inv = GpuInventory(
        gpu.index, gpu.model, gpu.uuid, gpu.product, tuple(items), offered, placements_per_profile,
        tuple(held), whole,
    )  # fmt: skip
    try:
        devices = offered_devices([inv])
    except InventoryError as exc:
        return Offer(None, frozenset(), 0, f"nothing offered to the scheduler: {exc}")
    existing = (Occupancy.FREE.value, Occupancy.ALLOCATED.value)
    unguarded = frozenset(
        PlacedInstance(d.start, d.profile) for d in devices if d.kind in existing and not d.guarded
    )
    placements = sum(1 for d in devices if d.kind not in existing)
    return Offer(inv, unguarded, placements)


def mig_device(gpu: GpuInfo, i: MigInstance) -> dict[str, Any]:
    """The instances inventory's published device for instance ``i``."""
    assert gpu.model is not None
    return MigDevice(
        gpu_index=gpu.index,
        profile=gpu.model.profile(i.profile),
        placement_start=i.start,
        product_name=gpu.product,
        parent_uuid=gpu.uuid,
        uuid=i.mig_uuid,
        memory_bytes=i.memory_bytes,
        multiprocessors=i.multiprocessors,
    ).to_api()


def pods_by_claim(claims: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """``namespace/name`` of each claim -> the pods it is reserved for (``status.reservedFor``)."""
    out: dict[str, list[str]] = {}
    for c in claims:
        meta = c.get("metadata") or {}
        reserved = (c.get("status") or {}).get("reservedFor") or []
        pods = [str(r.get("name", "")) for r in reserved if r.get("resource") == "pods"]
        if pods:
            out[f"{meta.get('namespace', '')}/{meta.get('name', '')}"] = pods
    return out
