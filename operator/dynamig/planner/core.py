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

2. Several passes run with different claim orders (large first, small first, most constrained first,
   seeded shuffles) and with "use existing free instances before anything else" on or off; the best pass
   by the objective (claims satisfied, then first choices, then free instances destroyed and GPUs touched)
   wins. How many passes run is bounded by the size of the input, so a 1,000-node round stays fast.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
_USE_COST = (0, 0, 0, 0, 0, 0)

# Work units (claims + GPUs) times passes allowed per round; keeps a 1,000-node round to about two passes.
_PASS_WORK_BUDGET = 30_000
_SHUFFLED_PASSES = 8
# Above this many nodes a node-restricted claim is placed through the heaps instead of visiting each node.
_DIRECT_NODE_LIMIT = 16

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
        if claim.count < 1:
            raise PlanInputError(f"claim {claim.name}: count must be at least 1, got {claim.count}")
        if not claim.alternatives:
            raise PlanInputError(f"claim {claim.name}: no profile alternatives")
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

    __slots__ = ("assigned", "busy", "changed", "current", "events", "free", "model", "node", "order",
                 "pinned", "state", "version")

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
        self.assigned: list[tuple[PlacedInstance, str]] = []
        self.events: list[tuple[str, PlacedInstance, str]] = []  # (removed|added, instance, purpose)

    def copy(self) -> _Gpu:
        g = _Gpu.__new__(_Gpu)
        g.order, g.state, g.node, g.model = self.order, self.state, self.node, self.model
        g.current, g.busy, g.pinned, g.free = self.current, self.busy, self.pinned, self.free
        g.changed, g.version = self.changed, 0
        g.assigned = list(self.assigned)
        g.events = list(self.events)
        return g

    def sig(self) -> Sig:
        return (self.model.key, self.pinned, self.free, self.changed)

    def layout(self) -> Layout:
        return tuple(sorted((*self.pinned, *self.free)))


class _Context:
    """What every pass shares: sorted GPUs, indexes, the option cache. Built once per ``plan`` call."""

    def __init__(self, gpus: Sequence[GpuState], claims: Sequence[ClaimDemand], policy: Policy,
                 geo: GeoCache) -> None:
        self.geo = geo
        self.policy = policy
        self.allowed = policy.allowed_profiles
        self.spread = policy.strategy == Strategy.SPREAD
        self.budget = policy.max_gpus_reshaped
        states = sorted(gpus, key=lambda s: (s.node, s.index))
        self.base = [_Gpu(i, s, geo.model(s.model)) for i, s in enumerate(states)]
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
        self._opt: dict[tuple[Sig, str, bool], _Option | None] = {}
        self._use: dict[tuple[Sig, str], _Option | None] = {}

    def use_option(self, sig: Sig, pname: str) -> _Option | None:
        """Take an existing free instance of ``pname`` on a GPU with signature ``sig``, if there is one."""
        k = (sig, pname)
        if k in self._use:
            return self._use[k]
        opt = None
        for inst in sig[2]:
            if inst.profile == pname:
                pinned, free = with_instance(sig[1], inst), without(sig[2], (inst,))
                opt = _Option(_USE_COST, _USE, inst, (), pinned, free)
                break
        self._use[k] = opt
        return opt

    def option(self, sig: Sig, pname: str, may_touch: bool) -> _Option | None:
        """Cheapest way to get one ``pname`` device on a GPU with signature ``sig``; None if impossible."""
        may_touch = may_touch or sig[3]
        k = (sig, pname, may_touch)
        if k in self._opt:
            return self._opt[k]
        opt = self.use_option(sig, pname)
        if opt is None and may_touch:
            opt = self._new_option(sig, pname)
        self._opt[k] = opt
        return opt

    def _new_option(self, sig: Sig, pname: str) -> _Option | None:
        mkey, pinned, free, changed = sig
        model = self.geo.model(mkey)
        if not model.has_profile(pname) or (self.allowed is not None and pname not in self.allowed):
            return None
        geo = self.geo
        size = model.profile(pname).placement_size
        touch = 0 if (changed or self.spread) else 1
        best: _Option | None = None
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
            largest, placements = geo.flex(model, layout, self.allowed)
            fit = used if self.spread else -used
            cost = (len(destroyed), touch, 1, fit, -largest, -placements)
            if best is None or cost < best.cost:
                best = _Option(cost, _NEW, inst, tuple(destroyed), new_pinned, tuple(kept))
        return best


