"""Keeps the node's ResourceSlices for driver ``mig.dynamig.io`` equal to a desired inventory.

:meth:`SlicePublisher.sync` (instances only) and :meth:`SlicePublisher.sync_inventory` (partitionable
devices) compare what the API holds (through the content digest each slice carries) with the slices the
inventory makes and, on any difference, write every slice of the pool at a new pool generation (one above the
highest seen), then delete slices the pool no longer needs (including those of the other inventory's naming,
so switching inventories leaves nothing behind). A slice someone deleted is therefore recreated on the next
sync. Side effects: API writes.

In the partitionable inventory every device booked and not answered yet stays published
(:mod:`dynamig.kube.inventory`): when a write would drop a published device, the claims are read afresh first
(the round's copy may not show a booking made a moment ago) and the devices they book are kept.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from dynamig import DRIVER_NAME
from dynamig.agent.bindings.answering import booked_devices
from dynamig.agent.bindings.booked import kept_booked, published_devices
from dynamig.agent.kube.api import KubeApi
from dynamig.kube.apicalls import status_of
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY, GpuInventory, build_inventory_slices
from dynamig.kube.slices import CONTENT_ANNOTATION, build_resource_slices

if TYPE_CHECKING:
    from dynamig.agent.health.devices import DeviceHealth

log = logging.getLogger(__name__)


def _generation(obj: dict[str, Any]) -> int:
    return int(((obj.get("spec") or {}).get("pool") or {}).get("generation") or 0)


def _digest(obj: dict[str, Any]) -> str:
    return str(((obj.get("metadata") or {}).get("annotations") or {}).get(CONTENT_ANNOTATION, ""))


class SlicePublisher:
    """Publishes one pool (named after the node) of driver ``mig.dynamig.io``."""

    def __init__(self, api: KubeApi, node: str, driver: str = DRIVER_NAME) -> None:
        self.api = api
        self.node = node
        self.driver = driver
        self.generation = 0  # last generation written; the API's highest wins after a restart
        self.publishes = 0
        # Owner of the slices (the Node, as for kubelet-registered drivers): deleting the node collects them.
        self.owner: dict[str, Any] | None = None
        # Devices a critical XID made sick are tainted or left out (agent/health/devices.py).
        self.health: DeviceHealth | None = None

    def _ours(self, slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            s
            for s in slices
            if (s.get("spec") or {}).get("driver") == self.driver
            and ((s.get("spec") or {}).get("pool") or {}).get("name") == self.node
        ]

    async def sync(
        self, devices: Sequence[dict[str, Any]], existing: list[dict[str, Any]] | None = None
    ) -> bool:
        """Make the pool publish exactly ``devices`` (instances only). Returns True when it wrote anything.

        ``existing`` may pass the node's slices already listed this round (any driver); otherwise they are
        listed here.
        """
        build = await self._healthy(lambda gen: build_resource_slices(self.node, gen, devices, self.driver))
        return await self._sync(build, existing)

    async def sync_inventory(
        self,
        gpus: Sequence[GpuInventory],
        existing: list[dict[str, Any]] | None = None,
        claims: list[dict[str, Any]] | None = None,
        whole: Sequence[dict[str, Any]] = (),
    ) -> bool:
        """Make the pool publish the partitionable inventory of ``gpus`` (counter sets, ranked devices), with
        every device ``claims`` book and the agent has not answered yet (``claims``: the round's copy; read
        afresh before a write that would drop a device), and the ``whole`` GPUs' devices (MIG mode off).
        Returns True when it wrote anything. Raises ``InventoryError`` before writing when it cannot be
        published."""
        booked = self._booked(claims or [])

        def build(gen: int) -> list[dict[str, Any]]:
            return build_inventory_slices(self.node, gen, gpus, self.driver, booked, whole)

        async def before_dropping() -> None:
            fresh = self._booked(await self.api.list_claims())  # newer than the round's copy: it wins
            booked.clear()
            booked.update(fresh)
            kept = kept_booked(gpus, booked)
            if kept:
                log.info(
                    "node %s: %d booked device(s) stay published until answered: %s",
                    self.node, len(kept), ", ".join(kept),
                )  # fmt: skip

        return await self._sync(await self._healthy(build, booked), existing, before_dropping)

    async def _healthy(
        self, build: Callable[[int], list[dict[str, Any]]], keep: set[str] | None = None
    ) -> Callable[[int], list[dict[str, Any]]]:
        """``build`` with the sick devices tainted, or withdrawn where the API drops taints (devices in
        ``keep``, booked and not answered, stay). Side effect: the first time, asks the API server."""
        health = self.health
        if health is None or not await health.prepare(self.api, self.driver):
            return build
        return lambda gen: health.apply(build(gen), keep or set())

    def _booked(self, claims: list[dict[str, Any]]) -> set[str]:
        return set(booked_devices(claims, self.driver, self.node, BINDING_READY, BINDING_FAILED))

    async def _sync(
        self,
        build: Callable[[int], list[dict[str, Any]]],
        existing: list[dict[str, Any]] | None,
        before_dropping: Callable[[], Awaitable[None]] | None = None,
    ) -> bool:
        current = self._ours(existing if existing is not None else await self.api.list_slices(self.node))
        by_name = {s["metadata"]["name"]: s for s in current}
        top = max([self.generation, *(_generation(s) for s in current)])
        probe = build(top)
        same = len(current) == len(probe) and all(
            p["metadata"]["name"] in by_name
            and _digest(by_name[p["metadata"]["name"]]) == _digest(p)
            and _generation(by_name[p["metadata"]["name"]]) == top
            and int(by_name[p["metadata"]["name"]]["spec"]["pool"].get("resourceSliceCount", 0)) == len(probe)
            for p in probe
        )
        if same:
            self.generation = top
            return False
        if existing is not None:  # a watched copy may be a moment behind: write from a fresh read
            return await self._sync(build, None, before_dropping)
        if before_dropping is not None and published_devices(current) - published_devices(probe):
            await before_dropping()  # a booking the round did not see keeps its device (kube/inventory.py)
        generation = top + 1
        wanted = build(generation)
        for body in wanted:
            if self.owner is not None:
                body["metadata"]["ownerReferences"] = [dict(self.owner)]
            name = body["metadata"]["name"]
            have = by_name.get(name)
            if have is None:
                await self.api.create_slice(body)
            else:
                body["metadata"]["resourceVersion"] = have["metadata"].get("resourceVersion")
                try:
                    await self.api.replace_slice(name, body)
                except Exception as exc:
                    if status_of(exc) != 404:
                        raise
                    del body["metadata"]["resourceVersion"]
                    await self.api.create_slice(body)
        keep = {b["metadata"]["name"] for b in wanted}
        for name in by_name:
            if name not in keep:
                await self.api.delete_slice(name)
        self.generation = generation
        self.publishes += 1
        log.info(
            "published %d device(s) for node %s in %d slice(s), pool generation %d",
            sum(len(b["spec"].get("devices") or []) for b in wanted),
            self.node,
            len(wanted),
            generation,
        )
        return True

    async def remove(self) -> int:
        """Delete every slice of this pool (uninstall). Returns how many were deleted."""
        current = self._ours(await self.api.list_slices(self.node))
        for s in current:
            await self.api.delete_slice(s["metadata"]["name"])
        return len(current)
