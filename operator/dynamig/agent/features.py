"""Which inventory the API server can take: partitionable devices with binding conditions, or instances only.

Kubernetes 1.36 serves partitionable devices (KEP-4815: ``sharedCounters``, ``consumesCounters``) and binding
conditions (KEP-5007: ``bindingConditions``) by default; 1.34 and 1.35 only behind alpha feature gates. An API
server whose gate is off does not reject those fields: it drops them on write (the usual handling of fields
of a disabled feature). So the agent asks the API server itself, with two server-side dry-run creates that
store nothing: a slice of counter sets, and a device slice whose device consumes a counter and carries binding
conditions. The features are there exactly when the answers keep those fields.

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
from dynamig.agent.kubeapi import KubeApi
from dynamig.kube.apicalls import status_of
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY

log = logging.getLogger(__name__)

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


async def detect_inventory(api: KubeApi, node: str, driver: str = DRIVER_NAME) -> InventorySupport:
    """Ask the API server (dry run: nothing is stored) which inventory it takes. Side effects: API reads."""
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
