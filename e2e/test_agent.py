"""Node agent end to end: discovery, ResourceSlices, scheduler allocation, reshape, busy instances, restarts.

Real: etcd, kube-apiserver, kube-scheduler (DRA allocation against the agent's ResourceSlices) and
kube-controller-manager, built from the Kubernetes sources; the agent's whole code path (NVML calls,
reconcile, publisher, status). Simulated: the GPUs (``dynamig.backends.simnvml`` under the agent's NVML calls,
shared through a state file with a restarted agent process) and the nodes (Node objects, no kubelet: pods are
bound, never run). Settle periods and poll intervals are shortened through the agent's flags.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml.device import NvmlDevices
from dynamig.demo.cluster import claim_pod, ensure_device_class, exactly, resource_claim
from dynamig.demo.inprocess import agent_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.sandbox import install_crds
from dynamig.devcluster.waiting import described, event_posted
from dynamig.geometry.catalog import load_catalog
from dynamig.operator.teardown import uninstall

pytestmark = pytest.mark.controlplane

DRIVER = "mig.dynamig.io"
REPO = Path(__file__).resolve().parent.parent


def install_crd(cp: ControlPlane) -> None:
    """Apply the CRDs (the agent's GpuPartition; the policy one `dynamig uninstall` reads) and wait until
    GpuPartitions are served (idempotent)."""
    install_crds(cp)
    deadline = time.monotonic() + 30
    while cp.kubectl("get", "gpupartitions", check=False).returncode != 0:  # storage may still initialise
        assert time.monotonic() < deadline, "GpuPartition storage not ready"
        time.sleep(0.2)


class Api:
    """Dict-level API shortcuts for the objects the scenarios look at."""

    def __init__(self, api: client.ApiClient) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)

    async def partition(self, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = await self.custom.get_cluster_custom_object(
                "dynamig.io", "v1alpha1", "gpupartitions", name
            )
            return obj
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def partitions(self, node: str) -> list[dict[str, Any]]:
        res = await self.custom.list_cluster_custom_object(
            "dynamig.io", "v1alpha1", "gpupartitions", label_selector=f"dynamig.io/node={node}"
        )
        return list(res["items"])

    async def set_layout(self, name: str, layout: str) -> int:
        """Write spec.layout from ``"1g.10gb@0,3g.40gb@4"``; returns the new generation."""
        items = []
        for part in filter(None, layout.split(",")):
            profile, start = part.split("@")
            items.append({"profile": profile, "start": int(start)})
        obj = await self.custom.patch_cluster_custom_object(
            "dynamig.io",
            "v1alpha1",
            "gpupartitions",
            name,
            {"spec": {"layout": items}},
            _content_type="application/merge-patch+json",
        )
        return int(obj["metadata"]["generation"])

    async def slices(self, node: str) -> list[dict[str, Any]]:
        res = await self.custom.list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
        )
        return [s for s in res["items"] if s["spec"]["driver"] == DRIVER]

    async def published(self, node: str) -> dict[str, dict[str, Any]]:
        """Device name -> device over the highest pool generation of the node's slices."""
        slices = await self.slices(node)
        if not slices:
            return {}
        top = max(s["spec"]["pool"]["generation"] for s in slices)
        return {
            d["name"]: d
            for s in slices
            if s["spec"]["pool"]["generation"] == top
            for d in s["spec"].get("devices") or []
        }

    async def create_claim(self, namespace: str, name: str, profile: str) -> None:
        expr = f'device.attributes["{DRIVER}"].profile == "{profile}"'
        body = resource_claim(name, exactly(expr))
        await self.custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims", body
        )

    async def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = await self.custom.get_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaims", name
            )
            return obj
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def allocated_device(self, namespace: str, claim: str) -> str | None:
        obj = await self.claim(namespace, claim)
        alloc = ((obj or {}).get("status") or {}).get("allocation")
        if not alloc:
            return None
        (result,) = alloc["devices"]["results"]
        return str(result["device"])

    async def create_pod(self, namespace: str, name: str, node: str, claim: str) -> None:
        body = claim_pod(name, {"kubernetes.io/hostname": node}, claim=claim)
        await self.core.create_namespaced_pod(namespace, body)

    async def release(self, namespace: str, pod: str, claim: str) -> None:
        """Delete the pod and the claim (the claim's finalizer goes once the pod is gone)."""
        await self.core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
        await self.custom.delete_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims", claim
        )


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the series ``name{labels}`` in Prometheus text output, or None."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def layout_of(part: dict[str, Any]) -> str:
    """``"1g.10gb@0,..."`` of the instances in a GpuPartition's status."""
    items = sorted((i["start"], i["profile"]) for i in (part.get("status") or {}).get("instances") or [])
    return ",".join(f"{p}@{s}" for s, p in items)


