"""Making room, end to end: a policy with ``spec.preemption.mode: DryRun`` tells a waiting high-priority pod
which lower-priority pods it would evict, and evicts none; with ``Evict`` it holds the placement, evicts them
and the waiting pod gets it; with ``spec.drain`` a claim starving at equal priority gets a GPU drained for it
and nobody is evicted (each test's docstring says how, in both inventories).

Real: etcd, kube-apiserver, kube-scheduler (the only allocator, and the one whose own preemption cannot free a
DRA device), kube-controller-manager (claims from templates, and PodDisruptionBudget status computed by its
disruption controller), the Priority admission plugin (``spec.priority`` and ``spec.preemptionPolicy`` from
PriorityClasses); the operator exactly as ``dynamig operator --standalone`` runs it and the node agent's whole
code path, both as tasks of the test's event loop.
Simulated: one A100-80GB (``dynamig.backends.simnvml``) and the node (a Node object without kubelet: pods are
bound, never run, so they never start and no PodDisruptionBudget counts them healthy).

DryRun scenario:
1. The GPU is cut into seven 1g.10gb; seven pods at priority 0 (a PriorityClass) take them all.
2. A pod at priority 1000 asks for a 3g.40gb: no re-cut serves it without evicting. The pod is told
   ``WouldPreempt`` naming the three pods under slices 4-7 (fewer than the four under slices 0-3), the
   policy's ``Preemption`` condition and metrics count it, and every low pod stays bound to its instance.
3. A PodDisruptionBudget covering the low pods, whose ``disruptionsAllowed`` 0 the disruption controller
   computes: the pod is told ``NoPreemptionVictims`` with the budget's reason.
4. A pod at priority 1000 with ``preemptionPolicy: Never``: ``NoPreemptionVictims``, never ``WouldPreempt``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import uuid
from collections.abc import Awaitable, Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.demo.cluster import ScenarioApi, allocated_device, claim_pod, layout_text
from dynamig.demo.inprocess import agent_running, operator_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.waiting import event_posted, events_about
from dynamig.kube.gpupartition import Inventory
from dynamig.operator.metrics import OperatorMetrics

pytestmark = pytest.mark.controlplane

SEVEN = [("1g.10gb", s) for s in range(7)]


@pytest.fixture
def sim_nvml() -> Iterator[ModuleType]:
    from dynamig.backends.nvml import load_nvml

    module: ModuleType = load_nvml("simulated")
    module.configure(gpus=["A100-80GB"], state_file=None)
    yield module
    module.configure(gpus=[], state_file=None)


async def test_dry_run_reports_victims_and_evicts_nothing(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim_nvml: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    budgets = client.PolicyV1Api(kube_api)
    pool = uuid.uuid4().hex[:8]
    node = make_node("preempt", labels={"dynamig.io/managed": "true", "test-pool": pool})
    gpu0 = f"{node}-gpu0"
    policy = f"preempt-{pool}"
    classes: dict[str, dict[str, Any]] = {
        "low": {"value": 0},
        "high": {"value": 1000},
        "never": {"value": 1000, "preemptionPolicy": "Never"},
    }
    await k.priority_classes({f"{name}-{pool}": fields for name, fields in classes.items()})
    await k.claim_template("small", ["1g.10gb"])
    await k.claim_template("big", ["3g.40gb"])
    metrics = OperatorMetrics()

    async def create_pod(name: str, template: str, priority_class: str, app: str) -> None:
        body = claim_pod(name, {"test-pool": pool}, template=template, labels={"app": app})
        body["spec"]["priorityClassName"] = f"{priority_class}-{pool}"
        await k.core.create_namespaced_pod(namespace, body)

    low = [f"low-{i}" for i in range(7)]

    async def still_bound(devices: dict[str, str], uids: dict[str, str]) -> None:
        """Nothing evicted: every low pod is the same pod, bound, not being deleted, on its instance."""
        for name in low:
            p = await k.core.read_namespaced_pod(name, namespace)
            assert p.metadata.uid == uids[name] and p.metadata.deletion_timestamp is None, name
            assert p.spec.node_name == node, name
            assert allocated_device(await k.claim_of(name)) == devices[name], name

    try:
        async with agent_running(kube_api, node, sim_nvml):
            await eventually(lambda: k.stable(gpu0), "the agent's GpuPartition", within_s=60)
            await k.set_layout(gpu0, SEVEN)
            await eventually(functools.partial(k.stable, gpu0, layout_text(SEVEN)), "gpu0 at 7 x 1g.10gb")

            # ---- 1. seven pods at priority 0 fill the GPU -------------------------------------------------
            for name in low:
                await create_pod(name, "small", "low", "low")

            async def all_allocated() -> dict[str, str] | None:
                devices = {p: allocated_device(await k.claim_of(p)) for p in low}
                return {p: d for p, d in devices.items() if d} if all(devices.values()) else None

            devices = await eventually(all_allocated, "the seven low pods' claims allocated", within_s=90)
            assert len(set(devices.values())) == 7
            uids = {p: (await k.core.read_namespaced_pod(p, namespace)).metadata.uid for p in low}
            for p in low:
                assert (await k.core.read_namespaced_pod(p, namespace)).spec.priority == 0
            # 3g.40gb at slice 4 covers memory slices 4-7: the 1g.10gb at 4, 5 and 6.
            expected = sorted(f"{namespace}/{p}" for p, d in devices.items() if d.split("-s")[-1] in "456")
            assert len(expected) == 3, devices

            async with operator_running(crds.kubeconfig_path, metrics):
                await k.create_policy(
                    policy,
                    _policy_spec(pool, {"mode": "DryRun"}),
                )

                async def governs() -> bool | None:
                    st = (await k.policy(policy)).get("status") or {}
                    return True if st.get("matchedGpus") == 1 else None

                await eventually(governs, "the policy to govern the GPU", within_s=30)

                # ---- 2. priority 1000 asks for 3g.40gb: told whom it would evict; nobody is evicted --------
                await create_pod("big", "big", "high", "big")
                assert (await k.core.read_namespaced_pod("big", namespace)).spec.priority == 1000
                await event_posted(
                    k.core,
                    namespace,
                    "big",
                    "WouldPreempt",
                    event_type="Normal",
                    saying=[
                        f"would evict {', '.join(expected)} (priority 0 < 1000) on {node}/gpu0",
                        "to cut 3g.40gb at slice 4",
                        "nothing is evicted",
                    ],
                    within_s=60,
                )

                async def condition() -> dict[str, Any] | None:
                    conds = ((await k.policy(policy)).get("status") or {}).get("conditions") or []
                    c = next((c for c in conds if c["type"] == "Preemption"), None)
                    ok = c is not None and "1 waiting claim(s) would have 3 pod(s) evicted" in c["message"]
                    return c if ok else None

                cond = await eventually(condition, "the policy's Preemption condition", within_s=30)
                assert (cond["status"], cond["reason"]) == ("True", "DryRun")

                def sample(name: str, **labels: str) -> float | None:
                    return metrics.registry.get_sample_value(name, {"policy": policy, **labels})

                async def counted() -> bool | None:
                    victims = sample("dynamig_operator_preemption_dryrun_victims")
                    would = sample("dynamig_operator_preemption_dryrun_preemptors", result="would-preempt")
                    return True if (victims, would) == (3, 1) else None

                await eventually(counted, "the DryRun metrics", within_s=30)
                await asyncio.sleep(4)  # rounds go on: a wrongly acting operator would evict now
                await still_bound(devices, uids)
                assert allocated_device(await k.claim_of("big")) is None
                told = [
                    e for e in await events_about(k.core, namespace, "big") if e["reason"] == "WouldPreempt"
                ]
                assert len(told) == 1, told  # once per change, not once per round

                # ---- 3. a PodDisruptionBudget allowing no disruption protects them ----------------------
                await budgets.create_namespaced_pod_disruption_budget(
                    namespace,
                    {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                     "metadata": {"name": "keep-low"},
                     "spec": {"minAvailable": 7, "selector": {"matchLabels": {"app": "low"}}}},
                )  # fmt: skip

                async def computed() -> bool | None:
                    pdb = await budgets.read_namespaced_pod_disruption_budget("keep-low", namespace)
                    seen = (
                        pdb.status is not None and pdb.status.observed_generation == pdb.metadata.generation
                    )
                    return True if seen and pdb.status.expected_pods == 7 else None

                await eventually(computed, "the disruption controller's status of keep-low", within_s=60)
                pdb = await budgets.read_namespaced_pod_disruption_budget("keep-low", namespace)
                assert pdb.status.disruptions_allowed == 0
                await event_posted(
                    k.core,
                    namespace,
                    "big",
                    "NoPreemptionVictims",
                    event_type="Normal",
                    saying=["PodDisruptionBudget keep-low allows no disruption (disruptionsAllowed 0)"],
                    within_s=60,
                )
                await still_bound(devices, uids)
                await budgets.delete_namespaced_pod_disruption_budget("keep-low", namespace)
                await k.delete_pods(["big"])

                # ---- 4. preemptionPolicy Never evicts nothing ------------------------------------------
                await create_pod("never", "big", "never", "never")
                assert (
                    await k.core.read_namespaced_pod("never", namespace)
                ).spec.preemption_policy == "Never"
                await event_posted(
                    k.core,
                    namespace,
                    "never",
                    "NoPreemptionVictims",
                    saying=["its preemptionPolicy is Never"],
                    within_s=60,
                )
                await asyncio.sleep(3)
                reasons = {e["reason"] for e in await events_about(k.core, namespace, "never")}
                assert "WouldPreempt" not in reasons, reasons
                await still_bound(devices, uids)
    finally:
        await k.delete_pods([*low, "big", "never"])
        with contextlib.suppress(ApiException):
            await k.delete_policy(policy)
        await k.delete_priority_classes(f"{name}-{pool}" for name in classes)


@pytest.mark.parametrize("inventory", [Inventory.INSTANCES, Inventory.PARTITIONABLE], ids=str.lower)
async def test_evict_holds_the_placement_and_serves_the_waiting_pod(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim_nvml: ModuleType,
    inventory: Inventory,
) -> None:
    """``mode: Evict``: the placement is held on the GpuPartition (spec.holds, then status.holds once the
    agent enforces it), the three pods under slices 4-7 are evicted through the Eviction API (and only
    they), a pending pod of the victims' priority does not get their freed slices, and the waiting pod is
    allocated the 3g.40gb it waited for; then the hold is released. The test plays the kubelet: it finishes
    the evicted pods' deletion, as a kubelet does once their containers exit."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    pool = uuid.uuid4().hex[:8]
    node = make_node("evict", labels={"dynamig.io/managed": "true", "test-pool": pool})
    gpu0 = f"{node}-gpu0"
    policy = f"evict-{pool}"
    await k.priority_classes({f"low-{pool}": {"value": 0}, f"high-{pool}": {"value": 1000}})
    await k.claim_template("small", ["1g.10gb"])
    await k.claim_template("big", ["3g.40gb"])
    metrics = OperatorMetrics()

    async def create_pod(name: str, template: str, priority_class: str) -> None:
        body = claim_pod(name, {"test-pool": pool}, template=template, labels={"app": priority_class})
        body["spec"]["priorityClassName"] = f"{priority_class}-{pool}"
        await k.core.create_namespaced_pod(namespace, body)

    low = [f"low-{i}" for i in range(7)]
    settings = dataclasses.replace(quick_agent_settings(node), inventory=inventory)
    try:
        async with agent_running(kube_api, node, sim_nvml, settings):
            devices = await _seven_allocated(k, gpu0, low, lambda name: create_pod(name, "small", "low"))
            victims = sorted(p for p, d in devices.items() if d.split("-s")[-1] in "456")
            kept = sorted(set(low) - set(victims))
            assert len(victims) == 3, devices
            uids = {p: (await k.core.read_namespaced_pod(p, namespace)).metadata.uid for p in low}

            async with operator_running(crds.kubeconfig_path, metrics):
                await k.create_policy(
                    policy,
                    _policy_spec(pool, {"mode": "Evict", "gpuCooldownSeconds": 0}),
                )
                # A pod of the victims' priority waits too: it evicts nobody and must not get their slices.
                await create_pod("low-late", "small", "low")
                await eventually(lambda: k.unschedulable("low-late"), "low-late unschedulable", within_s=60)
                await create_pod("big", "big", "high")

                async def held() -> dict[str, Any] | None:
                    part = await k.partition(gpu0)
                    enforced = (part.get("status") or {}).get("holds") or []
                    return part if enforced else None

                part = await eventually(held, "the hold enforced by the agent (status.holds)", within_s=60)
                (hold,) = part["spec"]["holds"]
                big_claim = await k.claim_of("big")
                assert big_claim is not None
                assert hold["claim"] == f"{namespace}/{big_claim['metadata']['name']}"
                assert (hold["profile"], hold["start"], hold["priority"]) == ("3g.40gb", 4, 1000)
                assert sorted(v.split("@")[0] for v in hold["victims"]) == [
                    f"{namespace}/{p}" for p in victims
                ]
                await event_posted(
                    k.core, namespace, "big", "Preempting", saying=["evicts", "to cut 3g.40gb at slice 4"]
                )

                async def evicted() -> bool | None:
                    for p in victims:
                        pod = await k.core.read_namespaced_pod(p, namespace)
                        if pod.metadata.deletion_timestamp is None:
                            return None
                    return True

                await eventually(evicted, "the three victims evicted (being deleted)", within_s=60)
                for p in victims:
                    await event_posted(
                        k.core, namespace, p, "Preempted", event_type="Warning",
                        saying=["to make room for claim", "priority 1000 > 0"],
                    )  # fmt: skip
                    victim_claim = await k.claim_of(p)  # told where the claim's owner reads it, too
                    assert victim_claim is not None, p
                    await event_posted(
                        k.core, namespace, victim_claim["metadata"]["name"], "Preempted",
                        event_type="Warning", saying=["to make room for claim"],
                    )  # fmt: skip
                # The kubelet's part: the containers exited, the pods go.
                await k.delete_pods(victims)

                async def served() -> str | None:
                    return allocated_device(await k.claim_of("big"))

                device = await eventually(served, "the waiting pod's claim allocated", within_s=60)
                assert device == "gpu0-3g40gb-s4", device

                async def bound() -> bool | None:
                    pod = await k.core.read_namespaced_pod("big", namespace)
                    return True if pod.spec.node_name == node else None

                await eventually(bound, "the waiting pod bound", within_s=60)

                async def released() -> bool | None:
                    part = await k.partition(gpu0)
                    gone = not (part["spec"].get("holds") or (part.get("status") or {}).get("holds"))
                    return True if gone else None

                await eventually(released, "the hold released once the claim is allocated", within_s=60)
                await event_posted(
                    k.core, namespace, big_claim["metadata"]["name"], "PreemptionHoldReleased",
                    saying=["is allocated"],
                )  # fmt: skip
                # Nobody else was evicted, and the late low pod got none of the held slices.
                for p in kept:
                    pod = await k.core.read_namespaced_pod(p, namespace)
                    assert pod.metadata.uid == uids[p] and pod.metadata.deletion_timestamp is None, p
                    assert allocated_device(await k.claim_of(p)) == devices[p], p
                late = allocated_device(await k.claim_of("low-late"))
                assert late is None or late.split("-s")[-1] not in "4567", late
                sample = metrics.registry.get_sample_value
                labels = {"policy": policy}
                assert sample("dynamig_operator_evictions_total", {**labels, "result": "evicted"}) == 3
                assert sample("dynamig_operator_evictions_total", {**labels, "result": "refused"}) == 0
                assert (
                    sample("dynamig_operator_preemption_holds_released_total", {**labels, "why": "served"})
                    == 1
                )
                (entry,) = (await k.policy(policy))["status"]["recentEvictions"]
                assert (entry["gpu"], sorted(entry["owners"])) == (
                    gpu0,
                    [f"Pod {namespace}/{p}" for p in victims],
                ), entry
            # A new operator process (a restart, a new leader) reads the ledger back from the policy's status:
            # its own rounds still count the three evictions of this hour (the rate limit and the sparing
            # of repeat victims go on from there), and keep the entry stored.
            again = OperatorMetrics()
            async with operator_running(crds.kubeconfig_path, again):

                async def rounds_done() -> bool | None:
                    done = again.registry.get_sample_value(
                        "dynamig_operator_plan_duration_seconds_count", {"policy": policy}
                    )
                    return True if (done or 0) >= 3 else None

                await eventually(rounds_done, "three rounds of the new operator", within_s=60)
                status = (await k.policy(policy))["status"]
                (cond,) = [c for c in status["conditions"] if c["type"] == "Preemption"]
                assert "3 pod(s) evicted in the last hour" in cond["message"], cond
                assert status["recentEvictions"] == [entry]
    finally:
        await k.delete_pods([*low, "low-late", "big"])
        with contextlib.suppress(ApiException):
            await k.delete_policy(policy)
        await k.delete_priority_classes([f"low-{pool}", f"high-{pool}"])


