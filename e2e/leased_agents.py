"""Node agents run as processes of their own with a heartbeat Lease, for the tests of fencing (the operator
judges each by its Lease, and a test kills, stops or slows it), and what those tests read of a node. Short
periods throughout: settle 0.3 s, rounds 1 s apart (0.2 s while reshaping)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from kubernetes_asyncio import client

from dynamig.demo.cluster import ScenarioApi
from dynamig.devcluster import ControlPlane
from dynamig.devcluster.processes import Component
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION
from dynamig.operator.settings import OperatorSettings


@contextlib.contextmanager
def leased_agent(
    cp: ControlPlane,
    node: str,
    namespace: str,
    work: Path,
    lease_seconds: float,
    *extra: str,
    gpus: str = "A100-80GB:1",
    inventory: str | None = "partitionable",
    name: str = "",
) -> Iterator[Component]:
    """The agent of ``node`` over simulated ``gpus`` (its state in ``work``), keeping its Lease in
    ``namespace``; ``inventory`` None lets it ask the API server. Stopped (and continued first, should the
    test have stopped it) on the way out."""
    name = name or f"agent-{node}"
    argv = [
        sys.executable, "-m", "dynamig", "agent", f"--node={node}", "--nvml=simulated",
        f"--simulate-gpus={gpus}", f"--state={work / f'nvml-{node}.json'}",
        f"--kubeconfig={cp.kubeconfig_path}", "--metrics-port=-1",
        f"--lease-namespace={namespace}", f"--lease-seconds={lease_seconds}", "--interval=1",
        "--reshape-poll=0.2", "--settle-seconds=0.3", *extra,
    ]  # fmt: skip
    if inventory is not None:
        argv.append(f"--inventory={inventory}")
    proc = Component.spawn(name, argv, log_path=work / f"{name}.log", cwd=work)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, signal.SIGCONT)
        proc.popen.terminate()
        with contextlib.suppress(Exception):
            proc.popen.wait(timeout=20)


def fencing_operator(cp: ControlPlane, namespace: str) -> OperatorSettings:
    """An operator that reads the agents' Leases in ``namespace`` and plans every second."""
    return OperatorSettings(
        kubeconfig=cp.kubeconfig_path, standalone=True, resync_seconds=1.0, agent_lease_namespace=namespace
    )


async def node_slices(k: ScenarioApi, node: str) -> int:
    """How many ResourceSlices ``node`` publishes (a fenced node's are withdrawn)."""
    got = await k.custom.list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
    )
    return len(got["items"])


async def published(k: ScenarioApi, node: str) -> bool | None:
    return True if await node_slices(k, node) > 0 else None


async def offering(k: ScenarioApi, gpu: str) -> bool | None:
    """True once ``gpu``'s agent offers placements in the partitionable inventory."""
    try:
        part = await k.custom.get_cluster_custom_object(GROUP, VERSION, GPU_PARTITION_PLURAL, gpu)
    except client.ApiException as exc:
        if exc.status == 404:  # the agent has not made it yet
            return None
        raise
    st = part.get("status") or {}
    return (
        True if st.get("inventory") == Inventory.PARTITIONABLE.value and st.get("offeredPlacements") else None
    )
