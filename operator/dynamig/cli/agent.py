"""``dynamig agent``: the node agent (one per GPU node). Reconciles GpuPartitions with NVML, publishes
ResourceSlices for driver ``mig.dynamig.io``, optionally serves the kubelet DRA plugin.

Examples::

    dynamig agent --node gpu-node-1                                  # real NVML, in-cluster config
    dynamig agent --node n1 --nvml simulated --simulate-gpus H100-80GB:2 --kubeconfig kc.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from dynamig.cli._logging import add_logging_arguments
from dynamig.cli._metrics import add_metrics_security_arguments, metrics_tls_files
from dynamig.cli.args import non_negative_float, port, positive_float, simulated_gpus
from dynamig.cli.errors import EXIT_USAGE, CommandError, add_api_wait_argument
from dynamig.kube.heartbeat import DEFAULT_LEASE_SECONDS, MAX_LEASE_SECONDS
from dynamig.planner.offerlimit import parse_limit


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("agent", help="run the node agent (NVML reconcile, ResourceSlices, DRA plugin)")
    p.add_argument(
        "--node",
        default=os.environ.get("NODE_NAME"),
        help="name of the Node this agent manages (default $NODE_NAME)",
    )
    p.add_argument(
        "--nvml",
        choices=("real", "simulated"),
        default="real",
        help="NVML library: the real one, or the simulated one (no GPU needed)",
    )
    p.add_argument(
        "--simulate-gpus",
        type=simulated_gpus,
        default="H100-80GB:1",
        help="with --nvml simulated: GPUs as catalog-key:count, comma separated",
    )
    p.add_argument(
        "--state",
        type=Path,
        default=None,
        help="with --nvml simulated: file holding the simulated GPUs' MIG state across restarts",
    )
    p.add_argument(
        "--sim-create-latency",
        type=non_negative_float,
        default=0.0,
        help="with --nvml simulated: seconds each GI/CI creation takes",
    )
    p.add_argument(
        "--sim-destroy-latency",
        type=non_negative_float,
        default=0.0,
        help="with --nvml simulated: seconds each GI/CI destruction takes",
    )
    p.add_argument(
        "--sim-char-devices",
        action="store_true",
        help="with --nvml simulated: make the driver's /dev entries real character devices (root), so a "
        "container runtime can inject them",
    )
    p.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="kubeconfig file (default $KUBECONFIG, ~/.kube/config, then in-cluster)",
    )
    p.add_argument(
        "--settle-seconds",
        type=non_negative_float,
        default=5.0,
        help="how long an instance the agent retires must be guarded (out of the ResourceSlice, or "
        "republished with binding conditions) and unallocated before it may be destroyed",
    )
    p.add_argument(
        "--quarantine-seconds",
        type=non_negative_float,
        default=120.0,
        help="partitionable inventory: how long the memory slices of a retired instance the agent destroyed "
        "get no instance of its own making (a floor), so that a pod a lagging scheduler bound to it from an "
        "older slice finds them free and its prepare creates it again",
    )
    p.add_argument(
        "--guard-free-instances",
        action="store_true",
        help="partitionable inventory: publish free instances with binding conditions too, so every "
        "booking waits for the agent (at least kube-scheduler's 5 s re-check); for clusters where a second "
        "scheduler binary allocates the same pools",
    )
    p.add_argument(
        "--placements-per-profile",
        type=_placements_per_profile,
        default=None,
        help="partitionable inventory: offer only the best-ranked N placements of each profile per GPU (0: "
        "every valid placement), or auto (default): the operator's choice from the number of GPU nodes, "
        "every placement up to 64 and one above; fewer devices keep kube-scheduler's cost per pod flat on "
        "large clusters (docs/install.md)",
    )
    p.add_argument(
        "--xid-effect",
        choices=["NoSchedule", "NoExecute"],
        default="NoSchedule",
        help="the taint a critical XID puts on the devices it affects (docs/operations.md, Device health); "
        "NoExecute also makes the scheduler's eviction controller move pods off them",
    )
    p.add_argument(
        "--xid-clear-after",
        type=non_negative_float,
        default=0.0,
        help="clear a GPU's XID faults after this many seconds without a new critical XID on it (0: only the "
        "GpuPartition's mig.dynamig.io/xid-cleared annotation clears them)",
    )
    p.add_argument(
        "--xid-ignore",
        default="",
        help="comma-separated XIDs that are no device fault, besides the application XIDs 13,31,43,45,68",
    )
    p.add_argument(
        "--interval",
        type=positive_float,
        default=10.0,
        help="seconds between rounds when all GPUs are Stable",
    )
    p.add_argument(
        "--reshape-poll", type=positive_float, default=0.5, help="seconds between rounds while reshaping"
    )
    p.add_argument(
        "--inventory",
        choices=("auto", "partitionable", "instances"),
        default="auto",
        help="how GPUs are published: partitionable (every placement bookable, cut when the scheduler "
        "allocates it), instances (existing instances only, re-cut ahead by the operator), or auto (ask the "
        "API server at start: partitionable where it keeps the fields and runs v1.37.2 or later, whose "
        "scheduler carries them at any cluster size)",
    )
    p.add_argument(
        "--metrics-port",
        type=_metrics_port,
        default=9465,
        help="Prometheus metrics port (0: any free port, -1: no metrics server)",
    )
    p.add_argument("--metrics-address", default="0.0.0.0", help="address the metrics server binds")
    add_metrics_security_arguments(p)
    p.add_argument(
        "--kubelet-plugin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve the kubelet DRA plugin (default: on with --nvml real, off with simulated)",
    )
    p.add_argument(
        "--kubelet-root",
        "--kubelet-dir",
        dest="kubelet_root",
        type=Path,
        default=Path("/var/lib/kubelet"),
        help="the kubelet's root directory",
    )
    p.add_argument("--cdi-root", type=Path, default=Path("/var/run/cdi"), help="where CDI specs are written")
    p.add_argument(
        "--cdi-base-spec",
        type=Path,
        default=None,
        help="NVIDIA's CDI spec for the node (nvidia-ctk cdi generate; YAML or JSON) whose common edits "
        "(driver libraries, nvidia-smi, hooks) go into every claim's spec (default <cdi-root>/nvidia.yaml)",
    )
    p.add_argument("--dev-root", type=Path, default=Path("/dev"), help="directory of the NVIDIA device nodes")
    p.add_argument(
        "--proc-root", type=Path, default=Path("/proc"), help="directory holding driver/nvidia/capabilities"
    )
    p.add_argument(
        "--proc-driver-nvidia",
        type=Path,
        default=None,
        help="the driver/nvidia directory itself, e.g. /host/proc/driver/nvidia (overrides --proc-root)",
    )
    p.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE") or "default",
        help="namespace of the node's heartbeat Lease dynamig-agent-<node> (default $POD_NAMESPACE, else "
        "default); the operator stops waiting for GPUs whose agent stops renewing it",
    )
    p.add_argument(
        "--lease-seconds",
        type=_lease_seconds,
        default=DEFAULT_LEASE_SECONDS,
        help=f"heartbeat Lease duration in seconds, 1-{int(MAX_LEASE_SECONDS)} (renewed every third of it "
        "while no round is stuck)",
    )
    p.add_argument(
        "--liveness-max-round-age",
        type=positive_float,
        default=180.0,
        help="seconds without a finished reconcile round after which /healthz fails (and the kubelet "
        "restarts the agent)",
    )
    add_logging_arguments(p)
    add_api_wait_argument(p)
    p.set_defaults(func=run)


def _metrics_port(text: str) -> int:
    """A port, 0 (any free one) or -1 (no metrics server)."""
    if text.strip() == "-1":
        return -1
    try:
        return port(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a port from 0 to 65535, or -1 for none, got {text!r}"
        ) from None


def run(args: argparse.Namespace) -> int:
    from dynamig.agent.controller import AgentSettings
    from dynamig.agent.health.xid import APPLICATION_XIDS
    from dynamig.agent.main import (
        AgentOptions,
        SimulationOptions,
        api_client_for,
        parse_simulated_gpus,
        run_agent,
    )
    from dynamig.agent.plugin.settings import PluginSettings
    from dynamig.cli._logging import configure_logging
    from dynamig.cli.errors import check_kubeconfig, reach_api
    from dynamig.geometry.catalog import load_catalog
    from dynamig.kube.gpupartition import Inventory
    from dynamig.kube.metricsauth import MetricsTLS

    configure_logging(args.log_level, args.log_format)
    if not args.node:
        raise CommandError("--node (or $NODE_NAME) is required", EXIT_USAGE)
    simulation = None
    if args.nvml == "simulated":
        catalog = load_catalog()
        try:
            keys = tuple(catalog.model(key).key for key in parse_simulated_gpus(args.simulate_gpus))
        except (KeyError, ValueError) as exc:
            raise CommandError(f"--simulate-gpus: {exc.args[0]}", EXIT_USAGE) from None
        simulation = SimulationOptions(
            gpus=keys,
            state_file=args.state,
            create_latency_s=args.sim_create_latency,
            destroy_latency_s=args.sim_destroy_latency,
            char_devices=args.sim_char_devices,
        )
    tls_files = metrics_tls_files(args)
    plugin = None
    serve_plugin = args.kubelet_plugin if args.kubelet_plugin is not None else args.nvml == "real"
    if serve_plugin:
        proc_root = args.proc_driver_nvidia.parent.parent if args.proc_driver_nvidia else args.proc_root
        plugin = PluginSettings(
            node_name=args.node,
            kubelet_root=args.kubelet_root,
            cdi_root=args.cdi_root,
            cdi_base_spec=args.cdi_base_spec,
            # Simulated GPUs have no driver to take the libraries from: device-nodes-only specs are fine.
            allow_missing_base_spec=args.nvml == "simulated",
            dev_root=args.dev_root,
            proc_root=proc_root,
        )
    options = AgentOptions(
        settings=AgentSettings(
            node=args.node,
            settle_seconds=args.settle_seconds,
            quarantine_seconds=args.quarantine_seconds,
            guard_free_instances=args.guard_free_instances,
            placements_per_profile=args.placements_per_profile,
            interval_seconds=args.interval,
            reshape_poll_seconds=args.reshape_poll,
            inventory={"partitionable": Inventory.PARTITIONABLE, "instances": Inventory.INSTANCES}.get(
                args.inventory
            ),
            lease_namespace=args.lease_namespace or None,
            lease_seconds=args.lease_seconds,
            xid_effect=args.xid_effect,
            xid_clear_after_seconds=args.xid_clear_after,
            xid_ignored=tuple(
                sorted(APPLICATION_XIDS | {int(x) for x in args.xid_ignore.split(",") if x.strip()})
            ),
        ),
        nvml=args.nvml,
        simulation=simulation,
        kubeconfig=args.kubeconfig,
        metrics_address=args.metrics_address,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        metrics_tls=MetricsTLS(*tls_files) if tls_files else None,
        metrics_authorize=args.metrics_authorize,
        plugin=plugin,
        liveness_max_round_age_s=args.liveness_max_round_age,
    )
    check_kubeconfig(args.kubeconfig)

    async def main() -> int:
        # The agent retries an unreachable server for ever (right once it runs): check it at start.
        api = await api_client_for(args.kubeconfig)
        try:
            await reach_api(api, args.wait_for_api)
        finally:
            await api.close()
        return await run_agent(options)

    return asyncio.run(main())


def _placements_per_profile(text: str) -> int | None:
    """``auto`` (None) or a whole number >= 0, or argparse's usage error."""
    try:
        return parse_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lease_seconds(text: str) -> int:
    """A Lease duration the API server and the chart's admission policy accept: 1 to MAX_LEASE_SECONDS (a
    longer one is refused at admission, and the operator would count only that much of it)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    top = int(MAX_LEASE_SECONDS)
    if not 1 <= value <= top:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number of seconds from 1 to {top} (the operator counts at most {top} s "
            "of a Lease, and the agent admission policy refuses a longer one)"
        )
    return value
