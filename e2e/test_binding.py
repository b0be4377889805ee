"""Booking a placement directly: partitionable devices with binding conditions on the real 1.36 scheduler.

Real: kube-apiserver, kube-scheduler (its DRA plugin allocates against counters and holds the binding until
the device's binding conditions are True), the inventory builder (``dynamig.kube.inventory``), the agent's
answer (``dynamig.agent.bindings.allocations``) and NVML code path. Simulated: the GPU (one A100-80GB,
simnvml). The agent's loop is not running: the test publishes the inventory and calls the answerer itself, so
each step is observed in order. The scheduler polls binding conditions every 5 s (dynamicresources.go,
PreBind), which bounds how fast a pod binds after the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry

from dynamig.agent.bindings.booked import published_devices
from dynamig.agent.bindings.decide import Failed, Ready
from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.kube.watch import node_copies
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml.device import NvmlDevices
from dynamig.backends.nvml import load_nvml
from dynamig.demo.cluster import (
    PROFILE_ATTRIBUTE,
    allocated_device,
    claim_pod,
    ensure_device_class,
    exactly,
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
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION, gpu_partition_name

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


async def _booked_partitionable(
    api: client.ApiClient, make_node: Any, namespace: str, sim: ModuleType, name: str
) -> tuple[Any, Any, str]:
    """An agent (partitionable inventory, no watches: its rounds run when the test says) on a node whose
    slices the test published, and a pod ``name`` whose 1g.10gb claim the real scheduler booked there: the
    agent, the node's devices and the booked device."""
    node, devices, agent = await booking_node(
        api, make_node, name, sim, inventory=Inventory.PARTITIONABLE, watch=False
    )
    await publish(client.CustomObjectsApi(api), node, 1, devices)
    await claim_and_pod(api, namespace, name, "1g.10gb", node)
    claim = await eventually(lambda: allocated_claim(api, namespace, name), f"{name} allocated")
    device = allocated_device(claim)
    assert device is not None
    return agent, devices, device


async def _answered_failed(
    api: client.ApiClient, namespace: str, name: str, device: str, agent: Any = None
) -> dict[str, Any] | None:
    """Pod ``name`` is not bound and ``agent`` (when given) counted one failed answer; the claim's failed
    condition for ``device``, or None once the scheduler released the allocation (and the entry with it)."""
    if agent is not None:
        failed = agent.metrics.registry.get_sample_value(
            "dynamig_binding_answers_total", {"Hostname": agent.settings.node, "answer": "failed"}
        )
        assert failed == 1
    claim = await get_claim(api, namespace, name)
    entries = [e for e in (claim["status"].get("devices") or []) if e["device"] == device]
    assert not (await client.CoreV1Api(api).read_namespaced_pod(name, namespace)).spec.node_name
    if not entries:
        return None
    (cond,) = entries[0]["conditions"]
    assert cond["type"] == BINDING_FAILED, cond
    return dict(cond)


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
    agent, _, device = await _booked_partitionable(kube_api, make_node, namespace, sim, "lost")
    sim.set_gpu_lost(0)

    await agent.reconcile_once()
    cond = await _answered_failed(kube_api, namespace, "lost", device, agent)
    if cond is not None:
        assert cond["reason"] == "GpuUnavailable" and "GpuIsLost" in cond["message"], cond


async def admin_claim_and_pod(api: client.ApiClient, ns: str, name: str, profile: str, node: str) -> None:
    """A monitoring claim: exactly one device of ``profile`` with admin access (the namespace must allow it:
    label ``resource.kubernetes.io/admin-access=true``, enforced by the API server)."""
    request = exactly(f'{PROFILE_ATTRIBUTE} == "{profile}"')
    request["exactly"]["adminAccess"] = True
    await client.CustomObjectsApi(api).create_namespaced_custom_object(
        "resource.k8s.io", "v1", ns, "resourceclaims", resource_claim(name, request)
    )
    await client.CoreV1Api(api).create_namespaced_pod(
        ns, claim_pod(name, {"kubernetes.io/hostname": node}, claim=name)
    )


