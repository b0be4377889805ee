"""The layout planner: pending claims + current GPU layouts + policy -> target layouts and assignments.

Pure and deterministic: no I/O, no clock, no randomness that is not seeded from constants, and no iteration
over sets or dicts whose order could leak into the output (GPUs and claims are sorted first).

How a round is planned
----------------------
1. Claims are placed one at a time by a greedy *pass*. For each claim, each alternative is tried in
   preference order (DRA ``firstAvailable``); for one alternative every device of the claim uses that
   profile, all on one node. A device goes to the cheapest option over all eligible GPUs, where an option
   on one GPU is, from cheapest to dearest:

   * an existing free instance of that profile (nothing changes on the GPU);
   * a new instance in free memory slices;
   * a new instance that needs free (unassigned, not busy) instances destroyed to make room.

   Options are compared on (free instances destroyed, GPU newly touched, kind, packing, fragmentation):
   ``pack`` prefers the GPU left fullest (small slices packed on already-cut GPUs so whole GPUs stay free
   for large profiles); ``spread`` prefers the GPU left emptiest and does not count touching a GPU. Within
   a GPU the start that leaves the largest creatable profile and the most creatable placements wins.
   Busy and assigned instances are pinned: no option ever removes or moves them, and every layout an
   option produces passes the geometry check (overlap, allowed starts, instance caps, media-engine rules).
   A GPU the policy marks frozen (still reshaping, cooling down) offers only its free instances.

2. Several passes run with different claim orders (large first, small first, least capacity needed first,
   most constrained first, seeded shuffles), with "use existing free instances before anything else" on or
   off, alternatives tried smallest first, fragmentation measured two ways, options ranked by the room the
   pinned instances leave ("repack"), and, under a small disruption budget, one pass per choice of GPUs
   allowed to change. The best pass by the objective (claims satisfied, then first choices, then free
   instances destroyed and GPUs touched) wins; a bounded local search then moves unsatisfied claims to the
   front or lets a satisfied claim try another alternative first, keeping moves that improve the score.
   How many passes run is bounded by the size of the input: a 1,000-node round with 5,000 claims gets one.

3. On the winning pass: idle GPUs (no busy instance, nothing assigned) return to the policy baseline, the
   warm pool is topped up in free slices only, and any claim still unsatisfied takes free instances that now
   exist on one node. Every step respects the disruption budget (GPUs whose layout changes).

Speed: GPUs with the same (model, pinned instances, free instances, touched) answer every question the
same way, so options are cached by that signature; unconstrained claims find their GPU through one heap
per (model, profile) with lazy invalidation; a (profile, count, nodes) shape that failed once is not
retried in the same pass (capacity only shrinks as claims are placed).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations, zip_longest
from math import comb
from typing import NamedTuple

from dynamig.geometry.catalog import Catalog, load_catalog
from dynamig.geometry.layout import LayoutViolation, check_layout
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, normalize_layout
from dynamig.planner._geo import GeoCache, with_instance, without
from dynamig.planner.model import (
    Assignment,
    ClaimDemand,
    GpuPlan,
    GpuState,
    PlanResult,
    Policy,
    Strategy,
)

_USE = 0  # take an existing free instance
_NEW = 1  # create an instance (possibly destroying free ones)
_USE_COST: tuple[int, ...] = (0, 0, 0)
_MISSING = object()

# Work units (claims + GPUs) times passes allowed per round: a 1,000-node round with 5,000 claims gets one
# pass, a 64-node round about twenty, a tiny round every pass variant and the improvement steps.
_PASS_WORK_BUDGET = 20_000
# A multi-device claim on any node tries the nodes of the cheapest GPUs first, at most this many.
_MAX_NODES_TRIED = 64
_SHUFFLED_PASSES = 8
# Above this many nodes a node-restricted claim is placed through the heaps instead of visiting each node.
_DIRECT_NODE_LIMIT = 16

_Entry = tuple[tuple[int, ...], int, int, bool]
"""Heap entry: (cost or a lower bound of it, GPU order, GPU version when pushed, cost is exact)."""

Sig = tuple[str, Layout, Layout, bool]
"""What a GPU's options depend on: model key, pinned instances, free unassigned instances, touched."""


class PlanInputError(ValueError):
    """The planner's input breaks a rule (unknown model/profile, invalid current layout, duplicate names)."""


class _Option(NamedTuple):
    cost: tuple[int, ...]
    kind: int
    inst: PlacedInstance
    destroyed: tuple[PlacedInstance, ...]
    pinned: Layout  # pinned instances after taking this option
    free: Layout  # free unassigned instances after taking this option
    after: int  # interned signature of the GPU after taking this option


def fmt_instance(inst: PlacedInstance) -> str:
    return f"{inst.profile}@{inst.start}"


