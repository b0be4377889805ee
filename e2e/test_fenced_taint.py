"""A fenced node's devices are tainted NoSchedule where the API server serves DRA device taints, and untainted
when the agent is back; where it does not, the node is withdrawn as before and nothing else is tried.

Real: the control plane (kube-apiserver validating the DeviceTaintRule, controller manager), the node agent
as a process (simulated NVML, a 3 s heartbeat Lease), SIGKILLed and started again, and the operator (Kopf,
standalone, no GpuPartitionPolicy). Simulated: the GPU (one A100-80GB) and the node (no kubelet).

resource.k8s.io/v1 DeviceTaintRule is served by default from Kubernetes 1.37 (DRADeviceTaintRules GA); 1.36
serves it only as v1beta2 behind an off-by-default gate and API, 1.35 as alpha (k8s.io/kubernetes
pkg/features/kube_features.go). Run with ``--k8s=v1.36.3`` for the other branch.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig import DRIVER_NAME
from dynamig.demo.cluster import ScenarioApi
from dynamig.demo.inprocess import operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.versions import KubeTarget
from dynamig.devcluster.waiting import event_posted
from dynamig.operator.fencing import REASON_AGENT_SILENT, TAINT_KEY, taint_rule_name
from dynamig.operator.kubeio import KubeIO
from dynamig.operator.metrics import OperatorMetrics
from leased_agents import fencing_operator, leased_agent, node_slices, published

pytestmark = [pytest.mark.controlplane, pytest.mark.matrix]

LEASE_SECONDS = 3


async def rule_of(k: ScenarioApi, node: str) -> dict[str, Any] | None:
    try:
        got: dict[str, Any] = await k.custom.get_cluster_custom_object(
            "resource.k8s.io", "v1", "devicetaintrules", taint_rule_name(node)
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return got


async def test_a_fenced_nodes_devices_are_tainted_where_served_and_untainted_when_its_agent_is_back(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    kube_target: KubeTarget,
    namespace: str,
    make_node: Callable[..., str],
    tmp_path: Path,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    node = make_node("taint", labels={"dynamig.io/managed": "true"})
    served = await KubeIO(kube_api).serves_taint_rules()
    assert served == (kube_target.minor >= 37 and not kube_target.feature_gates), (kube_target.name, served)
    settings = fencing_operator(crds, namespace)

    async with operator_running(crds.kubeconfig_path, OperatorMetrics(), settings):
        with leased_agent(
            crds, node, namespace, tmp_path, LEASE_SECONDS, inventory=None, name=f"agent-{node}-1"
        ) as agent:
            await eventually(functools.partial(published, k, node), f"{node} published", within_s=60)
            if served:
                assert await rule_of(k, node) is None  # a live agent's node is not tainted
            os.kill(agent.popen.pid, signal.SIGKILL)

            async def withdrawn() -> bool | None:
                return True if await node_slices(k, node) == 0 else None

            await eventually(withdrawn, f"{node}'s slices withdrawn", within_s=30)
            # Posted after the slices are deleted: waited for.
            (event, *_) = await event_posted(k.core, "default", node, REASON_AGENT_SILENT, within_s=30)
            if not served:
                # Withdrawal alone, as on every version before: no rule, nothing failed on the way.
                assert "DeviceTaintRule" not in event["message"], event
                print(f"\n  {kube_target.name}: no DeviceTaintRule served; {node} withdrawn only")
                return
            rule = await eventually(
                functools.partial(rule_of, k, node), f"{node}'s DeviceTaintRule", within_s=10
            )
            assert rule["spec"]["deviceSelector"] == {"driver": DRIVER_NAME, "pool": node}, rule
            taint = rule["spec"]["taint"]
            assert (taint["key"], taint["effect"]) == (TAINT_KEY, "NoSchedule"), rule
            assert "tainted NoSchedule" in event["message"], event
        # The agent is back: it renews its Lease and publishes the node again; the rule goes.
        with leased_agent(
            crds, node, namespace, tmp_path, LEASE_SECONDS, inventory=None, name=f"agent-{node}-2"
        ):
            back = time.monotonic()
            await eventually(functools.partial(published, k, node), f"{node} published again", within_s=60)

            async def untainted() -> bool | None:
                return True if await rule_of(k, node) is None else None

            await eventually(untainted, f"{node}'s DeviceTaintRule deleted", within_s=30)
            print(
                f"\n  {node}: tainted while fenced, untainted {time.monotonic() - back:.1f}s after the agent "
                "started again"
            )
