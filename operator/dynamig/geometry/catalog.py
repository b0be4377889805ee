"""The MIG geometry catalog: every supported GPU model, loaded once from the YAML files in ``geometry/data/``.

The data files are the single place where profile tables live (one file per model, transcribed from
``reference/mig-geometry.md`` with the source of every row). This module only parses and checks them:
structural errors (unknown NVML enum, a placement that leaves the slice grid, a media suffix that does not
match the profile name, ``confirmed`` disagreeing with ``inferred``) raise :class:`CatalogError` at load time,
so a bad edit fails the first test that touches the catalog.

``load_catalog()`` reads package data (file I/O) once and caches the result; everything else is pure.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from dynamig.geometry.model import GpuModel, MediaExtension, Profile

# NVML_GPU_INSTANCE_PROFILE_* values (nvml.h; identical in pynvml, which geometry must not import).
GI_PROFILE_ENUMS: Mapping[str, int] = {
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE": 0x0,
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE": 0x1,
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE": 0x2,
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE": 0x3,
    "NVML_GPU_INSTANCE_PROFILE_7_SLICE": 0x4,
    "NVML_GPU_INSTANCE_PROFILE_8_SLICE": 0x5,
    "NVML_GPU_INSTANCE_PROFILE_6_SLICE": 0x6,
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1": 0x7,
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1": 0x8,
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2": 0x9,
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX": 0xA,
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX": 0xB,
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX": 0xC,
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME": 0xD,
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME": 0xE,
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME": 0xF,
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME": 0x10,
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX": 0x11,
}
GI_PROFILE_COUNT = 0x12

_PROFILE_FIELDS = frozenset(
    {
        "name", "profile_id", "nvml_enum", "compute_slices", "placement_starts", "placement_size",
        "max_instances", "multiprocessors", "copy_engines", "decoders", "encoders", "jpegs", "ofas",
        "memory_mib", "media", "confirmed", "inferred", "source",
    }
)  # fmt: skip
_MODEL_FIELDS = frozenset(
    {
        "key", "product_names", "pci_device_ids", "memory_slices", "compute_slices", "memory_mib",
        "sources", "notes", "profiles",
    }
)  # fmt: skip


class CatalogError(ValueError):
    """A catalog data file is malformed or inconsistent."""


def media_of(profile_name: str) -> MediaExtension:
    """The media extension a profile name's suffix denotes (``1g.24gb+me.all`` -> ``+me.all``). Pure."""
    for ext in (MediaExtension.ME_ALL, MediaExtension.ME, MediaExtension.NO_ME, MediaExtension.GFX):
        if profile_name.endswith(ext.value):
            return ext
    return MediaExtension.NONE


def pci_device_id_of(value: int) -> int:
    """The 16-bit PCI device id from either the bare id (``0x20B0``) or NVML's ``pciDeviceId``
    (``(device << 16) | vendor``, e.g. ``0x20B010DE``). Pure."""
    return value >> 16 if value > 0xFFFF else value


def _normalize_product(name: str) -> str:
    name = " ".join(name.split()).lower()
    return name.removeprefix("nvidia ")


