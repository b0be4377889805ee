"""What the operator withdraws and fails for a node whose agent went silent (operator/fencing.py). Pure:
claims and slices as the API server returns them, no API."""

from __future__ import annotations

from typing import Any

from dynamig.kube.apicalls import answered
from dynamig.kube.heartbeat import agent_leases, lease_body, silent_agents
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY
from dynamig.operator.fencing import REASON_AGENT_SILENT, disrupted, failed_answer, fences

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


def test_every_agent_silent_at_once_is_a_disruption_counting_only_agents_of_nodes_that_exist() -> None:
    """One live GPU node and a stale Lease of a removed node: the Lease is not an agent (kube/heartbeat.py
    ``agent_leases``), so the live node's dead agent alone is silent among one agent and is withdrawn."""
    assert not disrupted({}, 0)
    assert not disrupted({"a": "silent"}, 1)  # the only agent: withdrawn
    assert not disrupted({"a": "silent"}, 3)
    assert disrupted({"a": "silent", "b": "silent"}, 2)
    assert not disrupted({"a": "silent", "b": "silent"}, 3)
    # Counted with the stale Lease (two "agents", both silent) it would read as a disruption for ever.
    stale = [lease_body("live", "ns", 0.0, 30), lease_body("removed", "ns", 0.0, 30)]
    silent = silent_agents(stale, 1000.0)
    assert disrupted(silent, len(stale))
    agents = agent_leases(stale, {"live"})
    silent = silent_agents(agents, 1000.0)
    assert list(silent) == ["live"] and not disrupted(silent, len(agents))


def test_an_answer_already_written_is_an_answer_whoever_wrote_it() -> None:
    """The guarded write (kube/apicalls.py ``put_device_status`` with ``unless``) refuses an entry that
    carries the binding condition or the failure condition True: the agent's ready stays, the operator's
    failed stays."""
    types = (BINDING_READY, BINDING_FAILED)
    ready = {"conditions": [{"type": BINDING_READY, "status": "True"}]}
    failed = {"conditions": [{"type": BINDING_FAILED, "status": "True"}]}
    data_only = {"data": {"migUUID": "MIG-1"}}
    not_yet = {"conditions": [{"type": BINDING_READY, "status": "False"}]}
    other = {"conditions": [{"type": "Something", "status": "True"}]}
    assert answered(ready, types) and answered(failed, types)
    assert not any(answered(e, types) for e in (None, {}, data_only, not_yet, other))
    assert not answered(ready, ())
