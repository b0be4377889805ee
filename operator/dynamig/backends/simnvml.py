"""A simulated NVML: a drop-in for the subset of ``pynvml`` (nvidia-ml-py 13.615) that MIG management uses.

The functions below have the names, arguments and return types of their ``pynvml`` namesakes: handles
are real ctypes pointers (``c_nvmlDevice_t``, ``c_nvmlGpuInstance_t``, ``c_nvmlComputeInstance_t``),
structures are ``pynvml``'s own ``c_nvml*`` classes, strings come back as ``str`` as ``pynvml``'s
``convertStrBytes`` wrappers return them, out-parameters follow the ctypes-reference convention
(``nvmlDeviceGetGpuInstancePossiblePlacements(h, id, None, byref(count))`` for the count, then again with
an array), and failures raise
``pynvml``'s ``NVMLError_*`` classes, so ``except pynvml.NVMLError_InUse`` catches the simulated error too.
Every ``pynvml`` constant, structure and exception class is re-exported from this module.

The simulated GPUs obey the rules the real driver enforces (``reference/mig-geometry.md``): a GI is created
only at one of its profile's placements (else ``InvalidArgument``); a placement overlapping occupied memory
slices, a profile over its instance cap, or a second media-engine instance fails with
``InsufficientResources``; MIG calls on a GPU with MIG disabled fail with ``NotSupported``; a CI or GI with
running processes, or a GI that still has CIs, cannot be destroyed (``InUse``); an NVML enum the model does
not offer gives ``NotSupported``. Profile tables come from the geometry catalog.

Parent and MIG device handles are distinct, as nvml.h documents them: ``nvmlComputeInstanceGetInfo`` and
``nvmlGpuInstanceGetInfo`` return the *parent* device in ``device``; a MIG device handle (one per compute
instance) comes only from ``nvmlDeviceGetMigDeviceHandleByIndex`` or ``nvmlDeviceGetHandleByUUID("MIG-...")``
and answers UUID, memory, attributes and processes for that instance alone.
``tests/unit/test_simnvml_fidelity.py`` checks each function the agent calls against the sentence of nvml.h
that documents it.

Event sets and XID critical-error events (``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents``,
``nvmlEventSetWait``, ``nvmlEventSetFree``) follow nvml.h's "Event Handling Methods";
:mod:`dynamig.backends.simevents` holds that machinery and says what it models. MIG mode
(``nvmlDeviceSetMigMode``, ``nvmlDeviceGetMigMode``: pending until the switch, per GPU generation; a GPU
reset a VM does not expose; an idle GPU required) and GPUs with no MIG (e.g. ``L4-24GB``) are
:mod:`dynamig.backends.simmode`'s, re-exported here. NVLink links and the NVLink fabric
(``nvmlDeviceGetNvLinkState``, ``nvmlDeviceGetGpuFabricInfo`` / ``...InfoV``: links per model, the fabric on
Hopper and later NVSwitch systems) are :mod:`dynamig.backends.simfabric`'s. The records of the simulated
machine, their persistence and the handles that name them are :mod:`dynamig.backends.simstate`'s; this
module holds the NVML session and the functions.

Not in ``pynvml`` (simulation control): :func:`configure`, :func:`attach_process`, :func:`detach_process`,
:func:`set_gpu_lost`, :func:`reload_driver`, :func:`set_mig_enumeration_delay`, :func:`inject_xid`,
:func:`reset_gpu`, :func:`set_minor_renumbering`, :func:`set_nvlink_active`, :func:`set_fabric`,
:func:`fail_next`, :func:`clear_failures`, :func:`history`, :func:`snapshot`, :func:`reset`.

State (GPUs, MIG mode, instances, processes, the event history) lives in memory or, with ``state_file``, in a
JSON file shared by every process that configures the same path: each call re-reads the file when it has
changed, and each change runs under an ``fcntl`` lock as read-modify-write, written temp file -> fsync ->
rename. So a node agent and a test see the same GPUs. Being a drop-in for a module, the configuration is
module state (one simulated machine per process).

Simplifications, stated: a MIG mode change is pending until the GPU has switched, ``switch_latency_s`` after
the call (by default 2 s on Ampere, whose switch is a GPU reset the driver performs, at once on Hopper and
later), while the call itself returns at once; GI ids are the lowest free id from 1; a CI is placed at the
first free aligned compute slice.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
import types
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pynvml
from pynvml import (
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNINITIALIZED,
    NVML_GPU_FABRIC_STATE_COMPLETED,
    NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2,
    NVML_GPU_INSTANCE_PROFILE_COUNT,
    NVML_SUCCESS,
    NVMLError,
    c_nvmlComputeInstanceInfo_t,
    c_nvmlComputeInstanceProfileInfo_t,
    c_nvmlComputeInstanceProfileInfo_v2_t,
    c_nvmlDeviceAttributes,
    c_nvmlGpuInstanceInfo_t,
    c_nvmlGpuInstanceProfileInfo_t,
    c_nvmlGpuInstanceProfileInfo_v2_t,
    c_nvmlMemory_t,
    c_nvmlMemory_v2_t,
    c_nvmlProcessInfo_v3_t,
    nvmlPciInfo_t,
    nvmlStructToFriendlyObject,
)

from dynamig.backends import simfabric, simmode
from dynamig.backends import simstate as st
from dynamig.backends.simevents import SUPPORTED_EVENT_TYPES, XidRecord
from dynamig.backends.simmode import DEFAULT_SWITCH_LATENCY_S as DEFAULT_SWITCH_LATENCY_S  # re-exported
from dynamig.backends.simmode import NON_MIG_PRODUCTS as NON_MIG_PRODUCTS
from dynamig.backends.simmode import require_mig as _require_mig
from dynamig.backends.simstate import STATE_FORMAT as STATE_FORMAT  # re-exported
from dynamig.backends.simstate import SimEvent as SimEvent
from dynamig.geometry.layout import (
    RULE_DISALLOWED_START,
    RULE_OUT_OF_RANGE,
    RULE_UNKNOWN_PROFILE,
    check_layout,
    free_starts,
    remaining_capacity,
)
from dynamig.geometry.model import PlacedInstance, Profile

# This very module (or copy of it: backends/nvml.py fresh_simulated_nvml): what simmode acts on.
_THIS = sys.modules[__name__]

# Re-export pynvml's constants, structures and exception classes (not its functions: those would call the
# real library).
for _name, _value in vars(pynvml).items():
    if _name.startswith("_") or _name in globals() or isinstance(_value, types.ModuleType):
        continue
    if isinstance(_value, types.FunctionType) and not _name.startswith("nvmlStructTo"):
        continue
    globals()[_name] = _value
del _name, _value

MIB = 1024 * 1024
DRIVER_VERSION = "580.65.06"
_VENDOR_NVIDIA = 0x10DE
_SUCCESS: int = int(NVML_SUCCESS)

# Compute-instance profile enum -> compute slices (nvml.h NVML_COMPUTE_INSTANCE_PROFILE_*).
_CI_SLICES = {0x0: 1, 0x1: 2, 0x2: 3, 0x3: 4, 0x4: 7, 0x5: 8, 0x6: 6, 0x7: 1, 0x8: 7}
_CI_ENUMS_BY_GI_SLICES = {
    1: (0x0,),
    2: (0x0, 0x1),
    3: (0x0, 0x1, 0x2),
    4: (0x0, 0x1, 0x3),
    7: (0x0, 0x1, 0x2, 0x3, 0x4),
}


# pynvml asks the C library for the text of codes it has no string for; without the library the text would
# be "NVML Error with code 23". Give it the library's wording for the codes the simulation raises.
for _code, _text in (
    (NVML_ERROR_IN_USE, "In use by another client"),
    (NVML_ERROR_INSUFFICIENT_RESOURCES, "Insufficient Resources"),
):
    NVMLError._errcode_to_string.setdefault(_code, _text)
del _code, _text


_SIM: st.Simulator | None = None
_INIT_COUNT = 0
_INIT_EPOCH = 0  # driver epoch this process's NVML session was initialised in
_MODULE_LOCK = threading.RLock()


def _sim() -> st.Simulator:
    if _SIM is None:
        raise st.error(NVML_ERROR_LIBRARY_NOT_FOUND)
    return _SIM


def _initialized() -> st.Simulator:
    sim = _sim()
    if _INIT_COUNT <= 0 or sim.state().driver_epoch != _INIT_EPOCH:
        raise st.error(NVML_ERROR_UNINITIALIZED)
    return sim


# --- simulation control (not in pynvml) ----------------------------------------------------------------


def configure(
    gpus: Sequence[str] = (),
    *,
    state_file: Path | str | None = None,
    create_latency_s: float = 0.0,
    destroy_latency_s: float = 0.0,
    mig_enabled: bool | Sequence[bool] = True,
    vm: bool | Sequence[bool] = False,
    switch_latency_s: float | Sequence[float | None] | None = None,
    seed: str | None = None,
    reset: bool = False,
) -> None:
    """Set up the simulated machine: one GPU per key in ``gpus`` (a catalog key, or a GPU without MIG from
    ``NON_MIG_PRODUCTS``), index order. Side effects.

    With ``state_file``, state is shared through that JSON file: an existing file is adopted (its GPUs must
    match ``gpus``, or ``gpus`` may be empty to attach to whatever it describes); ``reset=True`` starts over.
    ``seed`` makes GPU UUIDs differ between simulated nodes (default: the state file's absolute path, so
    each node's file gives its own UUIDs). The latencies are slept in GI create and GI destroy calls.
    Per GPU (one value, or one per GPU; kept in the state, so an adopted file keeps its own), as
    :mod:`dynamig.backends.simmode` models them: ``mig_enabled`` (MIG mode at start), ``vm`` (GPU reset not
    exposed: a pass-through VM), ``switch_latency_s`` (a MIG mode switch's duration; None: by generation).
    Leaves NVML uninitialised: call ``nvmlInit()`` as with the real library.
    """
    global _SIM, _INIT_COUNT
    path = Path(state_file) if state_file is not None else None
    if path is not None and reset:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    if path is not None and not gpus and not path.exists():
        raise ValueError(f"no GPUs given and no state file at {path} to attach to")
    if seed is None:
        seed = str(path.resolve()) if path is not None else ""
    fields = simmode.gpu_fields(gpus, mig_enabled, vm, switch_latency_s)  # KeyError, ValueError
    with _MODULE_LOCK:
        _SIM = st.Simulator(gpus, path, create_latency_s, destroy_latency_s, fields, seed)
        _INIT_COUNT = 0


def reset() -> None:
    """Forget the configuration (the state file, if any, stays). Side effect on module state."""
    global _SIM, _INIT_COUNT
    with _MODULE_LOCK:
        _SIM = None
        _INIT_COUNT = 0


def _find_mig(state: st.State, mig_uuid: str) -> tuple[st.Gpu, st.GpuInstance, st.ComputeInstance]:
    for gpu in state.gpus:
        for gi in gpu.gpu_instances:
            for ci in gi.compute_instances:
                if ci.uuid == mig_uuid:
                    return gpu, gi, ci
    raise KeyError(f"no simulated MIG device {mig_uuid}")


def _process_owner(state: st.State, uuid_: str) -> tuple[st.Gpu, Any, dict[str, Any]]:
    """(GPU, the record holding the processes, its history fields) of a MIG device or a whole GPU. KeyError
    if no such device."""
    gpu = next((g for g in state.gpus if g.uuid == uuid_), None)
    if gpu is None:
        gpu, gi, ci = _find_mig(state, uuid_)
        return gpu, ci, {"gi_id": gi.id, "ci_id": ci.id, "mig_uuid": uuid_}
    return gpu, gpu, {}


def attach_process(uuid_: str, pid: int, used_memory_mib: int = 256) -> None:
    """Pretend process ``pid`` runs on MIG device ``uuid_``, or on GPU ``uuid_`` with MIG off and no switch
    under way (else ValueError; KeyError if no such device). Side effect: state."""
    sim = _sim()
    with sim.mutate() as state:
        gpu, owner, ids = _process_owner(state, uuid_)
        if owner is gpu and (gpu.mig_current == NVML_DEVICE_MIG_ENABLE or gpu.switch_at):
            raise ValueError(f"GPU {uuid_}: MIG mode is on or switching; processes run on MIG devices")
        if any(p.pid == pid for p in owner.processes):
            return
        owner.processes.append(st.Process(pid, used_memory_mib * MIB))
        sim.record(state, "attach-process", gpu, pid=pid, **ids)


def detach_process(uuid_: str, pid: int) -> None:
    """Pretend process ``pid`` on ``uuid_`` exited (no-op if it was not there). Side effect: state."""
    sim = _sim()
    with sim.mutate() as state:
        gpu, owner, ids = _process_owner(state, uuid_)
        before = len(owner.processes)
        owner.processes = [p for p in owner.processes if p.pid != pid]
        if len(owner.processes) != before:
            sim.record(state, "detach-process", gpu, pid=pid, **ids)


def set_gpu_lost(index: int, lost: bool = True) -> None:
    """Make GPU ``index`` fall off the bus (every call on it raises NVMLError_GpuIsLost) or come back."""
    sim = _sim()
    with sim.mutate() as state:
        gpu = state.gpus[index]
        if gpu.lost != lost:
            gpu.lost = lost
            sim.record(state, "gpu-lost", gpu, value=int(lost))


def reload_driver() -> None:
    """Unload and reload the simulated kernel driver: every process's NVML session (and every handle it
    holds) becomes stale, and its calls fail with ``Uninitialized`` until it calls ``nvmlInit`` again.
    MIG mode and instances are kept. Side effect: state.

    Assumption, stated: nvml.h does not document what a session sees after a reload; dynamig's agent
    re-initialises on ``Uninitialized``, ``DriverNotLoaded``, ``LibraryNotFound`` and ``Unknown`` alike.
    """
    sim = _sim()
    with sim.mutate() as state:
        state.driver_epoch += 1
        for gpu in state.gpus:
            sim.record(state, "driver-reload", gpu, value=state.driver_epoch)


def set_mig_enumeration_delay(seconds: float) -> None:
    """Compute instances created from now on get their MIG device enumerated ``seconds`` after the create:
    until then ``nvmlDeviceGetMigDeviceHandleByIndex`` answers NOT_FOUND at its index (nvml.h: "if no valid
    MIG device was found at index") and ``nvmlDeviceGetHandleByUUID`` NOT_FOUND for its UUID, while the GI
    and CI themselves are listed. Models a MIG device the driver has not set up yet right after the create.
    The delay is this process's setting; the time it ends is kept in the state. Side effect: module state.
    """
    _sim().mig_enumeration_delay_s = max(0.0, float(seconds))


def inject_xid(index: int, xid: int, *, gi_id: int | None = None, ci_id: int | None = None) -> int:
    """Make the simulated driver report XID ``xid`` on GPU ``index``: the whole GPU, or the GPU instance
    ``gi_id`` (and compute instance ``ci_id``) when MIG is enabled, which must exist (KeyError if not). Sets
    waiting on the GPU receive it (:mod:`dynamig.backends.simevents`). Returns its history sequence number.
    Side effect: state."""
    sim = _sim()
    if ci_id is not None and gi_id is None:
        raise ValueError("a compute instance id needs its GPU instance id")
    with sim.mutate() as state:
        gpu = state.gpus[index]
        if gi_id is not None:
            gi = st.find_gi(gpu, gi_id) if gpu.mig_current == NVML_DEVICE_MIG_ENABLE else None
            if gi is None or (ci_id is not None and st.find_ci(gi, ci_id) is None):
                raise KeyError(f"GPU {index} has no MIG instance GI {gi_id} / CI {ci_id}")
        sim.record(state, "xid", gpu, gi_id=gi_id, ci_id=ci_id, value=int(xid))
        return state.serial


def _xids() -> list[XidRecord]:
    return [
        XidRecord(e.seq, e.gpu_index, int(e.value or 0), e.gi_id, e.ci_id)
        for e in _sim().state().history
        if e.kind == "xid"
    ]


def fail_next(function: str, code: int, *, times: int = 1, **match: Any) -> None:
    """The next ``times`` calls of ``function`` (a pynvml name this module serves; only those that check
    :func:`_injected`) whose keyword arguments include ``match`` raise NVML error ``code`` instead (e.g. a
    transient ``NVML_ERROR_UNKNOWN`` on one profile enum). In this process only. Side effect: module state.
    """
    _sim().failures.append(st.Failure(function, code, times, dict(match)))


def clear_failures() -> None:
    """Forget every error :func:`fail_next` set up and not yet raised. Side effect: module state."""
    _sim().failures = []


def _injected(function: str, **args: Any) -> None:
    """Raise the error :func:`fail_next` set up for this call, if any."""
    sim = _SIM
    if sim is None or not sim.failures:
        return
    for f in sim.failures:
        if f.function == function and f.remaining > 0 and all(args.get(k) == v for k, v in f.match.items()):
            f.remaining -= 1
            sim.failures = [x for x in sim.failures if x.remaining > 0]
            raise st.error(f.code)


def _enumerated(ci: st.ComputeInstance) -> bool:
    return ci.enumerable_at <= time.time()


def history() -> list[SimEvent]:
    """Every create/destroy/attach/detach/mode event so far, oldest first (a copy). Reads state."""
    return list(_sim().state().history)


def snapshot() -> dict[str, Any]:
    """The whole simulated state as JSON-shaped data (for tests and debugging). Reads state."""
    return _sim().state().to_json()


# --- handles -------------------------------------------------------------------------------------------


def _read(handle: Any, *kinds: int) -> st.Resolved:
    return st.resolve(_initialized().state(), handle, *kinds)


# --- library and device queries ------------------------------------------------------------------------


def nvmlInit() -> None:
    global _INIT_COUNT, _INIT_EPOCH
    sim = _sim()
    epoch = sim.state().driver_epoch  # re-read the shared state file now
    with _MODULE_LOCK:
        if epoch != _INIT_EPOCH:  # a session from before a driver reload does not survive it
            _INIT_COUNT, _INIT_EPOCH = 0, epoch
        _INIT_COUNT += 1


def nvmlInitWithFlags(flags: int) -> None:
    nvmlInit()


def nvmlShutdown() -> None:
    global _INIT_COUNT
    sim = _sim()
    if _INIT_COUNT <= 0:
        raise st.error(NVML_ERROR_UNINITIALIZED)
    with _MODULE_LOCK:
        if sim.state().driver_epoch != _INIT_EPOCH:
            _INIT_COUNT = 0
            return
        _INIT_COUNT = max(0, _INIT_COUNT - 1)


def nvmlSystemGetDriverVersion() -> str:
    _initialized()
    return DRIVER_VERSION


def nvmlDeviceGetCount() -> int:
    return len(_initialized().state().gpus)


def nvmlDeviceGetHandleByIndex(index: int) -> Any:
    st.gpu_of(_initialized().state(), index)
    return st.gpu_handle(index)


def nvmlDeviceGetHandleByUUID(uuid_: str | bytes) -> Any:
    text = uuid_.decode() if isinstance(uuid_, bytes) else str(uuid_)
    state = _initialized().state()
    if any(g.lost for g in state.gpus):
        raise st.error(NVML_ERROR_GPU_IS_LOST)  # nvml.h: "if any GPU has fallen off the bus"
    for gpu in state.gpus:
        if gpu.uuid == text:
            return st.gpu_handle(st.gpu_of(state, gpu.index).index)
        for gi in gpu.gpu_instances:
            for ci in gi.compute_instances:
                if ci.uuid == text and _enumerated(ci):
                    st.gpu_of(state, gpu.index)
                    return st.mig_handle(gpu.index, gi.id, ci.id)
    raise st.error(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetIndex(handle: Any) -> int:
    return _read(handle, st.KIND_GPU).gpu.index


def nvmlDeviceGetMinorNumber(handle: Any) -> int:
    gpu = _read(handle, st.KIND_GPU).gpu
    return gpu.index if gpu.minor is None else gpu.minor


def nvmlDeviceGetName(handle: Any) -> str:
    r = _read(handle, st.KIND_GPU, st.KIND_MIG)
    if r.gi is None:
        return r.model.product_name
    return f"{r.model.product_name} MIG {r.model.profile_by_id(r.gi.profile_id).name}"


def nvmlDeviceGetUUID(handle: Any) -> str:
    r = _read(handle, st.KIND_GPU, st.KIND_MIG)
    return r.gpu.uuid if r.ci is None else r.ci.uuid


def nvmlDeviceGetSerial(handle: Any) -> str:
    r = _read(handle, st.KIND_GPU)
    return f"{1320000000000 + r.gpu.index}"


def nvmlDeviceGetPciInfo(handle: Any) -> Any:
    r = _read(handle, st.KIND_GPU)
    info = nvmlPciInfo_t()
    # Eight-GPU boards spread over buses 0x17..0xE7; larger simulated nodes continue in further PCI domains.
    domain, slot = divmod(r.gpu.index, 14)
    bus = 0x17 + 0x10 * slot
    info.domain = domain
    info.bus = bus
    info.device = 0
    info.pciDeviceId = (r.model.pci_device_ids[0] << 16) | _VENDOR_NVIDIA
    info.pciSubSystemId = (0x1450 << 16) | _VENDOR_NVIDIA
    bus_id = f"{domain:08X}:{bus:02X}:00.0".encode()
    info.busId = bus_id
    info.busIdLegacy = bus_id
    return info


nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo


def nvmlDeviceGetArchitecture(handle: Any) -> int:
    return simmode.architecture(_read(handle, st.KIND_GPU).model)[0]


def nvmlDeviceGetCudaComputeCapability(handle: Any) -> tuple[int, int]:
    return simmode.architecture(_read(handle, st.KIND_GPU, st.KIND_MIG).model)[1]


def _used_bytes(gpu: st.Gpu, gi: st.GpuInstance | None = None) -> int:
    gis = [gi] if gi is not None else gpu.gpu_instances
    whole = sum(p.used_bytes for p in gpu.processes) if gi is None else 0
    return whole + sum(p.used_bytes for g in gis for c in g.compute_instances for p in c.processes)


def nvmlDeviceGetMemoryInfo(handle: Any, version: int | None = None) -> Any:
    r = _read(handle, st.KIND_GPU, st.KIND_MIG)
    if r.gi is None:
        total, used = r.model.memory_mib * MIB, _used_bytes(r.gpu)
    else:
        total, used = r.model.profile_by_id(r.gi.profile_id).memory_mib * MIB, _used_bytes(r.gpu, r.gi)
    mem = c_nvmlMemory_v2_t() if version else c_nvmlMemory_t()
    if version:
        mem.version = version
    mem.total, mem.used, mem.free = total, used, max(0, total - used)
    return mem


def nvmlDeviceGetAttributes(handle: Any) -> Any:
    r = _read(handle, st.KIND_GPU, st.KIND_MIG)
    if r.gi is None or r.ci is None:
        raise st.error(NVML_ERROR_NOT_SUPPORTED)  # nvml.h: "currently only supports MIG device handles"
    attrs = c_nvmlDeviceAttributes()
    p = r.model.profile_by_id(r.gi.profile_id)
    gi_slices, ci_slices = p.compute_slices, _CI_SLICES[r.ci.profile_id]
    sms = p.multiprocessors * ci_slices // p.compute_slices
    mem = p.memory_mib
    attrs.multiprocessorCount = sms
    attrs.sharedCopyEngineCount = p.copy_engines
    attrs.sharedDecoderCount = p.decoders
    attrs.sharedEncoderCount = p.encoders
    attrs.sharedJpegCount = p.jpegs
    attrs.sharedOfaCount = p.ofas
    attrs.gpuInstanceSliceCount = gi_slices
    attrs.computeInstanceSliceCount = ci_slices
    attrs.memorySizeMB = mem
    return attrs


nvmlDeviceGetAttributes_v2 = nvmlDeviceGetAttributes


def nvmlDeviceGetMigMode(device: Any) -> list[int]:
    return simmode.get_mig_mode(_THIS, device)


def nvmlDeviceSetMigMode(device: Any, mode: int) -> int:
    return simmode.set_mig_mode(_THIS, device, mode)


def reset_gpu(index: int) -> None:
    """Reset GPU ``index`` as a pass-through VM's reboot does (:func:`dynamig.backends.simmode.reset_gpu`)."""
    simmode.reset_gpu(_THIS, index)


def set_minor_renumbering(enabled: bool = True) -> None:
    """MIG mode switches give the GPU a new minor (:func:`dynamig.backends.simmode.set_minor_renumbering`)."""
    simmode.set_minor_renumbering(_THIS, enabled)


def nvmlDeviceGetNvLinkState(device: Any, link: int) -> int:
    return simfabric.nvlink_state(_THIS, device, link)


def nvmlDeviceGetGpuFabricInfo(device: Any, gpuFabricInfo: Any) -> int:
    return simfabric.fabric_info(_THIS, device, gpuFabricInfo)


def nvmlDeviceGetGpuFabricInfoV(device: Any, gpuFabricInfo: Any) -> int:
    return simfabric.fabric_info(_THIS, device, gpuFabricInfo, versioned=True)


def set_nvlink_active(index: int, link: int, active: bool = True) -> None:
    """Take an NVLink link down or up (:func:`dynamig.backends.simfabric.set_nvlink_active`)."""
    simfabric.set_nvlink_active(_THIS, index, link, active)


def set_fabric(
    index: int,
    *,
    state: int = NVML_GPU_FABRIC_STATE_COMPLETED,
    status: int = _SUCCESS,
    cluster_uuid: str | None = None,
    clique_id: int = simfabric.DEFAULT_CLIQUE_ID,
) -> None:
    """What the fabric query answers for GPU ``index`` (:func:`dynamig.backends.simfabric.set_fabric`)."""
    simfabric.set_fabric(
        _THIS, index, state=state, status=status, cluster_uuid=cluster_uuid, clique_id=clique_id
    )


def nvmlDeviceIsMigDeviceHandle(device: Any) -> Any:
    kind = st.decode(device)[0]
    _read(device, st.KIND_GPU, st.KIND_MIG)
    return ctypes.c_uint(1 if kind == st.KIND_MIG else 0)  # pynvml returns the c_uint itself


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: Any) -> Any:
    return st.gpu_handle(_read(migDevice, st.KIND_MIG).gpu.index)


def nvmlDeviceGetGpuInstanceId(device: Any) -> int:
    r = _read(device, st.KIND_GPU, st.KIND_MIG)
    if r.gi is None:
        raise st.error(NVML_ERROR_INVALID_ARGUMENT)
    return r.gi.id


def nvmlDeviceGetComputeInstanceId(device: Any) -> int:
    r = _read(device, st.KIND_GPU, st.KIND_MIG)
    if r.ci is None:
        raise st.error(NVML_ERROR_INVALID_ARGUMENT)
    return r.ci.id


def nvmlDeviceGetMaxMigDeviceCount(device: Any) -> int:
    r = _read(device, st.KIND_GPU)
    if r.gpu.mig_current != NVML_DEVICE_MIG_ENABLE:
        return 0  # nvml.h: "Returns zero if MIG is not supported or enabled."
    return r.model.compute_slices


def _mig_devices(gpu: st.Gpu) -> list[tuple[st.GpuInstance, st.ComputeInstance]]:
    return [
        (gi, ci)
        for gi in sorted(gpu.gpu_instances, key=lambda g: g.id)
        for ci in sorted(gi.compute_instances, key=lambda c: c.id)
    ]


def nvmlDeviceGetMigDeviceHandleByIndex(device: Any, index: int) -> Any:
    r = _read(device, st.KIND_GPU)
    _require_mig(r.gpu)
    if index < 0 or index >= r.model.compute_slices:
        raise st.error(NVML_ERROR_INVALID_ARGUMENT)
    devices = _mig_devices(r.gpu)
    if index >= len(devices) or not _enumerated(devices[index][1]):
        raise st.error(NVML_ERROR_NOT_FOUND)  # nvml.h: "if no valid MIG device was found at index"
    gi, ci = devices[index]
    return st.mig_handle(r.gpu.index, gi.id, ci.id)


def nvmlDeviceGetComputeRunningProcesses(handle: Any) -> list[Any]:
    r = _read(handle, st.KIND_GPU, st.KIND_MIG)
    if r.ci is not None:
        assert r.gi is not None
        owners = [(r.gi, r.ci)]
    else:
        owners = _mig_devices(r.gpu)
    out = []
    whole = [(p, 0xFFFFFFFF, 0xFFFFFFFF) for p in (r.gpu.processes if r.ci is None else [])]
    for p, gi_id, ci_id in whole + [(p, gi.id, ci.id) for gi, ci in owners for p in ci.processes]:
        info = c_nvmlProcessInfo_v3_t()
        info.pid, info.usedGpuMemory = p.pid, p.used_bytes
        info.gpuInstanceId, info.computeInstanceId = gi_id, ci_id  # nvml.h: 0xFFFFFFFF without MIG
        out.append(nvmlStructToFriendlyObject(info))
    return out


nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses


# --- GPU instances -------------------------------------------------------------------------------------


def _fill_gi_profile_info(info: Any, p: Profile, *, with_name: bool) -> Any:
    info.id = p.profile_id
    info.isP2pSupported = 0
    info.sliceCount = p.compute_slices
    info.instanceCount = p.max_instances
    info.multiprocessorCount = p.multiprocessors
    info.copyEngineCount = p.copy_engines
    info.decoderCount = p.decoders
    info.encoderCount = p.encoders
    info.jpegCount = p.jpegs
    info.ofaCount = p.ofas
    info.memorySizeMB = p.memory_mib
    if with_name:
        info.name = f"MIG {p.name}".encode()
    return info


def nvmlDeviceGetGpuInstanceProfileInfo(device: Any, profile: int, version: int = 2) -> Any:
    """By NVML enum. Version 2 (``...InfoV``) needs MIG enabled, as on the real driver."""
    r = _read(device, st.KIND_GPU)
    _injected("nvmlDeviceGetGpuInstanceProfileInfo", profile=profile)
    if version not in (1, 2):
        raise st.error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    if not 0 <= profile < NVML_GPU_INSTANCE_PROFILE_COUNT:
        raise st.error(NVML_ERROR_INVALID_ARGUMENT)
    if version == 2:
        _require_mig(r.gpu)
    try:
        p = r.model.profile_by_enum(profile)
    except KeyError:
        raise st.error(NVML_ERROR_NOT_SUPPORTED) from None
    if version == 2:
        return _fill_gi_profile_info(c_nvmlGpuInstanceProfileInfo_v2_t(), p, with_name=True)
    return _fill_gi_profile_info(c_nvmlGpuInstanceProfileInfo_t(), p, with_name=False)


nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo


def nvmlDeviceGetGpuInstanceProfileInfoById(device: Any, profileId: int) -> Any:
    r = _read(device, st.KIND_GPU)
    _require_mig(r.gpu)
    p = st.profile_by_id(r.model, profileId)
    return _fill_gi_profile_info(c_nvmlGpuInstanceProfileInfo_v2_t(), p, with_name=True)


nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById


def nvmlDeviceGetGpuInstancePossiblePlacements(
    device: Any,
    profileId: int,
    placementsRef: Any,
    countRef: Any,
) -> int:
    """All placements of the profile, whether or not MIG is enabled or they are free (nvml.h ``_v2``)."""
    _injected("nvmlDeviceGetGpuInstancePossiblePlacements", profileId=profileId)
    r = _read(device, st.KIND_GPU)
    if not simmode.mig_capable(r.model):
        raise st.error(NVML_ERROR_NOT_SUPPORTED)  # nvml.h: "If device doesn't support MIG"
    p = st.profile_by_id(r.model, profileId)
    count = st.deref(countRef)
    if placementsRef is None:
        count.value = len(p.placement_starts)
        return _SUCCESS
    target, capacity = st.capacity(placementsRef)  # count is output only (nvml.h _v2)
    if capacity < len(p.placement_starts):
        count.value = len(p.placement_starts)
        raise st.error(NVML_ERROR_INSUFFICIENT_SIZE)
    for i, start in enumerate(p.placement_starts):
        target[i].start = start
        target[i].size = p.placement_size
    count.value = len(p.placement_starts)
    return _SUCCESS


def nvmlDeviceGetGpuInstanceRemainingCapacity(device: Any, profileId: int) -> int:
    r = _read(device, st.KIND_GPU)
    _require_mig(r.gpu)
    p = st.profile_by_id(r.model, profileId)
    return remaining_capacity(r.model, st.layout(r.model, r.gpu), p.name)


def _create_gi(device: Any, profile_id: int, start: int | None, size: int | None) -> Any:
    sim = _initialized()
    if sim.create_latency_s > 0:
        time.sleep(sim.create_latency_s)
    with sim.mutate() as state:
        r = st.resolve(state, device, st.KIND_GPU)
        _require_mig(r.gpu)
        p = st.profile_by_id(r.model, profile_id)
        layout = st.layout(r.model, r.gpu)
        if start is None:
            starts = free_starts(r.model, layout, p.name)
            if not starts:
                raise st.error(NVML_ERROR_INSUFFICIENT_RESOURCES)
            start = starts[0]
        elif size != p.placement_size:
            raise st.error(NVML_ERROR_INVALID_ARGUMENT)
        violation = check_layout(r.model, [*layout, PlacedInstance(start, p.name)])
        if violation is not None:
            if violation.rule in (RULE_UNKNOWN_PROFILE, RULE_OUT_OF_RANGE, RULE_DISALLOWED_START):
                raise st.error(NVML_ERROR_INVALID_ARGUMENT)
            raise st.error(NVML_ERROR_INSUFFICIENT_RESOURCES)  # overlap, instance cap, media engines
        used = {g.id for g in r.gpu.gpu_instances}
        gi_id = next(i for i in range(1, 4096) if i not in used)
        r.gpu.gpu_instances.append(st.GpuInstance(gi_id, p.profile_id, start, p.placement_size))
        sim.record(
            state, "create-gi", r.gpu,
            gi_id=gi_id, profile=p.name, profile_id=p.profile_id, start=start, size=p.placement_size,
        )  # fmt: skip
        return st.gi_handle(r.gpu.index, gi_id)


def nvmlDeviceCreateGpuInstanceWithPlacement(device: Any, profileId: int, placement: Any) -> Any:
    _injected("nvmlDeviceCreateGpuInstanceWithPlacement", profileId=profileId)
    pl = st.deref(placement)
    return _create_gi(device, profileId, int(pl.start), int(pl.size))


def nvmlDeviceCreateGpuInstance(device: Any, profileId: int) -> Any:
    return _create_gi(device, profileId, None, None)


def nvmlDeviceGetGpuInstances(device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any) -> int:
    r = _read(device, st.KIND_GPU)
    _require_mig(r.gpu)
    st.profile_by_id(r.model, profileId)
    count = st.deref(countRef)
    target, capacity = st.capacity(gpuInstancesRef)
    found = sorted((g for g in r.gpu.gpu_instances if g.profile_id == profileId), key=lambda g: g.id)
    if len(found) > capacity:
        count.value = len(found)
        raise st.error(NVML_ERROR_INSUFFICIENT_SIZE)
    for i, gi in enumerate(found):
        target[i] = st.gi_handle(r.gpu.index, gi.id)
    count.value = len(found)
    return _SUCCESS


def nvmlDeviceGetGpuInstanceById(device: Any, gpuInstanceId: int) -> Any:
    r = _read(device, st.KIND_GPU)
    _require_mig(r.gpu)
    if st.find_gi(r.gpu, gpuInstanceId) is None:
        raise st.error(NVML_ERROR_NOT_FOUND)
    return st.gi_handle(r.gpu.index, gpuInstanceId)


def nvmlGpuInstanceGetInfo(gpuInstance: Any) -> Any:
    r = _read(gpuInstance, st.KIND_GI)
    assert r.gi is not None
    info = c_nvmlGpuInstanceInfo_t()
    info.device = st.gpu_handle(r.gpu.index)
    info.id = r.gi.id
    info.profileId = r.gi.profile_id
    info.placement.start = r.gi.start
    info.placement.size = r.gi.size
    return info


def nvmlGpuInstanceDestroy(gpuInstance: Any) -> int:
    sim = _initialized()
    if sim.destroy_latency_s > 0:
        time.sleep(sim.destroy_latency_s)
    with sim.mutate() as state:
        r = st.resolve(state, gpuInstance, st.KIND_GI)
        assert r.gi is not None
        if r.gi.compute_instances:
            raise st.error(NVML_ERROR_IN_USE)  # CIs (and so any processes) still on it
        r.gpu.gpu_instances.remove(r.gi)
        p = r.model.profile_by_id(r.gi.profile_id)
        sim.record(
            state, "destroy-gi", r.gpu,
            gi_id=r.gi.id, profile=p.name, profile_id=p.profile_id, start=r.gi.start, size=r.gi.size,
        )  # fmt: skip
    return _SUCCESS


# --- compute instances ---------------------------------------------------------------------------------


def _ci_enums(gi_profile: Profile) -> tuple[int, ...]:
    """Compute-instance profiles a GI of this profile offers (the size-2 1g GIs use 1_SLICE_REV1)."""
    if gi_profile.nvml_enum == NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2:
        return (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1,)
    return _CI_ENUMS_BY_GI_SLICES.get(gi_profile.compute_slices, (0x0,))


def _ci_profile_info(gi_profile: Profile, enum: int, version: int) -> Any:
    slices = _CI_SLICES[enum]
    info = c_nvmlComputeInstanceProfileInfo_v2_t() if version == 2 else c_nvmlComputeInstanceProfileInfo_t()
    info.id = enum  # CI profile ids equal the enum values on every driver seen
    info.sliceCount = slices
    info.instanceCount = gi_profile.compute_slices // slices
    info.multiprocessorCount = gi_profile.multiprocessors * slices // gi_profile.compute_slices
    info.sharedCopyEngineCount = gi_profile.copy_engines
    info.sharedDecoderCount = gi_profile.decoders
    info.sharedEncoderCount = gi_profile.encoders
    info.sharedJpegCount = gi_profile.jpegs
    info.sharedOfaCount = gi_profile.ofas
    if version == 2:
        full = slices == gi_profile.compute_slices
        info.name = (f"MIG {gi_profile.name}" if full else f"MIG {slices}c.{gi_profile.name}").encode()
    return info


def nvmlGpuInstanceGetComputeInstanceProfileInfo(
    device: Any,
    profile: int,
    engProfile: int,
    version: int = 2,
) -> Any:
    r = _read(device, st.KIND_GI)
    assert r.gi is not None
    if version not in (1, 2):
        raise st.error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    if not 0 <= profile < NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
        raise st.error(NVML_ERROR_INVALID_ARGUMENT)
    if engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
        raise st.error(NVML_ERROR_NOT_SUPPORTED)
    gi_profile = r.model.profile_by_id(r.gi.profile_id)
    if profile not in _ci_enums(gi_profile):
        raise st.error(NVML_ERROR_NOT_SUPPORTED)
    return _ci_profile_info(gi_profile, profile, version)


nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo


def _ci_free_starts(gi_profile: Profile, gi: st.GpuInstance, slices: int) -> list[int]:
    taken = 0
    for ci in gi.compute_instances:
        taken |= ((1 << ci.size) - 1) << ci.start
    out = []
    for start in range(0, gi_profile.compute_slices - slices + 1, slices):
        if not taken & (((1 << slices) - 1) << start):
            out.append(start)
    return out


def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gpuInstance: Any, profileId: int) -> int:
    r = _read(gpuInstance, st.KIND_GI)
    assert r.gi is not None
    gi_profile = r.model.profile_by_id(r.gi.profile_id)
    if profileId not in _ci_enums(gi_profile):
        raise st.error(NVML_ERROR_INVALID_ARGUMENT)
    return len(_ci_free_starts(gi_profile, r.gi, _CI_SLICES[profileId]))


