"""What a node offers through DRA: every free MIG instance and every valid placement of the allowed profiles,
as partitionable devices (KEP-4815) that wait for the node agent before the pod binds (KEP-5007). Pure.

Counters
--------
Each GPU gets one counter set, ``gpu<index>``, and every device consumes from its GPU's set what its
placement occupies, so that a set of devices fits the counters exactly when ``check_layout`` accepts the
layout they form (proved per catalog model in ``tests/unit/test_inventory_counters.py``):

* ``mem-<i>`` (1 each): memory slice ``i``; a placement consumes 1 of every slice it spans -> no overlap.
* ``media-me`` (1): every ``+me`` profile consumes 1 -> at most one ``+me`` instance per GPU.
* ``media-all`` (memory slices, N): a ``+me.all`` profile consumes N, every profile but ``-me`` consumes 1,
  ``-me`` nothing -> a ``+me.all`` instance has only ``-me`` instances beside it (N + 1 > N), and without
  one the counter never binds (a GPU holds at most N instances).
* ``cap-<profile id>`` (the profile's instance cap): only for a profile whose cap is below the number of
  non-overlapping placements it has (none in today's catalog; ``+me`` / ``+me.all`` are capped at 1 by
  the media counters already).

A counter set carries only the counters some published device consumes (a counter nothing consumes can
never bind), so the sets stay well below the API's 32 counters.

What is published
-----------------
* ``free`` instances: the device of their placement (same name whether the instance exists or not), with
  the MIG UUID and NVML's memory; first in the order (zero wait).
* new placements of the allowed profiles that fit beside the instances that stay (see
  :mod:`dynamig.planner.ranking` for the order); one that overlaps free instances means "destroy those,
  cut this".
* ``allocated`` instances (a claim allocation names their device): still published, last, because the
  scheduler subtracts the counters of allocated devices only for devices it finds in the pool's slices.
* ``booked`` devices (allocated with binding conditions, not answered yet) the offer above lacks: still
  published, with their counters and binding conditions, until the agent answers. The scheduler counts an
  allocated device's counters only while the device is in the pool's current slices (allocator_incubating.go
  looks the counters up in the slices it gathers): if the offer changes between a booking and its answer
  (``offeredProfiles`` narrowed, a floor instance re-ranking the GPU), a vanished placement would leave its
  counters free and an overlapping second booking would go through, one of the two then answered failed.
* ``busy`` instances (busy outside DRA: processes, or not ours): not published; their counters are taken
  out of the counter set's values instead, and placements that would need them gone are not offered. The
  reduced counters then say exactly "fits beside the busy instances", with no device the scheduler could
  hand out.

* the ``whole`` GPU (``GpuInventory.whole``, GpuPartition ``spec.offerWhole``): the GPU as one device
  (``gpu<index>``, profile ``whole``) beside its MIG devices, consuming every counter of its set at full
  value, so the scheduler books it only while nothing of the GPU is allocated, and nothing of the GPU while
  it is; last, guarded (the agent switches MIG off before answering). Only on a GPU with no allocated or
  busy instance and no held placement.

``allowed_profiles`` governs new placements only: an empty set offers just the existing free instances
(``Static`` / ``DryRun`` policies).

A device that needs NVML work before its pod may run (a placement to cut), and an instance the agent is
retiring (``Instance.guarded``, see :mod:`dynamig.agent.layout.lifecycle`), carries ``bindingConditions:
[mig.dynamig.io/ready]`` and ``bindingFailureConditions: [mig.dynamig.io/failed]``: the scheduler holds the
pod's binding until the node agent reports the instance ready in the claim's ``status.devices``, or releases
the allocation when it reports failure. Every other existing instance carries none and binds in the
scheduling cycle: kube-scheduler re-checks binding conditions only every 5 s (dynamicresources.go PreBind,
``wait.PollUntilContextTimeout(ctx, 5*time.Second, ...)``), so a condition costs its pod at least that.
``bindsToNode`` is not set: the slices name their node (``nodeName``), which already restricts an
allocation to that node (allocator_incubating.go, ``nodeName != nil || BindsToNode``).

Slices
------
In Kubernetes 1.36 a slice holds either devices or counter sets, never both; the counter sets go in
slices of their own (``<node>-mig.dynamig.io-counters-NNN``, at most 8 sets each) and the devices, in rank
order, in slices of at most 64 (``...-devices-NNN``, named so that name order is rank order). Every slice
carries the pool's ``generation`` and ``resourceSliceCount`` (counter slices included) and a digest of its
content (order kept) as ``dynamig.io/content-hash``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from dynamig import DRIVER_NAME
from dynamig.geometry.layout import check_layout
from dynamig.geometry.model import (
    GpuModel,
    Layout,
    MediaExtension,
    PlacedInstance,
    Profile,
    placement_of,
)
from dynamig.kube.devices import MigDevice
from dynamig.kube.slices import CONTENT_ANNOTATION, ordered_content_hash, ordered_slice_name
from dynamig.planner.ranking import GpuOffers, OfferKind, rank_offers

# Limits of resource.k8s.io/v1 in Kubernetes v1.36.3 and v1.37.2, from pkg/apis/resource/types.go (checked in
# pkg/apis/resource/validation/validation.go, validateResourceSliceSpec / validateDevice).
MAX_DEVICES_PER_SLICE_WITH_COUNTERS = 64  # types.go ResourceSliceMaxDevicesWithAdvancedFeatures
MAX_COUNTER_SETS_PER_SLICE = 8  # types.go ResourceSliceMaxCounterSets
MAX_COUNTERS_PER_SET = 32  # types.go ResourceSliceMaxCountersPerCounterSet
MAX_COUNTER_CONSUMPTIONS_PER_DEVICE = 2  # types.go ResourceSliceMaxDeviceCounterConsumptionsPerDevice
MAX_COUNTERS_PER_CONSUMPTION = 32  # types.go ResourceSliceMaxCountersPerDeviceCounterConsumption
MAX_BINDING_CONDITIONS = 4  # types.go BindingConditionsMaxSize
MAX_BINDING_FAILURE_CONDITIONS = 4  # types.go BindingFailureConditionsMaxSize
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # types.go ResourceSliceMaxAttributesAndCapacitiesPerDevice
DNS_LABEL_MAX = 63  # device, counter set and counter names are DNS labels (validation.go)

# Condition types the agent sets in ResourceClaim.status.devices[].conditions (label names, validation.go
# validateDeviceBindingParameters).
BINDING_READY = f"{DRIVER_NAME}/ready"
BINDING_FAILED = f"{DRIVER_NAME}/failed"

COUNTER_SLICE_PART = "counters"
DEVICE_SLICE_PART = "devices"


class InventoryError(ValueError):
    """The inventory cannot be published as asked (an impossible layout, or an API limit exceeded)."""


class Occupancy(StrEnum):
    FREE = "free"  # offered as it is, or destroyed to make room
    ALLOCATED = "allocated"  # a claim allocation names its device: published, counters held by the allocation
    BUSY = "busy"  # busy outside DRA (processes, not ours): not published, counters taken out


@dataclass(frozen=True, slots=True)
class Instance:
    """An existing MIG instance on a GPU."""

    profile: str
    start: int
    occupancy: Occupancy
    uuid: str = ""  # MIG UUID
    memory_bytes: int | None = None  # from NVML
    multiprocessors: int | None = None
    guarded: bool = False  # free but being retired: published with binding conditions

    @property
    def placed(self) -> PlacedInstance:
        return PlacedInstance(self.start, self.profile)


@dataclass(frozen=True, slots=True)
class GpuInventory:
    """One GPU as the agent knows it (builder input)."""

    index: int
    model: GpuModel
    parent_uuid: str
    product_name: str = ""  # NVML product name; the model's canonical one when empty
    instances: tuple[Instance, ...] = ()
    allowed_profiles: frozenset[str] | None = None  # new placements offered; None: every profile of the model
    # At most this many placements to cut per profile (the best-ranked ones); 0: every valid placement. Fewer
    # devices per node are what keeps kube-scheduler's cost flat at 1,000 nodes (docs/benchmarks.md).
    placements_per_profile: int = 0
    # Placements kept for one claim each (preemption, agent/bindings/holds.py): no other device over their
    # memory slices is offered (the held placement is, to be cut for that claim).
    held: tuple[PlacedInstance, ...] = ()
    # The whole GPU's device (a resource.k8s.io/v1 Device: name, attributes, capacity), offered beside the
    # MIG devices sharing their counters; None: not offered (see the module docstring).
    whole: Mapping[str, Any] | None = None

    def layout(self, *states: Occupancy) -> Layout:
        return tuple(sorted(i.placed for i in self.instances if i.occupancy in states))


@dataclass(frozen=True, slots=True)
class OfferedDevice:
    """One published device and why it is there."""

    kind: str  # an OfferKind value ("free", "new", "recut"), "allocated" or "booked"
    device: MigDevice
    counters: Mapping[str, int]  # consumed from counter set ``counter_set_name(gpu_index)``
    destroys: Layout = ()  # free instances this placement needs destroyed
    guarded: bool = True  # carries binding conditions: the agent answers before the pod binds

    @property
    def name(self) -> str:
        return self.device.name

    @property
    def gpu_index(self) -> int:
        return self.device.gpu_index

    @property
    def profile(self) -> str:
        return self.device.profile.name

    @property
    def start(self) -> int:
        return self.device.placement_start

    def to_api(self) -> dict[str, Any]:
        """The resource.k8s.io/v1 ``Device``: attributes and capacity, counters, and binding conditions when
        it is guarded."""
        return _consuming(self.device.to_api(), self.gpu_index, self.counters, self.guarded)


def _consuming(
    body: Mapping[str, Any], gpu_index: int, counters: Mapping[str, int], guarded: bool
) -> dict[str, Any]:
    """The ``Device`` ``body`` consuming ``counters`` from its GPU's counter set, with binding conditions when
    ``guarded``. Pure."""
    out = {
        **body,
        "consumesCounters": [
            {
                "counterSet": counter_set_name(gpu_index),
                "counters": {k: {"value": str(v)} for k, v in counters.items()},
            }
        ],
    }
    if guarded:
        out["bindingConditions"] = [BINDING_READY]
        out["bindingFailureConditions"] = [BINDING_FAILED]
    return out


# ------------------------------------------------------------------------------------------ counters
def counter_set_name(gpu_index: int) -> str:
    return f"gpu{gpu_index}"


def _mem(i: int) -> str:
    return f"mem-{i}"


def _cap(p: Profile) -> str:
    return f"cap-{p.profile_id}"


MEDIA_ME = "media-me"
MEDIA_ALL = "media-all"


def _max_disjoint(p: Profile) -> int:
    """Most instances of ``p`` that fit side by side by memory slices alone (interval scheduling)."""
    count, end = 0, -1
    for s in sorted(p.placement_starts, key=lambda s: s + p.placement_size):
        if s > end:
            count, end = count + 1, s + p.placement_size - 1
    return count


def _needs_cap(p: Profile) -> bool:
    return p.media not in (MediaExtension.ME, MediaExtension.ME_ALL) and _max_disjoint(p) > p.max_instances


def counter_capacity(model: GpuModel) -> dict[str, int]:
    """The full counter set of an idle GPU of ``model`` (before trimming to what is published). Pure."""
    out = {_mem(i): 1 for i in range(model.memory_slices)}
    media = {p.media for p in model.profiles}
    if MediaExtension.ME in media:
        out[MEDIA_ME] = 1
    if MediaExtension.ME_ALL in media:
        out[MEDIA_ALL] = model.memory_slices
    for p in model.profiles:
        if _needs_cap(p):
            out[_cap(p)] = p.max_instances
    return out


def counter_consumption(model: GpuModel, profile: str, start: int) -> dict[str, int]:
    """What one instance of ``profile`` at ``start`` consumes from its GPU's counter set. Pure."""
    p = model.profile(profile)
    out = {_mem(i): 1 for i in p.span(start)}
    if p.media is MediaExtension.ME:
        out[MEDIA_ME] = 1
    if any(q.media is MediaExtension.ME_ALL for q in model.profiles):
        if p.media is MediaExtension.ME_ALL:
            out[MEDIA_ALL] = model.memory_slices
        elif p.media is not MediaExtension.NO_ME:
            out[MEDIA_ALL] = 1
    if _needs_cap(p):
        out[_cap(p)] = 1
    return out


