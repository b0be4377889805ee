"""The agent's copies of the API objects its rounds read, so that a round of an idle node makes no request.

Each :class:`WatchedList` holds one kind under one selector (the Node, the node's GpuPartitions, the node's
ResourceSlices of every driver, every ResourceClaim): one LIST, then a WATCH that resumes from the last
resourceVersion it saw (bookmarks keep that fresh) and lists again only when the server has compacted past it
(410 Gone). A change wakes the agent when ``matters(old, new)`` says so. Rounds fall back to reading the API
while a copy is not synced. What the agent writes is written from fresh reads (the publisher lists its slices
again before changing them), so a copy a moment behind the agent's own write costs a read, never a conflict.

A watch that fails is tried again after a wait that doubles up to
:data:`~dynamig.agent.kube.api.API_RETRY_MAX_S` (2 s), however long the API server stays away. One dropped
stream resumes from its resourceVersion; a second failure in a row means the API server is out of reach,
and the copy is listed again once it answers: that LIST proves it is back (``on_reconnect`` then starts a
round at once, even one the agent's error back-off holds) and replaces what the copy missed.

Side effects: one LIST per (re)sync (at start, after a 410, after an outage) and one long-running WATCH per
copy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio import watch
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.agent.kube.api import API_RETRY_MAX_S, backoff_delay

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300
RETRY_BASE_S = 0.125  # the first retry of a failed watch waits 0.25 s, the next ones double up to 2 s
Obj = dict[str, Any]


def object_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def always(_old: Obj | None, _new: Obj | None) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Source:
    """What to list and watch: a kubernetes-asyncio list function and its arguments."""

    name: str
    list_call: Callable[..., Awaitable[Any]]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


class WatchedList:
    """One kind's objects under one selector, kept current by a watch."""

    def __init__(
        self,
        source: Source,
        to_dict: Callable[[Any], Obj],
        wake: Callable[[], None],
        matters: Callable[[Obj | None, Obj | None], bool] = always,
    ) -> None:
        self.source = source
        self._to_dict = to_dict  # a list answer (a model or a dict) as a plain dict
        self._wake = wake
        self._matters = matters
        self._objects: dict[str, Obj] = {}
        self._resource_version = ""
        self.synced = asyncio.Event()
        self.lists = 0  # LISTs made: one at start, one per lost watch position or outage
        self.failures = 0  # requests (LIST or WATCH) failed in a row
        # Called when a LIST succeeds after the API server was out of reach (None: ``wake`` is).
        self.on_reconnect: Callable[[], None] | None = None

    def items(self) -> list[Obj] | None:
        """The objects as last seen, or None before the first LIST finished."""
        return list(self._objects.values()) if self.synced.is_set() else None

    async def relist(self) -> None:
        answer = self._to_dict(await self.source.list_call(*self.source.args, **self.source.kwargs))
        self.lists += 1
        before = self._objects
        self._objects = {object_key(o): o for o in answer.get("items") or []}
        self._resource_version = str((answer.get("metadata") or {}).get("resourceVersion", ""))
        if any(
            self._matters(before.get(k), self._objects.get(k)) for k in before.keys() | self._objects.keys()
        ):
            self._wake()
        self.synced.set()

    def apply(self, kind: str, obj: Obj) -> None:
        """One watch event. Pure but for the copy and the ``wake`` call."""
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self._resource_version = str(version)
        if kind == "BOOKMARK":
            return
        key = object_key(obj)
        old = self._objects.get(key)
        if kind == "DELETED":
            self._objects.pop(key, None)
            new = None
        else:
            self._objects[key] = new = obj
        if self._matters(old, new):
            self._wake()

    async def run(self, stop: asyncio.Event) -> None:
        """List, then watch until ``stop``; errors back off (2 s at most) and resume, or list again after a
        410 or an outage."""
        need_list = True
        while not stop.is_set():
            try:
                if need_list:
                    await self.relist()
                    need_list = False
                    if self.failures:
                        self.failures = 0
                        log.info("%s: the API server answers again; listed anew", self.source.name)
                        (self.on_reconnect or self._wake)()
                need_list = await self._watch()
                self.failures = 0  # the server answered, then ended the stream (its timeout, an ERROR)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # rounds read the copy as last seen meanwhile; say why and resume
                log.debug("%s watch ended (%s); resuming", self.source.name, exc)
                if isinstance(exc, ApiException) and exc.status == 410:  # the server answered: list again
                    need_list = True
                    await asyncio.sleep(RETRY_BASE_S)
                    continue
                self.failures += 1
                need_list = need_list or self.failures >= 2
                await asyncio.sleep(backoff_delay(self.failures, RETRY_BASE_S, API_RETRY_MAX_S))

    async def _watch(self) -> bool:
        """One WATCH from the copy's resourceVersion, applied until the server ends it; True when the copy
        must be listed again (410 Gone)."""
        w = watch.Watch()
        try:
            async with w.stream(
                self.source.list_call,
                *self.source.args,
                **self.source.kwargs,
                resource_version=self._resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=WATCH_TIMEOUT_S,
            ) as stream:
                async for event in stream:
                    self.failures = 0
                    obj = event.get("raw_object") or event.get("object") or {}
                    if event.get("type") == "ERROR":
                        log.debug("%s watch error: %s", self.source.name, obj.get("message", obj))
                        return bool(obj.get("code") == 410)
                    self.apply(str(event.get("type")), obj)
        finally:
            w.stop()
        return False