@dataclass(frozen=True)
class Catalog:
    """All GPU models by catalog key, in file-name order."""

    _models: Mapping[str, GpuModel]
    _by_product: Mapping[str, GpuModel] = field(init=False, repr=False, compare=False)
    _by_pci: Mapping[int, GpuModel] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_product: dict[str, GpuModel] = {}
        by_pci: dict[int, GpuModel] = {}
        for model in self._models.values():
            for name in model.product_names:
                norm = _normalize_product(name)
                if norm in by_product and by_product[norm] is not model:
                    raise CatalogError(
                        f"product name {name!r} is listed by both {by_product[norm].key} and {model.key}"
                    )
                by_product[norm] = model
            for pci in model.pci_device_ids:
                if pci in by_pci:
                    raise CatalogError(
                        f"PCI device id {pci:#06x} listed by {by_pci[pci].key} and {model.key}"
                    )
                by_pci[pci] = model
        object.__setattr__(self, "_by_product", by_product)
        object.__setattr__(self, "_by_pci", by_pci)

    def keys(self) -> tuple[str, ...]:
        return tuple(self._models)

    def models(self) -> tuple[GpuModel, ...]:
        return tuple(self._models.values())

    def model(self, key: str) -> GpuModel:
        """The model with catalog key ``key``, matched case-insensitively when no key matches exactly (what a
        person types: ``a100-80gb``); KeyError listing the known keys otherwise."""
        found = self._models.get(key)
        if found is None:
            found = next((m for k, m in self._models.items() if k.lower() == key.lower()), None)
        if found is None:
            raise KeyError(f"unknown GPU model {key!r} (known: {', '.join(self._models)})")
        return found

    def __contains__(self, key: object) -> bool:
        return key in self._models

    def for_product(self, product_name: str, pci_device_id: int | None = None) -> GpuModel | None:
        """The model for an NVML product name and/or PCI device id, or None if the catalog lacks it.

        The PCI device id wins when both are known (several SKUs share marketing names); it may be the bare
        16-bit id or NVML's ``pciDeviceId`` (device << 16 | vendor). Names match case-insensitively, with or
        without the ``NVIDIA`` prefix older drivers omit.
        """
        if pci_device_id is not None:
            found = self._by_pci.get(pci_device_id_of(pci_device_id))
            if found is not None:
                return found
        return self._by_product.get(_normalize_product(product_name))


