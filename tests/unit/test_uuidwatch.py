"""Allocated MIG instances destroyed or re-created outside dynamig are reported once each (pure part)."""

from __future__ import annotations

from dynamig.agent.uuidwatch import AllocatedUuids

DEV = "gpu0-1g10gb-s6"
HELD = {DEV: ["ml/infer-0"]}


def test_an_instance_recreated_under_a_new_uuid_is_reported_once() -> None:
    w = AllocatedUuids()
    assert w.update("gpu0-", {DEV: "MIG-a"}, HELD) == []
    assert w.update("gpu0-", {DEV: "MIG-a"}, HELD) == []
    (change,) = w.update("gpu0-", {DEV: "MIG-b"}, HELD)
    assert (change.reason, change.before, change.after, change.holders) == (
        "AllocatedInstanceReplaced",
        "MIG-a",
        "MIG-b",
        ("ml/infer-0",),
    )
    assert "restart the pod" in change.message()
    assert w.update("gpu0-", {DEV: "MIG-b"}, HELD) == []


def test_gone_then_back_under_a_new_uuid_is_two_reports() -> None:
    w = AllocatedUuids()
    w.update("gpu0-", {DEV: "MIG-a"}, HELD)
    (gone,) = w.update("gpu0-", {}, HELD)
    assert (gone.reason, gone.after) == ("AllocatedInstanceLost", "")
    assert w.update("gpu0-", {}, HELD) == []  # once
    (back,) = w.update("gpu0-", {DEV: "MIG-c"}, HELD)
    assert (back.before, back.after) == ("MIG-a", "MIG-c")


def test_released_or_other_gpu_or_new_holder_is_not_a_change() -> None:
    w = AllocatedUuids()
    w.update("gpu0-", {DEV: "MIG-a"}, HELD)
    assert w.update("gpu1-", {}, {}) == []  # another GPU's round leaves gpu0 alone
    assert w.update("gpu0-", {DEV: "MIG-b"}, {DEV: ["ml/infer-1"]}) == []  # a new claim got a new instance
    assert w.update("gpu0-", {}, {}) == []  # released, then destroyed by dynamig: not reported
    assert w.update("gpu0-", {DEV: "MIG-c"}, HELD) == []  # held again: its first UUID
    assert w.update("gpu10-", {"gpu10-1g10gb-s6": "MIG-x"}, {"gpu10-1g10gb-s6": ["a/b"]}) == []
    assert [c.after for c in w.update("gpu0-", {DEV: "MIG-d"}, HELD)] == ["MIG-d"]
