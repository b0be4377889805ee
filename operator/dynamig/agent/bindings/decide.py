"""How the agent answers an allocation of one of its devices (binding conditions, KEP-5007). Pure.

With every placement published as a device (DESIGN.md, "Inventory and binding"), the scheduler may book a
device whose instance does not exist yet. Each device carries binding conditions, so the pod does not bind
until the agent of its node answers in ``ResourceClaim.status.devices[]``:

- the instance exists whole (one compute instance spanning it) and nobody else holds it -> :class:`Ready`;
- the placement is free, or held only by free instances -> :class:`Cut`: destroy those, create this one
  (then ready); a GPU instance left without its compute instance is completed the same way;
- the instance exists whole but NVML has not enumerated its MIG device yet (no UUID to hand out) ->
  :class:`Enumerate`: read again, a bounded number of times, then ready with the UUID or failed;
- anything else (a busy instance in the way, a GPU instance someone else split, MIG off, a GPU the round
  refuses, a name that is no placement here, a rule of the model broken) -> :class:`Failed` with a reason,
  which makes the scheduler release the allocation and try again. A pod never binds to an instance that does
  not exist, and ``ready`` always carries the MIG UUID NVML reported.

An allocation with ``adminAccess`` (monitoring; resource.k8s.io/v1 DeviceRequestAllocationResult: admin
access "ignore[s] all ordinary claims to the device with respect to access modes and any resource
allocations", and kube-scheduler does not count it as allocated, allocateddevices.go) never cuts and never
destroys: it is ready for an instance that exists whole, whoever holds it, and failed for a placement with
no instance. Its binding conditions are answered all the same: the scheduler copies a device's conditions
into every allocation result, admin or not (allocator_incubating.go), and holds the pod until they are.

:func:`decide` reads only what it is given; the agent observes NVML and the API afresh for each answer and
acts under its lock, so nothing it decides here can be raced by its own reshapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamig.agent.bindings.holds import REASON_PLACEMENT_HELD, held_against
from dynamig.agent.layout.reconcile import Observed, overlaps
from dynamig.geometry.layout import check_layout
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, normalize_layout, placement_of
from dynamig.kube.answers import answer_entry
from dynamig.kube.gpupartition import Hold, Reason
from dynamig.kube.names import WHOLE_PROFILE, whole_device_index

REASON_UNKNOWN_DEVICE = "UnknownDevice"
REASON_MIG_DISABLED = "MigDisabled"
REASON_PLACEMENT_TAKEN = "PlacementTaken"
REASON_LAYOUT_RULE = "LayoutRule"
REASON_ADMIN_NO_INSTANCE = "AdminAccessNoInstance"
REASON_NO_MIG_DEVICE = "MigDeviceNotEnumerated"
REASON_MIG_ENABLED = "MigEnabled"  # a whole GPU booked while its MIG mode is on
# What the round says of a GPU served whole that does not stop a whole-GPU answer: MIG mode off, a model
# without MIG (served whole by its policy).
WHOLE_SERVED = frozenset({Reason.MIG_DISABLED, Reason.UNKNOWN_MODEL})


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU as the agent observed it just now."""

    index: int
    model: GpuModel | None
    mig_enabled: bool
    observed: tuple[Observed, ...] = ()
    mig_uuids: dict[PlacedInstance, str] = field(default_factory=dict)  # whole instances only ("" unread)
    refused: tuple[str, str] | None = None  # (reason, message): the round leaves this GPU alone
    holds: tuple[Hold, ...] = ()  # placements kept for one claim each (agent/bindings/holds.py)
    uuid: str = ""  # the GPU's
    # The whole GPU kept for one claim of whole GPUs (agent/bindings/holds.py): with MIG mode off, or on until
    # it switches (no other claim is booked on its instances meanwhile).
    whole_hold: Hold | None = None
    # MIG mode on, and the whole GPU offered beside its slices (GpuPartition spec.offerWhole): a booking of it
    # waits for the round to switch MIG off (agent/modes/booked.py).
    offers_whole: bool = False


@dataclass(frozen=True, slots=True)
class Ready:
    """Ready: ``mig_uuid`` is the MIG device's UUID; for a whole GPU (``placed`` is the profile ``whole``
    at 0) the GPU's UUID."""

    gpu_index: int
    placed: PlacedInstance
    mig_uuid: str

    @property
    def whole(self) -> bool:
        return self.placed.profile == WHOLE_PROFILE