def fits(capacity: Mapping[str, int], consumptions: Iterable[Mapping[str, int]]) -> bool:
    """True when the summed ``consumptions`` stay within ``capacity`` (a missing counter has none): the
    scheduler's check for one counter set. Pure."""
    used: dict[str, int] = {}
    for c in consumptions:
        for k, v in c.items():
            used[k] = used.get(k, 0) + v
    return all(v <= capacity.get(k, 0) for k, v in used.items())


# ------------------------------------------------------------------------------------------ devices
def _mig_device(gpu: GpuInventory, profile: str, start: int, inst: Instance | None) -> MigDevice:
    return MigDevice(
        gpu_index=gpu.index,
        profile=gpu.model.profile(profile),
        placement_start=start,
        product_name=gpu.product_name or gpu.model.product_name,
        parent_uuid=gpu.parent_uuid,
        uuid=inst.uuid if inst else "",
        memory_bytes=inst.memory_bytes if inst else None,
        multiprocessors=inst.multiprocessors if inst else None,
    )


def offered_devices(gpus: Sequence[GpuInventory]) -> tuple[OfferedDevice, ...]:
    """Every device the node publishes, in publishing order: ranked offers, then allocated instances. Pure.

    InventoryError when a GPU's existing instances do not form a layout its model accepts.
    """
    gpus = sorted(gpus, key=lambda g: g.index)
    by_index = {g.index: g for g in gpus}
    offers_in = []
    for g in gpus:
        held = g.layout(Occupancy.ALLOCATED, Occupancy.BUSY)
        free = g.layout(Occupancy.FREE)
        violation = check_layout(g.model, (*held, *free))
        if violation is not None:
            raise InventoryError(f"gpu{g.index}: existing instances are not a valid layout: {violation}")
        offers_in.append(GpuOffers(g.index, g.model, held, free, g.allowed_profiles))
    try:
        ranked = rank_offers(offers_in)
    except ValueError as exc:
        raise InventoryError(str(exc)) from None
    out: list[OfferedDevice] = []
    placements: dict[tuple[int, str], int] = {}  # (GPU, profile) -> placements offered so far
    for o in ranked:
        g = by_index[o.gpu_index]
        if g.held and _over_held(g, PlacedInstance(o.start, o.profile)):
            continue
        if o.kind is not OfferKind.FREE and g.placements_per_profile:
            seen = placements[(g.index, o.profile)] = placements.get((g.index, o.profile), 0) + 1
            if seen > g.placements_per_profile:
                continue  # ranked order: the ones kept are the best
        inst = (
            next((i for i in g.instances if i.placed == o.placed), None) if o.kind is OfferKind.FREE else None
        )
        out.append(
            OfferedDevice(
                o.kind.value,
                _mig_device(g, o.profile, o.start, inst),
                counter_consumption(g.model, o.profile, o.start),
                o.destroys,
                guarded=inst is None or inst.guarded,  # a placement to cut, or an instance being retired
            )
        )
    for g in gpus:
        for i in sorted(g.instances, key=lambda i: i.placed):
            if i.occupancy is Occupancy.ALLOCATED:
                out.append(
                    OfferedDevice(
                        Occupancy.ALLOCATED.value,
                        _mig_device(g, i.profile, i.start, i),
                        counter_consumption(g.model, i.profile, i.start),
                        guarded=False,  # it exists; a second allocation (admin access) binds at once
                    )
                )
    return tuple(out)


