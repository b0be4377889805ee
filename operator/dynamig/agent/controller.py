"""The node agent's loop and the order of one round: observe, decide, act.

One round (:meth:`NodeAgent.reconcile_once`, :meth:`NodeAgent._round`):

1. observe: the Node (opt-in, a MIG manager), the GPUs (NVML), the node's ResourceSlices, the claims
   allocated from its pool and its GpuPartitions, into a :class:`NodeView`;
2. answer the bookings waiting on the node first (partitionable inventory,
   :mod:`dynamig.agent.bindings.allocations`);
3. per GPU: decide whether to refuse it (:func:`dynamig.agent.publishing.gpu_status.refusal`), plan
   (:func:`dynamig.agent.layout.reconcile.plan_gpu`), carry the plan out (:mod:`dynamig.agent.layout.reshape`:
   destroys decided by :mod:`dynamig.agent.layout.lifecycle` from reads made right before), and decide the
   status and inventory from what the GPU looks like now (:mod:`dynamig.agent.publishing.gpu_status`);
4. publish (:mod:`dynamig.agent.publishing.publisher`) and report: status, Events, metrics
   (:mod:`dynamig.agent.publishing.reporting`).

Two inventories (``status.inventory``; chosen at start by :mod:`dynamig.agent.publishing.features` unless
set): ``Instances`` publishes only instances that exist and re-cuts ahead of the scheduler through
``spec.layout``; ``Partitionable`` also publishes every valid placement of ``spec.offeredProfiles``
(:mod:`dynamig.kube.inventory`) and ``spec.layout`` is a floor of instances kept pre-created.

Nothing is carried between rounds but timers (since when an instance has been guarded, when a reshape began):
a restart only restarts the settle period, never skips it. A lock serialises rounds with
:mod:`dynamig.agent.devices_service` calls from the kubelet plugin.
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
from dynamig.agent.bindings.allocations import AllocationAnswerer
from dynamig.agent.bindings.answering import refusals
from dynamig.agent.bindings.decide import Ready
from dynamig.agent.bindings.given_uuids import given_uuids
from dynamig.agent.bindings.holds import guarded_by_holds, held_desired, valid_holds, whole_hold
from dynamig.agent.bindings.uuidwatch import AllocatedUuids, UuidChange
from dynamig.agent.health.devices import DeviceHealth, XidWatcher, instance_devices
from dynamig.agent.health.xid import APPLICATION_XIDS
from dynamig.agent.kube.api import (
    API_RETRY_MAX_S,
    KubeApi,
    NodeFacts,
    allocated_devices,
    backoff_delay,
    node_facts,
)
from dynamig.agent.kube.watch import NodeCopies, node_copies
from dynamig.agent.layout.reconcile import plan_gpu
from dynamig.agent.layout.reshape import Reshaper
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.modes.booked import booked_by, offers_whole, requested_mode, whole_bookable
from dynamig.agent.modes.switch import ModeSwitcher, Step, switch_status, switch_step, wants_switch
from dynamig.agent.modes.whole import whole_outcome
from dynamig.agent.nvml.device import GpuInfo, MigInstance, NvmlDevices
from dynamig.agent.prepared import PreparedDevices
from dynamig.agent.publishing.features import InventorySupport, detect_inventory
from dynamig.agent.publishing.gpu_status import (
    GpuOutcome,
    degraded_status,
    gpu_status,
    lost_status,
    managed_status,
    mig_device,
    partitionable_offer,
    pods_by_claim,
    readiness,
    refusal,
    refused_status,
)
from dynamig.agent.publishing.ownership import foreign_mig_owners, node_is_managed, node_mig_owner
from dynamig.agent.publishing.publisher import SlicePublisher
from dynamig.agent.publishing.reporting import NodeReporter
from dynamig.geometry.model import PlacedInstance, device_name
from dynamig.kube.apicalls import is_transient, status_of
from dynamig.kube.gpupartition import (
    ConditionType,
    GpuPartition,
    Hold,
    Inventory,
    MigModeRequest,
    Phase,
    Reason,
    parse_gpu_partition,
    set_condition,
)
from dynamig.kube.heartbeat import DEFAULT_LEASE_SECONDS, lease_body, stuck
from dynamig.kube.inventory import whole_offers
from dynamig.kube.names import NODE_LABEL, UNINSTALL_ANNOTATION, gpu_partition_name
from dynamig.kube.times import now_rfc3339
from dynamig.planner.offerlimit import in_force

log = logging.getLogger(__name__)

InstanceKey = tuple[int, PlacedInstance]  # (GPU index, placement)
_NO_PARTITION = GpuPartition.model_validate({"metadata": {"name": ""}})


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentSettings:
    """How one node agent behaves. Built once in ``main`` from flags."""

    node: str
    driver: str = DRIVER_NAME
    settle_seconds: float = 5.0  # a retired instance guarded and unallocated this long may be destroyed
    # The slices of a retired instance destroyed get no instance of the agent's own making for this long:
    # a pod the scheduler bound to it from a slice older than the guard (a scheduler that lags far behind,
    # e.g. re-listing after an API server outage) finds them free, and its prepare creates it again.
    quarantine_seconds: float = 120.0
    guard_free_instances: bool = False  # partitionable: free instances carry binding conditions too
    # Partitionable: best-ranked placements offered per profile (0: all); None (auto): the operator's choice
    # in spec.autoPlacementsPerProfile (planner/offerlimit.py), every placement until it writes one.
    placements_per_profile: int | None = 0
    interval_seconds: float = 10.0  # time between rounds when every GPU is Stable
    reshape_poll_seconds: float = 0.5  # time between rounds while a GPU reshapes
    min_round_gap_seconds: float = 0.2  # rounds woken by watch events are at least this far apart
    watch: bool = True  # watch GpuPartitions and ResourceClaims to start rounds on changes
    inventory: Inventory | None = Inventory.INSTANCES  # None: ask the API server at start
    events_namespace: str = "default"  # where Events about GpuPartitions (cluster-scoped) go
    lease_namespace: str | None = None  # where the agent keeps its heartbeat Lease (None: no heartbeat)
    lease_seconds: int = DEFAULT_LEASE_SECONDS  # renewed every third of this
    # Added to this host's clock where the Lease's renewTime is written: the dev cluster plays a node whose
    # clock is off with it (the operator dates renewals by its own clock, so it must not matter).
    clock_offset_seconds: float = 0.0
    # Device health (agent/health/devices.py): watch NVML's XID events; the taint a critical XID puts on the
    # devices it affects; the quiet period after which a GPU's faults clear (0: only the GpuPartition's
    # mig.dynamig.io/xid-cleared annotation clears them); the XIDs that are no device fault.
    xid_watch: bool = True
    xid_effect: str = "NoSchedule"
    xid_clear_after_seconds: float = 0.0
    xid_ignored: tuple[int, ...] = tuple(sorted(APPLICATION_XIDS))


# The longest wait after rounds that keep failing for another reason than the API server (a bug, a refusal):
# a hot loop would fill the log. Rounds that fail on the API server (out of reach, 5xx, 429) wait at most
# API_RETRY_MAX_S, so the node is served within seconds of its return, whatever the outage's length.
ERROR_BACKOFF_MAX_S = 30.0


def node_owner_reference(node: str, uid: str) -> dict[str, Any] | None:
    """An ownerReference to the Node (so the garbage collector removes our objects with it). Pure."""
    if not uid:
        return None
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}


@dataclass(slots=True)
class NodeView:
    """What one round observed of its node, before it acts."""

    meta: NodeFacts
    gpus: list[GpuInfo]
    unreadable: dict[int, str]  # GPU index -> why NVML cannot read it
    lost_reason: str  # NVML discovery failed as a whole
    slices: list[dict[str, Any]]  # the node's ResourceSlices, every driver's
    raw_claims: list[dict[str, Any]]
    claims: dict[str, list[str]]  # device name -> claims allocating it from this node's pool
    parts: dict[str, GpuPartition]
    node_owner: str | None  # a MIG manager that owns every GPU of the node
    foreign: dict[str, str] = field(default_factory=dict)  # GPU UUID -> driver publishing its MIG devices

    @property
    def leaving(self) -> bool:
        """dynamig is being uninstalled: withdraw, create nothing new."""
        return any(UNINSTALL_ANNOTATION in p.metadata.annotations for p in self.parts.values())

    @property
    def unavailable(self) -> str:
        """Why no booking of this node can be answered ready (empty when some GPU is readable)."""
        return self.lost_reason or "; ".join(
            f"NVML cannot read GPU {i}: {e}" for i, e in self.unreadable.items()
        )


class NodeAgent:
    """Runs the rounds of one node's agent: the loop, the heartbeat, and each round's order of steps."""

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
        self.prepared = PreparedDevices()  # devices the kubelet plugin prepared (in use by a pod), per claim
        self.allocated_uuids = AllocatedUuids()  # reports allocated instances changed outside dynamig
        self._quiet_since: dict[InstanceKey, float] = {}
        self._reshape_started: dict[int, float] = {}
        self._wake = asyncio.Event()
        self._reconnected = asyncio.Event()  # a watch listed again after the API server was out of reach
        self._managed_logged: bool | None = None
        self.rounds = 0
        self.copies: NodeCopies | None = None  # with settings.watch: rounds read the API objects from these
        self.on_round: Callable[[], None] | None = None  # called after every round, failed or not
        # Removes what the agent made on the node (plugin files) when dynamig is uninstalled; returns them.
        self.on_uninstall: Callable[[], Awaitable[list[str]]] | None = None
        self.uninstalled = False  # done: the node is left alone until the agent is deleted
        # When the round now running last got something done (started, cut, answered); None between rounds.
        # The heartbeat stops when it is too old (kube/heartbeat.py ``stuck``).
        self._progress_at: float | None = None
        self.answerer = AllocationAnswerer(
            settings.driver, settings.node, api, devices, metrics, self.prepared
        )
        self.reshaper = Reshaper(
            settings.node, settings.driver, api, devices, metrics, self.prepared, clock,
            quarantine_seconds=settings.quarantine_seconds, progress=self.progressed,
        )  # fmt: skip
        self.answerer.progress = self.progressed
        self.reporter = NodeReporter(api, metrics, settings.node, settings.events_namespace)
        self.modes = ModeSwitcher(devices, api, settings.node, settings.driver, clock)
        self.health = DeviceHealth(
            settings.node, settings.xid_effect, settings.xid_clear_after_seconds
        )  # faults from XID events: the publisher taints or withdraws their devices
        self.publisher.health = self.health
        self.xids: XidWatcher | None = None
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

    def reconnected(self) -> None:
        """The API server answers again (a watch listed anew after losing it): a round now, even one an
        error back-off holds."""
        self._reconnected.set()
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile until ``stop`` is set. Errors end the round, not the loop.

        With ``settings.watch`` a change of the Node, its GpuPartitions or slices, or of a claim allocated on
        its pool starts a round at once, and rounds read those objects from watched copies (an idle round
        makes no request); otherwise rounds list them and only follow the poll intervals.
        """
        watchers: list[asyncio.Task[None]] = [asyncio.create_task(self._heartbeats(stop), name="agent-lease")]
        nvml = getattr(self.devices, "nvml", None)
        if self.settings.xid_watch and nvml is not None and hasattr(nvml, "nvmlEventSetCreate"):
            loop = asyncio.get_running_loop()

            def woken() -> None:
                loop.call_soon_threadsafe(self.wake)

            self.health.on_fault = woken
            self.xids = XidWatcher(nvml, self.health, self.metrics.registry, self.settings.xid_ignored)
            self.xids.start()
        if self.settings.watch:
            self.copies = node_copies(self.api, self.settings.node, self.settings.driver, self.wake)
            for copy in self.copies.all():
                copy.on_reconnect = self.reconnected
            watchers += [
                asyncio.create_task(c.run(stop), name=f"agent-watch-{c.source.name}")
                for c in self.copies.all()
            ]
        try:
            await self._loop(stop)
        finally:
            if self.xids is not None:
                await asyncio.to_thread(self.xids.stop)
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
            self._reconnected.clear()
            busy = True
            cap = ERROR_BACKOFF_MAX_S
            try:
                busy = await self.reconcile_once()
                failures = 0
            except Exception as exc:
                failures += 1
                self.metrics.reconcile_errors.labels(self.settings.node).inc()
                if is_transient(exc):
                    cap = API_RETRY_MAX_S
                    log.warning("round failed (%d in a row) on the API server: %r; retrying", failures, exc)
                else:
                    log.exception("reconcile round failed (%d in a row); retrying", failures)
            if self.on_round is not None:
                self.on_round()  # the liveness probe's evidence that the loop turns
            delay = self.settings.reshape_poll_seconds if busy else self.settings.interval_seconds
            events = [stop, self._wake]
            if failures:
                # A round that keeps failing backs off, and watch events do not cut the wait short: a hot loop
                # would load the API server and fill the log. A watch that lists again after losing the API
                # server does: it is back, and the node's waiting demand is served now.
                delay = backoff_delay(failures, self.settings.reshape_poll_seconds, cap)
                events = [stop, self._reconnected]
            waiters = [asyncio.ensure_future(e.wait()) for e in events]
            try:
                await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()

    def progressed(self) -> None:
        """The round got something done (an NVML destroy or create, an answer written): the agent is not
        stuck, however long the round runs."""
        if self._progress_at is not None:
            self._progress_at = self.clock()

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        """Renew the node's Lease every third of its duration while the agent can answer: not while a round
        has done nothing for half the Lease (an NVML call hung in the driver), so a stuck agent goes silent
        like a dead one and the operator withdraws its node (operator/fencing.py). A round that cuts bookings
        one after another makes progress and renews."""
        while not stop.is_set():
            every = max(1.0, self.settings.lease_seconds / 3)
            answering = not stuck(self._progress_at, self.clock(), self.settings.lease_seconds)
            if answering and not await self._heartbeat():
                # Renewed again within seconds of the API server's return, not a third of the Lease later.
                every = min(every, API_RETRY_MAX_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=every)

    async def _heartbeat(self) -> bool:
        """Renew the node's Lease (the operator's evidence the agent lives). False when that failed."""
        namespace = self.settings.lease_namespace
        now = time.time() + self.settings.clock_offset_seconds
        if namespace is None:
            return True
        try:
            # Owned by the Node once a round has read its uid: the garbage collector removes it with the Node.
            await self.api.renew_lease(
                lease_body(
                    self.settings.node, namespace, now, self.settings.lease_seconds, self.publisher.owner
                )
            )
        except Exception as exc:  # a missed renewal is retried within API_RETRY_MAX_S
            log.warning("could not renew the agent lease in namespace %s: %s", namespace, exc)
            return False
        return True

    async def reconcile_once(self) -> bool:
        """One round over every GPU. Returns True while some GPU still reshapes (poll again soon)."""
        async with self.lock:
            self._progress_at = self.clock()
            try:
                return await self._round()
            finally:
                self._progress_at = None

    async def _round(self) -> bool:
        self.rounds += 1
        if self.uninstalled:
            return False
        meta = await self._node()
        if not await self._managed(meta):
            return False
        assert meta is not None
        view = await self._observe(meta)
        parts = map(parse_gpu_partition, await self._partitions())
        view.parts = {p.name: self.reporter.freshest(p) for p in parts}  # the answers need the refusals
        # A pod waiting on its binding is the most urgent thing on the node. Under the instances inventory
        # nothing published carries binding conditions, but a booking made on the partitionable inventory
        # before a switch still waits on one: it is answered too, not left to the scheduler's timeout.
        if view.gpus or view.unavailable:
            await self._answer(view)
        view.claims = allocated_devices(view.raw_claims, self.settings.driver, self.settings.node)
        outcomes, created, replaced = await self._each_gpu(view)
        self.health.observe(view.gpus, instance_devices(outcomes), view.parts)
        await self._publish(view, outcomes)
        self._after_publish(outcomes, view.claims)  # the guards stand from now: their settle clocks start
        for o in outcomes:
            part = view.parts.get(o.name) or created.get(o.name, _NO_PARTITION)
            self.health.report(o, part)  # the DevicesHealthy condition, an Event per critical XID
            if o.status is not None and o.status != part.status:
                await self.reporter.write_status(o.name, o.status, part.metadata.uid)
            await self.reporter.post_events(part, o)
        await self.reporter.tell_holders(replaced, view.raw_claims)
        self.reporter.export(outcomes, pods_by_claim(view.raw_claims))
        busy = any(o.busy for o in outcomes)
        if view.leaving and not busy:
            await self._finish_uninstall(view.parts, outcomes)
        return busy

    # --- observe -------------------------------------------------------------------------------------

    async def _managed(self, meta: NodeFacts | None) -> bool:
        """Whether the node exists and opted in; an opted-out node offers nothing (MIG and GpuPartitions
        stay as they are)."""
        node = self.settings.node
        if meta is not None and node_is_managed(meta.labels):
            self._managed_logged = True
            if self.support is None:
                self.support = await detect_inventory(self.api, node, self.settings.driver)
                log.info(
                    "inventory for node %s: %s (%s)", node, self.support.inventory.value, self.support.why
                )
            self.reporter.node_owner = self.publisher.owner = node_owner_reference(node, meta.uid)
            return True
        if self._managed_logged is not False:
            log.warning("node %s does not exist or lacks dynamig.io/managed=true; not managing it", node)
        self._managed_logged = False
        if meta is not None and await self.publisher.remove():
            log.warning("node %s opted out: its mig.dynamig.io ResourceSlices were withdrawn", node)
        return False

    def _copy(self, kind: str) -> list[dict[str, Any]] | None:
        """The watched copy of ``kind`` (node, partitions, slices, claims); None without one or before its
        first LIST."""
        return None if self.copies is None else getattr(self.copies, kind).items()

    async def _node(self) -> NodeFacts | None:
        nodes = self._copy("node")
        if nodes is None:
            return await self.api.node_meta(self.settings.node)
        return node_facts(nodes[0]) if nodes else None

    async def _partitions(self) -> list[dict[str, Any]]:
        parts = self._copy("partitions")
        if parts is None:
            parts = await self.api.list_partitions(f"{NODE_LABEL}={self.settings.node}")
        return parts

    async def _observe(self, meta: NodeFacts) -> NodeView:
        """The GPUs (NVML), the node's slices and claims; MIG manager or NVML failure told on the Node."""
        node_owner = node_mig_owner(meta.labels, meta.allocatable)
        await self.reporter.tell_node(meta.uid, "ForeignMigOwner", node_owner)
        gpus: list[GpuInfo] = []
        unreadable: dict[int, str] = {}
        lost_reason = ""
        try:
            gpus, unreadable = await asyncio.to_thread(self.devices.discover)
        except self.devices.error_type as exc:
            self.metrics.nvml_error("discover", self.devices.error_name(exc))
            lost_reason = f"NVML discovery failed: {exc}"
            log.error("%s", lost_reason)
        await self.reporter.tell_node(meta.uid, "NvmlError", lost_reason or None)
        for error in unreadable.values():
            self.metrics.nvml_error("discover", error.split(":", 1)[0])
        slices = self._copy("slices")
        if slices is None:
            slices = await self.api.list_slices(self.settings.node)
        raw_claims = self._copy("claims")
        if raw_claims is None:
            raw_claims = await self.api.list_claims()
        return NodeView(
            meta, gpus, unreadable, lost_reason, slices, raw_claims, {}, {}, node_owner,
            foreign_mig_owners(slices, [g.uuid for g in gpus], self.settings.driver),
        )  # fmt: skip

    # --- answer --------------------------------------------------------------------------------------

    async def _answer(self, view: NodeView) -> None:
        """Answer every booking of this node (failed at once with no GPU readable or on a GPU the round
        refuses: booked again elsewhere); then write the MIG UUIDs of bookings bound without an answer."""
        unavailable = None if view.gpus else view.unavailable
        node = self.settings.node
        allocated = allocated_devices(view.raw_claims, self.settings.driver, node)
        refuse = refusals(
            node, view.parts, view.node_owner, view.foreign, _NO_PARTITION, self.partitionable, allocated
        )
        wall = time.time()

        def holds_of(gpu: GpuInfo) -> tuple[Hold, ...]:
            part = view.parts.get(gpu_partition_name(self.settings.node, gpu.index))
            if part is None:
                return ()
            active = part.spec.active_holds(wall)
            whole = tuple(h for h in active if h.whole)
            return whole if gpu.model is None else (*valid_holds(gpu.model, active), *whole)

        def offers(gpu: GpuInfo) -> bool:
            # a booking whose switch NVML answered ResetRequired is failed (booked again elsewhere), not
            # left to wait for a VM reboot
            part = view.parts.get(gpu_partition_name(self.settings.node, gpu.index))
            bookable = part is not None and whole_bookable(gpu, part, self.partitionable)
            return bookable and not self.modes.reset_required(gpu)

        answers = await self.answerer.answer_all(view.raw_claims, unavailable, refuse, holds_of, offers)
        for _, answer in answers:
            outcome = "ready" if isinstance(answer, Ready) else "failed"
            self.metrics.binding_answers.labels(self.settings.node, outcome).inc()
        if view.gpus and self.partitionable:  # the instances inventory gives MIG UUIDs in its slices
            await self.answerer.report_bound(view.raw_claims)

    # --- each GPU ------------------------------------------------------------------------------------

    async def _each_gpu(
        self, view: NodeView
    ) -> tuple[list[GpuOutcome], dict[str, GpuPartition], list[UuidChange]]:
        """Reconcile every readable GPU; GPUs NVML cannot read or no longer reports are Degraded (GpuLost)."""
        node = self.settings.node
        outcomes: list[GpuOutcome] = []
        created: dict[str, GpuPartition] = {}
        replaced: list[UuidChange] = []
        stamp = now_rfc3339()
        given = given_uuids(
            view.slices, view.raw_claims, self.settings.driver, node, from_slices=not self.partitionable
        )
        for gpu in view.gpus:
            name = gpu_partition_name(node, gpu.index)
            part = view.parts.get(name)
            try:
                instances = await asyncio.to_thread(self.devices.instances, gpu)
            except self.devices.error_type as exc:
                self.metrics.nvml_error("list-instances", self.devices.error_name(exc))
                if part is not None:
                    why = f"NVML cannot read GPU {gpu.index}: {exc}"
                    outcomes.append(GpuOutcome(name, status=lost_status(part, why, stamp)))
                continue
            if part is None and view.leaving:
                continue  # dynamig is being removed: no new GpuPartitions
            if part is None:
                part = created[name] = await self.reporter.create_partition(gpu, instances)
            owner = view.node_owner
            if owner is None and gpu.uuid in view.foreign:
                owner = f"driver {view.foreign[gpu.uuid]} publishes MIG devices of this GPU"
            try:
                outcome = await self._reconcile_gpu(
                    gpu, part, instances, view.claims, owner, leaving=view.leaving
                )
            except Exception as exc:
                if status_of(exc) is not None or is_transient(exc):
                    raise  # the API server: every GPU of the round would meet it; the round backs off
                # Anything else is this GPU's own trouble: the node's other GPUs go on being served.
                self.metrics.reconcile_errors.labels(node).inc()
                log.exception("%s: reconcile failed; the node's other GPUs go on", name)
                why = f"reconciling this GPU failed: {exc!r}"
                status = degraded_status(part, why, Reason.RECONCILE_ERROR, (ConditionType.READY,), stamp)
                outcomes.append(GpuOutcome(name, status=status))
                continue
            now_uuids = {device_name(i.gpu_index, i.profile, i.start): i.mig_uuid for i in instances}
            for change in self.allocated_uuids.update(f"gpu{gpu.index}-", now_uuids, view.claims, given):
                log.warning("%s: %s", name, change.message())
                outcome.events.append(("Warning", change.reason, change.message()))
                replaced.append(change)
            outcomes.append(outcome)
        for index, error in view.unreadable.items():
            part = view.parts.get(gpu_partition_name(node, index))
            if part is not None:
                why = f"NVML cannot read GPU {index}: {error}"
                outcomes.append(GpuOutcome(part.name, status=lost_status(part, why, stamp)))
        seen = {o.name for o in outcomes}
        for name, part in view.parts.items():
            if name not in seen:
                why = view.lost_reason or "NVML no longer reports this GPU"
                outcomes.append(GpuOutcome(name, status=lost_status(part, why, stamp)))
        return outcomes, created, replaced

    async def _reconcile_gpu(
        self,
        gpu: GpuInfo,
        part: GpuPartition,
        instances: list[MigInstance],
        claims: dict[str, list[str]],
        owner: str | None,
        *,
        leaving: bool = False,
    ) -> GpuOutcome:
        """Observe (done: ``instances``, ``claims``), decide, act, and decide again from the result. While
        uninstalling nothing is offered, so free instances beyond spec.layout are not kept for bookings."""
        node, inventory = self.settings.node, self.support.inventory if self.support else None
        problem = refusal(gpu, part, owner)
        # A booking of the whole GPU offered beside its slices asks MIG off as spec.migMode would
        # (agent/modes/booked.py); the switch is for that booking, which holds nothing back.
        booked = () if leaving else booked_by(gpu, part, self.partitionable, claims)
        request = None if leaving else requested_mode(gpu, part, self.partitionable, claims)
        switchable = problem is None or problem[0] in (Reason.MIG_DISABLED, Reason.MIG_MODE_PENDING)
        # A switch starts from the mode NVML reports current: whole -> MIG from the whole GPU, MIG -> whole by
        # retiring the instances (never for a pending disable someone else asked while MIG is on).
        switching = (
            switchable
            and gpu.model is not None
            and wants_switch(gpu, request)
            and (not gpu.mig_current or request is MigModeRequest.DISABLED)
        )
        if not switching:
            self.modes.forget(gpu)
        # A GPU without MIG (an L4, a T4: no catalog model, MIG mode NotSupported) is left alone unless its
        # policy asks it served whole (spec.migMode Disabled); a MIG GPU with MIG off is served whole.
        no_mig = problem is not None and problem[0] == Reason.UNKNOWN_MODEL and not gpu.mig_current
        whole_by_policy = no_mig and request is MigModeRequest.DISABLED
        if (
            (switching and not gpu.mig_current)
            or (problem is not None and problem[0] == Reason.MIG_DISABLED)
            or whole_by_policy
        ):
            whole = await asyncio.to_thread(self.devices.whole, gpu)
            outcome = whole_outcome(
                node, inventory, gpu, part, whole, claims, self.prepared, now_rfc3339(), time.time()
            )
            if switching and request is not None:  # to MIG: withdrawn, switched once nothing uses it
                to_mig = await self.modes.step(
                    gpu, request, claims, self.prepared, whole.processes, self.settings.settle_seconds
                )
                return self._switched(outcome, part, to_mig)
            if request is None:
                return outcome
            return self._switched(outcome, part, switch_step(gpu, request, (), None, 0.0, None))
        if problem is not None or gpu.model is None:
            problem = problem or (Reason.UNKNOWN_MODEL, "unknown model")
            status = gpu_status(
                node, inventory, gpu, part, instances, claims, self.prepared, (), Phase.DEGRADED, problem[1]
            )
            return GpuOutcome(part.name, status=refused_status(status, part, problem, now_rfc3339()))

        model, keep = gpu.model, self.partitionable and not leaving and not switching
        active = part.spec.active_holds(time.time())
        holds = () if leaving or switching else valid_holds(model, active)
        # Going whole: nothing desired, so the free instances are retired (withdrawn, settled, destroyed).
        # Kept whole for a claim of whole GPUs until its switch is asked (agent/bindings/holds.py): the free
        # instances are withdrawn but kept, so a keep that ends without a switch (the claim served
        # elsewhere, the hold expired) gives them back as they were.
        kept_whole = not leaving and not switching and whole_hold(active) is not None
        going_whole = switching or kept_whole
        desired = () if switching else held_desired(model, part.spec.desired(), holds, self.partitionable)
        settle, now = self.settings.settle_seconds, self.clock()
        observed = self.reshaper.observe(instances, claims)
        for o in observed:
            if o.busy:
                self._quiet_since.pop((gpu.index, o.placed), None)
        quiet = {p: t for (idx, p), t in self._quiet_since.items() if idx == gpu.index}
        plan = plan_gpu(model, desired, observed, quiet, now, settle, keep)
        if plan.acts:
            self._reshape_started.setdefault(gpu.index, now)
        done = await self.reshaper.carry_out(
            gpu, model, desired, plan, observed, instances, claims, quiet, settle, keep
        )
        for p in done.destroyed:
            self._quiet_since.pop((gpu.index, p), None)
        claims.update(done.claims)  # claims that won a race against a destroy count as allocated
        plan, instances, blocker = done.plan, done.instances, done.failed or done.blocker
        # Blocked only by busy instances is Stable: nothing moves until a workload lets go. A layout that
        # keeps failing is Degraded (the operator plans around it), retried on a back-off
        # (agent/layout/retry.py).
        reshaping = bool(plan.acts or plan.draining or blocker) and plan.violation is None and not done.failed
        if reshaping:
            self._reshape_started.setdefault(gpu.index, now)
        started = None if reshaping else self._reshape_started.pop(gpu.index, None)
        if started is not None:
            self.metrics.reshape_duration.labels(node).observe(max(0.0, self.clock() - started))

        published, offer = (set() if switching else set(plan.publish)), None
        if kept_whole:  # only what is allocated or in use stays published
            published &= {o.placed for o in observed if o.busy}
        auto = part.spec.auto_placements_per_profile
        limit = in_force(self.settings.placements_per_profile, auto.choice() if auto else None)
        if keep:
            retiring = {w.placed for w in plan.draining} | set(plan.destroy)  # still there: guarded
            retiring |= guarded_by_holds(model, (i.placed for i in instances), holds)
            if going_whole:  # kept whole for a claim: its free instances are booked by nobody else
                retiring |= {i.placed for i in instances}
            beside = None  # the whole GPU offered beside its slices
            if offers_whole(gpu, part, self.partitionable) and not going_whole:
                beside = (await asyncio.to_thread(self.devices.whole_device, gpu)).to_api()
            offer = partitionable_offer(
                gpu, part, instances, claims, self.prepared, retiring, self.settings.guard_free_instances,
                limit[0], [h.placed() for h in holds], beside,
            )  # fmt: skip
            published = set(offer.unguarded)
            if offer.problem:
                blocker = (Reason.INVALID_LAYOUT, offer.problem)
        ready = readiness(gpu.index, plan, blocker, done.notes)
        phase = Phase.DEGRADED if done.failed else Phase.RESHAPING if reshaping else Phase.STABLE
        status = gpu_status(
            node, inventory, gpu, part, instances, claims, self.prepared, published, phase, ready[0]
        )
        status = managed_status(
            status, part, model.key, plan, ready, now_rfc3339(),
            reshape_finished=started is not None, offered_placements=offer.placements if offer else 0,
            placements_per_profile=limit if offer else None,
        )  # fmt: skip
        beside_offered = bool(offer and offer.inventory and whole_offers([offer.inventory])) or None
        status = status.model_copy(update={"holds": list(holds), "whole_offered": beside_offered})
        outcome = GpuOutcome(
            name=part.name,
            status=status,
            busy=reshaping,
            instances=instances,
            published=published,
            inventory=offer.inventory if offer else None,
            events=done.events,
            devices=[mig_device(gpu, i) for i in instances if i.placed in published],
        )
        if request is None:
            return outcome
        step = switch_step(gpu, request, (), None, 0.0, None)
        if switching:  # to whole: nothing published; the switch once the last instance is gone
            outcome.published, outcome.inventory, outcome.devices = set(), None, []
            if instances:  # retired as any free instance is; allocated and busy ones end first
                self.modes.withdrawn(gpu, request)
                step = (Step.WAIT, f"switching MIG off once its {len(instances)} MIG instance(s) are gone")
            else:
                step = await self.modes.step(
                    gpu, request, claims, self.prepared, 0, self.settings.settle_seconds, booked
                )
            if booked:
                step = (step[0], f"{step[1]} (the whole GPU is booked for {', '.join(booked)})")
        return self._switched(outcome, part, step)

    def _switched(self, outcome: GpuOutcome, part: GpuPartition, step: tuple[Step, str]) -> GpuOutcome:
        """``outcome`` with the MigMode condition of ``spec.migMode``; while a switch is under way nothing
        of the GPU is published and Ready says why."""
        if outcome.status is not None:
            outcome.status = switch_status(outcome.status, part, step[0], step[1], now_rfc3339())
        if step[0] is not Step.DONE:
            outcome.whole, outcome.busy = None, True
        return outcome

    # --- act -----------------------------------------------------------------------------------------

    async def _publish(self, view: NodeView, outcomes: list[GpuOutcome]) -> None:
        """Offer what each GPU's outcome says, in the node's inventory; nothing while uninstalling."""
        node = self.settings.node
        if view.leaving:
            if await self.publisher.remove():  # nothing more to book here, whatever the inventory
                log.info("uninstalling: withdrew the ResourceSlices of node %s", node)
            for o in outcomes:
                o.published = set()
            return
        whole = [o.whole for o in outcomes if o.whole is not None]
        if self.partitionable:
            inventory = [o.inventory for o in outcomes if o.inventory is not None]
            changed = await self.publisher.sync_inventory(inventory, view.slices, view.raw_claims, whole)
        else:
            devices = [d for o in outcomes for d in o.devices] + whole
            changed = await self.publisher.sync(devices, view.slices)
        if changed:
            self.metrics.slice_publishes.labels(node).inc()

    async def _finish_uninstall(self, parts: dict[str, GpuPartition], outcomes: list[GpuOutcome]) -> None:
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
            await self.reporter.write_status(
                name, status.model_copy(update={"conditions": conds}), part.metadata.uid
            )
        self.uninstalled = True
        log.info("uninstalled from node %s: %s", self.settings.node, message)

    # --- after publishing ----------------------------------------------------------------------------

    def _after_publish(self, outcomes: list[GpuOutcome], claims: dict[str, list[str]]) -> None:
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
