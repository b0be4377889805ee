"""The ``dynamig`` command. Each sub-command lives in its own module with ``register(subparsers)``.

Sub-command modules import heavy dependencies (Kopf, kubernetes-asyncio, gRPC) inside their run functions so
that ``dynamig plan`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# module name under dynamig.cli -> exposes register(subparsers: argparse._SubParsersAction) -> None
_COMMAND_MODULES = ("plan", "geometry", "devcluster", "agent", "operator", "demo", "simulate", "doctor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynamig", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"dynamig.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"dynamig.cli.{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: each sub-command sets ``func(args) -> int`` as its handler."""
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
