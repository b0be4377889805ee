"""The geometry catalog against NVIDIA's published MIG tables (``docs/reference/mig-geometry.md``).

The simulated NVML enforces placements with the catalog itself, so every other test would pass with a wrong
catalog. This module is the independent check: it parses the reference's per-model tables (profile, ID, NVML
enum, compute slices, placement starts : size, max instances, SMs, engines, GiB/MiB), its NVML enum table,
the grid and PCI ids in each model heading, and the prose of the H20 section (which has no table), and
compares every model and profile the reference lists with the packaged catalog.

Rows or cells the reference marks unconfirmed (``(inferred)``, ``?``, "Placements **inferred**", "engine
counts: **inferred**", the H20 "everything else is inferred") are compared too: where the reference gives a
value the catalog must hold it, and the message says the reference row is unconfirmed. In addition the
catalog may not claim confirmed (``confirmed: true`` or a field missing from ``inferred``) what the reference
only infers. Memory is compared to the printed GiB within half a unit of its last printed digit (x 1024), or
exactly where the reference gives MiB. The last tests alter the reference text and check the difference is
caught, so these tests can fail.

Real: the reference file and the catalog data files. Nothing is simulated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dynamig.geometry.catalog import GI_PROFILE_COUNT, GI_PROFILE_ENUMS, load_catalog
from dynamig.geometry.model import GpuModel, Profile

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "mig-geometry.md"

# Heading prefix of each model section (after "## N. ") -> catalog key. Sections 1, 13 and 14 are not models.
SECTION_KEYS = {
    "A100-SXM4-40GB": "A100-40GB",
    "A100 80GB": "A100-80GB",
    "A30 24GB": "A30-24GB",
    "H100 80GB": "H100-80GB",
    "H100 NVL": "H100-94GB",
    "H100 96GB on GH200": "H100-96GB",
    "H200 141GB": "H200-141GB",
    "H20 (": "H20-96GB",
    "B200 180GB": "B200-180GB",
    "GB200 ": "GB200-186GB",
    "RTX PRO 6000": "RTXPRO6000-96GB",
}

# The H20 section has no table: "inferred from the GH100 pattern" is read from the section whose profile
# names it shares.
H20_KEY = "H20-96GB"
H20_PATTERN_KEY = "H100-96GB"
TIMES = "\u00d7"  # the reference writes caps as "1g.12gb\u00d77"

# Table column -> catalog Profile field ("placement" fills placement_starts and placement_size).
COLUMNS = {
    "profile": "name",
    "lgip id": "profile_id",
    "id": "profile_id",
    "nvml enum": "nvml_enum",
    "enum": "nvml_enum",
    "compute slices": "compute_slices",
    "compute": "compute_slices",
    "placement starts : size": "placement",
    "starts : size": "placement",
    "max": "max_instances",
    "sm": "multiprocessors",
    "ce": "copy_engines",
    "dec": "decoders",
    "enc": "encoders",
    "jpeg": "jpegs",
    "ofa": "ofas",
}
ENGINE_FIELDS = ("copy_engines", "decoders", "encoders", "jpegs", "ofas")
PLACEMENT_FIELDS = ("placement_starts", "placement_size")
# Fields that follow from the profile name (compute slices from "Ng", the enum from the name's shape).
NAME_DERIVED = ("compute_slices", "nvml_enum")
COMPARED = (
    "profile_id", "nvml_enum", "compute_slices", *PLACEMENT_FIELDS, "max_instances", "multiprocessors",
    *ENGINE_FIELDS, "memory_mib",
)  # fmt: skip


@dataclass(frozen=True)
class RefValue:
    """One value the reference gives (None when it gives none, e.g. ``?``) and whether it is confirmed."""

    value: object
    confirmed: bool
    cell: str
    tolerance: float = 0.0  # for memory_mib: MiB either side


@dataclass
class RefRow:
    name: str
    values: dict[str, RefValue] = field(default_factory=dict)


@dataclass
class RefModel:
    key: str
    section: str  # "§5 H100 80GB (...)"
    memory_slices: int | None
    compute_slices: int | None
    pci_ids: tuple[int, ...]
    rows: dict[str, RefRow]


class ReferenceFormatError(ValueError):
    """The reference text no longer has the shape this parser reads."""


# --- parsing -------------------------------------------------------------------------------------------


def _sections(text: str) -> list[tuple[str, str, list[str]]]:
    """(number, title, body lines) of every "## N. title" section."""
    out: list[tuple[str, str, list[str]]] = []
    for line in text.splitlines():
        m = re.match(r"^## (\d+)\. (.*)$", line)
        if m:
            out.append((m.group(1), m.group(2).strip(), []))
        elif out:
            out[-1][2].append(line)
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(lines: list[str]) -> list[list[list[str]]]:
    """Markdown tables in ``lines`` as lists of cell rows (header first, separator dropped)."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for line in lines:
        if line.startswith("|"):
            cells = _cells(line)
            if current is None:
                current = []
                tables.append(current)
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        else:
            current = None
    return tables


