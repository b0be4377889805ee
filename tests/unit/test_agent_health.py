"""The agent's probes (``dynamig.agent.health``): what makes liveness and readiness fail (a fake clock)."""

from __future__ import annotations

from pathlib import Path

from dynamig.agent.health import Health


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_liveness_follows_the_reconcile_loop_and_the_plugin_sockets(tmp_path: Path) -> None:
    clock = Clock()
    health = Health(max_round_age_s=60, clock=clock)
    assert health.liveness() == {"reconcile-loop": "ok"}  # starting: the first round has 60 s
    clock.now += 61
    assert "no reconcile round finished for 61s" in health.liveness()["reconcile-loop"]
    health.round_finished()
    assert health.liveness() == {"reconcile-loop": "ok"}
    sock = tmp_path / "dra.sock"
    health.plugin_sockets = (sock,)
    assert health.liveness()["kubelet-plugin"] == f"socket gone: {sock}"
    sock.touch()
    assert set(health.liveness().values()) == {"ok"}


def test_readiness_waits_for_the_first_round_and_the_kubelet_registration() -> None:
    clock = Clock()
    registered = False
    health = Health(max_round_age_s=60, clock=clock, plugin_registered=lambda: registered)
    checks = health.readiness()
    assert checks["first-round"] == "no reconcile round finished yet"
    assert checks["kubelet-registration"] == "the kubelet has not registered the plugin"
    health.round_finished()
    registered = True
    assert set(health.readiness().values()) == {"ok"}
