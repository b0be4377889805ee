"""The reconciler's pure parts: a snapshot parsed into a world, claims given to policies, status patches, and
the metrics registry; and what a round writes for GPUs whose agent went silent.

Real: policy/GpuPartition/claim parsing, CEL evaluation of selectors, ownership resolution and the Prometheus
client registry. The snapshot is made of plain dicts shaped like API objects; no API server is involved: a
round talks to :class:`FakeKube`, which records what it is asked to write.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from typing import Any, cast

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig import DRIVER_NAME
from dynamig.devcluster.waiting import eventually
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.heartbeat import lease_body
from dynamig.operator.kubeio import KubeIO, Snapshot
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.policy_status import replacing_keys, status_differs
from dynamig.operator.reconciler import Reconciler
from dynamig.operator.settings import OperatorSettings
from dynamig.operator.world import parse_world

PROFILE = 'device.attributes["mig.dynamig.io"].profile'


def gpu(node: str, index: int, model: str, product: str) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{node}-gpu{index}", "generation": 1},
        "spec": {"layout": []},
        "status": {
            "node": node, "gpuIndex": index, "model": model, "product": product, "migMode": "Enabled",
            "observedGeneration": 1, "phase": "Stable", "instances": [],
        },
    }  # fmt: skip


def policy(name: str, created: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": created}, "spec": spec}


def pending(name: str, profile: str, node: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    claim = {
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io",
            "selectors": [{"cel": {"expression": f'{PROFILE} == "{profile}"'}}]}}]}},
    }  # fmt: skip
    pod_spec: dict[str, Any] = {"resourceClaims": [{"name": "gpu", "resourceClaimName": name}]}
    if node:
        pod_spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    pod = {
        "metadata": {"name": name, "namespace": "ns", "uid": f"p-{name}"},
        "spec": pod_spec,
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
    }
    return claim, pod


def snapshot() -> Snapshot:
    c1, p1 = pending("small-a100", "1g.10gb")
    c2, p2 = pending("small-h100", "1g.20gb", node="h")  # 1g.20gb: A100-80GB and H100 both have it
    c3, p3 = pending("nowhere", "9g.1tb")
    return Snapshot(
        policies=(
            policy("hopper", "2026-01-01T00:00:00Z", gpuProducts=["H100-80GB"]),
            policy("ampere", "2026-02-01T00:00:00Z", gpuProducts=["A100-80GB"]),
            policy("everything", "2026-03-01T00:00:00Z"),
        ),
        partitions=(
            gpu("a", 0, "A100-80GB", "NVIDIA A100-SXM4-80GB"),
            gpu("h", 0, "H100-80GB", "NVIDIA H100 80GB HBM3"),
        ),
        nodes=(
            {"metadata": {"name": "a", "labels": {"kubernetes.io/hostname": "a"}}},
            {"metadata": {"name": "h", "labels": {"kubernetes.io/hostname": "h"}}},
        ),
        pods=(p1, p2, p3),
        claims=(c1, c2, c3),
        device_classes=(
            {
                "metadata": {"name": "mig.dynamig.io"},
                "spec": {"selectors": [{"cel": {"expression": 'device.driver == "mig.dynamig.io"'}}]},
            },
        ),
    )


def test_claims_go_to_the_first_policy_that_can_serve_them() -> None:
    world = parse_world(snapshot(), load_catalog())
    assert world.ownership.owner == {"a-gpu0": "ampere", "h-gpu0": "hopper"}
    assert world.ownership.lost["everything"] == {"a-gpu0": "ampere", "h-gpu0": "hopper"}
    # 1g.10gb exists on both models and the pod may go anywhere: the oldest policy that can serve it wins
    assert world.claim_owner["ns/small-a100"] == "hopper"
    # pinned to node h by its pod's node selector: the H100 policy
    assert world.claim_owner["ns/small-h100"] == "hopper"
    # nobody can serve it: the oldest policy reports why
    assert world.claim_owner["ns/nowhere"] == "hopper"
    assert {c.claim.key for c in world.pending} == {"ns/small-a100", "ns/small-h100", "ns/nowhere"}


def test_claim_pinned_to_a_node_goes_to_the_policy_governing_that_node() -> None:
    snap = snapshot()
    c4, p4 = pending("on-a", "1g.10gb+me", node="a")
    snap = Snapshot(snap.policies, snap.partitions, snap.nodes, (*snap.pods, p4), (*snap.claims, c4),
                    snap.device_classes)  # fmt: skip
    world = parse_world(snap, load_catalog())
    assert world.claim_owner["ns/on-a"] == "ampere"


def test_merge_patch_of_a_map_names_keys_to_drop() -> None:
    assert replacing_keys({"NoCapacity": 2, "ReshapeScheduled": 1}, {"ReshapeScheduled": 3}) == {
        "NoCapacity": None,
        "ReshapeScheduled": 3,
    }
    assert replacing_keys(None, {}) == {}


def test_status_difference_ignores_condition_times_and_empty_lists() -> None:
    cond = {"type": "Valid", "status": "True", "reason": "Valid", "message": "ok", "observedGeneration": 1}
    old = {"matchedGpus": 2, "conditions": [{**cond, "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    same = {
        "matchedGpus": 2,
        "lostGpus": [],
        "conditions": [{**cond, "lastTransitionTime": "2026-06-01T00:00:00Z"}],
    }
    assert not status_differs(old, same)
    assert status_differs(old, {**same, "matchedGpus": 3})
    assert status_differs(old, {**same, "conditions": [{**cond, "status": "False"}]})


def test_metrics_series_are_replaced_and_forgotten() -> None:
    m = OperatorMetrics()
    m.set_pending("p", {("1g.10gb", "NoCapacity"): 3})
    m.set_pending("p", {("2g.20gb", "ReshapeScheduled"): 1})
    r = m.registry
    gone = {"policy": "p", "profile": "1g.10gb", "reason": "NoCapacity"}
    now = {"policy": "p", "profile": "2g.20gb", "reason": "ReshapeScheduled"}
    assert r.get_sample_value("dynamig_operator_pending_devices", gone) is None
    assert r.get_sample_value("dynamig_operator_pending_devices", now) == 1
    m.set_governed("p", 4, 42.5)
    assert r.get_sample_value("dynamig_operator_oldest_pending_claim_age_seconds", {"policy": "p"}) == 42.5
    m.forget_policy("p")
    assert r.get_sample_value("dynamig_operator_governed_gpus", {"policy": "p"}) is None
    assert r.get_sample_value("dynamig_operator_oldest_pending_claim_age_seconds", {"policy": "p"}) is None
    assert r.get_sample_value("dynamig_operator_build_info", {"version": "0.1.0"}) == 1


class FakeKube:
    """The KubeIO calls a round makes, answered from one snapshot; writes are recorded."""

    def __init__(
        self, snap: Snapshot, slices: tuple[dict[str, Any], ...] = (), patch_errors: int = 0
    ) -> None:
        self.snap = snap
        self.slices = slices
        self.patch_errors = patch_errors  # this many condition patches fail (an API server error)
        self.conditions: dict[str, list[dict[str, Any]]] = {}
        self.events: list[tuple[dict[str, Any], str, str]] = []  # (involvedObject, type, reason)
        self.deleted: list[str] = []  # ResourceSlices withdrawn

    async def snapshot(self, lease_namespace: str | None = None) -> Snapshot:
        return self.snap

    async def patch_partition_conditions(self, name: str, conditions: list[dict[str, Any]]) -> None:
        if self.patch_errors:
            self.patch_errors -= 1
            raise ApiException(status=500, reason="Internal Server Error")
        self.conditions[name] = conditions

    async def post_event(
        self, involved: Mapping[str, Any], event_type: str, reason: str, message: str, namespace: str
    ) -> None:
        self.events.append((dict(involved), event_type, reason))

    async def list_node_slices(self, node: str) -> tuple[dict[str, Any], ...]:
        return tuple(s for s in self.slices if s["spec"]["nodeName"] == node)

    async def delete_slice(self, name: str) -> None:
        self.deleted.append(name)

    async def put_device_status(self, namespace: str, name: str, entry: dict[str, Any]) -> bool:
        return True

    async def write_spec(self, name: str, spec: Any, annotations: Any, rv: str) -> dict[str, Any]:
        return {"metadata": {"generation": 2}}

    async def patch_policy_status(self, name: str, status: Mapping[str, Any]) -> None:
        pass

    async def write_device_classes(self, changes: Any) -> None:
        pass

    async def serves_taint_rules(self) -> bool:  # as Kubernetes 1.36 and older, by default
        return False


def silent_node_snapshot() -> Snapshot:
    """Node ``a``: an A100 that policy ``ampere`` governs and an H100 no policy governs, both Ready, and an
    agent whose Lease ran out ten minutes ago."""
    parts = []
    for index, model, product in (
        (0, "A100-80GB", "NVIDIA A100-SXM4-80GB"),
        (1, "H100-80GB", "NVIDIA H100 80GB HBM3"),
    ):
        part = gpu("a", index, model, product)
        part["metadata"]["uid"] = f"uid-a-gpu{index}"
        part["status"]["conditions"] = [
            {"type": "Ready", "status": "True", "reason": "LayoutApplied", "message": "ok",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
        ]  # fmt: skip
        parts.append(part)
    return Snapshot(
        policies=(policy("ampere", "2026-02-01T00:00:00Z", gpuProducts=["A100-80GB"]),),
        partitions=tuple(parts),
        nodes=({"metadata": {"name": "a", "uid": "uid-node-a", "labels": {"kubernetes.io/hostname": "a"}}},),
        pods=(),
        claims=(),
        device_classes=(),
        leases=(lease_body("a", "default", time.time() - 600, 30),),
    )


class Wall:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def reconciler(kube: FakeKube, wall: Wall | None = None, **settings: Any) -> Reconciler:
    return Reconciler(
        cast(KubeIO, kube), load_catalog(), OperatorMetrics(), OperatorSettings(**settings),
        wall=wall or Wall(),
    )  # fmt: skip


async def silent_reconciler(kube: FakeKube) -> Reconciler:
    """A reconciler that saw node a's Lease once, a minute ago (renewals are dated when they are seen: a
    reader that just started gives every Lease one duration), so a's agent now counts as silent."""
    wall = Wall()
    rec = reconciler(kube, wall)
    await rec.round("ampere")
    assert not [e for e in kube.events if e[2] == "AgentSilent"] and kube.deleted == []
    wall.t += 60
    return rec


