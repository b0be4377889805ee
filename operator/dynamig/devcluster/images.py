"""Container images built here, with no registry: an OCI image layout tarball the runtime imports.

A real node needs two images and can pull none: the sandbox (``pause``, compiled from Kubernetes' own
``build/pause/linux/pause.c``) and a workload image holding a static busybox. :func:`oci_archive` writes one
image as an OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/...``; image-spec v1.1) with a
single uncompressed layer, which ``ctr images import`` takes. Files are written with fixed owners and
times, so the same inputs give the same digests.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Image names say where they come from: built on this machine, never pulled.
IMAGE_HOST = "dynamig.local"
PAUSE_IMAGE = f"{IMAGE_HOST}/pause:1"
BUSYBOX_IMAGE = f"{IMAGE_HOST}/busybox:1"


@dataclass(frozen=True, slots=True)
class ImageFile:
    """One file of an image layer: contents from ``source`` (a host file) or ``data``; a ``link_to`` makes
    it a symlink."""

    path: str
    mode: int = 0o755
    source: Path | None = None
    data: bytes = b""
    link_to: str | None = None


def _layer(files: Sequence[ImageFile]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for f in files:
            parts = f.path.strip("/").split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
            info = tarfile.TarInfo(f.path.strip("/"))
            info.mode = f.mode
            if f.link_to is not None:
                info.type, info.linkname = tarfile.SYMTYPE, f.link_to
                tar.addfile(info)
                continue
            data = f.source.read_bytes() if f.source is not None else f.data
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return digest, len(data)


def oci_archive(
    out: Path,
    *,
    name: str,
    files: Sequence[ImageFile],
    entrypoint: Sequence[str],
    env: Mapping[str, str] | None = None,
) -> Path:
    """Writes the image ``name`` (``host/repo:tag``) as an OCI image layout tar at ``out``. Side effect: one
    file. Returns ``out``."""
    blobs: dict[str, bytes] = {}
    layer = _layer(files)
    layer_digest, layer_size = _blob(blobs, layer)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": list(entrypoint),
            "Env": [f"{k}={v}" for k, v in (env or {"PATH": "/bin"}).items()],
        },
        # The uncompressed layer's digest is its diff id.
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    config_digest, config_size = _blob(blobs, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer_size,
            }
        ],
    }
    manifest_digest, manifest_size = _blob(blobs, json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name},
            }
        ],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        entries = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode()}
        entries["index.json"] = json.dumps(index).encode()
        for digest, data in sorted(blobs.items()):
            entries[f"blobs/sha256/{digest.removeprefix('sha256:')}"] = data
        for path, data in entries.items():
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out


def busybox_files(busybox: Path, applets: Sequence[str]) -> list[ImageFile]:
    """A static busybox at ``/bin/busybox`` with one symlink per applet. Pure."""
    return [
        ImageFile("bin/busybox", source=busybox),
        *(ImageFile(f"bin/{a}", link_to="busybox") for a in applets),
    ]


def node_images(out_dir: Path, *, busybox: Path, pause: Path) -> dict[str, Path]:
    """Writes the node's two images; returns archive path by image name. Side effect: files."""
    applets = ("sh", "ls", "cat", "env", "sleep", "stat", "echo", "grep", "find", "readlink", "wc")
    return {
        PAUSE_IMAGE: oci_archive(
            out_dir / "pause.tar",
            name=PAUSE_IMAGE,
            files=[ImageFile("pause", source=pause)],
            entrypoint=["/pause"],
        ),
        BUSYBOX_IMAGE: oci_archive(
            out_dir / "busybox.tar",
            name=BUSYBOX_IMAGE,
            files=busybox_files(busybox, applets),
            entrypoint=["/bin/sh"],
        ),
    }
