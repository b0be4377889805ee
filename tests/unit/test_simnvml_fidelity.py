"""The simulated NVML against nvml.h, function by function.

The simulator is not an oracle: each behaviour it models must be what NVIDIA's header documents. Every case
below names the C function ``pynvml`` calls, quotes the sentence of ``tests/data/nvml/nvml.h`` (verbatim from
NVIDIA/go-nvml) that states the behaviour, checks that the quote really is in that function's documentation
block, and then checks the simulator does what the sentence says. A last test makes sure every NVML function
the agent's ``NvmlDevices`` calls has at least one case here.
"""

from __future__ import annotations

import ctypes
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
from nvml_doc import doc_block, member_doc, squash

from dynamig.backends import simnvml as nv

AGENT = Path(__file__).resolve().parents[2] / "operator" / "dynamig" / "agent"
AGENT_NVML = AGENT / "nvml" / "device.py"
AGENT_HEALTH = AGENT / "health" / "devices.py"


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    nv.reset()
    yield
    nv.reset()


@dataclass(frozen=True)
class World:
    """One simulated H100 with MIG on: 3g.40gb@4 (whole CI, a process on it) and 1g.10gb@0 (whole CI)."""

    parent: Any
    gi_big: Any
    ci_big: Any
    gi_small: Any
    ci_small: Any


def _placement(start: int, size: int) -> Any:
    pl = pynvml.c_nvmlGpuInstancePlacement_t()
    pl.start, pl.size = start, size
    return pl


def _world(mig_enabled: bool = True) -> World:
    nv.configure(["H100-80GB", "H100-80GB"], mig_enabled=mig_enabled)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    if not mig_enabled:
        return World(h, None, None, None, None)
    big = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, ctypes.byref(_placement(4, 4)))  # 3g.40gb@4
    ci_big = nv.nvmlGpuInstanceCreateComputeInstance(big, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    small = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, ctypes.byref(_placement(0, 1)))  # 1g.10gb@0
    ci_small = nv.nvmlGpuInstanceCreateComputeInstance(small, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    return World(h, big, ci_big, small, ci_small)


def _migs(parent: Any) -> dict[tuple[int, int], Any]:
    out = {}
    for i in range(nv.nvmlDeviceGetMaxMigDeviceCount(parent)):
        try:
            mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, i)
        except pynvml.NVMLError_NotFound:
            continue
        out[(nv.nvmlDeviceGetGpuInstanceId(mig), nv.nvmlDeviceGetComputeInstanceId(mig))] = mig
    return out


def _mig_of(w: World, gi: Any, ci: Any) -> Any:
    key = (nv.nvmlGpuInstanceGetInfo(gi).id, nv.nvmlComputeInstanceGetInfo(ci).id)
    return _migs(w.parent)[key]


# --- the cases -----------------------------------------------------------------------------------------


def ci_info_device_is_the_parent() -> None:
    w = _world()
    dev = nv.nvmlComputeInstanceGetInfo(w.ci_big).device
    assert nv.nvmlDeviceIsMigDeviceHandle(dev).value == 0
    assert nv.nvmlDeviceGetUUID(dev) == nv.nvmlDeviceGetUUID(w.parent)


def gi_info_device_is_the_parent() -> None:
    w = _world()
    dev = nv.nvmlGpuInstanceGetInfo(w.gi_big).device
    assert nv.nvmlDeviceGetUUID(dev) == nv.nvmlDeviceGetUUID(w.parent)


def mig_handle_by_index_then_not_found() -> None:
    w = _world()
    assert len(_migs(w.parent)) == 2  # one MIG device per compute instance
    count = nv.nvmlDeviceGetMaxMigDeviceCount(w.parent)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(w.parent, count - 1)  # only 2 of 7 indices are used
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(w.parent, count)


def mig_device_enumerated_after_its_create() -> None:
    # A compute instance whose MIG device the driver has not set up yet: the GI and CI are listed, but no
    # valid MIG device is at its index (nor under its UUID) until the delay has passed.
    w = _world()
    nv.set_mig_enumeration_delay(0.3)
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(w.parent, 19, ctypes.byref(_placement(1, 1)))
    ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    key = (nv.nvmlGpuInstanceGetInfo(gi).id, nv.nvmlComputeInstanceGetInfo(ci).id)
    assert key not in _migs(w.parent) and len(_migs(w.parent)) == 2
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(w.parent, 2)  # GI ids 1, 2, 3: the new one is third
    time.sleep(0.35)
    assert key in _migs(w.parent) and len(_migs(w.parent)) == 3


