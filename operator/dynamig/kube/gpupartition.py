"""Typed model of the ``GpuPartition`` custom resource (``dynamig.io/v1alpha1``, one per physical GPU).

Raw API dicts are parsed once, at the edge, with :func:`parse_gpu_partition`; status is written back with
:meth:`GpuPartitionStatus.to_api`. Field names here are the wire names (camelCase aliases) of
``crds/gpupartitions.yaml``; keep the two in step. Pure: no I/O.

Ownership of fields: the node agent creates the object and owns ``status``; the operator owns ``spec.layout``
(and ``spec.offeredProfiles``, ``spec.autoPlacementsPerProfile``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, normalize_layout
from dynamig.kube.devices import NvlinkFacts
from dynamig.kube.names import GPU_PARTITION_KIND, GROUP_VERSION, WHOLE_PROFILE
from dynamig.kube.times import parse_time
from dynamig.planner.offerlimit import AutoChoice


class Phase(StrEnum):
    STABLE = "Stable"
    RESHAPING = "Reshaping"
    DEGRADED = "Degraded"


class InstanceState(StrEnum):
    FREE = "free"
    ALLOCATED = "allocated"
    IN_USE = "in-use"


class MigMode(StrEnum):
    ENABLED = "Enabled"
    DISABLED = "Disabled"
    ENABLE_PENDING = "EnablePending"
    DISABLE_PENDING = "DisablePending"
    UNKNOWN = "Unknown"


class Inventory(StrEnum):
    """How the agent publishes a GPU to the scheduler (``status.inventory``)."""

    # Every free instance and every valid placement of the offered profiles, as partitionable devices that
    # wait for the agent's binding answer (Kubernetes 1.36: KEP-4815 + KEP-5007).
    PARTITIONABLE = "Partitionable"
    # Only instances that exist; the operator re-cuts ahead of the scheduler (clusters without the features).
    INSTANCES = "Instances"


class ConditionType(StrEnum):
    """Condition types the agent sets on a GpuPartition."""

    READY = "Ready"  # the GPU matches spec.layout, or keeps it as the floor of its offers (True); or why not
    LAYOUT_VALID = "LayoutValid"  # spec.layout is valid for this GPU model
    MANAGED = "Managed"  # the agent may manage this GPU (no other MIG owner, MIG enabled)
    HEALTHY = "Healthy"  # NVML can reach the GPU
    # no uncleared critical XID on the GPU's devices (absent on a GPU that never had one); False: some of its
    # devices are tainted in the node's slices (dynamig.agent.health.devices)
    DEVICES_HEALTHY = "DevicesHealthy"
    UNINSTALLED = "Uninstalled"  # the agent withdrew this GPU and removed its files from the node
    # spec.migMode is what NVML reports (True), or why not yet (False: draining for the switch, waiting
    # for the GPU to go idle, a reset the platform does not expose); absent while spec.migMode is unset
    MIG_MODE = "MigMode"


class Reason(StrEnum):
    """CamelCase reasons used in conditions."""

    LAYOUT_APPLIED = "LayoutApplied"
    NODE_CLEANED = "NodeCleaned"
    RESHAPING = "Reshaping"
    DRAINING = "Draining"
    INSTANCE_BUSY = "InstanceBusy"
    # Partitionable inventory: a floor instance waits for bookings to release its memory slices (expected).
    FLOOR_HELD = "FloorHeld"
    INSUFFICIENT_RESOURCES = "InsufficientResources"
    PLACEMENT_TAKEN = "PlacementTaken"
    INVALID_LAYOUT = "InvalidLayout"
    LAYOUT_FAILED = "LayoutFailed"  # NVML refused spec.layout on every try: Degraded, retried on a back-off
    VALID = "Valid"
    MANAGED = "Managed"
    FOREIGN_MIG_OWNER = "ForeignMigOwner"
    MIG_DISABLED = "MigDisabled"
    MIG_MODE_PENDING = "MigModePending"
    UNKNOWN_MODEL = "UnknownModel"
    GPU_LOST = "GpuLost"
    GPU_REPLACED = "GpuReplaced"
    WHOLE_GPU = "WholeGpu"  # MIG mode is off: the GPU is published whole
    MIG_MODE_SWITCHED = "MigModeSwitched"  # NVML reports spec.migMode
    MIG_MODE_DRAINING = "MigModeDraining"  # devices withdrawn; waiting for them to end, then the switch
    MIG_MODE_GPU_BUSY = "GpuNotIdle"  # NVML_ERROR_IN_USE: the switch is tried again once the GPU is idle
    RESET_REQUIRED = "ResetRequired"  # NVML_ERROR_RESET_REQUIRED: a VM reboot is needed; never retried
    GPU_PRESENT = "GpuPresent"
    NVML_ERROR = "NvmlError"
    RECONCILE_ERROR = "ReconcileError"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class LayoutEntry(_Model):
    """One desired instance: a GPU-instance profile at a placement start (memory slice)."""

    profile: str
    start: int = Field(ge=0)

    def placed(self) -> PlacedInstance:
        return PlacedInstance(self.start, self.profile)


class AutoPlacementsSpec(_Model):
    """The operator's choice of placements per profile for agents left on ``auto`` (planner/offerlimit.py)."""

    limit: int = Field(ge=0)  # 0: every placement
    gpu_nodes: int = Field(ge=0)  # the GPU nodes it was chosen from

    def choice(self) -> AutoChoice:
        return AutoChoice(self.limit, self.gpu_nodes)


