"""Unit tests of the kubelet plugin's file formats: CDI specs, NVIDIA capability files, the checkpoint.

What runs for real: the CDI builder and writer, the capability-file parser and reader, the checkpoint
encoder/decoder and store, on a temporary directory standing in for ``/var/run/cdi``, ``/dev`` and
``/proc``. Nothing is simulated; no GPU, NVML or Kubernetes is involved.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamig.agent.plugin import cdi, cdi_validation
from dynamig.agent.plugin.checkpoint import (
    CHECKPOINT_VERSION,
    CheckpointError,
    CheckpointStore,
    PreparedClaim,
    PreparedDevice,
    decode,
    encode,
)
from dynamig.agent.plugin.instances import PreparedInstance

UID = "6a1f3c2e-8d0b-4c8e-9f4a-1b2c3d4e5f60"


def instance(name: str = "gpu1-1g10gb-s6", *, minor: int = 1, gi: int = 13, ci: int = 0) -> PreparedInstance:
    return PreparedInstance(
        device_name=name,
        mig_uuid=f"MIG-{name}-uuid",
        parent_uuid="GPU-aaaa",
        gpu_index=1,
        gpu_minor=minor,
        gi_id=gi,
        ci_id=ci,
        profile="1g.10gb",
        placement_start=6,
    )


# --- capability files ----------------------------------------------------------------------------------

REAL_ACCESS_FILE = "DeviceFileMinor: 138\nDeviceFileMode: 292\nDeviceFileModify: 1\n"


def test_parse_access_file_reads_the_minor_line() -> None:
    assert cdi.parse_access_file(REAL_ACCESS_FILE) == 138
    assert cdi.parse_access_file("DeviceFileMode: 444\n  DeviceFileMinor:   7  \n") == 7


@pytest.mark.parametrize("text", ["", "DeviceFileMode: 292\n", "DeviceFileMinor: x\n", "DeviceFileMinor:\n"])
def test_parse_access_file_rejects_files_without_a_minor(text: str) -> None:
    with pytest.raises(ValueError, match="DeviceFileMinor"):
        cdi.parse_access_file(text)


@settings(max_examples=40)
@given(minor=st.integers(min_value=0, max_value=2**20), mode=st.integers(min_value=0, max_value=0o777))
def test_parse_access_file_roundtrip(minor: int, mode: int) -> None:
    text = f"DeviceFileMode: {mode}\nDeviceFileMinor: {minor}\nDeviceFileModify: 1\n"
    assert cdi.parse_access_file(text) == minor


def write_caps(proc: Path, gpu_minor: int, gi: int, ci: int, gi_minor: int, ci_minor: int) -> None:
    gi_file = cdi.gi_access_path(proc, gpu_minor, gi)
    ci_file = cdi.ci_access_path(proc, gpu_minor, gi, ci)
    ci_file.parent.mkdir(parents=True)
    gi_file.write_text(f"DeviceFileMinor: {gi_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    ci_file.write_text(f"DeviceFileMinor: {ci_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")


def test_read_capability_minors_follows_the_driver_layout(tmp_path: Path) -> None:
    write_caps(tmp_path, gpu_minor=1, gi=13, ci=0, gi_minor=255, ci_minor=256)
    assert (tmp_path / "driver/nvidia/capabilities/gpu1/mig/gi13/ci0/access").is_file()
    minors = cdi.read_capability_minors(tmp_path, instance(minor=1, gi=13, ci=0))
    assert minors == cdi.CapabilityMinors(gi_access=255, ci_access=256)


def test_read_capability_minors_names_the_missing_file(tmp_path: Path) -> None:
    write_caps(tmp_path, gpu_minor=1, gi=13, ci=0, gi_minor=255, ci_minor=256)
    with pytest.raises(cdi.CapabilityError, match=r"gpu1/mig/gi14/access does not exist"):
        cdi.read_capability_minors(tmp_path, instance(gi=14))
    (tmp_path / "driver/nvidia/capabilities/gpu1/mig/gi13/ci0/access").write_text("garbage\n")
    with pytest.raises(cdi.CapabilityError, match=r"gi13/ci0/access has no 'DeviceFileMinor"):
        cdi.read_capability_minors(tmp_path, instance())


# --- CDI -----------------------------------------------------------------------------------------------


def test_cdi_ids_are_qualified_and_parseable() -> None:
    dev_id = cdi.cdi_device_id(UID, "gpu1-1g10gb-s6")
    assert dev_id == f"k8s.mig.dynamig.io/claim={UID}-gpu1-1g10gb-s6"
    kind, name = dev_id.split("=")
    vendor, klass = kind.split("/")
    # CDI name rules: vendor is a domain-like name, class and device name use [A-Za-z0-9_.:-].
    assert vendor == cdi.CDI_VENDOR and klass == cdi.CDI_CLASS
    assert all(c.isalnum() or c in "-_.:" for c in name)


def test_build_spec_has_device_nodes_env_and_version() -> None:
    """Without a base spec (simulated nodes): the slice's nodes per device, the control nodes spec-wide."""
    inst = instance()
    minors = cdi.CapabilityMinors(gi_access=255, ci_access=256)
    spec = cdi.build_spec(UID, [cdi.CdiDevice(inst, minors)], Path("/host/dev"), None)
    assert spec["cdiVersion"] == "0.6.0"
    assert tuple(int(x) for x in spec["cdiVersion"].split(".")) >= (0, 6, 0)
    assert spec["kind"] == "k8s.mig.dynamig.io/claim"
    [device] = spec["devices"]
    assert device["name"] == f"{UID}-gpu1-1g10gb-s6"
    edits = device["containerEdits"]
    assert edits["env"] == ["DYNAMIG_MIG_UUIDS=MIG-gpu1-1g10gb-s6-uuid"]
    assert edits["deviceNodes"] == [
        {"path": "/dev/nvidia1", "hostPath": "/host/dev/nvidia1"},
        {"path": "/dev/nvidia-caps/nvidia-cap255", "hostPath": "/host/dev/nvidia-caps/nvidia-cap255"},
        {"path": "/dev/nvidia-caps/nvidia-cap256", "hostPath": "/host/dev/nvidia-caps/nvidia-cap256"},
    ]
    # The legacy NVIDIA hook must not inject devices on top of CDI: NVIDIA_VISIBLE_DEVICES is "void".
    assert spec["containerEdits"] == {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [
            {"path": "/dev/nvidiactl", "hostPath": "/host/dev/nvidiactl"},
            {"path": "/dev/nvidia-uvm", "hostPath": "/host/dev/nvidia-uvm"},
        ],
    }
    assert cdi_validation.spec_errors(spec) == []


