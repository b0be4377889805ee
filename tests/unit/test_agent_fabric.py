"""The NVLink and fabric facts of a whole GPU, read by the agent's NVML code path (``NvmlDevices.whole`` and
``dynamig.agent.nvml.fabric``) over the simulated NVML, and published on the ``gpu<index>`` device.

Real: the agent's NVML calls, the device it publishes, CEL evaluation of a claim's selector. Simulated: the
GPUs (``dynamig.backends.simfabric``: links per model, the fabric on Hopper and later NVSwitch systems).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pynvml
import pytest

from dynamig import DRIVER_NAME
from dynamig.agent.nvml.device import NvmlDevices, WholeGpu
from dynamig.agent.nvml.fabric import active_nvlinks, fabric_clique
from dynamig.backends import simfabric
from dynamig.backends.nvml import fresh_simulated_nvml, load_nvml
from dynamig.kube.cel import device_view_from_api, evaluate_selector
from dynamig.kube.devices import NvlinkFacts, WholeGpuDevice

H100, A100, L4 = 0, 1, 2
ATTR = "mig.dynamig.io"


@pytest.fixture
def nvml() -> Iterator[ModuleType]:
    module: ModuleType = load_nvml("simulated")
    module.configure(
        gpus=["H100-80GB", "A100-80GB", "L4-24GB"], state_file=None, mig_enabled=False, seed="n1"
    )
    yield module
    module.configure(gpus=[], state_file=None)


def whole(devices: NvmlDevices, index: int) -> WholeGpu:
    return devices.whole(devices.gpu(index))


def attributes(device: WholeGpuDevice) -> dict[str, Any]:
    return dict(device.to_api()["attributes"])


def test_an_h100_publishes_its_links_and_its_fabric(devices: NvmlDevices, nvml: ModuleType) -> None:
    d = whole(devices, H100).device
    assert d.nvlink_active_links == 18
    assert d.fabric_clique_id == simfabric.DEFAULT_CLIQUE_ID
    assert str(uuid.UUID(d.fabric_cluster_uuid)) == d.fabric_cluster_uuid  # the UUID's usual text form
    attrs = attributes(d)
    assert attrs[f"{ATTR}/nvlinkActiveLinks"] == {"int": 18}
    assert attrs[f"{ATTR}/fabricClusterUuid"] == {"string": d.fabric_cluster_uuid}
    assert attrs[f"{ATTR}/fabricCliqueId"] == {"int": simfabric.DEFAULT_CLIQUE_ID}
    assert attrs[f"{ATTR}/architecture"] == {"string": "Hopper"}  # the facts before are kept


def test_an_a100_publishes_its_links_and_no_fabric(devices: NvmlDevices) -> None:
    d = whole(devices, A100).device
    assert (d.nvlink_active_links, d.fabric_cluster_uuid, d.fabric_clique_id) == (12, "", None)
    attrs = attributes(d)
    assert attrs[f"{ATTR}/nvlinkActiveLinks"] == {"int": 12}
    assert f"{ATTR}/fabricClusterUuid" not in attrs and f"{ATTR}/fabricCliqueId" not in attrs


def test_an_l4_publishes_neither(devices: NvmlDevices) -> None:
    d = whole(devices, L4).device
    assert (d.nvlink_active_links, d.fabric_cluster_uuid, d.fabric_clique_id) == (None, "", None)
    facts = ("profile", "productName", "gpuIndex", "uuid", "architecture", "cudaComputeCapability")
    assert set(attributes(d)) == {f"{ATTR}/{k}" for k in facts}


def test_a_link_down_is_not_counted(devices: NvmlDevices, nvml: ModuleType) -> None:
    nvml.set_nvlink_active(H100, 5, False)
    nvml.set_nvlink_active(A100, 0, False)
    assert whole(devices, H100).device.nvlink_active_links == 17
    assert whole(devices, A100).device.nvlink_active_links == 11
    for link in range(12):
        nvml.set_nvlink_active(A100, link, False)
    d = whole(devices, A100).device
    assert d.nvlink_active_links == 0 and attributes(d)[f"{ATTR}/nvlinkActiveLinks"] == {"int": 0}


def test_gpus_of_one_node_share_its_cluster_another_node_has_its_own(devices: NvmlDevices) -> None:
    other = fresh_simulated_nvml()
    try:
        other.configure(["H100-80GB", "H100-80GB"], mig_enabled=False, seed="n2")
        there = NvmlDevices(other, devices.catalog)
        there.init()
        a, b = (whole(there, i).device for i in (0, 1))
        assert a.fabric_cluster_uuid == b.fabric_cluster_uuid
        assert a.fabric_cluster_uuid != whole(devices, H100).device.fabric_cluster_uuid
        there.shutdown()
    finally:
        other.reset()


def test_gpus_with_mig_mode_on_are_listed_with_their_facts(devices: NvmlDevices) -> None:
    """nvml.h names no MIG mode condition for either query (both take the parent GPU): the agent asks them
    whatever the mode and reports them in the GpuPartition status, so the operator knows which GPU to switch
    MIG off for a claim that selects on them."""
    other = fresh_simulated_nvml()
    try:
        other.configure(["H100-80GB", "A100-80GB", "L4-24GB"], mig_enabled=True, seed="n1")
        there = NvmlDevices(other, devices.catalog)
        there.init()
        h100, a100, l4 = there.gpus()
        assert h100.mig_enabled and a100.mig_enabled
        cluster = whole(devices, H100).device.fabric_cluster_uuid  # the same simulated node ("n1")
        assert h100.nvlink == NvlinkFacts(18, cluster, simfabric.DEFAULT_CLIQUE_ID)
        assert (a100.nvlink, l4.nvlink) == (NvlinkFacts(12), NvlinkFacts())
        there.shutdown()
    finally:
        other.reset()


@pytest.mark.parametrize(
    "answer",
    [
        {"state": pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED},
        {"state": pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS},
        {"status": pynvml.NVML_ERROR_UNKNOWN},  # completed, but the registration failed
        {"cluster_uuid": simfabric.ZERO_CLUSTER_UUID, "clique_id": 0},  # NVLink, no multi-node fabric
    ],
    ids=["not-started", "in-progress", "failed", "zero-cluster"],
)
def test_no_fabric_published_unless_registered(devices: NvmlDevices, nvml: ModuleType, answer: Any) -> None:
    nvml.set_fabric(H100, **answer)
    d = whole(devices, H100).device
    assert (d.fabric_cluster_uuid, d.fabric_clique_id, d.nvlink_active_links) == ("", None, 18)
    nvml.set_fabric(H100)  # registered again: published again
    assert whole(devices, H100).device.fabric_clique_id == simfabric.DEFAULT_CLIQUE_ID


def test_a_clique_set_on_the_fabric_is_the_one_published(devices: NvmlDevices, nvml: ModuleType) -> None:
    cluster = "6b0e4c3a-1f7d-4e3b-9a51-2d8f0c7e9b14"
    nvml.set_fabric(H100, cluster_uuid=cluster, clique_id=32766)
    d = whole(devices, H100).device
    assert (d.fabric_cluster_uuid, d.fabric_clique_id) == (cluster, 32766)


def test_a_driver_without_the_versioned_call_is_read_through_the_old_one(
    devices: NvmlDevices, nvml: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = whole(devices, H100).device.fabric_cluster_uuid

    def missing(*_: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    monkeypatch.setattr(nvml, "nvmlDeviceGetGpuFabricInfoV", missing)
    d = whole(devices, H100).device
    assert (d.fabric_cluster_uuid, d.fabric_clique_id) == (expected, simfabric.DEFAULT_CLIQUE_ID)


def test_an_nvml_error_leaves_the_fact_out_not_the_gpu(
    devices: NvmlDevices, nvml: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link answering an error other than "no such link" / "no NVLink" makes the count unknown (left out,
    not a wrong count); a fabric query failing so leaves the fabric out. The GPU is still published."""
    state = nvml.nvmlDeviceGetNvLinkState

    def flaky_link(h: Any, link: int) -> int:
        if link == 4:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return int(state(h, link))

    def flaky_fabric(*_: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(nvml, "nvmlDeviceGetNvLinkState", flaky_link)
    monkeypatch.setattr(nvml, "nvmlDeviceGetGpuFabricInfoV", flaky_fabric)
    d = whole(devices, H100).device
    assert (d.nvlink_active_links, d.fabric_cluster_uuid, d.fabric_clique_id) == (None, "", None)
    assert d.architecture == "Hopper" and d.memory_bytes  # the GPU itself is still published


def test_the_readers_on_their_own(devices: NvmlDevices, nvml: ModuleType) -> None:
    h100, l4 = (nvml.nvmlDeviceGetHandleByIndex(i) for i in (H100, L4))
    assert active_nvlinks(nvml, h100) == 18 and active_nvlinks(nvml, l4) is None
    clique = fabric_clique(nvml, h100)
    assert clique is not None and clique.clique_id == simfabric.DEFAULT_CLIQUE_ID
    assert fabric_clique(nvml, l4) is None


def test_a_claim_selects_gpus_by_links_and_fabric(devices: NvmlDevices) -> None:
    """What a multi-GPU training claim writes: at least 8 active links, and a fabric clique."""
    h100 = device_view_from_api(DRIVER_NAME, whole(devices, H100).device.to_api())
    a100 = device_view_from_api(DRIVER_NAME, whole(devices, A100).device.to_api())
    l4 = device_view_from_api(DRIVER_NAME, whole(devices, L4).device.to_api())
    links = f'device.attributes["{ATTR}"].nvlinkActiveLinks >= 8'
    fabric = f'has(device.attributes["{ATTR}"].fabricCliqueId)'
    assert [evaluate_selector(links, v).matched for v in (h100, a100, l4)] == [True, True, False]
    assert [evaluate_selector(fabric, v).matched for v in (h100, a100, l4)] == [True, False, False]


def test_facts_nvml_does_not_give_are_left_out() -> None:
    bare = WholeGpuDevice(1, "NVIDIA H100 80GB HBM3", "GPU-x")
    assert set(bare.attributes()) == {"profile", "productName", "gpuIndex", "uuid"}
    device = WholeGpuDevice(1, "H100", "GPU-x", nvlink_active_links=0, fabric_cluster_uuid="c")
    attrs = dataclasses.replace(device, fabric_clique_id=0).attributes()  # 0 is known, and published
    assert (attrs["nvlinkActiveLinks"], attrs["fabricClusterUuid"], attrs["fabricCliqueId"]) == (0, "c", 0)
