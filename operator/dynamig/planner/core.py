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
   A GPU the policy marks frozen (still reshaping) offers only its free instances; one it marks additive
   (cooling down) also offers new instances in free memory slices, never one that destroys anything, and
   neither returns to the baseline nor takes warm-pool instances.

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

from collections.abc import Iterator, Mapping, Sequence

from dynamig.geometry.catalog import Catalog, load_catalog
from dynamig.geometry.model import Layout, PlacedInstance, normalize_layout
from dynamig.planner._geo import GeoCache, with_instance, without
from dynamig.planner.greedy import (
    Context,
    Option,
    Pass,
    PassConfig,
    budget_configs,
    order_claims,
    pass_configs,
)
from dynamig.planner.model import (
    Assignment,
    ClaimDemand,
    GpuPlan,
    GpuState,
    PlanResult,
    Policy,
)
from dynamig.planner.validation import fmt_instance, validate_inputs

# Work units (claims + GPUs) times passes allowed per round: a 1,000-node round with 5,000 claims gets one
# pass, a 64-node round about twenty, a tiny round every pass variant and the improvement steps.
_PASS_WORK_BUDGET = 20_000


# -- after the claims: baseline, warm pool, leftovers -------------------------------------------------------
def _return_to_baseline(p: Pass, baseline: Mapping[str, Layout]) -> None:
    for g in p.gpus:
        base = baseline.get(g.model.key)
        if base is None or g.busy or g.assigned or g.order in p.ctx.frozen or g.order in p.ctx.additive:
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


def _fill_warm_pool(p: Pass, warm_pool: Mapping[str, int]) -> None:
    ctx = p.ctx
    for pname in sorted(warm_pool):
        want = warm_pool[pname]
        have = sum(1 for g in p.gpus for i in g.free if i.profile == pname)
        while have < want:
            best: tuple[tuple[int, ...], int, Option] | None = None
            seen: dict[int, Option | None] = {}
            for g in p.gpus:
                # A GPU cooling down gains instances for claims only: the warm pool waits for the cooldown.
                if not g.model.has_profile(pname) or g.order in ctx.frozen or g.order in ctx.additive:
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


def _take_leftover_free(p: Pass, claims: Sequence[ClaimDemand]) -> None:
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


def _result(p: Pass, claims: Sequence[ClaimDemand]) -> PlanResult:
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
    order: list[ClaimDemand], best: Pass, first: dict[str, int]
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
    ctx = Context(gpus, claims, policy, geo)
    n = len(claims)
    max_passes = max(1, _PASS_WORK_BUDGET // max(1, n + len(ctx.base)))
    configs = pass_configs()
    configs += budget_configs(ctx, max_passes - len(configs))
    configs = configs[:max_passes]
    best: Pass | None = None
    best_score: tuple[int, ...] = ()
    best_run: tuple[PassConfig, list[ClaimDemand]] | None = None
    ordered: dict[str, list[ClaimDemand]] = {}
    passes = 0
    for cfg in configs:
        if cfg.order not in ordered:
            ordered[cfg.order] = order_claims(claims, ctx, cfg.order)
        p = Pass(ctx, cfg)
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
            p = Pass(ctx, cfg)
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
