"""A whole GPU offered beside its MIG slices, and the MIG mode switch its booking asks. Pure.

GpuPartition ``spec.offerWhole`` (partitionable inventory, MIG mode on, ``spec.migMode`` absent or
``Enabled``; written by an administrator or by a policy's ``migMode.offerWhole``): the agent publishes the
GPU's whole device ``gpu<index>`` beside its MIG devices, consuming every counter of the GPU's counter set
(:mod:`dynamig.kube.inventory`), so kube-scheduler chooses between the whole GPU and its slices and never
books both. The whole device carries binding conditions: its booking waits, as a cut does, while the agent

1. destroys the GPU's free instances as a cut destroys those in its way (the claims read again before each
   destroy: :mod:`dynamig.agent.bindings.allocations`), takes the booking as ``spec.migMode: Disabled``
   would ask (:func:`requested_mode`): the GPU's devices leave the slice, and once the settle period has
   passed and nothing else uses the GPU it switches MIG off through NVML (:mod:`dynamig.agent.modes.switch`);
   the booking itself, and the pod waiting on it, are what the switch is for, so they do not hold it back
   (:func:`booked_by`);
2. answers the booking ready once MIG mode is off and the GPU is published whole
   (:func:`dynamig.agent.bindings.decide.decide`; until then it is not answered at all), or failed once
   NVML answered the switch NVML_ERROR_RESET_REQUIRED (a pass-through VM: the switch waits for a reboot),
   so the pod is booked again elsewhere instead of waiting out kube-scheduler's binding timeout.

The GPU then stays whole, as a GPU whose MIG mode is off is served. While its whole device is allocated the
round works toward MIG off whatever ``spec.migMode`` says (:func:`requested_mode`): an ``Enabled`` written
before the booking asks MIG back only once the allocation ends. The operator replaces an ``Enabled`` of its
own with ``Disabled`` when it sees the booking (:mod:`dynamig.operator.whole_offers`), so a GPU a policy
offered stays whole until the policy's MIG mode round switches it on for MIG claims. Should the operator
write ``Disabled`` while MIG is still on, the booking's switch goes on as before: it is still the booking's
(:func:`booked_by`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dynamig.agent.nvml.device import GpuInfo
from dynamig.kube.gpupartition import GpuPartition, MigModeRequest
from dynamig.kube.names import whole_device_name


def whole_bookable(gpu: GpuInfo, part: GpuPartition, partitionable: bool) -> bool:
    """Whether a booking of ``gpu``'s whole device, made while it was offered, is answered by switching MIG
    off: the partitionable inventory, ``spec.offerWhole``, a catalog model and MIG mode on, whatever
    ``spec.migMode`` says now (the operator may have written ``Disabled`` for the booking). Pure."""
    return partitionable and bool(part.spec.offer_whole) and gpu.model is not None and gpu.mig_enabled


def offers_whole(gpu: GpuInfo, part: GpuPartition, partitionable: bool) -> bool:
    """Whether ``gpu`` offers its whole device beside its MIG devices: :func:`whole_bookable` with
    ``spec.migMode`` absent or ``Enabled`` (a GPU asked MIG off is withdrawn for its switch). Pure."""
    return whole_bookable(gpu, part, partitionable) and part.spec.mig_mode in (None, MigModeRequest.ENABLED)


def booked_by(
    gpu: GpuInfo, part: GpuPartition, partitionable: bool, claims: Mapping[str, Sequence[str]]
) -> tuple[str, ...]:
    """The claims (``namespace/name``) that booked ``gpu``'s whole device while its MIG mode is on
    (:func:`whole_bookable`): the MIG mode switch is theirs, pending in NVML or not. Pure."""
    if not whole_bookable(gpu, part, partitionable):
        return ()
    return _holders(gpu, claims)


def requested_mode(
    gpu: GpuInfo, part: GpuPartition, partitionable: bool, claims: Mapping[str, Sequence[str]]
) -> MigModeRequest | None:
    """The MIG mode the round works toward: ``Disabled`` while a claim allocates the whole device of a GPU
    with ``spec.offerWhole`` (MIG mode on: the switch its booking asks; off already: the allocation pins it
    whole until it ends, whatever ``spec.migMode`` says); else ``spec.migMode``. Pure."""
    pinned = part.spec.pinned_whole(
        partitionable=partitionable,
        known_model=gpu.model is not None,
        whole_allocated=bool(_holders(gpu, claims)),
    )
    return part.spec.mode_toward(pinned)


def _holders(gpu: GpuInfo, claims: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    return tuple(sorted(set(claims.get(whole_device_name(gpu.index), ()))))
