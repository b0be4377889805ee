"""The partitionable inventory end to end: the agent's loop publishes every placement, the real 1.36
scheduler books them, the agent cuts and answers, pods bind.

Real: etcd, kube-apiserver, kube-scheduler (DRA allocation against shared counters; binding held until
the device's binding conditions are True, polled every 5 s in PreBind, dynamicresources.go),
kube-controller-manager, the node agent's whole loop (feature probe, inventory, allocation answers, NVML
code path) and, where a policy drives the GPUs, the operator. Simulated: the GPUs
(simnvml, with a create latency; its event history is the ground truth for "no allocated instance was
destroyed") and the nodes (no kubelet: pods bind, never run).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.agent.controller import AgentSettings
from dynamig.demo.cluster import (
    AllocationWatch,
    ScenarioApi,
    allocated_device,
    claim_pod,
    exactly,
    first_available,
    layout_text,
    resource_claim,
)
from dynamig.demo.inprocess import agent_running, operator_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.versions import PRIMARY, KubeTarget, current
from dynamig.devcluster.waiting import described
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.teardown import uninstall
from dynamig.simulate.trace import percentile

pytestmark = pytest.mark.controlplane

BASELINE = [("3g.40gb", 0), ("3g.40gb", 4)]
CREATE_LATENCY_S = 0.5
A100_PROFILES = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


def partitionable(node: str) -> AgentSettings:
    """Quick periods, the partitionable inventory: chosen by the agent's probe where it picks it (1.37.2 on),
    opted into where the API server serves it to a scheduler that does not scale with it."""
    auto = current().chooses_partitionable
    return dataclasses.replace(
        quick_agent_settings(node), inventory=None if auto else Inventory.PARTITIONABLE
    )


async def offer(k: ScenarioApi, gpu: str, layout: list[tuple[str, int]], profiles: list[str]) -> None:
    """What a Dynamic policy's operator writes for a partitionable GPU: the floor layout and the offers."""
    await k.custom.patch_cluster_custom_object(
        GROUP, VERSION, GPU_PARTITION_PLURAL, gpu,
        {"spec": {"layout": [{"profile": p, "start": s} for p, s in layout], "offeredProfiles": profiles}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


async def offering(k: ScenarioApi, gpu: str, layout: str) -> dict[str, Any] | None:
    part = await k.stable(gpu, layout)
    st = (part or {}).get("status") or {}
    if st.get("inventory") != Inventory.PARTITIONABLE.value or not st.get("offeredPlacements"):
        return None
    return part


async def one_gpu_node(
    k: ScenarioApi, sim: ModuleType, make_node: Callable[..., str], prefix: str, **sim_kw: Any
) -> str:
    """The DeviceClass, one simulated A100-80GB and a managed node for it; the node's name."""
    await k.ensure_device_class()
    sim.configure(gpus=["A100-80GB"], state_file=None, **sim_kw)
    return make_node(prefix, labels={"dynamig.io/managed": "true"})


async def offered(k: ScenarioApi, gpu: str, layout: list[tuple[str, int]], profiles: list[str]) -> None:
    """Once the agent has made ``gpu``'s GpuPartition: offer ``profiles`` above ``layout`` and wait until the
    agent publishes them."""
    await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
    await offer(k, gpu, layout, profiles)
    await eventually(functools.partial(offering, k, gpu, layout_text(layout)), f"{gpu} offering")


async def bound_node(k: ScenarioApi, pod: str) -> str | None:
    got = await k.core.read_namespaced_pod(pod, k.ns)
    return got.spec.node_name or None


def burst_policy(pool: str) -> dict[str, Any]:
    """The Dynamic policy both halves of the morning burst run under: the baseline, a short batch window,
    both GPUs may change at once. Pure."""
    return {
        "nodeSelector": {"matchLabels": {"test-pool": pool}},
        "mode": "Dynamic",
        "baseline": {"A100-80GB": [{"profile": p, "start": s} for p, s in BASELINE]},
        "batchWindowSeconds": 1,
        "disruptionBudget": {"maxGpusReshaping": 2},
    }


async def burst(k: ScenarioApi, watch: AllocationWatch, pool: str, pods: list[str]) -> list[float]:
    """Create the inference pods at once; seconds from each pod's creation to its binding."""
    created: dict[str, float] = {}
    for name in pods:
        created[name] = time.time()
        await k.pod(name, "inference", {"test-pool": pool})

    async def all_bound() -> bool | None:
        watch.raise_if_stopped()
        return True if all(p in watch.first_bound for p in pods) else None

    await eventually(all_bound, "every burst pod bound", within_s=180, every_s=0.2)
    return [watch.first_bound[p] - created[p] for p in pods]


@pytest.mark.matrix("partitionable")
async def test_morning_burst_books_placements_directly_and_is_compared_with_reshape_ahead(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """2 x A100-80GB pre-cut 2 x 3g.40gb, seven pods asking 1g.10gb else 2g.20gb, the same Dynamic policy:
    once with the instances inventory (the operator re-cuts ahead), once with the partitionable inventory (the
    operator offers every profile, pods book placements straight away), in the same run, with the same
    simulated create latency."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    await k.claim_template("inference", ["1g.10gb", "2g.20gb"])
    figures: dict[str, list[float]] = {}
    pods = [f"infer-{i}" for i in range(7)]

    # ---- today's design: instances inventory, the operator re-cuts ahead of the scheduler ----------------
    sim.configure(gpus=["A100-80GB", "A100-80GB"], state_file=None, create_latency_s=CREATE_LATENCY_S)
    pool = uuid.uuid4().hex[:8]
    node = make_node("ahead", labels={"dynamig.io/managed": "true", "test-pool": pool})
    gpus = [f"{node}-gpu0", f"{node}-gpu1"]
    watch = AllocationWatch(k)
    policy = f"ahead-{pool}"
    async with agent_running(kube_api, node, sim):
        for g in gpus:
            await eventually(functools.partial(k.stable, g), f"GpuPartition {g}", within_s=60)
            await k.set_layout(g, BASELINE)
        for g in gpus:
            await eventually(functools.partial(k.stable, g, layout_text(BASELINE)), f"{g} pre-cut")
        async with operator_running(crds.kubeconfig_path, OperatorMetrics()):
            await k.create_policy(policy, burst_policy(pool))
            watch.start()
            try:
                figures["instances"] = await burst(k, watch, pool, pods)
                # Once the agents are done, the policy is Ready, as kubectl wait sees it.
                # (in a thread: the agent and the operator run on this event loop)
                wait = ("wait", "--for=condition=Ready", f"gpp/{policy}", "--timeout=60s")
                await asyncio.to_thread(crds.kubectl, *wait, timeout=90)
                # The operator's and the agent's Events show where a person looks (kubectl describe filters
                # on the uid). The agent posts its own after the status the policy's Ready follows: waited
                # for while it runs.
                shown = ("LayoutChanged", "InstanceDestroyed", "InstanceCreated", "LayoutApplied")
                await described(crds, "gpupartition", gpus, *shown, within_s=30)
            finally:
                await watch.stop()
                await k.delete_policy(policy)
    await k.delete_pods(pods)
    await eventually(lambda: _no_pods(k), "the first burst's pods gone", within_s=60)

    # ---- the partitionable inventory: the same Dynamic policy offers every placement, pods book them -------
    sim.configure(gpus=["A100-80GB", "A100-80GB"], state_file=None, create_latency_s=CREATE_LATENCY_S)
    pool = uuid.uuid4().hex[:8]
    node = make_node("direct", labels={"dynamig.io/managed": "true", "test-pool": pool})
    gpus = [f"{node}-gpu0", f"{node}-gpu1"]
    watch = AllocationWatch(k)
    policy = f"direct-{pool}"
    async with (
        agent_running(kube_api, node, sim, partitionable(node)) as agent,
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        for g in gpus:
            await eventually(functools.partial(k.stable, g), f"GpuPartition {g}", within_s=60)
            await k.set_layout(g, BASELINE)
        await k.create_policy(policy, burst_policy(pool))
        for g in gpus:  # the operator wrote the baseline and every profile of the model as offers
            part = await eventually(functools.partial(offering, k, g, layout_text(BASELINE)), f"{g} offering")
            assert set(A100_PROFILES) <= set(part["spec"]["offeredProfiles"]), part["spec"]
        assert agent.support is not None and agent.support.inventory is Inventory.PARTITIONABLE
        status = await eventually(lambda: _policy_inventory(k, policy), "the policy reports its inventory")
        assert status == {"partitionable": 2, "instances": 0}
        history_start = len(sim.history())
        watch.start()
        try:
            figures["partitionable"] = await burst(k, watch, pool, pods)
        finally:
            await watch.stop()
        history = sim.history()[history_start:]
        assert watch.destroyed_while_allocated(history) == []
        devices = {p: allocated_device(await k.claim_of(p)) for p in pods}
        assert all(d and "-1g10gb-" in d for d in devices.values()), devices  # every first choice served
        assert len(set(devices.values())) == 7
        assert any(ev.kind == "destroy-gi" and ev.profile == "3g.40gb" for ev in history)  # re-cut, free
        for p in pods:  # what the pod got, as kubectl shows it
            claim = await k.claim_of(p)
            assert claim is not None
            (entry,) = claim["status"]["devices"]
            assert entry["data"]["profile"] == "1g.10gb" and entry["data"]["migUUID"].startswith("MIG-")
        # Counted once the round's answers and their Events are written: a pod may bind before.
        answers = await eventually(
            lambda: _answers(agent, node, "ready", 7), "seven ready answers counted", within_s=30
        )
        assert answers == 7

        # DryRun: the offers are withdrawn (the agent stops publishing placements), what Dynamic would offer
        # is reported on the policy, and the pods keep their instances.
        await k.set_mode(policy, "DryRun")
        for g in gpus:
            await eventually(functools.partial(_withdrawn, k, g), f"{g} offers withdrawn")

        seen: list[Any] = [None]

        async def planned() -> list[dict[str, Any]] | None:  # written apart from the GpuPartitions' specs
            seen[0] = ((await k.policy(policy)).get("status") or {}).get("plannedOffers")
            return seen[0] if sorted(o["gpu"] for o in seen[0] or []) == gpus else None

        try:
            await eventually(planned, f"the offers DryRun plans for {gpus} on the policy", within_s=30)
        except TimeoutError as exc:
            raise AssertionError(f"plannedOffers last seen: {seen[0]}") from exc
        assert {allocated_device(await k.claim_of(p)) for p in pods} == set(devices.values())
        await k.delete_policy(policy)
    await k.delete_pods(pods)

    with capsys.disabled():
        print()
        for name, values in figures.items():
            print(
                f"  morning burst, {name:>13} inventory: pod created -> bound p50 "
                f"{percentile(values, 50):.1f}s, p99 {percentile(values, 99):.1f}s "
                f"(create latency {CREATE_LATENCY_S}s; the scheduler re-reads binding conditions every 5s)"
            )
    assert len(figures["partitionable"]) == 7 and len(figures["instances"]) == 7


async def _answers(agent: Any, node: str, answer: str, at_least: int) -> float | None:
    """The agent's count of ``answer`` answers once it is ``at_least``."""
    got = float(agent.metrics.binding_answers.labels(node, answer)._value.get())
    return got if got >= at_least else None


async def _policy_inventory(k: ScenarioApi, policy: str) -> dict[str, int] | None:
    inventory: dict[str, int] | None = ((await k.policy(policy)).get("status") or {}).get("inventory")
    return inventory or None


async def _withdrawn(k: ScenarioApi, gpu: str) -> bool | None:
    part = await k.partition(gpu)
    offered = part["spec"].get("offeredProfiles")
    return True if offered == [] and not (part.get("status") or {}).get("offeredPlacements") else None


async def _no_pods(k: ScenarioApi) -> bool | None:
    return True if not (await k.core.list_namespaced_pod(k.ns)).items else None


async def _create_claim(k: ScenarioApi, name: str, request: dict[str, Any]) -> None:
    await k.custom.create_namespaced_custom_object(
        "resource.k8s.io", "v1", k.ns, "resourceclaims", resource_claim(name, request)
    )


async def _bound_1g_pod(k: ScenarioApi, name: str, node: str) -> None:
    """Pod ``name`` with a claim of its own for one 1g.10gb, pinned to ``node``; returns once it is bound."""
    await _create_claim(k, name, {"firstAvailable": first_available(["1g.10gb"])})
    await k.core.create_namespaced_pod(k.ns, claim_pod(name, {"kubernetes.io/hostname": node}, claim=name))
    assert await eventually(lambda: bound_node(k, name), f"pod {name} bound", within_s=60) == node


async def test_two_claims_and_a_two_device_request_are_cut_on_one_gpu_and_the_pod_binds(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    node = await one_gpu_node(k, sim, make_node, "pair")
    gpu = f"{node}-gpu0"
    async with agent_running(kube_api, node, sim, partitionable(node)):
        await offered(k, gpu, [], A100_PROFILES)
        # One pod, two claims (a 2g.20gb and a pair of 1g.10gb from one request).
        await _create_claim(k, "one", {"firstAvailable": first_available(["2g.20gb"])})
        await _create_claim(
            k, "pair", exactly('device.attributes["mig.dynamig.io"].profile == "1g.10gb"', count=2)
        )
        body = claim_pod("two-claims", {"kubernetes.io/hostname": node}, claim="one")
        body["spec"]["resourceClaims"].append({"name": "pair", "resourceClaimName": "pair"})
        body["spec"]["containers"][0]["resources"]["claims"].append({"name": "pair"})
        await k.core.create_namespaced_pod(namespace, body)
        assert (
            await eventually(lambda: bound_node(k, "two-claims"), "the two-claim pod bound", within_s=60)
            == node
        )
        got: list[PlacedInstance] = []
        for name in ("one", "pair"):
            claim = await k.custom.get_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaims", name
            )
            results = claim["status"]["allocation"]["devices"]["results"]
            assert {r["pool"] for r in results} == {node}
            assert len(claim["status"]["devices"]) == len(results)
            got += [
                PlacedInstance(e["data"]["placementStart"], e["data"]["profile"])
                for e in claim["status"]["devices"]
            ]
        assert sorted(p.profile for p in got) == ["1g.10gb", "1g.10gb", "2g.20gb"]
        existing = {i.placed for i in _instances(sim)}
        assert set(got) <= existing  # each one cut, none overlapping (NVML would have refused)


def _instances(sim: ModuleType) -> list[Any]:
    from dynamig.agent.nvml.device import NvmlDevices
    from dynamig.geometry.catalog import load_catalog

    devices = NvmlDevices(sim, load_catalog())
    devices.init()
    try:
        return [i for g in devices.discover()[0] for i in devices.instances(g)]
    finally:
        devices.shutdown()


async def test_a_placement_taken_behind_the_agents_back_fails_the_binding_and_the_pod_binds_elsewhere(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """The race the settle timer could lose: the scheduler books a placement, and before the agent answers
    someone else creates an instance there and runs a process on it. The binding fails, the scheduler
    books again, the pod binds; no instance is destroyed while allocated or busy."""
    k = ScenarioApi(kube_api, namespace)
    node = await one_gpu_node(k, sim, make_node, "race")
    gpu = f"{node}-gpu0"
    watch = AllocationWatch(k)
    async with agent_running(kube_api, node, sim, partitionable(node)) as agent:
        await offered(k, gpu, [], ["3g.40gb"])
        watch.start()
        async with agent.lock:  # the agent is between rounds: nothing answers until the lock is released
            await _create_claim(k, "half", {"firstAvailable": first_available(["3g.40gb"])})
            await k.core.create_namespaced_pod(
                namespace, claim_pod("half", {"kubernetes.io/hostname": node}, claim="half")
            )
            claim = await eventually(lambda: _allocated(k, "half"), "the claim booked", within_s=60)
            booked = allocated_device(claim)
            assert booked is not None
            start = int(booked.rsplit("-s", 1)[1])
            intruder = _create_behind_the_agents_back(sim, "3g.40gb", start)
        try:
            assert await eventually(lambda: bound_node(k, "half"), "the pod bound", within_s=120) == node
        finally:
            await watch.stop()
        final = allocated_device(await _allocated(k, "half"))
        assert final is not None and final != booked
        assert agent.metrics.binding_answers.labels(node, "failed")._value.get() >= 1
        history = sim.history()
        assert watch.destroyed_while_allocated(history) == []
        assert not [e for e in history if e.kind == "destroy-gi" and e.start == start]  # intruder intact
        assert intruder in {i.mig_uuid for i in _instances(sim)}
        # What happened is on the claim, where kubectl describe shows it (the ready answer's Event is
        # posted after the answer the binding follows: waited for).
        await described(
            crds,
            "resourceclaim",
            "half",
            "AllocationFailed",
            "AllocationReady",
            namespace=namespace,
            within_s=30,
        )


def _create_behind_the_agents_back(sim: ModuleType, profile: str, start: int) -> str:
    """Create ``profile`` at ``start`` with a process on it, straight through NVML; its MIG UUID."""
    from dynamig.agent.nvml.device import NvmlDevices
    from dynamig.geometry.catalog import load_catalog

    devices = NvmlDevices(sim, load_catalog())
    devices.init()
    try:
        made = devices.create(devices.gpu(0), PlacedInstance(start, profile))
        sim.attach_process(made.mig_uuid, 4242)
        return str(made.mig_uuid)
    finally:
        devices.shutdown()


async def _allocated(k: ScenarioApi, name: str) -> dict[str, Any] | None:
    with contextlib.suppress(client.ApiException):
        claim: dict[str, Any] = await k.custom.get_namespaced_custom_object(
            "resource.k8s.io", "v1", k.ns, "resourceclaims", name
        )
        return claim if allocated_device(claim) else None
    return None


@pytest.mark.matrix
async def test_auto_picks_the_inventory_this_versions_scheduler_carries_and_says_why(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
    kube_target: KubeTarget,
) -> None:
    """``--inventory=auto`` on each Kubernetes target: Partitionable only where the API server keeps the
    fields and the scheduler carries them at any size (v1.37.2 on); the GpuPartition says which, and why."""
    k = ScenarioApi(kube_api, namespace)
    node = await one_gpu_node(k, sim, make_node, "auto")
    gpu = f"{node}-gpu0"
    settings = dataclasses.replace(quick_agent_settings(node), inventory=None)
    async with agent_running(kube_api, node, sim, settings) as agent:
        chosen = await eventually(lambda: _support(agent), "the agent's choice")
        expected = Inventory.PARTITIONABLE if kube_target.chooses_partitionable else Inventory.INSTANCES
        assert chosen is expected, agent.support
        part = await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
        assert part["status"]["inventory"] == expected.value
        why = agent.support.why if agent.support else ""
        if kube_target.serves_partitionable and not kube_target.chooses_partitionable:
            assert kube_target.version in why and "v1.37.2" in why  # the version, and the way to opt in
            assert "--inventory=partitionable" in why
        elif not kube_target.serves_partitionable:
            assert "DRAPartitionableDevices" in why


@pytest.mark.matrix("partitionable")
async def test_a_warm_instance_is_booked_with_no_create_on_the_path(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    node = await one_gpu_node(k, sim, make_node, "warm", create_latency_s=CREATE_LATENCY_S)
    gpu = f"{node}-gpu0"
    warm = [("1g.10gb", 6)]
    async with agent_running(kube_api, node, sim, partitionable(node)):
        await offered(k, gpu, warm, A100_PROFILES)  # a warm pool of one 1g.10gb, pre-created
        history_start = len(sim.history())
        await _bound_1g_pod(k, "w", node)
        claim = await _allocated(k, "w")
        assert allocated_device(claim) == "gpu0-1g10gb-s6"
        assert [e.kind for e in sim.history()[history_start:] if e.kind.startswith("create")] == []
        # It existed and was free: booked without binding conditions, so no answer stood between it and
        # its pod (the scheduler's 5 s re-check never ran).
        assert claim is not None
        result = claim["status"]["allocation"]["devices"]["results"][0]
        assert "bindingConditions" not in result

        async def reported() -> dict[str, Any] | None:
            got = await _allocated(k, "w")
            return next(iter((got or {}).get("status", {}).get("devices") or []), None)

        # After the fact the agent reports what the pod got, with nothing for the scheduler to wait on.
        entry = await eventually(reported, "the MIG UUID reported in the claim", within_s=30)
        (made,) = [i for i in _instances(sim) if (i.profile, i.start) == ("1g.10gb", 6)]
        assert entry["data"]["migUUID"] == made.mig_uuid and not entry.get("conditions")


async def test_an_allocated_instance_recut_behind_the_agents_back_is_reported_on_the_gpu_and_the_claim(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """Someone destroys the instance a running pod holds and creates it again at the same place: same
    device name, new MIG UUID, and the pod's containers point at the old one. `kubectl describe` shows it on
    the GpuPartition and on the claim, once."""
    k = ScenarioApi(kube_api, namespace)
    node = await one_gpu_node(k, sim, make_node, "recut")
    gpu = f"{node}-gpu0"
    async with agent_running(kube_api, node, sim, partitionable(node)) as agent:
        await offered(k, gpu, [], A100_PROFILES)
        await _bound_1g_pod(k, "held", node)
        device = allocated_device(await _allocated(k, "held"))
        assert device is not None
        start = int(device.rsplit("-s", 1)[1])
        (before,) = [i.mig_uuid for i in _instances(sim) if i.start == start]
        await agent.reconcile_once()  # a round that sees the instance held under its first UUID
        async with agent.lock:  # between rounds: the agent sees only the outcome
            after = _recut_behind_the_agents_back(sim, "1g.10gb", start)
        assert after != before
        await agent.reconcile_once()
        await agent.reconcile_once()

        gpart = await asyncio.to_thread(crds.kubectl, "describe", "gpupartition", gpu)
        lines = [x for x in gpart.stdout.splitlines() if "AllocatedInstanceReplaced" in x]
        assert len(lines) == 1, gpart.stdout
        claim = await asyncio.to_thread(crds.kubectl, "describe", "resourceclaim", "-n", namespace, "held")
        text = " ".join(claim.stdout.split())
        assert "AllocatedInstanceReplaced" in text and after in text and before in text, claim.stdout


def _recut_behind_the_agents_back(sim: ModuleType, profile: str, start: int) -> str:
    """Destroy the instance at ``start`` and create ``profile`` there again, straight through NVML."""
    from dynamig.agent.nvml.device import NvmlDevices
    from dynamig.geometry.catalog import load_catalog

    devices = NvmlDevices(sim, load_catalog())
    devices.init()
    try:
        gpu = devices.gpu(0)
        devices.destroy(gpu, PlacedInstance(start, profile))
        return str(devices.create(gpu, PlacedInstance(start, profile)).mig_uuid)
    finally:
        devices.shutdown()


async def test_an_agent_restarted_between_the_two_nvml_creates_answers_once_and_orphans_nothing(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """The crash nvml.h makes possible: the agent created the GPU instance of a booked placement and died
    before its compute instance and its answer. A new agent completes that instance, answers the allocation
    once, and the pod binds, with nothing destroyed or left half-made."""
    k = ScenarioApi(kube_api, namespace)
    node = await one_gpu_node(k, sim, make_node, "restart")
    gpu = f"{node}-gpu0"
    async with agent_running(kube_api, node, sim, partitionable(node)):
        await offered(k, gpu, [], ["2g.20gb"])
    # The agent is gone; its slices stay, so the scheduler books a placement and waits for an answer.
    await _create_claim(k, "r", {"firstAvailable": first_available(["2g.20gb"])})
    await k.core.create_namespaced_pod(namespace, claim_pod("r", {"kubernetes.io/hostname": node}, claim="r"))
    claim = await eventually(lambda: _allocated(k, "r"), "the claim booked", within_s=60)
    booked = allocated_device(claim)
    assert booked is not None
    start = int(booked.rsplit("-s", 1)[1])
    _gpu_instance_only(sim, "2g.20gb", start)  # how far the dead agent got
    assert not await bound_node(k, "r")
    crash_at = len(sim.history())
    async with agent_running(kube_api, node, sim, partitionable(node)) as second:
        assert await eventually(lambda: bound_node(k, "r"), "the pod bound", within_s=60) == node
        answered = await _allocated(k, "r")
        assert answered is not None and allocated_device(answered) == booked
        (entry,) = answered["status"]["devices"]
        assert entry["data"]["placementStart"] == start
        later = sim.history()[crash_at:]
        assert [e.kind for e in later if e.kind.startswith("create")] == ["create-ci"]  # completed
        assert not [e for e in later if e.kind.startswith("destroy")]
        # Counted once the answer's Event is posted: the pod may bind before.
        ready = await eventually(lambda: _answers(second, node, "ready", 1), "the ready answer counted", 30)
        assert ready == 1
        assert [(i.profile, i.start, i.has_compute_instance) for i in _instances(sim)] == [
            ("2g.20gb", start, True)
        ]


def _gpu_instance_only(sim: ModuleType, profile: str, start: int) -> None:
    """The first of the two NVML creates, alone (nvmlDeviceCreateGpuInstanceWithPlacement)."""
    import ctypes

    from dynamig.geometry.catalog import load_catalog

    p = load_catalog().model("A100-80GB").profile(profile)
    sim.nvmlInit()
    try:
        import pynvml

        placement = pynvml.c_nvmlGpuInstancePlacement_t(start, p.placement_size)
        sim.nvmlDeviceCreateGpuInstanceWithPlacement(
            sim.nvmlDeviceGetHandleByIndex(0), p.profile_id, ctypes.byref(placement)
        )
    finally:
        sim.nvmlShutdown()


GATES_OFF = "--feature-gates=DRAPartitionableDevices=false,DRADeviceBindingConditions=false"


@pytest.mark.matrix
async def test_without_the_features_the_agent_keeps_the_instances_inventory(
    tmp_path: Any, sim: ModuleType
) -> None:
    """A cluster whose API server and scheduler run without partitionable devices and binding conditions (as
    1.34/1.35 do by default): the agent finds out at start, says so in GpuPartition status, publishes only
    instances that exist, and a claim is served from them."""
    gated = ControlPlane(work_dir=tmp_path / "cp", apiserver_args=[GATES_OFF], scheduler_args=[GATES_OFF])
    async with gated as cp:
        node = "old-node"
        _own_cluster(cp, node, "old")
        sim.configure(gpus=["A100-80GB"], state_file=None)
        async with cp.api_client() as api:
            k = ScenarioApi(api, "old")
            await k.ensure_device_class()
            gpu = f"{node}-gpu0"
            auto = dataclasses.replace(quick_agent_settings(node), inventory=None)
            async with agent_running(api, node, sim, auto) as agent:
                assert await eventually(lambda: _support(agent), "the probe's verdict") is Inventory.INSTANCES
                await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
                await k.set_layout(gpu, [("1g.10gb", 0)])
                part = await eventually(functools.partial(k.stable, gpu, "1g.10gb@0"), f"{gpu} cut")
                assert part["status"]["inventory"] == Inventory.INSTANCES.value
                assert "DRAPartitionableDevices" in (agent.support.why if agent.support else "")
                slices = (
                    await k.custom.list_cluster_custom_object(
                        "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
                    )
                )["items"]
                devices = [d for s in slices for d in s["spec"].get("devices") or []]
                assert [d["name"] for d in devices] == ["gpu0-1g10gb-s0"]
                assert not any("bindingConditions" in d or "consumesCounters" in d for d in devices)
                await _bound_1g_pod(k, "c", node)
                assert allocated_device(await _allocated(k, "c")) == "gpu0-1g10gb-s0"


def _own_cluster(cp: ControlPlane, node: str, namespace: str) -> None:
    """A test's own control plane made ready for an agent: dynamig's CRDs, a managed node, a namespace."""
    from dynamig.devcluster.binaries import find_repo_root

    root = find_repo_root()
    assert root is not None
    for path in sorted((root / "crds").glob("*.yaml")):
        cp.kubectl("apply", "-f", str(path))
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    cp.register_node(node, labels={"dynamig.io/managed": "true"})
    cp.rest().request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    with contextlib.suppress(Exception):  # the controller manager may have made it already
        cp.rest().request(
            "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": "default"}}
        )


async def _support(agent: Any) -> Inventory | None:
    return agent.support.inventory if agent.support is not None else None


async def _published_profiles(k: ScenarioApi, node: str) -> set[str]:
    """Profiles of the devices the node's ResourceSlices publish, as the scheduler reads them."""
    res = await k.custom.list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
    )
    return {
        d["attributes"]["mig.dynamig.io/profile"]["string"]
        for sl in res["items"]
        for d in sl["spec"].get("devices") or []
        if "mig.dynamig.io/profile" in (d.get("attributes") or {})
    }


async def test_an_idle_node_is_kept_for_a_waiting_two_gpu_claim_and_a_small_pod_waits_for_it(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """A claim for two whole GPUs waits while a node with two idle GPUs exists (its pod asks for more CPU
    than the node has: the operator does not look at CPU, so it sees a waiting two-GPU claim). The operator
    keeps the node for it: its GPUs offer only 7g.80gb, and the real scheduler leaves a 1g.10gb pod pending
    instead of splitting the node. Once the two-GPU claim is gone the node offers every profile again and the
    small pod binds."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["A100-80GB", "A100-80GB"], state_file=None)
    pool = uuid.uuid4().hex[:8]
    node = make_node("kept", labels={"dynamig.io/managed": "true", "test-pool": pool})
    gpus = [f"{node}-gpu0", f"{node}-gpu1"]
    policy = f"kept-{pool}"
    async with (
        agent_running(kube_api, node, sim, partitionable(node)),
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        await k.create_policy(
            policy,
            {
                "nodeSelector": {"matchLabels": {"test-pool": pool}},
                "mode": "Dynamic",
                "batchWindowSeconds": 1,
            },
        )
        for g in gpus:
            await eventually(functools.partial(offering, k, g, ""), f"{g} offering", within_s=60)
        assert {"1g.10gb", "7g.80gb"} <= await _published_profiles(k, node)

        await _create_claim(k, "pair", exactly('device.attributes["mig.dynamig.io"].profile == "7g.80gb"', 2))
        body = claim_pod("pair", {"kubernetes.io/hostname": node}, claim="pair")
        body["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "1000"}  # the node has 64
        await k.core.create_namespaced_pod(namespace, body)

        async def kept() -> bool | None:
            parts = [await k.partition(g) for g in gpus]
            if any(p["spec"].get("offeredProfiles") != ["7g.80gb"] for p in parts):
                return None
            return True if await _published_profiles(k, node) == {"7g.80gb"} else None

        await eventually(kept, "the idle node kept for the two-GPU claim", within_s=60)
        why = f"idle node kept for waiting multi-GPU claim {namespace}/pair"
        await described(crds, "gpupartition", gpus[0], why, within_s=30)  # its Event follows the spec

        await _create_claim(k, "small", {"firstAvailable": first_available(["1g.10gb"])})
        await k.core.create_namespaced_pod(
            namespace, claim_pod("small", {"kubernetes.io/hostname": node}, claim="small")
        )

        # the scheduler tries it (Unschedulable: no 1g.10gb device) and leaves the node whole
        async def tried() -> bool | None:
            pod = await k.core.read_namespaced_pod("small", namespace)
            conds = {c.type: c for c in pod.status.conditions or []}
            cond = conds.get("PodScheduled")
            return True if cond is not None and cond.reason == "Unschedulable" else None

        await eventually(tried, "the small pod found unschedulable", within_s=30)
        assert await bound_node(k, "small") is None

        await k.delete_pods(["pair"])
        await k.custom.delete_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims", "pair"
        )
        assert await eventually(lambda: bound_node(k, "small"), "the small pod bound", within_s=60) == node
        claim = await k.custom.get_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims", "small"
        )
        assert "-1g10gb-" in (allocated_device(claim) or "")
        for g in gpus:  # the node offers every profile again
            part = await k.partition(g)
            assert set(A100_PROFILES) <= set(part["spec"]["offeredProfiles"]), part["spec"]
        await k.delete_policy(policy)
    await k.delete_pods(["small"])


async def test_a_control_plane_upgraded_in_place_to_1_37_2_switches_the_inventory_and_keeps_instances(
    tmp_path: Any, sim: ModuleType
) -> None:
    """A control plane upgraded in place from v1.36.3 to v1.37.2 (API server, then scheduler and controller
    manager, same etcd data) under a running agent: the agent picked Instances on 1.36 and keeps it through
    the upgrade (its watches reconnect; the choice changes only with the agents' rollout, so the scheduler
    never sees a mix); the rollout's restart picks Partitionable. The instance allocated on 1.36 stays (same
    device, still allocated, its pod still bound, never destroyed) and a new pod books a placement at once."""
    async with ControlPlane(work_dir=tmp_path / "cp", target=KubeTarget("v1.36.3")) as cp:
        node = "upgraded-node"
        _own_cluster(cp, node, "upg")
        sim.configure(gpus=["A100-80GB"], state_file=None)
        async with cp.api_client() as api:
            k = ScenarioApi(api, "upg")
            await k.ensure_device_class()
            gpu = f"{node}-gpu0"
            auto = dataclasses.replace(quick_agent_settings(node), inventory=None)
            async with agent_running(api, node, sim, auto) as agent:
                assert await eventually(lambda: _support(agent), "the 1.36 verdict") is Inventory.INSTANCES
                await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
                await k.set_layout(gpu, [("1g.10gb", 0)])
                await eventually(functools.partial(k.stable, gpu, "1g.10gb@0"), f"{gpu} cut")
                await _bound_1g_pod(k, "before", node)
                allocation = ((await _allocated(k, "before")) or {})["status"]["allocation"]
                assert allocation["devices"]["results"][0]["device"] == "gpu0-1g10gb-s0"
                (kept,) = _instances(sim)
                history_start = len(sim.history())

                await asyncio.to_thread(cp.upgrade, KubeTarget(PRIMARY))
                assert (await asyncio.to_thread(cp.rest().request, "GET", "/version"))[
                    "gitVersion"
                ] == PRIMARY
                # The running agent keeps its inventory and still answers: a second 1g.10gb is cut and booked.
                await k.set_layout(gpu, [("1g.10gb", 0), ("1g.10gb", 1)])  # an admin's (or policy's) re-cut
                await eventually(functools.partial(k.stable, gpu, "1g.10gb@0,1g.10gb@1"), f"{gpu} cut again")
                assert agent.support is not None and agent.support.inventory is Inventory.INSTANCES
                await _bound_1g_pod(k, "during", node)

            async with agent_running(api, node, sim, auto) as agent:  # the agents' rollout
                assert (
                    await eventually(lambda: _support(agent), "the 1.37 verdict") is Inventory.PARTITIONABLE
                )
                both = [("1g.10gb", 0), ("1g.10gb", 1)]
                await offered(k, gpu, both, A100_PROFILES)  # what a Dynamic policy writes
                part = await k.partition(gpu)
                assert part["status"]["inventory"] == Inventory.PARTITIONABLE.value
                rows = {i["deviceName"]: i for i in part["status"]["instances"]}
                assert rows["gpu0-1g10gb-s0"]["state"] == "allocated"
                assert rows["gpu0-1g10gb-s0"]["claims"] == ["upg/before"]
                assert rows["gpu0-1g10gb-s1"]["claims"] == ["upg/during"]
                await _create_claim(k, "after", {"firstAvailable": first_available(["3g.40gb"])})
                await k.core.create_namespaced_pod(
                    "upg", claim_pod("after", {"kubernetes.io/hostname": node}, claim="after")
                )
                assert (
                    await eventually(lambda: bound_node(k, "after"), "the new pod bound", within_s=60) == node
                )
                # Nothing moved under the pod that was bound before the upgrade.
                assert await bound_node(k, "before") == node
                assert ((await _allocated(k, "before")) or {})["status"]["allocation"] == allocation
                assert kept.mig_uuid in {i.mig_uuid for i in _instances(sim)}
                assert not [e for e in sim.history()[history_start:] if e.kind.startswith("destroy")]


async def test_a_booking_waiting_on_its_binding_is_answered_by_an_agent_switched_to_instances(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """The agent restarted with ``--inventory=instances`` (a Helm upgrade that sets it) while a pod waits in
    PreBind on a placement the partitionable agent published: the new agent answers that booking (cuts the
    instance, ready) and the pod binds, rather than waiting out the scheduler's binding timeout (10 min)."""
    k = ScenarioApi(kube_api, namespace)
    node = await one_gpu_node(k, sim, make_node, "switch")
    gpu = f"{node}-gpu0"
    async with agent_running(kube_api, node, sim, partitionable(node)):
        await offered(k, gpu, [], A100_PROFILES)
    # No agent now: its placements stay published; the scheduler books one and waits on its condition.
    await _create_claim(k, "w", {"firstAvailable": first_available(["1g.10gb"])})
    await k.core.create_namespaced_pod(k.ns, claim_pod("w", {"kubernetes.io/hostname": node}, claim="w"))

    async def booked() -> dict[str, Any] | None:
        claim = await _allocated(k, "w")
        return claim["status"]["allocation"]["devices"]["results"][0] if claim else None

    result = await eventually(booked, "the placement booked", within_s=60)
    assert result["bindingConditions"] == ["mig.dynamig.io/ready"], result
    assert await bound_node(k, "w") is None
    instances = dataclasses.replace(quick_agent_settings(node), inventory=Inventory.INSTANCES)
    async with agent_running(kube_api, node, sim, instances):
        assert await eventually(lambda: bound_node(k, "w"), "the pod bound", within_s=30) == node
        claim = await _allocated(k, "w")
        assert claim is not None
        (entry,) = claim["status"]["devices"]
        assert entry["device"] == result["device"]
        ready = {c["type"]: c["status"] for c in entry["conditions"]}
        assert ready == {"mig.dynamig.io/ready": "True"}, entry
        made = {i.mig_uuid for i in _instances(sim)}
        assert entry["data"]["migUUID"] in made, (entry, made)


async def test_uninstall_leaving_gpus_empty_destroys_the_free_instances_kept_for_bookings(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """In the partitionable inventory the agent keeps free instances beyond spec.layout for the next booking;
    uninstalling withdraws the offer, so with ``leave: empty`` they go too and the GPU is left bare."""
    k = ScenarioApi(kube_api, namespace)
    node = await one_gpu_node(k, sim, make_node, "leave")
    gpu = f"{node}-gpu0"
    async with agent_running(kube_api, node, sim, partitionable(node)) as agent:
        await offered(k, gpu, [], A100_PROFILES)
        await _bound_1g_pod(k, "w", node)
        await k.delete_pods(["w"])
        await k.resource.delete_namespaced_resource_claim("w", namespace)

        async def kept_free() -> list[Any] | None:
            part = await k.stable(gpu)
            held = any(i.get("claims") for i in ((part or {}).get("status") or {}).get("instances") or [])
            return None if held else _instances(sim) or None

        (kept,) = await eventually(kept_free, "the released 1g.10gb kept free for the next booking")
        assert kept.profile == "1g.10gb"
        report = await uninstall(
            kube_api, load_catalog(), leave="empty", namespace=None, operator_deployment=None,
            timeout_s=30, nodes=frozenset({node}), poll_s=0.2,
        )  # fmt: skip
        assert report.cleaned == [gpu] and report.complete, report
        assert _instances(sim) == [] and agent.uninstalled


async def test_a_retired_instances_slices_get_no_floor_instance_until_its_quarantine_ends(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """A floor 3g.40gb@0 over a free 1g.10gb@0: the agent retires the 1g (guarded), destroys it after the
    settle period, and then keeps its slices free for the quarantine, so that a pod a lagging scheduler bound
    to the 1g from an older slice would find them free; the GpuPartition says why the floor waits. Then the
    floor instance is created."""
    from dynamig.agent.nvml.device import NvmlDevices

    quarantine_s = 4.0
    k = ScenarioApi(kube_api, namespace)
    node = await one_gpu_node(k, sim, make_node, "quarantine")
    gpu = f"{node}-gpu0"
    devices = NvmlDevices(sim, load_catalog())
    devices.init()
    devices.create(devices.gpu(0), PlacedInstance(0, "1g.10gb"))  # free, before the agent starts
    devices.shutdown()
    settings = dataclasses.replace(partitionable(node), quarantine_seconds=quarantine_s)
    async with agent_running(kube_api, node, sim, settings):
        await offered(k, gpu, [("1g.10gb", 0)], A100_PROFILES)  # adopted as it is
        await offer(k, gpu, [("3g.40gb", 0)], A100_PROFILES)

        def at(placed: PlacedInstance) -> bool:
            return any(i.placed == placed for i in _instances(sim))

        async def small_gone() -> float | None:
            return time.monotonic() if not at(PlacedInstance(0, "1g.10gb")) else None

        gone_at = await eventually(small_gone, "the free 1g.10gb@0 retired and destroyed", every_s=0.05)
        assert not at(PlacedInstance(0, "3g.40gb"))

        async def says_kept_free() -> str | None:
            part = await k.custom.get_cluster_custom_object(GROUP, VERSION, GPU_PARTITION_PLURAL, gpu)
            ready = [c for c in part["status"].get("conditions") or [] if c["type"] == "Ready"]
            text = ready[0]["message"] if ready else ""
            return text if "kept free" in text else None

        message = await eventually(says_kept_free, f"{gpu} saying why its floor waits", within_s=quarantine_s)
        assert "waiting to create gpu0-3g40gb-s0" in message and "1g.10gb@0" in message

        async def floor_made() -> float | None:
            return time.monotonic() if at(PlacedInstance(0, "3g.40gb")) else None

        made_at = await eventually(floor_made, "the floor 3g.40gb@0 created", within_s=30, every_s=0.05)
        # The quarantine starts at the destroy, which is before this test saw the 1g gone.
        assert made_at - gone_at >= quarantine_s - 0.3, (made_at - gone_at, quarantine_s)
