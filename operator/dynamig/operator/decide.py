"""One planning round for one policy: what to write, and why each pending claim is still pending. Pure.

``decide_round`` takes a frozen snapshot (the policy, the GPUs it governs, the claims it owns, ``now`` as a
value, when each GPU went idle) and returns a :class:`RoundDecision`: the GpuPartition layouts to write, a
verdict per pending claim (an Event reason and a message with numbers), and the policy's status figures.
The caller does the I/O. The planner (``dynamig.planner.plan``) decides the layouts; this module applies the
policy's mode, cooldown and disruption budget on top of it:

- ``Static``: nothing is written; claims that no free instance can serve are ``ReshapeDisabled``.
- ``DryRun``: the planned layouts are reported (status ``plannedLayouts`` and ``WouldReshape``), not written.
- ``Dynamic``: a changed GPU is written when it is not in flight, the disruption budget (GPUs in flight plus
  GPUs written this round) allows, and its cooldown (since the operator last wrote its layout) is over;
  that holds for changes that serve claims and for warm-pool top-ups. A return to the baseline waits until
  the GPU has had no allocated instance for the cooldown.

GPUs whose agent reports the ``Partitionable`` inventory are booked by the kube-scheduler directly (every
valid placement of ``spec.offeredProfiles`` is a device; the agent cuts it before the pod binds), so no claim
is planned ahead on them. Their ``spec.offeredProfiles`` is the policy's allowed profiles of the model in
``Dynamic`` and empty otherwise (an :class:`OfferWrite`: no cooldown, no budget); their ``spec.layout`` gets
the baseline and warm pool only. A claim only they can serve is ``WaitingForScheduler`` while an offered
placement fits beside the busy instances of a GPU on an eligible node, and every device of its pod (its
requests and the pod's other claims) fits one node together; ``NoCapacity`` otherwise. Claims an
``Instances`` GPU can serve are planned ahead on those GPUs as before.

A claim with requests only a whole GPU serves (``PendingClaim.whole``: MIG mode off, ``gpu.dynamig.io``) is
never planned for MIG: it is ``WaitingForWholeGpu``, a Normal Event while a GPU of the policy with MIG mode
off can serve it on an eligible node (the scheduler allocates it), a Warning while none can (dynamig does not
switch MIG mode under a ``Fixed`` policy; under a ``Dynamic`` one, ``operator/modes.py`` adds what it switches
for the claim, or why it cannot). A claim that also has MIG requests is planned for them only while such a GPU
exists. A GPU switching its MIG mode counts against the disruption budget.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.layout import free_starts, remaining_capacity
from dynamig.geometry.model import Layout, PlacedInstance
from dynamig.kube.gpupartition import layout_summary
from dynamig.kube.names import WHOLE_PROFILE
from dynamig.kube.policy import GpuPartitionPolicy, Mode, SpecProblem
from dynamig.operator.demand import PendingClaim, RequestDemand
from dynamig.operator.inventory import GpuView
from dynamig.planner import plan
from dynamig.planner.model import (
    Assignment,
    ClaimDemand,
    CurrentInstance,
    GpuKey,
    GpuPlan,
    GpuState,
    PlanResult,
)
from dynamig.planner.model import Policy as PlannerPolicy
from dynamig.planner.reserve import IdleNode, WaitingClaim, keep_idle_nodes


class Reason(StrEnum):
    """Event reasons on pending claims and their pods (``kubectl describe`` answers "why pending?")."""

    RESHAPE_SCHEDULED = "ReshapeScheduled"
    RESHAPE_IN_PROGRESS = "ReshapeInProgress"
    WAITING_FOR_SCHEDULER = "WaitingForScheduler"
    WAITING_FOR_COOLDOWN = "WaitingForCooldown"
    WAITING_FOR_BUDGET = "WaitingForDisruptionBudget"
    NO_CAPACITY = "NoCapacity"
    PROFILE_NOT_ALLOWED = "ProfileNotAllowed"
    NO_MATCHING_PROFILE = "NoMatchingProfile"
    NO_ELIGIBLE_NODE = "NoEligibleNode"
    RESHAPE_DISABLED = "ReshapeDisabled"
    WOULD_RESHAPE = "WouldReshape"
    POLICY_INVALID = "PolicyInvalid"
    SCHEDULER_ERROR = "SchedulerError"
    WAITING_FOR_WHOLE_GPU = "WaitingForWholeGpu"
    # MIG claims no GPU can serve now while a whole GPU is switched to MIG for them (operator/modes.py)
    WAITING_FOR_MIG_MODE_SWITCH = "WaitingForMigModeSwitch"


WARNING_REASONS = frozenset(
    {
        Reason.NO_CAPACITY,
        Reason.PROFILE_NOT_ALLOWED,
        Reason.NO_MATCHING_PROFILE,
        Reason.NO_ELIGIBLE_NODE,
        Reason.SCHEDULER_ERROR,
    }
)


@dataclass(frozen=True, slots=True)
class ClaimVerdict:
    claim: PendingClaim
    reason: Reason
    message: str
    profile: str  # the profile the claim is counted under (first acceptable one, "" if none)
    gpu: str = ""  # GPU the plan puts it on, if any
    warn: bool = False  # a Warning whatever the reason (WaitingForWholeGpu with no GPU to serve it)

    @property
    def warning(self) -> bool:
        return self.warn or self.reason in WARNING_REASONS

    @property
    def devices(self) -> int:
        """The devices the claim is counted for under :attr:`profile`: whole GPUs when it waits for them,
        its MIG requests' devices otherwise."""
        if self.profile == WHOLE_PROFILE:
            return self.claim.whole_gpus
        return sum(r.count for r in self.claim.requests)


@dataclass(frozen=True, slots=True)
class LayoutWrite:
    gpu: str
    node: str
    model: str
    before: Layout
    layout: Layout
    reason: str  # planner's account of the change
    claims: tuple[str, ...]  # claims the new layout serves