def mig_handle_not_supported_without_mig() -> None:
    w = _world(mig_enabled=False)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(w.parent, 0)


def max_mig_count_zero_without_mig() -> None:
    w = _world(mig_enabled=False)
    assert nv.nvmlDeviceGetMaxMigDeviceCount(w.parent) == 0
    nv.nvmlDeviceSetMigMode(w.parent, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert nv.nvmlDeviceGetMaxMigDeviceCount(w.parent) == 7


def is_mig_device_handle() -> None:
    w = _world()
    assert nv.nvmlDeviceIsMigDeviceHandle(w.parent).value == 0
    assert nv.nvmlDeviceIsMigDeviceHandle(_mig_of(w, w.gi_big, w.ci_big)).value == 1


def parent_from_mig_handle() -> None:
    w = _world()
    parent = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(_mig_of(w, w.gi_small, w.ci_small))
    assert nv.nvmlDeviceGetUUID(parent) == nv.nvmlDeviceGetUUID(w.parent)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(w.parent)


def gi_and_ci_ids_of_mig_handle() -> None:
    w = _world()
    mig = _mig_of(w, w.gi_big, w.ci_big)
    assert nv.nvmlDeviceGetGpuInstanceId(mig) == nv.nvmlGpuInstanceGetInfo(w.gi_big).id
    assert nv.nvmlDeviceGetComputeInstanceId(mig) == nv.nvmlComputeInstanceGetInfo(w.ci_big).id
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # "Target MIG device handle": not the parent
        nv.nvmlDeviceGetGpuInstanceId(w.parent)


def mig_uuid_is_its_own() -> None:
    w = _world()
    parent_uuid = nv.nvmlDeviceGetUUID(w.parent)
    uuids = {nv.nvmlDeviceGetUUID(m) for m in _migs(w.parent).values()}
    assert len(uuids) == 2 and parent_uuid not in uuids
    assert all(u.startswith("MIG-") for u in uuids) and parent_uuid.startswith("GPU-")
    for u in uuids:  # "can be used to identify MIG devices across both GPU and MIG devices"
        assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByUUID(u)) == u


def handle_by_uuid_fails_when_any_gpu_is_lost() -> None:
    _world()
    healthy = nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(0))
    nv.set_gpu_lost(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetHandleByUUID(healthy)
    assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(0)) == healthy  # by index still works
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.set_gpu_lost(1, False)
        nv.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")


def handle_by_uuid_not_found_before_the_mig_device_is_enumerated() -> None:
    w = _world()
    nv.set_mig_enumeration_delay(0.3)
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(w.parent, 19, ctypes.byref(_placement(1, 1)))
    nv.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    (new,) = [e.mig_uuid for e in nv.history() if e.kind == "create-ci"][-1:]
    assert new is not None
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetHandleByUUID(new)  # not yet a valid device on the system
    time.sleep(0.35)
    assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByUUID(new)) == new


def handle_by_index_gpu_lost() -> None:
    _world()
    nv.set_gpu_lost(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetHandleByIndex(1)


def memory_per_instance_on_mig_handle() -> None:
    w = _world()
    gib = 2**30
    assert nv.nvmlDeviceGetMemoryInfo(_mig_of(w, w.gi_small, w.ci_small)).total < 11 * gib
    assert 39 * gib < nv.nvmlDeviceGetMemoryInfo(_mig_of(w, w.gi_big, w.ci_big)).total < 41 * gib
    assert nv.nvmlDeviceGetMemoryInfo(w.parent).total > 79 * gib  # aggregate on the parent


def attributes_only_on_mig_handles() -> None:
    w = _world()
    assert nv.nvmlDeviceGetAttributes(_mig_of(w, w.gi_big, w.ci_big)).multiprocessorCount == 60
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetAttributes(w.parent)


def processes_per_instance_on_mig_handle() -> None:
    w = _world()
    big, small = _mig_of(w, w.gi_big, w.ci_big), _mig_of(w, w.gi_small, w.ci_small)
    nv.attach_process(nv.nvmlDeviceGetUUID(big), 4242)
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(big)] == [4242]
    assert nv.nvmlDeviceGetComputeRunningProcesses(small) == []
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(w.parent)] == [4242]  # aggregate


