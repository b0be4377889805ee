"""Building the package without ``make``: every build carries the kubelet gRPC stubs (setup.py's build step).

What runs for real: ``pip wheel --no-build-isolation`` on a copy of the sources that has no generated stubs,
``pip wheel`` on an sdist built by the setuptools backend from that copy, and the backend's editable build;
then the wheel's stubs are imported from the unpacked wheel, not from this checkout. The build requirements
(setuptools, wheel, grpcio-tools) come from this environment (the dev extra), so nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path("operator/dynamig/agent/plugin")
GENERATED = "dynamig/agent/plugin/_generated"
PROTOS = sorted(p.stem for p in (ROOT / PLUGIN / "proto").glob("*.proto"))

pytest.importorskip("grpc_tools", reason="grpcio-tools (a build requirement, in the dev extra) is missing")


def _sources(dest: Path) -> Path:
    """What a build reads, as a fresh checkout has it: no generated stubs, no build leftovers."""
    dest.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(
        ROOT / "operator",
        dest / "operator",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_generated", "*.egg-info", ".proto-*"),
    )
    assert not (dest / PLUGIN / "_generated").exists()
    return dest


def _run(argv: list[str], cwd: Path) -> None:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _pip_wheel(source: str, cwd: Path, out: Path) -> Path:
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir"]
    _run([*pip, "--wheel-dir", str(out), source], cwd)
    (wheel,) = out.glob("dynamig-*.whl")
    return wheel


def _assert_carries_stubs(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert PROTOS, "no .proto files found"
    for stem in PROTOS:
        assert f"{GENERATED}/{stem}_pb2.py" in names, sorted(n for n in names if "_generated" in n)
        assert f"{GENERATED}/{stem}_pb2_grpc.py" in names


def test_a_wheel_built_without_make_carries_the_kubelet_stubs_and_they_import(tmp_path: Path) -> None:
    src = _sources(tmp_path / "src")
    wheel = _pip_wheel(".", src, tmp_path / "dist")
    _assert_carries_stubs(wheel)

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # PYTHONPATH comes before site-packages, where this checkout's editable install points.
    modules = [
        f"dynamig.agent.plugin._generated.{stem}{kind}" for stem in PROTOS for kind in ("_pb2", "_pb2_grpc")
    ]
    code = (
        "import importlib, dynamig\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "from dynamig.agent.plugin.stubs import load_stubs\n"
        "load_stubs()\n"
        "print(dynamig.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).is_relative_to(site), proc.stdout


def test_an_sdist_and_an_editable_build_generate_the_stubs_too(tmp_path: Path) -> None:
    src = _sources(tmp_path / "src")
    backend = "from setuptools import build_meta as b; import sys; b.build_{}(sys.argv[1])"
    _run([sys.executable, "-c", backend.format("sdist"), str(tmp_path / "sdist")], src)
    (sdist,) = (tmp_path / "sdist").glob("dynamig-*.tar.gz")
    _assert_carries_stubs(_pip_wheel(str(sdist), tmp_path, tmp_path / "from-sdist"))

    # The editable wheel only points at the sources: the stubs must be generated there.
    _run([sys.executable, "-c", backend.format("editable"), str(tmp_path / "editable")], src)
    for stem in PROTOS:
        assert (src / PLUGIN / "_generated" / f"{stem}_pb2.py").is_file()
        assert (src / PLUGIN / "_generated" / f"{stem}_pb2_grpc.py").is_file()


def test_the_generated_stubs_stay_out_of_git() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    path = PLUGIN / "_generated" / "dra_v1_pb2.py"
    proc = subprocess.run(
        ["git", "check-ignore", "--no-index", "-q", str(path)], cwd=ROOT, timeout=30, check=False
    )
    assert proc.returncode == 0, f"{path} is not git-ignored"
