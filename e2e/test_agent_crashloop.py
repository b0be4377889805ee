"""A crash-looping agent: killed again and again while pods book its GPU, it loses nothing, leaves no pod on a
device that does not exist, and is fenced only while it stays down.

Real: the control plane (kube-apiserver, kube-scheduler with DRA and binding conditions, controller manager),
the node agent as a process of its own (simulated NVML in a state file that outlives each process, as a GPU
outlives its driver's clients; partitionable inventory; a 10 s heartbeat Lease, renewed every 3.3 s, silent
15 s after the last renewal the operator saw) and the operator (Kopf, standalone, no GpuPartitionPolicy).
Simulated: the GPU (one A100-80GB, 0.5 s per GPU-instance create) and the node (no kubelet).

The scene, as a kubelet restarts a crashing container: six short lives (the agent SIGKILLed 2-4 s after it
started, seeded; restarted 0.5 s later), a pod asking for a 1g.10gb created in each; then the back-off: down
25 s, longer than the Lease and its grace; then up for good.

Asserted:
- while the restarts come quickly (every silence shorter than the Lease and its grace, measured from the
  Lease's renewals as the operator sees them), the node is never fenced: a crash loop is not a dead node;
- down for the back-off, the node offers nothing new (its ResourceSlices withdrawn) within 30 s of the kill,
  and offers again once the agent is back;
- every pod ends bound, its claim answered by the agent with the MIG UUID of an instance NVML holds at the
  allocated placement, within 90 s of the last start;
- no instance destroyed while a claim allocated it (the simulated NVML's history against the claims, read
  every 50 ms), across every kill, including kills in the middle of a cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.demo.cluster import AllocationWatch, ScenarioApi, allocated_device, claim_pod
from dynamig.demo.inprocess import operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import device_name
from dynamig.kube.heartbeat import lease_name
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION
from dynamig.operator.metrics import OperatorMetrics
from leased_agents import fencing_operator, leased_agent, node_slices, offering, published

pytestmark = pytest.mark.controlplane

LEASE_SECONDS = 10
SILENT_AFTER_S = LEASE_SECONDS + 5  # the operator's grace after the Lease runs out
SHORT_LIVES = 6
BACK_OFF_S = 25.0
SEED = 38
MANAGED = {"dynamig.io/managed": "true"}


class Observer:
    """Every 0.2 s: whether the node publishes slices, and when (this clock) the Lease's renewTime moved."""

    def __init__(self, k: ScenarioApi, node: str, namespace: str) -> None:
        self.k, self.node, self.namespace = k, node, namespace
        self.withdrawn: list[float] = []  # time.monotonic() of each sighting with no slice published
        self.renewals: list[float] = []  # time.monotonic() when a new renewTime was first seen
        self._last_renew: float | None = None
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        coordination = client.CoordinationV1Api(self.k.core.api_client)
        while True:
            with contextlib.suppress(client.ApiException):
                now = time.monotonic()
                if await node_slices(self.k, self.node) == 0:
                    self.withdrawn.append(now)
                lease = await coordination.read_namespaced_lease(lease_name(self.node), self.namespace)
                renewed = lease.spec.renew_time.timestamp() if lease.spec.renew_time else None
                if renewed is not None and renewed != self._last_renew:
                    self._last_renew = renewed
                    self.renewals.append(now)
            await asyncio.sleep(0.2)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="crashloop-observer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def longest_silence(self, since: float, until: float) -> float:
        """The longest time between renewals seen in [since, until] (the edges count as renewals)."""
        marks = [since, *[t for t in self.renewals if since < t < until], until]
        return max(b - a for a, b in itertools.pairwise(marks))


def nvml_instances(state: Path) -> dict[str, str]:
    """Device name -> MIG UUID of each whole instance in the simulated NVML's state file."""
    model = load_catalog().model("A100-80GB")
    doc: dict[str, Any] = json.loads(state.read_bytes())
    out = {}
    for gpu in doc["gpus"]:
        for gi in gpu["gpu_instances"]:
            for ci in gi["compute_instances"]:
                out[device_name(gpu["index"], model.profile_by_id(gi["profile_id"]).name, gi["start"])] = ci[
                    "uuid"
                ]
    return out


def history(state: Path) -> list[SimpleNamespace]:
    """The simulated NVML's event history, as objects AllocationWatch reads."""
    doc: dict[str, Any] = json.loads(state.read_bytes())
    fields = ("kind", "timestamp", "gpu_index", "profile", "start")
    return [SimpleNamespace(**{f: ev.get(f) for f in fields}) for ev in doc["history"]]


