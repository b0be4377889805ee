"""Kueue beside the local control plane: its controller manager, built from its Go module
(``hack/build-kueue.sh``), run as a process against the test API server, for the tests that put dynamig's
MIG slices under Kueue quotas.

Kueue admits through webhooks. In a cluster they are a Service in ``kueue-system`` with certificates Kueue
rotates itself; here no Service routes, so the release's webhook manifests are rewritten to call the process
at ``https://127.0.0.1:<port>`` with the control plane's own serving certificate (its SANs hold 127.0.0.1) and
CA, Kueue's certificate management off. Only the webhooks of what runs are kept: Kueue's own objects, plain
pods (the ``pod`` integration, the one that manages a pod asking ``nvidia.com/mig-*`` with a
``kueue.x-k8s.io/queue-name`` label) and Jobs (``batch/job``: a Job with that label, its pods one pod set).
The pod and Job webhooks are ``failurePolicy: Fail``, so they are limited to namespaces labelled
:data:`MANAGED_NAMESPACE_LABEL`: the other tests sharing the control plane never call them, and nothing
breaks when Kueue stops.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dynamig.devcluster.binaries import build_tool
from dynamig.devcluster.controlplane import ControlPlane, ControlPlaneError
from dynamig.devcluster.processes import Component, free_port, wait_for

BUILD_SCRIPT = "build-kueue.sh"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MANAGED_NAMESPACE_LABEL = "dynamig.io/kueue-managed"
API = ("kueue.x-k8s.io", "v1beta2")
WEBHOOK_PATHS_KEPT = ("-v1-pod", "-batch-v1-job", "-kueue-x-k8s-io-")  # pods, Jobs, Kueue's own objects
# Webhooks of objects in any namespace (pods, Jobs): held to the namespaces that opt in.
NAMESPACED_WEBHOOK_SUFFIXES = ("-v1-pod", "-batch-v1-job")
# Where Kueue reads its metrics server's certificate when it does not manage certificates itself: a fixed
# path in cmd/kueue/main.go (v0.17.0), not a setting; the process exits when the files are missing.
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")


@dataclass(frozen=True)
class KueueProcess:
    """A running Kueue controller manager and what was installed for it."""

    component: Component
    webhook_configurations: tuple[tuple[str, str], ...]  # (kind, name)
    version: str


def kueue_config(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration for a process beside the test control plane. Pure."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["pod", "batch/job"]},
        "managedJobsNamespaceSelector": {"matchLabels": {MANAGED_NAMESPACE_LABEL: "true"}},
    }


def local_webhooks(manifests: str, base_url: str, ca_pem: bytes) -> list[dict[str, Any]]:
    """The release's webhook configurations, rewritten to call ``base_url`` and trust ``ca_pem``, with only
    the webhooks of plain pods and Jobs (held to managed namespaces) and of Kueue's own objects. Pure."""
    ca_bundle = base64.b64encode(ca_pem).decode()
    out: list[dict[str, Any]] = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        hooks = []
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            if not any(part in path for part in WEBHOOK_PATHS_KEPT):
                continue
            hook = dict(hook, clientConfig={"url": f"{base_url}{path}", "caBundle": ca_bundle})
            if path.endswith(NAMESPACED_WEBHOOK_SUFFIXES):
                hook["namespaceSelector"] = {"matchLabels": {MANAGED_NAMESPACE_LABEL: "true"}}
            hooks.append(hook)
        name = f"dynamig-test-kueue-{doc['kind'].removesuffix('WebhookConfiguration').lower()}"
        out.append({**doc, "metadata": {"name": name}, "webhooks": hooks})
    return out


def _healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/readyz")
            return conn.getresponse().status == 200
        finally:
            conn.close()
    except OSError:
        return False


def _serving(port: int) -> bool:
    """The webhook server answers TLS (any HTTP status: it has no handler at ``/``)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=2, context=ctx)
        try:
            conn.request("GET", "/")
            conn.getresponse()
            return True
        finally:
            conn.close()
    except OSError:
        return False


@contextlib.contextmanager
def kueue_running(cp: ControlPlane, directory: Path, timeout: float = 120.0) -> Iterator[KueueProcess]:
    """Install Kueue's CRDs, start its controller manager against ``cp`` (files and log under
    ``directory``), wait until it is ready and its webhooks are registered; on exit remove the webhook
    configurations and stop it. Side effects. Raises :class:`ControlPlaneError` with the log's tail when it
    does not come up."""
    tool = build_tool(BUILD_SCRIPT)
    version = tool.name.removeprefix("kueue-")
    directory.mkdir(parents=True, exist_ok=True)
    cp.kubectl("apply", "--server-side", "-f", str(tool / "config" / "crd"), timeout=120)
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(tool / "config" / "crd"))
    cp.kubectl("create", "namespace", "kueue-system", check=False)
    cert_dir = directory / "certs"
    for where in (cert_dir, METRICS_CERT_DIR):
        try:
            where.mkdir(mode=0o700, parents=True, exist_ok=True)
            (where / "tls.crt").write_bytes(cp.pki.apiserver.cert.read_bytes())
            (where / "tls.key").write_bytes(cp.pki.apiserver.key.read_bytes())
        except PermissionError as exc:
            raise ControlPlaneError(
                f"Kueue reads its certificates from {where}, which is not writable: {exc}"
            ) from exc
    webhook_port, health_port = free_port(), free_port()
    config = directory / "kueue-config.yaml"
    config.write_text(yaml.safe_dump(kueue_config(webhook_port, health_port, cert_dir)))
    comp = Component.spawn(
        "kueue",
        [
            str(tool / "bin" / "kueue"),
            f"--config={config}",
            f"--kubeconfig={cp.kubeconfig_path}",
            # the visibility API server wants its own certificate at /visibility and an APIService; the
            # tests read pending workloads from the ClusterQueue's status instead
            "--feature-gates=VisibilityOnDemand=false",
        ],
        log_path=directory / "kueue.log",
        cwd=directory,
    )
    installed: list[tuple[str, str]] = []
    try:
        deadline = time.monotonic() + timeout
        wait_for(
            comp, lambda: _healthy(health_port), deadline=deadline, what="Kueue ready", fail=ControlPlaneError
        )
        wait_for(
            comp,
            lambda: _serving(webhook_port),
            deadline=deadline,
            what="Kueue's webhooks",
            fail=ControlPlaneError,
        )
        hooks = local_webhooks(
            (tool / "config" / "webhooks.yaml").read_text(),
            f"https://127.0.0.1:{webhook_port}",
            cp.pki.ca.cert.read_bytes(),
        )
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(hooks))
        installed = [(h["kind"], h["metadata"]["name"]) for h in hooks]
        yield KueueProcess(comp, tuple(installed), version)
    finally:
        for kind, name in installed:
            cp.kubectl("delete", kind.lower(), name, "--ignore-not-found", check=False)
        comp.stop()
