"""No ``_created`` series on either metrics endpoint: the Prometheus client library adds one beside every
counter and histogram child unless told not to, which no rule or dashboard reads.

Real: the operator as ``dynamig operator`` runs it (a process against the local control plane, /metrics over
HTTP), and the agent's metrics served by the agent's own endpoint (dynamig.agent.endpoints.serve) in a fresh
interpreter, as in an agent process; both scraped over HTTP. Fresh processes, so no switch flipped by another
test in this one can hide a missing one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamig.devcluster import ControlPlane

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _created(text: str) -> list[str]:
    """The samples of a scrape whose name ends in ``_created``. Pure."""
    return [
        s.name for f in text_string_to_metric_families(text) for s in f.samples if s.name.endswith("_created")
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PROMETHEUS_DISABLE_CREATED_SERIES", None)  # the processes must not rely on it
    return env


AGENT_SCRAPE = """
import asyncio, sys, urllib.request
from prometheus_client import CollectorRegistry
from dynamig.agent.endpoints import Health, serve
from dynamig.agent.metrics import AgentMetrics

async def main() -> None:
    metrics = AgentMetrics(CollectorRegistry(), "gpu-node-a")
    metrics.operation("create", "ok")
    metrics.plugin_request("prepare", ["ok"], 0.2)
    port = int(sys.argv[1])
    runner = await serve(Health(max_round_age_s=180), metrics.registry, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    await runner.cleanup()
    sys.stdout.write(body)

asyncio.run(main())
"""


def test_the_agent_endpoint_serves_no_created_series(tmp_path: Path) -> None:
    script = tmp_path / "scrape_agent.py"
    script.write_text(textwrap.dedent(AGENT_SCRAPE))
    proc = subprocess.run(
        [sys.executable, str(script), str(_free_port())],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    names = {s.name for f in text_string_to_metric_families(proc.stdout) for s in f.samples}
    # The counters and histograms are there, with their samples, and nothing else beside them.
    assert {
        "dynamig_reshape_operations_total",
        "dynamig_kubelet_plugin_request_duration_seconds_count",
    } <= names
    assert _created(proc.stdout) == []


@pytest.mark.controlplane
def test_the_operator_endpoint_serves_no_created_series(control_plane: ControlPlane, tmp_path: Path) -> None:
    for crd in sorted((REPO / "crds").glob("*.yaml")):
        control_plane.kubectl("apply", "-f", str(crd))
    port = _free_port()
    log_path = tmp_path / "operator.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamig", "operator", "--standalone", "--metrics-port", str(port),
             "--metrics-host", "127.0.0.1", "--kubeconfig", str(control_plane.kubeconfig_path)],
            stdout=log, stderr=subprocess.STDOUT, env=_env(),
        )  # fmt: skip
    try:
        deadline, text = time.monotonic() + 60, ""
        while time.monotonic() < deadline and not text:
            assert proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                    text = resp.read().decode()
            except OSError:
                time.sleep(0.3)
        assert text, log_path.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "dynamig_operator_claim_pending_to_allocated_seconds_count" in names, sorted(names)
    assert _created(text) == []
