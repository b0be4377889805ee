"""One policy's MIG mode round (:func:`dynamig.operator.modes.decide_modes`): what it has decided so far, the
rules each switch is checked against (:meth:`ModeRound.why_not`, :meth:`ModeRound.blocked`), and which GPUs
count as whole GPUs for a claim of whole GPUs (:func:`count_supply`). Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamig.geometry.generation import mode_switch_needs_reset
from dynamig.geometry.model import PlacedInstance
from dynamig.kube.gpupartition import InstanceState, MigMode, MigModeRequest
from dynamig.kube.gpupartition import layout_summary as _summary
from dynamig.kube.policy import GpuPartitionPolicy, Mode
from dynamig.operator.decide import RoundDecision
from dynamig.operator.demand import PendingClaim
from dynamig.operator.inventory import (
    MIG_MODE_FOR_ANNOTATION,
    MIG_MODE_REQUESTED_ANNOTATION,
    MIG_MODE_WRITTEN_ANNOTATION,
    GpuView,
)
from dynamig.operator.verdicts import serves_whole

OFF, ON = MigModeRequest.DISABLED, MigModeRequest.ENABLED


def mode_word(mode: MigModeRequest) -> str:
    return "off" if mode is OFF else "on"


def other_mode(mode: MigModeRequest) -> MigModeRequest:
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
class ModeInput:
    policy: GpuPartitionPolicy
    gpus: tuple[GpuView, ...]  # every GPU the policy governs, unusable ones included
    decision: RoundDecision  # the round's layout writes and verdicts (decide_round)
    now: float
    # claims a node was drained for (migMode.drainNodeAfterSeconds) -> when: each is drained once
    drained: Mapping[str, float] = field(default_factory=dict)


def seconds_text(s: float) -> str:
    return f"{max(0, round(s))}s"


def names_text(gpus: Sequence[str], limit: int = 3) -> str:
    more = len(gpus) - limit
    return ", ".join(gpus[:limit]) + (f" (+{more} more)" if more > 0 else "")


def free_whole(g: GpuView, claim: str = "") -> bool:
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


def offered_whole(g: GpuView, claim: str = "") -> bool:
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


@dataclass
class ModeRound:
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

    def refused(self, g: GpuView, to: MigModeRequest) -> str | None:
        """Why the policy or the platform never lets ``g`` be switched ``to`` (a reset the policy does not
        allow, or one the platform does not expose, here or on a GPU of its model on its node); None when
        nothing of the kind stands in the way. Pure."""
        assert g.model is not None
        if mode_switch_needs_reset(g.model.key) and not self.policy.spec.mig_mode.allow_reset:
            return (
                f"{g.model.key} switches MIG mode only through a GPU reset, and policy {self.policy.name}'s "
                "spec.migMode.allowReset is false"
            )
        if to in g.reset_required:
            return f"the agent answered ResetRequired for MIG mode {mode_word(to)} here: not asked again"
        other = self.reset_nodes.get((g.node, g.model.key, to))
        if other is not None and other != g.name:
            return (
                f"{other} on the same node answered ResetRequired for MIG mode {mode_word(to)} (its platform "
                "exposes no GPU reset)"
            )
        return None

    def why_not(self, g: GpuView, to: MigModeRequest) -> tuple[str, bool] | None:
        """Why ``g`` may not be switched ``to`` now, and whether only time stands in the way (a cooldown, a
        reshape under way); None when it may."""
        assert g.model is not None
        mm = self.policy.spec.mig_mode
        if g.trouble:
            return g.trouble, False
        if g.mode_reset_stuck:
            return f"the agent answered ResetRequired switching MIG {mode_word(g.mode_wanted or to)}", False
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
        elif not free_whole(g):
            w = g.whole_gpu
            state = "not published" if w is None or not w.published else w.state.value
            return f"the whole GPU is {state}", False
        refused = self.refused(g, to)
        if refused is not None:
            return refused, False
        if g.in_flight:
            return "its layout is being applied", True
        if any(w.gpu == g.name for w in self.inp.decision.writes):
            return "its layout is written this round", True
        if g.mode_written is not None and self.inp.now - g.mode_written < mm.cooldown_seconds:
            since = self.inp.now - g.mode_written
            left = seconds_text(mm.cooldown_seconds - since)
            return f"switched {seconds_text(since)} ago, cooldown {mm.cooldown_seconds}s ({left} left)", True
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
            f"policy {self.policy.name}: switching {g.name} ({g.model.key}) MIG mode {mode_word(to)} for "
            f"claim {claim.claim.key} ({why}): {what}"
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


def reasons_text(rejected: Sequence[tuple[GpuView, str]], limit: int = 4) -> str:
    shown = "; ".join(f"{g.name}: {why}" for g, why in rejected[:limit])
    more = len(rejected) - limit
    return shown + (f" (+{more} more GPU(s))" if more > 0 else "")


@dataclass(frozen=True, slots=True)
class Supply:
    """Whole GPUs (free, or switching off) counted for a claim of whole GPUs, all on one node."""

    enough: bool
    node: str  # "" when there are none
    gpus: tuple[GpuView, ...]
    per_node: dict[str, int] = field(default_factory=dict)  # eligible node -> such GPUs there


def count_supply(r: ModeRound, claim: PendingClaim, models: frozenset[str]) -> Supply:
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
            (g.switching is OFF and g.mode_for == key) or (g.whole_hold == key and free_whole(g, key))
        )
        if g.whole_hold not in ("", key):
            continue  # kept whole for another claim
        if g.booked_whole:
            continue  # switching off for the claim that booked its whole device
        ready = free_whole(g, key) or g.switching is OFF or (need == 1 and offered_whole(g, key))
        if mine or (g.name not in r.taken and ready):
            by_node.setdefault(g.node, []).append(g)
    if not by_node:
        return Supply(False, "", ())
    node = min(by_node, key=lambda n: (-len(by_node[n]), n))
    have = sorted(
        by_node[node],
        key=lambda g: (g.switching is OFF, g.mode_target is ON, g.mode_for != claim.claim.key, g.name),
    )
    taken = tuple(have[:need])
    r.taken.update(g.name for g in taken)
    return Supply(len(taken) >= need, node, taken, {n: len(gs) for n, gs in by_node.items()})
