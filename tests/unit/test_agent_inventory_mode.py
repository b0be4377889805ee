"""The agent under the partitionable inventory: ``spec.layout`` as a floor, and how the API server's answers
to the feature probe choose the inventory. Pure values: the H100-80GB geometry of the real catalog, no API.

The probe's premise (an API server whose feature gate is off drops the gated fields on write rather than
rejecting them) is checked against a real API server in tests/integration/test_partitionable_apiserver.py.
"""

from __future__ import annotations

import copy
from typing import Any

from dynamig.agent.layout.reconcile import Observed, plan_gpu
from dynamig.agent.publishing.features import InventorySupport, carried, judge, parse_version, probe_slices
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import parse_layout
from dynamig.geometry.model import PlacedInstance
from dynamig.kube.gpupartition import Inventory

H100 = load_catalog().model("H100-80GB")


def obs(text: str, busy: str = "", processes: str = "") -> tuple[Observed, ...]:
    held = set(parse_layout(busy)) if busy else set()
    running = set(parse_layout(processes)) if processes else set()
    return tuple(
        Observed(p, claims=("ns/c",) if p in held else (), processes=1 if p in running else 0)
        for p in parse_layout(text)
    )


def keep(desired: str, observed: tuple[Observed, ...]) -> Any:
    return plan_gpu(H100, parse_layout(desired), observed, {}, 0.0, 5.0, keep_undesired=True)


def test_instances_outside_the_layout_stay_and_free_ones_stay_published() -> None:
    # Cut for allocations earlier: 1g@0 (allocated) and 1g@1 (free again); the floor is 3g@4.
    plan = keep("3g.40gb@4", obs("1g.10gb@0,1g.10gb@1,3g.40gb@4", busy="1g.10gb@0"))
    assert plan.destroy == () and plan.create == () and plan.draining == () and plan.kept_busy == ()
    assert plan.publish == parse_layout("1g.10gb@1,3g.40gb@4")  # the allocated one is the inventory's job
    assert plan.converged


def test_without_keep_the_same_leftovers_would_drain() -> None:
    plan = plan_gpu(H100, parse_layout("3g.40gb@4"), obs("1g.10gb@0,1g.10gb@1,3g.40gb@4"), {}, 0.0, 5.0)
    assert {w.placed for w in plan.draining} == set(parse_layout("1g.10gb@0,1g.10gb@1"))


def test_a_missing_floor_instance_retires_free_leftovers_in_its_way_then_destroys_them() -> None:
    # Warm pool wants 3g@0; free 1g@0 and 1g@2 lie under it. They were bookable without binding conditions,
    # so this round only retires them (the agent republishes them guarded); the floor waits for them.
    observed = obs("1g.10gb@0,1g.10gb@2,1g.10gb@5")
    plan = keep("3g.40gb@0", observed)
    assert plan.destroy == () and plan.create == ()
    assert {w.placed for w in plan.draining} == set(parse_layout("1g.10gb@0,1g.10gb@2"))
    assert all("published guarded" in w.reason for w in plan.draining)
    assert [w.placed for w in plan.blocked] == [PlacedInstance(0, "3g.40gb")]
    assert plan.publish == parse_layout("1g.10gb@5")
    # Guarded for the settle period: destroyed, and the floor instance is created in the same round.
    guarded = {p: 0.0 for p in parse_layout("1g.10gb@0,1g.10gb@2")}
    later = plan_gpu(H100, parse_layout("3g.40gb@0"), observed, guarded, 5.0, 5.0, keep_undesired=True)
    assert later.destroy == parse_layout("1g.10gb@0,1g.10gb@2")
    assert later.create == parse_layout("3g.40gb@0")
    # One guarded too briefly holds the floor back; the other may already go.
    briefly = {**guarded, PlacedInstance(2, "1g.10gb"): 1.0}
    early = plan_gpu(H100, parse_layout("3g.40gb@0"), observed, briefly, 5.0, 5.0, keep_undesired=True)
    assert early.destroy == parse_layout("1g.10gb@0") and early.create == ()


def test_a_busy_leftover_blocks_the_floor_and_free_ones_beside_it_are_spared() -> None:
    # 1g@1 is allocated: 3g@0 cannot be made, so destroying the free 1g@0 would gain nothing.
    plan = keep("3g.40gb@0", obs("1g.10gb@0,1g.10gb@1", busy="1g.10gb@1"))
    assert plan.destroy == () and plan.create == ()
    assert [w.placed for w in plan.blocked] == [PlacedInstance(0, "3g.40gb")]
    assert [w.placed for w in plan.kept_busy] == [PlacedInstance(1, "1g.10gb")]
    assert plan.publish == parse_layout("1g.10gb@0")


def test_an_instance_with_processes_is_never_destroyed_for_the_floor() -> None:
    plan = keep("7g.80gb@0", obs("1g.10gb@3", processes="1g.10gb@3"))
    assert plan.destroy == () and plan.create == ()


def test_a_half_made_leftover_is_cleaned_up() -> None:
    # A GPU instance without its compute instance that nothing wants (the claim that booked it is gone).
    half = (Observed(PlacedInstance(2, "1g.10gb"), has_compute_instance=False),)
    assert keep("", half).destroy == parse_layout("1g.10gb@2")


def _echo(body: dict[str, Any], drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """What an API server answers to a dry-run create: the object, less the fields its gates drop."""
    out = copy.deepcopy(body)
    spec = out["spec"]
    if "sharedCounters" in drop:
        spec.pop("sharedCounters", None)
    for d in spec.get("devices") or []:
        for field in drop:
            d.pop(field, None)
    return out


def test_probe_keeps_fields_means_partitionable() -> None:
    counters, devices = probe_slices("n1")
    assert judge(_echo(counters), _echo(devices)).inventory is Inventory.PARTITIONABLE


def test_probe_fields_dropped_mean_instances_and_say_which_gate() -> None:
    counters, devices = probe_slices("n1")
    no_counters = judge(_echo(counters, ("sharedCounters",)), _echo(devices, ("consumesCounters",)))
    assert no_counters.inventory is Inventory.INSTANCES and "DRAPartitionableDevices" in no_counters.why
    no_binding = judge(_echo(counters), _echo(devices, ("bindingConditions", "bindingFailureConditions")))
    assert no_binding.inventory is Inventory.INSTANCES and "DRADeviceBindingConditions" in no_binding.why
    assert "DRAPartitionableDevices" not in no_binding.why


def test_versions_are_read_as_the_distributions_write_them() -> None:
    assert parse_version("v1.37.2") == (1, 37, 2)
    assert parse_version("v1.36.3-gke.1200") == (1, 36, 3)
    assert parse_version("v1.38.0+k3s1") == (1, 38, 0)
    assert parse_version("") is None and parse_version("vX") is None


def test_partitionable_only_where_the_scheduler_carries_it_at_any_size() -> None:
    kept = InventorySupport(Inventory.PARTITIONABLE, "the API server keeps them")
    for version in ("v1.37.2", "v1.37.10-eks.3", "v1.38.0"):
        assert carried(kept, version).inventory is Inventory.PARTITIONABLE, version
    for version in ("v1.36.3", "v1.37.1", "v1.35.4", "", "garbage"):
        got = carried(kept, version)
        assert got.inventory is Inventory.INSTANCES, version
        assert "v1.37.2" in got.why and "--inventory=partitionable" in got.why
    dropped = InventorySupport(Inventory.INSTANCES, "the API server drops sharedCounters")
    assert carried(dropped, "v1.38.0") is dropped  # a newer version adds nothing the API server drops
