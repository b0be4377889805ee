"""Integrity of the MIG geometry catalog (``dynamig.geometry.catalog``) for every GPU model.

Runs for real: the packaged YAML data files are loaded and checked. Nothing is simulated; no GPU is needed.
"""

from __future__ import annotations

import re

import pytest

from dynamig.geometry.catalog import (
    GI_PROFILE_ENUMS,
    CatalogError,
    build_catalog,
    load_catalog,
    media_of,
    pci_device_id_of,
)
from dynamig.geometry.layout import enumerate_layouts, is_valid
from dynamig.geometry.model import GpuModel, MediaExtension, PlacedInstance, device_name

EXPECTED_KEYS = {
    "A30-24GB", "A100-40GB", "A100-80GB", "H100-80GB", "H100-94GB", "H100-96GB", "H200-141GB",
    "H20-96GB", "B200-180GB", "GB200-186GB", "RTXPRO6000-96GB",
}  # fmt: skip

# Source keys of reference/mig-geometry.md's legend.
REFERENCE_SOURCES = {
    "DOC-PROF",
    "DOC-GS",
    "DOC-CONC",
    "VGPU-H",
    "NVML-H",
    "PYNVML",
    "MP",
    "DRA",
    "R-A100-80",
    "R-A100-80P",
    "R-A30",
    "R-H100",
    "R-H100NVL",
    "R-GH200",
    "R-GH200-144",
    "R-H200",
    "R-H20",
    "R-B200",
    "R-GB200",
    "R-RTX6K",
}

MODELS = load_catalog().models()


def test_catalog_has_exactly_the_required_models() -> None:
    assert set(load_catalog().keys()) == EXPECTED_KEYS
    assert load_catalog() is load_catalog()  # loaded once


def test_unknown_key_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="A100-80GB") as err:
        load_catalog().model("V100-32GB")
    assert "V100-32GB" in str(err.value)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.key)
def test_placements_fit_the_grid_and_counts_are_reachable(model: GpuModel) -> None:
    full = [p for p in model.profiles if p.placement_size == model.memory_slices]
    assert full, "a whole-GPU profile defines the slot count"
    for p in model.profiles:
        for start in p.placement_starts:
            assert start >= 0 and start + p.placement_size <= model.memory_slices, (p.name, start)
        assert p.compute_slices <= model.compute_slices
        assert p.max_instances <= len(p.placement_starts)
        # max_instances is reachable on an empty GPU: that many instances fit side by side.
        instances: list[PlacedInstance] = []
        for start in p.placement_starts:
            candidate = [*instances, PlacedInstance(start, p.name)]
            if is_valid(model, candidate):
                instances = candidate
        assert len(instances) == p.max_instances, (p.name, instances)
        assert p.memory_mib < model.memory_mib
        assert p.nvml_enum in GI_PROFILE_ENUMS.values()
        assert p.media is media_of(p.name)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.key)
def test_engine_totals_never_exceed_the_whole_gpu(model: GpuModel) -> None:
    """Resource arithmetic: no valid layout uses more SMs, compute slices or media engines than exist."""
    whole = max(model.profiles, key=lambda p: (p.placement_size, p.multiprocessors))
    for layout in enumerate_layouts(model, maximal=True):
        profiles = [model.profile(i.profile) for i in layout]
        assert sum(p.compute_slices for p in profiles) <= model.compute_slices, layout
        assert sum(p.multiprocessors for p in profiles) <= whole.multiprocessors, layout
        assert sum(p.ofas for p in profiles) <= max(1, whole.ofas), layout
        assert sum(p.memory_mib for p in profiles) <= model.memory_mib, layout


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.key)
def test_confirmed_flags_agree_with_inferred_fields(model: GpuModel) -> None:
    for p in model.profiles:
        assert p.confirmed == (not p.inferred), p.name
        assert p.source in REFERENCE_SOURCES, (p.name, p.source)
    assert set(model.sources) <= REFERENCE_SOURCES


def test_confirmation_matches_the_reference() -> None:
    cat = load_catalog()
    for key in ("A30-24GB", "A100-40GB", "H100-80GB", "H100-94GB", "RTXPRO6000-96GB"):
        assert cat.model(key).confirmed, key
    # Placements inferred for these models: every row stays unconfirmed until seen on hardware.
    for key in ("H100-96GB", "H200-141GB", "H20-96GB", "B200-180GB", "GB200-186GB"):
        model = cat.model(key)
        assert not any(p.confirmed for p in model.profiles), key
    h200 = cat.model("H200-141GB")
    assert all("placement_starts" in p.inferred for p in h200.profiles)
    a100_80 = cat.model("A100-80GB")
    assert [p.name for p in a100_80.profiles if not p.confirmed] == ["1g.20gb"]


