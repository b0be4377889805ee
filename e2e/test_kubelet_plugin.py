"""The kubelet DRA plugin end to end: a gRPC client plays the kubelet over real unix sockets.

Real: etcd, kube-apiserver, kube-scheduler and kube-controller-manager (the scheduler allocates every claim
used here from ResourceSlices, and binds the pods); the node agent (``NodeAgent``: adopts the MIG instances,
creates the GpuPartition, publishes the node's ResourceSlices; ``AgentMigInstances`` behind the plugin); the
plugin's gRPC servers on unix sockets, its API reads, CDI writer and checkpoint; the NVML code path
(``NvmlDevices``) with the pynvml API.
Simulated: the GPUs (``dynamig.backends.simnvml``, an A100-80GB with MIG enabled); the NVIDIA kernel
driver's ``/dev`` nodes and ``/proc/driver/nvidia/capabilities`` files, and the node CDI spec NVIDIA's
container toolkit would generate (with stand-ins of the driver files it names), written by
``SimulatedDriverFiles`` into a temporary directory from what NVML reports; the kubelet (this test's gRPC
client) and the Node (registered through the API; pods are bound but never run).

Scenarios: registration (GetInfo, NotifyRegistrationStatus); prepare, repeat (v1 and v1beta1), restart the
plugin and prepare again, unprepare (instance kept, marked free); one batch with a claim of another node, a
missing claim, a claim with a stale UID and a good claim (one error per claim); a claim whose instance was
destroyed (re-created at prepare); a claim whose placement is now taken (clear error); a restart that
cleans up a claim deleted meanwhile; a two-device claim; a corrupt checkpoint; and the same calls made by a
Go client built from k8s.io/kubelet's own generated stubs (wire compatibility without trusting our .proto
copies; skipped only where no Go toolchain or module cache exists).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

from dynamig.agent.bindings.stranded import StrandedPods
from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.devices_service import AgentMigInstances
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml.device import GpuInfo, NvmlDevices
from dynamig.agent.nvml.simulated_driver import (
    SimulatedDriverFiles,
    SimulatedDriverInstances,
    ci_cap_minor,
    gi_cap_minor,
)
from dynamig.agent.plugin import MigInstances, PluginServer, PluginSettings, serve_plugin
from dynamig.agent.plugin import cdi as cdi_files
from dynamig.agent.plugin.checkpoint import CheckpointError, CheckpointStore
from dynamig.agent.plugin.instances import InstanceError
from dynamig.agent.plugin.stubs import Stubs, load_stubs
from dynamig.backends import simnvml
from dynamig.demo.cluster import claim_pod, ensure_device_class, exactly, resource_claim
from dynamig.devcluster import ControlPlane, eventually
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance, device_name
from dynamig.kube.devices import MigDevice
from dynamig.kube.names import MANAGED_NODE_LABEL
from dynamig.kube.pods import REASON_RESCHEDULED, REASON_STRANDED
from dynamig.kube.slices import build_resource_slices

pytestmark = pytest.mark.controlplane

DRIVER = "mig.dynamig.io"
REPO = Path(__file__).resolve().parents[1]
# The A100-80GB layout every test node starts with (adopted by the agent as the GpuPartition's spec).
LAYOUT = (
    PlacedInstance(0, "2g.20gb"),
    PlacedInstance(2, "1g.10gb"),
    PlacedInstance(3, "1g.10gb"),
    PlacedInstance(4, "3g.40gb"),
)
T = TypeVar("T")


# --- the kubelet's side -----------------------------------------------------------------------------------


class Kubelet:
    """What the kubelet does with a DRA plugin, over the same unix sockets and wire messages."""

    def __init__(self, settings: PluginSettings, stubs: Stubs) -> None:
        self.settings = settings
        self.stubs = stubs

    @contextlib.asynccontextmanager
    async def _channel(self, socket: Path) -> AsyncIterator[grpc.aio.Channel]:
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            yield channel

    async def register(self) -> Any:
        """GetInfo on the registration socket, then NotifyRegistrationStatus(registered)."""
        reg, reg_grpc = self.stubs.registration, self.stubs.registration_grpc
        async with self._channel(self.settings.registration_socket) as ch:
            stub = reg_grpc.RegistrationStub(ch)
            info = await stub.GetInfo(reg.InfoRequest(), timeout=10)
            await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=10)
        return info

    async def prepare(self, *claims: tuple[str, str, str], version: str = "v1") -> dict[str, Any]:
        """NodePrepareResources for (namespace, name, uid) claims; the per-claim answers by UID."""
        pb = self.stubs.dra_v1 if version == "v1" else self.stubs.dra_v1beta1
        grpc_mod = self.stubs.dra_v1_grpc if version == "v1" else self.stubs.dra_v1beta1_grpc
        request = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        async with self._channel(self.settings.dra_socket) as ch:
            response = await grpc_mod.DRAPluginStub(ch).NodePrepareResources(request, timeout=30)
        return dict(response.claims)

    async def unprepare(self, *claims: tuple[str, str, str]) -> dict[str, str]:
        pb, grpc_mod = self.stubs.dra_v1, self.stubs.dra_v1_grpc
        request = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        async with self._channel(self.settings.dra_socket) as ch:
            response = await grpc_mod.DRAPluginStub(ch).NodeUnprepareResources(request, timeout=30)
        return {uid: r.error for uid, r in response.claims.items()}


def devices_of(answer: Any) -> list[tuple[list[str], str, str, list[str]]]:
    return [
        (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in answer.devices
    ]


# --- the node: simulated GPUs, the agent, the plugin -------------------------------------------------------


@dataclass
class Node:
    name: str
    root: Path
    agent: NodeAgent
    devices: NvmlDevices
    files: SimulatedDriverFiles
    instances: MigInstances
    settings: PluginSettings
    kubelet: Kubelet
    stranded: StrandedPods
    server: PluginServer | None = None

    @property
    def gpu(self) -> GpuInfo:
        return self.devices.gpu(0)

    async def start_plugin(self, api: client.ApiClient) -> PluginServer:
        self.server = await serve_plugin(self.settings, self.instances, api, stranded=self.stranded)
        return self.server

    async def stop_plugin(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None

    def mig_uuid(self, placed: PlacedInstance) -> str | None:
        for inst in self.devices.instances(self.gpu):
            if inst.placed == placed:
                return inst.mig_uuid
        return None


@pytest.fixture(scope="session")
def crds(control_plane: ControlPlane) -> None:
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    control_plane.kubectl(
        "wait", "--for=condition=Established", "crd/gpupartitions.dynamig.io", "--timeout=60s"
    )


@pytest.fixture
async def node(crds: None, kube_api: client.ApiClient, make_node: Callable[..., str]) -> AsyncIterator[Node]:
    """A managed node with one simulated A100-80GB carrying ``LAYOUT``, its agent, and its plugin started."""
    async with node_with(kube_api, make_node, mig=True) as n:
        yield n


@pytest.fixture
async def whole_node(
    crds: None, kube_api: client.ApiClient, make_node: Callable[..., str]
) -> AsyncIterator[Node]:
    """The same with the GPU's MIG mode off: one whole GPU, ``gpu0``."""
    async with node_with(kube_api, make_node, mig=False) as n:
        yield n


