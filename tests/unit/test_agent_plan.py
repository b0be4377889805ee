"""The agent's pure parts: reshape plan, ResourceSlice builder, ownership rules, GpuPartition model, which API
errors are retried, which devices claims hold.

Everything here is plain values: the H100-80GB and A100-40GB geometry from the real catalog, no NVML, no API.
The reshape-protocol invariants are also checked with hypothesis over valid layouts of the catalog model.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.agent.kube.api import allocated_devices
from dynamig.agent.layout.reconcile import Observed, plan_gpu
from dynamig.agent.main import parse_simulated_gpus
from dynamig.agent.publishing.ownership import foreign_mig_owners, node_is_managed, node_mig_owner
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import enumerate_layouts, parse_layout
from dynamig.geometry.model import PlacedInstance
from dynamig.kube.apicalls import is_transient
from dynamig.kube.devices import MigDevice
from dynamig.kube.gpupartition import (
    GpuPartitionStatus,
    InstanceStatus,
    layout_summary,
    parse_gpu_partition,
    set_condition,
)
from dynamig.kube.slices import CONTENT_ANNOTATION, MAX_DEVICES_PER_SLICE, build_resource_slices, content_hash

CATALOG = load_catalog()
H100 = CATALOG.model("H100-80GB")
LAYOUTS = list(enumerate_layouts(H100, ["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"]))


def obs(text: str, busy: str = "") -> tuple[Observed, ...]:
    """Observed instances from ``"1g.10gb@0,2g.20gb@2"``; those listed in ``busy`` hold a claim."""
    held = set(parse_layout(busy)) if busy else set()
    return tuple(Observed(p, claims=("ns/c",) if p in held else ()) for p in parse_layout(text))


def test_unchanged_layout_publishes_everything_and_converges() -> None:
    plan = plan_gpu(H100, parse_layout("3g.40gb@0,3g.40gb@4"), obs("3g.40gb@0,3g.40gb@4"), {}, 0.0, 5.0)
    assert plan.violation is None
    assert plan.publish == parse_layout("3g.40gb@0,3g.40gb@4")
    assert plan.converged and not plan.acts


def test_removal_waits_for_settle_period_then_destroys() -> None:
    desired = parse_layout("1g.10gb@4,1g.10gb@5,1g.10gb@6,3g.40gb@0")
    existing = obs("3g.40gb@0,3g.40gb@4")
    gone = PlacedInstance(4, "3g.40gb")
    # Round 1: the instance leaves the slice; its settle period has not begun.
    first = plan_gpu(H100, desired, existing, {}, 100.0, 5.0)
    assert first.publish == parse_layout("3g.40gb@0")
    assert first.destroy == () and [w.placed for w in first.draining] == [gone]
    assert [w.placed for w in first.blocked] == list(parse_layout("1g.10gb@4,1g.10gb@5,1g.10gb@6"))
    # Still settling.
    mid = plan_gpu(H100, desired, existing, {gone: 100.0}, 103.0, 5.0)
    assert mid.destroy == () and mid.draining
    # Settled: destroy, and the new instances fit in the freed slices in the same round.
    done = plan_gpu(H100, desired, existing, {gone: 100.0}, 105.5, 5.0)
    assert done.destroy == (gone,)
    assert done.create == parse_layout("1g.10gb@4,1g.10gb@5,1g.10gb@6")


def test_busy_instance_is_kept_and_blocks_what_overlaps_it() -> None:
    desired = parse_layout("7g.80gb@0")
    plan = plan_gpu(
        H100,
        desired,
        obs("1g.10gb@0,1g.10gb@1", busy="1g.10gb@1"),
        {PlacedInstance(0, "1g.10gb"): 0.0, PlacedInstance(1, "1g.10gb"): 0.0},
        100.0,
        1.0,
    )
    assert plan.destroy == (PlacedInstance(0, "1g.10gb"),)
    assert [w.placed for w in plan.kept_busy] == [PlacedInstance(1, "1g.10gb")]
    assert "ns/c" in plan.kept_busy[0].reason
    assert plan.create == () and [w.placed for w in plan.blocked] == [PlacedInstance(0, "7g.80gb")]
    assert plan.publish == ()  # the kept instance is not offered again


def test_processes_make_an_instance_busy() -> None:
    observed = (Observed(PlacedInstance(0, "7g.80gb"), processes=2),)
    plan = plan_gpu(H100, (), observed, {PlacedInstance(0, "7g.80gb"): 0.0}, 100.0, 0.0)
    assert plan.destroy == () and "2 process" in plan.kept_busy[0].reason


def test_invalid_layout_touches_nothing() -> None:
    existing = obs("3g.40gb@0,3g.40gb@4")
    plan = plan_gpu(H100, parse_layout("3g.40gb@0,1g.10gb@3"), existing, {}, 0.0, 0.0)
    assert plan.violation is not None and "1g.10gb@3" in plan.violation
    assert not plan.acts and plan.publish == parse_layout("3g.40gb@0,3g.40gb@4")
    unknown = plan_gpu(H100, parse_layout("9g.99gb@0"), existing, {}, 0.0, 0.0)
    assert unknown.violation is not None and not unknown.acts


def test_half_made_instance_is_completed_when_desired_and_destroyed_otherwise() -> None:
    half = (Observed(PlacedInstance(0, "3g.40gb"), has_compute_instance=False),)
    keep = plan_gpu(H100, parse_layout("3g.40gb@0"), half, {}, 0.0, 60.0)
    assert keep.complete == parse_layout("3g.40gb@0") and keep.publish == ()
    drop = plan_gpu(H100, (), half, {}, 0.0, 60.0)
    assert drop.destroy == parse_layout("3g.40gb@0")  # never published: no settle period needed


@settings(max_examples=60, deadline=None)
@given(
    current=st.sampled_from(LAYOUTS),
    desired=st.sampled_from(LAYOUTS),
    busy_bits=st.integers(min_value=0, max_value=255),
    quiet_bits=st.integers(min_value=0, max_value=255),
)
def test_plan_never_destroys_busy_and_never_overlaps(
    current: tuple[PlacedInstance, ...], desired: tuple[PlacedInstance, ...], busy_bits: int, quiet_bits: int
) -> None:
    observed = tuple(
        Observed(p, claims=("ns/x",) if busy_bits >> i & 1 else ()) for i, p in enumerate(current)
    )
    quiet = {p: 0.0 for i, p in enumerate(current) if quiet_bits >> i & 1}
    plan = plan_gpu(H100, desired, observed, quiet, 10.0, 5.0)
    busy = {o.placed for o in observed if o.busy}
    assert not busy & set(plan.destroy)
    assert set(plan.destroy) <= set(current) - set(desired)
    assert set(plan.publish) <= set(current) & set(desired)
    # After the destroys, existing instances plus creations never share a memory slice.
    after = [p for p in current if p not in plan.destroy] + list(plan.create)
    used: set[int] = set()
    for p in after:
        span = set(H100.profile(p.profile).span(p.start))
        assert not used & span, (current, desired, plan)
        used |= span
    # Only instances that were quiet for the settle period are destroyed.
    assert all(p in quiet for p in plan.destroy)


def test_slices_split_at_128_devices_and_carry_pool_metadata() -> None:
    profile = H100.profile("1g.10gb")
    devices = [
        MigDevice(g, profile, s, "NVIDIA H100 80GB HBM3", f"GPU-{g}").to_api()
        for g in range(40)
        for s in range(7)
    ]  # 280 devices
    slices = build_resource_slices("node-a", 7, devices)
    assert [len(s["spec"]["devices"]) for s in slices] == [MAX_DEVICES_PER_SLICE, MAX_DEVICES_PER_SLICE, 24]
    for s in slices:
        assert s["spec"]["driver"] == "mig.dynamig.io" and s["spec"]["nodeName"] == "node-a"
        assert s["spec"]["pool"] == {"name": "node-a", "generation": 7, "resourceSliceCount": 3}
        assert s["metadata"]["annotations"][CONTENT_ANNOTATION] == content_hash(s["spec"]["devices"])
    names = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert names == sorted(names) and len(set(names)) == 280
    empty = build_resource_slices("node-a", 1, [])
    assert len(empty) == 1 and empty[0]["spec"]["devices"] == []
    # Same inventory in another order: same slices.
    assert build_resource_slices("node-a", 7, list(reversed(devices))) == slices


def test_ownership_rules() -> None:
    assert node_is_managed({"dynamig.io/managed": "true"})
    assert not node_is_managed({"dynamig.io/managed": "false"}) and not node_is_managed({})
    assert node_mig_owner({"nvidia.com/mig.config": "all-1g.10gb"}) is not None
    assert node_mig_owner({}) is None
    # The NVIDIA device plugin's resources, whole GPUs or MIG devices; zero means it is off for the node.
    mig_plugin = node_mig_owner({}, {"cpu": "8", "nvidia.com/mig-1g.10gb": "7"})
    assert mig_plugin is not None and "nvidia.com/mig-1g.10gb=7" in mig_plugin
    assert node_mig_owner({}, {"nvidia.com/gpu": "0", "example.com/gpu": "2"}) is None
    nvidia_slice = {
        "spec": {
            "driver": "gpu.nvidia.com",
            "devices": [
                {
                    "name": "gpu-0-mig-1",
                    "attributes": {"type": {"string": "mig"}, "parentUUID": {"string": "GPU-A"}},
                },
            ],
        }
    }
    ours = {
        "spec": {
            "driver": "mig.dynamig.io",
            "devices": [
                {"name": "gpu1-1g10gb-s0", "attributes": {"mig.dynamig.io/parentUUID": {"string": "GPU-B"}}},
            ],
        }
    }
    assert foreign_mig_owners([nvidia_slice, ours], ["GPU-A", "GPU-B"]) == {"GPU-A": "gpu.nvidia.com"}


def test_gpu_partition_model_round_trip_and_conditions() -> None:
    obj = {
        "apiVersion": "dynamig.io/v1alpha1",
        "kind": "GpuPartition",
        "metadata": {"name": "n-gpu0", "generation": 3},
        "spec": {"layout": [{"profile": "3g.40gb", "start": 4}, {"profile": "3g.40gb", "start": 0}]},
    }
    part = parse_gpu_partition(obj)
    assert part.spec.desired() == parse_layout("3g.40gb@0,3g.40gb@4")
    assert part.status.phase is None
    inst = InstanceStatus(profile="3g.40gb", start=0, device_name="gpu0-3g40gb-s0", mig_uuid="MIG-x")
    status = GpuPartitionStatus(instances=[inst])
    wire = status.to_api()
    assert wire["instances"][0]["migUUID"] == "MIG-x"
    assert wire["instances"][0]["deviceName"] == "gpu0-3g40gb-s0"
    assert GpuPartitionStatus.model_validate(wire) == status
    conds = set_condition([], "Ready", True, "LayoutApplied", "ok", 3, "2026-01-01T00:00:00Z")
    same = set_condition(conds, "Ready", True, "LayoutApplied", "still ok", 4, "2026-01-02T00:00:00Z")
    assert same[0].last_transition_time == "2026-01-01T00:00:00Z" and same[0].message == "still ok"
    flipped = set_condition(same, "Ready", False, "Draining", "x", 4, "2026-01-03T00:00:00Z")
    assert flipped[0].last_transition_time == "2026-01-03T00:00:00Z" and flipped[0].status == "False"
    assert layout_summary([]) == "-"
    assert layout_summary(parse_layout("3g.40gb@4,1g.10gb@0")) == "1g.10gb@0,3g.40gb@4"


def test_parse_simulated_gpus() -> None:
    assert parse_simulated_gpus("H100-80GB:2,A100-40GB:1") == ("H100-80GB", "H100-80GB", "A100-40GB")
    assert parse_simulated_gpus("A30-24GB") == ("A30-24GB",)
    with pytest.raises(ValueError):
        parse_simulated_gpus("H100-80GB:x")


def test_transient_api_errors_are_the_retryable_ones() -> None:
    assert is_transient(ApiException(status=503)) and is_transient(ApiException(status=429))
    assert is_transient(aiohttp.ClientConnectionError()) and is_transient(TimeoutError())
    assert not is_transient(ApiException(status=404)) and not is_transient(ApiException(status=409))
    assert not is_transient(ApiException(status=422)) and not is_transient(ValueError("x"))


def test_allocated_devices_keeps_only_this_driver_and_pool() -> None:
    def claim(ns: str, name: str, *results: tuple[str, str, str]) -> dict[str, Any]:
        rows = [{"request": "gpu", "driver": d, "pool": p, "device": dev} for d, p, dev in results]
        return {
            "metadata": {"namespace": ns, "name": name},
            "status": {"allocation": {"devices": {"results": rows}}},
        }

    mine = "mig.dynamig.io"

    claims = [
        claim("a", "one", (mine, "n1", "gpu0-1g10gb-s0")),
        claim("b", "two", (mine, "n2", "gpu0-1g10gb-s0"), ("gpu.nvidia.com", "n1", "gpu-0")),
        claim("c", "three", (mine, "n1", "gpu1-7g80gb-s0"), (mine, "n1", "gpu0-1g10gb-s0")),
        {"metadata": {"namespace": "d", "name": "pending"}, "status": {}},
    ]
    assert allocated_devices(claims, "mig.dynamig.io", "n1") == {
        "gpu0-1g10gb-s0": ["a/one", "c/three"],
        "gpu1-7g80gb-s0": ["c/three"],
    }


@pytest.mark.parametrize("desired", ["", "3g.40gb@0", "7g.80gb@0"])
def test_a_gpu_instance_split_outside_dynamig_is_never_published_completed_or_destroyed(desired: str) -> None:
    split = Observed(PlacedInstance(0, "3g.40gb"), partitioned="2 compute instance(s) (1c, 1c of 3)")
    plan = plan_gpu(H100, parse_layout(desired), (split,), {split.placed: 0.0}, 1e9, 5.0)
    assert split.busy and "outside dynamig" in split.busy_reason()
    assert plan.publish == () and plan.destroy == () and plan.complete == ()
    assert [w.placed for w in plan.kept_busy] == [split.placed]
    if desired == "7g.80gb@0":  # what overlaps it waits for it
        assert plan.create == () and [w.placed for w in plan.blocked] == [PlacedInstance(0, "7g.80gb")]