def test_reference_rows_spot_checks() -> None:
    cat = load_catalog()
    a100 = cat.model("A100-40GB")
    assert a100.profile("1g.10gb").placement_size == 2
    assert a100.profile("1g.10gb").nvml_enum == GI_PROFILE_ENUMS["NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2"]
    assert a100.profile("3g.20gb").placement_starts == (0, 4)
    assert a100.profile("7g.40gb").memory_mib == 40192
    assert a100.profile_by_id(19).name == "1g.5gb"
    # Same name, different geometry on another model.
    assert cat.model("A100-80GB").profile("1g.10gb").placement_size == 1
    a30 = cat.model("A30-24GB")
    assert (a30.memory_slices, a30.profile_by_enum(0).profile_id) == (4, 14)
    h100 = cat.model("H100-80GB")
    assert [h100.profile(n).multiprocessors for n in ("1g.20gb", "3g.40gb", "7g.80gb")] == [26, 60, 132]
    rtx = cat.model("RTXPRO6000-96GB")
    assert rtx.memory_slices == 12
    assert rtx.profile("1g.24gb").placement_starts == (0, 3, 6, 9)
    assert rtx.profile("2g.48gb+me.all").media is MediaExtension.ME_ALL
    assert rtx.profile("4g.96gb").placement_size == 12


def test_for_product_by_name_and_pci_id() -> None:
    cat = load_catalog()
    assert cat.for_product("NVIDIA A100-SXM4-80GB") is cat.model("A100-80GB")
    assert cat.for_product("a100-sxm4-40gb") is cat.model("A100-40GB")  # old drivers omit "NVIDIA"
    assert cat.for_product("NVIDIA H100 NVL") is cat.model("H100-94GB")
    # NVML pciDeviceId = device << 16 | vendor; the id wins over an unknown name.
    assert cat.for_product("something", 0x233510DE) is cat.model("H200-141GB")
    assert cat.for_product("NVIDIA RTX PRO 6000 Blackwell Server Edition", 0x2BB5) is cat.model(
        "RTXPRO6000-96GB"
    )
    assert cat.for_product("NVIDIA Tesla V100-SXM2-16GB", 0x1DB1) is None
    assert pci_device_id_of(0x20B010DE) == 0x20B0 == pci_device_id_of(0x20B0)


def test_bad_data_is_refused_with_a_precise_message() -> None:
    doc = """
key: X
product_names: ["X"]
pci_device_ids: [1]
memory_slices: 8
compute_slices: 7
memory_mib: 1000
profiles:
  - {name: 7g.1gb, profile_id: 0, nvml_enum: NVML_GPU_INSTANCE_PROFILE_7_SLICE, compute_slices: 7,
     placement_starts: [1], placement_size: 8, max_instances: 1, multiprocessors: 1, copy_engines: 1,
     decoders: 0, encoders: 0, jpegs: 0, ofas: 0, memory_mib: 900, confirmed: true, source: T}
"""
    with pytest.raises(CatalogError, match=r"placement 1:8 leaves the 8-slice grid"):
        build_catalog([("x.yaml", doc)])
    with pytest.raises(CatalogError, match="confirmed=True but inferred"):
        build_catalog(
            [("x.yaml", doc.replace("[1]", "[0]").replace("source: T", "source: T, inferred: [x]"))]
        )
    with pytest.raises(CatalogError, match="does not match the name suffix"):
        build_catalog([("x.yaml", doc.replace("[1]", "[0]").replace("source: T", "source: T, media: '+me'"))])
    assert build_catalog([("x.yaml", doc.replace("[1]", "[0]"))]).model("X").profile("7g.1gb").ofas == 0


@pytest.mark.parametrize("model", load_catalog().models(), ids=lambda m: m.key)
def test_device_names_are_distinct_dns_labels(model: GpuModel) -> None:
    """Every (profile, start) of a model gets its own name: `+me` and `-me` profiles never collide."""
    names = [device_name(0, p.name, s) for p in model.profiles for s in p.placement_starts]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 63 for n in names), names


def test_media_engine_variants_are_named_apart() -> None:
    assert device_name(0, "1g.24gb+me", 3) == "gpu0-1g24gb-me-s3"
    assert device_name(0, "1g.24gb-me", 3) == "gpu0-1g24gb-nome-s3"
    assert device_name(1, "2g.48gb+gfx", 0) == "gpu1-2g48gb-gfx-s0"


def test_model_keys_are_matched_case_insensitively_when_typed() -> None:
    from dynamig.geometry.catalog import load_catalog

    catalog = load_catalog()
    assert catalog.model("a100-80gb").key == "A100-80GB"
    assert "a100-80gb" not in catalog  # membership stays exact: stored keys are canonical
    with pytest.raises(KeyError, match="unknown GPU model 'a100-90gb'"):
        catalog.model("a100-90gb")