@contextlib.asynccontextmanager
async def node_with(
    kube_api: client.ApiClient, make_node: Callable[..., str], *, mig: bool
) -> AsyncIterator[Node]:
    from dynamig.backends.nvml import load_nvml

    await ensure_device_class(client.ResourceV1Api(kube_api))
    # Short path: AF_UNIX socket paths are limited to 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="dmkp", dir="/tmp"))
    name = make_node("kp", labels={MANAGED_NODE_LABEL: "true"})
    nvml = load_nvml("simulated")
    nvml.configure(gpus=["A100-80GB"], state_file=root / "nvml-state.json", mig_enabled=mig)
    devices = NvmlDevices(nvml, load_catalog())
    devices.init()
    gpu = devices.gpu(0)
    assert gpu.mig_enabled == mig
    for placed in LAYOUT if mig else ():
        devices.create(gpu, placed)
    agent = NodeAgent(
        AgentSettings(node=name, settle_seconds=0.5),
        KubeApi(kube_api),
        devices,
        AgentMetrics(CollectorRegistry(), name),
    )
    await agent.reconcile_once()  # adopts the instances, creates the GpuPartition, publishes the slice
    settings = PluginSettings(
        node_name=name,
        kubelet_root=root / "kubelet",
        cdi_root=root / "cdi",
        dev_root=root / "dev",
        proc_root=root / "proc",
    )
    # The base spec goes where the settings expect NVIDIA's: <cdi root>/nvidia.yaml.
    files = SimulatedDriverFiles(
        devices, proc_root=root / "proc", dev_root=root / "dev", base_spec=settings.base_spec_path
    )
    files.sync()
    n = Node(
        name=name,
        root=root,
        agent=agent,
        devices=devices,
        files=files,
        instances=SimulatedDriverInstances(AgentMigInstances(agent), files),
        settings=settings,
        kubelet=Kubelet(settings, load_stubs()),
        stranded=StrandedPods(agent.api, name, after_s=3600.0),  # the give-back test shortens it
    )
    await n.start_plugin(kube_api)
    try:
        yield n
    finally:
        await n.stop_plugin()
        await agent.publisher.remove()
        for part in await agent.api.list_partitions(f"dynamig.io/node={name}"):
            await agent.api.delete_partition(part["metadata"]["name"])
        devices.shutdown()
        shutil.rmtree(root, ignore_errors=True)


