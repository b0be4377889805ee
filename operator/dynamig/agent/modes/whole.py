"""A GPU whose MIG mode is off, served whole: one device ``gpu<index>`` and its GpuPartition status. Pure.

A MIG-capable GPU with MIG mode off (and no mode change pending) is no longer refused: the agent publishes it
as one device (:class:`dynamig.kube.devices.WholeGpuDevice`, attribute ``profile`` = ``whole``) in either
inventory, with no counters and no binding conditions (nothing is cut: it binds in the scheduling cycle),
unless it is kept for a claim of whole GPUs (a hold of the whole GPU): then with binding conditions, and only
that claim's booking is answered ready.
Its state follows the MIG instances' rules: ``allocated`` while a claim allocation names it, ``in-use``
while a prepared claim or compute processes use it. Processes with no claim are work outside DRA: the
device is withdrawn (as a busy MIG instance is) until they end, so the scheduler hands it to nobody else.
Nothing here changes the MIG mode.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from dynamig.agent.bindings.holds import whole_hold
from dynamig.agent.nvml.device import GpuInfo, WholeGpu
from dynamig.agent.publishing.gpu_status import GpuOutcome, gpu_status, mig_mode
from dynamig.kube.gpupartition import (
    ConditionType,
    GpuPartition,
    InstanceState,
    Inventory,
    Phase,
    Reason,
    WholeGpuStatus,
    set_condition,
)
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY

Claims = Mapping[str, Sequence[str]]


def whole_state(name: str, processes: int, claims: Claims, prepared: Collection[str]) -> InstanceState:
    if processes > 0 or name in prepared:
        return InstanceState.IN_USE
    return InstanceState.ALLOCATED if claims.get(name) else InstanceState.FREE


def whole_outcome(
    node: str,
    inventory: Inventory | None,
    gpu: GpuInfo,
    part: GpuPartition,
    whole: WholeGpu,
    claims: Claims,
    prepared: Collection[str],
    stamp: str,
    now: float = 0.0,
) -> GpuOutcome:
    """What a GPU with MIG mode off contributes to a round: its whole device (unless work outside DRA holds
    it) and a status saying so. While a hold of the whole GPU stands (``now``: epoch seconds), the device is
    published guarded where the agent publishes the partitionable inventory (``inventory``: the API server
    keeps binding conditions there), so only the claim it is kept for is answered ready
    (agent/bindings/holds.py); in the instances inventory a hold keeps nothing."""
    device = whole.device
    name = device.name
    held = sorted(set(claims.get(name, ())))
    state = whole_state(name, whole.processes, claims, prepared)
    outside = whole.processes > 0 and not held and name not in prepared  # nobody in DRA asked for it
    entry = WholeGpuStatus(
        device_name=name, state=state, published=not outside, processes=whole.processes, claims=held
    )
    hold = whole_hold(part.spec.active_holds(now))
    guarded = hold is not None and inventory is Inventory.PARTITIONABLE and not outside
    if outside:
        why = f"{whole.processes} process(es) outside DRA use GPU {gpu.index}: {name} withdrawn till they end"
        ready = (False, Reason.INSTANCE_BUSY, why)
    elif guarded and hold is not None:
        why = f"MIG mode is off: the GPU is published whole as {name} ({state}), kept for claim {hold.claim}"
        ready = (True, Reason.WHOLE_GPU, why)
    else:
        ready = (True, Reason.WHOLE_GPU, f"MIG mode is off: the GPU is published whole as {name} ({state})")
    status = gpu_status(node, inventory, gpu, part, (), claims, prepared, (), Phase.STABLE, ready[2])
    gen = part.metadata.generation
    conds = set_condition(
        status.conditions, ConditionType.MANAGED, True, Reason.MANAGED, "managed by dynamig", gen, stamp
    )
    conds = set_condition(
        conds, ConditionType.HEALTHY, True, Reason.GPU_PRESENT, "NVML reports the GPU", gen, stamp
    )
    if part.spec.desired():
        text = "spec.layout is not applied: MIG mode is off on this GPU (the agent does not change it)"
        conds = set_condition(conds, ConditionType.LAYOUT_VALID, False, Reason.MIG_DISABLED, text, gen, stamp)
    else:
        text = "no layout: MIG mode is off on this GPU"
        conds = set_condition(conds, ConditionType.LAYOUT_VALID, True, Reason.VALID, text, gen, stamp)
    conds = set_condition(conds, ConditionType.READY, ready[0], ready[1], ready[2], gen, stamp)
    status = status.model_copy(
        update={
            "mig_mode": mig_mode(gpu),
            "whole_gpu": entry,
            "layout_summary": "whole",
            "free_slices": 1 if state is InstanceState.FREE and not outside else 0,
            "total_slices": 1,
            "offered_placements": 0,
            "holds": [hold] if guarded and hold is not None else [],
            "conditions": conds,
        }
    )
    published = None if outside else device.to_api()
    if published is not None and guarded:
        published |= {"bindingConditions": [BINDING_READY], "bindingFailureConditions": [BINDING_FAILED]}
    return GpuOutcome(part.name, status=status, whole=published)
