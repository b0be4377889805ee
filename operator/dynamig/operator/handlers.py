"""Kopf wiring: an explicit registry with thin handlers, and :func:`run_operator` to run it in-process.

Handlers only parse and delegate to the :class:`~dynamig.operator.reconciler.Reconciler`:

- one daemon per GpuPartitionPolicy runs that policy's reshape loop (Kopf stops it when the policy is deleted
  and pauses it when peering hands control to another replica);
- watch events on pods, ResourceClaims, ResourceSlices, GpuPartitions, Nodes and policies wake the loops.

``run_operator(settings, stop_flag)`` builds every dependency in one place (API client from the kubeconfig,
catalog, metrics registry and endpoint) and runs Kopf until ``stop_flag`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
import yaml
from kubernetes_asyncio import client, config

from dynamig.geometry.catalog import Catalog, load_catalog
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, POLICY_PLURAL, VERSION
from dynamig.operator.kubeio import KubeIO
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.reconciler import Reconciler
from dynamig.operator.settings import OperatorSettings

log = logging.getLogger(__name__)

ANNOTATION_PREFIX = "operator.dynamig.io"


def build_registry(reconciler: Reconciler, settings: OperatorSettings) -> kopf.OperatorRegistry:
    """A Kopf registry whose handlers close over ``reconciler`` (no module-level state)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)  # type: ignore[untyped-decorator]
    def login(**_: Any) -> kopf.ConnectionInfo | None:
        if settings.kubeconfig is None:
            return kopf.login_with_service_account()
        return connection_from_kubeconfig(settings.kubeconfig)

    @kopf.daemon(GROUP, VERSION, POLICY_PLURAL, registry=registry, cancellation_timeout=10.0)  # type: ignore[untyped-decorator]
    async def policy_loop(name: str, stopped: kopf.DaemonStopped, **_: Any) -> None:
        await reconciler.run_policy(name, stopped)

    def wake(**_: Any) -> None:
        reconciler.wake()

    for group, version, plural in (
        (GROUP, VERSION, POLICY_PLURAL),
        (GROUP, VERSION, GPU_PARTITION_PLURAL),
        ("resource.k8s.io", "v1", "resourceclaims"),
        ("resource.k8s.io", "v1", "resourceslices"),
        ("", "v1", "pods"),
        ("", "v1", "nodes"),
    ):
        kopf.on.event(group, version, plural, registry=registry, id=f"wake-{plural}")(wake)
    return registry


def connection_from_kubeconfig(path: Path) -> kopf.ConnectionInfo:
    """Kopf credentials from the current context of a kubeconfig (client certificates or a token). Reads the
    file."""
    doc = yaml.safe_load(path.read_text())
    ctx_name = doc.get("current-context")
    ctx = next(c["context"] for c in doc["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"])
    user: dict[str, Any] = next(
        (u["user"] for u in doc.get("users") or [] if u["name"] == ctx.get("user")), {}
    )
    base = path.parent

    def rel(p: str | None) -> str | None:
        return str((base / p).resolve()) if p else None

    return kopf.ConnectionInfo(
        server=cluster["server"],
        ca_path=rel(cluster.get("certificate-authority")),
        ca_data=_b64(cluster.get("certificate-authority-data")),
        insecure=cluster.get("insecure-skip-tls-verify"),
        certificate_path=rel(user.get("client-certificate")),
        certificate_data=_b64(user.get("client-certificate-data")),
        private_key_path=rel(user.get("client-key")),
        private_key_data=_b64(user.get("client-key-data")),
        token=user.get("token"),
        scheme="Bearer" if user.get("token") else None,
        default_namespace=ctx.get("namespace"),
    )


def _b64(data: str | None) -> bytes | None:
    import base64

    return base64.b64decode(data) if data else None


def kopf_settings(settings: OperatorSettings) -> kopf.OperatorSettings:
    """Kopf's settings: progress kept in annotations (the CRD status schema has no place for Kopf's own)."""
    ks = kopf.OperatorSettings()
    ks.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    ks.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=ANNOTATION_PREFIX)
    ks.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
    ks.posting.level = logging.WARNING  # Kopf's own handler-log Events: only problems
    ks.peering.name = settings.peering_name
    ks.peering.priority = settings.priority
    ks.peering.standalone = settings.standalone
    ks.peering.mandatory = not settings.standalone
    ks.watching.server_timeout = 60
    ks.watching.connect_timeout = 10
    return ks


@contextlib.asynccontextmanager
async def api_client(settings: OperatorSettings) -> AsyncIterator[client.ApiClient]:
    """A kubernetes-asyncio ApiClient from the kubeconfig, or in-cluster credentials when none is given."""
    conf = client.Configuration()
    if settings.kubeconfig is not None:
        await config.load_kube_config(config_file=str(settings.kubeconfig), client_configuration=conf)
    else:
        config.load_incluster_config(client_configuration=conf)
    async with client.ApiClient(configuration=conf) as api:
        yield api


async def run_operator(
    settings: OperatorSettings,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
    *,
    catalog: Catalog | None = None,
    metrics: OperatorMetrics | None = None,
) -> None:
    """Run the operator in the current event loop until ``stop_flag`` is set (or the task is cancelled).

    ``ready_flag`` is set once Kopf has started its watchers. ``metrics`` lets a caller read the Prometheus
    registry in-process; with ``settings.metrics_port`` set, ``/metrics`` is also served over HTTP.
    """
    metrics = metrics or OperatorMetrics()
    catalog = catalog or load_catalog()
    server = None
    if settings.metrics_port is not None:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(
            settings.metrics_port, settings.metrics_host, registry=metrics.registry
        )
        log.info("metrics on http://%s:%d/metrics", settings.metrics_host, server.server_port)
    try:
        async with api_client(settings) as api:
            reconciler = Reconciler(KubeIO(api), catalog, metrics, settings)
            registry = build_registry(reconciler, settings)
            await kopf.operator(
                registry=registry,
                settings=kopf_settings(settings),
                clusterwide=True,
                standalone=settings.standalone,
                # Kopf makes peering mandatory whenever a name is passed, even when standalone.
                peering_name=None if settings.standalone else settings.peering_name,
                priority=settings.priority,
                identity=settings.peer_id,
                stop_flag=stop_flag,
                ready_flag=ready_flag,
                liveness_endpoint=settings.liveness_endpoint,
            )
    finally:
        if server is not None:
            server.shutdown()
