"""How close the greedy planner comes to the best possible round, and the exhaustive search's own checks.

Real: the planner, the exhaustive reference search (``dynamig.planner.exhaustive``), the packaged geometry
catalog. The rounds are random but fixed: ``dynamig.planner.synthetic.small_round`` with seeds 0-299 (up to
4 GPUs on up to 3 nodes, up to 10 claims, random busy/free instances, allowed profiles and budgets).
"""

from __future__ import annotations

import random

import pytest

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance
from dynamig.planner import ClaimDemand, CurrentInstance, GpuState, Policy, plan
from dynamig.planner.exhaustive import MAX_CLAIMS, best_plan
from dynamig.planner.synthetic import small_round

CATALOG = load_catalog()
CASES = 300


def test_greedy_matches_exhaustive_on_at_least_99_percent_of_small_rounds() -> None:
    agree = 0
    behind: list[tuple[int, int, int]] = []
    for seed in range(CASES):
        r = small_round(random.Random(seed), CATALOG)
        greedy = len(r.claims) - len(plan(r.gpus, r.claims, r.policy, CATALOG).unsatisfied)
        best = best_plan(r.gpus, r.claims, r.policy, CATALOG).satisfied
        assert greedy <= best, f"seed {seed}: greedy {greedy} beats the exhaustive optimum {best}"
        if greedy == best:
            agree += 1
        else:
            behind.append((seed, greedy, best))
    share = agree / CASES
    print(
        f"\nplanner satisfies as many claims as exhaustive search in {agree}/{CASES} = {share:.1%} of rounds;"
        f" behind in (seed, greedy, best): {behind}"
    )
    assert share >= 0.99


def test_exhaustive_finds_the_trade_a_greedy_first_choice_misses() -> None:
    # One free A100 80GB: the 4g claim prefers 4g@0, the 3g claim can only use 3g@4 after it, but a 7g
    # claim and a 4g claim cannot both fit; the search must satisfy the two that fit together.
    gpus = (GpuState("n", 0, "A100-80GB"),)
    claims = (
        ClaimDemand("a", ("4g.40gb", "3g.40gb")),
        ClaimDemand("b", ("4g.40gb",)),
        ClaimDemand("c", ("7g.80gb",)),
    )
    result = best_plan(gpus, claims, Policy(), CATALOG)
    assert result.satisfied == 2 and result.first_choices == 1
    assert result.plan.unsatisfied == ("c",)
    assert {(a.claim, a.profile, a.start) for a in result.plan.assignments} == {
        ("a", "3g.40gb", 4),
        ("b", "4g.40gb", 0),
    }
    assert result.plan.gpus[0].layout == (PlacedInstance(0, "4g.40gb"), PlacedInstance(4, "3g.40gb"))


def test_exhaustive_respects_the_budget_and_busy_instances() -> None:
    gpus = (
        GpuState("n", 0, "H100-80GB", (CurrentInstance("7g.80gb", 0, busy=True),)),
        GpuState("n", 1, "H100-80GB"),
        GpuState("n", 2, "H100-80GB"),
    )
    claims = (ClaimDemand("x", ("7g.80gb",)), ClaimDemand("y", ("7g.80gb",)))
    assert best_plan(gpus, claims, Policy(max_gpus_reshaped=1), CATALOG).satisfied == 1
    assert best_plan(gpus, claims, Policy(), CATALOG).satisfied == 2


def test_exhaustive_refuses_large_inputs() -> None:
    claims = tuple(ClaimDemand(f"c{i}", ("1g.10gb",)) for i in range(MAX_CLAIMS + 1))
    with pytest.raises(ValueError, match="limited"):
        best_plan((GpuState("n", 0, "A100-80GB"),), claims, Policy(), CATALOG)
