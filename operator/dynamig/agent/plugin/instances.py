"""What the plugin needs from whoever owns the MIG instances on the node: the ``MigInstances`` protocol.

The node agent implements it against NVML (it owns NVML and the GpuPartition status); the plugin only asks
for an instance to exist before a pod uses it, and says when the pod is done with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class PreparedInstance:
    """A MIG instance that exists, with what the CDI spec needs to hand it to a container."""

    device_name: str  # DRA device name, e.g. "gpu0-1g10gb-s6"
    mig_uuid: str  # "MIG-..." as NVML reports it; empty for a whole GPU
    parent_uuid: str  # "GPU-..." of the physical GPU
    gpu_index: int  # NVML index of the parent GPU
    gpu_minor: int  # minor number of the parent GPU: /dev/nvidia<minor>, capabilities/gpu<minor>
    gi_id: int  # GPU instance id on the parent
    ci_id: int  # compute instance id inside the GI
    profile: str = ""  # "1g.10gb"; "whole" for a GPU whose MIG mode is off (no GI, no CI: ids are -1)
    placement_start: int = -1

    @property
    def whole_gpu(self) -> bool:
        """The whole GPU (MIG mode off): reached through ``/dev/nvidia<minor>`` alone."""
        return self.gi_id < 0


class InstanceError(Exception):
    """A device cannot be prepared; the message is shown to the user in the pod's events. Per claim."""


class UnknownDevice(InstanceError):
    """The device name does not denote a (GPU, profile, placement) of this node."""


class PlacementTaken(InstanceError):
    """The instance does not exist and its memory slices are occupied by another instance."""


class MigInstances(Protocol):
    """Makes MIG instances exist for prepared claims and hears when they are no longer used.

    Safe to call concurrently for different devices. Each successful ``ensure`` counts one claim using the
    device and each ``release`` takes one away (an instance may serve an ordinary and an admin-access claim
    at once): the caller releases exactly what it ensured, once.
    """

    async def ensure(self, device_name: str) -> PreparedInstance:
        """Returns the instance named ``device_name``, creating its GI and CI at the device's placement when
        it does not exist and the placement is free. Raises ``PlacementTaken`` when the placement is occupied,
        ``UnknownDevice`` when the name does not denote a placement of this node's GPUs, ``InstanceError`` for
        any other reason the instance cannot be made available. Side effects: NVML, agent state."""
        ...

    async def lookup(self, device_name: str) -> PreparedInstance | None:
        """The instance named ``device_name`` as it exists now (GI/CI ids, MIG UUID), or None; creates
        nothing. Reads only."""
        ...

    async def release(self, device_name: str) -> None:
        """A claim using ``device_name`` was unprepared: one claim fewer uses the instance, which is free once
        none does (never destroyed here; the operator decides its fate). Side effects: agent state,
        GpuPartition status."""
        ...

    def mark_prepared(self, names: Iterable[str]) -> None:
        """Called once at plugin start with the devices of the claims the checkpoint still holds (a device
        once per claim), so an agent that restarted with the plugin counts them as in use again; what it
        counted before is replaced. Side effects: agent state."""
        ...