def validate_inputs(
    gpus: Sequence[GpuState], claims: Sequence[ClaimDemand], policy: Policy, geo: GeoCache
) -> None:
    """Raise ``PlanInputError`` with one precise line if the input is unusable. Pure."""
    seen: set[tuple[str, int]] = set()
    for gpu in gpus:
        label = f"{gpu.node}-gpu{gpu.index}"
        if (gpu.node, gpu.index) in seen:
            raise PlanInputError(f"gpu {label}: listed twice")
        seen.add((gpu.node, gpu.index))
        try:
            model = geo.model(gpu.model)
        except KeyError as exc:
            raise PlanInputError(f"gpu {label}: {exc.args[0]}") from None
        for current in gpu.instances:
            if not model.has_profile(current.profile):
                raise PlanInputError(
                    f"gpu {label}: instance {current.profile}@{current.start}: unknown-profile: "
                    f"{model.key} has no MIG profile {current.profile!r}"
                )
        layout = normalize_layout([i.placed for i in gpu.instances])
        violation = check_layout(model, layout)
        if violation is not None:
            raise PlanInputError(f"gpu {label}: {violation_line(violation)}")
    names: set[str] = set()
    for claim in claims:
        if claim.name in names:
            raise PlanInputError(f"claim {claim.name}: listed twice")
        names.add(claim.name)
        if claim.count < 1 or any(n < 1 for n in claim.alt_counts):
            raise PlanInputError(f"claim {claim.name}: count must be at least 1, got {claim.count}")
        if not claim.alternatives:
            raise PlanInputError(f"claim {claim.name}: no profile alternatives")
        if claim.alt_counts and len(claim.alt_counts) != len(claim.alternatives):
            raise PlanInputError(f"claim {claim.name}: one count per alternative, got {claim.alt_counts}")
    for key in sorted(policy.baseline):
        try:
            model = geo.model(key)
        except KeyError as exc:
            raise PlanInputError(f"baseline {key}: {exc.args[0]}") from None
        base = normalize_layout(list(policy.baseline[key]))
        for inst in base:
            if not model.has_profile(inst.profile):
                raise PlanInputError(
                    f"baseline {key}: instance {fmt_instance(inst)}: unknown-profile: "
                    f"{key} has no MIG profile {inst.profile!r}"
                )
        violation = check_layout(model, base)
        if violation is not None:
            raise PlanInputError(f"baseline {key}: {violation_line(violation)}")


def violation_line(violation: LayoutViolation) -> str:
    """``instance <profile>@<start>: <rule>: <message>`` for a layout violation. Pure."""
    message = violation.message
    if violation.instance is None:
        return f"{violation.rule}: {message}"
    where = fmt_instance(violation.instance)
    message = message.removeprefix(f"{where}: ")
    return f"instance {where}: {violation.rule}: {message}"


class _Gpu:
    """One GPU's planning state inside a pass (mutable; copied per pass)."""

    __slots__ = (
        "assigned",
        "busy",
        "changed",
        "current",
        "events",
        "free",
        "model",
        "node",
        "order",
        "pinned",
        "sid",
        "state",
        "version",
    )

    def __init__(self, order: int, state: GpuState, model: GpuModel) -> None:
        self.order = order
        self.state = state
        self.node = state.node
        self.model = model
        self.current: Layout = normalize_layout([i.placed for i in state.instances])
        self.busy: Layout = normalize_layout([i.placed for i in state.instances if i.busy])
        self.pinned: Layout = self.busy
        self.free: Layout = normalize_layout([i.placed for i in state.instances if not i.busy])
        self.changed = False
        self.version = 0
        self.sid = -1  # interned signature, set by the context
        self.assigned: list[tuple[PlacedInstance, str]] = []
        self.events: list[tuple[str, PlacedInstance, str]] = []  # (removed|added, instance, purpose)

    def copy(self) -> _Gpu:
        g = _Gpu.__new__(_Gpu)
        g.order, g.state, g.node, g.model = self.order, self.state, self.node, self.model
        g.current, g.busy, g.pinned, g.free = self.current, self.busy, self.pinned, self.free
        g.changed, g.version, g.sid = self.changed, 0, self.sid
        g.assigned = []  # the base GPUs never carry assignments or events
        g.events = []
        return g

    def sig(self) -> Sig:
        return (self.model.key, self.pinned, self.free, self.changed)

    def layout(self) -> Layout:
        return tuple(sorted((*self.pinned, *self.free)))


