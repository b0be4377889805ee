"""``dynamig plan -f scenario.yaml [-o table|json|yaml] [--offers]``: what dynamig would do, offline.

Reads a scenario (GPUs with their current instances, pending claims, policy; format in
``dynamig.planner.scenario``), runs the planner and prints the target layouts, the assignments and the
unsatisfied claims. An invalid scenario exits with status 2 and one line on stderr naming the GPU, the
instance and the rule it breaks.

``--offers`` prints instead what each node would publish to the scheduler for the current instances: the
ranked DRA devices (first = booked first), whether each is a free instance, a new placement or a re-cut
(with the free instances it replaces), and the counters it consumes. Busy instances are not offered; the
policy's ``allowedProfiles`` limit the new placements.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from dynamig.cli import add_output_argument, plain, render
from dynamig.geometry.catalog import Catalog, load_catalog
from dynamig.kube.inventory import (
    GpuInventory,
    Instance,
    Occupancy,
    OfferedDevice,
    counter_set_name,
    offered_devices,
)
from dynamig.planner import PlanResult, plan
from dynamig.planner.scenario import Scenario, ScenarioError, parse_scenario
from dynamig.textable import align

EXIT_INVALID = 2


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "plan",
        help="plan MIG layouts for a scenario file, offline",
        description=plain(__doc__.splitlines()[0] if __doc__ else None),
    )
    parser.add_argument("-f", "--file", required=True, help="scenario YAML or JSON ('-' for stdin)")
    add_output_argument(parser)
    parser.add_argument(
        "--offers",
        action="store_true",
        help="print the ranked DRA devices each node would publish for the current instances (no plan)",
    )
    parser.set_defaults(func=run)


def result_to_json(result: PlanResult) -> dict[str, Any]:
    """The plan as plain data (the ``-o json`` shape). Pure."""
    return {
        "gpus": [
            {
                "node": g.node,
                "index": g.index,
                "model": g.model,
                "layout": [{"profile": i.profile, "start": i.start} for i in g.layout],
                "changed": g.changed,
                "reason": g.reason,
            }
            for g in result.gpus
        ],
        "assignments": [
            {"claim": a.claim, "node": a.node, "index": a.index, "profile": a.profile, "start": a.start}
            for a in result.assignments
        ],
        "unsatisfied": list(result.unsatisfied),
    }


def result_to_table(result: PlanResult) -> str:
    """The plan as aligned text for a terminal. Pure."""
    rows = [("GPU", "MODEL", "LAYOUT", "CHANGED", "REASON")]
    for g in result.gpus:
        layout = " ".join(f"{i.profile}@{i.start}" for i in g.layout) or "-"
        rows.append(
            (f"{g.node}-gpu{g.index}", g.model, layout, "yes" if g.changed else "no", g.reason or "-")
        )
    lines = align(rows)
    lines.append("")
    arows = [("CLAIM", "GPU", "DEVICE")]
    arows += [(a.claim, f"{a.node}-gpu{a.index}", f"{a.profile}@{a.start}") for a in result.assignments]
    lines += align(arows) if result.assignments else ["no assignments"]
    lines.append("")
    lines.append("unsatisfied: " + (", ".join(result.unsatisfied) if result.unsatisfied else "none"))
    return "\n".join(lines)


def scenario_offers(scenario: Scenario, catalog: Catalog) -> dict[str, tuple[OfferedDevice, ...]]:
    """Per node (sorted), the devices it would publish, in publishing order. Pure."""
    nodes: dict[str, list[GpuInventory]] = {}
    allowed = scenario.policy.allowed_profiles
    for g in scenario.gpus:
        model = catalog.model(g.model)
        instances = tuple(
            Instance(i.profile, i.start, Occupancy.BUSY if i.busy else Occupancy.FREE) for i in g.instances
        )
        nodes.setdefault(g.node, []).append(
            GpuInventory(g.index, model, "", instances=instances, allowed_profiles=allowed)
        )
    return {node: offered_devices(gpus) for node, gpus in sorted(nodes.items())}


def _counters_text(counters: dict[str, int]) -> str:
    """``mem-4..7 media-all=1``: memory-slice counters as a range, others by name (value when not 1)."""
    mem = sorted(int(k.removeprefix("mem-")) for k in counters if k.startswith("mem-"))
    parts = []
    if mem:
        parts.append(f"mem-{mem[0]}" if len(mem) == 1 else f"mem-{mem[0]}..{mem[-1]}")
    parts += [k if v == 1 else f"{k}={v}" for k, v in counters.items() if not k.startswith("mem-")]
    return " ".join(parts)


def offers_to_json(offers: dict[str, tuple[OfferedDevice, ...]]) -> dict[str, Any]:
    """The ``--offers -o json`` shape. Pure."""
    return {
        "offers": [
            {
                "node": node,
                "rank": rank,
                "device": d.name,
                "gpu": d.gpu_index,
                "profile": d.profile,
                "start": d.start,
                "kind": d.kind,
                "destroys": [{"profile": i.profile, "start": i.start} for i in d.destroys],
                "counterSet": counter_set_name(d.gpu_index),
                "counters": dict(d.counters),
            }
            for node, devices in offers.items()
            for rank, d in enumerate(devices, 1)
        ]
    }


def offers_to_table(offers: dict[str, tuple[OfferedDevice, ...]]) -> str:
    """The ranked devices as aligned text. Pure."""
    rows = [("NODE", "RANK", "DEVICE", "PROFILE", "START", "KIND", "DESTROYS", "COUNTERS")]
    for node, devices in offers.items():
        for rank, d in enumerate(devices, 1):
            destroys = " ".join(f"{i.profile}@{i.start}" for i in d.destroys) or "-"
            counters = f"{counter_set_name(d.gpu_index)}: {_counters_text(dict(d.counters))}"
            rows.append((node, str(rank), d.name, d.profile, str(d.start), d.kind, destroys, counters))
    return "\n".join(align(rows))


# libyaml's C parser is an order of magnitude faster on big scenario files; the pure-Python one is the
# fallback where PyYAML was built without it. Both construct only plain data (the safe subset).
_YamlLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_document(text: str) -> Any:
    """The scenario document in ``text``: JSON when it is a JSON object (the fast path for generated
    files), else YAML with the C loader when available. Raises ``yaml.YAMLError``. Pure."""
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass  # YAML flow mappings also start with "{"; let the YAML parser say what is wrong
    return yaml.load(text, Loader=_YamlLoader)  # a safe loader: CSafeLoader or SafeLoader


def _invalid(file: str, why: str) -> int:
    """Say in one line, naming -f, why the scenario cannot be planned. Side effect: writes stderr."""
    print(f"dynamig plan: -f {file}: {' '.join(why.split())}", file=sys.stderr)
    return EXIT_INVALID


def run(args: argparse.Namespace) -> int:
    """Read the scenario file, plan, print. Side effects: reads a file or stdin, writes stdout/stderr."""
    try:
        if args.file == "-":
            text = sys.stdin.read()
        else:
            with open(args.file, encoding="utf-8") as fh:
                text = fh.read()
    except OSError as exc:
        return _invalid(args.file, f"cannot read: {(exc.strerror or str(exc)).lower()}")
    except UnicodeDecodeError:
        return _invalid(args.file, "not a text file (not UTF-8)")
    try:
        document = load_document(text)
    except yaml.YAMLError as exc:
        return _invalid(args.file, f"not valid YAML: {exc}")
    catalog = load_catalog()
    try:
        scenario = parse_scenario(document, catalog)
    except ScenarioError as exc:
        return _invalid(args.file, str(exc))
    if args.offers:
        offers = scenario_offers(scenario, catalog)
        print(
            offers_to_table(offers) if args.output == "table" else render(offers_to_json(offers), args.output)
        )
        return 0
    result = plan(scenario.gpus, scenario.claims, scenario.policy, catalog)
    print(result_to_table(result) if args.output == "table" else render(result_to_json(result), args.output))
    return 0