def architecture_of_the_device() -> None:
    w = _world(mig_enabled=False)
    assert nv.nvmlDeviceGetArchitecture(w.parent) == pynvml.NVML_DEVICE_ARCH_HOPPER  # H100
    second = nv.nvmlDeviceGetHandleByIndex(1)
    nv.configure(["A100-80GB"], mig_enabled=False)
    nv.nvmlInit()
    assert nv.nvmlDeviceGetArchitecture(nv.nvmlDeviceGetHandleByIndex(0)) == pynvml.NVML_DEVICE_ARCH_AMPERE
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetArchitecture(second)  # a GPU the machine no longer has: an invalid device


def compute_capability_of_the_device() -> None:
    w = _world(mig_enabled=False)
    assert tuple(nv.nvmlDeviceGetCudaComputeCapability(w.parent)) == (9, 0)  # Hopper: sm_90
    nv.configure(["A100-80GB"], mig_enabled=False)
    nv.nvmlInit()
    assert tuple(nv.nvmlDeviceGetCudaComputeCapability(nv.nvmlDeviceGetHandleByIndex(0))) == (8, 0)


def processes_on_a_gpu_with_mig_off() -> None:
    w = _world(mig_enabled=False)
    nv.attach_process(nv.nvmlDeviceGetUUID(w.parent), 77)
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(w.parent)] == [77]
    other = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetComputeRunningProcesses(other) == []


def set_mig_mode_activates_on_an_idle_hopper() -> None:
    """The agent's switch; every other activation status is checked in test_simnvml_migmode.py."""
    w = _world(mig_enabled=False)
    assert nv.nvmlDeviceSetMigMode(w.parent, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert list(nv.nvmlDeviceGetMigMode(w.parent)) == [1, 1]


def destroy_ci_in_use() -> None:
    w = _world()
    nv.attach_process(nv.nvmlDeviceGetUUID(_mig_of(w, w.gi_big, w.ci_big)), 7)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlComputeInstanceDestroy(w.ci_big)


def destroy_gi_in_use() -> None:
    w = _world()
    with pytest.raises(pynvml.NVMLError_InUse):  # compute instances active on it
        nv.nvmlGpuInstanceDestroy(w.gi_big)
    nv.nvmlComputeInstanceDestroy(w.ci_big)
    nv.nvmlGpuInstanceDestroy(w.gi_big)


def create_gi_insufficient_resources() -> None:
    w = _world()
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # overlaps 3g.40gb@4
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(w.parent, 19, ctypes.byref(_placement(5, 1)))


def create_gi_invalid_placement() -> None:
    w = _world()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # 3g may start at 0 or 4 only
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(w.parent, 9, ctypes.byref(_placement(2, 4)))


def create_gi_not_supported_without_mig() -> None:
    w = _world(mig_enabled=False)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(w.parent, 19, ctypes.byref(_placement(0, 1)))


def create_ci_insufficient_resources() -> None:
    w = _world()
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # the 1g GI is full
        nv.nvmlGpuInstanceCreateComputeInstance(w.gi_small, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)


def list_gis_not_supported_without_mig() -> None:
    w = _world(mig_enabled=False)
    arr = (pynvml.c_nvmlGpuInstance_t * 7)()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstances(w.parent, 19, arr, ctypes.byref(ctypes.c_uint(0)))


def list_cis_unsupported_profile() -> None:
    w = _world()
    arr = (pynvml.c_nvmlComputeInstance_t * 7)()
    with pytest.raises((pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument)):
        nv.nvmlGpuInstanceGetComputeInstances(
            w.gi_small, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE, arr, ctypes.byref(ctypes.c_uint(0))
        )


def profile_info_needs_mig() -> None:
    w = _world(mig_enabled=False)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstanceProfileInfo(w.parent, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)


def placements_regardless_of_mig() -> None:
    w = _world(mig_enabled=False)
    count = ctypes.c_uint(0)
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(w.parent, 9, None, ctypes.byref(count))
    assert count.value == 2


def mig_mode_current_and_pending() -> None:
    w = _world(mig_enabled=False)
    assert nv.nvmlDeviceGetMigMode(w.parent) == [0, 0]


def uninitialized() -> None:
    nv.configure(["A30-24GB"])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 1
    nv.reload_driver()  # a session from before a driver reload is stale (stated assumption in simnvml)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 1


def init_is_reference_counted() -> None:
    nv.configure(["A30-24GB"])
    nv.nvmlInit()
    nv.nvmlInit()
    nv.nvmlShutdown()
    assert nv.nvmlDeviceGetCount() == 1  # one initialisation is still open
    nv.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()


def gi_info_stale_handle() -> None:
    w = _world()
    nv.nvmlComputeInstanceDestroy(w.ci_small)
    nv.nvmlGpuInstanceDestroy(w.gi_small)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceGetInfo(w.gi_small)


def name_uuid_pci_minor() -> None:
    w = _world()
    assert nv.nvmlDeviceGetName(w.parent).startswith("NVIDIA H100")
    assert nv.nvmlDeviceGetPciInfo(w.parent).pciDeviceId & 0xFFFF == 0x10DE
    assert nv.nvmlDeviceGetMinorNumber(w.parent) == 0


def ci_profile_info() -> None:
    w = _world()
    info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        w.gi_big,
        pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
        pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    )
    assert info.sliceCount == 3
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            w.gi_small, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE, 0
        )


