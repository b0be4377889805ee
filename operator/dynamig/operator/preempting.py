"""Preemption's and drains' I/O, one policy round at a time: report (``DryRun``), or hold, evict and release
(``Evict``); drain a GPU for a claim starving behind small ones (``spec.drain``).

What is searched lives in operator/preemption.py and operator/draining.py (pure), what may start and when a
hold ends in operator/holds.py (pure); this module reads what they need, writes the holds into GpuPartition
specs, calls the Eviction API and tells every step: Events on the waiting pods (``WouldPreempt`` under
DryRun, ``Preempting`` under Evict, ``NoPreemptionVictims``, ``Draining``), on the victims and their claims
(``Preempted``) and on the waiting claim (``PreemptionHoldReleased``, ``PreemptionAborted``), and metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from dynamig import DRIVER_NAME
from dynamig.geometry.catalog import Catalog
from dynamig.kube.apicalls import is_transient, status_of
from dynamig.kube.events import claim_ref
from dynamig.kube.gpupartition import Hold, HoldKind
from dynamig.kube.policy import GpuPartitionPolicy, PreemptionMode
from dynamig.kube.times import parse_time
from dynamig.operator.decide import RoundDecision
from dynamig.operator.demand import pod_claim_names
from dynamig.operator.draining import REASON_DRAINING, draining_count, plan_drains
from dynamig.operator.holds import (
    LEDGER_WINDOW_S,
    Ledger,
    age,
    enforced,
    holds_of,
    new_hold,
    refusal,
    released,
    victim_ref,
)
from dynamig.operator.inventory import GpuView
from dynamig.operator.kubeio import KubeIO, Snapshot
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.preemption import (
    REASON_NO_VICTIMS,
    REASON_WOULD_PREEMPT,
    DryRunReport,
    Memory,
    Told,
    dry_run,
    owner_key,
    pod_key,
)
from dynamig.operator.verdicts import Reason
from dynamig.planner.model import GpuKey

log = logging.getLogger(__name__)

REASON_PREEMPTING = "Preempting"  # on the waiting pod: its placement is held, the victims are evicted
REASON_PREEMPTED = "Preempted"  # on a victim
REASON_HOLD_RELEASED = "PreemptionHoldReleased"  # on the waiting claim
REASON_ABORTED = "PreemptionAborted"  # on the waiting claim: the Eviction API refused a victim


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _pod_ref(pod: Mapping[str, Any]) -> dict[str, Any]:
    meta = pod.get("metadata") or {}
    return {"apiVersion": "v1", "kind": "Pod", "name": meta.get("name"), "namespace": meta.get("namespace"),
            "uid": meta.get("uid")}  # fmt: skip


def _hold_api(hold: Hold) -> dict[str, Any]:
    return hold.model_dump(mode="json", by_alias=True, exclude_none=True)


@dataclass
class _Round:
    """What one round of one policy read: its GpuPartitions, the claims and the pods by key."""

    policy: GpuPartitionPolicy
    parts: dict[str, dict[str, Any]]  # governed GpuPartition name -> object
    claims: dict[str, dict[str, Any]]
    pods: dict[str, dict[str, Any]]
    wall: float
    kept: dict[str, str] = field(default_factory=dict)  # GPU -> the claim a placement on it is held for
    oldest: float = 0.0  # age of the oldest hold kept, seconds


class Preempter:
    """Preemption for every policy of one operator. ``event_repeat_s``: an unchanged message is told again
    on a waiting pod after this long."""

    def __init__(
        self, kube: KubeIO, catalog: Catalog, metrics: OperatorMetrics, event_repeat_s: float
    ) -> None:
        self.kube, self.catalog, self.metrics = kube, catalog, metrics
        self.event_repeat_s = event_repeat_s
        self.memory: dict[str, Memory] = {}  # policy -> what its waiting pods were told
        self.ledger = Ledger()

    async def round(
        self,
        policy: GpuPartitionPolicy,
        mine: tuple[GpuView, ...],
        snap: Snapshot,
        decision: RoundDecision,
        now: float,
        wall: float,
        stored: Sequence[Any] = (),
    ) -> DryRunReport | None:
        """Preemption's part of a policy round; the report for the policy's Preemption condition, None when
        preemption is Off. ``stored``: the policy's ``status.recentEvictions``, read back into the ledger the
        first time this process sees the policy."""
        if read := self.ledger.restore(policy.name, stored):
            log.info("policy %s: %d hold(s) that evicted read back from status.recentEvictions", policy.name,
                     read)  # fmt: skip
        keep_s = max(LEDGER_WINDOW_S, float(policy.spec.preemption.gpu_cooldown_seconds))
        self.ledger.prune(policy.name, wall, keep_s)
        memory = self.memory.setdefault(policy.name, Memory())
        mode = policy.spec.preemption.mode
        evicting = mode is PreemptionMode.EVICT
        waiting = any(v.reason is Reason.NO_CAPACITY for v in decision.verdicts)
        names = {g.name for g in mine}
        parts = {str(p["metadata"]["name"]): p for p in snap.partitions if p["metadata"]["name"] in names}
        held = any(holds_of(p) for p in parts.values())
        draining = policy.spec.drain.after_seconds is not None
        if mode is PreemptionMode.OFF and not held and not draining:
            memory.keep_only(())
            self.metrics.forget_preemption(policy.name)
            return None
        unread = ""
        running: tuple[dict[str, Any], ...] = ()
        pdbs: tuple[dict[str, Any], ...] | None = None
        if waiting or held:
            try:
                running = await self.kube.list_running_pods()
                pdbs = await self.kube.list_disruption_budgets()
            except ApiException as exc:
                unread = f"cannot list pods or PodDisruptionBudgets: {exc.status} {exc.reason}"
                log.warning("policy %s: preemption: %s; no pod is taken for a victim", policy.name, unread)
        namespaces: dict[str, dict[str, str]] | None = None
        if waiting and policy.spec.preemption.namespace_selector is not None:
            try:
                namespaces = await self.kube.list_namespace_labels()
            except ApiException as exc:
                unread = f"cannot list namespaces: {exc.status} {exc.reason}"
                log.warning("policy %s: preemption: %s; no namespace takes part", policy.name, unread)
        pods = (*snap.pods, *running)
        rnd = _Round(policy, parts, {_key(c): c for c in snap.claims}, {pod_key(p): p for p in pods}, wall)
        await self._keep_holds(rnd, evicting, draining)
        report = await self._preempt(rnd, memory, mine, snap, decision, pods, pdbs, namespaces, unread, now)
        if draining and waiting:
            await self._drain(rnd, mine, snap, decision, pods)
        self.metrics.set_holds(policy.name, len(rnd.kept), rnd.oldest)
        return report

    async def _preempt(
        self,
        rnd: _Round,
        memory: Memory,
        mine: tuple[GpuView, ...],
        snap: Snapshot,
        decision: RoundDecision,
        pods: tuple[dict[str, Any], ...],
        pdbs: tuple[dict[str, Any], ...] | None,
        namespaces: dict[str, dict[str, str]] | None,
        unread: str,
        now: float,
    ) -> DryRunReport | None:
        """The victim search (DryRun, Evict): told, and under Evict held; None when preemption is Off."""
        policy, wall = rnd.policy, rnd.wall
        mode = policy.spec.preemption.mode
        evicting = mode is PreemptionMode.EVICT
        waiting = any(v.reason is Reason.NO_CAPACITY for v in decision.verdicts)
        if mode is PreemptionMode.OFF:
            memory.keep_only(())
            self.metrics.forget_preemption(policy.name, holds_too=False)
            return None
        report = DryRunReport(evicting=evicting)
        if waiting:
            spec = policy.spec.preemption
            spared = self.ledger.spared(policy.name, wall, spec.spare_after_evictions) if evicting else {}
            report = dry_run(
                policy, decision.verdicts, mine, snap.claims, pods, pdbs, self.catalog, DRIVER_NAME, wall,
                unread, rnd.kept, spared, namespaces,
            )  # fmt: skip
            if evicting:
                report = await self._hold(rnd, report, {GpuKey(g.node, g.index): g.name for g in mine})
        if evicting:
            spec = policy.spec.preemption
            spared_now = self.ledger.spared(policy.name, wall, spec.spare_after_evictions)
            report = replace(
                report,
                held=len(rnd.kept),
                evicted_last_hour=self.ledger.count(policy.name, wall),
                spared=tuple(sorted(spared_now)),
            )
            self.metrics.set_spared(policy.name, len(spared_now))
        else:
            self.metrics.set_preemption_dry_run(
                policy.name, report.victims, report.would_preempt, report.no_victims
            )
        await self._tell(memory, report, now)
        return report

    async def _drain(
        self,
        rnd: _Round,
        mine: tuple[GpuView, ...],
        snap: Snapshot,
        decision: RoundDecision,
        pods: tuple[dict[str, Any], ...],
    ) -> None:
        """Drain a GPU for each claim starving past ``drain.afterSeconds``, within ``drain.maxGpus``."""
        spec = rnd.policy.spec.drain
        room = spec.max_gpus - sum(draining_count(holds_of(p)) for p in rnd.parts.values())
        drains = plan_drains(
            rnd.policy, decision.verdicts, mine, snap.claims, pods, DRIVER_NAME, rnd.wall, rnd.kept, room
        )
        for d in drains:
            part = rnd.parts.get(d.gpu_name)
            claim = rnd.claims.get(d.claim.claim.key)
            if part is None or claim is None:
                continue
            hold = d.hold(str((claim.get("metadata") or {}).get("uid", "")), rnd.wall, spec.hold_seconds)
            if not await self._write_holds(d.gpu_name, part, [*holds_of(part), hold]):
                continue
            rnd.kept[d.gpu_name] = hold.claim
            self.metrics.drains.labels(policy=rnd.policy.name).inc()
            text = d.message(hold.expires_at)
            log.info("policy %s: draining %s for %s: %s", rnd.policy.name, d.gpu_name, hold.claim, text)
            for pod in d.claim.pods:
                ref = {"apiVersion": "v1", "kind": "Pod", "name": pod.name, "namespace": pod.namespace,
                       "uid": pod.uid}  # fmt: skip
                await self.kube.post_event(ref, "Normal", REASON_DRAINING, text, pod.namespace)

    # --- holds ---------------------------------------------------------------------------------------

    async def _keep_holds(self, rnd: _Round, evicting: bool, draining: bool) -> None:
        """Release the holds that end (the claim served or gone, expired, or the policy no longer evicts or
        drains), and evict the victims of those the agent enforces. Fills ``rnd.kept`` and ``rnd.oldest``."""
        for gpu, part in rnd.parts.items():
            holds = holds_of(part)
            if not holds:
                continue
            keep: list[Hold] = []
            ends: list[tuple[Hold, str, str]] = []
            for h in holds:
                kind, why = released(h, rnd.claims, rnd.wall)
                if h.kind is HoldKind.DRAIN and not draining:
                    kind, why = "off", f"policy {rnd.policy.name} no longer drains (drain.afterSeconds unset)"
                elif h.kind is HoldKind.WHOLE and not rnd.policy.spec.mig_mode.dynamic:
                    kind, why = "off", f"policy {rnd.policy.name} no longer switches MIG mode (migMode Fixed)"
                elif h.kind is HoldKind.EVICT and not evicting:
                    mode = rnd.policy.spec.preemption.mode
                    kind, why = "off", f"policy {rnd.policy.name} no longer evicts (preemption {mode})"
                (ends.append((h, kind, why)) if kind else keep.append(h))
            if ends and not await self._write_holds(gpu, part, keep):
                continue
            for h, kind, why in ends:
                await self._released(rnd, gpu, h, kind, why)
            for h in keep:
                self._remember(rnd, gpu, h)
                if enforced(part, h) and not await self._evict(rnd, gpu, part, h, keep):
                    continue  # refused: released
                rnd.kept[gpu] = h.claim
                rnd.oldest = max(rnd.oldest, age(h, rnd.wall))

    def _remember(self, rnd: _Round, gpu: str, hold: Hold) -> None:
        """Count a hold that evicts in the ledger, if it is not there yet (made by a process that stopped
        before it stored the ledger)."""
        at = parse_time(hold.created_at)
        if hold.kind is HoldKind.EVICT and at is not None:
            self.ledger.record(rnd.policy.name, at, gpu, [self._owner(rnd, v) for v in hold.victims])

    @staticmethod
    def _owner(rnd: _Round, victim: str) -> str:
        """The owner key of a victim (``namespace/name`` or ``namespace/name@uid``); the pod itself once it
        is gone."""
        key = victim.partition("@")[0]
        return owner_key(rnd.pods[key]) if key in rnd.pods else f"Pod {key}"

    def recent_evictions(self, policy: str) -> list[dict[str, Any]]:
        """The policy's ``status.recentEvictions``: the ledger as this process keeps it."""
        return self.ledger.stored(policy)

    async def _write_holds(self, gpu: str, part: dict[str, Any], holds: list[Hold]) -> bool:
        """Replace ``spec.holds`` of ``gpu``; False when the object changed since it was read (the next round
        reads it again)."""
        rv = str((part.get("metadata") or {}).get("resourceVersion", ""))
        body = [_hold_api(h) for h in holds]
        try:
            stored = await self.kube.write_holds(gpu, body, rv)
        except ApiException as exc:
            if exc.status != 409:
                if exc.status == 404:
                    log.info("GpuPartition %s is gone; its holds are not written", gpu)
                    return False
                raise
            # The agent writes the object's status as it goes, which moves its resourceVersion too: when
            # spec.holds is still what this round read, the edit still applies, on the fresh version.
            fresh = await self.kube.read_partition(gpu)
            if ((fresh.get("spec") or {}).get("holds") or []) != (
                (part.get("spec") or {}).get("holds") or []
            ):
                log.info("GpuPartition %s: its holds changed since they were read; next round", gpu)
                return False
            rv = str((fresh.get("metadata") or {}).get("resourceVersion", ""))
            try:
                stored = await self.kube.write_holds(gpu, body, rv)
            except ApiException as again:
                if again.status in (404, 409):
                    log.info("GpuPartition %s changed while its holds were written; next round", gpu)
                    return False
                raise
        part["metadata"]["resourceVersion"] = (stored.get("metadata") or {}).get("resourceVersion", rv)
        part.setdefault("spec", {})["holds"] = [_hold_api(h) for h in holds]
        return True

    async def _released(self, rnd: _Round, gpu: str, hold: Hold, kind: str, why: str) -> None:
        self.metrics.holds_released.labels(policy=rnd.policy.name, why=kind).inc()
        text = f"the placement {hold.profile}@{hold.start} on {gpu} is no longer held for it: {why}"
        log.info("policy %s: hold of %s released: %s", rnd.policy.name, hold.describe(), why)
        await self._tell_claim(hold, "Normal", REASON_HOLD_RELEASED, text)

    async def _tell_claim(self, hold: Hold, kind: str, reason: str, text: str) -> None:
        namespace, _, name = hold.claim.partition("/")
        ref = claim_ref(namespace, name, hold.claim_uid or None)
        await self.kube.post_event(ref, kind, reason, text, namespace)

    async def _evict(
        self, rnd: _Round, gpu: str, part: dict[str, Any], hold: Hold, holds: list[Hold]
    ) -> bool:
        """Evict the victims of ``hold`` still there (same uid, not being deleted); False when the Eviction
        API refused one (a PodDisruptionBudget): the hold is then released and the search runs again."""
        policy = rnd.policy.name
        for victim in hold.victims:
            namespace, pod_name, uid = victim_ref(victim)
            pod = rnd.pods.get(f"{namespace}/{pod_name}")
            meta = (pod or {}).get("metadata") or {}
            if pod is None or (uid and meta.get("uid") != uid) or meta.get("deletionTimestamp"):
                continue  # gone, replaced, or on its way out
            try:
                result = await self.kube.evict_pod(namespace, pod_name, uid)
            except Exception as exc:
                if not (isinstance(exc, ApiException) or is_transient(exc)):
                    raise
                self.metrics.evicted(policy, "error")
                log.warning("policy %s: evicting %s failed (%s); next round", policy, victim,
                            status_of(exc) or repr(exc))  # fmt: skip
                continue
            self.metrics.evicted(policy, result.outcome)
            if result.outcome == "refused":
                holds.remove(hold)
                if await self._write_holds(gpu, part, holds):
                    self.metrics.holds_released.labels(policy=policy, why="refused").inc()
                text = (
                    f"the Eviction API refused evicting {namespace}/{pod_name}: {result.message}; the "
                    f"placement {hold.profile}@{hold.start} on {gpu} is no longer held, victims are searched "
                    "again"
                )
                log.warning("policy %s: %s", policy, text)
                await self._tell_claim(hold, "Warning", REASON_ABORTED, text)
                return False
            if result.outcome == "evicted":
                prio = int((pod.get("spec") or {}).get("priority") or 0)
                text = (
                    f"evicted by dynamig to make room for claim {hold.claim}, priority {hold.priority} > "
                    f"{prio}, on {gpu}: {hold.profile} at slice {hold.start} (policy {policy})"
                )
                log.info("policy %s: evicted %s: %s", policy, victim, text)
                await self._tell_victim(rnd, pod, text)
        return True

    async def _tell_victim(self, rnd: _Round, pod: dict[str, Any], text: str) -> None:
        """``Preempted`` on the evicted pod and on each claim of its (the device is freed with the pod: said
        where a claim's owner reads it)."""
        namespace = str((pod.get("metadata") or {}).get("namespace", ""))
        await self.kube.post_event(_pod_ref(pod), "Warning", REASON_PREEMPTED, text, namespace)
        for name in pod_claim_names(pod):
            claim = rnd.claims.get(f"{namespace}/{name}")
            if claim is not None:
                ref = claim_ref(namespace, name, (claim.get("metadata") or {}).get("uid"))
                await self.kube.post_event(ref, "Warning", REASON_PREEMPTED, text, namespace)

    async def _hold(self, rnd: _Round, report: DryRunReport, gpu_names: Mapping[GpuKey, str]) -> DryRunReport:
        """Hold the placement of each claim the search serves, when the cooldown and the rate allow; the
        victims are evicted once the agent shows the hold (a later round)."""
        spec = rnd.policy.spec.preemption
        told: list[Told] = []
        for t in report.told:
            e = t.eviction
            if e is None:
                told.append(t)
                continue
            gpu = gpu_names.get(e.gpu, "")
            claim = rnd.claims.get(t.claim.claim.key)
            why = refusal(
                gpu, e.victims, rnd.policy.name, self.ledger, rnd.wall, spec.max_evictions_per_hour,
                spec.gpu_cooldown_seconds, spec.max_evictions_per_hour_per_namespace,
            )  # fmt: skip
            if claim is None or t.claim.claim.is_pod:
                why = why or "its pod asks for extended resources: preemption serves ResourceClaims"
            part = rnd.parts.get(gpu)
            if why or claim is None or part is None or gpu in rnd.kept:
                why = why or f"a placement on {gpu} is held already"
                text = f"no pod is evicted for it now: {why}"
                told.append(replace(t, reason=REASON_NO_VICTIMS, message=text, eviction=None))
                continue
            victims = [f"{v}@{t.victim_uids.get(v, '')}" for v in e.victims]
            hold = new_hold(claim, e.profile, e.start, t.priority, victims, rnd.wall, spec.hold_seconds)
            if not await self._write_holds(gpu, part, [*holds_of(part), hold]):
                continue
            rnd.kept[gpu] = hold.claim
            owners = [self._owner(rnd, v) for v in e.victims]
            self.ledger.record(rnd.policy.name, parse_time(hold.created_at) or rnd.wall, gpu, owners)
            log.info("policy %s: holding %s on %s; evicting %s once the agent keeps it",
                     rnd.policy.name, hold.describe(), gpu, ", ".join(e.victims))  # fmt: skip
            text = f"{t.message}; the placement is kept for it until {hold.expires_at}"
            told.append(replace(t, reason=REASON_PREEMPTING, message=text))
        return replace(report, told=tuple(told))

    # --- telling -------------------------------------------------------------------------------------

    async def _tell(self, memory: Memory, report: DryRunReport, now: float) -> None:
        """An Event on each waiting pod whose answer changed (or went stale)."""
        told: list[str] = []
        for t in report.told:
            for pod in t.claim.pods:
                told.append(pod.uid)
                if not memory.due(pod.uid, t.reason, t.message, now, self.event_repeat_s):
                    continue
                what = "extended resources" if t.claim.claim.is_pod else f"claim {t.claim.claim.name}"
                ref = {"apiVersion": "v1", "kind": "Pod", "name": pod.name, "namespace": pod.namespace,
                       "uid": pod.uid}  # fmt: skip
                await self.kube.post_event(ref, "Normal", t.reason, f"{what}: {t.message}", pod.namespace)
        memory.keep_only(told)

    def forget(self, policy: str) -> None:
        self.memory.pop(policy, None)
        self.metrics.forget_preemption(policy)


__all__ = ["REASON_WOULD_PREEMPT", "Preempter"]
