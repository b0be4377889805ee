"""The agent's NVML code path (``dynamig.agent.nvml.device``) and the plugin-facing instance service.

Real: the agent's NVML calls (the same ones it makes through ``pynvml`` on a GPU node), the geometry catalog.
Simulated: the GPUs, through ``dynamig.backends.simnvml`` (a drop-in for ``pynvml`` with NVML's placement,
overlap, instance-count and in-use rules). No Kubernetes API is involved.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
from prometheus_client import CollectorRegistry

from dynamig.agent.controller import AgentSettings, NodeAgent
from dynamig.agent.devices_service import AgentMigInstances
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml.device import PROFILE_RETRY_S, NvmlDevices
from dynamig.agent.plugin.instances import PlacementTaken, UnknownDevice
from dynamig.backends.nvml import load_nvml
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import parse_layout
from dynamig.geometry.model import PlacedInstance


@pytest.fixture
def nvml() -> Iterator[ModuleType]:
    module: ModuleType = load_nvml("simulated")
    module.configure(gpus=["H100-80GB", "A100-40GB"], state_file=None)
    yield module
    module.configure(gpus=[], state_file=None)


def layout(devices: NvmlDevices, index: int) -> tuple[PlacedInstance, ...]:
    gpu = devices.gpu(index)
    return tuple(i.placed for i in devices.instances(gpu))


def test_discovery_maps_gpus_to_catalog_models_with_nvml_profile_data(devices: NvmlDevices) -> None:
    gpus = devices.gpus()
    assert [g.model.key if g.model else None for g in gpus] == ["H100-80GB", "A100-40GB"]
    h100 = gpus[0]
    assert h100.uuid.startswith("GPU-") and h100.mig_enabled and h100.pci_device_id == 0x2330
    assert h100.product == "NVIDIA H100 80GB HBM3"
    assert h100.model is not None
    one = h100.model.profile("1g.10gb")
    assert one.profile_id == 19 and one.placement_starts == (0, 1, 2, 3, 4, 5, 6) and one.placement_size == 1
    assert h100.model.profile("1g.20gb").placement_size == 2
    assert devices.instances(h100) == []


def test_create_with_placement_then_destroy(devices: NvmlDevices) -> None:
    gpu = devices.gpu(0)
    made = devices.create(gpu, PlacedInstance(4, "3g.40gb"))
    assert made.start == 4 and made.size == 4 and made.ci_id is not None and made.mig_uuid.startswith("MIG-")
    assert made.memory_bytes and made.multiprocessors == 60
    again = devices.create(gpu, PlacedInstance(4, "3g.40gb"))  # idempotent
    assert again.mig_uuid == made.mig_uuid
    devices.create(gpu, PlacedInstance(0, "1g.10gb"))
    assert layout(devices, 0) == parse_layout("1g.10gb@0,3g.40gb@4")
    assert devices.destroy(gpu, PlacedInstance(4, "3g.40gb")) is True
    assert devices.destroy(gpu, PlacedInstance(4, "3g.40gb")) is False
    assert layout(devices, 0) == parse_layout("1g.10gb@0")


def test_taken_placement_is_insufficient_resources(devices: NvmlDevices, nvml: ModuleType) -> None:
    gpu = devices.gpu(0)
    devices.create(gpu, PlacedInstance(0, "3g.40gb"))
    with pytest.raises(nvml.NVMLError_InsufficientResources):
        devices.create(gpu, PlacedInstance(3, "1g.10gb"))
    assert layout(devices, 0) == parse_layout("3g.40gb@0")


def test_busy_instance_is_not_destroyed(devices: NvmlDevices, nvml: ModuleType) -> None:
    gpu = devices.gpu(0)
    made = devices.create(gpu, PlacedInstance(6, "1g.10gb"))
    nvml.attach_process(made.mig_uuid, 4242)
    assert devices.processes(gpu, PlacedInstance(6, "1g.10gb")) == 1
    with pytest.raises(nvml.NVMLError_InUse):
        devices.destroy(gpu, PlacedInstance(6, "1g.10gb"))
    # Even without the agent's own check, NVML refuses.
    with pytest.raises(nvml.NVMLError_InUse):
        devices.destroy(gpu, PlacedInstance(6, "1g.10gb"), check_processes=False)
    assert layout(devices, 0) == parse_layout("1g.10gb@6")


def test_existing_instances_are_adopted_as_nvml_reports_them(nvml: ModuleType) -> None:
    first = NvmlDevices(nvml, load_catalog())
    first.init()
    gpu = first.gpu(1)  # A100-40GB: 1g.10gb is the size-2 profile there
    first.create(gpu, PlacedInstance(2, "1g.10gb"))
    first.create(gpu, PlacedInstance(4, "3g.20gb"))
    # A new agent (fresh NvmlDevices) sees exactly what exists.
    second = NvmlDevices(nvml, load_catalog())
    second.init()
    found = second.instances(second.gpu(1))
    assert [(i.profile, i.start, i.size) for i in found] == [("1g.10gb", 2, 2), ("3g.20gb", 4, 4)]
    assert all(i.has_compute_instance for i in found)


def _agent(devices: NvmlDevices) -> NodeAgent:
    from kubernetes_asyncio.client import ApiClient, Configuration

    # Nothing listens there: ensure() reads the API only for a free instance in the way, and must then
    # refuse rather than destroy anything (the e2e plugin test covers the reads that succeed).
    conf = Configuration(host="http://127.0.0.1:9")
    return NodeAgent(
        AgentSettings(node="n1"),
        KubeApi(ApiClient(conf), attempts=1),
        devices,
        AgentMetrics(CollectorRegistry(), "n1"),
    )


async def test_ensure_creates_missing_instance_and_reports_ids(devices: NvmlDevices) -> None:
    agent = _agent(devices)
    service = AgentMigInstances(agent)
    assert await service.lookup("gpu0-1g10gb-s6") is None
    inst = await service.ensure("gpu0-1g10gb-s6")
    assert inst.device_name == "gpu0-1g10gb-s6" and inst.gpu_index == 0 and inst.placement_start == 6
    assert inst.mig_uuid.startswith("MIG-") and inst.parent_uuid == devices.gpu(0).uuid
    assert inst.gi_id >= 0 and inst.ci_id >= 0 and inst.gpu_minor >= 0
    assert "gpu0-1g10gb-s6" in agent.prepared
    assert await service.ensure("gpu0-1g10gb-s6") == inst  # repeatable
    assert await service.lookup("gpu0-1g10gb-s6") == inst
    await agent.api.api_client.close()


async def test_ensure_refuses_taken_placement_and_unknown_names(devices: NvmlDevices) -> None:
    agent = _agent(devices)
    service = AgentMigInstances(agent)
    devices.create(devices.gpu(0), PlacedInstance(4, "3g.40gb"))
    with pytest.raises(PlacementTaken, match=r"3g\.40gb at slice 4; whether it is free cannot be read now"):
        await service.ensure("gpu0-1g10gb-s5")
    agent.prepared.add("gpu0-3g40gb-s4")  # prepared for another pod: busy, refused without asking the API
    with pytest.raises(PlacementTaken, match=r"3g\.40gb at slice 4, which is in use"):
        await service.ensure("gpu0-1g10gb-s5")
    with pytest.raises(UnknownDevice):
        await service.ensure("gpu0-1g10gb-s9")
    with pytest.raises(UnknownDevice):
        await service.ensure("gpu7-1g10gb-s0")
    assert layout(devices, 0) == parse_layout("3g.40gb@4")
    await agent.api.api_client.close()


def test_each_instance_is_read_through_its_own_mig_device(devices: NvmlDevices, nvml: ModuleType) -> None:
    """UUID, memory, multiprocessors and processes come from the MIG device handle, not the parent GPU
    (nvml.h: nvmlComputeInstanceInfo_t.device is the "Parent device"; per-instance memory and processes
    "can be queried by using specific MIG device handles")."""
    gpu = devices.gpu(0)  # H100-80GB
    model = gpu.model
    assert model is not None
    small = devices.create(gpu, PlacedInstance(0, "1g.10gb"))
    big = devices.create(gpu, PlacedInstance(4, "3g.40gb"))
    for inst in (small, big):
        profile = model.profile(inst.profile)
        assert inst.mig_uuid.startswith("MIG-") and inst.mig_uuid != gpu.uuid
        assert inst.memory_bytes == profile.memory_mib * 2**20
        assert inst.multiprocessors == profile.multiprocessors
    assert small.mig_uuid != big.mig_uuid
    nvml.attach_process(big.mig_uuid, 4242)
    by_start = {i.start: i for i in devices.instances(gpu)}
    assert (by_start[0].processes, by_start[4].processes) == (0, 1)  # one process busies one instance only


def test_a_gpu_instance_split_by_someone_else_is_reported_as_it_is(
    devices: NvmlDevices, nvml: ModuleType
) -> None:
    import ctypes

    import pynvml

    gpu = devices.gpu(0)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    pl = pynvml.c_nvmlGpuInstancePlacement_t(0, 4)
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, ctypes.byref(pl))  # 3g.40gb@0, no CI yet
    (bare,) = devices.instances(gpu)
    assert not bare.has_compute_instance and bare.whole is None and not bare.partitioned
    for _ in range(2):  # like `nvidia-smi mig -cci 0,0`: two 1-slice compute instances
        nvml.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    (split,) = devices.instances(gpu)
    assert split.partitioned and split.whole is None and split.ci_id is None and split.mig_uuid == ""
    assert len(split.compute_instances) == 2
    assert all(c.mig_uuid.startswith("MIG-") and c.slices == 1 for c in split.compute_instances)
    assert split.describe_compute() == "2 compute instance(s) (1c, 1c of 3 compute slices)"
    with pytest.raises(ValueError, match="2 compute instance"):
        devices.create(gpu, PlacedInstance(0, "3g.40gb"))  # never "completed" into a third CI
    assert len(devices.instances(gpu)[0].compute_instances) == 2


def test_profiles_are_read_again_when_mig_mode_changes(nvml: ModuleType) -> None:
    nvml.configure(gpus=["H100-80GB"], state_file=None, mig_enabled=False)
    devices = NvmlDevices(nvml, load_catalog())
    devices.init()
    off = devices.gpu(0)
    assert not off.mig_enabled and devices.instances(off) == []
    assert off.model is not None and off.model.has_profile("1g.10gb")  # the catalog's, not an empty list
    nvml.nvmlDeviceSetMigMode(nvml.nvmlDeviceGetHandleByIndex(0), nvml.NVML_DEVICE_MIG_ENABLE)
    on = devices.gpu(0)
    assert on.mig_enabled and on.model is not None and on.model.profile("1g.10gb").profile_id == 19
    assert devices.create(on, PlacedInstance(6, "1g.10gb")).mig_uuid.startswith("MIG-")


def test_nvml_is_initialised_again_after_a_driver_reload(devices: NvmlDevices, nvml: ModuleType) -> None:
    gpu = devices.gpu(0)
    devices.create(gpu, PlacedInstance(0, "1g.10gb"))
    nvml.reload_driver()
    with pytest.raises(nvml.NVMLError_Uninitialized):
        devices.instances(gpu)  # the old session is stale
    found, failed = devices.discover()
    assert devices.reinits == 1 and not failed and found[0].uuid == gpu.uuid
    assert [i.placed for i in devices.instances(found[0])] == [PlacedInstance(0, "1g.10gb")]


def test_a_gpu_is_identified_by_uuid_not_index(devices: NvmlDevices, nvml: ModuleType) -> None:
    import dataclasses

    other = dataclasses.replace(devices.gpu(0), uuid=devices.gpu(1).uuid)  # index 0 no longer that GPU
    with pytest.raises(nvml.NVMLError_NotFound):
        devices.create(other, PlacedInstance(0, "1g.10gb"))
    assert devices.instances(devices.gpu(0)) == []


def test_a_transient_error_on_one_profile_is_read_again_not_hidden_until_restart(nvml: ModuleType) -> None:
    nvml.configure(gpus=["H100-80GB"], state_file=None)
    now = [100.0]
    devices = NvmlDevices(nvml, load_catalog(), clock=lambda: now[0])
    devices.init()
    three = load_catalog().model("H100-80GB").profile("3g.40gb")
    nvml.fail_next("nvmlDeviceGetGpuInstanceProfileInfo", nvml.NVML_ERROR_TIMEOUT, profile=three.nvml_enum)
    gpu = devices.gpu(0)
    # Not hidden: the profile keeps the catalog's figures, its placements can be booked and its instances
    # are listed; the failure is on record for the GPU.
    assert gpu.model is not None and gpu.model.has_profile("3g.40gb")
    devices.create(gpu, PlacedInstance(4, "3g.40gb"))
    assert [i.placed for i in devices.instances(gpu)] == [PlacedInstance(4, "3g.40gb")]
    assert devices.unread_profiles == {gpu.uuid: ["3g.40gb: Timeout"]}
    # Read again once PROFILE_RETRY_S has passed (not on every round), and then from NVML.
    nvml.fail_next("nvmlDeviceGetGpuInstanceProfileInfo", nvml.NVML_ERROR_TIMEOUT, profile=three.nvml_enum)
    now[0] += PROFILE_RETRY_S - 1
    assert devices.gpu(0).model == gpu.model and devices.unread_profiles == {gpu.uuid: ["3g.40gb: Timeout"]}
    now[0] += 1
    devices.gpu(0)  # the table is read again: the error injected above is met once more
    assert devices.unread_profiles == {gpu.uuid: ["3g.40gb: Timeout"]}
    now[0] += PROFILE_RETRY_S
    again = devices.gpu(0)
    assert devices.unread_profiles == {}
    assert again.model is not None and again.model.profile("3g.40gb").profile_id == three.profile_id


def test_a_profile_nvml_does_not_offer_stays_out(nvml: ModuleType) -> None:
    nvml.configure(gpus=["H100-80GB"], state_file=None)
    devices = NvmlDevices(nvml, load_catalog())
    devices.init()
    one = load_catalog().model("H100-80GB").profile("1g.10gb")
    nvml.fail_next(
        "nvmlDeviceGetGpuInstanceProfileInfo", nvml.NVML_ERROR_NOT_SUPPORTED, profile=one.nvml_enum
    )
    gpu = devices.gpu(0)
    assert gpu.model is not None and not gpu.model.has_profile("1g.10gb")
    assert devices.unread_profiles == {}
