"""The agent's HTTP endpoints: ``/metrics``, ``/healthz`` and ``/readyz``, served from the agent's own event
loop (aiohttp), so a blocked loop fails every probe instead of a side thread answering for it.

``/healthz`` (liveness) is 200 while the reconcile loop has finished a round (successful or not) within
``max_round_age_s`` and, where the kubelet plugin is served, both its sockets answer the gRPC health check
(SERVING); a hung round, a removed socket or a gRPC server that no longer answers makes it 503 with the
reason, and the kubelet restarts the container. ``/readyz`` is 200 once
the first round finished and the kubelet has registered the plugin (when served): before that the node's
pods cannot get devices from it. Bodies are JSON: ``{"ok": bool, "checks": {name: reason-or-"ok"}}``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from dynamig.kube.metricsauth import ApiAuthorizer, MetricsTLS, metrics_route, start

log = logging.getLogger(__name__)


@dataclass
class Health:
    """What the probes look at; the agent's loop and the plugin report into it."""

    max_round_age_s: float
    clock: Callable[[], float] = time.monotonic
    started_at: float = field(default=0.0)
    last_round_at: float | None = None
    plugin_probe: Callable[[], Awaitable[str]] | None = None  # "ok" or why the plugin is not serving
    plugin_registered: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        self.started_at = self.clock()

    def round_finished(self) -> None:
        self.last_round_at = self.clock()

    async def liveness(self) -> dict[str, str]:
        """Check name -> "ok" or why not. Side effect: the plugin probe."""
        now = self.clock()
        since = now - (self.last_round_at if self.last_round_at is not None else self.started_at)
        checks = {
            "reconcile-loop": "ok"
            if since <= self.max_round_age_s
            else f"no reconcile round finished for {since:.0f}s (limit {self.max_round_age_s:.0f}s)"
        }
        if self.plugin_probe is not None:
            checks["kubelet-plugin"] = await self.plugin_probe()
        return checks

    async def readiness(self) -> dict[str, str]:
        checks = await self.liveness()
        checks["first-round"] = "ok" if self.last_round_at is not None else "no reconcile round finished yet"
        if self.plugin_registered is not None:
            registered = self.plugin_registered()
            checks["kubelet-registration"] = (
                "ok" if registered else "the kubelet has not registered the plugin"
            )
        return checks


def _answer(checks: dict[str, str]) -> web.Response:
    ok = all(v == "ok" for v in checks.values())
    body: dict[str, Any] = {"ok": ok, "checks": checks}
    return web.Response(status=200 if ok else 503, text=json.dumps(body), content_type="application/json")


async def serve(
    health: Health,
    registry: CollectorRegistry,
    address: str,
    port: int,
    *,
    tls: MetricsTLS | None = None,
    authorizer: ApiAuthorizer | None = None,
) -> web.AppRunner:
    """Starts the endpoints on ``address:port`` (0: any free port; the port is logged), over TLS with
    ``tls`` and ``/metrics`` behind ``authorizer`` (dynamig.kube.metricsauth; the probes stay open). Returns
    the runner (``await runner.cleanup()`` stops it)."""

    async def healthz(_request: web.Request) -> web.Response:
        return _answer(await health.liveness())

    async def readyz(_request: web.Request) -> web.Response:
        return _answer(await health.readiness())

    routes = [metrics_route(registry), web.get("/healthz", healthz), web.get("/readyz", readyz)]
    runner, _port = await start(routes, address, port, tls=tls, authorizer=authorizer)
    return runner
