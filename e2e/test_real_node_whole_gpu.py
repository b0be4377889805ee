"""Pods that run on whole GPUs: a real kubelet and containerd give a container one GPU whose MIG mode is off.

Real: the control plane (etcd, kube-apiserver, kube-scheduler with DRA allocation, kube-controller-manager),
a kubelet and containerd 2.x with runc (CDI on), the pause and busybox images (built here, imported into
containerd), the dynamig agent as its own process (the whole-GPU devices ``gpu<index>`` it publishes, the
kubelet DRA plugin registered through the kubelet's plugin-registration socket, CDI specs read by
containerd's CDI cache). Simulated: the GPUs (simnvml: two H100-80GB whose MIG mode is off, seeded in the
node's state file before its agent starts; the file's event history is the ground truth for what was cut and
switched) and the NVIDIA driver's files, written as real character devices (major 195 for the GPUs) so runc
creates them in the container. The container lists its NVIDIA device nodes with their numbers and prints its
environment; the test reads that from the pod's log through the API server and the kubelet.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.agent.plugin import cdi
from dynamig.demo.cluster import allocated_device, device_plugin_pod
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.node import ContainerReport, RealNode, runnable
from dynamig.devcluster.pytest_plugin import running_real_node
from dynamig.kube.devices import whole_device_class
from real_node_scenario import NodeScenario, node_scenario, report_pod

pytestmark = pytest.mark.controlplane

WHOLE_GPUS = "H100-80GB:2"
GPU_NODE = re.compile(r"/dev/nvidia\d+")


@pytest.fixture(scope="module")
def whole_node(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[RealNode]:
    """A real node (kubelet + containerd) whose agent runs over two H100-80GB with MIG mode off."""
    with running_real_node(control_plane, request, WHOLE_GPUS, mig_enabled=False, prefix="whole") as node:
        yield node


class WholeScenario(NodeScenario):
    """A test's reads and writes against the node's whole GPUs."""

    async def published(self) -> dict[str, dict[str, Any]] | None:
        """The node's whole-GPU GpuPartitions once the agent reports both free and published."""
        parts = {}
        for index in (0, 1):
            try:
                part = await self.k.partition(f"{self.node.name}-gpu{index}")
            except ApiException:
                return None
            whole = (part.get("status") or {}).get("wholeGpu") or {}
            if whole.get("state") != "free" or not whole.get("published"):
                return None
            parts[f"gpu{index}"] = part
        return parts

    async def run_whole(self, name: str) -> None:
        await self.k.core.create_namespaced_pod(self.k.ns, report_pod(name, self.node.name, "whole"))

    async def device_of(self, pod: str) -> str:
        device = allocated_device(await self.claim(pod))
        assert device is not None and re.fullmatch(r"gpu\d", device), device
        return device

    async def partition_of(self, device: str) -> dict[str, Any]:
        return await self.k.partition(f"{self.node.name}-{device}")

    def minor(self, device: str) -> int:
        """The GPU's minor number, as the simulated NVML (and so the driver's /dev entries) gives it."""
        index = int(device.removeprefix("gpu"))
        gpu = json.loads(self.node.nvml_state.read_text())["gpus"][index]
        return int(gpu["minor"] if gpu.get("minor") is not None else gpu["index"])

    def expected_whole_devices(self, device: str) -> dict[str, str]:
        """The device nodes a container of the whole GPU ``device`` must get: the control nodes of the base
        spec and the GPU's own node, with the majors the node's driver lists. Side effect: reads files."""
        devices = (self.node.proc_root / "devices").read_text()
        nvidia_major = cdi.parse_char_major(devices, "nvidia")
        uvm_major = cdi.parse_char_major(devices, "nvidia-uvm")
        minor = self.minor(device)
        return {
            f"/dev/nvidia{minor}": f"{nvidia_major}:{minor}",
            "/dev/nvidiactl": f"{nvidia_major}:255",
            "/dev/nvidia-modeset": f"{nvidia_major}:254",
            "/dev/nvidia-uvm": f"{uvm_major}:0",
            "/dev/nvidia-uvm-tools": f"{uvm_major}:1",
        }

    async def check_sees_its_gpu(self, pod: str, got: ContainerReport) -> tuple[str, dict[str, Any]]:
        """The container saw exactly its allocated GPU (node, numbers, UUID) and the base spec's files; the
        GPU's GpuPartition says in-use. Returns the device and its GpuPartition."""
        device = await self.device_of(pod)

        async def prepared() -> dict[str, Any] | None:
            # The agent writes its status after the kubelet's prepare returns: wait for it to say in-use.
            part = await self.partition_of(device)
            return part if (part["status"].get("wholeGpu") or {}).get("state") == "in-use" else None

        part = await eventually(prepared, f"{device} in-use in its GpuPartition", within_s=30)
        st = part["status"]
        assert st["migMode"] == "Disabled", st
        assert st["wholeGpu"]["deviceName"] == device, st["wholeGpu"]
        minor = self.minor(device)
        assert [d for d in got.devices if GPU_NODE.fullmatch(d)] == [f"/dev/nvidia{minor}"], got.devices
        assert got.capability_nodes == [], got.devices
        assert got.devices == self.expected_whole_devices(device), (pod, got.devices)
        assert got.env["DYNAMIG_GPU_UUIDS"] == st["uuid"], (pod, got.env, st["uuid"])
        assert "DYNAMIG_MIG_UUIDS" not in got.env, got.env
        # The node's base CDI spec (the toolkit's, simulated) applied too: its env and the driver files.
        assert got.env["NVIDIA_VISIBLE_DEVICES"] == "void", got.env
        assert "/usr/bin/nvidia-smi" in got.files, got.files
        return device, part

    async def finish_whole(self, pod: str, *, freed: bool = True) -> None:
        """Deletes the pod: its kubelet finishes it, NodeUnprepareResources removes the claim's CDI spec, and
        (``freed``: when no pod waits for it) the GPU's GpuPartition says free again."""
        uid = (await self.claim(pod))["metadata"]["uid"]
        device = await self.device_of(pod)
        spec = cdi.spec_path(self.node.cdi_dir, uid)
        assert spec.exists(), f"the claim's CDI spec {spec} is where containerd reads it"
        await self.k.core.delete_namespaced_pod(pod, self.k.ns)

        async def pod_gone() -> bool | None:
            try:
                await self.k.core.read_namespaced_pod(pod, self.k.ns)
            except ApiException as e:
                return True if e.status == 404 else None
            return None

        await eventually(pod_gone, f"pod {pod} deleted by its kubelet", within_s=60, every_s=0.3)
        assert not spec.exists(), "NodeUnprepareResources removes the claim's CDI spec"
        if not freed:
            return

        async def free() -> bool | None:
            whole = (await self.partition_of(device))["status"]["wholeGpu"]
            return True if whole["state"] == "free" and not whole.get("claims") else None

        await eventually(free, f"{pod}'s GPU {device} free again", within_s=60, every_s=0.3)

    def check_mig_untouched(self) -> None:
        """No MIG instance was created or destroyed and MIG mode was never switched: both GPUs' mode off."""
        state = json.loads(self.node.nvml_state.read_text())
        touched = [
            e
            for e in state["history"]
            if e["kind"].startswith(("create", "destroy")) or e["kind"] == "set-mig-mode"
        ]
        assert touched == [], touched
        assert [(g["mig_current"], g["mig_pending"]) for g in state["gpus"]] == [(0, 0), (0, 0)], state[
            "gpus"
        ]


