"""A whole GPU offered beside its MIG slices, and the MIG mode switch its booking asks. Pure.

GpuPartition ``spec.offerWhole`` (partitionable inventory, MIG mode on, ``spec.migMode`` absent): the agent
publishes the GPU's whole device ``gpu<index>`` beside its MIG devices, consuming every counter of the GPU's
counter set (:mod:`dynamig.kube.inventory`), so kube-scheduler chooses between the whole GPU and its slices
and never books both. The whole device carries binding conditions: its booking waits, as a cut does, while
the agent

1. destroys the GPU's free instances as a cut destroys those in its way (the claims read again before each
   destroy: :mod:`dynamig.agent.bindings.allocations`), takes the booking as ``spec.migMode: Disabled``
   would ask (:func:`requested_mode`): the GPU's devices leave the slice, and once the settle period has
   passed and nothing else uses the GPU it switches MIG off through NVML (:mod:`dynamig.agent.modes.switch`);
   the booking itself, and the pod waiting on it, are what the switch is for, so they do not hold it back
   (:func:`booked_by`);
2. answers the booking ready once MIG mode is off and the GPU is published whole
   (:func:`dynamig.agent.bindings.decide.decide`; until then it is not answered at all).

The GPU then stays whole, as a GPU whose MIG mode is off is served, until its MIG mode is asked back
(``spec.migMode: Enabled``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dynamig.agent.nvml.device import GpuInfo
from dynamig.kube.gpupartition import GpuPartition, MigModeRequest
from dynamig.kube.names import whole_device_name


def offers_whole(gpu: GpuInfo, part: GpuPartition, partitionable: bool) -> bool:
    """Whether ``gpu`` offers its whole device beside its MIG devices: the partitionable inventory, MIG mode
    on, ``spec.offerWhole`` and no ``spec.migMode``. Pure."""
    return (
        partitionable
        and bool(part.spec.offer_whole)
        and part.spec.mig_mode is None
        and gpu.model is not None
        and gpu.mig_enabled
    )


def booked_by(
    gpu: GpuInfo, part: GpuPartition, partitionable: bool, claims: Mapping[str, Sequence[str]]
) -> tuple[str, ...]:
    """The claims (``namespace/name``) that booked ``gpu``'s whole device while its MIG mode is on (and
    ``spec.offerWhole`` asks it offered): the MIG mode switch is theirs, pending in NVML or not. Pure."""
    if not offers_whole(gpu, part, partitionable):
        return ()
    return tuple(sorted(set(claims.get(whole_device_name(gpu.index), ()))))


def requested_mode(
    gpu: GpuInfo, part: GpuPartition, partitionable: bool, claims: Mapping[str, Sequence[str]]
) -> MigModeRequest | None:
    """The MIG mode the round works toward: ``Disabled`` while the whole device is booked on a GPU offering
    it (:func:`booked_by`), else ``spec.migMode``. Pure."""
    if booked_by(gpu, part, partitionable, claims):
        return MigModeRequest.DISABLED
    return part.spec.mig_mode
