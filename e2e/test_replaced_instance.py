"""An allocated instance replaced behind the agent's back before any round of its saw the allocation.

Real: etcd, kube-apiserver, kube-scheduler (allocates the published instance and binds the pod), the node
agent's rounds (NVML code path, slices, Events). Simulated: the GPU (simnvml) and the node (no kubelet).
The agent's rounds are run one at a time, so the replacement falls between the scheduler's allocation and
the first round that sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry

from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml.device import NvmlDevices
from dynamig.demo.cluster import ScenarioApi, allocated_device, claim_pod, first_available, resource_claim
from dynamig.devcluster import ControlPlane, eventually
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance
from dynamig.kube.gpupartition import Inventory

pytestmark = pytest.mark.controlplane

PLACED = {"gpu0-1g10gb-s5": PlacedInstance(5, "1g.10gb"), "gpu0-1g10gb-s6": PlacedInstance(6, "1g.10gb")}


@contextlib.asynccontextmanager
async def nvml(sim: ModuleType) -> AsyncIterator[NvmlDevices]:
    devices = NvmlDevices(sim, load_catalog())
    devices.init()
    try:
        yield devices
    finally:
        devices.shutdown()


async def recut(sim: ModuleType, placed: PlacedInstance) -> str:
    """Destroy the instance at ``placed`` and create it again, straight through NVML; its new MIG UUID."""
    async with nvml(sim) as devices:
        gpu = devices.gpu(0)
        devices.destroy(gpu, placed)
        return str(devices.create(gpu, placed).mig_uuid)


async def published(k: ScenarioApi, node: str) -> dict[str, str]:
    """Device name -> the MIG UUID the node's slices publish for it."""
    slices = await k.custom.list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
    )
    return {
        d["name"]: d["attributes"]["mig.dynamig.io/uuid"]["string"]
        for s in slices.get("items", [])
        for d in s["spec"].get("devices") or []
    }


async def allocated(k: ScenarioApi, name: str) -> dict[str, Any] | None:
    claim: dict[str, Any] = await k.custom.get_namespaced_custom_object(
        "resource.k8s.io", "v1", k.ns, "resourceclaims", name
    )
    return claim if allocated_device(claim) else None


async def test_an_instance_replaced_before_the_agent_saw_its_allocation_is_reported_on_the_claim(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """The scheduler allocates two published instances; someone destroys and re-creates one before the
    agent's next round. That round is the first to see the claims allocated: it tells the claim of the
    replaced one (and the GpuPartition, once) that the instance is not the one it was given, and the other
    claim nothing."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["A100-80GB"], state_file=None)
    node = make_node("replaced", labels={"dynamig.io/managed": "true"})
    async with nvml(sim) as devices:  # adopted by the agent's first round
        first = {d: str(devices.create(devices.gpu(0), p).mig_uuid) for d, p in PLACED.items()}
    settings = AgentSettings(node=node, settle_seconds=0.3, watch=False, inventory=Inventory.INSTANCES)
    async with nvml(sim) as devices:
        agent = NodeAgent(settings, KubeApi(kube_api), devices, AgentMetrics(CollectorRegistry(), node))
        await agent.reconcile_once()
        await agent.reconcile_once()
        assert await published(k, node) == first

        for name in ("held", "kept"):
            claim = resource_claim(name, {"firstAvailable": first_available(["1g.10gb"])})
            await k.custom.create_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaims", claim
            )
            await k.core.create_namespaced_pod(
                namespace, claim_pod(name, {"kubernetes.io/hostname": node}, claim=name)
            )
        got = await eventually(lambda: allocated(k, "held"), "claim held allocated", within_s=60)
        await eventually(lambda: allocated(k, "kept"), "claim kept allocated", within_s=60)
        device = str(allocated_device(got))
        before = first[device]
        after = await recut(sim, PLACED[device])  # no round of the agent has run since the allocations
        assert after != before

        await agent.reconcile_once()  # the first round that sees the claims allocated
        await agent.reconcile_once()
        assert (await published(k, node))[device] == after  # the slice now shows the new instance

    gpart = await asyncio.to_thread(crds.kubectl, "describe", "gpupartition", f"{node}-gpu0")
    lines = [x for x in gpart.stdout.splitlines() if "AllocatedInstanceReplaced" in x]
    assert len(lines) == 1, gpart.stdout
    described = await asyncio.to_thread(crds.kubectl, "describe", "resourceclaim", "-n", namespace, "held")
    text = " ".join(described.stdout.split())
    assert "AllocatedInstanceReplaced" in text and before in text and after in text, described.stdout
    other = await asyncio.to_thread(crds.kubectl, "describe", "resourceclaim", "-n", namespace, "kept")
    assert "AllocatedInstance" not in other.stdout, other.stdout
