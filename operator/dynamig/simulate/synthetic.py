"""Synthetic traces from parameter files (``simulate/traces/*.yaml``), generated with fixed seeds.

A file names the cluster, the horizon and job classes. Each class has a profile (or a weighted mix of
profiles), a device count, an arrival process and a duration distribution:

```yaml
name: diurnal-shift
seed: 11
horizon_h: 72
cluster: {nodes: 4, gpus_per_node: 8, model: A100-80GB}
classes:
- name: inference
  profile: 1g.10gb          # or  profiles: {1g.10gb: 0.6, 2g.20gb: 0.4}
  fallbacks: 1              # next-larger profiles accepted after the first choice
  rate_per_h: [[8, 20, 190]] # [from hour, to hour, arrivals per hour] within each 24 h day (Poisson)
  bursts: {every_h: 3, first_h: 1, size: 120, spread_s: 120}   # optional: batches of arrivals
  duration: {dist: lognormal, median_s: 3000, sigma: 0.6}   # or exponential/uniform/pareto/fixed
  patience_h: 1             # optional: gives up after waiting this long
  priority: LS              # optional: LS, Burstable or BE (default: LS for kind inference, else BE)
```

Each class draws from its own ``random.Random`` seeded with ``"<seed>:<class>"``, so adding a class does
not change the others. Pure apart from reading the file (``load_trace_file``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from dynamig.geometry.catalog import load_catalog
from dynamig.simulate.priority import kind_priority
from dynamig.simulate.trace import (
    Job,
    Trace,
    alternatives_for,
    assign_models,
    mixed_alternatives,
    order_models,
    profile_share,
    sorted_jobs,
    uniform_cluster,
)


class TraceSpecError(ValueError):
    """A trace parameter file is malformed; the message names the field."""


def _num(doc: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = doc.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TraceSpecError(f"{where}.{key}: expected a number, got {value!r}")
    return float(value)


def _duration(rng: random.Random, spec: Mapping[str, Any], where: str) -> float:
    dist = spec.get("dist")
    if dist == "fixed":
        return _num(spec, "seconds", where)
    if dist == "exponential":
        return rng.expovariate(1.0 / _num(spec, "mean_s", where))
    if dist == "uniform":
        return rng.uniform(_num(spec, "min_s", where), _num(spec, "max_s", where))
    if dist == "lognormal":
        value = rng.lognormvariate(math.log(_num(spec, "median_s", where)), _num(spec, "sigma", where))
    elif dist == "pareto":
        value = _num(spec, "min_s", where) * rng.paretovariate(_num(spec, "alpha", where))
    else:
        raise TraceSpecError(
            f"{where}.dist: one of fixed, exponential, uniform, lognormal, pareto; got {dist!r}"
        )
    cap = spec.get("max_s")
    return min(value, float(cap)) if isinstance(cap, int | float) else value


def _arrivals(rng: random.Random, cls: Mapping[str, Any], horizon_s: float, where: str) -> list[float]:
    times: list[float] = []
    windows = cls.get("rate_per_h", [])
    if isinstance(windows, int | float):
        windows = [[0, 24, windows]]
    if not isinstance(windows, list):
        raise TraceSpecError(f"{where}.rate_per_h: a number or a list of [from_h, to_h, rate]")
    days = math.ceil(horizon_s / 86400.0)
    for day in range(days):
        for window in windows:
            if not (isinstance(window, list) and len(window) == 3):
                raise TraceSpecError(
                    f"{where}.rate_per_h: each window is [from_h, to_h, rate], got {window!r}"
                )
            start_h, end_h, rate = (float(x) for x in window)
            if rate <= 0:
                continue
            t = day * 86400.0 + start_h * 3600.0
            end = min(horizon_s, day * 86400.0 + end_h * 3600.0)
            while True:
                t += rng.expovariate(rate / 3600.0)
                if t >= end:
                    break
                times.append(t)
    bursts = cls.get("bursts")
    if isinstance(bursts, Mapping):
        every = _num(bursts, "every_h", f"{where}.bursts") * 3600.0
        t = _num(bursts, "first_h", f"{where}.bursts", 0.0) * 3600.0
        size = int(_num(bursts, "size", f"{where}.bursts"))
        spread = _num(bursts, "spread_s", f"{where}.bursts", 0.0)
        while t < horizon_s:
            times.extend(min(horizon_s, t + rng.uniform(0.0, spread)) for _ in range(size))
            t += every
    return sorted(times)


def build_trace(
    doc: Mapping[str, Any], source: str = "<trace>", mixed: Sequence[tuple[str, float]] | None = None
) -> Trace:
    """Generate the trace a parameter document describes. Pure and deterministic (seeded).

    ``mixed`` ((model key, weight), ...): the cluster's nodes get these models instead of the file's
    (``trace.assign_models``: weighted round-robin over the nodes in order), and each job asks for the
    share of a GPU its profile holds on the file's model (``trace.profile_share``), listed as every mixed
    model's profile for that share, smallest memory first, then their fallbacks
    (``trace.mixed_alternatives``). The random draws are the same as without ``mixed``."""
    name = str(doc.get("name", source))
    seed = int(_num(doc, "seed", name))
    horizon = _num(doc, "horizon_h", name) * 3600.0
    cluster_doc = doc.get("cluster")
    if not isinstance(cluster_doc, Mapping):
        raise TraceSpecError(f"{name}.cluster: expected a mapping {{nodes, gpus_per_node, model}}")
    model_key = str(cluster_doc.get("model", "A100-80GB"))
    model = load_catalog().model(model_key)
    cluster = uniform_cluster(
        int(_num(cluster_doc, "nodes", f"{name}.cluster")),
        int(_num(cluster_doc, "gpus_per_node", f"{name}.cluster")),
        model_key,
    )
    mixed_models = None
    if mixed:
        catalog = load_catalog()
        mixed_models = order_models(catalog.model(key) for key, _ in mixed)
        cluster = assign_models(cluster, mixed)
    classes = doc.get("classes")
    if not isinstance(classes, list) or not classes:
        raise TraceSpecError(f"{name}.classes: expected a non-empty list")
    jobs: list[Job] = []
    for cls in classes:
        if not isinstance(cls, Mapping) or "name" not in cls:
            raise TraceSpecError(f"{name}.classes: each class is a mapping with a name")
        where = f"{name}.classes.{cls['name']}"
        rng = random.Random(f"{seed}:{cls['name']}")
        mix = cls.get("profiles", {cls.get("profile"): 1.0})
        if not isinstance(mix, Mapping) or not mix:
            raise TraceSpecError(f"{where}: give profile or profiles")
        names = [str(p) for p in mix]
        for p in names:
            if not model.has_profile(p):
                raise TraceSpecError(f"{where}: {model_key} has no profile {p!r}")
        weights = [float(w) for w in mix.values()]
        fallbacks = int(_num(cls, "fallbacks", where, 0))
        count = int(_num(cls, "count", where, 1))
        patience_h = cls.get("patience_h")
        patience = float(patience_h) * 3600.0 if isinstance(patience_h, int | float) else None
        duration = cls.get("duration")
        if not isinstance(duration, Mapping):
            raise TraceSpecError(f"{where}.duration: expected a mapping with dist")
        named = cls.get("priority")
        try:
            priority = kind_priority(str(cls.get("kind", cls["name"])), None if named is None else str(named))
        except ValueError as exc:
            raise TraceSpecError(f"{where}.priority: {exc}") from None
        for i, t in enumerate(_arrivals(rng, cls, horizon, where)):
            profile = rng.choices(names, weights)[0] if len(names) > 1 else names[0]
            jobs.append(
                Job(
                    name=f"{cls['name']}-{i:05d}",
                    arrival=round(t, 3),
                    duration=round(max(1.0, _duration(rng, duration, f"{where}.duration")), 3),
                    alternatives=alternatives_for(model, profile, fallbacks)
                    if mixed_models is None
                    else mixed_alternatives(
                        mixed_models, profile_share(model, model.profile(profile)), fallbacks
                    ),
                    count=count,
                    kind=str(cls.get("kind", cls["name"])),
                    share=model.profile(profile).compute_slices / model.compute_slices,
                    patience=patience,
                    priority=priority,
                )
            )
    patience_h = doc.get("patience_h")
    return Trace(
        name=name,
        cluster=cluster,
        jobs=sorted_jobs(jobs),
        horizon=horizon,
        patience=float(patience_h) * 3600.0 if isinstance(patience_h, int | float) else None,
        description=str(doc.get("description", "")).strip(),
        params=dict(doc),
    )


def load_trace_file(path: Path, mixed: Sequence[tuple[str, float]] | None = None) -> Trace:
    """Read a parameter file and generate its trace (``mixed``: see ``build_trace``). Side effect: reads
    the file."""
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise TraceSpecError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(doc, Mapping):
        raise TraceSpecError(f"{path}: expected a mapping")
    return build_trace(doc, path.stem, mixed)


def builtin_trace_names() -> tuple[str, ...]:
    """Names of the parameter files shipped in ``dynamig/simulate/traces``. Side effect: lists files."""
    root = resources.files("dynamig.simulate") / "traces"
    return tuple(sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml")))


def load_builtin_trace(name: str, mixed: Sequence[tuple[str, float]] | None = None) -> Trace:
    """Generate a shipped synthetic trace by name (e.g. ``diurnal-shift``; ``mixed``: see
    ``build_trace``). Side effect: reads a file."""
    res = resources.files("dynamig.simulate") / "traces" / f"{name}.yaml"
    if not res.is_file():
        raise TraceSpecError(f"no built-in trace {name!r} (known: {', '.join(builtin_trace_names())})")
    doc = yaml.safe_load(res.read_text())
    if not isinstance(doc, Mapping):
        raise TraceSpecError(f"{name}: expected a mapping")
    return build_trace(doc, name, mixed)