def condition(part: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in (part.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return None


def stable_at(part: dict[str, Any] | None, generation: int | None = None) -> bool:
    if part is None:
        return False
    st = part.get("status") or {}
    gen = generation if generation is not None else part["metadata"]["generation"]
    return st.get("phase") == "Stable" and st.get("observedGeneration") == gen


def agent_settings(node: str, settle_s: float = 0.3, interval_s: float = 0.5) -> AgentSettings:
    """Short settle and quarantine periods and intervals for an agent running as a task of this event
    loop. Pure."""
    return AgentSettings(
        node=node,
        settle_seconds=settle_s,
        quarantine_seconds=1.0,
        interval_seconds=interval_s,
        reshape_poll_seconds=0.1,
    )


def start_agent_process(
    cp: ControlPlane, node: str, gpus: str, state: Path, log: Path, *extra: str
) -> subprocess.Popen[bytes]:
    """``python -m dynamig agent`` with simulated NVML sharing ``state``; output to ``log``."""
    argv = [
        sys.executable, "-m", "dynamig", "agent", "--node", node, "--nvml", "simulated",
        "--simulate-gpus", gpus, "--state", str(state), "--kubeconfig", str(cp.kubeconfig_path),
        "--metrics-port", "-1", "--interval", "0.5", "--reshape-poll", "0.1", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.wait(timeout=30)


# --------------------------------------------------------------------------------------------- scenarios


@pytest.fixture
def crd(control_plane: ControlPlane) -> ControlPlane:
    install_crd(control_plane)
    return control_plane


@pytest.fixture
def sim_nvml() -> Iterator[ModuleType]:
    from dynamig.backends.nvml import load_nvml

    module: ModuleType = load_nvml("simulated")
    module.configure(gpus=["H100-80GB", "H100-80GB"], state_file=None)
    yield module
    module.configure(gpus=[], state_file=None)


def _reshaped_keeping(start: int) -> str:
    """An H100 layout that keeps ``1g.10gb@start`` and turns three other 1g slices into one 3g.40gb."""
    if start < 4:
        return ",".join(f"1g.10gb@{s}" for s in range(4)) + ",3g.40gb@4"
    return "3g.40gb@0," + ",".join(f"1g.10gb@{s}" for s in range(4, 7))


@pytest.mark.matrix
async def test_agent_publishes_reshapes_free_instances_and_keeps_allocated_ones(
    crd: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim_nvml: ModuleType,
) -> None:
    timings: dict[str, float] = {}
    api = Api(kube_api)
    await ensure_device_class(client.ResourceV1Api(kube_api))
    node = make_node("agent", labels={"dynamig.io/managed": "true"})
    gpu0, gpu1 = f"{node}-gpu0", f"{node}-gpu1"
    # A long poll interval: changes must reach the agent through its watches.
    async with agent_running(
        kube_api, node, sim_nvml, agent_settings(node, settle_s=0.3, interval_s=600)
    ) as agent:
        t0 = time.monotonic()
        # 1. Discovery: one GpuPartition per GPU, adopted empty layout, Stable; an empty pool is published.
        parts = await eventually(lambda: _all_stable(api, node, 2), "two Stable GpuPartitions")
        p0 = next(p for p in parts if p["metadata"]["name"] == gpu0)
        assert p0["status"]["product"] == "NVIDIA H100 80GB HBM3" and p0["status"]["migMode"] == "Enabled"
        assert p0["status"]["uuid"].startswith("GPU-") and p0["spec"].get("layout", []) == []
        assert p0["metadata"]["ownerReferences"][0]["kind"] == "Node"
        timings["discover"] = time.monotonic() - t0

        # 2. Layouts written by hand (as the operator would): slices follow with NVML's memory and SMs.
        t1 = time.monotonic()
        g0 = await api.set_layout(gpu0, ",".join(f"1g.10gb@{s}" for s in range(7)))
        g1 = await api.set_layout(gpu1, "3g.40gb@0,3g.40gb@4")
        await eventually(lambda: _stable(api, gpu0, g0), "gpu0 Stable at 7x1g.10gb")
        await eventually(lambda: _stable(api, gpu1, g1), "gpu1 Stable at 2x3g.40gb")
        devices = await eventually(lambda: _published_count(api, node, 9), "9 devices published")
        timings["first layout"] = time.monotonic() - t1
        dev = devices["gpu0-1g10gb-s3"]
        attrs = dev["attributes"]
        assert attrs["mig.dynamig.io/profile"] == {"string": "1g.10gb"}
        assert attrs["mig.dynamig.io/uuid"]["string"].startswith("MIG-")
        assert attrs["mig.dynamig.io/parentUUID"] == {"string": p0["status"]["uuid"]}
        assert int(dev["capacity"]["mig.dynamig.io/multiprocessors"]["value"]) == 16
        (slice0,) = await api.slices(node)
        assert slice0["spec"]["pool"]["name"] == node and slice0["spec"]["nodeName"] == node
        gen_before = slice0["spec"]["pool"]["generation"]
        st0 = (await api.partition(gpu0) or {})["status"]
        assert st0["freeSlices"] == 7 and st0["totalSlices"] == 7
        assert (condition(await api.partition(gpu0) or {}, "Ready") or {})["status"] == "True"

        # 3. A claim for 1g.10gb is allocated by the scheduler; status says so.
        await api.create_claim(namespace, "small", "1g.10gb")
        await api.create_pod(namespace, "small", node, "small")
        taken = await eventually(lambda: api.allocated_device(namespace, "small"), "claim allocated")
        assert taken.startswith("gpu0-1g10gb-s")
        start = int(taken.rsplit("-s", 1)[1])

        async def allocated_in_status() -> dict[str, Any] | None:
            part = await api.partition(gpu0)
            for i in (part or {}).get("status", {}).get("instances", []):
                if i["deviceName"] == taken and i["state"] == "allocated":
                    assert i["claims"] == [f"{namespace}/small"]
                    return dict(i)
            return None

        before = await eventually(allocated_in_status, "allocated instance in status")
        instances_before = (await api.partition(gpu0) or {})["status"]["instances"]
        uuids_before = {i["deviceName"]: i["migUUID"] for i in instances_before}

        # 4. New layout: only free instances change; the allocated one keeps its MIG UUID; slices follow.
        t2 = time.monotonic()
        target = _reshaped_keeping(start)
        g0 = await api.set_layout(gpu0, target)
        part = await eventually(lambda: _stable(api, gpu0, g0), "gpu0 reshaped and Stable", within_s=60)
        timings["reshape 3x1g -> 3g"] = time.monotonic() - t2
        assert layout_of(part) == target
        after = {i["deviceName"]: i["migUUID"] for i in part["status"]["instances"]}
        kept = [n for n in after if n in uuids_before]
        assert taken in kept and all(after[n] == uuids_before[n] for n in kept)
        assert after[taken] == before["migUUID"]
        published = await api.published(node)
        expected_names = {i["deviceName"] for i in part["status"]["instances"]} | {
            "gpu1-3g40gb-s0",
            "gpu1-3g40gb-s4",
        }
        assert set(published) == expected_names
        assert (await api.slices(node))[0]["spec"]["pool"]["generation"] > gen_before
        assert await api.allocated_device(namespace, "small") == taken

        # 5. A layout that omits the allocated instance: the free ones go, the allocated one stays (kept),
        #    out of the slice; the 7g.80gb waits for it.
        g0 = await api.set_layout(gpu0, "7g.80gb@0")

        async def kept_busy() -> dict[str, Any] | None:
            p = await api.partition(gpu0)
            if p is None or p["status"].get("observedGeneration") != g0 or layout_of(p) != f"1g.10gb@{start}":
                return None
            ready = condition(p, "Ready")
            ok = ready and ready["reason"] == "InstanceBusy" and p["status"]["phase"] == "Stable"
            return p if ok else None

        p = await eventually(kept_busy, "allocated instance kept, others destroyed", within_s=60)
        assert taken in (condition(p, "Ready") or {})["message"]
        (inst,) = p["status"]["instances"]
        assert inst["migUUID"] == before["migUUID"] and inst["published"] is False
        assert not any(n.startswith("gpu0-") for n in await api.published(node))
        assert layout(agent, 0) == f"1g.10gb@{start}"  # NVML agrees

        # 6. Invalid layout on gpu1: refused with a reason, nothing touched.
        g1 = await api.set_layout(gpu1, "3g.40gb@0,1g.10gb@3")

        async def refused() -> dict[str, Any] | None:
            p = await api.partition(gpu1)
            c = condition(p or {}, "LayoutValid")
            return p if p and c and c["status"] == "False" and c["observedGeneration"] == g1 else None

        p1 = await eventually(refused, "invalid layout refused")
        assert "1g.10gb@3" in (condition(p1, "LayoutValid") or {})["message"]
        assert layout_of(p1) == "3g.40gb@0,3g.40gb@4" and layout(agent, 1) == "3g.40gb@0,3g.40gb@4"

        # 7. The workload ends: the claim goes, the kept instance is destroyed and the 7g.80gb made.
        t3 = time.monotonic()
        await api.release(namespace, "small", "small")
        p = await eventually(lambda: _stable(api, gpu0, g0, ready=True), "gpu0 at 7g.80gb", within_s=60)
        timings["release -> 7g"] = time.monotonic() - t3
        assert layout_of(p) == "7g.80gb@0" and "gpu0-7g80gb-s0" in await api.published(node)

        # 8. Someone deletes our slice: it is recreated at a higher generation.
        (sl,) = await api.slices(node)
        await api.custom.delete_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", sl["metadata"]["name"]
        )
        old_gen = sl["spec"]["pool"]["generation"]
        back = await eventually(lambda: _slice_back(api, node, old_gen), "slice recreated")
        assert "gpu0-7g80gb-s0" in {d["name"] for d in back["spec"]["devices"]}

        # 9. Metrics: DCGM-compatible instance labels, operations counted.
        text = generate_latest(agent.metrics.registry).decode()
        assert 'dynamig_build_info{version="' in text
        assert 'GPU_I_PROFILE="7g.80gb"' in text and f'Hostname="{node}"' in text and 'UUID="GPU-' in text
        ops = "dynamig_reshape_operations_total"
        assert (sample(text, ops, Hostname=node, operation="destroy", result="success") or 0) == 8
        assert (sample(text, ops, Hostname=node, operation="create", result="success") or 0) == 11
        assert "dynamig_reshape_duration_seconds_count" in text

        # 10. Uninstall (no policy governs these GPUs: their layouts stay): the agent withdraws its slices
        #     and reports, then slices and GpuPartitions go; MIG stays as it is.
        nvml_before = (layout(agent, 0), layout(agent, 1))
        report = await uninstall(
            kube_api, load_catalog(), leave="baseline", namespace=None, operator_deployment=None,
            timeout_s=30, nodes=frozenset({node}), poll_s=0.2,
        )  # fmt: skip
        assert sorted(report.cleaned) == [f"{node}-gpu0", f"{node}-gpu1"] and report.complete, report
        assert await api.slices(node) == [] and await api.partitions(node) == []
        assert (layout(agent, 0), layout(agent, 1)) == nvml_before
        assert agent.uninstalled
    print("\nagent scenario timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))


async def test_agent_refuses_gpus_of_another_mig_owner(
    crd: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Callable[..., str],
    sim_nvml: ModuleType,
) -> None:
    api = Api(kube_api)
    node = make_node("foreign", labels={"dynamig.io/managed": "true", "nvidia.com/mig.config": "all-1g.10gb"})
    async with agent_running(kube_api, node, sim_nvml, agent_settings(node)):

        async def degraded() -> list[dict[str, Any]] | None:
            parts = await api.partitions(node)
            ok = len(parts) == 2 and all((p.get("status") or {}).get("phase") == "Degraded" for p in parts)
            return parts if ok else None

        parts = await eventually(degraded, "GpuPartitions Degraded by the foreign owner")
        managed = condition(parts[0], "Managed") or {}
        assert managed["status"] == "False" and managed["reason"] == "ForeignMigOwner"
        assert "nvidia.com/mig.config" in managed["message"]
        await api.set_layout(parts[0]["metadata"]["name"], "7g.80gb@0")
        await asyncio.sleep(1.0)
        assert (await api.published(node)) == {}
        (sl,) = await api.slices(node)
        assert not sl["spec"].get("devices")

    # Another driver (the NVIDIA DRA driver) publishes MIG devices of GPU 1 on this node: GPU 1 is refused,
    # GPU 0 is managed.
    node = make_node("shared", labels={"dynamig.io/managed": "true"})
    reader = NvmlDevices(sim_nvml, load_catalog())
    reader.init()  # an NVML session of its own: the first agent shut its own down
    try:
        gpu1_uuid = reader.gpus()[1].uuid
    finally:
        reader.shutdown()
    foreign_slice: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpu.nvidia.com"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-1-mig-1g10gb-0",
                    "attributes": {"type": {"string": "mig"}, "parentUUID": {"string": gpu1_uuid}},
                }
            ],
        },
    }
    await api.custom.create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", foreign_slice)
    try:
        async with agent_running(kube_api, node, sim_nvml, agent_settings(node)):

            async def split() -> tuple[dict[str, Any], dict[str, Any]] | None:
                p0, p1 = await api.partition(f"{node}-gpu0"), await api.partition(f"{node}-gpu1")
                if p0 and p1 and stable_at(p0) and (p1.get("status") or {}).get("phase") == "Degraded":
                    return p0, p1
                return None

            _, p1 = await eventually(split, "gpu0 managed, gpu1 refused")
            managed = condition(p1, "Managed") or {}
            assert managed["reason"] == "ForeignMigOwner" and "gpu.nvidia.com" in managed["message"]
            gen = await api.set_layout(f"{node}-gpu0", "7g.80gb@0")
            await eventually(lambda: _stable(api, f"{node}-gpu0", gen, ready=True), "gpu0 follows its layout")
            await api.set_layout(f"{node}-gpu1", "7g.80gb@0")
            await asyncio.sleep(1.0)
            assert set(await api.published(node)) == {"gpu0-7g80gb-s0"}
    finally:
        await api.custom.delete_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", foreign_slice["metadata"]["name"]
        )

    # MIG disabled (an A100 as it often ships): reported as such, never enabled, published whole as gpu0
    # (no MIG device). A layout written for it is not applied and the GPU says why. When the node opts out,
    # the agent withdraws its slices.
    sim_nvml.configure(gpus=["A100-40GB"], state_file=None, mig_enabled=False)
    node = make_node("migoff", labels={"dynamig.io/managed": "true"})
    async with agent_running(kube_api, node, sim_nvml, agent_settings(node)):

        async def served_whole() -> dict[str, Any] | None:
            p = await api.partition(f"{node}-gpu0")
            ready = condition(p, "Ready") or {} if p else {}
            return p if ready.get("reason") == "WholeGpu" and ready.get("status") == "True" else None

        p = await eventually(served_whole, "MIG-disabled GPU served whole")
        st = p["status"]
        assert st["migMode"] == "Disabled" and st["product"].startswith("NVIDIA A100")
        assert st["wholeGpu"] == {
            "deviceName": "gpu0", "state": "free", "published": True, "processes": 0, "claims": []
        }  # fmt: skip
        assert (condition(p, "Managed") or {})["status"] == "True"
        published = await eventually(lambda: _published_count(api, node, 1), "the whole GPU published")
        attrs = published["gpu0"]["attributes"]
        assert attrs["mig.dynamig.io/profile"] == {"string": "whole"}
        assert attrs["mig.dynamig.io/uuid"] == {"string": st["uuid"]}
        assert attrs["mig.dynamig.io/architecture"] == {"string": "Ampere"}
        assert "bindingConditions" not in published["gpu0"] and "consumesCounters" not in published["gpu0"]
        memory = int(published["gpu0"]["capacity"]["mig.dynamig.io/memory"]["value"])
        total = int(sim_nvml.nvmlDeviceGetMemoryInfo(sim_nvml.nvmlDeviceGetHandleByIndex(0)).total)
        assert memory == total
        await api.set_layout(f"{node}-gpu0", "7g.40gb@0")

        async def layout_refused() -> dict[str, Any] | None:
            p = await api.partition(f"{node}-gpu0")
            valid = condition(p, "LayoutValid") or {} if p else {}
            return p if valid.get("reason") == "MigDisabled" else None

        await eventually(layout_refused, "a layout on a MIG-off GPU refused, named")
        assert set(await api.published(node)) == {"gpu0"}
        assert NvmlDevices(sim_nvml, load_catalog()).gpus()[0].mig_current == 0
        # An administrator enables MIG while the agent runs: the agent reads the GPU's profiles again and
        # applies the layout (a model cached while MIG was off would offer no profile at all).
        sim_nvml.nvmlDeviceSetMigMode(sim_nvml.nvmlDeviceGetHandleByIndex(0), sim_nvml.NVML_DEVICE_MIG_ENABLE)
        gen = (await api.partition(f"{node}-gpu0") or {})["metadata"]["generation"]

        async def applied() -> dict[str, Any] | None:
            p = await _stable(api, f"{node}-gpu0", gen, ready=True)
            return p if p and (condition(p, "Ready") or {}).get("reason") == "LayoutApplied" else None

        p = await eventually(applied, "applied once MIG is on")
        assert "wholeGpu" not in p["status"] and p["status"]["migMode"] == "Enabled"
        # the whole GPU is gone from the slice with MIG on: its memory is the MIG instance's now
        await eventually(lambda: _published_names(api, node, {"gpu0-7g40gb-s0"}), "only the MIG device")
        crd.register_node(node, labels={"dynamig.io/managed": "false"})
        await eventually(lambda: _no_slices(api, node), "slices withdrawn after opting out")


