"""Waiting for the cluster to reach a state: the one polling helper scenarios and tests share, and the waits
for an Event (through the API, through ``kubectl describe``) built on it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from kubernetes_asyncio import client

    from dynamig.devcluster.controlplane import ControlPlane

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T | None]], what: str, within_s: float = 60.0, every_s: float = 0.1
) -> T:
    """Await ``probe`` every ``every_s`` until it returns something other than None; TimeoutError naming
    ``what`` after ``within_s``. Side effects: only the probe's."""
    deadline = time.monotonic() + within_s
    while True:
        value = await probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within_s:.0f}s waiting for {what}")
        await asyncio.sleep(every_s)


async def events_about(core: client.CoreV1Api, namespace: str, name: str) -> list[dict[str, Any]]:
    """The core/v1 Events in ``namespace`` about the object named ``name`` (any kind), each as ``reason``,
    ``message``, ``type``, ``kind`` (the involved object's) and ``count``, in the order the API server lists
    them."""
    got = await core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
    return [
        {
            "reason": e.reason,
            "message": e.message or "",
            "type": e.type,
            "kind": e.involved_object.kind,
            "count": e.count,
        }
        for e in got.items
    ]


async def event_posted(
    core: client.CoreV1Api,
    namespace: str,
    name: str,
    *reasons: str,
    event_type: str | None = None,
    saying: Sequence[str] = (),
    beyond: int = 0,
    within_s: float = 60.0,
) -> list[dict[str, Any]]:
    """Wait for an Event in ``namespace`` about ``name`` whose reason is one of ``reasons``, of ``event_type``
    when given, whose message holds each of ``saying``: more than ``beyond`` of them in all, a repeat counted
    on its Event (``count``) as one more; returns every such Event (:func:`events_about`'s form), at least
    one. Events are posted after the change they tell of, by another process or task: a test that has seen
    a condition, a status or a deletion must still wait for the Event about it. After ``within_s`` a
    TimeoutError lists the Events about ``name`` last seen."""
    seen: list[dict[str, Any]] = []

    async def probe() -> list[dict[str, Any]] | None:
        seen[:] = await events_about(core, namespace, name)
        found = [
            e
            for e in seen
            if e["reason"] in reasons
            and (event_type is None or e["type"] == event_type)
            and all(s in e["message"] for s in saying)
        ]
        return found if sum(e["count"] or 1 for e in found) > beyond else None

    what = f"{event_type or 'an'} Event {' or '.join(reasons)} about {name} in {namespace}" + (
        f" saying {list(saying)}" if saying else ""
    )
    what += f", more than {beyond} in all" if beyond else ""
    try:
        return await eventually(probe, what, within_s=within_s, every_s=0.2)
    except TimeoutError as exc:
        told = [(e["type"], e["reason"], e["message"]) for e in seen]
        raise TimeoutError(f"{exc}; the Events about {name} then: {told}") from None


async def described(
    cp: ControlPlane,
    kind: str,
    name: str | Sequence[str],
    *texts: str,
    namespace: str | None = None,
    within_s: float = 60.0,
) -> str:
    """``kubectl describe`` of the ``kind`` ``name`` (or of several, their outputs one after the other) once
    that output holds each of ``texts``; the output. What it shows of an object's Events comes after the
    change they tell of: a test that has seen the change waits for them here. Each object is described on
    its own (kubectl shows no Events when it describes several at once). After ``within_s`` a TimeoutError
    with the output last seen."""
    names = [name] if isinstance(name, str) else list(name)
    where = ["-n", namespace] if namespace else []
    last = [""]

    async def probe() -> str | None:
        outs = [await asyncio.to_thread(cp.kubectl, "describe", kind, n, *where) for n in names]
        last[0] = "\n".join(out.stdout for out in outs)
        return last[0] if all(t in last[0] for t in texts) else None

    what = f"kubectl describe {kind} {' '.join(names)} showing {list(texts)}"
    try:
        return await eventually(probe, what, within_s, 0.5)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; it showed:\n{last[0]}") from None
