"""``dynamig doctor``: the catalog compared with NVML's answers, and create/destroy of every profile.

Real: the command (in-process through ``dynamig.cli.main`` and once as a subprocess), the agent's NVML code
path (``NvmlDevices``), the geometry catalog. Simulated: the GPUs, through ``dynamig.backends.simnvml``,
configured by the command itself (``--simulate-gpus``) or shared through a state file (``--state``).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from dynamig.agent.nvml.device import NvmlDevices
from dynamig.backends import simnvml
from dynamig.cli import doctor, main
from dynamig.geometry.catalog import Catalog, load_catalog
from dynamig.geometry.model import PlacedInstance

MIB = 1024 * 1024
MUTATE_A100 = ["doctor", "--nvml", "simulated", "--simulate-gpus", "A100-80GB:1", "--mutate", "-o", "json"]
RECORD_KEYS = {
    "profile",
    "mig_uuid",
    "parent_uuid",
    "memory_bytes",
    "create_s",
    "destroy_s",
    "ok",
    "gpu",
    "error",
}


@pytest.fixture(autouse=True)
def _forget_simulation() -> Iterator[None]:
    yield
    simnvml.reset()  # the command configures the module; leave no simulated machine behind


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().out


def _created(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["check"] == "create-destroy"]


def _assert_every_profile_made_once(records: list[dict[str, Any]]) -> None:
    model = load_catalog().model("A100-80GB")
    made = _created(records)
    assert [r["profile"] for r in made] == [p.name for p in model.profiles]  # each profile exactly once
    uuids = [r["mig_uuid"] for r in made]
    assert len(set(uuids)) == len(uuids)
    for r in made:
        assert set(r) >= RECORD_KEYS, r
        assert r["ok"] is True and r["error"] is None, r
        assert r["gpu"] == 0 and r["parent_uuid"].startswith("GPU-")
        assert r["mig_uuid"].startswith("MIG-") and r["mig_uuid"] != r["parent_uuid"]
        profile = model.profile(r["profile"])
        assert r["memory_bytes"] == profile.memory_mib * MIB
        assert r["start"] == profile.placement_starts[0]
        assert r["create_s"] >= 0 and r["destroy_s"] >= 0


def test_mutate_json_creates_and_destroys_every_profile_once(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, MUTATE_A100)
    assert rc == 0, out
    records = json.loads(out)
    assert records[0] == {
        "check": "catalog", "gpu": 0, "uuid": records[0]["uuid"], "product": "NVIDIA A100-SXM4-80GB",
        "model": "A100-80GB", "ok": True, "result": "matches",
    }  # fmt: skip
    _assert_every_profile_made_once(records)
    kinds = [e.kind for e in simnvml.history()]
    assert kinds.count("create-gi") == kinds.count("destroy-gi") == 7
    assert "set-mig-mode" not in kinds
    assert simnvml.snapshot()["gpus"][0]["gpu_instances"] == []  # nothing left behind


def test_mutate_json_as_a_subprocess() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dynamig", *MUTATE_A100], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    _assert_every_profile_made_once(json.loads(done.stdout))


def test_read_only_table_says_matches_and_changes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, ["doctor", "--nvml", "simulated", "--simulate-gpus", "H100-80GB:1,A30-24GB:1"])
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[0].split() == ["GPU", "PRODUCT", "PROFILE", "FIELD", "CATALOG", "NVML"]
    assert "H100-80GB" in lines[1] and lines[1].endswith("matches")
    assert "A30-24GB" in lines[2] and lines[2].endswith("matches")
    assert lines[-1] == "all checks passed"
    assert simnvml.history() == []  # read-only: no NVML change at all


def test_mutate_table_lists_each_instance_with_timings(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, ["doctor", "--nvml", "simulated", "--simulate-gpus", "A30-24GB:1", "--mutate"])
    assert rc == 0, out
    header = next(line for line in out.splitlines() if line.startswith("GPU  PROFILE"))
    assert header.split() == ["GPU", "PROFILE", "START", "MIG", "UUID", "MEMORY", "MiB", "CREATE", "s",
                              "DESTROY", "s", "RESULT"]  # fmt: skip
    rows = [line for line in out.splitlines() if " MIG-" in line]
    assert len(rows) == len(load_catalog().model("A30-24GB").profiles)
    assert all(row.endswith("ok") for row in rows)


def _state_with(tmp_path: Path, *, instance: bool = False, mig_enabled: bool = True) -> Path:
    """A simulated A100-80GB in a state file, optionally with one instance (as an agent would leave it)."""
    state = tmp_path / "gpus.json"
    simnvml.configure(["A100-80GB"], state_file=state, mig_enabled=mig_enabled)
    if instance:
        devices = NvmlDevices(simnvml, load_catalog())
        devices.init()
        devices.create(devices.gpu(0), PlacedInstance(4, "3g.40gb"))
        devices.shutdown()
    return state


def test_a_gpu_with_an_instance_is_refused_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _state_with(tmp_path, instance=True)
    before = simnvml.snapshot()["gpus"]
    rc, out = _run(capsys, ["doctor", "--nvml", "simulated", "--state", str(state), "--mutate", "-o", "json"])
    assert rc == 1
    made = _created(json.loads(out))
    assert len(made) == 1 and made[0]["profile"] is None and made[0]["ok"] is False
    assert "refused: the GPU has 1 GPU instance(s)" in made[0]["error"]
    assert simnvml.snapshot()["gpus"] == before  # the instance is untouched

    rc, out = _run(capsys, ["doctor", "--nvml", "simulated", "--state", str(state), "--mutate"])
    assert rc == 1 and "FAILED: refused: the GPU has 1 GPU instance(s)" in out


def test_mig_mode_is_never_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _state_with(tmp_path, mig_enabled=False)
    rc, out = _run(capsys, ["doctor", "--nvml", "simulated", "--state", str(state), "--mutate", "-o", "json"])
    assert rc == 1
    records = json.loads(out)
    # Read-only part: the unversioned profile call answers without MIG; everything but names compared.
    assert records[0]["result"] == "matches"
    assert "MIG mode is disabled" in _created(records)[0]["error"]
    assert simnvml.history() == []


def test_a_catalog_that_differs_from_nvml_is_reported(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = load_catalog()
    a100 = real.model("A100-80GB")
    changed = tuple(
        dataclasses.replace(p, memory_mib=40960, placement_starts=(0,)) if p.name == "3g.40gb" else p
        for p in a100.profiles
    )
    models = {m.key: m for m in real.models()}
    models["A100-80GB"] = dataclasses.replace(a100, profiles=changed)
    # The simulator keeps serving the packaged catalog: only the doctor's view changes.
    monkeypatch.setattr(doctor, "load_catalog", lambda: Catalog(models))

    argv = ["doctor", "--nvml", "simulated", "--simulate-gpus", "A100-80GB:1"]
    rc, out = _run(capsys, [*argv, "-o", "json"])
    assert rc == 1
    diffs = [(r["profile"], r["field"], r["catalog"], r["nvml"]) for r in json.loads(out)]
    assert diffs == [("3g.40gb", "memory_mib", 40960, 40192), ("3g.40gb", "placement_starts", [0], [0, 4])]

    rc, out = _run(capsys, argv)
    assert rc == 1
    rows = [line.split() for line in out.splitlines()]
    assert ["0", "NVIDIA", "A100-SXM4-80GB", "3g.40gb", "memory_mib", "40960", "40192"] in rows
    assert ["0", "NVIDIA", "A100-SXM4-80GB", "3g.40gb", "placement_starts", "0", "0,4"] in rows
    assert out.splitlines()[-1] == "some checks FAILED"


def test_a_mig_device_reporting_its_parent_is_caught(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a parent handle used in place of the MIG device's own would show: the GPU's UUID and memory.
    def parent_of(handle: Any) -> Any:
        try:
            return simnvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        except pynvml.NVMLError:  # a GPU handle: already the parent
            return handle

    uuid, memory = simnvml.nvmlDeviceGetUUID, simnvml.nvmlDeviceGetMemoryInfo
    monkeypatch.setattr(simnvml, "nvmlDeviceGetUUID", lambda h: uuid(parent_of(h)))
    monkeypatch.setattr(simnvml, "nvmlDeviceGetMemoryInfo", lambda h, *a: memory(parent_of(h), *a))
    rc, out = _run(capsys, MUTATE_A100)
    assert rc == 1
    made = _created(json.loads(out))
    assert len(made) == 7 and not any(r["ok"] for r in made)
    for r in made:
        assert "MIG UUID" in r["error"] and "parent GPU's UUID" in r["error"]
        assert "memory 81920 MiB" in r["error"]


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--nvml", "simulated", "--simulate-gpus", "V100-32GB:1"]) == 2
    assert "unknown GPU model 'V100-32GB'" in capsys.readouterr().err
    assert main(["doctor", "--simulate-gpus", "A100-80GB:1"]) == 2
    assert "need --nvml simulated" in capsys.readouterr().err