@dataclass(frozen=True, slots=True)
class Cut:
    """Destroy ``destroy`` (free instances in the way), then create ``create`` with its compute instance."""

    gpu_index: int
    create: PlacedInstance
    destroy: Layout = ()


@dataclass(frozen=True, slots=True)
class Enumerate:
    """The instance exists whole, but NVML does not list its MIG device yet (nvml.h:
    ``nvmlDeviceGetMigDeviceHandleByIndex`` NOT_FOUND): read its UUID again before answering."""

    gpu_index: int
    placed: PlacedInstance


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class SwitchFirst:
    """The whole GPU booked while its MIG mode is on, offered beside its slices: destroy its free instances
    (``destroy``), as a cut destroys those in its way; not answered yet: the round switches MIG off for the
    booking (:mod:`dynamig.agent.modes.booked`), then it is ready."""

    gpu_index: int
    destroy: Layout = ()


Answer = Ready | Cut | Enumerate | Failed | SwitchFirst


def locate(device: str, gpus: Sequence[GpuState]) -> tuple[GpuState, PlacedInstance] | None:
    """The GPU and placement a device name denotes on this node, or None. Pure."""
    for gpu in gpus:
        placed = placement_of(device, gpu.index, gpu.model) if gpu.model is not None else None
        if placed is not None:
            return gpu, placed
    return None


def _holders_besides(o: Observed, claim: str) -> Observed:
    """``o`` as busy as it is for anyone but ``claim`` (the claim being answered does not block itself)."""
    return dataclasses.replace(o, claims=tuple(c for c in o.claims if c != claim))


def _whole(gpu: GpuState, placed: PlacedInstance) -> Ready | Enumerate:
    """The answer for a whole instance that exists: ready with the UUID NVML reported, if it did."""
    uuid = gpu.mig_uuids.get(placed, "")
    return Ready(gpu.index, placed, uuid) if uuid else Enumerate(gpu.index, placed)


def _admin(device: str, gpu: GpuState, placed: PlacedInstance) -> Ready | Enumerate | Failed:
    """An admin-access allocation: the instance that exists, shared with whoever holds it; never a cut."""
    for o in gpu.observed:
        if o.placed == placed and o.has_compute_instance and not o.partitioned:
            return _whole(gpu, placed)
    return Failed(
        REASON_ADMIN_NO_INSTANCE,
        f"{device}: admin access is answered only for an instance that exists, and none is at "
        f"{placed.profile}@{placed.start}; dynamig cuts no instance for admin access (monitoring), since "
        "the cut would take memory slices the scheduler does not count as allocated",
    )


def _kept_whole_for_another(device: str, gpu: GpuState, claim: str) -> Failed | None:
    """Failed (PlacementHeld) when ``gpu`` is kept whole for a claim other than ``claim``: with MIG mode off
    its whole device, with MIG mode on (until it switches) every device of it; None otherwise."""
    hold = gpu.whole_hold
    if hold is None or hold.claim == claim:
        return None
    return Failed(
        REASON_PLACEMENT_HELD,
        f"{device}: GPU {gpu.index} is kept whole for claim {hold.claim} (a claim of whole GPUs: its MIG "
        f"mode is switched off for it) until {hold.expires_at}",
    )


def _whole_gpu(device: str, claim: str, index: int, gpus: Sequence[GpuState]) -> Ready | Failed | SwitchFirst:
    """The answer for a booking of a whole GPU (``gpu<index>``, MIG mode off): ready with the GPU's UUID,
    unless the GPU is kept whole for another claim (a hold of the whole GPU) or is no whole GPU now; with
    MIG mode on, :class:`SwitchFirst` where the GPU offers its whole device beside its slices."""
    gpu = next((g for g in gpus if g.index == index), None)
    if gpu is None:
        return Failed(REASON_UNKNOWN_DEVICE, f"{device}: no GPU {index} on this node")
    kept = _kept_whole_for_another(device, gpu, claim)
    # Switching MIG off for this booking: its pending mode is the switch under way, not a refusal.
    switch = gpu.mig_enabled and gpu.offers_whole and kept is None
    served = WHOLE_SERVED | ({Reason.MIG_MODE_PENDING} if switch else set())
    if gpu.refused is not None and gpu.refused[0] not in served:
        return Failed(gpu.refused[0], f"{device}: GPU {index} is left alone: {gpu.refused[1]}")
    if switch:
        busy = [b for o in gpu.observed if (b := _holders_besides(o, claim)).busy]
        if busy:  # work arrived on the GPU since the booking was made: booked again elsewhere
            what = f"{busy[0].placed.profile}@{busy[0].placed.start}"
            return Failed(REASON_PLACEMENT_TAKEN, f"{device}: {what} on GPU {index}: {busy[0].busy_reason()}")
        return SwitchFirst(index, normalize_layout([o.placed for o in gpu.observed]))
    if kept is not None:
        return kept
    if gpu.mig_enabled:
        return Failed(REASON_MIG_ENABLED, f"{device}: MIG mode is on on GPU {index}: it is no whole GPU now")
    return Ready(index, PlacedInstance(0, WHOLE_PROFILE), gpu.uuid)


