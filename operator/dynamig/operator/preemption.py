"""Preemption's search (``spec.preemption.mode: DryRun`` or ``Evict``): for each claim a round found no room
for without evicting anything, which lower-priority pods would have to go so that a re-cut serves it. Pure:
turns what the operator read (GPUs, allocated claims, the pods reserving them, PodDisruptionBudgets) into the
victim search's input (``dynamig.planner.victims``), runs it, and words the answer. operator/preempting.py
posts it and, under ``Evict``, holds the placement and evicts (operator/holds.py says when).

What the search is told, as Kubernetes means it:

- **Who holds an instance.** A claim whose allocation names a device of ``mig.dynamig.io`` holds that
  placement; the pods in its ``status.reservedFor`` use it. An instance busy with no claim naming it (NVML
  processes, an allocation the claim no longer shows), or a claim no pod reserves, has a holder the search
  knows nothing of: never freed. A pod reserving a claim another pod also reserves goes only with it (one
  unit).
- **Who may go.** ``spec.priority`` (0 when unset), ``status.startTime`` (now when the pod has not started,
  as kube-scheduler takes it). Never a victim: a pod that a PodDisruptionBudget allows no disruption
  (``status.disruptionsAllowed`` 0, or a status older than its spec), or that two budgets select (the
  Eviction API refuses such a pod); a pod Kueue manages while ``spareKueueWorkloads`` is set; a member of a
  pod group (gang), since its peers are not evicted with it yet; a pod already being deleted; a pod at a
  system priority (the search's own rule).
- **Who asks.** The pods of the claim: the lowest of their priorities; ``preemptionPolicy: Never`` on any
  of them evicts nothing. Only a claim of one device whose pod waits for no other claim is served: a
  placement is freed on one GPU at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.model import GpuModel, PlacedInstance, device_name
from dynamig.kube.policy import GpuPartitionPolicy, LabelSelector, PreemptionMode
from dynamig.kube.times import parse_time
from dynamig.operator.demand import PendingClaim
from dynamig.operator.inventory import GpuView
from dynamig.operator.verdicts import ClaimVerdict, Reason
from dynamig.planner.model import GpuKey
from dynamig.planner.victims import (
    SYSTEM_PRIORITY,
    Eviction,
    GpuHolding,
    HeldInstance,
    Preemptor,
    Rules,
    RunningPod,
    find_victims,
)

REASON_WOULD_PREEMPT = "WouldPreempt"
REASON_NO_VICTIMS = "NoPreemptionVictims"
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_LABELS = (f"{KUEUE_GROUP}/queue-name", f"{KUEUE_GROUP}/managed")
# Gang membership: the coscheduling plugin's label, and the Workload API's reference (spec.workloadRef).
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
VICTIMS_SHOWN = 8  # pods named in one Event; the rest are counted


@dataclass(frozen=True, slots=True)
class Budget:
    """A PodDisruptionBudget: which pods of its namespace it selects and, when it allows no disruption now,
    why ("" when it allows some)."""

    namespace: str
    name: str
    selector: LabelSelector | None  # None: selects no pod (policy/v1: a null selector matches nothing)
    blocks: str

    def selects(self, namespace: str, labels: Mapping[str, str]) -> bool:
        return self.selector is not None and namespace == self.namespace and self.selector.matches(labels)


def parse_budgets(objs: Iterable[Mapping[str, Any]]) -> tuple[Budget, ...]:
    """PodDisruptionBudgets as the API returns them (policy/v1). A budget whose status the disruption
    controller has not yet computed for its current spec allows nothing, as the Eviction API then refuses
    too. A selector that cannot be parsed selects everything in its namespace (kept safe). Pure."""
    out: list[Budget] = []
    for obj in objs:
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        raw = spec.get("selector")
        selector: LabelSelector | None
        try:
            selector = None if raw is None else LabelSelector.model_validate(raw)
        except ValueError:
            selector = LabelSelector()
        name = str(meta.get("name", ""))
        generation = int(meta.get("generation") or 0)
        observed = status.get("observedGeneration")
        allowed = int(status.get("disruptionsAllowed") or 0)
        if observed is None or int(observed) < generation:
            blocks = f"PodDisruptionBudget {name} has no status for its current spec yet"
        elif allowed <= 0:
            blocks = f"PodDisruptionBudget {name} allows no disruption (disruptionsAllowed 0)"
        else:
            blocks = ""
        out.append(Budget(str(meta.get("namespace", "")), name, selector, blocks))
    return tuple(out)


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def owner_key(pod: Mapping[str, Any]) -> str:
    """The workload a pod belongs to, for the ledger of evictions: its controller (``Kind namespace/name``),
    or the pod itself when it has none. Replacement pods of one controller share it. Pure."""
    meta = pod.get("metadata") or {}
    namespace = str(meta.get("namespace", ""))
    for owner in meta.get("ownerReferences") or []:
        if owner.get("controller"):
            return f"{owner.get('kind', '')} {namespace}/{owner.get('name', '')}"
    return f"Pod {namespace}/{meta.get('name', '')}"


def protection(
    pod: Mapping[str, Any],
    budgets: Sequence[Budget],
    spare_kueue: bool,
    spared: Mapping[str, str] | None = None,
) -> str:
    """Why ``pod`` may never be a victim, or "" when it may (priority and run time aside). ``spared``: owner
    key (:func:`owner_key`) -> why the ledger of evictions spares it. Pure."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    namespace = str(meta.get("namespace", ""))
    if meta.get("deletionTimestamp"):
        return "it is already being deleted"
    if spared and owner_key(pod) in spared:
        return spared[owner_key(pod)]
    if spare_kueue:
        if any(k in labels for k in KUEUE_LABELS):
            return "Kueue manages it (spareKueueWorkloads)"
        for owner in meta.get("ownerReferences") or []:
            if (
                str(owner.get("apiVersion", "")).startswith(f"{KUEUE_GROUP}/")
                and owner.get("kind") == "Workload"
            ):
                return f"Kueue Workload {owner.get('name')} owns it (spareKueueWorkloads)"
    group = labels.get(POD_GROUP_LABEL) or (spec.get("workloadRef") or {}).get("name")
    if group:
        return f"it is a member of pod group {group}, whose members are not evicted together yet"
    selecting = [b for b in budgets if b.selects(namespace, labels)]
    if len(selecting) > 1:
        names = ", ".join(sorted(b.name for b in selecting))
        return f"more than one PodDisruptionBudget selects it ({names}); the Eviction API refuses such a pod"
    if selecting and selecting[0].blocks:
        return selecting[0].blocks
    return ""


