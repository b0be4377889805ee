"""The agents' heartbeat Leases (``dynamig.kube.heartbeat``): what the agent writes, when the operator calls
an agent silent. Lease fields as coordination.k8s.io/v1 defines them (renewTime a MicroTime)."""

from __future__ import annotations

from dynamig.kube.heartbeat import (
    GRACE_SECONDS,
    MAX_LEASE_SECONDS,
    Sighting,
    agent_leases,
    lease_body,
    lease_name,
    lease_node,
    next_silence,
    sightings,
    silent_agents,
    stuck,
)


def test_a_lease_is_silent_only_past_its_duration_and_the_grace() -> None:
    renewed = 1_800_000_000.0
    lease = lease_body("node-a", "dynamig-system", renewed, 60)
    assert lease["metadata"]["name"] == lease_name("node-a") == "dynamig-agent-node-a"
    assert lease["spec"]["renewTime"] == "2027-01-15T08:00:00.000000Z"
    assert lease["spec"]["holderIdentity"] == "node-a"
    assert silent_agents([lease], renewed + 60 + GRACE_SECONDS) == {}
    late = silent_agents([lease], renewed + 60 + GRACE_SECONDS + 1)
    assert list(late) == ["node-a"] and "has not renewed its lease for 66s (lease 60s)" in late["node-a"]


def test_other_leases_and_unreadable_ones_are_not_judged() -> None:
    foreign = {
        "metadata": {"name": "kube-scheduler", "labels": {}},
        "spec": {"renewTime": "2020-01-01T00:00:00Z"},
    }
    broken = lease_body("node-b", "ns", 0.0, 60)
    broken["spec"]["renewTime"] = "not a time"
    assert silent_agents([foreign, broken], 1_800_000_000.0) == {}


def test_the_next_silence_is_the_earliest_lease_end_still_ahead() -> None:
    a = lease_body("a", "ns", 1000.0, 30)  # silent from 1035
    b = lease_body("b", "ns", 1010.0, 30)  # silent from 1045
    assert next_silence([a, b], 1020.0) == 1000.0 + 30 + GRACE_SECONDS
    assert next_silence([a, b], 1040.0) == 1010.0 + 30 + GRACE_SECONDS  # a is silent already
    assert next_silence([a, b], 1050.0) is None
    assert next_silence([{"metadata": {"name": "other"}, "spec": {"renewTime": "x"}}], 0.0) is None


def test_a_renew_time_in_the_future_buys_nothing() -> None:
    """A forged (or skewed) ``renewTime: 2030-01-01`` counts once, at the reader's clock; renewals that come
    after it but carry earlier times do not count (as the node lifecycle controller counts node Leases)."""
    now = 1_800_000_000.0
    forged = lease_body("liar", "ns", now + 100_000_000.0, 30)
    seen = sightings([forged], {}, now)
    assert seen["dynamig-agent-liar"].at == now  # not the year 2030
    assert silent_agents([forged], now + 30 + GRACE_SECONDS, seen) == {}
    assert list(silent_agents([forged], now + 30 + GRACE_SECONDS + 1, seen)) == ["liar"]
    # An honest renewal afterwards is "before" the forged time: it does not count either.
    honest = lease_body("liar", "ns", now + 20, 30)
    later = sightings([honest], seen, now + 20)
    assert later["dynamig-agent-liar"].at == now
    # A reader that reads once (a report) takes the forged time as now, not as 2030.
    assert list(silent_agents([forged], now + 36)) == []
    assert next_silence([forged], now) == now + 30 + GRACE_SECONDS


def test_a_huge_lease_duration_is_bounded() -> None:
    now = 1_800_000_000.0
    greedy = lease_body("greedy", "ns", now, 2_000_000_000)
    assert silent_agents([greedy], now + MAX_LEASE_SECONDS + GRACE_SECONDS + 1) != {}
    assert next_silence([greedy], now) == now + MAX_LEASE_SECONDS + GRACE_SECONDS


def test_a_renewal_counts_when_its_time_moves_forward_dated_by_the_readers_clock() -> None:
    t0 = 1_800_000_000.0
    seen = sightings([lease_body("a", "ns", t0, 30)], {}, t0 + 1)
    assert seen["dynamig-agent-a"].at == t0 + 1  # first seen: counts as renewed when seen
    seen = sightings([lease_body("a", "ns", t0 + 10, 30)], seen, t0 + 12)
    assert seen["dynamig-agent-a"].at == t0 + 12  # seen moved at t0 + 12, whatever it says
    assert sightings([lease_body("a", "ns", t0 + 5, 30)], seen, t0 + 13) == seen  # backwards: not a renewal
    assert sightings([lease_body("a", "ns", t0 + 10, 30)], seen, t0 + 40) == seen  # unchanged: not one


def test_an_agent_whose_clock_lags_is_not_silent_while_it_renews() -> None:
    """Its renewTimes are 60 s behind the reader's clock, longer than the Lease: only whether they move
    counts. Once they stop moving, it is silent one duration (plus the grace) after the last move seen."""
    lease, lag, t = 3, 60.0, 1_800_000_000.0
    seen: dict[str, Sighting] = {}
    for step in range(20):  # renewed every second, read every second
        now = t + step
        leases = [lease_body("slow", "ns", now - lag, lease)]
        seen = sightings(leases, seen, now)
        assert silent_agents(leases, now, seen) == {}, step
    last = t + 19
    assert silent_agents(leases, last + lease + GRACE_SECONDS, sightings(leases, seen, last + 8)) == {}
    late = last + lease + GRACE_SECONDS + 0.5
    assert list(silent_agents(leases, late, sightings(leases, seen, late))) == ["slow"]
    # The same Lease judged by its own time (the rule before) would have been silent from the start.
    assert list(silent_agents(leases, t, None)) == ["slow"]


def test_only_leases_of_nodes_that_exist_are_agents() -> None:
    """A Lease a removed node left behind (written before Leases had an owner) is neither silent nor counted
    among the agents; the node is read from the label, else from the name."""
    live = lease_body("live", "ns", 0.0, 30)
    gone = lease_body("gone", "ns", 0.0, 30)
    unlabelled = lease_body("bare", "ns", 0.0, 30)
    del unlabelled["metadata"]["labels"]
    foreign = {"metadata": {"name": "kube-scheduler"}, "spec": {"renewTime": "2020-01-01T00:00:00Z"}}
    assert [lease_node(x) for x in (live, gone, unlabelled)] == ["live", "gone", "bare"]
    kept = agent_leases([live, gone, unlabelled, foreign], {"live", "bare", "kube-scheduler"})
    assert kept == [live, unlabelled]


def test_the_lease_is_owned_by_its_node_once_the_node_is_known() -> None:
    owner = {"apiVersion": "v1", "kind": "Node", "name": "a", "uid": "uid-a"}
    assert "ownerReferences" not in lease_body("a", "ns", 0.0, 30)["metadata"]
    assert lease_body("a", "ns", 0.0, 30, owner)["metadata"]["ownerReferences"] == [owner]


def test_an_agent_is_stuck_only_after_half_the_lease_without_progress() -> None:
    assert not stuck(None, 1000.0, 30)  # between rounds
    assert not stuck(990.0, 1000.0, 30)  # 10 s since the round last did something
    assert stuck(985.0, 1000.0, 30)  # 15 s: half the Lease
