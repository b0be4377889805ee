"""Kueue's AdmissionCheck ``dynamig.io/mig-capacity``: whether the MIG slices a workload asks for fit the
GPUs dynamig manages, before Kueue admits it. Pure.

Kueue admits a workload by quota arithmetic: a ClusterQueue with a quota of three ``nvidia.com/mig-3g.40gb``
admits three such pods even where the GPUs hold two, and the third waits unschedulable with its quota taken
(the "admission and scheduling gap" Kueue documents). An AdmissionCheck whose ``spec.controllerName`` is
:data:`CONTROLLER`, listed in a ClusterQueue's ``admissionChecksStrategy``, closes it: for each workload with
its quota reserved and the check ``Pending`` the operator answers

- ``Ready`` once every MIG slice its pod sets ask (``nvidia.com/mig-<profile>`` requests or limits, times the
  pod set's count) fits the GPUs as they are: beside the instances allocated or in use and the placements
  held there, the free ones re-cut as dynamig would on GPUs a ``Dynamic`` policy governs, and only a free
  instance of the profile asked on any other GPU (``Static``, ``DryRun``, no policy: nothing is cut there);
  the slices of the pods not bound yet of the workloads answered ``Ready`` (not allocated yet) are counted
  as placed first, for at most :data:`READY_RESERVE_S` seconds (a pod that never comes does not hold the
  room for ever); a bound pod's own allocation counts instead (a pod's pod set: as Kueue labels it);
- ``Retry`` (Kueue releases the quota and queues the workload again) when they have not fitted for the
  check's bound (the AdmissionCheck's annotation :data:`RETRY_ANNOTATION`, default
  :data:`DEFAULT_RETRY_S` seconds) since it went ``Pending``;
- ``Rejected`` when a profile it asks is one no GPU dynamig manages has: no wait can make it fit;
- otherwise it stays ``Pending``, its message saying what is short.

It is a check of room, not a reservation: a pod outside Kueue may still take the room between the answer and
the workload's pods (dynamig then serves them as any pending claim).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from dynamig.geometry.layout import free_starts
from dynamig.geometry.model import GpuModel, PlacedInstance
from dynamig.kube.policy import GpuPartitionPolicy, Mode, resolve_ownership
from dynamig.kube.times import parse_time
from dynamig.operator.demand import fits_node, quantity, required_terms, spec_requests
from dynamig.operator.inventory import GpuView

CONTROLLER = "dynamig.io/mig-capacity"
RETRY_ANNOTATION = "dynamig.io/retry-after-seconds"
DEFAULT_RETRY_S = 60.0
READY_RESERVE_S = 300.0
RESOURCE_PREFIX = "nvidia.com/mig-"
POD_SET_LABEL = "kueue.x-k8s.io/podset"  # on a Job's pods: the admitted workload's pod set
ROLE_HASH_ANNOTATION = "kueue.x-k8s.io/role-hash"  # on a pod group's pods: its pod set's name


class State(StrEnum):
    PENDING = "Pending"
    READY = "Ready"
    RETRY = "Retry"
    REJECTED = "Rejected"


@dataclass(frozen=True, slots=True)
class PodSetAsk:
    """What one pod set asks: MIG slices by profile (times its count), on nodes with these labels and
    matching its required node affinity (any of ``node_terms``)."""

    name: str
    node_selector: Mapping[str, str]
    demand: Mapping[str, int]
    node_terms: tuple[Mapping[str, Any], ...] = ()
    count: int = 1  # its pods

    def unbound(self, bound: int) -> PodSetAsk | None:
        """What its pods not bound yet ask (``bound`` of its pods are: their allocations count instead), or
        None when all are. Pure."""
        left = self.count - bound
        if left <= 0:  # a pod set of no pods (count 0) has nothing left either
            return None
        demand = {p: n // self.count * left for p, n in self.demand.items()}
        return replace(self, demand=demand, count=left)


@dataclass(frozen=True, slots=True)
class CheckedWorkload:
    """A workload whose check of ours is listed in its status: where, since when, and what it asks."""

    namespace: str
    name: str
    uid: str
    check: str  # the AdmissionCheck's name
    index: int  # its position in status.admissionChecks (the JSON patch's path)
    state: State
    since: float | None  # the check's lastTransitionTime (epoch seconds)
    message: str
    quota_reserved: bool
    asks: tuple[PodSetAsk, ...]
    owner_uid: str = ""  # its controller owner's uid (a Job's, or the Pod's for a plain pod)
    pods: int = 0  # the pods its pod sets count

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def demand(self) -> dict[str, int]:
        """Profile -> slices, over every pod set."""
        out: dict[str, int] = {}
        for a in self.asks:
            for p, n in a.demand.items():
                out[p] = out.get(p, 0) + n
        return dict(sorted(out.items()))


def pod_set_asks(pod_sets: Iterable[Mapping[str, Any]]) -> tuple[PodSetAsk, ...]:
    """What each of ``pod_sets`` (a Workload's ``spec.podSets``) asks: each container's
    ``nvidia.com/mig-<profile>`` request (else limit), summed over the pod's containers (init containers run
    before them: the largest counts if larger), times the pod set's count; on the nodes its template's
    ``nodeSelector`` (Kueue adds the flavor's node labels there at admission) and required node affinity
    admit. Pure."""
    out: list[PodSetAsk] = []
    for ps in pod_sets:
        count = quantity(ps.get("count", 1))
        spec = ((ps.get("template") or {}).get("spec")) or {}
        per_pod = spec_requests(spec, lambda name: name.startswith(RESOURCE_PREFIX))
        demand = {
            name.removeprefix(RESOURCE_PREFIX): n * count for name, n in sorted(per_pod.items()) if count > 0
        }
        selector = {str(k): str(v) for k, v in (spec.get("nodeSelector") or {}).items()}
        out.append(PodSetAsk(str(ps.get("name", "")), selector, demand, required_terms(spec), count))
    return tuple(out)


def checked_workloads(workloads: Iterable[Mapping[str, Any]], checks: Iterable[str]) -> list[CheckedWorkload]:
    """The workloads that list one of ``checks`` (the names of our AdmissionChecks) in their status, oldest
    first. Pure."""
    ours = set(checks)
    out: list[CheckedWorkload] = []
    for w in workloads:
        meta, status = w.get("metadata") or {}, w.get("status") or {}
        reserved = any(
            c.get("type") == "QuotaReserved" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        pod_sets = (w.get("spec") or {}).get("podSets") or []
        refs = meta.get("ownerReferences") or []
        owner = str(next((r.get("uid", "") for r in refs if r.get("controller")), ""))
        for i, entry in enumerate(status.get("admissionChecks") or []):
            if entry.get("name") not in ours:
                continue
            try:
                state = State(entry.get("state", "Pending"))
            except ValueError:
                continue
            out.append(
                CheckedWorkload(
                    namespace=str(meta.get("namespace", "")),
                    name=str(meta.get("name", "")),
                    uid=str(meta.get("uid", "")),
                    check=str(entry["name"]),
                    index=i,
                    state=state,
                    since=parse_time(entry.get("lastTransitionTime")),
                    message=str(entry.get("message") or ""),
                    quota_reserved=reserved,
                    asks=pod_set_asks(pod_sets),
                    owner_uid=owner,
                    pods=sum(quantity(ps.get("count", 1)) for ps in pod_sets),
                )
            )
    return sorted(out, key=lambda c: (c.since or 0.0, c.key))


_Gpu = tuple[str, GpuModel, list[PlacedInstance]]  # name, model, the placements taken on it


@dataclass
class Room:
    """The GPUs' occupied placements, and what placing demand on them takes (mutable, one pass)."""

    gpus: list[_Gpu] = field(default_factory=list)
    labels: dict[str, Mapping[str, str]] = field(default_factory=dict)  # GPU -> its node's labels
    nodes: dict[str, str] = field(default_factory=dict)  # GPU -> its node
    # GPUs no Dynamic policy re-cuts (Static, DryRun, none): only their free instances serve, as they are
    fixed: dict[str, list[PlacedInstance]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        views: Sequence[GpuView],
        node_labels: Mapping[str, Mapping[str, str]] | None = None,
        *,
        recut: Container[str],
    ) -> Room:
        """The GPUs dynamig plans on (MIG mode on, usable), each with its allocated or busy instances and
        its held placements, and its node's labels. The rest of a GPU in ``recut`` (one a Dynamic policy
        governs) can be re-cut; on any other GPU only its free instances outside the holds serve."""
        room = cls()
        for g in views:
            if g.model is None or g.unusable or g.whole_hold:
                continue
            room.gpus.append((g.name, g.model, [*g.busy, *g.holds]))
            room.labels[g.name] = (node_labels or {}).get(g.node, {})
            room.nodes[g.name] = g.node
            if g.name not in recut:
                held = 0
                for h in g.holds:
                    held |= g.model.profile(h.profile).mask(h.start)
                room.fixed[g.name] = [
                    i
                    for i in g.actual
                    if i not in g.busy and not g.model.profile(i.profile).mask(i.start) & held
                ]
        return room

    def profiles(self) -> frozenset[str]:
        return frozenset(p.name for _, model, _ in self.gpus for p in model.profiles)

    def _copy(self) -> tuple[list[_Gpu], dict[str, list[PlacedInstance]]]:
        """The GPUs' layouts and the fixed GPUs' free instances, copied for a trial."""
        gpus = [(n, m, list(layout)) for n, m, layout in self.gpus]
        return gpus, {k: list(v) for k, v in self.fixed.items()}

    def place_all(self, asks: Sequence[PodSetAsk]) -> list[str] | None:
        """Place every pod set's demand on the GPUs of its nodes, or nothing (None) when one does not fit."""
        before = self._copy()
        used: list[str] = []
        for a in asks:
            got = self.place(a.demand, a.node_selector, a.node_terms)
            if got is None:
                self.gpus, self.fixed = before
                return None
            used += got
        return used

    def place(
        self,
        demand: Mapping[str, int],
        node_selector: Mapping[str, str] | None = None,
        node_terms: Sequence[Mapping[str, Any]] = (),
    ) -> list[str] | None:
        """Place ``demand`` (largest profiles first, each on the GPU with the least room that takes it: at
        its first free start, or on a GPU no policy re-cuts in a free instance of that profile) on GPUs whose
        node has every label of ``node_selector`` and matches a term of ``node_terms`` (a required node
        affinity, if any); the GPUs used, or None (and nothing placed) when some slice does not fit."""
        trial, spare = self._copy()
        used: list[str] = []
        order = sorted(demand.items(), key=lambda kv: (-_slices(self, kv[0]), kv[0]))
        for profile, n in order:
            for _ in range(n):
                best: tuple[int, int] | None = None  # (free memory slices, index)
                for i, (name, model, layout) in enumerate(trial):
                    if not model.has_profile(profile):
                        continue
                    if not fits_node(
                        node_selector or {}, node_terms, self.nodes.get(name, ""), self.labels.get(name, {})
                    ):
                        continue
                    if name in spare:
                        if not any(f.profile == profile for f in spare[name]):
                            continue
                    elif not free_starts(model, layout, profile):
                        continue
                    free = model.memory_slices - sum(model.profile(p.profile).placement_size for p in layout)
                    if best is None or free < best[0]:
                        best = (free, i)
                if best is None:
                    return None
                name, model, layout = trial[best[1]]
                if name in spare:
                    taken = next(f for f in spare[name] if f.profile == profile)
                    spare[name].remove(taken)
                    layout.append(taken)
                else:
                    layout.append(PlacedInstance(free_starts(model, layout, profile)[0], profile))
                used.append(name)
        self.gpus, self.fixed = trial, spare
        return used


def recuttable(
    policies: Sequence[GpuPartitionPolicy], views: Sequence[GpuView], labels: Mapping[str, Mapping[str, str]]
) -> frozenset[str]:
    """The GPUs of ``views`` a ``Dynamic`` policy governs: those dynamig re-cuts for waiting pods. Pure."""
    ownership = resolve_ownership(policies, [g.identity(labels.get(g.node, {})) for g in views])
    dynamic = {p.name for p in policies if p.spec.mode is Mode.DYNAMIC}
    return frozenset(gpu for gpu, owner in ownership.owner.items() if owner in dynamic)


def _slices(room: Room, profile: str) -> int:
    for _, model, _ in room.gpus:
        if model.has_profile(profile):
            return model.profile(profile).placement_size
    return 0


@dataclass(frozen=True, slots=True)
class Answer:
    state: State
    message: str


def _asks(demand: Mapping[str, int]) -> str:
    return ", ".join(f"{n} x {p}" for p, n in demand.items()) or "no MIG slice"


def answer(w: CheckedWorkload, room: Room, now: float, retry_after_s: float) -> Answer:
    """What to set the check of ``w`` (quota reserved, check Pending) to; places its demand in ``room`` when
    Ready. Pure but for ``room``."""
    asks = _asks(w.demand)
    unknown = sorted(set(w.demand) - room.profiles())
    if unknown:
        names = ", ".join(f"{RESOURCE_PREFIX}{p}" for p in unknown)
        return Answer(State.REJECTED, f"{CONTROLLER}: asks {names}: no GPU dynamig manages has that profile")
    used = room.place_all(w.asks)
    if used is not None:
        where = ", ".join(sorted(set(used))) or "no GPU needed"
        return Answer(State.READY, f"{CONTROLLER}: room for {asks} ({where})")
    waited = now - w.since if w.since is not None else 0.0
    if waited >= retry_after_s:
        return Answer(
            State.RETRY,
            f"{CONTROLLER}: no room for {asks} on the GPUs dynamig manages for {waited:.0f}s (bound "
            f"{retry_after_s:.0f}s): quota released, to be tried again",
        )
    return Answer(
        State.PENDING,
        f"{CONTROLLER}: no room for {asks} on the GPUs dynamig manages yet (Retry after "
        f"{retry_after_s:.0f}s)",
    )


def bound_pods(
    checked: Sequence[CheckedWorkload], pods: Iterable[Mapping[str, Any]]
) -> dict[str, dict[str, int]]:
    """Workload key -> pod set -> how many of its pods are bound to a node and not finished: the pods in its
    namespace that its controller owner also owns (a Job's), or that owner itself (a plain Pod's workload),
    each in the pod set Kueue names on it (label :data:`POD_SET_LABEL` on a Job's pods, annotation
    :data:`ROLE_HASH_ANNOTATION` on a pod group's; "" when neither is there). Pure."""
    by_owner = {(c.namespace, c.owner_uid): c.key for c in checked if c.owner_uid}
    out: dict[str, dict[str, int]] = {}
    for pod in pods:
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        if not spec.get("nodeName") or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        ns = str(meta.get("namespace", ""))
        uids = {str(meta.get("uid", ""))} | {str(r.get("uid", "")) for r in meta.get("ownerReferences") or []}
        pod_set = str(
            (meta.get("labels") or {}).get(POD_SET_LABEL)
            or (meta.get("annotations") or {}).get(ROLE_HASH_ANNOTATION)
            or ""
        )
        for uid in uids:
            key = by_owner.get((ns, uid))
            if key is not None:
                sets = out.setdefault(key, {})
                sets[pod_set] = sets.get(pod_set, 0) + 1
                break
    return out


def unbound_asks(c: CheckedWorkload, bound: Mapping[str, int]) -> tuple[PodSetAsk, ...]:
    """What ``c``'s pods not bound yet ask (``bound``: pod set -> its pods bound, :func:`bound_pods`): the
    room it still holds, its bound pods' allocations counting instead. A bound pod that names no pod set is
    one of the only pod set's, or (several pod sets) of none: its room stays held. Pure."""
    out: list[PodSetAsk] = []
    for a in c.asks:
        unnamed = bound.get("", 0) if len(c.asks) == 1 else 0
        left = a.unbound(bound.get(a.name, 0) + unnamed)
        if left is not None:
            out.append(left)
    return tuple(out)


def answered_lately(checked: Sequence[CheckedWorkload], now: float) -> list[CheckedWorkload]:
    """The workloads answered Ready, still admitted, in the last :data:`READY_RESERVE_S` seconds: those
    that may hold room their pods do not hold yet. Pure."""
    return [
        c
        for c in checked
        if c.state is State.READY
        and c.quota_reserved
        and c.since is not None
        and now - c.since < READY_RESERVE_S
    ]


def unbound(
    checked: Sequence[CheckedWorkload], bound: Mapping[str, Mapping[str, int]]
) -> list[CheckedWorkload]:
    """Those of ``checked`` whose pods are not all bound yet (``bound``: :func:`bound_pods`): the room of
    their unbound pods (:func:`unbound_asks`) is counted as taken. Pure."""
    return [c for c in checked if sum(bound.get(c.key, {}).values()) < c.pods]


def retry_after(check: Mapping[str, Any]) -> float:
    """An AdmissionCheck's bound (its annotation :data:`RETRY_ANNOTATION`), or the default. Pure."""
    raw = ((check.get("metadata") or {}).get("annotations") or {}).get(RETRY_ANNOTATION)
    try:
        value = float(raw) if raw is not None else DEFAULT_RETRY_S
    except ValueError:
        return DEFAULT_RETRY_S
    return value if value > 0 else DEFAULT_RETRY_S
