"""Which pods the operator gives back for a fenced node, and when (operator/fencing.py ``stranded_pods``,
``to_give_back``): pods bound to the node through a claim of its pool, that never started, once the node has
been fenced for the bound. Pure: pods and claims as the API server returns them, no API."""

from __future__ import annotations

from typing import Any

from dynamig.operator.fencing import stranded_pods, to_give_back

DRIVER = "mig.dynamig.io"
OWNER = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9", "uid": "rs", "controller": True}


def pod(name: str, node: str = "a", owned: bool = True, ns: str = "ns", **status: Any) -> dict[str, Any]:
    meta = {"name": name, "namespace": ns, "uid": f"uid-{name}", "ownerReferences": [OWNER] if owned else []}
    return {"metadata": meta, "spec": {"nodeName": node}, "status": status}


def claim(name: str, pool: str, users: list[str], driver: str = DRIVER, ns: str = "ns") -> dict[str, Any]:
    result = {"driver": driver, "pool": pool, "device": "gpu0-1g10gb-s0", "request": "gpu"}
    reserved = [{"resource": "pods", "name": u, "uid": f"uid-{u}"} for u in users]
    return {
        "metadata": {"name": name, "namespace": ns, "uid": f"claim-{name}"},
        "status": {"allocation": {"devices": {"results": [result]}}, "reservedFor": reserved},
    }


def test_pods_bound_through_a_claim_of_the_nodes_pool_that_never_started() -> None:
    started: dict[str, Any] = {"containerStatuses": [{"name": "app", "state": {"running": {}}}]}
    going = pod("going")
    going["metadata"]["deletionTimestamp"] = "2026-12-04T16:00:00Z"
    pods = [
        pod("owned"),
        pod("unowned", owned=False),
        pod("started", **started),
        going,
        pod("elsewhere", node="b"),  # its claim is of a's pool, but the pod is bound to b
        pod("no-claim"),  # bound to a, no claim of a's pool reserved for it
        pod("other-driver"),
        pod("other-pool"),
        pod("other-ns", ns="ns2"),  # a claim in ns reserved for a uid of the same name: not its claim
    ]
    claims = [
        claim("c-owned", "a", ["owned", "started", "going"]),
        claim("c-unowned", "a", ["unowned", "elsewhere"]),
        claim("c-other-driver", "a", ["other-driver"], driver="gpu.nvidia.com"),
        claim("c-other-pool", "b", ["other-pool"]),
        claim("c-other-ns", "a", ["other-ns"]),
    ]
    got = {
        (p.namespace, p.name): (p.action, p.detail, p.claims)
        for p in stranded_pods("a", pods, claims, DRIVER)
    }
    assert got == {
        ("ns", "owned"): ("delete", "ReplicaSet web-7d9", ("c-owned",)),
        ("ns", "unowned"): (
            "event",
            "no controller owns it: delete it to have it scheduled again",
            ("c-unowned",),
        ),
    }


def test_a_claim_that_is_not_reserved_for_the_pod_does_not_strand_it() -> None:
    unreserved = claim("c1", "a", [])
    assert stranded_pods("a", [pod("p")], [unreserved], DRIVER) == []


def test_pods_are_given_back_only_once_their_node_has_been_fenced_for_the_bound() -> None:
    pods = [pod("on-a"), pod("on-b", node="b")]
    claims = [claim("ca", "a", ["on-a"]), claim("cb", "b", ["on-b"])]
    fenced = {"a": 100.0, "b": 130.0}
    assert to_give_back(fenced, 159.9, 60.0, pods, claims, DRIVER) == []
    assert [p.name for p in to_give_back(fenced, 160.0, 60.0, pods, claims, DRIVER)] == ["on-a"]
    assert [p.name for p in to_give_back(fenced, 190.0, 60.0, pods, claims, DRIVER)] == ["on-a", "on-b"]
    assert to_give_back({}, 1000.0, 60.0, pods, claims, DRIVER) == []  # no node fenced: nothing
