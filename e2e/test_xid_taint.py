"""A critical XID on one MIG instance keeps new claims off that device, and only that one.

Real: etcd, kube-apiserver, kube-scheduler (DRA allocation from the node's ResourceSlices, first fit in device
name order, honouring device taints), kube-controller-manager; the node agent's whole code path (its XID
watcher thread on the ``pynvml`` API) as a task of the test's event loop. Simulated: one H100-80GB (simnvml,
whose XID events follow nvml.h: tests/unit/test_simnvml_fidelity.py) and the node (no kubelet: pods are bound,
never run).

Scenario: the GPU holds two free 1g.10gb instances, ``gpu0-1g10gb-s0`` (first in name order, so the
scheduler tries it first) and ``gpu0-1g10gb-s1``. XID 94 (contained ECC error) on the first one's GPU
instance: where the API server keeps device taints (DRADeviceTaints: 1.36 on) the slice carries
``mig.dynamig.io/xid=94:NoSchedule`` on that device alone, elsewhere the device leaves the slice. A claim for
one 1g.10gb is then allocated the other device; a second one is not allocated at all while the sick device is
the only one left. The GpuPartition says which XID (``DevicesHealthy`` False) and a ``CriticalXid`` Warning
Event tells it.

Without the taint the first claim gets ``gpu0-1g10gb-s0`` (first fit) and the second the other: both checks
fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.agent.health.devices import CONDITION
from dynamig.agent.health.xid import TAINT_KEY
from dynamig.demo.cluster import ScenarioApi, allocated_device, claim_pod, exactly, resource_claim
from dynamig.demo.inprocess import agent_running, operator_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.versions import KubeTarget
from dynamig.devcluster.waiting import event_posted
from dynamig.kube.names import GROUP, POLICY_PLURAL, VERSION
from dynamig.operator.metrics import OperatorMetrics

pytestmark = [pytest.mark.controlplane, pytest.mark.matrix]

PROFILE = 'device.attributes["mig.dynamig.io"].profile'
SICK, WELL = "gpu0-1g10gb-s0", "gpu0-1g10gb-s1"


async def node_devices(k: ScenarioApi, node: str) -> dict[str, dict[str, Any]]:
    got = await k.custom.list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
    )
    return {d["name"]: d for s in got["items"] for d in s["spec"].get("devices") or []}


async def test_a_critical_xid_on_one_instance_keeps_new_claims_off_just_that_device(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    kube_target: KubeTarget,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["H100-80GB"], state_file=None)
    node = make_node("xid", labels={"dynamig.io/managed": "true", "xid-pool": uuid.uuid4().hex[:8]})
    gpu = f"{node}-gpu0"
    where = {"kubernetes.io/hostname": node}

    async with agent_running(kube_api, node, sim):

        async def created() -> dict[str, Any] | None:
            try:
                return await k.partition(gpu)
            except client.ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        await eventually(created, f"{gpu} created", within_s=60)
        await k.set_layout(gpu, [("1g.10gb", 0), ("1g.10gb", 1)])

        async def both_published() -> dict[str, Any] | None:
            devices = await node_devices(k, node)
            return devices if {SICK, WELL} <= set(devices) else None

        await eventually(both_published, f"{SICK} and {WELL} published", within_s=60)
        gi = next(
            g["id"] for g in sim.snapshot()["gpus"][0]["gpu_instances"] if g["start"] == 0 and g["size"] == 1
        )
        sim.inject_xid(0, 94, gi_id=gi, ci_id=0)
        injected = time.monotonic()

        async def marked() -> dict[str, dict[str, Any]] | None:
            devices = await node_devices(k, node)
            sick = devices.get(SICK)
            return devices if sick is None or sick.get("taints") else None

        devices = await eventually(marked, f"{SICK} tainted or withdrawn", within_s=30, every_s=0.05)
        took = time.monotonic() - injected
        served = kube_target.minor >= 36 or "DRADeviceTaints" in kube_target.feature_gates
        if served:
            assert devices[SICK]["taints"] == [
                {
                    "key": TAINT_KEY,
                    "value": "94",
                    "effect": "NoSchedule",
                    "timeAdded": devices[SICK]["taints"][0]["timeAdded"],
                }
            ], devices[SICK]
        else:
            assert SICK not in devices, devices
        assert WELL in devices and not devices[WELL].get("taints"), devices  # the GPU's other device serves
        print(
            f"\n  {kube_target.name}: {SICK} {'tainted' if served else 'withdrawn'} {took:.2f}s after XID 94"
        )

        for name in ("first", "second"):
            body = resource_claim(name, exactly(f'{PROFILE} == "1g.10gb"'))
            await k.custom.create_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaims", body
            )
            await k.core.create_namespaced_pod(namespace, claim_pod(name, where, claim=name))

            async def allocated(claim: str = name) -> str | None:
                got = await k.custom.get_namespaced_custom_object(
                    "resource.k8s.io", "v1", namespace, "resourceclaims", claim
                )
                return allocated_device(got)

            if name == "first":
                device = await eventually(allocated, "the first claim allocated", within_s=60)
                assert device == WELL, device
            else:
                with pytest.raises(TimeoutError):  # the sick device is all that is left: never allocated
                    await eventually(allocated, "the second claim allocated", within_s=15)

        part = await k.partition(gpu)
        cond = next(c for c in part["status"]["conditions"] if c["type"] == CONDITION)
        assert cond["status"] == "False" and "XID 94" in cond["message"] and SICK in cond["message"], cond
        (event, *_) = await event_posted(
            k.core, "default", gpu, "CriticalXid", event_type="Warning", within_s=30
        )
        assert "Contained ECC error" in event["message"], event
        await k.delete_pods(["first", "second"])


@pytest.mark.parametrize("asked_by", ["agent flag", "policy"])
async def test_a_no_execute_xid_taint_moves_the_pod_off_its_device_and_spares_the_gpus_other_instance(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    kube_target: KubeTarget,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
    asked_by: str,
) -> None:
    """NoExecute asked by the agent's ``--xid-effect=NoExecute``, or by a policy's ``spec.health.xidEffect``
    (the agent's flag left at NoSchedule; the operator writes the GPU's ``spec.xidEffect``): an XID 94 on the
    instance a pod holds taints that device NoExecute, and kube-controller-manager's device-taint eviction
    controller evicts the pod (DRADeviceTaints: on from 1.36); the pod on the GPU's other instance stays."""
    if kube_target.minor < 36 and "DRADeviceTaints" not in kube_target.feature_gates:
        pytest.skip(f"{kube_target.name} serves no device taints: the sick device is withdrawn instead")
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["H100-80GB"], state_file=None)
    pool = uuid.uuid4().hex[:8]
    node = make_node("xidexec", labels={"dynamig.io/managed": "true", "test-pool": pool})
    gpu = f"{node}-gpu0"
    where = {"kubernetes.io/hostname": node}
    by_flag = asked_by == "agent flag"
    settings = dataclasses.replace(
        quick_agent_settings(node), xid_effect="NoExecute" if by_flag else "NoSchedule"
    )
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(agent_running(kube_api, node, sim, settings))
        await eventually(lambda: _created(k, gpu), f"{gpu} created", within_s=60)
        if not by_flag:  # a Static policy: the operator changes no layout, and writes the taint effect
            await stack.enter_async_context(operator_running(crds.kubeconfig_path, OperatorMetrics()))
            policy = {"nodeSelector": {"matchLabels": {"test-pool": pool}}, "mode": "Static",
                      "health": {"xidEffect": "NoExecute"}}  # fmt: skip
            await k.create_policy(f"xid-{pool}", policy)

            async def effect_written() -> bool | None:
                return True if (await k.partition(gpu))["spec"].get("xidEffect") == "NoExecute" else None

            await eventually(effect_written, f"{gpu}'s spec.xidEffect written by the operator", within_s=60)
        await k.set_layout(gpu, [("1g.10gb", 0), ("1g.10gb", 1)])

        async def both_published() -> bool | None:
            return True if {SICK, WELL} <= set(await node_devices(k, node)) else None

        await eventually(both_published, f"{SICK} and {WELL} published", within_s=60)
        for name, device in (("sick", SICK), ("well", WELL)):
            start = int(device.rsplit("-s", 1)[1])
            selector = (
                f'{PROFILE} == "1g.10gb" && device.attributes["mig.dynamig.io"].placementStart == {start}'
            )
            body = resource_claim(name, exactly(selector))
            await k.custom.create_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaims", body
            )
            await k.core.create_namespaced_pod(namespace, claim_pod(name, where, claim=name))
            await eventually(functools.partial(k.node_of, name), f"pod {name} bound", within_s=60)
        gi = next(
            g["id"] for g in sim.snapshot()["gpus"][0]["gpu_instances"] if g["start"] == 0 and g["size"] == 1
        )
        sim.inject_xid(0, 94, gi_id=gi, ci_id=0)

        async def evicted() -> bool | None:
            try:
                pod = await k.core.read_namespaced_pod("sick", namespace)
            except client.ApiException as exc:
                return True if exc.status == 404 else None
            return True if pod.metadata.deletion_timestamp is not None else None

        await eventually(evicted, "the pod on the tainted device evicted", within_s=60)
        devices = await node_devices(k, node)
        assert devices[SICK]["taints"][0]["effect"] == "NoExecute", devices[SICK]
        well = await k.core.read_namespaced_pod("well", namespace)
        assert well.metadata.deletion_timestamp is None, "the GPU's other instance keeps its pod"
        assert not devices[WELL].get("taints"), devices[WELL]
        if not by_flag:  # the GPU leaves its only policy: the effect is withdrawn, the agent's flag again
            await k.custom.delete_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL, f"xid-{pool}")

            async def effect_withdrawn() -> bool | None:
                return True if "xidEffect" not in (await k.partition(gpu))["spec"] else None

            await eventually(effect_withdrawn, f"{gpu}'s spec.xidEffect withdrawn", within_s=60)


async def _created(k: ScenarioApi, gpu: str) -> dict[str, Any] | None:
    try:
        return await k.partition(gpu)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
