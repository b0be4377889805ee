"""Finding (or building) the control-plane binaries.

Lookup order, first complete set wins:

1. ``KUBEBUILDER_ASSETS`` (the envtest convention): a directory holding all five binaries. When it is set but
   incomplete, that is an error rather than a silent fallback, because the user asked for that directory.
2. ``PATH``: all five of kube-apiserver, kube-scheduler, kube-controller-manager, etcd and kubectl.
3. ``hack/build-control-plane.sh`` from the source checkout, which builds them from their Go modules into a
   per-version cache directory (a no-op when already built) and prints that directory.

A version asked for (``version``, or ``DYNAMIG_K8S_VERSION``) other than the primary one skips 1 and 2: only
the build script knows which version a directory holds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dynamig.devcluster.progress import run_streaming
from dynamig.devcluster.versions import PRIMARY

TOOLS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "etcd", "kubectl")
BUILD_SCRIPT = Path("hack") / "build-control-plane.sh"


class BinariesNotFoundError(RuntimeError):
    """No complete set of control-plane binaries could be found or built."""


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of the five control-plane executables and where they came from."""

    kube_apiserver: Path
    kube_scheduler: Path
    kube_controller_manager: Path
    etcd: Path
    kubectl: Path
    source: str  # "KUBEBUILDER_ASSETS", "PATH" or "build"

    @property
    def directory(self) -> Path:
        """Directory of kubectl (for prefixing PATH); the set may span directories when found on PATH."""
        return self.kubectl.parent


def _from_dir(directory: Path, source: str) -> Binaries | None:
    paths = {tool: directory / tool for tool in TOOLS}
    if not all(p.is_file() and os.access(p, os.X_OK) for p in paths.values()):
        return None
    return _make(paths, source)


def _make(paths: Mapping[str, Path], source: str) -> Binaries:
    return Binaries(
        kube_apiserver=paths["kube-apiserver"].resolve(),
        kube_scheduler=paths["kube-scheduler"].resolve(),
        kube_controller_manager=paths["kube-controller-manager"].resolve(),
        etcd=paths["etcd"].resolve(),
        kubectl=paths["kubectl"].resolve(),
        source=source,
    )


def find_repo_root(start: Path | None = None) -> Path | None:
    """The source checkout holding the build script, searched upward from this file. Pure apart from stat."""
    here = (start or Path(__file__)).resolve()
    for parent in [here, *here.parents]:
        if (parent / BUILD_SCRIPT).is_file() and (parent / "pyproject.toml").is_file():
            return parent
    return None


def find_binaries(
    env: Mapping[str, str] | None = None,
    *,
    build: bool = True,
    progress: Callable[[str], None] | None = None,
    version: str | None = None,
) -> Binaries:
    """Locate the binaries of Kubernetes ``version`` (the primary one when None), building them when allowed
    and needed.

    Side effects: may run ``hack/build-control-plane.sh`` (minutes on a cold cache); its log goes to this
    process's stderr. ``progress`` receives one-line status messages.
    """
    env = dict(os.environ if env is None else env)
    say = progress or (lambda _msg: None)
    if version is not None:
        env["DYNAMIG_K8S_VERSION"] = version
    pinned = env.get("DYNAMIG_K8S_VERSION", PRIMARY) != PRIMARY

    assets = None if pinned else env.get("KUBEBUILDER_ASSETS")
    if assets:
        found = _from_dir(Path(assets), "KUBEBUILDER_ASSETS")
        if found is None:
            missing = [t for t in TOOLS if not (Path(assets) / t).is_file()]
            raise BinariesNotFoundError(
                f"KUBEBUILDER_ASSETS={assets} lacks {', '.join(missing) or 'executable bits'}; it must hold "
                f"{', '.join(TOOLS)} (unset it to use PATH or the build script)"
            )
        return found

    on_path = {tool: shutil.which(tool, path=env.get("PATH")) for tool in TOOLS}
    if all(on_path.values()) and not pinned:
        return _make({t: Path(p) for t, p in on_path.items() if p}, "PATH")

    if not build:
        raise BinariesNotFoundError("control-plane binaries not found in KUBEBUILDER_ASSETS or PATH")
    root = find_repo_root()
    if root is None:
        raise BinariesNotFoundError(
            "control-plane binaries not found: set KUBEBUILDER_ASSETS to a directory holding "
            f"{', '.join(TOOLS)}, put them on PATH, or run hack/build-control-plane.sh from a dynamig source "
            "checkout (needs Go >= 1.26) and set KUBEBUILDER_ASSETS to the directory it prints"
        )
    say(f"running {BUILD_SCRIPT} (a no-op once built; the first build takes minutes)")
    proc = subprocess.run(
        ["bash", str(root / BUILD_SCRIPT)],
        cwd=root,
        env=dict(env),
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise BinariesNotFoundError(f"{BUILD_SCRIPT} failed (exit code {proc.returncode}); see its log above")
    built = _from_dir(Path(lines[-1]), "build")
    if built is None:
        raise BinariesNotFoundError(f"{BUILD_SCRIPT} printed {lines[-1]!r}, which lacks some of {TOOLS}")
    return built


def build_tool(script: str, *args: str) -> Path:
    """Run ``hack/<script> [args]``, which builds one Go tool from its module once (cached; a no-op
    afterwards) and prints the binary's path last, and return that path. Side effect: may build (minutes on
    a cold cache), its progress lines passed through to this process's stderr as they come.
    Raises :class:`BinariesNotFoundError` with the end of the script's log when it fails."""
    root = find_repo_root()
    if root is None:
        raise BinariesNotFoundError(f"hack/{script} needs a dynamig source checkout")
    proc = run_streaming(["bash", str(root / "hack" / script), *args], cwd=root, timeout=1800)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise BinariesNotFoundError(
            f"hack/{script} failed (exit code {proc.returncode}): {proc.stderr_tail[-2000:]}"
        )
    return Path(lines[-1])