def _over_held(g: GpuInventory, placed: PlacedInstance) -> bool:
    """Whether ``placed`` takes memory slices of a placement ``g`` holds for a claim, other than that
    placement itself. Pure."""
    mask = g.model.profile(placed.profile).mask(placed.start)
    return any(h != placed and g.model.profile(h.profile).mask(h.start) & mask for h in g.held)


@dataclass(frozen=True, slots=True)
class WholeOffer:
    """The whole GPU offered beside its MIG devices: it consumes every counter of the GPU's set."""

    gpu_index: int
    device: Mapping[str, Any]
    counters: Mapping[str, int]

    def to_api(self) -> dict[str, Any]:
        """The ``Device``: its counters, and binding conditions (the agent switches MIG off first)."""
        return _consuming(self.device, self.gpu_index, self.counters, guarded=True)


def whole_offers(gpus: Sequence[GpuInventory]) -> tuple[WholeOffer, ...]:
    """The whole GPUs offered beside their MIG devices, by GPU index: each GPU with ``whole`` set and no
    allocated or busy instance and no held placement. Pure."""
    return tuple(
        WholeOffer(g.index, g.whole, counter_capacity(g.model))
        for g in sorted(gpus, key=lambda g: g.index)
        if g.whole is not None and not g.held and not g.layout(Occupancy.ALLOCATED, Occupancy.BUSY)
    )


