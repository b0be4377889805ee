"""Workload traces for the simulator: jobs, the cluster they run on, the mapping of GPU shares to profiles.

A trace is plain data: a cluster (nodes, GPUs per node, GPU model) and jobs that arrive at a time, ask for
``count`` devices on one node, each of one MIG profile from an ordered list of alternatives (DRA
``firstAvailable``), and run for ``duration`` seconds (``None``: never leave, the paper's protocol).
Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynamig.geometry.model import GpuModel, Profile
from dynamig.planner.warmpool import nearest_rank


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
    priority: int = 0  # the pod's priority (``dynamig.simulate.priority``); only preempting policies read it
    # whole-GPU demand (``WHOLE_ONLY``, ``WHOLE_FIRST``; "": none): read only by the policies that run GPUs
    # with MIG mode off (``dynamig.simulate.modes``); every other policy serves ``alternatives`` as before
    whole: str = ""

    @property
    def preferred(self) -> str:
        return self.alternatives[0]


# A job's whole-GPU demand (``Job.whole``). A policy with GPUs in MIG mode off (``dynamig.simulate.modes``)
# gives such a job whole GPUs (one per device, all on one node); the other policies serve its MIG
# alternatives (the model's largest profile, as the openb replay maps it), which is what users get today.
WHOLE_ONLY = "only"  # only GPUs with MIG mode off serve it
WHOLE_FIRST = "first"  # a GPU with MIG mode off first, else its MIG alternatives (DRA firstAvailable)
JOB_KINDS = ("whole-multi", "whole-single", "mig")


def job_kind(job: Job) -> str:
    """``whole-multi`` (whole GPUs, several), ``whole-single`` (one whole GPU) or ``mig``. Pure."""
    if not job.whole:
        return "mig"
    return "whole-multi" if job.count > 1 else "whole-single"


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


# -- mixed-model clusters ------------------------------------------------------------------------------------
# A job on a cluster of several GPU models asks for a share of one GPU; on each model that share is the
# model's smallest plain profile holding it (``profile_for_share``). The job lists them the DRA way, as
# ``firstAvailable`` alternatives, in the order a user would write them: the smallest memory that holds the
# share first (the cheapest GPU: models by memory size, e.g. A100-40GB, H100-80GB, H200-141GB), then the
# same for each fallback size. A GPU only offers plain profiles of its own model, so an alternative that
# names another model's profile does not match there (``Cluster.offers``).


def order_models(models: Iterable[GpuModel]) -> tuple[GpuModel, ...]:
    """Models in a job's preference order: smallest memory (cheapest) first, then by key. Pure."""
    return tuple(sorted({m.key: m for m in models}.values(), key=lambda m: (m.memory_mib, m.key)))


def _interleave(per_model: Sequence[Sequence[str]]) -> tuple[str, ...]:
    out: list[str] = []
    for level in range(max((len(a) for a in per_model), default=0)):
        for alts in per_model:
            if level < len(alts) and alts[level] not in out:
                out.append(alts[level])
    return tuple(out)


def mixed_alternatives(models: Sequence[GpuModel], share: float, fallbacks: int) -> tuple[str, ...]:
    """Alternatives for a ``share`` of one GPU on any of ``models`` (already in preference order): each
    model's ``profile_for_share``, then each model's first fallback, and so on. With one model this is
    ``alternatives_for(model, profile_for_share(model, share).name, fallbacks)``. Pure."""
    return _interleave([alternatives_for(m, profile_for_share(m, share).name, fallbacks) for m in models])


def full_alternatives(models: Sequence[GpuModel]) -> tuple[str, ...]:
    """The whole-GPU profile of each of ``models``, in their order (a multi-GPU task's alternatives). Pure."""
    return _interleave([(full_profile(m).name,) for m in models])


def compute_slices_by_name(models: Iterable[GpuModel]) -> dict[str, int]:
    """Compute slices per profile name over ``models`` (a name means the same compute size on every model
    that has it; ValueError if not). Pure."""
    out: dict[str, int] = {}
    for m in models:
        for p in m.profiles:
            known = out.setdefault(p.name, p.compute_slices)
            if known != p.compute_slices:
                raise ValueError(
                    f"profile {p.name}: {known} compute slices on one model, {p.compute_slices} on {m.key}"
                )
    return out


def preferred_on(job: Job, model: GpuModel) -> str | None:
    """The first of ``job``'s alternatives that a GPU of ``model`` offers (a plain profile of the model;
    ``Cluster.offers``); None when it offers none of them. Pure."""
    plain = {p.name for p in plain_profiles(model)}
    return next((name for name in job.alternatives if name in plain), None)


def parse_model_weights(text: str) -> tuple[tuple[str, float], ...]:
    """``A100-40GB=1,H100-80GB=2`` (weight 1 when omitted) -> ((key, weight), ...) in the order given.
    ValueError on a malformed entry, a non-positive weight or a repeated key. Pure."""
    out: list[tuple[str, float]] = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, sep, w = part.partition("=")
        key = key.strip()
        try:
            weight = float(w) if sep else 1.0
        except ValueError:
            raise ValueError(f"expected MODEL=WEIGHT, got {part!r}") from None
        if not key or weight <= 0:
            raise ValueError(f"expected MODEL=WEIGHT with a positive weight, got {part!r}")
        if any(k == key for k, _ in out):
            raise ValueError(f"model {key} given twice")
        out.append((key, weight))
    if not out:
        raise ValueError("expected at least one MODEL=WEIGHT")
    return tuple(out)


def assign_models(spec: ClusterSpec, weights: Sequence[tuple[str, float]]) -> ClusterSpec:
    """The same nodes, each given one of the weighted models so that each model gets about its share of
    the GPUs: nodes in order, each to the model furthest below its share of the GPUs assigned so far
    (ties: the order given). Equal node sizes and weights 1,1,1 give round-robin A, B, C, A, B, C, ...;
    deterministic. Pure."""
    total_w = sum(w for _, w in weights)
    assigned = [0] * len(weights)
    nodes = []
    for node in spec.nodes:
        after = sum(assigned) + node.gpus
        pick = max(range(len(weights)), key=lambda i: (after * weights[i][1] / total_w - assigned[i], -i))
        assigned[pick] += node.gpus
        nodes.append(NodeSpec(node.name, node.gpus, weights[pick][0], node.gpu_type))
    return ClusterSpec(tuple(nodes))


def gpus_per_model(spec: ClusterSpec) -> dict[str, int]:
    """GPUs of each model in ``spec`` (keys sorted). Pure."""
    out: dict[str, int] = {}
    for n in spec.nodes:
        out[n.model] = out.get(n.model, 0) + n.gpus
    return dict(sorted(out.items()))


def describe_cluster(spec: ClusterSpec) -> str:
    """``16 x A100-40GB + 8 x H100-80GB``. Pure."""
    return " + ".join(f"{n} x {k}" for k, n in gpus_per_model(spec).items())


def slice_demand(job: Job, slices_of: dict[str, int]) -> int:
    """Compute slices the job asks for: ``count`` devices of its preferred profile. Pure."""
    return job.count * slices_of[job.preferred]


def sorted_jobs(jobs: Iterable[Job]) -> tuple[Job, ...]:
    """Jobs sorted by arrival then name (a stable, deterministic order). Pure."""
    return tuple(sorted(jobs, key=lambda j: (j.arrival, j.name)))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of ``values`` (0.0 when empty). Pure."""
    return float(nearest_rank(values, q / 100.0))
