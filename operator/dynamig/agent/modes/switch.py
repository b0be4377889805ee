"""Switching a GPU's MIG mode when its GpuPartition asks (``spec.migMode``), without losing a workload.

The operator writes ``spec.migMode`` (``Enabled`` or ``Disabled``) under a policy whose MIG mode is
``Dynamic``; a person may too. The agent switches only a GPU nothing uses, in three steps per round:

1. **withdraw**: every device of the GPU leaves the slice (the whole GPU going to MIG; the MIG instances and
   placements going whole), so the scheduler books nothing new there, and bookings not answered yet are
   answered failed (``agent/bindings/answering.py``). Going whole, the free MIG instances are destroyed as any
   retired instance is (``agent/layout/lifecycle.py``: out of the slice, quiet for the settle period, read
   again just before); allocated or busy ones stay until their pods end.
2. **settle**: the GPU stays withdrawn for the settle period (a booking from a slice published before the
   withdrawal may still be on its way), then the claims and the pods binding toward the node are read afresh:
   any allocation naming a device of the GPU, a prepared claim, a compute process or a pod in a binding cycle
   keeps it waiting.
3. **switch**: ``nvmlDeviceSetMigMode``. Its ``activationStatus``: ``Success`` (the mode is current, or
   pending while the driver resets the GPU: the next rounds wait for it), ``InUse`` (nvml.h: "The caller of
   this API is expected to idle the device and retry setting the mode": tried again next round, once idle),
   ``ResetRequired`` (a VM whose reset is not exposed: reported and never tried again for this request, a
   VM reboot applies it).

Then the GPU is what its new mode makes it: MIG instances (``spec.layout``, offers) or a whole GPU, read
afresh from NVML (the switch may change the minor number; the agent reads every GPU each round). The
``MigMode`` condition says where the switch stands; timers and the last activation status live in memory
(a restarted agent withdraws and settles again, which is only slower).

:func:`switch_step` is pure; :class:`ModeSwitcher` keeps the timers and makes the calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from dynamig.agent.kube.api import KubeApi, allocated_devices
from dynamig.agent.nvml.device import GpuInfo, NvmlDevices
from dynamig.kube.gpupartition import (
    Condition,
    ConditionType,
    GpuPartition,
    GpuPartitionStatus,
    MigModeRequest,
    Phase,
    Reason,
    set_condition,
)
from dynamig.kube.names import whole_device_name

log = logging.getLogger(__name__)


class Step(StrEnum):
    DONE = "done"  # NVML reports the requested mode
    WAIT = "wait"  # withdrawn; something still uses the GPU, or the settle period runs
    SWITCH = "switch"  # call NVML now
    SWITCHING = "switching"  # the mode is pending in NVML (a reset under way, or a busy GPU)
    GPU_BUSY = "gpu-busy"  # NVML answered NVML_ERROR_IN_USE (the GPU is not idle): called again next round
    RESET_REQUIRED = "reset-required"  # NVML said a reset the platform does not expose is needed


def wants_switch(gpu: GpuInfo, request: MigModeRequest | None) -> bool:
    """Whether ``request`` asks for another MIG mode than NVML reports now, or one is pending. Pure."""
    if request is None:
        return False
    wanted = 1 if request is MigModeRequest.ENABLED else 0
    return gpu.mig_current != wanted or gpu.mig_pending != wanted


def switch_step(
    gpu: GpuInfo,
    request: MigModeRequest,
    users: Sequence[str],
    withdrawn_s: float | None,
    settle_s: float,
    last: str | None,
) -> tuple[Step, str]:
    """The next step of switching ``gpu`` to ``request``, and why. ``users``: what still uses the GPU (as
    read this round); ``withdrawn_s``: seconds its devices have been out of the slice (None: not yet);
    ``last``: the activation status of the last call for this request. Pure."""
    mode = "on" if request is MigModeRequest.ENABLED else "off"
    if not wants_switch(gpu, request):
        return Step.DONE, f"MIG mode is {mode}, as spec.migMode asks"
    if last == "ResetRequired":
        return Step.RESET_REQUIRED, (
            f"NVML answered NVML_ERROR_RESET_REQUIRED switching MIG {mode}: this platform does not expose a "
            "GPU reset (a pass-through VM); a VM reboot applies the pending mode. Not tried again"
        )
    if users:
        return Step.WAIT, f"switching MIG {mode} once nothing uses the GPU: " + "; ".join(users[:4])
    if withdrawn_s is None or withdrawn_s < settle_s:
        return Step.WAIT, f"switching MIG {mode}: devices withdrawn, settling before the switch"
    pending = gpu.mig_pending != gpu.mig_current
    if pending and last not in (None, "InUse"):
        return (
            Step.SWITCHING,
            f"switching MIG {mode}: NVML reports the change pending (the driver resets the GPU)",
        )
    return Step.SWITCH, f"switching MIG {mode} now"


def mig_mode_condition(
    conditions: list[Condition], step: Step, message: str, generation: int, stamp: str
) -> list[Condition]:
    """The ``MigMode`` condition for ``step``. Pure."""
    reason = {
        Step.DONE: Reason.MIG_MODE_SWITCHED,
        Step.WAIT: Reason.MIG_MODE_DRAINING,
        Step.SWITCH: Reason.MIG_MODE_DRAINING,
        Step.SWITCHING: Reason.MIG_MODE_DRAINING,
        Step.GPU_BUSY: Reason.MIG_MODE_GPU_BUSY,
        Step.RESET_REQUIRED: Reason.RESET_REQUIRED,
    }[step]
    done = step is Step.DONE
    return set_condition(conditions, ConditionType.MIG_MODE, done, reason, message, generation, stamp)


def switch_status(
    status: GpuPartitionStatus, part: GpuPartition, step: Step, message: str, stamp: str
) -> GpuPartitionStatus:
    """``status`` with the ``MigMode`` condition of ``spec.migMode``; while a switch is under way, Ready
    False with its reason, nothing published (``wholeGpu.published`` false), phase Reshaping (Degraded
    when a reset the platform does not expose is needed: a person must act). Pure."""
    gen = part.metadata.generation
    conds = mig_mode_condition(status.conditions, step, message, gen, stamp)
    if step is Step.DONE:
        return status.model_copy(update={"conditions": conds})
    reason = next(c.reason for c in conds if c.type == ConditionType.MIG_MODE)
    conds = set_condition(conds, ConditionType.READY, False, reason, message, gen, stamp)
    update: dict[str, object] = {
        "conditions": conds,
        "phase": Phase.DEGRADED if step is Step.RESET_REQUIRED else Phase.RESHAPING,
        "message": message,
        "free_slices": 0,
        "offered_placements": 0,
    }
    if status.whole_gpu is not None:
        update["whole_gpu"] = status.whole_gpu.model_copy(update={"published": False})
    return status.model_copy(update=update)


def gpu_users(
    index: int,
    claims: Mapping[str, Sequence[str]],
    prepared: Collection[str],
    processes: int,
    booked: Collection[str] = (),
) -> list[str]:
    """What uses GPU ``index``: claims allocated a device of it, prepared devices, compute processes; not
    the ``booked`` claims' booking of its whole device, which the switch is for
    (:mod:`dynamig.agent.modes.booked`). Pure."""
    prefix, whole = f"gpu{index}-", whole_device_name(index)
    out = []
    for dev, holders in sorted(claims.items()):
        if dev == whole and set(holders) <= set(booked):
            continue
        if holders and (dev == whole or dev.startswith(prefix)):
            out.append(f"{dev} allocated to {', '.join(sorted(set(holders)))}")
    out += [f"{dev} prepared for a pod" for dev in sorted(prepared) if dev == whole or dev.startswith(prefix)]
    if processes:
        out.append(f"{processes} compute process(es) on the GPU")
    return out


@dataclass
class _Switch:
    request: MigModeRequest
    withdrawn_at: float
    last: str | None = None  # activation status of the last call


class ModeSwitcher:
    """The timers and calls of MIG mode switches on one node. Side effects: NVML, API reads."""

    def __init__(
        self, devices: NvmlDevices, api: KubeApi, node: str, driver: str, clock: Callable[[], float]
    ) -> None:
        self.devices, self.api, self.node, self.driver, self.clock = devices, api, node, driver, clock
        self._switches: dict[str, _Switch] = {}  # GPU UUID -> the switch under way

    def withdrawn(self, gpu: GpuInfo, request: MigModeRequest) -> float:
        """Seconds since ``gpu``'s devices were withdrawn for ``request`` (starting the clock now)."""
        s = self._switches.get(gpu.uuid)
        if s is None or s.request is not request:
            s = self._switches[gpu.uuid] = _Switch(request, self.clock())
        return self.clock() - s.withdrawn_at

    def forget(self, gpu: GpuInfo) -> None:
        self._switches.pop(gpu.uuid, None)

    def reset_required(self, gpu: GpuInfo) -> bool:
        """Whether NVML answered NVML_ERROR_RESET_REQUIRED for ``gpu``'s switch under way: a booking that
        waits on it would wait until a VM reboot."""
        s = self._switches.get(gpu.uuid)
        return s is not None and s.last == "ResetRequired"

    async def step(
        self,
        gpu: GpuInfo,
        request: MigModeRequest,
        claims: Mapping[str, Sequence[str]],
        prepared: Collection[str],
        processes: int,
        settle_s: float,
        booked: Collection[str] = (),
    ) -> tuple[Step, str]:
        """Decide, and switch when it is time (after reading the claims and binding pods afresh); ``booked``:
        the claims whose booking of the whole device the switch is for, and their pods, hold nothing back."""
        if not wants_switch(gpu, request):
            self.forget(gpu)
            return switch_step(gpu, request, (), None, settle_s, None)
        withdrawn = self.withdrawn(gpu, request)
        record = self._switches[gpu.uuid]
        users = gpu_users(gpu.index, claims, prepared, processes, booked)
        step, why = switch_step(gpu, request, users, withdrawn, settle_s, record.last)
        if step is not Step.SWITCH:
            return step, why
        fresh = await self._fresh_users(gpu, booked)
        if fresh:
            return (
                Step.WAIT,
                f"switching MIG {'on' if request is MigModeRequest.ENABLED else 'off'} once "
                + ("nothing uses the GPU: " + "; ".join(fresh[:4])),
            )
        enable = request is MigModeRequest.ENABLED
        status = await asyncio.to_thread(self.devices.set_mig_mode, gpu, enable)
        record.last = status
        log.info("GPU %s (%s): MIG mode %s requested; NVML activation status %s",
                 gpu.index, gpu.uuid, "on" if enable else "off", status)  # fmt: skip
        if status == "ResetRequired":
            return switch_step(gpu, request, (), withdrawn, settle_s, status)
        if status == "InUse":
            return Step.GPU_BUSY, (
                f"switching MIG {'on' if enable else 'off'}: NVML_ERROR_IN_USE (the GPU is not idle); tried "
                "again next round"
            )
        return Step.SWITCHING, f"MIG mode {'on' if enable else 'off'} requested: NVML activation {status}"

    async def _fresh_users(self, gpu: GpuInfo, booked: Collection[str] = ()) -> list[str]:
        """What uses the GPU by a read made just now: pods binding toward the node first, then claims (the
        ``booked`` claims' booking of the whole device aside).

        For a switch a booking of the whole device asks, pods binding toward the node are not read: that
        booking consumed every counter of the GPU, so the scheduler allocated it only with nothing else of
        the GPU allocated or in flight, and has allocated nothing of the GPU since (its pod is one of those
        binding, waiting on this very switch)."""
        binding = [] if booked else await self.api.pods_binding_to(self.node)
        holders = allocated_devices(await self.api.list_claims(), self.driver, self.node)
        out = gpu_users(gpu.index, holders, (), 0, booked)
        if binding:
            out.append(
                "pods binding to this node may hold an allocation from an older slice: "
                + ", ".join(binding[:3])
            )
        return out