@dataclass(frozen=True, slots=True)
class OfferWrite:
    """``spec.offeredProfiles`` of a partitionable GPU: what the scheduler may book there to be cut."""

    gpu: str
    node: str
    model: str
    before: tuple[str, ...] | None
    profiles: tuple[str, ...]
    kept_for: str = ""  # the waiting multi-GPU claim the idle node is kept for ("" when not kept)


@dataclass(frozen=True, slots=True)
class RoundDecision:
    writes: tuple[LayoutWrite, ...]
    planned: tuple[LayoutWrite, ...]  # every change the plan wants (DryRun reports these)
    verdicts: tuple[ClaimVerdict, ...]
    held: Mapping[str, str] = field(default_factory=dict)  # GPU -> why its planned change is not written
    plan_seconds: float = 0.0
    offers: tuple[OfferWrite, ...] = ()  # offeredProfiles to write now (partitionable GPUs)
    planned_offers: tuple[OfferWrite, ...] = ()  # DryRun: what Dynamic would offer

    def pending_by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.verdicts:
            out[v.reason.value] = out.get(v.reason.value, 0) + 1
        return dict(sorted(out.items()))

    def pending_by_profile(self) -> dict[str, int]:
        """Devices of pending demand by the profile each claim is counted under. Claims the scheduler fails
        on (``SchedulerError``) are left out: no layout serves them, so they are no demand for any profile
        (``pending_by_reason`` still counts them)."""
        out: dict[str, int] = {}
        for v in self.verdicts:
            if v.reason is Reason.SCHEDULER_ERROR:
                continue
            key = v.profile or "none"
            devices = v.devices
            out[key] = out.get(key, 0) + devices
        return dict(sorted(out.items()))


@dataclass(frozen=True, slots=True)
class RoundInput:
    policy: GpuPartitionPolicy
    problems: tuple[SpecProblem, ...]
    gpus: tuple[GpuView, ...]  # GPUs this policy governs
    claims: tuple[PendingClaim, ...]  # pending claims this policy serves
    now: float
    idle_since: Mapping[str, float]  # GPU name -> epoch seconds since it has had no busy instance
    catalog: Catalog


def _fmt_secs(s: float) -> str:
    return f"{max(0, round(s))}s"


def _alts(
    claim: PendingClaim, allowed: frozenset[str] | None, models: frozenset[str] | None = None
) -> tuple[str, ...]:
    out: list[str] = []
    for r in claim.requests:
        for p in r.alternatives(allowed, models):
            if p not in out:
                out.append(p)
    return tuple(out)


def _first_profile(claim: PendingClaim) -> str:
    for r in claim.requests:
        alts = r.alternatives()
        if alts:
            return alts[0]
    return WHOLE_PROFILE if claim.whole and not claim.requests else ""


def _static_verdict(claim: PendingClaim, policy: GpuPartitionPolicy, gpus: Sequence[GpuView]) -> ClaimVerdict:
    allowed = _allowed(policy)
    alts = _alts(claim, allowed, _models(gpus))
    free: dict[str, int] = {}
    for g in gpus:
        for inst in g.free:
            free[inst.profile] = free.get(inst.profile, 0) + 1
    serving = [p for p in alts if free.get(p, 0) >= max(r.count_for(p) for r in claim.requests)]
    free_text = ", ".join(f"{n}x {p}" for p, n in sorted(free.items())) or "none"
    if serving:
        return ClaimVerdict(
            claim,
            Reason.WAITING_FOR_SCHEDULER,
            f"free {serving[0]} instances exist on the {len(gpus)} GPUs of policy {policy.name}; "
            "waiting for kube-scheduler to allocate one",
            _first_profile(claim),
        )
    return ClaimVerdict(
        claim,
        Reason.RESHAPE_DISABLED,
        f"policy {policy.name} is Static and never reshapes; the claim accepts {' or '.join(alts)} but the "
        f"{len(gpus)} GPUs it governs have free instances of: {free_text}",
        _first_profile(claim),
    )


def _allowed(policy: GpuPartitionPolicy) -> frozenset[str] | None:
    a = policy.spec.allowed_profiles
    return frozenset(a) if a is not None else None


