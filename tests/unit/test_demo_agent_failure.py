"""``dynamig demo --real-node``: when its agent process dies or never reports, the error says why.

The agent's log lives in the node's work directory, removed when the demo ends; so the error raised while
waiting for the agent must carry the log's end and the exit status. The node here only spawns a stand-in
agent command (no kubelet, no root); the waiting and the error are the demo's own.
"""

from __future__ import annotations

import asyncio
import types
from pathlib import Path
from typing import Any, cast

import pytest

from dynamig.demo.story import AgentExitedError, _NodeAgent
from dynamig.devcluster import eventually
from dynamig.devcluster.node import RealNode
from dynamig.devcluster.processes import Component, stop_all


class ScriptNode:
    """Stands in for :class:`RealNode`: ``start_agent`` spawns ``script`` the way RealNode spawns the agent
    (a :class:`Component` logging to a file in the work directory)."""

    def __init__(self, work_dir: Path, script: str) -> None:
        self.work_dir = work_dir
        self.script = script
        self.agent: Component | None = None

    def start_agent(self, gpus: str, kubeconfig: Path, *extra: str) -> Component:
        self.agent = Component.spawn(
            "agent", ["sh", "-c", self.script], log_path=self.work_dir / "agent.log", cwd=self.work_dir
        )
        return self.agent

    def stop_agent(self) -> None:
        if self.agent is not None:
            stop_all([self.agent], timeout=5.0)


async def _never() -> Any:
    return None


def _demo_agent(tmp_path: Path, script: str) -> _NodeAgent:
    return _NodeAgent(types.ModuleType("unused-nvml"), cast(RealNode, ScriptNode(tmp_path, script)))


CP = types.SimpleNamespace(kubeconfig_path=Path("/nonexistent/kubeconfig"))


async def test_an_agent_that_exits_at_once_fails_the_wait_with_its_log_and_exit_status(
    tmp_path: Path,
) -> None:
    script = (
        "echo 'agent: starting'; echo 'error: cannot load kubeconfig /nonexistent/kubeconfig' >&2; exit 3"
    )
    agent = _demo_agent(tmp_path, script)
    with pytest.raises(AgentExitedError) as raised:
        async with agent.running(None, CP, ("A100-80GB",)):
            # A step timeout far beyond the test's: the exit must end the wait, not the timeout.
            await agent.wait(_never, "the agent's GpuPartition gpu-node-a-gpu0", within_s=120)
    message = str(raised.value)
    assert message.startswith("waiting for the agent's GpuPartition gpu-node-a-gpu0: the node agent (pid ")
    assert "exited with code 3" in message
    assert "error: cannot load kubeconfig /nonexistent/kubeconfig" in message
    assert "agent: starting" in message


async def test_a_timeout_waiting_for_a_running_agent_carries_its_log(tmp_path: Path) -> None:
    script = (
        "for i in $(seq 1 30); do echo \"agent: line $i\"; done; echo 'agent: no GPUs found'; exec sleep 60"
    )
    agent = _demo_agent(tmp_path, script)
    with pytest.raises(TimeoutError) as raised:
        async with agent.running(None, CP, ("A100-80GB",)):
            await agent.wait(_never, "the agent's GpuPartition gpu-node-a-gpu0", within_s=1.5)
    message = str(raised.value)
    assert message.startswith("timed out after 2s waiting for the agent's GpuPartition gpu-node-a-gpu0")
    assert "is still running" in message
    assert "agent: no GPUs found" in message
    assert "agent: line 12" in message  # the last 20 lines: 12..30 and the last one
    assert "agent: line 11\n" not in message


async def test_a_timeout_after_the_agent_died_gives_its_exit_status(tmp_path: Path) -> None:
    # A wait that does not watch the agent (a later step of the story) still reports how it ended.
    agent = _demo_agent(tmp_path, "echo 'agent: crashed on start' >&2; exit 1")
    with pytest.raises(TimeoutError) as raised:
        async with agent.running(None, CP, ("A100-80GB",)):
            assert agent.process is not None
            await asyncio.to_thread(agent.process.popen.wait, 30)
            await eventually(_never, "every inference pod allocated", within_s=0.2)
    message = str(raised.value)
    assert message.startswith("timed out after 0s waiting for every inference pod allocated")
    assert "exited with code 1" in message
    assert "agent: crashed on start" in message
