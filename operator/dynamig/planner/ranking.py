"""The order a node offers its MIG devices in, so the scheduler's first fit keeps large profiles placeable.

The DRA allocator in kube-scheduler is first-fit: it walks pools and slices in name order and the devices of
a slice in the order they are listed, and takes the first device that matches a request and whose counters
still fit (k8s.io/dynamic-resource-allocation v0.36.3, ``structured/internal/incubating/
pools_incubating.go`` ``sortSlicesByName`` and ``allocator_incubating.go`` ``allocateOne``). So the order
of the published devices *is* the placement policy. This module computes it. Pure, deterministic, no I/O.

What is ranked
--------------
Per GPU: ``held`` instances stay whatever happens (allocated to a claim, or busy outside DRA); ``free``
instances are offered as they are and may be destroyed to make room; new placements are offered for the
``allowed`` profiles at every start that fits beside ``held``. Each offer is one of:

* ``free``  -- an existing free instance: zero wait;
* ``new``   -- a placement in empty memory slices: create only;
* ``recut`` -- a placement that needs free instances destroyed first (listed in ``destroys``).

The order
---------
1. By kind: ``free`` < ``new`` < ``recut`` (a ready instance beats a create, which beats destroy + create).
2. Within a kind, by profile weight (memory slices, then compute slices), smallest first: a request that
   several profiles satisfy (a capacity selector) gets the smallest that does.
3. Within one profile, in the order greedy first-fit would book them if only that profile were asked for:
   starting from the current layouts, repeatedly take the offer with the smallest key

   ``(destroyed, blocked, -used, gpu index, -start)``

   where ``destroyed`` is the number of memory slices of free instances the offer destroys (only
   ``recut`` offers destroy any: the fewer warm instances lost the better); ``blocked`` counts, per size
   class from the largest down (compared lexicographically), the placements of *larger* profiles that are
   creatable now beside what exists and that this offer would rule out; ``used`` is the number of memory
   slices already occupied on that GPU (prefer GPUs already cut, so whole GPUs stay whole); then lower GPU
   index and higher start (small profiles fill from the top end, so the 0-3 half a 4g needs stays whole).
   After each pick the GPU's layout is updated and the keys on that GPU are recomputed; offers that no
   longer fit beside the picks start a next round from the current layouts again. The resulting sequence
   is what the scheduler books for a stream of claims of that profile between two republishes, so the
   static order reproduces the greedy choice made one claim at a time.

Example (A100-80GB, empty): ``1g.10gb`` is offered at 6, 5, 4, then 3, 2, 1, 0; after three small claims
the 4g at 0 (and the 3g at 0) is still placeable, whereas name order (start 0 first) loses the 4g with the
first claim.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from dynamig.geometry.layout import check_layout
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, Profile, normalize_layout


class OfferKind(StrEnum):
    FREE = "free"  # an existing free instance
    NEW = "new"  # a placement in empty memory slices
    RECUT = "recut"  # a placement that needs free instances destroyed first


_KIND_ORDER = {OfferKind.FREE: 0, OfferKind.NEW: 1, OfferKind.RECUT: 2}


@dataclass(frozen=True, slots=True)
class GpuOffers:
    """What one GPU holds and may offer (ranking input)."""

    index: int
    model: GpuModel
    held: Layout = ()  # stays whatever is booked: allocated to a claim, or busy outside DRA
    free: Layout = ()  # existing free instances: offered as they are, destroyed to make room
    allowed: frozenset[str] | None = None  # profiles offered as new placements; None: all of the model's


@dataclass(frozen=True, slots=True)
class RankedOffer:
    """One offered device, in publishing order. ``blocked`` lists (placement size, compute slices, count)
    of the larger placements it rules out, largest first (nonzero counts only)."""

    gpu_index: int
    profile: str
    start: int
    kind: OfferKind
    destroys: Layout = ()
    blocked: tuple[tuple[int, int, int], ...] = ()

    @property
    def placed(self) -> PlacedInstance:
        return PlacedInstance(self.start, self.profile)


def weight(profile: Profile) -> tuple[int, int]:
    """Size of a profile for ranking: (memory slices occupied, compute slices). Pure."""
    return (profile.placement_size, profile.compute_slices)


@dataclass(frozen=True, slots=True)
class _Candidate:
    gpu: int
    inst: PlacedInstance
    kind: OfferKind
    destroys: Layout


@dataclass(slots=True)
class _GpuState:
    fixed: Layout  # held instances plus the picks of the current round
    soft: Layout  # free instances not yet destroyed by a pick of this round


# Layout validity is a pure function of (model, layout); sharing it across calls makes repeated ranking
# (one call per republish) cheap. Keyed by the model object's id, with the model kept alive so the id
# cannot be reused; bounded so a long run cannot grow it without limit.
_VALID: dict[int, tuple[GpuModel, dict[Layout, bool]]] = {}
_VALID_MAX = 200_000


def _valid(model: GpuModel, layout: Layout) -> bool:
    entry = _VALID.get(id(model))
    if entry is None or entry[0] is not model:
        entry = (model, {})
        _VALID[id(model)] = entry
    cache = entry[1]
    got = cache.get(layout)
    if got is None:
        if len(cache) >= _VALID_MAX:
            cache.clear()
        got = check_layout(model, layout) is None
        cache[layout] = got
    return got


class _Ranker:
    """Per-call caches (never shared between calls; layout validity is shared, see ``_valid``)."""

    def __init__(self, gpus: Sequence[GpuOffers]) -> None:
        self.gpus = {g.index: g for g in gpus}
        self._keys: dict[tuple[int, Layout, Layout, PlacedInstance], tuple[tuple[int, ...], Layout]] = {}
        self.placements: dict[int, tuple[PlacedInstance, ...]] = {}
        for g in gpus:
            names = [p.name for p in g.model.profiles if g.allowed is None or p.name in g.allowed]
            self.placements[g.index] = tuple(
                PlacedInstance(s, n) for n in names for s in g.model.profile(n).placement_starts
            )
        # Size classes of every offerable profile on the node, largest first: the axes of ``blocked``.
        self.classes: tuple[tuple[int, int], ...] = tuple(
            sorted(
                {
                    weight(g.model.profile(i.profile))
                    for g in gpus
                    for i in (*self.placements[g.index], *g.free)
                },
                reverse=True,
            )
        )

    def valid(self, model: GpuModel, layout: Iterable[PlacedInstance]) -> bool:
        return _valid(model, normalize_layout(list(layout)))

    def destroys(self, g: GpuOffers, fixed: Layout, soft: Layout, inst: PlacedInstance) -> Layout:
        """The free instances ``inst`` needs destroyed: keep each (in start order) that still fits."""
        kept: list[PlacedInstance] = []
        for f in soft:
            if self.valid(g.model, (*fixed, *kept, f, inst)):
                kept.append(f)
        return tuple(f for f in soft if f not in kept)

    def key(self, gpu: int, state: _GpuState, inst: PlacedInstance) -> tuple[tuple[int, ...], Layout]:
        """(ranking key, destroys) of ``inst`` on ``gpu`` in ``state``; see the module docstring."""
        ck = (gpu, state.fixed, state.soft, inst)
        got = self._keys.get(ck)
        if got is not None:
            return got
        g = self.gpus[gpu]
        model = g.model
        if inst in state.soft:  # a free instance: nothing destroyed, the others stay
            destroys: Layout = ()
            base = (*state.fixed, *(f for f in state.soft if f != inst))
        else:
            destroys = self.destroys(g, state.fixed, state.soft, inst)
            base = (*state.fixed, *(f for f in state.soft if f not in destroys))
        own = weight(model.profile(inst.profile))
        counts = dict.fromkeys(self.classes, 0)
        for q in self.placements[gpu]:
            w = weight(model.profile(q.profile))
            if w <= own or q == inst or q in base:
                continue
            if self.valid(model, (*base, q)) and not self.valid(model, (*base, inst, q)):
                counts[w] += 1
        used = lost = 0
        for i in (*state.fixed, *state.soft):
            used |= model.profile(i.profile).mask(i.start)
        for i in destroys:
            lost |= model.profile(i.profile).mask(i.start)
        key = (lost.bit_count(), *(counts[c] for c in self.classes), -used.bit_count(), gpu, -inst.start)
        got = (key, destroys)
        self._keys[ck] = got
        return got

    def blocked_of(self, key: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
        return tuple((c[0], c[1], n) for c, n in zip(self.classes, key[1:], strict=False) if n)


def _candidates(r: _Ranker, g: GpuOffers, profile: str | None) -> list[_Candidate]:
    out = [_Candidate(g.index, f, OfferKind.FREE, ()) for f in g.free if profile in (None, f.profile)]
    for inst in r.placements[g.index]:
        if profile not in (None, inst.profile):
            continue
        if inst in g.free or inst in g.held or not r.valid(g.model, (*g.held, inst)):
            continue
        destroys = r.destroys(g, g.held, g.free, inst)
        out.append(_Candidate(g.index, inst, OfferKind.RECUT if destroys else OfferKind.NEW, destroys))
    return out


def _greedy(r: _Ranker, group: list[_Candidate]) -> list[RankedOffer]:
    """One profile's offers of one kind in greedy first-fit order (rounds, see the module docstring)."""
    out: list[RankedOffer] = []
    remaining = list(group)
    while remaining:
        states = {g.index: _GpuState(g.held, g.free) for g in r.gpus.values()}
        while True:
            best: tuple[tuple[int, ...], Layout, _Candidate] | None = None
            for c in remaining:
                st = states[c.gpu]
                if c.inst not in st.soft and not r.valid(r.gpus[c.gpu].model, (*st.fixed, c.inst)):
                    continue
                key, destroys = r.key(c.gpu, st, c.inst)
                if best is None or key < best[0]:
                    best = (key, destroys, c)
            if best is None:
                break
            key, destroys, c = best
            out.append(
                RankedOffer(c.gpu, c.inst.profile, c.inst.start, c.kind, c.destroys, r.blocked_of(key))
            )
            remaining.remove(c)
            st = states[c.gpu]
            st.fixed = normalize_layout([*st.fixed, c.inst])
            st.soft = tuple(f for f in st.soft if f != c.inst and f not in destroys)
    return out