async def test_silent_agent_events_carry_the_uid_of_their_object() -> None:
    # kubectl describe finds an object's Events by its uid: the first round that finds it silent knows them.
    node_slice = {"metadata": {"name": "a-mig-0"}, "spec": {"driver": DRIVER_NAME, "nodeName": "a"}}
    kube = FakeKube(silent_node_snapshot(), slices=(node_slice,))
    await (await silent_reconciler(kube)).round("ampere")
    silent = [(ref, kind) for ref, kind, reason in kube.events if reason == "AgentSilent"]
    assert sorted((ref["kind"], ref["name"], ref.get("uid")) for ref, _ in silent) == [
        ("GpuPartition", "a-gpu0", "uid-a-gpu0"),
        ("GpuPartition", "a-gpu1", "uid-a-gpu1"),
        ("Node", "a", "uid-node-a"),
    ]
    assert {kind for _, kind in silent} == {"Warning"}


async def test_every_gpu_of_a_silent_node_is_ready_unknown_governed_or_not() -> None:
    world = parse_world(silent_node_snapshot(), load_catalog(), time.time())
    assert world.ownership.owner == {"a-gpu0": "ampere"}  # a-gpu1: no policy governs it
    kube = FakeKube(silent_node_snapshot(), patch_errors=1)
    rec = await silent_reconciler(kube)
    with pytest.raises(ApiException):
        await rec.round("ampere")  # the API server refused the first patch: the loop runs the round again
    await rec.round("ampere")
    assert sorted(kube.conditions) == ["a-gpu0", "a-gpu1"]
    for name, conditions in kube.conditions.items():
        (ready,) = [c for c in conditions if c["type"] == "Ready"]
        assert (ready["status"], ready["reason"]) == ("Unknown", "AgentSilent"), name
        assert "has not renewed its lease" in ready["message"], name