def _profile_verdict(
    claim: PendingClaim, policy: GpuPartitionPolicy, gpus: Sequence[GpuView]
) -> ClaimVerdict | None:
    """NoMatchingProfile / ProfileNotAllowed / NoEligibleNode, or None when the claim is plannable."""
    accepted = _alts(claim, None, _models(gpus))
    if not accepted:
        models = sorted({g.model.key for g in gpus if g.model is not None})
        errors = "; ".join(dict.fromkeys(e for r in claim.requests for e in r.errors))
        names = ", ".join(models) or "the governed GPU models"
        msg = f"no MIG profile of {names} satisfies the claim's selectors"
        return ClaimVerdict(claim, Reason.NO_MATCHING_PROFILE, f"{msg}: {errors}" if errors else msg, "")
    allowed = _allowed(policy)
    if not _alts(claim, allowed, _models(gpus)):
        assert allowed is not None
        return ClaimVerdict(
            claim,
            Reason.PROFILE_NOT_ALLOWED,
            f"the claim accepts {', '.join(accepted)}; policy {policy.name} allows only "
            f"{', '.join(sorted(allowed))}",
            accepted[0],
        )
    if claim.nodes is not None and not any(g.node in claim.nodes for g in gpus):
        return ClaimVerdict(
            claim,
            Reason.NO_ELIGIBLE_NODE,
            f"the pod's node selector/affinity excludes all {len({g.node for g in gpus})} nodes of policy "
            f"{policy.name}",
            accepted[0],
        )
    return None


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _whole_verdict(
    claim: PendingClaim, policy: GpuPartitionPolicy, gpus: Sequence[GpuView]
) -> ClaimVerdict | None:
    """WaitingForWholeGpu for a claim that needs whole GPUs (MIG mode off), or None when it needs none, or
    when it has MIG requests too and a GPU with MIG mode off can serve the rest (then it is planned for its
    MIG requests). ``gpus``: every GPU the policy governs, unusable ones included. Pure."""
    if not claim.whole:
        return None
    wanted = claim.whole_by_model(_models(gpus))
    eligible = [g for g in gpus if claim.nodes is None or g.node in claim.nodes]
    serving = [g for g in eligible if g.whole and g.model is not None and g.model.key in wanted]
    if claim.requests and serving:
        return None
    n = claim.whole_gpus
    what = "a whole GPU" if n == 1 else f"{n} whole GPUs"
    accepted = list(wanted) or list(dict.fromkeys(m for r in claim.whole for m in r.whole_models()))
    of = f" of {' or '.join(accepted)}" if accepted else ""
    mig = (
        f" besides its {_plural(len(claim.requests), 'MIG request', 'MIG requests')}"
        if claim.requests
        else ""
    )
    head = f"the claim asks for {what}{of} (a GPU with MIG mode off){mig}, which no MIG slice serves"
    if serving:
        names = ", ".join(g.name for g in serving[:4]) + (
            f" (+{len(serving) - 4} more)" if len(serving) > 4 else ""
        )
        return ClaimVerdict(
            claim,
            Reason.WAITING_FOR_WHOLE_GPU,
            f"{head}; {_plural(len(serving), 'GPU', 'GPUs')} of policy {policy.name} with MIG mode off can "
            f"serve it ({names}): waiting for kube-scheduler to allocate {'one' if n == 1 else n}",
            WHOLE_PROFILE,
            serving[0].name,
        )
    where = (
        f" on the {_plural(len({g.node for g in eligible}), 'node', 'nodes')} the pod may use"
        if claim.nodes is not None
        else ""
    )
    whole_elsewhere = sum(1 for g in gpus if g.whole) - sum(1 for g in eligible if g.whole)
    elsewhere = (
        f" ({_plural(whole_elsewhere, 'GPU', 'GPUs')} with MIG mode off elsewhere, not on them)"
        if claim.nodes is not None and whole_elsewhere
        else ""
    )
    planned = "; its MIG requests are not planned until one has" if claim.requests else ""
    fixed = (
        ""
        if policy.spec.mig_mode.dynamic  # operator/modes.py says what is switched for it, or why nothing
        else f", and dynamig does not switch a GPU's MIG mode under a Fixed policy (policy {policy.name}'s "
        "MIG mode is Fixed: an administrator turns MIG mode off, or sets spec.migMode.policy Dynamic)"
    )
    return ClaimVerdict(
        claim,
        Reason.WAITING_FOR_WHOLE_GPU,
        f"{head}; no GPU{of} of policy {policy.name}{where} has MIG mode off{elsewhere}{fixed}{planned}",
        WHOLE_PROFILE,
        warn=True,
    )


def _scheduler_error_verdict(claim: PendingClaim) -> ClaimVerdict | None:
    """The scheduler fails on the claim itself: cutting instances cannot help, so it is not planned for."""
    if not claim.scheduler_error:
        return None
    return ClaimVerdict(
        claim,
        Reason.SCHEDULER_ERROR,
        f"kube-scheduler fails on this claim ({claim.scheduler_error}); dynamig does not reshape for it, "
        "since no layout helps until the claim is fixed (a CEL runtime error in a selector, e.g. an "
        "attribute some devices lack: guard it with device.attributes[...].?name.orValue(...); or a request "
        "over the API's limits)",
        _first_profile(claim),
    )


def _cooling(g: GpuView, now: float, cooldown: int) -> bool:
    """Was the GPU's layout written less than the cooldown ago? Pure."""
    return g.last_written is not None and now - g.last_written < cooldown


def _why_frozen(g: GpuView, now: float, cooldown: int) -> str:
    """Why a GPU in flight, failed or cooling down may not change this round. Pure."""
    if g.in_flight:
        return (
            f"{g.name} is still reshaping (generation {g.generation}, agent reported {g.observed_generation})"
        )
    if g.failure:
        return f"the agent could not apply {layout_summary(g.desired)} on {g.name} ({g.failure})"
    if g.floor_held:
        return f"{g.name} keeps its floor {layout_summary(g.desired)} waiting for bookings ({g.floor_held})"
    since = now - (g.last_written or now)
    left = _fmt_secs(cooldown - since)
    return f"{g.name} was reshaped {_fmt_secs(since)} ago; cooldown {cooldown}s ({left} left)"


def _models(gpus: Sequence[GpuView]) -> frozenset[str]:
    return frozenset(g.model.key for g in gpus if g.model is not None)


def _demands(
    claim: PendingClaim, policy: GpuPartitionPolicy, models: frozenset[str]
) -> tuple[ClaimDemand, ...]:
    return claim.planner_demands(_allowed(policy), models)