def nvmlGpuInstanceCreateComputeInstance(gpuInstance: Any, profileId: int) -> Any:
    sim = _initialized()
    with sim.mutate() as state:
        r = st.resolve(state, gpuInstance, st.KIND_GI)
        gi = r.gi
        assert gi is not None
        gi_profile = r.model.profile_by_id(gi.profile_id)
        if profileId not in _ci_enums(gi_profile):
            raise st.error(NVML_ERROR_INVALID_ARGUMENT)
        slices = _CI_SLICES[profileId]
        starts = _ci_free_starts(gi_profile, gi, slices)
        if not starts:
            raise st.error(NVML_ERROR_INSUFFICIENT_RESOURCES)
        used = {c.id for c in gi.compute_instances}
        ci_id = next(i for i in range(4096) if i not in used)
        mig_uuid = "MIG-" + str(uuid.uuid5(st.NAMESPACE, f"{r.gpu.uuid}/mig/{state.serial + 1}"))
        delay = _sim().mig_enumeration_delay_s
        ready_at = time.time() + delay if delay > 0 else 0.0
        gi.compute_instances.append(
            st.ComputeInstance(ci_id, profileId, starts[0], slices, mig_uuid, enumerable_at=ready_at)
        )
        sim.record(
            state, "create-ci", r.gpu,
            gi_id=gi.id, ci_id=ci_id, profile=gi_profile.name, profile_id=gi_profile.profile_id,
            start=gi.start, size=gi.size, mig_uuid=mig_uuid,
        )  # fmt: skip
        return st.ci_handle(r.gpu.index, gi.id, ci_id)


