"""The simulated NVML (``dynamig.backends.simnvml``) driven through the ``pynvml`` calling conventions.

Runs for real: the pynvml structures, constants and exception classes, ctypes out-parameters, the geometry
catalog, the JSON state file with its lock (including a second Python process). Simulated: the GPUs
themselves — there is no driver; the simulated module stands in for the NVML library.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamig.backends import simnvml as nv
from dynamig.backends.nvml import load_nvml
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import check_layout, remaining_capacity
from dynamig.geometry.model import PlacedInstance


@pytest.fixture(autouse=True)
def _fresh_module() -> Iterator[None]:
    nv.reset()
    yield
    nv.reset()


def _placement(start: int, size: int) -> Any:
    pl = pynvml.c_nvmlGpuInstancePlacement_t()
    pl.start, pl.size = start, size
    return pl


def _create(h: Any, profile_id: int, start: int, size: int) -> Any:
    return nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, ctypes.byref(_placement(start, size)))


def _full_ci(gi: Any) -> Any:
    """Create the compute instance that spans ``gi``, found the way NVML clients look it up."""
    gi_info = nv.nvmlGpuInstanceGetInfo(gi)
    h = gi_info.device
    gi_prof = nv.nvmlDeviceGetGpuInstanceProfileInfoById(h, gi_info.profileId)
    for enum in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, enum, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except pynvml.NVMLError_NotSupported:
            continue
        if info.sliceCount == gi_prof.sliceCount:
            return nv.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    raise AssertionError("no full compute-instance profile")


def _mig_handle(ci: Any) -> Any:
    """The MIG device of compute instance ``ci``, found the documented way: walk the parent's MIG device
    indices and match GI and CI ids (``nvmlComputeInstanceGetInfo(ci).device`` is the parent)."""
    info = nv.nvmlComputeInstanceGetInfo(ci)
    parent = info.device
    gi_id = nv.nvmlGpuInstanceGetInfo(info.gpuInstance).id
    for index in range(nv.nvmlDeviceGetMaxMigDeviceCount(parent)):
        try:
            mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
        except pynvml.NVMLError_NotFound:
            continue
        if (nv.nvmlDeviceGetGpuInstanceId(mig), nv.nvmlDeviceGetComputeInstanceId(mig)) == (gi_id, info.id):
            return mig
    raise AssertionError("no MIG device for the compute instance")


def _mig_uuid(ci: Any) -> str:
    uuid: str = nv.nvmlDeviceGetUUID(_mig_handle(ci))
    return uuid


def test_loader_returns_both_modules() -> None:
    assert load_nvml("simulated") is nv
    assert load_nvml("real") is pynvml
    with pytest.raises(ValueError, match="unknown NVML kind"):
        load_nvml("fake")


def test_pynvml_names_are_reexported() -> None:
    names = vars(nv)  # re-exported at import time, so not visible to a type checker
    assert names["NVMLError_InUse"] is pynvml.NVMLError_InUse
    assert names["c_nvmlGpuInstancePlacement_t"] is pynvml.c_nvmlGpuInstancePlacement_t
    assert names["NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2"] == 0x9
    assert names["nvmlStructToFriendlyObject"] is pynvml.nvmlStructToFriendlyObject
    for name in ("nvmlDeviceGetGpuInstancePossiblePlacements", "nvmlDeviceCreateGpuInstanceWithPlacement",
                 "nvmlGpuInstanceDestroy", "nvmlDeviceGetComputeRunningProcesses"):  # fmt: skip
        assert getattr(nv, name) is not getattr(pynvml, name)  # ours, not the C-library wrapper


def test_uninitialised_and_unconfigured_calls_fail_like_nvml() -> None:
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        nv.nvmlInit()
    nv.configure(["A30-24GB"])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 1
    nv.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(KeyError, match="known"):
        nv.configure(["V100-16GB"])


def test_device_identity() -> None:
    nv.configure(["A100-40GB", "H100-80GB"], seed="node-a")
    nv.nvmlInit()
    h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    assert isinstance(h0, pynvml.c_nvmlDevice_t)
    assert nv.nvmlDeviceGetName(h0) == "NVIDIA A100-SXM4-40GB"
    assert nv.nvmlDeviceGetPciInfo(h1).pciDeviceId == 0x233010DE
    uuid = nv.nvmlDeviceGetUUID(h1)
    assert uuid.startswith("GPU-")
    assert nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(uuid)) == 1
    assert nv.nvmlDeviceGetMemoryInfo(h0).total == 40960 * 2**20
    assert nv.nvmlDeviceGetMigMode(h0) == [1, 1]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h0) == 7
    assert nv.nvmlDeviceGetArchitecture(h1) == pynvml.NVML_DEVICE_ARCH_HOPPER
    assert not nv.nvmlDeviceIsMigDeviceHandle(h0).value
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    # Deterministic UUIDs: same seed, same UUID; another node's seed, another UUID.
    nv.configure(["A100-40GB", "H100-80GB"], seed="node-a")
    nv.nvmlInit()
    assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(1)) == uuid
    nv.configure(["A100-40GB", "H100-80GB"], seed="node-b")
    nv.nvmlInit()
    assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(1)) != uuid


def test_profile_info_and_placements_use_the_real_calling_convention() -> None:
    nv.configure(["A100-40GB"])
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2)
    assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
    assert (info.id, info.sliceCount, info.instanceCount, info.memorySizeMB) == (15, 1, 4, 9856)
    assert info.name == "MIG 1g.10gb"  # _PrintableStructure decodes char arrays
    v1 = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE, version=1)
    assert isinstance(v1, pynvml.c_nvmlGpuInstanceProfileInfo_t) and v1.id == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):  # A100 has no 1_SLICE_GFX
        nv.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
    count = ctypes.c_uint(0)
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, None, ctypes.byref(count))
    assert count.value == 4
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, arr, ctypes.byref(count))
    assert [(p.start, p.size) for p in arr] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    too_small = (pynvml.c_nvmlGpuInstancePlacement_t * 2)()
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, too_small, ctypes.byref(count))
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, info.id) == 4


def test_create_at_placement_and_the_rules_nvml_enforces() -> None:
    nv.configure(["A100-40GB"])
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    gi = _create(h, 9, 0, 4)  # 3g.20gb@0
    assert isinstance(gi, pynvml.c_nvmlGpuInstance_t)
    info = nv.nvmlGpuInstanceGetInfo(gi)
    assert (info.profileId, info.placement.start, info.placement.size) == (9, 0, 4)
    assert nv.nvmlDeviceGetIndex(info.device) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create(h, 19, 3, 1)  # 1g@3 overlaps memory slice 3 of 3g@0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create(h, 9, 0, 4)  # occupied placement: not ALREADY_EXISTS
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _create(h, 9, 2, 4)  # 3g may start at 0 or 4 only
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _create(h, 19, 4, 2)  # size does not match the profile
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _create(h, 99, 4, 1)  # no such profile id
    me = _create(h, 20, 4, 1)  # 1g.5gb+me
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create(h, 20, 5, 1)  # one +me instance per GPU
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 2  # 1g@5, 1g@6
    nv.nvmlGpuInstanceDestroy(me)
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 3
    # Auto placement picks a free start.
    auto = nv.nvmlDeviceCreateGpuInstance(h, 14)
    assert nv.nvmlGpuInstanceGetInfo(auto).placement.start == 4
    arr = (pynvml.c_nvmlGpuInstance_t * 3)()
    count = ctypes.c_uint(0)
    nv.nvmlDeviceGetGpuInstances(h, 14, arr, ctypes.byref(count))
    assert count.value == 1
    assert nv.nvmlGpuInstanceGetInfo(arr[0]).placement.start == 4
    assert nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceGetGpuInstanceById(h, info.id)).placement.start == 0


def test_a30_media_profiles_are_mutually_exclusive() -> None:
    nv.configure(["A30-24GB"])
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    _create(h, 21, 0, 1)  # 1g.6gb+me
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create(h, 6, 2, 2)  # 2g.12gb+me


def test_mig_disabled() -> None:
    nv.configure(["H100-80GB"], mig_enabled=False)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetMigMode(h) == [0, 0]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        _create(h, 19, 0, 1)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # the V (version 2) query needs MIG on
        nv.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    # Placements are listed whether or not MIG is enabled.
    count = ctypes.c_uint(0)
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, 19, None, ctypes.byref(count))
    assert count.value == 7
    assert nv.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]
    gi = _create(h, 19, 0, 1)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE)
    nv.nvmlGpuInstanceDestroy(gi)
    nv.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE)
    assert [e.kind for e in nv.history()].count("set-mig-mode") == 2


def test_compute_instances_mig_devices_and_processes() -> None:
    nv.configure(["H100-80GB"])
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    gi = _create(h, 15, 6, 2)  # 1g.20gb@6: size-2 1g, its CI is 1_SLICE_REV1 (ID 7) as on real Hopper
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 0)
    ci = _full_ci(gi)
    assert nv.nvmlComputeInstanceGetInfo(ci).profileId == pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nv.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1)
    parent_of_ci = nv.nvmlComputeInstanceGetInfo(ci).device  # nvml.h: "Parent device"
    assert nv.nvmlDeviceIsMigDeviceHandle(parent_of_ci).value == 0
    assert nv.nvmlDeviceGetUUID(parent_of_ci) == nv.nvmlDeviceGetUUID(h)
    mig = _mig_handle(ci)
    uuid = nv.nvmlDeviceGetUUID(mig)
    assert uuid.startswith("MIG-")
    assert nv.nvmlDeviceIsMigDeviceHandle(mig).value == 1
    assert nv.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 1g.20gb"
    assert nv.nvmlDeviceGetMemoryInfo(mig).total == round(19.62 * 1024) * 2**20
    assert nv.nvmlDeviceGetAttributes(mig).multiprocessorCount == 26
    assert nv.nvmlDeviceGetGpuInstanceId(mig) == nv.nvmlGpuInstanceGetInfo(gi).id
    assert nv.nvmlDeviceGetComputeInstanceId(mig) == 0
    parent = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    assert nv.nvmlDeviceGetUUID(parent) == nv.nvmlDeviceGetUUID(h)
    assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)) == uuid
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 1)
    assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByUUID(uuid)) == uuid
    # Listing CIs the pynvml way.
    arr = (pynvml.c_nvmlComputeInstance_t * 1)()
    count = ctypes.c_uint(0)
    nv.nvmlGpuInstanceGetComputeInstances(gi, 7, arr, ctypes.byref(count))
    assert count.value == 1 and nv.nvmlComputeInstanceGetInfo(arr[0]).id == 0

    assert nv.nvmlDeviceGetComputeRunningProcesses(mig) == []
    nv.attach_process(uuid, 4242, used_memory_mib=100)
    procs = nv.nvmlDeviceGetComputeRunningProcesses(mig)
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, 100 * 2**20)]
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)] == [4242]
    assert nv.nvmlDeviceGetMemoryInfo(mig).used == 100 * 2**20
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlComputeInstanceDestroy(ci)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlGpuInstanceDestroy(gi)
    nv.detach_process(uuid, 4242)
    with pytest.raises(pynvml.NVMLError_InUse):  # a GI with a CI cannot be destroyed
        nv.nvmlGpuInstanceDestroy(gi)
    nv.nvmlComputeInstanceDestroy(ci)
    nv.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # stale handle
        nv.nvmlGpuInstanceGetInfo(gi)
    assert str(pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)) == "In use by another client"


def test_history_records_every_change_in_order() -> None:
    nv.configure(["A100-80GB"])
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    gi = _create(h, 14, 2, 2)
    ci = _full_ci(gi)
    uuid = _mig_uuid(ci)
    nv.attach_process(uuid, 7)
    nv.detach_process(uuid, 7)
    nv.nvmlComputeInstanceDestroy(ci)
    nv.nvmlGpuInstanceDestroy(gi)
    events = nv.history()
    assert [e.kind for e in events] == [
        "create-gi", "create-ci", "attach-process", "detach-process", "destroy-ci", "destroy-gi",
    ]  # fmt: skip
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert all(e.profile == "2g.20gb" and e.start == 2 for e in events if e.kind.endswith(("-gi", "-ci")))
    assert {e.mig_uuid for e in events if e.kind.endswith("-ci")} == {uuid}
    assert events[0].timestamp <= events[-1].timestamp
    # A re-created instance gets a new MIG UUID (the check "nothing allocated was destroyed" relies on it).
    gi2 = _create(h, 14, 2, 2)
    assert _mig_uuid(_full_ci(gi2)) != uuid


def test_lost_gpu() -> None:
    nv.configure(["A100-40GB", "A100-40GB"])
    nv.nvmlInit()
    h1 = nv.nvmlDeviceGetHandleByIndex(1)
    gi = _create(h1, 19, 0, 1)
    nv.set_gpu_lost(1, True)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetUUID(h1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlGpuInstanceGetInfo(gi)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA A100-SXM4-40GB"
    nv.set_gpu_lost(1, False)
    assert nv.nvmlGpuInstanceGetInfo(gi).placement.start == 0


def test_state_file_persists_across_configure_and_init(tmp_path: Path) -> None:
    state = tmp_path / "node" / "nvml.json"
    nv.configure(["A100-40GB"], state_file=state)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    uuid = _mig_uuid(_full_ci(_create(h, 5, 0, 4)))  # 4g.20gb@0
    nv.attach_process(uuid, 99)
    doc = json.loads(state.read_text())
    assert doc["format"] == "dynamig-simnvml/v1" and doc["gpus"][0]["model"] == "A100-40GB"
    assert not list(tmp_path.glob("node/*.tmp"))  # written through a temp file and renamed

    # A restarted agent (new configure, same file) adopts what exists.
    nv.configure(["A100-40GB"], state_file=state)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert nv.nvmlDeviceGetUUID(mig) == uuid
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(mig)] == [99]
    assert [e.kind for e in nv.history()] == ["create-gi", "create-ci", "attach-process"]
    # Attaching with no GPU list takes the file's GPUs; a different list is refused.
    nv.configure(state_file=state)
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 1
    with pytest.raises(ValueError, match="describes GPUs"):
        nv.configure(["H100-80GB"], state_file=state)
    nv.configure(["H100-80GB"], state_file=state, reset=True)
    nv.nvmlInit()
    assert nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA H100 80GB HBM3"
    assert nv.history() == []


_CHILD = textwrap.dedent(
    """
    import ctypes, sys, pynvml
    from dynamig.backends import simnvml as nv
    nv.configure(state_file=sys.argv[1])
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    pl = pynvml.c_nvmlGpuInstancePlacement_t(int(sys.argv[2]), 1)
    try:
        gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, ctypes.byref(pl))
    except pynvml.NVMLError_InsufficientResources:
        print("insufficient")
    else:
        ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)
        print(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)))
    """
)


def _child(state: Path, start: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(state), str(start)], stdout=subprocess.PIPE, text=True
    )


def test_two_processes_share_one_simulated_machine(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    nv.configure(["A100-40GB"], state_file=state)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 7
    # Two processes race for the same placement: exactly one wins, the other sees the overlap.
    children = [_child(state, 3), _child(state, 3)]
    outputs = sorted(c.communicate(timeout=60)[0].strip() for c in children)
    assert all(c.returncode == 0 for c in children)
    assert outputs[1] == "insufficient" and outputs[0].startswith("MIG-")
    # This process sees the other process's instance without re-configuring.
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 6
    assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)) == outputs[0]
    nv.attach_process(outputs[0], 1234)
    assert [e.kind for e in nv.history()] == ["create-gi", "create-ci", "attach-process"]


def test_latency_is_applied(tmp_path: Path) -> None:
    import time

    nv.configure(["A30-24GB"], create_latency_s=0.05, destroy_latency_s=0.05)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    t0 = time.monotonic()
    gi = _create(h, 14, 0, 1)
    nv.nvmlGpuInstanceDestroy(gi)
    assert time.monotonic() - t0 >= 0.1


@pytest.mark.parametrize("key", load_catalog().keys())
def test_every_catalog_model_answers_profile_queries(key: str) -> None:
    model = load_catalog().model(key)
    nv.configure([key])
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    offered = {}
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, enum)
        except pynvml.NVMLError_NotSupported:
            continue
        offered[enum] = info
    assert set(offered) == {p.nvml_enum for p in model.profiles}
    for p in model.profiles:
        info = offered[p.nvml_enum]
        got = (info.id, info.sliceCount, info.instanceCount, info.memorySizeMB, info.multiprocessorCount)
        assert got == (p.profile_id, p.compute_slices, p.max_instances, p.memory_mib, p.multiprocessors)
        # Every profile can be created at every one of its placements on an empty GPU, with a full CI.
        for start in p.placement_starts:
            gi = _create(h, p.profile_id, start, p.placement_size)
            ci = _full_ci(gi)
            assert nv.nvmlDeviceGetAttributes(_mig_handle(ci)).multiprocessorCount == p.multiprocessors
            nv.nvmlComputeInstanceDestroy(ci)
            nv.nvmlGpuInstanceDestroy(gi)


_OPS = st.lists(st.tuples(st.booleans(), st.integers(0, 50), st.integers(0, 11)), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["A100-40GB", "A30-24GB", "RTXPRO6000-96GB"]), _OPS)
def test_random_create_destroy_agrees_with_the_geometry_rules(
    key: str, ops: list[tuple[bool, int, int]]
) -> None:
    """NVML accepts a GI exactly when check_layout accepts the resulting layout, and says why not."""
    model = load_catalog().model(key)
    nv.configure([key])
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    live: list[tuple[Any, PlacedInstance]] = []
    for create, pick, start in ops:
        if create or not live:
            p = model.profiles[pick % len(model.profiles)]
            want = [*(inst for _, inst in live), PlacedInstance(start, p.name)]
            violation = check_layout(model, want)
            try:
                gi = _create(h, p.profile_id, start, p.placement_size)
            except pynvml.NVMLError as exc:
                assert violation is not None, exc
                expected = (
                    pynvml.NVMLError_InvalidArgument
                    if violation.rule in ("disallowed-start", "out-of-range")
                    else pynvml.NVMLError_InsufficientResources
                )
                assert isinstance(exc, expected), (violation, exc)
            else:
                assert violation is None
                live.append((gi, PlacedInstance(start, p.name)))
        else:
            gi, _ = live.pop(pick % len(live))
            nv.nvmlGpuInstanceDestroy(gi)
        for profile in model.profiles:
            assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, profile.profile_id) == remaining_capacity(
                model, [inst for _, inst in live], profile.name
            )


def test_pci_bus_ids_stay_valid_and_distinct_on_large_simulated_nodes() -> None:
    """More GPUs than one PCI domain's buses fit: every GPU still gets a distinct, well-formed bus id."""
    import re

    from dynamig.backends import simnvml

    simnvml.configure(gpus=["H100-80GB"] * 20, state_file=None, reset=True)
    simnvml.nvmlInit()
    try:
        ids = []
        for i in range(20):
            info = simnvml.nvmlDeviceGetPciInfo(simnvml.nvmlDeviceGetHandleByIndex(i))
            bus_id = info.busId.decode() if isinstance(info.busId, bytes) else info.busId
            assert re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:00\.0", bus_id), bus_id
            ids.append(bus_id)
        assert len(set(ids)) == 20
    finally:
        simnvml.nvmlShutdown()
        simnvml.configure(gpus=[], state_file=None, reset=True)
