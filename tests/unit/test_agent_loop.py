"""The agent's loop: a round that keeps failing backs off instead of retrying at poll speed, and watch wakes
do not cut the backoff short; the first good round brings the normal pace back."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from prometheus_client import CollectorRegistry

from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.metrics import AgentMetrics


class FlakyAgent(NodeAgent):
    def __init__(self, failing_rounds: int) -> None:
        settings = AgentSettings(
            node="n1", interval_seconds=0.05, reshape_poll_seconds=0.01, min_round_gap_seconds=0.0
        )
        super().__init__(settings, cast(Any, None), cast(Any, None), AgentMetrics(CollectorRegistry(), "n1"))
        self.failing_rounds = failing_rounds
        self.calls = 0

    async def reconcile_once(self) -> bool:
        self.calls += 1
        if self.calls <= self.failing_rounds:
            raise RuntimeError("the API server said no")
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
