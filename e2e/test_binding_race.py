"""The binding race on a scheduler with a slow binding cycle: free instances booked while a layout change
wants them gone, in both inventories.

Real: kube-apiserver, kube-controller-manager and a kube-scheduler built from the same pinned module with one
extra Permit plugin (``hack/hold-scheduler/main.go``) that holds labelled pods for ``HOLD_S`` seconds after
their scheduling cycle allocated their claims in memory and before the DRA plugin's PreBind writes the
allocation, much longer than the agent's settle period (0.3 s). The node agent runs its own loop over the real
NVML code path; the GPU is simulated (one A100-80GB). Each round: seven free ``1g.10gb`` instances, seven pods
each booking one of them (held), then the GpuPartition's layout changes to one ``7g.80gb``, which needs every
one of those slices. The agent may destroy an instance only after it has republished it guarded and no pod is
in a binding cycle toward the node (agent/layout/lifecycle.py); the held pods carry
``status.nominatedNodeName`` from the start of their binding cycle. Counted: instances destroyed while
allocated, and pods bound to a device whose instance no longer exists. ``DYNAMIG_RACE_ROUNDS`` sets the rounds
(7 races each).

The check can fail: the same race with the agent blind to the pods in their binding cycle loses instances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from kubernetes_asyncio import client

from dynamig.agent.kube.api import KubeApi
from dynamig.backends.nvml import fresh_simulated_nvml
from dynamig.demo.cluster import ScenarioApi, allocated_device, claim_pod, exactly, resource_claim
from dynamig.demo.inprocess import agent_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually, find_binaries
from dynamig.devcluster.sandbox import install
from dynamig.geometry.model import device_name
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, MANAGED_NODE_LABEL, VERSION, gpu_partition_name

pytestmark = [pytest.mark.asyncio, pytest.mark.controlplane]

ROOT = Path(__file__).resolve().parents[1]
HOLD_S = 3.0
ROUNDS = int(os.environ.get("DYNAMIG_RACE_ROUNDS", "4"))
SMALL = [("1g.10gb", s) for s in range(7)]
BIG = [("7g.80gb", 0)]
DRIVER = "mig.dynamig.io"


@pytest.fixture(scope="module")
def hold_control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    built = subprocess.run(
        ["bash", str(ROOT / "hack" / "build-hold-scheduler.sh")],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    binaries = dataclasses.replace(find_binaries(), kube_scheduler=Path(built.stdout.strip()))
    profile = {
        "schedulerName": "default-scheduler",
        "plugins": {"permit": {"enabled": [{"name": "HoldForTest"}]}},
    }
    cp = ControlPlane(
        work_dir=tmp_path_factory.mktemp("hold-controlplane"),
        binaries=binaries,
        scheduler_config={"profiles": [profile]},
    )
    cp.start()
    try:
        install(cp)
        yield cp
    finally:
        cp.stop()


@pytest.fixture
async def hold_api(hold_control_plane: ControlPlane) -> AsyncIterator[client.ApiClient]:
    async with hold_control_plane.api_client() as api:
        yield api


@dataclasses.dataclass
class Tally:
    races: int = 0
    destroyed_while_allocated: int = 0
    bound_to_missing: int = 0


def live_devices(sim: ModuleType) -> set[str]:
    """The instances NVML holds now, replayed from the simulator's history (GPU instances)."""
    live: set[str] = set()
    for ev in sim.history():
        if ev.profile is None or ev.start is None:
            continue
        name = device_name(ev.gpu_index, ev.profile, ev.start)
        if ev.kind == "create-gi":
            live.add(name)
        elif ev.kind == "destroy-gi":
            live.discard(name)
    return live