def running_pod(
    pod: Mapping[str, Any],
    budgets: Sequence[Budget],
    spare_kueue: bool,
    now: float,
    unit: str = "",
    spared: Mapping[str, str] | None = None,
) -> RunningPod:
    """The victim search's view of a pod that holds instances. Pure."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    started = parse_time(status.get("startTime"))
    return RunningPod(
        name=pod_key(pod),
        priority=int(spec.get("priority") or 0),
        started_at=started if started is not None else now,
        unit=unit,
        protected=protection(pod, budgets, spare_kueue, spared),
    )


def _placements(gpu: GpuView) -> dict[str, PlacedInstance]:
    """Device name -> placement, for every placement of ``gpu``'s model. Pure."""
    assert gpu.model is not None
    return {
        device_name(gpu.index, p.name, s): PlacedInstance(s, p.name)
        for p in gpu.model.profiles
        for s in p.placement_starts
    }


def _overlaps(model: GpuModel, a: PlacedInstance, b: PlacedInstance) -> bool:
    return bool(model.profile(a.profile).mask(a.start) & model.profile(b.profile).mask(b.start))


@dataclass(frozen=True, slots=True)
class Holdings:
    gpus: tuple[GpuHolding, ...]
    holders: frozenset[tuple[str, str]]  # (namespace/name, uid) of every pod reserving an allocated claim
    shared: Mapping[str, str]  # pod key -> its unit, for pods reserving a claim with other pods