def nvmlGpuInstanceGetComputeInstances(
    gpuInstance: Any,
    profileId: int,
    computeInstancesRef: Any,
    countRef: Any,
) -> int:
    r = _read(gpuInstance, st.KIND_GI)
    gi = r.gi
    assert gi is not None
    if profileId not in _ci_enums(r.model.profile_by_id(gi.profile_id)):
        raise st.error(NVML_ERROR_INVALID_ARGUMENT)
    count = st.deref(countRef)
    target, capacity = st.capacity(computeInstancesRef)
    found = sorted((c for c in gi.compute_instances if c.profile_id == profileId), key=lambda c: c.id)
    if len(found) > capacity:
        count.value = len(found)
        raise st.error(NVML_ERROR_INSUFFICIENT_SIZE)
    for i, ci in enumerate(found):
        target[i] = st.ci_handle(r.gpu.index, gi.id, ci.id)
    count.value = len(found)
    return _SUCCESS


def nvmlGpuInstanceGetComputeInstanceById(gpuInstance: Any, computeInstanceId: int) -> Any:
    r = _read(gpuInstance, st.KIND_GI)
    assert r.gi is not None
    if st.find_ci(r.gi, computeInstanceId) is None:
        raise st.error(NVML_ERROR_NOT_FOUND)
    return st.ci_handle(r.gpu.index, r.gi.id, computeInstanceId)


