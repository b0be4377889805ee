"""What the operator withdraws and fails for a node whose agent went silent (operator/fencing.py). Pure:
claims and slices as the API server returns them, no API."""

from __future__ import annotations

from typing import Any

from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY
from dynamig.operator.fencing import REASON_AGENT_SILENT, failed_answer, fences

DRIVER = "mig.dynamig.io"


def slice_of(name: str, node: str, driver: str = DRIVER) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"driver": driver, "nodeName": node, "pool": {"name": node}}}


def booked(name: str, node: str, device: str, conditions: bool = True, answer: str = "") -> dict[str, Any]:
    result: dict[str, Any] = {"driver": DRIVER, "pool": node, "device": device, "request": "gpu"}
    if conditions:
        result |= {"bindingConditions": [BINDING_READY], "bindingFailureConditions": [BINDING_FAILED]}
    status: dict[str, Any] = {"allocation": {"devices": {"results": [result]}}}
    if answer:
        cond = {"type": answer, "status": "True", "reason": "x", "message": "x"}
        status["devices"] = [{"driver": DRIVER, "pool": node, "device": device, "conditions": [cond]}]
    meta = {"namespace": "ns", "name": name, "generation": 2, "uid": f"uid-{name}", "creationTimestamp": name}
    return {"metadata": meta, "status": status}


def test_a_silent_node_loses_its_slices_of_the_driver_and_its_unanswered_bookings() -> None:
    slices = [
        slice_of("a-counters", "a"),
        slice_of("a-devices", "a"),
        slice_of("a-other-driver", "a", driver="gpu.nvidia.com"),
        slice_of("b-devices", "b"),
    ]
    claims = [
        booked("c1", "a", "gpu0-1g10gb-s0"),  # waits for a's agent
        booked("c2", "a", "gpu0-1g10gb-s1", conditions=False),  # a free instance: bound already
        booked("c3", "a", "gpu0-1g10gb-s2", answer=BINDING_READY),  # answered before the agent stopped
        booked("c4", "b", "gpu0-1g10gb-s0"),  # another node's: its agent is alive
    ]
    (fence,) = fences({"a": "lease ran out"}, slices, claims, DRIVER, BINDING_READY, BINDING_FAILED)
    assert fence.node == "a" and fence.slices == ("a-counters", "a-devices")
    assert [(b.claim, b.device) for b in fence.bookings] == [("ns/c1", "gpu0-1g10gb-s0")]

    entry = failed_answer(fence, fence.bookings[0], DRIVER, BINDING_FAILED, "2026-12-03T00:00:00Z")
    assert (entry["driver"], entry["pool"], entry["device"]) == (DRIVER, "a", "gpu0-1g10gb-s0")
    (cond,) = entry["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == (BINDING_FAILED, "True", REASON_AGENT_SILENT)
    assert cond["observedGeneration"] == 2 and "lease ran out" in cond["message"]


def test_nothing_is_touched_while_every_agent_is_alive_and_a_withdrawn_node_is_empty() -> None:
    assert (
        fences(
            {}, [slice_of("a-devices", "a")], [booked("c1", "a", "d")], DRIVER, BINDING_READY, BINDING_FAILED
        )
        == []
    )
    (fence,) = fences({"a": "silent"}, [], [], DRIVER, BINDING_READY, BINDING_FAILED)
    assert fence.empty
