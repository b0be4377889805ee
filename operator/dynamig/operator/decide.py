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
  that holds for re-cuts that serve claims and for warm-pool top-ups. Within its cooldown a GPU may still
  gain instances for claims in free memory slices (nothing destroyed, nothing disrupted). A return to the
  baseline waits until the GPU has had no allocated instance for the cooldown.

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
exists. MIG mode switches count against the disruption budget (``inventory.switch_changes``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.model import Layout, PlacedInstance
from dynamig.kube.gpupartition import layout_summary
from dynamig.kube.policy import GpuPartitionPolicy, Mode, SpecProblem
from dynamig.operator.booking import Fleet, booking_verdict
from dynamig.operator.demand import PendingClaim
from dynamig.operator.inventory import GpuView, switch_changes
from dynamig.operator.verdicts import (
    ClaimVerdict,
    Reason,
    accepted_profiles,
    first_profile,
    fmt_secs,
    models_of,
    no_capacity_text,
    policy_allowed,
    profile_verdict,
    scheduler_error_verdict,
    static_verdict,
    whole_verdict,
)
from dynamig.planner import plan
from dynamig.planner.model import (
    Assignment,
    ClaimDemand,
    GpuKey,
    GpuPlan,
    GpuState,
    PlanResult,
)
from dynamig.planner.model import Policy as PlannerPolicy
from dynamig.planner.reserve import IdleNode, WaitingClaim, keep_idle_nodes


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
    left = fmt_secs(cooldown - since)
    return f"{g.name} was reshaped {fmt_secs(since)} ago; cooldown {cooldown}s ({left} left)"


def _demands(
    claim: PendingClaim, policy: GpuPartitionPolicy, models: frozenset[str]
) -> tuple[ClaimDemand, ...]:
    return claim.planner_demands(policy_allowed(policy), models)


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
    # A GPU kept whole for a claim of whole GPUs (operator/modes.py) is planned for nobody else.
    usable = tuple(g for g in inp.gpus if not g.unusable and g.model is not None and not g.whole_hold)
    verdicts: list[ClaimVerdict] = []
    if inp.problems:
        text = "; ".join(str(p) for p in inp.problems)
        for c in inp.claims:
            verdicts.append(
                ClaimVerdict(
                    c, Reason.POLICY_INVALID, f"policy {policy.name} is invalid: {text}", first_profile(c)
                )
            )
        return RoundDecision((), (), tuple(verdicts))

    plannable: list[PendingClaim] = []
    for c in inp.claims:
        early = (
            scheduler_error_verdict(c)
            or whole_verdict(c, policy, inp.gpus)
            or profile_verdict(c, policy, usable)
        )
        if early is not None:
            verdicts.append(early)
        else:
            plannable.append(c)

    booked = Fleet([g for g in usable if g.partitionable], policy_allowed(policy), inp.catalog)
    ahead = Fleet([g for g in usable if not g.partitionable], policy_allowed(policy), inp.catalog)
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
        verdicts.extend(static_verdict(c, policy, usable) for c in plannable)
        return RoundDecision((), (), tuple(verdicts), offers=offers)

    # Claims only partitionable GPUs can serve are left to the scheduler; the rest are planned ahead.
    models = models_of(ahead.gpus)
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
    # now instead of queueing behind a reshape in flight. A GPU in its cooldown may still gain instances in
    # free memory slices for claims (nothing on it is destroyed, so nothing is disrupted): a burst whose
    # claims come a round apart is cut for at once, not after the cooldown.
    cooling = {g.name for g in usable if _cooling(g, inp.now, spec.cooldown_seconds)}
    # A GPU whose agent could not apply its current spec.layout is not written again (the agent retries it
    # itself): rewriting the same layout every round would be a hot loop that serves nobody.
    failed = {g.name for g in usable if g.failure and not g.in_flight}
    # A partitionable GPU whose floor waits for bookings is not rewritten either: the agent creates the floor
    # once they end, and a new floor would wait on the same bookings.
    waiting = {g.name for g in usable if g.floor_held and not g.in_flight}
    frozen_gpus = [g for g in usable if g.in_flight or g.name in failed or g.name in waiting]
    frozen = frozenset(GpuKey(_planner_node(g), g.index) for g in frozen_gpus)
    additive = frozenset(GpuKey(_planner_node(g), g.index) for g in usable if g.name in cooling) - frozen
    planner_policy = replace(spec.to_planner(), frozen=frozen, additive=additive)
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
    # Frozen GPUs were planned as they are; say why each may not change this round. GPUs cooling down were
    # planned to gain instances for claims only, so what was planned for them may be written.
    held: dict[str, str] = {g.name: _why_frozen(g, inp.now, spec.cooldown_seconds) for g in frozen_gpus}
    recut_later = {
        g.name: _why_frozen(g, inp.now, spec.cooldown_seconds) for g in usable if g.name in cooling | failed
    }
    budget = spec.disruption_budget.max_gpus_reshaping
    # MIG mode switches (their GPUs unusable meanwhile) count against the budget as reshaping GPUs do.
    in_flight = sum(1 for g in usable if g.reshaping) + len(switch_changes(inp.gpus))
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
                held[w.gpu] = f"{w.gpu} idle for {fmt_secs(idle_for)}, returns to baseline after {cooldown}s"
                continue
        if in_flight + len(writes) >= budget:
            held[w.gpu] = (
                f"{in_flight + len(writes)} of {budget} GPUs allowed by the disruption budget are reshaping"
            )
            continue
        writes.append(w)

    written = {w.gpu for w in writes}
    # A GPU in its cooldown that gains nothing this round is held by it (its status says so).
    for name in sorted(cooling - written):
        held.setdefault(name, recut_later[name])
    planned_by_gpu = {w.gpu: w for w in planned}
    for c in to_plan:
        names = [d.name for d in demands_of[c.claim.key]]
        placed = [a for n in names for a in assigned.get(n, [])]
        profile = first_profile(c)
        if not placed or any(n in result.unsatisfied for n in names):
            if booked:
                # Nothing ahead for it, but the scheduler may still book a placement on a partitionable GPU.
                fallback = booking_verdict(c, policy, booked, mates.get(c.claim.key, ()))
                if fallback.reason is not Reason.NO_CAPACITY:
                    verdicts.append(fallback)
                    continue
            moving = [g.name for g in usable if g.reshaping]
            if moving:
                msg = (
                    f"{len(moving)} GPU(s) of policy {policy.name} are still reshaping "
                    f"({', '.join(moving)}); "
                    f"the claim is planned again when they finish. Now: {no_capacity_text(c, policy, usable)}"
                )
                verdicts.append(ClaimVerdict(c, Reason.RESHAPE_IN_PROGRESS, msg, profile))
            elif cooling or failed:
                msg = (
                    f"no GPU of policy {policy.name} has room for the claim without a re-cut it may not "
                    "make now; "
                    + "; ".join(recut_later[name] for name in sorted(cooling | failed))
                    + "; the claim is planned again when they may change"
                )
                reason = Reason.WAITING_FOR_COOLDOWN if cooling and not failed else Reason.NO_CAPACITY
                verdicts.append(ClaimVerdict(c, reason, msg, profile))
            else:
                verdicts.append(
                    ClaimVerdict(c, Reason.NO_CAPACITY, no_capacity_text(c, policy, usable), profile)
                )
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
    verdicts.extend(booking_verdict(c, policy, booked, mates.get(c.claim.key, ())) for c in to_book)
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
    allowed = policy_allowed(policy)
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
        WaitingClaim(c.claim.key, count, frozenset(accepted_profiles(c, allowed)), c.nodes)
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