def nvmlComputeInstanceGetInfo(computeInstance: Any) -> Any:
    r = _read(computeInstance, st.KIND_CI)
    assert r.gi is not None and r.ci is not None
    info = c_nvmlComputeInstanceInfo_t()
    info.device = st.gpu_handle(r.gpu.index)  # nvml.h: "Parent device", not the MIG device
    info.gpuInstance = st.gi_handle(r.gpu.index, r.gi.id)
    info.id = r.ci.id
    info.profileId = r.ci.profile_id
    info.placement.start = r.ci.start
    info.placement.size = r.ci.size
    return info


nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo


def nvmlComputeInstanceDestroy(computeInstance: Any) -> int:
    sim = _initialized()
    with sim.mutate() as state:
        r = st.resolve(state, computeInstance, st.KIND_CI)
        gi, ci = r.gi, r.ci
        assert gi is not None and ci is not None
        if ci.processes:
            raise st.error(NVML_ERROR_IN_USE)
        gi.compute_instances.remove(ci)
        p = r.model.profile_by_id(gi.profile_id)
        sim.record(
            state, "destroy-ci", r.gpu,
            gi_id=gi.id, ci_id=ci.id, profile=p.name, profile_id=p.profile_id,
            start=gi.start, size=gi.size, mig_uuid=ci.uuid,
        )  # fmt: skip
    return _SUCCESS


# --- events (nvml.h "Event Handling Methods"; dynamig.backends.simevents) -------------------------------


def nvmlEventSetCreate() -> Any:
    return _initialized().events.create()


def nvmlDeviceGetSupportedEventTypes(handle: Any) -> int:
    _read(handle, st.KIND_GPU)
    return SUPPORTED_EVENT_TYPES


def nvmlDeviceRegisterEvents(handle: Any, eventTypes: int, eventSet: Any) -> None:
    sim = _initialized()
    r = st.resolve(sim.state(), handle, st.KIND_GPU)
    sim.events.register(eventSet, r.gpu.index, int(eventTypes), sim.state().serial)


def nvmlEventSetWait_v2(eventSet: Any, timeoutms: int) -> Any:
    sim = _initialized()

    def lost(index: int) -> bool:
        gpus = sim.state().gpus
        return 0 <= index < len(gpus) and gpus[index].lost

    return sim.events.wait(eventSet, timeoutms, _xids, lost, st.gpu_handle)


nvmlEventSetWait = nvmlEventSetWait_v2


def nvmlEventSetFree(eventSet: Any) -> None:
    _initialized().events.free(eventSet)