def parse_enum_table(text: str) -> dict[str, int]:
    """``NVML_GPU_INSTANCE_PROFILE_*`` name -> value from the reference's NVML enum table (section 1),
    ``NVML_GPU_INSTANCE_PROFILE_COUNT`` included."""
    prefix = "NVML_GPU_INSTANCE_PROFILE_"
    out: dict[str, int] = {}
    for table in _tables(text.splitlines()):
        if table[0][:2] != ["enum", "value"]:
            continue
        for cells in table[1:]:
            names, values = cells[0].split(" / "), cells[1].split(" / ")
            if names[0].startswith("NVML_") and not names[0].startswith(prefix):
                continue  # compute-instance and MIG-mode constants
            if not names[0].startswith((prefix, "…_")):
                continue
            if len(names) != len(values):
                raise ReferenceFormatError(
                    f"enum row {cells} pairs {len(names)} names with {len(values)} values"
                )
            for name, value in zip(names, values, strict=True):
                bare = name.strip().removeprefix(prefix).removeprefix("…_")
                out[prefix + bare] = int(value.strip(), 16)
    if not out:
        raise ReferenceFormatError("no NVML enum table found")
    return out


def _unconfirmed_cell(cell: str) -> bool:
    return "inferred" in cell or "?" in cell


def _number(cell: str) -> tuple[float | None, int]:
    """The cell's primary number (bold and ``~`` stripped) and its count of decimals; None for ``?``."""
    m = re.match(r"^~?\s*(\d+(?:\.(\d+))?)", cell.replace("**", "").strip())
    if m is None:
        return None, 0
    return float(m.group(1)), len(m.group(2) or "")


def _int_value(cell: str) -> RefValue:
    number, decimals = _number(cell)
    if number is not None and decimals:
        raise ReferenceFormatError(f"expected an integer in {cell!r}")
    return RefValue(None if number is None else int(number), not _unconfirmed_cell(cell), cell)