async def allocate(
    kube_api: client.ApiClient,
    namespace: str,
    node: str,
    placed: PlacedInstance,
    name: str | None = None,
) -> tuple[str, str, str]:
    """A ResourceClaim for exactly the device at ``placed`` on GPU 0, allocated by the scheduler for a pod
    pinned to ``node``. Returns (namespace, claim name, claim UID)."""
    attr = f'device.attributes["{DRIVER}"]'
    selector = f'{attr}.profile == "{placed.profile}" && {attr}.placementStart == {placed.start}'
    ref, devices = await allocate_selector(kube_api, namespace, node, selector, name=name)
    assert devices == [device_name(0, placed.profile, placed.start)]
    return ref


async def allocate_selector(
    kube_api: client.ApiClient,
    namespace: str,
    node: str,
    selector: str,
    *,
    count: int = 1,
    name: str | None = None,
) -> tuple[tuple[str, str, str], list[str]]:
    """A ResourceClaim for ``count`` devices matching the CEL ``selector``, allocated by the scheduler for a
    pod pinned to ``node``. Returns ((namespace, claim name, claim UID), allocated device names)."""
    core, resource = client.CoreV1Api(kube_api), client.ResourceV1Api(kube_api)
    claim_name = name or f"c-{uuid.uuid4().hex[:8]}"
    await resource.create_namespaced_resource_claim(
        namespace, resource_claim(claim_name, exactly(selector, count))
    )
    await core.create_namespaced_pod(
        namespace,
        claim_pod(f"p-{claim_name}", {"kubernetes.io/hostname": node}, claim=claim_name),
    )

    async def allocated() -> client.ResourceV1ResourceClaim | None:
        c = await resource.read_namespaced_resource_claim(claim_name, namespace)
        return c if c.status and c.status.allocation else None

    claim = await eventually(allocated, f"claim {claim_name} allocated by the scheduler")
    results = claim.status.allocation.devices.results
    assert {(r.driver, r.pool) for r in results} == {(DRIVER, node)}
    return (namespace, claim_name, claim.metadata.uid), [r.device for r in results]


def host_node_exists(node: Node, host_path: str) -> bool:
    """The spec's host path is a (simulated) device node under the node's stand-in /dev."""
    return host_path.startswith(f"{node.root / 'dev'}/") and Path(host_path).exists()


def all_exist(paths: list[str]) -> bool:
    return all(Path(p).exists() for p in paths)


def read_base_spec_edits(node: Node) -> dict[str, Any]:
    """The spec-level containerEdits of the node's (simulated) NVIDIA CDI spec."""
    edits: dict[str, Any] = yaml.safe_load(node.settings.base_spec_path.read_text())["containerEdits"]
    return edits