class _Context:
    """What every pass shares: sorted GPUs, indexes, the option cache. Built once per ``plan`` call."""

    def __init__(
        self, gpus: Sequence[GpuState], claims: Sequence[ClaimDemand], policy: Policy, geo: GeoCache
    ) -> None:
        self.geo = geo
        self.policy = policy
        self.allowed = policy.allowed_profiles
        self.spread = policy.strategy == Strategy.SPREAD
        self.budget = policy.max_gpus_reshaped
        states = sorted(gpus, key=lambda s: (s.node, s.index))
        self.base = [_Gpu(i, s, geo.model(s.model)) for i, s in enumerate(states)]
        self.frozen = frozenset(g.order for g in self.base if g.state.key in policy.frozen)
        self.changeable = frozenset(range(len(self.base))) - self.frozen
        self.nodes: dict[str, list[int]] = {}
        for g in self.base:
            self.nodes.setdefault(g.node, []).append(g.order)
        model_keys = sorted({g.model.key for g in self.base})
        self.models = [geo.model(k) for k in model_keys]
        demanded = sorted({p for c in claims for p in c.alternatives})
        self.models_with: dict[str, list[str]] = {
            p: [m.key for m in self.models if m.has_profile(p)] for p in demanded
        }
        self.demanded: dict[str, list[str]] = {
            m.key: [p for p in demanded if m.has_profile(p)] for m in self.models
        }
        # A profile's size as a fraction of its GPU (smallest over models), to order claims by size.
        self.size: dict[str, float] = {}
        for p in demanded:
            sizes = [m.profile(p).placement_size / m.memory_slices for m in self.models if m.has_profile(p)]
            self.size[p] = min(sizes) if sizes else 1.0
        self._opt: dict[tuple[int, str, bool, bool, bool], _Option | None] = {}
        self._new: dict[tuple[int, str, bool], list[_Option]] = {}
        self._use: dict[tuple[int, str], _Option | None] = {}
        self._lb: dict[tuple[int, str, bool], tuple[tuple[int, ...], bool] | None] = {}
        self.initial_heaps: dict[
            tuple[frozenset[int] | None, bool, bool], dict[tuple[str, str], list[_Entry]]
        ] = {}
        # Signatures are interned to small ints: hashing nested layout tuples on every lookup is slow.
        self._sid: dict[Sig, int] = {}
        self.sigs: list[Sig] = []
        self.pin_mask: list[int] = []  # memory slices held by pinned instances, per signature
        self.full_mask: list[int] = []  # memory slices held by any instance, per signature
        self.masks: dict[tuple[str, str], tuple[int, ...]] = {
            (m.key, p.name): tuple(p.mask(st) for st in p.placement_starts)
            for m in self.models
            for p in m.profiles
        }
        for g in self.base:
            g.sid = self.intern(g.sig())

    def intern(self, sig: Sig) -> int:
        sid = self._sid.get(sig)
        if sid is None:
            sid = len(self.sigs)
            self._sid[sig] = sid
            self.sigs.append(sig)
            model = self.geo.model(sig[0])
            pin = 0
            for inst in sig[1]:
                pin |= model.profile(inst.profile).mask(inst.start)
            full = pin
            for inst in sig[2]:
                full |= model.profile(inst.profile).mask(inst.start)
            self.pin_mask.append(pin)
            self.full_mask.append(full)
        return sid

    def use_option(self, sid: int, pname: str) -> _Option | None:
        """Take an existing free instance of ``pname`` on a GPU with signature ``sid``, if there is one."""
        k = (sid, pname)
        if k in self._use:
            return self._use[k]
        sig = self.sigs[sid]
        opt = None
        for inst in sig[2]:
            if inst.profile == pname:
                pinned, free = with_instance(sig[1], inst), without(sig[2], (inst,))
                after = self.intern((sig[0], pinned, free, sig[3]))
                opt = _Option(_USE_COST, _USE, inst, (), pinned, free, after)
                break
        self._use[k] = opt
        return opt

    def option(
        self, sid: int, pname: str, may_touch: bool, repack: bool = False, capacity: bool = False
    ) -> _Option | None:
        """Cheapest way to get one ``pname`` device on a GPU with signature ``sig``; None if impossible.

        Default costs put existing free instances first, then fewest destroyed, fewest GPUs touched, packing
        and fragmentation. ``repack`` costs rank every option, existing instances included, by how much
        room the pinned instances leave for later claims (a pass variant for tight rounds). ``capacity``
        selects the fragmentation measure (see ``GeoCache.flex``).
        """
        k = (sid, pname, may_touch, repack, capacity)
        got = self._opt.get(k, _MISSING)
        if got is not _MISSING:
            return got  # type: ignore[return-value]
        sig = self.sigs[sid]
        may = may_touch or sig[3]
        use = self.use_option(sid, pname)
        opt: _Option | None
        if not repack:
            opt = use if use is not None or not may else self.new_option(sid, pname, capacity)
        else:
            model = self.geo.model(sig[0])
            options = [use] if use is not None else []
            if may:
                options += self._new_options(sid, pname, capacity)
            opt = None
            for o in options:
                cost = (*self.geo.flex(model, o.pinned, self.allowed, capacity), *o.cost)
                if opt is None or cost < opt.cost:
                    opt = o._replace(cost=cost)
        self._opt[k] = opt
        return opt

    def lower_bound(
        self, sid: int, pname: str, may_touch: bool, repack: bool, capacity: bool
    ) -> tuple[tuple[int, ...], bool] | None:
        """A cheap lower bound of ``option(...).cost`` and whether it is exact; None if no option exists.

        Computing the exact cost of a new instance (every start, fragmentation of each result) is the
        expensive part of planning, and most GPUs are never the best choice, so heaps start from bounds
        and only entries that reach the top get their exact cost.
        """
        if repack:
            opt = self.option(sid, pname, may_touch, repack, capacity)
            return None if opt is None else (opt.cost, True)
        k = (sid, pname, may_touch)  # the bound does not depend on the fragmentation measure
        got = self._lb.get(k, _MISSING)
        if got is not _MISSING:
            return got  # type: ignore[return-value]
        result: tuple[tuple[int, ...], bool] | None
        mkey, _, _, changed = self.sigs[sid]
        model = self.geo.model(mkey)
        use = self.use_option(sid, pname)
        if use is not None:
            result = (use.cost, True)
        elif (
            not (may_touch or changed)
            or not model.has_profile(pname)
            or (self.allowed is not None and pname not in self.allowed)
        ):
            result = None
        else:
            # Overlap only (bit masks): instance caps and media rules can only make the exact cost
            # dearer, so this stays a lower bound; the exact option applies every rule.
            touch = 0 if (changed or self.spread) else 1
            masks = self.masks[(mkey, pname)]
            full = self.full_mask[sid]
            if any(not (m & full) for m in masks):
                used = full.bit_count() + model.profile(pname).placement_size
                result = ((0, touch, 1, used if self.spread else -used), False)
            elif any(not (m & self.pin_mask[sid]) for m in masks):
                result = ((1,), False)
            else:
                result = None
        self._lb[k] = result
        return result

    def new_option(self, sid: int, pname: str, capacity: bool = False) -> _Option | None:
        """Cheapest new ``pname`` instance (default costs) on a GPU with signature ``sid``, or None."""
        best: _Option | None = None
        for o in self._new_options(sid, pname, capacity):
            if best is None or o.cost < best.cost:
                best = o
        return best

    def _new_options(self, sid: int, pname: str, capacity: bool) -> list[_Option]:
        """Every start where a new ``pname`` instance can go, destroying free instances as needed."""
        k = (sid, pname, capacity)
        got = self._new.get(k)
        if got is not None:
            return got
        mkey, pinned, free, changed = self.sigs[sid]
        model = self.geo.model(mkey)
        out: list[_Option] = []
        if not model.has_profile(pname) or (self.allowed is not None and pname not in self.allowed):
            self._new[k] = out
            return out
        geo = self.geo
        size = model.profile(pname).placement_size
        touch = 0 if (changed or self.spread) else 1
        for s in geo.free_starts(model, pinned, pname):
            inst = PlacedInstance(s, pname)
            new_pinned = with_instance(pinned, inst)
            end = s + size
            layout = new_pinned
            kept: list[PlacedInstance] = []
            destroyed: list[PlacedInstance] = []
            for f in free:
                f_end = f.start + model.profile(f.profile).placement_size
                if f.start < end and s < f_end:
                    destroyed.append(f)
                    continue
                trial = with_instance(layout, f)
                if geo.is_valid(model, trial):
                    layout = trial
                    kept.append(f)
                else:
                    destroyed.append(f)  # e.g. a second +me instance would break the per-GPU cap
            used = geo.used_slices(model, layout)
            fit = used if self.spread else -used
            cost = (len(destroyed), touch, 1, fit, *geo.flex(model, layout, self.allowed, capacity))
            after = self.intern((mkey, new_pinned, tuple(kept), True))
            out.append(_Option(cost, _NEW, inst, tuple(destroyed), new_pinned, tuple(kept), after))
        self._new[k] = out
        return out


