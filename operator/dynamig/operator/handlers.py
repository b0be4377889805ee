"""Kopf wiring: an explicit registry with thin handlers, and :func:`run_operator` to run it in-process.

Handlers only parse and delegate to the :class:`~dynamig.operator.reconciler.Reconciler`:

- one daemon per GpuPartitionPolicy runs that policy's reshape loop (Kopf stops it when the policy is deleted
  and pauses it when peering hands control to another replica);
- one daemon on the GpuPartition CRD watches the agents' heartbeat Leases and withdraws silent agents' nodes,
  policy or not;
- watch events on pods, ResourceClaims, ResourceSlices, GpuPartitions, Nodes and policies wake the loops.

``run_operator(settings, stop_flag)`` builds every dependency in one place (API client from the kubeconfig,
catalog, metrics registry and endpoint) and runs Kopf until ``stop_flag`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import kopf
from kubernetes_asyncio import client, config
from prometheus_client import disable_created_metrics

from dynamig.geometry.catalog import Catalog, load_catalog
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, POLICY_PLURAL, VERSION
from dynamig.operator.kubeio import KubeIO
from dynamig.operator.kueue_checks import CRD as KUEUE_CRD
from dynamig.operator.kueue_checks import KueueChecks
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.reconciler import Reconciler
from dynamig.operator.settings import OperatorSettings

log = logging.getLogger(__name__)

ANNOTATION_PREFIX = "operator.dynamig.io"


def build_registry(reconciler: Reconciler, settings: OperatorSettings) -> kopf.OperatorRegistry:
    """A Kopf registry whose handlers close over ``reconciler`` (no module-level state)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)  # type: ignore[untyped-decorator]
    async def login(**_: Any) -> kopf.ConnectionInfo | None:
        # Kopf calls this again when the API answers 401, so an exec plugin's expired token (or a rotated
        # ServiceAccount token, read again in-cluster) is renewed. In-cluster, kubernetes-asyncio reads the
        # server from KUBERNETES_SERVICE_HOST/PORT as client-go does (Kopf's own helper dials the
        # kubernetes.default.svc name, which needs cluster DNS).
        return connection_info(await client_configuration(settings))

    @kopf.daemon(GROUP, VERSION, POLICY_PLURAL, registry=registry, cancellation_timeout=10.0)  # type: ignore[untyped-decorator]
    async def policy_loop(name: str, stopped: kopf.DaemonStopped, **_: Any) -> None:
        await reconciler.run_policy(name, stopped)

    if settings.agent_lease_namespace is not None:
        # Fencing needs no policy: one watchdog daemon, on the GpuPartition CRD (there while dynamig is
        # installed; the operator lists and watches CRDs already), so Kopf runs it on the leading replica.
        crd = f"{GPU_PARTITION_PLURAL}.{GROUP}"

        def is_crd(name: str, **_: Any) -> bool:
            return name == crd

        @kopf.daemon(  # type: ignore[untyped-decorator]
            "apiextensions.k8s.io", "v1", "customresourcedefinitions",
            registry=registry, when=is_crd, cancellation_timeout=10.0,
        )  # fmt: skip
        async def agent_watchdog(stopped: kopf.DaemonStopped, **_: Any) -> None:
            await reconciler.watch_agents(stopped)

    # Kueue's AdmissionCheck dynamig.io/mig-capacity: answered while Kueue's AdmissionCheck CRD exists.
    checks = KueueChecks(reconciler.kube, reconciler.catalog, reconciler.wall)

    def is_kueue_crd(name: str, **_: Any) -> bool:
        return name == KUEUE_CRD

    @kopf.daemon(  # type: ignore[untyped-decorator]
        "apiextensions.k8s.io", "v1", "customresourcedefinitions",
        registry=registry, when=is_kueue_crd, cancellation_timeout=10.0, id="kueue_checks",
    )  # fmt: skip
    async def kueue_checks(stopped: kopf.DaemonStopped, **_: Any) -> None:
        await checks.run(stopped)

    def wake(**_: Any) -> None:
        reconciler.wake()

    _without_finalizers(registry)

    for group, version, plural in (
        (GROUP, VERSION, POLICY_PLURAL),
        (GROUP, VERSION, GPU_PARTITION_PLURAL),
        ("resource.k8s.io", "v1", "resourceclaims"),
        ("resource.k8s.io", "v1", "resourceslices"),
        ("", "v1", "pods"),
        ("", "v1", "nodes"),
    ):
        kopf.on.event(group, version, plural, registry=registry, id=f"{WAKE_PREFIX}{plural}")(wake)
    return registry


class KopfChanged(RuntimeError):
    """The installed Kopf no longer has the internals :func:`_without_finalizers` relies on."""


