"""MIG mode on demand: which GPU's MIG mode to switch for the pending claims of one policy, and what to tell
them. Pure.

A GPU with MIG mode off is published whole (``gpu<index>``, profile ``whole``); one with MIG mode on offers
MIG slices. Under a policy whose ``spec.migMode.policy`` is ``Dynamic`` (in ``spec.mode`` Dynamic) the
operator asks a node agent to switch a GPU (GpuPartition ``spec.migMode``; the agent withdraws the GPU's
devices, waits until nothing uses them, and switches through NVML):

- **off** (``Disabled``, with ``spec.layout: []`` and ``spec.offeredProfiles: []``) for a claim asking for
  whole GPUs (``PendingClaim.whole``) that no free GPU with MIG mode off (and none already switching off) of a
  model it accepts, on a node its pod may use, can take: one idle MIG GPU (MIG mode on, no allocated or busy
  instance, no held placement, not reshaping, not Degraded or otherwise unfit) of such a model and node,
  whose whole GPU the claim's selectors accept with the GPU's own NVLink facts (``nvlinkActiveLinks``, the
  fabric: the agent reports them whatever the MIG mode). The GPU whose switch disturbs least goes first:
  the fewest free instances to destroy.
- **on** (``Enabled``) for MIG claims the round left ``NoCapacity``: one free whole GPU (nothing allocated or
  running, no claim) of a model with a profile every MIG request of the claim accepts, that no pending
  whole-GPU claim could take and complete on its node (as many of the node's GPUs as it asks could be whole
  for it).

Limits, each told to the claim when it is what stops a switch: the policy's ``Fixed`` MIG mode (nothing is
switched; ``decide`` says so); models whose switch resets the GPU (Ampere,
:func:`dynamig.geometry.generation.mode_switch_needs_reset`) unless ``allowReset``; the floors
``minMigGpus`` / ``minWholeGpus`` (governed GPUs kept in each mode, counted by the mode each GPU has or is
switching to); the per-GPU ``cooldownSeconds`` since the operator last wrote ``spec.migMode`` (annotation
``dynamig.io/mig-mode-written-at``); the switches of one round all for one claim on one node (a claim of
several whole GPUs gets the GPUs it lacks on its node switched together); and the disruption budget,
which switches count against as reshaping GPUs do, the GPUs one claim has switched on one node as one change
(they are idle and kept for that claim: an eight-GPU claim's switches under a budget of one run together,
not one after another).

A GPU whose agent answered ``ResetRequired`` (a platform that exposes no GPU reset: a pass-through VM) is
never asked for that mode again: the operator records the mode in the annotation
``dynamig.io/mig-mode-reset-required``, withdraws its own request (``spec.migMode`` back to the mode NVML
reports, which gives the GPU back), and skips the GPUs of the same model on the same node for that mode too
(the platform is the node's). An administrator removes the annotation once the platform exposes the reset.

The caller writes :attr:`ModeDecision.switches` and :attr:`ModeDecision.resets`, and posts
:attr:`ModeDecision.verdicts` (every verdict of the round; those of claims a switch concerns rewritten:
``WaitingForWholeGpu`` says what is switched for the claim, or why nothing can be; a MIG claim a GPU is
switched on for is ``WaitingForMigModeSwitch``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dynamig.geometry.generation import mode_switch_needs_reset
from dynamig.geometry.layout import remaining_capacity
from dynamig.geometry.model import GpuModel, PlacedInstance
from dynamig.kube.gpupartition import Hold, HoldKind, InstanceState, MigMode, MigModeRequest
from dynamig.kube.gpupartition import layout_summary as _summary
from dynamig.kube.names import WHOLE_PROFILE
from dynamig.kube.policy import GpuPartitionPolicy, Mode
from dynamig.kube.times import micro_time
from dynamig.operator.decide import RoundDecision
from dynamig.operator.demand import PendingClaim
from dynamig.operator.inventory import (
    MIG_MODE_FOR_ANNOTATION,
    MIG_MODE_REQUESTED_ANNOTATION,
    MIG_MODE_RESET_ANNOTATION,
    MIG_MODE_WRITTEN_ANNOTATION,
    GpuView,
    switch_changes,
)
from dynamig.operator.verdicts import ClaimVerdict, Reason, serves_whole
from dynamig.planner.reserve import IdleNode, WaitingClaim, keep_idle_nodes

OFF, ON = MigModeRequest.DISABLED, MigModeRequest.ENABLED
# How long a GPU is kept whole for a claim of whole GPUs (its switch, an A100's reset included, and the
# scheduler's next try fit well within it); a claim still waiting then is kept for again.
WHOLE_HOLD_SECONDS = 900.0


def _word(mode: MigModeRequest) -> str:
    return "off" if mode is OFF else "on"


def _other(mode: MigModeRequest) -> MigModeRequest:
    return ON if mode is OFF else OFF


@dataclass(frozen=True, slots=True)
class ModeSwitch:
    """A GPU whose ``spec.migMode`` is to be written, and for which claim."""

    gpu: str
    node: str
    model: str
    to: MigModeRequest
    claim: str  # key (namespace/name) of the claim it is switched for
    destroys: tuple[PlacedInstance, ...]  # free MIG instances the agent destroys (switching off)
    message: str  # for the Events on the GpuPartition and the policy

    def spec(self) -> dict[str, Any]:
        """The spec fields to merge-patch: ``migMode`` (and, switching off, no layout and no offers)."""
        out: dict[str, Any] = {"migMode": self.to.value}
        if self.to is OFF:
            out["layout"] = []
            out["offeredProfiles"] = []
        return out

    def annotations(self, stamp: str) -> dict[str, str]:
        """The annotations written with it (``stamp``: now, RFC 3339): the cooldown starts here."""
        return {
            MIG_MODE_WRITTEN_ANNOTATION: stamp,
            MIG_MODE_REQUESTED_ANNOTATION: self.to.value,
            MIG_MODE_FOR_ANNOTATION: self.claim,
        }


@dataclass(frozen=True, slots=True)
class ResetRequired:
    """A GPU whose agent answered ResetRequired for ``mode``: recorded so it is never asked again, and the
    operator's own request withdrawn (``revert``: the spec.migMode written back; None: a person asked for it,
    and it is left)."""

    gpu: str
    mode: MigModeRequest
    modes: tuple[str, ...]  # the annotation's value, this mode included
    revert: MigModeRequest | None
    message: str

    def spec(self) -> dict[str, Any]:
        return {"migMode": self.revert.value} if self.revert is not None else {}

    def annotations(self) -> dict[str, str]:
        out = {MIG_MODE_RESET_ANNOTATION: ",".join(self.modes)}
        if self.revert is not None:
            out[MIG_MODE_REQUESTED_ANNOTATION] = self.revert.value
        return out


@dataclass(frozen=True, slots=True)
class WholeKeep:
    """A GPU to keep whole for one claim of whole GPUs (a hold of the whole GPU in its ``spec.holds``): one
    switched off for it, or free with MIG mode off and counted for it while others still switch."""

    gpu: str
    claim: str  # namespace/name
    claim_uid: str
    why: str = "while GPUs switch"  # ends the WholeGpuKept Event's sentence

    def hold(self, now: float, seconds: float = WHOLE_HOLD_SECONDS) -> Hold:
        """The hold written (``now``: epoch seconds)."""
        return Hold(
            claim=self.claim,
            claim_uid=self.claim_uid,
            kind=HoldKind.WHOLE,
            profile=WHOLE_PROFILE,
            start=0,
            created_at=micro_time(now),
            expires_at=micro_time(now + seconds),
        )


@dataclass(frozen=True, slots=True)
class WholeRelease:
    """A GPU kept whole for a claim that is kept on another node now: its hold is taken out with the round,
    rather than standing until it expires while the claim waits elsewhere."""

    gpu: str
    claim: str  # namespace/name
    node: str  # where the claim is kept now

    @property
    def why(self) -> str:
        return f"claim {self.claim} is kept on node {self.node} now"


@dataclass(frozen=True, slots=True)
class ModeDecision:
    switches: tuple[ModeSwitch, ...] = ()  # to write now (all for one claim, on one node)
    keeps: tuple[WholeKeep, ...] = ()  # GPUs to keep whole for a claim (holds written with the round)
    releases: tuple[WholeRelease, ...] = ()  # holds of claims kept elsewhere now (taken out with the round)
    planned: tuple[ModeSwitch, ...] = ()  # DryRun: what Dynamic would write
    resets: tuple[ResetRequired, ...] = ()
    verdicts: tuple[ClaimVerdict, ...] = ()  # the round's verdicts, those a switch concerns rewritten


@dataclass(frozen=True, slots=True)
class ModeInput:
    policy: GpuPartitionPolicy
    gpus: tuple[GpuView, ...]  # every GPU the policy governs, unusable ones included
    decision: RoundDecision  # the round's layout writes and verdicts (decide_round)
    now: float


def _secs(s: float) -> str:
    return f"{max(0, round(s))}s"


def _names(gpus: Sequence[str], limit: int = 3) -> str:
    more = len(gpus) - limit
    return ", ".join(gpus[:limit]) + (f" (+{more} more)" if more > 0 else "")


def _free_whole(g: GpuView, claim: str = "") -> bool:
    """A GPU with MIG mode off whose whole device is free: published, nothing allocated or running, and not
    kept whole for a claim other than ``claim``."""
    w = g.whole_gpu
    return (
        g.whole
        and g.whole_hold in ("", claim)
        and not g.trouble
        and w is not None
        and w.state is InstanceState.FREE
        and w.published
        and not w.claims
        and not w.processes
    )


def _offered_whole(g: GpuView, claim: str = "") -> bool:
    """A GPU with MIG mode on whose agent publishes its whole device beside its slices (``spec.offerWhole``,
    ``status.wholeOffered``): the scheduler books it, and the agent switches MIG off for that booking."""
    return (
        g.offer_whole
        and g.whole_offered
        and g.switching is None
        and g.mode_target is ON
        and g.whole_hold in ("", claim)
        and not g.trouble
    )


# Verdicts of MIG claims no GPU with MIG mode on can serve: no room, or none of a model and node they accept
# (where every GPU of the right model has MIG mode off, the claim is told NoMatchingProfile or
# NoEligibleNode).
_NO_MIG_GPU = frozenset({Reason.NO_CAPACITY, Reason.NO_MATCHING_PROFILE, Reason.NO_ELIGIBLE_NODE})


def _fits_empty(model: GpuModel, claim: PendingClaim, allowed: frozenset[str] | None) -> bool:
    """Every MIG request of ``claim`` has an allowed profile of ``model`` that an empty GPU of it holds as
    many of as the request asks. Pure."""
    if not claim.requests:
        return False
    for r in claim.requests:
        alts = r.alternatives(allowed, frozenset({model.key}))
        if not any(remaining_capacity(model, (), p) >= r.count_for(p) for p in alts):
            return False
    return True


@dataclass
class _Round:
    """What one policy's MIG mode round has decided so far (mutable, local to :func:`decide_modes`)."""

    inp: ModeInput
    gpus: list[GpuView]
    budget_left: int
    changes: set[tuple[str, str]]  # (node, claim) of the switches counted against the budget
    mig: int  # governed GPUs with MIG mode on, or switching on
    whole: int  # governed GPUs with MIG mode off, or switching off
    reset_nodes: dict[tuple[str, str, MigModeRequest], str]  # (node, model, mode) -> GPU that answered it
    taken: set[str] = field(default_factory=set)  # GPUs counted for a whole-GPU claim this round
    switches: list[ModeSwitch] = field(default_factory=list)

    @property
    def policy(self) -> GpuPartitionPolicy:
        return self.inp.policy

    @property
    def dry_run(self) -> bool:
        return self.policy.spec.mode == Mode.DRY_RUN

    def eligible(self, claim: PendingClaim, g: GpuView) -> bool:
        return g.model is not None and (claim.nodes is None or g.node in claim.nodes)

    def why_not(self, g: GpuView, to: MigModeRequest) -> tuple[str, bool] | None:
        """Why ``g`` may not be switched ``to`` now, and whether only time stands in the way (a cooldown, a
        reshape under way); None when it may."""
        assert g.model is not None
        mm = self.policy.spec.mig_mode
        if g.trouble:
            return g.trouble, False
        if g.mode_reset_stuck:
            return f"the agent answered ResetRequired switching MIG {_word(g.mode_wanted or to)}", False
        if to is OFF:
            if g.mig_mode is not MigMode.ENABLED:
                return f"MIG mode is {g.mig_mode.value}", False
            if g.busy or g.claims_on:
                n = len(g.busy | set(g.claims_on))
                return f"{n} MIG instance(s) allocated or in use", False
            if g.holds:
                return f"{len(g.holds)} placement(s) held for waiting claims", False
        elif g.whole_hold:
            return f"its whole GPU is kept for claim {g.whole_hold}", True
        elif not _free_whole(g):
            w = g.whole_gpu
            state = "not published" if w is None or not w.published else w.state.value
            return f"the whole GPU is {state}", False
        if mode_switch_needs_reset(g.model.key) and not mm.allow_reset:
            return (
                f"{g.model.key} switches MIG mode only through a GPU reset, and policy {self.policy.name}'s "
                "spec.migMode.allowReset is false",
                False,
            )
        if to in g.reset_required:
            return f"the agent answered ResetRequired for MIG mode {_word(to)} here: not asked again", False
        other = self.reset_nodes.get((g.node, g.model.key, to))
        if other is not None and other != g.name:
            return (
                f"{other} on the same node answered ResetRequired for MIG mode {_word(to)} (its platform "
                "exposes no GPU reset)",
                False,
            )
        if g.in_flight:
            return "its layout is being applied", True
        if any(w.gpu == g.name for w in self.inp.decision.writes):
            return "its layout is written this round", True
        if g.mode_written is not None and self.inp.now - g.mode_written < mm.cooldown_seconds:
            since = self.inp.now - g.mode_written
            left = _secs(mm.cooldown_seconds - since)
            return f"switched {_secs(since)} ago, cooldown {mm.cooldown_seconds}s ({left} left)", True
        return None

    def blocked(self, to: MigModeRequest, claim: str = "", node: str = "") -> tuple[str, bool] | None:
        """What stops any switch ``to`` this round (policy-wide), and whether only time stands in the way.
        The switches of one round are all for one claim, on one node (``claim``, ``node``: the switch asked
        for): a claim of several whole GPUs gets its node's GPUs switched together."""
        mm = self.policy.spec.mig_mode
        if self.policy.spec.mode == Mode.STATIC:
            return f"policy {self.policy.name} is Static and changes no GPU, its MIG mode included", False
        if to is OFF and self.mig - 1 < mm.min_mig_gpus:
            return (
                f"policy {self.policy.name} keeps at least {mm.min_mig_gpus} GPU(s) with MIG mode on "
                f"(spec.migMode.minMigGpus) and has {self.mig}",
                False,
            )
        if to is ON and self.whole - 1 < mm.min_whole_gpus:
            return (
                f"policy {self.policy.name} keeps at least {mm.min_whole_gpus} GPU(s) with MIG mode off "
                f"(spec.migMode.minWholeGpus) and has {self.whole}",
                False,
            )
        if self.switches and any(s.claim != claim or s.node != node for s in self.switches):
            first = self.switches[0]
            return (
                f"the MIG mode switches of a round are for one claim on one node: {first.gpu} is switched "
                f"for {first.claim} first; planned again next round",
                True,
            )
        if self.budget_left <= 0 and (node, claim) not in self.changes:
            budget = self.policy.spec.disruption_budget.max_gpus_reshaping
            return (
                f"the disruption budget allows {budget} GPU(s) reshaping or switching at once, and that many "
                "are",
                True,
            )
        return None

    def switch(self, g: GpuView, to: MigModeRequest, claim: PendingClaim, why: str) -> ModeSwitch:
        assert g.model is not None
        destroys = tuple(g.actual) if to is OFF else ()
        if to is OFF:
            what = (
                f"the agent destroys its {len(destroys)} free MIG instance(s) ({_summary(destroys)}) and "
                "switches once nothing uses it"
                if destroys
                else "it has no MIG instance; the agent switches once nothing uses it"
            )
        else:
            what = "the agent switches once nothing uses it; its MIG layout is planned after"
        message = (
            f"policy {self.policy.name}: switching {g.name} ({g.model.key}) MIG mode {_word(to)} for claim "
            f"{claim.claim.key} ({why}): {what}"
        )
        s = ModeSwitch(g.name, g.node, g.model.key, to, claim.claim.key, destroys, message)
        self.switches.append(s)
        if (g.node, s.claim) not in self.changes:  # the claim's switches on a node are one change
            self.changes.add((g.node, s.claim))
            self.budget_left -= 1
        if to is OFF:
            self.mig, self.whole = self.mig - 1, self.whole + 1
        else:
            self.mig, self.whole = self.mig + 1, self.whole - 1
        return s


