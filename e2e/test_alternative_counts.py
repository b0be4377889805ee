"""A ``firstAvailable`` request whose alternatives ask different counts is planned as the scheduler places it.

Real: the control plane (kube-apiserver, kube-scheduler allocating ``firstAvailable`` in order, controller
manager), the node agent and the operator (Kopf, standalone) in this process. Simulated: the GPU (one
A100-80GB, pre-cut into two free 3g.40gb halves) and the node.

The claim asks "eight 1g.10gb, else one 7g.80gb". Eight never fit on one A100 (seven placements), so the
scheduler can only ever give it the 7g.80gb. Under the instances inventory the operator must plan exactly
that (with one count for every alternative it would plan eight of either and nothing could be cut); under
the partitionable inventory the scheduler books the 7g.80gb placement itself. Either way the pod binds on one
7g.80gb and nothing else is cut.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.demo.cluster import ScenarioApi, allocated_device, claim_pod, layout_text, resource_claim
from dynamig.demo.inprocess import agent_running, operator_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.kube.gpupartition import Inventory
from dynamig.operator.settings import OperatorSettings

pytestmark = pytest.mark.controlplane

HALVES = [("3g.40gb", 0), ("3g.40gb", 4)]
PROFILE = 'device.attributes["mig.dynamig.io"].profile'


@pytest.fixture
def sim() -> Iterator[ModuleType]:
    from dynamig.backends.nvml import load_nvml

    module: ModuleType = load_nvml("simulated")
    module.configure(gpus=["A100-80GB"], state_file=None)
    yield module
    module.configure(gpus=[], state_file=None)


def alternative(name: str, profile: str, count: int) -> dict[str, Any]:
    return {
        "name": name,
        "deviceClassName": "mig.dynamig.io",
        "selectors": [{"cel": {"expression": f'{PROFILE} == "{profile}"'}}],
        "allocationMode": "ExactCount",
        "count": count,
    }


@pytest.mark.parametrize("inventory", [Inventory.INSTANCES, Inventory.PARTITIONABLE])
async def test_eight_small_or_one_whole_binds_on_one_whole_gpu_and_cuts_nothing_else(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
    inventory: Inventory,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    pool = namespace[-8:]
    node = make_node("counts", labels={"dynamig.io/managed": "true", "test-pool": pool})
    gpu = f"{node}-gpu0"
    settings = dataclasses.replace(quick_agent_settings(node), inventory=inventory)
    operator = OperatorSettings(kubeconfig=crds.kubeconfig_path, standalone=True, resync_seconds=1.0)
    async with agent_running(kube_api, node, sim, settings):
        await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
        await k.set_layout(gpu, HALVES)
        await eventually(functools.partial(k.stable, gpu, layout_text(HALVES)), "pre-cut halves", within_s=60)
        async with operator_running(crds.kubeconfig_path, settings=operator):
            await k.create_policy(
                f"counts-{pool}",
                {
                    "nodeSelector": {"matchLabels": {"test-pool": pool}},
                    "mode": "Dynamic",
                    "batchWindowSeconds": 1,
                    "cooldownSeconds": 0,
                },
            )
            request = {
                "firstAvailable": [alternative("many", "1g.10gb", 8), alternative("whole", "7g.80gb", 1)]
            }
            await k.custom.create_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaims", resource_claim("c", request)
            )
            await k.core.create_namespaced_pod(
                namespace, claim_pod("p", {"kubernetes.io/hostname": node}, claim="c")
            )

            async def bound() -> str | None:
                return (await k.core.read_namespaced_pod("p", namespace)).spec.node_name or None

            assert await eventually(bound, "the pod bound", within_s=90) == node
            claim = await k.claim_of("p") or await k.custom.get_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaims", "c"
            )
            results = claim["status"]["allocation"]["devices"]["results"]
            assert [r["request"] for r in results] == ["gpu/whole"] and allocated_device(
                claim
            ) == "gpu0-7g80gb-s0"
            part = await eventually(
                functools.partial(k.stable, gpu, layout_text([("7g.80gb", 0)])), "one whole GPU", within_s=60
            )
            assert part is not None
