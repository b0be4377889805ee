"""Column-aligned text tables, the way every dynamig command prints them for a terminal.

One helper for the commands (``dynamig plan``, ``geometry``, ``doctor``, ``simulate``, ``kubectl dynamig``)
and the demo's story. It imports nothing of dynamig, so any layer may use it without breaking the one-way
imports that import-linter checks.
"""

from __future__ import annotations

from collections.abc import Sequence

GAP = "  "


def align(rows: Sequence[Sequence[object]], *, rule: bool = False, trim: bool = True) -> list[str]:
    """``rows`` (the first one is the header) as lines of text: each column left-aligned to its widest
    cell, columns two spaces apart. ``rule``: a line of dashes as wide as each column under the header.
    ``trim``: no trailing spaces (otherwise the last column is padded like the others). Cells are shown
    with ``str()``; every row has as many cells as the header. Pure."""
    if not rows:
        return []
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]

    def line(row: Sequence[str]) -> str:
        text = GAP.join(c.ljust(w) for c, w in zip(row, widths, strict=True))
        return text.rstrip() if trim else text

    lines = [line(row) for row in cells]
    if rule:
        lines.insert(1, line(["-" * w for w in widths]))
    return lines