async def test_an_admin_access_booking_is_answered_without_a_cut_or_a_destroy(
    control_plane: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Any,
    namespace: str,
    sim: ModuleType,
) -> None:
    # Seven free 1g.10gb instances: every 2g.20gb placement lies over two of them. A monitoring claim (admin
    # access) for a 2g.20gb is booked on such a placement by the real scheduler (it counts admin access as
    # no allocation); answering it with a cut would destroy two free instances for a claim that holds
    # nothing. The agent answers it failed instead, and NVML is not touched.
    custom = client.CustomObjectsApi(kube_api)
    node, devices, agent = await booking_node(kube_api, make_node, "admin", sim)
    gpu = devices.gpu(0)
    for start in range(7):
        devices.create(gpu, PlacedInstance(start, "1g.10gb"))
    await publish(custom, node, 1, devices)
    before = len(sim.history())
    await client.CoreV1Api(kube_api).patch_namespace(
        namespace, {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}}
    )
    await admin_claim_and_pod(kube_api, namespace, "monitor", "2g.20gb", node)
    claim = await eventually(lambda: allocated_claim(kube_api, namespace, "monitor"), "monitor allocated")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["adminAccess"] is True and result["device"].startswith("gpu0-2g20gb-s"), result
    assert result["bindingConditions"] == [BINDING_READY], "the scheduler waits for the agent's answer"

    async with agent.lock:
        ((pending, answer),) = await agent.answerer.answer_all(await agent.api.list_claims())
    assert pending.device == result["device"]
    assert isinstance(answer, Failed) and answer.reason == "AdminAccessNoInstance", answer
    assert sim.history()[before:] == [], "an admin-access booking cut or destroyed something"
    assert len(devices.instances(gpu)) == 7
    await _answered_failed(kube_api, namespace, "monitor", result["device"])
    devices.shutdown()


async def test_a_booking_on_a_gpu_the_round_refuses_is_failed_with_the_reason_not_cut(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Any,
    namespace: str,
    sim: ModuleType,
) -> None:
    # The NVIDIA MIG manager's label on the node: the agent leaves its GPUs alone. A booking made from a
    # slice published before (here by the test) must not be cut either: it is answered failed, saying why.
    agent, devices, device = await _booked_partitionable(kube_api, make_node, namespace, sim, "late")
    await client.CoreV1Api(kube_api).patch_node(
        agent.settings.node, {"metadata": {"labels": {"nvidia.com/mig.config": "all-1g.10gb"}}}
    )
    before = len(sim.history())

    await agent.reconcile_once()
    assert sim.history()[before:] == [], "a GPU the round refuses was cut"
    cond = await _answered_failed(kube_api, namespace, "late", device, agent)
    if cond is not None:
        assert cond["reason"] == "ForeignMigOwner" and "nvidia.com/mig.config" in cond["message"], cond
    devices.shutdown()


async def test_ready_carries_the_mig_uuid_nvml_lists_and_a_device_never_listed_fails(
    control_plane: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Any,
    namespace: str,
    sim: ModuleType,
) -> None:
    # nvml.h lets nvmlDeviceGetMigDeviceHandleByIndex answer NOT_FOUND for a MIG device not set up yet. Right
    # after the cut the agent has no MIG UUID: it reads again (bounded) and answers ready only with the UUID;
    # a MIG device that is never listed in time fails the booking instead of binding a pod to "".
    custom = client.CustomObjectsApi(kube_api)
    node, devices, agent = await booking_node(kube_api, make_node, "enum", sim)
    gpu = devices.gpu(0)
    await publish(custom, node, 1, devices)
    sim.set_mig_enumeration_delay(0.6)  # within the answerer's reads (8, 0.25 s apart)
    await claim_and_pod(kube_api, namespace, "soon", "1g.10gb", node)
    claim = await eventually(lambda: allocated_claim(kube_api, namespace, "soon"), "soon allocated")
    device = allocated_device(claim)
    assert device is not None
    async with agent.lock:
        ((_, answer),) = await agent.answerer.answer_all(await agent.api.list_claims())
    assert isinstance(answer, Ready) and answer.mig_uuid.startswith("MIG-"), answer
    listed = {i.placed: i.mig_uuid for i in devices.instances(gpu)}
    assert listed[answer.placed] == answer.mig_uuid
    claim = await get_claim(kube_api, namespace, "soon")
    (entry,) = claim["status"]["devices"]
    assert entry["data"]["migUUID"] == answer.mig_uuid
    await eventually(lambda: _bound(kube_api, namespace, "soon", node), "soon bound", within_s=30)

    sim.set_mig_enumeration_delay(60)  # never within the answer
    await claim_and_pod(kube_api, namespace, "never", "1g.10gb", node)
    claim = await eventually(lambda: allocated_claim(kube_api, namespace, "never"), "never allocated")
    device = allocated_device(claim)
    async with agent.lock:
        ((_, answer),) = await agent.answerer.answer_all(await agent.api.list_claims())
    assert isinstance(answer, Failed) and answer.reason == "MigDeviceNotEnumerated", answer
    made = [i for i in devices.instances(gpu) if i.placed not in listed]
    assert len(made) == 1 and made[0].whole is not None and made[0].mig_uuid == "", made
    assert not (await client.CoreV1Api(kube_api).read_namespaced_pod("never", namespace)).spec.node_name
    devices.shutdown()


