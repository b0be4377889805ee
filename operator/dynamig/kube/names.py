"""Names, labels and annotations fixed by the design. Pure constants and helpers."""

from __future__ import annotations

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
