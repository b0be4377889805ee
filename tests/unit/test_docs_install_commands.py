"""The install commands the docs show name only what exists: a checkout's paths, the release's files, and the
registry a team publishes to (``<registry>``, ``<your-registry>``: hack/publish.sh pushes there). No package
index publishes ``dynamig`` and no public registry holds its image or chart, so a command that pulls one by a
public name would fail for every reader."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def command_lines() -> list[tuple[str, int, str]]:
    """(file, line number, command) of every line inside a fenced code block, without its comment."""
    found = []
    for path in DOCS:
        inside = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                inside = not inside
                continue
            if inside and line.strip():
                found.append((path.name, number, line.split("#", 1)[0].strip()))
    return found


def words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def unpublished(command: str) -> str | None:
    """Why ``command`` names something nothing publishes, or None."""
    argv = words(command)
    if argv[:2] == ["pip", "install"]:
        names = [a for a in argv[2:] if not a.startswith("-") and not a.startswith((".", "/", "'", '"'))]
        if any(re.fullmatch(r"dynamig(\[[\w,]+\])?([<>=!~].*)?", n) for n in names):
            return "pip installs dynamig from a package index, which does not publish it"
    if argv[:2] == ["helm", "install"] and len(argv) >= 4:
        chart = argv[3]
        local = chart.startswith((".", "/", "manifests/", "dist/")) or chart.endswith(".tgz")
        if not local and not chart.startswith("oci://<"):
            return f"helm installs chart {chart!r}, which no public chart repository holds"
    for arg in argv:
        value = arg.split("=", 1)[1] if arg.startswith("image.repository=") else None
        if value is not None and not value.startswith("<"):
            return f"the image {value!r} is in no registry: name the one the release was published to"
    return None


def test_no_install_command_names_a_package_or_image_that_nothing_publishes() -> None:
    wrong = [f"{f}:{n}: {c}  ({why})" for f, n, c in command_lines() if (why := unpublished(c))]
    assert not wrong, "\n".join(wrong)


def test_the_check_refuses_what_it_should() -> None:
    assert unpublished("pip install dynamig")
    assert unpublished("pip install 'dynamig[dev]'")
    assert unpublished("pip install dynamig==0.1.0")
    assert unpublished("helm install dynamig dynamig/dynamig -n dynamig-system")
    assert unpublished("helm install d manifests/helm/dynamig --set image.repository=dynamig/dynamig")
    assert unpublished("pip install -e .") is None
    assert unpublished("helm install dynamig oci://<registry>/charts/dynamig --version 0.1.0") is None
    local = "helm install d manifests/helm/dynamig --set image.repository=<registry>/dynamig"
    assert unpublished(local) is None