def counter_sets(
    gpus: Sequence[GpuInventory], devices: Sequence[OfferedDevice], whole: Sequence[WholeOffer] = ()
) -> list[dict[str, Any]]:
    """The ``CounterSet`` objects for ``devices`` and the ``whole`` GPUs offered: per GPU the counters they
    consume, less what the busy instances hold. A GPU none of whose devices is published gets no set.
    Pure."""
    out = []
    for g in sorted(gpus, key=lambda g: g.index):
        consumed = {k for d in devices if d.gpu_index == g.index for k in d.counters}
        consumed |= {k for w in whole if w.gpu_index == g.index for k in w.counters}
        if not consumed:
            continue
        capacity = counter_capacity(g.model)
        for i in g.instances:
            if i.occupancy is Occupancy.BUSY:
                for k, v in counter_consumption(g.model, i.profile, i.start).items():
                    capacity[k] -= v
        counters = {k: {"value": str(v)} for k, v in capacity.items() if k in consumed}
        if len(counters) > MAX_COUNTERS_PER_SET:
            raise InventoryError(
                f"gpu{g.index}: {len(counters)} counters, the API allows {MAX_COUNTERS_PER_SET}"
            )
        out.append({"name": counter_set_name(g.index), "counters": counters})
    return out


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


BOOKED = "booked"  # OfferedDevice.kind of a device kept for an allocation not answered yet


