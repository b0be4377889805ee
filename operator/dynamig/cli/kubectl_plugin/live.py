"""The commands' bodies: connect as kubectl does, read, print. Reads only; never writes to the cluster."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException

from dynamig.cli import render
from dynamig.cli.kubectl_plugin import EXIT_FAILED, EXIT_OK
from dynamig.cli.kubectl_plugin.report import (
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
    """An ApiClient logged in the way the operator logs in (kubectl's kubeconfig rules, exec plugins)."""
    from dynamig.operator.handlers import api_client
    from dynamig.operator.settings import OperatorSettings

    async with api_client(OperatorSettings(kubeconfig=args.kubeconfig, context=args.context)) as api:
        yield api


async def agent_namespace(api: client.ApiClient) -> str | None:
    """Namespace of the chart's agent pods (where they keep their heartbeat Leases), or None."""
    pods = await client.CoreV1Api(api).list_pod_for_all_namespaces(label_selector=AGENT_POD_SELECTOR, limit=1)
    items = pods.items or []
    return str(items[0].metadata.namespace) if items else None


async def snapshot(api: client.ApiClient, lease_namespace: str | None) -> Snapshot:
    """What one operator round reads, through the operator's own reader."""
    return await KubeIO(api).snapshot(lease_namespace)


async def _plan(args: argparse.Namespace) -> int:
    async with connected(args) as api:
        leases = args.agent_namespace or await agent_namespace(api)
        snap = await snapshot(api, leases)
    report = plan_report(snap, load_catalog(), time.time(), args.namespace, args.policy)
    print(plan_table(report) if args.output == "table" else render(report, args.output))
    return EXIT_OK


async def _verify(args: argparse.Namespace) -> int:
    async with connected(args) as api:
        body = await client.CustomObjectsApi(api).list_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL
        )
    rows = verify_report(body.get("items") or [])
    print(render(rows, "json") if args.output == "json" else verify_table(rows))
    return EXIT_OK if all(r["atSpec"] for r in rows) else EXIT_FAILED


async def _export(args: argparse.Namespace) -> int:
    async with connected(args) as api:
        snap = await snapshot(api, None)
    catalog = load_catalog()
    if args.shape == "scenario":
        doc = export_scenario(snap, catalog, time.time(), args.policy)
        print(yaml.safe_dump(doc, sort_keys=False), end="")
        return EXIT_OK
    policy, notes = export_policy_baseline(snap, catalog, time.time(), args.name, args.policy)
    print("\n".join(f"# {line}" for line in notes))
    print(yaml.safe_dump(policy, sort_keys=False), end="")
    return EXIT_OK


async def _must_gather(args: argparse.Namespace) -> int:
    from dynamig.cli.kubectl_plugin.gather import default_archive_name, gather

    path = args.output or default_archive_name(time.time())
    async with connected(args) as api:
        summary = await gather(api, path, args.namespace, args.selector, args.log_lines)
    print(f"wrote {path}: {summary}")
    return EXIT_OK


_COMMANDS = {"plan": _plan, "verify": _verify, "export": _export, "must-gather": _must_gather}


def run(args: argparse.Namespace) -> int:
    """Run the chosen command; connection and API errors become one line on stderr and exit status 1."""
    try:
        return asyncio.run(_COMMANDS[args.command](args))
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
    except ConfigException as exc:
        print(f"error: kubeconfig: {exc}", file=sys.stderr)
    except ApiException as exc:
        answer = f"{exc.status} {exc.reason}: {_api_message(exc)}"
        print(f"error: the API server answered {answer}", file=sys.stderr)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        print(f"error: cannot reach the API server: {exc}", file=sys.stderr)
    return EXIT_FAILED


def _api_message(exc: ApiException) -> str:
    try:
        body: Any = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return str(exc.body or "").strip()
    return str(body.get("message", "")) if isinstance(body, dict) else str(body)
