"""Victim search: which lower-priority pods to evict so that a re-cut can serve a waiting claim. Pure,
deterministic, no I/O; knows nothing of Kubernetes beyond the numbers it is given.

DRA has no preemption in kube-scheduler up to 1.37 (the ``dynamicresources`` plugin returns no
``PreFilterExtensions``, so victim simulation never frees a device), so dynamig chooses victims itself, the
way kube-scheduler chooses them for resources it understands (pkg/scheduler/framework/preemption,
``pickOneNodeForPreemption`` in v1.37.2), per GPU rather than per node:

1. never a pod that may not go: a PodDisruptionBudget allows it no disruption, Kueue manages it, it is
   at a system priority, it has not run ``min_run_s`` yet, the ledger spares its owner
   (``RunningPod.protected`` says which), or it is not lower than the preemptor by ``gap``: "fewest PDB
   violations" with none allowed;
2. then the lowest highest victim priority;
3. then the lowest sum of victim priorities (each offset by 2^31, as kube-scheduler does, so that fewer
   victims win among negative priorities);
4. then the fewest victims;
5. then the latest start among the highest-priority victims (the work lost is the least);
6. then the GPU's name, so the choice is stable.

A cut at placement ``start`` of a profile needs the memory slices that placement covers: every instance
overlapping them goes (free ones cost nothing), and the GPU with the rest plus the new instance must be a
valid layout. An instance goes only with every pod using it, and a pod only with every pod of its ``unit``
(pods sharing one claim, or a gang): all of them must be allowed to go. A ``preemptionPolicy: Never``
preemptor evicts nothing. The caller asks only for claims no plan that evicts nothing can serve; a
placement that needs no victim is left to the plain planner.

Each GPU serves at most one preemptor per round (its victims' instances are freed for that one cut), higher
priority first, then by name. For each (GPU, profile) only its best placement matters, since the rules
order candidates by their victims first: the best is the only one a preemptor can take if any is. So the
search is a sort per profile, then a walk per preemptor: one round on 8,000 GPUs with 20,000 running pods
and 2,000 preemptors fits in a second of CPU (bench/victims_bench.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from dynamig.geometry.layout import is_valid
from dynamig.geometry.model import GpuModel, PlacedInstance
from dynamig.planner.model import GpuKey

SYSTEM_PRIORITY = 2_000_000_000  # scheduling.SystemCriticalPriority: pods at or above it are never victims
_OFFSET = 2**31  # kube-scheduler's offset of each priority in the sum (math.MaxInt32 + 1)


@dataclass(frozen=True, slots=True)
class RunningPod:
    """A pod that holds MIG instances. ``unit``: pods that may only be evicted together (one claim shared by
    several pods, a gang); empty: the pod alone. ``protected``: why it may never be a victim (empty: it
    may)."""

    name: str  # "namespace/name"
    priority: int
    started_at: float  # epoch seconds
    unit: str = ""
    protected: str = ""


@dataclass(frozen=True, slots=True)
class HeldInstance:
    """An instance on a GPU and the pods using it (none: a free instance)."""

    placed: PlacedInstance
    holders: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuHolding:
    key: GpuKey
    model: str  # catalog key
    instances: tuple[HeldInstance, ...] = ()


@dataclass(frozen=True, slots=True)
class Preemptor:
    """A waiting claim's pod. ``alternatives`` in preference order (``firstAvailable``); ``nodes`` where it
    may run (None: anywhere); ``never``: its ``preemptionPolicy`` is ``Never``."""

    name: str
    priority: int
    alternatives: tuple[str, ...]
    nodes: frozenset[str] | None = None
    never: bool = False


@dataclass(frozen=True, slots=True)
class Rules:
    gap: int = 1  # a victim's priority must be at most the preemptor's minus this (1: strictly lower)
    min_run_s: float = 0.0  # a pod that started less than this ago is not a victim
    now: float = 0.0  # epoch seconds, for min_run_s

    def __post_init__(self) -> None:
        if self.gap < 1:
            raise ValueError(f"gap must be at least 1 (equal priorities never evict), got {self.gap}")
        if self.min_run_s < 0:
            raise ValueError(f"min_run_s must not be negative, got {self.min_run_s}")


@dataclass(frozen=True, slots=True)
class Eviction:
    """What one preemptor gets: the placement to cut, the pods to evict first, every instance in its way."""

    preemptor: str
    gpu: GpuKey
    profile: str
    start: int
    victims: tuple[str, ...]  # sorted pod names, whole units
    in_the_way: tuple[PlacedInstance, ...]  # instances to destroy for the cut (the victims' and free ones)
    highest_priority: int


@dataclass(frozen=True, slots=True)
class VictimPlan:
    evictions: tuple[Eviction, ...]
    refused: Mapping[str, str]  # preemptor -> why nothing is evicted for it


class _Score(NamedTuple):
    """Lower is better: the rules 2-6 above (a tuple: compared at C speed)."""

    highest: int
    total: int
    how_many: int
    later_start_first: float  # minus the earliest start among the highest-priority victims
    gpu: GpuKey


@dataclass(frozen=True, slots=True)
class _Candidate:
    score: _Score
    profile: str
    start: int
    victims: tuple[str, ...]
    in_the_way: tuple[PlacedInstance, ...]


def find_victims(
    preemptors: Sequence[Preemptor],
    gpus: Sequence[GpuHolding],
    pods: Mapping[str, RunningPod],
    rules: Rules,
    models: Mapping[str, GpuModel],
) -> VictimPlan:
    """Evictions for ``preemptors`` (each served at most once, on a GPU of its own), and why the others get
    none. ``pods``: every pod holding an instance of ``gpus``, by name. Pure."""
    units = _units(pods.values())
    wanted = {p for pre in preemptors if not pre.never for p in pre.alternatives}
    ranked: dict[str, list[_Candidate]] = {p: [] for p in wanted}
    valid: dict[str, dict[tuple[PlacedInstance, ...], bool]] = {}
    for gpu in gpus:
        model = models.get(gpu.model)
        if model is None:
            continue
        checked = valid.setdefault(model.key, {})
        for best in _best_on_gpu(gpu, model, sorted(wanted), pods, units, rules, checked):
            ranked[best.profile].append(best)
    for candidates in ranked.values():
        candidates.sort(key=lambda c: c.score)
    highest = {p: [c.score.highest for c in cs] for p, cs in ranked.items()}
    by_node: dict[str, dict[str, list[_Candidate]]] = {}  # profile -> node -> candidates, still sorted
    if any(pre.nodes is not None for pre in preemptors):
        for profile, candidates in ranked.items():
            for c in candidates:
                by_node.setdefault(profile, {}).setdefault(c.score.gpu.node, []).append(c)

    used: set[GpuKey] = set()
    evictions: list[Eviction] = []
    refused: dict[str, str] = {}
    for pre in sorted(preemptors, key=lambda p: (-p.priority, p.name)):
        if pre.never:
            refused[pre.name] = "its preemptionPolicy is Never"
            continue
        chosen = _choose(pre, ranked, highest, by_node, used, rules)
        if chosen is None:
            refused[pre.name] = (
                f"no GPU frees a placement of {', '.join(pre.alternatives)} by evicting only pods that "
                f"may go and whose priority is at most {pre.priority - rules.gap}"
            )
            continue
        used.add(chosen.score.gpu)
        evictions.append(
            Eviction(
                pre.name, chosen.score.gpu, chosen.profile, chosen.start, chosen.victims, chosen.in_the_way,
                chosen.score.highest,
            )
        )  # fmt: skip
    return VictimPlan(tuple(evictions), refused)


def _choose(
    pre: Preemptor,
    ranked: Mapping[str, list[_Candidate]],
    highest: Mapping[str, list[int]],
    by_node: Mapping[str, Mapping[str, list[_Candidate]]],
    used: set[GpuKey],
    rules: Rules,
) -> _Candidate | None:
    """The best candidate for ``pre``'s first alternative that has one. Candidates are sorted by their highest
    victim priority first, so none past the first one above the preemptor's reach can do."""
    ceiling = pre.priority - rules.gap
    for profile in pre.alternatives:
        if pre.nodes is None:
            reach = bisect.bisect_right(highest.get(profile, []), ceiling)
            found = next((c for c in ranked.get(profile, [])[:reach] if c.score.gpu not in used), None)
        else:
            nodes = by_node.get(profile, {})
            found = min(
                (
                    c
                    for node in pre.nodes
                    for c in nodes.get(node, [])
                    if c.score.highest <= ceiling and c.score.gpu not in used
                ),
                key=lambda c: c.score,
                default=None,
            )
        if found is not None:
            return found
    return None


