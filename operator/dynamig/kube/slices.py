"""ResourceSlices (resource.k8s.io/v1) for one node's pool of driver ``mig.dynamig.io``. Pure builders.

One pool per node, named after the node; a pool holds at most :data:`MAX_DEVICES_PER_SLICE` devices per
slice, so a large pool is split over several slices that all carry the pool's ``generation`` and
``resourceSliceCount``. Slice names are deterministic (``<node>-mig.dynamig.io-<i>``) so a publisher can
update in place and recreate a slice someone deleted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from dynamig import API_GROUP, DRIVER_NAME

MAX_DEVICES_PER_SLICE = 128
CONTENT_ANNOTATION = f"{API_GROUP}/content-hash"


def slice_name(node: str, index: int, driver: str = DRIVER_NAME) -> str:
    return f"{node}-{driver}-{index}"


def build_resource_slices(
    node: str, generation: int, devices: Sequence[dict[str, Any]], driver: str = DRIVER_NAME
) -> list[dict[str, Any]]:
    """The slices that publish ``devices`` (``Device`` dicts) as pool ``node`` at ``generation``. Pure.

    Devices are sorted by name so the same inventory always yields the same slices. An empty inventory still
    yields one slice with no devices, so the pool (and its generation) stays visible.
    """
    ordered = sorted(devices, key=lambda d: str(d["name"]))
    chunks = [ordered[i : i + MAX_DEVICES_PER_SLICE] for i in range(0, len(ordered), MAX_DEVICES_PER_SLICE)]
    if not chunks:
        chunks = [[]]
    out = []
    for i, chunk in enumerate(chunks):
        out.append(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {
                    "name": slice_name(node, i, driver),
                    "annotations": {CONTENT_ANNOTATION: content_hash(chunk)},
                },
                "spec": {
                    "driver": driver,
                    "nodeName": node,
                    "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
                    "devices": list(chunk),
                },
            }
        )
    return out


def content_hash(devices: Sequence[dict[str, Any]]) -> str:
    """A stable digest of a device list, stored on each slice as :data:`CONTENT_ANNOTATION`. Pure.

    Comparing slices through this digest avoids false differences after an API round trip (the API server
    rewrites quantities such as ``10485760`` as ``10Mi``).
    """
    return ordered_content_hash(sorted(devices, key=lambda d: str(d["name"])))


def ordered_content_hash(value: Any) -> str:
    """Like :func:`content_hash` for any JSON value, list order kept (for slices whose device order is the
    allocation order, so a reordering is a change to publish). Pure."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def ordered_slice_name(node: str, part: str, index: int, driver: str = DRIVER_NAME) -> str:
    """``<node>-<driver>-<part>-<NNN>``: the index zero-padded so that name order is index order (the
    scheduler visits a pool's slices in name order). Pure."""
    if not 0 <= index < 1000:
        raise ValueError(f"slice index {index} out of range 0-999")
    return f"{node}-{driver}-{part}-{index:03d}"
