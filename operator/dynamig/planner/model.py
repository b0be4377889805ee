"""Planner inputs and outputs: frozen values in, frozen plan out. Pure, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from dynamig.geometry.model import Layout, PlacedInstance


@dataclass(frozen=True, slots=True, order=True)
class GpuKey:
    node: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}-gpu{self.index}"


@dataclass(frozen=True, slots=True)
class CurrentInstance:
    """An instance that exists now. ``busy`` = allocated to a claim or has processes: never touched."""

    profile: str
    start: int
    busy: bool = False

    @property
    def placed(self) -> PlacedInstance:
        return PlacedInstance(self.start, self.profile)


@dataclass(frozen=True, slots=True)
class GpuState:
    node: str
    index: int
    model: str  # catalog key, e.g. "A100-80GB"
    instances: tuple[CurrentInstance, ...] = ()

    @property
    def key(self) -> GpuKey:
        return GpuKey(self.node, self.index)


@dataclass(frozen=True, slots=True)
class ClaimDemand:
    """A pending claim: ``count`` devices, all on one node, each of one profile from ``alternatives``.

    ``alternatives`` is in preference order (DRA ``firstAvailable``). Each ``firstAvailable`` alternative
    has its own count ("two 1g.10gb, else one 7g.80gb"): ``alt_counts``, aligned with ``alternatives``;
    empty means ``count`` for every one. ``nodes`` restricts which nodes may serve it (node selector /
    affinity already resolved); ``None`` means any node.
    """

    name: str
    alternatives: tuple[str, ...]
    count: int = 1
    nodes: frozenset[str] | None = None
    alt_counts: tuple[int, ...] = ()

    def count_for(self, profile: str) -> int:
        """How many devices the claim needs when served with ``profile``. Pure."""
        if not self.alt_counts:
            return self.count
        return self.alt_counts[self.alternatives.index(profile)]


class Strategy(StrEnum):
    PACK = "pack"  # fill the most-used GPUs first so whole GPUs stay free for large profiles
    SPREAD = "spread"  # spread load over GPUs


@dataclass(frozen=True, slots=True)
class Policy:
    allowed_profiles: frozenset[str] | None = None  # None: every profile of the model
    warm_pool: Mapping[str, int] = field(default_factory=dict)  # profile -> free instances kept ready
    baseline: Mapping[str, Layout] = field(default_factory=dict)  # model key -> layout idle GPUs return to
    max_gpus_reshaped: int | None = None  # disruption budget per round; None: unlimited
    strategy: Strategy = Strategy.PACK
    # GPUs that may not change this round (still reshaping): claims may take their free instances, nothing
    # is cut or destroyed on them, so the rest of the demand is planned elsewhere.
    frozen: frozenset[GpuKey] = frozenset()
    # GPUs that may only gain instances this round (cooling down after a re-cut): claims may take their free
    # instances and have new ones cut in free memory slices, but no instance is destroyed there. A cut into
    # free slices disrupts nothing, so a burst split across two rounds does not wait out the cooldown.
    additive: frozenset[GpuKey] = frozenset()


@dataclass(frozen=True, slots=True)
class GpuPlan:
    node: str
    index: int
    model: str
    layout: Layout
    changed: bool
    reason: str  # human-readable; "" when unchanged


@dataclass(frozen=True, slots=True)
class Assignment:
    claim: str
    node: str
    index: int
    profile: str
    start: int


@dataclass(frozen=True, slots=True)
class PlanResult:
    gpus: tuple[GpuPlan, ...]
    assignments: tuple[Assignment, ...]
    unsatisfied: tuple[str, ...]
