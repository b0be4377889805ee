"""The simulated machine's records (GPUs, GPU and compute instances, processes, the event history), their
persistence in memory or in a JSON state file shared between processes, and the handles that name them.

Part of :mod:`dynamig.backends.simnvml`, the simulated NVML, which holds the NVML session and the functions
and imports these under its own private names. Nothing here is module state: each copy of simnvml
(``dynamig.backends.nvml.fresh_simulated_nvml``) keeps its own :class:`Simulator`.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pynvml import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVMLError,
    c_nvmlComputeInstance_t,
    c_nvmlDevice_t,
    c_nvmlGpuInstance_t,
)

from dynamig.backends import simfabric, simmode
from dynamig.backends.simevents import EventSets
from dynamig.fileio import write_atomic
from dynamig.geometry.model import GpuModel, PlacedInstance, Profile

STATE_FORMAT = "dynamig-simnvml/v1"
NAMESPACE = uuid.uuid5(uuid.NAMESPACE_DNS, "simnvml.dynamig.io")

# Handle addresses: never dereferenced, they only encode what they name.
HANDLE_BASE = 0x5EED << 40
KIND_GPU, KIND_MIG, KIND_GI, KIND_CI = 1, 2, 3, 4


def error(code: int) -> Exception:
    err: Exception = NVMLError(code)  # pynvml maps the code to its NVMLError_* subclass
    return err


# --- records ---------------------------------------------------------------------------------------------


@dataclass
class Process:
    pid: int
    used_bytes: int


@dataclass
class ComputeInstance:
    id: int
    profile_id: int
    start: int
    size: int
    uuid: str
    processes: list[Process] = field(default_factory=list)
    enumerable_at: float = 0.0  # wall-clock time from which its MIG device is enumerated (0: at once)


@dataclass
class GpuInstance:
    id: int
    profile_id: int
    start: int
    size: int
    compute_instances: list[ComputeInstance] = field(default_factory=list)


@dataclass
class Gpu(simmode.MigModeState, simfabric.FabricState):  # MIG mode fields: simmode's; NVLink: simfabric's
    index: int
    model: str
    uuid: str
    lost: bool = False
    gpu_instances: list[GpuInstance] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)  # on the whole GPU (MIG off)


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One entry of the append-only simulation history."""

    seq: int
    timestamp: float
    # create-gi destroy-gi create-ci destroy-ci attach-process detach-process set-mig-mode gpu-reset gpu-lost
    # xid
    kind: str
    gpu_index: int
    gpu_uuid: str
    gi_id: int | None = None
    ci_id: int | None = None
    profile: str | None = None
    profile_id: int | None = None
    start: int | None = None
    size: int | None = None
    mig_uuid: str | None = None
    pid: int | None = None
    value: int | None = None  # MIG mode for set-mig-mode, 1/0 for gpu-lost, the XID for xid


@dataclass
class State:
    gpus: list[Gpu]
    history: list[SimEvent] = field(default_factory=list)
    serial: int = 0
    driver_epoch: int = 0  # bumped by reload_driver(): NVML sessions from before it are stale

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "serial": self.serial,
            "driver_epoch": self.driver_epoch,
            "gpus": [asdict(g) for g in self.gpus],
            "history": [asdict(e) for e in self.history],
        }

    @staticmethod
    def from_json(doc: dict[str, Any]) -> State:
        if doc.get("format") != STATE_FORMAT:
            raise ValueError(f"not a simulated NVML state file (format {doc.get('format')!r})")
        gpus = []
        for g in doc["gpus"]:
            gis = []
            for gi in g.pop("gpu_instances"):
                cis = []
                for ci in gi.pop("compute_instances"):
                    procs = [Process(**p) for p in ci.pop("processes")]
                    cis.append(ComputeInstance(**ci, processes=procs))
                gis.append(GpuInstance(**gi, compute_instances=cis))
            procs = [Process(**p) for p in g.pop("processes", [])]
            gpus.append(Gpu(**g, gpu_instances=gis, processes=procs))
        history = [SimEvent(**e) for e in doc["history"]]
        return State(gpus, history, int(doc["serial"]), int(doc.get("driver_epoch", 0)))


