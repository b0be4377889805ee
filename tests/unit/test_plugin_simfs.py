"""Unit tests of the simulated NVIDIA driver files (``dynamig.agent.plugin.simfs``) and of the plugin reading
them.

Real: the agent's NVML code path (``NvmlDevices``) with the pynvml API, the capability-file reader and CDI
builder of the plugin, on a temporary directory standing in for ``/dev`` and ``/proc``. Simulated: the GPUs
(``dynamig.backends.simnvml``, one H100-80GB) and, by construction, the driver's files. No Kubernetes API.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from dynamig.agent.nvml_device import NvmlDevices
from dynamig.agent.plugin import cdi
from dynamig.agent.plugin.instances import PreparedInstance
from dynamig.agent.plugin.simfs import SimulatedDriverFiles, ci_cap_minor, gi_cap_minor
from dynamig.backends.nvml import load_nvml
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
        prepared = PreparedInstance(
            device_name="x",
            mig_uuid=inst.mig_uuid,
            parent_uuid=gpu.uuid,
            gpu_index=0,
            gpu_minor=gpu.minor,
            gi_id=inst.gi_id,
            ci_id=inst.ci_id,
        )
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