def _same_node_roots(claims: Sequence[PendingClaim]) -> dict[str, str]:
    """Claim key -> one claim key per group of claims that must land on one node: the claims of one pod,
    transitively (kube-scheduler allocates all of a pod's claims on the node it binds the pod to). Pure."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    first_claim_of_pod: dict[tuple[str, str], str] = {}
    for c in claims:
        find(c.claim.key)
        for pod in c.pods:
            other = first_claim_of_pod.setdefault((pod.namespace, pod.name), c.claim.key)
            parent[find(c.claim.key)] = find(other)
    return {c.claim.key: find(c.claim.key) for c in claims}


def _pod_groups(
    claims: Sequence[PendingClaim], demands_of: Mapping[str, tuple[ClaimDemand, ...]]
) -> list[frozenset[str]]:
    """Planner demand names that must land on one node: the requests of one claim, and every claim of one
    pod (see :func:`_same_node_roots`). Pure."""
    roots = _same_node_roots(claims)
    by_root: dict[str, set[str]] = {}
    for c in claims:
        by_root.setdefault(roots[c.claim.key], set()).update(d.name for d in demands_of.get(c.claim.key, ()))
    return [frozenset(g) for g in by_root.values() if len(g) > 1]


_GROUP_NODES_TRIED = 4  # nodes tried for a pod's claims that the first plan split, before giving up on them


def _plan_together(
    states: Sequence[GpuState],
    demands: Sequence[ClaimDemand],
    groups: Sequence[frozenset[str]],
    policy: PlannerPolicy,
    catalog: Catalog,
) -> PlanResult:
    """The planner's result with every group of demands whole on one node, or left out: a group the plan
    split over nodes or served in part is held to one node and planned again, trying the nodes its members
    got, then the nodes with the most memory slices not held by busy instances; a group that fits none of
    them is left out (cutting for part of a pod serves nobody). Pure."""
    demands = list(demands)
    result = plan(states, demands, policy, catalog)

    def whole(g: frozenset[str], r: PlanResult) -> bool:
        nodes = {a.node for a in r.assignments if a.claim in g}
        return len(nodes) <= 1 and (not nodes or g <= {a.claim for a in r.assignments})

    def held_to(g: frozenset[str], nodes: frozenset[str]) -> list[ClaimDemand]:
        return [
            replace(d, nodes=nodes if d.nodes is None else d.nodes & nodes) if d.name in g else d
            for d in demands
        ]

    room: dict[str, int] = {}
    for st in states:
        model = catalog.model(st.model)
        busy = sum(model.profile(i.profile).placement_size for i in st.instances if i.busy)
        room[st.node] = room.get(st.node, 0) + model.memory_slices - busy
    for g in groups:
        if whole(g, result):
            continue
        got = [a.node for a in result.assignments if a.claim in g]
        candidates = sorted(set(got), key=lambda n: (-got.count(n), n))
        candidates += sorted((n for n in room if n not in candidates), key=lambda n: (-room[n], n))
        for node in candidates[:_GROUP_NODES_TRIED]:
            trial = held_to(g, frozenset({node}))
            tried = plan(states, trial, policy, catalog)
            if whole(g, tried) and {a.claim for a in tried.assignments} >= g:
                demands, result = trial, tried
                break
        else:
            demands = held_to(g, frozenset())  # no node: left out, reported unsatisfied
            result = plan(states, demands, policy, catalog)
    # A group placed first may have lost room to one placed after it: leave out whatever is not whole.
    for _ in groups:
        broken = [g for g in groups if not whole(g, result)]
        if not broken:
            break
        demands = held_to(broken[0], frozenset())
        result = plan(states, demands, policy, catalog)
    return result


def decide_round(inp: RoundInput) -> RoundDecision:
    """Plan one round for one policy and decide what may be written now. Pure (it times the planner)."""
    policy = inp.policy
    spec = policy.spec
    usable = tuple(g for g in inp.gpus if not g.unusable and g.model is not None)
    verdicts: list[ClaimVerdict] = []
    if inp.problems:
        text = "; ".join(str(p) for p in inp.problems)
        for c in inp.claims:
            verdicts.append(
                ClaimVerdict(
                    c, Reason.POLICY_INVALID, f"policy {policy.name} is invalid: {text}", _first_profile(c)
                )
            )
        return RoundDecision((), (), tuple(verdicts))

    plannable: list[PendingClaim] = []
    for c in inp.claims:
        early = (
            _scheduler_error_verdict(c)
            or _whole_verdict(c, policy, inp.gpus)
            or _profile_verdict(c, policy, usable)
        )
        if early is not None:
            verdicts.append(early)
        else:
            plannable.append(c)

    booked = _Fleet([g for g in usable if g.partitionable], _allowed(policy), inp.catalog)
    ahead = _Fleet([g for g in usable if not g.partitionable], _allowed(policy), inp.catalog)
    # Split plannable claims by inventory first: idle partitionable nodes are kept for the multi-GPU claims
    # the scheduler books there.
    to_book: list[PendingClaim] = []
    to_plan: list[PendingClaim] = []
    for c in plannable:
        only_booked = booked.can_serve(c) and not ahead.can_serve(c)
        (to_book if only_booked else to_plan).append(c)
    offers, planned_offers = _offers(policy, booked.gpus, to_book)
    mates = _pod_mates(plannable)

    if spec.mode == Mode.STATIC:
        verdicts.extend(_static_verdict(c, policy, usable) for c in plannable)
        return RoundDecision((), (), tuple(verdicts), offers=offers)

    # Claims only partitionable GPUs can serve are left to the scheduler; the rest are planned ahead.
    models = _models(ahead.gpus)
    demands_of = {c.claim.key: _demands(c, policy, models) for c in to_plan}
    if booked:
        # Claims may not land on partitionable GPUs: keep them to the nodes of Instances GPUs.
        ahead_nodes = frozenset(ahead.by_node)
        demands_of = {
            k: tuple(replace(d, nodes=ahead_nodes if d.nodes is None else d.nodes & ahead_nodes) for d in ds)
            for k, ds in demands_of.items()
        }
    demands = [d for c in to_plan for d in demands_of[c.claim.key]]
    states = [replace(g.state(), node=_planner_node(g)) for g in usable]
    # GPUs that could not be written this round are planned as they are, so demand goes where it can be cut
    # now instead of queueing behind a cooldown or a reshape in flight.
    cooling = {g.name for g in usable if _cooling(g, inp.now, spec.cooldown_seconds)}
    # A GPU whose agent could not apply its current spec.layout is not written again (the agent retries it
    # itself): rewriting the same layout every round would be a hot loop that serves nobody.
    failed = {g.name for g in usable if g.failure and not g.in_flight}
    # A partitionable GPU whose floor waits for bookings is not rewritten either: the agent creates the floor
    # once they end, and a new floor would wait on the same bookings.
    waiting = {g.name for g in usable if g.floor_held and not g.in_flight}
    frozen_gpus = [
        g for g in usable if g.in_flight or g.name in cooling or g.name in failed or g.name in waiting
    ]
    frozen = frozenset(GpuKey(_planner_node(g), g.index) for g in frozen_gpus)
    planner_policy = replace(spec.to_planner(), frozen=frozen)
    started = time.perf_counter()
    groups = _pod_groups(to_plan, demands_of)
    result: PlanResult = _plan_together(states, demands, groups, planner_policy, inp.catalog)
    plan_seconds = time.perf_counter() - started

    by_key = {(_planner_node(g), g.index): g for g in usable}
    assigned: dict[str, list[Assignment]] = {}
    for a in result.assignments:
        assigned.setdefault(a.claim, []).append(a)
    claims_per_gpu: dict[str, list[str]] = {}
    for a in result.assignments:
        g = by_key[(a.node, a.index)]
        claims_per_gpu.setdefault(g.name, []).append(a.claim)

    planned: list[LayoutWrite] = []
    for gp in result.gpus:
        if not gp.changed:
            continue
        g = by_key[(gp.node, gp.index)]
        if g.partitionable and gp.layout == g.desired:
            continue  # spec.layout already asks for it; leftover instances beside it are kept on purpose
        planned.append(_write_for(g, gp, tuple(sorted(set(claims_per_gpu.get(g.name, []))))))

    writes: list[LayoutWrite] = []
    # Frozen GPUs were planned as they are; say why each may not change this round.
    held: dict[str, str] = {g.name: _why_frozen(g, inp.now, spec.cooldown_seconds) for g in frozen_gpus}
    budget = spec.disruption_budget.max_gpus_reshaping
    # A GPU switching its MIG mode (unusable meanwhile) counts against the budget as a reshaping one does.
    in_flight = sum(1 for g in usable if g.reshaping) + sum(1 for g in inp.gpus if g.switching is not None)
    cooldown = spec.cooldown_seconds
    # Claim-serving changes first, then baseline / warm-pool drift.
    for w in sorted(planned, key=lambda w: (not w.claims, w.gpu)):
        g = next(x for x in usable if x.name == w.gpu)
        if g.name in held:
            continue
        if spec.mode == Mode.DRY_RUN:
            held[w.gpu] = f"policy {policy.name} is DryRun"
            continue
        warm_only = not w.claims and "warm pool" in w.reason and "baseline" not in w.reason
        if not w.claims and not warm_only:
            idle_for = inp.now - inp.idle_since.get(w.gpu, inp.now)
            if g.busy or idle_for < cooldown:
                held[w.gpu] = f"{w.gpu} idle for {_fmt_secs(idle_for)}, returns to baseline after {cooldown}s"
                continue
        if in_flight + len(writes) >= budget:
            held[w.gpu] = (
                f"{in_flight + len(writes)} of {budget} GPUs allowed by the disruption budget are reshaping"
            )
            continue
        writes.append(w)

    written = {w.gpu for w in writes}
    planned_by_gpu = {w.gpu: w for w in planned}
    for c in to_plan:
        names = [d.name for d in demands_of[c.claim.key]]
        placed = [a for n in names for a in assigned.get(n, [])]
        profile = _first_profile(c)
        if not placed or any(n in result.unsatisfied for n in names):
            if booked:
                # Nothing ahead for it, but the scheduler may still book a placement on a partitionable GPU.
                fallback = _booking_verdict(c, policy, booked, mates.get(c.claim.key, ()))
                if fallback.reason is not Reason.NO_CAPACITY:
                    verdicts.append(fallback)
                    continue
            moving = [g.name for g in usable if g.reshaping]
            if moving:
                msg = (
                    f"{len(moving)} GPU(s) of policy {policy.name} are still reshaping "
                    f"({', '.join(moving)}); "
                    f"the claim is planned again when they finish. Now: {_no_capacity(c, policy, usable)}"
                )
                verdicts.append(ClaimVerdict(c, Reason.RESHAPE_IN_PROGRESS, msg, profile))
            elif cooling or failed:
                msg = (
                    f"no GPU of policy {policy.name} that may be cut now has room for the claim; "
                    + "; ".join(held[name] for name in sorted(cooling | failed))
                    + "; the claim is planned again when they may change"
                )
                reason = Reason.WAITING_FOR_COOLDOWN if cooling and not failed else Reason.NO_CAPACITY
                verdicts.append(ClaimVerdict(c, reason, msg, profile))
            else:
                verdicts.append(ClaimVerdict(c, Reason.NO_CAPACITY, _no_capacity(c, policy, usable), profile))
            continue
        a = placed[0]
        g = by_key[(a.node, a.index)]
        inst = f"{a.profile}@{a.start}"
        if g.name in written:
            w = planned_by_gpu[g.name]
            verdicts.append(
                ClaimVerdict(
                    c,
                    Reason.RESHAPE_SCHEDULED,
                    f"reshaping {g.name} ({w.model}) from {layout_summary(w.before)} "
                    f"to {layout_summary(w.layout)}; "
                    f"the claim is planned on {inst}",
                    a.profile,
                    g.name,
                )
            )
        elif g.name in planned_by_gpu:
            why = held.get(g.name, "")
            if spec.mode == Mode.DRY_RUN:
                reason = Reason.WOULD_RESHAPE
                w = planned_by_gpu[g.name]
                msg = (
                    f"policy {policy.name} is DryRun: it would reshape {g.name} "
                    f"to {layout_summary(w.layout)} "
                    f"and the claim would get {inst}"
                )
            elif g.in_flight:
                reason, msg = Reason.RESHAPE_IN_PROGRESS, f"{why}; the claim is planned on {inst}"
            elif "cooldown" in why:
                reason, msg = Reason.WAITING_FOR_COOLDOWN, f"{why}; the claim is planned on {inst}"
            else:
                reason, msg = Reason.WAITING_FOR_BUDGET, f"{why}; the claim is planned on {inst}"
            verdicts.append(ClaimVerdict(c, reason, msg, a.profile, g.name))
        elif g.in_flight and PlacedInstance(a.start, a.profile) not in g.actual:
            verdicts.append(
                ClaimVerdict(
                    c,
                    Reason.RESHAPE_IN_PROGRESS,
                    f"{g.name} is reshaping to {layout_summary(g.desired)}; the claim is planned on {inst}",
                    a.profile,
                    g.name,
                )
            )
        else:
            verdicts.append(
                ClaimVerdict(
                    c,
                    Reason.WAITING_FOR_SCHEDULER,
                    f"free instance {inst} on {g.name} can serve the claim; waiting for kube-scheduler to "
                    "allocate it",
                    a.profile,
                    g.name,
                )
            )
    verdicts.extend(_booking_verdict(c, policy, booked, mates.get(c.claim.key, ())) for c in to_book)
    return RoundDecision(
        tuple(writes), tuple(planned), tuple(verdicts), held, plan_seconds, offers, planned_offers
    )


# ------------------------------------------------------------------------------ partitionable inventory


def _planner_node(g: GpuView) -> str:
    """The node name the planner sees: partitionable GPUs get one no claim demand names ('/' is not valid in
    a node name), so claims are never planned on them while baseline and warm pool still are."""
    return f"{g.node}/partitionable" if g.partitionable else g.node


def _offers(
    policy: GpuPartitionPolicy, gpus: Sequence[GpuView], waiting: Sequence[PendingClaim] = ()
) -> tuple[tuple[OfferWrite, ...], tuple[OfferWrite, ...]]:
    """(offeredProfiles writes due now, what Dynamic would offer: reported in DryRun). Pure.

    In ``Dynamic`` a GPU offers the policy's allowed profiles of its model, except on an idle node kept for a
    waiting multi-GPU claim (``dynamig.planner.reserve``): there only the profiles that claim accepts."""
    allowed = _allowed(policy)
    mode = policy.spec.mode
    kept = _kept_nodes(gpus, waiting, allowed)
    writes: list[OfferWrite] = []
    planned: list[OfferWrite] = []
    for g in gpus:
        assert g.model is not None
        full = _offerable(g, allowed)
        claim = kept.get(g.node)
        if claim is not None:
            full = tuple(p for p in full if p in claim.profiles)
        why = claim.name if claim is not None else ""
        want = full if mode == Mode.DYNAMIC else ()  # Static and DryRun: only instances that exist
        if mode == Mode.DRY_RUN:
            planned.append(OfferWrite(g.name, g.node, g.model.key, g.offered, full, why))
        if g.offered is None or frozenset(g.offered) != frozenset(want):
            writes.append(OfferWrite(g.name, g.node, g.model.key, g.offered, want, why if want else ""))
    return tuple(writes), tuple(planned)


def _offerable(g: GpuView, allowed: frozenset[str] | None) -> tuple[str, ...]:
    """The policy's allowed profiles that ``g``'s model has, in catalog order. Pure."""
    assert g.model is not None
    return tuple(p.name for p in g.model.profiles if allowed is None or p.name in allowed)


def _kept_nodes(
    gpus: Sequence[GpuView], waiting: Sequence[PendingClaim], allowed: frozenset[str] | None
) -> Mapping[str, WaitingClaim]:
    """Idle nodes kept for waiting claims of several devices (all on one node), by node. Pure."""
    claims = [
        WaitingClaim(c.claim.key, count, frozenset(_alts(c, allowed)), c.nodes)
        for c in waiting
        if (count := sum(r.min_count for r in c.requests)) > 1
    ]
    if not claims:
        return {}
    by_node: dict[str, list[GpuView]] = {}
    for g in gpus:
        by_node.setdefault(g.node, []).append(g)
    idle = [
        IdleNode(node, tuple(frozenset(_offerable(g, allowed)) for g in gs))
        for node, gs in sorted(by_node.items())
        if not any(g.busy or g.claims_on for g in gs)
    ]
    return keep_idle_nodes(idle, claims)


# Nodes tried, those with the most free memory slices first, for the devices of a pod that must all fit one
# partitionable node: a pod that fits none of the roomiest is taken to fit none.
_TOGETHER_NODES_TRIED = 8


@dataclass(frozen=True, slots=True)
class _Room:
    profile: str
    places: tuple[tuple[str, PlacedInstance], ...]  # (GPU, placement)


class _Fleet:
    """GPUs of one inventory indexed by node, with what fits on each cached for the round: a burst of claims
    of one shape costs one scan, not one per claim."""

    def __init__(
        self, gpus: Sequence[GpuView], allowed: frozenset[str] | None, catalog: Catalog | None = None
    ) -> None:
        self.gpus = tuple(gpus)
        self.allowed = allowed
        self.catalog = catalog
        self.by_node: dict[str, list[GpuView]] = {}
        for g in gpus:
            if g.model is not None:
                self.by_node.setdefault(g.node, []).append(g)
        self.all_models = sorted({g.model.key for g in self.gpus if g.model is not None})
        self._fits: dict[tuple[str, str, bool], tuple[tuple[PlacedInstance, ...], int]] = {}
        self._rooms: dict[tuple[object, ...], _Room | None] = {}
        self._node_models: dict[frozenset[str] | None, tuple[list[str], list[str]]] = {}
        self.verdicts: dict[tuple[object, ...], tuple[Reason, str, str, str]] = {}
        self._together: dict[tuple[object, ...], bool] = {}

    def __bool__(self) -> bool:
        return bool(self.gpus)

    def _eligible_nodes(self, claim: PendingClaim) -> tuple[list[str], list[str]]:
        """(eligible nodes, models on them) for the claim's node constraint."""
        if claim.nodes not in self._node_models:
            nodes = sorted(n for n in self.by_node if claim.nodes is None or n in claim.nodes)
            models = sorted({g.model.key for n in nodes for g in self.by_node[n] if g.model is not None})
            self._node_models[claim.nodes] = (nodes, models)
        return self._node_models[claim.nodes]

    def nodes(self, claim: PendingClaim) -> list[str]:
        return self._eligible_nodes(claim)[0]

    def eligible(self, claim: PendingClaim) -> list[GpuView]:
        return [g for n in self.nodes(claim) for g in self.by_node[n]]

    def shape(self, claim: PendingClaim) -> tuple[object, ...]:
        """What a verdict here depends on: node constraint, and per request the profiles per model."""
        per_request = tuple(
            (
                tuple((m, r.alternatives(None, frozenset({m}))) for m in self.all_models),
                r.alternative_counts(),
            )
            for r in claim.requests
        )
        return (claim.nodes, per_request, _first_profile(claim))

    def can_serve(self, claim: PendingClaim) -> bool:
        """Every MIG request of the claim has an allowed profile on some GPU of an eligible node. Pure."""
        models = self._eligible_nodes(claim)[1]
        return bool(models) and all(
            any(r.alternatives(self.allowed, frozenset({m})) for m in models) for r in claim.requests
        )

    def _fit(self, g: GpuView, profile: str, existing: bool) -> tuple[tuple[PlacedInstance, ...], int]:
        """(places, how many fit at once) of ``profile`` on ``g``: its free instances (``existing``), or the
        placements beside its busy instances (free ones do not block: a booking destroys them first)."""
        key = (g.name, profile, existing)
        if key not in self._fits:
            assert g.model is not None
            if existing:
                free = tuple(i for i in g.free if i.profile == profile)
                self._fits[key] = (free, len(free))
            else:
                busy = tuple(g.busy)
                starts = free_starts(g.model, busy, profile)
                places = tuple(PlacedInstance(s, profile) for s in starts)
                self._fits[key] = (places, remaining_capacity(g.model, busy, profile) if places else 0)
        return self._fits[key]

    def room(self, claim: PendingClaim, r: RequestDemand, existing: bool) -> _Room | None:
        """Where the devices of one accepted profile fit on one eligible node (as many as the alternative of
        that profile asks), or None. Pure."""
        nodes, models = self._eligible_nodes(claim)
        shape = tuple((m, r.alternatives(self.allowed, frozenset({m}))) for m in models)
        key = (shape, r.alternative_counts(), claim.nodes, existing)
        if key not in self._rooms:
            self._rooms[key] = self._find(nodes, r, existing)
        return self._rooms[key]

    def fits_together(self, group: Sequence[PendingClaim]) -> bool:
        """Whether one eligible node has room for every device of ``group`` (a claim's requests and the
        other claims of its pod) at once, beside the busy instances (free ones do not block). A single
        request is answered by :meth:`room` already; several are placed by the planner on one node at a
        time, the nodes with the most free memory slices first. Pure (cached for the round)."""
        if sum(len(c.requests) for c in group) <= 1:
            return True
        key = tuple(sorted((self.shape(c) for c in group), key=repr))
        if key not in self._together:
            self._together[key] = self._place_together(group)
        return self._together[key]

    def _place_together(self, group: Sequence[PendingClaim]) -> bool:
        nodes = set(self.by_node)
        for c in group:
            if c.nodes is not None:
                nodes &= c.nodes
        need = sum(r.min_count for c in group for r in c.requests)
        room: dict[str, int] = {}
        for node in nodes:
            free = 0
            for g in self.by_node[node]:
                assert g.model is not None
                busy = sum(g.model.profile(i.profile).placement_size for i in g.busy)
                free += g.model.memory_slices - busy
            if free >= need:  # every device takes at least one memory slice
                room[node] = free
        for node in sorted(room, key=lambda n: (-room[n], n))[:_TOGETHER_NODES_TRIED]:
            here = self.by_node[node]
            models = frozenset(g.model.key for g in here if g.model is not None)
            demands = [
                replace(d, name=f"{i}/{d.name}", nodes=frozenset({node}))  # names unique within the group
                for i, c in enumerate(group)
                for d in c.planner_demands(self.allowed, models)
            ]
            if len(demands) < sum(len(c.requests) for c in group):
                continue  # a request with no allowed profile on this node's models
            states = [
                GpuState(
                    node=node,
                    index=g.index,
                    model=g.model.key,
                    instances=tuple(CurrentInstance(i.profile, i.start, busy=True) for i in g.busy),
                )
                for g in here
                if g.model is not None
            ]
            result = plan(states, demands, PlannerPolicy(allowed_profiles=self.allowed), self.catalog)
            if not result.unsatisfied:
                return True
        return False

    def _find(self, nodes: Sequence[str], r: RequestDemand, existing: bool) -> _Room | None:
        for node in nodes:
            here = self.by_node[node]
            profiles: list[str] = []
            for g in here:
                assert g.model is not None
                for p in r.alternatives(self.allowed, frozenset({g.model.key})):
                    if p not in profiles:
                        profiles.append(p)
            for p in profiles:
                places: list[tuple[str, PlacedInstance]] = []
                capacity = 0
                for g in here:
                    assert g.model is not None
                    if g.model.has_profile(p):
                        fit, n = self._fit(g, p, existing)
                        places.extend((g.name, i) for i in fit)
                        capacity += n
                if capacity >= r.count_for(p):
                    return _Room(p, tuple(places))
        return None


