"""The fixed layouts a static-MIG cluster may be cut into, including the hindsight best fit for a trace.

- ``all-1g``: as many of the smallest profile as fit (7 x 1g.10gb on an A100-80GB);
- ``balanced``: the maximal layout with the most distinct sizes, then the most instances (2 x 1g.10gb,
  2g.20gb, 3g.40gb: NVIDIA mig-parted's ``all-balanced``);
- ``all-7g``: one full-GPU instance;
- ``best-fit``: chosen knowing the whole trace: the time-averaged number of busy devices per profile,
  scaled to the cluster, covered GPU by GPU with maximal layouts (greedy: each GPU gets the layout that
  covers the most still-uncovered slice demand).

On a cluster of several models each model gets its own layouts, from the same logic: the best fit covers
the demand expressed in that model's profiles (each job's first alternative the model offers), scaled to
that model's GPUs.

Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dynamig.geometry.layout import enumerate_layouts
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance
from dynamig.simulate.trace import (
    ClusterSpec,
    Job,
    Trace,
    full_profile,
    gpus_per_model,
    plain_profiles,
    preferred_on,
)


def maximal_layouts(model: GpuModel) -> tuple[Layout, ...]:
    """Maximal layouts built from the plain profiles, in the geometry's deterministic order. Pure."""
    return tuple(enumerate_layouts(model, [p.name for p in plain_profiles(model)], maximal=True))


def all_smallest(model: GpuModel) -> Layout:
    small = plain_profiles(model)[0].name
    return next(lay for lay in maximal_layouts(model) if all(i.profile == small for i in lay))


def balanced(model: GpuModel) -> Layout:
    return max(maximal_layouts(model), key=lambda lay: (len({i.profile for i in lay}), len(lay)))


def whole(model: GpuModel) -> Layout:
    return (PlacedInstance(0, full_profile(model).name),)


def average_mix(trace: Trace, model: GpuModel | None = None) -> dict[str, float]:
    """Time-averaged number of devices the trace asks for, per preferred profile (with ``model``: per
    profile of that model, each job's first alternative it offers; jobs it cannot serve left out). Pure."""
    mix: dict[str, float] = {}
    for job in trace.jobs:
        run = (
            trace.horizon - job.arrival
            if job.duration is None
            else min(job.duration, trace.horizon - job.arrival)
        )
        profile = job.preferred if model is None else preferred_on(job, model)
        if profile is not None:
            mix[profile] = mix.get(profile, 0.0) + job.count * max(0.0, run) / trace.horizon
    return mix


def device_mix_on(jobs: Iterable[Job], model: GpuModel) -> dict[str, float]:
    """Devices the jobs ask for, per profile of ``model`` (each job's first alternative it offers). Pure."""
    mix: dict[str, float] = {}
    for job in jobs:
        profile = preferred_on(job, model)
        if profile is not None:
            mix[profile] = mix.get(profile, 0.0) + job.count
    return mix


def best_fit(model: GpuModel, mix: dict[str, float], gpus: int) -> tuple[Layout, ...]:
    """One layout per GPU covering ``mix`` (devices per profile) scaled to fill ``gpus`` GPUs. Pure."""
    slices = {p.name: p.compute_slices for p in model.profiles}
    demand = sum(n * slices[p] for p, n in mix.items())
    if demand <= 0:
        return tuple(whole(model) for _ in range(gpus))
    scale = gpus * model.compute_slices / demand
    remaining = {p: n * scale for p, n in mix.items()}
    candidates = maximal_layouts(model)
    chosen: list[Layout] = []
    for _ in range(gpus):

        def covered(lay: Layout) -> tuple[float, int]:
            counts: dict[str, int] = {}
            for inst in lay:
                counts[inst.profile] = counts.get(inst.profile, 0) + 1
            cover = sum(min(c, max(0.0, remaining.get(p, 0.0))) * slices[p] for p, c in counts.items())
            return cover, -len(lay)

        best = max(candidates, key=covered)
        chosen.append(best)
        for inst in best:
            if inst.profile in remaining:
                remaining[inst.profile] -= 1
    return tuple(chosen)


def static_candidates(model: GpuModel, mix: dict[str, float], gpus: int) -> dict[str, tuple[Layout, ...]]:
    """Label -> per-GPU layouts (cycled over the cluster) for every static configuration compared; the
    best fit covers ``mix`` (devices per profile, e.g. ``average_mix(trace)``). Pure."""
    return {
        "all-1g": (all_smallest(model),),
        "balanced": (balanced(model),),
        "all-7g": (whole(model),),
        "best-fit": best_fit(model, mix, gpus),
    }


def mixed_static_candidates(
    models: Mapping[str, GpuModel], spec: ClusterSpec, mixes: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, tuple[Layout, ...]]]:
    """Label -> model key -> layouts (cycled over that model's GPUs): ``static_candidates`` per model, the
    best fit covering ``mixes[model key]`` on that model's GPUs. Pure."""
    counts = gpus_per_model(spec)
    out: dict[str, dict[str, tuple[Layout, ...]]] = {}
    for key in sorted(models):
        for label, layouts in static_candidates(
            models[key], dict(mixes.get(key, {})), counts.get(key, 0)
        ).items():
            out.setdefault(label, {})[key] = layouts
    return out
