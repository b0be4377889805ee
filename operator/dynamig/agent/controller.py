"""The node agent's reconcile loop: NVML + API observed afresh each round, the reshape plan carried out.

One round (:meth:`NodeAgent.reconcile_once`):

1. read the Node (opt-in label, NVIDIA MIG manager label), the GPUs and their instances (NVML), the node's
   ResourceSlices (ours and other drivers'), the ResourceClaim allocations naming our pool, and the node's
   GpuPartitions (creating a missing one with the GPU's current layout as its spec, so nothing is destroyed);
2. per GPU, plan with :func:`dynamig.agent.reconcile.plan_gpu` and act: destroy (after re-checking claims
   and NVML processes), finish half-made instances, create at explicit placements;
3. publish the devices every GPU's plan offers (one pool, generation bumped on change);
4. write each GpuPartition's status, metrics.

Two inventories (``status.inventory``; chosen at start by :mod:`dynamig.agent.features` unless set):

- ``Instances``: only instances that exist are published; an instance leaves the slice and settles before it
  is destroyed, and the operator re-cuts ahead of the scheduler through ``spec.layout``.
- ``Partitionable``: every free instance and every valid placement of ``spec.offeredProfiles`` is published
  as a partitionable device with binding conditions (:mod:`dynamig.kube.inventory`); each round first answers
  the allocations waiting on this node (:mod:`dynamig.agent.allocations`: cut, then ready, or failed), and
  ``spec.layout`` is a floor of instances kept pre-created (warm pool, baseline): other instances stay.

Nothing is carried between rounds but timers (since when an instance has been out of the slice and
unallocated, when a reshape began): a restart only restarts the settle period, never skips it.
A lock serialises rounds with :mod:`dynamig.agent.devices_service` calls from the kubelet plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from dynamig import DRIVER_NAME
from dynamig.agent.allocations import AllocationAnswerer
from dynamig.agent.binding import Ready
from dynamig.agent.claimcache import ClaimCache
from dynamig.agent.features import InventorySupport, detect_inventory
from dynamig.agent.kubeapi import KubeApi, allocated_devices
from dynamig.agent.lifecycle import destroys_now
from dynamig.agent.metrics import AgentMetrics, GpuSample, InstanceSample
from dynamig.agent.nvml_device import GpuInfo, MigInstance, NvmlDevices
from dynamig.agent.ownership import foreign_mig_owners, node_is_managed, node_mig_owner
from dynamig.agent.publisher import SlicePublisher
from dynamig.agent.reconcile import GpuPlan, Observed, observe, plan_gpu, without_creates_over
from dynamig.agent.uuidwatch import AllocatedUuids, UuidChange
from dynamig.geometry.model import PlacedInstance, device_name
from dynamig.kube.apicalls import is_transient, status_of
from dynamig.kube.devices import MigDevice
from dynamig.kube.events import AGENT_COMPONENT, claim_ref, event_body, gpu_partition_ref
from dynamig.kube.gpupartition import (
    ConditionType,
    GpuPartition,
    GpuPartitionStatus,
    InstanceState,
    InstanceStatus,
    Inventory,
    MigMode,
    Phase,
    Reason,
    build_gpu_partition,
    layout_summary,
    parse_gpu_partition,
    set_condition,
)
from dynamig.kube.heartbeat import DEFAULT_LEASE_SECONDS, lease_body
from dynamig.kube.inventory import GpuInventory, Instance, InventoryError, Occupancy, offered_devices
from dynamig.kube.names import (
    GPU_INDEX_LABEL,
    NODE_LABEL,
    PRODUCT_LABEL,
    UNINSTALL_ANNOTATION,
    gpu_partition_name,
)
from dynamig.kube.times import now_rfc3339

log = logging.getLogger(__name__)

InstanceKey = tuple[int, PlacedInstance]  # (GPU index, placement)
_NO_PARTITION = GpuPartition.model_validate({"metadata": {"name": ""}})


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentSettings:
    """How one node agent behaves. Built once in ``main`` from flags."""

    node: str
    driver: str = DRIVER_NAME
    settle_seconds: float = 5.0  # a retired instance guarded and unallocated this long may be destroyed
    guard_free_instances: bool = False  # partitionable: free instances carry binding conditions too
    interval_seconds: float = 10.0  # time between rounds when every GPU is Stable
    reshape_poll_seconds: float = 0.5  # time between rounds while a GPU reshapes
    min_round_gap_seconds: float = 0.2  # rounds woken by watch events are at least this far apart
    watch: bool = True  # watch GpuPartitions and ResourceClaims to start rounds on changes
    inventory: Inventory | None = Inventory.INSTANCES  # None: ask the API server at start
    events_namespace: str = "default"  # where Events about GpuPartitions (cluster-scoped) go
    lease_namespace: str | None = None  # where the agent keeps its heartbeat Lease (None: no heartbeat)
    lease_seconds: int = DEFAULT_LEASE_SECONDS  # renewed every third of this


ERROR_BACKOFF_MAX_S = 30.0


@dataclass(slots=True)
class _GpuOutcome:
    """What one GPU contributes to this round: devices to publish and the status to write."""

    name: str
    devices: list[dict[str, Any]] = field(default_factory=list)
    published: set[PlacedInstance] = field(default_factory=set)
    status: GpuPartitionStatus | None = None
    busy: bool = False  # still reshaping: poll again soon
    instances: list[MigInstance] = field(default_factory=list)
    inventory: GpuInventory | None = None  # partitionable inventory: what to publish for this GPU
    events: list[tuple[str, str, str]] = field(
        default_factory=list
    )  # (type, reason, message) done this round


def pods_by_claim(claims: list[dict[str, Any]]) -> dict[str, list[str]]:
    """``namespace/name`` of each claim -> the pods it is reserved for (``status.reservedFor``). Pure."""
    out: dict[str, list[str]] = {}
    for c in claims:
        meta = c.get("metadata") or {}
        reserved = (c.get("status") or {}).get("reservedFor") or []
        pods = [str(r.get("name", "")) for r in reserved if r.get("resource") == "pods"]
        if pods:
            out[f"{meta.get('namespace', '')}/{meta.get('name', '')}"] = pods
    return out


def node_owner_reference(node: str, uid: str) -> dict[str, Any] | None:
    """An ownerReference to the Node (so the garbage collector removes our objects with it). Pure."""
    if not uid:
        return None
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}


def _mig_mode(gpu: GpuInfo) -> MigMode:
    if gpu.mig_current != gpu.mig_pending:
        return MigMode.ENABLE_PENDING if gpu.mig_pending == 1 else MigMode.DISABLE_PENDING
    return MigMode.ENABLED if gpu.mig_current == 1 else MigMode.DISABLED


class NodeAgent:
    """Reconciles every GPU of one node. Side effects: NVML, API writes, metrics."""

    def __init__(
        self,
        settings: AgentSettings,
        api: KubeApi,
        devices: NvmlDevices,
        metrics: AgentMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.api = api
        self.devices = devices
        self.metrics = metrics
        self.clock = clock
        self.publisher = SlicePublisher(api, settings.node, settings.driver)
        self.lock = asyncio.Lock()
        self.prepared: set[str] = set()  # device names the kubelet plugin prepared (in use by a pod)
        self.allocated_uuids = AllocatedUuids()  # reports allocated instances changed outside dynamig
        self._node_problems: dict[str, str] = {}  # Event reason -> node-wide problem already told
        self._quiet_since: dict[InstanceKey, float] = {}
        self._reshape_started: dict[int, float] = {}
        self._wake = asyncio.Event()
        self._managed_logged: bool | None = None
        self._node_owner: dict[str, Any] | None = None
        self.rounds = 0
        self.claim_cache: ClaimCache | None = None  # with settings.watch: rounds read claims from it
        self.on_round: Callable[[], None] | None = None  # called after every round, failed or not
        # Removes what the agent made on the node (plugin files) when dynamig is uninstalled; returns them.
        self.on_uninstall: Callable[[], Awaitable[list[str]]] | None = None
        self.uninstalled = False  # done: the node is left alone until the agent is deleted
        self._round_started: float | None = None  # when the round now running began (heartbeat watchdog)
        self.answerer = AllocationAnswerer(
            settings.driver, settings.node, api, devices, metrics, self.prepared
        )
        self.support: InventorySupport | None = (
            None
            if settings.inventory is None
            else InventorySupport(settings.inventory, f"{settings.inventory.value}, as configured")
        )

    @property
    def partitionable(self) -> bool:
        return self.support is not None and self.support.inventory is Inventory.PARTITIONABLE

    # --- loop ----------------------------------------------------------------------------------------

    def wake(self) -> None:
        """Ask for a round now (e.g. after the plugin created or released an instance)."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile until ``stop`` is set. Errors end the round, not the loop.

        With ``settings.watch`` a change of the Node, its GpuPartitions or slices, or of a claim allocated on
        its pool starts a round at once, and rounds read claims from the watched cache; otherwise rounds
        list claims and only follow the poll intervals.
        """
        watchers: list[asyncio.Task[None]] = [asyncio.create_task(self._heartbeats(stop), name="agent-lease")]
        if self.settings.watch:
            from dynamig.agent.watch import watch_tasks

            self.claim_cache = ClaimCache(self.api, self.settings.driver, self.settings.node, self.wake)
            watchers += [
                asyncio.create_task(c, name=f"agent-watch-{i}")
                for i, c in enumerate(
                    [*watch_tasks(self.api, self.settings.node, self.wake, stop), self.claim_cache.run(stop)]
                )
            ]
        try:
            await self._loop(stop)
        finally:
            for t in watchers:
                t.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _loop(self, stop: asyncio.Event) -> None:
        last = 0.0
        failures = 0  # consecutive failed rounds
        while not stop.is_set():
            # Bursts of watch events make at most one round per min_round_gap_seconds.
            await asyncio.sleep(max(0.0, self.settings.min_round_gap_seconds - (self.clock() - last)))
            last = self.clock()
            self._wake.clear()  # a wake during the round below starts the next one at once
            busy = True
            try:
                busy = await self.reconcile_once()
                failures = 0
            except Exception:
                failures += 1
                self.metrics.reconcile_errors.labels(self.settings.node).inc()
                log.exception("reconcile round failed (%d in a row); retrying", failures)
            if self.on_round is not None:
                self.on_round()  # the liveness probe's evidence that the loop turns
            delay = self.settings.reshape_poll_seconds if busy else self.settings.interval_seconds
            events = [stop, self._wake]
            if failures:
                # A round that keeps failing (API errors, a bug) backs off, and watch events do not cut the
                # wait short: a hot loop would load the API server and fill the log.
                delay = min(self.settings.reshape_poll_seconds * 2**failures, ERROR_BACKOFF_MAX_S)
                events = [stop]
            waiters = [asyncio.ensure_future(e.wait()) for e in events]
            try:
                await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        """Renew the node's Lease every third of its duration while the agent can answer: not while a round
        has been running for half the Lease or more (an NVML call hung in the driver), so a stuck agent
        goes silent like a dead one and the operator withdraws its node (operator/fencing.py)."""
        while not stop.is_set():
            started = self._round_started
            if started is None or self.clock() - started < self.settings.lease_seconds / 2:
                await self._heartbeat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=max(1.0, self.settings.lease_seconds / 3))

    async def _heartbeat(self) -> None:
        """Renew the node's Lease (the operator's evidence the agent lives)."""
        namespace = self.settings.lease_namespace
        now = time.time()
        if namespace is None:
            return
        try:
            await self.api.renew_lease(
                lease_body(self.settings.node, namespace, now, self.settings.lease_seconds)
            )
        except Exception as exc:  # a missed renewal is retried a third of the lease later
            log.warning("could not renew the agent lease in namespace %s: %s", namespace, exc)

    async def reconcile_once(self) -> bool:
        """One round over every GPU. Returns True while some GPU still reshapes (poll again soon)."""
        async with self.lock:
            self._round_started = self.clock()
            try:
                return await self._round()
            finally:
                self._round_started = None

    async def _round(self) -> bool:
        node = self.settings.node
        self.rounds += 1
        if self.uninstalled:
            return False
        meta = await self.api.node_meta(node)
        labels = meta.labels if meta is not None else {}
        if meta is None or not node_is_managed(labels):
            if self._managed_logged is not False:
                log.warning("node %s does not exist or lacks dynamig.io/managed=true; not managing it", node)
            self._managed_logged = False
            if meta is not None and await self.publisher.remove():
                # Opted out: offer nothing to the scheduler; MIG and GpuPartitions stay as they are.
                log.warning("node %s opted out: its mig.dynamig.io ResourceSlices were withdrawn", node)
            return False
        self._managed_logged = True
        if self.support is None:
            self.support = await detect_inventory(self.api, node, self.settings.driver)
            log.info("inventory for node %s: %s (%s)", node, self.support.inventory.value, self.support.why)
        self._node_owner = node_owner_reference(node, meta.uid)
        self.publisher.owner = self._node_owner
        node_owner = node_mig_owner(labels, meta.allocatable)
        await self._tell_node(meta.uid, "ForeignMigOwner", node_owner)

        gpus: list[GpuInfo] = []
        unreadable: dict[int, str] = {}
        lost_reason = ""
        try:
            gpus, unreadable = await asyncio.to_thread(self.devices.discover)
        except self.devices.error_type as exc:
            self.metrics.nvml_error("discover", self.devices.error_name(exc))
            lost_reason = f"NVML discovery failed: {exc}"
            log.error("%s", lost_reason)
        await self._tell_node(meta.uid, "NvmlError", lost_reason or None)

        slices = await self.api.list_slices(node)
        foreign = foreign_mig_owners(slices, [g.uuid for g in gpus], self.settings.driver)
        cached = self.claim_cache.claims() if self.claim_cache is not None else None
        raw_claims = cached if cached is not None else await self.api.list_claims()
        unavailable = lost_reason or "; ".join(
            f"NVML cannot read GPU {i}: {e}" for i, e in unreadable.items()
        )
        if self.partitionable and (gpus or unavailable):
            # Answer first: a pod waiting on its binding is the most urgent thing on the node. With no GPU
            # readable every booking fails at once, so its pod is booked again elsewhere.
            for _, answer in await self.answerer.answer_all(raw_claims, None if gpus else unavailable):
                outcome = "ready" if isinstance(answer, Ready) else "failed"
                self.metrics.binding_answers.labels(node, outcome).inc()
            if gpus:
                await self.answerer.report_bound(raw_claims)
        claims = allocated_devices(raw_claims, self.settings.driver, node)
        parts = {
            p.name: p
            for p in (parse_gpu_partition(o) for o in await self.api.list_partitions(f"{NODE_LABEL}={node}"))
        }
        leaving = any(UNINSTALL_ANNOTATION in p.metadata.annotations for p in parts.values())

        outcomes: list[_GpuOutcome] = []
        created: dict[str, GpuPartition] = {}
        replaced: list[UuidChange] = []
        for gpu in gpus:
            name = gpu_partition_name(node, gpu.index)
            try:
                instances = await asyncio.to_thread(self.devices.instances, gpu)
            except self.devices.error_type as exc:
                self.metrics.nvml_error("list-instances", self.devices.error_name(exc))
                part = parts.get(name)
                if part is not None:
                    outcomes.append(self._lost(part, f"NVML cannot read GPU {gpu.index}: {exc}"))
                continue
            part = parts.get(name)
            if part is None and leaving:
                continue  # dynamig is being removed: no new GpuPartitions
            if part is None:
                part = created[name] = await self._create_partition(gpu, instances)
            owner = node_owner
            if owner is None and gpu.uuid in foreign:
                owner = f"driver {foreign[gpu.uuid]} publishes MIG devices of this GPU"
            try:
                gpu_outcome = await self._reconcile_gpu(gpu, part, instances, claims, owner)
            except Exception as exc:
                if status_of(exc) is not None or is_transient(exc):
                    raise  # the API server: every GPU of the round would meet it; the round backs off
                # Anything else is this GPU's own trouble: the node's other GPUs go on being served.
                self.metrics.reconcile_errors.labels(node).inc()
                log.exception("%s: reconcile failed; the node's other GPUs go on", name)
                why = f"reconciling this GPU failed: {exc!r}"
                outcomes.append(self._degraded(part, why, Reason.RECONCILE_ERROR, ConditionType.READY))
                continue
            now_uuids = {device_name(i.gpu_index, i.profile, i.start): i.mig_uuid for i in instances}
            for change in self.allocated_uuids.update(f"gpu{gpu.index}-", now_uuids, claims):
                log.warning("%s: %s", name, change.message())
                gpu_outcome.events.append(("Warning", change.reason, change.message()))
                replaced.append(change)
            outcomes.append(gpu_outcome)

        for index, error in unreadable.items():
            self.metrics.nvml_error("discover", error.split(":", 1)[0])
            part = parts.get(gpu_partition_name(node, index))
            if part is not None:
                outcomes.append(self._lost(part, f"NVML cannot read GPU {index}: {error}"))
        seen = {o.name for o in outcomes}
        for name, part in parts.items():
            if name not in seen:
                outcomes.append(self._lost(part, lost_reason or "NVML no longer reports this GPU"))

        if leaving:
            if await self.publisher.remove():  # nothing more to book here, whatever the inventory
                log.info("uninstalling: withdrew the ResourceSlices of node %s", node)
            for o in outcomes:
                o.published = set()
        elif self.partitionable:
            inventory = [o.inventory for o in outcomes if o.inventory is not None]
            if await self.publisher.sync_inventory(inventory, existing=slices):
                self.metrics.slice_publishes.labels(node).inc()
        else:
            devices = [d for o in outcomes for d in o.devices]
            if await self.publisher.sync(devices, existing=slices):
                self.metrics.slice_publishes.labels(node).inc()
        self._after_publish(outcomes, claims)  # the guards stand from now: their settle clocks start

        for o in outcomes:
            part = parts.get(o.name) or created.get(o.name, _NO_PARTITION)
            if o.status is not None and o.status != part.status:
                await self._write_status(o.name, o.status)
            await self._post_events(part, o)
        await self._tell_holders(replaced, raw_claims)
        self._export(outcomes, pods_by_claim(raw_claims))
        busy = any(o.busy for o in outcomes)
        if leaving and not busy:
            await self._finish_uninstall(parts, outcomes)
        return busy

    async def _finish_uninstall(self, parts: dict[str, GpuPartition], outcomes: list[_GpuOutcome]) -> None:
        """The layouts written for the removal are applied (busy instances stay): remove the node's files and
        say so on every GpuPartition, which is what `dynamig uninstall` waits for."""
        removed = await self.on_uninstall() if self.on_uninstall is not None else []
        latest = {o.name: o.status for o in outcomes if o.status is not None}
        message = f"slices withdrawn, {len(removed)} file(s) removed from node {self.settings.node}"
        stamp = now_rfc3339()
        for name, part in parts.items():
            status = latest.get(name) or part.status
            conds = set_condition(
                status.conditions, ConditionType.UNINSTALLED, True, Reason.NODE_CLEANED, message,
                part.metadata.generation, stamp,
            )  # fmt: skip
            await self._write_status(name, status.model_copy(update={"conditions": conds}))
        self.uninstalled = True
        log.info("uninstalled from node %s: %s", self.settings.node, message)

    # --- one GPU -------------------------------------------------------------------------------------

    async def _create_partition(self, gpu: GpuInfo, instances: list[MigInstance]) -> GpuPartition:
        """Create the GpuPartition with the layout that exists now as its spec (adopt, destroy nothing)."""
        name = gpu_partition_name(self.settings.node, gpu.index)
        labels = {NODE_LABEL: self.settings.node, GPU_INDEX_LABEL: str(gpu.index)}
        if gpu.model is not None:
            labels[PRODUCT_LABEL] = gpu.model.key
        adopted = [i.placed for i in instances if i.has_compute_instance and not i.partitioned]
        body = build_gpu_partition(name, labels, adopted)
        if self._node_owner is not None:
            body["metadata"]["ownerReferences"] = [dict(self._node_owner)]
        try:
            created = await self.api.create_partition(body)
        except Exception as exc:
            if status_of(exc) != 409:
                raise
            got = await self.api.get_partition(name)
            if got is None:
                raise
            created = got
        log.info("created GpuPartition %s adopting %d instance(s)", name, len(instances))
        return parse_gpu_partition(created)

    def _degraded(self, part: GpuPartition, why: str, reason: str, *conditions: str) -> _GpuOutcome:
        """A GPU the round could not act on: Degraded, ``conditions`` False with ``reason``, offered to
        nobody until a round succeeds again."""
        gen, stamp = part.metadata.generation, now_rfc3339()
        conds = part.status.conditions
        for ctype in conditions:
            conds = set_condition(conds, ctype, False, reason, why, gen, stamp)
        status = part.status.model_copy(
            update={"phase": Phase.DEGRADED, "message": why, "conditions": conds, "free_slices": 0}
        )
        return _GpuOutcome(name=part.name, status=status)

    def _lost(self, part: GpuPartition, why: str) -> _GpuOutcome:
        return self._degraded(part, why, Reason.GPU_LOST, ConditionType.HEALTHY, ConditionType.READY)

    def observe(self, instances: list[MigInstance], claims: dict[str, list[str]]) -> tuple[Observed, ...]:
        """:func:`dynamig.agent.reconcile.observe` with the instances the kubelet plugin prepared."""
        return observe(instances, claims, self.prepared)

    async def _pods_binding(self) -> list[str]:
        """The pods in a binding cycle toward this node; one stand-in entry when the agent may not list pods
        (whether a booking is in flight cannot be known then, so nothing retired may go)."""
        try:
            return await self.api.pods_binding_to(self.settings.node)
        except Exception as exc:
            if status_of(exc) not in (401, 403):
                raise
            return [f"(cannot list pods: {status_of(exc)}; the agent needs list on pods)"]

    async def _reconcile_gpu(
        self,
        gpu: GpuInfo,
        part: GpuPartition,
        instances: list[MigInstance],
        claims: dict[str, list[str]],
        owner: str | None,
    ) -> _GpuOutcome:
        gen = part.metadata.generation
        desired = part.spec.desired()
        notes: list[str] = []
        blocker: tuple[str, str] | None = None  # (reason, message) of an operation that failed
        refuse: tuple[str, str] | None = None
        recorded = part.status.uuid
        if recorded and recorded != gpu.uuid:
            # The index now names another physical GPU: its GpuPartition's layout is not for this one.
            refuse = (
                Reason.GPU_REPLACED,
                f"this GpuPartition describes GPU {recorded}, but index {gpu.index} is now {gpu.uuid}; "
                "nothing is changed or offered until the GpuPartition is deleted (it is then re-created "
                "adopting the GPU as it is)",
            )
        elif owner is not None:
            refuse = (Reason.FOREIGN_MIG_OWNER, f"not managing this GPU: {owner}")
        elif gpu.model is None:
            refuse = (Reason.UNKNOWN_MODEL, f"GPU product {gpu.product!r} is not in the MIG catalog")
        elif gpu.mig_current != gpu.mig_pending:
            refuse = (Reason.MIG_MODE_PENDING, "MIG mode change pending; the GPU needs a reset")
        elif not gpu.mig_enabled:
            refuse = (Reason.MIG_DISABLED, "MIG mode is disabled on this GPU; the agent does not enable it")
        if refuse is not None or gpu.model is None:
            reason, message = refuse or (Reason.UNKNOWN_MODEL, "unknown model")
            status = self._status(gpu, part, instances, claims, set(), None, Phase.DEGRADED, message)
            stamp = now_rfc3339()
            conds = status.conditions
            for ctype in (ConditionType.MANAGED, ConditionType.READY):
                conds = set_condition(conds, ctype, False, reason, message, gen, stamp)
            update: dict[str, Any] = {"conditions": conds}
            if reason == Reason.GPU_REPLACED:
                update["uuid"] = recorded  # keep the record until a person deletes the GpuPartition
            return _GpuOutcome(name=part.name, status=status.model_copy(update=update))

        model = gpu.model
        now = self.clock()
        keep = self.partitionable
        settle = self.settings.settle_seconds
        observed = self.observe(instances, claims)
        for o in observed:
            if o.busy:
                self._quiet_since.pop((gpu.index, o.placed), None)
        quiet = {p: t for (idx, p), t in self._quiet_since.items() if idx == gpu.index}
        plan = plan_gpu(model, desired, observed, quiet, now, settle, keep)

        events: list[tuple[str, str, str]] = []
        if plan.acts:
            self._reshape_started.setdefault(gpu.index, now)
            # Observe right before destroying (pods first, then claims), decide (lifecycle.py), act.
            go: tuple[PlacedInstance, ...] = ()
            spared: list[PlacedInstance] = []  # retired instances that may not go yet
            if plan.destroy:
                binding_pods = await self._pods_binding()
                fresh = allocated_devices(
                    await self.api.list_claims(), self.settings.driver, self.settings.node
                )
                go, kept = destroys_now(
                    plan.destroy,
                    {o.placed for o in observed if o.has_compute_instance},
                    quiet,  # since when each was guarded: unchanged since the plan was made
                    self.clock(),
                    settle,
                    {
                        o.placed: fresh.get(device_name(gpu.index, o.placed.profile, o.placed.start), [])
                        for o in observed
                    },
                    {p for p in plan.destroy if device_name(gpu.index, p.profile, p.start) in self.prepared},
                    binding_pods,
                )
                for k in kept:
                    dev = device_name(gpu.index, k.placed.profile, k.placed.start)
                    if k.won_by:
                        notes.append(f"kept {dev}: {k.why}")
                        self.metrics.kept_busy.labels(self.settings.node).inc()
                        holders = [h for h in fresh.get(dev, []) if h not in claims.get(dev, [])]
                        claims.setdefault(dev, []).extend(holders)
                    else:
                        notes.append(f"kept {dev} for now: {k.why}")
                        spared.append(k.placed)
            for p in go:
                dev = device_name(gpu.index, p.profile, p.start)
                try:
                    await asyncio.to_thread(self.devices.destroy, gpu, p)
                    self.metrics.operation("destroy", "success")
                    self._quiet_since.pop((gpu.index, p), None)
                    log.info("destroyed %s on %s", dev, self.settings.node)
                    events.append(
                        (
                            "Normal",
                            "InstanceDestroyed",
                            f"destroyed free {p.profile} at slice {p.start} ({dev})",
                        )
                    )
                except self.devices.error_type as exc:
                    err = self.devices.error_name(exc)
                    self.metrics.operation("destroy", "error")
                    self.metrics.nvml_error("destroy", err)
                    if self.devices.is_error(exc, "InUse"):
                        notes.append(f"kept {dev}: NVML reports it in use; will retry")
                        self.metrics.kept_busy.labels(self.settings.node).inc()
                    else:
                        blocker = (Reason.NVML_ERROR, f"destroying {dev} failed: {err}")
            if plan.destroy:  # what was really destroyed decides what fits now
                instances = await asyncio.to_thread(self.devices.instances, gpu)
                observed = self.observe(instances, claims)
                quiet = {p: t for (idx, p), t in self._quiet_since.items() if idx == gpu.index}
                plan = plan_gpu(model, desired, observed, quiet, self.clock(), settle, keep)
                plan = without_creates_over(model, plan, spared)
            for p in (*plan.complete, *plan.create):
                dev = device_name(gpu.index, p.profile, p.start)
                try:
                    await asyncio.to_thread(self.devices.create, gpu, p)
                    self.metrics.operation("create", "success")
                    log.info("created %s on %s", dev, self.settings.node)
                    events.append(
                        ("Normal", "InstanceCreated", f"created {p.profile} at slice {p.start} ({dev})")
                    )
                except self.devices.error_type as exc:
                    err = self.devices.error_name(exc)
                    self.metrics.operation("create", "error")
                    self.metrics.nvml_error("create", err)
                    if self.devices.is_error(exc, "InsufficientResources"):
                        blocker = (
                            Reason.INSUFFICIENT_RESOURCES,
                            f"NVML refused to create {p.profile} at memory slice {p.start} "
                            "(insufficient resources: the placement or an engine is taken)",
                        )
                    else:
                        blocker = (Reason.NVML_ERROR, f"creating {dev} failed: {err}")
            instances = await asyncio.to_thread(self.devices.instances, gpu)
            observed = self.observe(instances, claims)
            quiet = {p: t for (idx, p), t in self._quiet_since.items() if idx == gpu.index}
            plan = plan_gpu(model, desired, observed, quiet, self.clock(), settle, keep)

        # Blocked only by busy instances is Stable: nothing moves until a workload lets go.
        reshaping = bool(plan.acts or plan.draining or blocker) and plan.violation is None
        phase = Phase.RESHAPING if reshaping else Phase.STABLE
        if reshaping:
            self._reshape_started.setdefault(gpu.index, now)
        finished = False
        if not reshaping and gpu.index in self._reshape_started:
            started = self._reshape_started.pop(gpu.index)
            self.metrics.reshape_duration.labels(self.settings.node).observe(max(0.0, self.clock() - started))
            finished = True

        published = set(plan.publish)
        inventory: GpuInventory | None = None
        offered = 0
        if keep:
            retiring = {w.placed for w in plan.draining} | set(plan.destroy)  # still there: guarded
            inventory, published, offered, problem = self._inventory(gpu, part, instances, claims, retiring)
            if problem:
                blocker = (Reason.INVALID_LAYOUT, problem)
        message, ready, reason = self._readiness(gpu.index, plan, blocker, notes)
        status = self._status(gpu, part, instances, claims, published, plan, phase, message)
        tnow = now_rfc3339()
        conds = status.conditions

        def cond(ctype: str, value: bool, why: str, text: str) -> None:
            nonlocal conds
            conds = set_condition(conds, ctype, value, why, text, gen, tnow)

        cond(ConditionType.MANAGED, True, Reason.MANAGED, "managed by dynamig")
        cond(ConditionType.HEALTHY, True, Reason.GPU_PRESENT, "NVML reports the GPU")
        if plan.violation is not None:
            text = f"spec.layout is invalid for {model.key}: {plan.violation}; nothing changed"
            cond(ConditionType.LAYOUT_VALID, False, Reason.INVALID_LAYOUT, text)
        else:
            cond(ConditionType.LAYOUT_VALID, True, Reason.VALID, f"spec.layout is valid for {model.key}")
        cond(ConditionType.READY, ready, reason, message)
        changes: dict[str, Any] = {"conditions": conds, "offered_placements": offered}
        if finished:
            changes["last_reshape_time"] = tnow
        status = status.model_copy(update=changes)

        out = _GpuOutcome(
            name=part.name,
            status=status,
            busy=reshaping,
            instances=instances,
            published=published,
            inventory=inventory,
            events=events,
        )
        for i in instances:
            if i.placed in published:
                out.devices.append(self._device(gpu, i))
        return out

    @staticmethod
    def _readiness(
        index: int, plan: GpuPlan, blocker: tuple[str, str] | None, notes: list[str]
    ) -> tuple[str, bool, str]:
        """(message, Ready status, reason) for the Ready condition. Pure."""
        if plan.violation is not None:
            return f"spec.layout rejected, GPU left as is: {plan.violation}", False, Reason.INVALID_LAYOUT
        if blocker is not None:
            return blocker[1], False, blocker[0]
        parts: list[str] = list(notes)

        def name(p: PlacedInstance) -> str:
            return f"{device_name(index, p.profile, p.start)} ({p.profile}@{p.start})"

        parts += [f"kept {name(w.placed)}: {w.reason}" for w in plan.kept_busy]
        if plan.draining:
            parts += [f"draining {name(w.placed)}: {w.reason}" for w in plan.draining]
            return "; ".join(parts), False, Reason.DRAINING
        if plan.blocked:
            parts += [f"waiting to create {name(w.placed)}: {w.reason}" for w in plan.blocked]
            reason = Reason.INSTANCE_BUSY if plan.kept_busy else Reason.RESHAPING
            return "; ".join(parts), False, reason
        if plan.kept_busy or notes:
            return "; ".join(parts), False, Reason.INSTANCE_BUSY
        return "GPU matches spec.layout", True, Reason.LAYOUT_APPLIED

    def _inventory(
        self,
        gpu: GpuInfo,
        part: GpuPartition,
        instances: list[MigInstance],
        claims: dict[str, list[str]],
        retiring: set[PlacedInstance],
    ) -> tuple[GpuInventory | None, set[PlacedInstance], int, str]:
        """This GPU's partitionable inventory, the instances it publishes without binding conditions (the
        ``retiring`` ones are published guarded), how many placements it offers, and why it offers nothing
        (an empty string when it can be published)."""
        assert gpu.model is not None
        items = []
        for i in instances:
            dev = device_name(i.gpu_index, i.profile, i.start)
            if i.partitioned or not i.has_compute_instance:
                occupancy = Occupancy.BUSY  # not a whole instance: nobody may book its slices
            elif claims.get(dev):
                occupancy = Occupancy.ALLOCATED  # published: the scheduler counts its counters as used
            elif i.processes > 0 or dev in self.prepared:
                occupancy = Occupancy.BUSY
            else:
                occupancy = Occupancy.FREE
            guarded = occupancy is Occupancy.FREE and (
                i.placed in retiring or self.settings.guard_free_instances
            )
            items.append(
                Instance(
                    i.profile, i.start, occupancy, i.mig_uuid, i.memory_bytes, i.multiprocessors, guarded
                )
            )
        offered = frozenset(p for p in part.spec.offered_profiles or () if gpu.model.has_profile(p))
        inv = GpuInventory(gpu.index, gpu.model, gpu.uuid, gpu.product, tuple(items), offered)
        try:
            devices = offered_devices([inv])
        except InventoryError as exc:
            return None, set(), 0, f"nothing offered to the scheduler: {exc}"
        existing = (Occupancy.FREE.value, Occupancy.ALLOCATED.value)
        published = {
            PlacedInstance(d.start, d.profile) for d in devices if d.kind in existing and not d.guarded
        }
        placements = sum(1 for d in devices if d.kind not in existing)
        return inv, published, placements, ""

    def _device(self, gpu: GpuInfo, i: MigInstance) -> dict[str, Any]:
        assert gpu.model is not None
        return MigDevice(
            gpu_index=gpu.index,
            profile=gpu.model.profile(i.profile),
            placement_start=i.start,
            product_name=gpu.product,
            parent_uuid=gpu.uuid,
            uuid=i.mig_uuid,
            memory_bytes=i.memory_bytes,
            multiprocessors=i.multiprocessors,
        ).to_api()

    def _status(
        self,
        gpu: GpuInfo,
        part: GpuPartition,
        instances: list[MigInstance],
        claims: dict[str, list[str]],
        published: set[PlacedInstance],
        plan: GpuPlan | None,
        phase: Phase,
        message: str,
    ) -> GpuPartitionStatus:
        items = []
        for i in instances:
            dev = device_name(i.gpu_index, i.profile, i.start)
            holders = sorted(set(claims.get(dev, [])))
            if i.processes > 0 or dev in self.prepared or i.partitioned:
                state = InstanceState.IN_USE
            elif holders:
                state = InstanceState.ALLOCATED
            else:
                state = InstanceState.FREE
            items.append(
                InstanceStatus(
                    profile=i.profile,
                    start=i.start,
                    size=i.size,
                    device_name=dev,
                    mig_uuid=i.mig_uuid,
                    gpu_instance_id=i.gi_id,
                    compute_instance_id=i.ci_id,
                    state=state,
                    published=i.placed in published,
                    claims=holders,
                )
            )
        free = sum(1 for s in items if s.state == InstanceState.FREE and s.published)
        return part.status.model_copy(
            update={
                "node": self.settings.node,
                "gpu_index": gpu.index,
                "uuid": gpu.uuid,
                "product": gpu.product,
                "model": gpu.model.key if gpu.model is not None else "",
                "mig_mode": _mig_mode(gpu),
                "instances": items,
                "layout_summary": layout_summary([i.placed for i in instances]),
                "free_slices": free,
                "total_slices": len(items),
                "observed_generation": part.metadata.generation,
                "phase": phase,
                "message": message,
                "inventory": self.support.inventory if self.support is not None else None,
            }
        )

    # --- after publishing ----------------------------------------------------------------------------

    def _after_publish(self, outcomes: list[_GpuOutcome], claims: dict[str, list[str]]) -> None:
        """Start the settle clock of instances now guarded (out of the slice, or republished with binding
        conditions) and unallocated; stop it for others, which are published for binding at once."""
        now = self.clock()
        alive: set[InstanceKey] = set()
        for o in outcomes:
            for i in o.instances:
                key = (i.gpu_index, i.placed)
                alive.add(key)
                dev = device_name(i.gpu_index, i.profile, i.start)
                if i.placed in o.published or claims.get(dev) or dev in self.prepared:
                    self._quiet_since.pop(key, None)
                else:
                    self._quiet_since.setdefault(key, now)
        for key in list(self._quiet_since):
            if key not in alive:
                del self._quiet_since[key]

    async def _post_events(self, part: GpuPartition, o: _GpuOutcome) -> None:
        """Events on the GpuPartition, where `kubectl describe` shows them: what was cut or destroyed this
        round, and each change of its Ready condition (a refused layout, a busy instance, a lost GPU, MIG
        disabled, an NVML error, and the way back to LayoutApplied)."""
        events = list(o.events)
        before = part.status.condition(ConditionType.READY)
        after = o.status.condition(ConditionType.READY) if o.status is not None else None
        if after is not None and (
            before is None or (before.status, before.reason) != (after.status, after.reason)
        ):
            calm = after.is_true or after.reason in (Reason.RESHAPING, Reason.DRAINING)
            events.append(("Normal" if calm else "Warning", after.reason, after.message))
        ref = gpu_partition_ref(o.name, part.metadata.uid)
        for kind, reason, message in events:
            body = event_body(
                ref, kind, reason, message, self.settings.events_namespace, AGENT_COMPONENT, now_rfc3339(),
                instance=self.settings.node,
            )  # fmt: skip
            await self.api.post_event(body)

    async def _tell_node(self, uid: str, reason: str, problem: str | None) -> None:
        """Node-wide states on the Node, where `kubectl describe node` shows them: a Warning when one starts
        or changes, a Normal ``<reason>Resolved`` when it ends. Each change once."""
        before = self._node_problems.get(reason)
        if problem == before:
            return
        if problem is None:
            self._node_problems.pop(reason, None)
            kind, why, text = "Normal", f"{reason}Resolved", f"resolved: {before}"
        else:
            self._node_problems[reason] = problem
            kind, why, text = "Warning", reason, problem
        log.log(logging.WARNING if problem else logging.INFO, "node %s: %s", self.settings.node, text)
        ref = {"apiVersion": "v1", "kind": "Node", "name": self.settings.node, "uid": uid}
        body = event_body(
            ref, kind, why, text, self.settings.events_namespace, AGENT_COMPONENT, now_rfc3339(),
            instance=self.settings.node,
        )  # fmt: skip
        await self.api.post_event(body)

    async def _tell_holders(self, changes: list[UuidChange], raw_claims: list[dict[str, Any]]) -> None:
        """The claims whose instance changed behind the agent's back get the Event too: their owners look at
        `kubectl describe resourceclaim`, not at GpuPartitions."""
        if not changes:
            return
        uids = {
            f"{m.get('namespace', '')}/{m.get('name', '')}": str(m.get("uid", ""))
            for m in (c.get("metadata") or {} for c in raw_claims)
        }
        for change in changes:
            for holder in change.holders:
                namespace, name = holder.split("/", 1)
                body = event_body(
                    claim_ref(namespace, name, uids.get(holder)), "Warning", change.reason, change.message(),
                    namespace, AGENT_COMPONENT, now_rfc3339(), instance=self.settings.node,
                )  # fmt: skip
                await self.api.post_event(body)

    async def _write_status(self, name: str, status: GpuPartitionStatus) -> None:
        try:
            await self.api.patch_partition_status(name, status.to_api())
        except Exception as exc:
            if status_of(exc) == 404:
                log.warning("GpuPartition %s vanished; it is recreated next round", name)
                return
            raise

    def _export(self, outcomes: list[_GpuOutcome], pods: dict[str, list[str]]) -> None:
        samples: list[InstanceSample] = []
        gpus: list[GpuSample] = []
        for o in outcomes:
            st = o.status
            if st is None:
                continue
            gpus.append(GpuSample(st.gpu_index or 0, st.uuid, str(st.phase or "")))
            for i in st.instances:
                samples.append(
                    InstanceSample(
                        gpu_index=st.gpu_index or 0,
                        gpu_uuid=st.uuid,
                        profile=i.profile,
                        gi_id=i.gpu_instance_id or 0,
                        mig_uuid=i.mig_uuid,
                        device=i.device_name,
                        state=str(i.state),
                        claims=tuple((c, pod) for c in i.claims for pod in pods.get(c) or [""]),
                    )
                )
        self.metrics.snapshot(tuple(samples), tuple(gpus))