def decide(device: str, claim: str, gpus: Sequence[GpuState], *, admin: bool = False) -> Answer:
    """What to answer for ``claim`` ("namespace/name"), allocated ``device`` of this node; ``admin``: the
    allocation has ``adminAccess``. ``gpus[].observed`` name only ordinary (not admin-access) holders.
    Pure."""
    index = whole_device_index(device)
    if index is not None:
        return _whole_gpu(device, claim, index, gpus)
    found = locate(device, gpus)
    if found is None:
        return Failed(REASON_UNKNOWN_DEVICE, f"{device} is not a MIG placement of any GPU on this node")
    gpu, placed = found
    assert gpu.model is not None
    if gpu.refused is not None:
        reason, why = gpu.refused
        return Failed(reason, f"{device}: GPU {gpu.index} is left alone: {why}")
    if not gpu.mig_enabled:
        return Failed(REASON_MIG_DISABLED, f"{device}: MIG mode is not enabled on GPU {gpu.index}")
    if admin:
        return _admin(device, gpu, placed)
    model = gpu.model
    refused = _kept_whole_for_another(device, gpu, claim)
    if refused is not None:
        return refused
    hold = held_against(model, placed, claim, gpu.holds)
    if hold is not None:
        return Failed(
            REASON_PLACEMENT_HELD,
            f"{device}: memory slices kept for claim {hold.claim} until {hold.expires_at} (pods were evicted "
            "to make room for it)",
        )
    in_way: list[PlacedInstance] = []
    for raw in gpu.observed:
        o = _holders_besides(raw, claim)
        if o.placed == placed:
            if o.claims or o.partitioned or (o.processes and not o.prepared):
                return Failed(REASON_PLACEMENT_TAKEN, f"{device}: {o.busy_reason()}")
            if o.has_compute_instance:
                return _whole(gpu, placed)
            return Cut(gpu.index, placed)  # a GPU instance whose compute instance is missing
        if overlaps(model, placed, o.placed):
            if o.busy:
                held = f"{o.placed.profile}@{o.placed.start}"
                return Failed(
                    REASON_PLACEMENT_TAKEN, f"{device}: memory slices held by {held}: {o.busy_reason()}"
                )
            in_way.append(o.placed)
    kept = [o.placed for o in gpu.observed if o.placed not in in_way]
    violation = check_layout(model, [*kept, placed])
    if violation is not None:
        return Failed(REASON_LAYOUT_RULE, f"{device}: {violation.message}")
    return Cut(gpu.index, placed, normalize_layout(in_way))


# --- the answer as the API takes it (which allocations wait: dynamig.kube.answers) --------------------


def device_status(
    driver: str,
    pool: str,
    device: str,
    answer: Ready | Failed,
    ready: str,
    failed: str,
    now: str,
    generation: int,
) -> dict[str, Any]:
    """The ``status.devices[]`` entry that answers an allocation: for a ready device its MIG UUID and profile
    in ``data``, so ``kubectl get resourceclaim -o yaml`` shows what the pod got. Pure."""
    if isinstance(answer, Ready) and answer.whole:
        message = f"whole GPU {answer.mig_uuid} (MIG mode off)"
        facts = {"uuid": answer.mig_uuid, "profile": WHOLE_PROFILE}
        return answer_entry(driver, pool, device, ready, "WholeGpuReady", message, now, generation, facts)
    if isinstance(answer, Ready):
        placed = answer.placed
        message = f"MIG instance {answer.mig_uuid} ({placed.profile}@{placed.start})"
        data = {"migUUID": answer.mig_uuid, "profile": placed.profile, "placementStart": placed.start}
        return answer_entry(driver, pool, device, ready, "InstanceReady", message, now, generation, data)
    return answer_entry(driver, pool, device, failed, answer.reason, answer.message, now, generation)
