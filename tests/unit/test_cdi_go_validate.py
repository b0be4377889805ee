"""The CDI specs dynamig generates, checked by the CDI project's own Go code.

Real: ``cdi-validate`` (``hack/build-cdi-validate.sh``), a small Go program over
``tags.cncf.io/container-device-interface``'s ``pkg/cdi.ReadSpec``, the parser and validation containerd and
CRI-O load CDI specs with, plus the vendored CDI JSON schema checked with the JSON schema library CDI's own
``schema`` package uses; the plugin's claim-spec builder and writer; the simulated node base spec written by
``SimulatedDriverFiles``. Simulated: the GPUs (``dynamig.backends.simnvml``, two A100-80GB) and the driver's
files. No Kubernetes.

``make test`` builds the binary first (``make cdivalidate``); when it is not built yet this test builds it
(cached under ``~/.cache/dynamig/tools``) and fails, never skips, when it cannot.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dynamig.agent.devices_service import prepared_instance
from dynamig.agent.nvml.device import NvmlDevices
from dynamig.agent.nvml.simulated_driver import SimulatedDriverFiles
from dynamig.agent.plugin import cdi
from dynamig.agent.plugin.cdi_base import read_base_spec
from dynamig.agent.plugin.cdi_validation import SCHEMA_DIR, spec_errors
from dynamig.backends.nvml import load_nvml
from dynamig.devcluster.binaries import BinariesNotFoundError, build_tool
from dynamig.geometry.model import PlacedInstance, device_name

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "operator" / "dynamig" / "agent" / "plugin" / SCHEMA_DIR / "schema.json"
UID = "0f4c2a9e-3b1d-4e8f-a7c6-5d2e1b0a9c88"


@pytest.fixture(scope="module")
def cdi_validate() -> str:
    """Path of the cdi-validate binary (built once from the CDI Go module; cached)."""
    try:
        return str(build_tool("build-cdi-validate.sh"))
    except BinariesNotFoundError as exc:
        pytest.fail(f"cdi-validate could not be built (make cdivalidate): {exc}")


@pytest.fixture
def nvml() -> Iterator[ModuleType]:
    module: ModuleType = load_nvml("simulated")
    module.configure(gpus=["A100-80GB", "A100-80GB"], state_file=None)
    yield module
    module.configure(gpus=[], state_file=None)


def run(binary: str, *paths: Path) -> tuple[int, list[dict[str, Any]]]:
    """Runs cdi-validate (with the vendored schema) over ``paths``: exit code, one result per path."""
    proc = subprocess.run(
        [binary, "-schema", str(SCHEMA), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.stderr == "", proc.stderr
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()]


def claim_spec(
    devices: NvmlDevices, files: SimulatedDriverFiles, placed: list[PlacedInstance]
) -> list[cdi.CdiDevice]:
    """CdiDevices for fresh instances at ``placed`` on GPU 0, read back from the simulated driver files."""
    gpu = devices.gpu(0)
    assert gpu.minor is not None
    made = [devices.create(gpu, p) for p in placed]
    files.sync()
    out = []
    for p, inst in zip(placed, made, strict=True):
        assert inst.ci_id is not None
        prepared = prepared_instance(device_name(0, p.profile, p.start), gpu, inst)
        uuids = tuple(i.mig_uuid for i in made)
        out.append(cdi.CdiDevice(prepared, cdi.read_capability_minors(files.proc_root, prepared), uuids))
    return out


def test_generated_specs_pass_the_cdi_library_and_broken_ones_do_not(
    cdi_validate: str, devices: NvmlDevices, tmp_path: Path
) -> None:
    cdi_root = tmp_path / "cdi"
    base_path = cdi_root / "nvidia.yaml"
    files = SimulatedDriverFiles(
        devices, proc_root=tmp_path / "proc", dev_root=tmp_path / "dev", base_spec=base_path
    )
    files.sync()
    base = read_base_spec(base_path)
    assert base is not None
    cdi_devices = claim_spec(devices, files, [PlacedInstance(0, "1g.10gb"), PlacedInstance(4, "3g.40gb")])
    claim = cdi.write_spec(cdi_root, UID, cdi.build_spec(UID, cdi_devices, files.dev_root, base))
    nodes_only_uid = "1a2b3c4d-0000-4000-8000-000000000001"
    nodes_only = cdi.write_spec(
        cdi_root, nodes_only_uid, cdi.build_spec(nodes_only_uid, cdi_devices[:1], files.dev_root, None)
    )

    rc, results = run(cdi_validate, base_path, claim, nodes_only)
    assert rc == 0, results
    assert [r["valid"] for r in results] == [True, True, True]
    base_result, claim_result, nodes_only_result = results
    gpus = devices.gpus()
    assert (base_result["kind"], base_result["cdiVersion"]) == ("nvidia.com/gpu", "0.5.0")
    assert base_result["devices"] == [
        f"nvidia.com/gpu={name}" for g in gpus for name in (str(g.index), g.uuid)
    ] + ["nvidia.com/gpu=all"]
    # The CDI library resolves exactly the device ids the plugin answers the kubelet with.
    assert claim_result["kind"] == "k8s.mig.dynamig.io/claim"
    assert claim_result["devices"] == [
        cdi.cdi_device_id(UID, "gpu0-1g10gb-s0"),
        cdi.cdi_device_id(UID, "gpu0-3g40gb-s4"),
    ]
    assert nodes_only_result["devices"] == [cdi.cdi_device_id(nodes_only_uid, "gpu0-1g10gb-s0")]

    # Deliberately broken variants of the claim spec: the Go library refuses each, and so does our check.
    good: dict[str, Any] = json.loads(claim.read_text())
    breakages: dict[str, Any] = {
        "env-without-equals": lambda s: s["containerEdits"]["env"].append("NVIDIA_VISIBLE_DEVICES"),
        "device-node-without-path": lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].pop("path"),
        "unknown-hook-stage": lambda s: s["containerEdits"]["hooks"][0].update(hookName="afterStart"),
        "unknown-field": lambda s: s["containerEdits"].update(ldconfig="/sbin/ldconfig"),
        "bad-device-name": lambda s: s["devices"][1].update(name="gpu0 3g40gb"),
        "no-devices": lambda s: s.update(devices=[]),
        "version-too-old-for-annotations": lambda s: s.update(cdiVersion="0.5.0"),
        "unknown-version": lambda s: s.update(cdiVersion="0.9.0"),
    }
    bad_paths = []
    for name, breakage in breakages.items():
        spec = copy.deepcopy(good)
        breakage(spec)
        assert spec_errors(spec) != [], f"{name}: our validation accepts it"
        path = tmp_path / "broken" / f"{name}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(spec))
        bad_paths.append(path)
    rc, results = run(cdi_validate, *bad_paths)
    assert rc == 1
    refused = {Path(r["path"]).stem: r for r in results}
    assert {n for n, r in refused.items() if r["valid"]} == set(), refused
    assert set(refused) == set(breakages)
    reasons = {
        "env-without-equals": 'invalid environment variable "NVIDIA_VISIBLE_DEVICES"',
        "device-node-without-path": "invalid (empty) device path",
        "unknown-hook-stage": 'invalid hook name "afterStart"',
        "unknown-field": "field ldconfig not found",
        "bad-device-name": "invalid character ' ' in device name",
        "no-devices": "invalid spec, no devices",
        "version-too-old-for-annotations": "the spec version must be at least v0.6.0",
        "unknown-version": 'invalid version "0.9.0"',
    }
    assert {n: reasons[n] in r["error"] for n, r in refused.items()} == dict.fromkeys(breakages, True), (
        refused
    )
