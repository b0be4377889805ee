"""Repeated Events fold into one with a count, as client-go's correlator does (pure part)."""

from __future__ import annotations

from typing import Any

from dynamig.kube.events import REPEAT_WINDOW_S, EventCorrelator, event_body

REF = {"apiVersion": "dynamig.io/v1alpha1", "kind": "GpuPartition", "name": "n1-gpu0", "uid": "u-1"}


def body(
    reason: str = "InstanceBusy", message: str = "busy", now: str = "2026-01-01T00:00:00Z"
) -> dict[str, Any]:
    return event_body(REF, "Warning", reason, message, "dynamig", "dynamig-agent", now, instance="n1")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_repeat_patches_the_first_event_with_a_count() -> None:
    clock = Clock()
    c = EventCorrelator(clock)
    first = c.write_for(body())
    assert first.patch is None
    clock.t = 30
    again = c.write_for(body(now="2026-01-01T00:00:30Z"))
    assert again.name == first.body["metadata"]["name"]
    assert again.patch == {"count": 2, "lastTimestamp": "2026-01-01T00:00:30Z"}
    assert c.write_for(body()).patch == {"count": 3, "lastTimestamp": "2026-01-01T00:00:00Z"}


def test_other_reason_message_or_object_is_a_new_event() -> None:
    c = EventCorrelator(Clock())
    c.write_for(body())
    assert c.write_for(body(reason="GpuLost")).patch is None
    assert c.write_for(body(message="busy with pid 7")).patch is None
    other = body()
    other["involvedObject"]["uid"] = "u-2"
    assert c.write_for(other).patch is None


def test_after_the_window_or_once_forgotten_a_new_event_is_created() -> None:
    clock = Clock()
    c = EventCorrelator(clock)
    c.write_for(body())
    clock.t = REPEAT_WINDOW_S + 1
    assert c.write_for(body()).patch is None
    c.forget(body())
    assert c.write_for(body()).patch is None
