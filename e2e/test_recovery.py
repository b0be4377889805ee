"""Back within seconds of an API server outage: pods that were waiting when kube-apiserver stopped are served
soon after it is ready again, in both inventories.

Real: etcd, kube-apiserver, kube-scheduler, kube-controller-manager, on a control plane of the test's own (the
session's is shared: it must not go down); the node agent's whole loop and the operator (Kopf, a Dynamic
policy), in-process. Simulated: one A100-80GB (simnvml) and the node (no kubelet: pods bind, never run).

Two pods, each with a claim for a 1g.10gb, are created just before kube-apiserver stops (SIGTERM, down
``down_s`` seconds, started again with the same etcd data); nothing is created while it is down. Instances
inventory: the GPU holds the baseline 2 x 3g.40gb, so the pods are unschedulable until the operator re-cuts
it (its batch window, 3 s, ends while the API server is down). Partitionable inventory: the scheduler has
booked a placement for each pod, and the agent (NVML create latency 1 s) has not answered yet.

Measured from the moment kube-apiserver answers /readyz again (it takes requests a second or two before
that: the figures say when it first answered too):

- **served**: dynamig's share, until the node offers what the pods wait for: a published 1g.10gb device for
  each (instances), every booking answered ready (partitionable). Asserted within ``SERVED_WITHIN_S``.
- **kube-scheduler back**: until kube-scheduler has re-listed what the pods wait on (ResourceSlices for the
  instances inventory, ResourceClaims for the partitionable one), read from its own log (client-go's
  "Caches populated", logged at -v=2). dynamig does not set this: each informer of kube-scheduler retries a
  lost watch after 0.8 s doubling to 30 s, each wait stretched by up to 100% (client-go v0.37.2
  tools/cache/reflector.go: defaultBackoffInit/Max/Factor/Jitter, lines 62-67, used by Run's
  ``delayHandler.Until``; apimachinery wait/backoff.go ``backoffManager.Step``: the back-off is reset only
  when 2 minutes have passed since the last reset, never by a success). When the API server is back, the
  try that reaches it does not resume the watch either: it is refused (403 "cannot watch resource": the API
  server takes requests before its RBAC informers have synced, kubernetes/kubernetes#121635) or the
  restarted API server's watch cache no longer holds the informer's resource version (410 "too old
  resource version"); neither is a retriable watch error (``isWatchErrorRetriable``: only connection
  refused and 429 are), so ListAndWatch returns and the informer waits one more, longer step before it
  re-lists. Measured after /readyz: 16.8 to 24.3 s for a 16 s outage, 27.0 and 43.7 s for a 100 s one.
- **bound**: until every waiting pod is bound: as soon as both dynamig has served and kube-scheduler is back
  (a scheduling cycle; for the partitionable inventory plus PreBind's poll of the binding conditions, every
  5 s, kubernetes v1.37.2 dynamicresources.go ``wait.PollUntilContextTimeout(ctx, 5*time.Second, ...)``).
  Asserted: no later than ``SCHEDULED_WITHIN_S`` after the later of the two, i.e. nothing else waits.

No KubeSchedulerConfiguration setting shortens this: its queue settings (podInitialBackoffSeconds,
podMaxBackoffSeconds, podMaxInUnschedulablePodsDuration) are not what waits (instances: the pods are bound
within 0.2 s of the re-list, whose events move them out of the unschedulable pool), and client-go's informer
back-off is not configurable. Where kube-scheduler runs with leader election (its default; this control plane
runs it without), an outage longer than its renewDeadline (10 s) makes it exit ("Leaderelection lost",
cmd/kube-scheduler/app/server.go) for its supervisor to restart; with ``delayCacheUntilActive: true`` the
restarted one lists only once it leads, which is a full leaseDuration (15 s) after it first reads the old
leader's Lease (client-go tools/leaderelection/leaderelection.go ``isLeaseValid``: observedTime plus
leaseDuration, on its own clock). Measured with a supervisor that restarts it at once, pods bound after
/readyz: 17.9 s (instances) and 18.2 s (partitionable) for a 16 s outage, 15.2 and 16.4 s for a 100 s one.

The instances inventory's pods are demand for the operator only once the scheduler has marked them
unschedulable (``PodScheduled=False``); the test waits for that before the outage, or the scheduler's own
return (it re-tries them after a re-list) would be measured as dynamig's share.

``down_s`` is 16; ``DYNAMIG_LONG_OUTAGE=1`` adds a 100 s outage (about 3 more minutes of run time).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import os
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig import DRIVER_NAME
from dynamig.demo.cluster import ScenarioApi, allocated_device, claim_pod, first_available, layout_text
from dynamig.demo.inprocess import agent_running, operator_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.versions import current
from dynamig.kube.answers import unanswered
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY
from dynamig.operator.metrics import OperatorMetrics
from test_partitionable import _create_claim, _own_cluster, offering, partitionable

pytestmark = pytest.mark.controlplane

LONG_ENV = "DYNAMIG_LONG_OUTAGE"
DOWN_S = [16] + ([100] if os.environ.get(LONG_ENV) == "1" else [])
GPU = "A100-80GB"
BASELINE = [("3g.40gb", 0), ("3g.40gb", 4)]
PODS = ["waiting-0", "waiting-1"]
NAMESPACE = "recovery"
# dynamig's share, as designed: the agent's watches and rounds, the operator's loop and Kopf's watches each
# try the API server again within 2 s of its first answer; then one operator round (instances: plan and write
# the layout, about 0.5 s) and the agent's re-cut (settle 0.3 s, NVML 0.2 s, rounds 0.1 s apart) or answers
# (partitionable: the second booking's 1 s NVML create). About 3.5 s from the first answer, which comes a
# second or two before /readyz, on this 2-core host under load.
SERVED_WITHIN_S = 5.0
# kube-scheduler's return: client-go waits up to 60 s (30 s, stretched by its jitter) between two tries of a
# lost watch, and its RBAC refusals right after the API server's start count as tries (measured: 70 s).
BOUND_WITHIN_S = 180.0
# From the later of "dynamig served" and "kube-scheduler back" to bound: a scheduling cycle and the binding
# (instances); partitionable adds PreBind's 5 s poll of the binding conditions. Slack for this loaded host.
SCHEDULED_WITHIN_S = {"instances": 3.0, "partitionable": 8.0}
# What the waiting pods need kube-scheduler to have seen again: the new devices (instances), the agent's
# answer in the claims' status (partitionable; PreBind reads the claims from the informer's cache).
SCHEDULER_SEES = {"instances": "ResourceSlice", "partitionable": "ResourceClaim"}
_KLOG_TIME = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6})")


@dataclasses.dataclass
class Recovery:
    served_s: float | None = None  # seconds from /readyz to dynamig having served every waiting pod
    bound_s: float | None = None  # ... to every waiting pod bound
    waiting_at_ready: int | None = None  # pods not bound at the first look after /readyz
    answered_s: float | None = None  # seconds from the API server's first answer to /readyz
    scheduler_back_s: float | None = None  # ... to kube-scheduler's re-list of what the pods wait on


def policy(inventory: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodeSelector": {"matchLabels": {"dynamig.io/managed": "true"}},
        "mode": "Dynamic",
        "batchWindowSeconds": 3,  # ends while the API server is down: the first plan is made after it
        "cooldownSeconds": 0,  # the baseline cut just before may be re-cut at once
    }
    if inventory == "instances":
        spec["baseline"] = {GPU: [{"profile": p, "start": s} for p, s in BASELINE]}
    return spec


async def published_1g(k: ScenarioApi, node: str) -> int:
    """The node's published 1g.10gb devices (instances inventory: each one an instance that exists)."""
    res = await k.custom.list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
    )
    return sum(
        1
        for s in res["items"]
        if s["spec"].get("driver") == DRIVER_NAME
        for d in s["spec"].get("devices") or []
        if ((d.get("attributes") or {}).get(f"{DRIVER_NAME}/profile") or {}).get("string") == "1g.10gb"
    )


