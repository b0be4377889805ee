"""Unit tests of the node base CDI spec (``dynamig.agent.plugin.cdi_base``) and of claim specs built on it.

Real: the base-spec reader and parser, the claim-spec builder and the validation, on a temporary directory
standing in for ``/var/run/cdi`` and ``/dev``. The base spec is text in the shape NVIDIA's container toolkit
writes (taken from its own ``cmd/nvidia-ctk/cdi/generate/generate_test.go``); no GPU, NVML or Kubernetes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from dynamig.agent.plugin import cdi
from dynamig.agent.plugin.cdi_base import (
    BaseSpecError,
    common_edits,
    load_base_spec,
    parse_base_spec,
    read_base_spec,
)
from dynamig.agent.plugin.cdi_validation import spec_errors
from dynamig.agent.plugin.instances import PreparedInstance
from dynamig.agent.plugin.settings import PluginSettings

UID = "6a1f3c2e-8d0b-4c8e-9f4a-1b2c3d4e5f60"

# What `nvidia-ctk cdi generate` writes (its generate_test.go expectation, driver root /driver).
NVIDIA_CTK_YAML = """---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
    - name: "0"
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
              hostPath: /driver/dev/nvidia0
    - name: all
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
              hostPath: /driver/dev/nvidia0
containerEdits:
    env:
        - NVIDIA_CTK_LIBCUDA_DIR=/lib/x86_64-linux-gnu
        - NVIDIA_VISIBLE_DEVICES=void
    deviceNodes:
        - path: /dev/nvidiactl
          hostPath: /driver/dev/nvidiactl
    hooks:
        - hookName: createContainer
          path: /usr/bin/nvidia-cdi-hook
          args:
            - nvidia-cdi-hook
            - create-symlinks
            - --link
            - libcuda.so.1::/lib/x86_64-linux-gnu/libcuda.so
          env:
            - NVIDIA_CTK_DEBUG=false
        - hookName: createContainer
          path: /usr/bin/nvidia-cdi-hook
          args:
            - nvidia-cdi-hook
            - enable-cuda-compat
            - --host-driver-version=999.88.77
          env:
            - NVIDIA_CTK_DEBUG=false
        - hookName: createContainer
          path: /usr/bin/nvidia-cdi-hook
          args:
            - nvidia-cdi-hook
            - update-ldcache
            - --folder
            - /lib/x86_64-linux-gnu
          env:
            - NVIDIA_CTK_DEBUG=false
    mounts:
        - hostPath: /driver/lib/x86_64-linux-gnu/libcuda.so.999.88.77
          containerPath: /lib/x86_64-linux-gnu/libcuda.so.999.88.77
          options:
            - ro
            - nosuid
            - nodev
            - rbind
            - rprivate
