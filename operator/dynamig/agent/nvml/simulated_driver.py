"""The NVIDIA kernel driver's files for simulated GPUs (only with the simulated NVML; never in production):
the plugin's real file-reading path, with no GPU.

With the simulated NVML (``dynamig.backends.simnvml``) nothing creates ``/dev/nvidia*`` or
``/proc/driver/nvidia/capabilities``. :class:`SimulatedDriverFiles` writes, under a stand-in ``dev_root`` and
``proc_root``, what the driver exposes for the GPUs and MIG instances NVML reports: empty files for
``nvidia<minor>``, the control nodes (``nvidiactl``, ``nvidia-uvm``, ``nvidia-uvm-tools``,
``nvidia-modeset``) and ``nvidia-caps/nvidia-cap<N>``, and the ``access`` files of every GI and CI with their
``DeviceFileMinor``. :class:`SimulatedDriverInstances` wraps a ``MigInstances``
and refreshes those files after each ``ensure``, as the driver does when NVML creates an instance.

With ``base_spec`` set it also plays NVIDIA's container toolkit: it writes stand-ins of the driver's
user-space files (libraries, ``nvidia-smi`` and the other binaries, GSP firmware, the ``nvidia-cdi-hook``
program) under a driver root next to the spec (``<dir>/<stem>-driver-root``), and at ``base_spec`` a node CDI
spec shaped like ``nvidia-ctk cdi generate`` output (:func:`simulated_base_spec`) pointing at them, so the
plugin's whole path, base spec included, runs without a GPU. It never replaces a base spec it did not write.

Capability minors follow the driver's ``/proc/driver/nvidia-caps/mig-minors`` table (minors 1 and 2 for
config and monitor, then per GPU minor 15 GIs of 9 minors: the GI's own, then CIs 0-7; NVIDIA's MIG guide
lists ``gpu31/gi14/ci7/access 4322`` as the last). The plugin does not depend on that numbering: it reads
whatever the files say.

Use it only with the simulated NVML: against real GPUs the driver owns these files.

``gi_cap_minor``, ``ci_cap_minor``, ``driver_files`` and ``simulated_base_spec`` are pure;
``SimulatedDriverFiles.sync`` (and so ``SimulatedDriverInstances.ensure``) writes the files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from dynamig.agent.nvml.device import GpuInfo, NvmlDevices
from dynamig.agent.plugin import cdi
from dynamig.agent.plugin.cdi_validation import check_spec, required_version
from dynamig.agent.plugin.instances import MigInstances, PreparedInstance
from dynamig.backends.simnvml import DRIVER_VERSION
from dynamig.fileio import write_atomic

log = logging.getLogger(__name__)

_FIRST_MIG_MINOR = 3
_MINORS_PER_GI = 9  # the GI's access file, then CIs 0..7
_GIS_PER_GPU = 15


def gi_cap_minor(gpu_minor: int, gi_id: int) -> int:
    """Capability minor of a GI's ``access`` file in the driver's table. Pure."""
    return _FIRST_MIG_MINOR + gpu_minor * _GIS_PER_GPU * _MINORS_PER_GI + gi_id * _MINORS_PER_GI


def ci_cap_minor(gpu_minor: int, gi_id: int, ci_id: int) -> int:
    """Capability minor of a CI's ``access`` file in the driver's table. Pure."""
    return gi_cap_minor(gpu_minor, gi_id) + 1 + ci_id


# The simulated node base spec. Its first line marks it as ours: a file without it is never replaced.
SIMULATED_SPEC_HEADER = "# dynamig: simulated NVIDIA container toolkit CDI spec (nvidia-ctk cdi generate)"
CONTROL_DEVICE_NODES = ("nvidia-modeset", "nvidia-uvm-tools", "nvidia-uvm", "nvidiactl")
LIB_DIR = "usr/lib/x86_64-linux-gnu"
HOOK_PROGRAM = "usr/bin/nvidia-cdi-hook"
DRIVER_BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
_MOUNT_OPTIONS = ["ro", "nosuid", "nodev", "rbind", "rprivate"]
# Character device majors of the simulated driver: 195 is the NVIDIA driver's fixed major (GPUs by minor,
# nvidiactl 255, nvidia-modeset 254); nvidia-uvm and nvidia-caps get dynamic majors on a real host, read
# from /proc/devices, so the simulated driver writes the two it chose into <proc_root>/devices.
NVIDIA_MAJOR = 195
NVIDIA_UVM_MAJOR = 510
NVIDIA_CAPS_MAJOR = 511
_CONTROL_NODE_NUMBERS = {
    "nvidiactl": (NVIDIA_MAJOR, 255),
    "nvidia-modeset": (NVIDIA_MAJOR, 254),
    "nvidia-uvm": (NVIDIA_UVM_MAJOR, 0),
    "nvidia-uvm-tools": (NVIDIA_UVM_MAJOR, 1),
}
_CHAR_MAJORS = {"nvidia": NVIDIA_MAJOR, "nvidia-uvm": NVIDIA_UVM_MAJOR, "nvidia-caps": NVIDIA_CAPS_MAJOR}
PROC_DEVICES = "Character devices:\n" + "".join(f"{major} {name}\n" for name, major in _CHAR_MAJORS.items())


def driver_files(version: str) -> tuple[str, ...]:
    """Driver files (relative to the driver root) the simulated base spec bind-mounts. Pure."""
    libs = ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so")
    return (
        *(f"{LIB_DIR}/{lib}.{version}" for lib in libs),
        *(f"usr/bin/{b}" for b in DRIVER_BINARIES),
        f"lib/firmware/nvidia/{version}/gsp_ga10x.bin",
    )


def simulated_base_spec(
    gpus: Sequence[GpuInfo], *, dev_root: Path, driver_root: Path, driver_version: str = DRIVER_VERSION
) -> dict[str, Any]:
    """A node CDI spec as ``nvidia-ctk cdi generate`` writes it, for simulated files. Pure.

    Same shape as the toolkit's (``pkg/nvcdi``; ``cmd/nvidia-ctk/cdi/generate/generate_test.go`` shows one):
    kind ``nvidia.com/gpu``; one device per GPU by index and by UUID (the default
    ``--device-name-strategy``), and ``all``; spec-level edits with the control device nodes
    (``common-nvml.go``), the driver's libraries, binaries and firmware as read-only bind mounts
    (``driver-nvml.go``), the ``nvidia-cdi-hook`` hooks (``internal/discover/hooks.go``) and
    ``NVIDIA_VISIBLE_DEVICES=void`` (``wrapper.go``). Host paths point under ``dev_root`` and ``driver_root``.
    """

    def node(name: str) -> dict[str, str]:
        return {"path": f"/dev/{name}", "hostPath": str(dev_root / name)}

    def hook(*args: str) -> dict[str, Any]:
        return {
            "hookName": "createContainer",
            "path": str(driver_root / HOOK_PROGRAM),
            "args": ["nvidia-cdi-hook", *args],
            "env": ["NVIDIA_CTK_DEBUG=false"],
        }

    gpu_nodes = [(g, f"nvidia{g.minor if g.minor is not None else g.index}") for g in gpus]
    devices: list[dict[str, Any]] = [
        {"name": name, "containerEdits": {"deviceNodes": [node(dev)]}}
        for g, dev in gpu_nodes
        for name in (str(g.index), g.uuid)
    ]
    devices.append({"name": "all", "containerEdits": {"deviceNodes": [node(dev) for _, dev in gpu_nodes]}})
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": "nvidia.com/gpu",
        "devices": devices,
        "containerEdits": {
            "env": [f"NVIDIA_CTK_LIBCUDA_DIR=/{LIB_DIR}", "NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [node(n) for n in CONTROL_DEVICE_NODES],
            "hooks": [
                hook("create-symlinks", "--link", f"libcuda.so.1::/{LIB_DIR}/libcuda.so"),
                hook("enable-cuda-compat", f"--host-driver-version={driver_version}"),
                hook("update-ldcache", "--folder", f"/{LIB_DIR}"),
                hook("disable-device-node-modification"),
            ],
            "mounts": [
                {"hostPath": str(driver_root / f), "containerPath": f"/{f}", "options": list(_MOUNT_OPTIONS)}
                for f in driver_files(driver_version)
            ],
        },
    }
    spec["cdiVersion"] = required_version(spec)
    return spec


def _access_text(minor: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"


class SimulatedDriverFiles:
    """Writes the driver's device nodes and capability files for what NVML reports, and with ``base_spec``
    the toolkit's node CDI spec and the driver files it names. Side effects: files."""

    def __init__(
        self,
        devices: NvmlDevices,
        *,
        proc_root: Path,
        dev_root: Path,
        base_spec: Path | None = None,
        char_devices: bool = False,
    ) -> None:
        self._devices = devices
        self.proc_root = proc_root
        self.dev_root = dev_root
        self.base_spec = base_spec
        # Real character device nodes (mknod, needs root) instead of empty files: a container runtime
        # injects only device nodes, so a node running real containers needs them.
        self.char_devices = char_devices
        self._warned_foreign_spec = False

    @property
    def driver_root(self) -> Path | None:
        """Where the simulated driver files go, ``<spec dir>/<stem>-driver-root``; None without a spec."""
        if self.base_spec is None:
            return None
        return self.base_spec.with_name(f"{self.base_spec.stem}-driver-root")

    def sync(self) -> None:
        """Makes the files match NVML: one set per GPU and per existing GI/CI; stale GI dirs removed; the
        base spec and driver files when ``base_spec`` is set."""
        (self.dev_root / "nvidia-caps").mkdir(parents=True, exist_ok=True)
        if self.char_devices:
            self.proc_root.mkdir(parents=True, exist_ok=True)
            (self.proc_root / "devices").write_text(PROC_DEVICES)
        for node in CONTROL_DEVICE_NODES:
            self._device_node(self.dev_root / node, *_CONTROL_NODE_NUMBERS[node])
        gpus = self._devices.gpus()
        if self.base_spec is not None:
            self._write_base_spec(gpus, self.base_spec)
        for gpu in gpus:
            minor = gpu.minor if gpu.minor is not None else gpu.index
            self._device_node(self.dev_root / f"nvidia{minor}", NVIDIA_MAJOR, minor)
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

    def remove(self) -> list[Path]:
        """Removes every stand-in this class wrote (the simulated driver going away with dynamig); a base
        spec it did not write stays. Returns what was removed."""
        removed: list[Path] = []
        candidates = [self.dev_root / n for n in CONTROL_DEVICE_NODES]
        candidates += sorted(self.dev_root.glob("nvidia[0-9]*"))
        candidates += sorted((self.dev_root / "nvidia-caps").glob("nvidia-cap*"))
        if self.char_devices:
            candidates.append(self.proc_root / "devices")
        for path in candidates:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        caps = self.proc_root / "driver" / "nvidia" / "capabilities"
        if caps.is_dir():
            shutil.rmtree(caps)
            removed.append(caps)
        for directory in (self.dev_root / "nvidia-caps", caps.parent, caps.parent.parent):
            with contextlib.suppress(OSError):  # only when empty
                directory.rmdir()
                removed.append(directory)
        spec, root = self.base_spec, self.driver_root
        if spec is not None and spec.is_file() and spec.read_text().startswith(SIMULATED_SPEC_HEADER):
            spec.unlink()
            removed.append(spec)
            if root is not None and root.is_dir():
                shutil.rmtree(root)
                removed.append(root)
        return removed

    def _write_base_spec(self, gpus: Sequence[GpuInfo], path: Path) -> None:
        root = self.driver_root
        assert root is not None
        try:
            current: str | None = path.read_text()
        except FileNotFoundError:
            current = None
        if current is not None and not current.startswith(SIMULATED_SPEC_HEADER):
            if not self._warned_foreign_spec:
                log.warning("not replacing %s: it is not a simulated base spec written by dynamig", path)
                self._warned_foreign_spec = True
            return
        for rel in driver_files(DRIVER_VERSION):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).touch()
        hook = root / HOOK_PROGRAM
        if not hook.exists():
            write_atomic(hook, b"#!/bin/sh\n# stand-in for nvidia-cdi-hook (simulated node)\nexit 0\n", 0o755)
        spec = simulated_base_spec(gpus, dev_root=self.dev_root, driver_root=root)
        check_spec(spec, f"simulated CDI base spec {path}")
        text = f"{SIMULATED_SPEC_HEADER}\n---\n{yaml.safe_dump(spec, sort_keys=False)}"
        if current != text:
            write_atomic(path, text.encode())

    def _write(self, access: Path, minor: int) -> None:
        access.parent.mkdir(parents=True, exist_ok=True)
        access.write_text(_access_text(minor))
        self._device_node(
            self.dev_root / "nvidia-caps" / f"nvidia-cap{minor}", NVIDIA_CAPS_MAJOR, minor, 0o444
        )

    def _device_node(self, path: Path, major: int, minor: int, mode: int = 0o666) -> None:
        if not self.char_devices:
            path.touch()
            return
        with contextlib.suppress(FileNotFoundError):
            st = path.lstat()
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(major, minor):
                return
            path.unlink()
        os.mknod(path, mode | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(path, mode)  # mknod's mode is filtered by the umask


class SimulatedDriverInstances:
    """A ``MigInstances`` that refreshes the simulated driver files after every ``ensure``."""

    def __init__(self, inner: MigInstances, files: SimulatedDriverFiles) -> None:
        self._inner = inner
        self._files = files

    async def ensure(self, device_name: str) -> PreparedInstance:
        inst = await self._inner.ensure(device_name)
        await asyncio.to_thread(self._files.sync)
        return inst

    async def lookup(self, device_name: str) -> PreparedInstance | None:
        return await self._inner.lookup(device_name)

    async def release(self, device_name: str) -> None:
        await self._inner.release(device_name)

    def mark_prepared(self, names: Iterable[str]) -> None:
        self._inner.mark_prepared(names)