def holdings(gpus: Sequence[GpuView], claims: Iterable[Mapping[str, Any]], driver: str) -> Holdings:
    """What each GPU holds and who: its instances and the placements claims have booked on it, each with the
    pods reserving the claims that name it (an unknown holder where none does but it is busy). Pure."""
    by_node: dict[str, list[GpuView]] = {}
    for g in gpus:
        if g.model is not None:
            by_node.setdefault(g.node, []).append(g)
    names = {g.name: _placements(g) for gs in by_node.values() for g in gs}
    users: dict[tuple[str, PlacedInstance], set[str]] = {}  # (GPU, placement) -> holder names
    holders: set[tuple[str, str]] = set()
    unit_of: dict[str, str] = {}
    for claim in claims:
        meta = claim.get("metadata") or {}
        status = claim.get("status") or {}
        namespace = str(meta.get("namespace", ""))
        key = f"{namespace}/{meta.get('name', '')}"
        reserved = status.get("reservedFor") or []
        pods = [f"{namespace}/{r.get('name')}" for r in reserved if r.get("resource") == "pods"]
        who = (
            set(pods) if pods and len(pods) == len(reserved) else {f"claim {key}, reserved by no pod we know"}
        )
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        for result in results:
            if result.get("driver") != driver:
                continue
            for g in by_node.get(str(result.get("pool", "")), ()):
                placed = names[g.name].get(str(result.get("device", "")))
                if placed is not None:
                    users.setdefault((g.name, placed), set()).update(who)
        if results and pods:
            holders.update((f"{namespace}/{r.get('name')}", str(r.get("uid", ""))) for r in reserved)
            if len(pods) > 1:
                for p in pods:
                    unit_of.setdefault(p, f"claim {key}")
    out: list[GpuHolding] = []
    for gs in by_node.values():
        for g in gs:
            assert g.model is not None
            model = g.model
            booked = [b for (name, b) in users if name == g.name]
            # A free instance under a booked placement is destroyed for it: the booking stands in its place.
            kept = [i for i in g.actual if not any(_overlaps(model, i, b) for b in booked)]
            held = []
            for inst in sorted({*booked, *kept}):
                using = users.get((g.name, inst))
                if using:
                    held.append(HeldInstance(inst, tuple(sorted(using))))
                elif inst in g.busy:
                    held.append(HeldInstance(inst, ("a process or allocation outside any claim",)))
                else:
                    held.append(HeldInstance(inst))
            out.append(GpuHolding(GpuKey(g.node, g.index), model.key, tuple(held)))
    return Holdings(tuple(out), frozenset(holders), unit_of)


@dataclass(frozen=True, slots=True)
class Waiting:
    """A claim this round found no room for, as the search's preemptor, or why it cannot be one."""

    verdict: ClaimVerdict
    preemptor: Preemptor | None
    refused: str = ""


def waiting_claims(
    verdicts: Sequence[ClaimVerdict],
    pending_pods: Mapping[str, Mapping[str, Any]],
    policy: GpuPartitionPolicy,
    models: frozenset[str],
) -> tuple[Waiting, ...]:
    """The ``NoCapacity`` claims of a round as preemptors (``pending_pods``: pod uid -> pod). Pure."""
    allowed = frozenset(policy.spec.allowed_profiles) if policy.spec.allowed_profiles is not None else None
    claims_of_pod: dict[str, int] = {}
    for v in verdicts:
        for p in v.claim.pods:
            claims_of_pod[p.uid] = claims_of_pod.get(p.uid, 0) + 1
    out: list[Waiting] = []
    for v in verdicts:
        if v.reason is not Reason.NO_CAPACITY:
            continue
        c: PendingClaim = v.claim
        raw = [pending_pods[p.uid] for p in c.pods if p.uid in pending_pods]
        if not raw:
            continue  # its pods are gone: nobody to make room for
        if len(c.requests) != 1:
            out.append(Waiting(v, None, f"the claim has {len(c.requests)} requests; preemption frees one "
                                        "placement for a claim of one device"))  # fmt: skip
            continue
        r = c.requests[0]
        alts = [
            p
            for p, n in zip(
                r.alternatives(allowed, models), r.alternative_counts(allowed, models), strict=True
            )
            if n == 1
        ]
        if not alts:
            out.append(Waiting(v, None, f"the claim asks for {r.min_count} devices; preemption frees one "
                                        "placement for a claim of one device"))  # fmt: skip
            continue
        if any(claims_of_pod.get(p.uid, 0) > 1 for p in c.pods):
            why = "its pod waits for other claims too, which must land on one node"
            out.append(Waiting(v, None, f"{why}; preemption frees one placement for a pod of one claim"))
            continue
        specs = [p.get("spec") or {} for p in raw]
        pre = Preemptor(
            name=c.claim.key,
            priority=min(int(s.get("priority") or 0) for s in specs),
            alternatives=tuple(alts),
            nodes=c.nodes,
            never=any(s.get("preemptionPolicy") == "Never" for s in specs),
        )
        out.append(Waiting(v, pre))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Told:
    """What one waiting claim's pods are told."""

    claim: PendingClaim
    reason: str  # REASON_WOULD_PREEMPT or REASON_NO_VICTIMS
    message: str
    victims: tuple[str, ...] = ()
    eviction: Eviction | None = None  # with REASON_WOULD_PREEMPT: the GPU, the placement, the victims
    victim_uids: Mapping[str, str] = field(default_factory=dict)  # victim -> its uid when searched
    priority: int = 0  # the waiting pods' (the lowest of them)


