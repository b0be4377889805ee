"""``dynamig geometry``: inspect the MIG geometry catalog (pure lookups, prints to stdout).

Examples::

    dynamig geometry models                                        # every catalog key
    dynamig geometry profiles --model A100-40GB                    # profile table (-o json|yaml: data)
    dynamig geometry layouts --model A100-40GB --profiles 1g.5gb,2g.10gb,3g.20gb,4g.20gb,7g.40gb --maximal
    dynamig geometry layouts --model H100-80GB --maximal --count
    dynamig geometry check --model A100-40GB 3g.20gb@0,1g.10gb@3   # exit 1 and the reason when refused
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from dynamig.cli import add_output_argument, render
from dynamig.geometry.model import GpuModel
from dynamig.textable import align


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("geometry", help="inspect MIG profiles, placements and valid layouts per GPU model")
    gsub = p.add_subparsers(dest="geometry_command", required=True, metavar="COMMAND")

    models = gsub.add_parser("models", help="list the GPU models in the catalog")
    add_output_argument(models)
    models.set_defaults(func=run_models)

    profiles = gsub.add_parser("profiles", help="table of a model's GPU-instance profiles")
    profiles.add_argument("--model", required=True, help="catalog key, e.g. A100-40GB")
    add_output_argument(profiles)
    profiles.set_defaults(func=run_profiles)

    layouts = gsub.add_parser("layouts", help="enumerate the valid placed layouts of a model")
    layouts.add_argument("--model", required=True, help="catalog key, e.g. A100-40GB")
    layouts.add_argument(
        "--profiles", default=None, help="comma-separated profile names to build layouts from (default: all)"
    )
    layouts.add_argument(
        "--maximal",
        action="store_true",
        help="only layouts to which no further instance of those profiles fits",
    )
    layouts.add_argument("--count", action="store_true", help="print only how many layouts there are")
    layouts.set_defaults(func=run_layouts)

    check = gsub.add_parser("check", help="say whether a layout is valid on a model, and why not")
    check.add_argument("--model", required=True, help="catalog key, e.g. A100-40GB")
    check.add_argument("layout", help="PROFILE@START,... e.g. 3g.20gb@0,2g.10gb@4")
    check.set_defaults(func=run_check)


def _table(rows: Sequence[Sequence[str]], out: TextIO) -> None:
    out.writelines(f"{line}\n" for line in align(rows))


def _model_or_none(key: str) -> GpuModel | None:
    """The catalog model ``key``, or None after printing the known keys to stderr."""
    from dynamig.geometry.catalog import load_catalog

    try:
        return load_catalog().model(key)
    except KeyError as exc:
        print(f"dynamig geometry: --model: {exc.args[0]}", file=sys.stderr)
        return None


def _confirmed(model: GpuModel) -> str:
    return "yes" if model.confirmed else "partly" if any(p.confirmed for p in model.profiles) else "no"


def models_data(models: Sequence[GpuModel]) -> list[dict[str, Any]]:
    """The ``geometry models -o json|yaml`` shape: one record per model, the table's columns. Pure."""
    return [
        {
            "model": m.key,
            "memorySlices": m.memory_slices,
            "computeSlices": m.compute_slices,
            "profiles": len(m.profiles),
            "confirmed": _confirmed(m),
            "productNames": list(m.product_names),
        }
        for m in models
    ]


def profiles_data(model: GpuModel) -> dict[str, Any]:
    """The ``geometry profiles -o json|yaml`` shape: the model, its profiles (the table's columns) and its
    notes. Pure."""
    return {
        "model": model.key,
        "memorySlices": model.memory_slices,
        "computeSlices": model.compute_slices,
        "productNames": list(model.product_names),
        "profiles": [
            {
                "name": p.name,
                "id": p.profile_id,
                "nvmlEnum": p.nvml_enum,
                "computeSlices": p.compute_slices,
                "placementStarts": list(p.placement_starts),
                "placementSize": p.placement_size,
                "maxInstances": p.max_instances,
                "memoryMiB": p.memory_mib,
                "multiprocessors": p.multiprocessors,
                "copyEngines": p.copy_engines,
                "decoders": p.decoders,
                "encoders": p.encoders,
                "jpegs": p.jpegs,
                "ofas": p.ofas,
                "confirmed": p.confirmed,
                "source": p.source,
                "inferred": list(p.inferred),
            }
            for p in model.profiles
        ],
        "notes": list(model.notes),
    }