def _require(doc: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in doc:
        raise CatalogError(f"{where}: missing field {key!r}")
    return doc[key]


def _int(doc: Mapping[str, Any], key: str, where: str) -> int:
    value = _require(doc, key, where)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CatalogError(f"{where}: field {key!r} must be an integer, got {value!r}")
    return value


def _ints(doc: Mapping[str, Any], key: str, where: str) -> tuple[int, ...]:
    value = _require(doc, key, where)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise CatalogError(f"{where}: field {key!r} must be a list of integers, got {value!r}")
    return tuple(value)


def _strs(
    doc: Mapping[str, Any], key: str, where: str, default: Iterable[str] | None = None
) -> tuple[str, ...]:
    if key not in doc and default is not None:
        return tuple(default)
    value = _require(doc, key, where)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CatalogError(f"{where}: field {key!r} must be a list of strings, got {value!r}")
    return tuple(value)


def _parse_profile(doc: Mapping[str, Any], memory_slices: int, where: str) -> Profile:
    unknown = set(doc) - _PROFILE_FIELDS
    if unknown:
        raise CatalogError(f"{where}: unknown fields {sorted(unknown)}")
    name = _require(doc, "name", where)
    if not isinstance(name, str):
        raise CatalogError(f"{where}: name must be a string")
    where = f"{where} ({name})"
    enum_name = _require(doc, "nvml_enum", where)
    if enum_name not in GI_PROFILE_ENUMS:
        raise CatalogError(f"{where}: unknown NVML enum {enum_name!r}")
    media = MediaExtension(doc.get("media", ""))
    if media is not media_of(name):
        raise CatalogError(f"{where}: media {media.value!r} does not match the name suffix")
    confirmed = _require(doc, "confirmed", where)
    if not isinstance(confirmed, bool):
        raise CatalogError(f"{where}: confirmed must be true or false")
    inferred = _strs(doc, "inferred", where, default=())
    if confirmed == bool(inferred):
        raise CatalogError(f"{where}: confirmed={confirmed} but inferred={list(inferred)}")
    bad_fields = set(inferred) - _PROFILE_FIELDS
    if bad_fields:
        raise CatalogError(f"{where}: inferred names unknown fields {sorted(bad_fields)}")
    size = _int(doc, "placement_size", where)
    starts = _ints(doc, "placement_starts", where)
    if not starts or list(starts) != sorted(set(starts)):
        raise CatalogError(f"{where}: placement_starts must be non-empty, sorted and unique")
    for start in starts:
        if start < 0 or start + size > memory_slices:
            raise CatalogError(f"{where}: placement {start}:{size} leaves the {memory_slices}-slice grid")
    profile = Profile(
        name=name,
        nvml_enum=GI_PROFILE_ENUMS[enum_name],
        profile_id=_int(doc, "profile_id", where),
        compute_slices=_int(doc, "compute_slices", where),
        placement_starts=starts,
        placement_size=size,
        max_instances=_int(doc, "max_instances", where),
        memory_mib=_int(doc, "memory_mib", where),
        multiprocessors=_int(doc, "multiprocessors", where),
        copy_engines=_int(doc, "copy_engines", where),
        decoders=_int(doc, "decoders", where),
        encoders=_int(doc, "encoders", where),
        jpegs=_int(doc, "jpegs", where),
        ofas=_int(doc, "ofas", where),
        media=media,
        confirmed=confirmed,
        source=str(_require(doc, "source", where)),
        inferred=inferred,
    )
    if profile.max_instances < 1 or profile.placement_size < 1 or profile.compute_slices < 1:
        raise CatalogError(f"{where}: max_instances, placement_size and compute_slices must be >= 1")
    return profile


def parse_model(doc: Mapping[str, Any], where: str = "<model>") -> GpuModel:
    """Build a :class:`GpuModel` from one parsed data file; CatalogError on any inconsistency. Pure."""
    unknown = set(doc) - _MODEL_FIELDS
    if unknown:
        raise CatalogError(f"{where}: unknown fields {sorted(unknown)}")
    key = _require(doc, "key", where)
    if not isinstance(key, str):
        raise CatalogError(f"{where}: key must be a string")
    memory_slices = _int(doc, "memory_slices", where)
    compute_slices = _int(doc, "compute_slices", where)
    raw_profiles = _require(doc, "profiles", where)
    if not isinstance(raw_profiles, list) or not raw_profiles:
        raise CatalogError(f"{where}: profiles must be a non-empty list")
    profiles = tuple(
        _parse_profile(p, memory_slices, f"{where}: profiles[{i}]") for i, p in enumerate(raw_profiles)
    )
    for attr in ("name", "profile_id", "nvml_enum"):
        values = [getattr(p, attr) for p in profiles]
        if len(values) != len(set(values)):
            raise CatalogError(f"{where}: duplicate profile {attr} in {values}")
    for p in profiles:
        if p.compute_slices > compute_slices:
            raise CatalogError(f"{where}: {p.name} has more compute slices than the GPU ({compute_slices})")
    max_size = max(p.placement_size for p in profiles)
    if max_size != memory_slices:
        # DRA derives the slot count as the largest placement size; the data must agree.
        raise CatalogError(f"{where}: largest placement size {max_size} != memory_slices {memory_slices}")
    return GpuModel(
        key=key,
        product_names=_strs(doc, "product_names", where),
        pci_device_ids=_ints(doc, "pci_device_ids", where),
        memory_slices=memory_slices,
        compute_slices=compute_slices,
        memory_mib=_int(doc, "memory_mib", where),
        profiles=profiles,
        sources=_strs(doc, "sources", where, default=()),
        notes=_strs(doc, "notes", where, default=()),
    )


def _read_data_files() -> list[tuple[str, str]]:
    data = resources.files("dynamig.geometry").joinpath("data")
    files = sorted((f for f in data.iterdir() if f.name.endswith(".yaml")), key=lambda f: f.name)
    return [(f.name, f.read_text(encoding="utf-8")) for f in files]


def build_catalog(documents: Iterable[tuple[str, str]]) -> Catalog:
    """Parse (file name, YAML text) pairs into a Catalog. Pure (no file access)."""
    models: dict[str, GpuModel] = {}
    for name, text in documents:
        doc = yaml.safe_load(text)
        if not isinstance(doc, dict):
            raise CatalogError(f"{name}: expected a mapping at top level")
        model = parse_model(doc, name)
        if model.key in models:
            raise CatalogError(f"{name}: duplicate model key {model.key}")
        models[model.key] = model
    if not models:
        raise CatalogError("no GPU models in the catalog")
    return Catalog(models)


@functools.cache
def load_catalog() -> Catalog:
    """The packaged catalog. Reads ``geometry/data/*.yaml`` on the first call only; cached afterwards."""
    return build_catalog(_read_data_files())
