"""A policy's ``migMode.offerWhole``: which governed GPUs offer their whole device beside their MIG slices
(GpuPartition ``spec.offerWhole``), and the operator's own ``spec.migMode: Enabled`` replaced once the
scheduler booked one. Pure.

An offered whole device lets kube-scheduler book a whole GPU at once: the node agent switches MIG off for the
booking before the pod binds (:mod:`dynamig.agent.modes.booked`), where without the offer the claim waits
for a policy round to switch a GPU off for it (:mod:`dynamig.operator.modes`). The policy keeps the limits
it puts on its own switches:

- only under ``spec.mode: Dynamic`` with ``migMode.policy: Dynamic`` (the CRD refuses ``offerWhole``
  otherwise), on GPUs of the partitionable inventory (the counters are what keep the scheduler from booking
  the whole GPU beside its slices);
- not on a GPU whose switch off would reset it unless ``allowReset``, nor on one whose agent answered
  ResetRequired for MIG off, nor during ``cooldownSeconds`` after the operator last wrote its
  ``spec.migMode`` (no ping-pong), nor on a GPU unfit or kept whole for a claim;
- ``minMigGpus``: at most as many GPUs offer as could all be booked at once and leave that many with MIG on;
  idle GPUs (nothing allocated, busy or held: the agent publishes the whole device only there) go first,
  then those offering already, so the offers do not move about.

The disruption budget does not count a booked switch (:func:`dynamig.operator.inventory.switch_changes`):
the scheduler made it on a GPU with nothing else allocated.

An offer is never withdrawn while its whole device is allocated (the agent's switch, and the pin that keeps
the GPU whole while the claim lasts, rest on it). One the operator did not write (no
``dynamig.io/whole-offered-by``: a person set it) is left as it is.

Once a whole device is booked on a GPU the operator had switched on (``spec.migMode: Enabled``, its own),
that ``Enabled`` is replaced by ``Disabled``: the GPU stays whole after the claim ends, until the policy's
MIG mode round switches it on for MIG claims, instead of switching back at once by itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynamig.geometry.generation import mode_switch_needs_reset
from dynamig.kube.gpupartition import MigModeRequest
from dynamig.kube.policy import GpuPartitionPolicy, Mode
from dynamig.operator.inventory import (
    MIG_MODE_FOR_ANNOTATION,
    MIG_MODE_REQUESTED_ANNOTATION,
    MIG_MODE_WRITTEN_ANNOTATION,
    WHOLE_OFFERED_BY_ANNOTATION,
    GpuView,
)

OFF, ON = MigModeRequest.DISABLED, MigModeRequest.ENABLED


@dataclass(frozen=True, slots=True)
class OfferWrite:
    """``spec.offerWhole`` to write on ``gpu`` (True) or remove (False), and why."""

    gpu: str
    offer: bool
    policy: str  # the policy it is written for ("" when withdrawn from a GPU no policy governs)
    message: str

    def spec(self) -> dict[str, Any]:
        return {"offerWhole": True if self.offer else None}  # a merge patch removes the field on null

    def annotations(self) -> dict[str, str]:
        return {WHOLE_OFFERED_BY_ANNOTATION: self.policy if self.offer else ""}


@dataclass(frozen=True, slots=True)
class BookedWhole:
    """A GPU whose offered whole device a claim allocated while ``spec.migMode`` said the operator's
    ``Enabled``: ``Disabled`` is written in its place (as a switch off writes it)."""

    gpu: str
    message: str

    def spec(self) -> dict[str, Any]:
        return {"migMode": OFF.value, "layout": [], "offeredProfiles": []}

    def annotations(self, stamp: str) -> dict[str, str]:
        return {
            MIG_MODE_WRITTEN_ANNOTATION: stamp,
            MIG_MODE_REQUESTED_ANNOTATION: OFF.value,
            MIG_MODE_FOR_ANNOTATION: "",
        }


@dataclass(frozen=True, slots=True)
class WholeOffers:
    """One policy round's writes about offered whole devices."""

    offers: tuple[OfferWrite, ...] = ()
    booked: tuple[BookedWhole, ...] = ()

    def by_gpu(self) -> dict[str, tuple[OfferWrite | None, BookedWhole | None]]:
        out: dict[str, tuple[OfferWrite | None, BookedWhole | None]] = {}
        for o in self.offers:
            out[o.gpu] = (o, None)
        for b in self.booked:
            out[b.gpu] = (out.get(b.gpu, (None, None))[0], b)
        return out