@dataclass(frozen=True, slots=True)
class _PassConfig:
    order: str  # "large" | "small" | "need" | "constrained" | "shuffle<N>"
    use_first: bool  # try existing free instances of every alternative before creating anything
    small_alternatives: bool = False  # try alternatives smallest first (rank still counts as given)
    touchable: frozenset[int] | None = None  # only these GPUs (by order) may change; None: any
    repack: bool = False  # rank options by the room left for later claims (see _Context.option)
    capacity: bool = False  # measure fragmentation by remaining capacity per profile (GeoCache.flex)


def _pass_configs() -> list[_PassConfig]:
    configs = [
        _PassConfig("large", use_first=False),
        _PassConfig("small", use_first=False),
        _PassConfig("large", use_first=True),
        _PassConfig("constrained", use_first=False),
        _PassConfig("small", use_first=True, small_alternatives=True),
        _PassConfig("large", use_first=False, small_alternatives=True),
        _PassConfig("need", use_first=False, small_alternatives=True),
        _PassConfig("need", use_first=True, small_alternatives=True),
        _PassConfig("need", use_first=False, small_alternatives=True, repack=True),
        _PassConfig("large", use_first=False, repack=True),
        _PassConfig("large", use_first=False, capacity=True),
        _PassConfig("need", use_first=False, small_alternatives=True, capacity=True),
        _PassConfig("need", use_first=False, small_alternatives=True, repack=True, capacity=True),
        _PassConfig("constrained", use_first=False, capacity=True),
    ]
    configs += [
        _PassConfig(f"shuffle{i}", use_first=False, small_alternatives=i % 2 == 1, capacity=i % 4 >= 2)
        for i in range(_SHUFFLED_PASSES)
    ]
    return configs


def _budget_configs(ctx: _Context, limit: int) -> list[_PassConfig]:
    """With a small disruption budget, which GPUs get it matters most: one pass per choice of GPUs to
    change (an exact search over that choice), for clusters small enough to afford it."""
    budget = ctx.budget
    n = len(ctx.changeable)
    if budget is None or budget <= 0 or budget >= n or comb(n, budget) > limit:
        return []
    out = []
    for subset in combinations(sorted(ctx.changeable), budget):
        for order in ("large", "need"):
            out.append(
                _PassConfig(
                    order, use_first=False, small_alternatives=order == "need", touchable=frozenset(subset)
                )
            )
    return out