class HoldKind(StrEnum):
    EVICT = "Evict"  # pods were evicted to free the placement
    DRAIN = "Drain"  # nobody is evicted: the instances in its way end on their own
    WHOLE = "Whole"  # the whole GPU (MIG mode off, or switching off) kept for a claim of whole GPUs


class Hold(_Model):
    """A placement kept for one claim (``spec.holds``, written by the operator when it evicts pods to make
    room, or drains the GPU for a starving claim): no other claim is answered ready on memory slices it
    overlaps, and no instance of the agent's own making goes there, until the claim is served, gone, or
    ``expiresAt`` passes. The agent copies the holds it enforces into ``status.holds``; the operator evicts
    only once a hold shows there."""

    claim: str  # namespace/name of the ResourceClaim it is kept for
    claim_uid: str = ""
    kind: HoldKind = HoldKind.EVICT
    profile: str
    start: int = Field(ge=0)
    priority: int = 0  # the waiting pod's
    victims: list[str] = Field(default_factory=list)  # namespace/name@uid of the pods evicted for it
    created_at: str = ""  # RFC 3339
    expires_at: str  # RFC 3339

    @property
    def whole(self) -> bool:
        """A hold of the whole GPU (profile ``whole``): it holds no MIG placement."""
        return self.profile == WHOLE_PROFILE

    def placed(self) -> PlacedInstance:
        return PlacedInstance(self.start, self.profile)

    def fits(self, model: GpuModel) -> bool:
        """Whether the held placement is one of ``model``'s (others hold nothing). Pure."""
        return model.has_profile(self.profile) and self.start in model.profile(self.profile).placement_starts

    def expires(self) -> float:
        """Epoch seconds; 0 when unreadable (an unreadable expiry holds nothing)."""
        return parse_time(self.expires_at) or 0.0

    def describe(self) -> str:
        return f"{self.profile}@{self.start} for {self.claim}"


class MigModeRequest(StrEnum):
    """The MIG mode the operator (or a person) asks the agent to switch a GPU to (``spec.migMode``)."""

    ENABLED = "Enabled"
    DISABLED = "Disabled"


class XidEffect(StrEnum):
    """The effect of the DRA device taint a critical XID puts on the affected devices (agent/health)."""

    NO_SCHEDULE = "NoSchedule"  # new claims avoid the device; pods on it stay
    NO_EXECUTE = "NoExecute"  # the device-taint eviction controller also evicts the pods using it


