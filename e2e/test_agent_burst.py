"""A live agent working through a long burst of bookings is never fenced.

Real: the control plane (kube-apiserver, kube-scheduler with DRA and binding conditions, controller manager),
the node agent as a process (simulated NVML, partitionable inventory, a 10 s heartbeat Lease) and the operator
(Kopf, standalone, reading the Leases every second). Simulated: the GPUs (eight A100-80GB on one node, each
instance create taking :data:`CREATE_LATENCY_S`) and the node (no kubelet: pods bind, never run).

:data:`BOOKINGS` pods ask for a ``1g.10gb`` each at once; each booking is a placement the agent cuts and
answers, one create after another, so the burst takes several Lease durations (at least three, asserted:
40 creates at 3 s, about two minutes, against a 10 s Lease; a shorter Lease than production's 30 s keeps the
test short, and the ratio is what matters). An agent that renewed only while its rounds were young would go
silent mid-burst: the operator would withdraw the node and fail its waiting bookings (reason
``AgentSilent``). Renewing by progress (each create, each answer), it is never fenced and every booking is
answered ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig import DRIVER_NAME
from dynamig.demo.cluster import AllocationWatch, ScenarioApi
from dynamig.demo.inprocess import operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION
from dynamig.operator.fencing import REASON_AGENT_SILENT
from dynamig.operator.metrics import OperatorMetrics
from leased_agents import fencing_operator, leased_agent, offering

pytestmark = pytest.mark.controlplane

LEASE_SECONDS = 10
CREATE_LATENCY_S = 3.0
BOOKINGS = 40
GPUS = 8


def fenced(metrics: OperatorMetrics) -> dict[str, float]:
    """What the operator has done about silent agents so far (nothing but zeros while none was silent)."""
    got = {"silent": metrics.registry.get_sample_value("dynamig_operator_silent_agents") or 0.0}
    for action in ("slice-withdrawn", "booking-failed"):
        got[action] = (
            metrics.registry.get_sample_value(
                "dynamig_operator_silent_node_actions_total", {"action": action}
            )
            or 0.0
        )
    return got


def answers(claim: dict[str, Any]) -> set[str]:
    """The answers written on a claim's devices of the driver (True conditions' types and reasons)."""
    return {
        f"{c.get('type')}:{c.get('reason')}"
        for e in (claim.get("status") or {}).get("devices") or []
        if e.get("driver") == DRIVER_NAME
        for c in e.get("conditions") or []
        if c.get("status") == "True"
    }


async def test_a_live_agent_cutting_a_burst_for_several_lease_durations_is_never_fenced(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    tmp_path: Path,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    await k.claim_template("one-1g", ["1g.10gb"])
    node = make_node("burst", labels={"dynamig.io/managed": "true"})
    gpus = [f"{node}-gpu{i}" for i in range(GPUS)]
    settings = fencing_operator(crds, namespace)
    metrics = OperatorMetrics()
    latency = f"--sim-create-latency={CREATE_LATENCY_S}"
    with leased_agent(crds, node, namespace, tmp_path, LEASE_SECONDS, latency, gpus=f"A100-80GB:{GPUS}"):
        async with operator_running(crds.kubeconfig_path, metrics, settings):
            for gpu in gpus:

                async def made(gpu: str = gpu) -> bool | None:
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
            for gpu in gpus:
                await eventually(functools.partial(offering, k, gpu), f"{gpu} offering", within_s=60)

            watch = AllocationWatch(k)
            watch.start()
            pods = [f"b{i}" for i in range(BOOKINGS)]
            started = time.monotonic()
            try:
                for name in pods:
                    await k.pod(name, "one-1g", {"kubernetes.io/hostname": node})

                async def all_bound() -> bool | None:
                    watch.raise_if_stopped()
                    now = fenced(metrics)
                    assert now == {"silent": 0.0, "slice-withdrawn": 0.0, "booking-failed": 0.0}, now
                    return True if all(p in watch.first_bound for p in pods) else None

                await eventually(
                    all_bound, "every burst pod bound", within_s=BOOKINGS * CREATE_LATENCY_S + 90
                )
                took = time.monotonic() - started
            finally:
                await watch.stop()
            print(
                f"\n  {BOOKINGS} bookings at {CREATE_LATENCY_S:g}s per create answered in {took:.1f}s "
                f"({took / LEASE_SECONDS:.1f} Lease durations of {LEASE_SECONDS}s), never fenced"
            )
            # The burst did span several Leases: otherwise this test would show nothing.
            assert took >= 3 * LEASE_SECONDS, took
            await asyncio.sleep(2)  # a round or two of the operator after the last answer
            assert fenced(metrics) == {"silent": 0.0, "slice-withdrawn": 0.0, "booking-failed": 0.0}
            claims = await k.claims()
            assert len(claims) == BOOKINGS
            got = {c["metadata"]["name"]: answers(c) for c in claims}
            not_ready = {
                n: a for n, a in got.items() if not any(x.startswith(f"{BINDING_READY}:") for x in a)
            }
            assert not not_ready, not_ready
            failed = {n: a for n, a in got.items() if any(x.startswith(f"{BINDING_FAILED}:") for x in a)}
            assert not failed, failed
            assert not [e for e in await k.events(node, "default") if e["reason"] == REASON_AGENT_SILENT]
