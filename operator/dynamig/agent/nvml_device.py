"""MIG discovery, adoption, creation and destruction through the NVML API (the ``pynvml`` module interface).

:class:`NvmlDevices` takes the NVML module as a parameter: the real ``pynvml`` on a GPU node, the simulated
``dynamig.backends.simnvml`` in tests; the code path is the same. Every method does NVML I/O and is blocking
(create/destroy can take seconds on real hardware), so async callers run them in a worker thread; a lock
serialises them because NVML's MIG calls are not meant to run concurrently on one device.

What NVML reports wins over the catalog: a GPU's profiles (ids, instance counts, memory, multiprocessors,
placements) are read from NVML and only matched to the catalog model for the fields NVML does not report.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.model import GpuModel, PlacedInstance, Profile

log = logging.getLogger(__name__)

MIB = 1024 * 1024

MIG_DISABLED = 0
MIG_ENABLED = 1


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """A physical GPU as NVML reports it."""

    index: int
    uuid: str
    product: str
    pci_device_id: int  # the 16-bit device id, e.g. 0x2330
    minor: int | None
    mig_current: int
    mig_pending: int
    model: GpuModel | None  # catalog model refined with NVML's profile data; None when unknown

    @property
    def mig_enabled(self) -> bool:
        return self.mig_current == MIG_ENABLED


@dataclass(frozen=True, slots=True)
class MigInstance:
    """A GPU instance (and its compute instance, when it has one) on one GPU."""

    gpu_index: int
    profile: str
    start: int
    size: int
    gi_id: int
    ci_id: int | None
    mig_uuid: str
    memory_bytes: int | None
    multiprocessors: int | None
    processes: int

    @property
    def placed(self) -> PlacedInstance:
        return PlacedInstance(self.start, self.profile)

    @property
    def has_compute_instance(self) -> bool:
        return self.ci_id is not None


class GpuLostError(RuntimeError):
    """NVML no longer reaches a GPU it reported before."""


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace").rstrip("\x00")
    return str(value)


def _error_name(exc: BaseException) -> str:
    """``InUse`` for ``NVMLError_InUse`` and so on; the class name otherwise."""
    name = type(exc).__name__
    return name.removeprefix("NVMLError_")


class NvmlDevices:
    """NVML access for one node. Holds a lock; every public method does NVML I/O (side effects noted)."""

    def __init__(self, nvml: ModuleType, catalog: Catalog) -> None:
        self.nvml = nvml
        self.catalog = catalog
        self._lock = threading.RLock()
        self._models: dict[str, GpuModel | None] = {}  # GPU UUID -> refined model (built once per GPU)

    # --- lifecycle -----------------------------------------------------------------------------------

    def init(self) -> None:
        """nvmlInit. Side effect: loads/initialises the library."""
        with self._lock:
            self.nvml.nvmlInit()

    def shutdown(self) -> None:
        with self._lock:
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)

    @property
    def error_type(self) -> type[Exception]:
        err: type[Exception] = self.nvml.NVMLError
        return err

    def error_name(self, exc: BaseException) -> str:
        return _error_name(exc)

    def is_error(self, exc: BaseException, name: str) -> bool:
        """True when ``exc`` is NVML's ``NVMLError_<name>`` (e.g. ``InUse``)."""
        cls = getattr(self.nvml, f"NVMLError_{name}", None)
        return cls is not None and isinstance(exc, cls)

    # --- discovery -----------------------------------------------------------------------------------

    def gpus(self) -> list[GpuInfo]:
        """Every GPU NVML reports, with MIG mode and its refined model. Reads only; raises on any error."""
        with self._lock:
            return [self._gpu(index) for index in range(self.nvml.nvmlDeviceGetCount())]

    def discover(self) -> tuple[list[GpuInfo], dict[int, str]]:
        """The GPUs NVML can read, and ``index -> error`` for those it cannot (e.g. fallen off the bus).

        Reads only. An error listing the GPUs at all is raised.
        """
        with self._lock:
            found: list[GpuInfo] = []
            failed: dict[int, str] = {}
            for index in range(self.nvml.nvmlDeviceGetCount()):
                try:
                    found.append(self._gpu(index))
                except self.nvml.NVMLError as exc:
                    failed[index] = f"{_error_name(exc)}: {exc}"
            return found, failed

    def gpu(self, index: int) -> GpuInfo:
        with self._lock:
            return self._gpu(index)

    def _gpu(self, index: int) -> GpuInfo:
        nv = self.nvml
        h = nv.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nv.nvmlDeviceGetUUID(h))
        product = _text(nv.nvmlDeviceGetName(h))
        pci = nv.nvmlDeviceGetPciInfo(h)
        pci_device_id = (int(pci.pciDeviceId) >> 16) & 0xFFFF
        try:
            minor: int | None = int(nv.nvmlDeviceGetMinorNumber(h))
        except nv.NVMLError:
            minor = None
        try:
            current, pending = nv.nvmlDeviceGetMigMode(h)
        except nv.NVMLError_NotSupported:
            current, pending = MIG_DISABLED, MIG_DISABLED
        if uuid not in self._models:
            self._models[uuid] = self._refine_model(h, product, pci_device_id)
        return GpuInfo(
            index=index,
            uuid=uuid,
            product=product,
            pci_device_id=pci_device_id,
            minor=minor,
            mig_current=int(current),
            mig_pending=int(pending),
            model=self._models[uuid],
        )

    def _refine_model(self, h: Any, product: str, pci_device_id: int) -> GpuModel | None:
        """The catalog model for this GPU with profile data replaced by what NVML reports."""
        base = self.catalog.for_product(product, pci_device_id)
        if base is None:
            log.warning("GPU %r (PCI device 0x%04x) is not in the catalog", product, pci_device_id)
            return None
        nv = self.nvml
        profiles: list[Profile] = []
        for p in base.profiles:
            try:
                info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, p.nvml_enum)
            except nv.NVMLError as exc:
                # NOT_SUPPORTED / INVALID_ARGUMENT: this GPU or driver lacks the profile.
                log.info("%s: profile %s not offered by NVML (%s)", product, p.name, _error_name(exc))
                continue
            reported = self._placements(h, int(info.id))
            starts = tuple(s for s, _ in reported) if reported else p.placement_starts
            size = reported[0][1] if reported else p.placement_size
            profiles.append(
                dataclasses.replace(
                    p,
                    profile_id=int(info.id),
                    max_instances=int(info.instanceCount),
                    memory_mib=int(info.memorySizeMB),
                    multiprocessors=int(info.multiprocessorCount),
                    placement_starts=starts,
                    placement_size=int(size),
                )
            )
        return dataclasses.replace(base, profiles=tuple(profiles))

    def _placements(self, h: Any, profile_id: int) -> list[tuple[int, int]]:
        nv = self.nvml
        placement_t = _ctype(nv, "c_nvmlGpuInstancePlacement_t")
        count = ctypes.c_uint(0)
        try:
            nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, ctypes.byref(count))
            arr = (placement_t * max(1, count.value))()
            nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ctypes.byref(count))
        except nv.NVMLError as exc:
            log.info("possible placements of profile id %d: %s", profile_id, _error_name(exc))
            return []
        return [(int(arr[i].start), int(arr[i].size)) for i in range(count.value)]

    def instances(self, gpu: GpuInfo) -> list[MigInstance]:
        """Every GPU instance on ``gpu`` with its compute instance, MIG UUID and process count. Reads only."""
        if gpu.model is None or not gpu.mig_enabled:
            return []
        with self._lock:
            h = self.nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            out = []
            for profile in gpu.model.profiles:
                for gi in self._gpu_instances(h, profile):
                    out.append(self._describe(gpu.index, profile, gi))
            return sorted(out, key=lambda m: (m.start, m.profile))

    def _gpu_instances(self, h: Any, profile: Profile) -> list[Any]:
        nv = self.nvml
        gi_t = _ctype(nv, "c_nvmlGpuInstance_t")
        arr = (gi_t * max(1, profile.max_instances))()
        count = ctypes.c_uint(0)
        try:
            nv.nvmlDeviceGetGpuInstances(h, profile.profile_id, arr, ctypes.byref(count))
        except (nv.NVMLError_NotFound, nv.NVMLError_NotSupported):
            return []
        return [arr[i] for i in range(count.value)]

    def _describe(self, gpu_index: int, profile: Profile, gi: Any) -> MigInstance:
        nv = self.nvml
        info = nv.nvmlGpuInstanceGetInfo(gi)
        ci = self._compute_instance(gi)
        mig_uuid = ""
        memory: int | None = None
        sms: int | None = None
        procs = 0
        ci_id: int | None = None
        if ci is not None:
            ci_info = nv.nvmlComputeInstanceGetInfo(ci)
            ci_id = int(ci_info.id)
            dev = ci_info.device
            mig_uuid = _text(nv.nvmlDeviceGetUUID(dev))
            try:
                memory = int(nv.nvmlDeviceGetMemoryInfo(dev).total)
            except nv.NVMLError:
                memory = None
            try:
                sms = int(nv.nvmlDeviceGetAttributes(dev).multiprocessorCount)
            except nv.NVMLError:
                sms = None
            try:
                procs = len(nv.nvmlDeviceGetComputeRunningProcesses(dev))
            except nv.NVMLError:
                procs = 0
        return MigInstance(
            gpu_index=gpu_index,
            profile=profile.name,
            start=int(info.placement.start),
            size=int(info.placement.size),
            gi_id=int(info.id),
            ci_id=ci_id,
            mig_uuid=mig_uuid,
            memory_bytes=memory,
            multiprocessors=sms,
            processes=procs,
        )

    def _ci_profile(self, gi: Any, slice_count: int) -> Any | None:
        """The compute-instance profile info that spans the whole GI (sliceCount == GI's), or None."""
        nv = self.nvml
        count = int(getattr(nv, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9))
        shared = int(getattr(nv, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0))
        for enum in range(count):
            try:
                info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, enum, shared)
            except nv.NVMLError:
                continue
            if int(info.sliceCount) == slice_count:
                return info
        return None

    def _compute_instance(self, gi: Any) -> Any | None:
        """The first compute instance of ``gi`` over every CI profile, or None when it has none."""
        nv = self.nvml
        count_enums = int(getattr(nv, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9))
        shared = int(getattr(nv, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0))
        ci_t = _ctype(nv, "c_nvmlComputeInstance_t")
        for enum in range(count_enums):
            try:
                prof = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, enum, shared)
            except nv.NVMLError:
                continue
            arr = (ci_t * max(1, int(prof.instanceCount)))()
            count = ctypes.c_uint(0)
            try:
                nv.nvmlGpuInstanceGetComputeInstances(gi, int(prof.id), arr, ctypes.byref(count))
            except nv.NVMLError:
                continue
            if count.value:
                return arr[0]
        return None

    def _find_gi(self, h: Any, gpu: GpuInfo, placed: PlacedInstance) -> Any | None:
        assert gpu.model is not None
        if not gpu.model.has_profile(placed.profile):
            return None
        for gi in self._gpu_instances(h, gpu.model.profile(placed.profile)):
            if int(self.nvml.nvmlGpuInstanceGetInfo(gi).placement.start) == placed.start:
                return gi
        return None

    # --- changes -------------------------------------------------------------------------------------

    def create(self, gpu: GpuInfo, placed: PlacedInstance) -> MigInstance:
        """Create GI ``placed`` at its explicit placement and a CI spanning it. Side effect: NVML change.

        Idempotent: an existing GI at that placement is reused and only its missing CI is created. Raises
        the NVML error (e.g. ``NVMLError_InsufficientResources`` for a taken placement) otherwise.
        """
        if gpu.model is None:
            raise ValueError(f"GPU {gpu.index} ({gpu.product}) has no known MIG model")
        profile = gpu.model.profile(placed.profile)
        nv = self.nvml
        with self._lock:
            h = nv.nvmlDeviceGetHandleByIndex(gpu.index)
            gi = self._find_gi(h, gpu, placed)
            if gi is None:
                placement_t = _ctype(nv, "c_nvmlGpuInstancePlacement_t")
                pl = placement_t()
                pl.start = placed.start
                pl.size = profile.placement_size
                gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile.profile_id, ctypes.byref(pl))
            if self._compute_instance(gi) is None:
                ci_prof = self._ci_profile(gi, profile.compute_slices)
                if ci_prof is None:
                    raise ValueError(f"no compute-instance profile spans {placed.profile} on GPU {gpu.index}")
                nv.nvmlGpuInstanceCreateComputeInstance(gi, int(ci_prof.id))
            return self._describe(gpu.index, profile, gi)

    def destroy(self, gpu: GpuInfo, placed: PlacedInstance, *, check_processes: bool = True) -> bool:
        """Destroy the CI(s) then the GI at ``placed``. Side effect: NVML change.

        Returns False when nothing is there (already gone). Raises ``NVMLError_InUse`` when processes run on
        it (NVML refuses; with ``check_processes`` the agent refuses first, without asking NVML to destroy).
        """
        nv = self.nvml
        with self._lock:
            h = nv.nvmlDeviceGetHandleByIndex(gpu.index)
            gi = self._find_gi(h, gpu, placed)
            if gi is None:
                return False
            if check_processes and gpu.model is not None:
                current = self._describe(gpu.index, gpu.model.profile(placed.profile), gi)
                if current.processes:
                    raise nv.NVMLError_InUse(nv.NVML_ERROR_IN_USE)
            while (ci := self._compute_instance(gi)) is not None:
                nv.nvmlComputeInstanceDestroy(ci)
            nv.nvmlGpuInstanceDestroy(gi)
            return True

    def processes(self, gpu: GpuInfo, placed: PlacedInstance) -> int:
        """Compute processes running on the instance at ``placed`` (0 when it does not exist). Reads only."""
        if gpu.model is None:
            return 0
        with self._lock:
            h = self.nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            gi = self._find_gi(h, gpu, placed)
            if gi is None:
                return 0
            return self._describe(gpu.index, gpu.model.profile(placed.profile), gi).processes


def _ctype(nv: ModuleType, name: str) -> Any:
    """A ctypes structure type of the NVML module (``pynvml`` and ``simnvml`` both export them)."""
    return getattr(nv, name)
