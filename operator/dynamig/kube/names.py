"""Names, labels and annotations fixed by the design. Pure constants and helpers."""

from __future__ import annotations

import re

from dynamig import API_GROUP, API_VERSION, DRIVER_NAME

GROUP = API_GROUP
VERSION = API_VERSION
GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"

GPU_PARTITION_KIND = "GpuPartition"
GPU_PARTITION_PLURAL = "gpupartitions"
POLICY_KIND = "GpuPartitionPolicy"
POLICY_PLURAL = "gpupartitionpolicies"

DEVICE_CLASS_NAME = DRIVER_NAME
ATTRIBUTE_DOMAIN = DRIVER_NAME
# The DeviceClasses the operator keeps, one per offered profile, carry this label ("true") and the profile
# in this annotation (label values take no "+").
PROFILE_CLASS_LABEL = f"{API_GROUP}/profile-class"
PROFILE_ANNOTATION = f"{API_GROUP}/profile"
# The prefix of the NVIDIA device plugin's "mixed" MIG strategy resource names (nvidia.com/mig-1g.10gb).
DEVICE_PLUGIN_MIG_PREFIX = "nvidia.com/mig-"

# A GPU with MIG mode off is published as one device, ``gpu<index>``, whose ``profile`` attribute is
# WHOLE_PROFILE; the DeviceClass WHOLE_CLASS_NAME selects exactly those and serves the device plugin's
# ``nvidia.com/gpu`` (DRAExtendedResource) where no other class names it.
WHOLE_PROFILE = "whole"
WHOLE_CLASS_NAME = f"gpu.{API_GROUP}"
WHOLE_GPU_RESOURCE = "nvidia.com/gpu"

# A node opts in to being managed by the agent with this label set to "true".
MANAGED_NODE_LABEL = f"{API_GROUP}/managed"
# Labels put on every GpuPartition so selectors and kubectl can filter by node / GPU.
NODE_LABEL = f"{API_GROUP}/node"
GPU_INDEX_LABEL = f"{API_GROUP}/gpu-index"
PRODUCT_LABEL = f"{API_GROUP}/product"
# Set on every GpuPartition by `dynamig uninstall` (the chart's pre-delete hook): the node's agent stops
# publishing, applies the layout written with it, removes what it made on the node and reports Uninstalled.
UNINSTALL_ANNOTATION = f"{API_GROUP}/uninstall"


def gpu_partition_name(node: str, gpu_index: int) -> str:
    """``<node>-gpu<index>``, the GpuPartition (one per physical GPU) name."""
    return f"{node}-gpu{gpu_index}"


def whole_device_name(gpu_index: int) -> str:
    """``gpu<index>``: the device a GPU with MIG mode off is published as."""
    return f"gpu{gpu_index}"


def whole_device_index(name: str) -> int | None:
    """The GPU index a whole-GPU device name stands for (``gpu3`` -> 3); None for any other name."""
    m = re.fullmatch(r"gpu(0|[1-9][0-9]*)", name)
    return int(m.group(1)) if m else None


def profile_resource_suffix(profile: str) -> str:
    """A profile as the NVIDIA device plugin spells it in resource names: ``+`` becomes ``.``
    (k8s-device-plugin internal/rm/rm.go: ``strings.ReplaceAll("mig-"+p.String(), "+", ".")``)."""
    return profile.replace("+", ".")


def extended_resource_name(profile: str) -> str:
    """The device plugin's mixed-strategy resource for ``profile``: ``nvidia.com/mig-1g.10gb``."""
    return DEVICE_PLUGIN_MIG_PREFIX + profile_resource_suffix(profile)


def profile_class_name(profile: str) -> str:
    """``mig-1g.10gb.dynamig.io``: the DeviceClass of one profile, named after its device-plugin resource."""
    return f"mig-{profile_resource_suffix(profile)}.{API_GROUP}"
