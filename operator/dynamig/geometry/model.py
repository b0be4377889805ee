"""MIG geometry types: GPU models, GI profiles, placed instances. Pure data, no I/O.

A *placement* is counted in memory slices (NVML `nvmlGpuInstancePlacement_t`): an instance of a profile
occupies memory slices ``[start, start + placement_size)``. Profile names are not unique across models
(``1g.10gb`` is size 1 on A100-80GB but size 2 on A100-40GB), so a profile is always looked up through
its ``GpuModel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class MediaExtension(StrEnum):
    """What a profile's name suffix says about media engines (go-nvlib naming)."""

    NONE = ""
    ME = "+me"  # at least one of each media engine; at most one such instance per GPU
    ME_ALL = "+me.all"  # all media engines; excludes every profile but the ``-me`` ones
    NO_ME = "-me"  # no media engines
    GFX = "+gfx"  # graphics-capable


@dataclass(frozen=True, slots=True)
class Profile:
    """One GPU-instance profile of one GPU model, as ``nvidia-smi mig -lgip/-lgipp`` shows it."""

    name: str  # "1g.10gb"
    nvml_enum: int  # NVML_GPU_INSTANCE_PROFILE_* value passed to nvmlDeviceGetGpuInstanceProfileInfo
    profile_id: int  # info.id, the lgip ID passed to create/placement calls
    compute_slices: int
    placement_starts: tuple[int, ...]
    placement_size: int  # memory slices occupied
    max_instances: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    media: MediaExtension = MediaExtension.NONE
    confirmed: bool = True  # False where the reference marks the row inferred
    source: str = ""
    inferred: tuple[str, ...] = ()  # names of the fields the reference infers (empty when confirmed)

    def span(self, start: int) -> range:
        """Memory slices an instance placed at ``start`` occupies."""
        return range(start, start + self.placement_size)

    def mask(self, start: int) -> int:
        """Bit mask of the memory slices an instance placed at ``start`` occupies (bit i = slice i). Pure."""
        return ((1 << self.placement_size) - 1) << start


@dataclass(frozen=True, slots=True)
class GpuModel:
    """A MIG-capable GPU model: its slice grid and its profiles (catalog key e.g. ``A100-80GB``)."""

    key: str
    product_names: tuple[str, ...]  # NVML product names that map to this key
    pci_device_ids: tuple[int, ...]
    memory_slices: int  # placement units: 8, 4 (A30) or 12 (RTX PRO 6000)
    compute_slices: int
    memory_mib: int
    profiles: tuple[Profile, ...]
    sources: tuple[str, ...] = ()  # reference source keys for the model as a whole
    notes: tuple[str, ...] = ()  # driver requirements and caveats from the reference
    _by_name: dict[str, Profile] = field(init=False, repr=False, compare=False, hash=False)
    # Tables other geometry modules derive from this model once (e.g. placement bit masks); lives and dies
    # with the model, so models built on the fly (dataclasses.replace) do not accumulate in a global cache.
    _derived: dict[str, object] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {p.name: p for p in self.profiles})
        object.__setattr__(self, "_derived", {})

    def profile(self, name: str) -> Profile:
        """The profile called ``name``; KeyError naming the model if it has none."""
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(p.name for p in self.profiles)
            raise KeyError(f"GPU model {self.key} has no MIG profile {name!r} (known: {known})") from None

    def has_profile(self, name: str) -> bool:
        return name in self._by_name

    @property
    def product_name(self) -> str:
        """The canonical NVML product name (the first listed)."""
        return self.product_names[0]

    @property
    def confirmed(self) -> bool:
        """True when every profile row of this model is confirmed by a real transcript or NVIDIA table."""
        return all(p.confirmed for p in self.profiles)

    def profile_by_enum(self, nvml_enum: int) -> Profile:
        """The profile with NVML_GPU_INSTANCE_PROFILE_* value ``nvml_enum``; KeyError if unsupported."""
        for p in self.profiles:
            if p.nvml_enum == nvml_enum:
                return p
        raise KeyError(f"GPU model {self.key} has no GI profile with NVML enum {nvml_enum:#x}")

    def profile_by_id(self, profile_id: int) -> Profile:
        for p in self.profiles:
            if p.profile_id == profile_id:
                return p
        raise KeyError(f"GPU model {self.key} has no GI profile id {profile_id}")


@dataclass(frozen=True, slots=True, order=True)
class PlacedInstance:
    """A GPU instance of ``profile`` at memory-slice ``start``. Sorted by start, then profile."""

    start: int
    profile: str


Layout = tuple[PlacedInstance, ...]
"""A GPU's MIG layout, kept sorted (``normalize_layout``) so equal layouts compare equal."""


def normalize_layout(instances: tuple[PlacedInstance, ...] | list[PlacedInstance]) -> Layout:
    return tuple(sorted(instances))


def device_name(gpu_index: int, profile: str, start: int) -> str:
    """Deterministic DRA device name for a placement, e.g. ``gpu0-1g10gb-s6`` (DNS-label safe).

    Profiles that differ only in ``+me`` (with the media engines) and ``-me`` (without any) get distinct
    names: ``1g24gb-me`` and ``1g24gb-nome``; other ``+`` suffixes keep their word (``2g48gb-gfx``).
    """
    slug = profile.lower().replace(".", "")
    if slug.endswith("-me"):
        slug = slug.removesuffix("-me") + "-nome"
    return f"gpu{gpu_index}-{slug.replace('+', '-')}-s{start}"


def placement_of(name: str, gpu_index: int, model: GpuModel) -> PlacedInstance | None:
    """The placement device ``name`` denotes on GPU ``gpu_index`` of ``model``, or None: the inverse of
    :func:`device_name`, found by building the names rather than parsing them. Pure."""
    if not name.startswith(f"gpu{gpu_index}-"):
        return None
    for p in model.profiles:
        for start in p.placement_starts:
            if device_name(gpu_index, p.name, start) == name:
                return PlacedInstance(start, p.name)
    return None
