"""The lag proxy between kube-scheduler and the API server (devcluster/lagproxy.py), on a real API server.

Real: etcd, kube-apiserver, kube-scheduler (its informers go through the proxy), kube-controller-manager.
The watches read here go through the same proxy, as the scheduler's identity: a held resource's events
arrive late by the lag and in order, another resource's at once; a dropped watch ends with 410 Expired and
the real scheduler lists again; a nomination write is stalled or refused while other status writes pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from dynamig.devcluster import eventually
from dynamig.devcluster.lagproxy import LaggingCluster
from dynamig.devcluster.rest import RestClient

pytestmark = pytest.mark.controlplane

LAG_S = 3.0


def _namespace(api: RestClient) -> str:
    name = f"lagproxy-{uuid.uuid4().hex[:8]}"
    api.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    with contextlib.suppress(Exception):  # pod admission needs it; the controller may be first
        api.request("POST", f"/api/v1/namespaces/{name}/serviceaccounts", {"metadata": {"name": "default"}})
    return name


def _pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        # Pinned to a node that does not exist: the scheduler leaves it alone.
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "nowhere"},
            "containers": [{"name": "main", "image": "example.invalid/app:1"}],
        },
    }


class _Reader:
    """One watch through the proxy; each event with the time it arrived here."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url
        self.got: list[tuple[float, dict[str, Any]]] = []
        self.ended = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            async with self.session.get(self.url) as resp:
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    if line.strip():
                        self.got.append((time.monotonic(), json.loads(line)))
        finally:
            self.ended.set()

    def names(self, kind: str = "ADDED") -> list[str]:
        return [ev["object"]["metadata"]["name"] for _, ev in self.got if ev["type"] == kind]

    def arrived(self, name: str) -> float | None:
        return next((t for t, ev in self.got if ev["object"].get("metadata", {}).get("name") == name), None)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, AssertionError, aiohttp.ClientError):
            await self.task


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        yield s


async def test_events_of_a_held_resource_arrive_late_by_the_lag_in_order_and_others_at_once(
    lagging_cluster: LaggingCluster, session: aiohttp.ClientSession
) -> None:
    cp, proxy = lagging_cluster
    api = cp.rest()
    ns = _namespace(api)
    node = f"lagproxy-node-{uuid.uuid4().hex[:6]}"
    pods_rv = api.request("GET", f"/api/v1/namespaces/{ns}/pods")["metadata"]["resourceVersion"]
    nodes_rv = api.request("GET", "/api/v1/nodes")["metadata"]["resourceVersion"]
    proxy.hold("pods", LAG_S)
    pods = _Reader(session, f"{proxy.url}/api/v1/namespaces/{ns}/pods?watch=true&resourceVersion={pods_rv}")
    nodes = _Reader(
        session,
        f"{proxy.url}/api/v1/nodes?watch=1&resourceVersion={nodes_rv}&fieldSelector=metadata.name={node}",
    )
    try:
        await eventually(lambda: _open(proxy, "pods", "nodes"), "both watches open through the proxy", 10)
        t0 = time.monotonic()
        names = [f"p{i}" for i in range(3)]
        for name in names:
            await asyncio.to_thread(api.request, "POST", f"/api/v1/namespaces/{ns}/pods", _pod(name))
        await asyncio.to_thread(cp.register_node, node)

        node_at = await eventually(lambda: _async(nodes.arrived(node)), "the node's event", 10)
        assert node_at - t0 < 1.5, node_at - t0  # not held
        assert pods.names() == []  # held: none of the pods yet
        await eventually(lambda: _async(True if len(pods.names()) == 3 else None), "the pods' events", 15)
        assert pods.names() == names  # in the order the API server sent them
        for name in names:
            at = pods.arrived(name)
            assert at is not None
            assert at - t0 >= LAG_S - 0.2, (name, at - t0)
        for _, ev in pods.got:  # what went through is on record, by name and resourceVersion
            meta = ev["object"]["metadata"]
            assert proxy.delivered("pods", meta["name"], meta["resourceVersion"])
            assert not proxy.delivered("pods", meta["name"], str(int(meta["resourceVersion"]) + 1000))
        held = [d for d in proxy.events if d.resource == "pods" and d.name in names and d.type != "LIST"]
        assert held and all(d.delivered - d.received >= LAG_S - 0.05 for d in held), held

        # reset() lets out what a watch still holds at once, and the watch stays open (no re-list)
        proxy.hold("pods", 60)
        t1 = time.monotonic()
        await asyncio.to_thread(api.request, "POST", f"/api/v1/namespaces/{ns}/pods", _pod("late"))
        await asyncio.sleep(1.0)
        assert pods.arrived("late") is None
        proxy.reset()
        at = await eventually(lambda: _async(pods.arrived("late")), "the held event after reset", 5)
        assert at is not None and at - t1 < 3.0 and not pods.ended.is_set()
        assert [ev["type"] for _, ev in pods.got if ev["type"] == "ERROR"] == []
    finally:
        await pods.close()
        await nodes.close()
        with contextlib.suppress(Exception):
            api.request("DELETE", f"/api/v1/namespaces/{ns}")
            cp.delete_node(node)


