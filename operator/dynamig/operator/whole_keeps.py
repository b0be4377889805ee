"""The GPUs a policy's MIG mode round keeps whole for claims of whole GPUs (holds of kind ``Whole`` in
GpuPartition ``spec.holds``): no other claim is booked there, and the planner cuts nothing there, while the
GPUs such a claim lacks switch MIG off (:func:`decide_keeps`). Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dynamig.kube.gpupartition import Hold, HoldKind
from dynamig.kube.names import WHOLE_PROFILE
from dynamig.kube.times import micro_time, parse_time
from dynamig.operator.demand import PendingClaim
from dynamig.operator.inventory import GpuView
from dynamig.operator.mode_round import (
    OFF,
    ON,
    ModeRound,
    Supply,
    free_whole,
)
from dynamig.operator.verdicts import serves_whole
from dynamig.planner.reserve import IdleNode, WaitingClaim, keep_idle_nodes

# How long a GPU is kept whole for a claim of whole GPUs (its switch, an A100's reset included, and the
# scheduler's next try fit well within it); a claim still waiting then is kept for again.
WHOLE_HOLD_SECONDS = 900.0


@dataclass(frozen=True, slots=True)
class WholeKeep:
    """A GPU to keep whole for one claim of whole GPUs (a hold of the whole GPU in its ``spec.holds``): one
    switched off for it, or free with MIG mode off and counted for it while others still switch."""

    gpu: str
    claim: str  # namespace/name
    claim_uid: str
    why: str = "while GPUs switch"  # ends the WholeGpuKept Event's sentence
    seconds: float = WHOLE_HOLD_SECONDS  # how long the hold lasts
    drain: bool = False  # a node drained for the claim (drainNodeAfterSeconds): once per claim

    def hold(self, now: float) -> Hold:
        """The hold written (``now``: epoch seconds)."""
        seconds = self.seconds
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


def decide_keeps(
    r: ModeRound, claims: Sequence[PendingClaim], supplies: Sequence[Supply]
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
            if g.node == node and g.name not in keep and g.name not in held and could_keep(r, claim, g)
        ]
        keep += [g.name for g in keep_order(claim, lacking)[: claim.whole_gpus - len(keep)]]
        for name in keep:
            held[name] = key
            if by_name[name].whole_hold != key:
                out.append(WholeKeep(name, key, claim.claim.uid))
    idle = kept_nodes(r, for_idle, held)
    kept = {k.claim for k in idle}
    held.update((k.gpu, k.claim) for k in idle)
    drains = drained_nodes(r, [c for c in for_idle if c.claim.key not in kept], held)
    return (*out, *idle, *drains), tuple(releases)


def _takes_whole(r: ModeRound, claim: PendingClaim, g: GpuView) -> bool:
    """Whether ``claim`` takes ``g`` whole (its model, a node it may use, the GPU's own NVLink facts) and
    ``g`` is kept whole for no other claim. Pure."""
    assert g.model is not None
    if not claim.whole_by_model(frozenset({g.model.key})) or not r.eligible(claim, g):
        return False
    return serves_whole(claim, g) and g.whole_hold in ("", claim.claim.key)


def could_keep(r: ModeRound, claim: PendingClaim, g: GpuView) -> bool:
    """Whether ``g`` could be kept whole for ``claim``: a free whole GPU, or a MIG GPU that could be switched
    off for it now or once time passes (a cooldown, its layout applied). Pure."""
    if not _takes_whole(r, claim, g):
        return False
    if free_whole(g, claim.claim.key):
        return True
    if g.mode_target is not ON or g.name in r.taken:
        return False
    why = r.why_not(g, OFF)
    return why is None or why[1]


def could_host(r: ModeRound, claim: PendingClaim, node: str, seen: dict[tuple[str, str], bool]) -> bool:
    """Whether ``node`` has as many GPUs as ``claim`` asks that could be whole for it (:func:`could_keep`, or
    switching off for it): a free whole GPU is kept from MIG claims only for a claim of whole GPUs that could
    complete on its node (an eight-GPU claim holds no free whole GPU of a four-GPU node). Memoised in
    ``seen``. Pure."""
    key = (claim.claim.key, node)
    if key not in seen:
        room = sum(
            1
            for g in r.gpus
            if g.node == node
            and (could_keep(r, claim, g) or (g.switching is OFF and g.mode_for == claim.claim.key))
        )
        seen[key] = room >= claim.whole_gpus
    return seen[key]


def keep_order(claim: PendingClaim, gpus: Sequence[GpuView]) -> list[GpuView]:
    """Free whole GPUs first, then the MIG GPUs whose switch destroys the fewest instances."""
    return sorted(
        gpus, key=lambda g: (not free_whole(g, claim.claim.key), len(g.actual), len(g.desired), g.name)
    )


def kept_nodes(
    r: ModeRound, claims: Sequence[PendingClaim], held: Mapping[str, str]
) -> tuple[WholeKeep, ...]:
    """An idle node kept for each of ``claims`` (several whole GPUs each, nothing kept for them yet), as
    :func:`decide_keeps` says; ``held``: GPU -> the claim it is kept for already. Pure."""
    if not claims:
        return ()
    by_node: dict[str, list[GpuView]] = {}
    for g in r.gpus:
        by_node.setdefault(g.node, []).append(g)

    def idle(gs: Sequence[GpuView]) -> bool:
        return not any(
            g.trouble or g.name in held or g.holds or g.busy or g.claims_on or g.switching is ON
            or g.booked_whole or (g.whole and not free_whole(g))
            for g in gs
        )  # fmt: skip

    # Each GPU "offers" the keys of the claims it could be kept for (reserve.IdleNode counts the matches).
    nodes = [
        IdleNode(node, tuple(frozenset(c.claim.key for c in claims if could_keep(r, c, g)) for g in gs))
        for node, gs in sorted(by_node.items())
        if idle(gs)
    ]
    waiting = [WaitingClaim(c.claim.key, c.whole_gpus, frozenset({c.claim.key}), c.nodes) for c in claims]
    by_key = {c.claim.key: c for c in claims}
    out: list[WholeKeep] = []
    for node, w in keep_idle_nodes(nodes, waiting).items():
        c = by_key[w.name]
        fit = keep_order(c, [g for g in by_node[node] if could_keep(r, c, g)])
        why = f"while it waits: node {node} is kept for it until {c.whole_gpus} of its GPUs are whole"
        out.extend(WholeKeep(g.name, c.claim.key, c.claim.uid, why) for g in fit[: c.whole_gpus])
    return tuple(out)


def busy_slices(g: GpuView) -> int:
    """The compute slices of ``g`` that allocated or running work holds: its busy MIG instances, or the
    whole GPU when its whole device is not free. Pure."""
    if g.model is None:
        return 0
    if g.whole:
        return 0 if free_whole(g) else g.model.compute_slices
    placed = g.busy | set(g.claims_on)
    return sum(g.model.profile(p.profile).compute_slices for p in placed)


def could_drain(r: ModeRound, claim: PendingClaim, g: GpuView) -> bool:
    """Whether ``g`` could be kept whole for ``claim`` while work still runs on it: a GPU the claim takes
    whole, not unfit, not held for anything else, and, with MIG mode on, one the policy may switch off once
    it is idle (a reset it allows, none that the platform refused). Pure."""
    if not _takes_whole(r, claim, g) or g.trouble or g.holds:
        return False
    if g.booked_whole:
        return False  # switching off for the claim that booked its whole device: a hold would turn it away
    if g.switching is ON or g.name in r.taken:
        return False
    return g.whole or (not g.mode_reset_stuck and r.refused(g, OFF) is None)


def drained_nodes(
    r: ModeRound, claims: Sequence[PendingClaim], held: Mapping[str, str]
) -> tuple[WholeKeep, ...]:
    """``spec.migMode.drainNodeAfterSeconds``: each of ``claims`` (several whole GPUs each, nothing kept for
    them, no idle node either) that has waited that long, oldest first, gets a node drained: as many GPUs as
    it asks kept whole for it though work still runs there, so nothing new is booked on them and each is
    switched off for it once idle (:func:`dynamig.operator.modes.decide_modes`), for
    ``drainNodeHoldSeconds``; a claim drained for before (``ModeInput.drained``) is not drained again. The
    node is the one whose chosen GPUs hold the fewest busy compute slices (:func:`busy_slices`), a node with
    a GPU kept for another claim left out; on it, the least busy GPUs. Nobody is evicted. ``held``: GPU ->
    the claim it is kept for already. Pure."""
    mm = r.policy.spec.mig_mode
    after = mm.drain_node_after_seconds
    if after is None or not claims:
        return ()
    by_node: dict[str, list[GpuView]] = {}
    for g in r.gpus:
        by_node.setdefault(g.node, []).append(g)
    taken_nodes = {g.node for g in r.gpus if g.name in held}
    waited = [(parse_time(c.created), c) for c in claims]
    out: list[WholeKeep] = []
    for created, c in sorted(((t, c) for t, c in waited if t is not None), key=lambda tc: tc[0]):
        if r.inp.now - created < after or c.claim.key in r.inp.drained:
            continue
        best: tuple[tuple[int, str], list[GpuView]] | None = None
        for node, gs in sorted(by_node.items()):
            if node in taken_nodes:
                continue
            fit = sorted((g for g in gs if could_drain(r, c, g)), key=lambda g: (busy_slices(g), g.name))
            if len(fit) < c.whole_gpus:
                continue
            chosen = fit[: c.whole_gpus]
            key = (sum(busy_slices(g) for g in chosen), node)
            if best is None or key < best[0]:
                best = (key, chosen)
        if best is None:
            continue
        (busy, node), chosen = best
        taken_nodes.add(node)
        why = (
            f"while it waits (over {after}s): node {node} is drained for it for up to "
            f"{mm.drain_node_hold_seconds}s, nothing new is booked on these GPUs ({busy} compute slice(s) "
            "busy there now) and each is switched off for it once idle"
        )
        hold_s = float(mm.drain_node_hold_seconds)
        out.extend(WholeKeep(g.name, c.claim.key, c.claim.uid, why, hold_s, drain=True) for g in chosen)
    return tuple(out)