class _Pass:
    """One greedy placement of all claims over a fresh copy of the GPUs."""

    def __init__(self, ctx: _Context, cfg: _PassConfig) -> None:
        self.ctx = ctx
        self.touchable = cfg.touchable
        if ctx.frozen:
            self.touchable = (ctx.changeable if cfg.touchable is None else cfg.touchable) - ctx.frozen
        self.repack = cfg.repack
        self.capacity = cfg.capacity
        self.gpus = [g.copy() for g in ctx.base]
        self.touched = 0
        self.exhausted = ctx.budget is not None and ctx.budget <= 0
        self.failed: set[tuple[str, int, frozenset[str] | None, bool]] = set()
        self.placed: dict[str, tuple[int, list[tuple[int, PlacedInstance]]]] = {}  # claim -> (rank, devices)
        self.destroyed = 0
        self.heaps: dict[tuple[str, str], list[_Entry]] = {}
        self._build_heaps()

    # -- budget and heaps -------------------------------------------------------------------------------
    def may_touch(self, order: int) -> bool:
        """May GPU ``order`` change (if it has not already)?"""
        return not self.exhausted and (self.touchable is None or order in self.touchable)

    def _build_heaps(self) -> None:
        ctx = self.ctx
        fresh = all(g.version == 0 for g in self.gpus) and not self.exhausted
        key = (self.touchable, self.repack, self.capacity)
        if fresh and key in ctx.initial_heaps:  # passes start from the same GPUs: share the work
            self.heaps = {k: list(h) for k, h in ctx.initial_heaps[key].items()}
            return
        heaps: dict[tuple[str, str], list[_Entry]] = {
            (m.key, p): [] for m in ctx.models for p in ctx.demanded[m.key]
        }
        bounds: dict[tuple[int, str, bool], tuple[tuple[int, ...], bool] | None] = {}
        for g in self.gpus:
            may = self.may_touch(g.order)
            for p in ctx.demanded[g.model.key]:
                bk = (g.sid, p, may)
                if bk in bounds:
                    lb = bounds[bk]
                else:
                    lb = bounds[bk] = ctx.lower_bound(g.sid, p, may, self.repack, self.capacity)
                if lb is not None:
                    heaps[(g.model.key, p)].append((lb[0], g.order, g.version, lb[1]))
        for h in heaps.values():
            heapq.heapify(h)
        self.heaps = heaps
        if fresh:
            ctx.initial_heaps[key] = {k: list(h) for k, h in heaps.items()}

    def _refresh(self, g: _Gpu) -> None:
        g.version += 1
        may = self.may_touch(g.order)
        for p in self.ctx.demanded[g.model.key]:
            lb = self.ctx.lower_bound(g.sid, p, may, self.repack, self.capacity)
            if lb is not None:
                heapq.heappush(self.heaps[(g.model.key, p)], (lb[0], g.order, g.version, lb[1]))

    def _current(self, heap: list[_Entry]) -> _Entry | None:
        """The cheapest entry that is not stale (its cost may be a lower bound)."""
        while heap:
            entry = heap[0]
            if entry[2] == self.gpus[entry[1]].version:
                return entry
            heapq.heappop(heap)
        return None

    def _top(self, heap: list[_Entry], pname: str) -> _Entry | None:
        """The cheapest current entry, with its exact cost (stale entries dropped, bounds resolved)."""
        while heap:
            entry = heap[0]
            g = self.gpus[entry[1]]
            if entry[2] != g.version:
                heapq.heappop(heap)
                continue
            if entry[3]:
                return entry
            heapq.heappop(heap)
            opt = self.ctx.option(g.sid, pname, self.may_touch(g.order), self.repack, self.capacity)
            if opt is not None:
                heapq.heappush(heap, (opt.cost, g.order, g.version, True))
        return None

    # -- placing a claim ----------------------------------------------------------------------------------
    def place(self, claim: ClaimDemand, rank: int, pname: str, use_only: bool) -> bool:
        models = self.ctx.models_with.get(pname)
        if not models:
            return False
        fkey = (pname, claim.count_for(pname), claim.nodes, use_only)
        if fkey in self.failed:
            return False
        steps: list[tuple[int, _Option]] | None
        if claim.nodes is not None and len(claim.nodes) <= _DIRECT_NODE_LIMIT:
            steps = self._best_on_listed_nodes(claim, pname, use_only)
        elif claim.nodes is None and claim.count_for(pname) == 1:
            steps = self._best_single(pname, use_only)
        else:
            steps = self._first_node_by_heap(claim, pname, use_only)
        if steps is None:
            self.failed.add(fkey)
            return False
        devices: list[tuple[int, PlacedInstance]] = []
        for order, opt in steps:
            self._commit(self.gpus[order], opt, claim.name)
            devices.append((order, opt.inst))
        self.placed[claim.name] = (rank, devices)
        return True

    def _best_single(self, pname: str, use_only: bool) -> list[tuple[int, _Option]] | None:
        best: _Entry | None = None
        for mkey in self.ctx.models_with[pname]:
            top = self._top(self.heaps[(mkey, pname)], pname)
            if top is not None and (best is None or top[:2] < best[:2]):
                best = top
        if best is None or (use_only and best[0] != _USE_COST):
            return None
        g = self.gpus[best[1]]
        opt = self.ctx.option(g.sid, pname, self.may_touch(g.order), self.repack, self.capacity)
        assert opt is not None and opt.cost == best[0]
        return [(g.order, opt)]

    def _simulate(
        self, orders: Sequence[int], pname: str, count: int, use_only: bool
    ) -> list[tuple[int, _Option]] | None:
        """Cheapest way to get ``count`` devices on these GPUs (one node), without changing anything."""
        ctx = self.ctx
        sids = {o: self.gpus[o].sid for o in orders}
        touched = self.touched
        budget = ctx.budget
        steps: list[tuple[int, _Option]] = []
        for _ in range(count):
            best: tuple[tuple[int, ...], int, _Option] | None = None
            may = budget is None or touched < budget
            if use_only:
                for o in orders:
                    opt = ctx.use_option(sids[o], pname)
                    if opt is not None and (best is None or (opt.cost, o) < best[:2]):
                        best = (opt.cost, o, opt)
            else:
                # Exact costs only for GPUs whose lower bound could still beat the best found.
                bounds = []
                for o in orders:
                    may_o = may and (self.touchable is None or o in self.touchable)
                    lb = ctx.lower_bound(sids[o], pname, may_o, self.repack, self.capacity)
                    if lb is not None:
                        bounds.append((lb[0], o, may_o))
                bounds.sort()
                for lb_cost, o, may_o in bounds:
                    if best is not None and (lb_cost, o) >= best[:2]:
                        break
                    opt = ctx.option(sids[o], pname, may_o, self.repack, self.capacity)
                    if opt is not None and (best is None or (opt.cost, o) < best[:2]):
                        best = (opt.cost, o, opt)
            if best is None:
                return None
            _, o, opt = best
            if opt.kind == _NEW and not ctx.sigs[sids[o]][3]:
                touched += 1
            sids[o] = opt.after
            steps.append((o, opt))
        return steps

    @staticmethod
    def _total(steps: list[tuple[int, _Option]]) -> tuple[int, ...]:
        return tuple(sum(c) for c in zip_longest(*(opt.cost for _, opt in steps), fillvalue=0))

    def _best_on_listed_nodes(
        self, claim: ClaimDemand, pname: str, use_only: bool
    ) -> list[tuple[int, _Option]] | None:
        assert claim.nodes is not None
        best: tuple[tuple[int, ...], str, list[tuple[int, _Option]]] | None = None
        for node in sorted(claim.nodes):
            orders = self.ctx.nodes.get(node)
            if not orders:
                continue
            steps = self._simulate(orders, pname, claim.count_for(pname), use_only)
            if steps is not None:
                total = self._total(steps)
                if best is None or (total, node) < best[:2]:
                    best = (total, node, steps)
        return None if best is None else best[2]

    def _first_node_by_heap(
        self, claim: ClaimDemand, pname: str, use_only: bool
    ) -> list[tuple[int, _Option]] | None:
        """Visit nodes in order of their cheapest GPU for ``pname``; take the first that fits the claim."""
        heaps = [self.heaps[(m, pname)] for m in self.ctx.models_with[pname]]
        popped: list[tuple[list[_Entry], _Entry]] = []
        tried: set[str] = set()
        result: list[tuple[int, _Option]] | None = None
        while True:
            best_heap = None
            best_top: _Entry | None = None
            for h in heaps:
                top = self._current(h)  # bounds are good enough to order the nodes to try
                if top is not None and (best_top is None or top[:2] < best_top[:2]):
                    best_top, best_heap = top, h
            if best_top is None or best_heap is None or (use_only and best_top[0] != _USE_COST):
                break
            heapq.heappop(best_heap)
            popped.append((best_heap, best_top))
            node = self.gpus[best_top[1]].node
            if node in tried or (claim.nodes is not None and node not in claim.nodes):
                continue
            tried.add(node)
            if len(tried) > _MAX_NODES_TRIED:
                break
            result = self._simulate(self.ctx.nodes[node], pname, claim.count_for(pname), use_only)
            if result is not None:
                break
        for h, entry in popped:
            heapq.heappush(h, entry)
        return result

    def _commit(self, g: _Gpu, opt: _Option, claim: str) -> None:
        if opt.kind == _NEW:
            if not g.changed:
                g.changed = True
                self.touched += 1
            for d in opt.destroyed:
                g.events.append(("removed", d, f"for claim {claim}"))
            self.destroyed += len(opt.destroyed)
            g.events.append(("added", opt.inst, f"for claim {claim}"))
        g.pinned, g.free, g.sid = opt.pinned, opt.free, opt.after
        g.assigned.append((opt.inst, claim))
        if not self.exhausted and self.ctx.budget is not None and self.touched >= self.ctx.budget:
            self.exhausted = True
            for h in self.gpus:
                h.version += 1
            self._build_heaps()
        else:
            self._refresh(g)

    # -- whole pass -----------------------------------------------------------------------------------------
    def run(
        self, claims: Sequence[ClaimDemand], cfg: _PassConfig, first: Mapping[str, int] | None = None
    ) -> None:
        """Place ``claims`` in this order; ``first`` names claims whose alternative of that rank is tried
        before the others (an improvement move)."""
        size = self.ctx.size
        for claim in claims:
            alts = list(enumerate(claim.alternatives))
            if cfg.small_alternatives:
                alts.sort(key=lambda ra: (size.get(ra[1], 1.0), ra[0]))
            if first and claim.name in first:
                alts.sort(key=lambda ra: ra[0] != first[claim.name])
            if cfg.use_first and any(self.place(claim, r, p, use_only=True) for r, p in alts):
                continue
            for r, p in alts:
                if self.place(claim, r, p, use_only=False):
                    break

    def score(self) -> tuple[int, ...]:
        """Objective, larger is better: satisfied, first choices, -rank sum, -destroyed, -GPUs touched."""
        ranks = [r for r, _ in self.placed.values()]
        return (len(ranks), sum(1 for r in ranks if r == 0), -sum(ranks), -self.destroyed, -self.touched)