@pytest.fixture
async def scenario(
    whole_node: RealNode, kube_api: client.ApiClient, namespace: str
) -> AsyncIterator[WholeScenario]:
    """The test's scenario; afterwards its pods are deleted and waited for (``node_scenario``)."""
    async with node_scenario(whole_node, kube_api, namespace):
        s = WholeScenario(kube_api, namespace, whole_node)
        await eventually(s.published, "both whole GPUs free and published", within_s=90)
        await s.k.claim_template("whole", ["whole"])
        yield s


async def test_a_pod_sees_exactly_its_one_whole_gpu(scenario: WholeScenario) -> None:
    s = scenario
    t0 = time.monotonic()
    await s.run_whole("trainer")
    got = await eventually(functools.partial(s.reported, "trainer"), "pod trainer reporting", within_s=120)
    took = time.monotonic() - t0
    device, part = await s.check_sees_its_gpu("trainer", got)
    print(
        f"\nreal node: whole-GPU pod created -> container reporting in {took:.1f}s: {device} "
        f"{part['status']['uuid']} -> {sorted(got.devices)}"
    )
    await s.finish_whole("trainer")
    s.check_mig_untouched()


async def test_two_pods_take_both_gpus_and_a_third_waits_for_one(scenario: WholeScenario) -> None:
    s = scenario
    t0 = time.monotonic()
    for name in ("train-a", "train-b"):
        await s.run_whole(name)
    seen = {
        name: await eventually(functools.partial(s.reported, name), f"pod {name} reporting", within_s=120)
        for name in ("train-a", "train-b")
    }
    print(f"\nreal node: two whole-GPU pods created -> both reporting in {time.monotonic() - t0:.1f}s")
    devices = {}
    for name, got in seen.items():
        devices[name], part = await s.check_sees_its_gpu(name, got)
        print(f"  {name}: {devices[name]} {part['status']['uuid']} -> {sorted(got.devices)}")
    assert sorted(devices.values()) == ["gpu0", "gpu1"]  # one GPU each, never the same one twice
    uuids = {seen[n].env["DYNAMIG_GPU_UUIDS"] for n in seen}
    assert len(uuids) == 2, uuids

    # Both GPUs are taken: a third waits, and is not run.
    await s.run_whole("train-c")
    await eventually(functools.partial(s.k.unschedulable, "train-c"), "the third pod Unschedulable")
    assert await s.reported("train-c") is None

    # One ends: its claim is unprepared and its GPU goes to the pod that waited.
    t0 = time.monotonic()
    await s.finish_whole("train-a", freed=False)  # train-c takes the GPU at once: never seen free
    got = await eventually(functools.partial(s.reported, "train-c"), "the waiting pod running", within_s=120)
    print(f"real node: train-a deleted -> train-c reporting on the freed GPU in {time.monotonic() - t0:.1f}s")
    device, _ = await s.check_sees_its_gpu("train-c", got)
    assert device == devices["train-a"]
    assert got.env["DYNAMIG_GPU_UUIDS"] == seen["train-a"].env["DYNAMIG_GPU_UUIDS"]

    # Nobody waits any more: each deletion gives its GPU back, free.
    await s.finish_whole("train-b")
    await s.finish_whole("train-c")
    assert await s.published() is not None
    s.check_mig_untouched()