def _reasons(rejected: Sequence[tuple[GpuView, str]], limit: int = 4) -> str:
    shown = "; ".join(f"{g.name}: {why}" for g, why in rejected[:limit])
    more = len(rejected) - limit
    return shown + (f" (+{more} more GPU(s))" if more > 0 else "")


def _reset_marks(gpus: Sequence[GpuView]) -> tuple[ResetRequired, ...]:
    """A record for each GPU whose agent newly answered ResetRequired for spec.migMode. Pure."""
    out: list[ResetRequired] = []
    for g in gpus:
        want = g.mode_wanted
        if not g.mode_reset_stuck or want is None or want in g.reset_required:
            continue
        modes = tuple(sorted({m.value for m in g.reset_required} | {want.value}))
        revert = _other(want) if g.mode_by_operator else None
        model = g.model.key if g.model is not None else g.product
        back = (
            f"; its request is withdrawn (spec.migMode back to {revert.value}) and the GPU returns to service"
            if revert is not None
            else "; spec.migMode was not written by dynamig and is left as it is"
        )
        out.append(
            ResetRequired(
                g.name,
                want,
                modes,
                revert,
                f"{g.name} ({model}): the agent answered ResetRequired switching MIG mode {_word(want)}: "
                "this platform exposes no GPU reset (a pass-through VM; a VM reboot would apply it). dynamig "
                f"does not ask it (nor GPUs of its model on node {g.node}) for MIG mode {_word(want)} "
                f"again{back}; remove annotation {MIG_MODE_RESET_ANNOTATION} once the platform exposes the "
                "reset",
            )
        )
    return tuple(out)


