"""``/metrics`` over TLS for bearer tokens the API server allows, against the real local kube-apiserver.

The agent's own endpoint server (dynamig.agent.endpoints.serve) runs with a certificate from a throwaway CA
and reviews tokens with the credentials of a service account that holds only ``system:auth-delegator`` (what
the chart binds the agent's and the operator's accounts to). Scrapers are service accounts with and without
the right to ``get /metrics``, with their own tokens from the TokenRequest API.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter

from dynamig.agent.endpoints import Health, serve
from dynamig.agent.main import api_client_for
from dynamig.devcluster import ControlPlane
from dynamig.devcluster.pki import generate_pki
from dynamig.kube.metricsauth import MetricsTLS

CHART = Path(__file__).resolve().parents[2] / "manifests" / "helm" / "dynamig"


def _sa_token(cp: ControlPlane, namespace: str, name: str) -> str:
    cp.kubectl("create", "serviceaccount", "-n", namespace, name)
    out = cp.kubectl("create", "token", name, "-n", namespace, "-o", "json").stdout
    token: str = json.loads(out)["status"]["token"]
    return token


@pytest.fixture
async def served(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> AsyncIterator[tuple[str, dict[str, str], ssl.SSLContext, Path]]:
    """The endpoint's URL, tokens by name ("reader", "stranger", "server"), a client context trusting the
    serving CA, and the directory of the serving pair."""
    cp = control_plane
    pki = generate_pki(tmp_path)
    tokens = {name: _sa_token(cp, namespace, name) for name in ("reader", "stranger", "server")}
    reader_role = f"{namespace}-metrics-reader"
    cp.kubectl("create", "clusterrole", reader_role, "--verb=get", "--non-resource-url=/metrics")
    cp.kubectl("create", "clusterrolebinding", reader_role, f"--clusterrole={reader_role}",
               f"--serviceaccount={namespace}:reader")  # fmt: skip
    delegator = f"{namespace}-auth-delegator"
    cp.kubectl("create", "clusterrolebinding", delegator, "--clusterrole=system:auth-delegator",
               f"--serviceaccount={namespace}:server")  # fmt: skip
    api = await api_client_for(cp.service_account_kubeconfig(namespace, "server"))
    registry = CollectorRegistry()
    Counter("dynamig_test_scrapes", "scrapes", registry=registry).inc()
    from dynamig.kube.metricsauth import ApiAuthorizer

    runner = await serve(
        Health(max_round_age_s=60.0), registry, "127.0.0.1", 0,
        tls=MetricsTLS(pki.apiserver.cert, pki.apiserver.key), authorizer=ApiAuthorizer(api),
    )  # fmt: skip
    port = runner.addresses[0][1]
    trust = ssl.create_default_context(cafile=str(pki.ca.cert))
    try:
        yield f"https://127.0.0.1:{port}", tokens, trust, tmp_path
    finally:
        await runner.cleanup()
        await api.close()
        cp.kubectl("delete", "clusterrolebinding", reader_role, delegator, "--ignore-not-found")
        cp.kubectl("delete", "clusterrole", reader_role, "--ignore-not-found")


async def test_metrics_answer_only_tokens_the_api_server_allows(
    served: tuple[str, dict[str, str], ssl.SSLContext, Path],
) -> None:
    url, tokens, trust, _ = served
    async with aiohttp.ClientSession() as http:

        async def get(path: str, token: str | None = None) -> tuple[int, str]:
            headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
            async with http.get(url + path, headers=headers, ssl=trust) as resp:
                return resp.status, await resp.text()

        assert (await get("/metrics"))[0] == 401
        assert (await get("/metrics", "not-a-token"))[0] == 401
        status, body = await get("/metrics", tokens["stranger"])
        assert status == 403 and "may not get /metrics" in body, body
        # The server's own account may review tokens; that does not let it read metrics either.
        assert (await get("/metrics", tokens["server"]))[0] == 403
        status, body = await get("/metrics", tokens["reader"])
        assert status == 200 and "dynamig_test_scrapes_total 1.0" in body, body
        # A second scrape is answered from the cache, the same way.
        assert (await get("/metrics", tokens["reader"]))[0] == 200
        # The kubelet's probes carry no token.
        assert (await get("/healthz"))[0] == 200
        assert (await get("/readyz"))[0] == 503  # no round finished yet: not ready, but not refused

        # No plain HTTP on the TLS port.
        with pytest.raises(aiohttp.ClientError):
            async with http.get(url.replace("https://", "http://") + "/healthz") as resp:
                await resp.read()


async def test_a_renewed_certificate_is_served_without_a_restart(
    served: tuple[str, dict[str, str], ssl.SSLContext, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    url, _tokens, _trust, pki_dir = served

    host, port = url.removeprefix("https://").split(":")

    async def served_cert() -> str:
        pem = await asyncio.to_thread(ssl.get_server_certificate, (host, int(port)))
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()

    before = await served_cert()
    # cert-manager writes the renewed pair into the mounted Secret: same paths, new files.
    renewed = generate_pki(tmp_path_factory.mktemp("renewed"))
    (pki_dir / "apiserver.crt").write_bytes(renewed.apiserver.cert.read_bytes())
    (pki_dir / "apiserver.key").write_bytes(renewed.apiserver.key.read_bytes())
    after = await served_cert()
    expected = hashlib.sha256(
        ssl.PEM_cert_to_DER_cert(renewed.apiserver.cert.read_text())
    ).hexdigest()  # fmt: skip
    assert before != after and after == expected


def _render_secure(helm: str, release: str, namespace: str, reader: dict[str, str]) -> list[dict[str, Any]]:
    """The chart with metrics.secure on and ``reader`` bound to its metrics-reader role. Runs helm."""
    rendered = subprocess.run(
        [helm, "template", release, str(CHART), "--namespace", namespace,
         "--set", "metrics.secure.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
         "--set", "metrics.serviceMonitor.skipCapabilityCheck=true",
         "--set-json", f"metrics.secure.readers=[{json.dumps(reader)}]"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    return [o for o in yaml.safe_load_all(rendered) if o]


async def test_the_charts_secure_metrics_serve_prometheus_and_no_one_else(
    control_plane: ControlPlane, namespace: str, helm: str, tmp_path: Path
) -> None:
    """The chart with metrics.secure on, in a namespace of its own: its Secret, ServiceAccounts and RBAC
    applied for real. The agent's endpoint serves the chart's certificate under the name the ServiceMonitor
    checks, reviews tokens with the agent's own account (bound to system:auth-delegator by the chart), and
    answers the reader the values name, not another account of the namespace."""
    cp = control_plane
    release = f"m{namespace[-8:]}"
    reader = {"kind": "ServiceAccount", "name": "prometheus", "namespace": namespace}
    objs = _render_secure(helm, release, namespace, reader)
    kinds = ("Secret", "ServiceAccount", "ClusterRole", "ClusterRoleBinding")
    wanted = [o for o in objs if o["kind"] in kinds and not o["metadata"]["name"].endswith("-uninstall")]
    stream = yaml.safe_dump_all(wanted)
    cp.kubectl("apply", "-f", "-", input=stream)
    try:
        secret = next(o for o in objs if o["kind"] == "Secret")["data"]
        for key in ("tls.crt", "tls.key", "ca.crt"):
            (tmp_path / key).write_bytes(base64.b64decode(secret[key]))
        monitor = next(
            o for o in objs if o["kind"] == "ServiceMonitor" and o["metadata"]["name"].endswith("-agent")
        )
        endpoint = monitor["spec"]["endpoints"][0]
        assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["ca"]["secret"]["key"] == "ca.crt"
        accounts = [o["metadata"]["name"] for o in wanted if o["kind"] == "ServiceAccount"]
        agent_sa = next(name for name in accounts if name.endswith("-agent"))
        api = await api_client_for(cp.service_account_kubeconfig(namespace, agent_sa))
        registry = CollectorRegistry()
        Counter("dynamig_test_scrapes", "scrapes", registry=registry).inc()
        from dynamig.kube.metricsauth import ApiAuthorizer

        runner = await serve(
            Health(max_round_age_s=60.0), registry, "127.0.0.1", 0,
            tls=MetricsTLS(tmp_path / "tls.crt", tmp_path / "tls.key"), authorizer=ApiAuthorizer(api),
        )  # fmt: skip
        try:
            url = f"https://127.0.0.1:{runner.addresses[0][1]}/metrics"
            trust = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
            prometheus = _sa_token(cp, namespace, "prometheus")
            other = _sa_token(cp, namespace, "someone-else")
            async with aiohttp.ClientSession() as http:

                async def scrape(token: str) -> int:
                    async with http.get(
                        url, headers={"Authorization": f"Bearer {token}"}, ssl=trust,
                        server_hostname=endpoint["tlsConfig"]["serverName"],
                    ) as resp:  # fmt: skip
                        return resp.status

                assert await scrape(other) == 403
                assert await scrape(prometheus) == 200
        finally:
            await runner.cleanup()
            await api.close()
    finally:
        cluster_wide = [o for o in wanted if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
        cp.kubectl(
            "delete", "--ignore-not-found", "-f", "-", input=yaml.safe_dump_all(cluster_wide), check=False
        )
