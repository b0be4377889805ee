"""A GPU's MIG profile table as NVML itself reports it, and its differences from the geometry catalog.

:func:`read_nvml_profiles` asks NVML (the real ``pynvml`` or the simulated ``dynamig.backends.simnvml``) for
every GPU-instance profile enum ``0 .. NVML_GPU_INSTANCE_PROFILE_COUNT - 1`` with
``nvmlDeviceGetGpuInstanceProfileInfoV`` (``NOT_SUPPORTED`` / ``INVALID_ARGUMENT``: the GPU does not offer it,
which is how nvml.h says to enumerate profiles) and for each offered profile its
``nvmlDeviceGetGpuInstancePossiblePlacements``. :func:`diff_profiles` is the pure comparison of that table
with a catalog model: profiles are matched by NVML enum (names are not unique across models and change with
drivers), and every missing profile, extra profile and differing field is returned with both values.

Against the simulated NVML the comparison is a self-consistency check only (the simulator serves the catalog);
the catalog's independent check is ``tests/unit/test_geometry_reference.py`` against NVIDIA's tables.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from dynamig.geometry.model import GpuModel, Profile

# nvidia-smi prints profile memory in GiB with two decimals and the catalog's MiB were transcribed from it,
# so a catalog figure is only known to within half a hundredth of a GiB.
MEMORY_TOLERANCE_MIB = 0.005 * 1024

Value = int | str | tuple[int, ...] | None
DifferenceKind = Literal["missing", "extra", "mismatch", "unreadable"]

# Catalog Profile fields compared with NVML's answer, in report order.
COMPARED_FIELDS = (
    "name", "profile_id", "compute_slices", "max_instances", "memory_mib", "multiprocessors",
    "copy_engines", "decoders", "encoders", "jpegs", "ofas", "placement_starts", "placement_size",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class NvmlProfile:
    """One GPU-instance profile as NVML reports it (``nvmlGpuInstanceProfileInfo_v2_t`` + placements)."""

    nvml_enum: int
    name: str | None  # info.name without the "MIG " prefix; None from the unversioned (v1) call
    profile_id: int  # info.id, the id create/placement calls take
    compute_slices: int  # info.sliceCount
    max_instances: int  # info.instanceCount
    memory_mib: int  # info.memorySizeMB
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    placements: tuple[tuple[int, int], ...] | None  # (start, size); None when NVML refused to list them
    placements_error: str | None = None  # why placements is None

    @property
    def placement_starts(self) -> tuple[int, ...] | None:
        return None if self.placements is None else tuple(start for start, _ in self.placements)

    @property
    def placement_size(self) -> int | tuple[int, ...] | None:
        """The size every placement has; the distinct sizes when they differ (no driver does that)."""
        if self.placements is None:
            return None
        sizes = tuple(sorted({size for _, size in self.placements}))
        return sizes[0] if len(sizes) == 1 else sizes


@dataclass(frozen=True, slots=True)
class ProfileDifference:
    """One way a GPU's NVML profile table differs from its catalog model."""

    kind: DifferenceKind
    profile: str  # the catalog's name (NVML's for an extra profile)
    nvml_enum: int
    field: str | None = None  # the catalog field, for "mismatch" and "unreadable"
    catalog: Value = None
    nvml: Value = None

    def describe(self) -> str:
        where = f"{self.profile} (enum {self.nvml_enum:#x})"
        if self.kind == "missing":
            return f"{where}: in the catalog, not offered by NVML"
        if self.kind == "extra":
            return f"{where}: offered by NVML, not in the catalog"
        if self.kind == "unreadable":
            return f"{where}: NVML did not report {self.field}: {self.nvml}"
        return f"{where}: {self.field}: catalog {show(self.catalog)}, NVML {show(self.nvml)}"


def show(value: Value) -> str:
    """A value as the doctor prints it (starts as ``0,2,4,6``; ``-`` for none)."""
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace").rstrip("\x00")
    return str(value)


def _error_name(exc: BaseException) -> str:
    return type(exc).__name__.removeprefix("NVMLError_")


def _not_offered(nvml: ModuleType) -> tuple[type[BaseException], ...]:
    return tuple(getattr(nvml, name) for name in ("NVMLError_NotSupported", "NVMLError_InvalidArgument"))


def _placements(nvml: ModuleType, handle: Any, profile_id: int) -> tuple[tuple[int, int], ...]:
    """``nvmlDeviceGetGpuInstancePossiblePlacements``: count with a NULL array first, then the array."""
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
    arr = (nvml.c_nvmlGpuInstancePlacement_t * max(1, count.value))()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, arr, ctypes.byref(count))
    return tuple((int(arr[i].start), int(arr[i].size)) for i in range(count.value))


def _profile_info(
    nvml: ModuleType, handle: Any, enum: int, version: int, retries: int, sleep: Callable[[float], None]
) -> Any:
    """The profile info of ``enum``: an error other than "not offered" (a transient driver error) is asked
    again ``retries`` times, 0.1 s, 0.2 s ... apart, before it is raised."""
    skip = _not_offered(nvml)
    for attempt in range(retries + 1):
        try:
            if version == 2:
                return nvml.nvmlDeviceGetGpuInstanceProfileInfoV(handle, enum)
            return nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum, version)
        except skip:
            raise
        except nvml.NVMLError:
            if attempt == retries:
                raise
            sleep(0.1 * 2**attempt)
    raise AssertionError("unreachable")