def decide_modes(inp: ModeInput) -> ModeDecision:
    """The MIG mode switches of one policy's round and the verdicts they change (module docstring). Pure."""
    policy = inp.policy
    resets = _reset_marks(inp.gpus)
    verdicts = list(inp.decision.verdicts)
    if not policy.spec.mig_mode.dynamic:
        return ModeDecision(resets=resets, verdicts=tuple(verdicts))
    # A GPU kept whole for a claim no longer waiting (allocated, deleted) keeps nothing: the preempter
    # releases the hold later in the round (operator/preempting.py), and this round must not wait on it.
    waiting = {v.claim.claim.key for v in verdicts}
    gpus = [
        replace(g, whole_hold="") if g.whole_hold and g.whole_hold not in waiting else g
        for g in inp.gpus
        if g.model is not None
    ]
    in_flight = sum(1 for g in gpus if not g.unusable and g.reshaping)
    changes = switch_changes(gpus)
    in_flight += len(changes)
    reset_nodes: dict[tuple[str, str, MigModeRequest], str] = {}
    for g in gpus:
        assert g.model is not None
        stuck = {g.mode_wanted} if g.mode_reset_stuck and g.mode_wanted is not None else set()
        for mode in g.reset_required | stuck:
            reset_nodes.setdefault((g.node, g.model.key, mode), g.name)
    r = _Round(
        inp=inp,
        gpus=gpus,
        budget_left=policy.spec.disruption_budget.max_gpus_reshaping - in_flight - len(inp.decision.writes),
        changes=changes,
        mig=sum(1 for g in gpus if g.mode_target is ON),
        whole=sum(1 for g in gpus if g.mode_target is OFF),
        reset_nodes=reset_nodes,
    )
    models = frozenset(g.model.key for g in gpus if g.model is not None)
    whole_claims = [
        i for i, v in enumerate(verdicts) if v.claim.whole and v.reason is Reason.WAITING_FOR_WHOLE_GPU
    ]
    # Pass 1: GPUs switching off for a claim are counted for it first, then the free whole GPUs and the other
    # GPUs switching off go to the waiting claims in order; what is left short is switched for in pass 2.
    for i in whole_claims:
        claim = verdicts[i].claim
        for g in gpus:
            mine = (g.switching is OFF and g.mode_for == claim.claim.key) or (
                g.whole_hold == claim.claim.key and g.mode_target is OFF
            )
            if mine and r.eligible(claim, g):
                r.taken.add(g.name)
    supply = {i: _count_supply(r, verdicts[i].claim, models) for i in whole_claims}
    # Pass 2, claims in order (oldest first): switch for the first that needs it.
    for i, v in enumerate(verdicts):
        if i in supply:
            verdicts[i] = _whole_claim(r, v, supply[i], models)
        elif v.reason in _NO_MIG_GPU and v.claim.requests:
            verdicts[i] = _mig_claim(r, v, verdicts, whole_claims, models)
    held = [g.name for g in gpus if g.whole_hold and g.mode_target is ON]
    if held:  # the planner left them out: say why a MIG claim gets no room there
        for i, v in enumerate(verdicts):
            if v.reason is Reason.NO_CAPACITY and v.claim.requests:
                kept = f"{_names(held)} kept whole for claims of whole GPUs: nothing is cut there for it"
                verdicts[i] = replace(v, message=f"{v.message}; {kept}")
    switches = tuple(r.switches)
    if r.dry_run:
        return ModeDecision(planned=switches, resets=resets, verdicts=tuple(verdicts))
    keeps, releases = _keeps(r, [verdicts[i].claim for i in whole_claims], [supply[i] for i in whole_claims])
    for i in whole_claims:
        held_for = [k.gpu for k in keeps if k.claim == verdicts[i].claim.claim.key]
        if held_for:
            v = verdicts[i]
            kept = f"{_names(held_for)} kept whole for it (no other claim is booked there while it waits)"
            verdicts[i] = replace(v, message=f"{v.message}; {kept}", warn=False)
    return ModeDecision(
        switches=switches, keeps=keeps, releases=releases, resets=resets, verdicts=tuple(verdicts)
    )


