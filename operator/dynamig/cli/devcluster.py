"""``dynamig dev-cluster up|down|env|status|logs``: a local control plane that outlives the command.

``up`` builds the binaries when needed (progress on stderr), starts the cluster in the background and prints
the kubeconfig path on stdout; with ``--gpu-node NAME=MODEL:COUNT`` it also runs dynamig on simulated GPU
nodes (CRDs, DeviceClass, an agent per node, the operator). ``env`` prints shell exports
(``eval "$(dynamig dev-cluster env)"``); ``down`` stops it and deletes its files; ``status`` says whether it
runs and lists the agents and the operator; ``logs [COMPONENT]`` prints a component's log.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from dynamig.cli.args import gpu_node


def _say(message: str) -> None:
    print(f"[dev-cluster] {message}", file=sys.stderr, flush=True)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "dev-cluster",
        help="run a local Kubernetes control plane (etcd, API server, "
        "scheduler, controller manager) in the background",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the cluster keeps its files (default ~/.cache/dynamig/dev-cluster)",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="start the cluster (no-op when running) and print the kubeconfig path")
    up.add_argument(
        "--foreground",
        action="store_true",
        help="run in this process until interrupted instead of in the background",
    )
    up.add_argument(
        "--gpu-node",
        type=gpu_node,
        action="append",
        default=[],
        metavar="NAME=MODEL:COUNT[:mig-off][:vm][,MODEL:COUNT...]",
        help="a simulated GPU node (repeatable): registers it and runs its agent over simulated NVML; the "
        "operator, the CRDs and the DeviceClass come with it. :mig-off starts those GPUs with MIG mode off, "
        ":vm puts them in a VM without GPU reset (an A100/A30 MIG mode switch then waits for a reboot). "
        "e.g. --gpu-node n1=A100-80GB:2,A30-24GB:1:mig-off:vm",
    )
    up.add_argument(
        "--keep-gpu-state",
        action="store_true",
        help="keep the MIG instances the simulated GPUs had when the last run stopped (default: start clean)",
    )
    actions.add_parser("down", help="stop the cluster and delete its files")
    actions.add_parser("env", help="print shell exports for KUBECONFIG and PATH (kubectl)")
    actions.add_parser(
        "status", help="print whether the cluster runs, its server URL, log directory, agents and operator"
    )
    inject = actions.add_parser(
        "inject",
        help="make a simulated GPU report a fault: inject xid NODE GPU [INSTANCE] CODE (INSTANCE: a MIG "
        "device name such as gpu0-1g10gb-s0, or a GPU instance id; without it, the whole GPU)",
    )
    inject.add_argument("fault", choices=["xid"], help="what to inject")
    inject.add_argument("node", metavar="NODE", help="a --gpu-node name")
    inject.add_argument("gpu", metavar="GPU", type=int, help="the GPU's index on the node")
    inject.add_argument("rest", metavar="[INSTANCE] CODE", nargs="+", help="the MIG instance, then the XID")
    logs = actions.add_parser("logs", help="print a component's log (without COMPONENT: list them)")
    logs.add_argument("component", nargs="?", help="e.g. operator, agent-n1, kube-apiserver")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynamig.devcluster import BinariesNotFoundError
    from dynamig.devcluster.background import (
        default_state_dir,
        down,
        pid_running,
        run_foreground,
        running_state,
        up,
    )

    state_dir: Path = args.state_dir or default_state_dir(os.environ)
    try:
        if args.action == "up" and args.foreground:
            return run_foreground(state_dir, _say, args.gpu_node, keep_gpu_state=args.keep_gpu_state)
        if args.action == "up":
            started = up(state_dir, _say, gpu_nodes=args.gpu_node, keep_gpu_state=args.keep_gpu_state)
            _say(f"ready in {started.start_seconds:.1f}s at {started.server_url}; logs in {started.log_dir}")
            _say('use it with: eval "$(dynamig dev-cluster env)"   stop it with: dynamig dev-cluster down')
            print(started.kubeconfig)
            return 0
        if args.action == "down":
            if not down(state_dir, _say):
                _say("no dev cluster was running (leftover files removed)")
            return 0
        state = running_state(state_dir)
        if state is None:
            _say("no dev cluster is running; start one with: dynamig dev-cluster up")
            return 1
        if args.action == "inject":
            return _inject(state_dir, args)
        if args.action == "env":
            print(f"export KUBECONFIG={shlex.quote(state.kubeconfig)}")
            print(f'export PATH={":".join(shlex.quote(d) for d in _path_dirs(state.bin_dir))}:"$PATH"')
        elif args.action == "logs":
            return _logs(Path(state.log_dir), args.component)
        else:
            print(f"running: supervisor pid {state.supervisor_pid}, server {state.server_url}")
            print(f"kubeconfig: {state.kubeconfig}")
            print(f"logs: {state.log_dir}")
            for name, pid in sorted(state.dynamig_pids.items()):
                metrics = f", metrics {state.metrics[name]}" if name in state.metrics else ""
                print(f"{name}: pid {pid}, {'running' if pid_running(pid) else 'exited'}{metrics}")
        return 0
    except (BinariesNotFoundError, RuntimeError, ValueError) as exc:
        _say(f"error: {exc}")
        return 1


def _inject(state_dir: Path, args: argparse.Namespace) -> int:
    from dynamig.devcluster.sandbox import inject_xid

    if len(args.rest) > 2:
        _say(f"error: [INSTANCE] CODE: at most two values, got {' '.join(args.rest)}")
        return 2
    instance, code = (None, args.rest[0]) if len(args.rest) == 1 else args.rest
    if not code.isdigit():
        _say(f"error: CODE {code!r}: an XID is a number (e.g. 48, 79, 94)")
        return 2
    _say(f"injected {inject_xid(state_dir, args.node, args.gpu, instance, int(code))}")
    return 0


def _path_dirs(bin_dir: str) -> list[str]:
    """kubectl's directory, then this installation's scripts (``kubectl-dynamig``) unless on PATH."""
    dirs = [bin_dir]
    scripts = Path(sys.executable).parent  # a venv's bin/, where pip put kubectl-dynamig
    on_path = os.environ.get("PATH", "").split(os.pathsep)
    if (scripts / "kubectl-dynamig").exists() and str(scripts) not in on_path:
        dirs.append(str(scripts))
    return dirs


def _logs(log_dir: Path, component: str | None) -> int:
    """Print one component's log, or list the components that have one."""
    names = sorted(p.stem for p in log_dir.glob("*.log"))
    if component is None:
        print("\n".join(names))
        return 0
    if component not in names:
        _say(f"no log for {component!r}; there are: {', '.join(names)}")
        return 1
    sys.stdout.write((log_dir / f"{component}.log").read_text(errors="replace"))
    return 0
