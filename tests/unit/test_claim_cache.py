"""The agent's ResourceClaim cache bookkeeping (``dynamig.agent.kube.claims``) without a server: which watch
events wake the agent, where the next watch resumes. Against the real API server: tests/integration."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dynamig.agent.kube.claims import ClaimCache


def _claim(name: str, pool: str | None, version: str) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if pool is not None:
        results = [{"request": "gpu", "driver": "mig.dynamig.io", "pool": pool, "device": "d"}]
        status = {"allocation": {"devices": {"results": results}}}
    return {"metadata": {"namespace": "ns", "name": name, "resourceVersion": version}, "status": status}


def test_claim_cache_wakes_for_claims_entering_or_leaving_its_pool_only() -> None:
    wakes: list[str] = []
    unused = SimpleNamespace(
        custom=SimpleNamespace(list_cluster_custom_object=None)
    )  # nothing is listed here
    cache = ClaimCache(unused, "mig.dynamig.io", "node-a", lambda: wakes.append("wake"))  # type: ignore[arg-type]
    cache.synced.set()
    cache.apply("ADDED", _claim("a", None, "1"))
    cache.apply("MODIFIED", _claim("a", "node-b", "2"))  # allocated elsewhere
    assert wakes == []
    cache.apply("MODIFIED", _claim("a", "node-a", "3"))  # allocated here
    cache.apply("MODIFIED", _claim("a", None, "4"))  # deallocated: it was here
    cache.apply("ADDED", _claim("b", "node-a", "5"))
    cache.apply("DELETED", _claim("b", "node-a", "6"))
    assert len(wakes) == 4
    cache.apply("BOOKMARK", {"metadata": {"resourceVersion": "9"}})
    assert cache._resource_version == "9"  # where the next watch resumes
    assert [c["metadata"]["name"] for c in cache.claims() or []] == ["a"]


def test_pods_by_claim_reads_the_reservations() -> None:
    from dynamig.agent.publishing.gpu_status import pods_by_claim

    claim = _claim("c", "node-a", "1")
    claim["status"]["reservedFor"] = [
        {"resource": "pods", "name": "p1", "uid": "u1"},
        {"apiGroup": "batch", "resource": "jobs", "name": "j", "uid": "u2"},
    ]
    assert pods_by_claim([claim, _claim("d", "node-a", "2")]) == {"ns/c": ["p1"]}
