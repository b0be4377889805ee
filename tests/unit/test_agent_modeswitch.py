"""The agent's MIG mode switch decisions (agent/modes/switch.py) and their status. Pure functions."""

from __future__ import annotations

import pytest

from dynamig.agent.modes.switch import Step, gpu_users, switch_status, switch_step, wants_switch
from dynamig.agent.nvml.device import GpuInfo
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.gpupartition import (
    ConditionType,
    GpuPartition,
    GpuPartitionStatus,
    MigModeRequest,
    Phase,
    Reason,
    WholeGpuStatus,
)

MODEL = load_catalog().model("H100-80GB")
ON, OFF = MigModeRequest.ENABLED, MigModeRequest.DISABLED
STAMP = "2026-12-06T08:00:00Z"


def gpu(current: int, pending: int | None = None) -> GpuInfo:
    pending = current if pending is None else pending
    return GpuInfo(2, "GPU-x", "NVIDIA H100 80GB HBM3", 0x2330, 2, current, pending, MODEL)


def test_wants_a_switch_only_when_nvml_differs_or_a_change_is_pending() -> None:
    assert not wants_switch(gpu(0), None)
    assert not wants_switch(gpu(0), OFF) and not wants_switch(gpu(1), ON)
    assert wants_switch(gpu(0), ON) and wants_switch(gpu(1), OFF)
    assert wants_switch(gpu(0, pending=1), OFF)  # someone else's pending enable: withdrawn by asking off


@pytest.mark.parametrize(
    ("users", "withdrawn", "last", "pending", "step"),
    [
        (["gpu2 allocated to ns/a"], 100.0, None, None, Step.WAIT),  # in use: never switched under it
        ([], None, None, None, Step.WAIT),  # not withdrawn yet
        ([], 0.1, None, None, Step.WAIT),  # withdrawn, still settling
        ([], 5.0, None, None, Step.SWITCH),
        ([], 5.0, "InUse", 1, Step.SWITCH),  # nvml.h: idle the device and retry
        ([], 5.0, "Success", 1, Step.SWITCHING),  # pending: the driver's reset under way
        ([], 5.0, "ResetRequired", 1, Step.RESET_REQUIRED),  # never retried
        (["gpu2 prepared for a pod"], 5.0, "ResetRequired", 1, Step.RESET_REQUIRED),
    ],
)
def test_the_next_step(
    users: list[str], withdrawn: float | None, last: str | None, pending: int | None, step: Step
) -> None:
    got, why = switch_step(gpu(0, pending), ON, users, withdrawn, 1.0, last)
    assert got is step, why
    if users and step is Step.WAIT:
        assert users[0] in why


def test_done_once_nvml_reports_the_mode() -> None:
    assert switch_step(gpu(1), ON, ["gpu2-1g10gb-s0 allocated to ns/a"], None, 1.0, None)[0] is Step.DONE


def test_what_uses_a_gpu() -> None:
    claims = {"gpu2": ["ns/w"], "gpu2-1g10gb-s0": ["ns/a"], "gpu20-1g10gb-s0": ["ns/other"], "gpu2-x": []}
    users = gpu_users(2, claims, {"gpu2-3g40gb-s4", "gpu3"}, 1)
    assert users == [
        "gpu2 allocated to ns/w",
        "gpu2-1g10gb-s0 allocated to ns/a",
        "gpu2-3g40gb-s4 prepared for a pod",
        "1 compute process(es) on the GPU",
    ]
    assert gpu_users(2, {}, (), 0) == []


def _part() -> GpuPartition:
    return GpuPartition.model_validate(
        {"metadata": {"name": "n-gpu2", "generation": 4}, "spec": {"migMode": "Enabled"}}
    )


def test_the_status_while_switching_and_once_done() -> None:
    base = GpuPartitionStatus(phase=Phase.STABLE, free_slices=1, whole_gpu=WholeGpuStatus(device_name="gpu2"))
    waiting = switch_status(base, _part(), Step.WAIT, "switching MIG on once nothing uses the GPU: x", STAMP)
    mode, ready = waiting.condition(ConditionType.MIG_MODE), waiting.condition(ConditionType.READY)
    assert mode is not None and not mode.is_true and mode.reason == Reason.MIG_MODE_DRAINING
    assert ready is not None and not ready.is_true and ready.reason == Reason.MIG_MODE_DRAINING
    assert waiting.phase == Phase.RESHAPING and waiting.free_slices == 0
    assert waiting.whole_gpu is not None and waiting.whole_gpu.published is False
    reset = switch_status(base, _part(), Step.RESET_REQUIRED, "a VM reboot is needed", STAMP)
    assert reset.phase == Phase.DEGRADED
    assert (reset.condition(ConditionType.MIG_MODE) or ready).reason == Reason.RESET_REQUIRED
    busy = switch_status(base, _part(), Step.GPU_BUSY, "NVML_ERROR_IN_USE (the GPU is not idle)", STAMP)
    assert (busy.condition(ConditionType.MIG_MODE) or ready).reason == Reason.MIG_MODE_GPU_BUSY
    assert busy.phase == Phase.RESHAPING
    # The reason follows the step, not the words: a message quoting the error under another step keeps it.
    quoted = switch_status(base, _part(), Step.WAIT, "last try: NVML_ERROR_IN_USE; settling", STAMP)
    assert (quoted.condition(ConditionType.MIG_MODE) or ready).reason == Reason.MIG_MODE_DRAINING
    done = switch_status(base, _part(), Step.DONE, "MIG mode is on", STAMP)
    assert done.phase == Phase.STABLE and done.free_slices == 1
    cond = done.condition(ConditionType.MIG_MODE)
    assert cond is not None and cond.is_true and cond.reason == Reason.MIG_MODE_SWITCHED
    assert done.condition(ConditionType.READY) is None  # left to the GPU's own readiness