@dataclass(frozen=True, slots=True)
class DryRunReport:
    told: tuple[Told, ...] = ()
    victims: int = 0  # pods evicted for every WouldPreempt together
    would_preempt: int = 0
    no_victims: int = 0
    unread: str = ""  # what could not be read (then every pod is kept)
    evicting: bool = False  # Evict: the victims are evicted once the placement is held
    held: int = 0  # Evict: placements held for waiting claims after the round
    evicted_last_hour: int = 0  # Evict: pods the policy evicted in the last hour
    spared: tuple[str, ...] = ()  # Evict: workloads the ledger spares (evicted too often within the hour)

    @property
    def preemptors(self) -> int:
        return self.would_preempt + self.no_victims

    def summary(self) -> str:
        """The policy's Preemption condition message. Pure."""
        if self.evicting:
            text = (
                f"Evict: {self.held} placement(s) held for waiting claims, {self.evicted_last_hour} pod(s) "
                f"evicted in the last hour; {self.no_victims} waiting claim(s) find no victims"
            )
            if self.spared:
                text += f"; spared after repeated evictions within the hour: {_names(self.spared)}"
        else:
            text = (
                f"DryRun: {self.would_preempt} waiting claim(s) would have {self.victims} pod(s) evicted, "
                f"{self.no_victims} find no victims; nothing is evicted"
            )
        return f"{text} ({self.unread})" if self.unread else text


