"""``dynamig operator`` as the Deployment runs it: a process with a liveness probe and JSON logs.

Real: the command in a subprocess against the local control plane (kube-apiserver built from the Kubernetes
sources), Kopf's liveness endpoint over HTTP. Nothing is simulated.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dynamig.devcluster import ControlPlane

pytestmark = pytest.mark.controlplane
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_operator_serves_liveness_and_logs_json(control_plane: ControlPlane, tmp_path: Path) -> None:
    for crd in sorted((REPO / "crds").glob("*.yaml")):
        control_plane.kubectl("apply", "-f", str(crd))
    url = f"http://127.0.0.1:{_free_port()}/healthz"
    log_path = tmp_path / "operator.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamig", "operator", "--standalone", "--liveness", url,
             "--log-format", "json", "--kubeconfig", str(control_plane.kubeconfig_path)],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and status != 200:
            assert proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    status = resp.status
            except OSError:
                time.sleep(0.3)
        assert status == 200, log_path.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    assert lines, "the operator logged nothing"
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "msg"} <= r.keys() for r in records)
