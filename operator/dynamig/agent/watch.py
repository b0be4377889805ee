"""Wake the reconcile loop on changes: watches of the Node (its labels), its GpuPartitions and ResourceSlices
(ResourceClaims have their own cache and wake the loop for this node's claims only: ``claimcache``).

The loop also polls (``AgentSettings.interval_seconds``), so a watch that breaks only delays a round; each
watch restarts after an error with a short backoff. Side effects: API watch connections.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kubernetes_asyncio import watch

from dynamig.agent.kubeapi import RESOURCE_GROUP, RESOURCE_VERSION, KubeApi
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, NODE_LABEL, VERSION

log = logging.getLogger(__name__)


async def _watch_forever(
    name: str, start: Callable[[watch.Watch], Any], wake: Callable[[], None], stop: asyncio.Event
) -> None:
    backoff = 0.5
    while not stop.is_set():
        w = watch.Watch()
        try:
            async with start(w) as stream:
                async for _event in stream:
                    backoff = 0.5
                    wake()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the poll keeps the agent correct; say why and retry
            log.debug("watch of %s ended: %s", name, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
        finally:
            w.stop()


def watch_tasks(
    api: KubeApi, node: str, wake: Callable[[], None], stop: asyncio.Event
) -> list[Coroutine[Any, Any, None]]:
    """Coroutines watching ``node``, its GpuPartitions and its slices, calling ``wake`` on events."""

    def partitions(w: watch.Watch) -> Any:
        return w.stream(
            api.custom.list_cluster_custom_object,
            GROUP,
            VERSION,
            GPU_PARTITION_PLURAL,
            label_selector=f"{NODE_LABEL}={node}",
            timeout_seconds=300,
        )

    def slices(w: watch.Watch) -> Any:
        return w.stream(
            api.custom.list_cluster_custom_object,
            RESOURCE_GROUP,
            RESOURCE_VERSION,
            "resourceslices",
            field_selector=f"spec.nodeName={node}",
            timeout_seconds=300,
        )

    def nodes(w: watch.Watch) -> Any:
        return w.stream(api.core.list_node, field_selector=f"metadata.name={node}", timeout_seconds=300)

    return [
        _watch_forever("node", nodes, wake, stop),
        _watch_forever("gpupartitions", partitions, wake, stop),
        _watch_forever("resourceslices", slices, wake, stop),
    ]