async def set_layout(k: ScenarioApi, gpu: str, layout: list[tuple[str, int]]) -> None:
    await k.custom.patch_cluster_custom_object(
        GROUP, VERSION, GPU_PARTITION_PLURAL, gpu,
        {"spec": {"layout": [{"profile": p, "start": s} for p, s in layout], "offeredProfiles": []}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


async def has_layout(k: ScenarioApi, gpu: str, layout: list[tuple[str, int]]) -> bool | None:
    part = await k.stable(gpu)
    have = {(i["profile"], i["start"]) for i in ((part or {}).get("status") or {}).get("instances") or []}
    return True if have == set(layout) else None


async def race_rounds(
    cp: ControlPlane, api: client.ApiClient, inventory: Inventory, rounds: int, prefix: str
) -> Tally:
    ns = f"{prefix}-{inventory.value.lower()}"
    cp.kubectl("create", "namespace", ns)
    with contextlib.suppress(client.ApiException):  # pod admission needs it; the controller may be first
        await client.CoreV1Api(api).create_namespaced_service_account(ns, {"metadata": {"name": "default"}})
    k = ScenarioApi(api, ns)
    node = f"{ns}-node"
    await cp.aregister_node(node, labels={MANAGED_NODE_LABEL: "true"})
    sim = fresh_simulated_nvml()
    sim.configure(gpus=["A100-80GB"], state_file=None, seed=node)
    gpu = gpu_partition_name(node, 0)
    tally = Tally()
    settings = dataclasses.replace(quick_agent_settings(node), inventory=inventory)
    try:
        async with agent_running(api, node, sim, settings):
            await eventually(lambda: k.stable(gpu), f"GpuPartition {gpu}", within_s=60)
            for r in range(rounds):
                await set_layout(k, gpu, SMALL)
                await eventually(lambda: has_layout(k, gpu, SMALL), f"round {r}: seven 1g.10gb", within_s=60)
                pods = [f"r{r}-p{s}" for _, s in SMALL]
                for (profile, start), pod in zip(SMALL, pods, strict=True):
                    sel = (
                        f'device.attributes["{DRIVER}"].profile == "{profile}" && '
                        f'device.attributes["{DRIVER}"].placementStart == {start}'
                    )
                    await k.custom.create_namespaced_custom_object(
                        "resource.k8s.io", "v1", ns, "resourceclaims", resource_claim(pod, exactly(sel))
                    )
                    body = claim_pod(
                        pod, {"kubernetes.io/hostname": node}, claim=pod,
                        labels={"dynamig.io/test-hold-seconds": str(HOLD_S)},
                    )  # fmt: skip
                    await k.core.create_namespaced_pod(ns, body)

                # Every pod is in its binding cycle (held in Permit): its allocation exists only in the
                # scheduler's memory. Now the layout change that wants every one of those instances gone.
                nominated = functools.partial(_all_nominated, k, pods, node)
                await eventually(nominated, f"round {r}: pods in their binding cycle", within_s=30)
                before = len(sim.history())
                await set_layout(k, gpu, BIG)
                await eventually(
                    functools.partial(_all_bound, k, pods), f"round {r}: pods bound", within_s=HOLD_S + 60
                )
                live = live_devices(sim)
                for pod in pods:
                    claim = await k.custom.get_namespaced_custom_object(
                        "resource.k8s.io", "v1", ns, "resourceclaims", pod
                    )
                    dev = allocated_device(claim)
                    tally.races += 1
                    if dev is None or dev not in live:
                        tally.bound_to_missing += 1
                destroyed = [
                    ev for ev in sim.history()[before:] if ev.kind == "destroy-gi" and ev.profile == "1g.10gb"
                ]
                tally.destroyed_while_allocated += len(destroyed)
                for pod in pods:
                    with contextlib.suppress(client.ApiException):
                        await k.core.delete_namespaced_pod(pod, ns, grace_period_seconds=0)
                    with contextlib.suppress(client.ApiException):
                        await k.custom.delete_namespaced_custom_object(
                            "resource.k8s.io", "v1", ns, "resourceclaims", pod
                        )
                # Liveness: once the pods are gone the layout change goes through.
                await eventually(lambda: has_layout(k, gpu, BIG), f"round {r}: 7g.80gb", within_s=60)
    finally:
        sim.configure(gpus=[], state_file=None)
        with contextlib.suppress(Exception):
            await cp.adelete_node(node)
    return tally


async def _all_nominated(k: ScenarioApi, pods: list[str], node: str) -> bool | None:
    got = {
        p.metadata.name: p.status.nominated_node_name for p in (await k.core.list_namespaced_pod(k.ns)).items
    }
    return True if all(got.get(p) == node for p in pods) else None


async def _all_bound(k: ScenarioApi, pods: list[str]) -> bool | None:
    got = {p.metadata.name: p.spec.node_name for p in (await k.core.list_namespaced_pod(k.ns)).items}
    return True if all(got.get(p) for p in pods) else None


@pytest.mark.parametrize("inventory", [Inventory.PARTITIONABLE, Inventory.INSTANCES])
async def test_no_instance_is_destroyed_under_a_booking_held_in_its_binding_cycle(
    hold_control_plane: ControlPlane, hold_api: client.ApiClient, inventory: Inventory
) -> None:
    tally = await race_rounds(hold_control_plane, hold_api, inventory, ROUNDS, "race")
    print(f"\n  binding race, {inventory.value}: {tally}")
    assert tally.races == 7 * ROUNDS
    assert tally.destroyed_while_allocated == 0 and tally.bound_to_missing == 0, tally


async def test_an_agent_blind_to_pods_in_their_binding_cycle_loses_the_race(
    hold_control_plane: ControlPlane, hold_api: client.ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def nobody(self: KubeApi, node: str) -> list[str]:
        return []

    monkeypatch.setattr(KubeApi, "pods_binding_to", nobody)
    tally = await race_rounds(hold_control_plane, hold_api, Inventory.PARTITIONABLE, 1, "blind")
    print(f"\n  binding race, agent blind to pods in their binding cycle: {tally}")
    assert tally.bound_to_missing > 0 and tally.destroyed_while_allocated > 0, tally
