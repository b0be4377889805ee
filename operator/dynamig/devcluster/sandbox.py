"""What an installed dynamig adds to the dev cluster: ``dynamig dev-cluster up --gpu-node NAME=MODEL:COUNT``.

The supervisor applies the CRDs and the DeviceClass, registers each GPU node (Ready, labelled
``dynamig.io/managed=true``) and runs one node agent per node over simulated NVML plus the operator, each a
child process with its own log beside the control plane's (``agent-<node>.log``, ``operator.log``), tied to
the supervisor as the control plane's components are. There is no kubelet: pods bind, they do not run.

``MODEL:COUNT:mig-off`` starts those GPUs with MIG mode off, ``MODEL:COUNT:vm`` puts them in a pass-through
VM that exposes no GPU reset (a MIG mode switch then waits for a reboot: :mod:`dynamig.backends.simmode`).
The supervisor writes those options into the node's simulated NVML state file before its agent starts; the
agent adopts the file as it finds it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dynamig.backends import simmode, simnvml
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


GPU_OPTIONS = ("mig-off", "vm")


@dataclass(frozen=True)
class GpuNode:
    """A simulated GPU node: its name, its GPUs as the agent's ``--simulate-gpus`` takes them, and which of
    them (by GPU index) start with MIG off or sit in a VM that exposes no GPU reset."""

    name: str
    gpus: str  # e.g. "A100-80GB:2,H100-80GB:1"
    mig_off: tuple[int, ...] = ()
    vm: tuple[int, ...] = ()

    def keys(self) -> list[str]:
        """One catalog key per GPU, index order. Pure."""
        out: list[str] = []
        for part in self.gpus.split(","):
            model, count = part.split(":")
            out += [model] * int(count)
        return out


def parse_gpu_node(text: str) -> GpuNode:
    """``n1=A100-80GB:2:mig-off:vm,H100-80GB:1`` -> GpuNode. Raises ValueError naming what is wrong. Pure."""
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec:
        raise ValueError(f"--gpu-node {text!r}: expected NAME=MODEL:COUNT[:mig-off][:vm][,MODEL:COUNT...]")
    if not _NODE_NAME.match(name):
        raise ValueError(f"--gpu-node {text!r}: {name!r} is not a valid node name (a DNS label)")
    catalog = load_catalog()
    parts: list[str] = []
    flagged: dict[str, list[int]] = {option: [] for option in GPU_OPTIONS}
    first = 0
    for part in spec.split(","):
        model, _, rest = part.partition(":")
        count, *options = rest.split(":")
        if model not in catalog:
            known = ", ".join(sorted(catalog.keys()))
            raise ValueError(f"--gpu-node {text!r}: unknown GPU model {model!r} (known: {known})")
        if not count.isdigit() or not 1 <= int(count) <= 8:
            raise ValueError(f"--gpu-node {text!r}: {part!r} needs a GPU count from 1 to 8")
        for option in options:
            if option not in GPU_OPTIONS:
                known = ", ".join(GPU_OPTIONS)
                raise ValueError(
                    f"--gpu-node {text!r}: unknown option {option!r} in {part!r} (known: {known})"
                )
            if options.count(option) > 1:
                raise ValueError(f"--gpu-node {text!r}: {option!r} given twice in {part!r}")
        if "vm" in options and not simmode.switch_needs_reset(catalog.model(model)):
            raise ValueError(
                f"--gpu-node {text!r}: {part!r}: vm (no GPU reset) changes nothing on {model}, whose MIG "
                "mode switches without a reset; it matters on A100 and A30"
            )
        for option in options:
            flagged[option].extend(range(first, first + int(count)))
        first += int(count)
        parts.append(f"{model}:{count}")
    return GpuNode(name, ",".join(parts), tuple(flagged["mig-off"]), tuple(flagged["vm"]))


def seed_gpu_state(node: GpuNode, path: Path) -> bool:
    """Write ``node``'s simulated NVML state file with its GPUs' options (MIG off, in a VM) for its agent to
    adopt, unless it has none or the file exists (kept from the last run: left as it is). True when written.
    Side effect: the file."""
    if not (node.mig_off or node.vm) or path.exists():
        return False
    keys = node.keys()
    try:
        simnvml.configure(
            keys,
            state_file=path,
            seed=node.name,  # as the agent seeds it: the same GPU UUIDs as without options
            mig_enabled=[i not in node.mig_off for i in range(len(keys))],
            vm=[i in node.vm for i in range(len(keys))],
        )
    finally:
        simnvml.reset()
    return True


def inject_xid(state_dir: Path, node: str, gpu: int, instance: str | None, xid: int) -> str:
    """Make simulated GPU ``gpu`` of dev-cluster node ``node`` report XID ``xid``: on the whole GPU, or on the
    MIG instance ``instance`` (its DRA device name, e.g. ``gpu0-1g10gb-s0``, or its GPU instance id), as the
    driver reports an XID it can attribute. The node's agent, waiting on its NVML event set, sees it. Returns
    what was injected, for the user. ValueError naming the argument when the node, GPU or instance is not
    there. Side effect: the node's simulated NVML state file."""
    path = state_dir / f"nvml-{node}.json"
    if not path.exists():
        known = sorted(
            p.name.removeprefix("nvml-").removesuffix(".json") for p in state_dir.glob("nvml-*.json")
        )
        raise ValueError(
            f"NODE {node!r}: no simulated GPU node of that name (nodes: {', '.join(known) or 'none'})"
        )
    if not 0 < xid < 1000:
        raise ValueError(f"CODE {xid}: an XID is a number from 1 to 999")
    try:
        simnvml.configure(state_file=path)
        gpus = simnvml.snapshot()["gpus"]
        if not 0 <= gpu < len(gpus):
            raise ValueError(f"GPU {gpu}: node {node} has GPUs 0-{len(gpus) - 1}")
        target, gi_id, ci_id = f"GPU {gpu} of {node}", None, None
        if instance is not None:
            found = _gpu_instance(gpus[gpu], gpu, instance)
            if found is None:
                raise ValueError(f"INSTANCE {instance!r}: no such MIG instance on GPU {gpu} of {node}")
            gi_id = int(found["id"])
            ci_id = next((int(c["id"]) for c in found.get("compute_instances") or []), None)
            target = f"MIG instance GI {gi_id} ({instance}) of GPU {gpu} of {node}"
        simnvml.inject_xid(gpu, xid, gi_id=gi_id, ci_id=ci_id)
    finally:
        simnvml.reset()
    return f"XID {xid} on {target}"


def _gpu_instance(gpu: dict[str, Any], index: int, instance: str) -> dict[str, Any] | None:
    """The GPU instance ``instance`` names (a GI id, or a DRA device name: its placement start). Pure."""
    for gi in gpu.get("gpu_instances") or []:
        if instance.isdigit() and int(gi["id"]) == int(instance):
            return dict(gi)
        if instance.startswith(f"gpu{index}-") and instance.endswith(f"-s{gi['start']}"):
            return dict(gi)
    return None


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
        nvml_state = state_dir / f"nvml-{node.name}.json"
        seed_gpu_state(node, nvml_state)
        argv = [
            *python, "agent", f"--node={node.name}", "--nvml=simulated", f"--simulate-gpus={node.gpus}",
            f"--state={nvml_state}", kubeconfig, f"--metrics-port={port}", "--inventory=auto",
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