def _order_claims(claims: Sequence[ClaimDemand], ctx: _Context, how: str) -> list[ClaimDemand]:
    def csize(c: ClaimDemand) -> float:
        return c.count_for(c.alternatives[0]) * ctx.size.get(c.alternatives[0], 1.0)

    def nodes_n(c: ClaimDemand) -> int:
        return len(c.nodes) if c.nodes is not None else len(ctx.nodes) + 1

    def need(c: ClaimDemand) -> float:
        return min(c.count_for(p) * ctx.size.get(p, 1.0) for p in c.alternatives)

    by_name = sorted(claims, key=lambda c: c.name)
    if how == "need":
        return sorted(by_name, key=lambda c: (need(c), c.nodes is None))
    if how == "large":
        return sorted(by_name, key=lambda c: (c.nodes is None, -csize(c), len(c.alternatives)))
    if how == "small":
        return sorted(by_name, key=lambda c: (csize(c), c.nodes is None))
    if how == "constrained":
        return sorted(by_name, key=lambda c: (nodes_n(c), len(c.alternatives), -csize(c)))
    seed = int(how.removeprefix("shuffle"))
    rng = random.Random(7919 * (seed + 1))
    rng.shuffle(by_name)
    return by_name


# -- after the claims: baseline, warm pool, leftovers -------------------------------------------------------
def _return_to_baseline(p: _Pass, baseline: Mapping[str, Layout]) -> None:
    for g in p.gpus:
        base = baseline.get(g.model.key)
        if base is None or g.busy or g.assigned or g.order in p.ctx.frozen:
            continue
        target = normalize_layout(list(base))
        if g.layout() == target:
            continue
        if not g.changed:
            if p.exhausted:
                continue
            g.changed = True
            p.touched += 1
            if p.ctx.budget is not None and p.touched >= p.ctx.budget:
                p.exhausted = True
        for inst in g.free:
            if inst not in target:
                g.events.append(("removed", inst, "return to baseline"))
        for inst in target:
            if inst not in g.free:
                g.events.append(("added", inst, "return to baseline"))
        g.free = target
        g.sid = p.ctx.intern(g.sig())


