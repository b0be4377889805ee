"""Which inventory the API server can take: partitionable devices with binding conditions, or instances only.

Kubernetes 1.36 serves partitionable devices (KEP-4815: ``sharedCounters``, ``consumesCounters``) and binding
conditions (KEP-5007: ``bindingConditions``) by default; 1.34 and 1.35 only behind alpha feature gates. An API
server whose gate is off does not reject those fields: it drops them on write (the usual handling of fields
of a disabled feature). So the agent asks the API server itself, with two server-side dry-run creates that
store nothing: a slice of counter sets, and a device slice whose device consumes a counter and carries binding
conditions. The features are there exactly when the answers keep those fields.

An API server that keeps the fields is not enough: kube-scheduler before v1.37.2 gathers every node's slices
with ``sharedCounters`` on each Filter call (k8s.io/dynamic-resource-allocation v0.36.3,
``structured/internal/incubating``: pools_incubating.go, "Always include slices with SharedCounters"), so its
CPU per pod grows as N^1.9 with the number of GPU nodes (0.55 s at 50 nodes, 45 s at 500; docs/install.md).
v1.37.2 carries the fix (kubernetes/kubernetes#138917). On an older server the probe's answer becomes
Instances, the same on every node (the version is the cluster's), unless the admin opts in
(``--inventory=partitionable``), which docs/install.md advises only for clusters of a few dozen GPU nodes.

What this cannot see is the scheduler's own gates (DRAPartitionableDevices, DRADeviceBindingConditions); a
cluster that enables a feature in the API server but not in the scheduler is misconfigured, and
docs/install.md says which versions get which inventory.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from dynamig import DRIVER_NAME
from dynamig.agent.kube.api import KubeApi
from dynamig.kube.apicalls import status_of
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY

log = logging.getLogger(__name__)

# The first kube-scheduler release whose DRA allocator checks only the node's own pools (#138917).
SCALES_FROM = (1, 37, 2)

_PROBE_SET = "probe"
_PROBE_COUNTER = "probe"


@dataclass(frozen=True, slots=True)
class InventorySupport:
    inventory: Inventory
    why: str  # what the probe saw, for logs and status


def probe_slices(node: str, driver: str = DRIVER_NAME) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two ResourceSlices the probe dry-runs: counter sets, then a device consuming them. Pure."""
    # The node's own pool and slice-name prefix, as the node admission policy requires of the agent; a
    # dry run stores nothing, so the real pool is untouched.
    pool = {"name": node, "generation": 0, "resourceSliceCount": 2}

    def body(part: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver}-feature-probe-{part}"},
            "spec": {"driver": driver, "nodeName": node, "pool": dict(pool), **spec},
        }

    counters = body(
        "counters",
        {"sharedCounters": [{"name": _PROBE_SET, "counters": {_PROBE_COUNTER: {"value": "1"}}}]},
    )
    devices = body(
        "devices",
        {
            "devices": [
                {
                    "name": "probe",
                    "consumesCounters": [
                        {"counterSet": _PROBE_SET, "counters": {_PROBE_COUNTER: {"value": "1"}}}
                    ],
                    "bindingConditions": [BINDING_READY],
                    "bindingFailureConditions": [BINDING_FAILED],
                }
            ]
        },
    )
    return counters, devices


def judge(counters: dict[str, Any], devices: dict[str, Any]) -> InventorySupport:
    """The inventory the API server's answers to :func:`probe_slices` allow. Pure."""
    missing = []
    if not (counters.get("spec") or {}).get("sharedCounters"):
        missing.append("sharedCounters (DRAPartitionableDevices)")
    device: dict[str, Any] = next(iter((devices.get("spec") or {}).get("devices") or []), {})
    if not device.get("consumesCounters"):
        missing.append("consumesCounters (DRAPartitionableDevices)")
    if not device.get("bindingConditions"):
        missing.append("bindingConditions (DRADeviceBindingConditions)")
    if missing:
        return InventorySupport(
            Inventory.INSTANCES, "the API server drops " + ", ".join(missing) + ": publishing instances only"
        )
    return InventorySupport(
        Inventory.PARTITIONABLE, "the API server keeps partitionable devices and binding conditions"
    )


def parse_version(git_version: str) -> tuple[int, int, int] | None:
    """``v1.37.2`` (or ``v1.37.2-gke.100``, ``v1.36.3+k3s1``) -> (1, 37, 2); None when unreadable. Pure."""
    core = git_version.lstrip("v").split("-", 1)[0].split("+", 1)[0]
    try:
        major, minor, patch = (int(x) for x in core.split(".")[:3])
    except ValueError:
        return None
    return major, minor, patch


def carried(support: InventorySupport, git_version: str) -> InventorySupport:
    """``support`` narrowed to what the cluster's scheduler carries at any size: Partitionable only from
    :data:`SCALES_FROM` on. Pure."""
    if support.inventory is not Inventory.PARTITIONABLE:
        return support
    version = parse_version(git_version)
    if version is not None and version >= SCALES_FROM:
        return InventorySupport(Inventory.PARTITIONABLE, f"{support.why} (Kubernetes {git_version})")
    return InventorySupport(
        Inventory.INSTANCES,
        f"the API server ({git_version or 'version unknown'}) keeps partitionable devices, but "
        "kube-scheduler before v1.37.2 spends CPU per pod that grows as N^1.9 with the GPU nodes on them: "
        "publishing instances only (--inventory=partitionable opts in; docs/install.md)",
    )


async def detect_inventory(api: KubeApi, node: str, driver: str = DRIVER_NAME) -> InventorySupport:
    """Ask the API server (dry run: nothing is stored) which inventory it takes and which version it runs,
    and choose what the scheduler of that version carries. Side effects: API reads."""
    support = await probe_inventory(api, node, driver)
    if support.inventory is not Inventory.PARTITIONABLE:
        return support
    return carried(support, await api.server_version())


async def probe_inventory(api: KubeApi, node: str, driver: str = DRIVER_NAME) -> InventorySupport:
    """Which inventory the API server takes (dry run: nothing is stored). Side effects: API reads."""
    counters, devices = probe_slices(node, driver)
    try:
        got_counters = await api.dry_run_create_slice(counters)
        got_devices = await api.dry_run_create_slice(devices)
    except Exception as exc:
        code = status_of(exc)
        message = _api_message(exc)
        if code is None or code in (401, 403) or "ValidatingAdmissionPolicy" in message:
            raise  # permissions or the node admission policy: a setup error, not a missing feature
        # 404: no resource.k8s.io/v1 at all; 422: the server rejects the fields outright (an older schema).
        return InventorySupport(
            Inventory.INSTANCES,
            f"the API server refused the probe slice ({code}: {message}): publishing instances only",
        )
    return judge(got_counters, got_devices)


def _api_message(exc: BaseException) -> str:
    """The API server's message in an error answer, else ''. Pure."""
    body = getattr(exc, "body", None)
    try:
        return str(json.loads(body).get("message", "")) if body else ""
    except (ValueError, AttributeError):
        return str(body)