class Simulator:
    """The simulated machine: its configuration and (cached) state. Methods do file I/O when persisted."""

    def __init__(
        self,
        gpus: Sequence[str],
        state_file: Path | None,
        create_latency_s: float,
        destroy_latency_s: float,
        gpu_fields: list[dict[str, Any]],
        seed: str,
    ) -> None:
        self.state_file = state_file
        self.create_latency_s = create_latency_s
        self.mig_enumeration_delay_s = 0.0  # a new compute instance's MIG device is listed this much later
        self.failures: list[Failure] = []  # injected errors (fail_next), in this process only
        self.events = EventSets()  # event sets are handles of this process, as NVML's
        self.destroy_latency_s = destroy_latency_s
        self.renumber_minor = False  # set_minor_renumbering(), in this process only
        self._lock = threading.RLock()
        self._stamp: tuple[int, int, int] | None = None
        fresh = State(
            [
                Gpu(i, key, "GPU-" + str(uuid.uuid5(NAMESPACE, f"{seed}/gpu{i}/{key}")), **fields)
                for i, (key, fields) in enumerate(zip(gpus, gpu_fields, strict=True))
            ]
        )
        if state_file is None:
            self._state = fresh
            return
        with self._file_lock():
            if state_file.exists():
                self._state = self._load()
                existing = [g.model for g in self._state.gpus]
                if gpus and existing != list(gpus):
                    raise ValueError(
                        f"state file {state_file} describes GPUs {existing}, not {list(gpus)}; "
                        "use another file or reset=True"
                    )
            else:
                self._state = fresh
                self._save()

    # -- persistence ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        assert self.state_file is not None
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.state_file.with_name(self.state_file.name + ".lock"), "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _file_stamp(self) -> tuple[int, int, int] | None:
        assert self.state_file is not None
        try:
            st = self.state_file.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _load(self) -> State:
        assert self.state_file is not None
        stamp = self._file_stamp()
        state = State.from_json(json.loads(self.state_file.read_bytes()))
        self._stamp = stamp
        return state

    def _save(self) -> None:
        assert self.state_file is not None
        data = json.dumps(self._state.to_json(), indent=1, sort_keys=True).encode()
        write_atomic(self.state_file, data, mode=0o600)  # only the user's own processes share the GPUs
        self._stamp = self._file_stamp()

    def state(self) -> State:
        """Current state for reading (re-read from the file when another process changed it)."""
        with self._lock:
            if self.state_file is not None:
                stamp = self._file_stamp()
                if stamp is None:
                    raise FileNotFoundError(f"simulated NVML state file {self.state_file} disappeared")
                if stamp != self._stamp:
                    self._state = self._load()
            simmode.settle(self._state.gpus)  # MIG mode switches that have completed since
            return self._state

    @contextlib.contextmanager
    def mutate(self) -> Iterator[State]:
        """Read-modify-write under the thread and file locks; saved only when the body does not raise."""
        with self._lock:
            if self.state_file is None:
                simmode.settle(self._state.gpus)
                yield self._state
                return
            with self._file_lock():
                self._state = self._load()
                simmode.settle(self._state.gpus)
                try:
                    yield self._state
                except BaseException:
                    self._stamp = None  # drop any half-made change: the next read reloads the file
                    raise
                self._save()

    def record(self, state: State, kind: str, gpu: Gpu, **fields: Any) -> None:
        state.serial += 1
        state.history.append(SimEvent(state.serial, time.time(), kind, gpu.index, gpu.uuid, **fields))


@dataclass
class Failure:
    function: str
    code: int
    remaining: int
    match: dict[str, Any]


# --- handles -------------------------------------------------------------------------------------------


def address(kind: int, gpu: int, gi: int = 0, ci: int = 0) -> int:
    return HANDLE_BASE | kind << 36 | gpu << 24 | gi << 12 | ci


def handle(ptr_type: Any, address: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(address), ptr_type)


def gpu_handle(index: int) -> Any:
    return handle(c_nvmlDevice_t, address(KIND_GPU, index))


