"""Drain sweep: ``dynamig`` against ``dynamig-drain`` (GpuPartitionPolicy ``spec.drain``) under each setting
of its knobs, on a synthetic trace (several seeds) or the openb replay.

Run: ``python bench/drain_sweep.py`` (the built-in ``bursty-inference``, its file's seed). Options:
``--trace NAME|FILE.yaml``, ``--seeds 23,1,2`` (each replaces the trace file's seed), ``--alibaba DIR
--load 1.5 --stride 10`` (the openb replay instead of a synthetic trace), ``--node-orders``,
``--afters`` (seconds), ``--max-gpus``, ``--hold-s``, ``--large`` (the profile that starves, default
``7g.80gb``) and ``--small`` (the profiles whose mean wait is shown).

Printed per trace and node order, one row per policy or setting: the large profile's p95 time to running
(single-device jobs whose first choice it is, every one that arrived; one never started waits until the
horizon) and its ratio to ``dynamig``'s; served slice-hours and their ratio to ``dynamig``'s; the mean
time to running of each small profile; drains started and expired; evictions (0: a drain evicts nobody).
The issue's goal: large p95 <= 0.5x ``dynamig``'s with served >= 0.99x.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from dynamig.geometry.catalog import load_catalog
from dynamig.simulate import alibaba
from dynamig.simulate.drain_policy import DrainSettings
from dynamig.simulate.engine import RunResult, SimConfig, simulate
from dynamig.simulate.runner import DynamigSettings, allocator_factories, cluster_models
from dynamig.simulate.static_layouts import average_mix
from dynamig.simulate.synthetic import build_trace
from dynamig.simulate.trace import Trace
from dynamig.textable import align

MODEL = "A100-80GB"


def numbers(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def synthetic(name: str, seeds: list[float]) -> list[Trace]:
    """The trace ``name`` (built-in name or parameter file) once per seed (none: the file's own)."""
    path = Path(name)
    if not path.is_file():
        path = Path(__file__).parent.parent / "operator/dynamig/simulate/traces" / f"{name}.yaml"
    doc = yaml.safe_load(path.read_text())
    out = []
    for seed in seeds or [doc["seed"]]:
        seeded = {**doc, "seed": int(seed), "name": f"{doc['name']} (seed {int(seed)})"}
        out.append(build_trace(seeded, path.stem))
    return out


def openb(directory: Path, load: float, stride: int) -> Trace:
    model = load_catalog().model(MODEL)
    tasks, full = alibaba.load(directory, model)
    small = alibaba.every_kth_node(full, stride)
    capacity = sum(n.gpus for n in small.nodes) * model.compute_slices
    compress = alibaba.compression_for_load(tasks, model, capacity, load)
    return alibaba.replay_trace(
        tasks, small, model, compress=compress, until_last_arrival=True, name=f"openb-load{load:g}"
    )


def run(trace: Trace, cfg: SimConfig, policy: str, dyn: DynamigSettings) -> tuple[RunResult, int, int]:
    """One policy on ``trace``: its result, and the drains it started and saw expire."""
    mixes = {m.key: average_mix(trace, m) for m in cluster_models(trace.cluster)}
    ((_, make),), _ = allocator_factories(trace.cluster, mixes, cfg, dyn, (policy,))
    alloc = make()
    result = simulate(trace, alloc, cfg)
    return result, getattr(alloc, "drains_started", 0), getattr(alloc, "drains_expired", 0)


def row(
    label: str, got: tuple[RunResult, int, int], base: RunResult, large: str, small: list[str]
) -> list[str]:
    r, started, expired = got
    p95 = r.wait_p95_by_profile.get(large, 0.0)
    base_p95 = base.wait_p95_by_profile.get(large, 0.0)
    return [
        label,
        f"{p95 / 60:.1f} min",
        f"{p95 / base_p95:.2f}x" if base_p95 else "-",
        f"{r.served_slice_h:,.0f}",
        f"{r.served_slice_h / base.served_slice_h:.4f}x",
        *(f"{r.wait_mean_by_profile.get(p, 0.0):,.0f} s" for p in small),
        f"{started} / {expired}",
        f"{r.evictions}",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="bursty-inference")
    p.add_argument("--seeds", default="")
    p.add_argument("--alibaba", type=Path)
    p.add_argument("--load", type=float, default=1.5)
    p.add_argument("--stride", type=int, default=10)
    p.add_argument("--node-orders", default="pack,spread")
    p.add_argument("--create-latency-s", type=float, default=6.0)
    p.add_argument("--afters", default="60,180,300")
    p.add_argument("--max-gpus", default="1,2,4")
    p.add_argument("--hold-s", type=float, default=3600.0)
    p.add_argument("--large", default="7g.80gb")
    p.add_argument("--small", default="1g.10gb,2g.20gb")
    args = p.parse_args()

    traces = (
        [openb(args.alibaba, args.load, args.stride)]
        if args.alibaba
        else synthetic(args.trace, numbers(args.seeds))
    )
    small = [x.strip() for x in args.small.split(",") if x.strip()]
    header = [
        "policy", f"{args.large} p95", "/ dynamig", "served slice-h", "/ dynamig",
        *(f"{p} mean" for p in small), "drains started / expired", "evictions",
    ]  # fmt: skip
    settings = [
        DrainSettings(after_s=a, max_gpus=int(m), hold_s=args.hold_s)
        for a in numbers(args.afters)
        for m in numbers(args.max_gpus)
    ]
    for trace in traces:
        for order in [o.strip() for o in args.node_orders.split(",") if o.strip()]:
            cfg = SimConfig(reshape_latency_s=args.create_latency_s, node_order=order)
            base = run(trace, cfg, "dynamig", DynamigSettings())
            rows = [row("dynamig", base, base[0], args.large, small)]
            for s in settings:
                got = run(trace, cfg, "dynamig-drain", DynamigSettings(drain=s))
                label = f"dynamig-drain (after {s.after_s:g}s, {s.max_gpus} GPUs)"
                rows.append(row(label, got, base[0], args.large, small))
            print(f"\n== {trace.name}, {order} node order, create {args.create_latency_s:g}s", flush=True)
            print("\n".join(align([header, *rows], rule=True)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
