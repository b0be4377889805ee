"""The commands' bodies: connect as kubectl does, read, print. Reads only; never writes to the cluster."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException

from dynamig.cli import OUTPUT_FORMATS, render
from dynamig.cli.errors import EXIT_USAGE, CommandError, check_kubeconfig, describe, exit_code, reach_api
from dynamig.cli.kubectl_plugin import EXIT_FAILED, EXIT_OK, PROG
from dynamig.cli.kubectl_plugin.report import (
    PreemptionReads,
    ReportError,
    export_policy_baseline,
    export_scenario,
    plan_report,
    plan_table,
    verify_report,
    verify_table,
)
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION
from dynamig.operator.kubeio import KubeIO, Snapshot

AGENT_POD_SELECTOR = "app.kubernetes.io/name=dynamig,app.kubernetes.io/component=agent"


@contextlib.asynccontextmanager
async def connected(args: argparse.Namespace) -> AsyncIterator[client.ApiClient]:
    """An ApiClient logged in the way the operator logs in (kubectl's kubeconfig rules, exec plugins), once
    the API server has answered ``GET /version`` with these credentials: a server that cannot be reached, or
    that refuses them, is the same one line as from ``dynamig operator`` and ``uninstall``
    (:func:`dynamig.cli.errors.reach_api`, tried once), before a command reads anything (must-gather would
    otherwise write an archive of nothing but failures)."""
    from dynamig.operator.handlers import api_client
    from dynamig.operator.settings import OperatorSettings

    async with api_client(OperatorSettings(kubeconfig=args.kubeconfig, context=args.context)) as api:
        await reach_api(api, 0.0)
        yield api


async def agent_namespace(api: client.ApiClient) -> str | None:
    """Namespace of the chart's agent pods (where they keep their heartbeat Leases), or None."""
    pods = await client.CoreV1Api(api).list_pod_for_all_namespaces(label_selector=AGENT_POD_SELECTOR, limit=1)
    items = pods.items or []
    return str(items[0].metadata.namespace) if items else None


async def snapshot(api: client.ApiClient, lease_namespace: str | None) -> Snapshot:
    """What one operator round reads, through the operator's own reader."""
    return await KubeIO(api).snapshot(lease_namespace)


async def preemption_reads(api: client.ApiClient, snap: Snapshot) -> PreemptionReads | None:
    """What the operator's victim search reads beyond the snapshot, when a policy preempts; what cannot be
    read (RBAC) is said, and then no pod is taken for a victim."""
    specs = [(p.get("spec") or {}).get("preemption") or {} for p in snap.policies]
    if not any(s.get("mode") in ("DryRun", "Evict") for s in specs):
        return None
    io = KubeIO(api, attempts=2)
    try:
        running, pdbs = await io.list_running_pods(), await io.list_disruption_budgets()
    except ApiException as exc:
        return PreemptionReads(unread=f"cannot list pods or PodDisruptionBudgets: {exc.status} {exc.reason}")
    if not any(s.get("namespaceSelector") is not None for s in specs):
        return PreemptionReads(running, pdbs, None, "")
    try:
        return PreemptionReads(running, pdbs, await io.list_namespace_labels(), "")
    except ApiException as exc:
        return PreemptionReads(running, pdbs, None, f"cannot list namespaces: {exc.status} {exc.reason}")


async def _plan(args: argparse.Namespace) -> int:
    async with connected(args) as api:
        leases = args.agent_namespace or await agent_namespace(api)
        snap = await snapshot(api, leases)
        reads = await preemption_reads(api, snap)
    report = plan_report(snap, load_catalog(), time.time(), args.namespace, args.policy, reads)
    print(plan_table(report) if args.output == "table" else render(report, args.output))
    return EXIT_OK


async def _verify(args: argparse.Namespace) -> int:
    async with connected(args) as api:
        body = await client.CustomObjectsApi(api).list_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL
        )
    rows = verify_report(body.get("items") or [])
    print(verify_table(rows) if args.output == "table" else render(rows, args.output))
    return EXIT_OK if all(r["atSpec"] for r in rows) else EXIT_FAILED