def _units(pods: Iterable[RunningPod]) -> dict[str, tuple[str, ...]]:
    """Unit name -> its pods, sorted (a pod without a unit is its own)."""
    out: dict[str, list[str]] = {}
    for pod in pods:
        out.setdefault(pod.unit or pod.name, []).append(pod.name)
    return {u: tuple(sorted(names)) for u, names in out.items()}


def _best_on_gpu(
    gpu: GpuHolding,
    model: GpuModel,
    profiles: Iterable[str],
    pods: Mapping[str, RunningPod],
    units: Mapping[str, tuple[str, ...]],
    rules: Rules,
    valid: dict[tuple[PlacedInstance, ...], bool],
) -> Iterator[_Candidate]:
    """Per profile of ``profiles``, the best placement on ``gpu`` that needs victims, all of whom may go.
    ``valid``: layouts already checked (many GPUs share a layout)."""
    held = [
        (model.profile(i.placed.profile).mask(i.placed.start), i.placed, _victims_of(i, pods, units, rules))
        for i in gpu.instances
    ]
    for profile in profiles:
        if not model.has_profile(profile):
            continue
        prof = model.profile(profile)
        candidates = []
        for start in prof.placement_starts:
            need = prof.mask(start)
            in_the_way = [(placed, victims) for mask, placed, victims in held if mask & need]
            if any(victims is None for _, victims in in_the_way):
                continue  # a pod that may not go
            names = sorted({v for _, victims in in_the_way for v in victims or ()})
            if not names:  # none needed: the plain planner's case
                continue
            chosen = [pods[v] for v in names]
            top = max(p.priority for p in chosen)
            score = _Score(
                top,
                sum(p.priority + _OFFSET for p in chosen),
                len(chosen),
                -min(p.started_at for p in chosen if p.priority == top),
                gpu.key,
            )
            candidates.append((score, start, tuple(names), tuple(sorted(placed for placed, _ in in_the_way))))
        for score, start, victims, gone in sorted(candidates):
            layout = tuple(
                sorted([*(p for _, p, _ in held if p not in gone), PlacedInstance(start, profile)])
            )
            ok = valid.get(layout)
            if ok is None:
                ok = valid[layout] = is_valid(model, layout)
            if ok:
                yield _Candidate(score, profile, start, victims, gone)
                break


def _victims_of(
    inst: HeldInstance, pods: Mapping[str, RunningPod], units: Mapping[str, tuple[str, ...]], rules: Rules
) -> tuple[str, ...] | None:
    """Every pod that must go to free ``inst``, whole units (() for a free instance); None when one may not
    (whatever the preemptor's priority)."""
    victims: set[str] = set()
    for holder in inst.holders:
        pod = pods.get(holder)
        if pod is None:
            return None  # a holder we know nothing of is never a victim
        victims.update(units[pod.unit or pod.name])
    for name in victims:
        pod = pods[name]
        if pod.protected or pod.priority >= SYSTEM_PRIORITY or rules.now - pod.started_at < rules.min_run_s:
            return None
    return tuple(sorted(victims))
