"""What kube-scheduler pays for dynamig's two inventories as the cluster grows, per Kubernetes version.

For each version (``--versions``, built like the test control plane) and inventory, one local control plane
grows to each size in ``--nodes``: fake Ready nodes registered through the API, each publishing the inventory
of an idle ``--gpus`` x A100-80GB node (no agents, no kubelet):

- ``partitionable``: every valid placement of every profile as a partitionable device with shared counters
  (dynamig.kube.inventory, as the agent publishes an idle node), binding conditions dropped so pods bind with
  no agent to answer;
- ``instances``: seven existing ``1g.10gb`` instances per GPU, no counters (dynamig.kube.slices).

At each size ``--pods`` pods, each with one claim for a ``1g.10gb``, are created at ``--rate`` per second
(no node selector: the scheduler filters every node). Printed per row: kube-scheduler CPU seconds per bound
pod (from /proc), p50/p99 pod created -> bound, pods bound per second, the DynamicResources Filter mean from
the scheduler's own ``scheduler_plugin_execution_duration_seconds`` (sampled), Filter timeouts
(FailedScheduling "timed out trying to allocate devices"), the scheduler's RSS and peak RSS, and the growth
exponent of CPU per pod against the previous size. A row stops at ``--row-budget-s``; what was bound by then
is what it reports ("bound k/M").

    python bench/sched_scale.py                                  # 1.36.3 and 1.37.2, 50..1000 nodes
    python bench/sched_scale.py --versions v1.37.2 --nodes 50,200 --pods 50 -o json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import ssl
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dynamig.demo.cluster import claim_pod, first_available, resource_claim
from dynamig.devcluster import ControlPlane
from dynamig.devcluster.rest import ApiError, RestClient
from dynamig.devcluster.versions import KubeTarget
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.devices import MigDevice, device_class
from dynamig.kube.inventory import GpuInventory, build_inventory_slices
from dynamig.kube.names import DEVICE_CLASS_NAME
from dynamig.kube.slices import build_resource_slices
from dynamig.planner.offerlimit import auto_limit, parse_limit
from dynamig.simulate.trace import percentile

MODEL = load_catalog().model("A100-80GB")
PROFILE = "1g.10gb"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
TICKS = os.sysconf("SC_CLK_TCK")
# The scheduler serves /metrics only to authorised clients; the bench's control plane lets anyone read it.
SCHEDULER_ARGS = ["--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics"]


@dataclass
class Row:
    version: str
    inventory: str
    nodes: int
    pods: int
    bound: int = 0
    cpu_per_pod_s: float = math.nan
    bound_p50_s: float = math.nan
    bound_p99_s: float = math.nan
    pods_per_s: float = math.nan
    filter_mean_ms: float = math.nan
    filter_timeouts: int = 0
    rss_mb: float = 0.0
    peak_rss_mb: float = 0.0
    exponent: float | None = None  # growth of CPU per pod against the previous size
    devices_per_node: int = 0
    slices_per_node: int = 0
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        exp = "" if self.exponent is None else f"  N^{self.exponent:.2f}"
        return (
            f"{self.version:8} {self.inventory:13} {self.nodes:5} nodes  bound {self.bound}/{self.pods}  "
            f"scheduler CPU/pod {self.cpu_per_pod_s:.3f}s{exp}  created->bound p50 {self.bound_p50_s:.2f}s "
            f"p99 {self.bound_p99_s:.2f}s  {self.pods_per_s:.2f} pods/s  Filter {self.filter_mean_ms:.2f}ms  "
            f"timeouts {self.filter_timeouts}  RSS {self.rss_mb:.0f}MB (peak {self.peak_rss_mb:.0f}MB)"
        )


def node_slices(node: str, inventory: str, gpus: int, top: int = 0) -> list[dict[str, Any]]:
    """The ResourceSlices an idle node of ``gpus`` A100-80GBs publishes in ``inventory``; with ``top`` > 0 the
    partitionable inventory keeps only the ``top`` best-ranked placements of each profile on each GPU."""
    uuid = f"GPU-{node}"
    if inventory == "partitionable":
        inv = [GpuInventory(i, MODEL, f"{uuid}-{i}") for i in range(gpus)]
        slices = build_inventory_slices(node, 1, inv)
        kept: dict[tuple[str, str], int] = {}
        for s in slices:
            devices = []
            for d in s["spec"].get("devices") or []:
                for name in ("bindingConditions", "bindingFailureConditions", "bindsToNode"):
                    d.pop(name, None)  # no agent answers here: bind at once
                attrs = d["attributes"]
                which = (str(attrs["mig.dynamig.io/gpuIndex"]), str(attrs["mig.dynamig.io/profile"]))
                kept[which] = kept.get(which, 0) + 1
                if not top or kept[which] <= top:  # devices come in rank order
                    devices.append(d)
            if "devices" in s["spec"]:
                s["spec"]["devices"] = devices
        return slices
    profile = MODEL.profile(PROFILE)
    devices = [
        MigDevice(
            gpu_index=i, profile=profile, placement_start=start, product_name="NVIDIA A100-SXM4-80GB",
            parent_uuid=f"{uuid}-{i}", uuid=f"MIG-{node}-{i}-{start}",
            memory_bytes=profile.memory_mib << 20, multiprocessors=profile.multiprocessors,
        ).to_api()
        for i in range(gpus)
        for start in profile.placement_starts
    ]  # fmt: skip
    return build_resource_slices(node, 1, devices)


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def proc_rss_mb(pid: int) -> tuple[float, float]:
    status = Path(f"/proc/{pid}/status").read_text()

    def kb(key: str) -> float:
        m = re.search(rf"^{key}:\s+(\d+) kB", status, re.M)
        return int(m.group(1)) / 1024 if m else 0.0

    return kb("VmRSS"), kb("VmHWM")


def filter_totals(port: int) -> tuple[float, float]:
    """(sum seconds, count) of the scheduler's sampled DynamicResources Filter executions."""
    url = f"https://127.0.0.1:{port}/metrics"
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE  # the scheduler's self-signed cert
    with urllib.request.urlopen(url, context=insecure, timeout=30) as resp:
        text = resp.read().decode()
    total = {"sum": 0.0, "count": 0.0}
    pattern = r"^scheduler_plugin_execution_duration_seconds_(sum|count)\{([^}]*)\} (\S+)$"
    for kind, labels, value in re.findall(pattern, text, re.M):
        if 'plugin="DynamicResources"' in labels and 'extension_point="Filter"' in labels:
            total[kind] += float(value)
    return total["sum"], total["count"]