def _places_text(room: _Room, limit: int = 4) -> str:
    """``1g.10gb@4, 1g.10gb@5 on node-a-gpu0 (+3 more)``. Pure."""
    groups: dict[str, list[str]] = {}
    for gpu, inst in room.places[:limit]:
        groups.setdefault(gpu, []).append(f"{inst.profile}@{inst.start}")
    shown = "; ".join(f"{', '.join(items)} on {gpu}" for gpu, items in groups.items())
    more = len(room.places) - limit
    return f"{shown} (+{more} more)" if more > 0 else shown


def _pod_mates(claims: Sequence[PendingClaim]) -> dict[str, tuple[PendingClaim, ...]]:
    """Claim key -> the other pending claims that must land on the same node with it (the claims of its pods,
    transitively, see :func:`_same_node_roots`). Claims alone on their pods are left out. Pure."""
    roots = _same_node_roots(claims)
    groups: dict[str, list[PendingClaim]] = {}
    for c in claims:
        groups.setdefault(roots[c.claim.key], []).append(c)
    return {
        c.claim.key: tuple(o for o in group if o is not c)
        for group in groups.values()
        if len(group) > 1
        for c in group
    }


def _booking_verdict(
    claim: PendingClaim, policy: GpuPartitionPolicy, fleet: _Fleet, mates: Sequence[PendingClaim] = ()
) -> ClaimVerdict:
    """The verdict on a claim the scheduler books on partitionable GPUs (nothing is planned ahead). A claim
    whose devices (with those of ``mates``, the other claims of its pod) each fit some node, but no node all
    together, is ``NoCapacity``: the scheduler binds a pod to one node with every device it asks for. Pure."""
    key = (fleet.shape(claim), tuple(sorted((fleet.shape(m) for m in mates), key=repr)))
    if key not in fleet.verdicts:
        v = _new_booking_verdict(claim, policy, fleet)
        if v.reason is Reason.WAITING_FOR_SCHEDULER and not fleet.fits_together((claim, *mates)):
            v = _apart_verdict(claim, policy, fleet, mates)
        fleet.verdicts[key] = (v.reason, v.message, v.profile, v.gpu)
    reason, message, profile, gpu = fleet.verdicts[key]
    return ClaimVerdict(claim, reason, message, profile, gpu)


