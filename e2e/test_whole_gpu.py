"""Whole GPUs on the real scheduler: a GPU whose MIG mode is off is one device, booked and bound at once.

Real: etcd, kube-apiserver, kube-scheduler (DRA allocation from the node's ResourceSlices), the
kube-controller-manager (claims made from templates, removed with their pods), the node agent's whole loop
over the NVML code path. Simulated: the GPUs (simnvml: two H100-80GB with MIG mode off) and the node (no
kubelet: pods bind, never run). Both inventories: the whole GPU is published without counters or binding
conditions in either, so nothing is cut and nothing waits on an answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.demo.cluster import ScenarioApi, device_plugin_pod
from dynamig.demo.inprocess import agent_running, mig_modes, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.kube.devices import whole_device_class
from dynamig.kube.gpupartition import Inventory

pytestmark = pytest.mark.controlplane


async def _whole_published(k: ScenarioApi, node: str) -> dict[str, dict[str, Any]] | None:
    devices = await k.published(node)
    return devices if {"gpu0", "gpu1"} <= set(devices) else None


@pytest.mark.parametrize("inventory", [Inventory.PARTITIONABLE, Inventory.INSTANCES])
async def test_whole_gpu_pods_bind_at_once_on_mig_off_gpus_and_nothing_is_cut(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
    inventory: Inventory,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["H100-80GB", "H100-80GB"], state_file=None, mig_enabled=False)
    node = make_node("whole", labels={"dynamig.io/managed": "true"})
    where = {"kubernetes.io/hostname": node}
    settings = dataclasses.replace(quick_agent_settings(node), inventory=inventory)
    async with agent_running(kube_api, node, sim, settings):
        devices = await eventually(functools.partial(_whole_published, k, node), "both whole GPUs published")
        for d in devices.values():
            assert "bindingConditions" not in d and "consumesCounters" not in d
        await k.claim_template("whole", ["whole"])
        await k.claim_template("slice", ["1g.10gb"])
        created = time.monotonic()
        await k.pod("train-a", "whole", where)
        bound = functools.partial(k.node_of, "train-a")
        assert await eventually(bound, "the first whole-GPU pod bound", every_s=0.02) == node
        print(f"\n{inventory.value}: whole-GPU pod created -> bound in {time.monotonic() - created:.2f}s")
        await k.pod("train-b", "whole", where)
        await eventually(functools.partial(k.node_of, "train-b"), "the second whole-GPU pod bound")
        got = {}
        for pod in ("train-a", "train-b"):
            claim = await k.claim_of(pod)
            assert claim is not None
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            assert result["pool"] == node and "bindingConditions" not in result
            got[pod] = result["device"]
        assert sorted(got.values()) == ["gpu0", "gpu1"]  # one GPU each, never the same one twice

        # Every whole GPU is taken: a third waits, and so does a MIG slice (MIG mode is off, nothing is
        # cut and the mode is never changed).
        await k.pod("train-c", "whole", where)
        await k.pod("small", "slice", where)
        await eventually(functools.partial(k.unschedulable, "train-c"), "the third whole-GPU pod waits")
        await eventually(functools.partial(k.unschedulable, "small"), "the MIG pod waits")

        async def both_allocated() -> list[dict[str, Any]] | None:
            parts = [await k.partition(f"{node}-gpu{i}") for i in (0, 1)]
            whole = [(p.get("status") or {}).get("wholeGpu") or {} for p in parts]
            return parts if all(w.get("state") == "allocated" for w in whole) else None

        parts = await eventually(both_allocated, "both GPUs reported allocated on their GpuPartitions")
        for p in parts:
            st = p["status"]
            assert st["migMode"] == "Disabled" and st["layoutSummary"] == "whole", st
            assert st["wholeGpu"]["claims"], st["wholeGpu"]
        if inventory is Inventory.PARTITIONABLE:  # bound without an answer: reported after the fact

            async def reported() -> dict[str, Any] | None:
                claim = await k.claim_of("train-a")
                return next(iter(((claim or {}).get("status") or {}).get("devices") or []), None)

            entry = await eventually(reported, "the GPU UUID reported in the claim")
            index = int(got["train-a"].removeprefix("gpu"))
            assert entry["data"] == {"uuid": parts[index]["status"]["uuid"], "profile": "whole"}

        # One ends: its GPU goes to the pod that waited.
        await k.delete_pods(["train-a"])
        await eventually(functools.partial(k.node_of, "train-c"), "the waiting pod bound on the freed GPU")
        claim = await k.claim_of("train-c")
        assert claim is not None
        assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == got["train-a"]
        assert await k.unschedulable("small")

        # A pod written for the device plugin (nvidia.com/gpu: 1, no claim) is served a whole GPU through the
        # class gpu.dynamig.io (DRAExtendedResource: the scheduler makes its claim from the class).
        with contextlib.suppress(ApiException):  # 409: made by another test
            await k.resource.create_device_class(whole_device_class())
        await k.delete_pods(["train-b"])
        legacy = device_plugin_pod("legacy", where, resource="nvidia.com/gpu")
        await k.core.create_namespaced_pod(namespace, legacy)
        await eventually(functools.partial(k.node_of, "legacy"), "the nvidia.com/gpu pod bound", within_s=60)
        claim = await k.claim_of("legacy")
        assert claim is not None
        assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == got["train-b"]

    assert [e.kind for e in sim.history() if e.kind.startswith(("create", "destroy"))] == []
    assert mig_modes(sim) == [0, 0]


async def test_a_gpu_without_mig_is_served_whole_only_when_its_gpu_partition_asks(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """An L4 (no MIG): left alone (UnknownModel, nothing published) until its GpuPartition asks
    ``spec.migMode: Disabled`` (what a policy serving such GPUs writes); then one whole device, and a pod on
    it; never offered as MIG. Withdrawn again when the request goes."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["L4-24GB"], state_file=None)
    node = make_node("l4", labels={"dynamig.io/managed": "true"})
    gpu = f"{node}-gpu0"
    async with agent_running(kube_api, node, sim, quick_agent_settings(node)):

        async def refused() -> dict[str, Any] | None:
            try:
                part = await k.partition(gpu)
            except ApiException:
                return None
            conditions = (part.get("status") or {}).get("conditions") or []  # none until the agent writes
            managed: dict[str, Any] = next((c for c in conditions if c["type"] == "Managed"), {})
            return part if managed.get("reason") == "UnknownModel" else None

        part = await eventually(refused, "the L4 left alone")
        assert part["status"]["migMode"] == "Disabled" and "wholeGpu" not in part["status"]
        assert await k.published(node) == {}
        await k.custom.patch_cluster_custom_object(
            "dynamig.io", "v1alpha1", "gpupartitions", gpu, {"spec": {"migMode": "Disabled"}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        served = functools.partial(_devices_named, k, node, {"gpu0"})
        devices = await eventually(served, "the L4 served whole")
        attrs = devices["gpu0"]["attributes"]
        assert attrs["mig.dynamig.io/profile"] == {"string": "whole"}
        assert attrs["mig.dynamig.io/productName"] == {"string": "NVIDIA L4"}
        assert attrs["mig.dynamig.io/architecture"] == {"string": "Ada"}
        await k.claim_template("whole", ["whole"])
        await k.pod("infer", "whole", {"kubernetes.io/hostname": node})
        assert await eventually(functools.partial(k.node_of, "infer"), "the pod bound on the L4") == node
        await k.delete_pods(["infer"])
        await k.custom.patch_cluster_custom_object(
            "dynamig.io", "v1alpha1", "gpupartitions", gpu, {"spec": {"migMode": None}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        await eventually(functools.partial(_devices_named, k, node, set()), "withdrawn when no longer asked")


async def _devices_named(k: ScenarioApi, node: str, names: set[str]) -> dict[str, dict[str, Any]] | None:
    devices = await k.published(node)
    return devices if set(devices) == names else None
