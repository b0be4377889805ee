"""MIG discovery, adoption, creation and destruction through the NVML API (the ``pynvml`` module interface).

:class:`NvmlDevices` takes the NVML module as a parameter: the real ``pynvml`` on a GPU node, the simulated
``dynamig.backends.simnvml`` in tests; the code path is the same. Every method does NVML I/O and is blocking
(create/destroy can take seconds on real hardware), so async callers run them in a worker thread; a lock
serialises them because NVML's MIG calls are not meant to run concurrently on one device.

What NVML reports wins over the catalog: a GPU's profiles (ids, instance counts, memory, multiprocessors,
placements) are read from NVML and only matched to the catalog model for the fields NVML does not report.
A profile NVML answers ``NOT_SUPPORTED`` or ``INVALID_ARGUMENT`` for is not offered (nvml.h's way to say so);
any other error on one profile (a transient driver error) keeps the catalog's figures for it and the table is
read again :data:`PROFILE_RETRY_S` later, so an error of a moment neither hides a profile (and the instances
of it) nor freezes a guess until the agent restarts.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from dynamig.agent.nvml.fabric import nvlink_facts
from dynamig.geometry.catalog import Catalog
from dynamig.geometry.model import GpuModel, PlacedInstance, Profile
from dynamig.kube.devices import NvlinkFacts, WholeGpuDevice

log = logging.getLogger(__name__)

MIB = 1024 * 1024

MIG_DISABLED = 0
MIG_ENABLED = 1

PROFILE_RETRY_S = 30.0  # a profile table with a profile NVML failed to read is read again this much later
_NOT_OFFERED = ("NotSupported", "InvalidArgument")  # nvml.h: the GPU (or driver) lacks the profile


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
    # read whatever the MIG mode: the operator matches claims of whole GPUs against it
    nvlink: NvlinkFacts = field(default_factory=NvlinkFacts)

    @property
    def mig_enabled(self) -> bool:
        return self.mig_current == MIG_ENABLED


@dataclass(frozen=True, slots=True)
class ComputeInstance:
    """One compute instance of a GPU instance, read through its MIG device handle."""

    ci_id: int
    slices: int  # compute slices it spans inside its GPU instance
    mig_uuid: str  # "MIG-...": the MIG device's own UUID, never the parent GPU's
    memory_bytes: int | None
    multiprocessors: int | None
    processes: int


@dataclass(frozen=True, slots=True)
class MigInstance:
    """A GPU instance on one GPU, with its compute instances as NVML reports them.

    dynamig makes exactly one compute instance spanning the whole GPU instance (:attr:`whole`). A GPU
    instance split into several or partial compute instances (made by someone else, e.g. ``nvidia-smi mig
    -cci``) is reported as it is (:attr:`partitioned`) and is never offered or destroyed.
    """

    gpu_index: int
    profile: str
    start: int
    size: int
    gi_id: int
    compute_slices: int  # of the GPU instance
    compute_instances: tuple[ComputeInstance, ...] = ()

    @property
    def placed(self) -> PlacedInstance:
        return PlacedInstance(self.start, self.profile)

    @property
    def whole(self) -> ComputeInstance | None:
        """The single compute instance spanning the GPU instance, or None."""
        cis = self.compute_instances
        if len(cis) == 1 and cis[0].slices == self.compute_slices:
            return cis[0]
        return None

    @property
    def has_compute_instance(self) -> bool:
        return bool(self.compute_instances)

    @property
    def partitioned(self) -> bool:
        """Several compute instances, or one that does not span the GPU instance."""
        return self.has_compute_instance and self.whole is None

    @property
    def ci_id(self) -> int | None:
        w = self.whole
        return None if w is None else w.ci_id

    @property
    def mig_uuid(self) -> str:
        w = self.whole
        return "" if w is None else w.mig_uuid

    @property
    def memory_bytes(self) -> int | None:
        w = self.whole
        return None if w is None else w.memory_bytes

    @property
    def multiprocessors(self) -> int | None:
        w = self.whole
        return None if w is None else w.multiprocessors

    @property
    def processes(self) -> int:
        return sum(c.processes for c in self.compute_instances)

    def describe_compute(self) -> str:
        """How the GPU instance is split, for status and logs, e.g. ``2 compute instances (1c, 1c of 2)``."""
        n = len(self.compute_instances)
        parts = ", ".join(f"{c.slices}c" for c in self.compute_instances)
        return f"{n} compute instance(s) ({parts} of {self.compute_slices} compute slices)"


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


# Errors after which the library is re-initialised once and the call retried: NVML was shut down under us,
# or the driver was unloaded and reloaded (every handle of the old session is then stale).
_REINIT_ERRORS = ("Uninitialized", "DriverNotLoaded", "LibraryNotFound", "Unknown")


class NvmlDevices:
    """NVML access for one node. Holds a lock; every public method does NVML I/O (side effects noted).

    A GPU is identified by its UUID: every call on it re-reads the handle at its index and checks the UUID,
    so a GPU that disappears or is re-enumerated is never confused with another one.
    """

    def __init__(
        self, nvml: ModuleType, catalog: Catalog, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.nvml = nvml
        self.catalog = catalog
        self.clock = clock
        self._lock = threading.RLock()
        # (GPU UUID, MIG mode) -> (refined model, when to read it again: None when NVML answered every
        # profile). Refreshed when MIG mode changes (profiles need MIG on).
        self._models: dict[tuple[str, int], tuple[GpuModel | None, float | None]] = {}
        self.unread_profiles: dict[str, list[str]] = {}  # GPU UUID -> "profile: error" NVML failed to read
        self.reinits = 0  # times the library was re-initialised after a driver reload

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

    def reinit(self) -> None:
        """Shut NVML down and initialise it again, forgetting every cached model. Side effect: library."""
        with self._lock:
            self.shutdown()
            self._models.clear()
            self.nvml.nvmlInit()
            self.reinits += 1
            log.warning("NVML re-initialised (driver reloaded or library shut down)")

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
            return [self._gpu(index) for index in range(self._device_count())]

    def discover(self) -> tuple[list[GpuInfo], dict[int, str]]:
        """The GPUs NVML can read, and ``index -> error`` for those it cannot (e.g. fallen off the bus).

        Reads only. An error listing the GPUs at all is raised. A library left uninitialised by a driver
        reload is re-initialised once first.
        """
        with self._lock:
            found: list[GpuInfo] = []
            failed: dict[int, str] = {}
            for index in range(self._device_count()):
                try:
                    found.append(self._gpu(index))
                except self.nvml.NVMLError as exc:
                    failed[index] = f"{_error_name(exc)}: {exc}"
            return found, failed

    def _device_count(self) -> int:
        try:
            return int(self.nvml.nvmlDeviceGetCount())
        except self.nvml.NVMLError as exc:
            if _error_name(exc) not in _REINIT_ERRORS:
                raise
            log.warning("nvmlDeviceGetCount: %s; re-initialising NVML", _error_name(exc))
            self.reinit()
            return int(self.nvml.nvmlDeviceGetCount())

    def gpu(self, index: int) -> GpuInfo:
        with self._lock:
            return self._gpu(index)

    def _handle(self, gpu: GpuInfo) -> Any:
        """The parent device handle of ``gpu``, checked to still be the GPU with ``gpu.uuid``.

        Looked up by index and verified by UUID rather than with ``nvmlDeviceGetHandleByUUID``, which nvml.h
        lets fail with GPU_IS_LOST "if any GPU has fallen off the bus": one lost GPU must not stop the rest.
        A different GPU at that index (re-enumerated after a GPU vanished) raises NVML's NotFound.
        """
        nv = self.nvml
        h = nv.nvmlDeviceGetHandleByIndex(gpu.index)
        now = _text(nv.nvmlDeviceGetUUID(h))
        if now != gpu.uuid:
            log.warning("GPU index %d is now %s, no longer %s", gpu.index, now, gpu.uuid)
            raise nv.NVMLError(nv.NVML_ERROR_NOT_FOUND)
        return h

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
        key = (uuid, int(current))
        cached = self._models.get(key)
        if cached is None or (cached[1] is not None and self.clock() >= cached[1]):
            model, unread = self._refine_model(h, product, pci_device_id, int(current) == MIG_ENABLED)
            self._models[key] = (model, self.clock() + PROFILE_RETRY_S if unread else None)
            if unread:
                self.unread_profiles[uuid] = unread
            elif self.unread_profiles.pop(uuid, None) is not None:
                log.info("GPU %s: NVML reports every profile again", uuid)
        return GpuInfo(
            index=index,
            uuid=uuid,
            product=product,
            pci_device_id=pci_device_id,
            minor=minor,
            mig_current=int(current),
            mig_pending=int(pending),
            model=self._models[key][0],
            nvlink=nvlink_facts(nv, h),
        )

    def _refine_model(
        self, h: Any, product: str, pci_device_id: int, mig_enabled: bool
    ) -> tuple[GpuModel | None, list[str]]:
        """The catalog model for this GPU with profile data replaced by what NVML reports, and the profiles
        NVML failed to read (``"profile: error"``; kept with the catalog's figures until read again).

        NVML answers profile queries only with MIG enabled (nvml.h, ``nvmlDeviceGetGpuInstanceProfileInfoV``:
        NOT_SUPPORTED "if device doesn't have MIG mode enabled"), so with MIG off the catalog model is kept
        as it is; it is refined again once MIG mode changes.
        """
        base = self.catalog.for_product(product, pci_device_id)
        if base is None:
            log.warning("GPU %r (PCI device 0x%04x) is not in the catalog", product, pci_device_id)
            return None, []
        if not mig_enabled:
            return base, []
        nv = self.nvml
        profiles: list[Profile] = []
        unread: list[str] = []
        for p in base.profiles:
            try:
                info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, p.nvml_enum)
            except nv.NVMLError as exc:
                if _error_name(exc) in _NOT_OFFERED:  # this GPU or driver lacks the profile
                    log.info("%s: profile %s not offered by NVML (%s)", product, p.name, _error_name(exc))
                    continue
                unread.append(f"{p.name}: {_error_name(exc)}")
                profiles.append(p)  # the catalog's figures until NVML answers again
                continue
            reported, error = self._placements(h, int(info.id))
            if error and error != "NoPermission":  # NoPermission stays: the catalog's placements it is
                unread.append(f"{p.name} placements: {error}")
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
        if unread:
            log.warning(
                "%s: NVML failed to read profile(s) %s; using the catalog's figures for them and reading "
                "them again in %.0fs", product, ", ".join(unread), PROFILE_RETRY_S,
            )  # fmt: skip
        return dataclasses.replace(base, profiles=tuple(profiles)), unread

    def _placements(self, h: Any, profile_id: int) -> tuple[list[tuple[int, int]], str]:
        """NVML's placements of the profile, and the NVML error's name when it refused to list them."""
        nv = self.nvml
        placement_t = _ctype(nv, "c_nvmlGpuInstancePlacement_t")
        count = ctypes.c_uint(0)
        try:
            nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, ctypes.byref(count))
            arr = (placement_t * max(1, count.value))()
            nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ctypes.byref(count))
        except nv.NVMLError as exc:
            log.info("possible placements of profile id %d: %s", profile_id, _error_name(exc))
            return [], _error_name(exc)
        return [(int(arr[i].start), int(arr[i].size)) for i in range(count.value)], ""

    def instances(self, gpu: GpuInfo) -> list[MigInstance]:
        """Every GPU instance on ``gpu`` with its compute instances, MIG UUIDs and processes. Reads only."""
        if gpu.model is None or not gpu.mig_enabled:
            return []
        with self._lock:
            h = self._handle(gpu)
            migs = self._mig_devices(h)
            out = []
            for profile in gpu.model.profiles:
                for gi in self._gpu_instances(h, profile):
                    out.append(self._describe(gpu.index, profile, gi, migs))
            return sorted(out, key=lambda m: (m.start, m.profile))

    def _mig_devices(self, h: Any) -> dict[tuple[int, int], Any]:
        """``(GI id, CI id) -> MIG device handle`` for every MIG device under parent ``h``.

        nvml.h: ``nvmlDeviceGetMigDeviceHandleByIndex`` walks indices below ``nvmlDeviceGetMaxMigDeviceCount``
        (NOT_FOUND "if no valid MIG device was found at index"); each handle is matched to its GI/CI through
        ``nvmlDeviceGetGpuInstanceId`` / ``nvmlDeviceGetComputeInstanceId``. ``nvmlComputeInstanceGetInfo``'s
        ``device`` is the *parent* device and must not be used for this.
        """
        nv = self.nvml
        out: dict[tuple[int, int], Any] = {}
        for index in range(int(nv.nvmlDeviceGetMaxMigDeviceCount(h))):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, index)
            except nv.NVMLError_NotFound:
                continue
            out[(int(nv.nvmlDeviceGetGpuInstanceId(mig)), int(nv.nvmlDeviceGetComputeInstanceId(mig)))] = mig
        return out

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

    def _describe(
        self, gpu_index: int, profile: Profile, gi: Any, migs: dict[tuple[int, int], Any]
    ) -> MigInstance:
        nv = self.nvml
        info = nv.nvmlGpuInstanceGetInfo(gi)
        gi_id = int(info.id)
        cis = []
        for ci in self._compute_instances(gi):
            ci_info = nv.nvmlComputeInstanceGetInfo(ci)
            ci_id = int(ci_info.id)
            mig = migs.get((gi_id, ci_id))
            cis.append(self._read_mig(mig, ci_id, int(ci_info.placement.size)))
        return MigInstance(
            gpu_index=gpu_index,
            profile=profile.name,
            start=int(info.placement.start),
            size=int(info.placement.size),
            gi_id=gi_id,
            compute_slices=profile.compute_slices,
            compute_instances=tuple(sorted(cis, key=lambda c: c.ci_id)),
        )

    def _read_mig(self, mig: Any | None, ci_id: int, slices: int) -> ComputeInstance:
        """UUID, memory, multiprocessors and processes of one MIG device, read from its own handle."""
        nv = self.nvml
        if mig is None:  # a CI that NVML lists but has no MIG device for (yet): nothing to hand out
            return ComputeInstance(ci_id, slices, "", None, None, 0)
        uuid = _text(nv.nvmlDeviceGetUUID(mig))
        try:
            memory: int | None = int(nv.nvmlDeviceGetMemoryInfo(mig).total)
        except nv.NVMLError:
            memory = None
        try:
            sms: int | None = int(nv.nvmlDeviceGetAttributes(mig).multiprocessorCount)
        except nv.NVMLError:
            sms = None
        try:
            procs = len(nv.nvmlDeviceGetComputeRunningProcesses(mig))
        except nv.NVMLError:
            procs = 0
        return ComputeInstance(ci_id, slices, uuid, memory, sms, procs)

    def _ci_profile(self, gi: Any, slice_count: int) -> Any | None:
        """The compute-instance profile info that spans the whole GI (sliceCount == GI's), or None."""
        for info in self._ci_profiles(gi):
            if int(info.sliceCount) == slice_count:
                return info
        return None

    def _ci_profiles(self, gi: Any) -> list[Any]:
        """Every compute-instance profile ``gi`` offers (shared engines)."""
        nv = self.nvml
        count = int(getattr(nv, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9))
        shared = int(getattr(nv, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0))
        out = []
        for enum in range(count):
            try:
                out.append(nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, enum, shared))
            except nv.NVMLError:
                continue
        return out

    def _compute_instances(self, gi: Any) -> list[Any]:
        """Every compute instance of ``gi``, over every CI profile."""
        nv = self.nvml
        ci_t = _ctype(nv, "c_nvmlComputeInstance_t")
        found: list[Any] = []
        for prof in self._ci_profiles(gi):
            arr = (ci_t * max(1, int(prof.instanceCount)))()
            count = ctypes.c_uint(0)
            try:
                nv.nvmlGpuInstanceGetComputeInstances(gi, int(prof.id), arr, ctypes.byref(count))
            except nv.NVMLError:
                continue
            found.extend(arr[i] for i in range(count.value))
        return found

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
        the NVML error (e.g. ``NVMLError_InsufficientResources`` for a taken placement) otherwise, and
        ``ValueError`` for a GI someone else split into compute instances.
        """
        if gpu.model is None:
            raise ValueError(f"GPU {gpu.index} ({gpu.product}) has no known MIG model")
        profile = gpu.model.profile(placed.profile)
        nv = self.nvml
        with self._lock:
            h = self._handle(gpu)
            gi = self._find_gi(h, gpu, placed)
            if gi is None:
                placement_t = _ctype(nv, "c_nvmlGpuInstancePlacement_t")
                pl = placement_t()
                pl.start = placed.start
                pl.size = profile.placement_size
                gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile.profile_id, ctypes.byref(pl))
            if not self._compute_instances(gi):
                ci_prof = self._ci_profile(gi, profile.compute_slices)
                if ci_prof is None:
                    raise ValueError(f"no compute-instance profile spans {placed.profile} on GPU {gpu.index}")
                nv.nvmlGpuInstanceCreateComputeInstance(gi, int(ci_prof.id))
            made = self._describe(gpu.index, profile, gi, self._mig_devices(h))
            if made.partitioned:
                raise ValueError(
                    f"{placed.profile}@{placed.start} on GPU {gpu.index}: {made.describe_compute()}"
                )
            return made

    def destroy(self, gpu: GpuInfo, placed: PlacedInstance, *, check_processes: bool = True) -> bool:
        """Destroy the CI(s) then the GI at ``placed``. Side effect: NVML change.

        Returns False when nothing is there (already gone). Raises ``NVMLError_InUse`` when processes run on
        it (NVML refuses; with ``check_processes`` the agent refuses first, without asking NVML to destroy).
        """
        nv = self.nvml
        with self._lock:
            h = self._handle(gpu)
            gi = self._find_gi(h, gpu, placed)
            if gi is None:
                return False
            if check_processes and gpu.model is not None:
                current = self._describe(
                    gpu.index, gpu.model.profile(placed.profile), gi, self._mig_devices(h)
                )
                if current.processes:
                    raise nv.NVMLError_InUse(nv.NVML_ERROR_IN_USE)
            for ci in self._compute_instances(gi):
                nv.nvmlComputeInstanceDestroy(ci)
            nv.nvmlGpuInstanceDestroy(gi)
            return True

    def processes(self, gpu: GpuInfo, placed: PlacedInstance) -> int:
        """Compute processes running on the instance at ``placed`` (0 when it does not exist). Reads only."""
        if gpu.model is None:
            return 0
        with self._lock:
            h = self._handle(gpu)
            gi = self._find_gi(h, gpu, placed)
            if gi is None:
                return 0
            return self._describe(
                gpu.index, gpu.model.profile(placed.profile), gi, self._mig_devices(h)
            ).processes

    def set_mig_mode(self, gpu: GpuInfo, enable: bool) -> str:
        """Asks NVML to switch ``gpu``'s MIG mode; the activation status's name: ``Success``, ``InUse`` or
        ``ResetRequired``. Raises for the call's own errors (NOT_SUPPORTED, NO_PERMISSION, ...).

        nvml.h ``nvmlDeviceSetMigMode``: "This API may unbind or reset the device to activate the requested
        mode. Thus, the attributes associated with the device, such as minor number, might change. The caller
        of this API is expected to query such attributes again." (the agent reads every GPU afresh each
        round); "if device unbind fails because the device isn't idle, NVML_ERROR_IN_USE would be returned.
        The caller of this API is expected to idle the device and retry setting the mode."; "activationStatus
        would return NVML_ERROR_RESET_REQUIRED" where a reset is not exposed (pass-through VMs: a VM reboot
        is required). Side effect: NVML."""
        nv = self.nvml
        mode = nv.NVML_DEVICE_MIG_ENABLE if enable else nv.NVML_DEVICE_MIG_DISABLE
        with self._lock:
            status = int(nv.nvmlDeviceSetMigMode(self._handle(gpu), mode))
        return ACTIVATION.get(status, f"error {status}")

    def whole(self, gpu: GpuInfo) -> WholeGpu:
        """A GPU with MIG mode off as one device (:meth:`whole_device`), and the compute processes running
        on it. Reads only."""
        device = self.whole_device(gpu)
        with self._lock:
            processes = len(self.nvml.nvmlDeviceGetComputeRunningProcesses(self._handle(gpu)))
        return WholeGpu(device, processes)

    def whole_device(self, gpu: GpuInfo) -> WholeGpuDevice:
        """The GPU as one device: its memory, architecture, CUDA compute capability, active NVLink links and
        NVLink fabric clique (as ``gpu`` was listed with them); whatever its MIG mode (a MIG GPU offers it
        beside its slices). Reads only; a fact NVML does not give (NOT_SUPPORTED on an older driver, or on a
        GPU without NVLink) is left out rather than failing the GPU."""
        nv = self.nvml
        with self._lock:
            h = self._handle(gpu)
            try:
                memory: int | None = int(nv.nvmlDeviceGetMemoryInfo(h).total)
            except nv.NVMLError:
                memory = None
            try:
                arch = ARCHITECTURES.get(int(nv.nvmlDeviceGetArchitecture(h)), "")
            except nv.NVMLError:
                arch = ""
            try:
                major, minor = nv.nvmlDeviceGetCudaComputeCapability(h)
                capability = f"{int(major)}.{int(minor)}"
            except nv.NVMLError:
                capability = ""
        device = WholeGpuDevice(gpu.index, gpu.product, gpu.uuid, memory, arch, capability)
        return device.with_nvlink(gpu.nvlink)


# nvml.h nvmlReturn_t values nvmlDeviceSetMigMode's activationStatus takes, by name.
ACTIVATION = {0: "Success", 19: "InUse", 16: "ResetRequired"}

# nvml.h nvmlDeviceArchitecture_t: NVML_DEVICE_ARCH_<NAME>, by value.
ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}


@dataclass(frozen=True, slots=True)
class WholeGpu:
    """A GPU with MIG mode off as NVML reports it: the device it is published as, and its processes."""

    device: WholeGpuDevice
    processes: int


def _ctype(nv: ModuleType, name: str) -> Any:
    """A ctypes structure type of the NVML module (``pynvml`` and ``simnvml`` both export them)."""
    return getattr(nv, name)