def _keeps(
    r: _Round, claims: Sequence[PendingClaim], supplies: Sequence[_Supply]
) -> tuple[tuple[WholeKeep, ...], tuple[WholeRelease, ...]]:
    """The GPUs to keep whole for each claim of whole GPUs no node serves now, so nobody else books them (the
    agent answers PlacementHeld and retires their free instances; the planner plans nothing there) while
    the GPUs it lacks switch, one round or budget at a time:

    - a claim GPUs are switched off for (this round or before), or GPUs are already kept for: on that node,
      the GPUs switched, the free whole GPUs counted for it, and the idle MIG GPUs it still lacks there;
    - a claim of several whole GPUs with nothing switched or kept for it yet (its switch waits for the
      disruption budget, a cooldown, or another claim's round): an idle node, the choice
      :func:`dynamig.planner.reserve.keep_idle_nodes` makes for multi-device MIG claims (largest claim
      first, the smallest idle node that holds it), as many of its GPUs as it asks, free whole GPUs first.
      A node is idle when none of its GPUs is allocated, in use, held, switching on or unfit.

    A claim free whole GPUs serve at once gets none (the scheduler books them in its next cycle; a hold
    would make it wait on binding conditions). GPUs kept for a claim on another node than the one it is kept
    on now (its switches went elsewhere: the kept GPUs could not be switched in time) are released."""
    out: list[WholeKeep] = []
    releases: list[WholeRelease] = []
    by_name = {g.name: g for g in r.gpus}
    held = {g.name: g.whole_hold for g in r.gpus if g.whole_hold}  # GPU -> claim kept for, as decided
    for_idle: list[PendingClaim] = []
    for claim, supply in zip(claims, supplies, strict=True):
        key = claim.claim.key
        switched = [s.gpu for s in r.switches if s.claim == key]
        switching = [g.name for g in supply.gpus if g.switching is OFF and g.mode_for == key]
        mine = [name for name, c in held.items() if c == key]
        if not switched and not switching and (supply.enough or not mine):
            if not supply.enough and claim.whole_gpus > 1:
                for_idle.append(claim)
            continue
        node = by_name[(switched or switching or mine)[0]].node
        releases += [WholeRelease(name, key, node) for name in mine if by_name[name].node != node]
        keep = [*switched, *(g.name for g in supply.gpus), *mine]
        keep = [n for n in dict.fromkeys(keep) if by_name[n].node == node]
        lacking = [
            g
            for g in r.gpus
            if g.node == node and g.name not in keep and g.name not in held and _could_keep(r, claim, g)
        ]
        keep += [g.name for g in _keep_order(claim, lacking)[: claim.whole_gpus - len(keep)]]
        for name in keep:
            held[name] = key
            if by_name[name].whole_hold != key:
                out.append(WholeKeep(name, key, claim.claim.uid))
    return (*out, *_kept_nodes(r, for_idle, held)), tuple(releases)


