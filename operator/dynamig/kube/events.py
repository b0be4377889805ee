"""Kubernetes Events (core/v1) as dynamig posts them: builders, and the repeat folding both agent and operator
use. Callers pass the API calls."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dynamig.kube.names import GPU_PARTITION_KIND, GROUP_VERSION

MAX_MESSAGE = 1024
# Like client-go's event correlator: an Event repeated within this window becomes count+1 on the first one
# (`kubectl describe` shows "(x4 over 3m)") instead of a new object per round.
REPEAT_WINDOW_S = 600.0
REMEMBERED_EVENTS = 4096
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


def claim_ref(namespace: str, name: str, uid: str | None) -> dict[str, Any]:
    """The involvedObject of an Event about a ResourceClaim. Pure."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "namespace": namespace, "name": name,
            "uid": uid}  # fmt: skip


@dataclass(frozen=True)
class EventWrite:
    """What to send for one Event: a create of ``body``, or a merge patch of the earlier Event ``name``."""

    body: dict[str, Any]
    name: str = ""
    patch: dict[str, Any] | None = None


@dataclass
class _Seen:
    name: str
    count: int
    first_s: float


class EventCorrelator:
    """Folds repeats of the same Event (same object, type, reason, message and source) into one object with a
    count, so a condition that holds for an hour is one Event, not one per round. Remembers the last
    REMEMBERED_EVENTS keys; forgets one whose Event is gone (:meth:`forget`). Pure but for the clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._seen: OrderedDict[tuple[str, ...], _Seen] = OrderedDict()

    @staticmethod
    def key(body: Mapping[str, Any]) -> tuple[str, ...]:
        inv = body["involvedObject"]
        ident = str(inv.get("uid") or f"{inv.get('kind')}/{inv.get('namespace', '')}/{inv.get('name')}")
        namespace = str(body["metadata"]["namespace"])
        source = str(body.get("reportingInstance", ""))
        return (namespace, ident, body["type"], body["reason"], body["message"], source)

    def write_for(self, body: dict[str, Any]) -> EventWrite:
        key = self.key(body)
        now = self.clock()
        seen = self._seen.get(key)
        if seen is None or now - seen.first_s > REPEAT_WINDOW_S:
            self._seen[key] = _Seen(body["metadata"]["name"], 1, now)
            self._seen.move_to_end(key)
            while len(self._seen) > REMEMBERED_EVENTS:
                self._seen.popitem(last=False)
            return EventWrite(body)
        seen.count += 1
        self._seen.move_to_end(key)
        patch = {"count": seen.count, "lastTimestamp": body["lastTimestamp"]}
        return EventWrite(body, seen.name, patch)

    def forget(self, body: Mapping[str, Any]) -> None:
        """The earlier Event is gone (expired by the API server's TTL): the next repeat creates a new one."""
        self._seen.pop(self.key(body), None)


async def deliver(
    correlator: EventCorrelator,
    body: dict[str, Any],
    create: Callable[[dict[str, Any]], Awaitable[object]],
    patch: Callable[[str, dict[str, Any]], Awaitable[bool]],
) -> None:
    """Post ``body``, or count it on its earlier copy. ``patch`` returns False when that copy is gone (the
    API server expires Events after an hour), and a new Event is created instead."""
    write = correlator.write_for(body)
    if write.patch is not None and await patch(write.name, write.patch):
        return
    if write.patch is not None:
        correlator.forget(body)
        correlator.write_for(body)
    await create(body)
