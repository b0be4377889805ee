"""Unit tests of the kubelet plugin's prepare path writing CDI specs on top of the node's base spec.

Real: ``MigDriver`` (prepare, its error handling and rollback), the CDI builder, validation and writer, the
base-spec reader, the checkpoint store, ``SimulatedDriverFiles`` writing the driver's files and the node base
spec, on a temporary directory standing in for ``/var/lib/kubelet``, ``/var/run/cdi``, ``/dev`` and
``/proc``; the NVML code path (``NvmlDevices``). Simulated: the GPU (``dynamig.backends.simnvml``, one
A100-80GB). Stand-ins: the claim source (returns an allocated claim) and the ``MigInstances`` behind the
driver (creates the instance through NVML, records releases); the agent and Kubernetes are not involved.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dynamig import DRIVER_NAME
from dynamig.agent.devices_service import prepared_instance
from dynamig.agent.nvml.device import MigInstance, NvmlDevices
from dynamig.agent.nvml.simulated_driver import SimulatedDriverFiles, SimulatedDriverInstances
from dynamig.agent.plugin import cdi
from dynamig.agent.plugin.checkpoint import CheckpointStore
from dynamig.agent.plugin.claims import AllocatedDevice, Claim, ClaimRef
from dynamig.agent.plugin.driver import MigDriver
from dynamig.agent.plugin.instances import PreparedInstance
from dynamig.agent.plugin.settings import PluginSettings
from dynamig.backends.nvml import load_nvml
from dynamig.geometry.model import PlacedInstance, device_name

NODE = "n1"
PLACED = PlacedInstance(6, "1g.10gb")
DEVICE = device_name(0, PLACED.profile, PLACED.start)


@pytest.fixture
def nvml() -> Iterator[ModuleType]:
    module: ModuleType = load_nvml("simulated")
    module.configure(gpus=["A100-80GB"], state_file=None)
    yield module
    module.configure(gpus=[], state_file=None)


class Claims:
    async def read(self, ref: ClaimRef) -> Claim | None:
        return Claim(
            ref.namespace, ref.name, ref.uid, True, (AllocatedDevice("gpu", DRIVER_NAME, NODE, DEVICE),)
        )


class Instances:
    """Makes the one device of these tests exist through NVML; records releases."""

    def __init__(self, devices: NvmlDevices) -> None:
        self._devices = devices
        self.released: list[str] = []

    async def ensure(self, name: str) -> PreparedInstance:
        assert name == DEVICE
        gpu = self._devices.gpu(0)
        inst = next((i for i in self._devices.instances(gpu) if i.placed == PLACED), None)
        inst = inst or self._devices.create(gpu, PLACED)
        return self._prepared(name, inst)

    async def lookup(self, name: str) -> PreparedInstance | None:
        gpu = self._devices.gpu(0)
        inst = next((i for i in self._devices.instances(gpu) if i.placed == PLACED), None)
        return None if inst is None else self._prepared(name, inst)

    def _prepared(self, name: str, inst: MigInstance) -> PreparedInstance:
        gpu = self._devices.gpu(0)
        assert gpu.minor is not None and inst.ci_id is not None
        return prepared_instance(name, gpu, inst)

    async def release(self, name: str) -> None:
        self.released.append(name)

    def mark_prepared(self, names: Iterable[str]) -> None:
        pass


def make_driver(
    devices: NvmlDevices, root: Path, *, simulate_base: bool, allow_missing: bool = False
) -> tuple[MigDriver, Instances, PluginSettings]:
    settings = PluginSettings(
        node_name=NODE,
        kubelet_root=root / "kubelet",
        cdi_root=root / "cdi",
        dev_root=root / "dev",
        proc_root=root / "proc",
        allow_missing_base_spec=allow_missing,
    )
    files = SimulatedDriverFiles(
        devices,
        proc_root=settings.proc_root,
        dev_root=settings.dev_root,
        base_spec=settings.base_spec_path if simulate_base else None,
    )
    files.sync()
    inner = Instances(devices)
    driver = MigDriver(
        settings, SimulatedDriverInstances(inner, files), Claims(), CheckpointStore(settings.checkpoint_path)
    )
    return driver, inner, settings


def read_spec(settings: PluginSettings, uid: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(cdi.spec_path(settings.cdi_root, uid).read_text())
    return data


async def test_prepare_writes_the_claim_spec_on_top_of_the_base_spec(
    devices: NvmlDevices, tmp_path: Path
) -> None:
    driver, _, settings = make_driver(devices, tmp_path, simulate_base=True)
    await driver.start()
    ref = ClaimRef("ns", "c", "uid-1")
    result = (await driver.prepare([ref]))["uid-1"]
    assert result.error == ""
    [dev] = result.devices
    assert dev.cdi_device_ids == (cdi.cdi_device_id("uid-1", DEVICE),)
    spec = read_spec(settings, "uid-1")
    edits = spec["containerEdits"]
    assert spec["annotations"]["mig.dynamig.io/cdi-base-spec"] == str(tmp_path / "cdi" / "nvidia.yaml")
    assert "/usr/bin/nvidia-smi" in {m["containerPath"] for m in edits["mounts"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= {n["path"] for n in edits["deviceNodes"]}
    assert edits["env"][-1] == "NVIDIA_VISIBLE_DEVICES=void"
    [cdi_dev] = spec["devices"]
    assert cdi_dev["containerEdits"]["env"] == [f"DYNAMIG_MIG_UUIDS={dev.instance.mig_uuid}"]
    assert len(cdi_dev["containerEdits"]["deviceNodes"]) == 3


async def test_missing_base_spec_fails_prepare_clearly_and_leaves_nothing(
    devices: NvmlDevices, tmp_path: Path
) -> None:
    driver, inner, settings = make_driver(devices, tmp_path, simulate_base=False)
    await driver.start()
    result = (await driver.prepare([ClaimRef("ns", "c", "uid-2")]))["uid-2"]
    assert result.devices == ()
    assert f"CDI base spec {settings.base_spec_path} does not exist" in result.error
    assert f"nvidia-ctk cdi generate --output={settings.base_spec_path}" in result.error
    assert not cdi.spec_path(settings.cdi_root, "uid-2").exists()
    assert CheckpointStore(settings.checkpoint_path).load() == {}
    assert inner.released == [DEVICE], "the instance ensured for the claim is reported free again"


async def test_device_nodes_only_when_allowed(devices: NvmlDevices, tmp_path: Path) -> None:
    driver, _, settings = make_driver(devices, tmp_path, simulate_base=False, allow_missing=True)
    await driver.start()
    assert (await driver.prepare([ClaimRef("ns", "c", "uid-3")]))["uid-3"].error == ""
    spec = read_spec(settings, "uid-3")
    assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert "mounts" not in spec["containerEdits"]


async def test_invalid_base_spec_fails_prepare_naming_the_file(devices: NvmlDevices, tmp_path: Path) -> None:
    driver, _, settings = make_driver(devices, tmp_path, simulate_base=False, allow_missing=True)
    settings.base_spec_path.parent.mkdir(parents=True, exist_ok=True)
    settings.base_spec_path.write_text(
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\ncontainerEdits: {env: [X]}\n"
    )
    await driver.start()
    error = (await driver.prepare([ClaimRef("ns", "c", "uid-4")]))["uid-4"].error
    assert error.startswith(f"CDI base spec {settings.base_spec_path} is not a valid CDI spec")
    assert "invalid environment variable 'X'" in error
    assert not cdi.spec_path(settings.cdi_root, "uid-4").exists()


async def test_a_repeated_prepare_checks_the_checkpoint_against_nvml(
    devices: NvmlDevices, tmp_path: Path
) -> None:
    """The kubelet may call prepare again for a claim the checkpoint holds; if the instance was destroyed and
    made again meanwhile (another MIG UUID), the old spec would name a device that no longer exists."""
    driver, _, settings = make_driver(devices, tmp_path, simulate_base=True)
    await driver.start()
    ref = ClaimRef("ns", "c", "uid-5")
    first = (await driver.prepare([ref]))["uid-5"].devices[0].instance
    assert (await driver.prepare([ref]))["uid-5"].devices[0].instance == first  # answered from the checkpoint
    gpu = devices.gpu(0)
    devices.destroy(gpu, PLACED)
    devices.create(gpu, PLACED)
    again = (await driver.prepare([ref]))["uid-5"].devices[0].instance
    assert again.mig_uuid != first.mig_uuid
    assert read_spec(settings, "uid-5")["devices"][0]["containerEdits"]["env"] == [
        f"DYNAMIG_MIG_UUIDS={again.mig_uuid}"
    ]
    saved = CheckpointStore(settings.checkpoint_path).load()["uid-5"]
    assert saved.devices[0].instance.mig_uuid == again.mig_uuid
