"""Run a node agent or the operator as a task of the current event loop (the demo and scenario tests).

Side effects: the agent drives the NVML module it is given and writes to the API; the operator runs Kopf.
Both stop (and are awaited) when the context exits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry

from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml.device import NvmlDevices
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import device_name
from dynamig.operator.handlers import run_operator
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.settings import OperatorSettings


def quick_agent_settings(node: str) -> AgentSettings:
    """Short settle and poll periods: a scenario on a local control plane needs no production margins."""
    return AgentSettings(
        node=node, settle_seconds=0.3, quarantine_seconds=1.0, interval_seconds=0.5, reshape_poll_seconds=0.1
    )


@contextlib.asynccontextmanager
async def agent_running(
    api_client: Any, node: str, nvml: ModuleType, settings: AgentSettings | None = None
) -> AsyncIterator[NodeAgent]:
    """One node agent over ``nvml`` (the real ``pynvml`` or the simulated module) for ``node``."""
    devices = NvmlDevices(nvml, load_catalog())
    devices.init()
    settings = settings or quick_agent_settings(node)
    agent = NodeAgent(settings, KubeApi(api_client), devices, AgentMetrics(CollectorRegistry(), node))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop), name=f"agent-{node}")
    try:
        yield agent
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        devices.shutdown()


@contextlib.asynccontextmanager
async def operator_running(
    kubeconfig: Path, metrics: OperatorMetrics | None = None, settings: OperatorSettings | None = None
) -> AsyncIterator[OperatorMetrics]:
    """The operator, standalone, replanning every 2 s unless ``settings`` say otherwise."""
    settings = settings or OperatorSettings(kubeconfig=kubeconfig, standalone=True, resync_seconds=2.0)
    metrics = metrics or OperatorMetrics()
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_operator(settings, stop, ready, metrics=metrics), name="operator")
    await asyncio.wait_for(ready.wait(), timeout=60)
    try:
        yield metrics
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


def mig_modes(nvml: ModuleType) -> list[int]:
    """The current MIG mode (1 on, 0 off) of every GPU ``nvml`` holds, read through the agent's NVML code
    path."""
    devices = NvmlDevices(nvml, load_catalog())
    devices.init()
    try:
        return [g.mig_current for g in devices.gpus()]
    finally:
        devices.shutdown()


def whole_instances(nvml: ModuleType) -> dict[str, str]:
    """Device name -> MIG UUID of every whole instance (GPU instance with its compute instance) ``nvml``
    holds now, read through the agent's own NVML code path."""
    devices = NvmlDevices(nvml, load_catalog())
    devices.init()
    try:
        return {
            device_name(g.index, i.profile, i.start): i.mig_uuid
            for g in devices.discover()[0]
            for i in devices.instances(g)
            if i.whole is not None
        }
    finally:
        devices.shutdown()
