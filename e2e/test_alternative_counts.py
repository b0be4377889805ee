"""Claims planned as the scheduler will place them: a ``firstAvailable`` request whose alternatives ask
different counts, and the claims of one pod (all on the node the pod binds to).

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

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.backends.nvml import fresh_simulated_nvml
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


async def test_a_pods_two_claims_are_cut_on_one_node_not_one_on_each(
    crds: ControlPlane, kube_api: client.ApiClient, namespace: str, make_node: Callable[..., str]
) -> None:
    # Instances inventory. Nodes a and b each have room for one 3g.40gb beside a 4g.40gb running a process;
    # node c is idle. One pod asks for two claims of one 3g.40gb each: the scheduler binds it to one node
    # with both, so both are cut on c, and neither a nor b is cut for half of it.
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    pool = namespace[-8:]
    nodes = [
        make_node(p, labels={"dynamig.io/managed": "true", "test-pool": pool})
        for p in ("half-a", "half-b", "idle-c")
    ]
    sims = {n: fresh_simulated_nvml() for n in nodes}
    for n, sim in sims.items():
        sim.configure(gpus=["A100-80GB"], state_file=None, seed=n)
    operator = OperatorSettings(kubeconfig=crds.kubeconfig_path, standalone=True, resync_seconds=1.0)
    try:
        async with contextlib.AsyncExitStack() as stack:
            for n in nodes:
                settings = dataclasses.replace(quick_agent_settings(n), inventory=Inventory.INSTANCES)
                await stack.enter_async_context(agent_running(kube_api, n, sims[n], settings))
            for n in nodes[:2]:
                gpu = f"{n}-gpu0"
                await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
                await k.set_layout(gpu, [("4g.40gb", 0)])
                part = await eventually(
                    functools.partial(k.stable, gpu, layout_text([("4g.40gb", 0)])), f"{gpu} cut", within_s=60
                )
                (inst,) = part["status"]["instances"]
                sims[n].attach_process(inst["migUUID"], 4242)  # busy: never moved
            await stack.enter_async_context(operator_running(crds.kubeconfig_path, settings=operator))
            await k.create_policy(
                f"pair-{pool}",
                {
                    "nodeSelector": {"matchLabels": {"test-pool": pool}},
                    "mode": "Dynamic",
                    "batchWindowSeconds": 1,
                    "cooldownSeconds": 0,
                    "baseline": {},
                    "disruptionBudget": {"maxGpusReshaping": 3},
                },
            )
            three = {"firstAvailable": [alternative("half", "3g.40gb", 1)]}
            for name in ("left", "right"):
                await k.custom.create_namespaced_custom_object(
                    "resource.k8s.io", "v1", namespace, "resourceclaims", resource_claim(name, three)
                )
            body = claim_pod("pair", {"test-pool": pool}, claim="left")
            body["spec"]["resourceClaims"].append({"name": "right", "resourceClaimName": "right"})
            body["spec"]["containers"][0]["resources"]["claims"].append({"name": "right"})
            await k.core.create_namespaced_pod(namespace, body)

            async def bound() -> str | None:
                return (await k.core.read_namespaced_pod("pair", namespace)).spec.node_name or None

            assert await eventually(bound, "the two-claim pod bound", within_s=90) == nodes[2]
            for n in nodes[:2]:  # neither half-busy node was cut for a part of the pod
                cuts = [e for e in sims[n].history() if e.kind == "create-gi" and e.profile == "3g.40gb"]
                assert cuts == [], (n, cuts)
    finally:
        for sim in sims.values():
            sim.configure(gpus=[], state_file=None)
