"""What answering a node's allocations needs beyond NVML, read from the claims and the round's view. Pure.

- Admin access (resource.k8s.io/v1 ``DeviceRequestAllocationResult.adminAccess``): such an allocation
  "ignore[s] all ordinary claims to the device" and kube-scheduler does not count it as allocated
  (pkg/scheduler/framework/plugins/dynamicresources/allocateddevices.go), so it neither blocks an ordinary
  answer (:func:`ordinary_holders`) nor is answered like one (:func:`admin_allocations`, then
  :func:`dynamig.agent.bindings.decide.decide` with ``admin=True``).
- Bookings not yet answered (:func:`booked_devices`): the publisher keeps them in the slices until they are
  (``build_inventory_slices(booked=...)`` in :mod:`dynamig.kube.inventory`).
- The GPUs the round refuses (:func:`refusals`): an allocation on one is answered failed with the
  refusal's reason, never cut, whatever older slice it was made from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dynamig.agent.kube.api import claim_ref, claim_results
from dynamig.agent.modes.booked import booked_by, requested_mode
from dynamig.agent.modes.switch import wants_switch
from dynamig.agent.nvml.device import GpuInfo
from dynamig.agent.publishing.gpu_status import Problem, refusal
from dynamig.kube.answers import unanswered
from dynamig.kube.gpupartition import GpuPartition, Reason
from dynamig.kube.names import gpu_partition_name

Claims = Sequence[Mapping[str, Any]]


def admin_allocations(claims: Claims, driver: str, pool: str) -> frozenset[tuple[str, str]]:
    """(``namespace/name``, device) of every allocation of ``driver``/``pool`` with admin access. Pure."""
    return frozenset(
        (claim_ref(c), str(r.get("device")))
        for c in claims
        for r in claim_results(c, driver, pool)
        if r.get("adminAccess")
    )


def ordinary_holders(claims: Claims, driver: str, pool: str) -> dict[str, list[str]]:
    """Device name -> ``namespace/name`` of the claims allocating it without admin access. Pure."""
    out: dict[str, list[str]] = {}
    for c in claims:
        for r in claim_results(c, driver, pool):
            if not r.get("adminAccess"):
                out.setdefault(str(r.get("device")), []).append(claim_ref(c))
    return out


def booked_devices(claims: Claims, driver: str, pool: str, ready: str, failed: str) -> frozenset[str]:
    """Devices of ``driver``/``pool`` allocated with binding conditions and not answered yet. Pure."""
    return frozenset(p.device for p in unanswered(claims, driver, pool, ready, failed))


def refusals(
    node: str,
    parts: Mapping[str, GpuPartition],
    node_owner: str | None,
    foreign: Mapping[str, str],
    no_partition: GpuPartition,
    partitionable: bool = False,
    allocated: Mapping[str, Sequence[str]] | None = None,
) -> Callable[[GpuInfo], Problem | None]:
    """Why the round leaves a GPU alone (:func:`dynamig.agent.publishing.gpu_status.refusal`), as the answerer
    asks it of the GPUs it observes afresh: its GpuPartition (``no_partition`` before one exists), the node's
    MIG owner, another driver publishing MIG devices of the GPU (``foreign``: GPU UUID -> driver), or a MIG
    mode switch the round works toward (:func:`dynamig.agent.modes.booked.requested_mode`, from the devices
    ``allocated``: device name -> claims) that is not the switch a booking of the whole GPU asks (that
    booking is answered by the switch). Pure."""
    claims = allocated or {}

    def refuse(gpu: GpuInfo) -> Problem | None:
        owner = node_owner
        if owner is None and gpu.uuid in foreign:
            owner = f"driver {foreign[gpu.uuid]} publishes MIG devices of this GPU"
        part = parts.get(gpu_partition_name(node, gpu.index), no_partition)
        problem = refusal(gpu, part, owner)
        wanted = requested_mode(gpu, part, partitionable, claims)
        if problem is None and wants_switch(gpu, wanted) and not booked_by(gpu, part, partitionable, claims):
            # withdrawn for a MIG mode switch (agent/modes/switch.py): a booking from an older slice fails
            assert wanted is not None
            return Reason.MIG_MODE_DRAINING, f"GPU {gpu.index} is being switched to MIG mode {wanted.value}"
        return problem

    return refuse