def _could_keep(r: _Round, claim: PendingClaim, g: GpuView) -> bool:
    """Whether ``g`` could be kept whole for ``claim``: a free whole GPU, or a MIG GPU that could be switched
    off for it now or once time passes (a cooldown, its layout applied). Pure."""
    assert g.model is not None
    models = frozenset({g.model.key})
    if not claim.whole_by_model(models) or not r.eligible(claim, g) or not serves_whole(claim, g):
        return False
    if g.whole_hold not in ("", claim.claim.key):
        return False
    if _free_whole(g, claim.claim.key):
        return True
    if g.mode_target is not ON or g.name in r.taken:
        return False
    why = r.why_not(g, OFF)
    return why is None or why[1]


def _could_host(r: _Round, claim: PendingClaim, node: str, seen: dict[tuple[str, str], bool]) -> bool:
    """Whether ``node`` has as many GPUs as ``claim`` asks that could be whole for it (:func:`_could_keep`, or
    switching off for it): a free whole GPU is kept from MIG claims only for a claim of whole GPUs that could
    complete on its node (an eight-GPU claim holds no free whole GPU of a four-GPU node). Memoised in
    ``seen``. Pure."""
    key = (claim.claim.key, node)
    if key not in seen:
        room = sum(
            1
            for g in r.gpus
            if g.node == node
            and (_could_keep(r, claim, g) or (g.switching is OFF and g.mode_for == claim.claim.key))
        )
        seen[key] = room >= claim.whole_gpus
    return seen[key]