def read_spec(node: Node, claim_uid: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(cdi_files.spec_path(node.settings.cdi_root, claim_uid).read_text())
    return data


# --- scenarios ---------------------------------------------------------------------------------------------


async def test_registration_over_the_registry_socket(node: Node) -> None:
    assert node.server is not None
    info = await node.kubelet.register()
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == str(node.root / "kubelet/plugins/mig.dynamig.io/dra.sock")
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert node.settings.registration_socket == node.root / "kubelet/plugins_registry/mig.dynamig.io-reg.sock"
    await asyncio.wait_for(node.server.registered.wait(), 5)
    assert node.server.registration_error == ""


async def test_prepare_repeat_restart_unprepare(
    node: Node, kube_api: client.ApiClient, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    placed = PlacedInstance(2, "1g.10gb")
    dev = device_name(0, placed.profile, placed.start)
    ref = await allocate(kube_api, namespace, node.name, placed)
    uid = ref[2]
    expected_id = f"k8s.mig.dynamig.io/claim={uid}-{dev}"

    t0 = time.perf_counter()
    answer = (await node.kubelet.prepare(ref))[uid]
    first_prepare_s = time.perf_counter() - t0
    assert answer.error == ""
    assert devices_of(answer) == [(["gpu"], node.name, dev, [expected_id])]

    # The CDI spec hands the container exactly this MIG instance, and the driver as NVIDIA's node spec has it.
    spec = read_spec(node, uid)
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == "k8s.mig.dynamig.io/claim"
    [cdi_dev] = spec["devices"]
    assert f"k8s.mig.dynamig.io/claim={cdi_dev['name']}" == expected_id
    mig = next(i for i in node.devices.instances(node.gpu) if i.placed == placed)
    assert cdi_dev["containerEdits"]["env"] == [f"DYNAMIG_MIG_UUIDS={mig.mig_uuid}"]
    minor = node.gpu.minor
    assert minor is not None and mig.ci_id is not None
    nodes = cdi_dev["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in nodes] == [
        f"/dev/nvidia{minor}",
        f"/dev/nvidia-caps/nvidia-cap{gi_cap_minor(minor, mig.gi_id)}",
        f"/dev/nvidia-caps/nvidia-cap{ci_cap_minor(minor, mig.gi_id, mig.ci_id)}",
    ]
    assert all(host_node_exists(node, n["hostPath"]) for n in nodes)
    common = spec["containerEdits"]
    base = read_base_spec_edits(node)
    assert common["mounts"] == base["mounts"] and common["hooks"] == base["hooks"]
    assert "/usr/bin/nvidia-smi" in {m["containerPath"] for m in common["mounts"]}
    assert all_exist([m["hostPath"] for m in common["mounts"]] + [h["path"] for h in common["hooks"]])
    common_nodes = [n["path"] for n in common["deviceNodes"]]
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= set(common_nodes)
    assert all(host_node_exists(node, n["hostPath"]) for n in common["deviceNodes"])
    # The legacy NVIDIA hook sees no device to inject: CDI alone hands the slice over.
    assert [e for e in common["env"] if e.startswith("NVIDIA_VISIBLE_DEVICES=")] == [
        "NVIDIA_VISIBLE_DEVICES=void"
    ]
    assert dev in node.agent.prepared

    # Repeated, also through the v1beta1 service: the same answer.
    t0 = time.perf_counter()
    again = (await node.kubelet.prepare(ref))[uid]
    repeat_prepare_s = time.perf_counter() - t0
    assert devices_of(again) == devices_of(answer)
    beta = (await node.kubelet.prepare(ref, version="v1beta1"))[uid]
    assert beta.error == "" and devices_of(beta) == devices_of(answer)
    # Concurrent calls for the same claim agree, and a spec file that vanished (tmpfs /var/run/cdi after a
    # reboot of the runtime's view) is written again.
    cdi_files.spec_path(node.settings.cdi_root, uid).unlink()
    racing = await asyncio.gather(*(node.kubelet.prepare(ref) for _ in range(4)))
    assert all(devices_of(r[uid]) == devices_of(answer) for r in racing)
    assert read_spec(node, uid) == spec

    # A restarted plugin (new process state, same checkpoint) gives the same answer.
    await node.stop_plugin()
    assert not node.settings.dra_socket.exists() and not node.settings.registration_socket.exists()
    await node.start_plugin(kube_api)
    assert set(CheckpointStore(node.settings.checkpoint_path).load()) == {uid}
    restarted = (await node.kubelet.prepare(ref))[uid]
    assert devices_of(restarted) == devices_of(answer)

    # Unprepare: spec and checkpoint entry gone, the instance kept and no longer counted as prepared.
    assert await node.kubelet.unprepare(ref) == {uid: ""}
    assert not cdi_files.spec_path(node.settings.cdi_root, uid).exists()
    assert CheckpointStore(node.settings.checkpoint_path).load() == {}
    assert dev not in node.agent.prepared
    assert node.mig_uuid(placed) == mig.mig_uuid, "unprepare must not destroy the instance"
    assert await node.kubelet.unprepare(ref) == {uid: ""}, "unprepare is idempotent"
    with capsys.disabled():
        print(
            f"\nkubelet plugin: first prepare {first_prepare_s * 1000:.1f} ms, "
            f"repeated prepare {repeat_prepare_s * 1000:.1f} ms"
        )


async def test_claim_with_two_devices(node: Node, kube_api: client.ApiClient, namespace: str) -> None:
    """Two 1g.10gb instances for one request: both in the answer, each CDI device sees both UUIDs."""
    selector = f'device.attributes["{DRIVER}"].profile == "1g.10gb"'
    ref, names = await allocate_selector(kube_api, namespace, node.name, selector, count=2)
    assert sorted(names) == ["gpu0-1g10gb-s2", "gpu0-1g10gb-s3"]
    answer = (await node.kubelet.prepare(ref))[ref[2]]
    assert answer.error == ""
    assert sorted(d[2] for d in devices_of(answer)) == sorted(names)
    assert all(d[0] == ["gpu"] for d in devices_of(answer))
    uuids = sorted(u or "" for u in (node.mig_uuid(PlacedInstance(s, "1g.10gb")) for s in (2, 3)))
    spec = read_spec(node, ref[2])
    assert len(spec["devices"]) == 2
    for cdi_dev in spec["devices"]:
        [env] = cdi_dev["containerEdits"]["env"]
        assert sorted(env.removeprefix("DYNAMIG_MIG_UUIDS=").split(",")) == uuids
    assert await node.kubelet.unprepare(ref) == {ref[2]: ""}
    assert not {"gpu0-1g10gb-s2", "gpu0-1g10gb-s3"} & node.agent.prepared


async def test_a_whole_gpu_is_prepared_as_its_one_device_node(
    whole_node: Node, kube_api: client.ApiClient, namespace: str
) -> None:
    """MIG mode off: the scheduler allocates ``gpu0`` and the prepared CDI device is the GPU's node alone
    (``/dev/nvidia<minor>``, no capability nodes) with its UUID; a MIG placement on it is refused."""
    node = whole_node
    selector = f'device.attributes["{DRIVER}"].profile == "whole"'
    ref, names = await allocate_selector(kube_api, namespace, node.name, selector)
    assert names == ["gpu0"]
    uid = ref[2]
    answer = (await node.kubelet.prepare(ref))[uid]
    assert answer.error == ""
    assert devices_of(answer) == [(["gpu"], node.name, "gpu0", [f"k8s.mig.dynamig.io/claim={uid}-gpu0"])]
    [cdi_dev] = read_spec(node, uid)["devices"]
    assert cdi_dev["containerEdits"]["env"] == [f"DYNAMIG_GPU_UUIDS={node.gpu.uuid}"]
    nodes = cdi_dev["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in nodes] == [f"/dev/nvidia{node.gpu.minor}"]
    assert all(host_node_exists(node, n["hostPath"]) for n in nodes)
    assert "gpu0" in node.agent.prepared
    await node.agent.reconcile_once()
    part = await node.agent.api.get_partition(f"{node.name}-gpu0")
    assert part is not None
    assert part["status"]["wholeGpu"]["state"] == "in-use", part["status"]
    with pytest.raises(InstanceError, match="MIG mode is not enabled"):
        await node.instances.ensure("gpu0-1g10gb-s0")
    assert await node.kubelet.unprepare(ref) == {uid: ""}
    assert "gpu0" not in node.agent.prepared
    assert node.devices.instances(node.gpu) == []  # nothing was cut, nothing to destroy


async def test_corrupt_checkpoint_stops_the_plugin_from_starting(
    node: Node, kube_api: client.ApiClient
) -> None:
    await node.stop_plugin()
    path = node.settings.checkpoint_path
    path.write_bytes(b'{"version": "mig.dynamig.io/checkpoint/v1", "checksum": "sha256:0", "data": {}}')
    with pytest.raises(CheckpointError, match="checksum does not match"):
        await node.start_plugin(kube_api)
    assert not node.settings.dra_socket.exists() and not node.settings.registration_socket.exists()


async def test_one_error_per_claim_in_a_batch(
    node: Node, kube_api: client.ApiClient, namespace: str, make_node: Callable[..., str]
) -> None:
    resource = client.ResourceV1Api(kube_api)
    # Another node publishes its own device; the scheduler allocates a claim there.
    other = make_node("kp-other")
    a100 = load_catalog().model("A100-80GB")
    foreign = MigDevice(0, a100.profile("1g.10gb"), 0, a100.product_name, "GPU-other", "MIG-other")
    (slice_body,) = build_resource_slices(other, 1, [foreign.to_api()])
    await resource.create_resource_slice(slice_body)
    try:
        theirs = await allocate(kube_api, namespace, other, PlacedInstance(0, "1g.10gb"))
        ours = await allocate(kube_api, namespace, node.name, PlacedInstance(0, "2g.20gb"))
        missing = (namespace, "no-such-claim", str(uuid.uuid4()))
        stale = (ours[0], ours[1], str(uuid.uuid4()))

        answers = await node.kubelet.prepare(theirs, missing, stale, ours)
        assert set(answers) == {theirs[2], missing[2], stale[2], ours[2]}
        assert f"of another node's pool; this is node {node.name}" in answers[theirs[2]].error
        assert f"{other}/gpu0-1g10gb-s0" in answers[theirs[2]].error
        assert answers[missing[2]].error == f"ResourceClaim {namespace}/no-such-claim does not exist"
        assert "deleted and re-created" in answers[stale[2]].error
        assert answers[ours[2]].error == ""
        assert [d[2] for d in devices_of(answers[ours[2]])] == ["gpu0-2g20gb-s0"]
        # Failed claims leave nothing behind.
        assert cdi_files.spec_claim_uids(node.settings.cdi_root) == {ours[2]}
        assert set(CheckpointStore(node.settings.checkpoint_path).load()) == {ours[2]}
    finally:
        await resource.delete_resource_slice(slice_body["metadata"]["name"])


async def test_destroyed_instance_is_recreated_and_taken_placement_is_refused(
    node: Node, kube_api: client.ApiClient, namespace: str
) -> None:
    gpu = node.gpu
    # 1. The allocated instance was destroyed after allocation: prepare re-creates it at its placement.
    small = PlacedInstance(3, "1g.10gb")
    ref = await allocate(kube_api, namespace, node.name, small)
    old_uuid = node.mig_uuid(small)
    assert node.devices.destroy(gpu, small) is True
    node.files.sync()
    assert node.mig_uuid(small) is None
    answer = (await node.kubelet.prepare(ref))[ref[2]]
    assert answer.error == ""
    new = next(i for i in node.devices.instances(gpu) if i.placed == small)
    assert new.mig_uuid and new.ci_id is not None
    spec = read_spec(node, ref[2])
    assert spec["devices"][0]["containerEdits"]["env"] == [f"DYNAMIG_MIG_UUIDS={new.mig_uuid}"]
    assert old_uuid is not None

    # 2. The allocated placement is now held by a free instance (the scheduler allocated it from a slice
    # older than a retire): the last line of defence destroys the free one and creates the device.
    big = PlacedInstance(4, "3g.40gb")
    ref_big = await allocate(kube_api, namespace, node.name, big)
    assert node.devices.destroy(gpu, big) is True
    node.devices.create(gpu, PlacedInstance(4, "2g.20gb"))
    node.files.sync()
    answer = (await node.kubelet.prepare(ref_big))[ref_big[2]]
    assert answer.error == ""
    assert node.mig_uuid(PlacedInstance(4, "2g.20gb")) is None and node.mig_uuid(big)
    assert "gpu0-3g40gb-s4" in node.agent.prepared
    assert node.agent.metrics.bound_recovered.labels(node.name)._value.get() == 1
    await node.kubelet.unprepare(ref_big)

    # 3. Held by an instance a process uses: a clear per-claim error, nothing destroyed, nothing created.
    assert node.devices.destroy(gpu, big) is True
    intruder = node.devices.create(gpu, PlacedInstance(4, "2g.20gb"))
    simnvml.attach_process(intruder.mig_uuid, 4242)
    node.files.sync()
    answer = (await node.kubelet.prepare(ref_big))[ref_big[2]]
    simnvml.detach_process(intruder.mig_uuid, 4242)
    assert "in use" in answer.error
    assert "gpu0-3g40gb-s4" in answer.error
    assert "memory slices 4-7 of GPU 0" in answer.error and "2g.20gb at slice 4" in answer.error
    assert list(answer.devices) == []
    assert node.mig_uuid(big) is None and node.mig_uuid(PlacedInstance(4, "2g.20gb")) == intruder.mig_uuid
    assert not cdi_files.spec_path(node.settings.cdi_root, ref_big[2]).exists()
    assert "gpu0-3g40gb-s4" not in node.agent.prepared


async def test_a_pod_whose_device_stays_unpreparable_goes_back_to_its_controller(
    node: Node, kube_api: client.ApiClient, namespace: str
) -> None:
    # The last line of defence, second half (agent/bindings/stranded.py): a pod bound to a device whose slices
    # a busy instance holds. A pod no controller owns gets a Warning Event and stays; one a controller owns
    # and that never started is deleted (uid precondition) for the controller to create it again.
    core = client.CoreV1Api(kube_api)
    gpu, big = node.gpu, PlacedInstance(4, "3g.40gb")
    ref = await allocate(kube_api, namespace, node.name, big)
    pod = f"p-{ref[1]}"
    assert node.devices.destroy(gpu, big) is True
    intruder = node.devices.create(gpu, PlacedInstance(4, "2g.20gb"))
    simnvml.attach_process(intruder.mig_uuid, 4343)  # a workload outside DRA: busy, never destroyed
    node.files.sync()

    async def reasons() -> list[str]:
        events = await core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod}")
        return sorted(e.reason for e in events.items if e.reason.startswith("DeviceUnavailable"))

    try:
        # Within the bound: refused, nothing else happens.
        assert "in use" in (await node.kubelet.prepare(ref))[ref[2]].error
        assert await reasons() == []
        node.stranded.after_s = 0.0  # past the bound from now on
        assert "in use" in (await node.kubelet.prepare(ref))[ref[2]].error
        assert await reasons() == [REASON_STRANDED]
        assert (await core.read_namespaced_pod(pod, namespace)).metadata.deletion_timestamp is None

        # A ConfigMap stands in for the pod's controller (the garbage collector keeps the pod while it is).
        owner = await core.create_namespaced_config_map(namespace, {"metadata": {"name": f"owner-{pod}"}})
        owned = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": owner.metadata.name,
            "uid": owner.metadata.uid,
        }
        patch = {"metadata": {"ownerReferences": [owned | {"controller": True}]}}
        await core.patch_namespaced_pod(pod, namespace, patch)
        assert "in use" in (await node.kubelet.prepare(ref))[ref[2]].error

        # Deleted with its own grace period: with no kubelet here it stays Terminating, being deleted.
        gone = (await core.read_namespaced_pod(pod, namespace)).metadata.deletion_timestamp
        assert gone is not None, f"pod {pod} is not being deleted"
        assert await reasons() == sorted([REASON_STRANDED, REASON_RESCHEDULED])
        assert node.mig_uuid(PlacedInstance(4, "2g.20gb")) == intruder.mig_uuid  # nothing busy destroyed
    finally:
        simnvml.detach_process(intruder.mig_uuid, 4343)
        node.stranded.after_s = 3600.0


async def test_restart_unprepares_claims_deleted_meanwhile(
    node: Node, kube_api: client.ApiClient, namespace: str
) -> None:
    core, resource = client.CoreV1Api(kube_api), client.ResourceV1Api(kube_api)
    placed = PlacedInstance(2, "1g.10gb")
    ref = await allocate(kube_api, namespace, node.name, placed)
    assert (await node.kubelet.prepare(ref))[ref[2]].error == ""
    await node.stop_plugin()

    # While the plugin is down the pod and its claim go away.
    await core.delete_namespaced_pod(f"p-{ref[1]}", namespace, grace_period_seconds=0)
    await resource.delete_namespaced_resource_claim(ref[1], namespace)

    async def gone() -> bool | None:
        try:
            await resource.read_namespaced_resource_claim(ref[1], namespace)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return None

    await eventually(gone, "claim deleted")
    await node.start_plugin(kube_api)
    assert CheckpointStore(node.settings.checkpoint_path).load() == {}
    assert not cdi_files.spec_path(node.settings.cdi_root, ref[2]).exists()
    assert device_name(0, placed.profile, placed.start) not in node.agent.prepared
    assert node.mig_uuid(placed) is not None, "the instance is kept"


# --- the kubelet's own Go stubs against the plugin ---------------------------------------------------------

# A client built from k8s.io/kubelet's generated Go gRPC code (the code the kubelet itself links), so the
# wire check does not depend on our .proto copies being right. Built once per source digest.
GO_MOD = """module dynamig.io/kubelet-wire-client

go 1.26.0

require (
	google.golang.org/grpc v1.79.3
	k8s.io/kubelet v0.36.3
)
"""

GO_CLIENT = """// Plays the kubelet with the kubelet's own generated gRPC stubs, over unix sockets.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	drav1 "k8s.io/kubelet/pkg/apis/dra/v1"
	drav1beta1 "k8s.io/kubelet/pkg/apis/dra/v1beta1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

func dial(path string) *grpc.ClientConn {
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	return conn
}

func main() {
	// usage: client info <reg.sock> | prepare|unprepare v1|v1beta1 <dra.sock> <namespace> <name> <uid>
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out any
	var err error
	switch os.Args[1] {
	case "info":
		conn := dial(os.Args[2])
		defer conn.Close()
		c := registerapi.NewRegistrationClient(conn)
		out, err = c.GetInfo(ctx, &registerapi.InfoRequest{})
		if err == nil {
			_, err = c.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true})
		}
	case "prepare", "unprepare":
		conn := dial(os.Args[3])
		defer conn.Close()
		ns, name, uid := os.Args[4], os.Args[5], os.Args[6]
		if os.Args[2] == "v1" {
			c := drav1.NewDRAPluginClient(conn)
			claims := []*drav1.Claim{{Namespace: ns, Name: name, Uid: uid}}
			if os.Args[1] == "prepare" {
				out, err = c.NodePrepareResources(ctx, &drav1.NodePrepareResourcesRequest{Claims: claims})
			} else {
				out, err = c.NodeUnprepareResources(ctx, &drav1.NodeUnprepareResourcesRequest{Claims: claims})
			}
		} else {
			c := drav1beta1.NewDRAPluginClient(conn)
			claims := []*drav1beta1.Claim{{Namespace: ns, Name: name, Uid: uid}}
			if os.Args[1] == "prepare" {
				req := &drav1beta1.NodePrepareResourcesRequest{Claims: claims}
				out, err = c.NodePrepareResources(ctx, req)
			} else {
				req := &drav1beta1.NodeUnprepareResourcesRequest{Claims: claims}
				out, err = c.NodeUnprepareResources(ctx, req)
			}
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	b, _ := json.Marshal(out)
	fmt.Println(string(b))
}
"""


def go_wire_client() -> Path:
    """Builds (or reuses) the Go client; skips when no Go toolchain or module cache can build it."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain: the check against the kubelet's Go stubs needs one")
    digest = hashlib.sha256((GO_MOD + GO_CLIENT).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("DYNAMIG_CACHE") or Path.home() / ".cache" / "dynamig")  # as hack/*.sh
    out_dir = cache / "kubelet-wire-client" / digest
    binary = out_dir / "client"
    if binary.exists():
        return binary
    src = Path(tempfile.mkdtemp(prefix="dmwire"))
    try:
        (src / "go.mod").write_text(GO_MOD)
        (src / "main.go").write_text(GO_CLIENT)
        env = {
            **os.environ,
            "GOTOOLCHAIN": "local",
            "GOFLAGS": "-mod=mod",
            "CGO_ENABLED": "0",
            # Modules come from the local cache the control-plane build filled (already verified there).
            "GOPROXY": "off",
            "GOSUMDB": "off",
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp_binary = out_dir / f".client.{os.getpid()}"
        proc = subprocess.run(
            [go, "build", "-trimpath", "-o", str(tmp_binary), "."],
            cwd=src,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if proc.returncode != 0:
            if "module lookup disabled" in proc.stderr:
                pytest.skip(f"k8s.io/kubelet Go modules are not in the module cache: {proc.stderr[-300:]}")
            pytest.fail(f"building the Go kubelet client failed:\n{proc.stderr}")
        tmp_binary.rename(binary)
        return binary
    finally:
        shutil.rmtree(src, ignore_errors=True)


async def run_go(binary: Path, *args: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        str(binary), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    data: dict[str, Any] = json.loads(out)
    return data


async def test_the_kubelets_own_go_stubs_talk_to_the_plugin(
    node: Node, kube_api: client.ApiClient, namespace: str
) -> None:
    binary = await asyncio.to_thread(go_wire_client)
    info = await run_go(binary, "info", str(node.settings.registration_socket))
    assert info == {
        "type": "DRAPlugin",
        "name": DRIVER,
        "endpoint": str(node.settings.dra_socket),
        "supported_versions": ["v1.DRAPlugin", "v1beta1.DRAPlugin"],
    }
    placed = PlacedInstance(2, "1g.10gb")
    ns, name, uid = await allocate(kube_api, namespace, node.name, placed)
    expected = {
        "claims": {
            uid: {
                "devices": [
                    {
                        "request_names": ["gpu"],
                        "pool_name": node.name,
                        "device_name": "gpu0-1g10gb-s2",
                        "cdi_device_ids": [f"k8s.mig.dynamig.io/claim={uid}-gpu0-1g10gb-s2"],
                    }
                ]
            }
        }
    }
    for version in ("v1", "v1beta1"):
        got = await run_go(binary, "prepare", version, str(node.settings.dra_socket), ns, name, uid)
        assert got == expected, version
    missing = str(uuid.uuid4())
    got = await run_go(binary, "prepare", "v1", str(node.settings.dra_socket), ns, "gone", missing)
    assert got == {"claims": {missing: {"error": f"ResourceClaim {ns}/gone does not exist"}}}
    got = await run_go(binary, "unprepare", "v1", str(node.settings.dra_socket), ns, name, uid)
    assert got == {"claims": {uid: {}}}
    assert not cdi_files.spec_path(node.settings.cdi_root, uid).exists()
