"""The ``dynamig`` command. Each sub-command lives in its own module with ``register(subparsers)``.

Sub-command modules import heavy dependencies (Kopf, kubernetes-asyncio, gRPC) inside their run functions so
that ``dynamig plan`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence

# module name under dynamig.cli -> exposes register(subparsers: argparse._SubParsersAction) -> None
_COMMAND_MODULES = (
    "plan", "geometry", "devcluster", "agent", "operator", "uninstall", "demo", "simulate", "doctor",
)  # fmt: skip


def plain(text: str | None) -> str | None:
    """A docstring as --help shows it: reST roles and literals (``x``, :func:`x`) turned into plain text."""
    if text is None:
        return None
    return re.sub(r":[a-z]+:`([^`]*)`", r"\1", text).replace("``", "")


DESCRIPTION = (
    "Re-cut NVIDIA MIG GPUs while the cluster runs, driven by what pending Kubernetes workloads ask for "
    "through Dynamic Resource Allocation."
)


def build_parser() -> argparse.ArgumentParser:
    from dynamig import __version__

    parser = argparse.ArgumentParser(prog="dynamig", description=DESCRIPTION)
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
    """Entry point: each sub-command sets ``func(args) -> int`` as its handler."""
    parser = build_parser()
    args = parser.parse_args(argv)
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
    return result


if __name__ == "__main__":
    sys.exit(main())
