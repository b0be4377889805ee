"""``dynamig geometry`` sub-commands, run through the real CLI parser and the packaged catalog.

Runs for real: argument parsing, catalog loading, layout enumeration, output. Nothing is simulated.
"""

from __future__ import annotations

import pytest

from dynamig.cli import main


def test_profiles_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["geometry", "profiles", "--model", "A100-40GB"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("A100-40GB: 8 memory slices, 7 compute slices")
    assert out[1].split()[:5] == ["PROFILE", "ID", "ENUM", "CI", "STARTS:SIZE"]
    row = next(line.split() for line in out if line.startswith("1g.10gb "))
    assert row[:7] == ["1g.10gb", "15", "0x9", "1", "{0,2,4,6}:2", "4", "9856"]


def test_profiles_marks_inferred_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["geometry", "profiles", "--model", "H200-141GB"]) == 0
    out = capsys.readouterr().out
    assert "inferred: 7g.141gb: placement_starts, placement_size" in out
    assert all(line.split()[13] == "no" for line in out.splitlines()[2:9])


def test_unknown_model_lists_known_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["geometry", "profiles", "--model", "V100"]) == 2
    assert "known: A100-40GB" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("profiles", "expected"),
    [
        ("1g.5gb,2g.10gb,3g.20gb,4g.20gb,7g.40gb", 19),
        ("1g.5gb,2g.10gb,3g.20gb,4g.20gb,7g.40gb,1g.10gb", 78),
        ("1g.5gb,2g.10gb,3g.20gb,4g.20gb,7g.40gb,1g.10gb,1g.5gb+me", 239),
    ],
)
def test_layouts_count(profiles: str, expected: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["geometry", "layouts", "--model", "A100-40GB", "--profiles", profiles, "--maximal", "--count"])
        == 0
    )
    assert capsys.readouterr().out.strip() == str(expected)


def test_layouts_listing(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["geometry", "layouts", "--model", "A30-24GB", "--profiles", "4g.24gb,2g.12gb", "--maximal"])
        == 0
    )
    assert capsys.readouterr().out.splitlines() == ["2g.12gb@0,2g.12gb@2", "4g.24gb@0"]
    assert main(["geometry", "layouts", "--model", "A30-24GB", "--profiles", "9g.1gb"]) == 2
    assert "no MIG profile '9g.1gb'" in capsys.readouterr().err


def test_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["geometry", "check", "--model", "A100-40GB", "4g.20gb@0,3g.20gb@4"]) == 0
    assert capsys.readouterr().out.strip() == "valid"
    assert main(["geometry", "check", "--model", "A100-40GB", "3g.20gb@0,1g.5gb@3"]) == 1
    assert (
        capsys.readouterr().out.strip() == "invalid [overlap] 1g.5gb@3: overlaps 3g.20gb@0 on memory slice 3"
    )


def test_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["geometry", "models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 12
    rtx = next(line.split() for line in lines if line.startswith("RTXPRO6000-96GB"))
    assert rtx[1:3] == ["12", "4"]
