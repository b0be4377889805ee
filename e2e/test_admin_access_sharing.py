"""An ordinary claim and an ``adminAccess`` claim prepared on one MIG instance: unpreparing the monitor
leaves the instance held for the workload.

Real: etcd, kube-apiserver, kube-scheduler and kube-controller-manager (the scheduler allocates both claims
from the node's ResourceSlices, the admin-access one on the API server's ``DRAAdminAccess`` rules: only in
a namespace labelled ``resource.kubernetes.io/admin-access=true``; the claim controller deallocates a claim
whose pod is gone); the node agent's whole loop in the instances inventory; the kubelet DRA plugin's
gRPC servers on unix sockets, its claim reads, CDI writer and checkpoint, driven over the wire by the
kubelet stand-in of e2e/test_kubelet_plugin.py (``Kubelet``: NodePrepareResources /
NodeUnprepareResources, as the kubelet sends them). Simulated: the GPU (simnvml; its event history is the
ground truth for destroys), the NVIDIA driver files (``SimulatedDriverFiles``) and the node (pods bind,
never run).

The instances inventory, because only there can the scheduler hand out an allocated instance once more: in
the partitionable inventory every device consumes its GPU's counters, and the allocator checks counters for
an admin-access request too (``allocateDevice`` calls ``checkAvailableCounters`` whatever the request's
admin access), so an instance an ordinary claim holds is refused to the monitor ("cannot allocate all
claims"), seen with kube-scheduler v1.37.2.

The scenario: a free 1g.10gb ``Z`` (``spec.layout``). Claim ``c`` (ordinary) is allocated ``Z`` and
prepared; claim ``a`` (``adminAccess``, monitoring) is allocated the same ``Z`` and prepared. The layout then
changes to a 3g.40gb over ``Z``'s slice, so a free ``Z`` would be retired and destroyed. ``a``'s pod is
deleted and ``a`` unprepared; then ``c``'s pod is deleted too, the claim controller deallocates ``c``, and
the kubelet has not unprepared ``c`` yet (its containers still stopping): ``Z`` is held only by ``c``'s
prepare.

Asserted: ``Z`` stays prepared, once, for ``c`` (the agent's ``PreparedDevices`` count) and ``in-use`` in
the GpuPartition's status; the agent neither retires nor destroys it while ``c`` is prepared (nothing of
``Z`` in the simulator's history, the 3g.40gb not cut); nothing is destroyed while a claim allocates it;
and once ``c`` is unprepared ``Z`` is reported free and then retired for the new layout.

It can fail: with ``PreparedDevices`` counting a device once whatever the number of claims (a plain set),
unpreparing ``a`` makes ``Z`` look unprepared, and once ``c`` is deallocated the agent retires ``Z`` and
destroys it under the workload that still has it prepared.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.agent.bindings.stranded import StrandedPods
from dynamig.agent.controller import NodeAgent
from dynamig.agent.devices_service import AgentMigInstances
from dynamig.agent.nvml.simulated_driver import SimulatedDriverFiles, SimulatedDriverInstances
from dynamig.agent.plugin import PluginSettings, serve_plugin
from dynamig.agent.plugin.stubs import load_stubs
from dynamig.demo.cluster import AllocationWatch, ScenarioApi, claim_pod, exactly, resource_claim
from dynamig.demo.inprocess import agent_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.geometry.model import device_name
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.names import MANAGED_NODE_LABEL
from test_kubelet_plugin import Kubelet

pytestmark = pytest.mark.controlplane

DRIVER = "mig.dynamig.io"
ADMIN_LABEL = "resource.kubernetes.io/admin-access"
Z = ("1g.10gb", 6)
OVER_Z = ("3g.40gb", 4)  # the new layout's instance: memory slices 4-7, Z's slice among them
SETTLE_S = 3.0  # long enough to read Z's status as free before its retire may destroy it
HOLD_S = 15.0  # how long Z is watched while only c's prepare holds it: several settle periods and rounds


@dataclasses.dataclass
class Node:
    name: str
    agent: NodeAgent
    kubelet: Kubelet


@contextlib.asynccontextmanager
async def plugin_node(api: client.ApiClient, node: str, sim: ModuleType) -> AsyncIterator[Node]:
    """The agent's loop (instances inventory) for ``node`` and its kubelet plugin on unix sockets under a
    temporary root, with the simulated driver files the CDI specs name; all stopped and removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="dmaa", dir="/tmp"))  # AF_UNIX paths are limited to 107 bytes
    settings = dataclasses.replace(
        quick_agent_settings(node), inventory=Inventory.INSTANCES, settle_seconds=SETTLE_S
    )
    try:
        async with agent_running(api, node, sim, settings) as agent:
            plugin = PluginSettings(
                node_name=node,
                kubelet_root=root / "kubelet",
                cdi_root=root / "cdi",
                dev_root=root / "dev",
                proc_root=root / "proc",
            )
            files = SimulatedDriverFiles(
                agent.devices, proc_root=root / "proc", dev_root=root / "dev", base_spec=plugin.base_spec_path
            )
            files.sync()
            instances = SimulatedDriverInstances(AgentMigInstances(agent), files)
            stranded = StrandedPods(agent.api, node, after_s=3600.0)
            server = await serve_plugin(plugin, instances, api, stranded=stranded)
            try:
                yield Node(node, agent, Kubelet(plugin, load_stubs()))
            finally:
                await server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def exactly_z(admin: bool = False) -> dict[str, Any]:
    attr = f'device.attributes["{DRIVER}"]'
    request = exactly(f'{attr}.profile == "{Z[0]}" && {attr}.placementStart == {Z[1]}')
    if admin:
        request["exactly"]["adminAccess"] = True
    return request


