"""A GPU's profile table read from NVML (``dynamig.agent.nvml.catalog``) and its diff against the catalog.

Real: the NVML calls (``nvmlDeviceGetGpuInstanceProfileInfoV`` over every enum, possible placements with the
count-then-array protocol), the catalog, the pure diff. Simulated: the GPUs, through
``dynamig.backends.simnvml``.

The simulator serves its profile tables from the catalog itself, so "no differences on every model" below is a
self-consistency check of the reading and diffing code, not evidence that the catalog is right. The
independent check of the catalog is ``test_geometry_reference.py`` (NVIDIA's published tables).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from dynamig.agent.nvml.catalog import (
    MEMORY_TOLERANCE_MIB,
    NvmlProfile,
    ProfileDifference,
    count_gpu_instances,
    diff_profiles,
    read_nvml_profiles,
)
from dynamig.agent.nvml.device import NvmlDevices
from dynamig.backends.nvml import load_nvml
from dynamig.geometry.catalog import GI_PROFILE_ENUMS, load_catalog
from dynamig.geometry.model import GpuModel, PlacedInstance

CATALOG = load_catalog()
KEYS = CATALOG.keys()


@pytest.fixture
def nvml() -> Iterator[ModuleType]:
    module: ModuleType = load_nvml("simulated")
    module.configure(gpus=list(KEYS), state_file=None)  # one GPU of every catalog model, in key order
    module.nvmlInit()
    yield module
    module.nvmlShutdown()
    module.configure(gpus=[], state_file=None)


def _profiles(nvml: ModuleType, key: str, version: int = 2) -> list[NvmlProfile]:
    return read_nvml_profiles(nvml, nvml.nvmlDeviceGetHandleByIndex(KEYS.index(key)), version=version)


@pytest.mark.parametrize("key", KEYS, ids=str)
def test_nvml_table_equals_catalog_for_every_model(nvml: ModuleType, key: str) -> None:
    # Self-consistency only (the simulator serves the catalog); test_geometry_reference is the real check.
    model = CATALOG.model(key)
    reported = _profiles(nvml, key)
    assert [p.nvml_enum for p in reported] == sorted(p.nvml_enum for p in model.profiles)
    assert diff_profiles(model, reported) == []


def test_reads_every_field_nvml_reports(nvml: ModuleType) -> None:
    by_name = {p.name: p for p in _profiles(nvml, "A100-80GB")}
    assert set(by_name) == {p.name for p in CATALOG.model("A100-80GB").profiles}
    double = by_name["1g.20gb"]
    assert double == NvmlProfile(
        nvml_enum=GI_PROFILE_ENUMS["NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2"], name="1g.20gb", profile_id=15,
        compute_slices=1, max_instances=4, memory_mib=19968, multiprocessors=14, copy_engines=1, decoders=1,
        encoders=0, jpegs=0, ofas=0, placements=((0, 2), (2, 2), (4, 2), (6, 2)),
    )  # fmt: skip
    assert double.placement_starts == (0, 2, 4, 6) and double.placement_size == 2
    whole = by_name["7g.80gb"]
    assert (whole.profile_id, whole.placements, whole.multiprocessors) == (0, ((0, 8),), 98)


def test_rtx_pro_6000_offers_its_graphics_and_media_enums(nvml: ModuleType) -> None:
    enums = {p.nvml_enum: p for p in _profiles(nvml, "RTXPRO6000-96GB")}
    gfx = enums[GI_PROFILE_ENUMS["NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX"]]
    assert (gfx.name, gfx.profile_id, gfx.placements) == ("4g.96gb+gfx", 32, ((0, 12),))
    assert GI_PROFILE_ENUMS["NVML_GPU_INSTANCE_PROFILE_7_SLICE"] not in enums  # NOT_SUPPORTED: skipped


def test_mig_disabled_gpu_answers_only_the_unversioned_call(nvml: ModuleType) -> None:
    nvml.configure(gpus=["H100-80GB"], state_file=None, mig_enabled=False)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert read_nvml_profiles(nvml, handle) == []  # ...InfoV needs MIG enabled: NOT_SUPPORTED everywhere
    v1 = read_nvml_profiles(nvml, handle, version=1)
    assert v1 and all(p.name is None for p in v1)
    assert diff_profiles(CATALOG.model("H100-80GB"), v1) == []  # names are not compared when NVML gives none


def test_refused_placements_are_reported_not_raised(
    nvml: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_permission(*args: Any) -> int:
        raise nvml.NVMLError_NoPermission(nvml.NVML_ERROR_NO_PERMISSION)

    monkeypatch.setattr(nvml, "nvmlDeviceGetGpuInstancePossiblePlacements", no_permission)
    reported = _profiles(nvml, "A30-24GB")
    assert reported and all(
        p.placements is None and "NoPermission" in str(p.placements_error) for p in reported
    )
    diffs = diff_profiles(CATALOG.model("A30-24GB"), reported)
    assert {d.kind for d in diffs} == {"unreadable"} and len(diffs) == len(reported)
    assert "NVML did not report placements: NoPermission" in diffs[0].describe()


def test_counts_gpu_instances_over_every_profile(nvml: ModuleType) -> None:
    devices = NvmlDevices(nvml, CATALOG)
    index = KEYS.index("H100-80GB")
    gpu = devices.gpu(index)
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    reported = read_nvml_profiles(nvml, handle)
    assert count_gpu_instances(nvml, handle, reported) == 0
    devices.create(gpu, PlacedInstance(0, "1g.10gb"))
    devices.create(gpu, PlacedInstance(4, "3g.40gb"))
    assert count_gpu_instances(nvml, handle, reported) == 2


# --- the pure diff -------------------------------------------------------------------------------------


def _reported(model: GpuModel) -> list[NvmlProfile]:
    """What an NVML agreeing with ``model`` would report."""
    return [
        NvmlProfile(
            nvml_enum=p.nvml_enum,
            name=p.name,
            profile_id=p.profile_id,
            compute_slices=p.compute_slices,
            max_instances=p.max_instances,
            memory_mib=p.memory_mib,
            multiprocessors=p.multiprocessors,
            copy_engines=p.copy_engines,
            decoders=p.decoders,
            encoders=p.encoders,
            jpegs=p.jpegs,
            ofas=p.ofas,
            placements=tuple((s, p.placement_size) for s in p.placement_starts),
        )
        for p in model.profiles
    ]


def test_diff_reports_missing_extra_and_each_differing_field_with_both_values() -> None:
    model = CATALOG.model("H100-80GB")
    reported = _reported(model)
    by_name = {p.name: i for i, p in enumerate(reported)}
    three = reported[by_name["3g.40gb"]]
    reported[by_name["3g.40gb"]] = dataclasses.replace(
        three, profile_id=10, multiprocessors=64, placements=((0, 4), (2, 4), (4, 4))
    )
    one = reported[by_name["1g.10gb"]]
    reported[by_name["1g.10gb"]] = dataclasses.replace(one, name="1g.12gb", memory_mib=one.memory_mib + 256)
    del reported[by_name["1g.10gb+me"]]
    gfx = GI_PROFILE_ENUMS["NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX"]
    reported.append(dataclasses.replace(one, nvml_enum=gfx, name="1g.10gb+gfx", profile_id=47))

    diffs = diff_profiles(model, reported)
    assert diffs == [
        ProfileDifference("mismatch", "1g.10gb", 0x0, "name", "1g.10gb", "1g.12gb"),
        ProfileDifference("mismatch", "1g.10gb", 0x0, "memory_mib", 9984, 10240),
        ProfileDifference("mismatch", "3g.40gb", 0x2, "profile_id", 9, 10),
        ProfileDifference("mismatch", "3g.40gb", 0x2, "multiprocessors", 60, 64),
        ProfileDifference("mismatch", "3g.40gb", 0x2, "placement_starts", (0, 4), (0, 2, 4)),
        ProfileDifference("missing", "1g.10gb+me", 0x7, catalog="1g.10gb+me"),
        ProfileDifference("extra", "1g.10gb+gfx", gfx, nvml="1g.10gb+gfx"),
    ]
    assert [d.describe() for d in diffs[4:]] == [
        "3g.40gb (enum 0x2): placement_starts: catalog 0,4, NVML 0,2,4",
        "1g.10gb+me (enum 0x7): in the catalog, not offered by NVML",
        "1g.10gb+gfx (enum 0xa): offered by NVML, not in the catalog",
    ]


def test_memory_is_compared_within_the_precision_the_catalog_was_transcribed_at() -> None:
    model = CATALOG.model("A30-24GB")  # MiB from nvidia-smi's two-decimal GiB (e.g. 5.81 GiB -> 5949)
    assert round(MEMORY_TOLERANCE_MIB, 2) == 5.12
    for delta, differs in ((5, False), (-5, False), (6, True), (-6, True)):
        reported = [dataclasses.replace(p, memory_mib=p.memory_mib + delta) for p in _reported(model)]
        diffs = diff_profiles(model, reported)
        assert bool(diffs) is differs, delta
        assert all(d.field == "memory_mib" for d in diffs)


def test_mixed_placement_sizes_are_a_difference() -> None:
    model = CATALOG.model("A100-40GB")
    reported = _reported(model)
    reported[0] = dataclasses.replace(reported[0], placements=((0, 1), (1, 2)))
    diffs = diff_profiles(model, reported)
    sizes = [d for d in diffs if d.field == "placement_size"]
    assert sizes == [ProfileDifference("mismatch", "1g.5gb", 0x0, "placement_size", 1, (1, 2))]


def test_a_transient_error_on_one_profile_is_asked_again_and_a_lasting_one_raised(nvml: ModuleType) -> None:
    enum = CATALOG.model("A100-80GB").profile("3g.40gb").nvml_enum
    handle = nvml.nvmlDeviceGetHandleByIndex(KEYS.index("A100-80GB"))
    waited: list[float] = []
    nvml.fail_next("nvmlDeviceGetGpuInstanceProfileInfo", nvml.NVML_ERROR_TIMEOUT, times=2, profile=enum)
    reported = read_nvml_profiles(nvml, handle, sleep=waited.append)
    assert enum in {p.nvml_enum for p in reported}, "a transient error dropped the profile"
    assert diff_profiles(CATALOG.model("A100-80GB"), reported) == [] and waited == [0.1, 0.2]
    nvml.fail_next("nvmlDeviceGetGpuInstanceProfileInfo", nvml.NVML_ERROR_TIMEOUT, times=3, profile=enum)
    with pytest.raises(nvml.NVMLError_Timeout):
        read_nvml_profiles(nvml, handle, sleep=waited.append)
