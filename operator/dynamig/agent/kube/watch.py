"""The copies an agent's rounds read instead of the API (:mod:`dynamig.agent.kube.cache`): its Node, its
GpuPartitions, its node's ResourceSlices (every driver's) and every ResourceClaim. A change to any of them
starts a round at once (claims: only those allocated on this node's pool, ``claimcache``).

The loop also polls (``AgentSettings.interval_seconds``) for what only NVML shows (processes, a GPU lost);
those rounds read the copies, so an idle node makes no API request but its Lease renewals and a watch
restart every few minutes per copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynamig.agent.kube.api import RESOURCE_GROUP, RESOURCE_VERSION, KubeApi
from dynamig.agent.kube.cache import Source, WatchedList
from dynamig.agent.kube.claims import ClaimCache
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, NODE_LABEL, VERSION


@dataclass(frozen=True, slots=True)
class NodeCopies:
    node: WatchedList
    partitions: WatchedList
    slices: WatchedList
    claims: ClaimCache

    def all(self) -> tuple[WatchedList, ...]:
        return (self.node, self.partitions, self.slices, self.claims)


def node_copies(api: KubeApi, node: str, driver: str, wake: Any) -> NodeCopies:
    """The four copies of ``node``'s agent; ``wake`` starts a round."""
    custom = api.custom.list_cluster_custom_object
    return NodeCopies(
        node=WatchedList(
            Source("node", api.core.list_node, (), {"field_selector": f"metadata.name={node}"}),
            api.api_client.sanitize_for_serialization,  # list_node answers with a model
            wake,
        ),
        partitions=WatchedList(
            Source(
                "gpupartitions",
                custom,
                (GROUP, VERSION, GPU_PARTITION_PLURAL),
                {"label_selector": f"{NODE_LABEL}={node}"},
            ),
            dict,
            wake,
        ),
        slices=WatchedList(
            Source(
                "resourceslices",
                custom,
                (RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices"),
                {"field_selector": f"spec.nodeName={node}"},
            ),
            dict,
            wake,
        ),
        claims=ClaimCache(api, driver, node, wake),
    )
