"""The agent's loop: a round that keeps failing backs off instead of retrying at poll speed, and watch wakes
do not cut the backoff short; the first good round brings the normal pace back. A round that fails on the API
server backs off to a couple of seconds at most, whatever the outage's length, and a watch that lists again
after the outage (the API server is back) ends the back-off at once; so does the heartbeat."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from dynamig.agent import controller
from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.kube.api import API_RETRY_MAX_S
from dynamig.agent.metrics import AgentMetrics
from dynamig.kube.times import parse_time


def refused() -> Exception:
    return ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 6443)")


class FlakyAgent(NodeAgent):
    def __init__(
        self,
        failing_rounds: int,
        error: Callable[[], Exception] = lambda: RuntimeError("a bug"),
        poll_seconds: float = 0.01,
    ) -> None:
        settings = AgentSettings(
            node="n1", interval_seconds=0.05, reshape_poll_seconds=poll_seconds, min_round_gap_seconds=0.0
        )
        super().__init__(settings, cast(Any, None), cast(Any, None), AgentMetrics(CollectorRegistry(), "n1"))
        self.failing_rounds = failing_rounds
        self.error = error
        self.calls = 0
        self.started: list[float] = []
        self.failed = asyncio.Event()

    async def reconcile_once(self) -> bool:
        self.calls += 1
        self.started.append(time.monotonic())
        if self.calls <= self.failing_rounds:
            self.failed.set()
            raise self.error()
        return False


async def run_for(agent: NodeAgent, seconds: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.create_task(agent._loop(stop))

    async def keep_waking() -> None:  # a busy watch: events all the time
        while not stop.is_set():
            agent.wake()
            await asyncio.sleep(0.005)

    waker = asyncio.create_task(keep_waking())
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(loop, waker)


async def test_failing_rounds_back_off_and_wakes_do_not_shorten_it() -> None:
    agent = FlakyAgent(failing_rounds=1000)
    await run_for(agent, 1.5)
    # 0.02 + 0.04 + ... doubles: 7 rounds fill 1.27 s; at poll speed (or woken) it would be over 100.
    assert 5 <= agent.calls <= 8, agent.calls
    errors = agent.metrics.registry.get_sample_value("dynamig_reconcile_errors_total", {"Hostname": "n1"})
    assert errors == agent.calls


async def test_the_first_good_round_ends_the_backoff() -> None:
    agent = FlakyAgent(failing_rounds=3)
    await run_for(agent, 1.0)
    # 3 failures (0.02 + 0.04 + 0.08 s of backoff), then woken rounds with no backoff: many more.
    assert agent.calls > 20, agent.calls


def test_rounds_failing_on_the_api_server_wait_a_couple_of_seconds_at_most() -> None:
    assert API_RETRY_MAX_S <= 3.0
    assert controller.ERROR_BACKOFF_MAX_S > API_RETRY_MAX_S  # a bug still backs off further


async def test_rounds_failing_on_the_api_server_stop_backing_off_at_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same doubling as for a bug, but it stops at ``API_RETRY_MAX_S`` (here 0.08 s, to keep it short)."""
    monkeypatch.setattr(controller, "API_RETRY_MAX_S", 0.08)
    agent = FlakyAgent(failing_rounds=1000, error=refused)
    await run_for(agent, 1.5)
    # 0.02 + 0.04 + 0.08 + 0.08 + ...: about 20 rounds in 1.5 s (a bug: 7).
    assert agent.calls >= 12, agent.calls
    gaps = [b - a for a, b in zip(agent.started, agent.started[1:], strict=False)]
    assert max(gaps) < 0.08 + 0.15, gaps  # never the doubling's 0.16, 0.32, ... (slack for a loaded host)


