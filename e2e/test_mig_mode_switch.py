"""MIG mode switched on request (GpuPartition ``spec.migMode``) on the real scheduler, never under a workload.

Real: etcd, kube-apiserver, kube-scheduler (DRA allocation, binding conditions), kube-controller-manager,
the node agent's whole loop over the NVML code path. Simulated: the GPUs (simnvml: MIG mode switches as
nvml.h documents them, ``dynamig.backends.simmode``; its history is the ground truth for what NVML was asked)
and the node (no kubelet: pods bind, never run). ``spec.migMode`` is written here as the operator writes it
under a ``Dynamic`` MIG-mode policy.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.demo.cluster import ScenarioApi
from dynamig.demo.inprocess import agent_running, mig_modes, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION

pytestmark = pytest.mark.controlplane


async def _spec(k: ScenarioApi, gpu: str, spec: dict[str, Any]) -> None:
    await k.custom.patch_cluster_custom_object(
        GROUP, VERSION, GPU_PARTITION_PLURAL, gpu, {"spec": spec},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


def _condition(part: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (part.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


async def _mig_mode(k: ScenarioApi, gpu: str, reason: str) -> dict[str, Any] | None:
    part = await k.partition(gpu)
    return part if _condition(part, "MigMode").get("reason") == reason else None


def _set_calls(sim: ModuleType) -> list[Any]:
    return [e for e in sim.history() if e.kind == "set-mig-mode"]


@pytest.mark.parametrize("inventory", [Inventory.PARTITIONABLE, Inventory.INSTANCES])
async def test_a_gpu_switches_to_mig_once_its_whole_gpu_pod_ends_and_back_once_its_slices_end(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
    inventory: Inventory,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["H100-80GB"], state_file=None, mig_enabled=False)
    node = make_node("modes", labels={"dynamig.io/managed": "true"})
    gpu, where = f"{node}-gpu0", {"kubernetes.io/hostname": node}
    settings = dataclasses.replace(quick_agent_settings(node), inventory=inventory)
    async with agent_running(kube_api, node, sim, settings):
        await eventually(lambda: _published_has(k, node, "gpu0"), "the whole GPU published")
        await k.claim_template("whole", ["whole"])
        await k.claim_template("slice", ["1g.10gb"])
        await k.pod("train", "whole", where)
        assert await eventually(functools.partial(k.node_of, "train"), "the whole-GPU pod bound") == node

        # Asked to switch to MIG while the whole GPU is allocated: withdrawn, told why, not switched.
        floor = [{"profile": "1g.10gb", "start": 0}]  # what the operator writes for the waiting slice claim
        await _spec(k, gpu, {"migMode": "Enabled", "offeredProfiles": ["1g.10gb"], "layout": floor})
        part = await eventually(functools.partial(_mig_mode, k, gpu, "MigModeDraining"), "the switch waiting")
        assert "allocated to" in _condition(part, "MigMode")["message"], _condition(part, "MigMode")
        assert part["status"]["phase"] == "Reshaping" and part["status"]["wholeGpu"]["published"] is False
        await eventually(lambda: _published_lacks(k, node, "gpu0"), "the whole GPU withdrawn")
        assert mig_modes(sim) == [0] and _set_calls(sim) == []

        # The pod ends: the GPU switches to MIG, and a slice pod binds on it.
        ended = time.monotonic()
        await k.delete_pods(["train"])
        await eventually(
            functools.partial(_mig_mode, k, gpu, "MigModeSwitched"), "switched to MIG", within_s=60
        )
        switched_s = time.monotonic() - ended
        assert mig_modes(sim) == [1] and len(_set_calls(sim)) == 1
        await k.pod("small", "slice", where)
        await eventually(functools.partial(k.node_of, "small"), "the MIG pod bound on the switched GPU")
        cut_s = time.monotonic() - ended
        print(f"\n{inventory.value}: whole-GPU pod deleted -> MIG on {switched_s:.1f}s -> 1g.10gb pod bound "
              f"{cut_s:.1f}s")  # fmt: skip
        assert "gpu0" not in set(await k.published(node))
        claim = await k.claim_of("small")
        assert claim is not None
        device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
        assert device.startswith("gpu0-1g10gb-")

        # Asked back to whole while the slice is allocated: its instance is never destroyed under it.
        await _spec(k, gpu, {"migMode": "Disabled"})
        await eventually(functools.partial(_mig_mode, k, gpu, "MigModeDraining"), "the switch back waiting")
        destroyed_before = [e for e in sim.history() if e.kind.startswith("destroy")]
        assert mig_modes(sim) == [1]
        await k.delete_pods(["small"])
        await eventually(
            functools.partial(_mig_mode, k, gpu, "MigModeSwitched"), "switched back", within_s=60
        )
        assert mig_modes(sim) == [0] and len(_set_calls(sim)) == 2
        await eventually(lambda: _published_has(k, node, "gpu0"), "the whole GPU published again")
        # the held instance went only after its pod ended (the destroys came after the deletion)
        assert all(e.kind != "destroy-ci" for e in destroyed_before)


async def _published_has(k: ScenarioApi, node: str, name: str) -> bool | None:
    return True if name in set(await k.published(node)) else None


async def _published_lacks(k: ScenarioApi, node: str, name: str) -> bool | None:
    return True if name not in set(await k.published(node)) else None


async def test_a_vm_gpu_whose_reset_is_not_exposed_is_asked_once_and_told_why(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """An A100 in a pass-through VM: NVML answers NVML_ERROR_RESET_REQUIRED; the agent reports it (Degraded,
    ResetRequired) and never calls again for that request; the VM's reboot applies the pending mode."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["A100-80GB"], state_file=None, mig_enabled=False, vm=True)
    node = make_node("vm", labels={"dynamig.io/managed": "true"})
    gpu = f"{node}-gpu0"
    async with agent_running(kube_api, node, sim, quick_agent_settings(node)) as agent:
        await eventually(lambda: _published_has(k, node, "gpu0"), "the whole GPU published")
        await _spec(k, gpu, {"migMode": "Enabled"})
        part = await eventually(functools.partial(_mig_mode, k, gpu, "ResetRequired"), "reset required told")
        assert part["status"]["phase"] == "Degraded"
        assert "VM reboot" in _condition(part, "MigMode")["message"]
        later = agent.rounds + 5

        async def rounds_later() -> bool | None:
            return True if agent.rounds >= later else None

        await eventually(rounds_later, "five more agent rounds")
        assert len(_set_calls(sim)) == 1, "RESET_REQUIRED is never retried"
        assert "gpu0" not in set(await k.published(node))
        # The VM reboots (a reset): the pending mode becomes current and the switch is done.
        sim.reset_gpu(0)
        await eventually(functools.partial(_mig_mode, k, gpu, "MigModeSwitched"), "switched after the reboot")
        assert mig_modes(sim) == [1] and len(_set_calls(sim)) == 1
