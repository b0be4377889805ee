"""Layout validity and enumeration (``dynamig.geometry.layout``) on the packaged catalog.

Runs for real: the catalog data and the pure layout functions. Nothing is simulated; no GPU is needed.
The maximal-layout counts are the reference's exhaustive-search figures (mig-geometry.md section 1.7).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import (
    check_layout,
    enumerate_layouts,
    format_layout,
    free_starts,
    is_valid,
    occupied_slices,
    parse_layout,
    remaining_capacity,
)
from dynamig.geometry.model import GpuModel, PlacedInstance

CAT = load_catalog()
A100 = CAT.model("A100-40GB")
A30 = CAT.model("A30-24GB")
RTX = CAT.model("RTXPRO6000-96GB")
ORIGINAL_FIVE = ("1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")


def L(text: str) -> tuple[PlacedInstance, ...]:
    return parse_layout(text)


def test_a100_original_five_profiles_give_19_maximal_layouts() -> None:
    layouts = list(enumerate_layouts(A100, ORIGINAL_FIVE, maximal=True))
    assert len(layouts) == 19
    assert len(set(layouts)) == 19
    text = {format_layout(lay) for lay in layouts}
    # A few of the reference's named layouts, including the R510+ 4g+3g combination.
    assert {"7g.40gb@0", "4g.20gb@0,3g.20gb@4", "3g.20gb@0,3g.20gb@4",
            "2g.10gb@0,2g.10gb@2,2g.10gb@4,1g.5gb@6"} <= text  # fmt: skip
    assert "1g.5gb@0,1g.5gb@1,1g.5gb@2,1g.5gb@3,1g.5gb@4,1g.5gb@5,1g.5gb@6" in text


def test_adding_1g10gb_gives_78_and_1g5gb_me_gives_239() -> None:
    assert sum(1 for _ in enumerate_layouts(A100, (*ORIGINAL_FIVE, "1g.10gb"), maximal=True)) == 78
    with_me = (*ORIGINAL_FIVE, "1g.10gb", "1g.5gb+me")
    assert sum(1 for _ in enumerate_layouts(A100, with_me, maximal=True)) == 239


def _brute_force(model: GpuModel, profiles: tuple[str, ...]) -> set[tuple[PlacedInstance, ...]]:
    """Every subset of candidate placements, filtered by check_layout (independent of the DFS)."""
    cands = sorted(PlacedInstance(s, n) for n in profiles for s in model.profile(n).placement_starts)
    found = set()
    most = model.memory_slices // min(model.profile(n).placement_size for n in profiles)
    for r in range(1, most + 1):
        for combo in itertools.combinations(cands, r):
            if check_layout(model, combo) is None:
                found.add(combo)
    return found


@pytest.mark.parametrize(
    ("model", "profiles"),
    [
        (A100, ORIGINAL_FIVE),
        (A30, tuple(p.name for p in A30.profiles)),
        (RTX, tuple(p.name for p in RTX.profiles)),
    ],
    ids=["A100-5", "A30-all", "RTX-all"],
)
def test_enumeration_matches_brute_force(model: GpuModel, profiles: tuple[str, ...]) -> None:
    expected = _brute_force(model, profiles)
    got = list(enumerate_layouts(model, profiles))
    assert len(got) == len(set(got)) and set(got) == expected
    maximal = {
        lay for lay in expected
        if not any(is_valid(model, (*lay, PlacedInstance(s, n)))
                   for n in profiles for s in model.profile(n).placement_starts)
    }  # fmt: skip
    assert set(enumerate_layouts(model, profiles, maximal=True)) == maximal


@pytest.mark.parametrize(
    ("layout", "rule", "message"),
    [
        ("3g.20gb@2", "disallowed-start", "3g.20gb@2: start 2 is not an allowed placement (allowed: 0, 4)"),
        ("3g.20gb@0,1g.5gb@3", "overlap", "1g.5gb@3: overlaps 3g.20gb@0 on memory slice 3"),
        ("4g.20gb@0,3g.20gb@0", "overlap", "4g.20gb@0: overlaps 3g.20gb@0 on memory slices 0-3"),
        ("3g.20gb@6", "out-of-range", "3g.20gb@6: start 6 with size 4 does not fit the 8 memory slices"),
        (
            "2g.10gb@6",
            "disallowed-start",
            "2g.10gb@6: start 6 is not an allowed placement (allowed: 0, 2, 4)",
        ),
        ("1g.5gb@9", "out-of-range", "1g.5gb@9: start 9 with size 1 does not fit"),
        ("1g.40gb@0", "unknown-profile", "1g.40gb@0: A100-40GB has no MIG profile '1g.40gb'"),
        ("1g.5gb+me@0,1g.5gb+me@1", "max-instances", "1g.5gb+me@1: at most 1 instance(s) of 1g.5gb+me"),
        ("1g.5gb@0,1g.5gb@0", "overlap", "1g.5gb@0: overlaps 1g.5gb@0 on memory slice 0"),
    ],
)
def test_check_layout_names_the_rule(layout: str, rule: str, message: str) -> None:
    violation = check_layout(A100, L(layout))
    assert violation is not None
    assert violation.rule == rule
    assert violation.message.startswith(message), violation.message
    assert violation.instance is not None and violation.instance.profile in layout


def test_media_rules() -> None:
    # A30: one JPEG/OFA in total, so the two +me profiles exclude each other.
    v = check_layout(A30, L("1g.6gb+me@0,2g.12gb+me@2"))
    assert v is not None and v.rule == "media-exclusive" and "1g.6gb+me@0" in v.message
    assert is_valid(A30, L("1g.6gb+me@0,1g.6gb@1,2g.12gb@2"))
    # RTX PRO 6000: +me.all only beside -me profiles, in either order.
    assert is_valid(RTX, L("1g.24gb+me.all@0,1g.24gb-me@3,2g.48gb-me@6"))
    for bad in (
        "1g.24gb+me.all@0,1g.24gb@3",
        "1g.24gb@0,1g.24gb+me.all@3",
        "1g.24gb+me@0,2g.48gb+me.all@6",
        "1g.24gb+me.all@0,2g.48gb+me.all@6",
        "1g.24gb+me.all@0,1g.24gb+gfx@3",
    ):
        v = check_layout(RTX, L(bad))
        assert v is not None and v.rule == "media-exclusive", (bad, v)
    assert is_valid(RTX, L("1g.24gb+me@0,1g.24gb@3,1g.24gb-me@6,1g.24gb+gfx@9"))
    assert free_starts(RTX, L("1g.24gb+me.all@0"), "1g.24gb") == ()
    assert free_starts(RTX, L("1g.24gb+me.all@0"), "1g.24gb-me") == (3, 6, 9)
    assert free_starts(RTX, L("1g.24gb@0"), "2g.48gb+me.all") == ()


def test_free_starts_and_occupied_slices() -> None:
    lay = L("3g.20gb@0")
    assert occupied_slices(A100, lay) == frozenset(range(4))
    assert free_starts(A100, lay, "1g.5gb") == (4, 5, 6)  # not 3: 3g@0 holds memory slice 3
    assert free_starts(A100, lay, "1g.10gb") == (4, 6)
    assert free_starts(A100, lay, "3g.20gb") == (4,)
    assert free_starts(A100, lay, "4g.20gb") == ()
    assert free_starts(A100, (), "7g.40gb") == (0,)
    assert free_starts(A100, L("1g.5gb+me@6"), "1g.5gb+me") == ()  # max 1
    assert free_starts(A100, L("3g.20gb@2"), "1g.5gb") == ()  # invalid layout: nothing can be added
    with pytest.raises(KeyError, match="no MIG profile"):
        free_starts(A100, lay, "9g.1tb")
    assert occupied_slices(A100, L("7g.40gb@0")) == frozenset(range(8))


def test_remaining_capacity() -> None:
    assert remaining_capacity(A100, (), "1g.5gb") == 7
    assert remaining_capacity(A100, (), "1g.10gb") == 4
    assert remaining_capacity(A100, L("3g.20gb@0"), "1g.5gb") == 3
    assert remaining_capacity(A100, L("1g.5gb@1"), "2g.10gb") == 2
    assert remaining_capacity(A100, L("1g.5gb+me@0"), "1g.5gb+me") == 0


def test_parse_and_format_round_trip() -> None:
    lay = L(" 1g.5gb@4 , 3g.20gb@0,")
    assert lay == (PlacedInstance(0, "3g.20gb"), PlacedInstance(4, "1g.5gb"))
    assert parse_layout(format_layout(lay)) == lay
    with pytest.raises(ValueError, match="PROFILE@START"):
        parse_layout("3g.20gb")


@st.composite
def _random_layouts(draw: st.DrawFn) -> tuple[GpuModel, list[PlacedInstance]]:
    model = draw(st.sampled_from(CAT.models()))
    items = draw(
        st.lists(
            st.tuples(
                st.sampled_from([p.name for p in model.profiles]), st.integers(-1, model.memory_slices)
            ),
            max_size=8,
        )
    )
    return model, [PlacedInstance(s, n) for n, s in items]


@settings(max_examples=150, deadline=None)
@given(_random_layouts())
def test_check_layout_agrees_with_an_independent_definition(
    case: tuple[GpuModel, list[PlacedInstance]],
) -> None:
    model, layout = case
    slices = [set(model.profile(i.profile).span(i.start)) for i in layout]
    ok = all(i.start in model.profile(i.profile).placement_starts for i in layout)
    ok &= all(not (a & b) for a, b in itertools.combinations(slices, 2))
    ok &= all(sum(1 for j in layout if j.profile == i.profile) <= model.profile(i.profile).max_instances
              for i in layout)  # fmt: skip
    media = [model.profile(i.profile).media.value for i in layout]
    ok &= media.count("+me") <= 1
    others = [m for m in media if m != "+me.all"]
    ok &= "+me.all" not in media or (media.count("+me.all") == 1 and all(m == "-me" for m in others))
    assert is_valid(model, layout) == ok, check_layout(model, layout)
    if ok:
        # free_starts agrees with check_layout for every profile.
        for p in model.profiles:
            expected = tuple(
                s for s in p.placement_starts if is_valid(model, [*layout, PlacedInstance(s, p.name)])
            )
            assert free_starts(model, layout, p.name) == expected
