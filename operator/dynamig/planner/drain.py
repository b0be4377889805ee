"""Drain choice: which GPU stops taking new small bookings so that a claim starving at equal priority gets
the large placement it waits for. Pure, deterministic, no I/O.

A stream of small claims can keep every GPU partly busy for hours: each time a small instance ends, the
scheduler books the freed slices for the next small claim, and a large profile (a 7g.80gb, a 4g.40gb)
never finds its slices free together. Batch schedulers answer with backfill behind a reservation; here a
reservation is a drain: one GPU keeps the placement for the starving claim, takes no new booking over it,
and the claim gets it as soon as the instances already running there end. Nobody is evicted.

Which placement: the one whose busy instances block the fewest memory slices (the least work to wait
for), then the fewest busy instances, then the GPU and start (a stable choice). A placement is a candidate
only if

- every instance in its way is free or used by pods we know (a process outside any claim may never end);
- at least one is busy, and so is one in the way of every other placement of the profile on that GPU (where
  one is free, the plain planner serves the claim without a drain);
- the GPU with the rest of its instances and the new one is a valid layout;
- its GPU is on a node the claim may run on, and not draining or held for another claim already.

Claims are served oldest first, one GPU each, at most ``room`` of them (a policy's ``drain.maxGpus`` less
the drains it already has); a claim's ``firstAvailable`` alternatives are tried in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dynamig.geometry.layout import is_valid
from dynamig.geometry.model import GpuModel, PlacedInstance
from dynamig.planner.model import GpuKey
from dynamig.planner.victims import GpuHolding, Preemptor


@dataclass(frozen=True, slots=True)
class DrainChoice:
    """A placement kept for ``claim`` on ``gpu`` until the busy instances ``waiting_for`` end."""

    claim: str
    gpu: GpuKey
    profile: str
    start: int
    waiting_for: tuple[PlacedInstance, ...]  # the busy instances in the way
    blocked_slices: int  # memory slices those hold


def _slices(model: GpuModel, placed: PlacedInstance) -> int:
    return model.profile(placed.profile).mask(placed.start).bit_count()


def _best(
    gpu: GpuHolding, model: GpuModel, profile: str, known: frozenset[str]
) -> tuple[tuple[int, int, GpuKey, int], tuple[PlacedInstance, ...]] | None:
    """The best placement of ``profile`` on ``gpu`` to drain: (score, busy instances in the way); None when
    there is none, or when a placement can be cut now (nothing busy in its way: the planner's case)."""
    if not model.has_profile(profile):
        return None
    prof = model.profile(profile)
    best = None
    for start in prof.placement_starts:
        need = prof.mask(start)
        in_the_way = [i for i in gpu.instances if model.profile(i.placed.profile).mask(i.placed.start) & need]
        if any(h not in known for i in in_the_way for h in i.holders):
            continue
        busy = tuple(sorted(i.placed for i in in_the_way if i.holders))
        rest = [i.placed for i in gpu.instances if i not in in_the_way]
        if not is_valid(model, tuple(sorted([*rest, PlacedInstance(start, profile)]))):
            continue
        if not busy:
            return None
        score = (sum(_slices(model, b) for b in busy), len(busy), gpu.key, start)
        if best is None or score < best[0]:
            best = (score, busy)
    return best


def choose_drains(
    waiting: Sequence[Preemptor],
    gpus: Sequence[GpuHolding],
    known: frozenset[str],
    models: Mapping[str, GpuModel],
    room: int,
) -> tuple[DrainChoice, ...]:
    """Drains for ``waiting`` (oldest first, as given; each at most once, on a GPU of its own), at most
    ``room``. ``gpus``: the GPUs that may drain, with who uses each instance; ``known``: the pods whose
    instances end when they do. Pure."""
    used: set[GpuKey] = set()
    out: list[DrainChoice] = []
    for pre in waiting:
        if len(out) >= room:
            break
        for profile in pre.alternatives:
            found = [
                (best, gpu, model)
                for gpu in gpus
                if gpu.key not in used
                and (pre.nodes is None or gpu.key.node in pre.nodes)
                and (model := models.get(gpu.model)) is not None
                and (best := _best(gpu, model, profile, known)) is not None
            ]
            if not found:
                continue
            (score, busy), gpu, model = min(found, key=lambda f: f[0][0])
            used.add(gpu.key)
            out.append(DrainChoice(pre.name, gpu.key, profile, score[3], busy, score[0]))
            break
    return tuple(out)
