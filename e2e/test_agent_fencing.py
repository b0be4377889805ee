"""Fencing both ways: a dead agent's node is withdrawn, a live one's never is.

Real: the control plane (kube-apiserver, scheduler, controller manager with its garbage collector), node
agents (one as a process, simulated NVML, partitionable inventory; one in this process) with 3 s heartbeat
Leases, and the operator (Kopf, standalone) reading those Leases with no GpuPartitionPolicy at all: its agent
watchdog fences without one. Simulated: the GPUs (one A100-80GB per node) and the nodes (no kubelet).

- Leases left behind by nodes that no longer exist (written before Leases had an owner, so the garbage
  collector never removed them) are not agents: counted, they made "every agent silent at once" hold for
  ever, and the SIGKILLed agent of the one live node was never fenced.
- An agent whose clock is 60 s behind writes renewTimes older than its Lease: the operator dates a renewal
  by its own clock when it sees renewTime move, so that agent is not fenced.
- The agent's Lease is owned by its Node: deleting the Node deletes the Lease.
- The agent and the operator answering one booking at once: the first answer stands.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig import DRIVER_NAME
from dynamig.agent.kube.api import KubeApi
from dynamig.backends.nvml import fresh_simulated_nvml
from dynamig.demo.cluster import ScenarioApi
from dynamig.demo.inprocess import agent_running, operator_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.waiting import event_posted
from dynamig.kube.answers import answer_entry
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.heartbeat import lease_body, lease_name
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY
from dynamig.kube.times import parse_time
from dynamig.operator.kubeio import KubeIO
from dynamig.operator.metrics import OperatorMetrics
from leased_agents import fencing_operator, leased_agent, node_slices, published

pytestmark = pytest.mark.controlplane

LEASE_SECONDS = 3  # silent 3 s + 5 s of grace after the last renewal the operator saw
MANAGED = {"dynamig.io/managed": "true"}


async def lease(api: client.ApiClient, namespace: str, node: str) -> dict[str, Any] | None:
    try:
        got = await client.CoordinationV1Api(api).read_namespaced_lease(lease_name(node), namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return dict(api.sanitize_for_serialization(got))


async def test_a_killed_agent_is_fenced_with_no_policy_and_stale_leases_of_removed_nodes(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    tmp_path: Path,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    live = make_node("fenced", labels=MANAGED)
    # Leases of two nodes that were removed, written without an owner: nothing ever deletes them.
    coordination = client.CoordinationV1Api(kube_api)
    for gone in (f"removed-{uuid.uuid4().hex[:6]}", f"removed-{uuid.uuid4().hex[:6]}"):
        await coordination.create_namespaced_lease(
            namespace, lease_body(gone, namespace, time.time() - 3600, LEASE_SECONDS)
        )
    metrics = OperatorMetrics()
    with leased_agent(crds, live, namespace, tmp_path, LEASE_SECONDS) as agent:
        async with operator_running(crds.kubeconfig_path, metrics, fencing_operator(crds, namespace)):
            await eventually(functools.partial(published, k, live), f"{live} published", within_s=60)
            node = await k.core.read_node(live)

            async def owned() -> list[dict[str, Any]] | None:
                got = await lease(kube_api, namespace, live)
                return ((got or {}).get("metadata") or {}).get("ownerReferences") or None

            owners = await eventually(owned, f"{live}'s Lease owned by its Node", within_s=30)
            assert owners == [{"apiVersion": "v1", "kind": "Node", "name": live, "uid": node.metadata.uid}]

            os.kill(agent.popen.pid, signal.SIGKILL)
            killed = time.monotonic()

            async def withdrawn() -> bool | None:
                return True if await node_slices(k, live) == 0 else None

            await eventually(withdrawn, f"{live}'s slices withdrawn", within_s=30)
            took = time.monotonic() - killed
            print(f"\n  killed agent: {live} withdrawn {took:.1f}s after the SIGKILL, with no policy")
            assert took < 30, took
            # The Event is posted after the slices are deleted: waited for, not read at once.
            await event_posted(
                k.core, "default", live, "AgentSilent", event_type="Warning", saying=["withdrew"]
            )
            assert metrics.registry.get_sample_value("dynamig_operator_silent_agents") == 1

    # Owned by its Node: the garbage collector deletes the Lease with the Node.
    crds.delete_node(live)

    async def lease_gone() -> bool | None:
        return True if await lease(kube_api, namespace, live) is None else None

    await eventually(lease_gone, f"{live}'s Lease deleted with its Node", within_s=30)


async def test_an_agent_whose_clock_is_a_minute_behind_is_not_fenced(
    crds: ControlPlane, kube_api: client.ApiClient, namespace: str, make_node: Callable[..., str]
) -> None:
    k = ScenarioApi(kube_api, namespace)
    node = make_node("slow-clock", labels=MANAGED)
    nvml = fresh_simulated_nvml()
    nvml.configure(gpus=["A100-80GB"], state_file=None, seed=node)
    settings = dataclasses.replace(
        quick_agent_settings(node),
        inventory=Inventory.PARTITIONABLE,
        lease_namespace=namespace,
        lease_seconds=LEASE_SECONDS,
        clock_offset_seconds=-60.0,
    )
    metrics = OperatorMetrics()
    async with agent_running(kube_api, node, nvml, settings):
        await eventually(functools.partial(published, k, node), f"{node} published", within_s=60)
        got = await lease(kube_api, namespace, node)
        renewed = parse_time(((got or {}).get("spec") or {}).get("renewTime"))
        assert renewed is not None and time.time() - renewed > 55, got  # the lag is real
        async with operator_running(crds.kubeconfig_path, metrics, fencing_operator(crds, namespace)):
            # Judged by its renewTimes, the agent is silent at once. Watched for three times the Lease and
            # its grace (the operator reads the Leases every second): never silent, nothing withdrawn.
            deadline = time.monotonic() + 3 * (LEASE_SECONDS + 5)
            while time.monotonic() < deadline:
                assert not metrics.registry.get_sample_value("dynamig_operator_silent_agents")
                for action in ("slice-withdrawn", "booking-failed"):
                    done = metrics.registry.get_sample_value(
                        "dynamig_operator_silent_node_actions_total", {"action": action}
                    )
                    assert not done, (action, done)
                await asyncio.sleep(0.5)
            assert metrics.registry.get_sample_value("dynamig_operator_silent_agents") == 0
            assert await node_slices(k, node) > 0
            assert not [e for e in await k.events(node, "default") if e["reason"] == "AgentSilent"]


async def test_the_first_answer_to_a_booking_stands_whoever_writes_second(
    crds: ControlPlane, kube_api: client.ApiClient, namespace: str
) -> None:
    """The agent answering ready and the operator failing the same booking (its agent went silent just as it
    answered): whichever writes second is refused, on the API server's own claim."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    device, pool = "gpu0-1g10gb-s0", "node-x"
    for name, first, second in (
        ("agent-first", "agent", "operator"),
        ("operator-first", "operator", "agent"),
    ):
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER_NAME}}]}},
        }
        claim = await k.custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims", body
        )
        result = {
            "request": "gpu", "driver": DRIVER_NAME, "pool": pool, "device": device,
            "bindingConditions": [BINDING_READY], "bindingFailureConditions": [BINDING_FAILED],
        }  # fmt: skip
        claim["status"] = {"allocation": {"devices": {"results": [result]}}}
        await k.custom.replace_namespaced_custom_object_status(
            "resource.k8s.io", "v1", namespace, "resourceclaims", name, claim
        )
        answers = {
            "agent": (BINDING_READY, "InstanceReady", KubeApi(kube_api).put_device_status),
            "operator": (BINDING_FAILED, "AgentSilent", KubeIO(kube_api).put_device_status),
        }
        for who, expected in ((first, True), (second, False)):
            condition, reason, put = answers[who]
            entry = answer_entry(DRIVER_NAME, pool, device, condition, reason, who, "2026-12-04T00:00:00Z", 1)
            assert await put(namespace, name, entry) is expected, (name, who)
        got = await k.custom.get_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims", name
        )
        ((entry_now,),) = [got["status"]["devices"]]
        ((cond,),) = [entry_now["conditions"]]
        assert (cond["type"], cond["message"]) == (answers[first][0], first), got["status"]
