"""The agents' heartbeat Leases (``dynamig.kube.heartbeat``): what the agent writes, when the operator calls
an agent silent. Lease fields as coordination.k8s.io/v1 defines them (renewTime a MicroTime)."""

from __future__ import annotations

from dynamig.kube.heartbeat import GRACE_SECONDS, lease_body, lease_name, next_silence, silent_agents


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