def mig_handle(index: int, gi: int, ci: int) -> Any:
    return handle(c_nvmlDevice_t, address(KIND_MIG, index, gi, ci))


def gi_handle(index: int, gi: int) -> Any:
    return handle(c_nvmlGpuInstance_t, address(KIND_GI, index, gi))


def ci_handle(index: int, gi: int, ci: int) -> Any:
    return handle(c_nvmlComputeInstance_t, address(KIND_CI, index, gi, ci))


def decode(handle: Any) -> tuple[int, int, int, int]:
    if handle is None:
        raise error(NVML_ERROR_INVALID_ARGUMENT)
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        raise error(NVML_ERROR_INVALID_ARGUMENT) from None
    if address is None or address & ~((1 << 40) - 1) != HANDLE_BASE:
        raise error(NVML_ERROR_INVALID_ARGUMENT)
    return (address >> 36) & 0xF, (address >> 24) & 0xFFF, (address >> 12) & 0xFFF, address & 0xFFF


@dataclass(frozen=True, slots=True)
class Resolved:
    state: State
    gpu: Gpu
    model: GpuModel
    gi: GpuInstance | None = None
    ci: ComputeInstance | None = None


def gpu_of(state: State, index: int) -> Gpu:
    if not 0 <= index < len(state.gpus):
        raise error(NVML_ERROR_INVALID_ARGUMENT)
    gpu = state.gpus[index]
    if gpu.lost:
        raise error(NVML_ERROR_GPU_IS_LOST)
    return gpu


def find_gi(gpu: Gpu, gi_id: int) -> GpuInstance | None:
    return next((g for g in gpu.gpu_instances if g.id == gi_id), None)


def find_ci(gi: GpuInstance, ci_id: int) -> ComputeInstance | None:
    return next((c for c in gi.compute_instances if c.id == ci_id), None)


def resolve(state: State, handle: Any, *kinds: int) -> Resolved:
    """What ``handle`` names in ``state``; InvalidArgument if it is stale or of another kind."""
    kind, index, gi_id, ci_id = decode(handle)
    if kind not in kinds:
        raise error(NVML_ERROR_INVALID_ARGUMENT)
    gpu = gpu_of(state, index)
    model = simmode.gpu_model(gpu.model)
    if kind == KIND_GPU:
        return Resolved(state, gpu, model)
    gi = find_gi(gpu, gi_id)
    if gi is None:
        raise error(NVML_ERROR_INVALID_ARGUMENT)
    if kind == KIND_GI:
        return Resolved(state, gpu, model, gi)
    ci = find_ci(gi, ci_id)
    if ci is None:
        raise error(NVML_ERROR_INVALID_ARGUMENT)
    return Resolved(state, gpu, model, gi, ci)


def profile_by_id(model: GpuModel, profile_id: int) -> Profile:
    try:
        return model.profile_by_id(profile_id)
    except KeyError:
        raise error(NVML_ERROR_INVALID_ARGUMENT) from None


def layout(model: GpuModel, gpu: Gpu) -> list[PlacedInstance]:
    return [PlacedInstance(gi.start, model.profile_by_id(gi.profile_id).name) for gi in gpu.gpu_instances]


def deref(ref: Any) -> Any:
    """The ctypes object behind ``byref(x)``, ``pointer(x)`` or ``x`` itself."""
    if ref is None:
        raise error(NVML_ERROR_INVALID_ARGUMENT)
    inner = getattr(ref, "_obj", None)  # ctypes.byref(...) -> CArgObject
    if inner is not None:
        return inner
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    return ref


def capacity(array_ref: Any) -> tuple[Any, int]:
    """(indexable target, capacity) of an out-array passed as an array, byref(array) or pointer."""
    target = getattr(array_ref, "_obj", array_ref)
    if isinstance(target, ctypes.Array):
        return target, len(target)
    if isinstance(target, ctypes._Pointer):
        return target, 1 << 30  # a bare pointer: the caller vouches for the size
    raise error(NVML_ERROR_INVALID_ARGUMENT)