def shutdown_then_uninitialized() -> None:
    _world()
    nv.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetHandleByIndex(0)


# --- events (nvml.h "Event Handling Methods"; dynamig.backends.simevents) ------------------------------

XID = pynvml.nvmlEventTypeXidCriticalError


def _xid_set(w: World) -> Any:
    s = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(w.parent, XID, s)
    return s


def _gi_id(gi: Any) -> int:
    return int(nv.nvmlGpuInstanceGetInfo(gi).id)


def event_set_needs_init() -> None:
    nv.configure(["H100-80GB"])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlEventSetCreate()
    nv.nvmlInit()
    s = nv.nvmlEventSetCreate()
    nv.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlEventSetWait(s, 0)


def events_before_register_not_recorded() -> None:
    w = _world()
    nv.inject_xid(0, 48)  # before the registration: not recorded
    s = _xid_set(w)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlEventSetWait(s, 50)
    nv.inject_xid(0, 79)
    assert nv.nvmlEventSetWait(s, 50).eventData == 79


def register_unsupported_type() -> None:
    w = _world()
    s = nv.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceRegisterEvents(w.parent, XID | pynvml.nvmlEventTypeClock, s)
    nv.inject_xid(0, 48)
    with pytest.raises(pynvml.NVMLError_Timeout):  # nothing of that call was registered
        nv.nvmlEventSetWait(s, 50)
    nv.nvmlDeviceRegisterEvents(w.parent, XID, s)  # the set can still be used
    nv.inject_xid(0, 48)
    assert nv.nvmlEventSetWait(s, 50).eventData == 48


def register_invalid_types() -> None:
    w = _world()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceRegisterEvents(w.parent, 1 << 40, nv.nvmlEventSetCreate())


def register_on_lost_gpu() -> None:
    w = _world()
    nv.set_gpu_lost(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceRegisterEvents(w.parent, XID, nv.nvmlEventSetCreate())


def wait_times_out() -> None:
    w = _world()
    s = _xid_set(w)
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlEventSetWait(s, 200)
    assert 0.15 <= time.monotonic() - started < 2.0


def wait_returns_at_once_when_ready() -> None:
    w = _world()
    s = _xid_set(w)
    nv.inject_xid(0, 94, gi_id=_gi_id(w.gi_small), ci_id=0)
    started = time.monotonic()
    assert nv.nvmlEventSetWait(s, 10_000).eventData == 94
    assert time.monotonic() - started < 1.0


def wait_sleeps_till_event() -> None:
    w = _world()
    s = _xid_set(w)
    timer = threading.Timer(0.3, lambda: nv.inject_xid(0, 63))
    timer.start()
    started = time.monotonic()
    data = nv.nvmlEventSetWait(s, 5_000)
    timer.join()
    assert data.eventData == 63 and 0.25 <= time.monotonic() - started < 3.0


def every_xid_delivered() -> None:
    w = _world()
    s = _xid_set(w)
    other = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(1), XID, other)
    nv.inject_xid(0, 48)
    nv.inject_xid(1, 74)  # another GPU: not in this set
    nv.inject_xid(0, 31)
    assert [nv.nvmlEventSetWait(s, 50).eventData for _ in range(2)] == [48, 31]
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlEventSetWait(s, 20)
    assert nv.nvmlEventSetWait(other, 50).eventData == 74


