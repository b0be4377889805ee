"""Booking a placement directly: partitionable devices with binding conditions on the real 1.36 scheduler.

Real: kube-apiserver, kube-scheduler (its DRA plugin allocates against counters and holds the binding until
the device's binding conditions are True), the inventory builder (``dynamig.kube.inventory``), the agent's
answer (``dynamig.agent.allocations``) and NVML code path. Simulated: the GPU (one A100-80GB, simnvml).
The agent's loop is not running: the test publishes the inventory and calls the answerer itself, so each
step is observed in order. The scheduler polls binding conditions every 5 s (dynamicresources.go, PreBind),
which bounds how fast a pod binds after the answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry

from dynamig.agent.binding import Failed, Ready
from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.kubeapi import KubeApi
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml_device import NvmlDevices
from dynamig.backends.nvml import load_nvml
from dynamig.demo.cluster import (
    allocated_device,
    claim_pod,
    ensure_device_class,
    first_available,
    resource_claim,
)
from dynamig.devcluster.controlplane import ControlPlane
from dynamig.devcluster.waiting import eventually
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.inventory import (
    BINDING_FAILED,
    BINDING_READY,
    GpuInventory,
    Instance,
    Occupancy,
    build_inventory_slices,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.matrix("partitionable")]


@pytest.fixture
def sim() -> Iterator[ModuleType]:
    module: ModuleType = load_nvml("simulated")
    module.configure(gpus=["A100-80GB"], state_file=None, seed="binding")
    yield module
    module.configure(gpus=[], state_file=None)


async def publish(custom: client.CustomObjectsApi, node: str, generation: int, devices: NvmlDevices) -> None:
    """Publish what the GPU offers now (its instances free), replacing the pool's slices."""
    gpu = devices.gpu(0)
    assert gpu.model is not None
    instances = tuple(
        Instance(i.profile, i.start, Occupancy.FREE, i.mig_uuid, i.memory_bytes)
        for i in devices.instances(gpu)
    )
    res = await custom.list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
    )
    for old in res["items"]:
        await custom.delete_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", old["metadata"]["name"]
        )
    inventory = GpuInventory(0, gpu.model, gpu.uuid, gpu.product, instances)
    for body in build_inventory_slices(node, generation, [inventory]):
        await custom.create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", body)


async def booking_node(
    kube_api: client.ApiClient, make_node: Any, prefix: str, sim: ModuleType, **settings: Any
) -> tuple[str, NvmlDevices, NodeAgent]:
    """The DeviceClass, a managed node, NVML over ``sim`` and an agent for the node (its loop not running)."""
    await ensure_device_class(client.ResourceV1Api(kube_api))
    node: str = make_node(prefix, labels={"dynamig.io/managed": "true"})
    devices = NvmlDevices(sim, load_catalog())
    devices.init()
    agent = NodeAgent(
        AgentSettings(node=node, **settings),
        KubeApi(kube_api),
        devices,
        AgentMetrics(CollectorRegistry(), node),
    )
    return node, devices, agent


async def claim_and_pod(api: client.ApiClient, ns: str, name: str, profile: str, node: str) -> None:
    body = resource_claim(name, {"firstAvailable": first_available([profile])})
    await client.CustomObjectsApi(api).create_namespaced_custom_object(
        "resource.k8s.io", "v1", ns, "resourceclaims", body
    )
    await client.CoreV1Api(api).create_namespaced_pod(
        ns, claim_pod(name, {"kubernetes.io/hostname": node}, claim=name)
    )


async def get_claim(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        "resource.k8s.io", "v1", ns, "resourceclaims", name
    )
    return obj


