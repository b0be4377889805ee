"""``/metrics`` over TLS for callers the API server vouches for, as kube-rbac-proxy serves it.

A scrape carries a bearer token. The API server says whose it is (TokenReview) and whether that user may
``get`` the non-resource URL ``/metrics`` (SubjectAccessReview): Prometheus' ClusterRole in the usual
monitoring stacks grants exactly that, and so does the chart's ``<release>-metrics-reader``. The answers are
kept for a minute per token, so a scraper costs the API server two reviews a minute, not two per scrape.
Only the paths given are guarded: the kubelet's probes (``/healthz``, ``/readyz``) carry no token.

The serving certificate is read again when its files change (cert-manager renews it in place in the mounted
Secret), at the next TLS handshake.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

CACHE_SECONDS = 60.0
_CACHE_MAX = 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class MetricsTLS:
    """The serving certificate (PEM, chain first) and its private key."""

    cert_file: Path
    key_file: Path


@dataclass(frozen=True, slots=True)
class Decision:
    """An HTTP status for the request (200 lets it through) and why."""

    status: int
    reason: str


class ReloadingTLS:
    """A server SSLContext whose certificate follows its files: each handshake looks at their mtimes and
    switches to a context with the new pair when they changed (a broken pair keeps the old one, logged)."""

    def __init__(self, tls: MetricsTLS) -> None:
        self._tls = tls
        self._stamp = self._mtimes()
        self._current = self._load()
        self.context = self._load()
        self.context.sni_callback = self._on_hello

    def _mtimes(self) -> tuple[int, int]:
        return (os.stat(self._tls.cert_file).st_mtime_ns, os.stat(self._tls.key_file).st_mtime_ns)

    def _load(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self._tls.cert_file, self._tls.key_file)
        return ctx

    def _on_hello(self, sock: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _ctx: ssl.SSLContext) -> None:
        try:
            stamp = self._mtimes()
            if stamp != self._stamp:
                self._current = self._load()
                self._stamp = stamp
                log.info("metrics: serving certificate %s reloaded", self._tls.cert_file)
        except (OSError, ssl.SSLError) as exc:
            log.warning("metrics: keeping the previous serving certificate: %s", exc)
        sock.context = self._current


class ApiAuthorizer:
    """Whether a bearer token may ``get`` ``path``, as the API server answers (TokenReview, then
    SubjectAccessReview), cached per token for ``ttl`` seconds."""

    def __init__(
        self,
        api: client.ApiClient,
        path: str = "/metrics",
        ttl: float = CACHE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._authn = client.AuthenticationV1Api(api)
        self._authz = client.AuthorizationV1Api(api)
        self._path = path
        self._ttl = ttl
        self._clock = clock
        self._cache: dict[str, tuple[float, Decision]] = {}

    async def check(self, token: str) -> Decision:
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self._clock()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            decision = await self._review(token)
        except (ApiException, OSError) as exc:
            # Not cached: the next scrape asks again.
            log.warning("metrics: cannot review a scrape's token with the API server: %s", exc)
            return Decision(503, "the API server could not be asked about this token")
        if len(self._cache) >= _CACHE_MAX:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
        self._cache[key] = (now + self._ttl, decision)
        return decision

    async def _review(self, token: str) -> Decision:
        review: Any = await self._authn.create_token_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
        )
        status = review.status
        if status is None or not status.authenticated or status.user is None:
            return Decision(401, "the token is not valid")
        user = status.user
        sar: Any = await self._authz.create_subject_access_review(
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": user.username,
                    "groups": user.groups or [],
                    "uid": user.uid or "",
                    "extra": user.extra or {},
                    "nonResourceAttributes": {"path": self._path, "verb": "get"},
                },
            }
        )
        if sar.status is not None and sar.status.allowed:
            return Decision(200, "allowed")
        return Decision(403, f"{user.username} may not get {self._path}")


def guard(authorizer: ApiAuthorizer, paths: Collection[str]) -> Middleware:
    """aiohttp middleware: requests for ``paths`` need a bearer token the authorizer allows (401 without or
    with an invalid one, 403 for a user without the permission); other paths pass."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in paths:
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return web.Response(
                status=401, text="a bearer token is required\n", headers={"WWW-Authenticate": "Bearer"}
            )
        decision = await authorizer.check(token)
        if decision.status != 200:
            return web.Response(status=decision.status, text=decision.reason + "\n")
        return await handler(request)

    return middleware


def metrics_route(registry: CollectorRegistry) -> web.RouteDef:
    """``GET /metrics``: the registry in Prometheus' text format."""

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return web.get("/metrics", metrics)


async def start(
    routes: list[web.RouteDef],
    address: str,
    port: int,
    *,
    tls: MetricsTLS | None = None,
    authorizer: ApiAuthorizer | None = None,
    guarded: Collection[str] = ("/metrics",),
) -> tuple[web.AppRunner, int]:
    """Serves ``routes`` on ``address:port`` (0: any free port), over TLS with ``tls``, with ``guarded``
    paths behind ``authorizer``. Returns the runner (``await runner.cleanup()`` stops it) and the bound port.
    A token is never asked for over plain HTTP: an authorizer needs ``tls`` (ValueError)."""
    if authorizer is not None and tls is None:
        raise ValueError("bearer-token authorization of /metrics needs TLS (a certificate and key)")
    app = web.Application(middlewares=[guard(authorizer, guarded)] if authorizer is not None else [])
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    # Bound here, so port 0 gives a known port to log.
    sock = socket.create_server((address, port), family=socket.AF_INET6 if ":" in address else socket.AF_INET)
    await web.SockSite(
        runner, sock, ssl_context=ReloadingTLS(tls).context if tls is not None else None
    ).start()
    bound: int = sock.getsockname()[1]
    log.info(
        "metrics on %s://%s:%d/metrics%s",
        "https" if tls is not None else "http",
        address,
        bound,
        " (bearer tokens the API server allows to get /metrics)" if authorizer is not None else "",
    )
    return runner, bound