async def served(k: ScenarioApi, node: str, inventory: str) -> bool:
    if inventory == "instances":
        return await published_1g(k, node) >= len(PODS)
    claims = [c for c in await k.claims() if c["metadata"]["name"] in PODS]
    booked = [c for c in claims if allocated_device(c)]
    waiting = unanswered(claims, DRIVER_NAME, node, BINDING_READY, BINDING_FAILED)
    return len(booked) == len(PODS) and not waiting


async def unbound(k: ScenarioApi) -> int:
    pods = (await k.core.list_namespaced_pod(NAMESPACE)).items
    return sum(1 for p in pods if p.metadata.name in PODS and not p.spec.node_name)


async def measure(k: ScenarioApi, node: str, inventory: str, ready: float, within_s: float) -> Recovery:
    """Look every 0.1 s until every waiting pod is bound (API errors just after the start are retried)."""
    got = Recovery()
    while got.bound_s is None and time.monotonic() - ready < within_s:
        with contextlib.suppress(ApiException, aiohttp.ClientError, OSError, TimeoutError):
            waiting = await unbound(k)
            if got.waiting_at_ready is None:
                got.waiting_at_ready = waiting
            if got.served_s is None and await served(k, node, inventory):
                got.served_s = time.monotonic() - ready
            if waiting == 0:
                got.bound_s = time.monotonic() - ready
                got.served_s = got.bound_s if got.served_s is None else got.served_s
        await asyncio.sleep(0.1)
    return got


