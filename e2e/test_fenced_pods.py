"""A pod bound to a dead agent's node that never started goes back to its controller, once the node has been
fenced for ``stranded_after_seconds``; a pod no controller owns is told why, never deleted.

Real: the control plane (kube-apiserver, kube-scheduler with DRA and binding conditions, controller manager),
the node agent as a process (simulated NVML, partitionable inventory, a 3 s heartbeat Lease) and the operator
(Kopf, standalone, no GpuPartitionPolicy). Simulated: the GPU (one A100-80GB) and the node (no kubelet: a
bound pod never starts, and a deleted one stays Terminating, as on a node whose kubelet is gone too).

The scene: two pods are booked on the node and bound (their claims allocated in the node's pool, answered
by the agent); one is owned by a stand-in controller (a ConfigMap as its controller owner), the other by
none. The agent is SIGKILLed: the operator fences the node, and once it has been fenced for the bound the
owned pod is deleted (a Warning Event on it says why) and the unowned one gets the Event only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from dynamig.demo.cluster import ScenarioApi, claim_pod
from dynamig.demo.inprocess import operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.waiting import event_posted
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION
from dynamig.kube.pods import REASON_RESCHEDULED, REASON_STRANDED
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.settings import OperatorSettings
from leased_agents import leased_agent, node_slices, offering

pytestmark = pytest.mark.controlplane

LEASE_SECONDS = 3  # fenced 3 s + 5 s of grace after the last renewal the operator saw
STRANDED_AFTER_S = 6.0
MANAGED = {"dynamig.io/managed": "true"}


async def test_a_dead_agents_bound_pods_that_never_started_go_back_to_their_controller(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    tmp_path: Path,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    await k.claim_template("one-1g", ["1g.10gb"])
    node = make_node("stranded", labels=MANAGED)
    gpu = f"{node}-gpu0"
    stand_in = await k.core.create_namespaced_config_map(namespace, {"metadata": {"name": "stand-in"}})
    owner = {
        "apiVersion": "v1", "kind": "ConfigMap", "name": "stand-in", "uid": stand_in.metadata.uid,
        "controller": True,
    }  # fmt: skip
    settings = OperatorSettings(
        kubeconfig=crds.kubeconfig_path,
        standalone=True,
        resync_seconds=1.0,
        agent_lease_namespace=namespace,
        stranded_after_seconds=STRANDED_AFTER_S,
    )
    metrics = OperatorMetrics()
    with leased_agent(crds, node, namespace, tmp_path, LEASE_SECONDS) as agent:
        async with operator_running(crds.kubeconfig_path, metrics, settings):

            async def made() -> bool | None:
                with contextlib.suppress(client.ApiException):
                    return bool(await k.partition(gpu)) or None
                return None

            await eventually(made, f"GpuPartition {gpu}", within_s=60)
            # What a Dynamic policy writes: no floor, 1g.10gb offered (no policy here to write it).
            await k.custom.patch_cluster_custom_object(
                GROUP, VERSION, GPU_PARTITION_PLURAL, gpu,
                {"spec": {"layout": [], "offeredProfiles": ["1g.10gb"]}},
                _content_type="application/merge-patch+json",
            )  # fmt: skip
            await eventually(functools.partial(offering, k, gpu), f"{gpu} offering", within_s=60)
            for name, owners in (("owned", [owner]), ("unowned", [])):
                body = claim_pod(name, {"kubernetes.io/hostname": node}, template="one-1g")
                body["metadata"]["ownerReferences"] = owners
                await k.core.create_namespaced_pod(namespace, body)

            async def bound() -> bool | None:
                pods = (await k.core.list_namespaced_pod(namespace)).items
                return True if len(pods) == 2 and all(p.spec.node_name == node for p in pods) else None

            await eventually(bound, f"both pods bound to {node}", within_s=90)
            for name in ("owned", "unowned"):
                claim = await k.claim_of(name)
                assert claim is not None, name
                results = claim["status"]["allocation"]["devices"]["results"]
                assert {r["pool"] for r in results} == {node}, claim["status"]
            # Bound, the agent alive: nothing is given back while the node is not fenced.
            assert metrics_of(metrics) == (0, 0)

            os.kill(agent.popen.pid, signal.SIGKILL)
            killed = time.monotonic()

            async def withdrawn() -> bool | None:
                return True if await node_slices(k, node) == 0 else None

            await eventually(withdrawn, f"{node}'s slices withdrawn", within_s=30, every_s=0.2)
            fenced = time.monotonic()

            async def terminating() -> str | None:
                got = await k.core.read_namespaced_pod("owned", namespace)
                return got.metadata.deletion_timestamp or None

            await eventually(
                terminating, "the owned pod deleted", within_s=STRANDED_AFTER_S + 20, every_s=0.2
            )
            deleted = time.monotonic()
            print(
                f"\n  fenced {fenced - killed:.1f}s after the SIGKILL; the owned pod deleted "
                f"{deleted - fenced:.1f}s after the fence (bound {STRANDED_AFTER_S:.0f}s)"
            )
            # Not before the bound (the fence seen here at most one poll after it happened).
            assert deleted - fenced >= STRANDED_AFTER_S - 0.5, deleted - fenced
            assert deleted - killed < LEASE_SECONDS + 5 + STRANDED_AFTER_S + 10, deleted - killed

            told = await event_posted(k.core, namespace, "owned", REASON_RESCHEDULED, within_s=10)
            assert "ConfigMap stand-in" in told[0]["message"], told
            assert "never started" in told[0]["message"] and node in told[0]["message"], told
            (event,) = await event_posted(k.core, namespace, "unowned", REASON_STRANDED, within_s=10)
            assert "no controller owns it" in event["message"] and event["type"] == "Warning", event
            # Told, never deleted; told once, though the operator goes on reading the node every second.
            rounds_end = time.monotonic() + 3
            while time.monotonic() < rounds_end:
                got = await k.core.read_namespaced_pod("unowned", namespace)
                assert got.metadata.deletion_timestamp is None
                await asyncio.sleep(0.5)
            assert metrics_of(metrics) == (1, 1)
            assert len([e for e in await k.events("unowned") if e["reason"] == REASON_STRANDED]) == 1


def metrics_of(metrics: OperatorMetrics) -> tuple[float, float]:
    """The operator's count of pods deleted and pods told for fenced nodes."""

    def sample(action: str) -> float:
        value = metrics.registry.get_sample_value(
            "dynamig_operator_silent_node_actions_total", {"action": action}
        )
        return value or 0.0

    return sample("pod-deleted"), sample("pod-told")
