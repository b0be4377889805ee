"""Workload traces for the simulator: jobs, the cluster they run on, the mapping of GPU shares to profiles.

A trace is plain data: a cluster (nodes, GPUs per node, GPU model) and jobs that arrive at a time, ask for
``count`` devices on one node, each of one MIG profile from an ordered list of alternatives (DRA
``firstAvailable``), and run for ``duration`` seconds (``None``: never leave, the paper's protocol).
Pure, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynamig.geometry.model import GpuModel, Profile


@dataclass(frozen=True, slots=True)
class Job:
    """One workload: ``count`` devices on one node, each one of ``alternatives`` (preference order)."""

    name: str
    arrival: float
    duration: float | None
    alternatives: tuple[str, ...]
    count: int = 1
    kind: str = ""
    share: float = 1.0  # GPU fraction per device the workload asked for (trace units), for allocation rates
    patience: float | None = None  # seconds it waits before giving up; None: the trace's default
    gpu_types: tuple[str, ...] = ()  # node GPU types it may run on (the trace's gpu_spec); empty: any

    @property
    def preferred(self) -> str:
        return self.alternatives[0]


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    gpus: int
    model: str  # catalog key
    gpu_type: str = ""  # the GPU type the trace names for the node (jobs' gpu_types match it)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    nodes: tuple[NodeSpec, ...]

    @property
    def gpu_count(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def models(self) -> tuple[str, ...]:
        return tuple(sorted({n.model for n in self.nodes}))

    def nodes_for(self, job: Job) -> frozenset[str] | None:
        """Names of the nodes ``job`` may run on; None: any. Pure."""
        if not job.gpu_types:
            return None
        return frozenset(n.name for n in self.nodes if n.gpu_type in job.gpu_types)


def job_fits_node(job: Job, node: NodeSpec) -> bool:
    """Whether ``job``'s GPU-type constraint admits ``node``. Pure."""
    return not job.gpu_types or node.gpu_type in job.gpu_types


@dataclass(frozen=True, slots=True)
class Trace:
    """A cluster and the jobs offered to it over ``[0, horizon]`` seconds."""

    name: str
    cluster: ClusterSpec
    jobs: tuple[Job, ...]
    horizon: float
    patience: float | None = None  # a job that waited this long leaves unserved; None: waits forever
    description: str = ""
    params: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if any(b.arrival < a.arrival for a, b in zip(self.jobs, self.jobs[1:], strict=False)):
            raise ValueError(f"trace {self.name}: jobs must be sorted by arrival")


def uniform_cluster(nodes: int, gpus_per_node: int, model: str, prefix: str = "node") -> ClusterSpec:
    """A cluster of ``nodes`` identical nodes. Pure."""
    return ClusterSpec(tuple(NodeSpec(f"{prefix}-{i:04d}", gpus_per_node, model) for i in range(nodes)))


def plain_profiles(model: GpuModel) -> tuple[Profile, ...]:
    """The model's profiles without media-engine variants or the double-memory 1g, smallest first. Pure.

    These are the shapes a share is rounded to (on an A100-80GB: 1g.10gb, 2g.20gb, 3g.40gb, 4g.40gb,
    7g.80gb). Variants with ``+me``/``-me``/``+gfx`` differ in engines, not in size, and the double-memory
    1g (e.g. ``1g.20gb``) holds less compute than ``2g`` for the same memory slices.
    """
    by_compute: dict[int, Profile] = {}
    for p in model.profiles:
        if p.media.value:
            continue
        known = by_compute.get(p.compute_slices)
        # one profile per compute size: the one with the fewest memory slices (the plain ``1_SLICE`` 1g)
        if known is None or p.placement_size < known.placement_size:
            by_compute[p.compute_slices] = p
    return tuple(by_compute[c] for c in sorted(by_compute))


def profile_share(model: GpuModel, profile: Profile) -> float:
    """The fraction of the GPU an instance of ``profile`` guarantees: the smaller of its compute and memory
    fractions. Pure."""
    return min(profile.compute_slices / model.compute_slices, profile.placement_size / model.memory_slices)


def profile_for_share(model: GpuModel, share: float) -> Profile:
    """Smallest plain profile whose compute and memory fractions both hold ``share`` (0 < share <= 1).
    Pure."""
    for p in plain_profiles(model):
        if profile_share(model, p) + 1e-9 >= share:
            return p
    return plain_profiles(model)[-1]


def alternatives_for(model: GpuModel, preferred: str, fallbacks: int) -> tuple[str, ...]:
    """``preferred`` then up to ``fallbacks`` next-larger plain profiles (never the full GPU as a fallback
    for a fractional request, so a small job never silently takes a whole GPU). Pure."""
    plain = [p.name for p in plain_profiles(model)]
    i = plain.index(preferred)
    larger = plain[i + 1 : len(plain) - 1]
    return (preferred, *larger[:fallbacks])


def full_profile(model: GpuModel) -> Profile:
    """The profile that covers the whole GPU (``7g.80gb`` on an A100-80GB). Pure."""
    return plain_profiles(model)[-1]


def share_mapping_table(model: GpuModel) -> list[tuple[str, float, float]]:
    """(profile, lowest share it takes, highest share it holds) for every plain profile. Pure."""
    rows: list[tuple[str, float, float]] = []
    low = 0.0
    for p in plain_profiles(model):
        high = profile_share(model, p)
        rows.append((p.name, low, high))
        low = high
    return rows


def slice_demand(job: Job, slices_of: dict[str, int]) -> int:
    """Compute slices the job asks for: ``count`` devices of its preferred profile. Pure."""
    return job.count * slices_of[job.preferred]


def sorted_jobs(jobs: Iterable[Job]) -> tuple[Job, ...]:
    """Jobs sorted by arrival then name (a stable, deterministic order). Pure."""
    return tuple(sorted(jobs, key=lambda j: (j.arrival, j.name)))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of ``values`` (0.0 when empty). Pure."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]
