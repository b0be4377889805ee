"""Making room on a node that runs its pods: the victims of a preemption really stop and the waiting pod runs
on the instance cut for it.

Real: the control plane (kube-scheduler, whose own preemption cannot free a DRA device;
kube-controller-manager with the Deployment, ReplicaSet, ResourceClaim and garbage-collector controllers), a
kubelet and containerd with runc (see ``test_real_node``), the dynamig agent as its own process with its
kubelet plugin, and the operator exactly as ``dynamig operator --standalone`` runs it (a task of the test's
event loop).
Simulated: the A100-80GB (simnvml; its state file's history is the record of every create and destroy).

Scenario, in both inventories:
1. The GPU cut into seven 1g.10gb; a Deployment of seven pods at priority 0 runs one on each (each container
   reports its devices, then waits; it exits 143 when sent SIGTERM).
2. A policy with ``preemption.mode: Evict`` governs the node; a pod at priority 1000 asks for a 3g.40gb.
3. The operator holds slice 4 and evicts the three pods under slices 4-7 through the Eviction API; the kubelet
   sends their containers SIGTERM (each exits 143, not 137: no kill after the grace period), unprepares their
   claims; the agent destroys their instances and cuts the 3g.40gb at slice 4; the kubelet prepares it and the
   waiting pod's container reports that instance's device nodes.
4. The four other pods keep their containers; the Deployment's three replacements wait (priority 0 evicts
   nobody: no ping-pong), and nothing more is evicted while they wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.demo.cluster import allocated_device
from dynamig.demo.inprocess import operator_running
from dynamig.devcluster import eventually
from dynamig.devcluster.node import EXIT_ON_SIGTERM, RealNode
from dynamig.operator.metrics import OperatorMetrics
from real_node_scenario import NodeScenario, node_scenario, report_pod

pytestmark = pytest.mark.controlplane

SEVEN = [("1g.10gb", s) for s in range(7)]
GRACE_S = 10  # the victims' terminationGracePeriodSeconds (runnable's)


@pytest.fixture
async def scenario(
    real_node: RealNode, kube_api: client.ApiClient, namespace: str
) -> AsyncIterator[NodeScenario]:
    async with node_scenario(real_node, kube_api, namespace) as s:
        yield s


@contextlib.asynccontextmanager
async def agent_inventory(node: RealNode, inventory: str) -> AsyncIterator[None]:
    """The node's agent publishing ``inventory``; the agent as it was afterwards."""
    before = node.agent_args
    gpus, kubeconfig, *extra = before
    await asyncio.to_thread(node.start_agent, gpus, kubeconfig, *extra, f"--inventory={inventory}")
    try:
        yield
    finally:
        await asyncio.to_thread(node.start_agent, *before)


async def record_terminations(core: client.CoreV1Api, namespace: str, out: dict[str, dict[str, Any]]) -> None:
    """Fills ``out``, pod name -> what the kubelet reported of its container once it ended (exit code,
    reason) and whether the pod was being deleted then, from a watch: the pod object goes right after."""
    w = watch.Watch()
    async for event in w.stream(core.list_namespaced_pod, namespace, label_selector="app=low"):
        pod = event["object"]
        for status in (pod.status.container_statuses if pod.status else None) or []:
            ended = status.state.terminated if status.state else None
            if ended is not None:
                out[pod.metadata.name] = {
                    "exit_code": ended.exit_code,
                    "reason": ended.reason,
                    "deleting": pod.metadata.deletion_timestamp is not None,
                }


def low_deployment(node: str, pool: str) -> dict[str, Any]:
    """Seven replicas at priority 0, one 1g.10gb each, running the device report on ``node``. Pure."""
    pod = report_pod("low", node, "small")
    spec = {**pod["spec"], "restartPolicy": "Always", "priorityClassName": f"low-{pool}"}
    labels = {"app": "low"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "low"},
        "spec": {
            "replicas": 7,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": spec},
        },
    }


async def scaled_to_zero(apps: client.AppsV1Api, core: client.CoreV1Api, namespace: str) -> None:
    """The low Deployment scaled to 0 and its pods gone, then deleted: deleted at once, its ReplicaSet could
    make a replacement while the deletion propagates."""
    with contextlib.suppress(ApiException):
        await apps.patch_namespaced_deployment_scale("low", namespace, {"spec": {"replicas": 0}})

    async def gone() -> bool | None:
        return None if (await core.list_namespaced_pod(namespace, label_selector="app=low")).items else True

    await eventually(gone, "the low pods gone", within_s=90, every_s=0.5)
    with contextlib.suppress(ApiException):
        await apps.delete_namespaced_deployment("low", namespace)


