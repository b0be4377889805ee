"""The layout planner (``dynamig.planner.plan``): hand-written rounds and hypothesis properties.

Real: the planner, the packaged MIG geometry catalog and the layout validity check every output is held to,
and the exhaustive reference search used for the "never worse than doing nothing" property. Nothing is
simulated: the planner is a pure function of plain values.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamig.geometry.catalog import Catalog, load_catalog
from dynamig.geometry.layout import check_layout, free_starts
from dynamig.geometry.model import PlacedInstance, normalize_layout
from dynamig.planner import (
    ClaimDemand,
    CurrentInstance,
    GpuState,
    PlanInputError,
    PlanResult,
    Policy,
    Strategy,
    plan,
)
from dynamig.planner.exhaustive import best_plan
from dynamig.planner.synthetic import SMALL_MODELS

CATALOG = load_catalog()


def gpu(node: str, index: int, model: str, *instances: tuple[str, int, bool]) -> GpuState:
    return GpuState(node, index, model, tuple(CurrentInstance(p, s, b) for p, s, b in instances))


def layout_of(result: PlanResult, node: str, index: int) -> list[str]:
    g = next(g for g in result.gpus if (g.node, g.index) == (node, index))
    return [f"{i.profile}@{i.start}" for i in g.layout]


def check_invariants(
    gpus: tuple[GpuState, ...],
    claims: tuple[ClaimDemand, ...],
    policy: Policy,
    result: PlanResult,
    catalog: Catalog = CATALOG,
) -> None:
    """Every hard rule of a plan, checked from the outside."""
    by_key = {(g.node, g.index): g for g in gpus}
    assert sorted((g.node, g.index) for g in result.gpus) == sorted(by_key)
    layouts = {}
    changed = 0
    for gp in result.gpus:
        state = by_key[(gp.node, gp.index)]
        model = catalog.model(state.model)
        assert gp.model == state.model
        assert check_layout(model, gp.layout) is None, (gp, check_layout(model, gp.layout))
        current = normalize_layout([i.placed for i in state.instances])
        assert gp.changed == (gp.layout != current)
        assert bool(gp.reason) == gp.changed
        changed += gp.changed
        assert not (gp.changed and state.key in policy.frozen), f"frozen {state.key} changed"
        if state.key in policy.additive and state.key not in policy.frozen:
            assert set(current) <= set(gp.layout), f"an instance of additive {state.key} was destroyed"
            added = {i for i in gp.layout if i not in current}
            got = {
                PlacedInstance(a.start, a.profile)
                for a in result.assignments
                if (a.node, a.index) == (state.node, state.index)
            }
            assert added <= got, f"additive {state.key} gained {added - got}, which no claim takes"
        for cur in state.instances:
            if cur.busy:
                assert cur.placed in gp.layout, f"busy {cur} removed from {gp.node}-gpu{gp.index}"
        baseline = set(policy.baseline.get(state.model, ()))
        for inst in gp.layout:
            if inst not in current and inst not in baseline and policy.allowed_profiles is not None:
                assert inst.profile in policy.allowed_profiles, f"created disallowed {inst}"
        layouts[(gp.node, gp.index)] = gp.layout
    if policy.max_gpus_reshaped is not None:
        assert changed <= policy.max_gpus_reshaped
    claim_by_name = {c.name: c for c in claims}
    used: set[tuple[str, int, PlacedInstance]] = set()
    per_claim: dict[str, list[tuple[str, int, str]]] = {}
    for a in result.assignments:
        target = PlacedInstance(a.start, a.profile)
        key = (a.node, a.index, target)
        assert target in layouts[(a.node, a.index)], f"{a} points at no instance of the target layout"
        busy = {i.placed for i in by_key[(a.node, a.index)].instances if i.busy}
        assert target not in busy, f"{a} takes a busy instance"
        assert key not in used, f"{a}: instance assigned twice"
        used.add(key)
        per_claim.setdefault(a.claim, []).append((a.node, a.index, a.profile))
    for name, devices in per_claim.items():
        claim = claim_by_name[name]
        assert len({n for n, _, _ in devices}) == 1, f"{name} spans nodes"
        assert len({p for _, _, p in devices}) == 1 and devices[0][2] in claim.alternatives
        assert len(devices) == claim.count_for(devices[0][2])
        if claim.nodes is not None:
            assert devices[0][0] in claim.nodes
    assert set(result.unsatisfied) == set(claim_by_name) - set(per_claim)
    assert len(result.unsatisfied) == len(set(result.unsatisfied))
    # A claim is never left waiting while free instances it could take sit unassigned on one node.
    for name in result.unsatisfied:
        claim = claim_by_name[name]
        for node in {n for n, _ in layouts}:
            if claim.nodes is not None and node not in claim.nodes:
                continue
            for alt in claim.alternatives:
                free = sum(
                    1 for (n, i), lay in layouts.items() if n == node
                    for inst in lay
                    if inst.profile == alt and (n, i, inst) not in used
                    and inst not in {c.placed for c in by_key[(n, i)].instances if c.busy}
                )  # fmt: skip
                assert free < claim.count, f"{name} unsatisfied but {free} free {alt} on {node}"


# -- hand-written rounds -----------------------------------------------------------------------------------


def test_issue_example_recuts_the_free_half_and_keeps_the_busy_one() -> None:
    gpus = (gpu("node-a", 0, "A100-80GB", ("3g.40gb", 0, True), ("3g.40gb", 4, False)),)
    claims = (ClaimDemand("infer-1", ("1g.10gb", "2g.20gb")),)
    policy = Policy(allowed_profiles=frozenset({"1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"}))
    result = plan(gpus, claims, policy, CATALOG)
    check_invariants(gpus, claims, policy, result)
    assert result.unsatisfied == ()
    (a,) = result.assignments
    assert (a.claim, a.profile) == ("infer-1", "1g.10gb")
    g = result.gpus[0]
    assert PlacedInstance(0, "3g.40gb") in g.layout and g.changed
    assert "removed free 3g.40gb@4" in g.reason and "infer-1" in g.reason


def test_existing_free_instance_is_used_before_anything_is_recut() -> None:
    gpus = (
        gpu("n1", 0, "A100-80GB"),
        gpu("n2", 0, "A100-80GB", ("4g.40gb", 0, True), ("1g.10gb", 5, False)),
    )
    claims = (ClaimDemand("c", ("1g.10gb",)),)
    result = plan(gpus, claims, Policy(), CATALOG)
    check_invariants(gpus, claims, Policy(), result)
    assert [(a.node, a.start) for a in result.assignments] == [("n2", 5)]
    assert not any(g.changed for g in result.gpus)


def test_busy_instances_block_and_survive() -> None:
    gpus = (gpu("n", 0, "A100-80GB", ("7g.80gb", 0, True)),)
    claims = (ClaimDemand("c", ("1g.10gb", "3g.40gb")),)
    result = plan(gpus, claims, Policy(), CATALOG)
    assert result.unsatisfied == ("c",)
    assert layout_of(result, "n", 0) == ["7g.80gb@0"] and not result.gpus[0].changed


def test_first_choice_wins_when_both_fit() -> None:
    gpus = (gpu("n", 0, "H100-80GB"),)
    claims = (ClaimDemand("c", ("2g.20gb", "1g.10gb")),)
    result = plan(gpus, claims, Policy(), CATALOG)
    assert [a.profile for a in result.assignments] == ["2g.20gb"]


def test_second_choice_when_the_first_cannot_fit() -> None:
    gpus = (gpu("n", 0, "H100-80GB", ("4g.40gb", 0, True), ("2g.20gb", 4, True)),)
    claims = (ClaimDemand("c", ("3g.40gb", "1g.10gb")),)
    result = plan(gpus, claims, Policy(), CATALOG)
    assert [(a.profile, a.start) for a in result.assignments] == [("1g.10gb", 6)]


def test_multi_device_claim_stays_on_one_node() -> None:
    # Each node has room for one 3g.40gb only: a claim for two cannot be split across nodes.
    gpus = (
        gpu("n1", 0, "A100-80GB", ("4g.40gb", 0, True)),
        gpu("n2", 0, "A100-80GB", ("4g.40gb", 0, True)),
    )
    claims = (ClaimDemand("pair", ("3g.40gb",), count=2),)
    result = plan(gpus, claims, Policy(), CATALOG)
    assert result.unsatisfied == ("pair",)
    gpus2 = (*gpus, gpu("n2", 1, "A100-80GB"))
    result2 = plan(gpus2, claims, Policy(), CATALOG)
    check_invariants(gpus2, claims, Policy(), result2)
    assert {a.node for a in result2.assignments} == {"n2"} and len(result2.assignments) == 2


def test_each_alternative_keeps_its_own_count() -> None:
    # "eight 1g.10gb, else one 7g.80gb" on one idle A100: eight never fit on one GPU (seven placements),
    # so the claim gets one 7g.80gb; with one count for both alternatives it would get nothing.
    gpus = (gpu("n", 0, "A100-80GB"),)
    claims = (ClaimDemand("c", ("1g.10gb", "7g.80gb"), count=8, alt_counts=(8, 1)),)
    result = plan(gpus, claims, Policy(), CATALOG)
    check_invariants(gpus, claims, Policy(), result)
    assert [(a.profile, a.start) for a in result.assignments] == [("7g.80gb", 0)]
    # "two 1g.10gb, else one 7g.80gb": the first alternative fits and is taken, two devices of it.
    two = (ClaimDemand("c", ("1g.10gb", "7g.80gb"), count=2, alt_counts=(2, 1)),)
    result = plan(gpus, two, Policy(), CATALOG)
    assert [a.profile for a in result.assignments] == ["1g.10gb", "1g.10gb"]
    assert best_plan(gpus, claims, Policy(), CATALOG).satisfied == 1  # the exhaustive planner agrees


def test_alternative_counts_must_match_the_alternatives() -> None:
    claims = (ClaimDemand("c", ("1g.10gb", "7g.80gb"), alt_counts=(2,)),)
    with pytest.raises(PlanInputError, match="one count per alternative"):
        plan((gpu("n", 0, "A100-80GB"),), claims, Policy(), CATALOG)


def test_claim_node_restriction_is_respected() -> None:
    gpus = (gpu("n1", 0, "A100-80GB"), gpu("n2", 0, "A100-80GB"))
    claims = (ClaimDemand("c", ("1g.10gb",), nodes=frozenset({"n2"})),)
    result = plan(gpus, claims, Policy(), CATALOG)
    assert [a.node for a in result.assignments] == ["n2"]


def test_allowed_profiles_limit_what_is_created_not_what_is_used() -> None:
    gpus = (gpu("n", 0, "A100-80GB", ("2g.20gb", 0, False)),)
    policy = Policy(allowed_profiles=frozenset({"1g.10gb"}))
    claims = (ClaimDemand("a", ("2g.20gb",)), ClaimDemand("b", ("2g.20gb",)), ClaimDemand("c", ("1g.10gb",)))
    result = plan(gpus, claims, policy, CATALOG)
    check_invariants(gpus, claims, policy, result)
    assert len([a for a in result.assignments if a.profile == "2g.20gb"]) == 1  # the existing one only
    assert "c" not in result.unsatisfied


def test_disruption_budget_caps_changed_gpus() -> None:
    gpus = tuple(gpu(f"n{i}", 0, "H100-80GB") for i in range(3))
    claims = tuple(ClaimDemand(f"big{i}", ("7g.80gb",)) for i in range(3))
    policy = Policy(max_gpus_reshaped=2)
    result = plan(gpus, claims, policy, CATALOG)
    check_invariants(gpus, claims, policy, result)
    assert sum(g.changed for g in result.gpus) == 2 and len(result.unsatisfied) == 1


def test_a_frozen_gpu_serves_from_its_free_instances_and_the_rest_is_cut_elsewhere() -> None:
    # Packing would cut all three on gpu0 (already cut); frozen, it gives its free 1g.10gb and gpu1 is cut.
    gpus = (
        gpu("n", 0, "A100-80GB", ("1g.10gb", 0, True), ("1g.10gb", 1, False), ("3g.40gb", 4, False)),
        gpu("n", 1, "A100-80GB", ("3g.40gb", 0, False), ("3g.40gb", 4, False)),
    )
    claims = tuple(ClaimDemand(f"c{i}", ("1g.10gb",)) for i in range(3))
    policy = Policy(frozen=frozenset({gpus[0].key}))
    result = plan(gpus, claims, policy, CATALOG)
    check_invariants(gpus, claims, policy, result)
    assert result.unsatisfied == () and not result.gpus[0].changed
    assert sorted(a.index for a in result.assignments) == [0, 1, 1]


def test_an_additive_gpu_gains_instances_in_free_slices_and_destroys_nothing() -> None:
    # gpu0 has busy 1g.10gb at 0 and 1, slices 2-3 free and a free 3g.40gb at 4; three 1g.10gb claims.
    gpus = (gpu("n", 0, "A100-80GB", ("1g.10gb", 0, True), ("1g.10gb", 1, True), ("3g.40gb", 4, False)),)
    claims = tuple(ClaimDemand(f"c{i}", ("1g.10gb",)) for i in range(3))
    # Cooling down (additive): two claims get 1g.10gb cut into slices 2 and 3; the free 3g.40gb stays, so
    # the third claim waits; no warm-pool instance is added.
    policy = Policy(additive=frozenset({gpus[0].key}), warm_pool={"2g.20gb": 1})
    result = plan(gpus, claims, policy, CATALOG)
    check_invariants(gpus, claims, policy, result)
    assert sorted(a.start for a in result.assignments) == [2, 3] and len(result.unsatisfied) == 1
    assert set(result.gpus[0].layout) == {
        *(PlacedInstance(s, "1g.10gb") for s in range(4)),
        PlacedInstance(4, "3g.40gb"),
    }
    # Free to be cut: the 3g.40gb is destroyed for the third claim.
    free = plan(gpus, claims, Policy(), CATALOG)
    assert free.unsatisfied == () and PlacedInstance(4, "3g.40gb") not in free.gpus[0].layout
    # Frozen (still reshaping): nothing is cut at all.
    frozen = plan(gpus, claims, Policy(frozen=frozenset({gpus[0].key})), CATALOG)
    assert len(frozen.unsatisfied) == 3 and not frozen.gpus[0].changed


def test_pack_keeps_whole_gpus_free_and_spread_spreads() -> None:
    gpus = (gpu("n", 0, "A100-80GB"), gpu("n", 1, "A100-80GB"))
    claims = (ClaimDemand("a", ("1g.10gb",)), ClaimDemand("b", ("1g.10gb",)))
    packed = plan(gpus, claims, Policy(strategy=Strategy.PACK), CATALOG)
    spread = plan(gpus, claims, Policy(strategy=Strategy.SPREAD), CATALOG)
    assert len({a.index for a in packed.assignments}) == 1
    assert len({a.index for a in spread.assignments}) == 2


def test_small_slices_go_to_the_already_cut_gpu() -> None:
    gpus = (gpu("n", 0, "A100-80GB"), gpu("n", 1, "A100-80GB", ("3g.40gb", 0, True)))
    claims = (ClaimDemand("a", ("1g.10gb",)),)
    result = plan(gpus, claims, Policy(), CATALOG)
    assert [a.index for a in result.assignments] == [1]
    assert not result.gpus[0].changed


def test_warm_pool_is_filled_in_free_space_only() -> None:
    gpus = (gpu("n", 0, "A100-80GB", ("4g.40gb", 0, True)), gpu("n", 1, "A100-80GB", ("7g.80gb", 0, False)))
    policy = Policy(warm_pool={"1g.10gb": 2})
    result = plan(gpus, (), policy, CATALOG)
    check_invariants(gpus, (), policy, result)
    assert layout_of(result, "n", 1) == ["7g.80gb@0"]  # the free 7g is not destroyed for the pool
    made = [i for i in result.gpus[0].layout if i.profile == "1g.10gb"]
    assert len(made) == 2 and "warm pool 1g.10gb" in result.gpus[0].reason


def test_idle_gpu_returns_to_baseline_and_busy_one_does_not() -> None:
    base = normalize_layout([PlacedInstance(0, "3g.40gb"), PlacedInstance(4, "3g.40gb")])
    gpus = (gpu("n", 0, "H100-80GB", ("1g.10gb", 0, False)), gpu("n", 1, "H100-80GB", ("1g.10gb", 0, True)))
    policy = Policy(baseline={"H100-80GB": base})
    result = plan(gpus, (), policy, CATALOG)
    check_invariants(gpus, (), policy, result)
    assert result.gpus[0].layout == base and "return to baseline" in result.gpus[0].reason
    assert not result.gpus[1].changed


def test_invalid_inputs_are_refused_with_the_gpu_instance_and_rule() -> None:
    bad = (gpu("n", 0, "A100-80GB", ("3g.40gb", 0, True), ("1g.10gb", 3, False)),)
    with pytest.raises(PlanInputError, match=r"gpu n-gpu0: instance 1g.10gb@3: overlap"):
        plan(bad, (), Policy(), CATALOG)
    with pytest.raises(PlanInputError, match="unknown GPU model"):
        plan((gpu("n", 0, "Z100"),), (), Policy(), CATALOG)
    with pytest.raises(PlanInputError, match="listed twice"):
        plan((gpu("n", 0, "A30-24GB"), gpu("n", 0, "A30-24GB")), (), Policy(), CATALOG)


# -- properties ---------------------------------------------------------------------------------------------


@st.composite
def rounds(draw: st.DrawFn) -> tuple[tuple[GpuState, ...], tuple[ClaimDemand, ...], Policy]:
    keys = draw(
        st.lists(
            st.sampled_from([k for k in SMALL_MODELS if k in CATALOG]), min_size=1, max_size=2, unique=True
        )
    )
    n_gpus = draw(st.integers(1, 4))
    n_nodes = draw(st.integers(1, min(3, n_gpus)))
    gpus = []
    for i in range(n_gpus):
        model = CATALOG.model(draw(st.sampled_from(keys)))
        layout: list[PlacedInstance] = []
        for _ in range(draw(st.integers(0, 5))):
            name = draw(st.sampled_from([p.name for p in model.profiles]))
            starts = free_starts(model, normalize_layout(layout), name)
            if starts:
                layout.append(PlacedInstance(draw(st.sampled_from(starts)), name))
        instances = tuple(CurrentInstance(x.profile, x.start, draw(st.booleans())) for x in sorted(layout))
        gpus.append(GpuState(f"n{i % n_nodes}", i // n_nodes, model.key, instances))
    profiles = sorted({p.name for k in keys for p in CATALOG.model(k).profiles if "+" not in p.name})
    nodes = sorted({g.node for g in gpus})
    claims = []
    for i in range(draw(st.integers(0, 8))):
        alts = tuple(draw(st.lists(st.sampled_from(profiles), min_size=1, max_size=3, unique=True)))
        only = draw(st.none() | st.frozensets(st.sampled_from(nodes), min_size=1))
        claims.append(ClaimDemand(f"c{i}", alts, draw(st.integers(1, 3)), only))
    allowed = draw(st.none() | st.frozensets(st.sampled_from(profiles), min_size=1))
    warm = draw(st.dictionaries(st.sampled_from(profiles), st.integers(0, 2), max_size=2))
    baseline = {}
    if draw(st.booleans()):
        key = draw(st.sampled_from(keys))
        name = CATALOG.model(key).profiles[-1].name  # the whole-GPU profile
        baseline[key] = (PlacedInstance(0, name),)
    policy = Policy(
        allowed_profiles=allowed,
        warm_pool=warm,
        baseline=baseline,
        max_gpus_reshaped=draw(st.none() | st.integers(0, 3)),
        strategy=draw(st.sampled_from(list(Strategy))),
    )
    return tuple(gpus), tuple(claims), policy


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(rounds())
def test_every_plan_keeps_the_hard_rules(
    case: tuple[tuple[GpuState, ...], tuple[ClaimDemand, ...], Policy],
) -> None:
    gpus, claims, policy = case
    result = plan(gpus, claims, policy, CATALOG)
    check_invariants(gpus, claims, policy, result)


@PROPERTY
@given(rounds(), st.data())
def test_frozen_gpus_never_change(
    case: tuple[tuple[GpuState, ...], tuple[ClaimDemand, ...], Policy], data: st.DataObject
) -> None:
    gpus, claims, policy = case
    frozen = data.draw(st.frozensets(st.sampled_from([g.key for g in gpus])))
    policy = dataclasses.replace(policy, frozen=frozen)
    check_invariants(gpus, claims, policy, plan(gpus, claims, policy, CATALOG))


@PROPERTY
@given(rounds(), st.data())
def test_additive_gpus_only_gain_instances_for_claims(
    case: tuple[tuple[GpuState, ...], tuple[ClaimDemand, ...], Policy], data: st.DataObject
) -> None:
    gpus, claims, policy = case
    keys = [g.key for g in gpus]
    additive = data.draw(st.frozensets(st.sampled_from(keys)))
    frozen = data.draw(st.frozensets(st.sampled_from(keys)))
    policy = dataclasses.replace(policy, additive=additive, frozen=frozen)
    check_invariants(gpus, claims, policy, plan(gpus, claims, policy, CATALOG))


@PROPERTY
@given(rounds(), st.randoms(use_true_random=False))
def test_plans_are_deterministic_and_ignore_input_order(
    case: tuple[tuple[GpuState, ...], tuple[ClaimDemand, ...], Policy], rnd: object
) -> None:
    gpus, claims, policy = case
    first = plan(gpus, claims, policy, CATALOG)
    assert plan(gpus, claims, policy, CATALOG) == first
    shuffled_gpus, shuffled_claims = list(gpus), list(claims)
    rnd.shuffle(shuffled_gpus)  # type: ignore[attr-defined]
    rnd.shuffle(shuffled_claims)  # type: ignore[attr-defined]
    again = plan(shuffled_gpus, shuffled_claims, policy, CATALOG)
    assert again.gpus == first.gpus and again.assignments == first.assignments
    assert sorted(again.unsatisfied) == sorted(first.unsatisfied)


@PROPERTY
@given(rounds())
def test_never_worse_than_doing_nothing(
    case: tuple[tuple[GpuState, ...], tuple[ClaimDemand, ...], Policy],
) -> None:
    """As many claims as the best assignment of the existing free instances alone (no GPU changed)."""
    gpus, claims, policy = case
    result = plan(gpus, claims, policy, CATALOG)
    nothing = best_plan(gpus, claims, Policy(max_gpus_reshaped=0), CATALOG)
    assert len(claims) - len(result.unsatisfied) >= nothing.satisfied
    # The exhaustive search ignores the warm pool and the baseline (which may create profiles the policy
    # does not let claims create), so the upper bound is checked on the claims-only policy.
    plain = Policy(
        allowed_profiles=policy.allowed_profiles,
        max_gpus_reshaped=policy.max_gpus_reshaped,
        strategy=policy.strategy,
    )
    exact = best_plan(gpus, claims, plain, CATALOG)
    assert len(claims) - len(plan(gpus, claims, plain, CATALOG).unsatisfied) <= exact.satisfied
    check_invariants(gpus, claims, plain, exact.plan)


def test_counter_of_profiles_in_example_round() -> None:
    """A full node of mixed demand: every claim fits, and the profiles handed out match the demand."""
    gpus = tuple(gpu("n", i, "A100-80GB") for i in range(2))
    claims = (
        ClaimDemand("big", ("7g.80gb",)),
        *(ClaimDemand(f"small{i}", ("1g.10gb",)) for i in range(7)),
    )
    result = plan(gpus, claims, Policy(), CATALOG)
    check_invariants(gpus, claims, Policy(), result)
    assert result.unsatisfied == ()
    assert Counter(a.profile for a in result.assignments) == {"7g.80gb": 1, "1g.10gb": 7}
    assert len({a.index for a in result.assignments if a.profile == "1g.10gb"}) == 1
