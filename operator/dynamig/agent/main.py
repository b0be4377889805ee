"""Wiring of the node agent: settings in, dependencies built once and passed down, loop run until a signal.

``run_agent(options)`` is what ``dynamig agent`` calls. It loads NVML (the real library or the simulated
one), connects to the API (kubeconfig from the flag, ``$KUBECONFIG``, ``~/.kube/config`` or the in-cluster
service account), serves metrics, optionally serves the kubelet DRA plugin, and reconciles until SIGTERM or
SIGINT. When ``dynamig uninstall`` marks the node's GpuPartitions, the agent withdraws its slices, applies the
layouts written with the mark and removes the plugin's files from the node (see ``NodeAgent.on_uninstall``).
The environment is read here only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry

from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.devices_service import AgentMigInstances
from dynamig.agent.endpoints import Health
from dynamig.agent.endpoints import serve as serve_http
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml.device import NvmlDevices
from dynamig.agent.plugin.settings import PluginSettings
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.metricsauth import ApiAuthorizer, MetricsTLS

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationOptions:
    """How the simulated NVML is set up (``--nvml simulated``)."""

    gpus: tuple[str, ...]  # catalog keys, one per GPU
    state_file: Path | None = None  # shared with other processes (e.g. a restarted agent) when given
    create_latency_s: float = 0.0
    destroy_latency_s: float = 0.0
    # Write the simulated driver's /dev entries as real character devices (root), for a container runtime.
    char_devices: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentOptions:
    settings: AgentSettings
    nvml: str = "real"  # "real" | "simulated"
    simulation: SimulationOptions | None = None
    kubeconfig: Path | None = None
    metrics_address: str = "0.0.0.0"
    metrics_port: int | None = None  # None: no metrics server; 0: any free port
    metrics_tls: MetricsTLS | None = None  # serve /metrics (and the probes) over TLS
    metrics_authorize: bool = False  # /metrics only for tokens the API server allows (needs metrics_tls)
    plugin: PluginSettings | None = None  # serve the kubelet DRA plugin with these settings
    liveness_max_round_age_s: float = 180.0  # /healthz fails when no round finished for this long


def parse_simulated_gpus(text: str) -> tuple[str, ...]:
    """``H100-80GB:2,A100-40GB:1`` -> ``("H100-80GB", "H100-80GB", "A100-40GB")``. Pure."""
    out: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, count = part.partition(":")
        n = int(count) if count else 1
        if n < 0:
            raise ValueError(f"negative GPU count in {part!r}")
        out.extend([key] * n)
    return tuple(out)


def load_nvml_module(options: AgentOptions) -> ModuleType:
    """The NVML module: real ``pynvml``, or the simulated one configured with the simulation options."""
    from dynamig.backends.nvml import load_nvml

    module: ModuleType = load_nvml(options.nvml)
    if options.nvml == "simulated":
        sim = options.simulation or SimulationOptions(gpus=())
        module.configure(
            gpus=list(sim.gpus),
            state_file=sim.state_file,
            create_latency_s=sim.create_latency_s,
            destroy_latency_s=sim.destroy_latency_s,
            seed=options.settings.node,  # GPU UUIDs differ between simulated nodes
        )
    return module


async def api_client_for(kubeconfig: Path | None) -> Any:
    """A kubernetes-asyncio ApiClient: flag, then $KUBECONFIG / ~/.kube/config, then in-cluster config."""
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    path = kubeconfig or (Path(os.environ["KUBECONFIG"]) if os.environ.get("KUBECONFIG") else None)
    if path is None and (Path.home() / ".kube" / "config").exists():
        path = Path.home() / ".kube" / "config"
    if path is not None:
        await config.load_kube_config(config_file=str(path), client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)
    return client.ApiClient(configuration=cfg)


async def run_agent(options: AgentOptions) -> int:
    """Run the agent until a signal (or uninstall and return). Side effects: everything the agent does."""
    settings = options.settings
    nvml = load_nvml_module(options)
    devices = NvmlDevices(nvml, load_catalog())
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, settings.node)
    api_client = await api_client_for(options.kubeconfig)
    plugin_server: Any = None
    http_server: Any = None
    try:
        api = KubeApi(api_client)
        devices.init()
        agent = NodeAgent(settings, api, devices, metrics)
        health = Health(max_round_age_s=options.liveness_max_round_age_s)
        agent.on_round = health.round_finished
        instances: Any = AgentMigInstances(agent)
        sim_files: Any = None
        if options.plugin is not None:
            from dynamig.agent.bindings.stranded import StrandedPods
            from dynamig.agent.plugin import probe_sockets, serve_plugin

            p = options.plugin
            if options.nvml == "simulated":
                # No kernel driver makes /dev and /proc entries for simulated GPUs: write stand-ins.
                from dynamig.agent.nvml.simulated_driver import SimulatedDriverFiles, SimulatedDriverInstances

                sim_files = files = SimulatedDriverFiles(
                    devices,
                    proc_root=p.proc_root,
                    dev_root=p.dev_root,
                    base_spec=p.base_spec_path,
                    char_devices=options.simulation is not None and options.simulation.char_devices,
                )
                instances = SimulatedDriverInstances(instances, files)
            stranded = StrandedPods(api, settings.node)  # a pod whose device stays unpreparable goes back
            plugin_server = await serve_plugin(p, instances, api_client, metrics.plugin_request, stranded)
            health.plugin_probe = lambda: probe_sockets(plugin_server.sockets)
            health.plugin_registered = lambda: plugin_server.registered.is_set()

            async def remove_node_files() -> list[str]:
                """Uninstall: the sockets first (the kubelet stops calling), then the files; the probes stop
                looking at the plugin, so the kubelet does not restart the agent to serve it again."""
                from dynamig.agent.plugin.teardown import remove_node_files as remove_plugin_files

                health.plugin_probe = health.plugin_registered = None
                await plugin_server.stop()
                removed = [str(f) for f in remove_plugin_files(p)]
                if sim_files is not None:
                    removed += [str(f) for f in sim_files.remove()]
                return removed

            agent.on_uninstall = remove_node_files
        if options.metrics_port is not None:
            authorizer = ApiAuthorizer(api_client) if options.metrics_authorize else None
            http_server = await serve_http(
                health,
                registry,
                options.metrics_address,
                options.metrics_port,
                tls=options.metrics_tls,
                authorizer=authorizer,
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        log.info("agent for node %s running (settle %.1fs)", settings.node, settings.settle_seconds)
        await agent.run(stop)
        return 0
    finally:
        if plugin_server is not None:
            await plugin_server.stop()
        if http_server is not None:
            await http_server.cleanup()
        devices.shutdown()
        await api_client.close()
