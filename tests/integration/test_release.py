"""``make release`` (hack/release.sh): its artefacts, the hash-pinned lock they come from, installing them.

What runs for real: the release script, in a clone of this repository whose one new commit is the working
tree as it is now (so the clean-tree path runs, and this checkout's git state is not touched), building the
image (hack/build-image.sh) and its SBOM (syft); the helm binary built from its Go module (``helm show
chart`` of the package, ``helm install`` of it); kubectl against the local control plane for the single
install manifest; the SPDX project's own parser and validator (``spdx-tools``) and the host's dpkg-query for
the SBOM; ``sha256sum -c`` for the checksums; hadolint for the context's Dockerfile. The lock checks need no
network: they compare requirements/runtime.lock with the dependency metadata of the distributions installed
in this environment. Publishing to a registry and pulling from it: e2e/test_chart_real_node.py.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from dynamig.devcluster import ControlPlane
from dynamig.devcluster.helmrelease import adopt_crds, forget_release
from dynamig.devcluster.pytest_plugin import unique_name

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
VERSION: str = PYPROJECT["version"]
RUNTIME_LOCK = ROOT / "requirements" / "runtime.lock"
BUILD_LOCK = ROOT / "requirements" / "build.lock"
# What issue 16 names as dev-only: the control plane's PKI and the simulator's plots.
KNOWN_DEV_ONLY = {"cryptography", "matplotlib"}
DYNAMIG_CRDS = ("gpupartitions.dynamig.io", "gpupartitionpolicies.dynamig.io")
SYSTEM_NS = "dynamig-system"
GIT_IDENTITY = ["-c", "user.name=dynamig tests", "-c", "user.email=tests@dynamig.invalid"]


# ------------------------------------------------------------------------------------------------ helpers
class Pin(NamedTuple):
    version: str
    sha256: set[str]
    required_by: set[str]  # from the lock's "# via" annotations; "dynamig" for pyproject's own


def parse_lock(path: Path) -> dict[str, Pin]:
    """The pins of a hash-pinned requirements file written by ``uv pip compile``, by canonical name."""
    pins: dict[str, Pin] = {}
    name = ""
    for line in path.read_text().splitlines():
        if pin := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line):
            name = canonicalize_name(pin.group(1))
            assert name not in pins, f"{name} is pinned twice in {path.name}"
            assert ";" not in line, f"{line}: an environment marker; the image is one platform"
            pins[name] = Pin(pin.group(2), set(), set())
        elif (
            name
            and (via := re.match(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9][\w.-]*)", line))
            and via.group(1) != "via"
        ):
            pins[name].required_by.add(canonicalize_name(via.group(1)))
        for digest in re.findall(r"--hash=sha256:([0-9a-f]{64})", line):
            pins[name].sha256.add(digest)
    return pins


def closure(requirements: Iterable[str], follow: Callable[[str], bool] = lambda name: True) -> set[str]:
    """Canonical names of the distributions ``requirements`` pull in, transitively, on this interpreter and
    platform, read from the installed distributions' metadata (extras followed). A distribution for which
    ``follow(name)`` is false is named but its own requirements are not read."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in requirements]
    names: set[str] = set()
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(key[0])
        if not follow(key[0]):
            continue
        try:
            requires = metadata.distribution(req.name).requires or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{req.name} is not installed here: run `make setup`")
        for sub in map(Requirement, requires):
            extras = {"", *req.extras}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return names


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=True
    ).stdout


def run_release(repo: Path, out: Path, helm: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``hack/release.sh`` of ``repo`` into ``out``, with this interpreter and the cached helm binary."""
    return subprocess.run(
        ["bash", str(repo / "hack" / "release.sh")],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=1800,  # a first run builds the image, and syft if make test is still building it
        check=False,
        env={
            **os.environ,
            "RELEASE_DIR": str(out),
            "PYTHON": sys.executable,
            "DYNAMIG_HELM": helm,
            **env,
        },
    )


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone of this repository plus one commit holding its working tree as it is now (what git does not
    ignore), so the release runs from a clean tree."""
    clone = tmp_path_factory.mktemp("release") / "repo"
    git("clone", "--quiet", str(ROOT), str(clone), cwd=ROOT)
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT)
    for rel in filter(None, listed.split("\0")):
        src, dst = ROOT / rel, clone / rel
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        elif dst.is_file():  # deleted in the working tree
            dst.unlink()
    git("add", "--all", cwd=clone)
    git(*GIT_IDENTITY, "commit", "--quiet", "--allow-empty", "-m", "working tree", cwd=clone)
    return clone