def _booked_device(gpus: Sequence[GpuInventory], name: str) -> OfferedDevice | None:
    """The device ``name`` stands for on one of ``gpus``, as a guarded placement; None when it names no
    placement here, or an instance busy outside DRA (its counters are already out of the set)."""
    for g in gpus:
        placed = placement_of(name, g.index, g.model)
        if placed is None:
            continue
        if any(i.placed == placed and i.occupancy is Occupancy.BUSY for i in g.instances):
            return None
        device = MigDevice(
            gpu_index=g.index,
            profile=g.model.profile(placed.profile),
            placement_start=placed.start,
            product_name=g.product_name or g.model.product_name,
            parent_uuid=g.parent_uuid,
        )
        return OfferedDevice(BOOKED, device, counter_consumption(g.model, placed.profile, placed.start))
    return None


def published_devices_of(
    gpus: Sequence[GpuInventory], booked: Collection[str] = ()
) -> tuple[OfferedDevice, ...]:
    """What the pool publishes: the offer of ``gpus`` (:func:`offered_devices`), then every ``booked`` device
    it lacks, in name order. Pure; InventoryError as the offer raises it."""
    devices = offered_devices(gpus)
    have = {d.name for d in devices}
    kept = (_booked_device(gpus, name) for name in sorted(set(booked) - have))
    return (*devices, *(d for d in kept if d is not None))