def publish(api: RestClient, name: str, inventory: str, gpus: int, top: int) -> tuple[int, int]:
    """Publish node ``name``'s slices; (devices, slices) it published."""
    built = node_slices(name, inventory, gpus, top)
    for s in built:
        with contextlib.suppress(ApiError):
            api.request("POST", SLICES, s)
    return sum(len(s["spec"].get("devices") or []) for s in built), len(built)


def grow(
    api: RestClient, cp: ControlPlane, have: int, want: int, inventory: str, gpus: int, top: int
) -> tuple[int, int]:
    """Register nodes ``have``..``want``-1 and publish their slices; (devices, slices) per node."""
    devices = slices = 0
    for n in range(have, want):
        name = f"gpu-{n:04d}"
        cp.register_node(name, allocatable={"pods": "500"})
        devices, slices = publish(api, name, inventory, gpus, top)
    return devices, slices


def republish(api: RestClient, nodes: int, inventory: str, gpus: int, top: int) -> None:
    """Replace the slices of nodes 0..``nodes``-1 with ones offering ``top`` placements per profile, as the
    agents do when the operator's choice for the cluster's size changes."""
    api.request("DELETE", SLICES)
    for n in range(nodes):
        publish(api, f"gpu-{n:04d}", inventory, gpus, top)