async def marked_unschedulable(k: ScenarioApi) -> bool | None:
    """Both waiting pods carry the scheduler's verdict ``PodScheduled=False/Unschedulable`` (the operator's
    sign of demand), or None."""
    pods = [p for p in (await k.core.list_namespaced_pod(NAMESPACE)).items if p.metadata.name in PODS]
    marked = [
        p
        for p in pods
        for c in p.status.conditions or []
        if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
    ]
    return True if len(marked) == len(PODS) else None


def relisted(log: Path, kind: str, since: float) -> float | None:
    """When (wall clock) kube-scheduler's log first says it re-listed ``kind`` at or after ``since``: the
    client-go reflector logs "Caches populated" with ``type="*v1.<kind>"`` at -v=2 after each list. None when
    it has not. klog stamps local time without a year: this year is assumed."""
    year = datetime.datetime.now().year
    for line in log.read_text(errors="replace").splitlines():
        if '"Caches populated"' not in line or f'type="*v1.{kind}"' not in line:
            continue
        m = _KLOG_TIME.match(line)
        if m is None:
            continue
        month, day, hour, minute, second, micro = (int(g) for g in m.groups())
        at = datetime.datetime(year, month, day, hour, minute, second, micro).timestamp()
        if at >= since:
            return at
    return None


async def first_answer(k: ScenarioApi, restart: asyncio.Future[float], after: float) -> float | None:
    """When the API server first answered a request after ``after`` (monotonic), while it restarts."""
    while not restart.done():
        if time.monotonic() >= after:
            with contextlib.suppress(ApiException, aiohttp.ClientError, OSError, TimeoutError):
                await asyncio.wait_for(k.core.list_namespace(limit=1), timeout=1)
                return time.monotonic()
        await asyncio.sleep(0.05)
    return None


