"""The devices the kubelet plugin prepared, counted per claim (agent/prepared.py): an instance an ordinary
claim and an admin-access claim both use stays prepared, hence never destroyed, until both are unprepared.
Pure: no NVML, no API."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dynamig.agent.prepared import PreparedDevices


def test_a_device_stays_prepared_while_any_claim_uses_it() -> None:
    prepared = PreparedDevices()
    prepared.add("gpu0-1g10gb-s0")  # the workload's claim
    prepared.add("gpu0-1g10gb-s0")  # a monitoring claim with admin access to the same instance
    prepared.discard("gpu0-1g10gb-s0")  # the monitor is unprepared first
    assert "gpu0-1g10gb-s0" in prepared and prepared.claims("gpu0-1g10gb-s0") == 1
    prepared.discard("gpu0-1g10gb-s0")
    assert "gpu0-1g10gb-s0" not in prepared and list(prepared) == [] and len(prepared) == 0
    prepared.discard("gpu0-1g10gb-s0")  # a release too many never goes below nothing
    prepared.add("gpu0-1g10gb-s0")
    assert "gpu0-1g10gb-s0" in prepared


def test_a_checkpoint_naming_a_device_twice_counts_twice() -> None:
    prepared = PreparedDevices(["a", "b", "a"])
    assert sorted(prepared) == ["a", "b"] and prepared.claims("a") == 2
    prepared.discard("a")
    assert "a" in prepared


def test_a_plugin_that_starts_again_replaces_the_counts_with_its_checkpoint() -> None:
    prepared = PreparedDevices(["a", "b"])
    prepared.reset(["a"])  # the checkpoint as the plugin starts again in the same agent: "a" once
    assert list(prepared) == ["a"] and prepared.claims("a") == 1


@given(st.lists(st.tuples(st.booleans(), st.sampled_from("abc")), max_size=60))
def test_prepared_exactly_while_more_prepares_than_releases(ops: list[tuple[bool, str]]) -> None:
    prepared, count = PreparedDevices(), dict.fromkeys("abc", 0)
    for add, name in ops:
        if add:
            prepared.add(name)
            count[name] += 1
        else:
            prepared.discard(name)
            count[name] = max(0, count[name] - 1)
        assert {n for n in "abc" if n in prepared} == {n for n, c in count.items() if c > 0}
