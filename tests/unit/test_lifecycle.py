"""The device lifecycle table (agent/layout/lifecycle.py): which moves it allows, and the rule that an
instance published without binding conditions is never destroyed on the agent's own initiative until it has
been republished guarded and no allocation from the older slice can still bind. Pure: no NVML, no API."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamig.agent.layout.lifecycle import (
    MOVES,
    Event,
    IllegalMove,
    State,
    bound_may_clear,
    destroys_now,
    free_state,
    move,
    retired_may_go,
)
from dynamig.geometry.model import PlacedInstance

# Every allowed move, written out once more by hand: the table may only change together with this list.
ALLOWED = {
    (State.FREE_UNGUARDED, Event.RETIRE): State.GUARDED,
    (State.FREE_UNGUARDED, Event.ALLOCATE): State.READY,
    (State.FREE_UNGUARDED, Event.DESTROY_IN_WAY): State.DESTROYED,
    (State.FREE_UNGUARDED, Event.DESTROY_FOR_BOUND): State.DESTROYED,
    (State.GUARDED, Event.KEEP): State.FREE_UNGUARDED,
    (State.GUARDED, Event.ALLOCATE): State.READY,
    (State.GUARDED, Event.BOOK): State.BOOKED,
    (State.GUARDED, Event.DESTROY_IN_WAY): State.DESTROYED,
    (State.GUARDED, Event.DESTROY_RETIRED): State.DESTROYED,
    (State.GUARDED, Event.DESTROY_FOR_BOUND): State.DESTROYED,
    (State.GUARDED, Event.CREATE): State.FREE_UNGUARDED,
    (State.BOOKED, Event.ANSWER_READY): State.READY,
    (State.BOOKED, Event.START_CUT): State.CUTTING,
    (State.BOOKED, Event.ANSWER_FAILED): State.FAILED,
    (State.CUTTING, Event.CUT_DONE): State.READY,
    (State.CUTTING, Event.ANSWER_FAILED): State.FAILED,
    (State.READY, Event.RELEASE): State.FREE_UNGUARDED,
    (State.FAILED, Event.RELEASE): State.GUARDED,
    (State.DESTROYED, Event.OFFER): State.GUARDED,
    (State.DESTROYED, Event.CREATE): State.FREE_UNGUARDED,
}


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("event", list(Event))
def test_every_pair_is_allowed_exactly_as_listed_or_refused(state: State, event: Event) -> None:
    if (state, event) in ALLOWED:
        assert move(state, event) is ALLOWED[(state, event)]
    else:
        with pytest.raises(IllegalMove, match=f"{event.value} is not allowed from {state.value}"):
            move(state, event)


def test_the_table_has_no_moves_beyond_the_list() -> None:
    assert {(s, e) for s, moves in MOVES.items() for e in moves} == set(ALLOWED)


def test_an_unguarded_instance_cannot_be_destroyed_on_the_agents_own_initiative() -> None:
    with pytest.raises(IllegalMove):
        move(free_state(guarded=False), Event.DESTROY_RETIRED)
    assert move(free_state(guarded=True), Event.DESTROY_RETIRED) is State.DESTROYED


def test_nothing_allocated_or_being_answered_can_be_destroyed() -> None:
    for state in (State.READY, State.BOOKED, State.CUTTING):
        for event in (Event.DESTROY_RETIRED, Event.DESTROY_IN_WAY, Event.DESTROY_FOR_BOUND):
            with pytest.raises(IllegalMove):
                move(state, event)


@given(st.lists(st.sampled_from(list(Event)), max_size=40))
def test_any_walk_destroys_on_its_own_initiative_only_after_a_retire(events: list[Event]) -> None:
    # Walk from a free unguarded instance; skip refused moves. Whenever DESTROY_RETIRED is taken, the last
    # move into the guarded state came from a RETIRE, a failed booking or an offer of an empty placement,
    # never from a state in which an allocation without conditions could have been made unseen.
    state, guarded_by = State.FREE_UNGUARDED, ""
    for event in events:
        try:
            nxt = move(state, event)
        except IllegalMove:
            continue
        if event is Event.DESTROY_RETIRED:
            assert state is State.GUARDED and guarded_by in (Event.RETIRE, Event.RELEASE, Event.OFFER)
        if nxt is State.GUARDED and state is not State.GUARDED:
            guarded_by = event
        state = nxt


@pytest.mark.parametrize(
    ("guarded_for", "holders", "binding", "expected"),
    [
        (None, (), (), "not yet republished guarded"),
        (1.0, (), (), "guarded 1.0s of 5.0s"),
        (9.0, ("ns/c",), (), "allocated to ns/c"),
        (1.0, ("ns/c",), (), "allocated to ns/c"),
        (9.0, (), ("ns/p1",), "pods binding to this node may hold an allocation from an older slice: ns/p1"),
        (9.0, (), ("a/1", "a/2", "a/3", "a/4"), "... older slice: a/1, a/2, a/3 ..."),
        (9.0, (), (), None),
        (5.0, (), (), None),
    ],
)
def test_a_retired_instance_goes_only_when_the_guard_stood_and_nothing_can_still_bind(
    guarded_for: float | None, holders: tuple[str, ...], binding: tuple[str, ...], expected: str | None
) -> None:
    got = retired_may_go(guarded_for, 5.0, holders, binding)
    if expected is None:
        assert got is None
    elif expected.startswith("..."):
        assert got is not None and got.endswith(expected[4:])
    else:
        assert got == expected


def test_destroys_now_lets_go_only_what_the_rule_allows() -> None:
    a, b, c, d, half = (PlacedInstance(s, "1g.10gb") for s in range(5))
    planned = (a, b, c, d, half)
    bookable = {a, b, c, d}  # ``half`` is a GPU instance without its compute instance: never published
    guarded = {a: 0.0, b: 9.0, c: 0.0}  # ``d`` was never republished guarded
    holders = {c: ["ns/won"]}
    go, kept = destroys_now(planned, bookable, guarded, 10.0, 5.0, holders, set(), [])
    assert go == (a, half)
    assert {k.placed: k.why for k in kept} == {
        b: "guarded 1.0s of 5.0s",
        c: "a claim won the race (ns/won)",
        d: "not yet republished guarded",
    }
    assert [k.won_by for k in kept if k.placed == c] == [("ns/won",)]
    # A pod in its binding cycle toward the node holds every retired instance; half-made ones still go.
    go, kept = destroys_now(planned, bookable, guarded, 10.0, 5.0, {}, {b}, ["ns/binding"])
    assert go == (half,)
    assert [k.won_by for k in kept if k.placed == b] == [("prepared by the kubelet",)]


@pytest.mark.parametrize(
    ("holders", "binding", "expected"),
    [
        ((), (), None),
        (("ns/c",), (), "allocated to ns/c"),
        (("ns/c",), ("ns/p",), "allocated to ns/c"),
        ((), ("ns/p",), "pods binding to this node may hold an allocation from an older slice: ns/p"),
    ],
)
def test_a_free_instance_in_a_bound_pods_way_goes_only_on_the_retire_evidence(
    holders: tuple[str, ...], binding: tuple[str, ...], expected: str | None
) -> None:
    # The last line of defence needs no guard period (the pod is bound already), but the same reads:
    # a claim naming the instance, or a pod binding toward the node, keeps it.
    assert bound_may_clear(holders, binding) == expected