@pytest.mark.parametrize("inventory", [Inventory.INSTANCES, Inventory.PARTITIONABLE], ids=str.lower)
async def test_drain_keeps_the_placement_for_a_claim_starving_at_equal_priority(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim_nvml: ModuleType,
    inventory: Inventory,
) -> None:
    """``spec.drain``: every pod at one priority, so nothing may be evicted. The 3g.40gb claim gets gpu0
    drained for it at slice 4 (three 1g.10gb in the way, not four): a hold of kind Drain, no victims. A
    1g.10gb pod arriving later does not get the slice freed when one of those three pods ends; once the
    other two end, the 3g.40gb is cut and allocated to the waiting claim, the hold is released, and nobody
    was evicted. The test plays the kubelet: it deletes the pods that finish."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    pool = uuid.uuid4().hex[:8]
    node = make_node("drain", labels={"dynamig.io/managed": "true", "test-pool": pool})
    gpu0 = f"{node}-gpu0"
    policy = f"drain-{pool}"
    await k.claim_template("small", ["1g.10gb"])
    await k.claim_template("big", ["3g.40gb"])
    metrics = OperatorMetrics()

    async def create_pod(name: str, template: str) -> None:
        await k.core.create_namespaced_pod(namespace, claim_pod(name, {"test-pool": pool}, template=template))

    low = [f"low-{i}" for i in range(7)]
    settings = dataclasses.replace(quick_agent_settings(node), inventory=inventory)
    try:
        async with agent_running(kube_api, node, sim_nvml, settings):
            devices = await _seven_allocated(k, gpu0, low, lambda name: create_pod(name, "small"))
            in_the_way = sorted(p for p, d in devices.items() if d.split("-s")[-1] in "456")
            kept = sorted(set(low) - set(in_the_way))
            uids = {p: (await k.core.read_namespaced_pod(p, namespace)).metadata.uid for p in low}

            async with operator_running(crds.kubeconfig_path, metrics):
                spec = {**_policy_spec(pool, {"mode": "Evict"}), "drain": {"afterSeconds": 0}}
                await k.create_policy(policy, spec)
                await create_pod("big", "big")

                async def held() -> dict[str, Any] | None:
                    part = await k.partition(gpu0)
                    return part if (part.get("status") or {}).get("holds") else None

                part = await eventually(held, "the drain enforced by the agent (status.holds)", within_s=60)
                (hold,) = part["spec"]["holds"]
                big_claim = await k.claim_of("big")
                assert big_claim is not None
                assert hold["claim"] == f"{namespace}/{big_claim['metadata']['name']}"
                assert (hold["kind"], hold["profile"], hold["start"]) == ("Drain", "3g.40gb", 4)
                assert hold.get("victims", []) == [], hold
                await event_posted(
                    k.core, namespace, "big", "Draining", saying=["no GPU can cut now", "nobody is evicted"]
                )
                # A 1g.10gb pod arrives; one of the three in the way ends: its slice stays with the hold.
                await create_pod("late", "small")
                await eventually(lambda: k.unschedulable("late"), "late unschedulable", within_s=60)
                await k.delete_pods(in_the_way[:1])
                await asyncio.sleep(5)
                late = allocated_device(await k.claim_of("late"))
                assert late is None, late
                await k.delete_pods(in_the_way[1:])

                async def served() -> str | None:
                    return allocated_device(await k.claim_of("big"))

                device = await eventually(served, "the starving claim allocated", within_s=60)
                assert device == "gpu0-3g40gb-s4", device

                async def released() -> list[dict[str, Any]] | None:
                    part = await k.partition(gpu0)
                    holds = [*(part["spec"].get("holds") or []), *(part["status"].get("holds") or [])]
                    return None if any(h["claim"] == hold["claim"] for h in holds) else holds

                after = await eventually(released, "the drain released once the claim is served", within_s=60)
                # The 1g.10gb pod starves now (afterSeconds 0): the next drain, if any, is its own.
                assert all(h["claim"] != hold["claim"] and h["profile"] == "1g.10gb" for h in after), after
                # Nobody was evicted: the four pods outside the placement kept their instances throughout.
                for p in kept:
                    pod = await k.core.read_namespaced_pod(p, namespace)
                    assert pod.metadata.uid == uids[p] and pod.metadata.deletion_timestamp is None, p
                    assert allocated_device(await k.claim_of(p)) == devices[p], p
                sample = metrics.registry.get_sample_value
                labels = {"policy": policy}
                # One drain for the 3g.40gb claim, and one for the 1g.10gb pod if its round has come.
                assert sample("dynamig_operator_drains_total", labels) in (1, 2)
                assert not sample("dynamig_operator_evictions_total", {**labels, "result": "evicted"})
                released_total = "dynamig_operator_preemption_holds_released_total"
                assert sample(released_total, {**labels, "why": "served"}) == 1
    finally:
        await k.delete_pods([*low, "late", "big"])
        with contextlib.suppress(ApiException):
            await k.delete_policy(policy)


def _policy_spec(pool: str, preemption: dict[str, Any]) -> dict[str, Any]:
    """A policy governing the pool's A100s with 1g.10gb and 3g.40gb, re-cutting at once."""
    return {
        "nodeSelector": {"matchLabels": {"test-pool": pool}},
        "gpuProducts": ["A100-80GB"],
        "mode": "Dynamic",
        "allowedProfiles": ["1g.10gb", "3g.40gb"],
        "batchWindowSeconds": 1,
        "cooldownSeconds": 0,
        # The pods never start here (no kubelet): each counts as started now.
        "preemption": {"minRunSeconds": 0, **preemption},
    }


async def _seven_allocated(
    k: ScenarioApi, gpu0: str, pods: list[str], create: Callable[[str], Awaitable[None]]
) -> dict[str, str]:
    """``gpu0`` cut into seven 1g.10gb and one of ``pods`` (made by ``create``) allocated each: device by
    pod."""
    await eventually(lambda: k.stable(gpu0), "the agent's GpuPartition", within_s=60)
    await k.set_layout(gpu0, SEVEN)
    await eventually(lambda: _instances(k, gpu0, len(SEVEN)), "gpu0 at 7 x 1g.10gb", within_s=60)
    for name in pods:
        await create(name)

    async def all_allocated() -> dict[str, str] | None:
        devices = {p: allocated_device(await k.claim_of(p)) for p in pods}
        return {p: d for p, d in devices.items() if d} if all(devices.values()) else None

    return await eventually(all_allocated, "the seven pods' claims allocated", within_s=90)


async def _instances(k: ScenarioApi, gpu: str, count: int) -> bool | None:
    """True once the agent reports ``count`` instances on ``gpu``."""
    st = (await k.partition(gpu)).get("status") or {}
    return True if len(st.get("instances") or []) == count else None