def test_build_spec_lists_every_uuid_of_a_request() -> None:
    a, b = instance("gpu0-1g10gb-s0", minor=0, gi=9), instance("gpu0-1g10gb-s1", minor=0, gi=10)
    m = cdi.CapabilityMinors(1, 2)
    both = (a.mig_uuid, b.mig_uuid)
    spec = cdi.build_spec(UID, [cdi.CdiDevice(a, m, both), cdi.CdiDevice(b, m, both)], Path("/dev"), None)
    envs = [d["containerEdits"]["env"] for d in spec["devices"]]
    assert envs == [[f"DYNAMIG_MIG_UUIDS={a.mig_uuid},{b.mig_uuid}"]] * 2


def test_write_spec_is_atomic_and_removable(tmp_path: Path) -> None:
    root = tmp_path / "cdi"
    spec = cdi.build_spec(UID, [cdi.CdiDevice(instance(), cdi.CapabilityMinors(3, 4))], tmp_path, None)
    path = cdi.write_spec(root, UID, spec)
    assert path == root / f"k8s.mig.dynamig.io-claim_{UID}.json"
    assert json.loads(path.read_text()) == spec
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    # No temporary file is left next to it.
    assert [p.name for p in root.iterdir()] == [path.name]
    assert cdi.spec_claim_uids(root) == {UID}
    # Files of other tools in the CDI root are never taken for ours.
    (root / "nvidia.com-gpu.yaml").write_text("cdiVersion: 0.5.0\n")
    (root / "k8s.mig.dynamig.io-claim_../../etc.json").parent.mkdir(parents=True, exist_ok=True)
    assert cdi.spec_claim_uids(root) == {UID}
    assert cdi.remove_spec(root, UID) is True
    assert cdi.remove_spec(root, UID) is False
    assert cdi.spec_claim_uids(root) == set()


def test_spec_path_refuses_unsafe_uids(tmp_path: Path) -> None:
    for bad in ["../x", "a/b", "", ".hidden"]:
        with pytest.raises(ValueError):
            cdi.spec_path(tmp_path, bad)


def test_concurrent_writers_never_expose_a_partial_spec(tmp_path: Path) -> None:
    """Readers racing two writers always parse a complete spec (rename is atomic)."""
    root = tmp_path / "cdi"
    big = [cdi.CdiDevice(instance(f"gpu0-1g10gb-s{i}"), cdi.CapabilityMinors(i, i + 1)) for i in range(7)]
    specs = [cdi.build_spec(UID, big[:n], tmp_path, None) for n in (1, 7)]
    cdi.write_spec(root, UID, specs[0])
    stop = threading.Event()

    def writer(spec: dict[str, object]) -> None:
        while not stop.is_set():
            cdi.write_spec(root, UID, spec)

    threads = [threading.Thread(target=writer, args=(s,)) for s in specs]
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            assert json.loads(cdi.spec_path(root, UID).read_text()) in specs
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_missing_device_nodes(tmp_path: Path) -> None:
    (tmp_path / "nvidia-caps").mkdir()
    for n in ["nvidia1", "nvidiactl", "nvidia-caps/nvidia-cap3"]:
        (tmp_path / n).touch()
    nodes = cdi.device_nodes(instance(), cdi.CapabilityMinors(3, 4)) + cdi.CONTROL_NODES
    missing = cdi.missing_device_nodes(tmp_path, nodes)
    assert missing == [tmp_path / "nvidia-caps/nvidia-cap4", tmp_path / "nvidia-uvm"]


