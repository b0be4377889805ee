"""How many placements of each profile a GPU offers the scheduler (partitionable inventory) when the user
does not say: chosen from the number of GPU nodes dynamig manages. Pure.

One source of truth: the operator counts the GPU nodes (the nodes of every GpuPartition) and writes
:func:`auto_limit`'s answer, with the count, into ``spec.autoPlacementsPerProfile`` of each GPU a policy
governs; an agent started with ``--placements-per-profile=auto`` (the default) follows it, one started with a
number keeps that number. The agent reports the limit in force and where it came from (:func:`in_force`) in
the GpuPartition's status (``kubectl get gpupartitions -o wide``).

Why these thresholds (docs/benchmarks.md, "The scheduler at 1,000 nodes", kube-scheduler v1.37.2, idle
8 x A100-80GB nodes, one ``1g.10gb`` claim per pod): kube-scheduler's CPU per pod against the instances
inventory (the cheapest the scheduler can get; the project's goal is at most 2x) is

=========  ===============  =====================================
nodes      every placement  one placement per profile and GPU
=========  ===============  =====================================
50         1.8x (0.022 s)   1.3x (0.016 s)
200        2.8x (0.047 s)   1.7x (0.028 s)
500        3.2x (0.100 s)   1.6x (0.049 s)
1,000      5.9x (0.296 s)   1.9x (0.095 s)
=========  ===============  =====================================

Every placement stays under 2x at 50 nodes and is over it at 200; between the two the ratio grows as
N^0.32 (log-log), so it crosses 2x near 70 nodes. Up to :data:`EVERY_PLACEMENT_UP_TO` (64) GPU nodes each GPU
therefore offers every placement (several bookings of one GPU in one scheduling pass, what a small cluster's
bursts want); from 65 on, the best-ranked placement of each profile (the one the scheduler books first
anyway), which stays under 2x at every measured size. No other limit was measured, so none is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
EVERY_PLACEMENT = 0  # the limit that offers every valid placement
EVERY_PLACEMENT_UP_TO = 64  # GPU nodes: every placement at or below this many, one per profile above
# (fewest GPU nodes, limit), ascending: the last tier whose floor the count reaches applies.
AUTO_TIERS: tuple[tuple[int, int], ...] = ((0, EVERY_PLACEMENT), (EVERY_PLACEMENT_UP_TO + 1, 1))
# The count written beside the limit is refreshed when the cluster's size moved this far from it (the limit
# itself is rewritten at once when it changes): one node joining a 1,000-node fleet does not rewrite 8,000
# GpuPartitions.
RECOUNT_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class AutoChoice:
    """What the operator wrote into a GpuPartition: the limit, and the GPU nodes it was chosen from."""

    limit: int
    gpu_nodes: int


def auto_limit(gpu_nodes: int) -> int:
    """The placements per profile each GPU offers on a cluster of ``gpu_nodes`` GPU nodes (0: every one)."""
    chosen = EVERY_PLACEMENT
    for floor, limit in AUTO_TIERS:
        if gpu_nodes >= floor:
            chosen = limit
    return chosen


def choose(gpu_nodes: int) -> AutoChoice:
    return AutoChoice(auto_limit(gpu_nodes), gpu_nodes)


def needs_rewrite(written: AutoChoice | None, chosen: AutoChoice) -> bool:
    """Whether the operator writes ``chosen`` over ``written``: a new limit at once, a count only once it
    moved by more than :data:`RECOUNT_SHARE` of the count written."""
    if written is None or written.limit != chosen.limit:
        return True
    return abs(written.gpu_nodes - chosen.gpu_nodes) > RECOUNT_SHARE * written.gpu_nodes


def parse_limit(text: str) -> int | None:
    """``auto`` (None) or a whole number >= 0; ValueError naming what was expected otherwise."""
    value = text.strip()
    if value.lower() == AUTO:
        return None
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(f"expected 'auto' or a whole number >= 0 (0: every placement), got {text!r}")
    return number


def in_force(flag: int | None, written: AutoChoice | None) -> tuple[int, str]:
    """The limit an agent applies and how it came to be, as its GpuPartition's status says it: ``set`` (the
    agent's flag), ``auto (N GPU nodes)`` (the operator's choice), or every placement while no choice was
    written (no policy governs the GPU, or the operator has not counted yet)."""
    if flag is not None:
        return flag, "set"
    if written is None:
        return EVERY_PLACEMENT, "auto (not chosen yet)"
    return written.limit, f"auto ({written.gpu_nodes} GPU nodes)"