class GpuPartitionSpec(_Model):
    layout: list[LayoutEntry] = Field(default_factory=list)
    # The MIG mode wanted (agent/modes/switch.py switches once the GPU is idle); None: leave it as it is.
    mig_mode: MigModeRequest | None = None
    # Partitionable inventory, MIG on, mig_mode None: the whole GPU is published beside the MIG devices
    # (sharing their counters); a booking of it switches MIG off (agent/modes/booked.py). None: false.
    offer_whole: bool | None = None
    # Partitionable inventory only: profiles whose free placements are offered to the scheduler as devices
    # to be cut on allocation. None or empty: only the instances that exist are offered.
    offered_profiles: list[str] | None = None
    auto_placements_per_profile: AutoPlacementsSpec | None = None  # written by the operator
    holds: list[Hold] = Field(default_factory=list)  # written by the operator (preemption)
    # Written by the operator from its policy's spec.health.xidEffect; None: the agent's --xid-effect.
    xid_effect: XidEffect | None = None

    def pinned_whole(self, *, partitionable: bool, known_model: bool, whole_allocated: bool) -> bool:
        """Whether a claim allocating the GPU's offered whole device pins it MIG-off: the partitionable
        inventory, ``offerWhole``, a catalog model and an allocation of ``gpu<index>``. Its round then works
        toward MIG off whatever ``migMode`` says (MIG on: the switch the booking asks; off already: kept whole
        until the allocation ends). The agent and the operator both decide it here. Pure."""
        return partitionable and bool(self.offer_whole) and known_model and whole_allocated

    def mode_toward(self, pinned_whole: bool) -> MigModeRequest | None:
        """The MIG mode the GPU's round works toward: ``Disabled`` while :meth:`pinned_whole`, else
        ``migMode``. Pure."""
        return MigModeRequest.DISABLED if pinned_whole else self.mig_mode

    def active_holds(self, now: float) -> tuple[Hold, ...]:
        """The holds not yet expired at ``now`` (epoch seconds). Pure."""
        return tuple(h for h in self.holds if h.expires() > now)

    def desired(self) -> Layout:
        """The desired layout as a normalized (sorted) tuple of placed instances."""
        return normalize_layout([e.placed() for e in self.layout])

    @classmethod
    def from_layout(cls, layout: Layout | list[PlacedInstance]) -> GpuPartitionSpec:
        return cls(layout=[LayoutEntry(profile=p.profile, start=p.start) for p in normalize_layout(layout)])


class InstanceStatus(_Model):
    profile: str
    start: int
    size: int = 0
    device_name: str
    mig_uuid: str = Field(default="", alias="migUUID")
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    state: InstanceState = InstanceState.FREE
    published: bool = True
    claims: list[str] = Field(default_factory=list)

    def placed(self) -> PlacedInstance:
        return PlacedInstance(self.start, self.profile)


class WholeGpuStatus(_Model):
    """A GPU with MIG mode off, published whole as one device (``gpu<index>``)."""

    device_name: str
    state: InstanceState = InstanceState.FREE
    published: bool = True
    processes: int = 0  # compute processes NVML lists on the GPU
    claims: list[str] = Field(default_factory=list)


class Condition(_Model):
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int | None = None

    @property
    def is_true(self) -> bool:
        return self.status == "True"