async def test_a_dropped_watch_ends_with_410_expired_and_the_real_scheduler_lists_again(
    lagging_cluster: LaggingCluster, session: aiohttp.ClientSession
) -> None:
    cp, proxy = lagging_cluster
    # kube-scheduler watches ResourceSlices through the proxy (its DRA plugin's informer).
    await eventually(lambda: _open(proxy, "resourceslices"), "the scheduler's ResourceSlice watch", 30)
    rv = cp.rest().request("GET", "/api/v1/nodes")["metadata"]["resourceVersion"]
    mine = _Reader(session, f"{proxy.url}/api/v1/nodes?watch=true&resourceVersion={rv}")
    try:
        await eventually(
            lambda: _async(True if proxy.open_watches("nodes") >= 2 else None), "my node watch", 10
        )
        t0 = time.monotonic()
        assert proxy.drop("nodes") >= 2  # mine and the scheduler's
        assert proxy.drop("resourceslices") >= 1
        await asyncio.wait_for(mine.ended.wait(), 10)
        (last,) = [ev for _, ev in mine.got if ev["type"] == "ERROR"]
        assert last["object"]["code"] == 410 and last["object"]["reason"] == "Expired"

        def relisted(resource: str) -> bool | None:
            # A list, or a watch-list (sendInitialEvents): client-go's answer to 410, not a plain re-watch.
            again = [
                s for s in proxy.seen(resource, since=t0)
                if s.method == "GET" and (not s.watch or "sendInitialEvents=true" in s.query)
            ]  # fmt: skip
            return True if again else None

        await eventually(lambda: _async(relisted("resourceslices")), "the scheduler listing slices again", 30)
        await eventually(lambda: _async(relisted("nodes")), "the scheduler listing nodes again", 30)
        # and it watches again, through the proxy
        await eventually(lambda: _open(proxy, "resourceslices"), "the scheduler's new slice watch", 30)
    finally:
        await mine.close()


async def test_a_nomination_write_is_stalled_or_refused_and_other_status_writes_pass(
    lagging_cluster: LaggingCluster, session: aiohttp.ClientSession
) -> None:
    cp, proxy = lagging_cluster
    api = cp.rest()
    ns = _namespace(api)
    try:
        api.request("POST", f"/api/v1/namespaces/{ns}/pods", _pod("p"))
        url = f"{proxy.url}/api/v1/namespaces/{ns}/pods/p/status"
        merge = {"Content-Type": "application/merge-patch+json"}

        async def patch(body: dict[str, Any]) -> tuple[int, float]:
            t = time.monotonic()
            async with session.patch(url, data=json.dumps(body), headers=merge) as resp:
                await resp.read()
                return resp.status, time.monotonic() - t

        def nominated() -> str | None:
            got: str | None = api.request("GET", f"/api/v1/namespaces/{ns}/pods/p")["status"].get(
                "nominatedNodeName"
            )
            return got

        proxy.fail_nominations(500)
        status, _ = await patch({"status": {"nominatedNodeName": "n1"}})
        assert status == 500 and nominated() is None
        other = {"status": {"conditions": [{"type": "Example", "status": "True"}]}}
        status, _ = await patch(other)
        assert status == 200  # a status write without a nomination is forwarded

        proxy.fail_nominations(None)
        proxy.stall_nominations(2.0)
        status, took = await patch({"status": {"nominatedNodeName": "n1"}})
        assert status == 200 and took >= 2.0 and nominated() == "n1"
        assert [p for _, p in proxy.nominations].count(f"/api/v1/namespaces/{ns}/pods/p/status") == 2
    finally:
        with contextlib.suppress(Exception):
            api.request("DELETE", f"/api/v1/namespaces/{ns}/pods/p?gracePeriodSeconds=0")
            api.request("DELETE", f"/api/v1/namespaces/{ns}")


async def _open(proxy: Any, *resources: str) -> bool | None:
    return True if all(proxy.open_watches(r) for r in resources) else None


async def _async(value: Any) -> Any:
    return value