def wait_gpu_lost() -> None:
    w = _world()
    s = _xid_set(w)
    nv.set_gpu_lost(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlEventSetWait(s, 50)


def event_device_is_the_parent() -> None:
    w = _world()
    s = _xid_set(w)
    nv.inject_xid(0, 94, gi_id=_gi_id(w.gi_big), ci_id=0)
    data = nv.nvmlEventSetWait(s, 50)
    assert nv.nvmlDeviceIsMigDeviceHandle(data.device).value == 0
    assert nv.nvmlDeviceGetUUID(data.device) == nv.nvmlDeviceGetUUID(w.parent)
    assert data.eventType == XID


def event_data_is_the_xid() -> None:
    w = _world()
    s = _xid_set(w)
    nv.inject_xid(0, 95)
    assert nv.nvmlEventSetWait(s, 50).eventData == 95


def event_instance_ids() -> None:
    w = _world()
    s = _xid_set(w)
    gi = _gi_id(w.gi_small)
    nv.inject_xid(0, 94, gi_id=gi, ci_id=0)
    nv.inject_xid(0, 48)  # the whole GPU
    mig, whole = nv.nvmlEventSetWait(s, 50), nv.nvmlEventSetWait(s, 50)
    assert (mig.gpuInstanceId, mig.computeInstanceId) == (gi, 0)
    assert (whole.gpuInstanceId, whole.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)


def event_instance_ids_need_mig() -> None:
    w = _world(mig_enabled=False)
    with pytest.raises(KeyError):  # no GPU instance to attribute it to with MIG off
        nv.inject_xid(0, 94, gi_id=1)
    s = _xid_set(w)
    nv.inject_xid(0, 94)
    data = nv.nvmlEventSetWait(s, 50)
    assert (data.gpuInstanceId, data.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)


def supported_event_types() -> None:
    w = _world()
    assert nv.nvmlDeviceGetSupportedEventTypes(w.parent) & XID


def event_set_free() -> None:
    w = _world()
    s = _xid_set(w)
    nv.nvmlEventSetFree(s)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # released: no longer a set (not in nvml.h)
        nv.nvmlEventSetWait(s, 0)


@dataclass(frozen=True)
class Case:
    pynvml_name: str  # the pynvml function the agent calls
    c_function: str  # what pynvml calls in the library; "struct:member" for a structure member
    quote: str  # the documenting sentence, verbatim (whitespace aside)
    check: Callable[[], None]


CASES = [
    Case("nvmlComputeInstanceGetInfo", "struct:nvmlComputeInstanceInfo_st:device", "Parent device",
         ci_info_device_is_the_parent),
    Case("nvmlGpuInstanceGetInfo", "struct:nvmlGpuInstanceInfo_st:device", "Parent device",
         gi_info_device_is_the_parent),
    Case("nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetMigDeviceHandleByIndex",
         "NVML_ERROR_NOT_FOUND if no valid MIG device was found at index",
         mig_handle_by_index_then_not_found),
    Case("nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetMigDeviceHandleByIndex",
         "NVML_ERROR_NOT_FOUND if no valid MIG device was found at index",
         mig_device_enumerated_after_its_create),
    Case("nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetMigDeviceHandleByIndex",
         "NVML_ERROR_NOT_SUPPORTED if this query is not supported by the device",
         mig_handle_not_supported_without_mig),
    Case("nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMaxMigDeviceCount",
         "Returns zero if MIG is not supported or enabled.", max_mig_count_zero_without_mig),
    Case("nvmlDeviceIsMigDeviceHandle", "nvmlDeviceIsMigDeviceHandle",
         "isMigDevice True when handle refers to a MIG device", is_mig_device_handle),
    Case("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
         "Get parent device handle from a MIG device handle.", parent_from_mig_handle),
    Case("nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetGpuInstanceId",
         "Get GPU instance ID for the given MIG device handle.", gi_and_ci_ids_of_mig_handle),
    Case("nvmlDeviceGetComputeInstanceId", "nvmlDeviceGetComputeInstanceId",
         "Get compute instance ID for the given MIG device handle.", gi_and_ci_ids_of_mig_handle),
    Case("nvmlDeviceGetUUID", "nvmlDeviceGetUUID",
         "When used with MIG device handles the API returns globally unique UUIDs which can be used to "
         "identify MIG devices across both GPU and MIG devices.", mig_uuid_is_its_own),
    Case("nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByUUID",
         "NVML_ERROR_GPU_IS_LOST if any GPU has fallen off the bus or is otherwise inaccessible",
         handle_by_uuid_fails_when_any_gpu_is_lost),
    Case("nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByUUID",
         "NVML_ERROR_NOT_FOUND if uuid does not match a valid device on the system",
         handle_by_uuid_not_found_before_the_mig_device_is_enumerated),
    Case("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2",
         "NVML_ERROR_GPU_IS_LOST if the target GPU has fallen off the bus or is otherwise inaccessible",
         handle_by_index_gpu_lost),
    Case("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo",
         "Per-instance information can be queried by using specific MIG device handles.",
         memory_per_instance_on_mig_handle),
    Case("nvmlDeviceGetAttributes", "nvmlDeviceGetAttributes_v2",
         "This API currently only supports MIG device handles.", attributes_only_on_mig_handles),
    Case("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v3",
         "Per-instance information can be queried by using specific MIG device handles.",
         processes_per_instance_on_mig_handle),
    Case("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v3",
         "This function returns information only about compute running processes (e.g. CUDA application "
         "which have active context).", processes_on_a_gpu_with_mig_off),
    Case("nvmlDeviceSetMigMode", "nvmlDeviceSetMigMode",
         "This API may unbind or reset the device to activate the requested mode.",
         set_mig_mode_activates_on_an_idle_hopper),
    Case("nvmlDeviceGetArchitecture", "nvmlDeviceGetArchitecture",
         "Reference where architecture is returned, if call successful.", architecture_of_the_device),
    Case("nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetCudaComputeCapability",
         "Returns the major and minor compute capability version numbers of the device.",
         compute_capability_of_the_device),
    Case("nvmlComputeInstanceDestroy", "nvmlComputeInstanceDestroy",
         "NVML_ERROR_IN_USE If the compute instance is in use. This error would be returned if processes "
         "(e.g. CUDA application) are active on the compute instance.", destroy_ci_in_use),
    Case("nvmlGpuInstanceDestroy", "nvmlGpuInstanceDestroy",
         "NVML_ERROR_IN_USE If the GPU instance is in use. This error would be returned if processes "
         "(e.g. CUDA application) or compute instances are active on the GPU instance.", destroy_gi_in_use),
    Case("nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlDeviceCreateGpuInstanceWithPlacement",
         "NVML_ERROR_INSUFFICIENT_RESOURCES If the requested GPU instance could not be created",
         create_gi_insufficient_resources),
    Case("nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlDeviceCreateGpuInstanceWithPlacement",
         "NVML_ERROR_INVALID_ARGUMENT If device, profile, profileId, placement or gpuInstance are invalid",
         create_gi_invalid_placement),
    Case("nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlDeviceCreateGpuInstanceWithPlacement",
         "NVML_ERROR_NOT_SUPPORTED If device doesn't have MIG mode enabled or in vGPU guest",
         create_gi_not_supported_without_mig),
    Case("nvmlGpuInstanceCreateComputeInstance", "nvmlGpuInstanceCreateComputeInstance",
         "NVML_ERROR_INSUFFICIENT_RESOURCES If the requested compute instance could not be created",
         create_ci_insufficient_resources),
    Case("nvmlDeviceGetGpuInstances", "nvmlDeviceGetGpuInstances",
         "NVML_ERROR_NOT_SUPPORTED If device doesn't have MIG mode enabled",
         list_gis_not_supported_without_mig),
    Case("nvmlGpuInstanceGetComputeInstances", "nvmlGpuInstanceGetComputeInstances",
         "NVML_ERROR_NOT_SUPPORTED If profileId isn't supported", list_cis_unsupported_profile),
    Case("nvmlGpuInstanceGetComputeInstanceProfileInfo", "nvmlGpuInstanceGetComputeInstanceProfileInfo",
         "NVML_ERROR_NOT_SUPPORTED If profile isn't supported", ci_profile_info),
    Case("nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstanceProfileInfoV",
         "NVML_ERROR_NOT_SUPPORTED If device doesn't have MIG mode enabled or profile isn't supported",
         profile_info_needs_mig),
    Case("nvmlDeviceGetGpuInstancePossiblePlacements", "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
         "This API only returns all the possible placements for the given profile regardless of whether MIG "
         "is enabled or not.", placements_regardless_of_mig),
    Case("nvmlDeviceGetMigMode", "nvmlDeviceGetMigMode",
         "currentMode Returns the current mode, NVML_DEVICE_MIG_DISABLE or NVML_DEVICE_MIG_ENABLE",
         mig_mode_current_and_pending),
    Case("nvmlDeviceGetCount", "nvmlDeviceGetCount_v2",
         "NVML_ERROR_UNINITIALIZED if the library has not been successfully initialized", uninitialized),
    Case("nvmlGpuInstanceGetInfo", "nvmlGpuInstanceGetInfo",
         "NVML_ERROR_INVALID_ARGUMENT If gpuInstance or info are invalid", gi_info_stale_handle),
    Case("nvmlDeviceGetName", "nvmlDeviceGetName", "Retrieves the name of this device.", name_uuid_pci_minor),
    Case("nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v3", "Retrieves the PCI attributes of this device.",
         name_uuid_pci_minor),
    Case("nvmlDeviceGetMinorNumber", "nvmlDeviceGetMinorNumber",
         "Retrieves minor number for the device.", name_uuid_pci_minor),
    Case("nvmlShutdown", "nvmlShutdown",
         "Shut down NVML by releasing all GPU resources previously allocated with nvmlInit",
         shutdown_then_uninitialized),
    Case("nvmlInit", "nvmlInit_v2",
         "A reference count of the number of initializations is maintained. Shutdown only occurs when the "
         "reference count reaches zero.", init_is_reference_counted),
    Case("nvmlEventSetCreate", "nvmlEventSetCreate", "Create an empty set of events.", event_set_needs_init),
    Case("nvmlEventSetCreate", "nvmlEventSetCreate",
         "NVML_ERROR_UNINITIALIZED if the library has not been successfully initialized",
         event_set_needs_init),
    Case("nvmlDeviceRegisterEvents", "nvmlDeviceRegisterEvents",
         "All events that occurred before this call are not recorded.", events_before_register_not_recorded),
    Case("nvmlDeviceRegisterEvents", "nvmlDeviceRegisterEvents",
         "If function reports NVML_ERROR_NOT_SUPPORTED, event set can still be used. None of the requested "
         "eventTypes are registered in that case.", register_unsupported_type),
    Case("nvmlDeviceRegisterEvents", "nvmlDeviceRegisterEvents",
         "NVML_ERROR_INVALID_ARGUMENT if eventTypes is invalid or set is NULL", register_invalid_types),
    Case("nvmlDeviceRegisterEvents", "nvmlDeviceRegisterEvents",
         "NVML_ERROR_GPU_IS_LOST if the target GPU has fallen off the bus or is otherwise inaccessible",
         register_on_lost_gpu),
    Case("nvmlDeviceGetSupportedEventTypes", "nvmlDeviceGetSupportedEventTypes",
         "Returns information about events supported on device", supported_event_types),
    Case("nvmlEventSetWait", "nvmlEventSetWait_v2",
         "NVML_ERROR_TIMEOUT if no event arrived in specified timeout or interrupt arrived", wait_times_out),
    Case("nvmlEventSetWait", "nvmlEventSetWait_v2",
         "If some events are ready to be delivered at the time of the call, function returns immediately.",
         wait_returns_at_once_when_ready),
    Case("nvmlEventSetWait", "nvmlEventSetWait_v2",
         "If there are no events ready to be delivered, function sleeps till event arrives but not longer "
         "than specified timeout.", wait_sleeps_till_event),
    Case("nvmlEventSetWait", "nvmlEventSetWait_v2",
         "On Linux, every Xid error event would return the associated event data and other information if "
         "applicable.", every_xid_delivered),
    Case("nvmlEventSetWait", "nvmlEventSetWait_v2",
         "NVML_ERROR_GPU_IS_LOST if a GPU has fallen off the bus or is otherwise inaccessible",
         wait_gpu_lost),
    Case("nvmlEventSetWait", "nvmlEventSetWait_v2",
         "This API does not currently support per-instance event reporting using MIG device handles.",
         event_device_is_the_parent),
    Case("nvmlEventSetWait", "struct:nvmlEventData_st:device", "Specific device where the event occurred",
         event_device_is_the_parent),
    Case("nvmlEventSetWait", "struct:nvmlEventData_st:eventData",
         "Stores Xid error for the device in the event of nvmlEventTypeXidCriticalError,",
         event_data_is_the_xid),
    Case("nvmlEventSetWait", "struct:nvmlEventData_st:gpuInstanceId",
         "If MIG is enabled and nvmlEventTypeXidCriticalError event is attributable to a GPU instance, "
         "stores a valid GPU instance ID. gpuInstanceId is set to 0xFFFFFFFF otherwise.", event_instance_ids),
    Case("nvmlEventSetWait", "struct:nvmlEventData_st:computeInstanceId",
         "If MIG is enabled and nvmlEventTypeXidCriticalError event is attributable to a compute instance, "
         "stores a valid compute instance ID. computeInstanceId is set to 0xFFFFFFFF otherwise.",
         event_instance_ids),
    Case("nvmlEventSetWait", "struct:nvmlEventData_st:gpuInstanceId",
         "If MIG is enabled and nvmlEventTypeXidCriticalError event is attributable to a GPU instance",
         event_instance_ids_need_mig),
    Case("nvmlEventSetFree", "nvmlEventSetFree", "Releases events in the set", event_set_free),
]  # fmt: skip


def _documented(case: Case) -> str:
    if case.c_function.startswith("struct:"):
        _, struct, member = case.c_function.split(":")
        return member_doc(struct, member)
    return doc_block(case.c_function)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.pynvml_name}:{c.check.__name__}")
