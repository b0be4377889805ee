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
from collections.abc import Callable
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


def test_operator_serves_liveness_and_logs_json(
    control_plane: ControlPlane, make_node: Callable[..., str], tmp_path: Path
) -> None:
    for crd in sorted((REPO / "crds").glob("*.yaml")):
        control_plane.kubectl("apply", "-f", str(crd))
    make_node("log-volume")  # a watch event for the operator's wake handlers, which it must not log at INFO
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
    chatter = [r["msg"] for r in records if r["msg"].startswith("Handler 'wake-")]
    assert chatter == [], chatter[:3]


CREDENTIAL_PLUGIN = """import json, pathlib, sys
pathlib.Path(sys.argv[2]).open("a").write("called\\n")
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {"token": pathlib.Path(sys.argv[1]).read_text().strip()}}))
"""


def test_operator_logs_in_through_an_exec_credential_plugin(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    """A kubeconfig whose user is an exec credential plugin (as EKS, GKE and AKS write them): both halves of
    the operator (Kopf's watches and the kubernetes-asyncio client) log in through it and the operator acts:
    it writes a policy's status. The token is a real ServiceAccount token bound to cluster-admin."""
    cp = control_plane
    for crd in sorted((REPO / "crds").glob("*.yaml")):
        cp.kubectl("apply", "-f", str(crd))
    sa = f"exec-login-{os.getpid()}"
    cp.kubectl("create", "serviceaccount", sa, "-n", "default")
    cp.kubectl(
        "create", "clusterrolebinding", sa, "--clusterrole=cluster-admin", f"--serviceaccount=default:{sa}"
    )
    token = cp.kubectl("create", "token", sa, "-n", "default", "--duration=1h").stdout.strip()
    (tmp_path / "token").write_text(token)
    (tmp_path / "plugin.py").write_text(CREDENTIAL_PLUGIN)
    calls = tmp_path / "calls"
    kubeconfig = tmp_path / "exec.kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {"server": cp.server_url, "certificate-authority": str(cp.pki.ca.cert)},
                    }
                ],
                "users": [
                    {
                        "name": "u",
                        "user": {
                            "exec": {
                                "apiVersion": "client.authentication.k8s.io/v1",
                                "command": sys.executable,
                                "args": [str(tmp_path / "plugin.py"), str(tmp_path / "token"), str(calls)],
                                "interactiveMode": "Never",
                            }
                        },
                    }
                ],
                "contexts": [{"name": "exec", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "exec",
            }
        )
    )
    policy = f"exec-login-{os.getpid()}"
    cp.kubectl(
        "apply", "-f", "-",
        input=json.dumps({
            "apiVersion": "dynamig.io/v1alpha1", "kind": "GpuPartitionPolicy", "metadata": {"name": policy},
            "spec": {"mode": "DryRun", "nodeSelector": {"matchLabels": {"exec-login": "none"}}},
        }),
    )  # fmt: skip
    log_path = tmp_path / "operator.log"
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamig", "operator", "--standalone", "--kubeconfig", str(kubeconfig)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        conditions = ""
        while time.monotonic() < deadline and "Ready" not in conditions:
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.5)
            conditions = cp.kubectl(
                "get", "gpp", policy, "-o", "jsonpath={.status.conditions[*].type}", check=False
            ).stdout
        assert "Ready" in conditions, log_path.read_text()
        assert calls.read_text().count("called") >= 2, "Kopf and the API client each ran the plugin"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        cp.kubectl("delete", "gpp", policy, "--wait=false", check=False)
        cp.kubectl("delete", "clusterrolebinding", sa, check=False)
