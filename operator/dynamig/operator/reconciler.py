"""The reshape loop: per policy, read a snapshot, decide a round, write layouts and offered profiles, status,
Events and metrics.

:class:`Reconciler` holds the operator's dependencies (API I/O, catalog, metrics, settings) and the little
state that lives only in memory: when each claim was first seen pending (for the latency histogram), when each
GPU went idle, which layout writes are waiting for their agent, and the last verdict told to each claim (so
Events are posted when something changes, not every round). Losing that state on a restart or a peering
hand-over only delays a return to the baseline by one cooldown and repeats a few Events.

``Reconciler.run_policy(name, stopped)`` is the body of the Kopf daemon that runs for each policy. Watch
events on pods, claims, GpuPartitions, slices and nodes call :meth:`Reconciler.wake`; each policy loop then
waits its ``batchWindowSeconds`` so that a burst of claims is planned in one round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import ValidationError

from dynamig.geometry.catalog import Catalog
from dynamig.kube.apicalls import is_transient, status_of
from dynamig.kube.events import gpu_partition_ref
from dynamig.kube.gpupartition import (
    AutoPlacementsSpec,
    MigModeRequest,
    layout_summary,
)
from dynamig.kube.heartbeat import Sighting, agent_leases, next_silence, sightings
from dynamig.kube.names import GROUP_VERSION, POLICY_KIND, WHOLE_PROFILE
from dynamig.kube.policy import (
    GpuPartitionPolicy,
    Mode,
    check_spec_against_catalog,
    warm_pool_shortfall,
)
from dynamig.kube.times import now_rfc3339, parse_time
from dynamig.operator.decide import LayoutWrite, OfferWrite, RoundDecision, RoundInput, decide_round
from dynamig.operator.extended import class_changes, offered_profiles, served_resource, whole_offered
from dynamig.operator.inventory import (
    LAYOUT_WRITTEN_ANNOTATION,
    MIG_MODE_REQUESTED_ANNOTATION,
    MIG_MODE_WRITTEN_ANNOTATION,
    GpuView,
)
from dynamig.operator.kubeio import KubeIO, Snapshot
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.mode_round import ModeInput
from dynamig.operator.modes import (
    ModeDecision,
    decide_modes,
    released_without_mig,
    served_without_mig,
)
from dynamig.operator.policy_status import drained_claims, policy_status, read_drained_claims, status_differs
from dynamig.operator.preempting import Preempter
from dynamig.operator.preemption import DryRunReport
from dynamig.operator.settings import OperatorSettings
from dynamig.operator.silent_nodes import SilentNodes
from dynamig.operator.verdicts import ClaimVerdict, Reason
from dynamig.operator.whole_offers import WholeOffers, decide_whole_offers, ungoverned_whole_offers
from dynamig.operator.world import World, parse_world
from dynamig.operator.xid_effects import ungoverned_xid_effects, xid_effect_writes
from dynamig.planner.offerlimit import AutoChoice, choose, needs_rewrite

log = logging.getLogger(__name__)

CLAIM_API = "resource.k8s.io/v1"


class StopFlag(Protocol):
    """What the loop needs of Kopf's ``stopped`` flag (or any stand-in)."""

    def is_set(self) -> bool: ...


@dataclass
class _Memory:
    pending_since: dict[str, float] = field(default_factory=dict)  # claim uid -> first seen pending
    idle_since: dict[str, float] = field(default_factory=dict)  # GPU -> since when no busy instance
    awaiting: dict[str, tuple[str, int, float]] = field(default_factory=dict)  # GPU -> (policy, gen, t)
    floor_told: dict[str, int] = field(default_factory=dict)  # GPU -> generation whose FloorHeld was told
    told: dict[str, tuple[str, str, float]] = field(default_factory=dict)  # claim uid -> (reason, gpu, t)
    problems: dict[str, str] = field(default_factory=dict)  # policy -> last problems text
    taken: dict[str, str] = field(default_factory=dict)  # profile -> the other owner's class reported
    leases: dict[str, Sighting] = field(default_factory=dict)  # agent Lease -> when seen renewed
    # GPU -> (policy, MIG mode asked, claim, when): switches written, for their completion Event
    switching: dict[str, tuple[str, str, str, float]] = field(default_factory=dict)
    drained: dict[str, float] = field(default_factory=dict)  # claim key -> when a node was drained for it
    # policies whose status.drainedClaims this process has read back into ``drained``
    drains_read: set[str] = field(default_factory=set)


def auto_limits(
    gpus: tuple[GpuView, ...], mine: tuple[GpuView, ...], partitions: Mapping[str, Mapping[str, Any]]
) -> dict[str, AutoChoice]:
    """The GPUs of ``mine`` whose ``spec.autoPlacementsPerProfile`` is to be written, and what: the choice
    for the number of GPU nodes dynamig manages (the nodes of every GpuPartition, ``gpus``). Pure."""
    chosen = choose(len({g.node for g in gpus if g.node}))
    out: dict[str, AutoChoice] = {}
    for g in mine:
        if g.model is None:
            continue  # a GPU without MIG (served whole) has no placements to offer
        raw = ((partitions.get(g.name) or {}).get("spec") or {}).get("autoPlacementsPerProfile")
        try:
            written = AutoPlacementsSpec.model_validate(raw).choice() if raw else None
        except ValidationError:
            written = None
        if needs_rewrite(written, chosen):
            out[g.name] = chosen
    return out


