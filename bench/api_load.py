"""API cost per node: N simulated GPU nodes against the real API server under a churn of claims.

For each N (``--nodes 10,50,100``) a fresh local control plane, N registered nodes with one simulated
A100-80GB each and an in-process agent per node (each with its own simulated NVML and its own API client,
production intervals), the operator with one Dynamic policy over all of them (partitionable inventory: pods
book MIG placements directly), then ``--seconds`` of churn: pods asking ``1g.10gb`` else ``2g.20gb`` created
at ``--rate`` per second cluster-wide, each deleted ``--lifetime`` seconds later (no kubelet: pods bind,
never run).

Measured, server side: ``apiserver_request_total`` (all clients) over the window, and the API server's
audit log (stage RequestReceived, one line per request) attributed by user agent, so agents
(``dynamig-agent/<node>``), the operator (Kopf's and its kubernetes-asyncio client's default agents), this
benchmark's own load (``dynamig-load``) and Kubernetes' components are counted apart. Client side:
claim-to-allocation and pod-to-bound latency from watches, and the process's CPU seconds and peak RSS. The
in-run comparison is the per-node request rate at the largest N against the smallest (flat means 1.0).

    python bench/api_load.py --nodes 10,50,100 -o json      # one JSON object per N, then the summary
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import resource
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from kubernetes_asyncio import client, watch
from prometheus_client import CollectorRegistry

from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml.device import NvmlDevices
from dynamig.backends.nvml import fresh_simulated_nvml
from dynamig.demo.cluster import ScenarioApi
from dynamig.demo.inprocess import operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.sandbox import install
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.names import MANAGED_NODE_LABEL
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.settings import OperatorSettings
from dynamig.simulate.trace import percentile

NAMESPACE = "load"
POOL_LABEL = "dynamig.io/load-pool"
AGENT_UA = "dynamig-agent"
BENCH_UA = "dynamig-load"
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["ResponseStarted", "ResponseComplete", "Panic"]
rules:
- level: Metadata
"""


