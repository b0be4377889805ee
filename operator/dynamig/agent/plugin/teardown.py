"""What the kubelet plugin leaves on a node, removed when dynamig is uninstalled: the claims' CDI specs, the
checkpoint, and the capability device nodes it created (its ledger says which; nodes the driver or
nvidia-modprobe made stay). The sockets go when the server stops. Side effects: deletes files."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from dynamig.agent.plugin import cdi
from dynamig.agent.plugin.settings import PluginSettings

log = logging.getLogger(__name__)


def _remove(path: Path, removed: list[Path]) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        removed.append(path)


def remove_node_files(settings: PluginSettings) -> list[Path]:
    """Removes the plugin's files from the node; returns what was removed. Running containers keep the
    devices they were given; a container created after this cannot use a dynamig claim any more."""
    removed: list[Path] = []
    for uid in sorted(cdi.spec_claim_uids(settings.cdi_root)):
        _remove(cdi.spec_path(settings.cdi_root, uid), removed)
    ledger = settings.device_node_ledger
    with contextlib.suppress(FileNotFoundError):
        for line in ledger.read_text().splitlines():
            if line.strip():
                _remove(Path(line.strip()), removed)
    _remove(ledger, removed)
    _remove(settings.checkpoint_path, removed)
    for directory in (settings.plugin_dir, settings.checkpoint_path.parent):
        with contextlib.suppress(OSError):  # only when empty: other drivers' files are never touched
            directory.rmdir()
    log.info("removed %d file(s) the kubelet plugin made on the node", len(removed))
    return removed
