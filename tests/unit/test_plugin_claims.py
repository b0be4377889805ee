"""Unit tests of the kubelet plugin's pure parts: claim parsing and checks, settings, stub loading, and the
proto build.

What runs for real: ``parse_claim`` / ``devices_for_node`` on ResourceClaim JSON shaped as the
``resource.k8s.io/v1`` API returns it (plain values, no API server), the settings' path derivation, the lazy
import of the generated gRPC modules, and ``build_protos`` (grpcio-tools' protoc, in process). Nothing is
simulated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dynamig.agent.plugin import build_protos, stubs
from dynamig.agent.plugin.claims import ClaimError, ClaimRef, devices_for_node, parse_claim
from dynamig.agent.plugin.settings import PluginSettings

DRIVER = "mig.dynamig.io"
UID = "0b3b9c54-2f1d-4d53-9d7e-3c2b1a0f9e8d"
Res = dict[str, str]
REF = ClaimRef(namespace="team-a", name="train-gpu", uid=UID)


def claim_json(results: list[dict[str, str]] | None, uid: str = UID) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "train-gpu", "namespace": "team-a", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    }
    if results is not None:
        obj["status"] = {"allocation": {"devices": {"results": results}}}
    return obj


def result(device: str, *, pool: str = "node-a", driver: str = DRIVER, request: str = "gpu") -> Res:
    return {"request": request, "driver": driver, "pool": pool, "device": device}


def test_parse_claim_and_accept_devices_of_this_node() -> None:
    claim = parse_claim(
        claim_json([result("gpu0-1g10gb-s6", request="gpu/small"), result("other", driver="gpu.example.com")])
    )
    assert claim.allocated and claim.uid == UID
    [dev] = devices_for_node(REF, claim, driver="mig.dynamig.io", node="node-a")
    got = (dev.device, dev.pool, dev.request, dev.base_request)
    assert got == ("gpu0-1g10gb-s6", "node-a", "gpu/small", "gpu")


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (claim_json(None), "is not allocated"),
        (claim_json([result("gpu0-1g10gb-s6")], uid="another-uid"), "deleted and re-created"),
        (claim_json([result("d", driver="gpu.example.com")]), "no device of driver mig.dynamig.io"),
        (claim_json([result("gpu0-1g10gb-s6", pool="node-b")]), "node-b/gpu0-1g10gb-s6 of another node"),
    ],
)
def test_claims_that_cannot_be_prepared_here(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(ClaimError, match=message):
        devices_for_node(REF, parse_claim(obj), driver="mig.dynamig.io", node="node-a")


def test_settings_paths_follow_the_kubelet_layout(tmp_path: Path) -> None:
    s = PluginSettings(node_name="n1")
    assert s.registration_socket == Path("/var/lib/kubelet/plugins_registry/mig.dynamig.io-reg.sock")
    assert s.dra_socket == Path("/var/lib/kubelet/plugins/mig.dynamig.io/dra.sock")
    assert s.cdi_root == Path("/var/run/cdi")
    assert s.checkpoint_path == Path("/var/lib/kubelet/plugins/mig.dynamig.io/checkpoint.json")
    s.validate()
    moved = PluginSettings(node_name="n1", kubelet_root=tmp_path / "k", state_dir=tmp_path / "st")
    assert moved.dra_socket == tmp_path / "k/plugins/mig.dynamig.io/dra.sock"
    assert moved.checkpoint_path == tmp_path / "st/checkpoint.json"
    with pytest.raises(ValueError, match="longer than the 107"):
        PluginSettings(node_name="n1", kubelet_root=Path("/" + "x" * 100)).validate()
    with pytest.raises(ValueError, match="node_name"):
        PluginSettings(node_name="").validate()


def test_stubs_load_and_missing_stubs_say_to_run_make_proto() -> None:
    build_protos.build()
    loaded = stubs.load_stubs()
    # The wire names the kubelet calls.
    assert loaded.dra_v1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert loaded.dra_v1beta1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1beta1"
    assert loaded.registration.DESCRIPTOR.package == "pluginregistration"
    assert "DRAPlugin" in loaded.dra_v1.DESCRIPTOR.services_by_name
    assert "Registration" in loaded.registration.DESCRIPTOR.services_by_name
    with pytest.raises(stubs.StubsMissingError, match="run `make proto`"):
        stubs._import("no_such_pb2")


def test_proto_fields_match_the_kubelet_wire_interface() -> None:
    """Field names and numbers as in k8s.io/kubelet pkg/apis/dra/v1 and pluginregistration/v1."""
    loaded = stubs.load_stubs()

    def fields(module: Any, message: str) -> dict[str, int]:
        return {f.name: f.number for f in module.DESCRIPTOR.message_types_by_name[message].fields}

    v1, v1beta1, reg = loaded.dra_v1, loaded.dra_v1beta1, loaded.registration
    assert fields(v1, "Claim") == {"namespace": 1, "uid": 2, "name": 3}
    assert fields(v1, "Device") == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    }
    assert fields(v1beta1, "Device") == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
    }
    for mod in (v1, v1beta1):
        assert fields(mod, "NodePrepareResourceResponse") == {"devices": 1, "error": 2}
        assert fields(mod, "NodeUnprepareResourceResponse") == {"error": 1}
        assert fields(mod, "NodePrepareResourcesRequest") == {"claims": 1}
        assert fields(mod, "NodePrepareResourcesResponse") == {"claims": 1}
        service = mod.DESCRIPTOR.services_by_name["DRAPlugin"]
        assert [m.name for m in service.methods] == ["NodePrepareResources", "NodeUnprepareResources"]
    assert fields(reg, "PluginInfo") == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    assert fields(reg, "RegistrationStatus") == {"plugin_registered": 1, "error": 2}
    assert [m.name for m in reg.DESCRIPTOR.services_by_name["Registration"].methods] == [
        "GetInfo",
        "NotifyRegistrationStatus",
    ]


def test_build_protos_is_idempotent() -> None:
    build_protos.build()
    stamp = build_protos.GENERATED_DIR / build_protos.STAMP_NAME
    before = stamp.stat().st_mtime_ns
    assert build_protos.build() is False
    assert stamp.stat().st_mtime_ns == before
    assert (build_protos.GENERATED_DIR / "dra_v1_pb2.pyi").is_file()