def _apart_verdict(
    claim: PendingClaim, policy: GpuPartitionPolicy, fleet: _Fleet, mates: Sequence[PendingClaim]
) -> ClaimVerdict:
    """NoCapacity for a claim whose pod's devices fit no single node together. Pure."""
    group = (claim, *mates)
    devices = sum(r.min_count for c in group for r in c.requests)
    what = f"its {len(claim.requests)} requests" if not mates else f"the {len(group)} claims of its pod"
    eligible = fleet.eligible(claim) or list(fleet.gpus)
    return ClaimVerdict(
        claim,
        Reason.NO_CAPACITY,
        _no_capacity(claim, policy, eligible, "partitionable ")
        + f"; {what} need {devices} devices on one node, and no eligible node has room for all of them "
        "beside its allocated instances (each alone would fit)",
        _first_profile(claim),
    )


def _new_booking_verdict(claim: PendingClaim, policy: GpuPartitionPolicy, fleet: _Fleet) -> ClaimVerdict:
    dry = policy.spec.mode == Mode.DRY_RUN
    free = [fleet.room(claim, r, existing=True) for r in claim.requests] if dry else []
    if free and all(free) and free[0] is not None:
        room = free[0]
        return ClaimVerdict(
            claim,
            Reason.WAITING_FOR_SCHEDULER,
            f"free {'instances' if len(room.places) > 1 else 'instance'} {_places_text(room)} can serve the "
            "claim; waiting for kube-scheduler to allocate one",
            room.profile,
            room.places[0][0],
        )
    cut = [fleet.room(claim, r, existing=False) for r in claim.requests]
    if all(cut) and cut[0] is not None:
        room = cut[0]
        if dry:
            return ClaimVerdict(
                claim,
                Reason.WOULD_RESHAPE,
                f"policy {policy.name} is DryRun and offers only existing instances; it would offer "
                f"{_places_text(room)}, which could serve the claim",
                room.profile,
                room.places[0][0],
            )
        return ClaimVerdict(
            claim,
            Reason.WAITING_FOR_SCHEDULER,
            f"offered placements {_places_text(room)} can serve the claim; waiting for kube-scheduler to "
            "book one (the node agent cuts it before the pod binds)",
            room.profile,
            room.places[0][0],
        )
    eligible = fleet.eligible(claim) or list(fleet.gpus)
    return ClaimVerdict(
        claim,
        Reason.NO_CAPACITY,
        _no_capacity(claim, policy, eligible, "partitionable ") + "; no offered placement fits beside them",
        _first_profile(claim),
    )


