"""Kubernetes Events (core/v1) as dynamig posts them. Pure builders; callers do the I/O."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from dynamig.kube.names import GPU_PARTITION_KIND, GROUP_VERSION

MAX_MESSAGE = 1024
AGENT_COMPONENT = "dynamig-agent"
OPERATOR_COMPONENT = "dynamig-operator"


def event_body(
    involved: Mapping[str, Any],
    event_type: str,
    reason: str,
    message: str,
    namespace: str,
    component: str,
    now: str,
    instance: str = "",
) -> dict[str, Any]:
    """A core/v1 Event about ``involved`` (apiVersion, kind, name, namespace, uid). ``kubectl describe`` finds
    an object's Events by its uid, so callers pass it. Pure but for the random name suffix."""
    name = f"{involved.get('name', 'object')}.{uuid.uuid4().hex[:16]}"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name[:253], "namespace": namespace},
        "involvedObject": {k: v for k, v in involved.items() if v},
        "type": event_type,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "source": {"component": component, **({"host": instance} if instance else {})},
        "reportingComponent": component,
        "reportingInstance": instance or component,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def gpu_partition_ref(name: str, uid: str | None) -> dict[str, Any]:
    """The involvedObject of an Event about GpuPartition ``name``. Pure."""
    return {"apiVersion": GROUP_VERSION, "kind": GPU_PARTITION_KIND, "name": name, "uid": uid}
