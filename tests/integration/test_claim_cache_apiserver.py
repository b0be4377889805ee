"""The agent's ResourceClaim cache against the real API server: one LIST, then a watch that keeps it
current; only claims allocated on the agent's pool wake it.

Real: kube-apiserver (ResourceClaim storage, status subresource, watch, bookmarks).
The allocation is written to the claim's status by the test as the scheduler would (admin credentials).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.agent.kube.api import KubeApi
from dynamig.agent.kube.claims import ClaimCache, allocated_on
from dynamig.devcluster import eventually

pytestmark = pytest.mark.controlplane

DRIVER = "mig.dynamig.io"


def claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io"}}]}
        },
    }


def allocation(pool: str) -> dict[str, Any]:
    return {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": pool, "device": "gpu0-1g10gb-s0"}]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pool]}]}
                ]
            },
        }
    }


@pytest.fixture
async def running(kube_api: client.ApiClient) -> AsyncIterator[tuple[ClaimCache, list[int]]]:
    wakes: list[int] = []
    cache = ClaimCache(KubeApi(kube_api), DRIVER, "node-a", lambda: wakes.append(1))
    stop = asyncio.Event()
    task = asyncio.create_task(cache.run(stop))
    await asyncio.wait_for(cache.synced.wait(), 30)
    try:
        yield cache, wakes
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_cache_follows_claims_and_wakes_only_for_its_pool(
    running: tuple[ClaimCache, list[int]], kube_api: client.ApiClient, namespace: str
) -> None:
    cache, wakes = running
    custom = client.CustomObjectsApi(kube_api)
    mine, other = f"mine-{namespace}"[:60], f"other-{namespace}"[:60]
    for name in (mine, other):
        await custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims", claim(name)
        )

    def names() -> set[str]:
        return {
            c["metadata"]["name"] for c in cache.claims() or [] if c["metadata"]["namespace"] == namespace
        }

    async def both_seen() -> bool | None:
        return True if names() == {mine, other} else None

    await eventually(both_seen, "both claims in the cache", within_s=30)
    assert wakes == [], "unallocated claims wake nobody"

    await custom.patch_namespaced_custom_object_status(
        "resource.k8s.io", "v1", namespace, "resourceclaims", other, {"status": allocation("node-b")},
        _content_type="application/merge-patch+json",
    )  # fmt: skip
    await custom.patch_namespaced_custom_object_status(
        "resource.k8s.io", "v1", namespace, "resourceclaims", mine, {"status": allocation("node-a")},
        _content_type="application/merge-patch+json",
    )  # fmt: skip

    async def mine_allocated() -> bool | None:
        got = [c for c in cache.claims() or [] if c["metadata"]["name"] == mine]
        return True if got and allocated_on(got[0], DRIVER, "node-a") else None

    await eventually(mine_allocated, "the allocation seen by the cache", within_s=30)
    other_seen = [c for c in cache.claims() or [] if c["metadata"]["name"] == other]
    assert other_seen and allocated_on(other_seen[0], DRIVER, "node-b")
    assert len(wakes) == 1, "only the claim allocated on node-a's pool woke the agent"

    await custom.delete_namespaced_custom_object("resource.k8s.io", "v1", namespace, "resourceclaims", mine)

    async def deleted() -> bool | None:
        return True if names() == {other} else None

    await eventually(deleted, "the deletion seen", within_s=30)
    assert len(wakes) == 2, "deleting a claim allocated on the pool wakes the agent"
    assert cache.lists == 1, "one LIST; the watch did the rest"