async def test_every_agent_silent_at_once_is_a_disruption_and_no_node_is_withdrawn() -> None:
    """Right after an API server outage no agent has renewed yet: withdrawing every node would only churn
    (kube-controller-manager likewise stops evicting from a fully disrupted zone). One silent agent among live
    ones is still withdrawn."""

    def slices(*nodes: str) -> tuple[dict[str, Any], ...]:
        return tuple(
            {"metadata": {"name": f"{n}-mig-0"}, "spec": {"driver": DRIVER_NAME, "nodeName": n}}
            for n in nodes
        )

    snap = silent_node_snapshot()
    node_b = {"metadata": {"name": "b", "uid": "uid-node-b", "labels": {}}}
    both_silent = dataclasses.replace(
        snap,
        nodes=(*snap.nodes, node_b),
        leases=(*snap.leases, lease_body("b", "default", time.time() - 600, 30)),
    )
    kube = FakeKube(both_silent, slices=slices("a", "b"))
    await (await silent_reconciler(kube)).round("ampere")
    assert kube.deleted == []
    assert not [ref for ref, _, reason in kube.events if reason == "AgentSilent" and ref["kind"] == "Node"]
    wall = Wall()
    kube = FakeKube(dataclasses.replace(both_silent, leases=snap.leases), slices=slices("a", "b"))
    rec = reconciler(kube, wall)
    await rec.round("ampere")
    wall.t += 60
    # b's agent renews (its renewTime moves), a's does not: a alone is silent, and withdrawn.
    renewed = (*snap.leases, lease_body("b", "default", wall.t, 30))
    kube.snap = dataclasses.replace(both_silent, leases=renewed)
    await rec.round("ampere")
    assert kube.deleted == ["a-mig-0"]