class GpuPartitionStatus(_Model):
    node: str = ""
    gpu_index: int | None = None
    uuid: str = ""
    product: str = ""
    model: str = ""
    mig_mode: MigMode = MigMode.UNKNOWN
    instances: list[InstanceStatus] = Field(default_factory=list)
    whole_gpu: WholeGpuStatus | None = None  # MIG mode off: the GPU as one device
    # The GPU's NVLink facts, whatever its MIG mode (the whole device's attributes of the same names); None
    # where NVML does not give them.
    nvlink_active_links: int | None = None
    fabric_cluster_uuid: str | None = None
    fabric_clique_id: int | None = None
    layout_summary: str = ""
    free_slices: int = 0
    total_slices: int = 0
    observed_generation: int | None = None
    phase: Phase | None = None
    message: str = ""
    last_reshape_time: str | None = None
    inventory: Inventory | None = None
    offered_placements: int = 0  # devices published that are placements still to be cut
    # The whole GPU (gpu<index>) published beside the MIG devices (spec.offerWhole); None: not offered.
    whole_offered: bool | None = None
    # Partitionable: the best-ranked placements of each profile offered (0: all), and whether the agent's
    # flag set it ("set") or the operator chose it ("auto (N GPU nodes)").
    placements_per_profile: int | None = None
    placements_per_profile_choice: str | None = None
    holds: list[Hold] = Field(default_factory=list)  # the spec's holds the agent enforces now
    conditions: list[Condition] = Field(default_factory=list)

    def condition(self, ctype: str) -> Condition | None:
        for c in self.conditions:
            if c.type == ctype:
                return c
        return None

    def actual(self) -> Layout:
        """The instances that exist, as a normalized layout."""
        return normalize_layout([i.placed() for i in self.instances])

    def nvlink(self) -> NvlinkFacts:
        """The NVLink facts the agent reported (none known when it reported none)."""
        return NvlinkFacts(self.nvlink_active_links, self.fabric_cluster_uuid or "", self.fabric_clique_id)

    def to_api(self) -> dict[str, Any]:
        """The status as a merge patch takes it (camelCase, unset optionals dropped; ``wholeGpu``,
        ``wholeOffered`` and the NVLink facts null when unset, so the patch removes those written before: a
        device written while MIG mode was off, a whole GPU offered no more, a link that went down to no
        answer, a GPU that left its fabric)."""
        out = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        for field in ("wholeGpu", "wholeOffered", "nvlinkActiveLinks", "fabricClusterUuid", "fabricCliqueId"):
            out.setdefault(field, None)
        return out


class ObjectMeta(_Model):
    name: str
    uid: str = ""
    generation: int = 0
    resource_version: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    creation_timestamp: str | None = None


class GpuPartition(_Model):
    metadata: ObjectMeta
    spec: GpuPartitionSpec = Field(default_factory=GpuPartitionSpec)
    status: GpuPartitionStatus = Field(default_factory=GpuPartitionStatus)

    @property
    def name(self) -> str:
        return self.metadata.name


def parse_gpu_partition(obj: dict[str, Any]) -> GpuPartition:
    """Parse a GpuPartition as the API returns it (dict). A missing status parses as an empty one."""
    data = dict(obj)
    if data.get("status") is None:
        data["status"] = {}
    if data.get("spec") is None:
        data["spec"] = {}
    return GpuPartition.model_validate(data)


def build_gpu_partition(
    name: str, labels: dict[str, str], layout: Layout | list[PlacedInstance]
) -> dict[str, Any]:
    """A new GpuPartition object (no status) whose spec.layout is ``layout``. Pure."""
    return {
        "apiVersion": GROUP_VERSION,
        "kind": GPU_PARTITION_KIND,
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": GpuPartitionSpec.from_layout(layout).model_dump(
            mode="json", by_alias=True, exclude_none=True
        ),
    }


def layout_summary(layout: Layout | list[PlacedInstance]) -> str:
    """``1g.10gb@0,1g.10gb@1,3g.40gb@4`` (``-`` for none). Pure."""
    items = normalize_layout(layout)
    return ",".join(f"{p.profile}@{p.start}" for p in items) if items else "-"


def set_condition(
    conditions: list[Condition],
    ctype: str,
    status: bool | None,
    reason: str,
    message: str,
    generation: int | None,
    now: str,
) -> list[Condition]:
    """Conditions with ``ctype`` set; lastTransitionTime kept unless its status changes. Pure."""
    text = "Unknown" if status is None else ("True" if status else "False")
    previous = next((c for c in conditions if c.type == ctype), None)
    when = now
    if previous is not None and previous.status == text and previous.last_transition_time:
        when = previous.last_transition_time
    updated = Condition(
        type=ctype,
        status=text,
        reason=reason,
        message=message,
        last_transition_time=when,
        observed_generation=generation,
    )
    if previous is None:
        return [*conditions, updated]
    return [updated if c.type == ctype else c for c in conditions]
