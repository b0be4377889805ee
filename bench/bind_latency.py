"""What a user waits for: pod created -> pod bound, on the real kube-scheduler, the morning burst three ways.

One local control plane (kube-apiserver, kube-scheduler, kube-controller-manager built from their modules);
per scenario two fresh nodes with one simulated A100-80GB each (``--create-latency`` seconds per NVML GPU
instance create) and an in-process node agent per node with production settings (partitionable inventory,
as the API server offers it); no operator: the benchmark writes each GpuPartition's floor and offered
profiles as a Dynamic policy would. Then ``--pods`` pods, each with a claim for one ``1g.10gb``, created
back to back, and the time from each pod's creation to the first poll (50 ms) that sees it bound:

- ``free``: every 1g.10gb instance pre-created (a warm pool): published without binding conditions, so a
  pod binds in its scheduling cycle;
- ``free-guarded``: the same, with ``--guard-free-instances`` (every device carries binding conditions:
  how every booking waited before free instances bound at once): the in-run baseline for ``free``;
- ``cuts``: idle GPUs, every booking a placement that the agent cuts (binding conditions, answered ready).
- ``free-dp``, ``cuts-dp``: ``free`` and ``cuts`` with the pods written for the NVIDIA device plugin
  (``nvidia.com/mig-1g.10gb: 1`` in their limits, no claim), served through the DeviceClass the operator keeps
  for the profile (created here as the operator would): the same burst, side by side with its claim form;
- ``stuck-agent`` (``--stuck``): ``cuts`` with half the pods, the operator running (a Dynamic policy, the
  agents' heartbeat Leases at the production 30 s), and the agent of one node stopped once both published
  (its slices stay, as with a SIGSTOPped agent): how long until every pod is bound, and where.

    python bench/bind_latency.py                      # about 2 minutes; --stuck adds --stuck-wait
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from types import ModuleType

from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry

from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml.device import NvmlDevices
from dynamig.backends.nvml import fresh_simulated_nvml
from dynamig.demo.cluster import AllocationWatch, ScenarioApi, device_plugin_pod
from dynamig.demo.inprocess import operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.sandbox import install
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.devices import profile_device_class
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, MANAGED_NODE_LABEL, VERSION, gpu_partition_name
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.settings import OperatorSettings
from dynamig.simulate.trace import percentile

NAMESPACE = "bind"
POOL_LABEL = "dynamig.io/bench-pool"
WARM = [("1g.10gb", s) for s in range(7)]  # every 1g.10gb placement of an A100-80GB
DEVICE_PLUGIN = "-dp"  # scenario suffix: the pods ask nvidia.com/mig-1g.10gb: 1 instead of a claim


@dataclasses.dataclass
class Outcome:
    scenario: str
    pods: int
    bound: int
    p50_s: float
    p99_s: float
    max_s: float
    bound_by_node: dict[str, int]
    creates: int  # GPU instances created while the pods were booked

    def row(self) -> str:
        nodes = ", ".join(f"{n}: {c}" for n, c in sorted(self.bound_by_node.items()))
        return (
            f"{self.scenario:<14} {self.bound:>3}/{self.pods:<3} {self.p50_s:>7.2f} {self.p99_s:>7.2f} "
            f"{self.max_s:>7.2f} {self.creates:>7}   {nodes}"
        )


class Node:
    """One registered node with its simulated GPU and its running agent."""

    def __init__(self, name: str, nvml: ModuleType, agent: NodeAgent, task: asyncio.Task[None]) -> None:
        self.name, self.nvml, self.agent, self.task = name, nvml, agent, task

    def creates(self) -> int:
        return sum(1 for ev in self.nvml.history() if ev.kind == "create-gi")


async def start_node(
    cp: ControlPlane, api: client.ApiClient, name: str, pool: str, settings: AgentSettings, latency: float
) -> Node:
    await cp.aregister_node(name, labels={MANAGED_NODE_LABEL: "true", POOL_LABEL: pool})
    nvml = fresh_simulated_nvml()
    nvml.configure(gpus=["A100-80GB"], state_file=None, seed=name, create_latency_s=latency)
    devices = NvmlDevices(nvml, load_catalog())
    devices.init()
    agent = NodeAgent(settings, KubeApi(api), devices, AgentMetrics(CollectorRegistry(), name))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop), name=f"agent-{name}")
    task.add_done_callback(lambda _: stop.set())
    return Node(name, nvml, agent, task)


async def offered_as_policy(k: ScenarioApi, gpu: str, layout: list[tuple[str, int]]) -> None:
    """Write what a Dynamic policy's operator writes for a partitionable GPU, then wait until the agent has
    applied the floor and publishes the placements."""
    await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=120)
    await k.custom.patch_cluster_custom_object(
        GROUP, VERSION, GPU_PARTITION_PLURAL, gpu,
        {"spec": {"layout": [{"profile": p, "start": s} for p, s in layout], "offeredProfiles": ["1g.10gb"]}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip

    async def applied() -> bool | None:
        part = await k.stable(gpu)
        st = (part or {}).get("status") or {}
        have = {(i["profile"], i["start"]) for i in st.get("instances") or []}
        return True if st.get("inventory") == "Partitionable" and have == set(layout) else None

    await eventually(applied, f"{gpu} applied", within_s=120)


async def run_scenario(
    cp: ControlPlane, api: client.ApiClient, scenario: str, args: argparse.Namespace
) -> Outcome:
    k = ScenarioApi(api, NAMESPACE)
    guard = scenario == "free-guarded"
    stuck = scenario == "stuck-agent"
    layout = WARM if scenario.startswith("free") else []
    lease_ns = NAMESPACE if stuck else None
    settings = {
        name: AgentSettings(node=name, inventory=None, guard_free_instances=guard, lease_namespace=lease_ns)
        for name in (f"{scenario}-a", f"{scenario}-b")
    }
    nodes = [await start_node(cp, api, n, scenario, s, args.create_latency) for n, s in settings.items()]
    watch = AllocationWatch(k)
    operator = contextlib.AsyncExitStack()
    try:
        if stuck:  # the operator withdraws a silent agent's node and fails its waiting bookings
            op = OperatorSettings(
                kubeconfig=cp.kubeconfig_path, standalone=True, agent_lease_namespace=NAMESPACE
            )
            await operator.enter_async_context(operator_running(cp.kubeconfig_path, OperatorMetrics(), op))
            await k.create_policy(
                scenario, {"nodeSelector": {"matchLabels": {POOL_LABEL: scenario}}, "mode": "Dynamic"}
            )
        for node in nodes:
            await offered_as_policy(k, gpu_partition_name(node.name, 0), layout)
        if stuck:
            nodes[0].task.cancel()  # stopped: its slices stay published, nothing answers for it
            with contextlib.suppress(asyncio.CancelledError):
                await nodes[0].task
        await asyncio.sleep(1.0)  # start-up writes are not what a booking meets
        creates0 = sum(n.creates() for n in nodes)
        watch.start()
        created: dict[str, float] = {}
        pods = [f"{scenario}-{i:02d}" for i in range(args.pods // 2 if stuck else args.pods)]
        for name in pods:
            if scenario.endswith(DEVICE_PLUGIN):
                await k.core.create_namespaced_pod(NAMESPACE, device_plugin_pod(name, {POOL_LABEL: scenario}))
            else:
                await k.pod(name, "one-1g", {POOL_LABEL: scenario})
            created[name] = time.time()
        wait_s = args.stuck_wait if stuck else 120.0

        async def all_bound() -> bool | None:
            watch.raise_if_stopped()
            return True if all(p in watch.first_bound for p in pods) else None

        with contextlib.suppress(TimeoutError):
            await eventually(all_bound, f"{scenario}: every pod bound", within_s=wait_s)
        waits = [watch.first_bound[p] - created[p] for p in pods if p in watch.first_bound]
        by_node: dict[str, int] = {}
        for pod in (await k.core.list_namespaced_pod(NAMESPACE)).items:
            if pod.metadata.name in created and pod.spec.node_name:
                by_node[pod.spec.node_name] = by_node.get(pod.spec.node_name, 0) + 1
        outcome = Outcome(
            scenario,
            len(pods),
            len(waits),
            percentile(waits, 50),
            percentile(waits, 99),
            max(waits, default=0.0),
            by_node,
            sum(n.creates() for n in nodes) - creates0,
        )
        await k.delete_pods(pods)
        return outcome
    finally:
        await operator.aclose()
        await watch.stop()
        for node in nodes:
            node.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await node.task
            node.agent.devices.shutdown()
            node.nvml.configure(gpus=[], state_file=None)


async def main_async(args: argparse.Namespace) -> int:
    cp = ControlPlane(work_dir=Path(args.work_dir) / "cp")
    await asyncio.to_thread(cp.start)
    api = client.ApiClient(configuration=cp.client_configuration())
    outcomes: list[Outcome] = []
    try:
        install(cp)
        cp.kubectl("create", "namespace", NAMESPACE)
        k = ScenarioApi(api, NAMESPACE)
        await k.claim_template("one-1g", ["1g.10gb"])
        classes = ("resource.k8s.io", "v1", "deviceclasses")
        await k.custom.create_cluster_custom_object(*classes, profile_device_class("1g.10gb"))
        scenarios = ["free", "free-dp", "free-guarded", "cuts", "cuts-dp"] + (
            ["stuck-agent"] if args.stuck else []
        )
        for scenario in scenarios:
            print(f"running {scenario} ...", file=sys.stderr, flush=True)
            outcomes.append(await run_scenario(cp, api, scenario, args))
    finally:
        await api.close()
        await asyncio.to_thread(cp.stop)
    if args.output == "json":
        print(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=1))
        return 0
    print(f"pod created -> bound, {args.pods} pods, 2 nodes x 1 A100-80GB, create {args.create_latency}s")
    print(
        f"{'SCENARIO':<14} {'BOUND':>7} {'P50 S':>7} {'P99 S':>7} {'MAX S':>7} {'CREATES':>7}   PODS PER NODE"
    )
    for o in outcomes:
        print(o.row())
    by = {o.scenario: o for o in outcomes}
    if by["free"].p99_s > 0:
        ratio = by["free-guarded"].p99_s / by["free"].p99_s
        print(f"free instances: p99 {ratio:.1f}x faster without binding conditions than with them")
    for form in ("free", "cuts"):
        claim, plugin = by[form], by[form + DEVICE_PLUGIN]
        print(
            f"{form}: the device-plugin form binds at p50 {plugin.p50_s:.2f}s / p99 {plugin.p99_s:.2f}s "
            f"against {claim.p50_s:.2f}s / {claim.p99_s:.2f}s for the claim form"
        )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pods", type=int, default=14, help="pods in the burst (14 fill both GPUs with 1g.10gb)")
    p.add_argument("--create-latency", type=float, default=0.5, help="simulated seconds per NVML create")
    p.add_argument("--stuck", action="store_true", help="also run the burst with one agent stopped")
    p.add_argument("--stuck-wait", type=float, default=90.0, help="how long the stuck-agent run waits")
    p.add_argument("--work-dir", default="/tmp/dynamig-bind-latency")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