async def test_a_stale_lease_of_a_removed_node_neither_hides_nor_is_a_silent_agent() -> None:
    """Node a's agent is dead, and a Lease of node gone (removed, its Lease written before Leases had an
    owner) stays: counted as an agent it would make "every agent silent at once" hold for ever."""
    snap = silent_node_snapshot()
    stale = dataclasses.replace(snap, leases=(*snap.leases, lease_body("gone", "default", 0.0, 30)))
    node_slice = {"metadata": {"name": "a-mig-0"}, "spec": {"driver": DRIVER_NAME, "nodeName": "a"}}
    kube = FakeKube(stale, slices=(node_slice,))
    rec = await silent_reconciler(kube)
    await rec.round("ampere")
    assert kube.deleted == ["a-mig-0"]
    assert rec.metrics.registry.get_sample_value("dynamig_operator_silent_agents") == 1
    assert not [ref for ref, _, reason in kube.events if ref["name"] == "gone"]


class Stop:
    def __init__(self) -> None:
        self.stopped = False

    def is_set(self) -> bool:
        return self.stopped


async def test_the_watchdog_withdraws_a_silent_agents_node_with_no_policy_at_all() -> None:
    snap = dataclasses.replace(silent_node_snapshot(), policies=())
    node_slice = {"metadata": {"name": "a-mig-0"}, "spec": {"driver": DRIVER_NAME, "nodeName": "a"}}
    kube = FakeKube(snap, slices=(node_slice,))
    wall = Wall()
    rec = reconciler(kube, wall, resync_seconds=0.1)
    stop = Stop()
    watchdog = asyncio.create_task(rec.watch_agents(stop))
    try:
        await asyncio.sleep(0.3)  # a few reads: the Lease is seen, and does not run out yet
        assert kube.deleted == []
        wall.t += 60

        async def withdrawn() -> list[str] | None:
            return kube.deleted or None

        assert (await eventually(withdrawn, "a's slices withdrawn", within_s=5))[0] == "a-mig-0"
        assert [ref["name"] for ref, _, reason in kube.events if reason == "AgentSilent"]
    finally:
        stop.stopped = True
        await asyncio.wait_for(watchdog, timeout=5)


