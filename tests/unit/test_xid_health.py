"""XID classification, the devices an XID affects, how a slice shows them, and the watcher over simulated
NVML (agent/health/xid.py, agent/health/devices.py)."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry

from dynamig.agent.health.devices import CLEAR_ANNOTATION, CONDITION, DeviceHealth, Fault, XidWatcher
from dynamig.agent.health.xid import TAINT_KEY, Taint, affected_devices, classify, with_health
from dynamig.agent.publishing.gpu_status import GpuOutcome
from dynamig.kube.gpupartition import GpuPartition, GpuPartitionStatus
from dynamig.kube.slices import CONTENT_ANNOTATION, build_resource_slices

# (XID, critical, whole GPU): NVIDIA k8s-device-plugin's application XIDs are no device fault; every other one
# is; 79 and 95 take the whole GPU.
CLASSES = [
    (13, False, False),
    (31, False, False),
    (43, False, False),
    (45, False, False),
    (68, False, False),
    (48, True, False),
    (63, True, False),
    (64, True, False),
    (74, True, False),
    (79, True, True),
    (94, True, False),
    (95, True, True),
    (999, True, False),
    (12345, True, False),
]


@pytest.mark.parametrize(("xid", "critical", "whole"), CLASSES)
def test_classification(xid: int, critical: bool, whole: bool) -> None:
    kind = classify(xid)
    assert (kind.critical, kind.whole_gpu) == (critical, whole)
    assert kind.meaning


def test_an_ignored_xid_is_no_fault() -> None:
    assert classify(94).critical
    assert not classify(94, ignored={13, 94}).critical


INSTANCES = {1: "gpu0-1g10gb-s0", 2: "gpu0-3g40gb-s4"}
MAPPINGS = [
    ("MIG-scoped: that instance's device", 1, False, frozenset({"gpu0-1g10gb-s0"})),
    ("the other instance", 2, False, frozenset({"gpu0-3g40gb-s4"})),
    ("not attributed: the whole GPU", None, False, None),
    ("a whole-GPU XID attributed to an instance", 1, True, None),
    ("an instance no longer known: the whole GPU", 7, False, None),
]


@pytest.mark.parametrize(("case", "gi", "whole", "expected"), MAPPINGS, ids=[m[0] for m in MAPPINGS])
def test_mapping(case: str, gi: int | None, whole: bool, expected: frozenset[str] | None) -> None:
    assert affected_devices(0, gi, whole, INSTANCES) == expected


def _devices(*names: str) -> list[dict[str, Any]]:
    return [{"name": n, "attributes": {}} for n in names]


def _names(bodies: list[dict[str, Any]]) -> list[str]:
    return [d["name"] for b in bodies for d in b["spec"]["devices"]]


def test_taints_only_the_sick_device_and_its_slice_changes() -> None:
    bodies = build_resource_slices("n1", 1, _devices("gpu0-1g10gb-s0", "gpu0-1g10gb-s1", "gpu1-1g10gb-s0"))
    t = Taint(94, "2026-01-01T00:00:00Z")
    out = with_health(bodies, {"gpu0-1g10gb-s1": t}, {}, taints=True)
    tainted = {d["name"]: d.get("taints") for d in out[0]["spec"]["devices"]}
    assert tainted["gpu0-1g10gb-s1"] == [
        {"key": TAINT_KEY, "value": "94", "effect": "NoSchedule", "timeAdded": "2026-01-01T00:00:00Z"}
    ]
    assert tainted["gpu0-1g10gb-s0"] is None and tainted["gpu1-1g10gb-s0"] is None
    digest = out[0]["metadata"]["annotations"][CONTENT_ANNOTATION]
    assert digest != bodies[0]["metadata"]["annotations"][CONTENT_ANNOTATION]
    assert "taints" not in bodies[0]["spec"]["devices"][1]  # the input is untouched
    again = with_health(bodies, {"gpu0-1g10gb-s1": t}, {}, taints=True, effect="NoExecute")
    assert again[0]["spec"]["devices"][1]["taints"][0]["effect"] == "NoExecute"
    assert again[0]["metadata"]["annotations"][CONTENT_ANNOTATION] != digest


def test_a_whole_gpu_fault_takes_every_device_of_that_gpu_only() -> None:
    bodies = build_resource_slices("n1", 1, _devices("gpu1-1g10gb-s0", "gpu1-2g20gb-s2", "gpu10-1g10gb-s0"))
    out = with_health(bodies, {}, {1: Taint(79, "2026-01-01T00:00:00Z")}, taints=False)
    assert _names(out) == ["gpu10-1g10gb-s0"]


def test_withdrawal_keeps_booked_devices() -> None:
    bodies = build_resource_slices("n1", 1, _devices("gpu0-1g10gb-s0", "gpu0-1g10gb-s1"))
    t = Taint(48, "2026-01-01T00:00:00Z")
    out = with_health(bodies, {"gpu0-1g10gb-s0": t, "gpu0-1g10gb-s1": t}, {}, taints=False,
                      keep={"gpu0-1g10gb-s1"})  # fmt: skip
    assert _names(out) == ["gpu0-1g10gb-s1"]


def test_a_slice_over_the_taint_limit_withdraws_instead() -> None:
    names = [f"gpu0-d{i:03d}" for i in range(70)]
    bodies = build_resource_slices("n1", 1, _devices(*names))
    out = with_health(bodies, {}, {0: Taint(48, "2026-01-01T00:00:00Z")}, taints=True)
    assert _names(out) == []


def test_healthy_devices_leave_the_slices_as_they_are() -> None:
    bodies = build_resource_slices("n1", 1, _devices("gpu0-1g10gb-s0"))
    assert with_health(bodies, {}, {}, taints=True) == bodies


# --- DeviceHealth: resolution, clearing, the condition ------------------------------------------------


class _Gpu:
    def __init__(self, index: int, uuid: str) -> None:
        self.index, self.uuid = index, uuid


def _part(name: str, annotations: dict[str, str] | None = None) -> GpuPartition:
    return GpuPartition.model_validate({"metadata": {"name": name, "annotations": annotations or {}}})


def test_faults_resolve_clear_and_report() -> None:
    now = [1_800_000_000.0]
    health = DeviceHealth("n1", clock=lambda: now[0], clear_after_s=600)
    health.add(Fault("GPU-a", 94, "Contained ECC error", 1, 0, False, now[0]))
    gpus: Any = [_Gpu(0, "GPU-a")]
    parts = {"n1-gpu0": _part("n1-gpu0")}
    health.observe(gpus, {0: {1: "gpu0-1g10gb-s0"}}, parts)
    assert health.sick() == ({"gpu0-1g10gb-s0": Taint(94, "2027-01-15T08:00:00Z")}, {})
    outcome = GpuOutcome("n1-gpu0", status=GpuPartitionStatus())
    health.report(outcome, parts["n1-gpu0"])
    cond = outcome.status.condition(CONDITION) if outcome.status else None
    assert cond is not None and cond.status == "False" and "XID 94" in cond.message
    assert [e[1] for e in outcome.events] == ["CriticalXid"]
    again = GpuOutcome("n1-gpu0", status=GpuPartitionStatus())
    health.report(again, parts["n1-gpu0"])
    assert again.events == []  # one Event per fault

    now[0] += 300  # within the quiet period: still sick
    health.observe(gpus, {}, parts)
    assert health.sick()[0]
    now[0] += 301
    health.observe(gpus, {}, parts)
    assert health.sick() == ({}, {})
    cleared = GpuOutcome("n1-gpu0", status=GpuPartitionStatus())
    health.report(cleared, _part("n1-gpu0").model_copy(update={"status": outcome.status}))
    assert [e[1] for e in cleared.events] == ["XidCleared"]
    cond = cleared.status.condition(CONDITION) if cleared.status else None
    assert cond is not None and cond.status == "True"


def test_the_annotation_clears_faults_seen_before_it() -> None:
    health = DeviceHealth("n1", clock=lambda: 1_800_000_000.0)
    health.add(Fault("GPU-a", 48, "Double Bit ECC Error", None, None, False, 1_800_000_000.0))
    gpus: Any = [_Gpu(0, "GPU-a")]
    health.observe(gpus, {}, {"n1-gpu0": _part("n1-gpu0", {CLEAR_ANNOTATION: "2027-01-15T07:59:00Z"})})
    assert health.sick() == ({}, {0: Taint(48, "2027-01-15T08:00:00Z")})  # the mark is older
    health.observe(gpus, {}, {"n1-gpu0": _part("n1-gpu0", {CLEAR_ANNOTATION: "2027-01-15T08:00:05Z"})})
    assert health.sick() == ({}, {})


def test_a_gpu_without_faults_gets_no_condition() -> None:
    health = DeviceHealth("n1")
    outcome = GpuOutcome("n1-gpu0", status=GpuPartitionStatus())
    health.report(outcome, _part("n1-gpu0"))
    assert outcome.status is not None and outcome.status.condition(CONDITION) is None


def test_an_unknown_effect_is_refused() -> None:
    with pytest.raises(ValueError, match="NoSchedule"):
        DeviceHealth("n1", effect="PreferNoSchedule")


# --- the watcher over the simulated NVML -----------------------------------------------------------------


@pytest.fixture
def nvml(sim: ModuleType) -> Iterator[ModuleType]:
    sim.configure(["A100-40GB"], state_file=None)
    sim.nvmlInit()
    yield sim
    sim.nvmlShutdown()


def _wait_for(check: Any, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_watcher_records_critical_xids_and_counts_every_one(nvml: ModuleType) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    placement = pynvml.c_nvmlGpuInstancePlacement_t()
    placement.start, placement.size = 0, 1
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, ctypes.byref(placement))
    nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    gi_id = nvml.nvmlGpuInstanceGetInfo(gi).id
    woken: list[int] = []
    health = DeviceHealth("n1", on_fault=lambda: woken.append(1))
    registry = CollectorRegistry()
    watcher = XidWatcher(nvml, health, registry)
    watcher.start()
    try:
        _wait_for(watcher.registered.is_set)
        nvml.inject_xid(0, 31, gi_id=gi_id, ci_id=0)  # an application error
        nvml.inject_xid(0, 94, gi_id=gi_id, ci_id=0)
        _wait_for(lambda: len(health.faults()) == 1)
    finally:
        watcher.stop()
    fault = health.faults()[0]
    assert (fault.xid, fault.gi_id, fault.ci_id, fault.whole_gpu) == (94, gi_id, 0, False)
    assert woken == [1]
    uuid = nvml.nvmlDeviceGetUUID(h)

    def count(xid: str, critical: str) -> float | None:
        labels = {"Hostname": "n1", "gpu": "0", "UUID": uuid, "GPU_I_ID": str(gi_id), "xid": xid,
                  "critical": critical}  # fmt: skip
        return registry.get_sample_value("dynamig_xid_errors_total", labels)

    assert count("31", "false") == 1.0 and count("94", "true") == 1.0


def test_a_gpu_partition_naming_an_effect_overrides_the_agents_for_that_gpu_only() -> None:
    """The operator writes the policy's spec.health.xidEffect to GpuPartition spec.xidEffect: a fault on that
    GPU is tainted with it (in the slice, its content digest and the Event), the other GPU's with the
    agent's own --xid-effect."""
    at = 1_800_000_000.0
    health = DeviceHealth("n1", clock=lambda: at)  # the agent's effect: NoSchedule
    health.add(Fault("GPU-a", 94, "Contained ECC error", 1, 0, False, at))
    health.add(Fault("GPU-b", 94, "Contained ECC error", 1, 0, False, at))
    gpus: Any = [_Gpu(0, "GPU-a"), _Gpu(1, "GPU-b")]
    parts = {
        "n1-gpu0": GpuPartition.model_validate(
            {"metadata": {"name": "n1-gpu0"}, "spec": {"xidEffect": "NoExecute"}}
        ),
        "n1-gpu1": _part("n1-gpu1"),
    }
    health.observe(gpus, {0: {1: "gpu0-1g10gb-s0"}, 1: {1: "gpu1-1g10gb-s0"}}, parts)
    health.taints_served = True
    body = build_resource_slices("n1", 1, _devices("gpu0-1g10gb-s0", "gpu1-1g10gb-s0"))
    (tainted,) = health.apply(body, keep=())
    effects = {d["name"]: d["taints"][0]["effect"] for d in tainted["spec"]["devices"]}
    assert effects == {"gpu0-1g10gb-s0": "NoExecute", "gpu1-1g10gb-s0": "NoSchedule"}
    for name, effect in (("n1-gpu0", "NoExecute"), ("n1-gpu1", "NoSchedule")):
        outcome = GpuOutcome(name, status=GpuPartitionStatus())
        health.report(outcome, parts[name])
        (message,) = [e[2] for e in outcome.events if e[1] == "CriticalXid"]
        assert f"tainted {effect}" in message, message
    # The field gone again (the policy no longer sets it): the agent's effect.
    health.observe(gpus, {}, {"n1-gpu0": _part("n1-gpu0"), "n1-gpu1": _part("n1-gpu1")})
    (again,) = health.apply(body, keep=())
    assert {d["taints"][0]["effect"] for d in again["spec"]["devices"]} == {"NoSchedule"}
    assert (
        again["metadata"]["annotations"][CONTENT_ANNOTATION]
        != tainted["metadata"]["annotations"][CONTENT_ANNOTATION]
    )  # a changed effect is a changed slice: published again
