"""``dynamig uninstall``: take dynamig off a cluster cleanly (the chart's pre-delete hook runs it).

The operator is scaled to zero; every GPU is left at its policy's baseline (or empty with ``--leave
empty``), never destroying an instance a workload holds; each node's agent withdraws its ResourceSlices and
removes the CDI specs, checkpoint, plugin sockets and device nodes it made; then the remaining slices and the
GpuPartitions are deleted and dynamig's finalizers removed, so deleting the CRDs never hangs. Exit status 0
when every agent reported, 3 when some did not (they are listed; with ``--allow-unreported`` that is 0 too,
so that a dead node does not block ``helm uninstall``).

``--dry-run`` reads the cluster and prints what would happen (the operator scaled, the layout each GPU is
left with, the objects deleted) and changes nothing. Otherwise a person at a terminal is shown the same and
asked to confirm; ``--yes`` skips the question, and without a terminal it is required. Runs that predate it
keep working without it: the chart's hook (``--allow-unreported``) and removals of named nodes (``--node``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dynamig.cli import plain
from dynamig.cli._logging import add_logging_arguments
from dynamig.cli.args import non_negative_float
from dynamig.cli.errors import EXIT_USAGE, CommandError, add_api_wait_argument

if TYPE_CHECKING:  # the Kubernetes client and the operator load when the command runs
    from dynamig.geometry.catalog import Catalog
    from dynamig.operator.kubeio import Snapshot
    from dynamig.operator.teardown import Leave

EXIT_UNREPORTED = 3
EXIT_DECLINED = 1


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
        "--timeout",
        type=non_negative_float,
        default=300.0,
        help="seconds to wait for the agents (default 300)",
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
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print what it would do (the layout each GPU is left with, the objects deleted); change nothing",
    )
    parser.add_argument(
        "-y",
        "--yes",
        action="store_true",
        help="do not ask for confirmation (required when not run from a terminal)",
    )
    add_api_wait_argument(parser)
    add_logging_arguments(parser)
    parser.set_defaults(func=run)


def confirmation(args: argparse.Namespace, interactive: bool) -> Literal["go", "ask"]:
    """Whether to go ahead ("go") or ask the person at the terminal ("ask"); raises :class:`CommandError`
    when nobody can confirm. ``interactive``: stdin and stderr are a terminal. Pure."""
    if args.dry_run or args.yes:
        return "go"
    if interactive:
        return "ask"
    raise CommandError(
        "not run from a terminal, so nobody can confirm: pass --yes to uninstall (or --dry-run to see what "
        "it would do)",
        EXIT_USAGE,
    )


@dataclass(frozen=True)
class UninstallPlan:
    """What ``dynamig uninstall`` would do now, read from the cluster."""

    scale: str | None  # namespace/name of the operator Deployment scaled to zero
    layouts: Mapping[str, str]  # GPU -> the layout it is left with
    kept: frozenset[str]  # GPUs without a baseline to go to: they keep their layout
    nodes: tuple[str, ...]  # the nodes whose agents are waited for
    slices: tuple[str, ...]  # the driver's ResourceSlices now published (what the agents leave is deleted)
    finalizers: tuple[str, ...]  # policies that lose dynamig's finalizers
    classes: tuple[str, ...] = ()  # the operator's profile DeviceClasses (a whole-cluster uninstall only)


def plan_uninstall(
    snap: Snapshot,
    slices: Sequence[Mapping[str, Any]],
    catalog: Catalog,
    now: float,
    *,
    leave: Leave,
    namespace: str | None,
    operator_deployment: str | None,
    nodes: frozenset[str] | None,
) -> UninstallPlan:
    """The steps of :func:`dynamig.operator.teardown.uninstall`, computed instead of taken. Pure."""
    from dynamig.kube.gpupartition import layout_summary, parse_gpu_partition
    from dynamig.operator.extended import class_changes
    from dynamig.operator.teardown import OWN_FINALIZER_PREFIXES, _node_of, left_layout
    from dynamig.operator.world import parse_world

    world = parse_world(snap, catalog, now)
    layouts: dict[str, str] = {}
    kept: set[str] = set()
    waited: set[str] = set()
    for part in snap.partitions:
        node = _node_of(part)
        if nodes is not None and node not in nodes:
            continue
        name = str(part["metadata"]["name"])
        layout = left_layout(world, part, leave)
        spec = {**(part.get("spec") or {}), "offeredProfiles": []}  # the merge patch uninstall writes
        if layout is None:
            kept.add(name)
        else:
            spec["layout"] = layout
        layouts[name] = layout_summary(parse_gpu_partition({**part, "spec": spec}).spec.desired())
        if node:
            waited.add(node)
    return UninstallPlan(
        scale=f"{namespace}/{operator_deployment}"
        if namespace and operator_deployment and nodes is None
        else None,
        layouts=dict(sorted(layouts.items())),
        kept=frozenset(kept),
        nodes=tuple(sorted(waited)),
        slices=tuple(
            sorted(
                str(s["metadata"]["name"])
                for s in slices
                if nodes is None or (s.get("spec") or {}).get("nodeName") in nodes
            )
        ),
        finalizers=tuple(
            sorted(
                str(p["metadata"]["name"])
                for p in snap.policies
                if any(
                    str(f).startswith(OWN_FINALIZER_PREFIXES) for f in p["metadata"].get("finalizers") or []
                )
            )
        ),
        classes=class_changes((), snap.device_classes).delete if nodes is None else (),
    )


def plan_lines(plan: UninstallPlan, *, leave: str, timeout_s: float) -> list[str]:
    """The plan as the lines ``--dry-run`` prints and the confirmation shows. Pure."""
    lines = []
    if plan.scale:
        lines.append(f"would scale the operator Deployment {plan.scale} to zero replicas")
    why = "empty" if leave == "empty" else "its policy's baseline"
    for gpu, layout in plan.layouts.items():
        because = "no baseline: keeps its layout" if gpu in plan.kept else why
        lines.append(f"would leave {gpu} with {layout} ({because})")
    if plan.nodes:
        lines.append(
            f"would wait up to {timeout_s:.0f}s for the agents of {len(plan.nodes)} node(s) to withdraw "
            f"their GPUs and clean the node: {', '.join(plan.nodes)}"
        )
    lines.append(
        f"would delete {len(plan.slices)} ResourceSlice(s) of mig.dynamig.io (those the agents leave)"
        + (f": {', '.join(plan.slices)}" if plan.slices else "")
    )
    lines.append(
        f"would delete {len(plan.layouts)} GpuPartition(s)"
        + (f": {', '.join(plan.layouts)}" if plan.layouts else "")
    )
    if plan.classes:
        lines.append(f"would delete the profile DeviceClass(es) {', '.join(plan.classes)}")
    if plan.finalizers:
        lines.append(
            f"would remove dynamig's finalizers from GpuPartitionPolicy(ies): {', '.join(plan.finalizers)}"
        )
    return lines


async def read_plan(api: Any, args: argparse.Namespace, catalog: Catalog) -> UninstallPlan:
    """Read what :func:`plan_uninstall` needs. Side effect: API reads only."""
    from kubernetes_asyncio import client

    from dynamig import DRIVER_NAME
    from dynamig.operator.kubeio import RESOURCE_GROUP, RESOURCE_VERSION, KubeIO

    snap = await KubeIO(api).snapshot(args.namespace)
    listed = await client.CustomObjectsApi(api).list_cluster_custom_object(
        RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", field_selector=f"spec.driver={DRIVER_NAME}"
    )
    return plan_uninstall(
        snap,
        listed.get("items") or [],
        catalog,
        time.time(),
        leave=args.leave,
        namespace=args.namespace,
        operator_deployment=args.operator_deployment,
        nodes=frozenset(args.node) if args.node else None,
    )


def _confirmed(server: str, lines: Sequence[str]) -> bool:
    """Show the plan and ask on the terminal (Ctrl-C is a no). Side effects: writes stderr, reads stdin."""
    print(f"dynamig uninstall on the cluster at {server}:", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    print("Proceed? [y/N] ", end="", file=sys.stderr, flush=True)
    try:
        return sys.stdin.readline().strip().lower() in ("y", "yes")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return False


def run(args: argparse.Namespace) -> int:
    import asyncio

    from dynamig.cli._logging import configure_logging
    from dynamig.cli.errors import check_kubeconfig, reach_api
    from dynamig.geometry.catalog import load_catalog
    from dynamig.operator.handlers import api_client
    from dynamig.operator.settings import OperatorSettings
    from dynamig.operator.teardown import uninstall

    configure_logging(args.log_level, args.log_format)
    # Refused before anything is read: a script without --yes learns it at once.
    decision = confirmation(args, sys.stdin.isatty() and sys.stderr.isatty())
    check_kubeconfig(args.kubeconfig, args.context)
    settings = OperatorSettings(kubeconfig=args.kubeconfig, context=args.context)

    async def read() -> tuple[str, list[str]]:
        async with api_client(settings) as api:
            await reach_api(api, args.wait_for_api)
            plan = await read_plan(api, args, load_catalog())
            return str(api.configuration.host), plan_lines(plan, leave=args.leave, timeout_s=args.timeout)

    if args.dry_run or decision == "ask":
        server, lines = asyncio.run(read())
        if args.dry_run:
            print(f"dry run on the cluster at {server}: nothing is changed")
            print("\n".join(lines))
            return 0
        # Asked outside the event loop, so that Ctrl-C stops the question at once.
        if not _confirmed(server, lines):
            raise CommandError("not confirmed: nothing was changed", EXIT_DECLINED)

    async def main() -> int:
        async with api_client(settings) as api:
            # Nothing is changed unless the server answers first: no half-done removal on a wrong context.
            await reach_api(api, args.wait_for_api)
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
            f"{report.slices_deleted} ResourceSlice(s), {report.partitions_deleted} GpuPartition(s) and "
            f"{report.classes_deleted} profile DeviceClass(es) deleted; finalizers removed from "
            f"{len(report.finalizers_removed)} policy(ies)"
        )
        if report.complete or args.allow_unreported:
            return 0
        return EXIT_UNREPORTED

    return asyncio.run(main())