@dataclass(frozen=True, slots=True)
class _PassConfig:
    order: str  # "large" | "small" | "constrained" | "shuffle<N>"
    use_first: bool  # try existing free instances of every alternative before creating anything
    small_alternatives: bool = False  # try alternatives smallest first (rank still counts as given)


def _pass_configs() -> list[_PassConfig]:
    configs = [
        _PassConfig("large", use_first=False),
        _PassConfig("small", use_first=False),
        _PassConfig("large", use_first=True),
        _PassConfig("constrained", use_first=False),
        _PassConfig("small", use_first=True, small_alternatives=True),
        _PassConfig("large", use_first=False, small_alternatives=True),
    ]
    configs += [_PassConfig(f"shuffle{i}", use_first=i % 2 == 1) for i in range(_SHUFFLED_PASSES)]
    return configs


class _Pass:
    """One greedy placement of all claims over a fresh copy of the GPUs."""

    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx
        self.gpus = [g.copy() for g in ctx.base]
        self.touched = 0
        self.exhausted = ctx.budget is not None and ctx.budget <= 0
        self.failed: set[tuple[str, int, frozenset[str] | None, bool]] = set()
        self.placed: dict[str, tuple[int, list[tuple[int, PlacedInstance]]]] = {}  # claim -> (rank, devices)
        self.destroyed = 0
        self.heaps: dict[tuple[str, str], list[tuple[tuple[int, ...], int, int]]] = {}
        self._build_heaps()

    # -- budget and heaps -------------------------------------------------------------------------------
    def may_touch(self) -> bool:
        return not self.exhausted

    def _build_heaps(self) -> None:
        ctx = self.ctx
        heaps: dict[tuple[str, str], list[tuple[tuple[int, ...], int, int]]] = {
            (m.key, p): [] for m in ctx.models for p in ctx.demanded[m.key]
        }
        may = self.may_touch()
        for g in self.gpus:
            sig = g.sig()
            for p in ctx.demanded[g.model.key]:
                opt = ctx.option(sig, p, may)
                if opt is not None:
                    heaps[(g.model.key, p)].append((opt.cost, g.order, g.version))
        for h in heaps.values():
            heapq.heapify(h)
        self.heaps = heaps

    def _refresh(self, g: _Gpu) -> None:
        g.version += 1
        sig = g.sig()
        may = self.may_touch()
        for p in self.ctx.demanded[g.model.key]:
            opt = self.ctx.option(sig, p, may)
            if opt is not None:
                heapq.heappush(self.heaps[(g.model.key, p)], (opt.cost, g.order, g.version))

    def _top(self, heap: list[tuple[tuple[int, ...], int, int]]) -> tuple[tuple[int, ...], int, int] | None:
        while heap:
            entry = heap[0]
            if entry[2] == self.gpus[entry[1]].version:
                return entry
            heapq.heappop(heap)
        return None

    # -- placing a claim ----------------------------------------------------------------------------------
    def place(self, claim: ClaimDemand, rank: int, pname: str, use_only: bool) -> bool:
        models = self.ctx.models_with.get(pname)
        if not models:
            return False
        fkey = (pname, claim.count, claim.nodes, use_only)
        if fkey in self.failed:
            return False
        steps: list[tuple[int, _Option]] | None
        if claim.nodes is not None and len(claim.nodes) <= _DIRECT_NODE_LIMIT:
            steps = self._best_on_listed_nodes(claim, pname, use_only)
        elif claim.nodes is None and claim.count == 1:
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
        best: tuple[tuple[int, ...], int, int] | None = None
        for mkey in self.ctx.models_with[pname]:
            top = self._top(self.heaps[(mkey, pname)])
            if top is not None and (best is None or top[:2] < best[:2]):
                best = top
        if best is None or (use_only and best[0] != _USE_COST):
            return None
        g = self.gpus[best[1]]
        opt = self.ctx.option(g.sig(), pname, self.may_touch())
        assert opt is not None and opt.cost == best[0]
        return [(g.order, opt)]

    def _simulate(self, orders: Sequence[int], pname: str, count: int,
                  use_only: bool) -> list[tuple[int, _Option]] | None:
        """Cheapest way to get ``count`` devices on these GPUs (one node), without changing anything."""
        ctx = self.ctx
        sigs = {o: self.gpus[o].sig() for o in orders}
        touched = self.touched
        budget = ctx.budget
        steps: list[tuple[int, _Option]] = []
        for _ in range(count):
            best: tuple[tuple[int, ...], int, _Option] | None = None
            may = budget is None or touched < budget
            for o in orders:
                opt = ctx.use_option(sigs[o], pname) if use_only else ctx.option(sigs[o], pname, may)
                if opt is not None and (best is None or (opt.cost, o) < best[:2]):
                    best = (opt.cost, o, opt)
            if best is None:
                return None
            _, o, opt = best
            s = sigs[o]
            if opt.kind == _NEW and not s[3]:
                touched += 1
            sigs[o] = (s[0], opt.pinned, opt.free, s[3] or opt.kind == _NEW)
            steps.append((o, opt))
        return steps

    @staticmethod
    def _total(steps: list[tuple[int, _Option]]) -> tuple[int, ...]:
        return tuple(sum(c) for c in zip(*(opt.cost for _, opt in steps), strict=True))

    def _best_on_listed_nodes(self, claim: ClaimDemand, pname: str,
                              use_only: bool) -> list[tuple[int, _Option]] | None:
        assert claim.nodes is not None
        best: tuple[tuple[int, ...], str, list[tuple[int, _Option]]] | None = None
        for node in sorted(claim.nodes):
            orders = self.ctx.nodes.get(node)
            if not orders:
                continue
            steps = self._simulate(orders, pname, claim.count, use_only)
            if steps is not None:
                total = self._total(steps)
                if best is None or (total, node) < best[:2]:
                    best = (total, node, steps)
        return None if best is None else best[2]

    def _first_node_by_heap(self, claim: ClaimDemand, pname: str,
                            use_only: bool) -> list[tuple[int, _Option]] | None:
        """Visit nodes in order of their cheapest GPU for ``pname``; take the first that fits the claim."""
        heaps = [self.heaps[(m, pname)] for m in self.ctx.models_with[pname]]
        popped: list[tuple[list[tuple[tuple[int, ...], int, int]], tuple[tuple[int, ...], int, int]]] = []
        tried: set[str] = set()
        result: list[tuple[int, _Option]] | None = None
        while True:
            best_heap = None
            best_top: tuple[tuple[int, ...], int, int] | None = None
            for h in heaps:
                top = self._top(h)
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
            result = self._simulate(self.ctx.nodes[node], pname, claim.count, use_only)
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
        g.pinned, g.free = opt.pinned, opt.free
        g.assigned.append((opt.inst, claim))
        if not self.exhausted and self.ctx.budget is not None and self.touched >= self.ctx.budget:
            self.exhausted = True
            for h in self.gpus:
                h.version += 1
            self._build_heaps()
        else:
            self._refresh(g)

    # -- whole pass -----------------------------------------------------------------------------------------
    def run(self, claims: Sequence[ClaimDemand], cfg: _PassConfig) -> None:
        size = self.ctx.size
        for claim in claims:
            alts = list(enumerate(claim.alternatives))
            if cfg.small_alternatives:
                alts.sort(key=lambda ra: (size.get(ra[1], 1.0), ra[0]))
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
        return c.count * ctx.size.get(c.alternatives[0], 1.0)

    def nodes_n(c: ClaimDemand) -> int:
        return len(c.nodes) if c.nodes is not None else len(ctx.nodes) + 1

    by_name = sorted(claims, key=lambda c: c.name)
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
        if base is None or g.busy or g.assigned:
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


