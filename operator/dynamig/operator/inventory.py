"""The GPUs a policy governs, read from GpuPartition objects, in the shape the planner takes. Pure.

An instance is busy (never removed or moved by the planner) when the agent reports it ``allocated`` or
``in-use``, or when a ResourceClaim allocation already names its device (the scheduler may have allocated
it a moment before the agent noticed). A GPU whose agent has not yet reported the current ``spec.layout``
(``observedGeneration`` behind ``generation``, or phase ``Reshaping``) is *in flight*: the operator writes
nothing to it until the agent has caught up, and plans it as the layout it is becoming. On a GPU with the
``Partitionable`` inventory ``spec.layout`` is a floor (instances kept pre-created; the scheduler books the
rest), so it is in flight only while some desired instance is still missing. GPUs that are
``Degraded``, have MIG off, are owned by another MIG manager, carry an uncleared critical XID
(``DevicesHealthy`` False: their devices are tainted) or are of a model the catalog lacks are not planned
at all; nor is a GPU whose ``spec.migMode`` asks for MIG mode off (the agent withdraws its devices, destroys
its free instances and switches once nothing uses it).

MIG mode: a GpuView carries the mode NVML reports (``status.migMode``), the one asked (``spec.migMode``, or
``Disabled`` while a claim allocates the whole device a GPU offers beside its slices, ``spec.offerWhole``: the
agent works toward that, as :func:`dynamig.agent.modes.booked.requested_mode` says), the agent's ``MigMode``
condition, the whole GPU's state, and what the operator wrote about switches in
annotations (when, for which claim, and the modes a GPU needs a reset for: ``dynamig.operator.modes``). It
carries the GPU's NVLink facts too (whatever its MIG mode), which a claim of whole GPUs may select on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dynamig import API_GROUP
from dynamig.geometry.catalog import Catalog
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, device_name, normalize_layout
from dynamig.kube.devices import NvlinkFacts
from dynamig.kube.gpupartition import (
    Condition,
    ConditionType,
    GpuPartition,
    InstanceState,
    Inventory,
    MigMode,
    MigModeRequest,
    Phase,
    Reason,
    WholeGpuStatus,
    parse_gpu_partition,
)
from dynamig.kube.names import GPU_INDEX_LABEL, NODE_LABEL, whole_device_name
from dynamig.kube.policy import GpuIdentity, check_layout_fits
from dynamig.kube.times import parse_time
from dynamig.planner.model import CurrentInstance, GpuState

# Written by the operator on a GpuPartition whenever it writes spec.layout (RFC 3339): cooldown starts here.
LAYOUT_WRITTEN_ANNOTATION = f"{API_GROUP}/layout-written-at"
# Written by the operator whenever it writes spec.migMode: when (RFC 3339: the switch cooldown starts here),
# the mode it wrote, and the claim (namespace/name) it switched the GPU for.
MIG_MODE_WRITTEN_ANNOTATION = f"{API_GROUP}/mig-mode-written-at"
MIG_MODE_REQUESTED_ANNOTATION = f"{API_GROUP}/mig-mode-requested"
MIG_MODE_FOR_ANNOTATION = f"{API_GROUP}/mig-mode-for"
# The MIG modes (comma-separated) the agent answered ResetRequired for on this GPU: never asked again. An
# administrator removes it once the platform exposes the reset (e.g. the node left its pass-through VM).
MIG_MODE_RESET_ANNOTATION = f"{API_GROUP}/mig-mode-reset-required"
# The policy that wrote spec.offerWhole (migMode.offerWhole): the operator withdraws only offers of its own.
WHOLE_OFFERED_BY_ANNOTATION = f"{API_GROUP}/whole-offered-by"


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU as the operator sees it."""

    name: str
    node: str
    index: int
    model: GpuModel | None
    product: str
    generation: int
    observed_generation: int | None
    desired: Layout
    actual: Layout
    busy: frozenset[PlacedInstance]
    claims_on: Mapping[PlacedInstance, tuple[str, ...]]
    in_flight: bool
    unusable: str  # why the GPU cannot be planned ("" when it can)
    last_written: float | None  # epoch seconds the operator last wrote spec.layout
    failure: str  # the agent's Ready=False message when it is stuck on the current generation
    inventory: Inventory | None = None  # None: the agent does not report one (treated as Instances)
    offered: tuple[str, ...] | None = None  # spec.offeredProfiles as it is now
    # Partitionable: the agent's Ready message while a floor instance waits for bookings to end (Ready True,
    # reason FloorHeld, at the current generation): expected, not a failure; "" otherwise.
    floor_held: str = ""
    # Placements kept for waiting claims (spec.holds): planned as busy, with nothing else over their slices.
    holds: tuple[PlacedInstance, ...] = ()
    # MIG mode Disabled: the agent publishes the GPU whole (``gpu<index>``, profile ``whole``); it is still
    # unusable for MIG layouts (``unusable`` says so), but serves whole-GPU claims (gpu.dynamig.io).
    whole: bool = False
    # MIG mode: what NVML reports, what spec.migMode asks (None: leave it), the agent's MigMode condition (at
    # the current generation; None otherwise), and the whole GPU's status while MIG mode is off.
    mig_mode: MigMode = MigMode.UNKNOWN
    mode_wanted: MigModeRequest | None = None
    mode_condition: Condition | None = None
    whole_gpu: WholeGpuStatus | None = None
    # The operator's annotations: when it last wrote spec.migMode (epoch seconds), whether spec.migMode is
    # what it wrote, the claim it switched for, and the modes the agent answered ResetRequired for.
    mode_written: float | None = None
    mode_by_operator: bool = False
    mode_for: str = ""
    whole_hold: str = ""  # the claim a hold of the whole GPU (spec.holds, profile whole) keeps it for
    reset_required: frozenset[MigModeRequest] = frozenset()
    trouble: str = ""  # why the GPU is unfit whatever its MIG mode (Degraded, unmanaged, XID, silent agent)
    nvlink: NvlinkFacts = field(default_factory=NvlinkFacts)  # as the agent reports them, any MIG mode
    # The whole device offered beside the MIG devices: spec.offerWhole, the policy that wrote it (annotation;
    # "" when a person did), whether the agent publishes it now (status.wholeOffered), and whether a claim
    # allocates it on a GPU that offers it (the agent switches MIG off for it, or keeps it off meanwhile).
    offer_whole: bool = False
    offer_whole_by: str = ""
    whole_offered: bool = False
    booked_whole: bool = False
    mode_asked: MigModeRequest | None = None  # spec.migMode as written (mode_wanted: what the agent heeds)

    @property
    def mode_reset_stuck(self) -> bool:
        """The agent answered ResetRequired for the switch spec.migMode asks: it is not tried again (a VM
        reboot would apply it)."""
        c = self.mode_condition
        return (
            self.mode_wanted is not None
            and not self._mode_reached
            and c is not None
            and not c.is_true
            and c.reason == Reason.RESET_REQUIRED
        )

    @property
    def _mode_reached(self) -> bool:
        want = self.mode_wanted
        return want is not None and self.mig_mode.value == want.value

    @property
    def switching(self) -> MigModeRequest | None:
        """The MIG mode spec.migMode asks and NVML does not report yet (None: no switch under way; a switch
        the agent answered ResetRequired for is none either)."""
        if self.mode_wanted is None or self._mode_reached or self.mode_reset_stuck:
            return None
        return self.mode_wanted

    @property
    def mode_target(self) -> MigModeRequest | None:
        """The MIG mode the GPU has or is switching to (None: unknown)."""
        if (to := self.switching) is not None:
            return to
        if self.mig_mode in (MigMode.ENABLED, MigMode.DISABLE_PENDING):  # pending: current is still on
            return MigModeRequest.ENABLED
        if self.mig_mode in (MigMode.DISABLED, MigMode.ENABLE_PENDING):
            return MigModeRequest.DISABLED
        return None

    @property
    def partitionable(self) -> bool:
        return self.inventory is Inventory.PARTITIONABLE

    @property
    def reshaping(self) -> bool:
        """In flight with instances still to change: counts against the disruption budget."""
        if self.partitionable:
            return self.in_flight  # only set while a desired instance is missing
        return self.in_flight and self.desired != self.actual

    @property
    def free(self) -> Layout:
        return tuple(i for i in self.actual if i not in self.busy)

    def state(self) -> GpuState:
        """Planner input for this GPU. Pure.

        A GPU in flight is planned as the layout it is becoming (``spec.layout`` plus any busy instance the
        agent kept), so claims that its new instances will serve are not planned a second time elsewhere;
        if that union cannot exist, every actual instance is pinned instead. A held placement stands in for
        every instance over its slices, busy: no other claim is planned there, as the agent books none.
        """
        assert self.model is not None
        if self.in_flight:
            future = normalize_layout(list(self.desired) + [i for i in self.busy if i not in self.desired])
            if check_layout_fits(self.model, future) is None:
                instances = tuple(CurrentInstance(i.profile, i.start, busy=i in self.busy) for i in future)
            else:
                instances = tuple(CurrentInstance(i.profile, i.start, busy=True) for i in self.actual)
        else:
            instances = tuple(CurrentInstance(i.profile, i.start, busy=i in self.busy) for i in self.actual)
        if self.holds:
            model = self.model
            held = [model.profile(h.profile).mask(h.start) for h in self.holds]
            instances = (
                *(i for i in instances if not any(model.profile(i.profile).mask(i.start) & m for m in held)),
                *(CurrentInstance(h.profile, h.start, busy=True) for h in self.holds),
            )
        return GpuState(node=self.node, index=self.index, model=self.model.key, instances=instances)

    def identity(self, node_labels: Mapping[str, str]) -> GpuIdentity:
        return GpuIdentity(self.name, self.node, node_labels, self.model, self.product)