@pytest.mark.parametrize("inventory", ["partitionable", "instances"])
async def test_victims_stop_on_sigterm_and_the_preemptor_runs_on_the_cut(
    scenario: NodeScenario, inventory: str
) -> None:
    s, k = scenario, scenario.k
    node = s.node.name
    cp = s.node.cluster
    apps = client.AppsV1Api(k.core.api_client)
    pool = uuid.uuid4().hex[:8]
    policy = f"room-{pool}"
    metrics = OperatorMetrics()
    ended: dict[str, dict[str, Any]] = {}
    await k.priority_classes({f"low-{pool}": {"value": 0}, f"high-{pool}": {"value": 1000}})
    await k.claim_template("small", ["1g.10gb"])
    await k.claim_template("big", ["3g.40gb"])
    await asyncio.to_thread(cp.kubectl, "label", "node", node, f"test-pool={pool}", "--overwrite")
    watcher = asyncio.create_task(record_terminations(k.core, k.ns, ended))
    try:
        async with agent_inventory(s.node, inventory):
            # ---- 1. seven pods at priority 0 run, one on each 1g.10gb -----------------------------------
            await eventually(functools.partial(k.stable, s.gpu), "the agent's GpuPartition", within_s=60)
            await k.set_layout(s.gpu, SEVEN)
            await apps.create_namespaced_deployment(k.ns, low_deployment(node, pool))

            async def seven_reporting() -> list[str] | None:
                pods = (await k.core.list_namespaced_pod(k.ns, label_selector="app=low")).items
                names = sorted(p.metadata.name for p in pods)
                reports = [await s.reported(n) for n in names]
                return names if len(names) == 7 and all(reports) else None

            low = await eventually(seven_reporting, "seven low pods reporting", within_s=180)
            placed = {p: await s.instance_of(p) for p in low}
            containers = {p: await s.container(p) for p in low}
            assert sorted(i["start"] for i in placed.values()) == list(range(7)), placed
            # The 3g.40gb at slice 4 covers memory slices 4-7: the 1g.10gb at 4, 5 and 6 (the fewest pods).
            victims = sorted(p for p, i in placed.items() if i["start"] >= 4)
            kept = sorted(set(low) - set(victims))
            history_at = len(s.nvml_history())

            async with operator_running(cp.kubeconfig_path, metrics):
                await k.create_policy(
                    policy,
                    {
                        "nodeSelector": {"matchLabels": {"test-pool": pool}},
                        "gpuProducts": ["A100-80GB"],
                        "mode": "Dynamic",
                        "allowedProfiles": ["1g.10gb", "3g.40gb"],
                        "batchWindowSeconds": 1,
                        "cooldownSeconds": 0,
                        "preemption": {"mode": "Evict", "minRunSeconds": 0, "gpuCooldownSeconds": 0},
                    },
                )

                async def governs() -> bool | None:
                    st = (await k.policy(policy)).get("status") or {}
                    return True if st.get("matchedGpus") == 1 else None

                await eventually(governs, "the policy to govern the GPU", within_s=30)

                # ---- 2. priority 1000 asks for a 3g.40gb --------------------------------------------
                big = report_pod("big", node, "big")
                big["spec"]["priorityClassName"] = f"high-{pool}"
                t0 = time.monotonic()
                await k.core.create_namespaced_pod(k.ns, big)
                got = await eventually(functools.partial(s.reported, "big"), "big reporting", within_s=120)
                waited = time.monotonic() - t0
                print(
                    f"\nreal node ({inventory}): preemptor created -> running on its cut in {waited:.1f}s "
                    f"(goal: victims' grace {GRACE_S}s + 15s)"
                )

                # ---- 3. the victims stopped on SIGTERM; the preemptor runs on the 3g.40gb at slice 4 --
                inst = await s.instance_of("big", state="in-use")
                assert (inst["profile"], inst["start"]) == ("3g.40gb", 4), inst
                assert got.devices == s.expected_devices(inst), (got.devices, inst)
                assert got.env["DYNAMIG_MIG_UUIDS"] == inst["migUUID"], got.env

                async def victims_ended() -> bool | None:
                    return True if set(victims) <= set(ended) else None

                await eventually(victims_ended, "the victims' containers reported ended", within_s=30)
                for p in victims:
                    assert ended[p]["deleting"], (p, ended[p])
                    assert ended[p]["exit_code"] == EXIT_ON_SIGTERM, (p, ended[p])
                assert set(ended) == set(victims), f"only the victims ended: {ended}"
                since = s.nvml_history()[history_at:]
                destroyed = {e["mig_uuid"] for e in since if e["kind"] == "destroy-ci"}
                assert {placed[p]["migUUID"] for p in victims} <= destroyed, since
                assert not destroyed & {placed[p]["migUUID"] for p in kept}, since
                cuts = [(e["profile"], e["start"]) for e in since if e["kind"] == "create-gi"]
                assert ("3g.40gb", 4) in cuts, since

                # ---- 4. no ping-pong: the replacements wait, nothing more is evicted ----------------
                async def replacements_waiting() -> list[str] | None:
                    pods = (await k.core.list_namespaced_pod(k.ns, label_selector="app=low")).items
                    new = [p.metadata.name for p in pods if p.metadata.name not in low]
                    waiting = [n for n in new if await k.unschedulable(n)]
                    return waiting if len(waiting) == 3 else None

                replacements = await eventually(replacements_waiting, "three replacements waiting", 60)
                await asyncio.sleep(10)  # rounds go on: an operator that ping-pongs would evict now
                for p in replacements:
                    assert allocated_device(await k.claim_of(p)) is None, p
                for p in kept:
                    assert await s.container(p) == containers[p], f"{p} kept its container"
                assert await s.container("big") is not None
                sample = metrics.registry.get_sample_value
                assert (
                    sample("dynamig_operator_evictions_total", {"policy": policy, "result": "evicted"}) == 3
                )

                async def released() -> bool | None:
                    return None if (await k.partition(s.gpu))["spec"].get("holds") else True

                await eventually(released, "the hold released once the preemptor is served", within_s=30)
                assert waited <= GRACE_S + 15, f"the preemptor ran {waited:.1f}s after it was created"
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await scaled_to_zero(apps, k.core, k.ns)
        await k.delete_policy(policy)
        await asyncio.to_thread(cp.kubectl, "label", "node", node, "test-pool-")
        await k.delete_priority_classes([f"low-{pool}", f"high-{pool}"])
