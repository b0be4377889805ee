"""Unit tests of the real test node's pure parts: the OCI image archives it imports, the containerd and
kubelet configurations it writes, and the host checks that make a node that cannot start say why.

Real: the OCI image layout as image-spec v1.1 defines it (digests over the exact bytes, the layer's diff id
equal to its digest when uncompressed), TOML parsed by the standard library. The archives are also imported
by containerd itself in ``e2e/test_real_node.py``, the check by something we did not write.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
import tomllib
from pathlib import Path

import pytest

from dynamig.devcluster.images import ImageFile, oci_archive
from dynamig.devcluster.node import NodeError, check_host, containerd_config, kubelet_config


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_oci_archive_is_a_consistent_image_layout(tmp_path: Path) -> None:
    prog = tmp_path / "prog"
    prog.write_bytes(b"\x7fELF not really")
    out = oci_archive(
        tmp_path / "img.tar",
        name="dynamig.local/test:1",
        files=[ImageFile("bin/prog", source=prog), ImageFile("bin/alias", link_to="prog")],
        entrypoint=["/bin/prog"],
    )
    files = _members(out)
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1], f"{name}: digest mismatch"
    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "dynamig.local/test:1"
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
    manifest = json.loads(files[f"blobs/sha256/{entry['digest'].removeprefix('sha256:')}"])
    assert entry["size"] == len(files[f"blobs/sha256/{entry['digest'].removeprefix('sha256:')}"])
    config = json.loads(files[f"blobs/sha256/{manifest['config']['digest'].removeprefix('sha256:')}"])
    (layer,) = manifest["layers"]
    assert config["rootfs"]["diff_ids"] == [layer["digest"]]
    assert config["config"]["Entrypoint"] == ["/bin/prog"]
    layer_tar = tmp_path / "layer.tar"
    layer_tar.write_bytes(files[f"blobs/sha256/{layer['digest'].removeprefix('sha256:')}"])
    with tarfile.open(layer_tar) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin"].isdir()
    assert members["bin/prog"].isfile() and members["bin/prog"].mode == 0o755
    assert members["bin/alias"].issym() and members["bin/alias"].linkname == "prog"
    # Same inputs, same bytes: the image id does not change between runs.
    again = oci_archive(
        tmp_path / "again.tar",
        name="dynamig.local/test:1",
        files=[ImageFile("bin/prog", source=prog), ImageFile("bin/alias", link_to="prog")],
        entrypoint=["/bin/prog"],
    )
    assert _members(again) == files


def test_containerd_config_keeps_everything_under_the_work_dir_with_cdi_on(tmp_path: Path) -> None:
    runc = tmp_path / "bin" / "runc"
    doc = tomllib.loads(containerd_config(tmp_path / "c", runc, tmp_path / "cdi", restrict_oom=True))
    assert doc["version"] == 3
    assert doc["root"].startswith(str(tmp_path)) and doc["state"].startswith(str(tmp_path))
    assert doc["grpc"]["address"] == str(tmp_path / "c" / "containerd.sock")
    runtime = doc["plugins"]["io.containerd.cri.v1.runtime"]
    assert runtime["enable_cdi"] is True and runtime["cdi_spec_dirs"] == [str(tmp_path / "cdi")]
    assert runtime["restrict_oom_score_adj"] is True
    runc_options = runtime["containerd"]["runtimes"]["runc"]["options"]
    assert runc_options == {"BinaryName": str(runc), "SystemdCgroup": False}
    images = doc["plugins"]["io.containerd.cri.v1.images"]
    assert images["pinned_images"]["sandbox"] == "dynamig.local/pause:1"
    assert images["registry"]["config_path"] == str(tmp_path / "c" / "certs.d")  # RealNode.trust_registry
    relaxed = tomllib.loads(containerd_config(tmp_path / "c", runc, tmp_path / "cdi", restrict_oom=False))
    assert relaxed["plugins"]["io.containerd.cri.v1.runtime"]["restrict_oom_score_adj"] is False


@pytest.mark.parametrize(("mode", "fail_v1"), [("v1", False), ("v2", None)])
def test_kubelet_config_allows_cgroup_v1_only_where_the_host_has_it(
    tmp_path: Path, mode: str, fail_v1: bool | None
) -> None:
    config = kubelet_config(
        root=tmp_path,
        address="192.0.2.2",
        port=1,
        healthz_port=2,
        runtime_socket=tmp_path / "s",
        cgroup_mode=mode,
    )
    assert config.get("failCgroupV1") is fail_v1
    assert config["containerRuntimeEndpoint"] == f"unix://{tmp_path / 's'}"
    assert config["podLogsDir"].startswith(str(tmp_path))


def _fake_proc(tmp_path: Path, filesystems: str, mounts: str) -> Path:
    (tmp_path / "self").mkdir(parents=True)
    (tmp_path / "filesystems").write_text(filesystems)
    (tmp_path / "self" / "mounts").write_text(mounts)
    return tmp_path


V1_MOUNTS = "".join(
    f"cgroup /sys/fs/cgroup/{c} cgroup rw,relatime,{c} 0 0\n"
    for c in ("cpu", "cpuacct", "cpuset", "memory", "devices", "pids")
)


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="the check first asks for root")
def test_check_host_names_what_is_missing(tmp_path: Path) -> None:
    assert check_host(_fake_proc(tmp_path / "ok", "nodev\toverlay\n", V1_MOUNTS)) == "v1"
    v2 = "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n"
    assert check_host(_fake_proc(tmp_path / "v2", "nodev\toverlay\n", v2)) == "v2"
    with pytest.raises(NodeError, match="no overlay filesystem"):
        check_host(_fake_proc(tmp_path / "no-overlay", "nodev\tproc\n", V1_MOUNTS))
    no_devices = V1_MOUNTS.replace("devices", "freezer")
    with pytest.raises(NodeError, match="cgroup v1 controllers not mounted: devices"):
        check_host(_fake_proc(tmp_path / "no-devices", "nodev\toverlay\n", no_devices))
