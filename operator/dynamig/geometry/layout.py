"""Which MIG layouts a GPU accepts, and the layouts a set of profiles can form. Pure, no I/O.

A layout is valid when every instance (profile, start) satisfies the rules NVML enforces
(``reference/mig-geometry.md`` section 1):

- ``unknown-profile``: the model has a profile of that name;
- ``out-of-range`` / ``disallowed-start``: the start is one of the profile's placements
  (``nvmlDeviceGetGpuInstancePossiblePlacements``);
- ``overlap``: no two instances share a memory slice (so 1g@3 next to 3g@0 is rejected: 3g@0 holds
  memory slices 0-3);
- ``max-instances``: at most ``instanceCount`` instances of one profile;
- ``media-exclusive``: at most one ``+me`` instance per GPU (on A30 this makes ``1g.6gb+me`` and
  ``2g.12gb+me`` mutually exclusive: one JPEG/OFA in total), and a ``+me.all`` instance allows only
  ``-me`` instances beside it.

Per model the allowed placements are precomputed as bit masks (bit i = memory slice i), so
:func:`check_layout` and :func:`free_starts` cost a handful of integer operations per instance.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

from dynamig.geometry.model import GpuModel, Layout, MediaExtension, PlacedInstance, Profile, normalize_layout

RULE_UNKNOWN_PROFILE = "unknown-profile"
RULE_OUT_OF_RANGE = "out-of-range"
RULE_DISALLOWED_START = "disallowed-start"
RULE_OVERLAP = "overlap"
RULE_MAX_INSTANCES = "max-instances"
RULE_MEDIA_EXCLUSIVE = "media-exclusive"


@dataclass(frozen=True, slots=True)
class LayoutViolation:
    """Why a layout is refused: the offending instance (None if layout-wide), a rule id and a sentence."""

    instance: PlacedInstance | None
    rule: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True, slots=True)
class _ProfileTable:
    profile: Profile
    index: int
    masks: dict[int, int]  # start -> memory-slice mask
    starts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _ModelTable:
    by_name: dict[str, _ProfileTable]


def _table(model: GpuModel) -> _ModelTable:
    """Precomputed masks for ``model``, built on first use and kept on the model."""
    cached = model._derived.get("layout")
    if isinstance(cached, _ModelTable):
        return cached
    by_name = {
        p.name: _ProfileTable(p, i, {s: p.mask(s) for s in p.placement_starts}, p.placement_starts)
        for i, p in enumerate(model.profiles)
    }
    table = _ModelTable(by_name)
    model._derived["layout"] = table
    return table


def _fmt(inst: PlacedInstance) -> str:
    return f"{inst.profile}@{inst.start}"


def _slices(mask: int) -> str:
    bits = [i for i in range(mask.bit_length()) if mask >> i & 1]
    if len(bits) > 1 and bits == list(range(bits[0], bits[-1] + 1)):
        return f"memory slices {bits[0]}-{bits[-1]}"
    return ("memory slice " if len(bits) == 1 else "memory slices ") + ", ".join(map(str, bits))


class _State:
    """Incremental validity state of a partial layout (mutable; internal)."""

    __slots__ = ("counts", "has_me", "has_me_all", "has_non_no_me", "occupied")

    def __init__(self, n_profiles: int) -> None:
        self.occupied = 0
        self.counts = [0] * n_profiles
        self.has_me = False
        self.has_me_all = False
        self.has_non_no_me = False

    def can_add(self, pt: _ProfileTable, mask: int) -> bool:
        if self.occupied & mask or self.counts[pt.index] >= pt.profile.max_instances:
            return False
        media = pt.profile.media
        if media is MediaExtension.ME:
            return not self.has_me and not self.has_me_all
        if media is MediaExtension.ME_ALL:
            return not self.has_non_no_me
        return media is MediaExtension.NO_ME or not self.has_me_all

    def add(self, pt: _ProfileTable, mask: int) -> None:
        self.occupied |= mask
        self.counts[pt.index] += 1
        media = pt.profile.media
        self.has_me |= media is MediaExtension.ME
        self.has_me_all |= media is MediaExtension.ME_ALL
        self.has_non_no_me |= media is not MediaExtension.NO_ME

    def remove(self, pt: _ProfileTable, mask: int, prev: tuple[bool, bool, bool]) -> None:
        self.occupied &= ~mask
        self.counts[pt.index] -= 1
        self.has_me, self.has_me_all, self.has_non_no_me = prev

    def flags(self) -> tuple[bool, bool, bool]:
        return (self.has_me, self.has_me_all, self.has_non_no_me)


def check_layout(model: GpuModel, layout: Iterable[PlacedInstance]) -> LayoutViolation | None:
    """The first rule ``layout`` breaks on ``model`` (instances checked in sorted order), or None. Pure."""
    table = _table(model)
    state = _State(len(table.by_name))
    placed: list[tuple[PlacedInstance, int]] = []
    me_owner: PlacedInstance | None = None
    me_all_owner: PlacedInstance | None = None
    non_no_me_owner: PlacedInstance | None = None
    for inst in sorted(layout):
        pt = table.by_name.get(inst.profile)
        if pt is None:
            known = ", ".join(table.by_name)
            return LayoutViolation(
                inst, RULE_UNKNOWN_PROFILE,
                f"{_fmt(inst)}: {model.key} has no MIG profile {inst.profile!r} (known: {known})",
            )  # fmt: skip
        p = pt.profile
        mask = pt.masks.get(inst.start)
        if mask is None:
            allowed = ", ".join(map(str, pt.starts))
            if inst.start < 0 or inst.start + p.placement_size > model.memory_slices:
                return LayoutViolation(
                    inst, RULE_OUT_OF_RANGE,
                    f"{_fmt(inst)}: start {inst.start} with size {p.placement_size} does not fit the "
                    f"{model.memory_slices} memory slices of {model.key} (allowed starts: {allowed})",
                )  # fmt: skip
            return LayoutViolation(
                inst, RULE_DISALLOWED_START,
                f"{_fmt(inst)}: start {inst.start} is not an allowed placement (allowed: {allowed})",
            )  # fmt: skip
        if state.occupied & mask:
            other, other_mask = next((o, m) for o, m in placed if m & mask)
            return LayoutViolation(
                inst, RULE_OVERLAP,
                f"{_fmt(inst)}: overlaps {_fmt(other)} on {_slices(mask & other_mask)}",
            )  # fmt: skip
        if state.counts[pt.index] >= p.max_instances:
            return LayoutViolation(
                inst, RULE_MAX_INSTANCES,
                f"{_fmt(inst)}: at most {p.max_instances} instance(s) of {p.name} per GPU on {model.key}",
            )  # fmt: skip
        if me_all_owner is not None and p.media is not MediaExtension.NO_ME:
            return LayoutViolation(
                inst, RULE_MEDIA_EXCLUSIVE,
                f"{_fmt(inst)}: {_fmt(me_all_owner)} (+me.all) allows only -me profiles beside it",
            )  # fmt: skip
        if p.media is MediaExtension.ME and me_owner is not None:
            return LayoutViolation(
                inst, RULE_MEDIA_EXCLUSIVE,
                f"{_fmt(inst)}: only one +me instance per GPU, {_fmt(me_owner)} already holds it",
            )  # fmt: skip
        if p.media is MediaExtension.ME_ALL and non_no_me_owner is not None:
            return LayoutViolation(
                inst, RULE_MEDIA_EXCLUSIVE,
                f"{_fmt(inst)}: a +me.all instance allows only -me profiles beside it, "
                f"but {_fmt(non_no_me_owner)} is not one",
            )  # fmt: skip
        state.add(pt, mask)
        placed.append((inst, mask))
        if p.media is MediaExtension.ME:
            me_owner = inst
        if p.media is MediaExtension.ME_ALL:
            me_all_owner = inst
        if p.media is not MediaExtension.NO_ME and non_no_me_owner is None:
            non_no_me_owner = inst
    return None


def is_valid(model: GpuModel, layout: Iterable[PlacedInstance]) -> bool:
    """True when ``model`` accepts ``layout``. Pure."""
    return check_layout(model, layout) is None


def _state_of(table: _ModelTable, layout: Iterable[PlacedInstance]) -> _State | None:
    """State after adding ``layout``; None if the layout is itself invalid."""
    state = _State(len(table.by_name))
    for inst in layout:
        pt = table.by_name.get(inst.profile)
        if pt is None:
            return None
        mask = pt.masks.get(inst.start)
        if mask is None or not state.can_add(pt, mask):
            return None
        state.add(pt, mask)
    return state


def occupied_slices(model: GpuModel, layout: Iterable[PlacedInstance]) -> frozenset[int]:
    """Memory slices the instances of ``layout`` occupy (unknown profiles/starts ignored). Pure."""
    table = _table(model)
    mask = 0
    for inst in layout:
        pt = table.by_name.get(inst.profile)
        if pt is not None:
            mask |= pt.masks.get(inst.start, 0)
    return frozenset(i for i in range(model.memory_slices) if mask >> i & 1)


def free_starts(model: GpuModel, layout: Iterable[PlacedInstance], profile_name: str) -> tuple[int, ...]:
    """Starts at which one instance of ``profile_name`` can be added to ``layout`` keeping it valid.

    Empty when the layout is already invalid; KeyError when the model has no such profile. Pure.
    """
    table = _table(model)
    pt = table.by_name.get(profile_name)
    if pt is None:
        model.profile(profile_name)  # raises the descriptive KeyError
        raise AssertionError("unreachable")
    state = _state_of(table, layout)
    if state is None:
        return ()
    return tuple(s for s, m in pt.masks.items() if state.can_add(pt, m))


def remaining_capacity(model: GpuModel, layout: Iterable[PlacedInstance], profile_name: str) -> int:
    """How many more instances of ``profile_name`` fit beside ``layout`` (NVML's RemainingCapacity). Pure."""
    table = _table(model)
    pt = table.by_name.get(profile_name)
    if pt is None:
        model.profile(profile_name)
        raise AssertionError("unreachable")
    state = _state_of(table, layout)
    if state is None:
        return 0
    best = 0

    def search(from_idx: int, added: int) -> None:
        nonlocal best
        best = max(best, added)
        for i in range(from_idx, len(pt.starts)):
            mask = pt.masks[pt.starts[i]]
            if state.can_add(pt, mask):
                prev = state.flags()
                state.add(pt, mask)
                search(i + 1, added + 1)
                state.remove(pt, mask, prev)

    search(0, 0)
    return best


def enumerate_layouts(
    model: GpuModel, profiles: Collection[str] | None = None, *, maximal: bool = False
) -> Iterator[Layout]:
    """Every valid non-empty layout built from ``profiles`` (default: all of the model's), sorted, each once.

    With ``maximal=True`` only layouts to which no further instance of those profiles can be added.
    Deterministic order (depth-first over placements sorted by start, then profile name). Pure.
    """
    table = _table(model)
    names = list(table.by_name) if profiles is None else list(dict.fromkeys(profiles))
    for name in names:
        if name not in table.by_name:
            model.profile(name)  # raises the descriptive KeyError
    candidates = sorted(
        (PlacedInstance(start, name), table.by_name[name], mask)
        for name in names
        for start, mask in table.by_name[name].masks.items()
    )
    state = _State(len(table.by_name))
    chosen: list[PlacedInstance] = []

    def is_maximal() -> bool:
        return not any(state.can_add(pt, mask) for _, pt, mask in candidates)

    def search(from_idx: int) -> Iterator[Layout]:
        if chosen and (not maximal or is_maximal()):
            yield tuple(chosen)
        for i in range(from_idx, len(candidates)):
            inst, pt, mask = candidates[i]
            if state.can_add(pt, mask):
                prev = state.flags()
                state.add(pt, mask)
                chosen.append(inst)
                yield from search(i + 1)
                chosen.pop()
                state.remove(pt, mask, prev)

    yield from search(0)


_ITEM = re.compile(r"^\s*([^@\s]+)\s*@\s*(-?\d+)\s*$")


def parse_layout(text: str) -> Layout:
    """Parse ``"3g.20gb@0, 1g.5gb@4"`` into a normalized Layout; ValueError on bad syntax. Pure."""
    items: list[PlacedInstance] = []
    for part in text.split(","):
        if not part.strip():
            continue
        m = _ITEM.match(part)
        if m is None:
            raise ValueError(f"bad layout item {part.strip()!r}: expected PROFILE@START, e.g. 1g.10gb@6")
        items.append(PlacedInstance(int(m.group(2)), m.group(1)))
    return normalize_layout(items)


def format_layout(layout: Iterable[PlacedInstance]) -> str:
    """``"3g.20gb@0,1g.5gb@4"`` for a layout (sorted). Pure; inverse of :func:`parse_layout`."""
    return ",".join(_fmt(i) for i in sorted(layout))
