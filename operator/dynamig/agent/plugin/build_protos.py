"""Generates the kubelet gRPC stubs from ``proto/*.proto`` into ``_generated/`` (run by ``make proto``).

``python -m dynamig.agent.plugin.build_protos [--force]``

The ``.proto`` files are mapped into protoc's virtual path ``dynamig/agent/plugin/_generated/`` so the
generated ``*_pb2_grpc.py`` import their messages as ``dynamig.agent.plugin._generated.<name>_pb2`` with no
rewriting. ``--pyi_out`` writes type stubs next to the modules.

Idempotent and cheap: a stamp file records a digest of the inputs (the ``.proto`` files, this script and the
grpcio-tools version); when it matches, nothing runs. Output is generated into a sibling temporary directory
and swapped in with renames, under an exclusive lock, so a reader never sees a half-written package and two
concurrent builds do not interleave.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

PLUGIN_DIR = Path(__file__).resolve().parent
PROTO_DIR = PLUGIN_DIR / "proto"
GENERATED_DIR = PLUGIN_DIR / "_generated"
STAMP_NAME = ".inputs.sha256"
VIRTUAL_PREFIX = "dynamig/agent/plugin/_generated"


def proto_files() -> list[Path]:
    """The ``.proto`` inputs, sorted so the digest is stable. Reads the directory listing."""
    return sorted(PROTO_DIR.glob("*.proto"))


def inputs_digest(protos: Sequence[Path], tools_version: str) -> str:
    """Digest of everything the output depends on. Reads the files; no other side effects."""
    h = hashlib.sha256()
    h.update(tools_version.encode())
    for path in [*protos, Path(__file__).resolve()]:
        h.update(path.name.encode() + b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _stamp_matches(digest: str) -> bool:
    stamp = GENERATED_DIR / STAMP_NAME
    try:
        return stamp.read_text().strip() == digest and (GENERATED_DIR / "__init__.py").exists()
    except OSError:
        return False


def _run_protoc(protos: Sequence[Path], out_root: Path) -> None:
    """Runs protoc (in process, from grpcio-tools) writing under ``out_root``. Side effect: files."""
    try:
        import grpc_tools  # type: ignore[import-untyped]
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit("grpcio-tools is missing; install the dev extras: pip install -e '.[dev]'") from exc
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{VIRTUAL_PREFIX}={PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[f"{VIRTUAL_PREFIX}/{p.name}" for p in protos],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}: {' '.join(args)}")


def build(*, force: bool = False) -> bool:
    """Generates the stubs unless they are up to date. Returns True when it generated. Side effect: files."""
    try:
        from grpc_tools.grpc_version import VERSION  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit("grpcio-tools is missing; install the dev extras: pip install -e '.[dev]'") from exc

    protos = proto_files()
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_DIR}")
    digest = inputs_digest(protos, str(VERSION))
    if not force and _stamp_matches(digest):
        return False
    # Lock on this script's own file: it always exists and is not an artefact in the checkout.
    with open(__file__, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _stamp_matches(digest):
            return False
        tmp_root = Path(tempfile.mkdtemp(prefix=".proto-build-", dir=PLUGIN_DIR))
        try:
            _run_protoc(protos, tmp_root)
            built = tmp_root / VIRTUAL_PREFIX
            (built / "__init__.py").write_text(
                '"""Generated kubelet gRPC stubs (``make proto``); do not edit, not in version control."""\n'
            )
            (built / STAMP_NAME).write_text(digest + "\n")
            old = PLUGIN_DIR / f".proto-old-{os.getpid()}"
            if GENERATED_DIR.exists():
                GENERATED_DIR.rename(old)
            built.rename(GENERATED_DIR)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp_root, ignore_errors=True)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--force", action="store_true", help="regenerate even when the stamp matches")
    args = parser.parse_args(argv)
    generated = build(force=args.force)
    where = GENERATED_DIR.relative_to(PLUGIN_DIR.parents[2]) if generated else None
    print(f"generated kubelet gRPC stubs in {where}" if generated else "kubelet gRPC stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
