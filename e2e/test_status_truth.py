"""Status that tells the truth, in the partitionable inventory, end to end.

Real: etcd, kube-apiserver, kube-scheduler (DRA allocation of the agent's partitionable devices, binding
held until the agent cuts and answers; SchedulerError for a selector it cannot evaluate),
kube-controller-manager; the operator as ``dynamig operator --standalone`` runs it and the node agent's whole
code path, both as tasks of the test's event loop. Simulated: one A100-80GB (simnvml) and the node (no
kubelet: pods are bound, never run).

Scenario:
1. A Dynamic policy cuts the floor (baseline 2 x 3g.40gb). A pod books a 1g.10gb over one floor instance: the
   agent destroys the free 3g.40gb and cuts the 1g.10gb, so that floor instance waits for the booking. That is
   the inventory working as meant: the GpuPartition stays Ready (reason FloorHeld) and says so in a Normal
   Event, with no Warning.
2. A pod of two claims of four 1g.10gb each: each would fit the node alone (six placements left), both do not.
   The scheduler keeps it Unschedulable and the operator says NoCapacity on both claims, never
   WaitingForScheduler.
3. A pod whose claim's selector the scheduler cannot evaluate (SchedulerError): the policy counts it by reason
   but not in ``pendingDemand.byProfile``, which holds only the eight devices the cluster could serve.
4. The booking ends: the agent cuts the floor back and Ready returns to LayoutApplied.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.demo.cluster import ScenarioApi, claim_pod, exactly, layout_text, resource_claim
from dynamig.demo.inprocess import agent_running, operator_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.waiting import event_posted, events_about
from dynamig.kube.gpupartition import Inventory

pytestmark = pytest.mark.controlplane

BASELINE = [("3g.40gb", 0), ("3g.40gb", 4)]
PROFILE = 'device.attributes["mig.dynamig.io"].profile'


def ready_of(part: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in (part.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})


async def test_expected_states_are_normal_and_verdicts_and_demand_tell_the_truth(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["A100-80GB"], state_file=None)
    pool = uuid.uuid4().hex[:8]
    node = make_node("truth", labels={"dynamig.io/managed": "true", "test-pool": pool})
    gpu = f"{node}-gpu0"
    policy = f"truth-{pool}"
    where = {"kubernetes.io/hostname": node}
    settings = dataclasses.replace(quick_agent_settings(node), inventory=Inventory.PARTITIONABLE)

    async with agent_running(kube_api, node, sim, settings), operator_running(crds.kubeconfig_path):
        try:
            await k.create_policy(
                policy,
                {
                    "nodeSelector": {"matchLabels": {"test-pool": pool}},
                    "mode": "Dynamic",
                    "baseline": {"A100-80GB": [{"profile": p, "start": s} for p, s in BASELINE]},
                    "batchWindowSeconds": 1,
                    "cooldownSeconds": 2,
                },
            )
            floor = layout_text(BASELINE)
            await eventually(functools.partial(k.stable, gpu, floor), f"{gpu} at {floor}", within_s=90)

            # ---- 1. a booking over a floor instance ------------------------------------------------
            small = resource_claim("small", exactly(f'{PROFILE} == "1g.10gb"'))
            await k.custom.create_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaims", small
            )
            await k.core.create_namespaced_pod(namespace, claim_pod("small", where, claim="small"))

            async def floor_held() -> dict[str, Any] | None:
                part = await k.partition(gpu)
                return part if ready_of(part).get("reason") == "FloorHeld" else None

            part = await eventually(
                floor_held, f"{gpu} Ready with its floor held by the booking", within_s=60
            )
            ready = ready_of(part)
            assert ready["status"] == "True" and part["status"]["phase"] == "Stable", ready
            assert "held by bookings" in ready["message"] and "allocated to" in ready["message"], ready
            # The agent posts the Event after writing the condition: waited for, then no Warning beside it.
            await event_posted(k.core, "default", gpu, "FloorHeld", event_type="Normal", within_s=30)
            warnings = [e for e in await events_about(k.core, "default", gpu) if e["type"] == "Warning"]
            assert warnings == [], warnings

            # What the policy counted before this test's waiting claims: in a session other tests' claims
            # without node constraints may be pending too; the figures below are this test's share.
            before = ((await k.policy(policy)).get("status") or {}).get("pendingDemand") or {}

            # ---- 2. a pod of two claims of four: each fits the node alone, both do not -------------
            for name in ("left", "right"):
                body = resource_claim(name, exactly(f'{PROFILE} == "1g.10gb"', count=4))
                await k.custom.create_namespaced_custom_object(
                    "resource.k8s.io", "v1", namespace, "resourceclaims", body
                )
            pair = claim_pod("pair", where, claim="left")
            pair["spec"]["resourceClaims"].append({"name": "right", "resourceClaimName": "right"})
            pair["spec"]["containers"][0]["resources"]["claims"].append({"name": "right"})
            await k.core.create_namespaced_pod(namespace, pair)

            # ---- 3. a claim the scheduler fails on ------------------------------------------------
            broken = resource_claim(
                "broken", exactly('device.attributes["mig.dynamig.io"].rackPosition == "a1"')
            )
            await k.custom.create_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaims", broken
            )
            await k.core.create_namespaced_pod(namespace, claim_pod("broken", where, claim="broken"))

            seen: list[dict[str, Any]] = [before]

            def added(key: str) -> dict[str, int]:
                now, then = seen[-1].get(key) or {}, before.get(key) or {}
                return {name: n - then.get(name, 0) for name, n in now.items() if n != then.get(name, 0)}

            async def scheduled_reason(pod: str) -> str | None:
                got = await k.core.read_namespaced_pod(pod, namespace)
                conds = [c for c in got.status.conditions or [] if c.type == "PodScheduled"]
                return str(conds[0].reason) if conds and conds[0].status == "False" else None

            async def demand() -> dict[str, Any] | None:
                st = (await k.policy(policy)).get("status") or {}
                seen.append(st.get("pendingDemand") or {})
                return seen[-1] if added("byReason").get("NoCapacity") == 2 else None

            try:
                pending = await eventually(demand, "the policy's pending demand by reason", within_s=60)
            except TimeoutError as exc:
                raise AssertionError(f"pendingDemand before {before}, last {seen[-1]}") from exc
            # The devices of the claim the scheduler fails on are no demand for any profile.
            assert added("byProfile") == {"1g.10gb": 8}, (before, pending)
            assert added("byReason").get("SchedulerError", 0) <= 1, (before, pending)
            broken_reason = await scheduled_reason("broken")
            print(f"\npod broken: PodScheduled=False {broken_reason}; pendingDemand {pending}")
            # The operator posts its verdicts apart from the policy's status: waited for, each claim's.
            for name in ("left", "right"):
                await event_posted(k.core, namespace, name, "NoCapacity", event_type="Warning", within_s=30)
                reasons = {e["reason"] for e in await events_about(k.core, namespace, name)}
                assert "WaitingForScheduler" not in reasons, reasons
            pod = await k.core.read_namespaced_pod("pair", namespace)
            scheduled = next(c for c in pod.status.conditions if c.type == "PodScheduled")
            assert (scheduled.status, scheduled.reason) == ("False", "Unschedulable")
            no_room = [
                e for e in await events_about(k.core, namespace, "left") if e["reason"] == "NoCapacity"
            ]
            assert "no eligible node has room for all of them" in no_room[0]["message"], no_room

            # ---- 4. the booking ends: the floor is cut back -----------------------------------------
            applied = await events_about(k.core, "default", gpu)
            applied_before = sum(e["count"] or 1 for e in applied if e["reason"] == "LayoutApplied")
            await k.delete_pods(["small", "pair", "broken"])
            for name in ("small", "left", "right", "broken"):
                await k.custom.delete_namespaced_custom_object(
                    "resource.k8s.io", "v1", namespace, "resourceclaims", name
                )

            async def floor_back() -> dict[str, Any] | None:
                part = await k.partition(gpu)
                ready = ready_of(part)
                held = {(i["profile"], i["start"]) for i in part["status"].get("instances") or []}
                ok = ready.get("reason") == "LayoutApplied" and set(BASELINE) <= held
                return part if ok else None

            await eventually(floor_back, f"{gpu} back at its floor", within_s=60)
            # The Event of the way back is posted after the condition: waited for, then no Warning beside it.
            await event_posted(
                k.core,
                "default",
                gpu,
                "LayoutApplied",
                event_type="Normal",
                beyond=applied_before,
                within_s=30,
            )
            warnings = [e for e in await events_about(k.core, "default", gpu) if e["type"] == "Warning"]
            assert warnings == [], warnings
        finally:
            await k.delete_pods(["small", "pair", "broken"])
            await k.delete_policy(policy)
