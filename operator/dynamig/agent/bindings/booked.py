"""Which devices the node's slices must keep for bookings the agent has not answered yet (see "What is
published" in :mod:`dynamig.kube.inventory`). Pure."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from dynamig.kube.inventory import BOOKED, GpuInventory, published_devices_of


def kept_booked(gpus: Sequence[GpuInventory], booked: Collection[str]) -> list[str]:
    """The ``booked`` devices published only because they are booked (the offer lacks them). Pure."""
    return [d.name for d in published_devices_of(gpus, booked) if d.kind == BOOKED]


def published_devices(slices: Sequence[dict[str, Any]]) -> set[str]:
    """The device names ``slices`` publish. Pure."""
    return {str(d.get("name")) for s in slices for d in (s.get("spec") or {}).get("devices") or []}