def wait_idle(pid: int, limit_s: float = 300.0) -> None:
    """Until the scheduler spends under a tenth of a core for 3 s: work left from the last size (pods it was
    still trying when they were deleted) is not charged to the next."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = proc_cpu_s(pid)
        time.sleep(3.0)
        if proc_cpu_s(pid) - before < 0.3:
            return


def measure(api: RestClient, cp: ControlPlane, row: Row, rate: float, budget_s: float) -> None:
    ns = f"scale-{row.nodes}"
    api.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
    with contextlib.suppress(ApiError):
        api.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "default"}})
    pid, port = cp.pids["kube-scheduler"], cp.ports["kube-scheduler"]
    wait_idle(pid)
    cpu0, (fsum0, fcount0) = proc_cpu_s(pid), filter_totals(port)
    created: dict[str, float] = {}
    bound: dict[str, float] = {}
    start = time.monotonic()
    deadline = start + budget_s
    next_poll = 0.0

    def poll() -> None:
        items = api.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"]
        now = time.monotonic()
        for p in items:
            if p["spec"].get("nodeName") and p["metadata"]["name"] not in bound:
                bound[p["metadata"]["name"]] = now

    for i in range(row.pods):
        name = f"p{i:04d}"
        api.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims",
                    resource_claim(name, {"firstAvailable": first_available([PROFILE])}))  # fmt: skip
        api.request("POST", f"/api/v1/namespaces/{ns}/pods", claim_pod(name, {}, claim=name))
        created[name] = time.monotonic()
        while time.monotonic() < start + (i + 1) / rate:
            if time.monotonic() >= next_poll:
                poll()
                next_poll = time.monotonic() + 0.25
            time.sleep(0.05)
    while len(bound) < row.pods and time.monotonic() < deadline:
        poll()
        time.sleep(0.25)
    cpu1, (fsum1, fcount1) = proc_cpu_s(pid), filter_totals(port)
    row.bound = len(bound)
    if bound:
        waits = [bound[n] - created[n] for n in bound]
        row.cpu_per_pod_s = (cpu1 - cpu0) / len(bound)
        row.bound_p50_s, row.bound_p99_s = percentile(waits, 50), percentile(waits, 99)
        span = max(bound.values()) - min(created.values())
        row.pods_per_s = len(bound) / span if span > 0 else math.nan
    if fcount1 > fcount0:
        row.filter_mean_ms = (fsum1 - fsum0) / (fcount1 - fcount0) * 1000
    events = api.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    row.filter_timeouts = sum(
        int(e.get("count") or 1)
        for e in events
        if e.get("reason") == "FailedScheduling"
        and "timed out trying to allocate devices" in e.get("message", "")
    )
    row.rss_mb, row.peak_rss_mb = proc_rss_mb(pid)
    if row.bound < row.pods:
        row.notes.append(f"{row.pods - row.bound} pod(s) not bound within {budget_s:.0f}s")
    # Free the devices for the next size: pods and claims go at once (no kubelet to confirm).
    api.request("DELETE", f"/api/v1/namespaces/{ns}/pods?gracePeriodSeconds=0")
    api.request("DELETE", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims")
    api.request("DELETE", f"/api/v1/namespaces/{ns}")


def run(
    version: str,
    inventory: str,
    sizes: list[int],
    args: argparse.Namespace,
    say: Any,
    top: int | None = 0,
    score_pct: int = 0,
) -> list[Row]:
    """``top``: placements per profile (0: every one); None: the default, the operator's choice for each
    size (``offerlimit.auto_limit``), with every node republished when that choice changes."""
    rows: list[Row] = []
    label = "partitionable-default" if top is None else inventory if not top else f"{inventory}-top{top}"
    if score_pct:
        label += f"@{score_pct}%"
    # percentageOfNodesToScore: 0 leaves kube-scheduler's adaptive default (50% - N/125, at least 5%): each
    # pod's Filter pass visits a share of a growing cluster; a fixed share visits at least 100 nodes.
    config = {"percentageOfNodesToScore": score_pct} if score_pct else {}
    work = Path(args.work_dir) / f"{version}-{label}"
    with ControlPlane(
        work_dir=work, target=KubeTarget(version), scheduler_args=SCHEDULER_ARGS, scheduler_config=config
    ) as cp:
        api = cp.rest()
        api.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", device_class())
        have = 0
        published: int | None = None
        for n in sizes:
            t0 = time.monotonic()
            limit = auto_limit(n) if top is None else top
            if published is not None and limit != published:
                republish(api, have, inventory, args.gpus, limit)
            published = limit
            devices, slices = grow(api, cp, have, n, inventory, args.gpus, limit)
            have = n
            say(f"{version} {label}: {n} nodes registered and published in {time.monotonic() - t0:.0f}s")
            time.sleep(args.settle_s)  # the scheduler's informers take the new slices in
            row = Row(version, label, n, args.pods, devices_per_node=devices, slices_per_node=slices)
            measure(api, cp, row, args.rate, args.row_budget_s)
            if rows and rows[-1].bound and row.bound and rows[-1].cpu_per_pod_s > 0 and row.cpu_per_pod_s > 0:
                row.exponent = math.log(row.cpu_per_pod_s / rows[-1].cpu_per_pod_s) / math.log(
                    n / rows[-1].nodes
                )
            rows.append(row)
            say(row.text())
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", default="v1.36.3,v1.37.2")
    ap.add_argument("--inventories", default="partitionable,instances")
    ap.add_argument("--nodes", default="50,200,500,1000")
    ap.add_argument("--gpus", type=int, default=8, help="A100-80GBs per node")
    ap.add_argument("--pods", type=int, default=60, help="pods (one 1g.10gb claim each) per size")
    ap.add_argument("--rate", type=float, default=5.0, help="pods created per second")
    ap.add_argument(
        "--row-budget-s", type=float, default=120.0, help="time a size may take after the last create"
    )
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument(
        "--top",
        default="",
        help="also run the partitionable inventory publishing only the K best-ranked placements of each "
        "profile per GPU, for each K listed (e.g. 1,2), on the last version; 'auto' is the default, the "
        "operator's choice for each size (every placement up to 64 nodes, one above)",
    )
    ap.add_argument(
        "--nodes-to-score",
        default="0",
        help="kube-scheduler percentageOfNodesToScore per run, comma-separated; 0 is its adaptive default",
    )
    ap.add_argument("--work-dir", default="/tmp/dynamig-sched-scale")
    ap.add_argument("-o", "--output", choices=["text", "json"], default="text")
    args = ap.parse_args()
    sizes = sorted(int(x) for x in args.nodes.split(","))

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.output == "json" else sys.stdout, flush=True)

    say(f"{DEVICE_CLASS_NAME}: {args.gpus} x A100-80GB per node, {args.pods} pods per size at {args.rate}/s")
    rows: list[Row] = []
    versions = args.versions.split(",")
    for pct in [int(x) for x in args.nodes_to_score.split(",")]:
        for version in versions:
            for inventory in args.inventories.split(","):
                rows += run(version, inventory, sizes, args, say, score_pct=pct)
        for k in [parse_limit(x) for x in args.top.split(",") if x]:
            rows += run(versions[-1], "partitionable", sizes, args, say, top=k, score_pct=pct)
    if args.output == "json":
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    print(
        "\nsummary: scheduler CPU per pod against the instances inventory (same version, size, share scored)"
    )
    for pct in [int(x) for x in args.nodes_to_score.split(",")]:
        suffix = f"@{pct}%" if pct else ""
        for version in versions:
            for n in sizes:
                got = {
                    r.inventory: r
                    for r in rows
                    if r.version == version
                    and r.nodes == n
                    and r.inventory.endswith(suffix)
                    and (pct or "@" not in r.inventory)
                }
                base = got.pop("instances" + suffix, None)
                if base is None or not base.cpu_per_pod_s > 0:
                    continue
                ratios = ", ".join(
                    f"{label} {r.cpu_per_pod_s / base.cpu_per_pod_s:.1f}x" for label, r in got.items()
                )
                print(f"  {version} {n:5} nodes{suffix and ' ' + suffix}: {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