def _starts(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if ".." in part:
            lo, hi = part.split("..")
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return tuple(out)


def _placement(cell: str) -> tuple[RefValue, RefValue]:
    m = re.match(r"^\{([^}]*)\}\s*:\s*(\d+)", cell)
    if m is None:
        raise ReferenceFormatError(f"placement cell {cell!r} is not '{{starts}} : size'")
    confirmed = not _unconfirmed_cell(cell)
    return RefValue(_starts(m.group(1)), confirmed, cell), RefValue(int(m.group(2)), confirmed, cell)


def _memory(cell: str, unit_mib: int) -> RefValue:
    """MiB from a GiB (unit 1024) or MiB (unit 1) cell, with half a unit of its last printed digit."""
    number, decimals = _number(cell)
    if number is None:
        return RefValue(None, False, cell)
    tolerance = 0.5 * 10.0**-decimals * unit_mib if unit_mib != 1 else 0.0
    return RefValue(number * unit_mib, not _unconfirmed_cell(cell), cell, tolerance)


def _enum_value(cell: str, enums: dict[str, int]) -> RefValue:
    name = "NVML_GPU_INSTANCE_PROFILE_" + cell.strip("`* ")
    if name not in enums:
        raise ReferenceFormatError(f"enum {cell!r} is not in the reference's NVML enum table")
    return RefValue(enums[name], True, cell)


def _profile_table(table: list[list[str]], enums: dict[str, int], where: str) -> dict[str, RefRow]:
    header = [h.lower() for h in table[0]]
    rows: dict[str, RefRow] = {}
    for cells in table[1:]:
        if len(cells) != len(header):
            raise ReferenceFormatError(f"{where}: row {cells} has {len(cells)} cells, header {len(header)}")
        row = RefRow(cells[0].strip("` "))
        gib: RefValue | None = None
        for head, cell in zip(header, cells, strict=True):
            if head.startswith("gib"):
                gib = _memory(cell, 1024)
                continue
            if head.startswith("mib"):
                row.values["memory_mib"] = _memory(cell, 1)
                continue
            column = COLUMNS.get(head)
            if column is None:
                raise ReferenceFormatError(f"{where}: unknown column {head!r}")
            if column == "name":
                continue
            if column == "placement":
                row.values["placement_starts"], row.values["placement_size"] = _placement(cell)
            elif column == "nvml_enum":
                row.values["nvml_enum"] = _enum_value(cell, enums)
            else:
                row.values[column] = _int_value(cell)
        if "memory_mib" not in row.values and gib is not None:
            row.values["memory_mib"] = gib
        if row.name in rows:
            raise ReferenceFormatError(f"{where}: profile {row.name} listed twice")
        rows[row.name] = row
    return rows


def _unconfirm(row: RefRow, fields: tuple[str, ...]) -> None:
    for name in fields:
        v = row.values.get(name, RefValue(None, False, ""))
        row.values[name] = RefValue(v.value, False, v.cell, v.tolerance)


def _grid(title: str) -> tuple[int | None, int | None]:
    for pattern in (
        r"(\d+) memory slices, (\d+) compute slices",
        r"(\d+) memory / (\d+) compute slices",
        r"\*\*(\d+) placement units\*\*, (\d+) compute slices",
        r"— (\d+)/(\d+)",
    ):
        m = re.search(pattern, title)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None, None


def _h20_rows(body: str, pattern: RefModel) -> dict[str, RefRow]:
    """H20 rows from the prose of its section: VGPU-H profile list and caps, R-H20's partial ``-lgip``, and
    everything else ("IDs 15/14/9/5/0, SMs, placements") as the GH100 pattern, unconfirmed."""
    flat = " ".join(body.split())
    m = re.search(r'"NVIDIA H20 SXM5 96GB": ([^;]+);', flat)
    if m is None:
        raise ReferenceFormatError("H20 section: no VGPU-H profile list for the 96GB SKU")
    rows: dict[str, RefRow] = {}
    for item in m.group(1).split(","):
        im = re.fullmatch(r"\s*([\w.+-]+)" + TIMES + r"(\d+)\)?\s*", item)
        if im is None:
            raise ReferenceFormatError(f"H20 section: cannot read {item!r}")
        name, cap = im.group(1), int(im.group(2))
        if name not in pattern.rows:
            raise ReferenceFormatError(f"H20 profile {name} is not in the GH100 pattern section")
        row = RefRow(name)
        base = pattern.rows[name].values
        row.values["max_instances"] = RefValue(cap, True, item.strip())
        for name_field in NAME_DERIVED:
            row.values[name_field] = base[name_field]
        for inferred in ("profile_id", *PLACEMENT_FIELDS):
            row.values[inferred] = RefValue(base[inferred].value, False, "GH100 pattern")
        rows[name] = row
    lgip = re.search(r"Real partial `-lgip` \(R-H20\): (.*?)\. Everything else", flat)
    if lgip is None:
        raise ReferenceFormatError("H20 section: no R-H20 partial -lgip sentence")
    for part in lgip.group(1).split(";"):
        pm = re.match(r"\s*`([\w.+-]+)` ID (\d+)", part)
        if pm is None or pm.group(1) not in rows:
            raise ReferenceFormatError(f"H20 section: cannot read {part!r}")
        row = rows[pm.group(1)]
        row.values["profile_id"] = RefValue(int(pm.group(2)), True, part.strip())
        if gm := re.search(r"([\d.]+) GiB", part):
            row.values["memory_mib"] = _memory(gm.group(1), 1024)
        if sm := re.search(r"\**SM (\d+)\**", part):
            row.values["multiprocessors"] = RefValue(int(sm.group(1)), True, part.strip())
        if dm := re.search(r"DEC (\d+)", part):
            row.values["decoders"] = RefValue(int(dm.group(1)), True, part.strip())
    return rows


def parse_reference(text: str) -> dict[str, RefModel]:
    """Catalog key -> what the reference says about that model. Raises ReferenceFormatError on surprises."""
    enums = parse_enum_table(text)
    models: dict[str, RefModel] = {}
    h20: tuple[str, str, str] | None = None
    for number, title, body in _sections(text):
        key = next((k for prefix, k in SECTION_KEYS.items() if title.startswith(prefix)), None)
        tables = [t for t in _tables(body) if t[0][0].lower() == "profile"]
        if key is None:
            if tables:
                raise ReferenceFormatError(
                    f"section {number} ({title}) has a profile table but no catalog key"
                )
            continue
        where = f"§{number} {title.split(' (')[0].split(' —')[0]}"
        if key == H20_KEY:
            h20 = (number, title, "\n".join(body))
            continue
        if len(tables) != 1:
            raise ReferenceFormatError(f"{where}: expected one profile table, found {len(tables)}")
        rows = _profile_table(tables[0], enums, where)
        prose = " ".join(" ".join(body).split())
        if re.search(r"Placements \*\*inferred\*\*", prose):
            for row in rows.values():
                _unconfirm(row, PLACEMENT_FIELDS)
        for m in re.finditer(r"`?([\w.+-]+)`? engine counts: \*\*inferred\*\*", prose):
            if m.group(1) not in rows:
                raise ReferenceFormatError(f"{where}: engine note names unknown profile {m.group(1)}")
            _unconfirm(rows[m.group(1)], ENGINE_FIELDS)
        slices, compute = _grid(title)
        pci = tuple(int(h, 16) for h in re.findall(r"0x[0-9A-Fa-f]{4}\b", title))
        models[key] = RefModel(key, where, slices, compute, pci, rows)
    if h20 is not None:
        h20_number, h20_title, h20_body = h20
        slices, compute = _grid(h20_title)
        pci = tuple(int(h, 16) for h in re.findall(r"0x[0-9A-Fa-f]{4}\b", h20_title))
        h20_rows = _h20_rows(h20_body, models[H20_PATTERN_KEY])
        models[H20_KEY] = RefModel(H20_KEY, f"§{h20_number} H20", slices, compute, pci, h20_rows)
    return models


# --- comparison ----------------------------------------------------------------------------------------


def _show(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, tuple):
        return "{" + ",".join(map(str, value)) + "}"
    return str(value)


def compare_model(ref: RefModel, model: GpuModel) -> list[str]:
    """Every difference between the reference's rows for a model and the catalog's, one message each."""
    out: list[str] = []
    prefix = f"{model.key} ({ref.section})"
    if ref.memory_slices is not None and ref.memory_slices != model.memory_slices:
        out.append(f"{prefix}: memory_slices catalog {model.memory_slices} != reference {ref.memory_slices}")
    if ref.compute_slices is not None and ref.compute_slices != model.compute_slices:
        out.append(
            f"{prefix}: compute_slices catalog {model.compute_slices} != reference {ref.compute_slices}"
        )
    if ref.pci_ids and set(ref.pci_ids) != set(model.pci_device_ids):
        out.append(
            f"{prefix}: PCI device ids catalog {sorted(map(hex, model.pci_device_ids))} != reference "
            f"{sorted(map(hex, ref.pci_ids))}"
        )
    names = {p.name for p in model.profiles}
    for name in sorted(set(ref.rows) - names):
        out.append(f"{prefix}: profile {name} is listed by the reference but missing from the catalog")
    for name in sorted(names - set(ref.rows)):
        out.append(f"{prefix}: profile {name} is in the catalog but not listed by the reference")
    for profile in model.profiles:
        row = ref.rows.get(profile.name)
        if row is not None:
            out.extend(_compare_row(prefix, row, profile))
    return out


def _compare_row(prefix: str, row: RefRow, profile: Profile) -> list[str]:
    out: list[str] = []
    for name in COMPARED:
        ref = row.values.get(name)
        if ref is None or ref.value is None:
            continue
        catalog: object = getattr(profile, name)
        if name == "memory_mib":
            assert isinstance(ref.value, float)
            same = abs(int(profile.memory_mib) - ref.value) <= ref.tolerance + 1e-9
        else:
            same = catalog == ref.value
        if same:
            continue
        status = "confirmed" if ref.confirmed else "UNCONFIRMED in the reference"
        tol = f" ±{ref.tolerance:.1f}" if ref.tolerance else ""
        out.append(
            f"{prefix}: {profile.name}.{name}: catalog {_show(catalog)} != reference "
            f"{_show(ref.value)}{tol} (cell {ref.cell!r}; {status}; catalog confirmed: {profile.confirmed})"
        )
    return out


def overclaims(ref: RefModel, model: GpuModel) -> list[str]:
    """Fields the reference only infers (or leaves open) that the catalog presents as confirmed."""
    out: list[str] = []
    for profile in model.profiles:
        row = ref.rows.get(profile.name)
        if row is None:
            continue
        for name in COMPARED:
            if name in NAME_DERIVED:
                continue
            value = row.values.get(name)
            confirmed = value is not None and value.value is not None and value.confirmed
            if not confirmed and name not in profile.inferred:
                cell = "not given" if value is None or value.value is None else repr(value.cell)
                out.append(
                    f"{model.key} ({ref.section}): {profile.name}.{name}: the reference does not confirm it "
                    f"({cell}) but the catalog does not list it in `inferred`"
                )
    return out


# --- tests ---------------------------------------------------------------------------------------------

TEXT = REFERENCE.read_text(encoding="utf-8")
PARSED = parse_reference(TEXT)
CATALOG = load_catalog()


def test_reference_covers_every_catalog_model() -> None:
    assert set(PARSED) == set(CATALOG.keys())
    for ref in PARSED.values():
        assert ref.rows, ref.key


def test_reference_enum_table_matches_the_catalog_and_pynvml() -> None:
    import pynvml

    reference = parse_enum_table(TEXT)
    count = reference.pop("NVML_GPU_INSTANCE_PROFILE_COUNT")
    assert reference == dict(GI_PROFILE_ENUMS)
    assert count == GI_PROFILE_COUNT == max(reference.values()) + 1
    for name, value in reference.items():
        assert getattr(pynvml, name) == value, name
    assert count == pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT


@pytest.mark.parametrize("key", sorted(PARSED), ids=str)
def test_catalog_matches_reference(key: str) -> None:
    problems = compare_model(PARSED[key], CATALOG.model(key))
    assert not problems, "catalog differs from docs/reference/mig-geometry.md:\n" + "\n".join(problems)


@pytest.mark.parametrize("key", sorted(PARSED), ids=str)
def test_catalog_does_not_confirm_what_the_reference_infers(key: str) -> None:
    problems = overclaims(PARSED[key], CATALOG.model(key))
    assert not problems, "\n".join(problems)


def test_the_comparison_reads_values_not_just_names() -> None:
    h100 = PARSED["H100-80GB"].rows
    assert h100["1g.20gb"].values["multiprocessors"] == RefValue(26, True, "**26**")
    assert h100["1g.20gb"].values["placement_starts"].value == (0, 2, 4, 6)
    assert h100["7g.80gb"].values["copy_engines"].value == 8
    assert PARSED["A100-40GB"].rows["2g.10gb"].values["memory_mib"].value == 9856  # MiB column wins
    mem = PARSED["A30-24GB"].rows["4g.24gb"].values["memory_mib"]
    assert mem.value == pytest.approx(23.44 * 1024) and mem.tolerance == pytest.approx(5.12)
    assert PARSED["RTXPRO6000-96GB"].memory_slices == 12
    b200 = PARSED["B200-180GB"].rows
    assert b200["3g.90gb"].values["profile_id"] == RefValue(9, False, "9?")
    assert b200["1g.23gb"].values["placement_starts"].confirmed is False
    assert PARSED["H100-96GB"].rows["3g.48gb"].values["placement_size"].confirmed is False
    a100 = PARSED["A100-80GB"].rows["1g.20gb"].values
    assert not a100["copy_engines"].confirmed and a100["max_instances"].confirmed
    h20 = PARSED["H20-96GB"].rows
    sms = h20["1g.12gb"].values["multiprocessors"]
    assert (sms.value, sms.confirmed) == (8, True)
    assert h20["3g.48gb"].values["max_instances"].value == 2
    assert h20["3g.48gb"].values["profile_id"] == RefValue(9, False, "GH100 pattern")
    assert sum(len(m.rows) for m in PARSED.values()) == sum(len(m.profiles) for m in CATALOG.models())


# Each alteration: (old text, new text, catalog key, a fragment the difference message must contain). The old
# text must occur exactly once, so a reference edit cannot make a case vacuous.
ALTERATIONS = [
    ("| 3g.40gb | 9 | 3_SLICE | 3 | {0,4} : 4 | 2 | 42", "| 3g.40gb | 9 | 3_SLICE | 3 | {0,4} : 4 | 3 | 42",
     "A100-80GB", "3g.40gb.max_instances: catalog 2 != reference 3"),
    ("| 1g.20gb | 15 | 1_SLICE_REV2 | 1 | {0,2,4,6} : 2 | 4 | **26**",
     "| 1g.20gb | 15 | 1_SLICE_REV2 | 1 | {0..6} : 1 | 4 | **26**",
     "H100-80GB", "1g.20gb.placement_starts: catalog {0,2,4,6} != reference {0,1,2,3,4,5,6}"),
    ("| 3g.40gb | 9 | 3_SLICE | 3 | {0,4} : 4 | 2 | **60**",
     "| 3g.40gb | 9 | 3_SLICE | 3 | {0,4} : 4 | 2 | 64",
     "H100-80GB", "3g.40gb.multiprocessors: catalog 60 != reference 64"),
    ("| 8 | 7 | 0 | 7 | 1 | 92.62 |", "| 8 | 7 | 0 | 7 | 1 | 90.62 |",
     "H100-94GB", "7g.94gb.memory_mib: catalog 94843 != reference"),
    ("| 2g.48gb | 5 | 2_SLICE |", "| 2g.48gb | 6 | 2_SLICE |",
     "RTXPRO6000-96GB", "2g.48gb.profile_id: catalog 5 != reference 6"),
    ("| 4g.24gb | 0 | 4_SLICE |", "| 4g.24gb | 0 | 7_SLICE |",
     "A30-24GB", "4g.24gb.nvml_enum: catalog 3 != reference 4"),
    ("| 1g.5gb | 19 | 1_SLICE | 1 | {0,1,2,3,4,5,6} : 1 | 7 | 14 | 1 | 0 | 0 | 0 | 0 | 4.75 | 4864 |",
     "| 1g.5gb | 19 | 1_SLICE | 1 | {0,1,2,3,4,5,6} : 1 | 7 | 14 | 1 | 0 | 0 | 0 | 0 | 4.75 | 4860 |",
     "A100-40GB", "1g.5gb.memory_mib: catalog 4864 != reference 4860"),
    ("| 1g.10gb+me | 20 | 1_SLICE_REV1 | 1 | {0..6} : 1 | 1 | 14 | 1 | 1 | 0 | 1 | 1 | 9.50 |\n", "",
     "A100-80GB", "profile 1g.10gb+me is in the catalog but not listed by the reference"),
    ("| 3g.71gb | 9 | 3_SLICE | 3 | {0,4}:4 |", "| 3g.71gb | 9 | 3_SLICE | 3 | {0}:4 |",
     "H200-141GB", "3g.71gb.placement_starts: catalog {0,4} != reference {0} (cell '{0}:4'; UNCONFIRMED"),
    (f"3g.48gb{TIMES}2, 2g.24gb", f"3g.48gb{TIMES}3, 2g.24gb",
     "H20-96GB", "3g.48gb.max_instances: catalog 2 != reference 3"),
    ("`1g.12gb` ID 19, 11.75 GiB, **SM 8**", "`1g.12gb` ID 19, 11.75 GiB, **SM 9**",
     "H20-96GB", "1g.12gb.multiprocessors: catalog 8 != reference 9"),
    ("B200 180GB (0x2901) — 8/7", "B200 180GB (0x2901) — 12/7",
     "B200-180GB", "memory_slices catalog 8 != reference 12"),
    ("(0x20B7)", "(0x20B8)", "A30-24GB", "PCI device ids"),
]  # fmt: skip


@pytest.mark.parametrize(("old", "new", "key", "expected"), ALTERATIONS, ids=[a[3][:40] for a in ALTERATIONS])
def test_an_altered_reference_is_caught(old: str, new: str, key: str, expected: str) -> None:
    assert TEXT.count(old) == 1, f"alteration target not found exactly once: {old!r}"
    assert not compare_model(PARSED[key], CATALOG.model(key))
    altered = parse_reference(TEXT.replace(old, new))
    problems = compare_model(altered[key], CATALOG.model(key))
    assert any(expected in p for p in problems), problems


def test_an_inferred_marker_the_catalog_ignores_is_caught() -> None:
    old = "| 7g.40gb | 0 | 7_SLICE | 7 | {0} : 8 | 1 | 98 |"
    assert TEXT.count(old) == 1
    altered = parse_reference(
        TEXT.replace(old, "| 7g.40gb | 0 | 7_SLICE | 7 | {0} : 8 | 1 | 98 (inferred) |")
    )
    problems = overclaims(altered["A100-40GB"], CATALOG.model("A100-40GB"))
    assert problems == [
        "A100-40GB (§2 A100-SXM4-40GB): 7g.40gb.multiprocessors: the reference does not confirm it "
        "('98 (inferred)') but the catalog does not list it in `inferred`"
    ]


def test_reference_surprises_are_refused() -> None:
    with pytest.raises(ReferenceFormatError, match="unknown column"):
        parse_reference(TEXT.replace("| max | SM | CE |", "| cap | SM | CE |", 1))
    with pytest.raises(ReferenceFormatError, match="not in the reference's NVML enum table"):
        parse_reference(TEXT.replace("| 4g.24gb | 0 | 4_SLICE |", "| 4g.24gb | 0 | 5_SLICES |"))
