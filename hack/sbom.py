"""Writes an SPDX 2.3 JSON SBOM of the Python packages the image installs (requirements/runtime.lock).

    usage: python hack/sbom.py LOCK PYPROJECT REVISION CREATED OUTPUT

One SPDX package per locked distribution: name, version, PURL, the lock's sha256 values (one per wheel or
sdist the lock accepts; the image installs one of them) and, where the distribution installed next to this
interpreter has that same version and declares a valid SPDX expression, its license. The dependency graph
comes from the lock's ``# via`` annotations. Refuses a lock that misses a runtime dependency of pyproject or
pins it outside its declared range, so a release cannot ship a stale lock.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT_PACKAGE = "dynamig"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
VIA = re.compile(r"^\s+#\s+(?:via\s+)?(\S.*)$")


@dataclass
class Locked:
    name: str
    version: str
    sha256: list[str] = field(default_factory=list)
    required_by: list[str] = field(default_factory=list)


def parse_lock(text: str) -> dict[str, Locked]:
    """The pins of a ``uv pip compile --generate-hashes`` file, keyed by canonical name. Pure."""
    locked: dict[str, Locked] = {}
    current: Locked | None = None
    for line in text.splitlines():
        if pin := PIN.match(line):
            current = Locked(canonicalize_name(pin.group(1)), pin.group(2))
            locked[current.name] = current
        elif current is None:
            continue
        elif hashes := HASH.findall(line):
            current.sha256.extend(hashes)
        elif (via := VIA.match(line)) and via.group(1) != "via":
            who = via.group(1).split(" (")[0]  # "dynamig (pyproject.toml)" -> "dynamig"
            if not who.startswith("-"):  # "-r file" / "-c file": an input file, not a package
                current.required_by.append(canonicalize_name(who))
    return locked


def check_covers(locked: dict[str, Locked], dependencies: list[str]) -> None:
    """Exit when a runtime dependency is missing from the lock or pinned outside its range."""
    for spec in dependencies:
        req = Requirement(spec)
        pin = locked.get(canonicalize_name(req.name))
        if pin is None or not req.specifier.contains(pin.version, prereleases=True):
            found = "missing" if pin is None else f"pinned at {pin.version}"
            sys.exit(f"{req} is {found} in the lock: run `make lock`")


def declared_license(name: str, version: str) -> str:
    """The SPDX expression the installed distribution declares, when it is this version; else NOASSERTION."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return "NOASSERTION"
    if dist.version != version:
        return "NOASSERTION"
    # A missing field reads as None (email.message semantics).
    declared = dist.metadata["License-Expression"] or dist.metadata["License"] or ""
    try:
        from license_expression import get_spdx_licensing  # type: ignore[import-untyped]
    except ImportError:
        return "NOASSERTION"
    info = get_spdx_licensing().validate(declared.strip(), strict=True)
    return info.normalized_expression if declared.strip() and not info.errors else "NOASSERTION"


def spdx_id(name: str) -> str:
    return "SPDXRef-Package-" + re.sub(r"[^A-Za-z0-9.-]", "-", name)


def document(locked: dict[str, Locked], version: str, revision: str, created: str) -> dict[str, Any]:
    root_id = spdx_id(ROOT_PACKAGE)
    packages: list[dict[str, Any]] = [
        {
            "SPDXID": root_id,
            "name": ROOT_PACKAGE,
            "versionInfo": version,
            "downloadLocation": "NOASSERTION",
            "filesAnalyzed": False,
            "licenseConcluded": "NOASSERTION",
            "licenseDeclared": "Apache-2.0",
            "copyrightText": "NOASSERTION",
            "sourceInfo": f"built from git revision {revision}",
        }
    ]
    relationships: list[dict[str, str]] = [
        {"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES", "relatedSpdxElement": root_id}
    ]
    for pin in sorted(locked.values(), key=lambda p: p.name):
        packages.append(
            {
                "SPDXID": spdx_id(pin.name),
                "name": pin.name,
                "versionInfo": pin.version,
                "downloadLocation": "NOASSERTION",
                "filesAnalyzed": False,
                "checksums": [{"algorithm": "SHA256", "checksumValue": h} for h in sorted(pin.sha256)],
                "licenseConcluded": "NOASSERTION",
                "licenseDeclared": declared_license(pin.name, pin.version),
                "copyrightText": "NOASSERTION",
                "comment": "checksums: every distribution file of this version that the lock accepts",
                "externalRefs": [
                    {
                        "referenceCategory": "PACKAGE-MANAGER",
                        "referenceType": "purl",
                        "referenceLocator": f"pkg:pypi/{pin.name}@{pin.version}",
                    }
                ],
            }
        )
        for parent in sorted(set(pin.required_by)):
            relationships.append(
                {
                    "spdxElementId": spdx_id(parent),
                    "relationshipType": "DEPENDS_ON",
                    "relatedSpdxElement": spdx_id(pin.name),
                }
            )
    return {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"{ROOT_PACKAGE}-{version}-python",
        "documentNamespace": f"https://spdx.org/spdxdocs/{ROOT_PACKAGE}-{version}-{revision}",
        "creationInfo": {"created": created, "creators": ["Tool: dynamig-hack-sbom"]},
        "packages": packages,
        "relationships": relationships,
    }


def main(argv: list[str]) -> None:
    lock_path, pyproject_path, revision, created, output = argv
    project = tomllib.loads(Path(pyproject_path).read_text())["project"]
    locked = parse_lock(Path(lock_path).read_text())
    check_covers(locked, project["dependencies"])
    doc = document(locked, project["version"], revision, created)
    Path(output).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
