"""What an installed dynamig adds to the dev cluster: ``dynamig dev-cluster up --gpu-node NAME=MODEL:COUNT``.

The supervisor applies the CRDs and the DeviceClass, registers each GPU node (Ready, labelled
``dynamig.io/managed=true``) and runs one node agent per node over simulated NVML plus the operator, each a
child process with its own log beside the control plane's (``agent-<node>.log``, ``operator.log``), tied to
the supervisor as the control plane's components are. There is no kubelet: pods bind, they do not run.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dynamig.devcluster.binaries import find_repo_root
from dynamig.devcluster.controlplane import ControlPlane
from dynamig.devcluster.helmrelease import RELEASE_NAME_ANNOTATION, RELEASE_NAMESPACE_ANNOTATION
from dynamig.devcluster.processes import Component, free_port
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.devices import device_class
from dynamig.kube.names import MANAGED_NODE_LABEL

# The release the install docs name, whose ownership the sandbox's CRDs and DeviceClass carry.
CHART_RELEASE = "dynamig"
CHART_NAMESPACE = "dynamig-system"
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class GpuNode:
    """A simulated GPU node: its name and its GPUs as the agent's ``--simulate-gpus`` takes them."""

    name: str
    gpus: str  # e.g. "A100-80GB:2,H100-80GB:1"


def parse_gpu_node(text: str) -> GpuNode:
    """``n1=A100-80GB:2,H100-80GB:1`` -> GpuNode. Raises ValueError naming what is wrong. Pure."""
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec:
        raise ValueError(f"--gpu-node {text!r}: expected NAME=MODEL:COUNT[,MODEL:COUNT]")
    if not _NODE_NAME.match(name):
        raise ValueError(f"--gpu-node {text!r}: {name!r} is not a valid node name (a DNS label)")
    catalog = load_catalog()
    parts = []
    for part in spec.split(","):
        model, _, count = part.partition(":")
        if model not in catalog:
            known = ", ".join(sorted(catalog.keys()))
            raise ValueError(f"--gpu-node {text!r}: unknown GPU model {model!r} (known: {known})")
        if not count.isdigit() or not 1 <= int(count) <= 8:
            raise ValueError(f"--gpu-node {text!r}: {part!r} needs a GPU count from 1 to 8")
        parts.append(f"{model}:{count}")
    return GpuNode(name, ",".join(parts))


def owned_by_chart_release(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` marked as the documented Helm release's, so ``helm install`` adopts it, not refuses. Pure."""
    meta = dict(obj.get("metadata") or {})
    meta["labels"] = {**(meta.get("labels") or {}), "app.kubernetes.io/managed-by": "Helm"}
    meta["annotations"] = {
        **(meta.get("annotations") or {}),
        RELEASE_NAME_ANNOTATION: CHART_RELEASE,
        RELEASE_NAMESPACE_ANNOTATION: CHART_NAMESPACE,
    }
    return {**obj, "metadata": meta}


def install_crds(cp: ControlPlane) -> None:
    """Apply the repository's CRDs and wait until the API server serves them. Side effects."""
    root = find_repo_root()
    if root is None:
        raise RuntimeError("the CRDs come from a dynamig source checkout (crds/); none was found")
    for path in sorted((root / "crds").glob("*.yaml")):
        crd = owned_by_chart_release(yaml.safe_load(path.read_text()))
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(crd))
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")


def install(cp: ControlPlane) -> None:
    """The CRDs and the DeviceClass, as the chart installs them. Idempotent. Side effects."""
    install_crds(cp)
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(owned_by_chart_release(device_class())))


def clear_gpu_state(state_dir: Path) -> list[Path]:
    """Delete the simulated GPUs' state files a previous run left (their MIG instances); returns them."""
    leftovers = sorted(state_dir.glob("nvml-*.json"))
    for path in leftovers:
        path.unlink(missing_ok=True)
    return leftovers


@dataclass(frozen=True)
class Running:
    """dynamig's processes in the sandbox and where each serves its Prometheus metrics."""

    components: list[Component]
    metrics: dict[str, str]  # component name -> http://127.0.0.1:PORT/metrics


def start(cp: ControlPlane, nodes: Sequence[GpuNode], state_dir: Path) -> Running:
    """Register each node and start its agent, then the operator. Side effects: Nodes, processes."""
    components: list[Component] = []
    metrics: dict[str, str] = {}
    python = [sys.executable, "-m", "dynamig"]
    kubeconfig = f"--kubeconfig={cp.kubeconfig_path}"
    for node in nodes:
        cp.register_node(node.name, labels={MANAGED_NODE_LABEL: "true"})
        port = free_port()
        argv = [
            *python, "agent", f"--node={node.name}", "--nvml=simulated", f"--simulate-gpus={node.gpus}",
            f"--state={state_dir / f'nvml-{node.name}.json'}", kubeconfig, f"--metrics-port={port}",
            "--inventory=auto",
        ]  # fmt: skip
        components.append(_spawn(f"agent-{node.name}", argv, cp, state_dir))
        metrics[f"agent-{node.name}"] = f"http://127.0.0.1:{port}/metrics"
    port = free_port()
    argv = [*python, "operator", kubeconfig, "--standalone", f"--metrics-port={port}"]
    components.append(_spawn("operator", argv, cp, state_dir))
    metrics["operator"] = f"http://127.0.0.1:{port}/metrics"
    return Running(components, metrics)


def _spawn(name: str, argv: list[str], cp: ControlPlane, state_dir: Path) -> Component:
    return Component.spawn(name, argv, log_path=cp.log_dir / f"{name}.log", cwd=state_dir)
