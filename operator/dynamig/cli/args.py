"""The command-line parser of ``dynamig`` and ``kubectl dynamig``, and the value types their flags share.

A value a command cannot honour is refused while the flags are read, before anything starts: one line on
stderr, ``PROG: argument --flag: what is wrong; see PROG --help``, and exit status 2. The types below raise
:class:`argparse.ArgumentTypeError`, whose text argparse puts after the flag's name.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line that names the flag and points at ``--help``
    (argparse's own print the whole usage first). Sub-parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {' '.join(message.split())}; see {self.prog} --help\n")


def _number(
    kind: type[int] | type[float], what: str, test: Callable[[float], bool]
) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or not test(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in messages it writes itself
    return parse


def _int_type(what: str, test: Callable[[float], bool]) -> Callable[[str], int]:
    parse = _number(int, what, test)
    return lambda text: int(parse(text))


def _float_type(what: str, test: Callable[[float], bool]) -> Callable[[str], float]:
    parse = _number(float, what, test)
    return lambda text: float(parse(text))


positive_int = _int_type("a whole number of at least 1", lambda v: v >= 1)
non_negative_int = _int_type("a whole number of at least 0", lambda v: v >= 0)
positive_float = _float_type("a number above 0", lambda v: v > 0)
non_negative_float = _float_type("a number of at least 0", lambda v: v >= 0)
share = _float_type("a share from 0 to 1", lambda v: 0 <= v <= 1)
positive_share = _float_type("a share above 0, at most 1", lambda v: 0 < v <= 1)
port = _int_type("a port from 0 to 65535", lambda v: 0 <= v <= 65535)


def simulated_gpus(text: str) -> str:
    """``--simulate-gpus MODEL[:COUNT],...``: every model a catalog key, every count a whole number of at
    least 0; the text itself is returned. Reads the catalog."""
    from dynamig.geometry.catalog import load_catalog

    catalog = load_catalog()
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, count = part.partition(":")
        if count and not count.isdigit():
            raise argparse.ArgumentTypeError(f"expected MODEL:COUNT with a whole COUNT, got {part!r}")
        try:
            catalog.model(key)
        except KeyError as exc:
            raise argparse.ArgumentTypeError(str(exc.args[0])) from None
    return text


def gpu_node(text: str) -> str:
    """``--gpu-node NAME=MODEL:COUNT[:mig-off][:vm][,...]``, checked as the dev cluster reads it; the text
    itself is returned."""
    from dynamig.devcluster.sandbox import parse_gpu_node

    try:
        parse_gpu_node(text)
    except (ValueError, KeyError) as exc:
        raise argparse.ArgumentTypeError(str(exc.args[0]) if exc.args else str(exc)) from None
    return text