def _write_for(g: GpuView, gp: GpuPlan, claims: tuple[str, ...]) -> LayoutWrite:
    assert g.model is not None
    return LayoutWrite(
        gpu=g.name,
        node=g.node,
        model=g.model.key,
        before=g.actual,
        layout=gp.layout,
        reason=gp.reason,
        claims=claims,
    )


def _no_capacity(
    claim: PendingClaim, policy: GpuPartitionPolicy, gpus: Sequence[GpuView], kind: str = ""
) -> str:
    alts = _alts(claim, _allowed(policy), _models(gpus))
    count = max(r.count for r in claim.requests)
    busy_slices = sum(
        (g.model.profile(i.profile).compute_slices if g.model and g.model.has_profile(i.profile) else 0)
        for g in gpus
        for i in g.busy
    )
    total_slices = sum(g.model.compute_slices for g in gpus if g.model is not None)
    nodes = (
        ""
        if claim.nodes is None
        else f" on the {len({g.node for g in gpus if g.node in claim.nodes})} allowed nodes"
    )
    return (
        f"no room for {count} x {' or '.join(alts)}{nodes} among the {len(gpus)} {kind}GPUs "
        f"of policy {policy.name}: "
        f"{busy_slices} of {total_slices} compute slices are allocated"
    )
