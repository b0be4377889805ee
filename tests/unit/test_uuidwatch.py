"""Allocated MIG instances destroyed or re-created outside dynamig are reported once each (pure part)."""

from __future__ import annotations

from typing import Any

from dynamig import DRIVER_NAME as DRIVER
from dynamig.agent.bindings.given_uuids import given_uuids
from dynamig.agent.bindings.uuidwatch import AllocatedUuids

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


def test_an_instance_replaced_before_its_first_sighting_is_told_from_the_uuid_it_was_given() -> None:
    w = AllocatedUuids()
    (change,) = w.update("gpu0-", {DEV: "MIG-b"}, HELD, {DEV: "MIG-a"})
    assert (change.reason, change.before, change.after) == ("AllocatedInstanceReplaced", "MIG-a", "MIG-b")
    assert w.update("gpu0-", {DEV: "MIG-b"}, HELD, {DEV: "MIG-a"}) == []  # once, whatever the record says


def test_an_instance_gone_at_its_first_sighting_is_lost_when_a_uuid_was_given() -> None:
    w = AllocatedUuids()
    (gone,) = w.update("gpu0-", {}, HELD, {DEV: "MIG-a"})
    assert (gone.reason, gone.before) == ("AllocatedInstanceLost", "MIG-a")
    assert AllocatedUuids().update("gpu0-", {}, HELD) == []  # nothing recorded: nothing to tell


def test_the_given_uuid_counts_only_at_the_first_sighting() -> None:
    w = AllocatedUuids()
    assert w.update("gpu0-", {DEV: "MIG-a"}, HELD, {DEV: "MIG-a"}) == []  # the instance it was given
    # Held by a new claim: the instance there now is theirs, an older record of another claim is not.
    assert w.update("gpu0-", {DEV: "MIG-b"}, {DEV: ["ml/infer-1"]}, {DEV: "MIG-a"}) == []


def _slice(
    generation: int, devices: dict[str, str], driver: str = DRIVER, pool: str = "n1"
) -> dict[str, Any]:
    return {
        "spec": {
            "driver": driver,
            "pool": {"name": pool, "generation": generation},
            "devices": [
                {
                    "name": d,
                    "attributes": {
                        "mig.dynamig.io/uuid": {"string": u},
                        "mig.dynamig.io/gpuIndex": {"int": 0},
                    },
                }
                for d, u in devices.items()
            ],
        }
    }


def _claim(device: str, uuid: str, driver: str = DRIVER) -> dict[str, Any]:
    entry = {"driver": driver, "pool": "n1", "device": device, "data": {"migUUID": uuid}}
    return {"metadata": {"namespace": "ml", "name": "c"}, "status": {"devices": [entry]}}


def test_given_uuids_come_from_the_claims_answer_then_the_newest_slice_of_the_pool() -> None:
    slices = [
        _slice(1, {DEV: "MIG-old", "gpu0-1g10gb-s5": "MIG-x"}),
        _slice(2, {DEV: "MIG-a", "gpu0-3g40gb-s0": ""}),
        _slice(9, {DEV: "MIG-other-driver"}, driver="gpu.example.com"),
        _slice(9, {DEV: "MIG-other-pool"}, pool="n2"),
    ]
    assert given_uuids(slices, [], DRIVER, "n1", from_slices=True) == {DEV: "MIG-a"}
    claims = [_claim(DEV, "MIG-answered"), _claim("gpu0-1g10gb-s4", "MIG-z", driver="gpu.example.com")]
    assert given_uuids(slices, claims, DRIVER, "n1", from_slices=True) == {DEV: "MIG-answered"}
    # Partitionable: the answer says which instance a claim got, not the slice it was booked from.
    assert given_uuids(slices, [], DRIVER, "n1", from_slices=False) == {}
    assert given_uuids(slices, claims[:1], DRIVER, "n1", from_slices=False) == {DEV: "MIG-answered"}
