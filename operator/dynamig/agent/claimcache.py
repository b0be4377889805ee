"""The node agent's copy of the cluster's ResourceClaims: one LIST, then a WATCH that keeps it current.

ResourceClaims cannot be selected by node on the server, so each agent sees every claim's changes. What
keeps an agent's API cost independent of the cluster's size is what it does with them: rounds read this
cache instead of listing every claim again, and only a change to a claim allocated a device of this node's
pool (before or after the change) wakes the agent. The watch resumes from the last resourceVersion it saw
(bookmarks keep that fresh); when the server has compacted past it (410 Gone) the cache lists again.

Side effects: one LIST per (re)sync and a long-running WATCH.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio import watch
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.agent.kubeapi import RESOURCE_GROUP, RESOURCE_VERSION, KubeApi, allocated_devices

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300


def allocated_on(claim: dict[str, Any] | None, driver: str, pool: str) -> bool:
    """True when the claim's allocation names a device of ``driver`` in ``pool``. Pure."""
    return claim is not None and bool(allocated_devices([claim], driver, pool))


def _key(claim: dict[str, Any]) -> str:
    meta = claim.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class ClaimCache:
    """Every ResourceClaim, kept current by a watch; ``on_change`` is called for changes to claims allocated
    on this node's pool (the agent's pool is named after its node)."""

    def __init__(self, api: KubeApi, driver: str, node: str, on_change: Callable[[], None]) -> None:
        self._api = api
        self._driver = driver
        self._pool = node
        self._on_change = on_change
        self._claims: dict[str, dict[str, Any]] = {}
        self._resource_version = ""
        self.synced = asyncio.Event()
        self.lists = 0  # LISTs made: one at start, one per lost watch position

    def claims(self) -> list[dict[str, Any]] | None:
        """The claims as last seen, or None before the first LIST finished."""
        return list(self._claims.values()) if self.synced.is_set() else None

    async def relist(self) -> None:
        items, version = await self._api.list_claims_at()
        self.lists += 1
        before = self._claims
        self._claims = {_key(c): c for c in items}
        self._resource_version = version
        if any(
            allocated_on(before.get(k), self._driver, self._pool)
            != allocated_on(self._claims.get(k), self._driver, self._pool)
            for k in before.keys() | self._claims.keys()
        ):
            self._on_change()
        self.synced.set()

    def apply(self, kind: str, claim: dict[str, Any]) -> None:
        """One watch event. Pure but for the cache and the ``on_change`` call."""
        version = (claim.get("metadata") or {}).get("resourceVersion")
        if version:
            self._resource_version = str(version)
        if kind == "BOOKMARK":
            return
        key = _key(claim)
        old = self._claims.get(key)
        if kind == "DELETED":
            self._claims.pop(key, None)
        else:
            self._claims[key] = claim
        if allocated_on(old, self._driver, self._pool) or allocated_on(claim, self._driver, self._pool):
            self._on_change()

    async def run(self, stop: asyncio.Event) -> None:
        """List, then watch until ``stop``; errors back off and resume (or list again after a 410)."""
        backoff = 0.5
        need_list = True
        while not stop.is_set():
            w = watch.Watch()
            try:
                if need_list:
                    await self.relist()
                    need_list = False
                async with w.stream(
                    self._api.custom.list_cluster_custom_object,
                    RESOURCE_GROUP,
                    RESOURCE_VERSION,
                    "resourceclaims",
                    resource_version=self._resource_version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=WATCH_TIMEOUT_S,
                ) as stream:
                    async for event in stream:
                        backoff = 0.5
                        obj = event.get("raw_object") or event.get("object") or {}
                        if event.get("type") == "ERROR":
                            need_list = obj.get("code") == 410
                            log.debug("claim watch error: %s", obj.get("message", obj))
                            break
                        self.apply(str(event.get("type")), obj)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # rounds fall back to listing; say why and resume
                need_list = need_list or (isinstance(exc, ApiException) and exc.status == 410)
                log.debug("claim watch ended (%s); resuming", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                w.stop()
