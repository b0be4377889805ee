"""Exhaustive reference search for tiny clusters (at most 4 GPUs and 10 claims).

Used by the tests and the benchmark to measure how close the greedy planner comes to the best possible
round. It follows the same rules as ``dynamig.planner.plan``: all devices of a claim use one alternative
and sit on one node; busy instances stay; free instances may be used, kept or destroyed; only allowed
profiles are created; at most ``max_gpus_reshaped`` GPUs change. It maximises (claims satisfied, first
choices) and ignores the warm pool and the baseline (they never compete with claims).

The search is a dynamic programme over claims whose state is the multiset of profiles each GPU must
provide; whether a GPU can provide a multiset is answered by a small backtracking search over placements
(cached). Pure and deterministic; exponential, so the size limits are enforced.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations_with_replacement

from dynamig.geometry.catalog import Catalog, load_catalog
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, normalize_layout
from dynamig.planner._geo import GeoCache, with_instance
from dynamig.planner.model import Assignment, ClaimDemand, GpuPlan, GpuState, PlanResult, Policy
from dynamig.planner.validation import validate_inputs

MAX_GPUS = 4
MAX_CLAIMS = 10

Demand = tuple[str, ...]  # sorted profile names one GPU must provide
_Fit = tuple[bool, tuple[PlacedInstance, ...]]  # (layout changes, one instance per demand item)


@dataclass(frozen=True, slots=True)
class ExhaustiveResult:
    satisfied: int
    first_choices: int
    plan: PlanResult


class _Gpu:
    __slots__ = ("busy", "current", "free", "index", "model", "node")

    def __init__(self, state: GpuState, model: GpuModel) -> None:
        self.node = state.node
        self.index = state.index
        self.model = model
        self.current: Layout = normalize_layout([i.placed for i in state.instances])
        self.busy: Layout = normalize_layout([i.placed for i in state.instances if i.busy])
        self.free: Layout = normalize_layout([i.placed for i in state.instances if not i.busy])


class _Search:
    def __init__(self, gpus: list[_Gpu], claims: list[ClaimDemand], policy: Policy, geo: GeoCache) -> None:
        self.gpus = gpus
        self.claims = claims
        self.allowed = policy.allowed_profiles
        self.budget = policy.max_gpus_reshaped
        self.geo = geo
        self._fit: dict[tuple[int, Demand], _Fit | None] = {}
        self._seen: dict[tuple[int, tuple[Demand, ...]], tuple[int, int]] = {}
        self.best: tuple[int, int] = (-1, -1)
        self.best_choices: list[tuple[int, str, tuple[int, ...]] | None] = []
        self.nodes: dict[str, list[int]] = {}
        for i, g in enumerate(gpus):
            self.nodes.setdefault(g.node, []).append(i)
        classes: dict[tuple[str, str, Layout, Layout], list[int]] = {}
        for i, g in enumerate(gpus):
            classes.setdefault((g.node, g.model.key, g.busy, g.free), []).append(i)
        self.twins = [group for group in classes.values() if len(group) > 1]
        # Least capacity (fraction of a GPU) each claim needs; for each k the needs of claims k.. sorted.
        need = []
        for c in claims:
            sizes = [
                c.count_for(p) * m.profile(p).placement_size / m.memory_slices
                for p in c.alternatives
                for m in {g.model.key: g.model for g in gpus}.values()
                if m.has_profile(p)
            ]
            need.append(min(sizes) if sizes else float("inf"))
        self.needs = [sorted(need[k:]) for k in range(len(claims) + 1)]

    def fit(self, gi: int, demand: Demand) -> _Fit | None:
        """Can GPU ``gi`` provide ``demand``? (changes layout, instances) or None. Cached."""
        k = (gi, demand)
        if k in self._fit:
            return self._fit[k]
        g = self.gpus[gi]
        result: _Fit | None = None
        if not demand:
            result = (False, ())
        else:
            free_count = Counter(i.profile for i in g.free)
            if not Counter(demand) - free_count:
                pool = list(g.free)
                picked = []
                for p in demand:
                    inst = next(i for i in pool if i.profile == p)
                    pool.remove(inst)
                    picked.append(inst)
                result = (False, tuple(picked))
            else:
                placed = self._place(g, list(demand), g.busy, [], -1)
                if placed is not None:
                    result = (True, tuple(placed))
        self._fit[k] = result
        return result

    def _place(
        self, g: _Gpu, items: list[str], layout: Layout, done: list[PlacedInstance], last_start: int
    ) -> list[PlacedInstance] | None:
        if len(done) == len(items):
            return done
        p = items[len(done)]
        same_as_previous = bool(done) and items[len(done) - 1] == p
        for s in self.geo.free_starts(g.model, layout, p):
            if same_as_previous and s <= last_start:
                continue  # identical items: only increasing starts, no permutations
            inst = PlacedInstance(s, p)
            if self.allowed is not None and p not in self.allowed and inst not in g.free:
                continue
            got = self._place(g, items, with_instance(layout, inst), [*done, inst], s)
            if got is not None:
                return got
        return None

    def changed_count(self, state: tuple[Demand, ...]) -> int:
        n = 0
        for gi, d in enumerate(state):
            f = self.fit(gi, d)
            assert f is not None
            n += f[0]
        return n

    def canonical(self, state: tuple[Demand, ...]) -> tuple[Demand, ...]:
        """Interchangeable GPUs (same node, model and current instances) in a fixed order of demands."""
        out = list(state)
        for group in self.twins:
            for gi, d in zip(group, sorted(state[gi] for gi in group), strict=True):
                out[gi] = d
        return tuple(out)

    def free_fraction(self, state: tuple[Demand, ...]) -> float:
        total = 0.0
        for gi, g in enumerate(self.gpus):
            m = g.model
            used = sum(m.profile(i.profile).placement_size for i in g.busy)
            used += sum(m.profile(p).placement_size for p in state[gi])
            total += (m.memory_slices - used) / m.memory_slices
        return total

    def upper_bound(self, k: int, state: tuple[Demand, ...]) -> int:
        """At most how many of claims ``k..`` can still be satisfied: the smallest ones that fit in the
        free capacity left (a relaxation that ignores placement rules and node boundaries)."""
        room = self.free_fraction(state) + 1e-9
        n = 0
        for need in self.needs[k]:
            if need > room:
                break
            room -= need
            n += 1
        return n

    def search(
        self,
        k: int,
        state: tuple[Demand, ...],
        sat: int,
        firsts: int,
        choices: list[tuple[int, str, tuple[int, ...]] | None],
    ) -> None:
        """Depth-first branch and bound over claims ``k..``; records the best (satisfied, first choices)."""
        if (sat, firsts) > self.best:
            self.best = (sat, firsts)
            self.best_choices = list(choices) + [None] * (len(self.claims) - len(choices))
        if k == len(self.claims):
            return
        remaining = len(self.claims) - k
        if sat + remaining < self.best[0]:
            return
        ub = self.upper_bound(k, state)
        if (sat + ub, firsts + ub) <= self.best:
            return
        key = (k, self.canonical(state))
        seen = self._seen.get(key)
        if seen is not None and seen >= (sat, firsts):
            return
        self._seen[key] = (sat, firsts)
        claim = self.claims[k]
        for rank, p in enumerate(claim.alternatives):
            for node in sorted(self.nodes):
                if claim.nodes is not None and node not in claim.nodes:
                    continue
                gis = [gi for gi in self.nodes[node] if self.gpus[gi].model.has_profile(p)]
                for combo in combinations_with_replacement(gis, claim.count_for(p)):
                    new = list(state)
                    for gi in combo:
                        new[gi] = tuple(sorted((*new[gi], p)))
                    if any(self.fit(gi, new[gi]) is None for gi in set(combo)):
                        continue
                    nstate = tuple(new)
                    if self.budget is not None and self.changed_count(nstate) > self.budget:
                        continue
                    choices.append((rank, p, combo))
                    self.search(k + 1, nstate, sat + 1, firsts + (rank == 0), choices)
                    choices.pop()
        choices.append(None)
        self.search(k + 1, state, sat, firsts, choices)
        choices.pop()

    def build(self) -> ExhaustiveResult:
        state: tuple[Demand, ...] = tuple(() for _ in self.gpus)
        self.search(0, state, 0, 0, [])
        per_gpu: list[list[tuple[str, str]]] = [[] for _ in self.gpus]  # (profile, claim) per GPU
        unsatisfied = []
        for claim, choice in zip(self.claims, self.best_choices, strict=True):
            if choice is None:
                unsatisfied.append(claim.name)
                continue
            _, p, combo = choice
            for gi in combo:
                per_gpu[gi].append((p, claim.name))
        final = tuple(tuple(sorted(p for p, _ in items)) for items in per_gpu)
        plans = []
        assignments = []
        for gi, g in enumerate(self.gpus):
            fit = self.fit(gi, final[gi])
            assert fit is not None
            changed, instances = fit
            pool = list(instances)
            for p, name in per_gpu[gi]:
                inst = next(i for i in pool if i.profile == p)
                pool.remove(inst)
                assignments.append(Assignment(name, g.node, g.index, p, inst.start))
            layout = g.current
            if changed:
                layout = normalize_layout([*g.busy, *instances])
                for f in g.free:  # keep free instances that still fit
                    trial = with_instance(layout, f)
                    if f not in layout and self.geo.is_valid(g.model, trial):
                        layout = trial
            plans.append(
                GpuPlan(
                    g.node,
                    g.index,
                    g.model.key,
                    layout,
                    layout != g.current,
                    "exhaustive search" if layout != g.current else "",
                )
            )
        assignments.sort(key=lambda a: (a.claim, a.node, a.index, a.start))
        result = PlanResult(tuple(plans), tuple(assignments), tuple(unsatisfied))
        return ExhaustiveResult(self.best[0], self.best[1], result)


def best_plan(
    gpus: Sequence[GpuState],
    claims: Sequence[ClaimDemand],
    policy: Policy,
    catalog: Catalog | None = None,
) -> ExhaustiveResult:
    """The best possible round by (claims satisfied, first choices), found by exhaustive search. Pure.

    Raises ``ValueError`` above ``MAX_GPUS`` GPUs or ``MAX_CLAIMS`` claims, ``PlanInputError`` for bad input.
    """
    if len(gpus) > MAX_GPUS or len(claims) > MAX_CLAIMS:
        raise ValueError(f"exhaustive search is limited to {MAX_GPUS} GPUs and {MAX_CLAIMS} claims")
    geo = GeoCache(catalog if catalog is not None else load_catalog())
    validate_inputs(gpus, claims, policy, geo)
    states = sorted(gpus, key=lambda s: (s.node, s.index))
    search = _Search(
        [_Gpu(s, geo.model(s.model)) for s in states], sorted(claims, key=lambda c: c.name), policy, geo
    )
    return search.build()
