"""A dead agent must not freeze its policy: its heartbeat Lease runs out and the operator stops waiting.

Real: the control plane (kube-apiserver, scheduler with DRA, controller manager), two node agents in this
process (each with its own simulated NVML, heartbeat Leases every second of a 3 s lease) and the operator
(Kopf, standalone) reading those Leases. Simulated: the GPUs (one A100-80GB per node) and the nodes.

The scene: node A's agent dies just after A's GpuPartition got a new layout, so A stays in flight for ever
and holds the policy's whole disruption budget (one GPU). A pod then needs node B's GPU cut. Without the
heartbeat the pod waits for ever; with it, A's Lease runs out (3 s plus 5 s grace), A is left out of
planning with Ready=Unknown (AgentSilent) and an Event, the budget is free, B is cut and the pod allocated.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.backends.nvml import fresh_simulated_nvml
from dynamig.demo.cluster import ScenarioApi, allocated_device, layout_text
from dynamig.demo.inprocess import agent_running, operator_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.settings import OperatorSettings

pytestmark = pytest.mark.controlplane

WHOLE = [("7g.80gb", 0)]


def sample_value(metrics: OperatorMetrics, name: str) -> float | None:
    """A sample's value as the operator's /metrics would serve it."""
    return metrics.registry.get_sample_value(name)


LEASE_SECONDS = 3


async def test_a_silent_agent_frees_the_disruption_budget_it_held(
    crds: ControlPlane, kube_api: client.ApiClient, namespace: str, make_node: Callable[..., str]
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    await k.claim_template("small", ["1g.10gb"])
    pool = uuid.uuid4().hex[:8]
    a, b = (
        make_node(p, labels={"dynamig.io/managed": "true", "test-pool": pool})
        for p in ("silent-a", "alive-b")
    )
    gpu_a, gpu_b = f"{a}-gpu0", f"{b}-gpu0"
    sims = {}
    for node in (a, b):
        sims[node] = fresh_simulated_nvml()
        sims[node].configure(gpus=["A100-80GB"], state_file=None, seed=node)

    def settings(node: str) -> Any:
        return dataclasses.replace(
            quick_agent_settings(node), lease_namespace=namespace, lease_seconds=LEASE_SECONDS
        )

    async with agent_running(kube_api, b, sims[b], settings(b)):
        async with agent_running(kube_api, a, sims[a], settings(a)):
            for g in (gpu_a, gpu_b):
                await eventually(functools.partial(k.stable, g), f"GpuPartition {g}", within_s=60)
                await k.set_layout(g, WHOLE)
            for g in (gpu_a, gpu_b):
                await eventually(
                    functools.partial(k.stable, g, layout_text(WHOLE)), f"{g} whole", within_s=60
                )
        # A's agent is gone. A new layout on A is never applied: A stays in flight.
        await k.set_layout(gpu_a, [("3g.40gb", 0), ("3g.40gb", 4)])
        died = time.monotonic()
        operator = OperatorSettings(
            kubeconfig=crds.kubeconfig_path,
            standalone=True,
            resync_seconds=1.0,
            agent_lease_namespace=namespace,
        )
        async with operator_running(crds.kubeconfig_path, OperatorMetrics(), operator) as metrics:
            policy = f"silent-{pool}"
            await k.create_policy(
                policy,
                {
                    "nodeSelector": {"matchLabels": {"test-pool": pool}},
                    "mode": "Dynamic",
                    "batchWindowSeconds": 1,
                    "disruptionBudget": {"maxGpusReshaping": 1},
                },
            )
            try:
                await k.pod("small-0", "small", {"test-pool": pool})

                async def allocated() -> str | None:
                    return allocated_device(await k.claim_of("small-0"))

                device = await eventually(allocated, "the pod's claim allocated on B", within_s=90)
                took = time.monotonic() - died
                part_a = await k.partition(gpu_a)
                ready = {c["type"]: c for c in part_a["status"]["conditions"]}["Ready"]
                print(f"\nagent A silent: claim allocated on B {took:.1f}s after A died; {ready['message']}")
                assert device.startswith("gpu0-1g10gb"), device
                assert (await k.partition(gpu_b))["status"]["node"] == b
                assert ready["status"] == "Unknown" and ready["reason"] == "AgentSilent", ready
                assert sample_value(metrics, "dynamig_operator_silent_agents") == 1
                described = crds.kubectl("describe", "gpupartition", gpu_a).stdout
                assert "AgentSilent" in described, described
                # The claim went to B, the GPU whose agent is alive.
                claim = await k.claim_of("small-0")
                assert claim is not None
                (result,) = claim["status"]["allocation"]["devices"]["results"]
                assert result["pool"] == b, result
            finally:
                await k.delete_pods(["small-0"])
                await k.delete_policy(policy)