def _gpu_view(
    gp: GpuPartition,
    raw: Mapping[str, Any],
    catalog: Catalog,
    allocated: Mapping[str, frozenset[str]],
    silent: Mapping[str, str],
) -> GpuView:
    st = gp.status
    labels = gp.metadata.labels
    node = st.node or labels.get(NODE_LABEL, "")
    index = st.gpu_index if st.gpu_index is not None else int(labels.get(GPU_INDEX_LABEL, "-1") or -1)
    model: GpuModel | None = None
    if st.model and st.model in catalog:
        model = catalog.model(st.model)
    elif st.product:
        model = catalog.for_product(st.product)
    # Busy: the agent says so, or a claim allocation already names the device (the agent may not know yet).
    taken = allocated.get(node, frozenset())
    # The whole device offered beside the slices, allocated: the agent's round asks MIG off for it.
    booked_whole = gp.spec.pinned_whole(
        partitionable=st.inventory is Inventory.PARTITIONABLE,
        known_model=model is not None,
        whole_allocated=whole_device_name(index) in taken,
    )
    wanted = gp.spec.mode_toward(booked_whole)
    busy = frozenset(
        i.placed()
        for i in st.instances
        if i.state in (InstanceState.ALLOCATED, InstanceState.IN_USE)
        or device_name(index, i.profile, i.start) in taken
    )
    claims_on = {i.placed(): tuple(i.claims) for i in st.instances if i.claims}
    in_flight = (
        st.observed_generation is None
        or st.observed_generation < gp.metadata.generation
        or st.phase == Phase.RESHAPING
    )
    desired = gp.spec.desired()
    actual = normalize_layout(st.actual())
    if st.inventory is Inventory.PARTITIONABLE and set(desired) <= set(actual):
        # Leftover free instances beside spec.layout are kept on purpose: nothing is left to apply.
        in_flight = False
    unusable = ""
    managed = st.condition(ConditionType.MANAGED)
    health = st.condition(ConditionType.DEVICES_HEALTHY)
    # Why the GPU is unfit whatever its MIG mode ("" when it is fit): what a MIG mode switch looks at.
    trouble = ""
    if model is None:
        trouble = f"GPU model of {st.product or 'unknown product'} is not in the catalog"
    elif st.phase == Phase.DEGRADED:
        trouble = f"phase Degraded: {st.message}".rstrip(": ")
    elif managed is not None and not managed.is_true:
        trouble = f"not managed: {managed.message or managed.reason}"
    elif health is not None and not health.is_true:
        # a critical XID: its devices are tainted until the administrator clears it; nothing is cut there
        trouble = f"critical XID, devices tainted: {health.message or health.reason}"
    if model is None or st.phase == Phase.DEGRADED:
        unusable = trouble
    elif st.mig_mode not in (MigMode.ENABLED,):
        unusable = f"MIG mode is {st.mig_mode.value}"
    elif trouble:
        unusable = trouble
    elif booked_whole:
        unusable = "its whole device (spec.offerWhole) is allocated: the agent switches MIG off for it"
    elif wanted is MigModeRequest.DISABLED:
        unusable = "spec.migMode asks for MIG mode off: the agent withdraws its devices and switches"
    if node in silent:
        # Nothing planned on it and nothing awaited from it: a layout it never applies holds no budget.
        unusable, in_flight, trouble = silent[node], False, silent[node]
    ready = st.condition(ConditionType.READY)
    failure = ""
    if (
        ready is not None
        and not ready.is_true
        and ready.observed_generation == gp.metadata.generation
        and ready.reason not in ("Reshaping", "Draining")
    ):
        failure = f"{ready.reason}: {ready.message}"
    floor_held = ""
    if (
        ready is not None
        and ready.is_true
        and ready.reason == Reason.FLOOR_HELD
        and ready.observed_generation == gp.metadata.generation
    ):
        floor_held = ready.message
    annotations = (raw.get("metadata") or {}).get("annotations") or {}
    mode_cond = st.condition(ConditionType.MIG_MODE)
    if mode_cond is not None and mode_cond.observed_generation not in (None, gp.metadata.generation):
        mode_cond = None  # about an older spec.migMode
    requested = annotations.get(MIG_MODE_REQUESTED_ANNOTATION, "")
    reset = frozenset(
        MigModeRequest(m.strip())
        for m in str(annotations.get(MIG_MODE_RESET_ANNOTATION, "")).split(",")
        if m.strip() in {r.value for r in MigModeRequest}
    )
    return GpuView(
        name=gp.name,
        node=node,
        index=index,
        model=model,
        product=st.product,
        generation=gp.metadata.generation,
        observed_generation=st.observed_generation,
        desired=desired,
        actual=actual,
        busy=busy,
        claims_on=claims_on,
        in_flight=in_flight and not failure,
        unusable=unusable,
        last_written=parse_time(annotations.get(LAYOUT_WRITTEN_ANNOTATION)),
        failure=failure,
        inventory=st.inventory,
        offered=tuple(gp.spec.offered_profiles) if gp.spec.offered_profiles is not None else None,
        floor_held=floor_held,
        holds=tuple(h.placed() for h in gp.spec.holds if model is not None and h.fits(model)),
        whole=st.mig_mode is MigMode.DISABLED and wanted is not MigModeRequest.ENABLED,
        mig_mode=st.mig_mode,
        mode_wanted=wanted,
        mode_condition=mode_cond,
        whole_gpu=st.whole_gpu,
        mode_written=parse_time(annotations.get(MIG_MODE_WRITTEN_ANNOTATION)),
        mode_by_operator=gp.spec.mig_mode is not None and requested == gp.spec.mig_mode.value,
        mode_for=str(annotations.get(MIG_MODE_FOR_ANNOTATION, "")),
        whole_hold=next((h.claim for h in gp.spec.holds if h.whole), ""),
        reset_required=reset,
        trouble=trouble,
        nvlink=st.nvlink(),
        offer_whole=bool(gp.spec.offer_whole),
        offer_whole_by=str(annotations.get(WHOLE_OFFERED_BY_ANNOTATION, "")),
        whole_offered=bool(st.whole_offered),
        booked_whole=booked_whole,
        mode_asked=gp.spec.mig_mode,
    )


