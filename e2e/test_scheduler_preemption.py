"""kube-scheduler's own preemption meets dynamig's binding conditions: a pod waiting in PreBind for the
agent's answer is preempted, and its booking is released without a cut.

Real: etcd, kube-apiserver, kube-scheduler, kube-controller-manager, the node agent's whole loop in the
partitionable inventory. Simulated: one A100-80GB; the node (no kubelet: pods bind, never run).

kube-scheduler 1.37 cancels a victim's binding cycle in PreBind ("Preemptor rejected a pod in preBind",
pkg/scheduler/framework/preemption/executor.go) and the victim goes back to the queue; a preemptor retried
before the cancel has taken effect preempts again and deletes the victim. Either way the DRA plugin's
Unreserve takes the pod out of the claim's ``reservedFor`` and leaves the allocation: a booking reserved
for nobody, which the resource claim controller does not deallocate (it does so only when it removes the
last reservation itself).

1. The agent offers 1g.10gb placements, then stops: a booking now waits for an answer nobody gives yet.
2. A pod at priority 0 asking one CPU (all the node has) and a 1g.10gb from a claim of its own is booked
   (binding conditions) and waits in PreBind.
3. A pod at priority 1000 asking one CPU and no device: kube-scheduler preempts the waiting pod. The claim
   is left allocated, reserved for nobody.
4. The agent comes back: it answers the booking failed (``NobodyWaits``) and cuts nothing.
5. The preemptor ends; the claim's pod (the victim back from the queue, or a new one where it was deleted)
   is booked afresh, the agent cuts and answers, the pod binds.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.agent.bindings.allocations import REASON_NOBODY_WAITS
from dynamig.demo.cluster import ScenarioApi, allocated_device, claim_pod, first_available, resource_claim
from dynamig.demo.inprocess import agent_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.inventory import BINDING_FAILED
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION

pytestmark = pytest.mark.controlplane


def cpu_pod(name: str, node: str, priority_class: str, claim: str | None = None) -> dict[str, Any]:
    """A pod pinned to ``node`` asking one CPU, with ``claim`` when given. Pure."""
    if claim is None:
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "containers": [{"name": "main", "image": "example.invalid/app:1"}],
            },
        }
    else:
        pod = claim_pod(name, {"kubernetes.io/hostname": node}, claim=claim)
    pod["spec"]["priorityClassName"] = priority_class
    pod["spec"]["containers"][0].setdefault("resources", {})["requests"] = {"cpu": "1"}
    return pod


async def test_a_booking_whose_pod_was_preempted_in_prebind_is_released_without_a_cut(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["A100-80GB"], state_file=None)
    node = make_node("prebind", labels={"dynamig.io/managed": "true"}, allocatable={"cpu": "1"})
    gpu = f"{node}-gpu0"
    settings = dataclasses.replace(quick_agent_settings(node), inventory=Inventory.PARTITIONABLE)
    pool = uuid.uuid4().hex[:8]
    await k.priority_classes({f"low-{pool}": {"value": 0}, f"high-{pool}": {"value": 1000}})

    async def claim() -> dict[str, Any]:
        got: dict[str, Any] = await k.custom.get_namespaced_custom_object(
            "resource.k8s.io", "v1", k.ns, "resourceclaims", "gpu"
        )
        return got

    try:
        # ---- 1. placements offered, then no agent ------------------------------------------------------
        async with agent_running(kube_api, node, sim, settings):
            await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
            await k.custom.patch_cluster_custom_object(
                GROUP, VERSION, GPU_PARTITION_PLURAL, gpu, {"spec": {"offeredProfiles": ["1g.10gb"]}},
                _content_type="application/merge-patch+json",
            )  # fmt: skip

            async def offering() -> bool | None:
                return (
                    True if ((await k.partition(gpu)).get("status") or {}).get("offeredPlacements") else None
                )

            await eventually(offering, "1g.10gb placements published", within_s=30)

        # ---- 2. the low pod is booked and waits in PreBind -----------------------------------------------
        await k.custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", k.ns, "resourceclaims",
            resource_claim("gpu", {"firstAvailable": first_available(["1g.10gb"])}),
        )  # fmt: skip
        await k.core.create_namespaced_pod(k.ns, cpu_pod("low", node, f"low-{pool}", claim="gpu"))

        async def booked() -> dict[str, Any] | None:
            got = await claim()
            return got if allocated_device(got) and got["status"].get("reservedFor") else None

        result = (await eventually(booked, "the low pod's booking", within_s=60))["status"]["allocation"]
        (booking,) = result["devices"]["results"]
        assert booking.get("bindingConditions"), booking
        assert (await k.core.read_namespaced_pod("low", k.ns)).spec.node_name is None

        # ---- 3. the high pod preempts it -----------------------------------------------------------------
        t0 = time.monotonic()
        await k.core.create_namespaced_pod(k.ns, cpu_pod("high", node, f"high-{pool}"))

        async def unreserved() -> dict[str, Any] | None:
            left: dict[str, Any] = (await claim())["status"]
            return left if not left.get("reservedFor") else None

        left = await eventually(unreserved, "the booking unreserved by the preemption", within_s=60)
        assert left.get("allocation"), left  # booked for nobody
        took = time.monotonic() - t0
        print(f"\nkube-scheduler preempted the pod in PreBind {took:.1f}s after the preemptor came")

        # ---- 4. the agent releases the booking, cuts nothing ---------------------------------------------
        since = len(sim.history())
        async with agent_running(kube_api, node, sim, settings):

            async def answered() -> dict[str, Any] | None:
                entries = (await claim())["status"].get("devices") or []
                return entries[0] if entries else None

            entry = await eventually(answered, "the agent's answer to the booking", within_s=30)
            (cond,) = entry["conditions"]
            got = (cond["type"], cond["status"], cond["reason"])
            assert got == (BINDING_FAILED, "True", REASON_NOBODY_WAITS), cond
            assert [e.kind for e in sim.history()[since:]] == [], "nothing cut for a booking nobody waits on"

            # ---- 5. the preemptor ends; the claim's pod is booked again and binds -------------------------
            await k.core.delete_namespaced_pod("high", k.ns, grace_period_seconds=0)
            pod = "low"
            if not {p.metadata.name for p in (await k.core.list_namespaced_pod(k.ns)).items} & {"low"}:
                pod = "again"  # the preemptor's second attempt deleted the victim
                await k.core.create_namespaced_pod(k.ns, cpu_pod(pod, node, f"low-{pool}", claim="gpu"))
            print(f"the claim's pod: {pod}")

            async def bound() -> str | None:
                return (await k.core.read_namespaced_pod(pod, k.ns)).spec.node_name or None

            assert await eventually(bound, f"{pod}, the claim's pod, bound", within_s=60) == node
            assert [e.kind for e in sim.history()[since:]] == ["create-gi", "create-ci"]
    finally:
        await k.delete_priority_classes([f"low-{pool}", f"high-{pool}"])
