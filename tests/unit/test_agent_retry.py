"""A layout NVML keeps refusing: back-off, give-up verdict and fresh start (``dynamig.agent.layout.retry``).
Pure."""

from __future__ import annotations

from dynamig.agent.layout.retry import (
    GIVE_UP_AFTER,
    RETRY_MAX_S,
    after_attempt,
    backoff,
    current,
    gave_up,
    holding,
)
from dynamig.geometry.layout import parse_layout
from dynamig.kube.gpupartition import Reason

LAYOUT = parse_layout("3g.40gb@0")
ERROR = ("InsufficientResources", "NVML refused to create 3g.40gb at memory slice 0")


def test_failures_back_off_doubling_to_a_cap_and_a_success_starts_over() -> None:
    assert [backoff(n) for n in range(1, 10)] == [2, 4, 8, 16, 32, 64, 128, 256, RETRY_MAX_S]
    att = None
    for n in range(1, GIVE_UP_AFTER + 2):
        att = after_attempt(att, LAYOUT, ERROR, 100.0, f"t{n}")
        assert att is not None and att.failures == n and att.since == "t1"
        assert holding(att, 100.0) and not holding(att, 100.0 + backoff(n))
    assert after_attempt(att, LAYOUT, None, 200.0, "t9") is None


def test_the_gpu_is_reported_failed_only_after_several_failures_with_the_way_out() -> None:
    att = None
    for _ in range(1, GIVE_UP_AFTER):
        att = after_attempt(att, LAYOUT, ERROR, 0.0, "2026-01-01T00:00:00Z")
        assert gave_up(att) is None
    att = after_attempt(att, LAYOUT, ERROR, 0.0, "later")
    verdict = gave_up(att)
    assert verdict is not None and verdict[0] == Reason.LAYOUT_FAILED
    assert f"failed {GIVE_UP_AFTER} times in a row since 2026-01-01T00:00:00Z" in verdict[1]
    assert ERROR[1] in verdict[1] and "write another spec.layout" in verdict[1]
    assert gave_up(att) == verdict  # the same words while nothing changes: no status write per round


def test_another_layout_starts_over() -> None:
    att = after_attempt(None, LAYOUT, ERROR, 0.0, "t")
    other = parse_layout("7g.80gb@0")
    assert current(att, LAYOUT) == att and current(att, other) is None
    again = after_attempt(att, other, ERROR, 0.0, "u")
    assert again is not None and (again.failures, again.since) == (1, "u")