def rank_offers(gpus: Sequence[GpuOffers], profile: str | None = None) -> tuple[RankedOffer, ...]:
    """Every device a node offers, in the order to publish them (see the module docstring). Pure.

    With ``profile``, only that profile's offers, in the same order, without ranking the others: each
    (kind, profile) group is ranked on its own from the node's current state, so this is the full ranking
    filtered (tested), at the cost of one profile (what a scheduler booking one profile looks at).

    ValueError when two GPUs share an index, or a GPU's held and free instances together are not a layout
    its model accepts (the inventory would then promise what the hardware refuses).
    """
    indices = [g.index for g in gpus]
    if len(set(indices)) != len(indices):
        raise ValueError(f"GPU indices must be unique, got {sorted(indices)}")
    gpus = sorted(gpus, key=lambda g: g.index)
    for g in gpus:
        violation = check_layout(g.model, (*g.held, *g.free))
        if violation is not None:
            raise ValueError(f"gpu{g.index}: current layout is invalid: {violation}")
        overlap = set(g.held) & set(g.free)
        if overlap:
            raise ValueError(f"gpu{g.index}: instances both held and free: {sorted(overlap)}")
    r = _Ranker(gpus)
    groups: dict[tuple[int, tuple[int, int], str], list[_Candidate]] = {}
    for g in gpus:
        for c in _candidates(r, g, profile):
            w = weight(g.model.profile(c.inst.profile))
            groups.setdefault((_KIND_ORDER[c.kind], w, c.inst.profile), []).append(c)
    out: list[RankedOffer] = []
    for k in sorted(groups):
        out.extend(_greedy(r, groups[k]))
    return tuple(out)