def requests_total(cp: ControlPlane) -> float:
    """Sum of ``apiserver_request_total`` over all its series. Side effect: GET /metrics."""
    status, body = cp.rest().raw("GET", "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    total = 0.0
    for line in (body.decode() if isinstance(body, bytes) else str(body)).splitlines():
        if line.startswith("apiserver_request_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def audit_counts(path: Path, since: float, until: float) -> Counter[str]:
    """Requests received in [since, until) by client: agents (their Lease renewals apart), operator (Kopf),
    this benchmark, other. Pure but for reading the log."""
    counts: Counter[str] = Counter()
    with path.open() as f:
        for line in f:
            ev = json.loads(line)
            t = datetime.fromisoformat(ev["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
            if not since <= t < until:
                continue
            ua = ev.get("userAgent", "")
            lease = (ev.get("objectRef") or {}).get("resource") == "leases"
            who = (
                ("agent-leases" if lease else "agents")
                if ua.startswith(AGENT_UA)
                else "bench"
                if ua.startswith(BENCH_UA)
                else "operator"  # Kopf, and the operator's kubernetes-asyncio client (its default agent)
                if ua.startswith(("kopf/", "OpenAPI-Generator/"))
                else "other"
            )
            counts[who] += 1
    return counts


def api_client(cp: ControlPlane, user_agent: str) -> client.ApiClient:
    api = client.ApiClient(configuration=cp.client_configuration())
    api.user_agent = user_agent
    return api


class Latencies:
    """Watches the namespace's claims and pods: when each claim was first allocated and each pod bound."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.allocated: dict[str, float] = {}  # pod name -> time its claim was first seen allocated
        self.bound: dict[str, float] = {}

    async def claims(self) -> None:
        custom = client.CustomObjectsApi(self.api)
        while True:
            w = watch.Watch()
            with contextlib.suppress(Exception):
                async with w.stream(
                    custom.list_namespaced_custom_object,
                    "resource.k8s.io",
                    "v1",
                    NAMESPACE,
                    "resourceclaims",
                    timeout_seconds=300,
                ) as stream:
                    async for ev in stream:
                        obj = ev["object"]
                        if (obj.get("status") or {}).get("allocation"):
                            for ref in obj["metadata"].get("ownerReferences") or []:
                                self.allocated.setdefault(ref["name"], time.time())

    async def pods(self) -> None:
        core = client.CoreV1Api(self.api)
        while True:
            w = watch.Watch()
            with contextlib.suppress(Exception):
                async with w.stream(core.list_namespaced_pod, NAMESPACE, timeout_seconds=300) as stream:
                    async for ev in stream:
                        pod = ev["object"]
                        if pod.spec.node_name:
                            self.bound.setdefault(pod.metadata.name, time.time())


async def run_one(n: int, args: argparse.Namespace, say: Any) -> dict[str, Any]:
    work = Path(args.work_dir) / f"nodes-{n}"
    work.mkdir(parents=True, exist_ok=True)
    policy_file = work / "audit-policy.yaml"
    policy_file.write_text(AUDIT_POLICY)
    audit_log = work / "audit.log"
    audit_log.unlink(missing_ok=True)
    cp = ControlPlane(
        work_dir=work / "cp",
        apiserver_args=[
            f"--audit-policy-file={policy_file}",
            f"--audit-log-path={audit_log}",
            "--audit-log-format=json",
            "--audit-log-maxsize=0",
        ],
    )
    await asyncio.to_thread(cp.start)
    stop = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = []
    clients: list[client.ApiClient] = []
    modules: list[ModuleType] = []
    try:
        install(cp)
        cp.kubectl("create", "namespace", NAMESPACE)
        nodes = [f"load-{i:03d}" for i in range(n)]
        for node in nodes:
            await cp.aregister_node(node, labels={MANAGED_NODE_LABEL: "true", POOL_LABEL: "on"})
        catalog = load_catalog()
        for node in nodes:
            nvml = fresh_simulated_nvml()
            nvml.configure(
                gpus=["A100-80GB"] * args.gpus,
                state_file=None,
                seed=node,
                create_latency_s=args.create_latency,
            )
            modules.append(nvml)
            devices = NvmlDevices(nvml, catalog)
            devices.init()
            api = api_client(cp, f"{AGENT_UA}/{node}")
            clients.append(api)
            agent = NodeAgent(
                AgentSettings(  # as production: the inventory asked of the API server, a Lease
                    node=node,
                    inventory=None,
                    lease_namespace="default",
                    placements_per_profile=args.placements_per_profile,
                ),
                KubeApi(api),
                devices,
                AgentMetrics(CollectorRegistry(), node),
            )
            tasks.append(asyncio.create_task(agent.run(stop), name=f"agent-{node}"))
        bench_api = api_client(cp, BENCH_UA)
        clients.append(bench_api)
        k = ScenarioApi(bench_api, NAMESPACE)
        await k.claim_template("small", ["1g.10gb", "2g.20gb"])
        settings = OperatorSettings(kubeconfig=cp.kubeconfig_path, standalone=True)
        async with operator_running(cp.kubeconfig_path, OperatorMetrics(), settings):
            await k.create_policy(
                "load",
                {
                    "nodeSelector": {"matchLabels": {POOL_LABEL: "on"}},
                    "mode": "Dynamic",
                    "batchWindowSeconds": 1,
                },
            )

            async def all_offering() -> bool | None:
                parts = await k.custom.list_cluster_custom_object("dynamig.io", "v1alpha1", "gpupartitions")
                ready = [
                    p for p in parts["items"] if ((p.get("status") or {}).get("offeredPlacements") or 0) > 0
                ]
                return True if len(ready) == n * args.gpus else None

            t0 = time.monotonic()
            await eventually(
                all_offering, f"{n * args.gpus} GPUs offering placements", within_s=1800, every_s=5.0
            )
            say(f"N={n}: {n} agents and the operator settled in {time.monotonic() - t0:.0f}s")
            await asyncio.sleep(args.settle)  # start-up writes are not steady state
            idle_since = time.time()
            await asyncio.sleep(args.idle_seconds)  # no pods: what idle nodes cost
            await asyncio.sleep(1.0)  # the audit log is written as requests arrive
            idle = audit_counts(audit_log, idle_since, idle_since + args.idle_seconds)
            lat = Latencies(bench_api)
            tasks += [asyncio.create_task(lat.claims()), asyncio.create_task(lat.pods())]
            created: dict[str, float] = {}
            usage0 = resource.getrusage(resource.RUSAGE_SELF)
            before, since = requests_total(cp), time.time()
            i = 0
            deletions: list[tuple[float, str]] = []
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                name = f"p-{i:05d}"
                created[name] = time.time()
                await k.pod(name, "small", {POOL_LABEL: "on"})
                deletions.append((time.monotonic() + args.lifetime, name))
                while deletions and deletions[0][0] <= time.monotonic():
                    await k.delete_pods([deletions.pop(0)[1]])
                i += 1
                await asyncio.sleep(1.0 / args.rate)
            after, until = requests_total(cp), time.time()
            usage1 = resource.getrusage(resource.RUSAGE_SELF)
            await asyncio.sleep(1.0)  # the audit log is written as requests arrive
            by_client = audit_counts(audit_log, since, until)
            window = until - since
            alloc = [lat.allocated[p] - t for p, t in created.items() if p in lat.allocated]
            bound = [lat.bound[p] - t for p, t in created.items() if p in lat.bound]
            await k.delete_pods([name for _, name in deletions])
            await k.delete_policy("load")
        return {
            "nodes": n,
            "gpus": n * args.gpus,
            "placements_per_profile": args.placements_per_profile,
            "window_s": round(window, 1),
            "pods_created": len(created),
            "apiserver_requests_per_s": round((after - before) / window, 2),
            "requests_per_node_per_s": round(by_client["agents"] / window / n, 3),
            "lease_requests_per_node_per_s": round(by_client["agent-leases"] / window / n, 3),
            "idle_requests_per_node_per_s": round(idle["agents"] / args.idle_seconds / n, 4),
            "idle_lease_requests_per_node_per_s": round(idle["agent-leases"] / args.idle_seconds / n, 4),
            "operator_requests_per_s": round(by_client["operator"] / window, 2),
            "bench_requests_per_s": round(by_client["bench"] / window, 2),
            "other_requests_per_s": round(by_client["other"] / window, 2),
            "claims_allocated": len(alloc),
            "claim_p50_s": round(percentile(alloc, 50), 3),
            "claim_p99_s": round(percentile(alloc, 99), 3),
            "bound_p50_s": round(percentile(bound, 50), 3),
            "bound_p99_s": round(percentile(bound, 99), 3),
            "process_cpu_s_per_s": round(
                ((usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)) / window, 3
            ),
            "process_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for api in clients:
            await api.close()
        for nvml in modules:
            nvml.configure(gpus=[], state_file=None)
        await asyncio.to_thread(cp.stop)


async def main_async(args: argparse.Namespace) -> int:
    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    results = []
    for n in [int(x) for x in args.nodes.split(",")]:
        result = await run_one(n, args, say)
        results.append(result)
        print(json.dumps(result) if args.output == "json" else _text(result), flush=True)
    if len(results) > 1:
        first, last = results[0], results[-1]
        ratio = last["requests_per_node_per_s"] / max(first["requests_per_node_per_s"], 1e-9)
        summary = {
            "summary": f"agent requests per node per second at N={last['nodes']} vs N={first['nodes']}",
            "ratio": round(ratio, 2),
        }
        print(json.dumps(summary) if args.output == "json" else f"{summary['summary']}: {ratio:.2f}x")
    return 0


def _text(r: dict[str, Any]) -> str:
    return (
        f"N={r['nodes']:>4}: idle agents {r['idle_requests_per_node_per_s']:.4f} req/node/s (+ Lease "
        f"{r['idle_lease_requests_per_node_per_s']:.3f}); under churn agents "
        f"{r['requests_per_node_per_s']:.3f} req/node/s (+ Lease {r['lease_requests_per_node_per_s']:.3f}), "
        "operator "
        f"{r['operator_requests_per_s']:.2f} req/s, apiserver total {r['apiserver_requests_per_s']:.1f} "
        f"req/s; claim p50 {r['claim_p50_s']:.2f}s p99 {r['claim_p99_s']:.2f}s; bound p50 "
        f"{r['bound_p50_s']:.2f}s p99 {r['bound_p99_s']:.2f}s; cpu {r['process_cpu_s_per_s']:.2f}, "
        f"peak rss {r['process_peak_rss_mb']} MB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", default="10,50,100", help="comma-separated node counts, one run each")
    parser.add_argument("--gpus", type=int, default=1, help="simulated A100-80GBs per node")
    parser.add_argument(
        "--placements-per-profile",
        type=int,
        default=0,
        help="the agents' --placements-per-profile (0: every placement; 1 advised past a few hundred nodes)",
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the measured churn window")
    parser.add_argument("--rate", type=float, default=1.0, help="pods created per second, cluster-wide")
    parser.add_argument("--lifetime", type=float, default=20.0, help="seconds each pod lives")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds between start-up and measuring")
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="idle window before the churn")
    parser.add_argument(
        "--create-latency", type=float, default=0.5, help="simulated seconds per GI/CI create"
    )
    parser.add_argument("--work-dir", default="/tmp/dynamig-api-load", help="control planes and audit logs")
    parser.add_argument("-o", "--output", choices=("json", "text"), default="text")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
