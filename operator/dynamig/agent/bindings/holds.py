"""Placements kept for one claim (``GpuPartition.spec.holds``, written by the operator when it evicts pods to
make room for that claim, or drains the GPU for it). Pure; every kind of hold is kept alike.

A hold of the whole GPU (profile ``whole``, kind ``Whole``: the operator switched the GPU's MIG mode off for
a claim of whole GPUs, or counts its free whole GPU for one) is kept the same way on the one device a GPU with
MIG mode off has: the whole device is published guarded (with binding conditions) and every other claim's
booking of it is answered failed (``PlacementHeld``), so the GPUs switched for a claim of several whole GPUs
are not taken one by one by others while the rest switch (:func:`whole_hold`, agent/modes/whole.py).

While a hold stands on a GPU the agent:

- answers failed (``PlacementHeld``) every booking by another claim of a device whose memory slices overlap
  the held placement (:func:`held_against`), so the scheduler books those claims elsewhere;
- publishes the free instances over the held slices guarded (Partitionable inventory: with binding
  conditions, so a booking of one waits for that answer), so a victim's instance, freed when its pod exits,
  is not handed to the next small pod in the scheduling cycle (:func:`guarded_by_holds`);
- makes no instance of its own there: floor and warm-pool entries over the held slices wait
  (:func:`held_desired`). In the Instances inventory, where the scheduler books only instances that exist,
  the held placement itself joins the desired layout, so the agent cuts it once the victims are gone.

In the Partitionable inventory the waiting claim's own booking of the placement cuts it, as any booking
does (free instances in the way are destroyed at the booking, :mod:`dynamig.agent.layout.lifecycle`
``DESTROY_IN_WAY``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dynamig.agent.layout.reconcile import overlaps
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, normalize_layout
from dynamig.kube.gpupartition import Hold

REASON_PLACEMENT_HELD = "PlacementHeld"


def whole_hold(holds: Iterable[Hold]) -> Hold | None:
    """The hold of the whole GPU among ``holds`` (profile ``whole``: a GPU with MIG mode off, or switching
    off, kept for one claim of whole GPUs), or None. Pure."""
    return next((h for h in holds if h.whole), None)


def valid_holds(model: GpuModel, holds: Iterable[Hold]) -> tuple[Hold, ...]:
    """The holds that name a placement of ``model`` (others hold nothing). Pure."""
    return tuple(h for h in holds if h.fits(model))


def held_against(model: GpuModel, placed: PlacedInstance, claim: str, holds: Sequence[Hold]) -> Hold | None:
    """The hold a booking of ``placed`` by ``claim`` (namespace/name) would break, or None. Pure."""
    for h in holds:
        if h.claim != claim and overlaps(model, placed, h.placed()):
            return h
    return None


def held_desired(model: GpuModel, desired: Layout, holds: Sequence[Hold], partitionable: bool) -> Layout:
    """``desired`` without the entries over held slices; in the Instances inventory, with the held
    placements added (the agent cuts them once nothing busy is in the way). Pure."""
    kept = [p for p in desired if not any(overlaps(model, p, h.placed()) for h in holds)]
    if not partitionable:
        kept += [h.placed() for h in holds]
    return normalize_layout(kept)


def guarded_by_holds(
    model: GpuModel, instances: Iterable[PlacedInstance], holds: Sequence[Hold]
) -> frozenset[PlacedInstance]:
    """The instances over held slices: published guarded while the hold stands. Pure."""
    return frozenset(p for p in instances if any(overlaps(model, p, h.placed()) for h in holds))