async def test_a_reconnect_ends_the_back_off_a_watch_event_does_not() -> None:
    """A failed round waits 10 s here (poll 5 s, doubled); a watch event leaves it waiting, a watch that
    lists again after losing the API server starts the next round at once."""
    agent = FlakyAgent(failing_rounds=1, poll_seconds=5.0)
    stop = asyncio.Event()
    loop = asyncio.create_task(agent._loop(stop))
    try:
        await asyncio.wait_for(agent.failed.wait(), timeout=5)
        agent.wake()
        await asyncio.sleep(0.3)
        assert agent.calls == 1
        at = time.monotonic()
        agent.reconnected()
        await asyncio.sleep(0.3)
        assert agent.calls >= 2 and agent.started[1] - at < 0.25, (agent.started, at)
    finally:
        stop.set()
        await asyncio.wait_for(loop, timeout=20)


class Leases:
    """renew_lease: refused ``down`` times, then renewed."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.calls: list[float] = []

    async def renew_lease(self, body: dict[str, Any]) -> None:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.down:
            raise refused()


async def test_a_failed_heartbeat_is_retried_within_the_cap_not_a_third_of_the_lease_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(controller, "API_RETRY_MAX_S", 0.05)
    leases = Leases(down=3)
    settings = AgentSettings(node="n1", lease_namespace="dynamig", lease_seconds=30)  # renewed every 10 s
    agent = NodeAgent(settings, cast(Any, leases), cast(Any, None), AgentMetrics(CollectorRegistry(), "n1"))
    stop = asyncio.Event()
    beats = asyncio.create_task(agent._heartbeats(stop))
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.wait_for(beats, timeout=5)
    assert len(leases.calls) == 4, leases.calls  # 3 refused 0.05 s apart, renewed, then 10 s of quiet


class Bodies:
    """renew_lease: records what was written."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def renew_lease(self, body: dict[str, Any]) -> None:
        self.bodies.append(body)


async def test_a_long_round_that_makes_progress_renews_one_that_does_nothing_does_not() -> None:
    """Renewed every second (a 3 s Lease); stuck after 1.5 s without progress, whatever the round's age."""
    leases = Bodies()
    now = [1000.0]
    settings = AgentSettings(node="n1", lease_namespace="dynamig", lease_seconds=3)
    metrics = AgentMetrics(CollectorRegistry(), "n1")
    agent = NodeAgent(settings, cast(Any, leases), cast(Any, None), metrics, clock=lambda: now[0])
    assert agent.answerer.progress == agent.reshaper.progress == agent.progressed  # the hooks are wired
    agent.progressed()
    assert agent._progress_at is None  # between rounds, nothing to date
    agent._progress_at = now[0]  # a round starts (reconcile_once) ...
    now[0] += 100  # ... and cuts for 100 s, one booking after another
    agent.progressed()
    stop = asyncio.Event()
    beats = asyncio.create_task(agent._heartbeats(stop))
    try:
        await asyncio.sleep(0.2)
        assert len(leases.bodies) == 1  # renewed: the round made progress just now
        now[0] += 2  # then nothing for 2 s: an NVML call hangs
        await asyncio.sleep(1.1)
        assert len(leases.bodies) == 1
        agent.progressed()  # it returns, and the round goes on
        await asyncio.sleep(1.1)
        assert len(leases.bodies) == 2
    finally:
        stop.set()
        await asyncio.wait_for(beats, timeout=5)


async def test_the_lease_is_owned_by_the_node_and_dated_by_the_agents_clock() -> None:
    leases = Bodies()
    settings = AgentSettings(node="n1", lease_namespace="dynamig", clock_offset_seconds=-60.0)
    agent = NodeAgent(settings, cast(Any, leases), cast(Any, None), AgentMetrics(CollectorRegistry(), "n1"))
    assert await agent._heartbeat()  # before a round read the Node: no owner yet
    owner = {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-n1"}
    agent.publisher.owner = owner
    before = time.time()
    assert await agent._heartbeat()
    first, second = leases.bodies
    assert "ownerReferences" not in first["metadata"]
    assert second["metadata"]["ownerReferences"] == [owner]
    renewed = parse_time(second["spec"]["renewTime"])
    assert renewed is not None and before - 61 < renewed < before - 59
