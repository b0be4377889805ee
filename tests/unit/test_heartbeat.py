"""The agents' heartbeat Leases (``dynamig.kube.heartbeat``): what the agent writes, when the operator calls
an agent silent. Lease fields as coordination.k8s.io/v1 defines them (renewTime a MicroTime)."""

from __future__ import annotations

from dynamig.kube.heartbeat import (
    GRACE_SECONDS,
    MAX_LEASE_SECONDS,
    lease_body,
    lease_name,
    next_silence,
    sightings,
    silent_agents,
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
    # Without sightings (a reader that just started) the forged time is taken as now, not as 2030.
    assert list(silent_agents([forged], now + 36)) == []
    assert next_silence([forged], now) == now + 30 + GRACE_SECONDS


def test_a_huge_lease_duration_is_bounded() -> None:
    now = 1_800_000_000.0
    greedy = lease_body("greedy", "ns", now, 2_000_000_000)
    assert silent_agents([greedy], now + MAX_LEASE_SECONDS + GRACE_SECONDS + 1) != {}
    assert next_silence([greedy], now) == now + MAX_LEASE_SECONDS + GRACE_SECONDS


def test_a_renewal_counts_when_its_time_moves_forward() -> None:
    t0 = 1_800_000_000.0
    seen = sightings([lease_body("a", "ns", t0, 30)], {}, t0 + 1)
    assert seen["dynamig-agent-a"].at == t0  # a past time counts as written
    seen = sightings([lease_body("a", "ns", t0 + 10, 30)], seen, t0 + 12)
    assert seen["dynamig-agent-a"].at == t0 + 10
    assert sightings([lease_body("a", "ns", t0 + 5, 30)], seen, t0 + 13) == seen  # backwards: not a renewal
