"""One greedy pass of the layout planner (see :mod:`dynamig.planner.core` for how a round is planned):
claims placed one at a time, each device on the cheapest option over the eligible GPUs, options cached
by GPU signature and found through one heap per (model, profile). Also the pass variants a round runs
and the claim orders they use. Pure and deterministic."""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations, zip_longest
from math import comb
from typing import NamedTuple

from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, normalize_layout
from dynamig.planner._geo import GeoCache, with_instance, without
from dynamig.planner.model import (
    ClaimDemand,
    GpuState,
    Policy,
    Strategy,
)

_USE = 0  # take an existing free instance
_NEW = 1  # create an instance (possibly destroying free ones)
_USE_COST: tuple[int, ...] = (0, 0, 0)
_MISSING = object()


# A multi-device claim on any node tries the nodes of the cheapest GPUs first, at most this many.
_MAX_NODES_TRIED = 64
_SHUFFLED_PASSES = 8
# Above this many nodes a node-restricted claim is placed through the heaps instead of visiting each node.
_DIRECT_NODE_LIMIT = 16

_Entry = tuple[tuple[int, ...], int, int, bool]
"""Heap entry: (cost or a lower bound of it, GPU order, GPU version when pushed, cost is exact)."""

Sig = tuple[str, Layout, Layout, bool]
"""What a GPU's options depend on: model key, pinned instances, free unassigned instances, touched."""


class Option(NamedTuple):
    cost: tuple[int, ...]
    kind: int
    inst: PlacedInstance
    destroyed: tuple[PlacedInstance, ...]
    pinned: Layout  # pinned instances after taking this option
    free: Layout  # free unassigned instances after taking this option
    after: int  # interned signature of the GPU after taking this option


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


class Context:
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
        self.additive = frozenset(g.order for g in self.base if g.state.key in policy.additive) - self.frozen
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
        self._opt: dict[tuple[int, str, bool, bool, bool, bool], Option | None] = {}
        self._new: dict[tuple[int, str, bool], list[Option]] = {}
        self._use: dict[tuple[int, str], Option | None] = {}
        self._lb: dict[tuple[int, str, bool, bool], tuple[tuple[int, ...], bool] | None] = {}
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

    def use_option(self, sid: int, pname: str) -> Option | None:
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
                opt = Option(_USE_COST, _USE, inst, (), pinned, free, after)
                break
        self._use[k] = opt
        return opt

    def option(
        self,
        sid: int,
        pname: str,
        may_touch: bool,
        repack: bool = False,
        capacity: bool = False,
        add_only: bool = False,
    ) -> Option | None:
        """Cheapest way to get one ``pname`` device on a GPU with signature ``sig``; None if impossible.

        Default costs put existing free instances first, then fewest destroyed, fewest GPUs touched, packing
        and fragmentation. ``repack`` costs rank every option, existing instances included, by how much
        room the pinned instances leave for later claims (a pass variant for tight rounds). ``capacity``
        selects the fragmentation measure (see ``GeoCache.flex``). ``add_only``: no option destroys anything.
        """
        k = (sid, pname, may_touch, repack, capacity, add_only)
        got = self._opt.get(k, _MISSING)
        if got is not _MISSING:
            return got  # type: ignore[return-value]
        sig = self.sigs[sid]
        may = may_touch or sig[3]
        use = self.use_option(sid, pname)
        opt: Option | None
        if not repack:
            opt = use if use is not None or not may else self.new_option(sid, pname, capacity, add_only)
        else:
            model = self.geo.model(sig[0])
            options = [use] if use is not None else []
            if may:
                news = self._new_options(sid, pname, capacity)
                options += [o for o in news if not (add_only and o.destroyed)]
            opt = None
            for o in options:
                cost = (*self.geo.flex(model, o.pinned, self.allowed, capacity), *o.cost)
                if opt is None or cost < opt.cost:
                    opt = o._replace(cost=cost)
        self._opt[k] = opt
        return opt

    def lower_bound(
        self, sid: int, pname: str, may_touch: bool, repack: bool, capacity: bool, add_only: bool = False
    ) -> tuple[tuple[int, ...], bool] | None:
        """A cheap lower bound of ``option(...).cost`` and whether it is exact; None if no option exists.

        Computing the exact cost of a new instance (every start, fragmentation of each result) is the
        expensive part of planning, and most GPUs are never the best choice, so heaps start from bounds
        and only entries that reach the top get their exact cost.
        """
        if repack:
            opt = self.option(sid, pname, may_touch, repack, capacity, add_only)
            return None if opt is None else (opt.cost, True)
        k = (sid, pname, may_touch, add_only)  # the bound does not depend on the fragmentation measure
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
            elif not add_only and any(not (m & self.pin_mask[sid]) for m in masks):
                result = ((1,), False)
            else:
                result = None
        self._lb[k] = result
        return result

    def new_option(
        self, sid: int, pname: str, capacity: bool = False, add_only: bool = False
    ) -> Option | None:
        """Cheapest new ``pname`` instance (default costs) on a GPU with signature ``sid``, or None;
        ``add_only``: only one that destroys nothing."""
        best: Option | None = None
        for o in self._new_options(sid, pname, capacity):
            if add_only and o.destroyed:
                continue
            if best is None or o.cost < best.cost:
                best = o
        return best

    def _new_options(self, sid: int, pname: str, capacity: bool) -> list[Option]:
        """Every start where a new ``pname`` instance can go, destroying free instances as needed."""
        k = (sid, pname, capacity)
        got = self._new.get(k)
        if got is not None:
            return got
        mkey, pinned, free, changed = self.sigs[sid]
        model = self.geo.model(mkey)
        out: list[Option] = []
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
            out.append(Option(cost, _NEW, inst, tuple(destroyed), new_pinned, tuple(kept), after))
        self._new[k] = out
        return out


