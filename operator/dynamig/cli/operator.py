"""``dynamig operator``: run the operator (Kopf) against a cluster.

Peering: by default replicas coordinate through the cluster-wide ``ClusterKopfPeering`` object named by
``--peering`` (default ``dynamig``; its CRD ships with Kopf and must be installed), so that only the replica
with the highest ``--priority`` acts. Kopf pauses *every* replica when two of them share a priority, so a
replica started without ``--priority`` picks a random one: exactly one of several identical replicas acts,
and another takes over when it stops (at once on a clean exit, after Kopf's peer lifetime on a crash).
``--standalone`` skips peering: use it for a single replica, tests and demos.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dynamig.cli._logging import add_logging_arguments
from dynamig.cli._metrics import add_metrics_security_arguments, metrics_tls_files
from dynamig.cli.args import non_negative_float, port, positive_float
from dynamig.cli.errors import add_api_wait_argument


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("operator", help="run the operator that reshapes MIG GPUs for pending claims")
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="kubeconfig path (default: every path in $KUBECONFIG, else ~/.kube/config, else the in-cluster "
        "service account); exec credential plugins work",
    )
    parser.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    parser.add_argument("--peering", default="dynamig", help="ClusterKopfPeering name shared by the replicas")
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority; the highest acts (default: random, distinct per replica)",
    )
    parser.add_argument("--standalone", action="store_true", help="no peering: act as the only replica")
    parser.add_argument(
        "--metrics-port", type=port, default=None, help="serve Prometheus /metrics on this port"
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of the metrics endpoint")
    add_metrics_security_arguments(parser)
    parser.add_argument(
        "--resync-seconds", type=positive_float, default=30.0, help="replan at least this often"
    )
    parser.add_argument(
        "--events-namespace", default="default", help="namespace for Events about cluster-scoped objects"
    )
    parser.add_argument(
        "--agent-lease-namespace",
        default=None,
        help="namespace of the agents' heartbeat Leases (default $POD_NAMESPACE, else default)",
    )
    parser.add_argument(
        "--stranded-after-seconds",
        type=non_negative_float,
        default=60.0,
        help="a pod bound to the devices of a node whose agent went silent, never started, is given back "
        "after the node has been fenced this long: deleted for its controller to create again, or told in "
        "an Event when no controller owns it",
    )
    parser.add_argument(
        "--device-plugin-classes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep a DeviceClass per offered MIG profile serving the device plugin's resource name for it "
        "(nvidia.com/mig-1g.10gb), so unchanged device-plugin pods are served (default: on)",
    )
    add_logging_arguments(parser)
    parser.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="serve Kopf's liveness probe at this URL, e.g. http://0.0.0.0:8080/healthz",
    )
    add_api_wait_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build settings from the flags (and $KUBECONFIG), then run until SIGINT/SIGTERM."""
    import asyncio
    import random
    import signal

    from dynamig.cli._logging import configure_logging
    from dynamig.cli.errors import check_kubeconfig, reach_api
    from dynamig.operator.handlers import api_client, run_operator
    from dynamig.operator.settings import OperatorSettings

    tls_files = metrics_tls_files(args)
    settings = OperatorSettings(
        kubeconfig=args.kubeconfig,
        context=args.context,
        standalone=args.standalone,
        peering_name=args.peering,
        priority=args.priority if args.priority is not None else random.SystemRandom().randint(1, 2**31 - 1),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        metrics_tls_cert=tls_files[0] if tls_files else None,
        metrics_tls_key=tls_files[1] if tls_files else None,
        metrics_authorize=args.metrics_authorize,
        resync_seconds=args.resync_seconds,
        events_namespace=args.events_namespace,
        agent_lease_namespace=args.agent_lease_namespace or os.environ.get("POD_NAMESPACE") or "default",
        stranded_after_seconds=args.stranded_after_seconds,
        log_level=args.log_level,
        liveness_endpoint=args.liveness,
        device_plugin_classes=args.device_plugin_classes,
    )
    configure_logging(args.log_level, args.log_format)
    check_kubeconfig(args.kubeconfig, args.context)

    async def main() -> None:
        # Kopf retries an unreachable server for minutes and then fails with a traceback: check first.
        async with api_client(settings) as api:
            await reach_api(api, args.wait_for_api)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_operator(settings, stop)

    asyncio.run(main())
    return 0