def test_simulator_does_what_nvml_h_documents(case: Case) -> None:
    doc = _documented(case)
    assert squash(case.quote.replace("\\ref ", "")) in doc.replace("\\ref ", "").replace("\\a ", ""), (
        f"nvml.h does not say {case.quote!r} for {case.c_function}"
    )
    case.check()


def test_a_misquoted_behaviour_is_caught() -> None:
    """The quote check can fail: a sentence nvml.h does not contain for that function is refused."""
    doc = doc_block("nvmlComputeInstanceDestroy")
    assert "Returns the MIG device" not in doc
    assert member_doc("nvmlComputeInstanceInfo_st", "gpuInstance") != "Parent device"


def test_every_nvml_call_of_the_agent_has_a_documented_case() -> None:
    called = set(re.findall(r"\bnv(?:ml)?\.(nvml\w+)\(", AGENT_NVML.read_text()))
    called |= set(re.findall(r"self\.nvml\.(nvml\w+)\(", AGENT_NVML.read_text()))
    covered = {c.pynvml_name for c in CASES}
    assert called, "no NVML call found in the agent's NVML module"
    assert called <= covered, (
        f"NVML functions the agent calls with no nvml.h case: {sorted(called - covered)}"
    )


def test_every_nvml_call_of_the_xid_watcher_has_a_documented_case() -> None:
    called = set(re.findall(r"\bnv\.(nvml\w+)\(", AGENT_HEALTH.read_text()))
    assert {
        "nvmlEventSetCreate",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait",
        "nvmlEventSetFree",
    } <= called
    covered = {c.pynvml_name for c in CASES}
    assert called <= covered, f"NVML calls of the XID watcher with no nvml.h case: {sorted(called - covered)}"
