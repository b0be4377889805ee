"""The ``dynamig`` command. Each sub-command lives in its own module with ``register(subparsers)``.

Sub-command modules import heavy dependencies (Kopf, kubernetes-asyncio, gRPC) inside their run functions so
that ``dynamig plan`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

# module name under dynamig.cli -> exposes register(subparsers: argparse._SubParsersAction) -> None
_COMMAND_MODULES = (
    "plan", "geometry", "devcluster", "agent", "operator", "uninstall", "demo", "simulate", "doctor",
)  # fmt: skip


def plain(text: str | None) -> str | None:
    """A docstring as --help shows it: reST roles and literals (``x``, :func:`x`) turned into plain text."""
    if text is None:
        return None
    return re.sub(r":[a-z]+:`([^`]*)`", r"\1", text).replace("``", "")


# -o/--output of every command that prints a table (`dynamig plan`, `doctor`, `geometry models|profiles`,
# `kubectl dynamig plan|verify`; `kubectl dynamig export` takes the same names, defaults to yaml and refuses a
# table): the same name, choices and default everywhere. No `wide`: every table already shows every column.
OUTPUT_FORMATS = ("table", "json", "yaml")
# What a text table shows for "nothing"; JSON and YAML show null instead.
EMPTY_MARKS = ("", "-")


WIDE_HINT = "the table already shows every column; use -o table (the default), json or yaml"


def output_format(wide_hint: str = WIDE_HINT) -> Callable[[str], str]:
    """The type of ``-o``: kubectl's habit ``-o wide`` is refused with ``wide_hint`` (argparse puts the
    flag's name before it); any other name is left to the flag's choices. Pure."""

    def parse(text: str) -> str:
        if text == "wide":
            raise argparse.ArgumentTypeError(f"wide: {wide_hint}")
        return text

    parse.__name__ = "output format"  # argparse names the type in messages it writes itself
    return parse


def add_output_argument(
    parser: argparse.ArgumentParser,
    *,
    default: str = "table",
    help_text: str = "",
    wide_hint: str = WIDE_HINT,
) -> None:
    """The shared ``-o/--output`` flag: :data:`OUTPUT_FORMATS`, ``table`` by default."""
    parser.add_argument(
        "-o",
        "--output",
        type=output_format(wide_hint),
        choices=OUTPUT_FORMATS,
        default=default,
        help=help_text
        or f"output format: {', '.join(OUTPUT_FORMATS)} (default {default}); machine formats show an empty "
        "value as null",
    )


def nulls_for_empty(value: Any) -> Any:
    """``value`` with the tables' marks for nothing ("" and "-") as None, in every dict and list. Pure."""
    if isinstance(value, str):
        return None if value in EMPTY_MARKS else value
    if isinstance(value, dict):
        return {k: nulls_for_empty(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [nulls_for_empty(v) for v in value]
    return value


def render(data: Any, output: str) -> str:
    """``data`` as ``-o json`` or ``-o yaml`` prints it (no trailing newline), empty values null. Pure."""
    data = nulls_for_empty(data)
    if output == "yaml":
        import yaml

        return str(yaml.safe_dump(data, sort_keys=False)).rstrip("\n")
    return json.dumps(data, indent=2)


DESCRIPTION = (
    "Re-cut NVIDIA MIG GPUs while the cluster runs, driven by what pending Kubernetes workloads ask for "
    "through Dynamic Resource Allocation."
)


def build_parser() -> argparse.ArgumentParser:
    from dynamig import __version__
    from dynamig.cli.args import Parser

    parser = Parser(prog="dynamig", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"dynamig {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"dynamig.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"dynamig.cli.{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


# Packages outside the runtime install (requirements/runtime.lock), with the extra that brings each.
DEV_ONLY_PACKAGES = {"cryptography": "devcluster", "matplotlib": "sim"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: each sub-command sets ``func(args) -> int`` as its handler. A failure a person can fix
    (``dynamig.cli.errors``) is one line on stderr and exit status 1 (or the error's own); any other
    exception keeps its traceback. A usage error (a flag's value refused, one line) returns status 2, and
    ``--help`` or ``--version`` 0, instead of leaving through SystemExit."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    try:
        result: int = args.func(args)
    except ModuleNotFoundError as exc:
        if exc.name not in DEV_ONLY_PACKAGES:
            raise
        # The runtime image leaves out what only the local control plane, the demo and plots need.
        print(
            f"dynamig {args.command}: needs {exc.name}, which this install leaves out: "
            f"pip install 'dynamig[{DEV_ONLY_PACKAGES[exc.name]}]'",
            file=sys.stderr,
        )
        return 1
    except BrokenPipeError:
        # The reader went away (`dynamig geometry ... | head`): not our error; silence the flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        from dynamig.cli.errors import describe, exit_code

        message = describe(exc)
        if message is None:
            raise
        print(f"dynamig {args.command}: {message}", file=sys.stderr)
        return exit_code(exc)
    return result


if __name__ == "__main__":
    sys.exit(main())