@pytest.fixture(scope="module")
def release(snapshot: Path, helm: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist") / "release"
    start = time.monotonic()
    proc = run_release(snapshot, out, helm)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"release built in {time.monotonic() - start:.1f}s")
    return out


# ------------------------------------------------------------------------------------------------ lock
def test_runtime_lock_pins_every_runtime_dependency_and_nothing_dev_only() -> None:
    pins = parse_lock(RUNTIME_LOCK)
    for spec in PYPROJECT["dependencies"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not in {RUNTIME_LOCK.name}: run `make lock`"
        assert req.specifier.contains(pins[name].version, prereleases=True), f"{req} at {pins[name].version}"
        assert "dynamig" in pins[name].required_by
    assert all(pin.sha256 for pin in pins.values()), "every pin carries its sha256 hashes"

    # Nothing only an extra needs: every pin is there for pyproject's runtime dependencies, by the
    # resolver's own account of who requires it.
    reachable: set[str] = set()
    todo = ["dynamig"]
    while todo:
        parent = todo.pop()
        children = {name for name, pin in pins.items() if parent in pin.required_by} - reachable
        reachable |= children
        todo += children
    assert set(pins) == reachable, f"in the lock for no runtime dependency: {sorted(set(pins) - reachable)}"
    assert not set(pins) & KNOWN_DEV_ONLY

    # Nothing missing (the image's pip refuses a dependency that is not hash-pinned): every requirement of a
    # locked distribution, read from its metadata where the installed one is the locked version.
    def installed_as_locked(name: str) -> bool:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return name in pins and metadata.version(name) == pins[name].version
        return False

    needed = closure(PYPROJECT["dependencies"], follow=installed_as_locked)
    assert needed <= set(pins), f"missing from the lock: {sorted(needed - set(pins))}: run `make lock`"
    assert len([n for n in pins if installed_as_locked(n)]) > len(pins) // 2, "run `make setup`"

    # `make setup` installs .[dev]: it must still bring what the other extras carry.
    extras = PYPROJECT["optional-dependencies"]
    dev = {canonicalize_name(Requirement(r).name) for r in extras["dev"]}
    for extra, reqs in extras.items():
        assert {canonicalize_name(Requirement(r).name) for r in reqs} <= dev, f"dev misses extra {extra}"


def test_build_lock_matches_the_runtime_grpc_and_protobuf() -> None:
    """The stubs the build stage generates must load with the grpcio and protobuf the image runs."""
    build, runtime = parse_lock(BUILD_LOCK), parse_lock(RUNTIME_LOCK)
    assert {"grpcio-tools", "setuptools", "wheel"} <= set(build)
    assert all(pin.sha256 for pin in build.values())
    for name in ("grpcio", "protobuf"):
        assert (build[name].version, build[name].sha256) == (runtime[name].version, runtime[name].sha256)


def test_runtime_code_imports_without_the_dev_only_packages() -> None:
    """Every module of the image's code paths (CLI, agent, operator, planner, simulator) loads with the
    dev-only distributions made unimportable; only the dev cluster and the demo may need them."""
    runtime = closure(PYPROJECT["dependencies"])
    extras = PYPROJECT["optional-dependencies"]
    dev_only = closure(r for reqs in extras.values() for r in reqs) - runtime
    blocked = sorted(
        module
        for module, dists in metadata.packages_distributions().items()
        if {canonicalize_name(d) for d in dists} <= dev_only
    )
    assert "cryptography" in blocked and "matplotlib" in blocked
    script = """
import importlib, importlib.abc, pkgutil, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"dev-only: {name}", name=name)
        return None
sys.meta_path.insert(0, Block())
import dynamig
from dynamig.cli import build_parser
build_parser()
failed = []
for mod in pkgutil.walk_packages(dynamig.__path__, "dynamig."):
    if mod.name.startswith(("dynamig.devcluster", "dynamig.demo")) or mod.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(mod.name)
    except Exception as exc:
        failed.append(f"{mod.name}: {exc!r}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script, ",".join(blocked)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ artefacts
def test_release_refuses_a_dirty_tree(snapshot: Path, helm: str, tmp_path: Path) -> None:
    stray = snapshot / "stray-file"
    stray.write_text("not committed\n")
    try:
        proc = run_release(snapshot, tmp_path / "out", helm)
    finally:
        stray.unlink()
    assert proc.returncode == 1
    assert "ALLOW_DIRTY=1" in proc.stderr and "stray-file" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_release_artefacts_are_consistent(release: Path, snapshot: Path, helm: str) -> None:
    revision = git("rev-parse", "HEAD", cwd=snapshot).strip()
    chart_tgz = release / f"dynamig-{VERSION}.tgz"
    sbom = release / f"dynamig-{VERSION}.spdx.json"
    context = release / "image-context"
    for path in (chart_tgz, sbom, release / "dynamig.yaml", context / "Dockerfile"):
        assert path.is_file(), path

    sums = subprocess.run(
        ["sha256sum", "--check", "--strict", "SHA256SUMS"],
        cwd=release,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert sums.returncode == 0, sums.stdout + sums.stderr
    assert len(sums.stdout.splitlines()) == 6, sums.stdout

    # The image built from that context: one manifest, the digest beside it, this release's labels.
    image = release / f"dynamig-image-{VERSION}.oci.tar"
    with tarfile.open(image) as oci:
        (entry,) = json.load(oci.extractfile("index.json"))["manifests"]  # type: ignore[arg-type]
        manifest = json.load(oci.extractfile(f"blobs/sha256/{entry['digest'].split(':')[1]}"))  # type: ignore[arg-type]
        config = json.load(oci.extractfile(f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"))  # type: ignore[arg-type]
    assert (release / f"dynamig-image-{VERSION}.oci.tar.digest").read_text().strip() == entry["digest"]
    labels = config["config"]["Labels"]
    assert labels["org.opencontainers.image.revision"] == revision, labels
    assert labels["org.opencontainers.image.version"] == VERSION, labels

    shown = subprocess.run(
        [helm, "show", "chart", str(chart_tgz)], capture_output=True, text=True, timeout=60, check=True
    )
    chart = yaml.safe_load(shown.stdout)
    assert (chart["name"], chart["version"], chart["appVersion"]) == ("dynamig", VERSION, VERSION)

    # The install manifest: the CRDs first, then the chart's objects with the image of this version.
    objs = yaml_docs(release / "dynamig.yaml")
    kinds = [o["kind"] for o in objs]
    assert kinds[:3] == ["CustomResourceDefinition"] * 3
    assert "CustomResourceDefinition" not in kinds[3:]
    assert {"Namespace", "Deployment", "DaemonSet", "ClusterKopfPeering", "DeviceClass"} <= set(kinds)
    images = {c["image"] for o in objs if o["kind"] in ("Deployment", "DaemonSet") for c in _containers(o)}
    assert images == {f"dynamig/dynamig:{VERSION}"}

    # The build context: the Dockerfile pins the base by digest, installs only hash-checked packages and
    # carries this release's version and revision for its OCI labels.
    dockerfile = (context / "Dockerfile").read_text()
    digest = re.search(r"^ARG PYTHON_DIGEST=(sha256:[0-9a-f]{64})$", dockerfile, re.M)
    assert digest, "the base image is not pinned by digest"
    base = re.search(r"^ARG PYTHON_BASE=(python:[0-9][\w.-]*)$", dockerfile, re.M)
    assert base, "the base image has no tag"
    froms = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert froms and all(f == "${PYTHON_BASE}@${PYTHON_DIGEST}" for f in froms), froms
    assert "--require-hashes --only-binary=:all: -r requirements/runtime.lock" in dockerfile
    assert "--require-hashes --only-binary=:all: -r requirements/build.lock" in dockerfile
    assert "pip install --no-cache-dir --no-deps /dist/dynamig-*.whl" in dockerfile
    assert f"ARG DYNAMIG_VERSION={VERSION}\n" in dockerfile
    assert f"ARG DYNAMIG_REVISION={revision}\n" in dockerfile
    for label in ("version", "revision", "base.name", "base.digest", "licenses"):
        assert f"org.opencontainers.image.{label}=" in dockerfile, label
    hadolint = Path(sys.executable).parent / "hadolint"
    if hadolint.exists():
        lint = subprocess.run(
            [str(hadolint), "Dockerfile"],
            cwd=context,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert lint.returncode == 0, lint.stdout + lint.stderr

    for lock in ("runtime.lock", "build.lock"):
        assert (context / "requirements" / lock).read_bytes() == (ROOT / "requirements" / lock).read_bytes()
    assert (context / "operator" / "dynamig" / "cli" / "__init__.py").is_file()
    assert not (context / "tests").exists() and not (context / ".venv").exists()
    assert not list(context.rglob("__pycache__")) and not list(context.rglob("_generated"))
    with tarfile.open(release / f"dynamig-{VERSION}-image-context.tar.gz") as tar:
        in_tar = {m.name for m in tar.getmembers() if m.isfile()}
    assert in_tar == {f"image-context/{p.relative_to(context)}" for p in context.rglob("*") if p.is_file()}


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def dpkg_listing(image: Path, tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (version, architecture) of the packages installed in ``image`` (an OCI archive), as the host's
    dpkg-query reads them from the newest ``var/lib/dpkg/status`` of its layers."""
    admin = tmp / "dpkg"
    (admin / "info").mkdir(parents=True)
    with tarfile.open(image) as oci:
        (entry,) = json.load(oci.extractfile("index.json"))["manifests"]  # type: ignore[arg-type]
        manifest = json.load(oci.extractfile(f"blobs/sha256/{entry['digest'].split(':')[1]}"))  # type: ignore[arg-type]
        for layer in manifest["layers"]:
            blob = oci.extractfile(f"blobs/sha256/{layer['digest'].split(':')[1]}")
            with tarfile.open(fileobj=blob, mode="r:*") as files:
                for info in files:
                    if info.name.lstrip("./") == "var/lib/dpkg/status" and info.isfile():
                        (admin / "status").write_bytes(files.extractfile(info).read())  # type: ignore[union-attr]
    query = subprocess.run(
        ["dpkg-query", f"--admindir={admin}", "-W",
         "-f", "${db:Status-Status} ${Package} ${Version} ${Architecture}\\n"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    rows = [line.split() for line in query.stdout.splitlines()]
    return {name: (version, arch) for status, name, version, arch in rows if status == "installed"}


def test_sbom_is_syfts_valid_spdx_and_lists_what_the_image_holds(release: Path, tmp_path: Path) -> None:
    """The SBOM is syft's catalogue of the image (hack/release.sh): checked by the SPDX project's validator,
    against the lock (every pinned package at its pinned version) and against the image's own dpkg database
    read by the host's dpkg-query."""
    from spdx_tools.spdx.parser.parse_anything import parse_file
    from spdx_tools.spdx.validation.document_validator import validate_full_spdx_document

    path = release / f"dynamig-{VERSION}.spdx.json"
    problems = validate_full_spdx_document(parse_file(str(path)), "SPDX-2.3")
    assert not problems, [p.validation_message for p in problems][:10]
    doc = json.loads(path.read_text())
    assert doc["spdxVersion"] == "SPDX-2.3"
    assert doc["creationInfo"]["creators"][-1].startswith("Tool: syft-"), doc["creationInfo"]
    assert doc["name"] == "dynamig", doc["name"]

    def purls(pkg: dict[str, Any]) -> list[str]:
        return [r["referenceLocator"] for r in pkg.get("externalRefs", []) if r["referenceType"] == "purl"]

    python = {p["name"]: p for p in doc["packages"] if any(u.startswith("pkg:pypi/") for u in purls(p))}
    debs = {p["name"]: p for p in doc["packages"] if any(u.startswith("pkg:deb/debian/") for u in purls(p))}

    # Python: the lock's pins, dynamig itself, and what `python -m venv` seeds the image's venv with.
    pins = parse_lock(RUNTIME_LOCK)
    assert set(python) == set(pins) | {"dynamig"} | {"pip", "setuptools"}, set(python) ^ set(pins)
    assert python["dynamig"]["versionInfo"] == VERSION
    for name, (version, _, _) in pins.items():
        assert python[name]["versionInfo"] == version, name
        assert purls(python[name]) == [f"pkg:pypi/{name}@{version}"], name
    # Dependency edges from the installed metadata: dynamig's direct ones, and a transitive one.
    ids = {p["SPDXID"]: p["name"] for p in doc["packages"]}
    depends = {
        (ids[r["relatedSpdxElement"]], ids[r["spdxElementId"]])
        for r in doc["relationships"]
        if r["relationshipType"] == "DEPENDENCY_OF" and r["spdxElementId"] in ids
    }
    direct = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["dependencies"]}
    assert {child for parent, child in depends if parent == "dynamig"} == direct
    assert ("kopf", "aiohttp") in depends
    assert python["kubernetes-asyncio"]["licenseDeclared"] == "Apache-2.0"

    # Debian: exactly the packages dpkg-query lists from the image's own dpkg database, at their versions.
    listed = dpkg_listing(release / f"dynamig-image-{VERSION}.oci.tar", tmp_path)
    assert {name: p["versionInfo"] for name, p in debs.items()} == {n: v for n, (v, _) in listed.items()}
    for name, (version, arch) in listed.items():
        (purl,) = purls(debs[name])
        assert purl.startswith(
            f"pkg:deb/debian/{quote(name, safe='')}@{quote(version, safe='')}?arch={arch}&"
        ), purl
    assert {"libc6", "python3.11", "ca-certificates", "python3-venv"} <= set(debs)


# ------------------------------------------------------------------------------------------------ install
@contextlib.contextmanager
def _created_objects_removed(cp: ControlPlane, manifest: Path) -> Iterator[None]:
    """Deletes, afterwards, the objects of ``manifest`` (CRDs aside) that did not exist before."""
    docs = yaml_docs(manifest)
    custom_kinds = {d["spec"]["names"]["kind"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    objs = [o for o in docs if o["kind"] != "CustomResourceDefinition"]
    # One query for the built-in kinds; kubectl answers nothing at all for a stream with a kind it does not
    # know yet, so the objects of the file's own CRDs are asked one by one.
    builtin = [o for o in objs if o["kind"] not in custom_kinds]
    names = cp.kubectl(
        "get", "--ignore-not-found", "-o", "name", "-f", "-", input=yaml.safe_dump_all(builtin)
    ).stdout.split()
    for obj in objs:
        if obj["kind"] in custom_kinds:
            names += cp.kubectl(
                "get",
                obj["kind"].lower(),
                obj["metadata"]["name"],
                "--ignore-not-found",
                "-o",
                "name",
                check=False,
            ).stdout.split()
    existing = {(n.split("/")[0].split(".")[0], n.split("/")[1]) for n in names}
    created = [o for o in objs if (o["kind"].lower(), o["metadata"]["name"]) not in existing]
    try:
        yield
    finally:
        cp.kubectl(
            "delete",
            "--ignore-not-found",
            "--wait=false",
            "-f",
            "-",
            input=yaml.safe_dump_all(created),
            check=False,
        )
        if any(o["kind"] == "Namespace" for o in created):
            _await_namespace_gone(cp, SYSTEM_NS)


def _await_namespace_gone(cp: ControlPlane, namespace: str) -> None:
    """Waits until ``namespace`` is deleted. Its pods are force-deleted first: with no kubelet to confirm a
    graceful delete, a pod bound to a node would hold the namespace Terminating for good."""
    cp.kubectl("delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", check=False)
    cp.kubectl("wait", "--for=delete", f"namespace/{namespace}", "--timeout=90s", check=False, timeout=120)
    left = cp.kubectl("get", "namespace", namespace, "--ignore-not-found", "-o", "name").stdout
    assert not left.strip(), f"namespace {namespace} is still there: {left}"


def test_release_manifest_and_chart_install_on_the_control_plane(
    release: Path, control_plane: ControlPlane, helm: str, tmp_path: Path
) -> None:
    cp = control_plane
    manifest = release / "dynamig.yaml"
    # An earlier module's cleanup may still be deleting the namespace; nothing can go into it until then.
    phase = cp.kubectl("get", "namespace", SYSTEM_NS, "--ignore-not-found", "-o", "jsonpath={.status.phase}")
    if phase.stdout == "Terminating":
        _await_namespace_gone(cp, SYSTEM_NS)

    # 1. The single manifest, as docs/install.md says: apply, wait for the CRDs, apply again (the first pass
    #    cannot create the peering object before its CRD is served). No controller here runs workloads, so
    #    the Deployment and DaemonSet are real objects that start no pods.
    with _created_objects_removed(cp, manifest):
        first = cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(manifest), check=False)
        if first.returncode != 0:
            errors = [line for line in first.stderr.splitlines() if line.startswith("error")]
            assert len(errors) == 1 and 'no matches for kind "ClusterKopfPeering"' in errors[0], first.stderr
        cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", *DYNAMIG_CRDS)
        cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/clusterkopfpeerings.kopf.dev")
        second = cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(manifest))
        assert len(second.stdout.splitlines()) == len(yaml_docs(manifest)), second.stdout
        listed = cp.kubectl("get", "-f", str(manifest), "-o", "name").stdout.split()
        assert len(listed) == len(yaml_docs(manifest))
        image = cp.kubectl(
            "get",
            "deployment/dynamig-operator",
            "-n",
            SYSTEM_NS,
            "-o",
            "jsonpath={.spec.template.spec.containers[0].image}",
        ).stdout
        assert image == f"dynamig/dynamig:{VERSION}"

    # 2. The packaged chart, into a fresh namespace, its cluster-scoped names and peering apart from those
    #    above; pods pinned to no node. The CRDs exist by now: mark them adoptable, as a user moving from
    #    the plain manifest to Helm would.
    name = unique_name("dynamig-rel")  # holds the chart name, so the fullname is the release name
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "features": {"deviceClass": False},
                "operator": {
                    "replicas": 1,
                    "peering": {"name": name},
                    "nodeSelector": {"dynamig.io/test-never": "true"},
                },
                "agent": {"nodeSelector": {"dynamig.io/test-never": "true"}},
            }
        )
    )

    def run_helm(*args: str) -> str:
        proc = subprocess.run(
            [helm, *args, "--namespace", name],
            capture_output=True,
            text=True,
            timeout=180,
            env=cp.env(),
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    adopt_crds(cp, DYNAMIG_CRDS, name, name)
    try:
        run_helm(
            "install", name, str(release / f"dynamig-{VERSION}.tgz"), "--create-namespace", "-f", str(values)
        )
        (listed,) = json.loads(run_helm("list", "--filter", f"^{name}$", "-o", "json"))
        assert (listed["status"], listed["chart"], listed["app_version"]) == (
            "deployed",
            f"dynamig-{VERSION}",
            VERSION,
        )
        cp.kubectl("get", "-n", name, f"deployment/{name}-operator", f"daemonset/{name}-agent")
        cp.kubectl("get", f"clusterrole/{name}-operator", f"clusterkopfpeering/{name}")
        run_helm("uninstall", name, "--no-hooks")  # no kubelet here runs the pre-delete hook's Job
        gone = cp.kubectl("get", f"clusterrole/{name}-operator", check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr
    finally:
        forget_release(cp, helm, name, name, DYNAMIG_CRDS, ROOT / "crds")
