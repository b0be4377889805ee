"""Node agents run as processes of their own with a heartbeat Lease, for the tests of fencing: the operator
judges each by its Lease, and a test kills, stops or slows it. Short periods throughout: settle 0.3 s,
rounds 1 s apart (0.2 s while reshaping)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from dynamig.devcluster import ControlPlane
from dynamig.devcluster.processes import Component


@contextlib.contextmanager
def leased_agent(
    cp: ControlPlane,
    node: str,
    namespace: str,
    work: Path,
    lease_seconds: float,
    *extra: str,
    gpus: str = "A100-80GB:1",
    inventory: str | None = "partitionable",
    name: str = "",
) -> Iterator[Component]:
    """The agent of ``node`` over simulated ``gpus`` (its state in ``work``), keeping its Lease in
    ``namespace``; ``inventory`` None lets it ask the API server. Stopped (and continued first, should the
    test have stopped it) on the way out."""
    name = name or f"agent-{node}"
    argv = [
        sys.executable, "-m", "dynamig", "agent", f"--node={node}", "--nvml=simulated",
        f"--simulate-gpus={gpus}", f"--state={work / f'nvml-{node}.json'}",
        f"--kubeconfig={cp.kubeconfig_path}", "--metrics-port=-1",
        f"--lease-namespace={namespace}", f"--lease-seconds={lease_seconds}", "--interval=1",
        "--reshape-poll=0.2", "--settle-seconds=0.3", *extra,
    ]  # fmt: skip
    if inventory is not None:
        argv.append(f"--inventory={inventory}")
    proc = Component.spawn(name, argv, log_path=work / f"{name}.log", cwd=work)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, signal.SIGCONT)
        proc.popen.terminate()
        with contextlib.suppress(Exception):
            proc.popen.wait(timeout=20)
