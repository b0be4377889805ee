"""The one text-table helper every command and the demo print with. Real: the helper itself, on plain
values; nothing is simulated."""

from __future__ import annotations

from dynamig.textable import align


def test_columns_are_left_aligned_two_spaces_apart_without_trailing_spaces() -> None:
    rows = [("GPU", "MODEL", "LAYOUT"), ("n1-gpu0", "A100-80GB", "1g.10gb@0"), ("n1-gpu10", "H100", "-")]
    assert align(rows) == [
        "GPU       MODEL      LAYOUT",
        "n1-gpu0   A100-80GB  1g.10gb@0",
        "n1-gpu10  H100       -",
    ]


def test_a_rule_under_the_header_and_padded_last_column() -> None:
    assert align([("policy", "served"), ("dynamig", "98.0%"), ("first-fit", "1")], rule=True, trim=False) == [
        "policy     served",
        "---------  ------",
        "dynamig    98.0% ",
        "first-fit  1     ",
    ]


def test_a_header_alone_and_cells_that_are_not_text() -> None:
    assert align([("A", "LONGER")], rule=True) == ["A  LONGER", "-  ------"]
    assert align([("N", "X"), (10, 2.5)]) == ["N   X", "10  2.5"]
    assert align([]) == []