def _keep_order(claim: PendingClaim, gpus: Sequence[GpuView]) -> list[GpuView]:
    """Free whole GPUs first, then the MIG GPUs whose switch destroys the fewest instances."""
    return sorted(
        gpus, key=lambda g: (not _free_whole(g, claim.claim.key), len(g.actual), len(g.desired), g.name)
    )


def _kept_nodes(r: _Round, claims: Sequence[PendingClaim], held: Mapping[str, str]) -> tuple[WholeKeep, ...]:
    """An idle node kept for each of ``claims`` (several whole GPUs each, nothing kept for them yet), as
    :func:`_keeps` says; ``held``: GPU -> the claim it is kept for already. Pure."""
    if not claims:
        return ()
    by_node: dict[str, list[GpuView]] = {}
    for g in r.gpus:
        by_node.setdefault(g.node, []).append(g)

    def idle(gs: Sequence[GpuView]) -> bool:
        return not any(
            g.trouble or g.name in held or g.holds or g.busy or g.claims_on or g.switching is ON
            or (g.whole and not _free_whole(g))
            for g in gs
        )  # fmt: skip

    # Each GPU "offers" the keys of the claims it could be kept for (reserve.IdleNode counts the matches).
    nodes = [
        IdleNode(node, tuple(frozenset(c.claim.key for c in claims if _could_keep(r, c, g)) for g in gs))
        for node, gs in sorted(by_node.items())
        if idle(gs)
    ]
    waiting = [WaitingClaim(c.claim.key, c.whole_gpus, frozenset({c.claim.key}), c.nodes) for c in claims]
    by_key = {c.claim.key: c for c in claims}
    out: list[WholeKeep] = []
    for node, w in keep_idle_nodes(nodes, waiting).items():
        c = by_key[w.name]
        fit = _keep_order(c, [g for g in by_node[node] if _could_keep(r, c, g)])
        why = f"while it waits: node {node} is kept for it until {c.whole_gpus} of its GPUs are whole"
        out.extend(WholeKeep(g.name, c.claim.key, c.claim.uid, why) for g in fit[: c.whole_gpus])
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _Supply:
    """Whole GPUs (free, or switching off) counted for a claim of whole GPUs, all on one node."""

    enough: bool
    node: str  # "" when there are none
    gpus: tuple[GpuView, ...]
    per_node: dict[str, int] = field(default_factory=dict)  # eligible node -> such GPUs there


def _count_supply(r: _Round, claim: PendingClaim, models: frozenset[str]) -> _Supply:
    """Take whole GPUs (free first, then offered beside their slices, then switching off) for ``claim`` on
    one eligible node, as many as it asks; when no node has enough, the node with the most (the claim is short
    there; they are kept for it). An offered whole GPU counts for a claim of one GPU only: a claim of several
    is booked only where all are bookable at once, and a GPU kept for it is offered no more (the agent
    withdraws the offer of a GPU kept whole), so there it is switched like any idle MIG GPU."""
    wanted = claim.whole_by_model(models)
    need = claim.whole_gpus
    by_node: dict[str, list[GpuView]] = {}
    for g in r.gpus:
        assert g.model is not None
        if g.model.key not in wanted or not r.eligible(claim, g) or not serves_whole(claim, g):
            continue
        key = claim.claim.key
        mine = g.name in r.taken and (
            (g.switching is OFF and g.mode_for == key) or (g.whole_hold == key and _free_whole(g, key))
        )
        if g.whole_hold not in ("", key):
            continue  # kept whole for another claim
        if g.booked_whole:
            continue  # switching off for the claim that booked its whole device
        ready = _free_whole(g, key) or g.switching is OFF or (need == 1 and _offered_whole(g, key))
        if mine or (g.name not in r.taken and ready):
            by_node.setdefault(g.node, []).append(g)
    if not by_node:
        return _Supply(False, "", ())
    node = min(by_node, key=lambda n: (-len(by_node[n]), n))
    have = sorted(
        by_node[node],
        key=lambda g: (g.switching is OFF, g.mode_target is ON, g.mode_for != claim.claim.key, g.name),
    )
    taken = tuple(have[:need])
    r.taken.update(g.name for g in taken)
    return _Supply(len(taken) >= need, node, taken, {n: len(gs) for n, gs in by_node.items()})


