"""``dynamig plan -f`` input benchmark: how the time of a big scenario splits into parsing and planning.

Run: ``python bench/plan_input_bench.py`` (options: ``--sizes 64x200,256x1000`` as nodes x claims, 8 GPUs per
node; ``--repeat N``, best of N kept).

Each scenario is ``dynamig.planner.synthetic.large_round`` written out as YAML (block style, as a person or
a script would write it) and as JSON. Timed, in CPU seconds of this process on one core:

- ``yaml (SafeLoader)``: the pure-Python YAML loader, the baseline;
- ``yaml (CSafeLoader)`` and ``json``: what ``dynamig.cli.plan.load_document`` uses (the C loader when PyYAML
  has it, JSON for a document that is a JSON object);
- ``validate``: ``parse_scenario`` (schema and geometry checks);
- ``plan``: the planner on the parsed scenario.

The ``baseline ratio`` is the SafeLoader parse time over the time ``load_document`` takes on the same file.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import yaml

from dynamig.cli.plan import load_document
from dynamig.geometry.catalog import load_catalog
from dynamig.planner import plan
from dynamig.planner.scenario import parse_scenario
from dynamig.planner.synthetic import Round, large_round

T = TypeVar("T")


def scenario_doc(rnd: Round) -> dict[str, Any]:
    """The scenario file's document for a synthetic round. Pure."""
    return {
        "gpus": [
            {
                "node": g.node,
                "index": g.index,
                "model": g.model,
                "instances": [{"profile": i.profile, "start": i.start, "busy": i.busy} for i in g.instances],
            }
            for g in rnd.gpus
        ],
        "claims": [
            {
                "name": c.name,
                "count": c.count,
                "alternatives": list(c.alternatives),
                **({"nodes": sorted(c.nodes)} if c.nodes is not None else {}),
            }
            for c in rnd.claims
        ],
    }


def best_of(repeat: int, fn: Callable[[], T]) -> tuple[float, T]:
    best = float("inf")
    out: T | None = None
    for _ in range(repeat):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    assert out is not None
    return best, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sizes", default="64x200,256x1000", help="nodes x claims, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    catalog = load_catalog()
    print(f"C loader available: {hasattr(yaml, 'CSafeLoader')}")
    print(
        "GPUS   CLAIMS  FILE     BYTES      SAFELOADER  LOAD_DOCUMENT  VALIDATE  PLAN     PARSE SHARE  RATIO"
    )
    for size in args.sizes.split(","):
        nodes, claims = (int(x) for x in size.split("x"))
        rnd = large_round(random.Random(args.seed), catalog, nodes, 8, claims)
        doc = scenario_doc(rnd)
        texts = {
            "yaml": yaml.safe_dump(doc, default_flow_style=False, sort_keys=False),
            "json": json.dumps(doc),
        }
        for kind, text in texts.items():
            t_safe, loaded = best_of(args.repeat, functools.partial(yaml.load, text, Loader=yaml.SafeLoader))
            t_fast, fast = best_of(args.repeat, functools.partial(load_document, text))
            assert fast == loaded == doc, "loaders disagree"
            t_valid, scenario = best_of(args.repeat, functools.partial(parse_scenario, fast, catalog))
            t_plan, _ = best_of(
                1, functools.partial(plan, scenario.gpus, scenario.claims, scenario.policy, catalog)
            )
            parse = t_fast + t_valid
            print(
                f"{len(rnd.gpus):<6} {claims:<7} {kind:<8} {len(text):<10} {t_safe:<11.3f} {t_fast:<14.3f} "
                f"{t_valid:<9.3f} {t_plan:<8.3f} {100 * parse / (parse + t_plan):<12.1f} "
                f"{t_safe / t_fast if t_fast else float('inf'):.1f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
