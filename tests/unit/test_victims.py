"""Victim search (planner/victims.py): kube-scheduler's order of victims, per GPU, on the real MIG geometry.

The order is kube-scheduler's ``pickOneNodeForPreemption`` (pkg/scheduler/framework/preemption/preemption.go,
v1.37.2): no PDB violation allowed, then the lowest highest victim priority, the lowest sum, the fewest
victims, the latest start among the highest-priority victims. Each rule has a table row where it alone
decides; a property test checks the indexed search against a brute force over every GPU, alternative and
placement.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import is_valid
from dynamig.geometry.model import PlacedInstance
from dynamig.planner.model import GpuKey
from dynamig.planner.victims import (
    SYSTEM_PRIORITY,
    GpuHolding,
    HeldInstance,
    Preemptor,
    Rules,
    RunningPod,
    find_victims,
)

CATALOG = load_catalog()
A100 = CATALOG.model("A100-80GB")
MODELS = {"A100-80GB": A100}
NOW = 10_000.0


def gpu(node: str, *held: tuple[str, int, tuple[str, ...]]) -> GpuHolding:
    return GpuHolding(
        GpuKey(node, 0),
        "A100-80GB",
        tuple(HeldInstance(PlacedInstance(start, profile), holders) for profile, start, holders in held),
    )


def pods(*specs: tuple[str, int, float] | RunningPod) -> dict[str, RunningPod]:
    out = {}
    for s in specs:
        pod = s if isinstance(s, RunningPod) else RunningPod(s[0], s[1], s[2])
        out[pod.name] = pod
    return out


def seven_small(node: str, prios: list[int], started: float = 0.0) -> tuple[GpuHolding, list[RunningPod]]:
    """An A100 full of seven 1g.10gb, one pod each (``prios`` per slice 0..6)."""
    names = [f"{node}/p{i}" for i in range(7)]
    g = gpu(node, *[("1g.10gb", i, (names[i],)) for i in range(7)])
    return g, [RunningPod(names[i], prios[i], started) for i in range(7)]


def test_a_3g_pod_evicts_the_lowest_priority_slices_that_free_a_placement() -> None:
    g, running = seven_small("n1", [0, 0, 0, 0, 5, 5, 5])
    plan = find_victims(
        [Preemptor("hi", 1000, ("3g.40gb",))], [g], {p.name: p for p in running}, Rules(now=NOW), MODELS
    )
    (ev,) = plan.evictions
    # 3g.40gb at 0 covers slices 0-3: four priority-0 pods; at 4 it would take priority-5 pods.
    assert (ev.profile, ev.start, ev.victims) == ("3g.40gb", 0, ("n1/p0", "n1/p1", "n1/p2", "n1/p3"))
    assert ev.in_the_way == tuple(PlacedInstance(i, "1g.10gb") for i in range(4))
    assert ev.highest_priority == 0


@pytest.mark.parametrize(
    ("a", "b", "winner", "rule"),
    [
        # rule 2: the lowest highest priority
        ([1, 1, 1, 1, 9, 9, 9], [0, 0, 0, 7, 9, 9, 9], "n1", "highest"),
        # rule 3: equal highest, the lower sum
        ([3, 3, 3, 3, 9, 9, 9], [0, 0, 0, 3, 9, 9, 9], "n2", "sum"),
        # rule 6: everything equal, the GPU's name
        ([2, 2, 2, 2, 9, 9, 9], [2, 2, 2, 2, 9, 9, 9], "n1", "name"),
    ],
)
def test_kube_schedulers_order_between_gpus(a: list[int], b: list[int], winner: str, rule: str) -> None:
    g1, r1 = seven_small("n1", a)
    g2, r2 = seven_small("n2", b)
    plan = find_victims(
        [Preemptor("hi", 100, ("3g.40gb",))],
        [g1, g2],
        {p.name: p for p in [*r1, *r2]},
        Rules(now=NOW),
        MODELS,
    )
    assert plan.evictions[0].gpu.node == winner, (rule, plan)


def test_fewer_victims_win_at_equal_highest_priority() -> None:
    # n1: a 4g.40gb pod of priority 0 alone covers slices 0-3; n2: four 1g.10gb pods of priority 0 there.
    g1 = gpu("n1", ("4g.40gb", 0, ("n1/big",)))
    g2, r2 = seven_small("n2", [0, 0, 0, 0, 5, 5, 5])
    running = {p.name: p for p in [RunningPod("n1/big", 0, 0.0), *r2]}
    plan = find_victims([Preemptor("hi", 100, ("4g.40gb",))], [g2, g1], running, Rules(now=NOW), MODELS)
    assert plan.evictions[0].victims == ("n1/big",)


def test_the_latest_started_highest_priority_victims_go_first() -> None:
    g1, r1 = seven_small("n1", [0] * 7, started=100.0)
    g2, r2 = seven_small("n2", [0] * 7, started=200.0)
    plan = find_victims(
        [Preemptor("hi", 100, ("3g.40gb",))],
        [g1, g2],
        {p.name: p for p in [*r1, *r2]},
        Rules(now=NOW),
        MODELS,
    )
    assert plan.evictions[0].gpu.node == "n2"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"protected": "PodDisruptionBudget web allows no disruption"}, "pdb"),
        ({"priority": SYSTEM_PRIORITY}, "system"),
        ({"priority": 100}, "tie"),
        ({"started_at": NOW - 10}, "min run"),
    ],
)
def test_a_pod_that_may_not_go_keeps_its_slices(change: dict[str, object], why: str) -> None:
    # One A100: p0 holds slices 0-3 (a 4g.40gb); the other placement of 4g.40gb does not exist on A100.
    victim = dataclasses.replace(RunningPod("n1/p0", 0, 0.0), **change)  # type: ignore[arg-type]
    g = gpu("n1", ("4g.40gb", 0, ("n1/p0",)), ("3g.40gb", 4, ()))
    plan = find_victims(
        [Preemptor("hi", 100, ("4g.40gb",))], [g], {victim.name: victim}, Rules(now=NOW, min_run_s=60), MODELS
    )
    assert plan.evictions == (), why
    assert "at most 99" in plan.refused["hi"], plan.refused


def test_never_evicts_nothing_and_says_why() -> None:
    g, running = seven_small("n1", [0] * 7)
    plan = find_victims(
        [Preemptor("hi", 100, ("3g.40gb",), never=True)], [g], {p.name: p for p in running}, Rules(), MODELS
    )
    assert plan.evictions == ()
    assert plan.refused == {"hi": "its preemptionPolicy is Never"}


def test_a_shared_claim_goes_with_all_its_pods_or_not_at_all() -> None:
    # n1/p0 shares its instance's claim with n1/other, which holds a slice the cut does not need.
    g, running = seven_small("n1", [0] * 7)
    running = [RunningPod(p.name, p.priority, p.started_at, unit="claim-a" if p.name == "n1/p0" else "")
               for p in running]  # fmt: skip
    other = RunningPod("n1/other", 0, 0.0, unit="claim-a")
    plan = find_victims(
        [Preemptor("hi", 100, ("3g.40gb",))],
        [g],
        {p.name: p for p in [*running, other]},
        Rules(now=NOW),
        MODELS,
    )
    # With p0 at slice 0: the 3g at 0 costs five pods (p0-p3 and its peer), the 3g at 4 three: 4 wins.
    assert plan.evictions[0].start == 4
    assert plan.evictions[0].victims == ("n1/p4", "n1/p5", "n1/p6")
    protected = RunningPod("n1/other", 0, 0.0, unit="claim-a", protected="gang member not evictable")
    plan = find_victims(
        [Preemptor("hi", 100, ("2g.20gb",))], [g], {p.name: p for p in [*running, protected]},
        Rules(now=NOW), MODELS,
    )  # fmt: skip
    assert "n1/p0" not in plan.evictions[0].victims


def test_first_available_order_and_one_preemptor_per_gpu() -> None:
    g1, r1 = seven_small("n1", [0] * 7)
    running = {p.name: p for p in r1}
    pres = [
        Preemptor("a", 100, ("7g.80gb", "3g.40gb")),  # the first alternative wins where it can be had
        Preemptor("b", 50, ("3g.40gb",)),  # the GPU is taken by a: nothing left for b this round
    ]
    plan = find_victims(pres, [g1], running, Rules(now=NOW), MODELS)
    assert [(e.preemptor, e.profile) for e in plan.evictions] == [("a", "7g.80gb")]
    assert "b" in plan.refused


def test_node_restriction_and_unknown_holders() -> None:
    g1, r1 = seven_small("n1", [0] * 7)
    g2 = gpu("n2", ("7g.80gb", 0, ("stranger",)))
    plan = find_victims(
        [Preemptor("hi", 100, ("7g.80gb",), nodes=frozenset({"n2"}))], [g1, g2], {p.name: p for p in r1},
        Rules(now=NOW), MODELS,
    )  # fmt: skip
    assert plan.evictions == ()  # n1 is not allowed; n2's holder is unknown, never a victim


def test_bad_rules_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="gap"):
        Rules(gap=0)
    with pytest.raises(ValueError, match="min_run_s"):
        Rules(min_run_s=-1)


# --- the indexed search against a brute force -------------------------------------------------------------

SMALL = ["1g.10gb", "2g.20gb", "3g.40gb"]


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[GpuHolding], dict[str, RunningPod], Preemptor]:
    gpus, running = [], {}
    for n in range(draw(st.integers(1, 4))):
        layout: list[PlacedInstance] = []
        for profile in draw(st.lists(st.sampled_from([*SMALL, "4g.40gb"]), max_size=6)):
            starts = [
                s
                for s in A100.profile(profile).placement_starts
                if is_valid(A100, [*layout, PlacedInstance(s, profile)])
            ]
            if starts:
                layout.append(PlacedInstance(draw(st.sampled_from(starts)), profile))
        held = []
        for inst in layout:
            holders: tuple[str, ...] = ()
            if draw(st.booleans()):
                name = f"n{n}/{inst.profile}@{inst.start}"
                running[name] = RunningPod(
                    name, draw(st.integers(-5, 12)), draw(st.floats(0, 100)),
                    protected=draw(st.sampled_from(["", "", "", "pdb"])),
                )  # fmt: skip
                holders = (name,)
            held.append(HeldInstance(inst, holders))
        gpus.append(GpuHolding(GpuKey(f"n{n}", 0), "A100-80GB", tuple(held)))
    alts = tuple(
        draw(st.lists(st.sampled_from([*SMALL, "4g.40gb", "7g.80gb"]), min_size=1, max_size=3, unique=True))
    )
    return gpus, running, Preemptor("pre", draw(st.integers(0, 12)), alts)


def brute_force(
    gpus: list[GpuHolding], running: dict[str, RunningPod], pre: Preemptor, gap: int
) -> tuple[str, int, tuple[str, ...]] | None:
    """(profile, start, victims) of the best eviction for ``pre``, trying everything. Pure."""
    for profile in pre.alternatives:
        best: tuple[tuple[object, ...], str, int, tuple[str, ...]] | None = None
        for g, start in itertools.product(gpus, A100.profile(profile).placement_starts):
            need = set(A100.profile(profile).span(start))
            gone = [i for i in g.instances if need & set(A100.profile(i.placed.profile).span(i.placed.start))]
            victims = sorted({h for i in gone for h in i.holders})
            if not victims or any(
                running[v].protected or running[v].priority > pre.priority - gap for v in victims
            ):
                continue
            rest = [i.placed for i in g.instances if i not in gone]
            if not is_valid(A100, [*rest, PlacedInstance(start, profile)]):
                continue
            prios = [running[v].priority for v in victims]
            top = max(prios)
            latest = -min(running[v].started_at for v in victims if running[v].priority == top)
            key = (top, sum(p + 2**31 for p in prios), len(victims), latest, g.key)
            if best is None or key < best[0]:
                best = (key, profile, start, tuple(victims))
        if best is not None:
            return best[1:]
    return None


@settings(max_examples=300, deadline=None)
@given(clusters(), st.integers(1, 3))
def test_the_search_finds_what_a_brute_force_finds(
    case: tuple[list[GpuHolding], dict[str, RunningPod], Preemptor], gap: int
) -> None:
    gpus, running, pre = case
    plan = find_victims([pre], gpus, running, Rules(gap=gap, now=NOW), MODELS)
    want = brute_force(gpus, running, pre, gap)
    got = next(((e.profile, e.start, e.victims) for e in plan.evictions), None)
    if want is None:
        assert got is None, plan
    else:
        assert got is not None, (want, plan.refused)
        # The same victims on the same placement (the GPU is in the key, so ties cannot differ).
        assert got == want, (got, want)
