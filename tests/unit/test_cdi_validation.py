"""Unit tests of CDI spec validation (``dynamig.agent.plugin.cdi_validation``) and of the writer refusing an
invalid spec.

Real: the vendored CDI JSON schema checked with ``jsonschema``, the checks that mirror the CDI Go library,
the spec writer on a temporary directory. Nothing is simulated. ``test_cdi_go_validate.py`` runs the CDI
project's own Go code over generated specs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from dynamig.agent.plugin import cdi, cdi_validation
from dynamig.agent.plugin.cdi_validation import InvalidSpecError, required_version, spec_errors
from dynamig.agent.plugin.instances import PreparedInstance

UID = "6a1f3c2e-8d0b-4c8e-9f4a-1b2c3d4e5f60"

# The CDI project's schema/testdata/good/spec-example.json.
UPSTREAM_EXAMPLE: dict[str, Any] = {
    "cdiVersion": "0.6.0",
    "kind": "vendor.com/device",
    "devices": [
        {
            "name": "myDevice",
            "containerEdits": {
                "deviceNodes": [
                    {"hostPath": "/vendorroot/dev/card1", "path": "/dev/card1"},
                    {"path": "/dev/card2"},
                ]
            },
        }
    ],
    "containerEdits": {
        "env": ["FOO=CDI_SPEC", "BAR=BARVALUE1"],
        "deviceNodes": [{"path": "/dev/vendorctl", "uid": 1000, "gid": 1000}],
        "mounts": [
            {"hostPath": "/bin/vendorBin", "containerPath": "/bin/vendorBin"},
            {"hostPath": "/usr/lib/libVendor.so.0", "containerPath": "/usr/lib/libVendor.so.0"},
        ],
        "hooks": [
            {"hookName": "createContainer", "path": "/bin/vendor-hook"},
            {"hookName": "startContainer", "path": "/usr/bin/ldconfig"},
        ],
    },
}


def test_vendored_schema_is_the_cdi_one() -> None:
    schema_dir = Path(cdi_validation.__file__).parent / cdi_validation.SCHEMA_DIR
    schema = json.loads((schema_dir / "schema.json").read_text())
    assert schema["description"] == "Configuration Schema for the Container Device Interface"
    assert schema["required"] == ["cdiVersion", "kind", "devices"]
    # This revision validates spec-level edits too: the base spec's common edits land there.
    assert schema["properties"]["containerEdits"] == {"$ref": "defs.json#/definitions/containerEdits"}
    assert "05ae4b5bb730a036cb3f79477bd6676eea4a8c83" in (schema_dir / "README.md").read_text()


def test_upstream_examples_are_valid() -> None:
    assert spec_errors(UPSTREAM_EXAMPLE) == []
    minimal = {
        "cdiVersion": "0.3.0",
        "kind": "vendor.com/device",
        "devices": [{"name": "d", "containerEdits": {}}],
    }
    assert spec_errors(minimal) == []


def broken(path: str, value: Any) -> dict[str, Any]:
    """UPSTREAM_EXAMPLE with the value at a slash-separated path replaced (None deletes it). Pure."""
    spec = copy.deepcopy(UPSTREAM_EXAMPLE)
    *parents, last = path.split("/")
    node: Any = spec
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is None:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return spec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # Caught by the JSON schema.
        (broken("kind", None), "'kind' is a required property"),
        (broken("devices", {"name": "x"}), "at '/devices'"),
        (broken("devices/0/containerEdits", None), "'containerEdits' is a required property"),
        (broken("containerEdits/mounts/0/containerPath", None), "'containerPath' is a required property"),
        (broken("containerEdits/hooks/0/path", None), "'path' is a required property"),
        (broken("containerEdits/deviceNodes/0/uid", -1), "at '/containerEdits/deviceNodes/0/uid'"),
        (broken("annotations", {"a": 1}), "at '/annotations/a'"),
        # Caught by the checks the CDI Go library makes on load.
        (broken("containerEdits/env/0", "NO_EQUALS_SIGN"), "invalid environment variable 'NO_EQUALS_SIGN'"),
        (broken("containerEdits/env/0", "=value"), "invalid environment variable '=value'"),
        (broken("containerEdits/hooks/0/hookName", "afterStart"), "invalid hook name 'afterStart'"),
        (broken("containerEdits/deviceNodes/0/path", ""), "device node with an empty path"),
        (broken("containerEdits/deviceNodes/0/permissions", "rwx"), "invalid permissions 'rwx'"),
        (broken("containerEdits/mounts/0/hostPath", ""), "empty host or container path"),
        (broken("devices/0/name", "my device"), "invalid device name 'my device'"),
        (broken("devices", []), "the spec has no devices"),
        (broken("kind", "vendor.com"), "invalid class name ''"),
        (broken("kind", "-vendor.com/device"), "invalid vendor name '-vendor.com'"),
        (broken("cdiVersion", "0.9.0"), "cdiVersion '0.9.0' is not one of"),
        # The library decodes strictly: a field it does not know fails the whole spec.
        (broken("containerEdit", {}), "the spec: unknown field(s) 'containerEdit'"),
        (broken("devices/0/containerEdits/devicenodes", []), "unknown field(s) 'devicenodes'"),
        (broken("containerEdits/hooks/0/timeoutSeconds", 5), "containerEdits.hooks[0]: unknown field(s)"),
        (broken("containerEdits/mounts/1/readOnly", True), "containerEdits.mounts[1]: unknown field(s)"),
        (
            broken("cdiVersion", "0.4.0"),
            "cdiVersion 0.4.0 is too old for the spec's content: it must be at least 0.5.0",
        ),
    ],
)
def test_broken_specs_are_refused_with_a_reason(spec: dict[str, Any], message: str) -> None:
    errors = spec_errors(spec)
    assert any(message in e for e in errors), errors
    with pytest.raises(InvalidSpecError, match="the file is not a valid CDI spec"):
        cdi_validation.check_spec(spec, "the file")


def test_duplicate_device_names_are_refused() -> None:
    spec = copy.deepcopy(UPSTREAM_EXAMPLE)
    spec["devices"].append(copy.deepcopy(spec["devices"][0]))
    assert spec_errors(spec) == ["devices[1]: device name 'myDevice' appears more than once"]


@pytest.mark.parametrize(
    ("change", "version"),
    [
        ({}, "0.5.0"),  # a device node with a hostPath
        ({"annotations": {"a.io/b": "c"}}, "0.6.0"),
        ({"kind": "vendor.com/device.class"}, "0.6.0"),
        ({"containerEdits": {"additionalGids": [5]}}, "0.7.0"),
        ({"containerEdits": {"intelRdt": {"closID": "c"}}}, "0.7.0"),
        ({"containerEdits": {"netDevices": [{"hostInterfaceName": "eth1", "name": "net1"}]}}, "1.1.0"),
    ],
)
def test_required_version_follows_the_content(change: dict[str, Any], version: str) -> None:
    spec = {**copy.deepcopy(UPSTREAM_EXAMPLE), **change}
    assert required_version(spec) == version
    assert required_version({"kind": "a.com/b", "devices": [{"name": "x", "containerEdits": {}}]}) == "0.3.0"
    assert required_version({"kind": "a.com/b", "devices": [{"name": "0", "containerEdits": {}}]}) == "0.5.0"


def test_write_spec_refuses_an_invalid_spec(tmp_path: Path) -> None:
    inst = PreparedInstance(
        device_name="gpu0-1g10gb-s6",
        mig_uuid="MIG-x",
        parent_uuid="GPU-y",
        gpu_index=0,
        gpu_minor=0,
        gi_id=13,
        ci_id=0,
    )
    spec = cdi.build_spec(UID, [cdi.CdiDevice(inst, cdi.CapabilityMinors(3, 4))], tmp_path, None)
    spec["containerEdits"]["env"].append("BROKEN")
    with pytest.raises(
        InvalidSpecError, match=rf"CDI spec for claim {UID} is not a valid CDI spec: .*'BROKEN'"
    ):
        cdi.write_spec(tmp_path / "cdi", UID, spec)
    assert not cdi.spec_path(tmp_path / "cdi", UID).exists()
