"""Validation of CDI specs before the plugin writes them: the CDI JSON schema, then the checks a runtime's CDI
library makes when it loads a spec.

The schema (``cdi_schema/schema.json`` and ``defs.json``, vendored from the CDI project, see the README there)
is checked with ``jsonschema``. It leaves much open (environment entries, hook names, names), so
:func:`semantic_errors` adds the rules of the CDI project's Go library that container runtimes (containerd,
CRI-O) use: ``pkg/cdi/spec.go`` (``validate``), ``pkg/cdi/container-edits.go`` (``Validate`` of edits,
device nodes, hooks, mounts, ``ValidateEnv``), ``pkg/parser/parser.go`` (vendor, class and device names),
``specs-go/version.go`` (known versions, the minimum version a spec's content requires) and
``specs-go/config.go`` (the known fields: the library refuses a spec with any other).

:func:`required_version`, :func:`semantic_errors` and :func:`spec_errors` are pure (the schema is read from
the package once, then cached); :func:`check_spec` raises.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

import jsonschema
from referencing import Registry
from referencing.jsonschema import DRAFT7

SCHEMA_PACKAGE = "dynamig.agent.plugin"
SCHEMA_DIR = "cdi_schema"

# specs-go/version.go: the versions a CDI library accepts, oldest first.
KNOWN_VERSIONS = ("0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
_EARLIEST_REQUIRED = "0.3.0"
# pkg/cdi/container-edits.go: validHookNames.
HOOK_NAMES = frozenset(
    {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
)
_DEVICE_NODE_TYPES = frozenset({"", "b", "c", "u", "p"})
# pkg/parser/parser.go: vendor and class names, device names.
_VENDOR_OR_CLASS_RE = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
# specs-go/config.go: the fields the library knows. It decodes strictly (pkg/cdi/spec.go ``ParseSpec``,
# ``KnownFields(true)``), so a field it does not know makes the whole spec fail to load.
_FIELDS = {
    "spec": {"cdiVersion", "kind", "annotations", "devices", "containerEdits"},
    "device": {"name", "annotations", "containerEdits"},
    "edits": {"env", "deviceNodes", "netDevices", "hooks", "mounts", "intelRdt", "additionalGids"},
    "deviceNode": {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"},
    "mount": {"hostPath", "containerPath", "options", "type"},
    "hook": {"hookName", "path", "args", "env", "timeout"},
    "intelRdt": {"closID", "l3CacheSchema", "memBwSchema", "schemata", "enableMonitoring"},
    "netDevice": {"hostInterfaceName", "name"},
}


class InvalidSpecError(Exception):
    """A CDI spec is not valid; the message says what and where."""


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    base = resources.files(SCHEMA_PACKAGE).joinpath(SCHEMA_DIR)
    schema = json.loads(base.joinpath("schema.json").read_text())
    defs = json.loads(base.joinpath("defs.json").read_text())
    # schema.json refers to "defs.json#/definitions/..." relative to its own (unnamed) location.
    registry: Registry[Any] = Registry().with_resource("defs.json", DRAFT7.create_resource(defs))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator: jsonschema.protocols.Validator = cls(schema, registry=registry)
    return validator


def schema_errors(spec: Mapping[str, Any]) -> list[str]:
    """Violations of the CDI JSON schema, as ``at '<path>': <message>``. Pure (schema cached)."""
    errors = sorted(_validator().iter_errors(spec), key=lambda e: list(map(str, e.absolute_path)))
    return [f"at '/{'/'.join(map(str, e.absolute_path))}': {e.message}" for e in errors]


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.removeprefix("v").split("."))


def _edits(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    edits = [spec.get("containerEdits") or {}]
    edits += [d.get("containerEdits") or {} for d in spec.get("devices") or [] if isinstance(d, Mapping)]
    return [e for e in edits if isinstance(e, Mapping)]


def required_version(spec: Mapping[str, Any]) -> str:
    """The lowest CDI version whose features cover the spec's content (specs-go/version.go,
    ``MinimumRequiredVersion``). Pure."""
    edits = _edits(spec)
    rdts = [e["intelRdt"] for e in edits if e.get("intelRdt") is not None]
    if any(e.get("netDevices") for e in edits) or any(
        isinstance(r, Mapping) and (r.get("schemata") is not None or r.get("enableMonitoring")) for r in rdts
    ):
        return "1.1.0"
    if rdts or any(e.get("additionalGids") for e in edits):
        return "0.7.0"
    devices = [d for d in spec.get("devices") or [] if isinstance(d, Mapping)]
    _, _, klass = str(spec.get("kind", "")).partition("/")
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or "." in klass:
        return "0.6.0"
    if any(str(d.get("name", ""))[:1].isdigit() for d in devices) or any(
        isinstance(n, Mapping) and n.get("hostPath") for e in edits for n in e.get("deviceNodes") or []
    ):
        return "0.5.0"
    return _EARLIEST_REQUIRED


def _env_errors(env: Iterable[Any], where: str) -> list[str]:
    # ValidateEnv: every entry has a '=' after a non-empty name.
    return [f"{where}: invalid environment variable {v!r}" for v in env if str(v).find("=") <= 0]


def _unknown_fields(obj: Mapping[str, Any], what: str, where: str) -> list[str]:
    unknown = sorted(set(obj) - _FIELDS[what])
    return [f"{where}: unknown field(s) {', '.join(map(repr, unknown))}"] if unknown else []


def _edits_errors(edits: Mapping[str, Any], where: str) -> list[str]:
    errs = _unknown_fields(edits, "edits", where) + _env_errors(edits.get("env") or [], where)
    for what, key in (
        ("deviceNode", "deviceNodes"),
        ("mount", "mounts"),
        ("hook", "hooks"),
        ("netDevice", "netDevices"),
    ):
        for i, item in enumerate(edits.get(key) or []):
            errs += _unknown_fields(item, what, f"{where}.{key}[{i}]")
    if isinstance(edits.get("intelRdt"), Mapping):
        errs += _unknown_fields(edits["intelRdt"], "intelRdt", f"{where}.intelRdt")
    for n in edits.get("deviceNodes") or []:
        path = n.get("path", "")
        if not path:
            errs.append(f"{where}: device node with an empty path")
        if n.get("type", "") not in _DEVICE_NODE_TYPES:
            errs.append(f"{where}: device {path!r}: invalid type {n.get('type')!r}")
        if n.get("major", 0) < 0 or n.get("minor", 0) < 0:
            errs.append(f"{where}: device {path!r}: negative device number")
        if str(n.get("permissions", "")).strip("rwm"):
            errs.append(f"{where}: device {path!r}: invalid permissions {n.get('permissions')!r}")
    for h in edits.get("hooks") or []:
        name = h.get("hookName")
        if name not in HOOK_NAMES:
            errs.append(f"{where}: invalid hook name {name!r}")
        if not h.get("path"):
            errs.append(f"{where}: hook {name!r} with an empty path")
        errs += _env_errors(h.get("env") or [], f"{where}: hook {name!r}")
    for m in edits.get("mounts") or []:
        if not m.get("hostPath") or not m.get("containerPath"):
            errs.append(f"{where}: mount {m!r} with an empty host or container path")
    return errs


def semantic_errors(spec: Mapping[str, Any]) -> list[str]:
    """Violations of what a runtime's CDI library checks on load, for a spec that passed the schema. Pure."""
    errs = _unknown_fields(spec, "spec", "the spec")
    version = str(spec.get("cdiVersion", "")).removeprefix("v")
    if version not in KNOWN_VERSIONS:
        errs.append(f"cdiVersion {spec.get('cdiVersion')!r} is not one of {', '.join(KNOWN_VERSIONS)}")
    elif _version_key(version) < _version_key(need := required_version(spec)):
        errs.append(f"cdiVersion {version} is too old for the spec's content: it must be at least {need}")
    vendor, _, klass = str(spec.get("kind", "")).partition("/")
    for what, name in (("vendor", vendor), ("class", klass)):
        if not _VENDOR_OR_CLASS_RE.match(name):
            errs.append(f"kind {spec.get('kind')!r}: invalid {what} name {name!r}")
    errs += _edits_errors(spec.get("containerEdits") or {}, "containerEdits")
    devices = spec.get("devices") or []
    if not devices:
        errs.append("the spec has no devices")
    seen: set[str] = set()
    for i, d in enumerate(devices):
        name = str(d.get("name", ""))
        if not _DEVICE_NAME_RE.match(name):
            errs.append(f"devices[{i}]: invalid device name {name!r}")
        if name in seen:
            errs.append(f"devices[{i}]: device name {name!r} appears more than once")
        seen.add(name)
        errs += _unknown_fields(d, "device", f"devices[{i}]")
        errs += _edits_errors(d.get("containerEdits") or {}, f"devices[{i}] ({name}).containerEdits")
    return errs


def spec_errors(spec: Mapping[str, Any]) -> list[str]:
    """Every reason a runtime would refuse ``spec``: schema violations first; the CDI library's own checks
    only when the schema holds (they assume its shape). Empty when valid. Pure."""
    return schema_errors(spec) or semantic_errors(spec)


def check_spec(spec: Mapping[str, Any], what: str) -> None:
    """Raises InvalidSpecError naming ``what`` (e.g. the spec's file) and every problem. Pure."""
    errors = spec_errors(spec)
    if errors:
        raise InvalidSpecError(f"{what} is not a valid CDI spec: " + "; ".join(errors))
