"""The DRA path dynamig depends on, end to end on the real control plane.

Real: etcd, kube-apiserver, kube-scheduler (its DRA allocator) and kube-controller-manager (its ResourceClaim
controller), all built from the Kubernetes sources; the ResourceSlice is built by dynamig's own device and
slice builders (``dynamig.kube.devices``, ``dynamig.kube.slices``) from the A100-80GB geometry catalog.
Simulated: the GPU node is a Node object registered through the API (no kubelet), and the slice is written
by the test instead of the node agent, so pods are bound but never run.

Each test's node publishes one ``1g.10gb`` and one ``2g.20gb`` MIG device. Pods ask for a slice through a
ResourceClaimTemplate with ``firstAvailable``, as DESIGN.md shows.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from kubernetes_asyncio import client

from dynamig.demo.cluster import claim_pod, ensure_device_class
from dynamig.devcluster import eventually
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.devices import MigDevice
from dynamig.kube.names import DEVICE_CLASS_NAME
from dynamig.kube.policy import parse_policy
from dynamig.kube.slices import build_resource_slices
from dynamig.operator.decide import RoundInput, decide_round
from dynamig.operator.demand import extract_demand, parse_device_classes
from dynamig.operator.verdicts import Reason

pytestmark = [pytest.mark.controlplane, pytest.mark.matrix]

DRIVER = "mig.dynamig.io"
T = TypeVar("T")


def choice(name: str, profile: str) -> dict[str, Any]:
    """One ``firstAvailable`` entry: a device of class mig.dynamig.io with the given MIG profile."""
    selector = f'device.attributes["{DRIVER}"].profile == "{profile}"'
    return {
        "name": name,
        "deviceClassName": DEVICE_CLASS_NAME,
        "selectors": [{"cel": {"expression": selector}}],
    }


def claim_template(name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": choices}]}}},
    }


def pod(name: str, node: str, template: str) -> dict[str, Any]:
    return claim_pod(name, {"kubernetes.io/hostname": node}, template=template)


@dataclass(frozen=True)
class MigNode:
    name: str
    small: str  # device name of the 1g.10gb instance
    medium: str  # device name of the 2g.20gb instance


@pytest.fixture
async def mig_node(kube_api: client.ApiClient, make_node: Callable[..., str]) -> AsyncIterator[MigNode]:
    """A Ready node whose pool publishes one 1g.10gb and one 2g.20gb device, and the DeviceClass."""
    core = client.CoreV1Api(kube_api)
    resource = client.ResourceV1Api(kube_api)
    node = make_node("gpu-node", labels={"dynamig.io/managed": "true"})
    node_uid = (await core.read_node(node)).metadata.uid
    a100 = load_catalog().model("A100-80GB")
    devices = [
        MigDevice(0, a100.profile("1g.10gb"), 6, a100.product_name, "GPU-e2e-0", "MIG-e2e-1g"),
        MigDevice(0, a100.profile("2g.20gb"), 0, a100.product_name, "GPU-e2e-0", "MIG-e2e-2g"),
    ]
    (slice_body,) = build_resource_slices(node, 1, [d.to_api() for d in devices])
    # Owned by the Node, as a kubelet-registered driver's slices are: deleting the node collects them.
    slice_body["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True},
    ]
    await resource.create_resource_slice(slice_body)
    await ensure_device_class(resource)
    try:
        yield MigNode(node, devices[0].name, devices[1].name)
    finally:
        await resource.delete_resource_slice(slice_body["metadata"]["name"])


class Cluster:
    """Reads of one test namespace's pods and their generated claims."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.core = client.CoreV1Api(api)
        self.resource = client.ResourceV1Api(api)
        self.namespace = namespace

    async def claim_of(self, pod_name: str) -> client.V1ResourceClaim | None:
        """The claim the controller manager generated for the pod's ``gpu`` entry, once it exists."""
        p = await self.core.read_namespaced_pod(pod_name, self.namespace)
        for status in p.status.resource_claim_statuses or []:
            if status.name == "gpu" and status.resource_claim_name:
                claim: client.V1ResourceClaim = await self.resource.read_namespaced_resource_claim(
                    status.resource_claim_name, self.namespace
                )
                return claim
        return None

    async def allocated_claim(self, pod_name: str) -> client.V1ResourceClaim | None:
        claim = await self.claim_of(pod_name)
        return claim if claim is not None and claim.status and claim.status.allocation else None

    async def bound(self, pod_name: str) -> client.V1Pod | None:
        p: client.V1Pod = await self.core.read_namespaced_pod(pod_name, self.namespace)
        return p if p.spec.node_name else None

    async def unschedulable(self, pod_name: str) -> client.V1PodCondition | None:
        p = await self.core.read_namespaced_pod(pod_name, self.namespace)
        for cond in p.status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False":
                return cond
        return None

    async def expect_allocation(self, pod_name: str, node: str, subrequest: str, device: str) -> None:
        """The pod's claim holds ``device`` for ``gpu/<subrequest>``; the pod is bound to ``node``."""
        claim = await eventually(lambda: self.allocated_claim(pod_name), f"claim of {pod_name} allocated")
        # Generated by the ResourceClaim controller, owned by the pod.
        owners = claim.metadata.owner_references or []
        assert [(o.kind, o.name, o.controller) for o in owners] == [("Pod", pod_name, True)]
        assert claim.metadata.annotations.get("resource.kubernetes.io/pod-claim-name") == "gpu"
        results = claim.status.allocation.devices.results
        assert [(r.request, r.driver, r.pool, r.device) for r in results] == [
            (f"gpu/{subrequest}", DRIVER, node, device),
        ]
        assert [c.name for c in claim.status.reserved_for] == [pod_name]
        p = await eventually(lambda: self.bound(pod_name), f"{pod_name} bound")
        assert p.spec.node_name == node

    async def expect_unschedulable(self, pod_name: str) -> None:
        """The pod is PodScheduled=False/Unschedulable for its claim, which exists but is not allocated."""
        cond = await eventually(lambda: self.unschedulable(pod_name), f"{pod_name} reported unschedulable")
        assert cond.reason == "Unschedulable"
        assert "cannot allocate all claims" in cond.message, cond.message
        claim = await eventually(lambda: self.claim_of(pod_name), f"claim of {pod_name} created")
        assert claim.status is None or claim.status.allocation is None
        assert (await self.core.read_namespaced_pod(pod_name, self.namespace)).spec.node_name is None


