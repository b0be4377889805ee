"""A long-lived dev cluster for ``dynamig dev-cluster up|down|env|status``.

``up`` resolves (or builds) the binaries in the foreground, so build progress shows on the terminal, then
starts a detached supervisor process (``dynamig dev-cluster up --foreground``) that owns the control plane.
The supervisor writes ``state.json`` once the cluster is healthy, stops the cluster on SIGTERM/SIGINT/SIGHUP,
and stops it too if any component dies. Its components are tied to it by the kernel (parent-death signal),
so even a supervisor killed with SIGKILL leaves nothing running.

State directory (default ``$DYNAMIG_CACHE`` or ``~/.cache/dynamig``, then ``dev-cluster/``):
``state.json``, ``supervisor.log``, ``lock``, and ``cluster/`` (certificates, kubeconfig, etcd data,
``logs/<component>.log``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType

from dynamig.devcluster import sandbox
from dynamig.devcluster.binaries import find_binaries
from dynamig.devcluster.controlplane import ControlPlane
from dynamig.devcluster.processes import Component, stop_all
from dynamig.devcluster.progress import lock_with_heartbeat
from dynamig.devcluster.sandbox import parse_gpu_node

Say = Callable[[str], None]


def default_state_dir(env: Mapping[str, str]) -> Path:
    """``$DYNAMIG_CACHE/dev-cluster``, else ``$XDG_CACHE_HOME/dynamig/dev-cluster``. Pure."""
    if env.get("DYNAMIG_CACHE"):
        root = Path(env["DYNAMIG_CACHE"])
    else:
        root = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dynamig"
    return root / "dev-cluster"


@dataclass(frozen=True)
class ClusterState:
    """What ``state.json`` records about a running dev cluster."""

    supervisor_pid: int
    server_url: str
    kubeconfig: str
    bin_dir: str
    log_dir: str
    component_pids: dict[str, int]
    start_seconds: float
    gpu_nodes: list[str] = field(default_factory=list)  # the --gpu-node arguments it runs
    dynamig_pids: dict[str, int] = field(default_factory=dict)  # agent-<node> / operator -> pid
    metrics: dict[str, str] = field(default_factory=dict)  # agent-<node> / operator -> its /metrics URL

    @classmethod
    def read(cls, state_dir: Path) -> ClusterState | None:
        try:
            data = json.loads((state_dir / "state.json").read_text())
        except (OSError, ValueError):
            return None
        return cls(**data)

    def write(self, state_dir: Path) -> None:
        tmp = state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(state_dir / "state.json")  # atomic: readers never see half a file


def _alive(pid: int) -> bool:
    """True when ``pid`` runs a dynamig dev-cluster supervisor (guards against a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True  # no /proc (not Linux): trust the pid
    return b"dev-cluster" in cmdline


def running_state(state_dir: Path) -> ClusterState | None:
    """The recorded state when its supervisor is alive, else None."""
    state = ClusterState.read(state_dir)
    return state if state is not None and _alive(state.supervisor_pid) else None


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "lock", "w") as fh:
        # `up` holds it while the first build runs (minutes): a second `up` or `down` says what it waits for.
        lock_with_heartbeat(fh, f"the dev cluster in {state_dir}")
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def up(
    state_dir: Path,
    say: Say,
    *,
    gpu_nodes: Sequence[str] = (),
    keep_gpu_state: bool = False,
    timeout: float = 120.0,
) -> ClusterState:
    """Start the dev cluster in the background unless it runs already; returns its state. Side effects.

    ``gpu_nodes`` (``NAME=MODEL:COUNT[:mig-off][:vm][,...]``): simulated GPU nodes, each with its agent,
    plus the operator, the CRDs and the DeviceClass. Their GPUs start without MIG instances unless
    ``keep_gpu_state`` keeps those the last run left (a cluster rebuilt over GPUs still cut). Raises
    ``RuntimeError`` with the supervisor's log tail when the cluster does not come up, or when it runs already
    with other GPU nodes.
    """
    for text in gpu_nodes:
        parse_gpu_node(text)  # bad input fails here, before anything starts
    with _locked(state_dir):
        state = running_state(state_dir)
        if state is not None:
            if list(gpu_nodes) and list(gpu_nodes) != state.gpu_nodes:
                raise RuntimeError(
                    f"the dev cluster runs already with GPU nodes {state.gpu_nodes or 'none'}; "
                    "stop it first (dynamig dev-cluster down) to change them"
                )
            say(f"dev cluster already running (supervisor pid {state.supervisor_pid})")
            return state
        _cleanup(state_dir)
        binaries = find_binaries(progress=say)
        say(f"binaries: {binaries.directory} (from {binaries.source})")
        env = dict(os.environ, KUBEBUILDER_ASSETS=str(binaries.kube_apiserver.parent))
        if binaries.source == "PATH":
            env.pop("KUBEBUILDER_ASSETS")  # the five may live in different PATH directories
        log = state_dir / "supervisor.log"
        say("starting the control plane in the background")
        with open(log, "wb") as fh:
            argv = [
                sys.executable,
                "-m",
                "dynamig",
                "dev-cluster",
                f"--state-dir={state_dir}",
                "up",
                "--foreground",
                *(f"--gpu-node={n}" for n in gpu_nodes),
                *(["--keep-gpu-state"] if keep_gpu_state else []),
            ]
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        relayed = 0
        while True:
            relayed = _relay_progress(log, relayed, say)
            state = ClusterState.read(state_dir)
            if state is not None and state.supervisor_pid == proc.pid:
                _relay_progress(log, relayed, say)
                return state
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    _terminate(proc.pid)
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"dev cluster did not start; supervisor log {log}:\n{tail}")
            time.sleep(0.2)


