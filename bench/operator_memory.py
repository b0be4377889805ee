"""Operator memory against the number of GPUs it governs, measured alone (no agents in its process).

For each size (``--gpus 80,400,800``: nodes of 8 A100-80GB each) a fresh local control plane gets the CRDs,
the DeviceClass, the nodes, one GpuPartition per GPU with the status an agent reports (two free 3g.40gb
halves), one Dynamic policy over all of them, and ``--pending`` unschedulable pods with MIG claims (one per
8 GPUs by default) so that every round plans. ``dynamig operator`` then runs as its own process; its resident
memory (``VmRSS``, and ``VmHWM``, the peak) is read from /proc after ``--rounds`` planning rounds. The
in-run baseline is the same operator with no GPU at all; the figure is the slope of RSS over GPUs (least
squares) in KiB per GPU, and the intercept.

    python bench/operator_memory.py --gpus 80,400,800 -o json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dynamig.devcluster import ControlPlane
from dynamig.devcluster.processes import free_port
from dynamig.devcluster.sandbox import install
from dynamig.kube.names import GROUP_VERSION, MANAGED_NODE_LABEL

POOL_LABEL = "dynamig.io/memory-pool"
GPUS_PER_NODE = 8


def partition(node: str, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A GpuPartition and the status its agent would report: two free 3g.40gb halves. Pure."""
    name = f"{node}-gpu{index}"
    layout = [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]
    obj = {
        "apiVersion": GROUP_VERSION,
        "kind": "GpuPartition",
        "metadata": {"name": name, "labels": {"dynamig.io/node": node, "dynamig.io/gpu-index": str(index)}},
        "spec": {"layout": layout},
    }
    status = {
        "node": node, "gpuIndex": index, "uuid": f"GPU-{node}-{index}", "product": "NVIDIA A100-SXM4-80GB",
        "model": "A100-80GB", "migMode": "Enabled", "phase": "Stable", "observedGeneration": 1,
        "instances": [
            {"profile": "3g.40gb", "start": s, "deviceName": f"gpu{index}-3g40gb-s{s}", "state": "free"}
            for s in (0, 4)
        ],
    }  # fmt: skip
    return obj, status


def pending_pod(name: str) -> dict[str, Any]:
    """A pod with a claim for a 1g.10gb slice that no published device satisfies: unschedulable. Pure."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "containers": [
                {"name": "c", "image": "example.invalid/none", "resources": {"claims": [{"name": "g"}]}}
            ],
            "resourceClaims": [{"name": "g", "resourceClaimTemplateName": "memory-1g"}],
        },
    }


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB, from /proc. Side effect: reads a file."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def rounds(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "dynamig_operator_plan_duration_seconds_count"
    )


def measure(gpus: int, args: argparse.Namespace) -> dict[str, Any]:
    with ControlPlane() as cp:
        install(cp)
        api = cp.rest()
        nodes = gpus // GPUS_PER_NODE
        t0 = time.monotonic()
        for n in range(nodes):
            node = f"mem-{n:04d}"
            cp.register_node(node, labels={MANAGED_NODE_LABEL: "true", POOL_LABEL: "yes"})
            for i in range(GPUS_PER_NODE):
                obj, status = partition(node, i)
                made = api.request("POST", "/apis/dynamig.io/v1alpha1/gpupartitions", obj)
                made["status"] = status
                api.request(
                    "PUT", f"/apis/dynamig.io/v1alpha1/gpupartitions/{obj['metadata']['name']}/status", made
                )
        policy = {
            "apiVersion": GROUP_VERSION,
            "kind": "GpuPartitionPolicy",
            "metadata": {"name": "memory"},
            "spec": {
                "mode": "Dynamic",
                "nodeSelector": {"matchLabels": {POOL_LABEL: "yes"}},
                "cooldownSeconds": 3600,
            },
        }
        api.request("POST", "/apis/dynamig.io/v1alpha1/gpupartitionpolicies", policy)
        selector = 'device.attributes["mig.dynamig.io"].profile == "1g.10gb"'
        template = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "memory-1g", "namespace": "default"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "mig.dynamig.io", "selectors": [{"cel": {"expression": selector}}]}}]}}},
        }  # fmt: skip
        api.request("POST", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates", template)
        pending = args.pending if args.pending is not None else max(1, gpus // GPUS_PER_NODE)
        for p in range(pending if gpus else 0):
            api.request("POST", "/api/v1/namespaces/default/pods", pending_pod(f"wait-{p:04d}"))
        setup_s = time.monotonic() - t0

        port = free_port()
        argv = [
            sys.executable, "-m", "dynamig", "operator", "--standalone", f"--kubeconfig={cp.kubeconfig_path}",
            f"--metrics-port={port}", "--metrics-host=127.0.0.1", "--resync-seconds=1", "--log-level=warning",
        ]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + args.timeout
            done = 0.0
            while time.monotonic() < deadline:
                time.sleep(1.0)
                try:
                    done = rounds(port)
                except OSError:
                    continue
                if done >= args.rounds or (gpus == 0 and time.monotonic() - t0 > setup_s + 10):
                    break
            rss, peak = rss_kib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {"gpus": gpus, "nodes": gpus // GPUS_PER_NODE, "pending_pods": pending if gpus else 0,
            "rounds": done, "rss_mb": round(rss / 1024, 1), "peak_rss_mb": round(peak / 1024, 1),
            "setup_s": round(setup_s, 1)}  # fmt: skip


def slope(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y over x. Pure."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return b, my - b * mx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="80,400,800", help="GPU counts (multiples of 8), comma separated")
    parser.add_argument("--pending", type=int, default=None, help="pending pods per size (default GPUs/8)")
    parser.add_argument("--rounds", type=float, default=5, help="planning rounds before reading the memory")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the rounds")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text")
    args = parser.parse_args()
    sizes = [0, *(int(g) for g in args.gpus.split(","))]
    results = [measure(g, args) for g in sizes]
    for r in results:
        text = (
            f"{r['gpus']:5d} GPUs ({r['nodes']} nodes, {r['pending_pods']} pending pods): "
            f"RSS {r['rss_mb']} MB, peak {r['peak_rss_mb']} MB after {r['rounds']:.0f} rounds"
        )
        print(json.dumps(r) if args.output == "json" else text)
    b, a = slope([(r["gpus"], r["rss_mb"] * 1024) for r in results])
    summary = {"slope_kib_per_gpu": round(b, 1), "intercept_mb": round(a / 1024, 1),
               "baseline_mb": results[0]["rss_mb"]}  # fmt: skip
    print(json.dumps(summary) if args.output == "json" else
          f"slope {summary['slope_kib_per_gpu']} KiB per GPU, intercept {summary['intercept_mb']} MB "
          f"(no GPU: {summary['baseline_mb']} MB)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
