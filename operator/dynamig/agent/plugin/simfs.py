"""The NVIDIA kernel driver's files for simulated GPUs: the plugin's real file-reading path, with no GPU.

With the simulated NVML (``dynamig.backends.simnvml``) nothing creates ``/dev/nvidia*`` or
``/proc/driver/nvidia/capabilities``. :class:`SimulatedDriverFiles` writes, under a stand-in ``dev_root`` and
``proc_root``, what the driver exposes for the GPUs and MIG instances NVML reports: empty files for
``nvidia<minor>``, ``nvidiactl``, ``nvidia-uvm`` and ``nvidia-caps/nvidia-cap<N>``, and the ``access`` files
of every GI and CI with their ``DeviceFileMinor``. :class:`SimulatedDriverInstances` wraps a ``MigInstances``
and refreshes those files after each ``ensure``, as the driver does when NVML creates an instance.

Capability minors follow the driver's ``/proc/driver/nvidia-caps/mig-minors`` table (minors 1 and 2 for
config and monitor, then per GPU minor 15 GIs of 9 minors: the GI's own, then CIs 0-7; NVIDIA's MIG guide
lists ``gpu31/gi14/ci7/access 4322`` as the last). The plugin does not depend on that numbering: it reads
whatever the files say.

Use it only with the simulated NVML: against real GPUs the driver owns these files.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterable
from pathlib import Path

from dynamig.agent.nvml_device import NvmlDevices
from dynamig.agent.plugin import cdi
from dynamig.agent.plugin.instances import MigInstances, PreparedInstance

_FIRST_MIG_MINOR = 3
_MINORS_PER_GI = 9  # the GI's access file, then CIs 0..7
_GIS_PER_GPU = 15


def gi_cap_minor(gpu_minor: int, gi_id: int) -> int:
    """Capability minor of a GI's ``access`` file in the driver's table. Pure."""
    return _FIRST_MIG_MINOR + gpu_minor * _GIS_PER_GPU * _MINORS_PER_GI + gi_id * _MINORS_PER_GI


def ci_cap_minor(gpu_minor: int, gi_id: int, ci_id: int) -> int:
    """Capability minor of a CI's ``access`` file in the driver's table. Pure."""
    return gi_cap_minor(gpu_minor, gi_id) + 1 + ci_id


def _access_text(minor: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"


class SimulatedDriverFiles:
    """Writes the driver's device nodes and capability files for what NVML reports. Side effects: files."""

    def __init__(self, devices: NvmlDevices, *, proc_root: Path, dev_root: Path) -> None:
        self._devices = devices
        self.proc_root = proc_root
        self.dev_root = dev_root

    def sync(self) -> None:
        """Makes the files match NVML: one set per GPU and per existing GI/CI; stale GI dirs removed."""
        (self.dev_root / "nvidia-caps").mkdir(parents=True, exist_ok=True)
        for node in ("nvidiactl", "nvidia-uvm"):
            (self.dev_root / node).touch()
        for gpu in self._devices.gpus():
            minor = gpu.minor if gpu.minor is not None else gpu.index
            (self.dev_root / f"nvidia{minor}").touch()
            mig_dir = cdi.capabilities_dir(self.proc_root, minor) / "mig"
            wanted: set[str] = set()
            for inst in self._devices.instances(gpu):
                wanted.add(f"gi{inst.gi_id}")
                gi_access = cdi.gi_access_path(self.proc_root, minor, inst.gi_id)
                self._write(gi_access, gi_cap_minor(minor, inst.gi_id))
                if inst.ci_id is not None:
                    self._write(
                        cdi.ci_access_path(self.proc_root, minor, inst.gi_id, inst.ci_id),
                        ci_cap_minor(minor, inst.gi_id, inst.ci_id),
                    )
            if mig_dir.is_dir():
                for child in mig_dir.iterdir():
                    if child.name not in wanted:
                        shutil.rmtree(child)

    def _write(self, access: Path, minor: int) -> None:
        access.parent.mkdir(parents=True, exist_ok=True)
        access.write_text(_access_text(minor))
        (self.dev_root / "nvidia-caps" / f"nvidia-cap{minor}").touch()


class SimulatedDriverInstances:
    """A ``MigInstances`` that refreshes the simulated driver files after every ``ensure``."""

    def __init__(self, inner: MigInstances, files: SimulatedDriverFiles) -> None:
        self._inner = inner
        self._files = files

    async def ensure(self, device_name: str) -> PreparedInstance:
        inst = await self._inner.ensure(device_name)
        await asyncio.to_thread(self._files.sync)
        return inst

    async def release(self, device_name: str) -> None:
        await self._inner.release(device_name)

    def mark_prepared(self, names: Iterable[str]) -> None:
        self._inner.mark_prepared(names)
