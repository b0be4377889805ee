"""A GPU with MIG mode off served whole: its device, status, slices and CDI spec. Pure functions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from dynamig.agent.devices_service import whole_prepared, whole_refusal
from dynamig.agent.health.xid import Taint, with_health
from dynamig.agent.metrics import AgentMetrics, GpuSample
from dynamig.agent.modes.whole import whole_outcome
from dynamig.agent.nvml.device import GpuInfo, WholeGpu
from dynamig.agent.plugin import cdi
from dynamig.agent.plugin.cdi_validation import check_spec
from dynamig.agent.publishing.ownership import foreign_mig_owners
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.devices import WholeGpuDevice
from dynamig.kube.gpupartition import (
    ConditionType,
    GpuPartition,
    GpuPartitionStatus,
    InstanceState,
    Inventory,
    Phase,
    Reason,
    WholeGpuStatus,
)
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY, GpuInventory, build_inventory_slices
from dynamig.kube.names import whole_device_index, whole_device_name
from dynamig.kube.slices import build_resource_slices

MODEL = load_catalog().model("H100-80GB")
STAMP = "2026-12-06T08:00:00Z"
UUID = "GPU-0a1b"


def gpu(mig: int = 0, pending: int | None = None) -> GpuInfo:
    return GpuInfo(
        0, UUID, "NVIDIA H100 80GB HBM3", 0x2330, 0, mig, mig if pending is None else pending, MODEL
    )


def whole(processes: int = 0) -> WholeGpu:
    return WholeGpu(WholeGpuDevice(0, "NVIDIA H100 80GB HBM3", UUID, 80 << 30, "Hopper", "9.0"), processes)


def partition(
    layout: list[dict[str, Any]] | None = None, holds: list[dict[str, Any]] | None = None
) -> GpuPartition:
    spec = {"layout": layout or [], "holds": holds or []}
    return GpuPartition.model_validate(
        {"metadata": {"name": "n1-gpu0", "generation": 2}, "spec": spec, "status": {}}
    )


def outcome(processes: int = 0, claims: dict[str, list[str]] | None = None, prepared: set[str] | None = None,
            layout: list[dict[str, Any]] | None = None) -> Any:  # fmt: skip
    return whole_outcome(
        "n1", Inventory.PARTITIONABLE, gpu(), partition(layout), whole(processes), claims or {},
        prepared or set(), STAMP,
    )  # fmt: skip


def test_names() -> None:
    assert whole_device_name(3) == "gpu3" and whole_device_index("gpu3") == 3
    for other in ("gpu3-1g10gb-s0", "gpu", "gpu03", "gpux", "cpu0"):
        assert whole_device_index(other) is None, other


def test_the_device_says_whole_and_carries_nvmls_facts() -> None:
    body = whole().device.to_api()
    assert body["name"] == "gpu0"
    attrs = body["attributes"]
    assert attrs["mig.dynamig.io/profile"] == {"string": "whole"}
    assert attrs["mig.dynamig.io/uuid"] == {"string": UUID}
    assert attrs["mig.dynamig.io/gpuIndex"] == {"int": 0}
    assert attrs["mig.dynamig.io/architecture"] == {"string": "Hopper"}
    assert attrs["mig.dynamig.io/cudaComputeCapability"] == {"string": "9.0"}
    assert body["capacity"] == {"mig.dynamig.io/memory": {"value": str(80 << 30)}}
    assert "consumesCounters" not in body and "bindingConditions" not in body
    # Facts NVML did not give are left out rather than published empty.
    bare = WholeGpuDevice(1, "NVIDIA H100 80GB HBM3", "GPU-x").to_api()
    assert set(bare["attributes"]) == {
        f"mig.dynamig.io/{k}" for k in ("profile", "productName", "gpuIndex", "uuid")
    }
    assert bare["capacity"] == {}


def test_a_free_whole_gpu_is_published_and_ready() -> None:
    o = outcome()
    assert o.whole is not None and o.whole["name"] == "gpu0"
    st = o.status
    assert st.whole_gpu == WholeGpuStatus(device_name="gpu0", state=InstanceState.FREE)
    assert (st.layout_summary, st.free_slices, st.total_slices, st.phase) == ("whole", 1, 1, Phase.STABLE)
    assert st.mig_mode == "Disabled" and st.instances == []
    ready = st.condition(ConditionType.READY)
    assert ready is not None and ready.is_true and ready.reason == Reason.WHOLE_GPU
    managed = st.condition(ConditionType.MANAGED)
    assert managed is not None and managed.is_true


def test_allocated_and_prepared_stay_published() -> None:
    allocated = outcome(claims={"gpu0": ["ns/a"]})
    assert allocated.whole is not None
    assert allocated.status.whole_gpu.state == InstanceState.ALLOCATED
    assert allocated.status.whole_gpu.claims == ["ns/a"] and allocated.status.free_slices == 0
    used = outcome(processes=2, claims={"gpu0": ["ns/a"]}, prepared={"gpu0"})
    assert used.whole is not None and used.status.whole_gpu.state == InstanceState.IN_USE


def test_processes_outside_dra_withdraw_the_device() -> None:
    o = outcome(processes=1)
    assert o.whole is None
    assert o.status.whole_gpu.published is False and o.status.whole_gpu.state == InstanceState.IN_USE
    ready = o.status.condition(ConditionType.READY)
    assert ready is not None and not ready.is_true and ready.reason == Reason.INSTANCE_BUSY
    assert "outside DRA" in ready.message


def test_a_layout_on_a_mig_off_gpu_is_refused_by_name() -> None:
    o = outcome(layout=[{"profile": "7g.80gb", "start": 0}])
    valid = o.status.condition(ConditionType.LAYOUT_VALID)
    assert valid is not None and not valid.is_true and valid.reason == Reason.MIG_DISABLED
    assert o.whole is not None  # still served whole: the layout changes nothing


def test_the_status_patch_removes_whole_gpu_once_mig_is_on() -> None:
    assert GpuPartitionStatus().to_api()["wholeGpu"] is None  # a merge patch deletes it
    on = GpuPartitionStatus(whole_gpu=WholeGpuStatus(device_name="gpu0")).to_api()
    assert on["wholeGpu"]["deviceName"] == "gpu0"


def test_whole_devices_follow_the_counter_slices_in_the_partitionable_inventory() -> None:
    mig = GpuInventory(1, MODEL, "GPU-1", allowed_profiles=frozenset({"7g.80gb"}))
    slices = build_inventory_slices("n1", 4, [mig], whole=[whole().device.to_api()])
    device_slices = [s for s in slices if s["spec"].get("devices") is not None]
    names = [d["name"] for s in device_slices for d in s["spec"]["devices"]]
    assert names[-1] == "gpu0" and "gpu1-7g80gb-s0" in names
    assert all(s["spec"]["pool"]["resourceSliceCount"] == len(slices) for s in slices)
    # Only a whole GPU: no counter set at all, one device slice.
    alone = build_inventory_slices("n1", 1, [], whole=[whole().device.to_api()])
    assert [list(s["spec"]) for s in alone] == [["driver", "nodeName", "pool", "devices"]]
    assert (
        build_resource_slices("n1", 1, [whole().device.to_api()])[0]["spec"]["devices"][0]["name"] == "gpu0"
    )


def test_another_driver_publishing_the_gpu_itself_owns_it() -> None:
    foreign = {"spec": {"driver": "gpu.nvidia.com", "devices": [
        {"name": "gpu-0", "attributes": {"uuid": {"string": UUID}, "type": {"string": "gpu"}}}
    ]}}  # fmt: skip
    assert foreign_mig_owners([foreign], [UUID, "GPU-other"]) == {UUID: "gpu.nvidia.com"}
    ours = {"spec": {"driver": "mig.dynamig.io", "devices": [whole().device.to_api()]}}
    assert foreign_mig_owners([ours], [UUID]) == {}


def test_prepared_whole_gpu_and_its_refusal() -> None:
    inst = whole_prepared("gpu0", gpu())
    assert inst.whole_gpu and inst.parent_uuid == UUID and (inst.gi_id, inst.ci_id) == (-1, -1)
    assert whole_refusal("gpu0", gpu()) is None
    assert "MIG mode is on" in (whole_refusal("gpu0", gpu(mig=1)) or "")
    assert "changing" in (whole_refusal("gpu0", gpu(mig=0, pending=1)) or "")


def test_a_whole_gpus_cdi_spec_is_its_one_node_and_valid_cdi(tmp_path: Path) -> None:
    inst = whole_prepared("gpu0", gpu())
    assert cdi.read_capability_minors(tmp_path, inst) is None  # no procfs read: it has no capabilities
    spec = cdi.build_spec("uid-1", [cdi.CdiDevice(inst, None, (UUID, "GPU-9"))], Path("/dev"), None)
    [dev] = spec["devices"]
    assert dev["containerEdits"]["env"] == [f"DYNAMIG_GPU_UUIDS={UUID},GPU-9"]
    assert dev["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0"}]
    check_spec(spec, "whole-GPU spec")  # the CDI schema and the CDI library's own checks


def test_metrics_show_each_gpus_mode_and_the_whole_gpus_state() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, "n1")
    metrics.snapshot(
        (),
        (GpuSample(0, UUID, "Stable", "Disabled", "allocated"), GpuSample(1, "GPU-1", "Stable", "Enabled")),
    )
    text = generate_latest(registry).decode()
    assert 'dynamig_gpu_mig_mode{Hostname="n1",UUID="GPU-0a1b",gpu="0",mode="Disabled"} 1.0' in text
    assert 'dynamig_gpu_mig_mode{Hostname="n1",UUID="GPU-1",gpu="1",mode="Enabled"} 1.0' in text
    assert 'dynamig_whole_gpus{Hostname="n1",UUID="GPU-0a1b",gpu="0",state="allocated"} 1.0' in text
    assert 'dynamig_whole_gpus{Hostname="n1",UUID="GPU-1"' not in text  # MIG on: no whole GPU


def test_an_xid_on_a_gpu_with_mig_off_taints_its_whole_device() -> None:
    body = build_resource_slices(
        "n1", 1, [whole().device.to_api(), WholeGpuDevice(1, "H100", "GPU-1").to_api()]
    )
    (tainted,) = with_health(body, {}, {0: Taint(48, STAMP)}, taints=True)
    devices = {d["name"]: d for d in tainted["spec"]["devices"]}
    assert devices["gpu0"]["taints"] == [
        {"key": "mig.dynamig.io/xid", "value": "48", "effect": "NoSchedule", "timeAdded": STAMP}
    ]
    assert "taints" not in devices["gpu1"]
    (withdrawn,) = with_health(body, {}, {0: Taint(48, STAMP)}, taints=False)
    assert [d["name"] for d in withdrawn["spec"]["devices"]] == ["gpu1"]


def _held(claim: str = "ml/train", until: str = "2099-01-01T00:00:00Z") -> dict[str, Any]:
    return {"claim": claim, "kind": "Whole", "profile": "whole", "start": 0, "expiresAt": until}


def test_a_whole_gpu_kept_for_a_claim_is_published_guarded_and_only_that_claim_is_answered_ready() -> None:
    """A hold of the whole GPU (profile ``whole``): the device carries binding conditions where the API
    server keeps them, the status shows the hold, and the answers: ready with the GPU's UUID for the claim
    it is kept for, failed (``PlacementHeld``) for any other; an expired hold or one the API cannot carry
    keeps nothing."""
    from dynamig.agent.bindings.decide import (
        REASON_MIG_ENABLED,
        Failed,
        GpuState,
        Ready,
        decide,
        device_status,
    )
    from dynamig.agent.bindings.holds import REASON_PLACEMENT_HELD, whole_hold
    from dynamig.kube.gpupartition import Hold, HoldKind

    part = partition(holds=[_held()])
    now = 1_900_000_000.0

    def run(inventory: Inventory, part: GpuPartition) -> tuple[dict[str, Any], GpuPartitionStatus]:
        out = whole_outcome("n1", inventory, gpu(), part, whole(), {}, set(), STAMP, now)
        assert out.whole is not None and out.status is not None
        return out.whole, out.status

    device, status = run(Inventory.PARTITIONABLE, part)
    assert device["bindingConditions"] == [BINDING_READY]
    assert device["bindingFailureConditions"] == [BINDING_FAILED]
    assert [(h.claim, h.kind) for h in status.holds] == [("ml/train", HoldKind.WHOLE)]
    ready_cond = status.condition(ConditionType.READY)
    assert ready_cond is not None and "kept for claim ml/train" in ready_cond.message
    # The API keeps no binding conditions (instances only): published as before, nothing kept.
    device, status = run(Inventory.INSTANCES, part)
    assert "bindingConditions" not in device and status.holds == []
    # Expired: nothing kept.
    part = partition(holds=[_held(until="2020-01-01T00:00:00Z")])
    device, status = run(Inventory.PARTITIONABLE, part)
    assert "bindingConditions" not in device and status.holds == []
    assert whole_hold(part.spec.holds) is not None and whole_hold(()) is None

    hold = Hold.model_validate(_held())
    state = GpuState(
        0, MODEL, False, refused=(Reason.MIG_DISABLED, "MIG mode is off"), uuid=UUID, whole_hold=hold
    )
    ready = decide("gpu0", "ml/train", [state])
    assert isinstance(ready, Ready) and ready.whole and ready.mig_uuid == UUID
    entry = device_status("mig.dynamig.io", "n1", "gpu0", ready, "dynamig.io/ready", "x", STAMP, 1)
    assert (
        entry["data"] == {"uuid": UUID, "profile": "whole"}
        and "whole GPU" in entry["conditions"][0]["message"]
    )
    other = decide("gpu0", "ml/infer", [state])
    assert isinstance(other, Failed) and other.reason == REASON_PLACEMENT_HELD and "ml/train" in other.message
    free = decide("gpu0", "ml/infer", [GpuState(0, MODEL, False, uuid=UUID)])
    assert isinstance(free, Ready) and free.mig_uuid == UUID
    mig_on = decide("gpu0", "ml/train", [GpuState(0, MODEL, True, uuid=UUID)])
    assert isinstance(mig_on, Failed) and mig_on.reason == REASON_MIG_ENABLED
    switching = GpuState(0, MODEL, False, refused=(Reason.MIG_MODE_DRAINING, "being switched"), uuid=UUID)
    assert isinstance(decide("gpu0", "ml/train", [switching]), Failed)
    assert isinstance(decide("gpu5", "ml/train", [state]), Failed)