@pytest.mark.parametrize("down_s", DOWN_S)
@pytest.mark.parametrize(
    "inventory",
    [
        "instances",
        pytest.param(
            "partitionable",
            marks=pytest.mark.skipif(
                not current().serves_partitionable, reason="no partitionable devices on this target"
            ),
        ),
    ],
)
async def test_pods_waiting_when_the_api_server_stopped_are_served_within_seconds_of_its_return(
    tmp_path: Any, sim: Any, inventory: str, down_s: int, capsys: pytest.CaptureFixture[str]
) -> None:
    async with ControlPlane(work_dir=tmp_path / "cp") as cp:
        node = "recovery-node"
        _own_cluster(cp, node, NAMESPACE)
        sim.configure(gpus=[GPU], state_file=None, create_latency_s=0.2 if inventory == "instances" else 1.0)
        async with cp.api_client() as api:
            k = ScenarioApi(api, NAMESPACE)
            await k.ensure_device_class()
            gpu = f"{node}-gpu0"
            settings = partitionable(node) if inventory == "partitionable" else quick_agent_settings(node)
            async with (
                agent_running(api, node, sim, settings),
                operator_running(cp.kubeconfig_path, OperatorMetrics()),
            ):
                await k.create_policy("recovery", policy(inventory))
                if inventory == "instances":
                    layout = layout_text(BASELINE)
                    await eventually(functools.partial(k.stable, gpu, layout), f"{gpu} cut", within_s=90)
                else:
                    await eventually(functools.partial(offering, k, gpu, ""), f"{gpu} offering", within_s=90)

                # The waiting pods, just before the outage.
                for name in PODS:
                    await _create_claim(k, name, {"firstAvailable": first_available(["1g.10gb"])})
                    body = claim_pod(name, {"kubernetes.io/hostname": node}, claim=name)
                    await k.core.create_namespaced_pod(NAMESPACE, body)
                if inventory == "partitionable":  # booked, the agent's answers not written yet

                    async def booked() -> bool | None:
                        claims = [c for c in await k.claims() if c["metadata"]["name"] in PODS]
                        return True if sum(1 for c in claims if allocated_device(c)) == len(PODS) else None

                    await eventually(booked, "both pods booked", within_s=30, every_s=0.02)
                else:  # the operator's demand: pods the scheduler has found no device for
                    await eventually(
                        functools.partial(marked_unschedulable, k), "both pods unschedulable", within_s=30
                    )

                assert not await served(k, node, inventory)  # nothing was served before the outage
                stopped, stopped_wall = time.monotonic(), time.time()
                restart = asyncio.create_task(
                    asyncio.to_thread(cp.restart, "kube-apiserver", down_seconds=down_s)
                )
                first = await first_answer(k, restart, stopped + 1.0)
                start_s = await restart
                ready, ready_wall = time.monotonic(), time.time()
                got = await measure(k, node, inventory, ready, BOUND_WITHIN_S)
                got.answered_s = None if first is None else ready - first
                back = relisted(cp.log_paths["kube-scheduler"], SCHEDULER_SEES[inventory], stopped_wall)
                got.scheduler_back_s = None if back is None else back - ready_wall

    with capsys.disabled():
        print(
            f"\n[recovery] {inventory} inventory, kube-apiserver down {down_s}s (unreachable "
            f"{ready - stopped:.1f}s, /readyz {start_s:.1f}s after its start, {_s(got.answered_s)} after its "
            f"first answer): after /readyz, dynamig served the {len(PODS)} waiting pods in "
            f"{_s(got.served_s)}, kube-scheduler re-listed {SCHEDULER_SEES[inventory]}s in "
            f"{_s(got.scheduler_back_s)}, pods bound in {_s(got.bound_s)}"
        )
    assert got.waiting_at_ready == len(PODS), got  # they did wait through the outage
    assert got.bound_s is not None and got.served_s is not None, got
    assert got.served_s <= SERVED_WITHIN_S, got
    assert got.bound_s <= BOUND_WITHIN_S, got
    # Nothing but dynamig and kube-scheduler's informer is waited on: the pods are bound soon after the later
    # of the two (the scheduler's queue moved them on the re-list's events, no hint filtered them out).
    if got.scheduler_back_s is not None:
        assert got.bound_s <= max(got.served_s, got.scheduler_back_s) + SCHEDULED_WITHIN_S[inventory], got


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f}s"