def _fill_warm_pool(p: _Pass, warm_pool: Mapping[str, int]) -> None:
    ctx = p.ctx
    for pname in sorted(warm_pool):
        want = warm_pool[pname]
        have = sum(1 for g in p.gpus for i in g.free if i.profile == pname)
        while have < want:
            best: tuple[tuple[int, ...], int, _Option] | None = None
            seen: dict[int, _Option | None] = {}
            for g in p.gpus:
                if not g.model.has_profile(pname) or g.order in ctx.frozen:
                    continue
                if g.sid not in seen:
                    opt = ctx.new_option(g.sid, pname) if (g.changed or not p.exhausted) else None
                    seen[g.sid] = opt if opt is not None and not opt.destroyed else None
                found = seen[g.sid]
                if found is not None and (best is None or (found.cost, g.order) < best[:2]):
                    best = (found.cost, g.order, found)
            if best is None:
                break
            g = p.gpus[best[1]]
            opt = best[2]
            if not g.changed:
                g.changed = True
                p.touched += 1
                if ctx.budget is not None and p.touched >= ctx.budget:
                    p.exhausted = True
            g.events.append(("added", opt.inst, f"warm pool {pname}"))
            g.free = with_instance(g.free, opt.inst)
            g.sid = ctx.intern(g.sig())
            have += 1


def _take_leftover_free(p: _Pass, claims: Sequence[ClaimDemand]) -> None:
    """A claim still unsatisfied takes free instances that exist now (e.g. made by the baseline)."""
    pending = [c for c in claims if c.name not in p.placed]
    if not pending:
        return
    # Free unassigned instances per (node, profile), so a large cluster is not scanned once per claim.
    where: dict[tuple[str, str], list[tuple[int, PlacedInstance]]] = {}
    for g in p.gpus:
        for inst in g.free:
            where.setdefault((g.node, inst.profile), []).append((g.order, inst))
    for claim in pending:
        for rank, pname in enumerate(claim.alternatives):
            nodes = sorted(claim.nodes) if claim.nodes is not None else sorted(p.ctx.nodes)
            want = claim.count_for(pname)
            node = next((n for n in nodes if len(where.get((n, pname), ())) >= want), None)
            if node is None:
                continue
            found = where[(node, pname)][:want]
            del where[(node, pname)][:want]
            for o, inst in found:
                g = p.gpus[o]
                g.free = without(g.free, (inst,))
                g.pinned = with_instance(g.pinned, inst)
                g.assigned.append((inst, claim.name))
                g.sid = p.ctx.intern(g.sig())
            p.placed[claim.name] = (rank, found)
            break