"""


def instance(name: str = "gpu1-1g10gb-s6", *, gi: int = 13) -> PreparedInstance:
    return PreparedInstance(
        device_name=name,
        mig_uuid=f"MIG-{name}-uuid",
        parent_uuid="GPU-aaaa",
        gpu_index=1,
        gpu_minor=1,
        gi_id=gi,
        ci_id=0,
    )


def test_parses_nvidia_ctk_output_yaml_and_json(tmp_path: Path) -> None:
    base = parse_base_spec(NVIDIA_CTK_YAML, tmp_path / "nvidia.yaml")
    assert (base.kind, base.cdi_version, base.path) == ("nvidia.com/gpu", "0.5.0", tmp_path / "nvidia.yaml")
    raw = yaml.safe_load(NVIDIA_CTK_YAML)
    assert base.container_edits == raw["containerEdits"]
    # `nvidia-ctk cdi generate --format=json` (or --output=....json) writes the same content as JSON.
    as_json = parse_base_spec(json.dumps(raw), tmp_path / "nvidia.json")
    assert as_json.container_edits == base.container_edits


def test_common_edits_keep_everything_and_force_void(tmp_path: Path) -> None:
    raw = yaml.safe_load(NVIDIA_CTK_YAML)
    raw["containerEdits"]["env"] = ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_CTK_LIBCUDA_DIR=/lib"]
    base = parse_base_spec(json.dumps(raw), tmp_path / "nvidia.json")
    edits = common_edits(base)
    assert edits["env"] == ["NVIDIA_CTK_LIBCUDA_DIR=/lib", "NVIDIA_VISIBLE_DEVICES=void"]
    for key in ("deviceNodes", "hooks", "mounts"):
        assert edits[key] == raw["containerEdits"][key]
    edits["mounts"].clear()
    assert base.container_edits["mounts"], "common_edits returns a copy"


def test_claim_spec_on_top_of_the_base_spec(tmp_path: Path) -> None:
    base = parse_base_spec(NVIDIA_CTK_YAML, tmp_path / "nvidia.yaml")
    a, b = instance("gpu1-1g10gb-s5", gi=11), instance("gpu1-1g10gb-s6", gi=13)
    both = (a.mig_uuid, b.mig_uuid)
    devices = [
        cdi.CdiDevice(a, cdi.CapabilityMinors(102, 103), both),
        cdi.CdiDevice(b, cdi.CapabilityMinors(120, 121), both),
    ]
    spec = cdi.build_spec(UID, devices, Path("/host/dev"), base)
    assert spec_errors(spec) == []
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == "k8s.mig.dynamig.io/claim"
    assert spec["annotations"] == {
        "mig.dynamig.io/claim-uid": UID,
        "mig.dynamig.io/cdi-base-spec": str(tmp_path / "nvidia.yaml"),
    }
    # Spec-wide: the driver as NVIDIA's toolkit describes it (libraries, control nodes, hooks), and void.
    raw_edits = yaml.safe_load(NVIDIA_CTK_YAML)["containerEdits"]
    assert spec["containerEdits"] == raw_edits
    assert [h["args"][1] for h in spec["containerEdits"]["hooks"]] == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
    ]
    assert spec["containerEdits"]["env"].count("NVIDIA_VISIBLE_DEVICES=void") == 1
    # Per device: exactly that slice's nodes, and the request's MIG UUIDs under our own variable.
    first, second = spec["devices"]
    assert first["name"] == f"{UID}-gpu1-1g10gb-s5"
    assert first["containerEdits"] == {
        "env": [f"DYNAMIG_MIG_UUIDS={a.mig_uuid},{b.mig_uuid}"],
        "deviceNodes": [
            {"path": "/dev/nvidia1", "hostPath": "/host/dev/nvidia1"},
            {"path": "/dev/nvidia-caps/nvidia-cap102", "hostPath": "/host/dev/nvidia-caps/nvidia-cap102"},
            {"path": "/dev/nvidia-caps/nvidia-cap103", "hostPath": "/host/dev/nvidia-caps/nvidia-cap103"},
        ],
    }
    assert [n["path"] for n in second["containerEdits"]["deviceNodes"]][1:] == [
        "/dev/nvidia-caps/nvidia-cap120",
        "/dev/nvidia-caps/nvidia-cap121",
    ]
    # No variable of NVIDIA's names a device: the legacy hook has nothing to inject.
    all_env = spec["containerEdits"]["env"] + [e for d in spec["devices"] for e in d["containerEdits"]["env"]]
    assert [e for e in all_env if e.startswith("NVIDIA_VISIBLE_DEVICES=")] == ["NVIDIA_VISIBLE_DEVICES=void"]


def test_claim_spec_version_covers_the_base_content(tmp_path: Path) -> None:
    raw = yaml.safe_load(NVIDIA_CTK_YAML)
    raw["cdiVersion"] = "0.7.0"
    raw["containerEdits"]["additionalGids"] = [44]
    base = parse_base_spec(json.dumps(raw), tmp_path / "nvidia.json")
    spec = cdi.build_spec(UID, [cdi.CdiDevice(instance(), cdi.CapabilityMinors(3, 4))], tmp_path, base)
    assert spec["cdiVersion"] == "0.7.0" and spec_errors(spec) == []


def test_missing_base_spec_fails_with_how_to_generate_it(tmp_path: Path) -> None:
    path = tmp_path / "cdi" / "nvidia.yaml"
    assert read_base_spec(path) is None
    with pytest.raises(BaseSpecError) as err:
        load_base_spec(path, allow_missing=False)
    message = str(err.value)
    assert f"CDI base spec {path} does not exist" in message
    assert f"nvidia-ctk cdi generate --output={path}" in message
    assert "--cdi-base-spec" in message
    # Allowed on simulated nodes: no base, device-nodes-only specs.
    assert load_base_spec(path, allow_missing=True) is None
    path.parent.mkdir()
    path.write_text(NVIDIA_CTK_YAML)
    loaded = load_base_spec(path, allow_missing=False)
    assert loaded is not None and loaded.kind == "nvidia.com/gpu"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cdiVersion: [", "is not YAML or JSON"),
        ("- a list\n", "no mapping at the top"),
        ("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n", "'devices' is a required property"),
        (NVIDIA_CTK_YAML.replace("- NVIDIA_CTK_DEBUG=false", "- NVIDIA_CTK_DEBUG", 1), "'NVIDIA_CTK_DEBUG'"),
        (
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: [{name: all, containerEdits: {}}]\n",
            "has no common containerEdits",
        ),
    ],
)
def test_broken_base_spec_is_refused_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "nvidia.yaml"
    path.write_text(text)
    with pytest.raises(BaseSpecError, match=rf"CDI base spec {re.escape(str(path))}.*{re.escape(message)}"):
        load_base_spec(path, allow_missing=True)


def test_unreadable_base_spec_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "nvidia.yaml").mkdir()  # a directory where the file should be
    with pytest.raises(BaseSpecError, match=r"cannot read CDI base spec .*nvidia.yaml"):
        read_base_spec(tmp_path / "nvidia.yaml")


def test_settings_base_spec_path() -> None:
    assert PluginSettings(node_name="n").base_spec_path == Path("/var/run/cdi/nvidia.yaml")
    assert PluginSettings(node_name="n", cdi_root=Path("/x")).base_spec_path == Path("/x/nvidia.yaml")
    moved = PluginSettings(node_name="n", cdi_base_spec=Path("/etc/cdi/nvidia.json"))
    assert moved.base_spec_path == Path("/etc/cdi/nvidia.json")
    assert moved.allow_missing_base_spec is False