@dataclass(frozen=True, slots=True)
class PassConfig:
    order: str  # "large" | "small" | "need" | "constrained" | "shuffle<N>"
    use_first: bool  # try existing free instances of every alternative before creating anything
    small_alternatives: bool = False  # try alternatives smallest first (rank still counts as given)
    touchable: frozenset[int] | None = None  # only these GPUs (by order) may change; None: any
    repack: bool = False  # rank options by the room left for later claims (see Context.option)
    capacity: bool = False  # measure fragmentation by remaining capacity per profile (GeoCache.flex)


def pass_configs() -> list[PassConfig]:
    configs = [
        PassConfig("large", use_first=False),
        PassConfig("small", use_first=False),
        PassConfig("large", use_first=True),
        PassConfig("constrained", use_first=False),
        PassConfig("small", use_first=True, small_alternatives=True),
        PassConfig("large", use_first=False, small_alternatives=True),
        PassConfig("need", use_first=False, small_alternatives=True),
        PassConfig("need", use_first=True, small_alternatives=True),
        PassConfig("need", use_first=False, small_alternatives=True, repack=True),
        PassConfig("large", use_first=False, repack=True),
        PassConfig("large", use_first=False, capacity=True),
        PassConfig("need", use_first=False, small_alternatives=True, capacity=True),
        PassConfig("need", use_first=False, small_alternatives=True, repack=True, capacity=True),
        PassConfig("constrained", use_first=False, capacity=True),
    ]
    configs += [
        PassConfig(f"shuffle{i}", use_first=False, small_alternatives=i % 2 == 1, capacity=i % 4 >= 2)
        for i in range(_SHUFFLED_PASSES)
    ]
    return configs


def budget_configs(ctx: Context, limit: int) -> list[PassConfig]:
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
                PassConfig(
                    order, use_first=False, small_alternatives=order == "need", touchable=frozenset(subset)
                )
            )
    return out