def _fill_warm_pool(p: _Pass, warm_pool: Mapping[str, int]) -> None:
    ctx = p.ctx
    for pname in sorted(warm_pool):
        want = warm_pool[pname]
        have = sum(1 for g in p.gpus for i in g.free if i.profile == pname)
        while have < want:
            best: tuple[tuple[int, ...], int, _Option] | None = None
            seen: dict[Sig, _Option | None] = {}
            for g in p.gpus:
                if not g.model.has_profile(pname):
                    continue
                sig = g.sig()
                if sig not in seen:
                    opt = ctx._new_option(sig, pname) if (g.changed or not p.exhausted) else None
                    seen[sig] = opt if opt is not None and not opt.destroyed else None
                found = seen[sig]
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
            have += 1


def _take_leftover_free(p: _Pass, claims: Sequence[ClaimDemand]) -> None:
    """A claim still unsatisfied takes free instances that exist now (e.g. made by the baseline)."""
    for claim in claims:
        if claim.name in p.placed:
            continue
        for rank, pname in enumerate(claim.alternatives):
            nodes = sorted(claim.nodes) if claim.nodes is not None else sorted(p.ctx.nodes)
            done = False
            for node in nodes:
                orders = p.ctx.nodes.get(node, [])
                found = [(o, i) for o in orders for i in p.gpus[o].free if i.profile == pname]
                if len(found) >= claim.count:
                    for o, inst in found[: claim.count]:
                        g = p.gpus[o]
                        g.free = without(g.free, (inst,))
                        g.pinned = with_instance(g.pinned, inst)
                        g.assigned.append((inst, claim.name))
                    p.placed[claim.name] = (rank, found[: claim.count])
                    done = True
                    break
            if done:
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
        layout = g.layout()
        changed = layout != g.current
        gpu_plans.append(GpuPlan(g.node, g.state.index, g.model.key, layout, changed,
                                 _reason(g.events) if changed else ""))
    assignments = []
    for name in sorted(p.placed):
        for order, inst in p.placed[name][1]:
            g = p.gpus[order]
            assignments.append(Assignment(name, g.node, g.state.index, inst.profile, inst.start))
    assignments.sort(key=lambda a: (a.claim, a.node, a.index, a.start))
    unsatisfied = tuple(c.name for c in claims if c.name not in p.placed)
    return PlanResult(tuple(gpu_plans), tuple(assignments), unsatisfied)


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
    configs = _pass_configs()
    max_passes = max(1, min(len(configs), _PASS_WORK_BUDGET // max(1, n + len(ctx.base))))
    best: _Pass | None = None
    best_score: tuple[int, ...] | None = None
    ordered: dict[str, list[ClaimDemand]] = {}
    for cfg in configs[:max_passes]:
        if cfg.order not in ordered:
            ordered[cfg.order] = _order_claims(claims, ctx, cfg.order)
        p = _Pass(ctx)
        p.run(ordered[cfg.order], cfg)
        score = p.score()
        if best_score is None or score > best_score:
            best, best_score = p, score
        if best_score[0] == n and best_score[1] == n and best_score[3] == 0:
            break  # every claim got its first choice without destroying anything
    assert best is not None
    _return_to_baseline(best, policy.baseline)
    _fill_warm_pool(best, policy.warm_pool)
    _take_leftover_free(best, claims)
    return _result(best, claims)
