"""Idle nodes kept for waiting multi-GPU claims (``dynamig.planner.reserve``): which node, for whom."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dynamig.planner.reserve import IdleNode, WaitingClaim, keep_idle_nodes

BIG = frozenset({"7g.80gb", "4g.40gb"})
SMALL = frozenset({"1g.10gb"})


def node(name: str, gpus: int, offers: frozenset[str] = BIG | SMALL) -> IdleNode:
    return IdleNode(name, (offers,) * gpus)


def test_largest_claim_first_takes_the_smallest_node_that_holds_it() -> None:
    idle = [node("n8", 8), node("n4", 4), node("n2", 2)]
    kept = keep_idle_nodes(idle, [WaitingClaim("two", 2, BIG), WaitingClaim("four", 4, BIG)])
    assert {n: c.name for n, c in kept.items()} == {"n4": "four", "n2": "two"}
    # the 8-GPU claim comes first even when listed last, so the two-GPU claim cannot take the only 8
    kept = keep_idle_nodes(idle[:1] + idle[2:], [WaitingClaim("two", 2, BIG), WaitingClaim("eight", 8, BIG)])
    assert {n: c.name for n, c in kept.items()} == {"n8": "eight", "n2": "two"}


def test_single_device_claims_keep_nothing_and_a_claim_no_node_holds_keeps_nothing() -> None:
    assert keep_idle_nodes([node("n8", 8)], [WaitingClaim("one", 1, BIG)]) == {}
    assert keep_idle_nodes([node("n4", 4)], [WaitingClaim("eight", 8, BIG)]) == {}


def test_node_constraint_and_profiles_the_gpus_can_offer() -> None:
    idle = [node("a", 2), node("b", 4)]
    kept = keep_idle_nodes(idle, [WaitingClaim("c", 2, BIG, frozenset({"b"}))])
    assert list(kept) == ["b"]
    # GPUs of a model without the claim's profiles do not count (a mixed node holds only one such GPU)
    mixed = IdleNode("m", (BIG, SMALL))
    assert keep_idle_nodes([mixed], [WaitingClaim("c", 2, BIG)]) == {}
    assert list(keep_idle_nodes([mixed], [WaitingClaim("c", 2, BIG | SMALL)])) == ["m"]


@given(
    st.lists(st.integers(1, 8), max_size=8),
    st.lists(st.integers(1, 8), max_size=8),
)
def test_every_kept_node_holds_its_claim_and_serves_one_claim(sizes: list[int], counts: list[int]) -> None:
    idle = [node(f"n{i}", s) for i, s in enumerate(sizes)]
    claims = [WaitingClaim(f"c{i}", c, BIG) for i, c in enumerate(counts)]
    kept = keep_idle_nodes(idle, claims)
    by_name = {n.name: n for n in idle}
    assert len({c.name for c in kept.values()}) == len(kept)  # one node per claim
    assert all(len(by_name[n].gpus) >= c.count > 1 for n, c in kept.items())
    # a multi claim left without a node: no idle node that is not kept could hold it
    free = [n for n in idle if n.name not in kept]
    for c in claims:
        if c.count > 1 and c not in kept.values():
            assert all(len(n.gpus) < c.count for n in free)
