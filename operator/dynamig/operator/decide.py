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
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.model import Layout, PlacedInstance
from dynamig.kube.gpupartition import layout_summary
from dynamig.kube.policy import GpuPartitionPolicy, Mode, SpecProblem
from dynamig.operator.demand import PendingClaim
from dynamig.operator.inventory import GpuView
from dynamig.planner import plan
from dynamig.planner.model import Assignment, ClaimDemand, GpuPlan, PlanResult


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


WARNING_REASONS = frozenset(
    {Reason.NO_CAPACITY, Reason.PROFILE_NOT_ALLOWED, Reason.NO_MATCHING_PROFILE, Reason.NO_ELIGIBLE_NODE}
)


@dataclass(frozen=True, slots=True)
class ClaimVerdict:
    claim: PendingClaim
    reason: Reason
    message: str
    profile: str  # the profile the claim is counted under (first acceptable one, "" if none)
    gpu: str = ""  # GPU the plan puts it on, if any

    @property
    def warning(self) -> bool:
        return self.reason in WARNING_REASONS


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
class RoundDecision:
    writes: tuple[LayoutWrite, ...]
    planned: tuple[LayoutWrite, ...]  # every change the plan wants (DryRun reports these)
    verdicts: tuple[ClaimVerdict, ...]
    held: Mapping[str, str] = field(default_factory=dict)  # GPU -> why its planned change is not written
    plan_seconds: float = 0.0

    def pending_by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.verdicts:
            out[v.reason.value] = out.get(v.reason.value, 0) + 1
        return dict(sorted(out.items()))

    def pending_by_profile(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.verdicts:
            key = v.profile or "none"
            devices = sum(r.count for r in v.claim.requests)
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
    return ""


def _static_verdict(claim: PendingClaim, policy: GpuPartitionPolicy, gpus: Sequence[GpuView]) -> ClaimVerdict:
    allowed = _allowed(policy)
    alts = _alts(claim, allowed, _models(gpus))
    free: dict[str, int] = {}
    for g in gpus:
        for inst in g.free:
            free[inst.profile] = free.get(inst.profile, 0) + 1
    serving = [p for p in alts if free.get(p, 0) >= max(r.count for r in claim.requests)]
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


def _models(gpus: Sequence[GpuView]) -> frozenset[str]:
    return frozenset(g.model.key for g in gpus if g.model is not None)


def _demands(
    claim: PendingClaim, policy: GpuPartitionPolicy, models: frozenset[str]
) -> tuple[ClaimDemand, ...]:
    return claim.planner_demands(_allowed(policy), models)


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
        early = _profile_verdict(c, policy, usable)
        if early is not None:
            verdicts.append(early)
        else:
            plannable.append(c)

    if spec.mode == Mode.STATIC:
        verdicts.extend(_static_verdict(c, policy, usable) for c in plannable)
        return RoundDecision((), (), tuple(verdicts))

    models = _models(usable)
    demands = [d for c in plannable for d in _demands(c, policy, models)]
    planner_policy = spec.to_planner()
    started = time.perf_counter()
    result: PlanResult = plan([g.state() for g in usable], demands, planner_policy, inp.catalog)
    plan_seconds = time.perf_counter() - started

    by_key = {(g.node, g.index): g for g in usable}
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
        planned.append(_write_for(g, gp, tuple(sorted(set(claims_per_gpu.get(g.name, []))))))

    writes: list[LayoutWrite] = []
    held: dict[str, str] = {}
    budget = spec.disruption_budget.max_gpus_reshaping
    in_flight = sum(1 for g in usable if g.in_flight and g.desired != g.actual)
    cooldown = spec.cooldown_seconds
    # Claim-serving changes first, then baseline / warm-pool drift.
    for w in sorted(planned, key=lambda w: (not w.claims, w.gpu)):
        g = next(x for x in usable if x.name == w.gpu)
        if g.in_flight:
            held[w.gpu] = (
                f"{w.gpu} is still reshaping (generation {g.generation}, "
                f"agent reported {g.observed_generation})"
            )
            continue
        if spec.mode == Mode.DRY_RUN:
            held[w.gpu] = f"policy {policy.name} is DryRun"
            continue
        warm_only = not w.claims and "warm pool" in w.reason and "baseline" not in w.reason
        if (w.claims or warm_only) and g.last_written is not None and inp.now - g.last_written < cooldown:
            left = cooldown - (inp.now - g.last_written)
            held[w.gpu] = (
                f"{w.gpu} was reshaped {_fmt_secs(inp.now - g.last_written)} ago; cooldown {cooldown}s "
                f"({_fmt_secs(left)} left)"
            )
            continue
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
    for c in plannable:
        names = [d.name for d in _demands(c, policy, models)]
        placed = [a for n in names for a in assigned.get(n, [])]
        profile = _first_profile(c)
        if not placed or any(n in result.unsatisfied for n in names):
            moving = [g.name for g in usable if g.in_flight and g.desired != g.actual]
            if moving:
                msg = (
                    f"{len(moving)} GPU(s) of policy {policy.name} are still reshaping "
                    f"({', '.join(moving)}); "
                    f"the claim is planned again when they finish. Now: {_no_capacity(c, policy, usable)}"
                )
                verdicts.append(ClaimVerdict(c, Reason.RESHAPE_IN_PROGRESS, msg, profile))
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
    return RoundDecision(tuple(writes), tuple(planned), tuple(verdicts), held, plan_seconds)


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


def _no_capacity(claim: PendingClaim, policy: GpuPartitionPolicy, gpus: Sequence[GpuView]) -> str:
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
        f"no room for {count} x {' or '.join(alts)}{nodes} among the {len(gpus)} GPUs "
        f"of policy {policy.name}: "
        f"{busy_slices} of {total_slices} compute slices are allocated"
    )
