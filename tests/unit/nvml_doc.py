"""What nvml.h (``tests/data/nvml/nvml.h``, verbatim from NVIDIA/go-nvml) says, for the tests that check the
simulated NVML against it: a function's doc comment, a structure member's, a ``#define``'s or an enum
value's, each with whitespace squashed so a quote may be wrapped freely."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

HEADER = Path(__file__).resolve().parents[1] / "data" / "nvml" / "nvml.h"


def squash(text: str) -> str:
    return " ".join(text.split())


def plain(text: str) -> str:
    """``text`` without Doxygen's ``\\ref`` and ``\\a`` markers, squashed."""
    return squash(text.replace("\\ref ", "").replace("\\a ", ""))


@cache
def header() -> str:
    return HEADER.read_text(errors="replace")


def doc_block(c_function: str) -> str:
    """The doc comment right above ``nvmlReturn_t DECLDIR <c_function>(`` (whitespace squashed)."""
    text = header()
    decl = text.find(f"nvmlReturn_t DECLDIR {c_function}(")
    assert decl >= 0, f"{c_function} is not declared in nvml.h"
    start = text.rfind("/**", 0, decl)
    return squash(text[start:decl].replace("*", " "))


def typedef_member_doc(typedef: str, member: str) -> str:
    """The ``//!<`` comment of ``member`` in the structure ``typedef struct { ... } <typedef>;``."""
    text = header()
    end = text.find(f"}} {typedef};")
    assert end >= 0, f"no typedef struct {typedef} in nvml.h"
    body = text[text.rfind("typedef struct", 0, end) : end]
    m = re.search(rf"\b{member}(?:\[\w+\])?;\s*//!<\s*(.*)", body)
    assert m, f"{typedef}.{member} not found"
    return squash(m.group(1))


def member_doc(struct: str, member: str) -> str:
    """The ``//!<`` comment of ``member`` in ``typedef struct <struct>``, with the ``//`` lines after it."""
    body = header()[header().index(f"typedef struct {struct}") :]
    body = body[: body.index("}")]
    m = re.search(rf"\b{member};\s*//!<\s*(.*(?:\n\s*//(?!!<).*)*)", body)
    assert m, f"{struct}.{member} not found"
    return squash(re.sub(r"\n\s*//", " ", m.group(1)))


def define_doc(name: str) -> str:
    """The ``//!<`` comment of ``#define <name> <value>``."""
    m = re.search(rf"^#define {name}\s+\S+\s*//!<\s*(.*)$", header(), re.MULTILINE)
    assert m, f"#define {name} not found"
    return squash(m.group(1))


def define_value(name: str) -> int:
    """The integer value of ``#define <name> <value>``."""
    m = re.search(rf"^#define {name}\s+(\w+)", header(), re.MULTILINE)
    assert m, f"#define {name} not found"
    return int(m.group(1), 0)


def enum_doc(name: str) -> str:
    """The ``//!<`` comment of enum value ``<name> = <value>,``."""
    m = re.search(rf"^\s*{name}\s*=\s*\w+,?\s*//!<\s*(.*)$", header(), re.MULTILINE)
    assert m, f"enum value {name} not found"
    return squash(m.group(1))