def run_models(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print one line per catalog model. Side effect: writes to ``out`` (default stdout)."""
    out = out or sys.stdout
    from dynamig.geometry.catalog import load_catalog

    if args.output != "table":
        out.write(render(models_data(load_catalog().models()), args.output) + "\n")
        return 0
    rows = [["MODEL", "SLOTS", "COMPUTE", "PROFILES", "CONFIRMED", "PRODUCT NAMES"]]
    for m in load_catalog().models():
        rows.append([
            m.key, str(m.memory_slices), str(m.compute_slices), str(len(m.profiles)), _confirmed(m),
            "; ".join(m.product_names),
        ])  # fmt: skip
    _table(rows, out)
    return 0


def run_profiles(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print the profile table of ``--model``. Side effect: writes to ``out`` (default stdout)."""
    out = out or sys.stdout
    model = _model_or_none(args.model)
    if model is None:
        return 2
    if args.output != "table":
        out.write(render(profiles_data(model), args.output) + "\n")
        return 0
    out.write(
        f"{model.key}: {model.memory_slices} memory slices, {model.compute_slices} compute slices; "
        f"{', '.join(model.product_names)}\n"
    )
    header = ["PROFILE", "ID", "ENUM", "CI", "STARTS:SIZE", "MAX", "MiB", "SM", "CE", "DEC", "ENC", "JPG"]
    rows = [[*header, "OFA", "CONFIRMED", "SOURCE"]]
    for p in model.profiles:
        starts = ",".join(map(str, p.placement_starts))
        rows.append([
            p.name, str(p.profile_id), f"{p.nvml_enum:#x}", str(p.compute_slices),
            f"{{{starts}}}:{p.placement_size}", str(p.max_instances), str(p.memory_mib),
            str(p.multiprocessors), str(p.copy_engines), str(p.decoders), str(p.encoders), str(p.jpegs),
            str(p.ofas), "yes" if p.confirmed else "no", p.source,
        ])  # fmt: skip
    _table(rows, out)
    for p in model.profiles:
        if p.inferred:
            out.write(f"inferred: {p.name}: {', '.join(p.inferred)}\n")
    for note in model.notes:
        out.write(f"note: {note}\n")
    return 0


def run_layouts(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print (or count) the valid layouts of ``--model``. Side effect: writes to ``out`` (default stdout)."""
    out = out or sys.stdout
    from dynamig.geometry.layout import enumerate_layouts, format_layout

    model = _model_or_none(args.model)
    if model is None:
        return 2
    names = [n.strip() for n in args.profiles.split(",") if n.strip()] if args.profiles else None
    for name in names or ():
        if not model.has_profile(name):
            print(f"dynamig geometry layouts: --profiles: {model.key} has no MIG profile {name!r} "
                  f"(known: {', '.join(p.name for p in model.profiles)})", file=sys.stderr)  # fmt: skip
            return 2
    layouts = enumerate_layouts(model, names, maximal=args.maximal)
    if args.count:
        out.write(f"{sum(1 for _ in layouts)}\n")
        return 0
    try:
        for layout in layouts:
            out.write(format_layout(layout) + "\n")
        out.flush()
    except BrokenPipeError:
        # The reader (e.g. ``head``) stopped early: not an error. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def run_check(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print ``valid`` (exit 0) or the violated rule and reason (exit 1). Side effect: writes to ``out``."""
    out = out or sys.stdout
    from dynamig.geometry.layout import check_layout, parse_layout

    model = _model_or_none(args.model)
    if model is None:
        return 2
    try:
        layout = parse_layout(args.layout)
    except ValueError as exc:
        print(f"dynamig geometry check: LAYOUT {args.layout}: {exc}", file=sys.stderr)
        return 2
    violation = check_layout(model, layout)
    if violation is None:
        out.write("valid\n")
        return 0
    out.write(f"invalid [{violation.rule}] {violation.message}\n")
    return 1