def _reason(events: list[tuple[str, PlacedInstance, str]]) -> str:
    purposes: list[str] = []
    grouped: dict[str, tuple[list[str], list[str]]] = {}
    for what, inst, purpose in events:
        if purpose not in grouped:
            purposes.append(purpose)
            grouped[purpose] = ([], [])
        grouped[purpose][0 if what == "removed" else 1].append(fmt_instance(inst))
    parts = []
    for purpose in purposes:
        removed, added = grouped[purpose]
        bits = []
        if removed:
            bits.append("removed free " + ", ".join(removed))
        if added:
            bits.append("added " + ", ".join(added))
        parts.append(f"{purpose}: " + ", ".join(bits))
    return "; ".join(parts)


def _result(p: _Pass, claims: Sequence[ClaimDemand]) -> PlanResult:
    gpu_plans = []
    for g in p.gpus:
        # A GPU never marked changed still has exactly its current instances (assignments move none).
        layout = g.layout() if g.changed else g.current
        changed = layout != g.current
        gpu_plans.append(
            GpuPlan(g.node, g.state.index, g.model.key, layout, changed, _reason(g.events) if changed else "")
        )
    assignments = []
    for name in sorted(p.placed):
        for order, inst in p.placed[name][1]:
            g = p.gpus[order]
            assignments.append(Assignment(name, g.node, g.state.index, inst.profile, inst.start))
    assignments.sort(key=lambda a: (a.claim, a.node, a.index, a.start))
    unsatisfied = tuple(c.name for c in claims if c.name not in p.placed)
    return PlanResult(tuple(gpu_plans), tuple(assignments), unsatisfied)


def _moves(
    order: list[ClaimDemand], best: _Pass, first: dict[str, int]
) -> Iterator[tuple[list[ClaimDemand], dict[str, int]]]:
    """Local-search moves from the winning pass, generated lazily (the caller stops at its pass budget):
    an unsatisfied claim moved to the front; a satisfied claim trying another alternative first; both."""
    fronts = [[c, *(o for o in order if o is not c)] for c in order if c.name not in best.placed]
    yield from ((f, first) for f in fronts)
    swaps = [
        (claim.name, rank)
        for claim in order
        if (placed := best.placed.get(claim.name)) is not None
        for rank in range(len(claim.alternatives))
        if rank != placed[0]
    ]
    yield from ((order, {**first, name: rank}) for name, rank in swaps)
    for f in fronts:
        yield from ((f, {**first, name: rank}) for name, rank in swaps)


def plan(
    gpus: Sequence[GpuState],
    claims: Sequence[ClaimDemand],
    policy: Policy,
    catalog: Catalog | None = None,
) -> PlanResult:
    """Plan one round: target layout per GPU, claim-to-instance assignments, unsatisfied claims.

    Pure and deterministic (same input, same output). Raises ``PlanInputError`` for an unusable input.
    ``catalog`` defaults to the bundled catalog.
    """
    geo = GeoCache(catalog if catalog is not None else load_catalog())
    validate_inputs(gpus, claims, policy, geo)
    ctx = _Context(gpus, claims, policy, geo)
    n = len(claims)
    max_passes = max(1, _PASS_WORK_BUDGET // max(1, n + len(ctx.base)))
    configs = _pass_configs()
    configs += _budget_configs(ctx, max_passes - len(configs))
    configs = configs[:max_passes]
    best: _Pass | None = None
    best_score: tuple[int, ...] = ()
    best_run: tuple[_PassConfig, list[ClaimDemand]] | None = None
    ordered: dict[str, list[ClaimDemand]] = {}
    passes = 0
    for cfg in configs:
        if cfg.order not in ordered:
            ordered[cfg.order] = _order_claims(claims, ctx, cfg.order)
        p = _Pass(ctx, cfg)
        p.run(ordered[cfg.order], cfg)
        passes += 1
        score = p.score()
        if best is None or score > best_score:
            best, best_score, best_run = p, score, (cfg, ordered[cfg.order])
        if best_score[0] == n and best_score[1] == n and best_score[3] == 0:
            break  # every claim got its first choice without destroying anything
    # Bounded improvement (local search on the winning pass): move an unsatisfied claim to the front, or
    # make a satisfied claim try another of its alternatives first; keep a move when the score improves.
    first: dict[str, int] = {}
    improved = True
    while (
        improved and best is not None and best_run is not None and best_score[0] < n and passes < max_passes
    ):
        improved = False
        cfg, order = best_run
        for trial_order, trial_first in _moves(order, best, first):
            if passes >= max_passes:
                break
            p = _Pass(ctx, cfg)
            p.run(trial_order, cfg, trial_first)
            passes += 1
            if p.score() > best_score:
                best, best_score, best_run, first = p, p.score(), (cfg, trial_order), trial_first
                improved = True
                break
    assert best is not None
    _return_to_baseline(best, policy.baseline)
    _fill_warm_pool(best, policy.warm_pool)
    _take_leftover_free(best, claims)
    return _result(best, claims)