async def test_agent_refuses_a_node_where_the_nvidia_device_plugin_advertises_gpus(
    crd: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Callable[..., str],
    sim_nvml: ModuleType,
) -> None:
    """The device plugin's nvidia.com/gpu in the node's allocatable: both GPUs refused (Managed=False),
    nothing published, and a Warning Event on the Node, where `kubectl describe node` shows it; once the
    plugin is off, the agent manages the GPUs and says so on the Node."""
    api = Api(kube_api)
    node = make_node("devplugin", labels={"dynamig.io/managed": "true"})
    status = {"status": {"allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "2"}}}
    await api.core.patch_node_status(node, status)
    async with agent_running(kube_api, node, sim_nvml, agent_settings(node)):

        async def refused() -> list[dict[str, Any]] | None:
            parts = await api.partitions(node)
            managed = [(condition(p, "Managed") or {}).get("status") for p in parts]
            return parts if managed == ["False", "False"] else None

        for part in await eventually(refused, "both GPUs refused"):
            managed = condition(part, "Managed") or {}
            assert managed["reason"] == "ForeignMigOwner", managed
            assert "NVIDIA device plugin advertises nvidia.com/gpu=2" in managed["message"], managed
        await asyncio.sleep(1.0)
        assert await api.published(node) == {}
        # The agent's Warning on the Node is posted apart from the GpuPartitions' status: waited for.
        await described(crd, "node", node, "ForeignMigOwner", "device plugin", within_s=30)

        # The device plugin is turned off for this node: its resource goes to zero.
        status["status"]["allocatable"]["nvidia.com/gpu"] = "0"
        await api.core.patch_node_status(node, status)
        await eventually(lambda: _all_stable(api, node, 2), "both GPUs managed again")
        await described(crd, "node", node, "ForeignMigOwnerResolved", within_s=30)


async def _no_slices(api: Api, node: str) -> bool | None:
    return True if not await api.slices(node) else None


async def _all_stable(api: Api, node: str, n: int) -> list[dict[str, Any]] | None:
    parts = await api.partitions(node)
    return parts if len(parts) == n and all(stable_at(p) for p in parts) else None


async def _stable(api: Api, name: str, generation: int, ready: bool = False) -> dict[str, Any] | None:
    p = await api.partition(name)
    if not stable_at(p, generation):
        return None
    assert p is not None
    if ready and (condition(p, "Ready") or {}).get("status") != "True":
        return None
    return p


async def _published_names(api: Api, node: str, names: set[str]) -> bool | None:
    return True if set(await api.published(node)) == names else None


async def _published_count(api: Api, node: str, n: int) -> dict[str, dict[str, Any]] | None:
    devices = await api.published(node)
    return devices if len(devices) == n else None


async def _slice_back(api: Api, node: str, old_generation: int) -> dict[str, Any] | None:
    slices = await api.slices(node)
    if len(slices) == 1 and slices[0]["spec"]["pool"]["generation"] > old_generation:
        return slices[0]
    return None


def layout(agent: NodeAgent, index: int) -> str:
    """What NVML holds on GPU ``index``, as ``profile@start,...``."""
    gpu = agent.devices.gpu(index)
    return ",".join(f"{i.profile}@{i.start}" for i in agent.devices.instances(gpu))


def _target_keeping(start: int) -> str:
    """An H100 layout keeping ``1g.10gb@start``: destroys four or more 1g.10gb, creates two or more."""
    if start < 4:
        pair = start // 2 * 2
        return f"1g.10gb@{pair},1g.10gb@{pair + 1},2g.20gb@{2 - pair},3g.40gb@4"
    if start in (4, 5):
        return "3g.40gb@0,1g.10gb@4,1g.10gb@5,1g.20gb@6"
    return "3g.40gb@0,2g.20gb@4,1g.10gb@6"


def _read_nvml(state: Path) -> list[tuple[str, int, str, bool]]:
    """(profile, start, MIG UUID, has CI) of every instance on GPU 0 of the simulated state file."""
    from dynamig.backends.nvml import load_nvml

    module: ModuleType = load_nvml("simulated")
    module.configure(gpus=["H100-80GB"], state_file=state)
    devices = NvmlDevices(module, load_catalog())
    devices.init()
    try:
        gpu = devices.gpu(0)
        for _ in range(20):
            try:
                return [
                    (i.profile, i.start, i.mig_uuid, i.has_compute_instance) for i in devices.instances(gpu)
                ]
            except devices.error_type:
                # The agent process changed an instance between two of our calls: the handles we hold went
                # stale, as they would on a real GPU. Read again.
                time.sleep(0.01)
        raise AssertionError("the simulated GPU kept changing under every read")
    finally:
        devices.shutdown()


def _http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def _history(state: Path) -> list[Any]:
    """The simulated NVML's event history from the state file."""
    from dynamig.backends.nvml import load_nvml

    module: ModuleType = load_nvml("simulated")
    module.configure(gpus=["H100-80GB"], state_file=state)
    return list(module.history())


async def test_agent_killed_mid_reshape_converges_after_restart(
    crd: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    tmp_path: Path,
) -> None:
    api = Api(kube_api)
    await ensure_device_class(client.ResourceV1Api(kube_api))
    node = make_node("restart", labels={"dynamig.io/managed": "true"})
    name = f"{node}-gpu0"
    state, log = tmp_path / "simnvml.json", tmp_path / "agent.log"
    flags: tuple[str, ...] = ("--settle-seconds", "0.3", "--quarantine-seconds", "1")
    flags += ("--sim-create-latency", "0.25", "--sim-destroy-latency", "0.4")
    first = start_agent_process(crd, node, "H100-80GB:1", state, log, *flags)
    try:
        await eventually(lambda: api.partition(name), "GpuPartition of the agent process", within_s=60)
        gen = await api.set_layout(name, ",".join(f"1g.10gb@{s}" for s in range(7)))
        await eventually(lambda: _stable(api, name, gen, ready=True), "7x1g.10gb", within_s=60)
        await api.create_claim(namespace, "held", "1g.10gb")
        await api.create_pod(namespace, "held", node, "held")
        taken = await eventually(lambda: api.allocated_device(namespace, "held"), "claim allocated")
        start = int(taken.rsplit("-s", 1)[1])
        before = {(p, s): u for p, s, u, _ in _read_nvml(state)}
        held_uuid = before[("1g.10gb", start)]

        # Reshape; kill the agent with SIGKILL once NVML shows the reshape half done.
        target = _target_keeping(start)
        gen = await api.set_layout(name, target)
        t_reshape = time.monotonic()

        async def half_done() -> list[tuple[str, int, str, bool]] | None:
            now = await asyncio.to_thread(_read_nvml, state)
            return now if 0 < len(before) - len(now) < len(before) - 1 else None

        mid = await eventually(half_done, "first destroys of the reshape", within_s=60, every_s=0.05)
        kill(first)
        killed_at = time.monotonic()
        mid = await asyncio.to_thread(_read_nvml, state)
        mid_layout = ",".join(f"{p}@{s}" for p, s, _, _ in mid)
        assert mid_layout != target, "the reshape finished before the kill: nothing was interrupted"
        assert ("1g.10gb", start, held_uuid, True) in mid
    finally:
        kill(first)

    # Restart; kill again while the new instances are being created (slow creation makes the window wide).
    target_only = {(p, int(st)) for p, st in (i.split("@") for i in target.split(","))} - set(before)
    slow: tuple[str, ...] = ("--settle-seconds", "0.3", "--quarantine-seconds", "1")
    slow += ("--sim-create-latency", "0.8", "--sim-destroy-latency", "0.25")
    second = start_agent_process(crd, node, "H100-80GB:1", state, log, *slow)
    try:

        async def creating() -> list[tuple[str, int, str, bool]] | None:
            now = await asyncio.to_thread(_read_nvml, state)
            made = {(p, st) for p, st, _, _ in now} & target_only
            return now if made and made != target_only else None

        during_create = await eventually(creating, "first creations", within_s=60, every_s=0.05)
        kill(second)
        mid2_layout = ",".join(f"{p}@{s}" for p, s, _, _ in during_create)
    finally:
        kill(second)

    metrics = ("--metrics-port", "0", "--metrics-address", "127.0.0.1")
    second = start_agent_process(crd, node, "H100-80GB:1", state, log, *flags, *metrics)
    try:
        part = await eventually(
            lambda: _stable(api, name, gen, ready=True), "converged after restart", within_s=90
        )
        converged_s = time.monotonic() - killed_at
        # The restarted process serves its metrics (port chosen by the OS, read from its log).
        port = int(re.findall(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log.read_text())[-1])

        # The metrics follow at the end of the round that wrote the status.
        async def exported() -> str | None:
            text = await asyncio.to_thread(_http_get, f"http://127.0.0.1:{port}/metrics")
            labels = {
                "Hostname": node,
                "GPU_I_PROFILE": "1g.10gb",
                "mig_uuid": held_uuid,
                "state": "allocated",
            }
            return text if sample(text, "dynamig_mig_instance_info", **labels) == 1.0 else None

        text = await eventually(exported, "the held instance in the restarted agent's metrics", within_s=30)
        assert sample(text, "dynamig_build_info") == 1.0
        total_s = time.monotonic() - t_reshape
        after = await asyncio.to_thread(_read_nvml, state)
        # Nothing lost: the allocated instance is the same one (same MIG UUID), the claim still names it.
        assert ("1g.10gb", start, held_uuid, True) in after
        assert await api.allocated_device(namespace, "held") == taken
        # Nothing orphaned: NVML holds exactly the target, every GI has its CI; status and slices agree.
        assert ",".join(f"{p}@{s}" for p, s, _, _ in after) == target
        assert all(has_ci for *_, has_ci in after)
        # The simulated NVML's history agrees: the held instance's GI was created once and never destroyed.
        events = await asyncio.to_thread(_history, state)
        held_gi = [e for e in events if e.kind == "create-gi" and e.profile == "1g.10gb" and e.start == start]
        assert len(held_gi) == 1
        gi_id, created = held_gi[0].gi_id, held_gi[0].seq
        assert not [
            e
            for e in events
            if e.kind in ("destroy-gi", "destroy-ci") and e.gi_id == gi_id and e.seq > created
        ]
        assert layout_of(part) == target
        published = await api.published(node)
        assert set(published) == {i["deviceName"] for i in part["status"]["instances"]}
        assert {d["attributes"]["mig.dynamig.io/uuid"]["string"] for d in published.values()} == {
            u for _, _, u, _ in after
        }
        # Uninstall, as the chart's hook runs it: the agent reports; slices and GpuPartitions go; MIG stays.
        remover = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "dynamig", "uninstall", f"--kubeconfig={crd.kubeconfig_path}",
             f"--node={node}", "--timeout=30", "--yes"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert remover.returncode == 0, remover.stdout + remover.stderr
        assert f"{node}-gpu0: left with {target}; cleaned by its agent" in remover.stdout, remover.stdout
        assert await api.slices(node) == [] and await api.partitions(node) == []
        assert await asyncio.to_thread(_read_nvml, state) == after
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
        print(
            f"\nkilled while destroying at {mid_layout}, then while creating at {mid2_layout}; converged "
            f"{converged_s:.2f}s after the first kill ({total_s:.2f}s after the new layout)"
        )
    finally:
        kill(second)


async def test_agent_keeps_instances_with_processes_and_degrades_lost_gpus(
    crd: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Callable[..., str],
    sim_nvml: ModuleType,
) -> None:
    api = Api(kube_api)
    node = make_node("nvmlfacts", labels={"dynamig.io/managed": "true"})
    gpu0, gpu1 = f"{node}-gpu0", f"{node}-gpu1"
    async with agent_running(kube_api, node, sim_nvml, agent_settings(node, settle_s=0.2)) as agent:
        await eventually(lambda: _all_stable(api, node, 2), "two Stable GpuPartitions")
        gen = await api.set_layout(gpu0, "3g.40gb@0,3g.40gb@4")
        part = await eventually(lambda: _stable(api, gpu0, gen, ready=True), "gpu0 at 2x3g.40gb")
        busy = next(i for i in part["status"]["instances"] if i["start"] == 4)

        # A process runs on 3g.40gb@4 (no claim names it): a layout without it keeps it, and says why.
        sim_nvml.attach_process(busy["migUUID"], 4242)
        gen = await api.set_layout(gpu0, "7g.80gb@0")

        async def kept_for_process() -> dict[str, Any] | None:
            p = await api.partition(gpu0)
            if not stable_at(p, gen) or p is None or layout_of(p) != "3g.40gb@4":
                return None
            return p

        p = await eventually(kept_for_process, "instance with a process kept, the other destroyed")
        (inst,) = p["status"]["instances"]
        assert inst["state"] == "in-use" and inst["migUUID"] == busy["migUUID"]
        assert "process" in (condition(p, "Ready") or {})["message"]
        assert layout(agent, 0) == "3g.40gb@4"
        # The process exits: the reshape completes.
        sim_nvml.detach_process(busy["migUUID"], 4242)
        p = await eventually(lambda: _stable(api, gpu0, gen, ready=True), "gpu0 at 7g.80gb")
        assert layout_of(p) == "7g.80gb@0"

        # GPU 1 falls off the bus: Degraded, its devices unpublished; back again: Stable.
        gen1 = await api.set_layout(gpu1, "1g.10gb@0")
        await eventually(lambda: _stable(api, gpu1, gen1, ready=True), "gpu1 at 1g.10gb@0")
        sim_nvml.set_gpu_lost(1)

        async def lost() -> dict[str, Any] | None:
            p = await api.partition(gpu1)
            return p if p and p["status"].get("phase") == "Degraded" else None

        p = await eventually(lost, "gpu1 Degraded")
        healthy = condition(p, "Healthy") or {}
        assert healthy["status"] == "False" and healthy["reason"] == "GpuLost"
        assert set(await api.published(node)) == {"gpu0-7g80gb-s0"}
        assert (await api.partition(gpu0) or {})["status"]["phase"] == "Stable"
        sim_nvml.set_gpu_lost(1, False)
        await eventually(lambda: _stable(api, gpu1, gen1, ready=True), "gpu1 back")
        assert set(await api.published(node)) == {"gpu0-7g80gb-s0", "gpu1-1g10gb-s0"}
        text = generate_latest(agent.metrics.registry).decode()
        errors = "dynamig_nvml_errors_total"
        # The loss is seen where the round was when it happened: discovering GPUs or listing their instances.
        lost_errors = [
            sample(text, errors, Hostname=node, operation=op, error="GpuIsLost")
            for op in ("discover", "list-instances")
        ]
        assert any(lost_errors), lost_errors


async def test_a_gpupartition_of_another_gpu_is_refused_until_deleted(
    crd: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Callable[..., str],
    sim_nvml: ModuleType,
) -> None:
    """GPUs are identified by UUID: after a GPU swap, index 0 is another physical GPU and its GpuPartition
    (spec and status.uuid of the old one) is not applied to it; deleting the GpuPartition adopts the new
    GPU."""
    api = Api(kube_api)
    node = make_node("swap", labels={"dynamig.io/managed": "true"})
    sim_nvml.configure(gpus=["A100-80GB"], state_file=None, seed="before-swap")
    async with agent_running(kube_api, node, sim_nvml, agent_settings(node)):
        await eventually(lambda: _all_stable(api, node, 1), "GpuPartition created")
        gen = await api.set_layout(f"{node}-gpu0", "7g.80gb@0")
        first = await eventually(lambda: _stable(api, f"{node}-gpu0", gen, ready=True), "layout applied")
    old_uuid = first["status"]["uuid"]

    sim_nvml.configure(gpus=["A100-80GB"], state_file=None, seed="after-swap")  # a new board, no instances
    async with agent_running(kube_api, node, sim_nvml, agent_settings(node)):

        async def refused() -> dict[str, Any] | None:
            p = await api.partition(f"{node}-gpu0")
            ok = p is not None and (condition(p, "Managed") or {}).get("reason") == "GpuReplaced"
            return p if ok else None

        p = await eventually(refused, "GpuPartition of the old GPU refused")
        assert p["status"]["uuid"] == old_uuid and p["status"]["phase"] == "Degraded"
        assert old_uuid in (condition(p, "Ready") or {})["message"]
        await asyncio.sleep(1.0)
        assert await api.published(node) == {}
        assert [e.kind for e in sim_nvml.history()] == []  # nothing was created on the new GPU

        name = f"{node}-gpu0"
        await api.custom.delete_cluster_custom_object("dynamig.io", "v1alpha1", "gpupartitions", name)

        async def adopted() -> dict[str, Any] | None:
            p = await api.partition(f"{node}-gpu0")
            if p is None or not stable_at(p) or p["status"].get("uuid") in (None, old_uuid):
                return None
            return p

        p = await eventually(adopted, "new GPU adopted after the GpuPartition was deleted")
        assert p["spec"].get("layout", []) == [] and [e.kind for e in sim_nvml.history()] == []


def _probe(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


async def test_a_hung_reconcile_round_fails_the_liveness_probe(
    crd: ControlPlane, kube_api: client.ApiClient, make_node: Callable[..., str], tmp_path: Path
) -> None:
    """The agent process's /healthz and /readyz: ready after its first round; a round stuck in NVML (a GI
    create that takes 30 s here) fails liveness once it is older than --liveness-max-round-age, with the
    reason; /metrics is served by the same loop."""
    api = Api(kube_api)
    node = make_node("health", labels={"dynamig.io/managed": "true"})
    name = f"{node}-gpu0"
    state, log = tmp_path / "simnvml.json", tmp_path / "agent.log"
    flags = ("--metrics-port", "0", "--metrics-address", "127.0.0.1", "--liveness-max-round-age", "3")
    proc = start_agent_process(crd, node, "A100-80GB:1", state, log, "--sim-create-latency", "30", *flags)
    try:
        await eventually(lambda: api.partition(name), "GpuPartition of the agent process", within_s=60)
        port = int(re.findall(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log.read_text())[-1])
        base = f"http://127.0.0.1:{port}"
        assert (await asyncio.to_thread(_probe, f"{base}/healthz"))[0] == 200

        async def ready() -> bool | None:  # the GpuPartition appears during the first round, not after it
            return True if (await asyncio.to_thread(_probe, f"{base}/readyz"))[0] == 200 else None

        await eventually(ready, "/readyz once the first round finished", within_s=30, every_s=0.2)
        assert "dynamig_build_info" in await asyncio.to_thread(_http_get, f"{base}/metrics")

        await api.set_layout(name, "1g.10gb@0")  # the round that creates it blocks in NVML for 30 s
        t0 = time.monotonic()

        async def failing() -> dict[str, Any] | None:
            code, body = await asyncio.to_thread(_probe, f"{base}/healthz")
            return body if code == 503 else None

        body = await eventually(failing, "/healthz failing on the stuck round", within_s=20, every_s=0.5)
        print(f"\n/healthz failed {time.monotonic() - t0:.1f}s into a stuck round: {body['checks']}")
        assert "no reconcile round finished" in body["checks"]["reconcile-loop"]
        assert (await asyncio.to_thread(_probe, f"{base}/readyz"))[0] == 503
    finally:
        kill(proc)


class _BrokenGpuAgent(NodeAgent):
    """An agent whose work on GPU 1 raises what no API or NVML error is (a bug, a state nobody foresaw)."""

    async def _reconcile_gpu(self, gpu: Any, *args: Any, **kwargs: Any) -> Any:
        if gpu.index == 1:
            raise ValueError("an unforeseen state")
        return await super()._reconcile_gpu(gpu, *args, **kwargs)


async def test_a_gpu_whose_round_raises_does_not_stop_the_nodes_other_gpus(
    crd: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Callable[..., str],
    sim_nvml: ModuleType,
) -> None:
    api = Api(kube_api)
    node = make_node("onebroken", labels={"dynamig.io/managed": "true"})
    devices = NvmlDevices(sim_nvml, load_catalog())
    devices.init()
    try:
        agent = _BrokenGpuAgent(
            agent_settings(node), KubeApi(kube_api), devices, AgentMetrics(CollectorRegistry(), node)
        )
        await agent.reconcile_once()  # creates both GpuPartitions; GPU 1's round raises
        await agent.reconcile_once()  # does not raise: the round went on with GPU 0
        gen = await api.set_layout(f"{node}-gpu0", "7g.80gb@0")
        await agent.reconcile_once()
        await agent.reconcile_once()
        p0, p1 = await api.partition(f"{node}-gpu0"), await api.partition(f"{node}-gpu1")
        assert stable_at(p0, gen) and layout_of(p0 or {}) == "7g.80gb@0", p0
        ready = condition(p1 or {}, "Ready") or {}
        assert (ready.get("reason"), (p1 or {})["status"]["phase"]) == ("ReconcileError", "Degraded"), p1
        assert "an unforeseen state" in ready["message"]
        assert set(await api.published(node)) == {"gpu0-7g80gb-s0"}, "GPU 1 is offered to nobody"
        errors = agent.metrics.registry.get_sample_value("dynamig_reconcile_errors_total", {"Hostname": node})
        assert errors == 4
    finally:
        devices.shutdown()


async def test_a_layout_nvml_always_refuses_backs_off_then_is_reported_failed_with_a_way_out(
    crd: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Callable[..., str],
    sim_nvml: ModuleType,
) -> None:
    # NVML refuses every create of the GPU's spec.layout (as for a placement held by something dynamig cannot
    # see). The agent tries again on a doubling back-off (rounds in between touch nothing), then reports the
    # GPU Degraded with Ready=False LayoutFailed, the error and what to do; once NVML accepts, a retry applies
    # the layout. The agent's clock is the test's, so the back-off is stepped through without waiting it out.
    api = Api(kube_api)
    node = make_node("failing", labels={"dynamig.io/managed": "true"})
    devices = NvmlDevices(sim_nvml, load_catalog())
    devices.init()
    now = [1000.0]
    agent = NodeAgent(
        agent_settings(node), KubeApi(kube_api), devices, AgentMetrics(CollectorRegistry(), node),
        clock=lambda: now[0],
    )  # fmt: skip
    name = f"{node}-gpu0"
    three = load_catalog().model("H100-80GB").profile("3g.40gb")

    def refused() -> float:
        return (
            agent.metrics.registry.get_sample_value(
                "dynamig_reshape_operations_total",
                {"Hostname": node, "operation": "create", "result": "error"},
            )
            or 0.0
        )

    try:
        await agent.reconcile_once()  # the GpuPartitions
        sim_nvml.fail_next(
            "nvmlDeviceCreateGpuInstanceWithPlacement", sim_nvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
            times=1000, profileId=three.profile_id,
        )  # fmt: skip
        gen = await api.set_layout(name, "3g.40gb@0")
        waits = []
        for attempt in range(1, 6):
            await agent.reconcile_once()
            assert refused() == attempt
            await agent.reconcile_once()  # within the back-off: NVML is not asked again
            assert refused() == attempt
            part = await api.partition(name) or {}
            waits.append(agent.reshaper.attempts[devices.gpu(0).uuid].retry_at - now[0])
            now[0] += waits[-1]
        assert waits == [2.0, 4.0, 8.0, 16.0, 32.0]
        ready = condition(part, "Ready") or {}
        assert part["status"]["phase"] == "Degraded" and ready.get("reason") == "LayoutFailed", part["status"]
        assert ready["observedGeneration"] == gen
        assert "failed 5 times in a row" in ready["message"] and "InsufficientResources" in ready["message"]
        assert "write another spec.layout" in ready["message"], ready
        failed = await event_posted(api.core, "default", name, "LayoutFailed", within_s=10)
        assert [e["type"] for e in failed] == ["Warning"], failed

        sim_nvml.clear_failures()  # whatever NVML refused is gone: the next retry applies the layout
        await agent.reconcile_once()
        await agent.reconcile_once()
        part = await api.partition(name) or {}
        assert stable_at(part, gen) and layout_of(part) == "3g.40gb@0", part["status"]
        assert devices.gpu(0).uuid not in agent.reshaper.attempts
    finally:
        devices.shutdown()
