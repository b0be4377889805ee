"""The agent's probes (``dynamig.agent.endpoints``): what makes liveness and readiness fail (a fake clock),
and the plugin's gRPC health service as the standard grpc.health.v1 client sees it over its unix sockets."""

from __future__ import annotations

import socket
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dynamig.agent.endpoints import Health
from dynamig.agent.plugin.server import _start_unix_server, probe_sockets


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_liveness_follows_the_reconcile_loop_and_the_plugin() -> None:
    clock = Clock()
    health = Health(max_round_age_s=60, clock=clock)
    assert await health.liveness() == {"reconcile-loop": "ok"}  # starting: the first round has 60 s
    clock.now += 61
    assert "no reconcile round finished for 61s" in (await health.liveness())["reconcile-loop"]
    health.round_finished()
    assert await health.liveness() == {"reconcile-loop": "ok"}
    verdict = "socket gone: /x/dra.sock"

    async def probe() -> str:
        return verdict

    health.plugin_probe = probe
    assert (await health.liveness())["kubelet-plugin"] == "socket gone: /x/dra.sock"
    verdict = "ok"
    assert set((await health.liveness()).values()) == {"ok"}


async def test_readiness_waits_for_the_first_round_and_the_kubelet_registration() -> None:
    clock = Clock()
    registered = False
    health = Health(max_round_age_s=60, clock=clock, plugin_registered=lambda: registered)
    checks = await health.readiness()
    assert checks["first-round"] == "no reconcile round finished yet"
    assert checks["kubelet-registration"] == "the kubelet has not registered the plugin"
    health.round_finished()
    registered = True
    assert set((await health.readiness()).values()) == {"ok"}


async def test_plugin_sockets_serve_grpc_health_until_stopped(tmp_path: Path) -> None:
    sock = tmp_path / "dra.sock"
    server = await _start_unix_server(sock, [])
    try:
        # The standard client, as grpc-health-probe or a gRPC probe would ask.
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert await probe_sockets([sock]) == "ok"
        assert await probe_sockets([tmp_path / "gone.sock"]) == f"socket gone: {tmp_path / 'gone.sock'}"

        await server.health.enter_graceful_shutdown()
        assert await probe_sockets([sock]) == f"{sock}: NOT_SERVING"
    finally:
        await server.grpc.stop(None)
    assert not sock.exists()  # gRPC removes its socket on stop
    # A socket that accepts but never answers gRPC (a hung server): the probe fails on the answer.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:
        hung.bind(str(sock))
        hung.listen()
        verdict = await probe_sockets([sock], timeout_s=1)
    assert verdict.startswith(f"{sock}: health check failed: "), verdict