async def test_a_pod_written_for_the_device_plugin_runs_on_a_whole_gpu(scenario: WholeScenario) -> None:
    """``nvidia.com/gpu: 1`` in the limits, no claim: the scheduler books a whole GPU from the DeviceClass
    ``gpu.dynamig.io`` (DRAExtendedResource: it makes the pod's claim), the kubelet prepares that claim
    through dynamig's plugin, and the container gets the GPU's one node and UUID; deleting it frees it."""
    s = scenario
    try:
        await s.k.resource.create_device_class(whole_device_class())
    except ApiException as exc:
        if exc.status != 409:  # made by another test or an operator
            raise
    pod = runnable(
        device_plugin_pod("legacy", {"kubernetes.io/hostname": s.node.name}, resource="nvidia.com/gpu")
    )
    t0 = time.monotonic()
    await s.k.core.create_namespaced_pod(s.k.ns, pod)
    got = await eventually(functools.partial(s.reported, "legacy"), "the nvidia.com/gpu pod reporting", 120)
    print(f"\nreal node: nvidia.com/gpu pod created -> container reporting in {time.monotonic() - t0:.1f}s")
    claim = await s.claim("legacy")
    assert any(r["kind"] == "Pod" for r in claim["metadata"]["ownerReferences"])  # the scheduler's claim
    await s.check_sees_its_gpu("legacy", got)
    await s.finish_whole("legacy")
    s.check_mig_untouched()
