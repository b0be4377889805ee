"""Why a pending claim waits: the Event reasons on claims and their pods, the verdict that carries one with
its message, and the verdicts that need no plan (a Static policy, no profile or node that fits, a claim of
whole GPUs, a claim the scheduler fails on). Messages give numbers: what the claim accepts, what is free,
what is allocated. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from dynamig.kube.names import WHOLE_PROFILE
from dynamig.kube.policy import GpuPartitionPolicy
from dynamig.operator.demand import PendingClaim
from dynamig.operator.inventory import GpuView


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


def fmt_secs(s: float) -> str:
    return f"{max(0, round(s))}s"


def accepted_profiles(
    claim: PendingClaim, allowed: frozenset[str] | None, models: frozenset[str] | None = None
) -> tuple[str, ...]:
    out: list[str] = []
    for r in claim.requests:
        for p in r.alternatives(allowed, models):
            if p not in out:
                out.append(p)
    return tuple(out)


def first_profile(claim: PendingClaim) -> str:
    for r in claim.requests:
        alts = r.alternatives()
        if alts:
            return alts[0]
    return WHOLE_PROFILE if claim.whole and not claim.requests else ""


def static_verdict(claim: PendingClaim, policy: GpuPartitionPolicy, gpus: Sequence[GpuView]) -> ClaimVerdict:
    allowed = policy_allowed(policy)
    alts = accepted_profiles(claim, allowed, models_of(gpus))
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
            first_profile(claim),
        )
    return ClaimVerdict(
        claim,
        Reason.RESHAPE_DISABLED,
        f"policy {policy.name} is Static and never reshapes; the claim accepts {' or '.join(alts)} but the "
        f"{len(gpus)} GPUs it governs have free instances of: {free_text}",
        first_profile(claim),
    )


def policy_allowed(policy: GpuPartitionPolicy) -> frozenset[str] | None:
    a = policy.spec.allowed_profiles
    return frozenset(a) if a is not None else None


def profile_verdict(
    claim: PendingClaim, policy: GpuPartitionPolicy, gpus: Sequence[GpuView]
) -> ClaimVerdict | None:
    """NoMatchingProfile / ProfileNotAllowed / NoEligibleNode, or None when the claim is plannable."""
    accepted = accepted_profiles(claim, None, models_of(gpus))
    if not accepted:
        models = sorted({g.model.key for g in gpus if g.model is not None})
        errors = "; ".join(dict.fromkeys(e for r in claim.requests for e in r.errors))
        names = ", ".join(models) or "the governed GPU models"
        msg = f"no MIG profile of {names} satisfies the claim's selectors"
        return ClaimVerdict(claim, Reason.NO_MATCHING_PROFILE, f"{msg}: {errors}" if errors else msg, "")
    allowed = policy_allowed(policy)
    if not accepted_profiles(claim, allowed, models_of(gpus)):
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


def plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def serves_whole(claim: PendingClaim, g: GpuView) -> bool:
    """Whether ``g``'s whole GPU, with its own NVLink facts, serves every whole-GPU request of ``claim``: a
    claim selecting on ``nvlinkActiveLinks`` or the fabric accepts a model, yet not each GPU of it. Pure."""
    return g.model is not None and claim.accepts_whole_gpu(g.model, g.product, g.nvlink)


def whole_verdict(
    claim: PendingClaim, policy: GpuPartitionPolicy, gpus: Sequence[GpuView]
) -> ClaimVerdict | None:
    """WaitingForWholeGpu for a claim that needs whole GPUs (MIG mode off), or None when it needs none, or
    when it has MIG requests too and a GPU with MIG mode off can serve the rest (then it is planned for its
    MIG requests). ``gpus``: every GPU the policy governs, unusable ones included. Pure."""
    if not claim.whole:
        return None
    wanted = claim.whole_by_model(models_of(gpus))
    eligible = [g for g in gpus if claim.nodes is None or g.node in claim.nodes]
    serving = [g for g in eligible if g.whole and serves_whole(claim, g)]
    if claim.requests and serving:
        return None
    n = claim.whole_gpus
    what = "a whole GPU" if n == 1 else f"{n} whole GPUs"
    accepted = list(wanted) or list(dict.fromkeys(m for r in claim.whole for m in r.whole_models()))
    of = f" of {' or '.join(accepted)}" if accepted else ""
    mig = (
        f" besides its {plural(len(claim.requests), 'MIG request', 'MIG requests')}" if claim.requests else ""
    )
    head = f"the claim asks for {what}{of} (a GPU with MIG mode off){mig}, which no MIG slice serves"
    if serving:
        names = ", ".join(g.name for g in serving[:4]) + (
            f" (+{len(serving) - 4} more)" if len(serving) > 4 else ""
        )
        return ClaimVerdict(
            claim,
            Reason.WAITING_FOR_WHOLE_GPU,
            f"{head}; {plural(len(serving), 'GPU', 'GPUs')} of policy {policy.name} with MIG mode off can "
            f"serve it ({names}): waiting for kube-scheduler to allocate {'one' if n == 1 else n}",
            WHOLE_PROFILE,
            serving[0].name,
        )
    where = (
        f" on the {plural(len({g.node for g in eligible}), 'node', 'nodes')} the pod may use"
        if claim.nodes is not None
        else ""
    )
    whole_elsewhere = sum(1 for g in gpus if g.whole) - sum(1 for g in eligible if g.whole)
    elsewhere = (
        f" ({plural(whole_elsewhere, 'GPU', 'GPUs')} with MIG mode off elsewhere, not on them)"
        if claim.nodes is not None and whole_elsewhere
        else ""
    )
    # None serves it here, so a whole GPU of a model it accepts fails on its own NVLink facts.
    unfit = [g.name for g in eligible if g.whole and g.model is not None and g.model.key in wanted]
    unfit_text = (
        f" that its selectors accept ({', '.join(unfit[:4])}: MIG mode off, their NVLink facts fail)"
        if unfit
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
        f"{head}; no GPU{of} of policy {policy.name}{where} has MIG mode off{unfit_text}{elsewhere}{fixed}"
        f"{planned}",
        WHOLE_PROFILE,
        warn=True,
    )


def scheduler_error_verdict(claim: PendingClaim) -> ClaimVerdict | None:
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
        first_profile(claim),
    )


def models_of(gpus: Sequence[GpuView]) -> frozenset[str]:
    return frozenset(g.model.key for g in gpus if g.model is not None)


def no_capacity_text(
    claim: PendingClaim, policy: GpuPartitionPolicy, gpus: Sequence[GpuView], kind: str = ""
) -> str:
    alts = accepted_profiles(claim, policy_allowed(policy), models_of(gpus))
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
