"""Settings of the kubelet DRA plugin: one frozen dataclass, paths derived from a few roots. Pure.

Every filesystem location the plugin touches hangs off a root that can be moved, so tests point them at a
temporary directory standing in for ``/var/lib/kubelet``, ``/var/run/cdi``, ``/dev`` and ``/proc``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dynamig import DRIVER_NAME

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_UNIX_SOCKET_PATH = 107


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginSettings:
    """Where the plugin listens and writes, and which node it serves.

    ``dev_root`` is the directory holding the NVIDIA device nodes as the container runtime on the host sees
    them (written as ``hostPath`` into CDI specs; the container path is always under ``/dev``).
    ``proc_root`` is the directory with ``driver/nvidia/capabilities`` (normally ``/proc``).
    ``cdi_base_spec`` is NVIDIA's CDI spec for the node (``nvidia-ctk cdi generate``; YAML or JSON) whose
    common edits go into every claim's spec; by default ``<cdi_root>/nvidia.yaml``, where the toolkit's
    ``nvidia-cdi-refresh`` service writes it. ``allow_missing_base_spec`` lets prepare write device-nodes-only
    specs when that file is missing (simulated nodes); otherwise a missing file fails prepare.
    """

    node_name: str
    driver_name: str = DRIVER_NAME
    kubelet_root: Path = Path("/var/lib/kubelet")
    cdi_root: Path = Path("/var/run/cdi")
    dev_root: Path = Path("/dev")
    proc_root: Path = Path("/proc")
    cdi_base_spec: Path | None = None
    allow_missing_base_spec: bool = False
    # Directory of the checkpoint; by default the plugin's own directory under the kubelet root.
    state_dir: Path | None = None
    api_timeout_s: float = 10.0

    @property
    def base_spec_path(self) -> Path:
        """The node's base CDI spec: ``cdi_base_spec``, else ``<cdi_root>/nvidia.yaml``."""
        return self.cdi_base_spec or self.cdi_root / "nvidia.yaml"

    @property
    def plugin_dir(self) -> Path:
        """``<kubelet-root>/plugins/<driver>``: holds the DRA socket (and, by default, the checkpoint)."""
        return self.kubelet_root / "plugins" / self.driver_name

    @property
    def registry_dir(self) -> Path:
        """``<kubelet-root>/plugins_registry``: the kubelet's plugin watcher looks for sockets here."""
        return self.kubelet_root / "plugins_registry"

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / f"{self.driver_name}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        return self.plugin_dir / "dra.sock"

    @property
    def checkpoint_path(self) -> Path:
        return (self.state_dir or self.plugin_dir) / "checkpoint.json"

    @property
    def device_node_ledger(self) -> Path:
        """The capability device nodes the plugin created (one path per line), removed on uninstall."""
        return (self.state_dir or self.plugin_dir) / "created-device-nodes"

    def validate(self) -> None:
        """Raises ValueError naming the first problem (socket paths too long for AF_UNIX, empty node)."""
        if not self.node_name:
            raise ValueError("node_name must be set: the plugin only prepares devices of its own node's pool")
        for sock in (self.registration_socket, self.dra_socket):
            if len(str(sock).encode()) > MAX_UNIX_SOCKET_PATH:
                raise ValueError(
                    f"unix socket path {sock} is {len(str(sock).encode())} bytes, longer than the "
                    f"{MAX_UNIX_SOCKET_PATH} AF_UNIX allows; use a shorter kubelet root"
                )