def read_nvml_profiles(
    nvml: ModuleType,
    handle: Any,
    *,
    version: int = 2,
    retries: int = 2,
    sleep: Callable[[float], None] = time.sleep,
) -> list[NvmlProfile]:
    """Every GPU-instance profile NVML offers on the GPU ``handle``, in enum order. Reads NVML only.

    ``version=2`` uses ``nvmlDeviceGetGpuInstanceProfileInfoV`` (needs MIG enabled; reports the name);
    ``version=1`` the unversioned call, which nvml.h does not tie to MIG mode but which has no name. An enum
    answered with ``NOT_SUPPORTED`` or ``INVALID_ARGUMENT`` is not offered; any other NVML error is asked
    again ``retries`` times (an error of a moment must not drop the profile from the table), then raised.
    A placement query NVML refuses (e.g. ``NoPermission``: it needs a privileged user) is recorded on the
    profile instead of aborting the table.
    """
    skip = _not_offered(nvml)
    out: list[NvmlProfile] = []
    for enum in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        try:
            info = _profile_info(nvml, handle, enum, version, retries, sleep)
        except skip:
            continue
        placements: tuple[tuple[int, int], ...] | None
        error: str | None = None
        try:
            placements = _placements(nvml, handle, int(info.id))
        except nvml.NVMLError as exc:
            placements, error = None, f"{_error_name(exc)}: {exc}"
        name = _text(info.name).removeprefix("MIG ").strip() if version >= 2 else None
        out.append(
            NvmlProfile(
                nvml_enum=enum,
                name=name or None,
                profile_id=int(info.id),
                compute_slices=int(info.sliceCount),
                max_instances=int(info.instanceCount),
                memory_mib=int(info.memorySizeMB),
                multiprocessors=int(info.multiprocessorCount),
                copy_engines=int(info.copyEngineCount),
                decoders=int(info.decoderCount),
                encoders=int(info.encoderCount),
                jpegs=int(info.jpegCount),
                ofas=int(info.ofaCount),
                placements=placements,
                placements_error=error,
            )
        )
    return out


def count_gpu_instances(nvml: ModuleType, handle: Any, profiles: Sequence[NvmlProfile]) -> int:
    """How many GPU instances exist on the GPU, over every profile NVML offers. Reads NVML (MIG enabled)."""
    total = 0
    for p in profiles:
        arr = (nvml.c_nvmlGpuInstance_t * max(1, p.max_instances))()
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetGpuInstances(handle, p.profile_id, arr, ctypes.byref(count))
        total += count.value
    return total


def _catalog_value(profile: Profile, name: str) -> Value:
    value: Value = getattr(profile, name)
    return value


def _nvml_value(profile: NvmlProfile, name: str) -> Value:
    value: Value = getattr(profile, name)
    return value


def diff_profiles(
    model: GpuModel,
    nvml_profiles: Sequence[NvmlProfile],
    *,
    memory_tolerance_mib: float = MEMORY_TOLERANCE_MIB,
) -> list[ProfileDifference]:
    """Differences between a catalog model and NVML's profile table, matched by NVML enum. Pure.

    Missing (catalog only) and extra (NVML only) profiles, then per matched profile each field of
    :data:`COMPARED_FIELDS` that differs (memory within ``memory_tolerance_mib``; the name only when NVML
    reported one), and placements NVML would not list as ``unreadable``. Ordered by enum, then field.
    """
    by_enum = {p.nvml_enum: p for p in nvml_profiles}
    catalog_enums = {p.nvml_enum for p in model.profiles}
    out: list[ProfileDifference] = []
    for p in sorted(model.profiles, key=lambda q: q.nvml_enum):
        reported = by_enum.get(p.nvml_enum)
        if reported is None:
            out.append(ProfileDifference("missing", p.name, p.nvml_enum, catalog=p.name))
            continue
        for name in COMPARED_FIELDS:
            mine, theirs = _catalog_value(p, name), _nvml_value(reported, name)
            if name == "name" and theirs is None:
                continue
            if name.startswith("placement_") and reported.placements is None:
                if name == "placement_starts":
                    error = reported.placements_error
                    out.append(ProfileDifference("unreadable", p.name, p.nvml_enum, "placements", nvml=error))
                continue
            if name == "memory_mib":
                assert isinstance(mine, int) and isinstance(theirs, int)
                same = abs(mine - theirs) <= memory_tolerance_mib
            else:
                same = mine == theirs
            if not same:
                out.append(ProfileDifference("mismatch", p.name, p.nvml_enum, name, mine, theirs))
    for r in nvml_profiles:
        if r.nvml_enum not in catalog_enums:
            label = r.name or f"profile id {r.profile_id}"
            out.append(ProfileDifference("extra", label, r.nvml_enum, nvml=r.name))
    return sorted(out, key=lambda d: d.nvml_enum)  # stable: fields keep COMPARED_FIELDS order
