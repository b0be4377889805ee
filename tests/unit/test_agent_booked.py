"""A booked device stays in the slices until answered (``build_inventory_slices(booked=...)``). Pure."""

from __future__ import annotations

from dynamig.agent.bindings.booked import kept_booked, published_devices
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.inventory import (
    BINDING_READY,
    BOOKED,
    GpuInventory,
    Instance,
    Occupancy,
    build_inventory_slices,
    counter_consumption,
    fits,
    published_devices_of,
)

A100 = load_catalog().model("A100-80GB")


def inventory(offered: frozenset[str], *instances: Instance) -> GpuInventory:
    return GpuInventory(0, A100, "GPU-0", "", tuple(instances), offered)


def test_with_nothing_booked_outside_the_offer_the_slices_are_the_offers() -> None:
    gpus = [
        inventory(frozenset({"1g.10gb", "3g.40gb"}), Instance("3g.40gb", 4, Occupancy.ALLOCATED, "MIG-a"))
    ]
    offered = published_devices(build_inventory_slices("n1", 3, gpus))
    assert build_inventory_slices("n1", 3, gpus, booked={"gpu0-1g10gb-s0"}) == build_inventory_slices(
        "n1", 3, gpus
    )
    assert "gpu0-1g10gb-s0" in offered


def test_a_booked_placement_the_narrowed_offer_lacks_is_kept_with_its_counters_and_conditions() -> None:
    gpus = [inventory(frozenset({"1g.10gb"}))]  # 7g.80gb no longer offered
    assert "gpu0-7g80gb-s0" not in published_devices(build_inventory_slices("n1", 1, gpus))
    slices = build_inventory_slices("n1", 1, gpus, booked={"gpu0-7g80gb-s0"})
    devices = [d for s in slices for d in s["spec"].get("devices") or []]
    (kept,) = [d for d in devices if d["name"] == "gpu0-7g80gb-s0"]
    assert kept["bindingConditions"] == [BINDING_READY]
    consumed = {k: int(v["value"]) for k, v in kept["consumesCounters"][0]["counters"].items()}
    assert consumed == counter_consumption(A100, "7g.80gb", 0)
    (counter_set,) = [c for s in slices for c in s["spec"].get("sharedCounters") or []]
    capacity = {k: int(v["value"]) for k, v in counter_set["counters"].items()}
    # The scheduler counts the booking: no 1g.10gb fits beside it on the same memory slices.
    for start in A100.profile("1g.10gb").placement_starts:
        assert not fits(capacity, [consumed, counter_consumption(A100, "1g.10gb", start)])
    assert kept_booked(gpus, {"gpu0-7g80gb-s0"}) == ["gpu0-7g80gb-s0"]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}


def test_names_that_are_no_placement_here_or_a_busy_instance_are_not_published() -> None:
    gpus = [inventory(frozenset(), Instance("1g.10gb", 0, Occupancy.BUSY))]
    devices = published_devices_of(gpus, {"gpu0-1g10gb-s0", "gpu3-1g10gb-s0", "gpu0-nonsense"})
    assert not [d for d in devices if d.kind == BOOKED]
