"""``dynamig uninstall``: take dynamig off a cluster cleanly (the chart's pre-delete hook runs it).

The operator is scaled to zero; every GPU is left at its policy's baseline (or empty with ``--leave
empty``), never destroying an instance a workload holds; each node's agent withdraws its ResourceSlices and
removes the CDI specs, checkpoint, plugin sockets and device nodes it made; then the remaining slices and the
GpuPartitions are deleted and dynamig's finalizers removed, so deleting the CRDs never hangs. Exit status 0
when every agent reported, 3 when some did not (they are listed; with ``--allow-unreported`` that is 0 too,
so that a dead node does not block ``helm uninstall``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dynamig.cli import plain
from dynamig.cli._logging import add_logging_arguments

EXIT_UNREPORTED = 3


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "uninstall",
        help="leave every GPU at its baseline, clean the nodes and remove dynamig's objects",
        description=plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kubeconfig", type=Path, default=None, help="kubeconfig path (default as kubectl)")
    parser.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    parser.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE"),
        help="dynamig's namespace: the operator Deployment and the agents' Leases (default $POD_NAMESPACE)",
    )
    parser.add_argument(
        "--operator-deployment", default=None, help="the operator's Deployment, scaled to zero first"
    )
    parser.add_argument(
        "--leave",
        choices=("baseline", "empty"),
        default="baseline",
        help="layout each GPU is left with: its policy's baseline (default) or no instances",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the agents (default 300)"
    )
    parser.add_argument(
        "--node",
        action="append",
        default=None,
        metavar="NAME",
        help="only the GPUs and slices of this node (repeatable; e.g. a pool leaving dynamig); the operator "
        "keeps running",
    )
    parser.add_argument(
        "--allow-unreported",
        action="store_true",
        help="exit 0 even when some agents did not report (a dead node must not block the removal)",
    )
    add_logging_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from dynamig.cli._logging import configure_logging
    from dynamig.geometry.catalog import load_catalog
    from dynamig.operator.handlers import api_client
    from dynamig.operator.settings import OperatorSettings
    from dynamig.operator.teardown import uninstall

    configure_logging(args.log_level, args.log_format)

    async def main() -> int:
        async with api_client(OperatorSettings(kubeconfig=args.kubeconfig, context=args.context)) as api:
            report = await uninstall(
                api,
                load_catalog(),
                leave=args.leave,
                namespace=args.namespace,
                operator_deployment=args.operator_deployment,
                timeout_s=args.timeout,
                nodes=frozenset(args.node) if args.node else None,
            )
        for gpu, layout in sorted(report.layouts.items()):
            if gpu in report.cleaned:
                state = "cleaned by its agent"
            elif gpu in report.orphaned:
                state = "its node is gone"
            else:
                state = f"NOT reported: {report.unreported.get(gpu)}"
            print(f"{gpu}: left with {layout}; {state}")
        print(
            f"{len(report.cleaned)}/{len(report.layouts)} GPU(s) cleaned by their agents; "
            f"{report.slices_deleted} ResourceSlice(s) and {report.partitions_deleted} GpuPartition(s) "
            f"deleted; finalizers removed from {len(report.finalizers_removed)} policy(ies)"
        )
        if report.complete or args.allow_unreported:
            return 0
        return EXIT_UNREPORTED

    return asyncio.run(main())