def _kept_text(pods: Iterable[RunningPod], pre: Preemptor, rules: Rules) -> str:
    """Why the pods holding instances are kept, counted by reason (the commonest three). Pure."""
    why: dict[str, int] = {}
    for p in pods:
        if p.protected:
            reason = p.protected
        elif p.priority >= SYSTEM_PRIORITY:
            reason = "at a system priority"
        elif p.priority > pre.priority - rules.gap:
            reason = f"priority not below {pre.priority} by the gap {rules.gap}"
        elif rules.now - p.started_at < rules.min_run_s:
            reason = f"running less than minRunSeconds {rules.min_run_s:.0f}"
        else:
            continue
        why[reason] = why.get(reason, 0) + 1
    top = sorted(why.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    return "kept: " + "; ".join(f"{n} pod(s): {reason}" for reason, n in top) if top else ""


def _names(victims: Sequence[str]) -> str:
    shown = ", ".join(victims[:VICTIMS_SHOWN])
    more = len(victims) - VICTIMS_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


def _outside(
    selector: LabelSelector | None, namespaces: Mapping[str, Mapping[str, str]] | None
) -> Callable[[str], str]:
    """For ``namespace/name``: why its namespace takes no part in preemption, or "". Pure."""

    def why(key: str) -> str:
        namespace = key.partition("/")[0]
        if selector is None:
            return ""
        if namespaces is None:
            return "the namespaces could not be read for spec.preemption.namespaceSelector"
        if selector.matches(namespaces.get(namespace, {})):
            return ""
        return f"namespace {namespace} is not selected by spec.preemption.namespaceSelector"

    return why


def dry_run(
    policy: GpuPartitionPolicy,
    verdicts: Sequence[ClaimVerdict],
    gpus: Sequence[GpuView],
    claims: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    pdbs: Iterable[Mapping[str, Any]] | None,
    catalog: Catalog,
    driver: str,
    now: float,
    unread: str = "",
    kept: Mapping[str, str] | None = None,
    spared: Mapping[str, str] | None = None,
    namespaces: Mapping[str, Mapping[str, str]] | None = None,
) -> DryRunReport:
    """Which pods would be evicted for each claim of the round that found no room (``verdicts``), on the
    usable ``gpus`` of ``policy``. ``claims``: every ResourceClaim; ``pods``: every pod not finished (the
    waiting ones included); ``pdbs``: every PodDisruptionBudget, None when they could not be read (then no
    pod is a victim, and ``unread`` says why). ``kept``: GPU name -> the claim a placement on it is held
    for (no other preemptor is served there, and a claim holding one waits for it); ``spared``: owners the
    ledger of evictions spares (:func:`protection`); ``namespaces``: every namespace's labels, for the
    policy's ``namespaceSelector`` (None: not read, then no namespace is selected). Pure."""
    kept = kept or {}
    holding = frozenset(kept.values())
    usable = [g for g in gpus if not g.unusable and g.model is not None]
    models = {g.model.key: g.model for g in usable if g.model is not None}
    pod_list = list(pods)
    by_uid = {str((p.get("metadata") or {}).get("uid", "")): p for p in pod_list}
    verdicts = [v for v in verdicts if v.claim.claim.key not in holding]
    opted_out = _outside(policy.spec.preemption.namespace_selector, namespaces)
    waiting = tuple(
        Waiting(w.verdict, None, why) if w.preemptor and (why := opted_out(w.preemptor.name)) else w
        for w in waiting_claims(verdicts, by_uid, policy, frozenset(models))
    )
    evicting = policy.spec.preemption.mode is PreemptionMode.EVICT
    if not waiting:
        return DryRunReport(unread=unread, evicting=evicting)
    held = holdings([g for g in usable if g.name not in kept], claims, driver)
    spec = policy.spec.preemption
    budgets = parse_budgets(pdbs or ())
    running: dict[str, RunningPod] = {}
    uid_of: dict[str, str] = {}
    for key, uid in held.holders:
        pod = by_uid.get(uid)
        if pod is None or pod_key(pod) != key:
            continue  # gone or replaced: an unknown holder, never a victim
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            continue  # finished: its claim is released without anyone's help
        rp = running_pod(pod, budgets, spec.spare_kueue_workloads, now, held.shared.get(key, ""), spared)
        uid_of[key] = uid
        if not rp.protected and (why := opted_out(key)):
            rp = replace(rp, protected=why)
        if pdbs is None and not rp.protected:
            rp = RunningPod(
                rp.name, rp.priority, rp.started_at, rp.unit, f"not known to be unprotected ({unread})"
            )
        running[key] = rp
    preemptors = [w.preemptor for w in waiting if w.preemptor is not None]
    rules = Rules(gap=spec.priority_gap, min_run_s=float(spec.min_run_seconds), now=now)
    plan = find_victims(preemptors, held.gpus, running, rules, models)
    chosen = {e.preemptor: e for e in plan.evictions}
    gpu_name = {GpuKey(g.node, g.index): g.name for g in usable}
    told: list[Told] = []
    victims = 0
    for w in waiting:
        pre = w.preemptor
        if pre is None:
            told.append(Told(w.verdict.claim, REASON_NO_VICTIMS, f"no pod is evicted for it: {w.refused}"))
            continue
        e = chosen.get(pre.name)
        if e is None:
            why = plan.refused.get(pre.name, "no victims found")
            kept_why = _kept_text(running.values(), pre, rules)
            why += f"; {kept_why}" if kept_why else ""
            told.append(Told(w.verdict.claim, REASON_NO_VICTIMS, f"no pod would be evicted for it: {why}"))
            continue
        victims += len(e.victims)
        gone = ", ".join(f"{i.profile}@{i.start}" for i in e.in_the_way)
        text = (
            f"{'evicts' if evicting else 'would evict'} {_names(e.victims)} (priority "
            f"{e.highest_priority} < {pre.priority}) on {e.gpu.node}/gpu{e.gpu.index} "
            f"({gpu_name.get(e.gpu, '')}) to cut {e.profile} at slice {e.start} in place of {gone}"
        )
        if not evicting:
            text += f"; policy {policy.name} has preemption DryRun: nothing is evicted"
        uids = {v: uid_of.get(v, "") for v in e.victims}
        told.append(Told(w.verdict.claim, REASON_WOULD_PREEMPT, text, e.victims, e, uids, pre.priority))
    would = sum(1 for t in told if t.reason == REASON_WOULD_PREEMPT)
    return DryRunReport(tuple(told), victims, would, len(told) - would, unread, evicting)


@dataclass
class Memory:
    """What each waiting pod was last told (pod uid -> (reason, message, when)), so an Event is posted when
    it changes or goes stale, not every round."""

    told: dict[str, tuple[str, str, float]] = field(default_factory=dict)

    def due(self, uid: str, reason: str, message: str, now: float, repeat_s: float) -> bool:
        last = self.told.get(uid)
        if last is not None and last[:2] == (reason, message) and now - last[2] < repeat_s:
            return False
        self.told[uid] = (reason, message, now)
        return True

    def keep_only(self, uids: Iterable[str]) -> None:
        """Forget pods no longer told anything (served, gone, or preemption turned off)."""
        live = set(uids)
        for uid in [u for u in self.told if u not in live]:
            del self.told[uid]
