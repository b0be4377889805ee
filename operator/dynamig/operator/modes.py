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
- **on** (``Enabled``) for MIG claims the round left ``NoCapacity`` or ``WaitingForCooldown``: one free
  whole GPU (nothing allocated or running, no claim) of a model with a profile every MIG request of the claim
  accepts, that no pending whole-GPU claim could take and complete on its node (as many of the node's GPUs as
  it asks could be whole for it).

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
from dataclasses import dataclass, replace
from typing import Any

from dynamig.geometry.layout import remaining_capacity
from dynamig.geometry.model import GpuModel
from dynamig.kube.gpupartition import MigModeRequest
from dynamig.kube.gpupartition import layout_summary as _summary
from dynamig.operator.demand import PendingClaim
from dynamig.operator.inventory import (
    MIG_MODE_REQUESTED_ANNOTATION,
    MIG_MODE_RESET_ANNOTATION,
    GpuView,
    switch_changes,
)
from dynamig.operator.mode_round import (
    OFF,
    ON,
    ModeInput,
    ModeRound,
    ModeSwitch,
    Supply,
    count_supply,
    mode_word,
    names_text,
    other_mode,
    reasons_text,
    seconds_text,
)
from dynamig.operator.verdicts import ClaimVerdict, Reason, serves_whole
from dynamig.operator.whole_keeps import WholeKeep, WholeRelease, could_host, decide_keeps


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
class ModeDecision:
    switches: tuple[ModeSwitch, ...] = ()  # to write now (all for one claim, on one node)
    keeps: tuple[WholeKeep, ...] = ()  # GPUs to keep whole for a claim (holds written with the round)
    releases: tuple[WholeRelease, ...] = ()  # holds of claims kept elsewhere now (taken out with the round)
    planned: tuple[ModeSwitch, ...] = ()  # DryRun: what Dynamic would write
    resets: tuple[ResetRequired, ...] = ()
    verdicts: tuple[ClaimVerdict, ...] = ()  # the round's verdicts, those a switch concerns rewritten


# Verdicts of MIG claims no GPU with MIG mode on can serve now: no room, room only once a GPU's cooldown ends
# (a claim that came a round after the GPU was cut would otherwise wait out the cooldown beside a free whole
# GPU), or none of a model and node they accept (where every GPU of the right model has MIG mode off, the
# claim is told NoMatchingProfile or NoEligibleNode).
_NO_ROOM_NOW = frozenset({Reason.NO_CAPACITY, Reason.WAITING_FOR_COOLDOWN})
_NO_MIG_GPU = _NO_ROOM_NOW | {Reason.NO_MATCHING_PROFILE, Reason.NO_ELIGIBLE_NODE}


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


def _reset_marks(gpus: Sequence[GpuView]) -> tuple[ResetRequired, ...]:
    """A record for each GPU whose agent newly answered ResetRequired for spec.migMode. Pure."""
    out: list[ResetRequired] = []
    for g in gpus:
        want = g.mode_wanted
        if not g.mode_reset_stuck or want is None or want in g.reset_required:
            continue
        modes = tuple(sorted({m.value for m in g.reset_required} | {want.value}))
        revert = other_mode(want) if g.mode_by_operator else None
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
                f"{g.name} ({model}): the agent answered ResetRequired switching MIG mode {mode_word(want)}: "
                "this platform exposes no GPU reset (a pass-through VM; a VM reboot would apply it). dynamig "
                f"does not ask it (nor GPUs of its model on node {g.node}) for MIG mode {mode_word(want)} "
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
    r = ModeRound(
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
    supply = {i: count_supply(r, verdicts[i].claim, models) for i in whole_claims}
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
                kept = f"{names_text(held)} kept whole for claims of whole GPUs: nothing is cut there for it"
                verdicts[i] = replace(v, message=f"{v.message}; {kept}")
    switches = tuple(r.switches)
    if r.dry_run:
        return ModeDecision(planned=switches, resets=resets, verdicts=tuple(verdicts))
    keeps, releases = decide_keeps(
        r, [verdicts[i].claim for i in whole_claims], [supply[i] for i in whole_claims]
    )
    for i in whole_claims:
        held_for = [k.gpu for k in keeps if k.claim == verdicts[i].claim.claim.key]
        if held_for:
            v = verdicts[i]
            kept = f"{names_text(held_for)} kept whole for it (no other claim is booked there while it waits)"
            verdicts[i] = replace(v, message=f"{v.message}; {kept}", warn=False)
    return ModeDecision(
        switches=switches, keeps=keeps, releases=releases, resets=resets, verdicts=tuple(verdicts)
    )


def _switching_text(r: ModeRound, g: GpuView) -> str:
    c = g.mode_condition
    state = c.message if c is not None and c.message else "asked, the agent has not reported yet"
    since = f"; asked {seconds_text(r.inp.now - g.mode_written)} ago" if g.mode_written is not None else ""
    return f"{state}{since}"


def _whole_claim(r: ModeRound, v: ClaimVerdict, supply: Supply, models: frozenset[str]) -> ClaimVerdict:
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
                message=f"{v.message}; {names_text(offered)} offer(s) the whole GPU beside its MIG slices "
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
        f"; {names_text([g.name for g in coming])} already switching off for it"
        if coming and need > 1
        else ""
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
            + (f" ({reasons_text(rejected)})" if rejected else ""),
            gpu=coming[0].name,
            warn=False,
        )
    if fit:  # switches possible, but no node gets enough of them
        most = max(have_on[n] + len(by_node[n]) for n in by_node)
        reason = f"it needs {need} on one node, and at most {most} could be on any node it may use"
    elif rejected:
        reason = reasons_text(rejected)
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
    r: ModeRound,
    v: ClaimVerdict,
    verdicts: Sequence[ClaimVerdict],
    whole_claims: Sequence[int],
    models: frozenset[str],
) -> ClaimVerdict:
    """The verdict on a MIG claim no GPU with MIG mode on can serve now (NoCapacity, WaitingForCooldown, or
    none of a model and node it accepts): a free whole GPU switched on for it, or one already switching on;
    otherwise the verdict as it was, with why no whole GPU can be switched when one could serve it."""
    claim = v.claim
    now = (
        f"Now: {v.message}"
        if v.reason in _NO_ROOM_NOW
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
            and could_host(r, c, g.node, hosts)
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
        v,
        message=f"{v.message}; no whole GPU can be switched to MIG mode on for it: {reasons_text(rejected)}",
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
