"""The operator never cuts on a GPU with an uncleared critical XID: the demand goes to the healthy GPU.

Real: etcd, kube-apiserver, kube-scheduler, kube-controller-manager; the operator (standalone, its Kopf loop
and planner) and the node agent's whole code path (its XID watcher thread on the ``pynvml`` API) as tasks of
the test's event loop. Simulated: two H100-80GB GPUs (simnvml, whose XID events follow nvml.h:
tests/unit/test_simnvml_fidelity.py) and the node (no kubelet: pods are bound, never run).

Scenario: both GPUs empty, the instances inventory (the operator cuts ahead of the scheduler). XID 48 (a
double-bit ECC error: a fault of the whole GPU) on gpu0: the agent sets ``DevicesHealthy`` False on its
GpuPartition. A Dynamic policy then sees two claims for a 1g.10gb. Asserted: both are allocated devices of
gpu1, and the operator never wrote gpu0's ``spec.layout`` (no layout, no ``layout-written-at`` annotation).
Without the rule (``dynamig.operator.inventory``: such a GPU is unusable) the planner cuts gpu0, whose new
instances the agent publishes tainted (or not at all), and neither claim is allocated within 90 s.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.agent.health.devices import CONDITION
from dynamig.demo.cluster import ScenarioApi, allocated_device, claim_pod, exactly, resource_claim
from dynamig.demo.inprocess import agent_running, operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.operator.inventory import LAYOUT_WRITTEN_ANNOTATION
from dynamig.operator.metrics import OperatorMetrics

pytestmark = pytest.mark.controlplane

PROFILE = 'device.attributes["mig.dynamig.io"].profile'


async def _sick(k: ScenarioApi, gpu: str) -> dict[str, Any] | None:
    part = await k.partition(gpu)
    conds = (part.get("status") or {}).get("conditions") or []
    return part if any(c["type"] == CONDITION and c["status"] == "False" for c in conds) else None


async def _allocated(k: ScenarioApi, claim: str) -> str | None:
    got = await k.custom.get_namespaced_custom_object("resource.k8s.io", "v1", k.ns, "resourceclaims", claim)
    return allocated_device(got)


async def test_the_operator_never_cuts_on_a_gpu_with_an_uncleared_critical_xid(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["H100-80GB", "H100-80GB"], state_file=None)
    pool = uuid.uuid4().hex[:8]
    node = make_node("xidplan", labels={"dynamig.io/managed": "true", "test-pool": pool})
    sick, well = f"{node}-gpu0", f"{node}-gpu1"
    policy = f"xid-{pool}"
    async with agent_running(kube_api, node, sim), operator_running(crds.kubeconfig_path, OperatorMetrics()):
        for gpu in (sick, well):
            await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
        sim.inject_xid(0, 48)
        await eventually(functools.partial(_sick, k, sick), f"{sick} DevicesHealthy False", within_s=30)
        await k.create_policy(
            policy,
            {
                "nodeSelector": {"matchLabels": {"test-pool": pool}},
                "mode": "Dynamic",
                "batchWindowSeconds": 1,
            },
        )
        try:
            for name in ("first", "second"):
                body = resource_claim(name, exactly(f'{PROFILE} == "1g.10gb"'))
                await k.custom.create_namespaced_custom_object(
                    "resource.k8s.io", "v1", namespace, "resourceclaims", body
                )
                await k.core.create_namespaced_pod(
                    namespace, claim_pod(name, {"test-pool": pool}, claim=name)
                )
            devices = [
                await eventually(functools.partial(_allocated, k, name), f"{name} allocated", within_s=90)
                for name in ("first", "second")
            ]
            assert all(d.startswith("gpu1-1g10gb-") for d in devices), devices
            after = await k.partition(sick)
            written = (after["metadata"].get("annotations") or {}).get(LAYOUT_WRITTEN_ANNOTATION)
            assert written is None and not after["spec"].get("layout"), after
        finally:
            await k.delete_pods(["first", "second"])
            await k.delete_policy(policy)