def _without_finalizers(registry: kopf.OperatorRegistry) -> None:
    """Kopf puts a finalizer on every object a daemon serves, so that it can stop the daemon before the
    object goes; then `kubectl delete gpp` hangs whenever no operator runs. A policy loop needs no such
    guarantee (it ends when its policy is gone), so the daemons are registered as not needing one, and Kopf
    removes the finalizer from policies that still carry it.

    Kopf has no public switch for this (its maintainer declined one: nolar/kopf#896), so this reaches into
    its registry: ``OperatorRegistry._spawning._handlers``, a list of ``DaemonHandler`` dataclasses whose
    ``requires_finalizer`` ``SpawningRegistry.requires_finalizer`` reads (Kopf 1.45). Anything else raises
    :class:`KopfChanged` at start-up, before Kopf runs, rather than an operator that quietly finalizes again.
    """
    try:
        spawning = registry._spawning
        handlers = list(spawning._handlers)
        decides = spawning.requires_finalizer
    except (AttributeError, TypeError) as exc:
        raise _kopf_changed(f"its registry has no daemon list where 1.45 had one ({exc})") from exc
    kinds = {type(h).__name__ for h in handlers}
    if not handlers or kinds != {"DaemonHandler"} or not callable(decides):
        raise _kopf_changed(f"its daemon registry holds {sorted(kinds) or 'nothing'}, not DaemonHandlers")
    if not all(
        dataclasses.is_dataclass(h) and "requires_finalizer" in {f.name for f in dataclasses.fields(h)}
        for h in handlers
    ):
        raise _kopf_changed("its DaemonHandler has no requires_finalizer field")
    spawning._handlers = [dataclasses.replace(h, requires_finalizer=False) for h in handlers]
    if any(h.requires_finalizer for h in spawning._handlers):
        raise _kopf_changed("its daemon registry did not keep the handlers written back")


def _kopf_changed(what: str) -> KopfChanged:
    from importlib.metadata import version

    return KopfChanged(
        f"Kopf {version('kopf')} is not compatible with dynamig: {what}. dynamig registers its daemons "
        "without Kopf's finalizer (so a policy can be deleted while no operator runs) through Kopf's "
        "internal registry; install the Kopf version dynamig pins (requirements/runtime.lock)."
    )


def kubeconfig_available(settings: OperatorSettings) -> bool:
    """Whether a kubeconfig is to be used (kubectl's order): the flag, ``$KUBECONFIG``, ``~/.kube/config``;
    otherwise the in-cluster service account. Reads the environment."""
    return (
        settings.kubeconfig is not None
        or bool(os.environ.get("KUBECONFIG"))
        or Path("~/.kube/config").expanduser().is_file()
    )


async def client_configuration(settings: OperatorSettings) -> client.Configuration:
    """Credentials as kubectl finds them, loaded by kubernetes-asyncio: contexts, every ``$KUBECONFIG`` path,
    embedded data and exec credential plugins (EKS, GKE, AKS); else in-cluster. Runs an exec plugin if any."""
    conf = client.Configuration()
    if kubeconfig_available(settings):
        with _logged_only_if_loaded():
            try:
                await config.load_kube_config(
                    config_file=str(settings.kubeconfig) if settings.kubeconfig is not None else None,
                    context=settings.context,
                    client_configuration=conf,
                )
            except OSError as exc:  # an exec credential plugin that cannot be started
                raise config.ConfigException(_os_error_line(exc)) from exc
            except config.ConfigException as exc:  # "exec: process returned 1. <its stderr>"
                text = str(exc)
                if not text.startswith("exec: "):
                    raise
                raise config.ConfigException(
                    f"its user's exec credential plugin failed: {text.removeprefix('exec: ')}"
                ) from exc
    else:
        config.load_incluster_config(client_configuration=conf)
    return conf


KUBECONFIG_LOGGER = "kubernetes_asyncio.config.kube_config"


@contextlib.contextmanager
def _logged_only_if_loaded() -> Iterator[None]:
    """kubernetes-asyncio logs an exec credential plugin's failure at ERROR and also raises it; the raised
    error is what dynamig reports (one line on a command's stderr), so the records of a load that fails are
    dropped. Those of a load that succeeds (a plugin whose output holds no token) are passed on."""
    logger = logging.getLogger(KUBECONFIG_LOGGER)
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    logger.addFilter(hold)
    try:
        yield
    finally:
        logger.removeFilter(hold)
    for record in held:
        logger.handle(record)


def _os_error_line(exc: OSError) -> str:
    """What an OSError while loading the kubeconfig means, in words: the only program it starts is the
    user's exec credential plugin. Pure."""
    why = (exc.strerror or str(exc)).lower()
    if exc.filename:
        return f"its user's exec credential plugin {exc.filename} cannot be run ({why})"
    return f"loading it failed ({why})"