PROC_DEVICES = """Character devices:
  1 mem
  4 /dev/vc/0
195 nvidia-frontend
195 nvidia
234 nvidia-caps
510 nvidia-uvm

Block devices:
  7 loop
234 nvidia-caps-imex-channels
"""


def test_parse_char_major() -> None:
    assert cdi.parse_char_major(PROC_DEVICES, "nvidia-caps") == 234
    assert cdi.parse_char_major(PROC_DEVICES, "nvidia-uvm") == 510
    assert cdi.parse_char_major(PROC_DEVICES, "loop") is None  # a block device
    assert cdi.parse_char_major("", "nvidia-caps") is None


def test_missing_capability_nodes_are_created_as_char_devices(tmp_path: Path) -> None:
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    proc.mkdir()
    minors = cdi.CapabilityMinors(gi_access=129, ci_access=130)
    # Without the driver's major in /proc/devices nothing is guessed.
    assert cdi.create_capability_nodes(dev, proc, minors) == []
    (proc / "devices").write_text(PROC_DEVICES)
    (dev / "nvidia-caps").mkdir(parents=True)
    (dev / "nvidia-caps" / "nvidia-cap129").touch()  # already there: left alone
    try:
        created = cdi.create_capability_nodes(dev, proc, minors)
    except PermissionError:
        pytest.skip("creating device nodes needs CAP_MKNOD, which this environment lacks")
    assert created == [dev / "nvidia-caps" / "nvidia-cap130"]
    st = created[0].stat()
    assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o444
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (234, 130)
    assert cdi.create_capability_nodes(dev, proc, minors) == []


# --- checkpoint ----------------------------------------------------------------------------------------


def prepared(uid: str = UID, devices: int = 1) -> PreparedClaim:
    devs = tuple(
        PreparedDevice(
            request_names=("gpu",),
            pool_name="node-a",
            device_name=f"gpu1-1g10gb-s{i}",
            cdi_device_ids=(cdi.cdi_device_id(uid, f"gpu1-1g10gb-s{i}"),),
            instance=instance(f"gpu1-1g10gb-s{i}", gi=7 + i),
        )
        for i in range(devices)
    )
    return PreparedClaim(uid=uid, namespace="ns", name="claim", devices=devs)


def test_checkpoint_roundtrip_and_format(tmp_path: Path) -> None:
    claims = {UID: prepared(devices=2), "other-uid": prepared("other-uid")}
    raw = encode(claims)
    assert decode(raw) == claims
    doc = json.loads(raw)
    assert doc["version"] == CHECKPOINT_VERSION
    assert doc["checksum"].startswith("sha256:")
    assert set(doc["data"]["preparedClaims"]) == {UID, "other-uid"}
    # Deterministic: the same claims encode to the same bytes whatever the dict order.
    assert encode(dict(reversed(list(claims.items())))) == raw


def test_checkpoint_refuses_tampering_and_unknown_versions() -> None:
    doc = json.loads(encode({UID: prepared()}))
    doc["data"]["preparedClaims"][UID]["devices"][0]["instance"]["giID"] = 99
    with pytest.raises(CheckpointError, match="checksum"):
        decode(json.dumps(doc).encode())
    doc = json.loads(encode({UID: prepared()}))
    doc["version"] = "mig.dynamig.io/checkpoint/v0"
    with pytest.raises(CheckpointError, match="version"):
        decode(json.dumps(doc).encode())
    with pytest.raises(CheckpointError, match="JSON"):
        decode(b'{"version": ')
    with pytest.raises(CheckpointError, match="not a JSON object"):
        decode(b"[]")


def test_checkpoint_store(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "state" / "checkpoint.json")
    assert store.load() == {}
    store.save({UID: prepared()})
    assert store.load() == {UID: prepared()}
    assert oct(store.path.stat().st_mode & 0o777) == "0o600"
    store.save({})
    assert store.load() == {}
    assert sorted(os.listdir(store.path.parent)) == ["checkpoint.json"]
    store.path.write_bytes(store.path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=str(store.path)):
        store.load()


@settings(max_examples=30)
@given(
    uids=st.lists(st.uuids().map(str), max_size=4, unique=True),
    devices=st.integers(min_value=0, max_value=3),
)
def test_checkpoint_roundtrip_property(uids: list[str], devices: int) -> None:
    claims = {u: prepared(u, devices) for u in uids}
    assert decode(encode(claims)) == claims
