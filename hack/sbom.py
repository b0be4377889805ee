"""Writes an SPDX 2.3 JSON SBOM of the image: the Python packages it installs (requirements/runtime.lock) and,
given the image as an OCI archive, the Debian packages of its root filesystem.

    usage: python hack/sbom.py LOCK PYPROJECT REVISION CREATED OUTPUT [IMAGE.oci.tar]

One SPDX package per locked distribution: name, version, PURL, the lock's sha256 values (one per wheel or
sdist the lock accepts; the image installs one of them) and, where the distribution installed next to this
interpreter has that same version and declares a valid SPDX expression, its license. The dependency graph
comes from the lock's ``# via`` annotations. Refuses a lock that misses a runtime dependency of pyproject or
pins it outside its declared range, so a release cannot ship a stale lock.

The Debian packages are read from the image itself: dpkg's status database (``var/lib/dpkg/status``) in the
newest layer that has one, every package dpkg lists as installed, with its version and architecture as a
``pkg:deb/debian/...`` PURL (the purl-spec's deb type); dynamig depends on each (the interpreter and the
libraries it runs on).
"""

from __future__ import annotations

import json
import re
import sys
import tarfile
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import quote

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


@dataclass(frozen=True)
class DebPackage:
    name: str
    version: str
    architecture: str
    source: str  # the source package; the binary's own name when dpkg names none


def parse_dpkg_status(text: str) -> list[DebPackage]:
    """The installed packages of a dpkg status file, sorted by name. Pure."""
    packages = []
    for paragraph in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in paragraph.splitlines():
            if line[:1] in (" ", "\t") or ":" not in line:
                continue  # a continuation line (Description, Conffiles)
            key, _, value = line.partition(":")
            fields[key] = value.strip()
        if "Package" not in fields or not fields.get("Status", "").endswith(" installed"):
            continue
        source = fields.get("Source", "").split(" ")[0] or fields["Package"]
        packages.append(DebPackage(fields["Package"], fields["Version"], fields["Architecture"], source))
    return sorted(packages, key=lambda p: p.name)


def image_dpkg_status(archive: Path) -> str:
    """dpkg's status file in the image of an OCI archive (one manifest): the newest layer's copy."""
    with tarfile.open(archive) as oci:
        index = json.load(_member(oci, "index.json"))
        (entry,) = index["manifests"]
        manifest = json.load(_member(oci, _blob(entry["digest"])))
        status = ""
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=_member(oci, _blob(layer["digest"])), mode="r:*") as files:
                for info in files:
                    if info.name.lstrip("./") == "var/lib/dpkg/status" and info.isfile():
                        status = _member(files, info).read().decode()
    if not status:
        sys.exit(f"{archive}: no var/lib/dpkg/status in the image's layers")
    return status


def _blob(digest: str) -> str:
    algorithm, _, value = digest.partition(":")
    return f"blobs/{algorithm}/{value}"


def _member(archive: tarfile.TarFile, member: str | tarfile.TarInfo) -> Any:
    fh = archive.extractfile(member)
    if fh is None:
        sys.exit(f"{archive.name}: {member} is not a file")
    return fh


def deb_purl(deb: DebPackage) -> str:
    """``pkg:deb/debian/<name>@<version>?arch=<arch>``, the version percent-encoded as purl-spec asks
    (``2.36-9+deb12u14`` -> ``2.36-9%2Bdeb12u14``; an epoch's ``:`` stays). Pure."""
    return f"pkg:deb/debian/{deb.name}@{quote(deb.version, safe=':')}?arch={deb.architecture}"


def deb_spdx_id(name: str) -> str:
    return "SPDXRef-Package-deb-" + re.sub(r"[^A-Za-z0-9.-]", "-", name)


def deb_packages(debs: list[DebPackage], root_id: str) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """SPDX packages for the image's Debian packages and dynamig's dependency on each. Pure."""
    packages, relationships = [], []
    for deb in debs:
        packages.append(
            {
                "SPDXID": deb_spdx_id(deb.name),
                "name": deb.name,
                "versionInfo": deb.version,
                "supplier": "Organization: Debian",
                "downloadLocation": "NOASSERTION",
                "filesAnalyzed": False,
                "licenseConcluded": "NOASSERTION",
                "licenseDeclared": "NOASSERTION",
                "copyrightText": "NOASSERTION",
                "sourceInfo": f"Debian source package {deb.source}",
                "externalRefs": [
                    {
                        "referenceCategory": "PACKAGE-MANAGER",
                        "referenceType": "purl",
                        "referenceLocator": deb_purl(deb),
                    }
                ],
            }
        )
        relationships.append(
            {
                "spdxElementId": root_id,
                "relationshipType": "DEPENDS_ON",
                "relatedSpdxElement": deb_spdx_id(deb.name),
            }
        )
    return packages, relationships


def spdx_id(name: str) -> str:
    return "SPDXRef-Package-" + re.sub(r"[^A-Za-z0-9.-]", "-", name)


def document(
    locked: dict[str, Locked], version: str, revision: str, created: str, debs: list[DebPackage] | None = None
) -> dict[str, Any]:
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
    if debs is not None:
        more, edges = deb_packages(debs, root_id)
        packages += more
        relationships += edges
    return {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"{ROOT_PACKAGE}-{version}-{'image' if debs is not None else 'python'}",
        "documentNamespace": f"https://spdx.org/spdxdocs/{ROOT_PACKAGE}-{version}-{revision}",
        "creationInfo": {"created": created, "creators": ["Tool: dynamig-hack-sbom"]},
        "packages": packages,
        "relationships": relationships,
    }


def main(argv: list[str]) -> None:
    lock_path, pyproject_path, revision, created, output, *image = argv
    project = tomllib.loads(Path(pyproject_path).read_text())["project"]
    locked = parse_lock(Path(lock_path).read_text())
    check_covers(locked, project["dependencies"])
    debs = parse_dpkg_status(image_dpkg_status(Path(image[0]))) if image else None
    doc = document(locked, project["version"], revision, created, debs)
    Path(output).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
