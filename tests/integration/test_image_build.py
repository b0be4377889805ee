"""``make image`` (hack/build-image.sh): the image built from the Dockerfile without a Docker engine.

What runs for real: the build script, which makes a Python base from Debian packages (mmdebstrap, umoci),
builds the Dockerfile on it with buildah (chroot isolation) and writes an OCI archive; skopeo reads the
archive's config, umoci unpacks its root filesystem, and the program runs in it through chroot, as root and as
the image's user. The script caches the archive by its inputs (build context, base, version, revision), so
once built this costs seconds; the first build takes minutes and needs the Debian mirror and PyPI. Needs root
(mmdebstrap, buildah, chroot) and apt-get where buildah, umoci, skopeo or mmdebstrap are missing. What is not
exercised: running the image under a container runtime (the real node's containerd).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

from dynamig.devcluster.progress import run_streaming

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "build-image.sh"
VERSION: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# What the Dockerfile's COPY lines can see: the script's revision label names the last commit changing them.
CONTEXT_PATHS: tuple[str, ...] = ("Dockerfile", ".dockerignore", "LICENSE", "pyproject.toml", "README.md")
CONTEXT_PATHS += ("requirements", "operator")
# The script's cache (as hack/build-*.sh find it): the Debian bases are under image-base/.
_XDG_CACHE = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
CACHE = Path(os.environ.get("DYNAMIG_CACHE") or f"{_XDG_CACHE}/dynamig")
LABEL = "org.opencontainers.image."


def _build() -> tuple[Path, str]:
    """Runs the script; returns the archive's path and the script's log (its stderr's tail)."""
    result = run_streaming(["bash", str(SCRIPT)], cwd=ROOT, timeout=1800)
    if result.returncode != 0:
        pytest.fail(f"hack/build-image.sh failed ({result.returncode}):\n{result.stderr_tail}")
    return Path(result.stdout.strip()), result.stderr_tail


def _run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, **kwargs)


def _git(*args: str) -> str:
    return _run(["git", *args], cwd=ROOT).stdout.strip()


@pytest.fixture(scope="module")
def archive() -> Path:
    if os.geteuid() != 0:
        pytest.skip("the image build needs root: mmdebstrap, buildah's chroot isolation, chroot")
    tools = ("buildah", "umoci", "skopeo", "mmdebstrap")
    if shutil.which("apt-get") is None and not all(shutil.which(t) for t in tools):
        pytest.skip(f"needs {', '.join(tools)} (or apt-get to install them)")
    path, _ = _build()
    assert path.is_file(), path
    return path


@pytest.fixture(scope="module")
def config(archive: Path) -> dict[str, Any]:
    proc = _run(["skopeo", "inspect", "--config", f"oci-archive:{archive}"])
    assert proc.returncode == 0, proc.stderr
    parsed: dict[str, Any] = json.loads(proc.stdout)
    return parsed


@pytest.fixture(scope="module")
def rootfs(archive: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("image")
    with tarfile.open(archive) as tar:
        tar.extractall(work / "layout", filter="tar")
    image = f"{work / 'layout'}:dynamig/dynamig:{VERSION}"
    proc = _run(["umoci", "raw", "unpack", "--image", image, str(work / "rootfs")])
    assert proc.returncode == 0, proc.stderr
    return work / "rootfs"


def test_the_archive_holds_one_manifest_named_for_this_version(archive: Path) -> None:
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        assert member is not None
        index = json.load(member)
    (manifest,) = index["manifests"]
    assert manifest["annotations"]["org.opencontainers.image.ref.name"] == f"dynamig/dynamig:{VERSION}"
    assert (archive.parent / "digest").read_text().strip() == manifest["digest"]


def test_the_config_is_the_dockerfiles(config: dict[str, Any]) -> None:
    cfg = config["config"]
    assert cfg["Entrypoint"] == ["dynamig"]
    assert cfg["Cmd"] == ["--help"]
    assert cfg["User"] == "65532:65532"
    assert "PATH=/opt/dynamig/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in cfg["Env"]
    labels = cfg["Labels"]
    assert labels[LABEL + "title"] == "dynamig"
    assert labels[LABEL + "licenses"] == "Apache-2.0"
    assert labels[LABEL + "version"] == VERSION
    # The labels are the Dockerfile's alone (no builder identity label).
    assert all(key.startswith(LABEL) for key in labels), sorted(labels)


def test_the_revision_label_names_the_commit_of_the_build_context(config: dict[str, Any]) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    revision = _git("log", "-1", "--format=%H", "--", *CONTEXT_PATHS)
    if _git("status", "--porcelain", "--untracked-files=normal", "--", *CONTEXT_PATHS):
        revision += "-dirty"
    assert config["config"]["Labels"][LABEL + "revision"] == revision


def test_the_base_labels_name_the_debian_base_it_was_built_on(config: dict[str, Any]) -> None:
    labels = config["config"]["Labels"]
    name, digest = labels[LABEL + "base.name"], labels[LABEL + "base.digest"]
    key = re.fullmatch(r"localhost/dynamig-python-base:(bookworm-[0-9a-f]{10}-\d{8}T\d{6}Z)", name)
    assert key, name
    base = CACHE / "image-base" / key.group(1)
    assert (base / "digest").read_text().strip() == digest
    proc = _run(["skopeo", "inspect", "--config", f"oci:{base / 'oci'}:base"])
    assert proc.returncode == 0, proc.stderr
    base_layers = json.loads(proc.stdout)["rootfs"]["diff_ids"]
    # FROM that base: its one layer first, then the copied environment.
    assert config["rootfs"]["diff_ids"][: len(base_layers)] == base_layers
    assert len(config["rootfs"]["diff_ids"]) == len(base_layers) + 1


def test_the_program_runs_in_the_root_filesystem(rootfs: Path) -> None:
    proc = _run(["chroot", str(rootfs), "/opt/dynamig/bin/dynamig", "--help"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("usage: dynamig"), proc.stdout


def test_the_entrypoint_runs_as_the_images_user_with_its_environment(
    rootfs: Path, config: dict[str, Any]
) -> None:
    cfg = config["config"]
    argv = ["chroot", f"--userspec={cfg['User']}", str(rootfs), "/usr/bin/env", "-i", *cfg["Env"]]
    proc = _run([*argv, *cfg["Entrypoint"], *cfg["Cmd"]])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("usage: dynamig"), proc.stdout
    # The build's pip config is mounted into the RUN steps only and stays out of the image.
    assert not (rootfs / "etc" / "pip.conf").exists()
    assert (rootfs / "usr" / "bin" / "python3.11").is_file()


def test_a_second_run_reuses_the_cached_archive(archive: Path) -> None:
    # Two runs back to back: the first builds again only if the working tree changed since the fixture's.
    first, _ = _build()
    again, log = _build()
    assert again == first
    assert not [line for line in log.splitlines() if line.startswith("==>")], log
