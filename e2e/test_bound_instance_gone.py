"""A pod bound to a free instance that was destroyed outside dynamig before the agent saw the allocation: the
agent makes the instance again and reports its MIG UUID on the claim, without waiting for the kubelet's
prepare.

Real: kube-apiserver (the claim, its allocation, the GpuPartition) and the node agent's whole loop over the
NVML code path, partitionable inventory. Simulated: the GPU (one A100-80GB) and what happens behind the
agent's back: under the agent's lock (between two of its rounds) the free 1g.10gb at slice 6 is destroyed
through NVML, as an administrator's `nvidia-smi mig -dci -dgi` would, and a claim is allocated that instance
without binding conditions, as kube-scheduler allocates a free instance from a slice that still lists it.
The floor is empty, so no reshape would make it again: only the allocation can.

Asserted: within 30 s an instance exists at slice 6 and the claim's ``status.devices`` names its MIG UUID.
The agent before this change left it to the kubelet plugin's prepare (the chaos suite, which runs no
kubelet, saw such a pod bound to a missing device for its whole 60 s, partitionable seed 6).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.agent.nvml.device import NvmlDevices
from dynamig.demo.cluster import ScenarioApi, layout_text
from dynamig.demo.inprocess import whole_instances
from dynamig.devcluster import ControlPlane, eventually
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance, device_name
from dynamig.kube.gpupartition import Inventory
from test_retire_race import agent_with_layout, allocate, set_layout

pytestmark = pytest.mark.controlplane

Y = ("1g.10gb", 6)


async def test_a_bound_allocation_of_an_instance_destroyed_outside_is_made_again_and_reported(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    node = make_node("gone", labels={"dynamig.io/managed": "true"})
    gpu = f"{node}-gpu0"
    y = device_name(0, *Y)
    async with agent_with_layout(k, kube_api, node, sim, Inventory.PARTITIONABLE, [Y]) as agent:
        await set_layout(k, gpu, [])  # Y stays, free and bookable; nothing would make it again
        await eventually(functools.partial(k.stable, gpu, layout_text([Y])), "Y kept free", within_s=60)
        before = whole_instances(sim)[y]
        async with agent.lock:
            devices = NvmlDevices(sim, load_catalog())
            devices.init()
            try:
                (g,) = devices.discover()[0]
                devices.destroy(g, PlacedInstance(Y[1], Y[0]))
            finally:
                devices.shutdown()
            assert y not in whole_instances(sim)
            await allocate(k, "bound", node, y)

        async def reported() -> str | None:
            claim = await k.custom.get_namespaced_custom_object(
                "resource.k8s.io", "v1", k.ns, "resourceclaims", "bound"
            )
            entries: list[dict[str, Any]] = (claim.get("status") or {}).get("devices") or []
            migs = [(e.get("data") or {}).get("migUUID") for e in entries if e.get("device") == y]
            return migs[0] if migs and migs[0] else None

        mig = await eventually(reported, "the claim reported with an instance", within_s=30)
        now = whole_instances(sim)
    print(f"\n  {y}: was {before}, destroyed outside; made again as {now.get(y)}, reported {mig}")
    assert now.get(y) == mig != before, (now, mig, before)
