"""Who controls a GPU's MIG layout: this agent, or another MIG owner it must not fight. Pure functions.

Another owner is recognised by
- the NVIDIA MIG manager's node label ``nvidia.com/mig.config`` (it re-applies its own layout),
- the NVIDIA device plugin's extended resources in the node's allocatable (``nvidia.com/gpu``, and
  ``nvidia.com/mig-<profile>`` under its "mixed" MIG strategy, as NVIDIA/k8s-device-plugin's README names
  them): it hands the same GPUs to pods outside DRA, or
- a ResourceSlice of another driver (e.g. the NVIDIA DRA driver ``gpu.nvidia.com``) on the same node that
  publishes MIG devices whose parent is the GPU (an attribute named ``parentUUID`` equal to the GPU UUID),
  or the GPU itself (an attribute named ``uuid`` equal to it: that driver hands the whole GPU out).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dynamig import DRIVER_NAME
from dynamig.kube.names import MANAGED_NODE_LABEL

NVIDIA_MIG_CONFIG_LABEL = "nvidia.com/mig.config"


def node_is_managed(labels: dict[str, str]) -> bool:
    """The node opted in with ``dynamig.io/managed=true``. Pure."""
    return labels.get(MANAGED_NODE_LABEL, "").lower() == "true"


def device_plugin_resources(allocatable: Mapping[str, str]) -> dict[str, str]:
    """The NVIDIA device plugin's extended resources the node advertises (non-zero). Pure."""
    return {
        name: str(qty)
        for name, qty in sorted(allocatable.items())
        if (name == "nvidia.com/gpu" or name.startswith("nvidia.com/mig-")) and str(qty) not in ("0", "")
    }


def node_mig_owner(labels: Mapping[str, str], allocatable: Mapping[str, str] | None = None) -> str | None:
    """A sentence naming the node-wide foreign MIG owner, or None. Pure."""
    value = labels.get(NVIDIA_MIG_CONFIG_LABEL)
    if value is not None:
        return f"node label {NVIDIA_MIG_CONFIG_LABEL}={value} says the NVIDIA MIG manager controls MIG here"
    advertised = device_plugin_resources(allocatable or {})
    if advertised:
        listed = ", ".join(f"{k}={v}" for k, v in advertised.items())
        return (
            f"the NVIDIA device plugin advertises {listed} on this node and would hand the same GPUs to "
            "other pods; turn it off on dynamig nodes (see docs/install.md)"
        )
    return None


def _attr_value(attr: Any) -> str | None:
    if isinstance(attr, dict):
        for key in ("string", "version"):
            if key in attr:
                return str(attr[key])
    return None


def foreign_mig_owners(
    slices: Iterable[dict[str, Any]], gpu_uuids: Iterable[str], own_driver: str = DRIVER_NAME
) -> dict[str, str]:
    """GPU UUID -> driver name, for GPUs another driver publishes (MIG devices of, or the whole GPU). Pure."""
    wanted = set(gpu_uuids)
    out: dict[str, str] = {}
    for s in slices:
        spec = s.get("spec") or {}
        driver = str(spec.get("driver", ""))
        if driver == own_driver:
            continue
        for device in spec.get("devices") or []:
            for key, attr in (device.get("attributes") or {}).items():
                if key.rsplit("/", 1)[-1] not in ("parentUUID", "uuid"):
                    continue
                parent = _attr_value(attr)
                if parent in wanted:
                    out[parent] = driver
    return out