def why_not_offered(policy: GpuPartitionPolicy, g: GpuView, now: float) -> str | None:
    """Why ``g`` may not offer its whole device under ``policy`` now (None: it may). Pure."""
    mm = policy.spec.mig_mode
    if policy.spec.mode is not Mode.DYNAMIC or not mm.dynamic or not mm.offer_whole:
        return "the policy does not offer whole GPUs (migMode.offerWhole under a Dynamic MIG mode)"
    if not g.partitionable:
        return "not the partitionable inventory"
    if g.model is None or g.unusable:
        return g.unusable or "no catalog model"
    if g.switching is not None or g.mode_target is not ON:
        return "its MIG mode is not on"
    if g.whole_hold:
        return f"kept whole for claim {g.whole_hold}"
    if mode_switch_needs_reset(g.model.key) and not mm.allow_reset:
        return f"a {g.model.key}'s MIG mode switch resets the GPU and migMode.allowReset is false"
    if OFF in g.reset_required:
        return "its agent answered ResetRequired for MIG mode off"
    if g.mode_written is not None and now - g.mode_written < mm.cooldown_seconds:
        ago = now - g.mode_written
        return f"its MIG mode was switched {ago:.0f}s ago (cooldownSeconds {mm.cooldown_seconds})"
    return None


def _idle(g: GpuView) -> bool:
    return not g.busy and not g.holds


def decide_whole_offers(policy: GpuPartitionPolicy, mine: Sequence[GpuView], now: float) -> WholeOffers:
    """The ``spec.offerWhole`` writes for the GPUs ``policy`` governs (``mine``), and the operator's
    ``Enabled`` replaced where a whole device was booked (module docstring). Nothing under DryRun. Pure."""
    if policy.spec.mode is Mode.DRY_RUN:
        return WholeOffers()
    name = policy.name
    booked = tuple(
        BookedWhole(
            g.name,
            f"{g.name}: its whole device (offered beside its slices) was booked; spec.migMode Enabled "
            "(written when it was switched on) is now Disabled, so the GPU stays whole after the claim, "
            f"until policy {name} switches it on for MIG claims",
        )
        for g in mine
        if g.booked_whole and g.mode_asked is ON and g.mode_by_operator
    )
    fit = [g for g in mine if why_not_offered(policy, g, now) is None]
    room = max(0, sum(1 for g in mine if g.mode_target is ON) - policy.spec.mig_mode.min_mig_gpus)
    chosen = {g.name for g in sorted(fit, key=lambda g: (not _idle(g), not g.offer_whole, g.name))[:room]}
    offers: list[OfferWrite] = []
    for g in mine:
        if g.booked_whole:
            continue  # never withdrawn while allocated; nothing to add either
        if g.name in chosen and (not g.offer_whole or g.offer_whole_by != name):
            offers.append(OfferWrite(g.name, True, name, f"policy {name}: {g.name} offers its whole device"))
        elif g.name not in chosen and g.offer_whole and g.offer_whole_by:
            why = why_not_offered(policy, g, now) or f"minMigGpus {policy.spec.mig_mode.min_mig_gpus}"
            offers.append(
                OfferWrite(
                    g.name, False, "", f"policy {name}: {g.name} no longer offers its whole device: {why}"
                )
            )
    return WholeOffers(tuple(offers), booked)


def ungoverned_whole_offers(gpus: Iterable[GpuView], owner: Mapping[str, str]) -> tuple[OfferWrite, ...]:
    """Offers the operator wrote on GPUs no policy governs any more: withdrawn (not while allocated). Pure."""
    return tuple(
        OfferWrite(
            g.name,
            False,
            "",
            f"{g.name}: no policy governs this GPU any more: its whole device is not offered",
        )
        for g in gpus
        if g.name not in owner and g.offer_whole and g.offer_whole_by and not g.booked_whole
    )
