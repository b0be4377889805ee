"""Drain choice (planner/drain.py) on the real A100 MIG geometry: which GPU keeps a large placement for a
claim starving behind small ones, and why others are not chosen. Each rule has a row where it alone
decides."""

from __future__ import annotations

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance
from dynamig.planner.drain import choose_drains
from dynamig.planner.model import GpuKey
from dynamig.planner.victims import GpuHolding, HeldInstance, Preemptor

CATALOG = load_catalog()
MODELS = {"A100-80GB": CATALOG.model("A100-80GB")}


def gpu(node: str, *held: tuple[str, int, tuple[str, ...]]) -> GpuHolding:
    return GpuHolding(
        GpuKey(node, 0),
        "A100-80GB",
        tuple(HeldInstance(PlacedInstance(start, profile), holders) for profile, start, holders in held),
    )


def small(node: str, busy: range | list[int] = range(7)) -> GpuHolding:
    """Seven 1g.10gb; those at ``busy`` used by one pod each (``node/p<start>``)."""
    return gpu(node, *[("1g.10gb", s, (f"{node}/p{s}",) if s in busy else ()) for s in range(7)])


def known(*gpus: GpuHolding) -> frozenset[str]:
    return frozenset(h for g in gpus for i in g.instances for h in i.holders)


def big(name: str = "ml/big", *alternatives: str, nodes: frozenset[str] | None = None) -> Preemptor:
    return Preemptor(name, 0, alternatives or ("3g.40gb",), nodes)


def test_the_placement_with_the_fewest_busy_slices_is_kept() -> None:
    # 3g.40gb at 0 waits for four 1g.10gb, at 4 for three (slices 4, 5, 6; slice 7 has no 1g placement).
    g = small("a")
    (d,) = choose_drains([big()], [g], known(g), MODELS, 1)
    assert (d.gpu, d.profile, d.start, d.blocked_slices) == (GpuKey("a", 0), "3g.40gb", 4, 3)
    assert d.waiting_for == tuple(PlacedInstance(s, "1g.10gb") for s in (4, 5, 6))


def test_the_gpu_with_the_least_to_wait_for_wins() -> None:
    full, one = small("a"), small("b", busy=[5, 0, 1, 2, 3])  # b: at 4, only 1g@5 is busy
    (d,) = choose_drains([big()], [full, one], known(full, one), MODELS, 1)
    assert (d.gpu.node, d.start, d.blocked_slices) == ("b", 4, 1)
    assert d.waiting_for == (PlacedInstance(5, "1g.10gb"),)


def test_a_placement_with_nothing_busy_is_the_planners_not_a_drain() -> None:
    idle = small("a", busy=[])
    assert choose_drains([big()], [idle], frozenset(), MODELS, 1) == ()


def test_an_instance_used_outside_any_known_pod_is_never_waited_for() -> None:
    g = small("a")
    assert choose_drains([big()], [g], known(g) - {"a/p5"}, MODELS, 1)[0].start == 0
    assert choose_drains([big()], [g], frozenset(), MODELS, 1) == ()


def test_the_claims_nodes_bound_the_choice() -> None:
    a, b = small("a"), small("b", busy=[0, 1, 2, 3, 4])
    (d,) = choose_drains([big(nodes=frozenset({"a"}))], [a, b], known(a, b), MODELS, 1)
    assert d.gpu.node == "a"


def test_oldest_first_one_gpu_each_within_room() -> None:
    a, b = small("a"), small("b", busy=[0, 1, 2, 3, 4])
    first, second, third = big("ml/old"), big("ml/mid"), big("ml/new")
    out = choose_drains([first, second, third], [a, b], known(a, b), MODELS, 2)
    assert [(d.claim, d.gpu.node) for d in out] == [("ml/old", "b"), ("ml/mid", "a")]
    assert len(choose_drains([first, second], [a, b], known(a, b), MODELS, 1)) == 1


def test_alternatives_are_tried_in_order() -> None:
    # 7g.80gb needs the whole GPU: every instance in its way, so any busy one makes it a drain candidate;
    # the claim prefers it to 3g.40gb.
    g = small("a", busy=[6])
    (d,) = choose_drains([big("ml/x", "7g.80gb", "3g.40gb")], [g], known(g), MODELS, 1)
    assert (d.profile, d.start, d.blocked_slices) == ("7g.80gb", 0, 1)
    # Only 3g.40gb, which fits at 0 with nothing busy there: no drain (the planner cuts it).
    assert choose_drains([big("ml/x", "3g.40gb")], [g], known(g), MODELS, 1) == ()
    # A profile the GPU has not: the next alternative.
    (d,) = choose_drains([big("ml/x", "8g.96gb", "7g.80gb")], [g], known(g), MODELS, 1)
    assert d.profile == "7g.80gb"