def floor_snapshot(inventory: str, generation: int, ready: tuple[str, str], instances: list[Any]) -> Snapshot:
    """Node ``a``: one A100 at ``generation`` under policy ``warm`` (a warm pool of one 1g.10gb, no
    baseline), its agent live, reporting ``ready`` (status, reason) for that generation."""
    part = gpu("a", 0, "A100-80GB", "NVIDIA A100-SXM4-80GB")
    part["metadata"] |= {"uid": "uid-a-gpu0", "generation": generation, "resourceVersion": "5"}
    if generation > 1:
        part["spec"]["layout"] = [{"profile": "1g.10gb", "start": 6}]
    part["status"] |= {"observedGeneration": generation, "inventory": inventory, "instances": instances}
    part["status"]["conditions"] = [
        {"type": "Ready", "status": ready[0], "reason": ready[1], "message": "kept 1g.10gb@6: allocated",
         "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": generation},
    ]  # fmt: skip
    if inventory == "Partitionable":
        part["spec"]["offeredProfiles"] = ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb",
                                           "4g.40gb", "7g.80gb"]  # fmt: skip
    return Snapshot(
        policies=(policy("warm", "2026-02-01T00:00:00Z", mode="Dynamic", warmPool={"1g.10gb": 1}),),
        partitions=(part,),
        nodes=({"metadata": {"name": "a", "uid": "uid-node-a", "labels": {"kubernetes.io/hostname": "a"}}},),
        pods=(),
        claims=(),
        device_classes=(),
        leases=(lease_body("a", "default", time.time(), 30),),
    )


async def test_a_floor_held_by_bookings_is_told_once_as_normal_a_blocked_reshape_stays_a_warning() -> None:
    # A booking holds the slices of the warm pool's 1g.10gb@6.
    booked = [{"profile": "3g.40gb", "start": 4, "deviceName": "gpu0-3g40gb-s4", "state": "allocated",
               "claims": ["ns/x"]}]  # fmt: skip
    kube = FakeKube(floor_snapshot("Partitionable", 1, ("True", "LayoutApplied"), []))
    rec = reconciler(kube)
    await rec.round("warm")  # the warm pool is written: generation 2
    assert [r for _, _, r in kube.events if r == "ReshapeStarted"] == ["ReshapeStarted"]
    kube.snap = floor_snapshot("Partitionable", 2, ("True", "FloorHeld"), booked)
    for _ in range(3):
        await rec.round("warm")
    told = [(kind, reason) for ref, kind, reason in kube.events if reason.startswith(("Floor", "Reshape"))]
    assert told == [("Normal", "ReshapeStarted"), ("Normal", "FloorHeld")], told  # once, Normal
    # The bookings end and the agent creates the floor: completed, once.
    made = [{"profile": "1g.10gb", "start": 6, "deviceName": "gpu0-1g10gb-s6", "state": "free"}]
    kube.snap = floor_snapshot("Partitionable", 2, ("True", "LayoutApplied"), made)
    await rec.round("warm")
    await rec.round("warm")
    assert [r for _, _, r in kube.events].count("ReshapeCompleted") == 2  # on the policy and the GPU

    # Instances: the operator planned around busy instances, so one in the way is a race: a Warning.
    kube = FakeKube(floor_snapshot("Instances", 1, ("True", "LayoutApplied"), []))
    rec = reconciler(kube)
    await rec.round("warm")
    kube.snap = floor_snapshot("Instances", 2, ("False", "InstanceBusy"), booked)
    await rec.round("warm")
    assert ("Warning", "ReshapeBlocked") in [(kind, reason) for _, kind, reason in kube.events]
