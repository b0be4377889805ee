"""The node agent's copy of the cluster's ResourceClaims (a :class:`~dynamig.agent.kube.cache.WatchedList`).

ResourceClaims cannot be selected by node on the server, so each agent sees every claim's changes. What
keeps an agent's API cost independent of the cluster's size is what it does with them: rounds read this
copy instead of listing every claim again, and only a change to a claim allocated a device of this node's
pool (before or after the change) wakes the agent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dynamig.agent.kube.api import RESOURCE_GROUP, RESOURCE_VERSION, KubeApi, allocated_devices
from dynamig.agent.kube.cache import Source, WatchedList


def allocated_on(claim: dict[str, Any] | None, driver: str, pool: str) -> bool:
    """True when the claim's allocation names a device of ``driver`` in ``pool``. Pure."""
    return claim is not None and bool(allocated_devices([claim], driver, pool))


class ClaimCache(WatchedList):
    """Every ResourceClaim; ``on_change`` is called for changes to claims allocated on this node's pool (the
    agent's pool is named after its node)."""

    def __init__(self, api: KubeApi, driver: str, node: str, on_change: Callable[[], None]) -> None:
        def matters(old: dict[str, Any] | None, new: dict[str, Any] | None) -> bool:
            return allocated_on(old, driver, node) or allocated_on(new, driver, node)

        source = Source(
            "resourceclaims",
            api.custom.list_cluster_custom_object,
            (RESOURCE_GROUP, RESOURCE_VERSION, "resourceclaims"),
        )
        super().__init__(source, dict, on_change, matters)

    def claims(self) -> list[dict[str, Any]] | None:
        """The claims as last seen, or None before the first LIST finished."""
        return self.items()
