"""Whether a booking the round read still waits for its answer in claims read again right before a cut
destroys anything (kube/answers.py ``still_waits``): the booking's pod may have been deleted since (or
preempted, its reservation taken away), its claim deallocated or replaced by another of the same name.
Pure: claims as the API server returns them, no API."""

from __future__ import annotations

from typing import Any

from dynamig.kube.answers import Pending, still_waits
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY

DRIVER, NODE, DEVICE = "mig.dynamig.io", "gpu-a", "gpu0-4g40gb-s0"
BOOKING = Pending("ns", "b-gpu", DEVICE, 1, "uid-b")


def claim(
    uid: str = "uid-b", device: str = DEVICE, conditions: bool = True, answer: str = "", reserved: bool = True
) -> dict[str, Any]:
    result: dict[str, Any] = {"driver": DRIVER, "pool": NODE, "device": device, "request": "gpu"}
    if conditions:
        result |= {"bindingConditions": [BINDING_READY], "bindingFailureConditions": [BINDING_FAILED]}
    status: dict[str, Any] = {"allocation": {"devices": {"results": [result]}}}
    if reserved:  # kube-scheduler writes the pod's reservation with the allocation
        status["reservedFor"] = [{"resource": "pods", "name": "b", "uid": "uid-pod-b"}]
    if answer:
        cond = {"type": answer, "status": "True", "reason": "x", "message": "x"}
        status["devices"] = [{"driver": DRIVER, "pool": NODE, "device": device, "conditions": [cond]}]
    meta = {"namespace": "ns", "name": "b-gpu", "generation": 1, "uid": uid, "creationTimestamp": "t"}
    return {"metadata": meta, "status": status}


def waits(claims: list[dict[str, Any]]) -> bool:
    return still_waits(claims, BOOKING, DRIVER, NODE, BINDING_READY, BINDING_FAILED)


def test_the_booking_waits_while_its_claim_still_allocates_the_device_unanswered() -> None:
    assert waits([claim()])
    # the status written since (generation unchanged) does not matter; only who allocates what
    assert waits([claim(), claim(uid="uid-other", device="gpu0-1g10gb-s6")])


def test_a_deleted_replaced_answered_or_moved_booking_no_longer_waits() -> None:
    assert not waits([])  # the pod was deleted and its claim with it
    assert not waits([claim(uid="uid-new")])  # a new claim of the same name (a new pod of a StatefulSet)
    assert not waits([claim(device="gpu0-1g10gb-s6")])  # deallocated, then booked elsewhere
    assert not waits([claim(answer=BINDING_FAILED)])  # answered meanwhile (the operator fenced the node)
    assert not waits([claim(answer=BINDING_READY)])
    assert not waits([claim(conditions=False)])  # an allocation without conditions waits for no answer
    # Its pod preempted in PreBind: kube-scheduler takes the reservation away and leaves the allocation.
    assert not waits([claim(reserved=False)])