def connection_info(conf: client.Configuration) -> kopf.ConnectionInfo:
    """Kopf's credentials from a kubernetes-asyncio Configuration. Pure."""
    scheme, _, token = str(
        conf.api_key.get("BearerToken") or conf.api_key.get("authorization") or ""
    ).partition(" ")
    return kopf.ConnectionInfo(
        server=conf.host,
        ca_path=conf.ssl_ca_cert,
        insecure=not conf.verify_ssl,
        certificate_path=conf.cert_file,
        private_key_path=conf.key_file,
        scheme=scheme or None,
        token=token or None,
    )


WAKE_PREFIX = "wake-"


class QuietWakeHandlers(logging.Filter):
    """Kopf logs "Handler 'wake-pods' succeeded." at INFO for every watch event it hands to a wake handler:
    thousands of lines an hour on a busy cluster, saying nothing. They are kept at DEBUG only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not isinstance(record.msg, str):
            return True
        if not (record.msg.startswith(f"Handler '{WAKE_PREFIX}") and record.msg.endswith("succeeded.")):
            return True
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_kopf_watch_logs() -> None:
    """Side effect: installs :class:`QuietWakeHandlers` on Kopf's per-object logger (once)."""
    objects = logging.getLogger("kopf.objects")
    if not any(isinstance(f, QuietWakeHandlers) for f in objects.filters):
        objects.addFilter(QuietWakeHandlers())


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
    # Back within seconds of an API server outage of any length (read in Kopf 1.45.2's source):
    # - kopf/_cogs/clients/api.py `request()` retries a request that met a connection error, a timeout, a 5xx,
    #   403 or 429 after each delay of `networking.error_backoffs` (one attempt more than delays), then
    #   escalates. Its default (1, 1, 2, 3, 5, 8, 13, 21) waits up to 21 s: a watch came back up to 21 s after
    #   the API server did. Here no wait exceeds 2 s, and there are enough of them (about 6 minutes) that an
    #   outage of 5 minutes escalates nothing: a peering keep-alive that escalates is not restarted
    #   (kopf/_core/engines/peering.py `keepalive()` under `aiotasks.guard`), nor is a watcher whose request
    #   escalates a 5xx or 403 (kopf/_cogs/clients/watching.py: `continuous_watch()` ends quietly only on
    #   connection errors and timeouts, which `infinite_watch()` retries).
    # - `watching.reconnect_backoff` is the pause before `infinite_watch()` opens the next watch (list
    #   included); pinned at Kopf's default, 0.1 s.
    # - `networking.request_timeout` bounds a whole request but a watch (default 300 s, aiohttp's); the API
    #   server ends any other request after 60 s itself (kube-apiserver --request-timeout), so 70 s cuts
    #   nothing it would serve. `networking.connect_timeout` / `watching.connect_timeout` bound the TCP
    #   connect (default: none): an API server that drops packets instead of refusing costs a short attempt.
    # The policy loops read and write through kubernetes-asyncio, not Kopf, and retry alike (kubeio.py
    # `KubeIO._retry`, reconciler.py `Reconciler.run_policy`); Kopf's watches only wake them.
    ks.networking.error_backoffs = (0.5, 1.0, *(2.0,) * 180)  # 182 waits, about 6 minutes
    ks.networking.request_timeout = 70.0
    ks.networking.connect_timeout = 5.0
    ks.watching.connect_timeout = 5.0
    ks.watching.reconnect_backoff = 0.1
    return ks


@contextlib.asynccontextmanager
async def api_client(settings: OperatorSettings) -> AsyncIterator[client.ApiClient]:
    """A kubernetes-asyncio ApiClient from the kubeconfig, or in-cluster credentials when none is given."""
    conf = await client_configuration(settings)
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
    # No `_created` series beside each counter and histogram: the client library's switch, process-wide.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    metrics = metrics or OperatorMetrics()
    catalog = catalog or load_catalog()
    quiet_kopf_watch_logs()
    server = None
    secure = settings.metrics_tls_cert is not None and settings.metrics_tls_key is not None
    if settings.metrics_port is not None and not secure:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(
            settings.metrics_port, settings.metrics_host, registry=metrics.registry
        )
        log.info("metrics on http://%s:%d/metrics", settings.metrics_host, server.server_port)
    runner = None
    try:
        async with api_client(settings) as api:
            cert, key = settings.metrics_tls_cert, settings.metrics_tls_key
            if settings.metrics_port is not None and cert is not None and key is not None:
                from dynamig.kube.metricsauth import ApiAuthorizer, MetricsTLS, metrics_route, start

                runner, _port = await start(
                    [metrics_route(metrics.registry)],
                    settings.metrics_host,
                    settings.metrics_port,
                    tls=MetricsTLS(cert, key),
                    authorizer=ApiAuthorizer(api) if settings.metrics_authorize else None,
                )
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
        if runner is not None:
            await runner.cleanup()