class Pass:
    """One greedy placement of all claims over a fresh copy of the GPUs."""

    def __init__(self, ctx: Context, cfg: PassConfig) -> None:
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

    def add_only(self, order: int) -> bool:
        """May GPU ``order`` only gain instances (it is cooling down)?"""
        return order in self.ctx.additive

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
        bounds: dict[tuple[int, str, bool, bool], tuple[tuple[int, ...], bool] | None] = {}
        for g in self.gpus:
            may, add_only = self.may_touch(g.order), self.add_only(g.order)
            for p in ctx.demanded[g.model.key]:
                bk = (g.sid, p, may, add_only)
                if bk in bounds:
                    lb = bounds[bk]
                else:
                    lb = bounds[bk] = ctx.lower_bound(g.sid, p, may, self.repack, self.capacity, add_only)
                if lb is not None:
                    heaps[(g.model.key, p)].append((lb[0], g.order, g.version, lb[1]))
        for h in heaps.values():
            heapq.heapify(h)
        self.heaps = heaps
        if fresh:
            ctx.initial_heaps[key] = {k: list(h) for k, h in heaps.items()}

    def _refresh(self, g: _Gpu) -> None:
        g.version += 1
        may, add_only = self.may_touch(g.order), self.add_only(g.order)
        for p in self.ctx.demanded[g.model.key]:
            lb = self.ctx.lower_bound(g.sid, p, may, self.repack, self.capacity, add_only)
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
            opt = self._option(g, pname)
            if opt is not None:
                heapq.heappush(heap, (opt.cost, g.order, g.version, True))
        return None

    def _option(self, g: _Gpu, pname: str) -> Option | None:
        return self.ctx.option(
            g.sid, pname, self.may_touch(g.order), self.repack, self.capacity, self.add_only(g.order)
        )

    # -- placing a claim ----------------------------------------------------------------------------------
    def place(self, claim: ClaimDemand, rank: int, pname: str, use_only: bool) -> bool:
        models = self.ctx.models_with.get(pname)
        if not models:
            return False
        fkey = (pname, claim.count_for(pname), claim.nodes, use_only)
        if fkey in self.failed:
            return False
        steps: list[tuple[int, Option]] | None
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

    def _best_single(self, pname: str, use_only: bool) -> list[tuple[int, Option]] | None:
        best: _Entry | None = None
        for mkey in self.ctx.models_with[pname]:
            top = self._top(self.heaps[(mkey, pname)], pname)
            if top is not None and (best is None or top[:2] < best[:2]):
                best = top
        if best is None or (use_only and best[0] != _USE_COST):
            return None
        g = self.gpus[best[1]]
        opt = self._option(g, pname)
        assert opt is not None and opt.cost == best[0]
        return [(g.order, opt)]

    def _simulate(
        self, orders: Sequence[int], pname: str, count: int, use_only: bool
    ) -> list[tuple[int, Option]] | None:
        """Cheapest way to get ``count`` devices on these GPUs (one node), without changing anything."""
        ctx = self.ctx
        sids = {o: self.gpus[o].sid for o in orders}
        touched = self.touched
        budget = ctx.budget
        steps: list[tuple[int, Option]] = []
        for _ in range(count):
            best: tuple[tuple[int, ...], int, Option] | None = None
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
                    lb = ctx.lower_bound(sids[o], pname, may_o, self.repack, self.capacity, self.add_only(o))
                    if lb is not None:
                        bounds.append((lb[0], o, may_o))
                bounds.sort()
                for lb_cost, o, may_o in bounds:
                    if best is not None and (lb_cost, o) >= best[:2]:
                        break
                    opt = ctx.option(sids[o], pname, may_o, self.repack, self.capacity, self.add_only(o))
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
    def _total(steps: list[tuple[int, Option]]) -> tuple[int, ...]:
        return tuple(sum(c) for c in zip_longest(*(opt.cost for _, opt in steps), fillvalue=0))

    def _best_on_listed_nodes(
        self, claim: ClaimDemand, pname: str, use_only: bool
    ) -> list[tuple[int, Option]] | None:
        assert claim.nodes is not None
        best: tuple[tuple[int, ...], str, list[tuple[int, Option]]] | None = None
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
    ) -> list[tuple[int, Option]] | None:
        """Visit nodes in order of their cheapest GPU for ``pname``; take the first that fits the claim."""
        heaps = [self.heaps[(m, pname)] for m in self.ctx.models_with[pname]]
        popped: list[tuple[list[_Entry], _Entry]] = []
        tried: set[str] = set()
        result: list[tuple[int, Option]] | None = None
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

    def _commit(self, g: _Gpu, opt: Option, claim: str) -> None:
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
        self, claims: Sequence[ClaimDemand], cfg: PassConfig, first: Mapping[str, int] | None = None
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


def order_claims(claims: Sequence[ClaimDemand], ctx: Context, how: str) -> list[ClaimDemand]:
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
