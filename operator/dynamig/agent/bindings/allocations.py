"""Answers allocations of this node's devices that wait on binding conditions. Side effects: NVML, API.

For each allocation with no answer yet (:func:`dynamig.kube.answers.unanswered`) the agent observes its
GPUs afresh, decides (:func:`dynamig.agent.bindings.decide.decide`), carries out a cut (destroy the free
instances in the way, create the instance at its placement) and writes the answer into the claim's
``status.devices[]``. It runs inside the agent's round, under the agent's lock, so no reshape of its own
runs at the same time; a crash before the status write leaves the allocation unanswered and the next
round answers it once (a cut that already happened is then simply ready).

``ready`` carries the MIG UUID NVML reported: a MIG device not enumerated yet right after its create is read
again (:attr:`AllocationAnswerer.uuid_reads` times, :attr:`AllocationAnswerer.uuid_retry_s` apart), and the
allocation is answered failed if it still is not (the instance stays; the next booking finds it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from dynamig.agent.bindings.answering import admin_allocations, ordinary_holders
from dynamig.agent.bindings.decide import (
    REASON_NO_MIG_DEVICE,
    Cut,
    Enumerate,
    Failed,
    GpuState,
    Ready,
    SwitchFirst,
    decide,
    device_status,
    locate,
)
from dynamig.agent.bindings.holds import whole_hold
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.layout.reconcile import observe
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml.device import GpuInfo, NvmlDevices
from dynamig.agent.publishing.gpu_status import Problem
from dynamig.geometry.model import PlacedInstance, device_name
from dynamig.kube.answers import Pending, data_entry, still_waits, unanswered, unreported
from dynamig.kube.events import AGENT_COMPONENT, claim_ref, event_body
from dynamig.kube.gpupartition import Hold
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY
from dynamig.kube.names import WHOLE_PROFILE, whole_device_index
from dynamig.kube.times import now_rfc3339

log = logging.getLogger(__name__)

REASON_GPU_UNAVAILABLE = "GpuUnavailable"
REASON_NOBODY_WAITS = "NobodyWaits"  # the booking's pod is gone: a failed answer releases it, no cut

Refuse = Callable[[GpuInfo], Problem | None]  # why the round leaves a GPU alone, or None
# the placements kept for one claim each on a GPU, and the hold of the whole GPU (profile whole) if any
HoldsOf = Callable[[GpuInfo], tuple[Hold, ...]]
OffersWhole = Callable[[GpuInfo], bool]  # MIG on, the whole GPU offered beside its slices


class AllocationAnswerer:
    """Answers the binding conditions of one node's (pool ``node`` of ``driver``) allocated devices.
    ``prepared``: the device names the kubelet plugin prepared, shared with the agent (read, not kept)."""

    def __init__(
        self,
        driver: str,
        node: str,
        api: KubeApi,
        devices: NvmlDevices,
        metrics: AgentMetrics,
        prepared: Collection[str],
        *,
        uuid_reads: int = 8,
        uuid_retry_s: float = 0.25,
    ) -> None:
        self.driver, self.node = driver, node
        self.api, self.devices, self.metrics = api, devices, metrics
        self.prepared = prepared
        # A MIG device NVML has not enumerated yet is read this many times, this far apart (about 2 s in all:
        # the round holds the agent's lock meanwhile), before the allocation is answered failed.
        self.uuid_reads, self.uuid_retry_s = max(1, uuid_reads), uuid_retry_s
        self.progress: Callable[[], None] = lambda: None  # told after each booking handled (the heartbeat)
        self._switching: set[tuple[str, str]] = set()  # (claim, device): told once, waiting on a switch

    async def answer_all(
        self,
        claims: list[dict[str, Any]],
        unavailable: str | None = None,
        refuse: Refuse | None = None,
        holds: HoldsOf | None = None,
        offers_whole: OffersWhole | None = None,
    ) -> list[tuple[Pending, Ready | Failed]]:
        """Answer every unanswered allocation in ``claims``: ``failed`` with ``unavailable`` as the reason
        when the node's GPUs cannot be read (the pod is booked again elsewhere instead of waiting for the
        scheduler's binding timeout), with the refusal's reason on a GPU ``refuse`` names, and on slices
        ``holds`` keeps for another claim. A booking of a whole GPU that ``offers_whole`` beside its MIG
        slices is left unanswered until the round has switched MIG off. Call under the agent's lock. Returns
        the answers written."""
        written: list[tuple[Pending, Ready | Failed]] = []
        admin = admin_allocations(claims, self.driver, self.node)
        view = _GpuJudges(refuse, holds, offers_whole)
        pending = unanswered(claims, self.driver, self.node, BINDING_READY, BINDING_FAILED)
        self._switching &= {(p.claim, p.device) for p in pending}
        for p in pending:
            answer = await self._answer(p, claims, unavailable, view, (p.claim, p.device) in admin)
            self.progress()
            if answer is None:
                log.info("claim %s no longer waits on %s; nothing cut, nothing to answer", p.claim, p.device)
                continue
            if isinstance(answer, SwitchFirst):
                if (p.claim, p.device) not in self._switching:
                    self._switching.add((p.claim, p.device))
                    log.info("claim %s booked the whole GPU %s: answered once MIG is off", p.claim, p.device)
                continue
            entry = device_status(
                self.driver,
                self.node,
                p.device,
                answer,
                BINDING_READY,
                BINDING_FAILED,
                now_rfc3339(),
                p.generation,
            )
            if not await self.api.put_device_status(p.namespace, p.name, entry):
                log.info("claim %s no longer allocates %s; nothing to answer", p.claim, p.device)
                continue
            written.append((p, answer))
            if isinstance(answer, Ready):
                kind = "admin-access allocation" if (p.claim, p.device) in admin else "allocation"
                log.info("%s of %s to %s: ready (%s)", kind, p.device, p.claim, answer.mig_uuid)
                event = ("Normal", "AllocationReady", f"{p.device} on node {self.node} is {answer.mig_uuid}")
            else:
                log.warning(
                    "allocation of %s to %s failed: %s: %s", p.device, p.claim, answer.reason, answer.message
                )
                why = f"{p.device} on node {self.node}: {answer.reason}: {answer.message}"
                event = ("Warning", "AllocationFailed", f"{why}; the scheduler books again")
            # On the claim, where `kubectl describe resourceclaim` shows what its pod got or why it waits.
            ref = claim_ref(p.namespace, p.name, p.uid)
            await self.api.post_event(
                event_body(ref, *event, p.namespace, AGENT_COMPONENT, now_rfc3339(), self.node)
            )
        return written

    async def report_bound(self, claims: list[dict[str, Any]]) -> int:
        """Write the MIG UUID of each instance booked without binding conditions (its pod bound in the
        scheduling cycle) into its claim's ``status.devices[].data``, as a ready answer carries it, so
        ``kubectl get resourceclaim -o yaml`` shows what the pod got. After the fact: nothing waits on it.
        Call under the agent's lock. Returns how many were written."""
        todo = unreported(claims, self.driver, self.node)
        if not todo:
            return 0
        gpus, states = await self._observe(claims)
        written = 0
        for p in todo:
            whole = gpus.get(index) if (index := whole_device_index(p.device)) is not None else None
            if whole is not None and not whole.mig_enabled:  # a whole GPU: its UUID is what the pod got
                facts = {"uuid": whole.uuid, "profile": WHOLE_PROFILE}
                entry = data_entry(self.driver, self.node, p.device, facts)
                written += 1 if await self.api.put_device_status(p.namespace, p.name, entry) else 0
                continue
            found = locate(p.device, states)
            uuid = found[0].mig_uuids.get(found[1], "") if found is not None else ""
            if found is not None and not uuid and _slices_free(*found):
                # Gone since the scheduler saw it free (destroyed outside dynamig): its pod is bound, and
                # the kubelet plugin's prepare would create it; made now, the pod's start does not wait.
                uuid = await self._recreate(gpus[found[0].index], found[1], p.device)
            if found is None or not uuid:
                continue  # not a whole instance now: the kubelet plugin says so at prepare
            placed = found[1]
            data = {"migUUID": uuid, "profile": placed.profile, "placementStart": placed.start}
            entry = data_entry(self.driver, self.node, p.device, data)
            if await self.api.put_device_status(p.namespace, p.name, entry):
                written += 1
        return written

    async def _recreate(self, gpu: GpuInfo, placed: PlacedInstance, device: str) -> str:
        """Create the instance of a bound allocation over free slices; its MIG UUID, or "" when NVML
        refused (the prepare tries again and says why)."""
        try:
            made = await asyncio.to_thread(self.devices.create, gpu, placed)
        except (self.devices.error_type, ValueError) as exc:
            self.metrics.operation("create", "error")
            log.warning("%s is allocated to a bound pod and gone; creating it again failed: %s", device, exc)
            return ""
        self.metrics.operation("create", "success")
        log.warning(
            "%s is allocated to a bound pod and was gone (destroyed outside dynamig): created again", device
        )
        return made.mig_uuid or ""

    async def _answer(
        self,
        p: Pending,
        claims: list[dict[str, Any]],
        unavailable: str | None,
        judges: _GpuJudges,
        admin: bool,
    ) -> Ready | Failed | SwitchFirst | None:
        """Decide, and cut or read the MIG UUID again when that is the answer; an NVML error on the way is a
        failed answer, never silence. None: the booking is gone (read just before a destroy)."""
        if not p.reserved:
            return Failed(
                REASON_NOBODY_WAITS,
                f"{p.device}: no pod is reserved on the claim any more (deleted, or preempted while it "
                "waited for this answer); nothing is cut for it",
            )
        if unavailable is not None:
            return Failed(REASON_GPU_UNAVAILABLE, f"{p.device}: {unavailable}")
        devices = self.devices
        try:
            gpus, states = await self._observe(claims, judges)
            answer = decide(p.device, p.claim, states, admin=admin)
            while isinstance(answer, Cut | SwitchFirst) and answer.destroy:
                # The round's claims are a snapshot: since it was read the booking may have gone (its pod
                # deleted), and the scheduler may have given an instance in the way to another pod, which
                # binds at once. So the claims are read again from the API server right before each destroy
                # (each takes its time in NVML), under the lock every prepare takes, and the cut is decided
                # again from them.
                fresh = await self.api.list_claims()
                if not still_waits(fresh, p, self.driver, self.node, BINDING_READY, BINDING_FAILED):
                    return None
                gpus, states = await self._observe(fresh, judges)
                answer = decide(p.device, p.claim, states, admin=admin)
                if isinstance(answer, Cut | SwitchFirst) and answer.destroy:
                    refused = await self._destroy_in_the_way(
                        p.device, gpus[answer.gpu_index], answer.destroy[0]
                    )
                    if refused is not None:
                        return refused
                    # and round again: read, decide, then the next destroy (or the create)
            if isinstance(answer, Cut):
                return await self._create(answer, gpus)
            if isinstance(answer, Enumerate):
                return await self._enumerated(gpus[answer.gpu_index], answer.placed)
            return answer
        except devices.error_type as exc:
            self.metrics.nvml_error("answer", devices.error_name(exc))
            return Failed(REASON_GPU_UNAVAILABLE, f"{p.device}: NVML cannot read the GPUs: {exc}")

    async def _observe(
        self, claims: list[dict[str, Any]], judges: _GpuJudges | None = None
    ) -> tuple[dict[int, GpuInfo], list[GpuState]]:
        gpus, _ = await asyncio.to_thread(self.devices.discover)
        holders = ordinary_holders(claims, self.driver, self.node)  # admin access holds nothing
        states = []
        for gpu in gpus:
            instances = await asyncio.to_thread(self.devices.instances, gpu)
            uuids = {i.placed: i.mig_uuid for i in instances if i.whole is not None}
            observed = observe(instances, holders, self.prepared)
            refused = judges.refuse(gpu) if judges is not None and judges.refuse is not None else None
            held = judges.holds(gpu) if judges is not None and judges.holds is not None else ()
            whole = judges is not None and judges.offers_whole is not None and judges.offers_whole(gpu)
            placements = tuple(h for h in held if not h.whole)
            states.append(
                GpuState(
                    gpu.index,
                    gpu.model,
                    gpu.mig_enabled,
                    observed,
                    uuids,
                    refused,
                    placements,
                    gpu.uuid,
                    whole_hold(held),
                    whole,
                )
            )
        return {g.index: g for g in gpus}, states

    async def _enumerated(self, gpu: GpuInfo, placed: PlacedInstance) -> Ready | Failed:
        """Ready with the MIG UUID NVML reports for the whole instance at ``placed``, read up to
        ``uuid_reads`` times (nvml.h: a MIG device may not be enumerated yet, NOT_FOUND); failed if NVML
        never lists it, or the instance is gone."""
        what = device_name(gpu.index, placed.profile, placed.start)
        for attempt in range(self.uuid_reads):
            if attempt:
                await asyncio.sleep(self.uuid_retry_s)
            instances = await asyncio.to_thread(self.devices.instances, gpu)
            inst = next((i for i in instances if i.placed == placed and i.whole is not None), None)
            if inst is None:
                return Failed("InstanceGone", f"{what}: no whole instance there any more")
            if inst.mig_uuid:
                if attempt:
                    log.info("%s: NVML lists its MIG device after %d read(s)", what, attempt + 1)
                return Ready(gpu.index, placed, inst.mig_uuid)
        self.metrics.nvml_error("answer", "MigDeviceNotFound")
        return Failed(
            REASON_NO_MIG_DEVICE,
            f"{what}: the instance exists, but NVML listed no MIG device for it in {self.uuid_reads} reads "
            f"over {(self.uuid_reads - 1) * self.uuid_retry_s:.1f}s (nvmlDeviceGetMigDeviceHandleByIndex: "
            "NOT_FOUND), so there is no MIG UUID to hand out; the instance stays, the scheduler books again",
        )

    async def _destroy_in_the_way(self, what: str, gpu: GpuInfo, p: PlacedInstance) -> Failed | None:
        """Destroy the free instance ``p`` in the way of the booked device ``what``; a failed answer when NVML
        refuses (nothing busy is destroyed: NVML's own in-use check stands behind the decision's)."""
        try:
            await asyncio.to_thread(self.devices.destroy, gpu, p)
        except self.devices.error_type as exc:
            return self._refused(what, exc)
        except ValueError as exc:  # e.g. a GPU instance split by someone else
            return Failed("PlacementTaken", f"{what}: {exc}")
        self.metrics.operation("destroy", "success")
        log.info("destroyed free %s to cut %s", device_name(gpu.index, p.profile, p.start), what)
        return None

    def _refused(self, what: str, exc: Exception) -> Failed:
        err = self.devices.error_name(exc)
        self.metrics.nvml_error("cut", err)
        reason = "InstanceBusy" if self.devices.is_error(exc, "InUse") else "NvmlError"
        if self.devices.is_error(exc, "InsufficientResources"):
            reason = "PlacementTaken"
        return Failed(reason, f"{what}: NVML refused ({err}): {exc}")

    async def _create(self, cut: Cut, gpus: dict[int, GpuInfo]) -> Ready | Failed:
        """Create the booked instance, nothing left in its way (``_answer`` destroyed that, one read of the
        claims before each destroy)."""
        assert not cut.destroy, cut
        gpu = gpus[cut.gpu_index]
        what = device_name(gpu.index, cut.create.profile, cut.create.start)
        try:
            made = await asyncio.to_thread(self.devices.create, gpu, cut.create)
            self.metrics.operation("create", "success")
        except self.devices.error_type as exc:
            return self._refused(what, exc)
        except ValueError as exc:  # e.g. a GPU instance split by someone else
            return Failed("PlacementTaken", f"{what}: {exc}")
        log.info("created %s for an allocation", what)
        if not made.mig_uuid:  # created, but its MIG device is not enumerated yet
            return await self._enumerated(gpu, cut.create)
        return Ready(gpu.index, cut.create, made.mig_uuid)


@dataclass(frozen=True, slots=True)
class _GpuJudges:
    """What the round says of each GPU beyond NVML: whether it is left alone, what it keeps for whom."""

    refuse: Refuse | None = None
    holds: HoldsOf | None = None
    offers_whole: OffersWhole | None = None


def _slices_free(gpu: GpuState, placed: PlacedInstance) -> bool:
    """Whether no instance (whole or not) occupies any memory slice of ``placed`` on ``gpu``. Pure."""
    if gpu.model is None or not gpu.mig_enabled or gpu.refused is not None:
        return False
    need = gpu.model.profile(placed.profile).mask(placed.start)
    return not any(gpu.model.profile(o.placed.profile).mask(o.placed.start) & need for o in gpu.observed)