async def test_a_crash_looping_agent_loses_nothing_and_is_fenced_only_while_it_stays_down(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    await k.claim_template("one-1g", ["1g.10gb"])
    node = make_node("crashloop", labels=MANAGED)
    gpu = f"{node}-gpu0"
    state = tmp_path / f"nvml-{node}.json"
    life = functools.partial(
        leased_agent, crds, node, namespace, tmp_path, LEASE_SECONDS, "--sim-create-latency=0.5"
    )
    metrics = OperatorMetrics()
    observer = Observer(k, node, namespace)
    watch = AllocationWatch(k)
    pods: list[str] = []
    async with operator_running(crds.kubeconfig_path, metrics, fencing_operator(crds, namespace)):
        with life(name="agent-0"):
            await eventually(functools.partial(made, k, gpu), f"GpuPartition {gpu}", within_s=60)
            await k.custom.patch_cluster_custom_object(
                GROUP, VERSION, GPU_PARTITION_PLURAL, gpu,
                {"spec": {"layout": [], "offeredProfiles": ["1g.10gb"]}},
                _content_type="application/merge-patch+json",
            )  # fmt: skip
            await eventually(functools.partial(offering, k, gpu), f"{gpu} offering", within_s=60)
        observer.start()
        watch.start()
        try:
            loop_began = time.monotonic()
            kills: list[float] = []
            for i in range(SHORT_LIVES):
                with life(name=f"agent-{i + 1}") as agent:
                    name = f"p{i}"
                    await k.core.create_namespaced_pod(
                        namespace, claim_pod(name, {"kubernetes.io/hostname": node}, template="one-1g")
                    )
                    pods.append(name)
                    await asyncio.sleep(rng.uniform(2.0, 4.0))
                    os.kill(agent.popen.pid, signal.SIGKILL)
                    kills.append(time.monotonic())
                await asyncio.sleep(0.5)
            with life(name="agent-backoff") as agent:
                await asyncio.sleep(rng.uniform(2.0, 4.0))
                os.kill(agent.popen.pid, signal.SIGKILL)
            killed = loop_ended = time.monotonic()
            await asyncio.sleep(BACK_OFF_S)
            withdrawn_at = next((t for t in observer.withdrawn if t > killed), None)
            with life(name="agent-last"):
                back = time.monotonic()
                await eventually(
                    functools.partial(published, k, node), f"{node} publishing again", within_s=30
                )
                republished = time.monotonic() - back

                async def all_answered() -> dict[str, str] | None:
                    out = {}
                    for name in pods:
                        got = await k.core.read_namespaced_pod(name, namespace)
                        claim = await k.claim_of(name)
                        dev = allocated_device(claim)
                        answered = [
                            e for e in ((claim or {}).get("status") or {}).get("devices") or []
                            if e.get("device") == dev and (e.get("data") or {}).get("migUUID")
                        ]  # fmt: skip
                        if got.spec.node_name != node or dev is None or not answered:
                            return None
                        out[name] = f"{dev} {answered[0]['data']['migUUID']}"
                    return out

                answers = await eventually(all_answered, "every pod bound and answered", within_s=90)
                held = await asyncio.to_thread(nvml_instances, state)
        finally:
            await observer.stop()
            await watch.stop()

    quick_silence = observer.longest_silence(loop_began, loop_ended)
    fenced_in_loop = [t for t in observer.withdrawn if loop_began <= t <= loop_ended]
    lost = watch.destroyed_while_allocated(await asyncio.to_thread(history, state))
    print(
        f"\n  {SHORT_LIVES} short lives: longest silence {quick_silence:.1f}s "
        f"(silent after {SILENT_AFTER_S}s), "
        f"fenced {len(fenced_in_loop)} times; back-off: withdrawn "
        f"{(withdrawn_at - killed) if withdrawn_at else float('nan'):.1f}s after the kill, publishing again "
        f"{republished:.1f}s after the restart; {len(pods)} pods answered: {answers}"
    )
    assert quick_silence < SILENT_AFTER_S - 2, f"restarts too slow for this check: {quick_silence:.1f}s"
    assert not fenced_in_loop, "a crash-looping agent that kept renewing was fenced"
    assert withdrawn_at is not None and withdrawn_at - killed < 30, (withdrawn_at, killed)
    for name, answer in answers.items():
        dev, mig = answer.split()
        assert held.get(dev) == mig, f"{name}: answered {dev} {mig}, NVML holds {held.get(dev)}"
    assert lost == [], lost


async def made(k: ScenarioApi, gpu: str) -> bool | None:
    with contextlib.suppress(client.ApiException):
        return bool(await k.partition(gpu)) or None
    return None