def _switching_text(r: _Round, g: GpuView) -> str:
    c = g.mode_condition
    state = c.message if c is not None and c.message else "asked, the agent has not reported yet"
    since = f"; asked {_secs(r.inp.now - g.mode_written)} ago" if g.mode_written is not None else ""
    return f"{state}{since}"


def _whole_claim(r: _Round, v: ClaimVerdict, supply: _Supply, models: frozenset[str]) -> ClaimVerdict:
    """The verdict on a claim of whole GPUs under a Dynamic MIG mode: what is switched off for it, or why
    nothing can be."""
    claim = v.claim
    pol = r.policy.name
    coming = [g for g in supply.gpus if g.switching is OFF]
    offered = [g.name for g in supply.gpus if g.mode_target is ON and g.switching is None]
    if supply.enough:
        if offered and not coming:
            return replace(
                v,
                message=f"{v.message}; {_names(offered)} offer(s) the whole GPU beside its MIG slices "
                "(spec.offerWhole): the scheduler books it and the agent switches MIG mode off for it",
                warn=False,
            )
        if not coming:
            return v  # free whole GPUs serve it: decide's verdict stands
        g = coming[0]
        return replace(
            v,
            message=f"{v.message}; {g.name} is being switched to MIG mode off for it "
            f"({_switching_text(r, g)})",
            gpu=g.name,
            warn=False,
        )
    node, have = supply.node, supply.gpus
    need = claim.whole_gpus
    wanted = claim.whole_by_model(models)
    free = sum(1 for g in have if g.switching is None)
    if v.warn:  # decide found no GPU with MIG mode off for it
        head = v.message
    elif need > 1 and free:
        head = f"{v.message}; only {free} of them free on node {node}, and it needs {need} on one node"
    else:
        head = f"{v.message}; none of them is free now"
    candidates = [
        g
        for g in r.gpus
        if g.model is not None
        and g.model.key in wanted
        and r.eligible(claim, g)
        and g.name not in r.taken
        and g.mode_target is ON
        and g.whole_hold in ("", claim.claim.key)
    ]
    rejected: list[tuple[GpuView, str]] = []
    fit: list[GpuView] = []
    timed = False
    for g in candidates:
        if not serves_whole(claim, g):
            rejected.append((g, "its whole GPU would not pass the claim's selectors (its NVLink facts)"))
            continue
        why = r.why_not(g, OFF)
        if why is None:
            fit.append(g)
        else:
            rejected.append((g, why[0]))
            timed = timed or why[1]
    # The node whose switch completes the claim soonest, then the GPU whose switch destroys the fewest
    # free instances.
    by_node: dict[str, list[GpuView]] = {}
    for g in fit:
        by_node.setdefault(g.node, []).append(g)
    have_on = {n: supply.per_node.get(n, 0) for n in by_node}
    complete = [n for n in by_node if have_on[n] + len(by_node[n]) >= need]
    kept_on = {g.node for g in fit if g.whole_hold == claim.claim.key}  # the node kept for it, if any
    best: GpuView | None = None
    if complete:
        n = min(complete, key=lambda n: (n not in kept_on, need - have_on[n], n))
        best = min(by_node[n], key=lambda g: (len(g.actual), len(g.desired), g.name))
    what = f"{'a whole GPU' if need == 1 else f'{need} whole GPUs'} of {' or '.join(wanted) or 'a model'}"
    progress = (
        f"; {_names([g.name for g in coming])} already switching off for it" if coming and need > 1 else ""
    )
    if best is not None:
        blocked = r.blocked(OFF, claim.claim.key, best.node)
        if blocked is None:
            short = f"only {len(have)} GPU(s) with MIG mode off" if have else "no free GPU with MIG mode off"
            because = f"it asks for {what} and {short} can take it"
            # The node's GPUs the claim still lacks are switched together, least disturbing first, as far
            # as the disruption budget and the floors allow (the rest in later rounds).
            order = sorted(
                by_node[best.node],
                key=lambda g: (g.whole_hold != claim.claim.key, len(g.actual), len(g.desired), g.name),
            )
            switched: list[ModeSwitch] = []
            for g in order[: need - have_on[best.node]]:
                if switched and r.blocked(OFF, claim.claim.key, best.node) is not None:
                    break
                switched.append(r.switch(g, OFF, claim, because))
                r.taken.add(g.name)
            verb = f"policy {pol} is DryRun: it would switch" if r.dry_run else "switching"
            what_gpus = ", ".join(
                f"{s.gpu} ({s.model}, {_summary(next(g.actual for g in order if g.name == s.gpu))})"
                for s in switched
            )
            return replace(
                v,
                message=f"{head}; {verb} {what_gpus} on node {best.node} to MIG mode off for it (policy "
                f"{pol}'s MIG mode is Dynamic){progress}",
                gpu=best.name,
                warn=False,
            )
        text, wait = blocked
        return replace(
            v,
            message=f"{head}; {best.name} could be switched to MIG mode off for it, but {text}{progress}",
            warn=not wait,
        )
    if coming:
        return replace(
            v,
            message=f"{head}{progress}; no other GPU can be switched off for it now"
            + (f" ({_reasons(rejected)})" if rejected else ""),
            gpu=coming[0].name,
            warn=False,
        )
    if fit:  # switches possible, but no node gets enough of them
        most = max(have_on[n] + len(by_node[n]) for n in by_node)
        reason = f"it needs {need} on one node, and at most {most} could be on any node it may use"
    elif rejected:
        reason = _reasons(rejected)
    else:
        where = " on the nodes the pod may use" if claim.nodes is not None else ""
        reason = f"no GPU of {' or '.join(wanted) or 'a model it accepts'}{where} has MIG mode on"
    return replace(
        v,
        message=f"{head}; no GPU can be switched to MIG mode off for it (policy {pol}'s MIG mode is "
        f"Dynamic): {reason}",
        warn=bool(fit) or not timed,
    )