def _relay_progress(log: Path, already: int, say: Say) -> int:
    """Pass the supervisor's progress lines after the first ``already`` to ``say``; returns the count."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return already
    for line in lines[already:]:
        if line.startswith("[dev-cluster] "):
            say(line.removeprefix("[dev-cluster] "))
    return len(lines)


def run_foreground(
    state_dir: Path, say: Say, gpu_nodes: Sequence[str] = (), *, keep_gpu_state: bool = False
) -> int:
    """Run the control plane (and, with ``gpu_nodes``, dynamig on simulated GPU nodes) until a signal
    arrives or a component dies; returns the exit code. Blocks. The simulated GPUs start without MIG
    instances unless ``keep_gpu_state``."""
    stop_requested: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    state_dir.mkdir(parents=True, exist_ok=True)
    cp = ControlPlane(work_dir=state_dir / "cluster", progress=say)
    nodes = [parse_gpu_node(n) for n in gpu_nodes]
    dynamig: list[Component] = []
    metrics: dict[str, str] = {}
    try:
        cp.start()
        if nodes:
            if not keep_gpu_state and (cleared := sandbox.clear_gpu_state(state_dir)):
                say(
                    f"simulated GPUs start clean: removed the last run's {', '.join(p.name for p in cleared)}"
                )
            sandbox.install(cp)
            running = sandbox.start(cp, nodes, state_dir)
            dynamig, metrics = running.components, running.metrics
            names = ", ".join(n.name for n in nodes)
            say(f"GPU nodes {names}: an agent each over simulated NVML, and the operator")
        ClusterState(
            supervisor_pid=os.getpid(),
            server_url=cp.server_url,
            kubeconfig=str(cp.kubeconfig_path),
            bin_dir=str(cp.binaries.directory),
            log_dir=str(cp.log_dir),
            component_pids=cp.pids,
            start_seconds=round(cp.start_seconds or 0.0, 2),
            gpu_nodes=list(gpu_nodes),
            dynamig_pids={c.name: c.pid for c in dynamig},
            metrics=metrics,
        ).write(state_dir)
        say(f"kubeconfig: {cp.kubeconfig_path}")
        while not stop_requested:
            if not cp.running():
                dead = [name for name, pid in cp.pids.items() if not pid_running(pid)]
                say(f"component(s) exited: {', '.join(dead) or 'unknown'}; stopping the dev cluster")
                return 1
            for c in [c for c in dynamig if not c.running()]:
                # A dynamig part that exits is reported (status shows it) but does not stop the cluster.
                say(
                    f"{c.name} exited with code {c.popen.returncode}; its log: {c.log_path}\n{c.log_tail(10)}"
                )
                dynamig.remove(c)
            time.sleep(0.5)
        say(f"signal {stop_requested[0]}: stopping the dev cluster")
        return 0
    finally:
        stop_all(dynamig)
        cp.stop()
        with contextlib.suppress(FileNotFoundError):
            (state_dir / "state.json").unlink()


def pid_running(pid: int) -> bool:
    """Whether a process ``pid`` exists (it may be another program if the pid was recycled)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _terminate(pid: int, timeout: float = 20.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_running(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    if pid_running(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive_python(pid: int) -> bool:
    """True when ``pid`` still runs a dynamig agent or operator (so a recycled pid is never touched)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"dynamig" in cmdline and (b"agent" in cmdline or b"operator" in cmdline)


def _runs_binary_from(pid: int, bin_dir: str) -> bool:
    """True when ``pid`` still runs an executable from ``bin_dir`` (so a recycled pid is never touched)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return exe.startswith(bin_dir.rstrip("/") + "/")


def _cleanup(state_dir: Path) -> None:
    """Remove everything a previous cluster left (except the lock file)."""
    for entry in ("cluster", "state.json", "state.json.tmp", "supervisor.log"):
        path = state_dir / entry
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def down(state_dir: Path, say: Say) -> bool:
    """Stop the dev cluster and delete its files; returns whether one was running. Side effects."""
    with _locked(state_dir):
        state = ClusterState.read(state_dir)
        was_running = state is not None and _alive(state.supervisor_pid)
        if state is not None:
            if was_running:
                say(f"stopping dev cluster (supervisor pid {state.supervisor_pid})")
                _terminate(state.supervisor_pid)
            # Belt and braces: sweep the component process groups the state recorded.
            for pid in state.dynamig_pids.values():
                if pid_running(pid) and _alive_python(pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
            for pid in state.component_pids.values():
                if _runs_binary_from(pid, state.bin_dir):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
        _cleanup(state_dir)
        return was_running
