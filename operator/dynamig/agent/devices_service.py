"""MIG instances on demand for the kubelet DRA plugin: :class:`AgentMigInstances`.

It implements ``dynamig.agent.plugin.instances.MigInstances`` on top of the node agent:

- ``await ensure(device_name) -> PreparedInstance``: the instance named ``device_name`` (e.g.
  ``gpu0-1g10gb-s6``) exists afterwards, with its MIG UUID, parent GPU UUID/index/minor, GI id and CI id.
  A missing instance is created at its placement when those memory slices are free (reshape protocol step
  5); a GI left without its CI is completed. Raises ``UnknownDevice`` when the name is no placement of this
  node's GPUs, ``PlacementTaken`` when another instance holds the slices, ``InstanceError`` otherwise (MIG
  disabled, NVML failure). The device is then counted as prepared: busy, never destroyed, ``in-use`` in
  status.
- ``await release(device_name)``: a claim using it was unprepared; the device is counted once fewer
  (:class:`dynamig.agent.prepared.PreparedDevices`: an admin-access claim may still use it) and the
  GpuPartition status is refreshed (``free`` once no claim uses or allocates it). Never destroys.
- ``await lookup(device_name)``: the instance if it exists, else None; creates nothing.
- a whole GPU (``gpu<index>``, MIG mode off) needs no NVML work: ``ensure`` counts it prepared and hands it
  on (``PreparedInstance`` with GI and CI ids -1), and refuses it while the GPU's MIG mode is on or changing.
- ``mark_prepared(names)``: after a plugin restart, re-assert the devices its checkpoint holds.

Calls are serialised with the agent's reconcile rounds through the agent's lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from dynamig.agent.controller import NodeAgent
from dynamig.agent.kube.api import allocated_devices
from dynamig.agent.layout.lifecycle import bound_may_clear
from dynamig.agent.nvml.device import GpuInfo, MigInstance
from dynamig.agent.plugin.instances import InstanceError, PlacementTaken, PreparedInstance, UnknownDevice
from dynamig.geometry.model import PlacedInstance, device_name, placement_of
from dynamig.kube.names import WHOLE_PROFILE, whole_device_index

log = logging.getLogger(__name__)


def prepared_instance(name: str, gpu: GpuInfo, inst: MigInstance) -> PreparedInstance:
    """What the plugin hands on of an NVML instance (device ``name``); InstanceError without a CI. Pure."""
    if inst.ci_id is None or not inst.mig_uuid:
        raise InstanceError(f"{name}: GPU instance {inst.gi_id} has no compute instance")
    return PreparedInstance(
        device_name=name,
        mig_uuid=inst.mig_uuid,
        parent_uuid=gpu.uuid,
        gpu_index=gpu.index,
        gpu_minor=gpu.minor if gpu.minor is not None else gpu.index,
        gi_id=inst.gi_id,
        ci_id=inst.ci_id,
        profile=inst.profile,
        placement_start=inst.start,
    )


def whole_prepared(name: str, gpu: GpuInfo) -> PreparedInstance:
    """What the plugin hands on of a whole GPU (device ``name``, MIG mode off). Pure."""
    return PreparedInstance(
        device_name=name,
        mig_uuid="",
        parent_uuid=gpu.uuid,
        gpu_index=gpu.index,
        gpu_minor=gpu.minor if gpu.minor is not None else gpu.index,
        gi_id=-1,
        ci_id=-1,
        profile=WHOLE_PROFILE,
    )


def whole_refusal(name: str, gpu: GpuInfo) -> str | None:
    """Why the whole GPU ``name`` cannot be handed out now (its MIG mode is on or changing), or None. Pure."""
    if gpu.mig_enabled or gpu.mig_current != gpu.mig_pending:
        return f"{name}: MIG mode is on or changing on GPU {gpu.index}; the whole GPU is not a device now"
    return None


class AgentMigInstances:
    """The agent side of the plugin's ``MigInstances`` protocol. Side effects: NVML, agent state."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    async def _resolve(self, name: str) -> tuple[GpuInfo, PlacedInstance | None]:
        """The GPU and placement device ``name`` stands for; placement None for a whole GPU."""
        devices = self.agent.devices
        try:
            gpus, _ = await asyncio.to_thread(devices.discover)
        except devices.error_type as exc:
            raise InstanceError(f"{name}: NVML cannot list GPUs: {exc}") from exc
        whole = whole_device_index(name)
        for gpu in gpus:
            if whole is not None and gpu.index == whole:
                return gpu, None
            placed = placement_of(name, gpu.index, gpu.model) if gpu.model is not None else None
            if placed is not None:
                return gpu, placed
        raise UnknownDevice(
            f"{name} is not a MIG placement or a whole GPU of any GPU on node {self.agent.settings.node}"
        )

    async def lookup(self, name: str) -> PreparedInstance | None:
        """The existing instance named ``name``, or None. Reads only."""
        async with self.agent.lock:
            gpu, placed = await self._resolve(name)
            if placed is None:
                return None if whole_refusal(name, gpu) else whole_prepared(name, gpu)
            for inst in await asyncio.to_thread(self.agent.devices.instances, gpu):
                if inst.placed == placed and inst.whole is not None:
                    return prepared_instance(name, gpu, inst)
            return None

    async def ensure(self, device_name: str) -> PreparedInstance:
        """Make the instance exist (see module docstring). Side effects: NVML, agent state."""
        name = device_name
        agent = self.agent
        devices = agent.devices
        async with agent.lock:
            gpu, placed = await self._resolve(name)
            if placed is None:
                refused = whole_refusal(name, gpu)
                if refused is not None:
                    raise InstanceError(refused)
                agent.prepared.add(name)
                agent.wake()
                return whole_prepared(name, gpu)
            if not gpu.mig_enabled:
                raise InstanceError(f"{name}: MIG mode is not enabled on GPU {gpu.index}")
            assert gpu.model is not None
            instances = await asyncio.to_thread(devices.instances, gpu)
            found = next((i for i in instances if i.placed == placed), None)
            if found is not None and found.partitioned:
                raise InstanceError(
                    f"{name}: GPU instance {found.gi_id} is split into {found.describe_compute()} outside "
                    "dynamig; it cannot be handed out as one device"
                )
            if found is None or not found.has_compute_instance:
                span = gpu.model.profile(placed.profile).span(placed.start)
                in_way = [
                    o
                    for o in instances
                    if o.placed != placed and o.start < span.stop and span.start < o.start + o.size
                ]
                if in_way:
                    taken = (
                        f"{name}: memory slices {span.start}-{span.stop - 1} of GPU {gpu.index} are held by"
                    )
                    await self._clear_for_bound(name, gpu, in_way, taken)
                try:
                    found = await asyncio.to_thread(devices.create, gpu, placed)
                    agent.metrics.operation("create", "success")
                except devices.error_type as exc:
                    err = devices.error_name(exc)
                    agent.metrics.operation("create", "error")
                    agent.metrics.nvml_error("create", err)
                    if devices.is_error(exc, "InsufficientResources"):
                        raise PlacementTaken(
                            f"{name}: NVML refused {placed.profile} at memory slice {placed.start} "
                            "(insufficient resources)"
                        ) from exc
                    raise InstanceError(f"{name}: NVML could not create the instance: {err}") from exc
                log.info("created %s for a claim being prepared", name)
            agent.prepared.add(name)
        agent.wake()
        return prepared_instance(name, gpu, found)

    async def _clear_for_bound(self, name: str, gpu: GpuInfo, in_way: list[MigInstance], taken: str) -> None:
        """The last line of defence for a pod bound to a device whose slices another instance took (an
        allocation the scheduler made from a slice older than a retire or a cut): destroy the instances in
        the way when each is free, on the evidence a retire needs (lifecycle.py ``DESTROY_FOR_BOUND``: no
        pod in a binding cycle toward the node, then no claim naming them, read just now); otherwise raise
        PlacementTaken, and the kubelet tries the prepare again later. Call under the agent's lock."""
        agent = self.agent
        devices = agent.devices
        dev = {o.placed: device_name(gpu.index, o.profile, o.start) for o in in_way}
        taken += " " + ", ".join(f"{o.profile} at slice {o.start}" for o in in_way)
        for o in in_way:
            if o.partitioned or o.processes or dev[o.placed] in agent.prepared:
                raise PlacementTaken(f"{taken}, which is in use; the instance cannot be created")
        try:
            binding = await agent.api.pods_binding_to(agent.settings.node)
            holders = allocated_devices(
                await agent.api.list_claims(), agent.settings.driver, agent.settings.node
            )
        except Exception as exc:
            raise PlacementTaken(
                f"{taken}; whether it is free cannot be read now ({exc}); tried again"
            ) from exc
        for o in in_way:
            why = bound_may_clear(holders.get(dev[o.placed], []), binding)
            if why is not None:
                raise PlacementTaken(f"{taken}, which cannot go now: {why}; tried again")
        for o in in_way:
            try:
                await asyncio.to_thread(devices.destroy, gpu, o.placed)
            except devices.error_type as exc:
                agent.metrics.operation("destroy", "error")
                agent.metrics.nvml_error("destroy", devices.error_name(exc))
                raise PlacementTaken(f"{taken}; NVML refused to destroy it: {exc}") from exc
            agent.metrics.operation("destroy", "success")
            agent.metrics.bound_recovered.labels(agent.settings.node).inc()
            log.warning(
                "destroyed free %s: a pod is bound to %s, whose slices it took (the scheduler allocated %s "
                "from an older slice); %s is created again",
                dev[o.placed], name, name, name,
            )  # fmt: skip

    async def release(self, device_name: str) -> None:
        """One claim fewer uses the device; refresh status. Never destroys. Side effects: status."""
        self.agent.prepared.discard(device_name)
        try:
            await self.agent.reconcile_once()
        except Exception:  # the loop retries; release itself must not fail the unprepare
            log.exception("status refresh after releasing %s failed", device_name)
            self.agent.wake()

    def mark_prepared(self, names: Iterable[str]) -> None:
        """Count exactly ``names`` as prepared (the plugin's checkpoint as it starts, one name per claim)."""
        self.agent.prepared.reset(names)
        self.agent.wake()