async def test_first_available_first_choice_fallback_exhaustion_and_release(
    kube_api: client.ApiClient,
    namespace: str,
    mig_node: MigNode,
) -> None:
    started = time.monotonic()
    cluster = Cluster(kube_api, namespace)
    template = claim_template("mig", [choice("small", "1g.10gb"), choice("medium", "2g.20gb")])
    await cluster.resource.create_namespaced_resource_claim_template(namespace, template)

    # 1. First choice is free: the scheduler allocates the 1g.10gb and binds the pod.
    await cluster.core.create_namespaced_pod(namespace, pod("first", mig_node.name, "mig"))
    await cluster.expect_allocation("first", mig_node.name, "small", mig_node.small)

    # 2. First choice taken: the fallback 2g.20gb.
    await cluster.core.create_namespaced_pod(namespace, pod("second", mig_node.name, "mig"))
    await cluster.expect_allocation("second", mig_node.name, "medium", mig_node.medium)

    # 3. Nothing left: the claim exists but stays unallocated and the pod is Unschedulable.
    await cluster.core.create_namespaced_pod(namespace, pod("third", mig_node.name, "mig"))
    await cluster.expect_unschedulable("third")

    # 4. The first pod goes away: its claim is released and the waiting pod gets the freed first choice.
    await cluster.core.delete_namespaced_pod("first", namespace, grace_period_seconds=0)
    await cluster.expect_allocation("third", mig_node.name, "small", mig_node.small)
    print(f"\nDRA path scenario took {time.monotonic() - started:.1f}s")


async def test_claim_no_published_device_satisfies_is_unschedulable(
    kube_api: client.ApiClient,
    namespace: str,
    mig_node: MigNode,
) -> None:
    cluster = Cluster(kube_api, namespace)
    # A whole-GPU profile the node does not publish, and a 1g.10gb with more memory than any 1g.10gb has.
    big_1g = choice("big-small", "1g.10gb")
    big_1g["selectors"].append(
        {"cel": {"expression": f'device.capacity["{DRIVER}"].memory.compareTo(quantity("20Gi")) >= 0'}},
    )
    template = claim_template("whole", [choice("whole", "7g.80gb"), big_1g])
    await cluster.resource.create_namespaced_resource_claim_template(namespace, template)
    await cluster.core.create_namespaced_pod(namespace, pod("greedy", mig_node.name, "whole"))
    await cluster.expect_unschedulable("greedy")


async def test_a_claim_the_scheduler_fails_on_is_reported_and_never_planned_for(
    kube_api: client.ApiClient,
    namespace: str,
    mig_node: MigNode,
) -> None:
    """A selector that fails at run time (an attribute the devices lack, read without a guard): the real
    scheduler marks the pod SchedulerError, not Unschedulable. The operator's demand reading, fed the pod and
    claim as the API server returns them, gives a SchedulerError verdict with the scheduler's message and
    plans nothing for it."""
    cluster = Cluster(kube_api, namespace)
    broken = choice("broken", "1g.10gb")
    broken["selectors"] = [{"cel": {"expression": f'device.attributes["{DRIVER}"].rackPosition == "a1"'}}]
    await cluster.resource.create_namespaced_resource_claim_template(
        namespace, claim_template("broken", [broken])
    )
    await cluster.core.create_namespaced_pod(namespace, pod("broken", mig_node.name, "broken"))
    cond = await eventually(lambda: cluster.unschedulable("broken"), "broken pod reported by the scheduler")
    assert cond.reason == "SchedulerError", (cond.reason, cond.message)
    assert "rackPosition" in cond.message, cond.message

    claim = await eventually(lambda: cluster.claim_of("broken"), "claim of broken created")
    raw_pod = kube_api.sanitize_for_serialization(await cluster.core.read_namespaced_pod("broken", namespace))
    raw_claim = kube_api.sanitize_for_serialization(claim)
    raw_classes = kube_api.sanitize_for_serialization(await cluster.resource.list_device_class())["items"]
    a100 = load_catalog().model("A100-80GB")
    demand = extract_demand(
        [raw_claim], [raw_pod], parse_device_classes(raw_classes), (a100,), {mig_node.name: {}}
    )
    (pending,) = demand.pending
    assert pending.scheduler_error == cond.message
    policy = parse_policy(
        {"metadata": {"name": "p", "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"mode": "Dynamic"}}
    )
    decision = decide_round(RoundInput(policy, (), (), (pending,), time.time(), {}, load_catalog()))
    (verdict,) = decision.verdicts
    assert verdict.reason == Reason.SCHEDULER_ERROR and verdict.warning
    assert cond.message in verdict.message and "does not reshape" in verdict.message
    assert decision.writes == () and decision.planned == ()
