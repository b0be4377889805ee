"""A stuck agent is never what a pod waits for: its node stops offering devices and its bookings fail.

Real: the control plane (kube-apiserver, kube-scheduler with DRA and binding conditions, controller manager),
two node agents as processes (``dynamig agent``, simulated NVML, partitionable inventory, a 6 s heartbeat
Lease) and the operator (in this process) reading their Leases. Simulated: the GPUs (one A100-80GB per node)
and the nodes (no kubelet).

The scene: node A's agent is SIGSTOPped (alive, answering nothing, as when an NVML call hangs in the driver
with the process frozen). Seven pods then ask for a ``1g.10gb`` each; both GPUs are idle, so every booking is
a placement that waits for its agent's answer. Without the operator the pods booked on A would wait for the
scheduler's binding timeout (600 s). With it, A's Lease runs out, the operator withdraws A's slices and fails
A's waiting bookings, and the scheduler books them on B. SIGCONT: A's agent renews its Lease and publishes A
again.
"""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from dynamig.demo.cluster import AllocationWatch, ScenarioApi
from dynamig.demo.inprocess import operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.waiting import event_posted
from dynamig.operator.metrics import OperatorMetrics
from leased_agents import fencing_operator, leased_agent, node_slices, offering

pytestmark = pytest.mark.controlplane

LEASE_SECONDS = 6
PODS = 7


async def test_pods_booked_on_a_stuck_agents_node_are_booked_again_elsewhere_within_a_minute(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    tmp_path: Path,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    await k.claim_template("one-1g", ["1g.10gb"])
    pool = uuid.uuid4().hex[:8]
    a, b = (
        make_node(p, labels={"dynamig.io/managed": "true", "test-pool": pool}) for p in ("stuck-a", "alive-b")
    )
    settings = fencing_operator(crds, namespace)
    metrics = OperatorMetrics()
    with (
        leased_agent(crds, a, namespace, tmp_path, LEASE_SECONDS) as agent_a,
        leased_agent(crds, b, namespace, tmp_path, LEASE_SECONDS),
    ):
        async with operator_running(crds.kubeconfig_path, metrics, settings):
            await k.create_policy(
                f"stuck-{pool}",
                {
                    "nodeSelector": {"matchLabels": {"test-pool": pool}},
                    "mode": "Dynamic",
                    "batchWindowSeconds": 1,
                },
            )
            for node in (a, b):
                await eventually(
                    functools.partial(offering, k, f"{node}-gpu0"), f"{node} offering", within_s=90
                )

            os.kill(agent_a.popen.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            watch = AllocationWatch(k)
            watch.start()
            try:
                pods = [f"p{i}" for i in range(PODS)]
                for name in pods:
                    await k.pod(name, "one-1g", {"test-pool": pool})

                async def all_on_b() -> bool | None:
                    got = {
                        p.metadata.name: p.spec.node_name
                        for p in (await k.core.list_namespaced_pod(namespace)).items
                    }
                    return True if all(got.get(p) == b for p in pods) else None

                await eventually(all_on_b, "every pod bound on the live node", within_s=90)
                bound_after = time.monotonic() - stopped
            finally:
                await watch.stop()
            # The operator posts its Event after failing the bookings: the pods may be bound on b first.
            await event_posted(
                k.core,
                "default",
                a,
                "AgentSilent",
                saying=["withdrew", "failed the bookings of"],
                within_s=30,
            )
            failed = metrics.registry.get_sample_value(
                "dynamig_operator_silent_node_actions_total", {"action": "booking-failed"}
            )
            assert failed is not None and failed >= 1
            assert await node_slices(k, a) == 0
            print(f"\n  stuck agent: {PODS} pods bound on the live node {bound_after:.1f}s after the SIGSTOP")
            assert bound_after < 60, bound_after

            os.kill(agent_a.popen.pid, signal.SIGCONT)
            await eventually(functools.partial(node_slices, k, a), f"{a} published again", within_s=60)