class Reconciler:
    """Dependencies and in-memory state of the operator; one per process."""

    def __init__(
        self,
        kube: KubeIO,
        catalog: Catalog,
        metrics: OperatorMetrics,
        settings: OperatorSettings,
        clock: Callable[[], float] = time.time,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.catalog = catalog
        self.metrics = metrics
        self.settings = settings
        self.clock = clock
        self.wall = wall  # the wall clock Lease renewals are dated by (when this process saw them)
        self._memory = _Memory()
        self._wakers: dict[str, asyncio.Event] = {}
        self._lock = (
            asyncio.Lock()
        )  # one round at a time: rounds of different policies share the snapshot view
        self._windows: dict[str, int] = {}
        self.last_decisions: dict[str, RoundDecision] = {}
        self._gpu_uids: dict[str, str] = {}  # GpuPartition name -> uid, from the latest snapshot (for Events)
        self._next_silence: float | None = None  # wall time the next agent Lease runs out (plus grace)
        self._agents_checked = -float("inf")  # monotonic time the Leases were last read and acted on
        self.silent_nodes = SilentNodes(kube, metrics, settings, clock)
        self.preempter = Preempter(kube, catalog, metrics, settings.event_repeat_seconds)

    # ------------------------------------------------------------------------------------------ wake-ups
    def wake(self) -> None:
        """Something changed in the cluster: every policy loop plans again after its batch window."""
        for ev in self._wakers.values():
            ev.set()

    async def run_policy(self, name: str, stopped: StopFlag) -> None:
        """The loop of one policy, until ``stopped`` is set (its Kopf daemon's body)."""
        waker = self._wakers.setdefault(name, asyncio.Event())
        waker.set()
        self.metrics.policy_seen(name)  # its counters start at 0, so the first failure is an increase
        failures = 0  # rounds failed in a row on the API server
        try:
            while not stopped.is_set():
                await self._wait(waker, stopped, self._until_next_round())
                if stopped.is_set():
                    break
                window = 0 if failures else await self._batch_window(name)  # a retry has had its window
                if window > 0:
                    await self._sleep(window, stopped)
                waker.clear()
                try:
                    await self.round(name)
                    failures = 0
                except Exception as exc:
                    # Any API error, answered or not, is retried here: one that ended the daemon would be
                    # retried by Kopf only after settings.execution.default_backoff (60 s). Waits double from
                    # 0.5 s to 2 s at most, whatever the outage's length.
                    if not (isinstance(exc, ApiException) or is_transient(exc)):
                        raise
                    failures += 1
                    delay = min(2.0, 0.25 * 2 ** min(failures, 8))
                    why = status_of(exc) or repr(exc)
                    log.warning("policy %s: API error in round (%s); retrying in %.1fs", name, why, delay)
                    if status_of(exc) in (None, 0):
                        # Out of reach: a watch event (Kopf lists again once it reconnects) shows the API
                        # server answers again, and the round is retried at once.
                        await self._wait(waker, stopped, delay)
                    else:
                        await self._sleep(delay, stopped)
                    waker.set()
        finally:
            self._wakers.pop(name, None)
            self.metrics.forget_policy(name)

    def _until_next_round(self) -> float:
        """The resync period, or less when an agent's Lease runs out sooner: a silent agent's node is then
        withdrawn at once (operator/fencing.py), not up to a resync later."""
        if self._next_silence is None:
            return self.settings.resync_seconds
        return max(0.5, min(self.settings.resync_seconds, self._next_silence - self.wall() + 0.1))

    def _agents_due_in(self) -> float:
        """Seconds until the agents' Leases are to be read again: a resync after they were last read, or
        sooner when one runs out."""
        wait = self.settings.resync_seconds - (time.monotonic() - self._agents_checked)
        if self._next_silence is not None:
            wait = min(wait, self._next_silence - self.wall() + 0.1)
        return wait

    async def watch_agents(self, stopped: StopFlag) -> None:
        """The agents' watchdog, until ``stopped`` (the body of a Kopf daemon, so only the replica that leads
        runs it): reads the Leases and withdraws the nodes of silent agents whenever no policy round did so
        lately, so a silent agent's node is withdrawn with no GpuPartitionPolicy at all; with them, what the
        operator wrote to GPUs no policy governs any more (a GPU without MIG's migMode, an xidEffect)."""
        failures = 0
        while not stopped.is_set():
            left = self._agents_due_in()
            if left > 0:
                await self._sleep(min(left, 1.0), stopped)
                continue
            try:
                async with self._lock:
                    if self._agents_due_in() <= 0:  # a policy round may have read them meanwhile
                        snap = await self.kube.snapshot(self.settings.agent_lease_namespace)
                        world = await self._check_agents(snap)
                        # what GPUs that left the last policy still carry, which no policy round withdraws
                        await self._without_mig(world, snap)
                        await self._withdraw_xid_effects(world, snap)
                        await self._withdraw_whole_offers(world, snap)
                failures = 0
            except Exception as exc:
                if not (isinstance(exc, ApiException) or is_transient(exc)):
                    raise
                failures += 1
                delay = min(2.0, 0.25 * 2 ** min(failures, 8))
                why = status_of(exc) or repr(exc)
                log.warning("agent watchdog: API error (%s); retrying in %.1fs", why, delay)
                await self._sleep(delay, stopped)

    async def _wait(self, waker: asyncio.Event, stopped: StopFlag, seconds: float) -> None:
        """Until woken, stopped, or ``seconds`` passed (Kopf's flag is polled: it is not an asyncio.Event)."""
        deadline = time.monotonic() + seconds
        while not stopped.is_set() and not waker.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(waker.wait(), timeout=min(left, 0.5))
            except TimeoutError:
                continue

    async def _sleep(self, seconds: float, stopped: StopFlag) -> None:
        deadline = time.monotonic() + seconds
        while not stopped.is_set() and time.monotonic() < deadline:  # noqa: ASYNC110 - polls Kopf's flag
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    async def _batch_window(self, name: str) -> float:
        """Seconds to gather demand before planning; none before the policy's first round."""
        return float(self._windows.get(name, 0))

    # ------------------------------------------------------------------------------------------ one round
    async def round(self, name: str) -> RoundDecision | None:
        """Read, decide and act for policy ``name``. Returns the decision (None if the policy is gone)."""
        async with self._lock:
            snap = await self.kube.snapshot(self.settings.agent_lease_namespace)
            now = self.clock()
            world = await self._check_agents(snap)
            await self._keep_profile_classes(world, snap)
            await self._without_mig(world, snap)
            await self._withdraw_xid_effects(world, snap)
            await self._withdraw_whole_offers(world, snap)
            self._gpu_uids = {p["metadata"]["name"]: p["metadata"].get("uid", "") for p in snap.partitions}
            raw = next((p for p in snap.policies if p["metadata"]["name"] == name), None)
            policy = next((p for p in world.policies if p.name == name), None)
            if policy is None or raw is None:
                return None
            self._windows[name] = policy.spec.batch_window_seconds
            self._track_claims(world, snap, now)
            mine = tuple(g for g in world.gpus if world.ownership.owner.get(g.name) == name)
            self._track_idle(mine, now)
            await self._report_completions(policy, mine)
            problems = tuple(check_spec_against_catalog(policy.spec, self.catalog))
            claims = tuple(c for c in world.pending if world.claim_owner.get(c.claim.key) == name)
            decision = decide_round(
                RoundInput(policy, problems, mine, claims, now, dict(self._memory.idle_since), self.catalog)
            )
            self._read_drains(name, raw)
            # MIG mode switches (operator/modes.py) and the verdicts they change, with the round's writes.
            modes = decide_modes(ModeInput(policy, mine, decision, now, dict(self._memory.drained)))
            decision = replace(decision, verdicts=modes.verdicts)
            await self._report_switches(policy, mine)
            self.metrics.plan_duration.labels(policy=name).observe(decision.plan_seconds)
            partitions = {p["metadata"]["name"]: p for p in snap.partitions}
            limits = auto_limits(world.gpus, mine, partitions)
            for chosen in set(limits.values()):
                log.info(
                    "policy %s: placements per profile for agents on auto: %s (%d GPU nodes), to %d GPU(s)",
                    name, chosen.limit or "every placement", chosen.gpu_nodes, len(limits),
                )  # fmt: skip
            effects = xid_effect_writes(policy, mine, partitions)
            whole = decide_whole_offers(policy, mine, now)
            written = await self._apply_writes(
                policy, decision.writes, decision.offers, partitions, now, limits, modes, effects, whole
            )
            await self._tell_claims(decision.verdicts, now)
            stored = (raw.get("status") or {}).get("recentEvictions") or []
            preemption = await self.preempter.round(policy, mine, snap, decision, now, self.wall(), stored)
            models = [g.model for g in mine if g.model is not None and not g.unusable]
            warm = warm_pool_shortfall(policy.spec, models) if models and not problems else None
            await self._report_problems(policy, problems, warm)
            await self._update_status(
                policy, raw, world, mine, decision, written, problems, warm, now, preemption
            )
            self._update_metrics(name, mine, decision, time.time())  # claim creation times are wall-clock
            self.last_decisions[name] = decision
            return decision

    async def _check_agents(self, snap: Snapshot) -> World:
        """Date the agents' Lease renewals by this process's clock (kube/heartbeat.py ``sightings``), then
        report and withdraw the nodes of silent agents. The world parsed on the way is returned. Under the
        lock."""
        wall = self.wall()
        leases = agent_leases(
            snap.leases, {str(n["metadata"]["name"]) for n in snap.nodes if n.get("metadata")}
        )
        self._memory.leases = sightings(leases, self._memory.leases, wall)
        world = parse_world(snap, self.catalog, wall, self._memory.leases)
        self._next_silence = next_silence(leases, wall, self._memory.leases)
        self._agents_checked = time.monotonic()
        for gpu in await self.silent_nodes.report(world.silent, world.gpus, snap):
            self._memory.awaiting.pop(gpu, None)
        await self.silent_nodes.fence(world.silent, snap, len(leases))
        return world

    async def _keep_profile_classes(self, world: World, snap: Snapshot) -> None:
        """One DeviceClass per offered profile for pods asking the device plugin's resource names, and the
        whole-GPU class ``gpu.dynamig.io`` (``nvidia.com/gpu``) while a governed GPU has MIG mode off
        (operator/extended.py); a Warning Event on the policies offering a profile (or whole GPUs) whose name
        another owner's class already serves. A refusal to write (RBAC) is logged and the round goes on."""
        if not self.settings.device_plugin_classes:
            offered: dict[str, tuple[str, ...]] = {}  # and any made before are removed
        else:
            offered = offered_profiles(world.policies, world.gpus, world.ownership.owner)
            whole = whole_offered(world.policies, world.gpus, world.ownership.owner)
            if whole:
                offered[WHOLE_PROFILE] = whole
        changes = class_changes(offered, snap.device_classes)
        if changes.writes:
            try:
                await self.kube.write_device_classes(changes)
            except ApiException as exc:
                log.warning("could not keep the profile DeviceClasses: %s %s", exc.status, exc.reason)
                return
            log.info(
                "profile DeviceClasses: created %s, updated %s, deleted %s",
                [c["metadata"]["name"] for c in changes.create] or "none",
                [c["metadata"]["name"] for c in changes.replace] or "none",
                list(changes.delete) or "none",
            )
        for profile, other in changes.refused.items():
            if self._memory.taken.get(profile) == other:
                continue
            self._memory.taken[profile] = other
            what = "whole GPU (MIG mode off)" if profile == WHOLE_PROFILE else profile
            text = (
                f"{served_resource(profile)} is already served by DeviceClass {other}, which dynamig "
                f"did not make: pods asking for it get that class's devices, not a {what} of this policy; "
                f"delete {other} to let dynamig serve it"
            )
            log.warning("%s", text)
            for name in offered[profile]:
                policy = next((p for p in world.policies if p.name == name), None)
                if policy is not None:
                    await self._event_policy(policy, "Warning", "ExtendedResourceTaken", text)
        for profile in set(self._memory.taken) - set(changes.refused):
            del self._memory.taken[profile]

    def _track_claims(self, world: World, snap: Snapshot, now: float) -> None:
        mem = self._memory
        for c in world.pending:
            mem.pending_since.setdefault(c.claim.uid, now)
        for uid in list(mem.pending_since):
            if uid in world.allocated:
                self.metrics.pending_to_allocated.observe(now - mem.pending_since.pop(uid))
                mem.told.pop(uid, None)
        live = {str(c["metadata"].get("uid", "")) for c in snap.claims}
        live |= {c.claim.uid for c in world.pending if c.claim.is_pod}  # pods waiting with extended resources
        for uid in list(mem.pending_since):
            if uid not in live:
                mem.pending_since.pop(uid, None)
                mem.told.pop(uid, None)
        waiting = {c.claim.key for c in world.pending}
        mem.drained = {key: t for key, t in mem.drained.items() if key in waiting}

    def _track_idle(self, gpus: tuple[GpuView, ...], now: float) -> None:
        idle = self._memory.idle_since
        for g in gpus:
            if g.busy or g.in_flight:
                idle[g.name] = now
            else:
                since = idle.setdefault(g.name, now)
                if g.last_written is not None and g.last_written > since:
                    idle[g.name] = g.last_written

    async def _without_mig(self, world: World, snap: Snapshot) -> None:
        """GPUs without MIG (an L4): each one a policy governs (``migMode.gpusWithoutMig: Whole``) is asked to
        be served whole (GpuPartition ``spec.migMode: Disabled``; not under DryRun); one no policy governs any
        more has the operator's request withdrawn. A refused write is logged; the next round tries again."""
        by_name = {p.name: p for p in world.policies}
        partitions = {p["metadata"]["name"]: p for p in snap.partitions}
        writes: list[tuple[str, MigModeRequest | None, GpuPartitionPolicy | None]] = []
        for gpu in served_without_mig(world.gpus):
            policy = by_name.get(world.ownership.owner.get(gpu, ""))
            if policy is not None and policy.spec.mode is not Mode.DRY_RUN:
                writes.append((gpu, MigModeRequest.DISABLED, policy))
        writes += [(gpu, None, None) for gpu in released_without_mig(world.gpus, world.ownership.owner)]
        for gpu, mode, policy in writes:
            rv = str(((partitions.get(gpu) or {}).get("metadata") or {}).get("resourceVersion", ""))
            annotations = {
                MIG_MODE_REQUESTED_ANNOTATION: mode.value if mode else "",
                MIG_MODE_WRITTEN_ANNOTATION: now_rfc3339(),
            }
            try:
                await self.kube.write_spec(gpu, {"migMode": mode.value if mode else None}, annotations, rv)
            except ApiException as exc:
                log.warning("%s: spec.migMode write failed: %s", gpu, exc.reason)
                continue
            if policy is not None:
                msg = f"policy {policy.name}: a GPU without MIG, served whole (gpusWithoutMig: Whole)"
            else:
                msg = "no policy serves this GPU without MIG whole any more: left alone"
            log.info("%s: %s", gpu, msg)
            await self._event_gpu(gpu, "Normal", "ServedWhole" if policy is not None else "LeftAlone", msg)

    async def _withdraw_xid_effects(self, world: World, snap: Snapshot) -> None:
        """Remove ``spec.xidEffect`` from each GPU no policy governs any more: its agent's ``--xid-effect``
        applies again. A refused write is logged; the next round tries again."""
        partitions = {p["metadata"]["name"]: p for p in snap.partitions}
        for gpu in ungoverned_xid_effects(world.gpus, world.ownership.owner, partitions):
            rv = str(((partitions.get(gpu) or {}).get("metadata") or {}).get("resourceVersion", ""))
            try:
                await self.kube.write_spec(gpu, {"xidEffect": None}, {}, rv)
            except ApiException as exc:
                log.warning("%s: spec.xidEffect removal failed: %s", gpu, exc.reason)
                continue
            msg = "no policy governs this GPU any more: a critical XID taints with the agent's --xid-effect"
            log.info("%s: %s", gpu, msg)
            await self._event_gpu(gpu, "Normal", "XidEffectWithdrawn", msg)

    async def _withdraw_whole_offers(self, world: World, snap: Snapshot) -> None:
        """Remove ``spec.offerWhole`` the operator wrote on each GPU no policy governs any more (not while
        its whole device is allocated). A refused write is logged; the next round tries again."""
        partitions = {p["metadata"]["name"]: p for p in snap.partitions}
        for w in ungoverned_whole_offers(world.gpus, world.ownership.owner):
            rv = str(((partitions.get(w.gpu) or {}).get("metadata") or {}).get("resourceVersion", ""))
            try:
                await self.kube.write_spec(w.gpu, w.spec(), w.annotations(), rv)
            except ApiException as exc:
                log.warning("%s: spec.offerWhole removal failed: %s", w.gpu, exc.reason)
                continue
            log.info("%s", w.message)
            await self._event_gpu(w.gpu, "Normal", "WholeOfferWithdrawn", w.message)

    async def _report_switches(self, policy: GpuPartitionPolicy, gpus: tuple[GpuView, ...]) -> None:
        """A ``MigModeSwitched`` Event once NVML reports a MIG mode this process asked for (on the GPU and
        the policy); a switch the agent answered ResetRequired for is told by the ResetRequired record."""
        for g in gpus:
            entry = self._memory.switching.get(g.name)
            if entry is None or entry[0] != policy.name:
                continue
            _, to, claim, started = entry
            if g.mode_wanted is None or g.mode_wanted.value != to or g.mode_reset_stuck:
                self._memory.switching.pop(g.name)  # withdrawn, asked otherwise, or waiting for a reset
                continue
            if g.switching is not None or g.mig_mode.value != to:
                continue
            self._memory.switching.pop(g.name)
            took = self.clock() - started
            word = "on" if to == "Enabled" else "off"
            msg = f"{g.name}: MIG mode is {word} ({took:.1f}s after it was asked, for claim {claim})"
            await self._event_policy(policy, "Normal", "MigModeSwitched", msg)
            await self._event_gpu(g.name, "Normal", "MigModeSwitched", msg)

    async def _report_completions(self, policy: GpuPartitionPolicy, gpus: tuple[GpuView, ...]) -> None:
        for g in gpus:
            entry = self._memory.awaiting.get(g.name)
            if entry is None or entry[0] != policy.name:
                continue
            _, generation, started = entry
            if g.floor_held and (g.observed_generation or 0) >= generation:
                # Partitionable: the scheduler booked placements over the new floor's slices. Expected: told
                # once per layout written (Normal), and the completion is reported when the floor exists.
                if self._memory.floor_told.get(g.name) != generation:
                    self._memory.floor_told[g.name] = generation
                    msg = (
                        f"{g.name}: {layout_summary(g.desired)} waits for bookings to end before the agent "
                        f"creates it: {g.floor_held}"
                    )
                    log.info("%s", msg)
                    await self._event_policy(policy, "Normal", "FloorHeld", msg)
                continue
            if g.failure and (g.observed_generation or 0) >= generation:
                self._memory.awaiting.pop(g.name)
                self._memory.floor_told.pop(g.name, None)
                # A busy instance the new layout needed (a claim won the race) blocks; anything else failed.
                blocked = g.failure.startswith("InstanceBusy")
                reason = "ReshapeBlocked" if blocked else "ReshapeFailed"
                self.metrics.reshapes.labels(
                    policy=policy.name, result="blocked" if blocked else "failed"
                ).inc()
                msg = f"{g.name}: the agent could not apply {layout_summary(g.desired)}: {g.failure}"
                await self._event_policy(policy, "Warning", reason, msg)
                await self._event_gpu(g.name, "Warning", reason, msg)
            elif not g.in_flight and (g.observed_generation or 0) >= generation:
                self._memory.awaiting.pop(g.name)
                self._memory.floor_told.pop(g.name, None)
                self.metrics.reshapes.labels(policy=policy.name, result="completed").inc()
                took = self.clock() - started
                msg = (
                    f"{g.name} now has {layout_summary(g.actual)} ({took:.1f}s after the layout was written)"
                )
                await self._event_policy(policy, "Normal", "ReshapeCompleted", msg)
                await self._event_gpu(g.name, "Normal", "ReshapeCompleted", msg)

    async def _apply_writes(
        self,
        policy: GpuPartitionPolicy,
        writes: tuple[LayoutWrite, ...],
        offers: tuple[OfferWrite, ...],
        partitions: Mapping[str, Mapping[str, Any]],
        now: float,
        limits: Mapping[str, AutoChoice] | None = None,
        modes: ModeDecision | None = None,
        effects: Mapping[str, str | None] | None = None,
        whole: WholeOffers | None = None,
    ) -> tuple[LayoutWrite, ...]:
        """Write each GPU's layout, offered profiles, automatic placements per profile, MIG mode (a switch
        asked by operator/modes.py, a request withdrawn after ResetRequired, or Disabled for a booked whole
        device: operator/whole_offers.py) and whole offer in one patch (one resourceVersion, one generation).
        Returns the layout writes done."""
        done: list[LayoutWrite] = []
        stamp = now_rfc3339()
        layouts = {w.gpu: w for w in writes}
        offered = {o.gpu: o for o in offers}
        limits = limits or {}
        switches = {s.gpu: s for s in modes.switches} if modes is not None else {}
        resets = {r.gpu: r for r in modes.resets} if modes is not None else {}
        keeps = {k.gpu: k for k in modes.keeps} if modes is not None else {}
        releases = {x.gpu: x for x in modes.releases} if modes is not None else {}
        effects = effects or {}
        wholes = whole.by_gpu() if whole is not None else {}
        for gpu in dict.fromkeys(
            [*layouts, *offered, *limits, *switches, *resets, *keeps, *releases, *effects, *wholes]
        ):
            offer_whole, booked = wholes.get(gpu, (None, None))
            w, o, limit = layouts.get(gpu), offered.get(gpu), limits.get(gpu)
            switch, reset, keep = switches.get(gpu), resets.get(gpu), keeps.get(gpu)
            release = releases.get(gpu) if keep is None else None
            if switch is not None and switch.spec().get("offeredProfiles") is not None:
                o = None  # switching off: it offers nothing from now on
            raw = partitions.get(gpu) or {}
            rv = str((raw.get("metadata") or {}).get("resourceVersion", ""))
            spec: dict[str, Any] = {}
            annotations: dict[str, str] = {}
            if w is not None:
                spec["layout"] = [{"profile": i.profile, "start": i.start} for i in w.layout]
                annotations[LAYOUT_WRITTEN_ANNOTATION] = stamp  # offers alone start no cooldown
            if o is not None:
                spec["offeredProfiles"] = list(o.profiles)
            if limit is not None:
                spec["autoPlacementsPerProfile"] = {"limit": limit.limit, "gpuNodes": limit.gpu_nodes}
            if gpu in effects:  # a merge patch removes the field on null: the agent's --xid-effect again
                spec["xidEffect"] = effects[gpu]
            if offer_whole is not None:
                spec.update(offer_whole.spec())
                annotations.update(offer_whole.annotations())
            if booked is not None:  # its own Enabled, replaced: the GPU stays whole after the claim
                spec.update(booked.spec())
                annotations.update(booked.annotations(stamp))
            if reset is not None:
                spec.update(reset.spec())
                annotations.update(reset.annotations())
            if switch is not None:  # never beside a layout write (modes.py skips GPUs written this round)
                spec.update(switch.spec())
                annotations.update(switch.annotations(stamp))
            if keep is not None:  # the whole GPU kept for a claim of whole GPUs (agent/bindings/holds.py)
                stored = (raw.get("spec") or {}).get("holds") or []
                others = [h for h in stored if h.get("profile") != WHOLE_PROFILE]
                held = keep.hold(self.wall()).model_dump(mode="json", by_alias=True, exclude_none=True)
                spec["holds"] = [*others, held]
            elif release is not None:  # kept for a claim kept on another node now
                stored = (raw.get("spec") or {}).get("holds") or []
                spec["holds"] = [
                    h for h in stored if h.get("profile") != WHOLE_PROFILE or h.get("claim") != release.claim
                ]
            try:
                result = await self.kube.write_spec(gpu, spec, annotations, rv)
            except ApiException as exc:
                if exc.status in (404, 409):  # changed or gone since the snapshot: the next round replans
                    log.info("spec write to %s skipped (%s)", gpu, exc.status)
                    continue
                if switch is not None or reset is not None:
                    await self._event_policy(
                        policy,
                        "Warning",
                        "MigModeSwitchFailed",
                        f"{gpu}: spec.migMode write failed: {exc.reason}",
                    )
                if w is not None:
                    self.metrics.reshapes.labels(policy=policy.name, result="failed").inc()
                    await self._event_policy(
                        policy, "Warning", "ReshapeFailed", f"{gpu}: write failed: {exc.reason}"
                    )
                elif o is not None:
                    await self._event_policy(
                        policy,
                        "Warning",
                        "OffersFailed",
                        f"{gpu}: offeredProfiles write failed: {exc.reason}",
                    )
                elif release is not None:
                    log.warning("%s: releasing it for %s failed: %s", gpu, release.claim, exc.reason)
                elif switch is None and reset is None and keep is None:
                    log.warning(
                        "%s: autoPlacementsPerProfile, xidEffect, offerWhole or migMode write failed: %s",
                        gpu, exc.reason,
                    )  # fmt: skip
                elif keep is not None and switch is None:
                    log.warning("%s: keeping it whole for %s failed: %s", gpu, keep.claim, exc.reason)
                continue
            if gpu in effects:
                effect = effects[gpu] or "the agent's --xid-effect"
                log.info("policy %s: %s: a critical XID taints its devices %s", policy.name, gpu, effect)
            if offer_whole is not None:
                log.info("%s", offer_whole.message)
                reason = "WholeOffered" if offer_whole.offer else "WholeOfferWithdrawn"
                await self._event_gpu(gpu, "Normal", reason, offer_whole.message)
            if booked is not None:
                log.info("policy %s: %s", policy.name, booked.message)
                await self._event_gpu(gpu, "Normal", "WholeGpuBooked", booked.message)
            if keep is not None:
                if keep.drain:  # once per claim: remembered once a drain's hold is written (and in status)
                    self._memory.drained.setdefault(keep.claim, self.wall())
                text = f"{gpu} kept whole for claim {keep.claim} (a claim of whole GPUs) {keep.why}"
                log.info("policy %s: %s", policy.name, text)
                await self._event_gpu(gpu, "Normal", "WholeGpuKept", text)
            if release is not None:
                text = f"{gpu} no longer kept whole for claim {release.claim}: {release.why}"
                log.info("policy %s: %s", policy.name, text)
                self.metrics.holds_released.labels(policy=policy.name, why="moved").inc()
                await self._event_gpu(gpu, "Normal", "WholeGpuReleased", text)
            if reset is not None:
                log.warning("%s", reset.message)
                await self._event_policy(policy, "Warning", "MigModeResetRequired", reset.message)
                await self._event_gpu(gpu, "Warning", "MigModeResetRequired", reset.message)
            if switch is not None:
                self._memory.switching[gpu] = (policy.name, switch.to.value, switch.claim, now)
                self.metrics.mig_mode_switched(policy.name, switch.to.value)
                log.info("%s", switch.message)
                await self._event_policy(policy, "Normal", "MigModeSwitchRequested", switch.message)
                await self._event_gpu(gpu, "Normal", "MigModeSwitchRequested", switch.message)
            if o is not None:
                before = ", ".join(o.before) if o.before else "none"
                after = ", ".join(o.profiles) or "none (existing instances only)"
                msg = f"policy {policy.name} ({policy.spec.mode.value}): offered profiles {before} -> {after}"
                if o.kept_for:
                    msg += f" (idle node kept for waiting multi-GPU claim {o.kept_for})"
                log.info("%s: %s", gpu, msg)
                await self._event_gpu(gpu, "Normal", "OffersChanged", msg)
            if w is None:
                continue
            generation = int((result.get("metadata") or {}).get("generation", 0))
            self._memory.awaiting[w.gpu] = (policy.name, generation, now)
            self._memory.idle_since.pop(w.gpu, None)
            self.metrics.reshapes.labels(policy=policy.name, result="written").inc()
            serves = f" for {len(w.claims)} pending claim(s)" if w.claims else ""
            msg = (
                f"{w.gpu} ({w.model}): {layout_summary(w.before)} -> {layout_summary(w.layout)}{serves}; "
                f"{w.reason}"
            )
            await self._event_policy(policy, "Normal", "ReshapeStarted", msg)
            await self._event_gpu(w.gpu, "Normal", "LayoutChanged", f"policy {policy.name}: {msg}")
            done.append(w)
        return tuple(done)

    async def _tell_claims(self, verdicts: tuple[ClaimVerdict, ...], now: float) -> None:
        """Post an Event on each pending claim and its pods when its verdict changed (or went stale)."""
        told = self._memory.told
        for v in verdicts:
            uid = v.claim.claim.uid
            last = told.get(uid)
            key = (v.reason.value, v.gpu)
            if (
                last is not None
                and (last[0], last[1]) == key
                and now - last[2] < self.settings.event_repeat_seconds
            ):
                continue
            told[uid] = (key[0], key[1], now)
            kind = "Warning" if v.warning else "Normal"
            if v.claim.claim.is_pod:  # extended resources: no claim exists yet, the pod is told
                (pod,) = v.claim.pods
                await self.kube.post_event(
                    {"apiVersion": "v1", "kind": "Pod", "name": pod.name, "namespace": pod.namespace,
                     "uid": pod.uid},
                    kind, v.reason.value, f"extended resources: {v.message}", pod.namespace,
                )  # fmt: skip
                continue
            claim_ref = {
                "apiVersion": CLAIM_API,
                "kind": "ResourceClaim",
                "name": v.claim.claim.name,
                "namespace": v.claim.claim.namespace,
                "uid": uid,
            }
            await self.kube.post_event(claim_ref, kind, v.reason.value, v.message, v.claim.claim.namespace)
            for pod in v.claim.pods:
                pod_ref = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod.name,
                    "namespace": pod.namespace,
                    "uid": pod.uid,
                }
                msg = f"claim {v.claim.claim.name}: {v.message}"
                await self.kube.post_event(pod_ref, kind, v.reason.value, msg, pod.namespace)

    async def _report_problems(
        self, policy: GpuPartitionPolicy, problems: tuple[Any, ...], warm_shortfall: str | None
    ) -> None:
        """A Warning Event when what is wrong with the spec changes: problems stop planning (InvalidSpec); a
        warm pool too large for the governed GPUs does not (WarmPoolTooLarge: as much as fits is kept)."""
        text = "; ".join(str(p) for p in problems)
        reason = "InvalidSpec" if text else "WarmPoolTooLarge"
        text = text or warm_shortfall or ""
        if self._memory.problems.get(policy.name) == text:
            return
        self._memory.problems[policy.name] = text
        if text:
            await self._event_policy(policy, "Warning", reason, text)

    async def _update_status(
        self,
        policy: GpuPartitionPolicy,
        raw: Mapping[str, Any],
        world: World,
        mine: tuple[GpuView, ...],
        decision: RoundDecision,
        written: tuple[LayoutWrite, ...],
        problems: tuple[Any, ...],
        warm_shortfall: str | None,
        now: float,
        preemption: DryRunReport | None = None,
    ) -> None:
        lost = world.ownership.lost.get(policy.name, {})
        evictions = self.preempter.recent_evictions(policy.name)
        drains = {k: t for k, t in self._memory.drained.items() if world.claim_owner.get(k) == policy.name}
        status = policy_status(
            policy, raw, lost, mine, decision, written, problems, warm_shortfall, evictions, now_rfc3339(),
            preemption, drained_claims(drains),
        )  # fmt: skip
        if status_differs(raw.get("status") or {}, status):
            await self.kube.patch_policy_status(policy.name, status)

    def _read_drains(self, name: str, raw: Mapping[str, Any]) -> None:
        """Once per policy and process: the claims a node was drained for, as the policy's
        ``status.drainedClaims`` has them, so a restarted operator (or a new leader) drains none again."""
        if name in self._memory.drains_read:
            return
        self._memory.drains_read.add(name)
        stored = read_drained_claims((raw.get("status") or {}).get("drainedClaims"))
        for key, when in stored.items():
            self._memory.drained.setdefault(key, when)
        if stored:
            log.info("policy %s: %d claim(s) already drained for, read back from status", name, len(stored))

    def _update_metrics(
        self, name: str, mine: tuple[GpuView, ...], decision: RoundDecision, now: float
    ) -> None:
        counts: dict[tuple[str, str], int] = {}
        for v in decision.verdicts:
            key = (v.profile or "none", v.reason.value)
            counts[key] = counts.get(key, 0) + v.devices
        self.metrics.set_pending(name, counts)
        created = [parse_time(v.claim.created) for v in decision.verdicts]
        oldest = max((now - t for t in created if t is not None), default=0.0)
        published = sum(1 for g in mine if g.offer_whole and g.whole_offered)
        booked = sum(1 for g in mine if g.booked_whole)
        self.metrics.set_governed(name, len(mine), max(0.0, oldest), published, booked)

    async def _event_policy(self, policy: GpuPartitionPolicy, kind: str, reason: str, message: str) -> None:
        ref = {
            "apiVersion": GROUP_VERSION,
            "kind": POLICY_KIND,
            "name": policy.name,
            "uid": policy.metadata.uid,
        }
        await self.kube.post_event(ref, kind, reason, message, self.settings.events_namespace)

    async def _event_gpu(self, gpu: str, kind: str, reason: str, message: str, uid: str = "") -> None:
        # kubectl describe finds an object's Events by uid: without it they exist but never show. ``uid``
        # for a caller that runs before the round's snapshot uids are kept (a silent agent's GPUs).
        ref = gpu_partition_ref(gpu, uid or self._gpu_uids.get(gpu))
        await self.kube.post_event(ref, kind, reason, message, self.settings.events_namespace)


__all__ = ["Reason", "Reconciler", "StopFlag"]