def nvlink_by_model(gpus: Iterable[GpuView]) -> dict[str, tuple[NvlinkFacts, ...]]:
    """Model key -> each distinct set of NVLink facts its GPUs report, in the GPUs' order: the whole GPUs
    a claim's selectors are evaluated against (``dynamig.operator.demand``). Pure."""
    seen: dict[str, dict[NvlinkFacts, None]] = {}
    for g in gpus:
        if g.model is not None:
            seen.setdefault(g.model.key, {})[g.nvlink] = None
    return {key: tuple(facts) for key, facts in seen.items()}


def allocated_devices(claims: Iterable[Mapping[str, Any]], driver: str) -> dict[str, frozenset[str]]:
    """Node (pool) -> names of ``driver``'s devices that some ResourceClaim allocation names. Pure."""
    out: dict[str, set[str]] = {}
    for claim in claims:
        alloc = (claim.get("status") or {}).get("allocation") or {}
        for result in (alloc.get("devices") or {}).get("results") or []:
            if result.get("driver") == driver:
                out.setdefault(str(result.get("pool", "")), set()).add(str(result.get("device", "")))
    return {k: frozenset(v) for k, v in out.items()}


def parse_inventory(
    objs: Iterable[Mapping[str, Any]],
    catalog: Catalog,
    allocated: Mapping[str, frozenset[str]] | None = None,
    silent: Mapping[str, str] | None = None,
) -> tuple[GpuView, ...]:
    """GpuViews from raw GpuPartition dicts, sorted by (node, index). ``allocated``: node -> device names
    that claim allocations name (see :func:`allocated_devices`); ``silent``: node -> why its agent counts as
    gone (``dynamig.kube.heartbeat.silent_agents``): its GPUs are unusable and not in flight. Pure."""
    views = [_gpu_view(parse_gpu_partition(dict(o)), o, catalog, allocated or {}, silent or {}) for o in objs]
    return tuple(sorted(views, key=lambda v: (v.node, v.index, v.name)))


def switch_changes(gpus: Iterable[GpuView]) -> set[tuple[str, str]]:
    """The MIG mode switches under way as the disruption budget counts them: one change per node and claim
    switched for (a claim's GPUs on a node are idle and kept for it, and switch together), one per GPU where
    no claim is recorded. A switch for a booking of the whole device a GPU offered is not counted: the
    scheduler made it, on a GPU with nothing else allocated (the whole device consumed every counter), and
    the operator could not hold it back. Pure."""
    return {(g.node, g.mode_for or g.name) for g in gpus if g.switching is not None and not g.booked_whole}