async def _unschedulable(api: client.ApiClient, ns: str, name: str) -> bool | None:
    pod = await client.CoreV1Api(api).read_namespaced_pod(name, ns)
    conds = (pod.status.conditions if pod.status else None) or []
    return True if any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in conds) else None


async def _published(api: client.ApiClient, node: str) -> set[str]:
    res = await client.CustomObjectsApi(api).list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
    )
    return published_devices(res["items"])


async def test_a_booked_placement_stays_published_when_the_offer_narrows_before_the_agent_sees_it(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Any,
    namespace: str,
    sim: ModuleType,
) -> None:
    # The race: the scheduler books the whole GPU (7g.80gb@0); the operator narrows offeredProfiles to
    # 1g.10gb before the agent's copy of the claims shows the booking (a watch a moment behind). A round
    # publishing the narrowed offer without the booked device would free its counters in the scheduler's
    # eyes, and a 1g.10gb booking over the same memory slices would go through, only to be answered failed.
    # The agent's own rounds run here, reading copies listed from the real API server; the claims copy is
    # simply not updated until the test lets it catch up.
    custom = client.CustomObjectsApi(kube_api)
    node, devices, agent = await booking_node(
        kube_api, make_node, "narrow", sim, inventory=Inventory.PARTITIONABLE, watch=False
    )
    part = gpu_partition_name(node, 0)
    await agent.reconcile_once()  # makes the GpuPartition

    async def offer(profiles: list[str]) -> None:
        await custom.patch_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL, part, {"spec": {"offeredProfiles": profiles}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip

    await offer(["1g.10gb", "7g.80gb"])
    await agent.reconcile_once()
    assert "gpu0-7g80gb-s0" in await _published(kube_api, node)
    agent.copies = copies = node_copies(agent.api, node, agent.settings.driver, agent.wake)
    for c in copies.all():
        await c.relist()  # the claims copy stays as it is now: before the booking

    await claim_and_pod(kube_api, namespace, "whole", "7g.80gb", node)
    claim = await eventually(lambda: allocated_claim(kube_api, namespace, "whole"), "whole allocated")
    assert allocated_device(claim) == "gpu0-7g80gb-s0"
    await offer(["1g.10gb"])  # the operator narrows the offer
    for c in (copies.node, copies.partitions, copies.slices):
        await c.relist()
    await agent.reconcile_once()  # sees the narrowed offer, not the booking
    published = await _published(kube_api, node)
    assert "gpu0-7g80gb-s0" in published, "the booked device vanished from the slices before its answer"
    assert any(d.startswith("gpu0-1g10gb-") for d in published)

    # A 1g.10gb booking now would overlap the booked whole GPU: the scheduler must find no room.
    await claim_and_pod(kube_api, namespace, "small", "1g.10gb", node)

    async def verdict() -> str | None:
        if await allocated_claim(kube_api, namespace, "small") is not None:
            return "allocated"
        return "unschedulable" if await _unschedulable(kube_api, namespace, "small") else None

    assert await eventually(verdict, "the scheduler's verdict on small", within_s=30) == "unschedulable", (
        "an overlapping booking went through"
    )
    await asyncio.sleep(2)
    assert await allocated_claim(kube_api, namespace, "small") is None, "an overlapping booking went through"

    await copies.claims.relist()  # the agent's copy catches up: the booking is answered
    await agent.reconcile_once()
    answers = {
        a: agent.metrics.registry.get_sample_value(
            "dynamig_binding_answers_total", {"Hostname": node, "answer": a}
        )
        for a in ("ready", "failed")
    }
    assert (answers["ready"], answers["failed"] or 0.0) == (1.0, 0.0), answers
    assert [i.placed for i in devices.instances(devices.gpu(0))] == [PlacedInstance(0, "7g.80gb")]
    await eventually(lambda: _bound(kube_api, namespace, "whole", node), "whole bound", within_s=30)
    assert await allocated_claim(kube_api, namespace, "small") is None
    devices.shutdown()
