"""A burst whose claims come a round apart is cut for on the same GPU at once, not after its cooldown.

Real: etcd, kube-apiserver, kube-scheduler, kube-controller-manager; the operator (standalone, its Kopf loop
and planner) and the node agent's whole code path as tasks of the test's event loop. Simulated: one
H100-80GB (simnvml) and the node (no kubelet: pods are bound, never run).

Scenario: the instances inventory (the operator cuts ahead of the scheduler), a Dynamic policy with the
default cooldown (300 s). A first 1g.10gb pod: its GPU is cut and the pod binds. Then, after the cut, a second
1g.10gb pod. Asserted: it binds on the same GPU well inside the cooldown (before, the operator froze a GPU
for its whole cooldown and the claim waited ``WaitingForCooldown`` up to 300 s); NVML's history shows no
instance destroyed on the way (the cooldown still forbids re-cuts; only free memory slices were cut).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from types import ModuleType

import pytest
from kubernetes_asyncio import client

from dynamig.demo.cluster import ScenarioApi
from dynamig.demo.inprocess import agent_running, operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.operator.inventory import LAYOUT_WRITTEN_ANNOTATION
from dynamig.operator.metrics import OperatorMetrics

pytestmark = pytest.mark.controlplane

COOLDOWN_S = 300  # the policy default, written out so the assertion below says what it is compared with


async def test_a_second_claim_a_round_later_is_cut_for_within_the_cooldown(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["H100-80GB"], state_file=None)
    pool = uuid.uuid4().hex[:8]
    node = make_node("burst", labels={"dynamig.io/managed": "true", "test-pool": pool})
    gpu = f"{node}-gpu0"
    policy = f"burst-{pool}"

    async with agent_running(kube_api, node, sim), operator_running(crds.kubeconfig_path, OperatorMetrics()):
        await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
        await k.claim_template("one-1g", ["1g.10gb"])
        await k.create_policy(
            policy,
            {
                "nodeSelector": {"matchLabels": {"test-pool": pool}},
                "mode": "Dynamic",
                "batchWindowSeconds": 1,
                "cooldownSeconds": COOLDOWN_S,
            },
        )
        try:
            await k.pod("first", "one-1g", {"test-pool": pool})
            await eventually(functools.partial(k.node_of, "first"), "first bound", within_s=60)
            part = await k.partition(gpu)
            first_written = (part["metadata"].get("annotations") or {}).get(LAYOUT_WRITTEN_ANNOTATION)
            assert first_written, part["metadata"]
            since = len(sim.history())
            created = time.monotonic()
            await k.pod("second", "one-1g", {"test-pool": pool})
            bound_on = await eventually(functools.partial(k.node_of, "second"), "second bound", within_s=60)
            took = time.monotonic() - created
            print(f"\nthe second 1g.10gb pod bound {took:.1f}s after it was created (cooldown {COOLDOWN_S}s)")
            assert bound_on == node and took < COOLDOWN_S / 5, took
            events = sim.history()[since:]
            assert [e for e in events if e.kind == "create-gi" and e.profile == "1g.10gb"], events
            assert not [e for e in events if e.kind.startswith("destroy")], events
            part = await k.partition(gpu)
            layout = {(i["profile"], i["start"]) for i in part["spec"]["layout"]}
            assert sum(1 for p, _ in layout if p == "1g.10gb") >= 2, layout
        finally:
            await k.delete_pods(["first", "second"])
            await k.delete_policy(policy)
