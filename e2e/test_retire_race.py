"""Several free instances destroyed one after another, for a retire or for a cut, are each destroyed only
after the claims were read again: a claim allocated one of them while the agent was destroying another
keeps it.

Real: kube-apiserver (the claims, their allocations, the GpuPartition), the node agent's whole loop over the
NVML code path, in both inventories. Simulated: the GPU (one A100-80GB whose GPU-instance destroys take 1.5 s
each, as a slow driver's may) and the scheduler's write: the test writes the claim's allocation itself, as
kube-scheduler's PreBind does, while the agent is inside the first destroy.

Three free 1g.10gb at slices 4, 5 and 6 are retired together for a 3g.40gb at slice 4. Once NVML shows the
first destroy begun, a claim is allocated the instance the agent will reach last. That instance must survive:
the agent destroys the other two and keeps it (lifecycle.py: "a claim won the race"), and the 3g.40gb is not
cut over it. An agent that read the claims once
for the whole batch destroyed it about 1.5 s after the allocation was written (chaos seed 3 in the
partitionable inventory, with other work on the machine, lost an instance booked that way).

The cut, partitionable inventory: a booking of the 3g.40gb at slice 4 has the three free 1g.10gb in its way.
Once the first is destroyed, the booking is deleted (its pod gone) and the 1g.10gb at slice 6, free again in
the scheduler's view, is allocated to another claim. The agent reads the claims before the third destroy,
finds the booking gone and stops: the instance stays with its claim. An agent that read them once before
the cut destroyed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig import DRIVER_NAME
from dynamig.agent.controller import NodeAgent
from dynamig.demo.cluster import AllocationWatch, ScenarioApi, claim_pod, exactly, layout_text, resource_claim
from dynamig.demo.inprocess import agent_running, quick_agent_settings, whole_instances
from dynamig.devcluster import ControlPlane, eventually
from dynamig.geometry.model import device_name
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION

pytestmark = pytest.mark.controlplane

DESTROY_S = 1.5
FREE = [("1g.10gb", 4), ("1g.10gb", 5), ("1g.10gb", 6)]
FLOOR = [("3g.40gb", 4)]


async def set_layout(k: ScenarioApi, gpu: str, layout: list[tuple[str, int]]) -> None:
    await k.custom.patch_cluster_custom_object(
        GROUP, VERSION, GPU_PARTITION_PLURAL, gpu,
        {"spec": {"layout": [{"profile": p, "start": s} for p, s in layout], "offeredProfiles": ["1g.10gb"]}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


@contextlib.asynccontextmanager
async def agent_with_layout(
    k: ScenarioApi,
    kube_api: client.ApiClient,
    node: str,
    sim: ModuleType,
    inventory: Inventory,
    layout: list[tuple[str, int]],
    **gpu: Any,
) -> AsyncIterator[NodeAgent]:
    """The agent of ``node`` (one simulated A100-80GB, ``gpu``: its configure() settings) running, with
    ``layout`` made and settled on its GPU."""
    name = f"{node}-gpu0"
    sim.configure(gpus=["A100-80GB"], state_file=None, seed=node, **gpu)
    settings = dataclasses.replace(quick_agent_settings(node), inventory=inventory)
    async with agent_running(kube_api, node, sim, settings) as agent:
        await eventually(functools.partial(k.stable, name), f"GpuPartition {name}", within_s=60)
        await set_layout(k, name, layout)
        await eventually(functools.partial(k.stable, name, layout_text(layout)), f"{layout} made", 60)
        yield agent


def destroys_after(sim: ModuleType, since: int, t0: float) -> list[tuple[str, float]]:
    """Each GPU instance destroyed since history entry ``since``: its device and seconds after ``t0``."""
    history = sim.history()[since:]
    return [
        (device_name(0, e.profile, e.start), round(e.timestamp - t0, 2))
        for e in history
        if e.kind == "destroy-gi"
    ]


async def allocate(
    k: ScenarioApi, name: str, node: str, device: str, profile: str = "1g.10gb", guarded: bool = False
) -> None:
    """A claim for ``device`` and its allocation, written as kube-scheduler's PreBind writes one (with the
    binding conditions of a booking, and the waiting pod reserved on the claim, when ``guarded``). The pod
    names a scheduler nobody runs, so only the test books for it."""
    selector = f'device.attributes["{DRIVER_NAME}"].profile == "{profile}"'
    await k.custom.create_namespaced_custom_object(
        "resource.k8s.io", "v1", k.ns, "resourceclaims", resource_claim(name, exactly(selector))
    )
    result: dict[str, Any] = {"request": "gpu", "driver": DRIVER_NAME, "pool": node, "device": device}
    reserved: list[dict[str, str]] = []
    if guarded:
        result |= {"bindingConditions": [BINDING_READY], "bindingFailureConditions": [BINDING_FAILED]}
        pod = claim_pod(name, {"kubernetes.io/hostname": node}, claim=name)
        pod["spec"]["schedulerName"] = "nobody"
        made = await k.core.create_namespaced_pod(k.ns, pod)
        reserved = [{"resource": "pods", "name": name, "uid": made.metadata.uid}]
    allocation: dict[str, Any] = {
        "devices": {"results": [result]},
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        },
    }
    await k.custom.patch_namespaced_custom_object_status(
        "resource.k8s.io", "v1", k.ns, "resourceclaims", name,
        {"status": {"allocation": allocation, **({"reservedFor": reserved} if reserved else {})}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


@pytest.mark.parametrize("inventory", [Inventory.PARTITIONABLE, Inventory.INSTANCES])
async def test_a_claim_allocated_mid_retire_keeps_its_instance(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
    inventory: Inventory,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    node = make_node("retire-race", labels={"dynamig.io/managed": "true"})
    gpu = f"{node}-gpu0"
    watch = AllocationWatch(k)
    async with agent_with_layout(k, kube_api, node, sim, inventory, FREE, destroy_latency_s=DESTROY_S):
        since = len(sim.history())
        watch.start()
        try:
            await set_layout(k, gpu, FLOOR)

            first = await eventually(functools.partial(first_destroyed, sim, since), "the first destroy", 30)
            # The destroy is recorded once NVML returns; the agent goes on to the next one at once.
            left = [device_name(0, p, s) for p, s in FREE if device_name(0, p, s) != first]
            last = left[-1]
            t_alloc = time.time()
            await allocate(k, "won", node, last)

            def others_gone() -> bool | None:
                history = sim.history()[since:]
                gone = {device_name(0, e.profile, e.start) for e in history if e.kind == "destroy-gi"}
                return True if set(left[:-1]) | {first} <= gone else None

            await eventually(lambda: _async(others_gone()), "the other retired instances destroyed", 30)
            # Then several more rounds of the agent: the kept instance stays, the 3g.40gb waits for it.
            await asyncio.sleep(5.0)
            still = whole_instances(sim)
        finally:
            await watch.stop()
    destroys = destroys_after(sim, since, t_alloc)
    print(f"\n  {inventory.value}: first destroyed {first}; {last} allocated; destroys (s after): {destroys}")
    assert last not in [d for d, _ in destroys], destroys
    assert last in still, still
    assert device_name(0, *FLOOR[0]) not in still, "the 3g.40gb was cut over the kept instance"
    assert watch.destroyed_while_allocated(sim.history()[since:]) == []


IN_THE_WAY = FREE
BOOKED = ("3g.40gb", 4)


async def test_a_cut_whose_booking_goes_mid_cut_leaves_the_next_instance_to_its_new_claim(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    node = make_node("cut-race", labels={"dynamig.io/managed": "true"})
    watch = AllocationWatch(k)
    partitionable = Inventory.PARTITIONABLE
    async with agent_with_layout(
        k, kube_api, node, sim, partitionable, IN_THE_WAY, destroy_latency_s=DESTROY_S
    ):
        since = len(sim.history())
        watch.start()
        try:
            await allocate(k, "booked", node, device_name(0, *BOOKED), BOOKED[0], guarded=True)

            first = await eventually(functools.partial(first_destroyed, sim, since), "the first destroy", 30)
            await k.custom.delete_namespaced_custom_object(
                "resource.k8s.io", "v1", k.ns, "resourceclaims", "booked"
            )
            # The destroy is recorded once NVML returns; the next one is under way by then: take the last.
            other = [device_name(0, p, s) for p, s in IN_THE_WAY if device_name(0, p, s) != first][-1]
            t_alloc = time.time()
            await allocate(k, "next", node, other)
            await asyncio.sleep(3 * DESTROY_S + 2.0)  # the cut's second destroy would be long done
            still = whole_instances(sim)
        finally:
            await watch.stop()
    destroys = destroys_after(sim, since, t_alloc)
    print(
        f"\n  cut: first destroyed {first}; booking gone, {other} allocated; destroys (s after): {destroys}"
    )
    assert other in still, (other, still, destroys)
    assert watch.destroyed_while_allocated(sim.history()[since:]) == []


async def first_destroyed(sim: ModuleType, since: int) -> str | None:
    """The device of the first GPU instance destroyed since history entry ``since``; None while none."""
    gone = [e for e in sim.history()[since:] if e.kind == "destroy-gi"]
    return device_name(0, gone[0].profile, gone[0].start) if gone else None


async def _async(value: Any) -> Any:
    return value
