"""Crash-safe file writes shared by the kubelet plugin (CDI specs, checkpoint) and the simulated NVML state.

A reader of the target path sees either the old content or the new one, never a torn file, even when the
writer is killed mid-write: the data goes to a temp file in the same directory, is fsynced, renamed over
the target, and the directory is fsynced so the rename itself survives a crash.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` (permissions ``mode``): temp file -> fsync -> rename -> fsync(dir).

    Side effects: creates ``path``'s missing parent directories, replaces ``path``; on failure the temp file
    is removed and the exception re-raised (``path`` keeps its old content).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
