"""What the agent does with a pod whose device on its node stays unpreparable (kube/pods.py ``verdict``):
deleted for its controller only when a controller owns it and none of its containers ever started; an Event
alone for a pod no controller owns; nothing for a started pod, another node's, or one already going. Pure."""

from __future__ import annotations

from typing import Any

import pytest

from dynamig.kube.pods import verdict

OWNER = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9", "uid": "u1", "controller": True}


def pod(node: str = "gpu-a", owners: tuple[dict[str, Any], ...] = (OWNER,), **status: Any) -> dict[str, Any]:
    return {"metadata": {"ownerReferences": list(owners)}, "spec": {"nodeName": node}, "status": status}


def test_an_owned_pod_that_never_started_goes_back_to_its_controller() -> None:
    assert verdict(pod(), "gpu-a") == ("delete", "ReplicaSet web-7d9")
    waiting = [{"name": "app", "state": {"waiting": {"reason": "ContainerCreating"}}, "restartCount": 0}]
    assert verdict(pod(containerStatuses=waiting), "gpu-a")[0] == "delete"


def test_a_pod_no_controller_owns_is_only_told() -> None:
    action, why = verdict(pod(owners=({**OWNER, "controller": False},)), "gpu-a")
    assert action == "event" and "delete it" in why
    assert verdict(pod(owners=()), "gpu-a")[0] == "event"


@pytest.mark.parametrize(
    "status",
    [
        {"containerStatuses": [{"name": "app", "state": {"running": {}}}]},
        {"containerStatuses": [{"name": "app", "state": {"terminated": {"exitCode": 1}}}]},
        {"containerStatuses": [{"name": "app", "state": {"waiting": {}}, "restartCount": 2}]},
        {"initContainerStatuses": [{"name": "init", "started": True, "state": {"waiting": {}}}]},
    ],
)
def test_a_pod_that_ever_started_is_never_deleted_here(status: dict[str, Any]) -> None:
    action, why = verdict(pod(**status), "gpu-a")
    assert action == "leave" and "has started" in why


def test_another_nodes_pod_or_one_already_going_is_left_alone() -> None:
    assert verdict(pod(node="gpu-b"), "gpu-a")[0] == "leave"
    going = pod()
    going["metadata"]["deletionTimestamp"] = "2026-12-04T16:00:00Z"
    assert verdict(going, "gpu-a") == ("leave", "already being deleted")