async def _export(args: argparse.Namespace) -> int:
    async with connected(args) as api:
        snap = await snapshot(api, None)
    catalog = load_catalog()
    if args.shape == "scenario":
        doc = export_scenario(snap, catalog, time.time(), args.policy)
        notes: list[str] = []
    else:
        doc, notes = export_policy_baseline(snap, catalog, time.time(), args.name, args.policy)
    if args.output == "json":  # JSON has no comments: the notes go to stderr
        print("\n".join(f"# {line}" for line in notes), file=sys.stderr)
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(f"# {line}" for line in notes) + ("\n" if notes else ""), end="")
        print(yaml.safe_dump(doc, sort_keys=False), end="")
    return EXIT_OK


async def _must_gather(args: argparse.Namespace) -> int:
    from dynamig.cli.kubectl_plugin.gather import default_archive_name, gather

    path = args.output or default_archive_name(time.time())
    async with connected(args) as api:
        summary = await gather(api, path, args.namespace, args.selector, args.log_lines)
    print(f"wrote {path}: {summary}")
    return EXIT_OK


_COMMANDS = {"plan": _plan, "verify": _verify, "export": _export, "must-gather": _must_gather}


def check_arguments(args: argparse.Namespace) -> None:
    """CommandError (usage) for what a command cannot honour, before it connects: a report format it does
    not print, an archive that could not be written. Reads the file system."""
    if args.command == "export" and args.output == "table":
        raise CommandError(
            "-o table: export prints a manifest, not a table; use -o yaml (the default) or -o json",
            EXIT_USAGE,
        )
    if args.command == "must-gather" and args.output is not None:
        path: Path = args.output
        if str(path) in (*OUTPUT_FORMATS, "wide"):
            raise CommandError(
                f"-o {path}: must-gather writes an archive, not a report; -o names the archive file "
                "(e.g. -o gather.tar.gz)",
                EXIT_USAGE,
            )
        if path.is_dir():
            raise CommandError(
                f"-o {path}: a directory; name the archive file, e.g. -o {path}/gather.tar.gz", EXIT_USAGE
            )
        if not path.parent.is_dir():
            raise CommandError(f"-o {path}: no directory {path.parent} to write the archive in", EXIT_USAGE)


def run(args: argparse.Namespace) -> int:
    """Run the chosen command. What a person can fix (flags, kubeconfig, context, API server, credentials)
    is one line on stderr, ``kubectl dynamig COMMAND: ...``, and exit status 1 (2 for a usage error)."""
    try:
        check_arguments(args)
        check_kubeconfig(args.kubeconfig, args.context)
        return asyncio.run(_COMMANDS[args.command](args))
    except ReportError as exc:
        message, status = str(exc), EXIT_FAILED
    except ApiException as exc:
        described = describe(exc)  # 401 and 403 say what to do
        message = described or f"the API server answered {exc.status} {exc.reason}: {_api_message(exc)}"
        status = EXIT_FAILED
    except (CommandError, ConfigException, aiohttp.ClientError, OSError, TimeoutError) as exc:
        message = describe(exc) or _plain(exc)
        status = exit_code(exc)
    print(f"{PROG} {args.command}: {' '.join(message.split())}", file=sys.stderr)
    return status


def _plain(exc: BaseException) -> str:
    """The one line for a failure :func:`describe` does not word."""
    if isinstance(exc, TimeoutError):
        return "the API server did not answer in time: check that the cluster is up"
    if isinstance(exc, OSError) and not isinstance(exc, aiohttp.ClientError) and exc.filename:
        return f"{exc.filename}: {(exc.strerror or str(exc)).lower()}"
    return f"cannot reach the API server: {exc}"


def _api_message(exc: ApiException) -> str:
    try:
        body: Any = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return str(exc.body or "").strip()
    return str(body.get("message", "")) if isinstance(body, dict) else str(body)