def build_inventory_slices(
    node: str,
    generation: int,
    gpus: Sequence[GpuInventory],
    driver: str = DRIVER_NAME,
    booked: Collection[str] = (),
    whole: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The ResourceSlices (resource.k8s.io/v1) that publish the node's inventory as pool ``node`` at
    ``generation``, every ``booked`` device kept: counter-set slices first, then device slices in rank order
    (see the module docstring), then the whole GPUs offered beside their MIG devices, then the ``whole``
    GPUs' devices (MIG mode off: no counters, nothing to cut). Always at least one device slice, so the pool
    and its generation stay visible. Pure."""
    devices = published_devices_of(gpus, booked)
    offers = whole_offers(gpus)
    sets = counter_sets(gpus, devices, offers)
    api_devices = [d.to_api() for d in devices] + [o.to_api() for o in offers]
    api_devices += sorted(whole, key=lambda d: str(d["name"]))
    for d in api_devices:
        if len(d["name"]) > DNS_LABEL_MAX:
            raise InventoryError(f"device name {d['name']!r} is longer than {DNS_LABEL_MAX} characters")
        if len(d["attributes"]) + len(d["capacity"]) > MAX_ATTRIBUTES_AND_CAPACITIES:
            raise InventoryError(f"device {d['name']}: more than {MAX_ATTRIBUTES_AND_CAPACITIES} attributes")
    counter_chunks = _chunks(sets, MAX_COUNTER_SETS_PER_SLICE)
    device_chunks = _chunks(api_devices, MAX_DEVICES_PER_SLICE_WITH_COUNTERS) or [[]]
    total = len(counter_chunks) + len(device_chunks)

    def make(part: str, index: int, key: str, content: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "name": ordered_slice_name(node, part, index, driver),
                "annotations": {CONTENT_ANNOTATION: ordered_content_hash({key: list(content)})},
            },
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {"name": node, "generation": generation, "resourceSliceCount": total},
                key: list(content),
            },
        }

    return [make(COUNTER_SLICE_PART, i, "sharedCounters", c) for i, c in enumerate(counter_chunks)] + [
        make(DEVICE_SLICE_PART, i, "devices", c) for i, c in enumerate(device_chunks)
    ]


# ------------------------------------------------------------------------------------------ names
@dataclass(frozen=True, slots=True)
class DeviceRef:
    """What a device name denotes: a placement of a profile on a GPU."""

    gpu_index: int
    profile: str
    start: int
    model: GpuModel = field(compare=False, repr=False)


_GPU_PREFIX = re.compile(r"^gpu(\d+)-")


def device_ref(name: str, models: Mapping[int, GpuModel]) -> DeviceRef | None:
    """The (GPU, profile, start) that device ``name`` stands for, given each GPU's model by index; None when
    the name is none of them. The inverse of ``geometry.model.device_name``, found by building the names
    rather than parsing them, so it follows any change of the naming scheme. Pure."""
    m = _GPU_PREFIX.match(name)
    if m is None:
        return None
    index = int(m.group(1))
    model = models.get(index)
    if model is None:
        return None
    placed = placement_of(name, index, model)
    return None if placed is None else DeviceRef(index, placed.profile, placed.start, model)