async def claim_and_pod(k: ScenarioApi, name: str, node: str, request: dict[str, Any]) -> None:
    await k.custom.create_namespaced_custom_object(
        "resource.k8s.io", "v1", k.ns, "resourceclaims", resource_claim(name, request)
    )
    await k.core.create_namespaced_pod(k.ns, claim_pod(name, {"kubernetes.io/hostname": node}, claim=name))


async def read_claim(k: ScenarioApi, name: str) -> dict[str, Any]:
    got: dict[str, Any] = await k.custom.get_namespaced_custom_object(
        "resource.k8s.io", "v1", k.ns, "resourceclaims", name
    )
    return got


def results(claim: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = (
        ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
    ).get("results") or []
    return out


async def bound_with(k: ScenarioApi, name: str) -> tuple[str, list[dict[str, Any]]] | None:
    """(claim UID, allocation results) once ``name``'s claim is allocated and its pod bound."""
    pod = await k.core.read_namespaced_pod(name, k.ns)
    claim = await read_claim(k, name)
    if not pod.spec.node_name or not results(claim):
        return None
    return claim["metadata"]["uid"], results(claim)


async def bound_or_why(k: ScenarioApi, name: str) -> tuple[str, list[dict[str, Any]]]:
    """:func:`bound_with` within 60 s; on a timeout, what the pod and its claim say."""
    try:
        return await eventually(functools.partial(bound_with, k, name), f"{name} bound", within_s=60)
    except TimeoutError as exc:
        pod = await k.core.read_namespaced_pod(name, k.ns)
        conditions = [(c.type, c.status, c.reason, c.message) for c in pod.status.conditions or []]
        claim = await read_claim(k, name)
        raise AssertionError(
            f"{exc}: pod conditions {conditions}; claim status {claim.get('status')}"
        ) from exc


async def deallocated(k: ScenarioApi, name: str) -> bool | None:
    return True if not results(await read_claim(k, name)) else None


async def instance_states(k: ScenarioApi, gpu: str) -> dict[tuple[str, int], str]:
    """(profile, start) -> state of each instance in the GpuPartition's status."""
    part = await k.partition(gpu)
    return {
        (i["profile"], i["start"]): i.get("state", "")
        for i in (part.get("status") or {}).get("instances") or []
    }


def touched(history: list[Any], profile: str, start: int, t0: float) -> list[str]:
    """The simulator's destroys of the instance at (``profile``, ``start``), seconds after ``t0``."""
    return [
        f"{e.kind} {e.timestamp - t0:.1f}s after c was deallocated"
        for e in history
        if e.kind in ("destroy-gi", "destroy-ci") and e.profile == profile and e.start == start
    ]


async def test_unpreparing_an_admin_access_claim_leaves_the_instance_held_for_the_ordinary_claim(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Callable[..., str],
    namespace: str,
    sim: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    await k.core.patch_namespace(namespace, {"metadata": {"labels": {ADMIN_LABEL: "true"}}})
    sim.configure(gpus=["A100-80GB"], state_file=None)
    node = make_node("adminshare", labels={MANAGED_NODE_LABEL: "true"})
    gpu = f"{node}-gpu0"
    z = device_name(0, *Z)
    watch = AllocationWatch(k)
    async with plugin_node(kube_api, node, sim) as n:
        agent, kubelet = n.agent, n.kubelet
        await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
        await k.set_layout(gpu, [Z])

        async def z_free() -> bool | None:
            return True if (await instance_states(k, gpu)).get(Z) == "free" else None

        await eventually(z_free, f"{z} cut and free", within_s=60)
        since = len(sim.history())
        watch.start()
        try:
            # The workload: c allocated Z and prepared over the wire.
            await claim_and_pod(k, "c", node, exactly_z())
            c_uid, c_results = await bound_or_why(k, "c")
            assert [(r["device"], bool(r.get("adminAccess"))) for r in c_results] == [(z, False)], c_results
            c_ref = (namespace, "c", c_uid)
            c_answer = (await kubelet.prepare(c_ref))[c_uid]
            assert c_answer.error == "", c_answer.error
            assert [d.device_name for d in c_answer.devices] == [z]
            assert agent.prepared.claims(z) == 1

            # The monitor: a allocated the same Z with admin access, prepared.
            await claim_and_pod(k, "a", node, exactly_z(admin=True))
            a_uid, a_results = await bound_or_why(k, "a")
            assert [(r["device"], bool(r.get("adminAccess"))) for r in a_results] == [(z, True)], a_results
            a_ref = (namespace, "a", a_uid)
            a_answer = (await kubelet.prepare(a_ref))[a_uid]
            assert a_answer.error == "", a_answer.error
            assert [d.device_name for d in a_answer.devices] == [z]
            after_both = agent.prepared.claims(z)
            z_uuid = (await AgentMigInstances(agent).lookup(z) or pytest.fail(f"{z} gone")).mig_uuid

            # The layout now wants Z's slice: a free Z would be retired and destroyed.
            await k.set_layout(gpu, [OVER_Z])

            # The monitor goes: its pod deleted, its claim deallocated, unprepared.
            await k.core.delete_namespaced_pod("a", namespace, grace_period_seconds=0)
            await eventually(functools.partial(deallocated, k, "a"), "a deallocated", within_s=60)
            assert await kubelet.unprepare(a_ref) == {a_uid: ""}
            after_monitor = agent.prepared.claims(z)

            # The workload's pod is deleted and its claim deallocated; the kubelet has not unprepared c yet.
            await k.core.delete_namespaced_pod("c", namespace, grace_period_seconds=0)
            await eventually(functools.partial(deallocated, k, "c"), "c deallocated", within_s=60)
            t_held = time.time()
            await asyncio.sleep(HOLD_S)
            held_states = await instance_states(k, gpu)
            held_count = agent.prepared.claims(z)
            held_instance = await AgentMigInstances(agent).lookup(z)
            destroyed_while_held = touched(sim.history()[since:], *Z, t_held)

            # The workload lets go: unprepared, Z is free again and the floor may take its slice.
            assert await kubelet.unprepare(c_ref) == {c_uid: ""}
            t_free = time.time()
            after_workload = agent.prepared.claims(z)
            free_states = await instance_states(k, gpu)

            async def retired() -> bool | None:
                return True if (await instance_states(k, gpu)).get(OVER_Z) else None

            await eventually(retired, f"{OVER_Z} cut once {z} is free", within_s=60)
            t_retired = time.time()
            lost = watch.destroyed_while_allocated(sim.history()[since:])
        finally:
            await watch.stop()

    assert not destroyed_while_held, (
        f"{z} destroyed while claim c still had it prepared (counted {after_monitor} prepared claim(s) "
        f"after a was unprepared): {destroyed_while_held}"
    )
    assert after_both == 2, f"with c and a prepared, {z} counted {after_both} prepared claim(s)"
    assert held_instance is not None and held_instance.mig_uuid == z_uuid, (held_instance, z_uuid)
    assert after_monitor == 1, f"after a was unprepared {z} counted {after_monitor} prepared claim(s)"
    assert held_count == 1, f"{z} counted {held_count} prepared claim(s) while c held it"
    assert held_states.get(Z) == "in-use" and OVER_Z not in held_states, held_states
    assert lost == [], lost
    assert after_workload == 0 and free_states.get(Z) == "free", (after_workload, free_states)
    print(
        f"\n  {z} held {HOLD_S:.0f}s by c's prepare alone (a unprepared, c deallocated): "
        f"states {held_states}; "
        f"after c was unprepared {free_states}; {OVER_Z} cut {t_retired - t_free:.1f}s later"
    )
