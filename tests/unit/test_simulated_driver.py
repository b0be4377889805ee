"""Unit tests of the simulated NVIDIA driver files (``dynamig.agent.nvml.simulated_driver``) and of the plugin
reading them.

Real: the agent's NVML code path (``NvmlDevices``) with the pynvml API, the capability-file reader and CDI
builder of the plugin, its base-spec reader and spec validation, on a temporary directory standing in for
``/dev``, ``/proc`` and ``/var/run/cdi``. Simulated: the GPUs (``dynamig.backends.simnvml``, one H100-80GB)
and, by construction, the driver's files and NVIDIA's node CDI spec. No Kubernetes API.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from dynamig.agent.devices_service import prepared_instance
from dynamig.agent.nvml.device import NvmlDevices
from dynamig.agent.nvml.simulated_driver import (
    SIMULATED_SPEC_HEADER,
    SimulatedDriverFiles,
    ci_cap_minor,
    gi_cap_minor,
)
from dynamig.agent.plugin import cdi
from dynamig.agent.plugin.cdi_base import read_base_spec
from dynamig.agent.plugin.cdi_validation import spec_errors
from dynamig.backends.nvml import load_nvml
from dynamig.backends.simnvml import DRIVER_VERSION
from dynamig.geometry.model import PlacedInstance


@pytest.fixture
def nvml() -> Iterator[ModuleType]:
    module: ModuleType = load_nvml("simulated")
    module.configure(gpus=["H100-80GB"], state_file=None)
    yield module
    module.configure(gpus=[], state_file=None)


def test_minor_numbering_is_unique_per_gpu_gi_and_ci() -> None:
    minors = [gi_cap_minor(g, gi) for g in range(8) for gi in range(15)]
    minors += [ci_cap_minor(g, gi, ci) for g in range(8) for gi in range(15) for ci in range(8)]
    assert len(minors) == len(set(minors))
    assert min(minors) == 3  # 1 and 2 are the driver's config and monitor capabilities
    assert (gi_cap_minor(0, 1), ci_cap_minor(0, 1, 0)) == (12, 13)
    # Entries of the driver's mig-minors table as NVIDIA's MIG user guide prints them.
    assert ci_cap_minor(0, 0, 2) == 6
    assert ci_cap_minor(31, 14, 7) == 4322


def test_sync_mirrors_nvml_and_the_plugin_reads_it(devices: NvmlDevices, tmp_path: Path) -> None:
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    files = SimulatedDriverFiles(devices, proc_root=proc, dev_root=dev)
    gpu = devices.gpu(0)
    assert gpu.minor is not None
    a = devices.create(gpu, PlacedInstance(0, "3g.40gb"))
    b = devices.create(gpu, PlacedInstance(6, "1g.10gb"))
    files.sync()

    for inst in (a, b):
        assert inst.ci_id is not None
        prepared = prepared_instance("x", gpu, inst)
        minors = cdi.read_capability_minors(proc, prepared)
        assert minors == cdi.CapabilityMinors(
            gi_cap_minor(gpu.minor, inst.gi_id), ci_cap_minor(gpu.minor, inst.gi_id, inst.ci_id)
        )
        assert cdi.missing_device_nodes(dev, cdi.device_nodes(prepared, minors)) == []

    # A destroyed instance's capability directory goes away, as the driver removes it.
    assert devices.destroy(gpu, PlacedInstance(6, "1g.10gb")) is True
    files.sync()
    mig_dir = cdi.capabilities_dir(proc, gpu.minor) / "mig"
    assert sorted(p.name for p in mig_dir.iterdir()) == [f"gi{a.gi_id}"]


def test_simulated_base_spec_is_shaped_like_nvidia_ctk_and_points_at_real_files(
    devices: NvmlDevices, tmp_path: Path
) -> None:
    dev, base_path = tmp_path / "dev", tmp_path / "cdi" / "nvidia.yaml"
    files = SimulatedDriverFiles(devices, proc_root=tmp_path / "proc", dev_root=dev, base_spec=base_path)
    files.sync()
    gpu = devices.gpu(0)
    assert files.driver_root == tmp_path / "cdi" / "nvidia-driver-root"

    text = base_path.read_text()
    assert text.startswith(SIMULATED_SPEC_HEADER + "\n---\n")
    raw = yaml.safe_load(text)
    assert list(raw) == ["cdiVersion", "kind", "devices", "containerEdits"]
    assert (raw["cdiVersion"], raw["kind"]) == ("0.5.0", "nvidia.com/gpu")
    assert [d["name"] for d in raw["devices"]] == ["0", gpu.uuid, "all"]
    edits = raw["containerEdits"]
    assert set(edits) == {"env", "deviceNodes", "hooks", "mounts"}
    assert "NVIDIA_VISIBLE_DEVICES=void" in edits["env"]
    assert [n["path"] for n in edits["deviceNodes"]] == [
        "/dev/nvidia-modeset",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-uvm",
        "/dev/nvidiactl",
    ]
    assert [h["args"][1] for h in edits["hooks"]] == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
    ]
    assert {m["containerPath"] for m in edits["mounts"]} >= {
        f"/usr/lib/x86_64-linux-gnu/libcuda.so.{DRIVER_VERSION}",
        f"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{DRIVER_VERSION}",
        "/usr/bin/nvidia-smi",
    }
    # Every host path the spec names exists: device nodes under dev/, the rest under the driver root.
    host_paths = [n["hostPath"] for d in raw["devices"] for n in d["containerEdits"]["deviceNodes"]]
    host_paths += [n["hostPath"] for n in edits["deviceNodes"]] + [m["hostPath"] for m in edits["mounts"]]
    host_paths += [h["path"] for h in edits["hooks"]]
    assert all(Path(p).exists() for p in host_paths), [p for p in host_paths if not Path(p).exists()]
    assert os.access(edits["hooks"][0]["path"], os.X_OK)

    # The plugin reads it as the node's base spec and builds a valid claim spec on top.
    base = read_base_spec(base_path)
    assert base is not None
    inst = devices.create(gpu, PlacedInstance(6, "1g.10gb"))
    files.sync()
    assert gpu.minor is not None and inst.ci_id is not None
    prepared = prepared_instance("gpu0-1g10gb-s6", gpu, inst)
    minors = cdi.read_capability_minors(tmp_path / "proc", prepared)
    spec = cdi.build_spec("uid-1", [cdi.CdiDevice(prepared, minors)], dev, base)
    assert spec_errors(spec) == []
    assert spec["containerEdits"]["mounts"] == edits["mounts"]


def test_simulated_base_spec_never_replaces_a_foreign_one(devices: NvmlDevices, tmp_path: Path) -> None:
    base_path = tmp_path / "cdi" / "nvidia.yaml"
    base_path.parent.mkdir()
    base_path.write_text("---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")  # e.g. the real nvidia-ctk's
    files = SimulatedDriverFiles(
        devices, proc_root=tmp_path / "proc", dev_root=tmp_path / "dev", base_spec=base_path
    )
    files.sync()
    assert base_path.read_text() == "---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\n"
    assert [p.name for p in base_path.parent.iterdir()] == ["nvidia.yaml"]
    # Without base_spec nothing but the driver's /dev and /proc files is written.
    plain = SimulatedDriverFiles(devices, proc_root=tmp_path / "p2", dev_root=tmp_path / "d2")
    plain.sync()
    assert plain.driver_root is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cdi", "d2", "dev"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of character devices needs root")
def test_char_devices_carry_the_numbers_the_driver_documents(devices: NvmlDevices, tmp_path: Path) -> None:
    """With ``char_devices`` the /dev entries are character devices a container runtime can inject, numbered
    as NVIDIA documents: ``/dev/nvidia<minor>`` on the driver's fixed major 195, ``nvidiactl`` 195:255 and
    ``nvidia-modeset`` 195:254 (the driver's README, "Installing the NVIDIA driver": device files); nvidia-uvm
    and nvidia-caps on dynamic majors found in ``/proc/devices`` (the MIG user guide, "Device Nodes and
    Capabilities": ``cat /proc/devices | grep nvidia-caps``), each cap node's minor the one its ``access``
    file states. The plugin's reader finds the same major the simulated driver lists."""
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    files = SimulatedDriverFiles(devices, proc_root=proc, dev_root=dev, char_devices=True)
    gpu = devices.gpu(0)
    assert gpu.minor is not None
    inst = devices.create(gpu, PlacedInstance(0, "3g.40gb"))
    assert inst.ci_id is not None
    dev.mkdir()
    (dev / f"nvidia{gpu.minor}").touch()  # an empty file left by an earlier run is replaced
    files.sync()
    files.sync()  # idempotent: existing nodes with the right numbers stay

    def numbers(path: Path) -> tuple[int, int]:
        st = path.lstat()
        assert (st.st_mode & 0o170000) == 0o020000, f"{path} is not a character device"
        return os.major(st.st_rdev), os.minor(st.st_rdev)

    proc_devices = (proc / "devices").read_text()
    caps_major = cdi.parse_char_major(proc_devices, "nvidia-caps")
    assert cdi.parse_char_major(proc_devices, "nvidia") == 195
    assert caps_major is not None and cdi.parse_char_major(proc_devices, "nvidia-uvm") is not None
    assert numbers(dev / f"nvidia{gpu.minor}") == (195, gpu.minor)
    assert numbers(dev / "nvidiactl") == (195, 255)
    assert numbers(dev / "nvidia-modeset") == (195, 254)
    prepared = prepared_instance("x", gpu, inst)
    minors = cdi.read_capability_minors(proc, prepared)
    assert minors is not None
    for minor in (minors.gi_access, minors.ci_access):
        node = dev / "nvidia-caps" / f"nvidia-cap{minor}"
        assert numbers(node) == (caps_major, minor)
        assert node.stat().st_mode & 0o777 == 0o444