def _mig_claim(
    r: _Round,
    v: ClaimVerdict,
    verdicts: Sequence[ClaimVerdict],
    whole_claims: Sequence[int],
    models: frozenset[str],
) -> ClaimVerdict:
    """The verdict on a MIG claim no GPU with MIG mode on can serve (NoCapacity, or none of a model and node
    it accepts): a free whole GPU switched on for it, or one already switching on; otherwise the verdict as
    it was, with why no whole GPU can be switched when one could serve it."""
    claim = v.claim
    now = (
        f"Now: {v.message}"
        if v.reason is Reason.NO_CAPACITY
        else "No GPU with MIG mode on of a model and node it accepts serves it now."
    )
    allowed = frozenset(a) if (a := r.policy.spec.allowed_profiles) is not None else None

    def serves(g: GpuView) -> bool:
        return g.model is not None and r.eligible(claim, g) and _fits_empty(g.model, claim, allowed)

    coming = [g for g in r.gpus if g.switching is ON and serves(g)]
    if coming:
        g = coming[0]
        return replace(
            v,
            reason=Reason.WAITING_FOR_MIG_MODE_SWITCH,
            message=f"{g.name} is being switched to MIG mode on ({_switching_text(r, g)}); the claim is "
            f"planned there once it is. {now}",
            gpu=g.name,
        )
    wanted_whole = [verdicts[i].claim for i in whole_claims]
    hosts: dict[tuple[str, str], bool] = {}

    def kept_whole(g: GpuView) -> bool:
        assert g.model is not None
        return g.name in r.taken or any(
            g.model.key in c.whole_by_model(models)
            and r.eligible(c, g)
            and serves_whole(c, g)
            and _could_host(r, c, g.node, hosts)
            for c in wanted_whole
        )

    candidates = [g for g in r.gpus if g.mode_target is OFF and g.switching is None and serves(g)]
    rejected: list[tuple[GpuView, str]] = []
    fit: list[GpuView] = []
    for g in candidates:
        if kept_whole(g):
            rejected.append((g, "a pending claim of whole GPUs could take it"))
            continue
        why = r.why_not(g, ON)
        if why is None:
            fit.append(g)
        else:
            rejected.append((g, why[0]))
    if not candidates:
        return v  # no whole GPU could serve it: NoCapacity says why
    if fit:
        best = min(fit, key=lambda g: (g.node, g.index, g.name))
        blocked = r.blocked(ON)
        if blocked is None:
            s = r.switch(best, ON, claim, "no GPU with MIG mode on has room for it")
            if r.dry_run:
                return replace(
                    v,
                    reason=Reason.WOULD_RESHAPE,
                    message=f"policy {r.policy.name} is DryRun: it would switch {best.name} ({s.model}) to "
                    f"MIG mode on for the claim. {now}",
                    gpu=best.name,
                )
            return replace(
                v,
                reason=Reason.WAITING_FOR_MIG_MODE_SWITCH,
                message=f"switching {best.name} ({s.model}, a free whole GPU) to MIG mode on for the claim "
                f"(policy {r.policy.name}'s MIG mode is Dynamic); it is planned there once the agent reports "
                f"MIG mode on. {now}",
                gpu=best.name,
            )
        return replace(
            v,
            message=f"{v.message}; {best.name} (a free whole GPU) could be switched to MIG mode on for it, "
            f"but {blocked[0]}",
        )
    return replace(
        v, message=f"{v.message}; no whole GPU can be switched to MIG mode on for it: {_reasons(rejected)}"
    )


def served_without_mig(gpus: Sequence[GpuView]) -> tuple[str, ...]:
    """The governed GPUs without a catalog model (no MIG: an L4, a T4) whose GpuPartition does not ask yet to
    be served whole: ``spec.migMode: Disabled`` to write (a policy governs them only under
    ``gpusWithoutMig: Whole``, kube/policy.py). Pure."""
    return tuple(g.name for g in gpus if g.model is None and g.product and g.mode_wanted is not OFF)


def released_without_mig(gpus: Sequence[GpuView], owner: Mapping[str, str]) -> tuple[str, ...]:
    """GPUs without a catalog model that no policy governs any more and whose ``spec.migMode: Disabled`` the
    operator wrote: the request to withdraw (the agent then leaves them alone again). Pure."""
    return tuple(
        g.name
        for g in gpus
        if g.model is None and g.name not in owner and g.mode_wanted is OFF and g.mode_by_operator
    )