async def test_a_placement_is_cut_when_booked_and_the_pod_binds_only_after(
    control_plane: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Any,
    namespace: str,
    sim: ModuleType,
) -> None:
    custom = client.CustomObjectsApi(kube_api)
    node, devices, agent = await booking_node(kube_api, make_node, "book", sim)
    gpu = devices.gpu(0)
    devices.create(gpu, PlacedInstance(0, "3g.40gb"))  # pre-cut half, free
    answerer = agent.answerer
    await publish(custom, node, 1, devices)

    # 1. A 1g.10gb claim: nothing of that shape exists; the scheduler books a placement and waits.
    await claim_and_pod(kube_api, namespace, "small", "1g.10gb", node)
    claim = await eventually(lambda: allocated_claim(kube_api, namespace, "small"), "small allocated")
    device = allocated_device(claim)
    assert device is not None and device.startswith("gpu0-1g10gb-s")
    result = claim["status"]["allocation"]["devices"]["results"][0]
    assert result["bindingConditions"] == [BINDING_READY] and result["bindingFailureConditions"] == [
        BINDING_FAILED
    ]
    pod = await client.CoreV1Api(kube_api).read_namespaced_pod("small", namespace)
    assert not pod.spec.node_name, "the pod must not bind before the instance exists"
    assert [i.placed.profile for i in devices.instances(gpu)] == ["3g.40gb"]

    async with agent.lock:
        ((pending, answer),) = await answerer.answer_all(await agent.api.list_claims())
    assert pending.claim == f"{namespace}/small" and isinstance(answer, Ready)
    made = {i.placed: i for i in devices.instances(gpu)}
    start = int(device.rsplit("-s", 1)[1])
    inst = made[PlacedInstance(start, "1g.10gb")]
    claim = await get_claim(kube_api, namespace, "small")
    (entry,) = claim["status"]["devices"]
    assert entry["device"] == device and entry["conditions"][0]["type"] == BINDING_READY
    assert entry["data"] == {"migUUID": inst.mig_uuid, "profile": "1g.10gb", "placementStart": start}
    await eventually(lambda: _bound(kube_api, namespace, "small", node), "small bound", within_s=30)

    # 2. A 4g.40gb claim: its placement @0 lies under the free 3g.40gb@0. Someone starts a process on that
    #    instance behind the agent's back: the answer fails, nothing busy is destroyed, the pod stays
    #    unbound; once the process ends, the retried allocation is cut and the pod binds.
    three = made[PlacedInstance(0, "3g.40gb")]
    await publish(custom, node, 2, devices)
    sim.attach_process(three.mig_uuid, 777)
    await claim_and_pod(kube_api, namespace, "big", "4g.40gb", node)
    claim = await eventually(lambda: allocated_claim(kube_api, namespace, "big"), "big allocated")
    assert allocated_device(claim) == "gpu0-4g40gb-s0"
    async with agent.lock:
        ((pending, answer),) = await answerer.answer_all(await agent.api.list_claims())
    assert pending.device == "gpu0-4g40gb-s0"
    assert isinstance(answer, Failed) and answer.reason == "PlacementTaken" and "process" in answer.message
    claim = await get_claim(kube_api, namespace, "big")
    failed = [e for e in (claim["status"].get("devices") or []) if e["device"] == "gpu0-4g40gb-s0"]
    if failed:  # else the scheduler has already released the allocation, and the entry with it
        assert failed[0]["conditions"][0]["type"] == BINDING_FAILED
    assert not (await client.CoreV1Api(kube_api).read_namespaced_pod("big", namespace)).spec.node_name
    assert PlacedInstance(0, "3g.40gb") in {i.placed for i in devices.instances(gpu)}
    assert not [e for e in sim.history() if e.kind == "destroy-gi" and e.start == 0]

    sim.detach_process(three.mig_uuid, 777)

    async def answered_and_bound() -> bool | None:
        async with agent.lock:
            await answerer.answer_all(await agent.api.list_claims())
        return await _bound(kube_api, namespace, "big", node)

    await eventually(answered_and_bound, "big bound after the retry", within_s=120, every_s=1.0)
    layout = {i.placed for i in devices.instances(gpu)}
    assert PlacedInstance(0, "4g.40gb") in layout and PlacedInstance(0, "3g.40gb") not in layout
    destroyed = [e for e in sim.history() if e.kind == "destroy-gi"]
    assert [(e.profile, e.start) for e in destroyed] == [
        ("3g.40gb", 0)
    ]  # only the free one, once it was free
    devices.shutdown()


async def allocated_claim(api: client.ApiClient, ns: str, name: str) -> dict[str, Any] | None:
    claim = await get_claim(api, ns, name)
    return claim if allocated_device(claim) else None


async def _bound(api: client.ApiClient, ns: str, name: str, node: str) -> bool | None:
    pod = await client.CoreV1Api(api).read_namespaced_pod(name, ns)
    return True if pod.spec.node_name == node else None


async def test_a_booking_on_a_gpu_that_fell_off_the_bus_is_failed_at_once_not_left_to_time_out(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Any,
    namespace: str,
    sim: ModuleType,
) -> None:
    # The agent's own round (partitionable inventory) after NVML lost the node's only GPU: nothing can be
    # cut, so the booking is answered failed with the reason, and the scheduler books again instead of
    # holding the pod for its binding timeout (600 s).
    custom = client.CustomObjectsApi(kube_api)
    node, devices, agent = await booking_node(
        kube_api, make_node, "lost", sim, inventory=Inventory.PARTITIONABLE, watch=False
    )
    await publish(custom, node, 1, devices)
    await claim_and_pod(kube_api, namespace, "lost", "1g.10gb", node)
    claim = await eventually(lambda: allocated_claim(kube_api, namespace, "lost"), "lost allocated")
    device = allocated_device(claim)
    sim.set_gpu_lost(0)

    await agent.reconcile_once()
    answered = agent.metrics.registry.get_sample_value(
        "dynamig_binding_answers_total", {"Hostname": node, "answer": "failed"}
    )
    assert answered == 1
    claim = await get_claim(kube_api, namespace, "lost")
    entries = [e for e in (claim["status"].get("devices") or []) if e["device"] == device]
    if entries:  # else the scheduler has already released the allocation, and the entry with it
        (cond,) = entries[0]["conditions"]
        assert (cond["type"], cond["reason"]) == (BINDING_FAILED, "GpuUnavailable")
        assert "GpuIsLost" in cond["message"], cond
    assert not (await client.CoreV1Api(kube_api).read_namespaced_pod("lost", namespace)).spec.node_name
