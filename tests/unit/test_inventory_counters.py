"""The DRA inventory (``dynamig.kube.inventory``): its counters are exact, its slices respect the API limits.

Real: the packaged geometry catalog (all 11 models), ``check_layout``, the ranking and the slice builder, run
in-process. Nothing is simulated and no API server is involved (the integration test
``tests/integration/test_partitionable_apiserver.py`` sends the same slices to a real one).

Why the exhaustive check proves the encoding. Let V be the sets of placements ``check_layout`` accepts and F
the sets whose summed consumption fits the counters. Both are closed under taking subsets (the rules only
forbid; consumptions are non-negative). The test enumerates all of F (depth-first from the empty set, adding
placements in a fixed order, which reaches every member of a subset-closed family) and asserts

1. every S in F is in V, and
2. for every S in F and every placement p: S + p is in F exactly when it is in V.

Then V is contained in F as well: a T in V but not in F would have a subset S + p (built by adding T's
placements one at a time) with S in F and S + p not in F, hence by 2 not in V, although subsets of T are in
V. So F = V for every model. (A30 is also checked over its whole power set, with no argument needed.)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import check_layout, enumerate_layouts
from dynamig.geometry.model import GpuModel, PlacedInstance, device_name
from dynamig.kube.devices import WholeGpuDevice
from dynamig.kube.inventory import (
    BINDING_FAILED,
    BINDING_READY,
    MAX_ATTRIBUTES_AND_CAPACITIES,
    MAX_BINDING_CONDITIONS,
    MAX_BINDING_FAILURE_CONDITIONS,
    MAX_COUNTER_CONSUMPTIONS_PER_DEVICE,
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_COUNTERS_PER_CONSUMPTION,
    MAX_COUNTERS_PER_SET,
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS,
    GpuInventory,
    Instance,
    InventoryError,
    Occupancy,
    build_inventory_slices,
    counter_capacity,
    counter_consumption,
    device_ref,
    fits,
    offered_devices,
)
from dynamig.kube.slices import CONTENT_ANNOTATION, ordered_content_hash

CAT = load_catalog()
MODELS = CAT.models()
IDS = [m.key for m in MODELS]
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

Placement = tuple[str, int]


@functools.cache
def all_layouts(model: GpuModel) -> list[tuple[PlacedInstance, ...]]:
    return list(enumerate_layouts(model))


def placements(model: GpuModel) -> list[Placement]:
    return [(p.name, s) for p in model.profiles for s in p.placement_starts]


def accepted(model: GpuModel, items: Sequence[Placement]) -> bool:
    return check_layout(model, [PlacedInstance(s, p) for p, s in items]) is None


def counter_family(
    cands: Sequence[Placement],
    consumption: Mapping[Placement, Mapping[str, int]],
    capacity: Mapping[str, int],
) -> Iterator[tuple[int, ...]]:
    """Every set of candidates (as sorted index tuples) whose consumption fits ``capacity``."""

    def walk(chosen: tuple[int, ...], used: dict[str, int]) -> Iterator[tuple[int, ...]]:
        yield chosen
        for i in range((chosen[-1] + 1) if chosen else 0, len(cands)):
            c = consumption[cands[i]]
            if all(used.get(k, 0) + v <= capacity.get(k, 0) for k, v in c.items()):
                nxt = dict(used)
                for k, v in c.items():
                    nxt[k] = nxt.get(k, 0) + v
                yield from walk((*chosen, i), nxt)

    yield from walk((), {})


def assert_exact(
    cands: Sequence[Placement],
    consumption: Mapping[Placement, Mapping[str, int]],
    capacity: Mapping[str, int],
    valid: Any,
) -> int:
    """Checks 1. and 2. of the module docstring; returns |F|."""
    size = 0
    for chosen in counter_family(cands, consumption, capacity):
        size += 1
        items = [cands[i] for i in chosen]
        assert valid(items), f"counters accept an invalid layout {items}"
        for j, p in enumerate(cands):
            if j in chosen:
                continue
            grown = [*items, p]
            assert fits(capacity, (consumption[x] for x in grown)) == valid(grown), grown
    return size


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_counters_accept_exactly_the_layouts_check_layout_accepts(model: GpuModel) -> None:
    cands = placements(model)
    consumption = {c: counter_consumption(model, *c) for c in cands}
    size = assert_exact(cands, consumption, counter_capacity(model), lambda items: accepted(model, items))
    # F is V: as many sets as the geometry enumerates (plus the empty layout).
    assert size == 1 + len(all_layouts(model))


def test_counters_exact_when_an_instance_cap_binds() -> None:
    """No catalog profile today has a cap below what fits side by side (media profiles aside); a model with
    such caps gets ``cap-<profile id>`` counters, exact as well."""
    base = CAT.model("A100-80GB")
    caps = {"1g.10gb": 3, "2g.20gb": 2}
    profiles = tuple(
        dataclasses.replace(p, max_instances=caps.get(p.name, p.max_instances)) for p in base.profiles
    )
    model = dataclasses.replace(base, key="A100-80GB-capped", profiles=profiles)
    capacity = counter_capacity(model)
    assert {k: v for k, v in capacity.items() if k.startswith("cap-")} == {"cap-19": 3, "cap-14": 2}
    cands = placements(model)
    consumption = {c: counter_consumption(model, *c) for c in cands}
    size = assert_exact(cands, consumption, capacity, lambda items: accepted(model, items))
    assert size == 1 + sum(1 for _ in enumerate_layouts(model))


def test_a30_counters_over_the_whole_power_set() -> None:
    model = CAT.model("A30-24GB")
    cands = placements(model)
    capacity = counter_capacity(model)
    consumption = {c: counter_consumption(model, *c) for c in cands}
    for n in range(len(cands) + 1):
        for subset in itertools.combinations(cands, n):
            assert fits(capacity, (consumption[c] for c in subset)) == accepted(model, subset), subset


@st.composite
def any_subset(draw: st.DrawFn) -> tuple[GpuModel, list[Placement]]:
    model = draw(st.sampled_from(MODELS))
    return model, draw(st.lists(st.sampled_from(placements(model)), unique=True, max_size=8))


@settings(max_examples=400, deadline=None)
@given(any_subset())
def test_counters_agree_with_check_layout_on_random_sets(case: tuple[GpuModel, list[Placement]]) -> None:
    model, items = case
    capacity = counter_capacity(model)
    assert fits(capacity, (counter_consumption(model, *c) for c in items)) == accepted(model, items)
    if accepted(model, items):  # check_layout's family is closed under subsets (used by the proof)
        assert all(accepted(model, items[:i] + items[i + 1 :]) for i in range(len(items)))


def test_counters_stay_within_api_limits_for_every_model() -> None:
    for model in MODELS:
        capacity = counter_capacity(model)
        assert len(capacity) <= MAX_COUNTERS_PER_SET
        assert all(DNS_LABEL.match(k) for k in capacity)
        for p, s in placements(model):
            assert len(counter_consumption(model, p, s)) <= MAX_COUNTERS_PER_CONSUMPTION


# ------------------------------------------------------------------------------------------ from slices
def read_slices(slices: list[dict[str, Any]]) -> tuple[dict[str, dict[str, int]], list[dict[str, Any]]]:
    """(counter sets by name, devices in pool order) as the scheduler reads them: slices by name."""
    sets: dict[str, dict[str, int]] = {}
    devices: list[dict[str, Any]] = []
    for s in sorted(slices, key=lambda s: s["metadata"]["name"]):
        for cs in s["spec"].get("sharedCounters", []):
            assert cs["name"] not in sets
            sets[cs["name"]] = {k: int(v["value"]) for k, v in cs["counters"].items()}
        devices.extend(s["spec"].get("devices", []))
    return sets, devices


def consumed(device: dict[str, Any]) -> tuple[str, dict[str, int]]:
    (c,) = device["consumesCounters"]
    return c["counterSet"], {k: int(v["value"]) for k, v in c["counters"].items()}


def placed(device: dict[str, Any]) -> PlacedInstance:
    attrs = device["attributes"]
    return PlacedInstance(
        attrs["mig.dynamig.io/placementStart"]["int"], attrs["mig.dynamig.io/profile"]["string"]
    )


def split(
    model: GpuModel, layout: Sequence[PlacedInstance], pattern: Sequence[Occupancy]
) -> tuple[Instance, ...]:
    return tuple(
        Instance(i.profile, i.start, occ, uuid=f"MIG-{i.profile}-{i.start}", memory_bytes=1 << 30)
        for i, occ in zip(layout, itertools.cycle(pattern), strict=False)
    )


def mixes(model: GpuModel) -> list[tuple[str, tuple[Instance, ...]]]:
    """A few existing-instance mixes per model: free, busy outside DRA, allocated, and all three."""
    layouts = list(enumerate_layouts(model, maximal=True))
    small = min(layouts, key=lambda lay: (len(lay), lay))
    full = max(layouts, key=lambda lay: (len(lay), lay))
    return [
        ("free", split(model, small, [Occupancy.FREE])),
        ("busy", split(model, small, [Occupancy.BUSY])),
        ("allocated", split(model, full[:2], [Occupancy.ALLOCATED])),
        ("mixed", split(model, full, [Occupancy.FREE, Occupancy.BUSY, Occupancy.ALLOCATED])),
    ]


def check_gpu_exact(slices: list[dict[str, Any]], gpu: GpuInventory) -> int:
    """Exactness as the scheduler sees the pool: the devices of ``gpu`` not yet allocated, with the counters
    left after the allocated ones, fit exactly when the busy + allocated + chosen instances form a valid
    layout."""
    sets, devices = read_slices(slices)
    name = f"gpu{gpu.index}"
    mine = [d for d in devices if consumed(d)[0] == name]
    allocated_names = {
        device_name(gpu.index, i.profile, i.start)
        for i in gpu.instances
        if i.occupancy is Occupancy.ALLOCATED
    }
    capacity = dict(sets.get(name, {}))
    for d in mine:
        if d["name"] in allocated_names:
            for k, v in consumed(d)[1].items():
                capacity[k] -= v
    assert all(v >= 0 for v in capacity.values())
    held = [i.placed for i in gpu.instances if i.occupancy is not Occupancy.FREE]
    offered = [d for d in mine if d["name"] not in allocated_names]
    cands = [(placed(d).profile, placed(d).start) for d in offered]
    consumption = {c: consumed(d)[1] for c, d in zip(cands, offered, strict=True)}
    return assert_exact(
        cands,
        consumption,
        capacity,
        lambda items: check_layout(gpu.model, [*held, *(PlacedInstance(s, p) for p, s in items)]) is None,
    )


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_published_counters_are_exact_beside_busy_and_allocated_instances(model: GpuModel) -> None:
    idle = GpuInventory(1, model, "GPU-1")
    for n, (label, instances) in enumerate(mixes(model)):
        gpu = GpuInventory(0, model, "GPU-0", instances=instances)
        slices = build_inventory_slices("node-a", 3, [gpu, idle])
        assert check_gpu_exact(slices, gpu) >= 1, label
        if n == 0:  # the idle neighbour publishes the model's whole family, through the slices
            assert check_gpu_exact(slices, idle) == 1 + len(all_layouts(model))


@st.composite
def gpu_states(draw: st.DrawFn) -> GpuInventory:
    model = draw(st.sampled_from(MODELS))
    layout = draw(st.sampled_from(all_layouts(model))) if draw(st.booleans()) else ()
    occ = [draw(st.sampled_from(list(Occupancy))) for _ in layout]
    allowed = draw(
        st.one_of(st.none(), st.frozensets(st.sampled_from([p.name for p in model.profiles]), max_size=4))
    )
    return GpuInventory(
        0, model, "GPU-0", instances=split(model, layout, occ) if occ else (), allowed_profiles=allowed
    )


@settings(max_examples=40, deadline=None)
@given(gpu_states())
def test_published_counters_are_exact_for_random_states(gpu: GpuInventory) -> None:
    check_gpu_exact(build_inventory_slices("node-a", 1, [gpu]), gpu)


# ------------------------------------------------------------------------------------------ what is offered
def test_free_instance_is_the_device_of_its_placement_first_and_with_its_uuid() -> None:
    model = CAT.model("A100-80GB")
    free = Instance("2g.20gb", 2, Occupancy.FREE, uuid="MIG-abc", memory_bytes=20 << 30, multiprocessors=28)
    devices = offered_devices([GpuInventory(0, model, "GPU-0", instances=(free,))])
    first = devices[0]
    assert (first.kind, first.name) == ("free", device_name(0, "2g.20gb", 2))
    assert first.counters == counter_consumption(model, "2g.20gb", 2)
    assert first.device.uuid == "MIG-abc" and first.device.capacity()["memory"] == 20 << 30
    assert [d.name for d in devices].count(first.name) == 1
    recut = [d for d in devices if d.kind == "recut"]
    assert recut and all(d.destroys == (PlacedInstance(2, "2g.20gb"),) for d in recut)
    assert {d.kind for d in devices[1:]} == {"new", "recut"}
    kinds = [d.kind for d in devices]
    assert kinds == sorted(kinds, key=["free", "new", "recut"].index)


def test_busy_instances_are_not_offered_and_reduce_the_counters() -> None:
    model = CAT.model("H100-80GB")
    busy = Instance("3g.40gb", 0, Occupancy.BUSY, uuid="MIG-busy")
    gpu = GpuInventory(0, model, "GPU-0", instances=(busy,))
    slices = build_inventory_slices("node-a", 1, [gpu])
    sets, devices = read_slices(slices)
    names = {d["name"] for d in devices}
    assert device_name(0, "3g.40gb", 0) not in names
    assert device_name(0, "7g.80gb", 0) not in names and device_name(0, "1g.10gb", 3) not in names
    assert device_name(0, "3g.40gb", 4) in names
    # Counters for slices 0-3 are consumed by nothing published, so they are not in the set at all.
    assert set(sets["gpu0"]) == {"mem-4", "mem-5", "mem-6", "mem-7", "media-me"}


def test_allocated_instances_stay_published_last_with_full_counters() -> None:
    model = CAT.model("A100-80GB")
    alloc = Instance("4g.40gb", 0, Occupancy.ALLOCATED, uuid="MIG-a")
    gpu = GpuInventory(0, model, "GPU-0", instances=(alloc,))
    slices = build_inventory_slices("node-a", 1, [gpu])
    sets, devices = read_slices(slices)
    assert devices[-1]["name"] == device_name(0, "4g.40gb", 0)
    assert devices[-1]["attributes"]["mig.dynamig.io/uuid"] == {"string": "MIG-a"}
    assert sets["gpu0"]["mem-0"] == 1  # the allocation holds it, not the counter set
    assert all(not placed(d).profile.startswith("7g") for d in devices)


def test_empty_allowed_profiles_offer_only_existing_free_instances() -> None:
    model = CAT.model("A100-80GB")
    gpu = GpuInventory(
        0,
        model,
        "GPU-0",
        instances=(Instance("3g.40gb", 4, Occupancy.FREE), Instance("1g.10gb", 0, Occupancy.ALLOCATED)),
        allowed_profiles=frozenset(),
    )
    assert [(d.kind, d.name) for d in offered_devices([gpu])] == [
        ("free", device_name(0, "3g.40gb", 4)),
        ("allocated", device_name(0, "1g.10gb", 0)),
    ]


def test_allowed_profiles_limit_new_placements() -> None:
    model = CAT.model("A100-80GB")
    gpu = GpuInventory(0, model, "GPU-0", allowed_profiles=frozenset({"1g.10gb", "7g.80gb"}))
    devices = offered_devices([gpu])
    assert {d.profile for d in devices} == {"1g.10gb", "7g.80gb"}
    assert len(devices) == 8


def test_an_invalid_existing_layout_is_refused() -> None:
    model = CAT.model("A100-80GB")
    gpu = GpuInventory(
        0,
        model,
        "GPU-0",
        instances=(Instance("3g.40gb", 0, Occupancy.BUSY), Instance("1g.10gb", 3, Occupancy.FREE)),
    )
    with pytest.raises(InventoryError, match=r"gpu0: existing instances are not a valid layout.*overlap"):
        build_inventory_slices("node-a", 1, [gpu])


# ------------------------------------------------------------------------------------------ API limits
def check_limits(slices: list[dict[str, Any]], node: str, generation: int) -> None:
    names = [s["metadata"]["name"] for s in slices]
    assert len(set(names)) == len(names)
    sets, devices = read_slices(slices)
    for s in slices:
        spec = s["spec"]
        assert spec["nodeName"] == node and spec["driver"] == "mig.dynamig.io"
        assert spec["pool"] == {"name": node, "generation": generation, "resourceSliceCount": len(slices)}
        assert ("devices" in spec) != ("sharedCounters" in spec)  # never both (1.35+)
        assert len(spec.get("devices", [])) <= MAX_DEVICES_PER_SLICE_WITH_COUNTERS
        assert len(spec.get("sharedCounters", [])) <= MAX_COUNTER_SETS_PER_SLICE
        key = "devices" if "devices" in spec else "sharedCounters"
        assert s["metadata"]["annotations"][CONTENT_ANNOTATION] == ordered_content_hash({key: spec[key]})
        for cs in spec.get("sharedCounters", []):
            assert DNS_LABEL.match(cs["name"]) and 1 <= len(cs["counters"]) <= MAX_COUNTERS_PER_SET
            assert all(DNS_LABEL.match(k) and int(v["value"]) >= 1 for k, v in cs["counters"].items())
    assert len({d["name"] for d in devices}) == len(devices)
    for d in devices:
        assert DNS_LABEL.match(d["name"]), d["name"]
        assert len(d["attributes"]) + len(d["capacity"]) <= MAX_ATTRIBUTES_AND_CAPACITIES
        assert 1 <= len(d["consumesCounters"]) <= MAX_COUNTER_CONSUMPTIONS_PER_DEVICE
        set_name, counters = consumed(d)
        assert len(counters) <= MAX_COUNTERS_PER_CONSUMPTION
        # What the scheduler checks before it allocates from a pool (validateDeviceCounterConsumption).
        assert set(counters) <= set(sets[set_name]), (d["name"], set_name)
        # Both or neither: which devices carry them is checked against the offer kinds below.
        if "bindingConditions" not in d:
            assert "bindingFailureConditions" not in d, d["name"]
        else:
            assert d["bindingConditions"] == [BINDING_READY]
            assert d["bindingFailureConditions"] == [BINDING_FAILED]
            assert len(d["bindingConditions"]) <= MAX_BINDING_CONDITIONS
            assert len(d["bindingFailureConditions"]) <= MAX_BINDING_FAILURE_CONDITIONS
        assert "bindsToNode" not in d


@pytest.mark.parametrize("gpu_count", [8, 16])
@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_slices_respect_api_limits(model: GpuModel, gpu_count: int) -> None:
    for label, instances in [("idle", ()), *mixes(model)]:
        gpus = [
            GpuInventory(i, model, f"GPU-{i}", instances=instances if i % 3 == 1 else ())
            for i in range(gpu_count)
        ]
        slices = build_inventory_slices("node-a", 5, gpus)
        check_limits(slices, "node-a", 5)
        # Name order of the device slices is rank order: reading them as the scheduler does gives the ranking.
        _, devices = read_slices(slices)
        offered = offered_devices(gpus)
        assert [d["name"] for d in devices] == [d.name for d in offered], label
        # A placement to cut waits for the agent; an existing instance binds in the scheduling cycle.
        guarded = [("bindingConditions" in d) for d in devices]
        assert guarded == [o.kind not in ("free", "allocated") for o in offered], label


def test_slice_layout_for_eight_idle_a100s() -> None:
    model = CAT.model("A100-80GB")
    slices = build_inventory_slices("node-a", 2, [GpuInventory(i, model, f"GPU-{i}") for i in range(8)])
    assert [
        (s["metadata"]["name"], len(s["spec"].get("devices", s["spec"].get("sharedCounters", []))))
        for s in slices
    ] == [
        ("node-a-mig.dynamig.io-counters-000", 8),
        ("node-a-mig.dynamig.io-devices-000", 64),
        ("node-a-mig.dynamig.io-devices-001", 64),
        ("node-a-mig.dynamig.io-devices-002", 64),
        ("node-a-mig.dynamig.io-devices-003", 8),
    ]


def test_no_gpus_still_publish_one_empty_device_slice() -> None:
    (only,) = build_inventory_slices("node-a", 1, [])
    assert only["spec"]["devices"] == [] and only["spec"]["pool"]["resourceSliceCount"] == 1


def test_slices_are_deterministic_and_a_reorder_changes_the_digest() -> None:
    model = CAT.model("H100-80GB")
    gpus = [GpuInventory(i, model, f"GPU-{i}") for i in range(3)]
    one = build_inventory_slices("node-a", 1, gpus)
    assert build_inventory_slices("node-a", 1, list(reversed(gpus))) == one
    devices = one[1]["spec"]["devices"]
    assert ordered_content_hash({"devices": devices}) != ordered_content_hash({"devices": devices[::-1]})


# ------------------------------------------------------------------------------------------ names
def test_device_ref_inverts_device_name_for_every_model() -> None:
    for model in MODELS:
        models = {0: model, 3: model}
        for p, s in placements(model):
            for index in models:
                ref = device_ref(device_name(index, p, s), models)
                assert ref is not None and (ref.gpu_index, ref.profile, ref.start) == (index, p, s)
    assert device_ref("gpu9-1g10gb-s0", {0: CAT.model("A100-80GB")}) is None
    assert device_ref("gpu0-9g99gb-s0", {0: CAT.model("A100-80GB")}) is None
    assert device_ref("something-else", {0: CAT.model("A100-80GB")}) is None


def test_a_retiring_free_instance_is_published_guarded_and_the_others_bind_at_once() -> None:
    model = CAT.model("A100-80GB")
    gpu = GpuInventory(
        0,
        model,
        "GPU-0",
        instances=(
            Instance("1g.10gb", 0, Occupancy.FREE, guarded=True),
            Instance("1g.10gb", 1, Occupancy.FREE),
            Instance("1g.10gb", 2, Occupancy.ALLOCATED),
        ),
    )
    _, devices = read_slices(build_inventory_slices("node-a", 1, [gpu]))
    conditions = {d["name"]: d.get("bindingConditions") for d in devices}
    assert conditions["gpu0-1g10gb-s0"] == [BINDING_READY]  # retiring: a booking waits for the agent
    assert conditions["gpu0-1g10gb-s1"] is None and conditions["gpu0-1g10gb-s2"] is None
    placements = [
        n for n, c in conditions.items() if n not in ("gpu0-1g10gb-s0", "gpu0-1g10gb-s1", "gpu0-1g10gb-s2")
    ]
    assert placements and all(conditions[n] == [BINDING_READY] for n in placements)


def test_a_placement_cap_keeps_the_best_ranked_placements_and_every_free_instance() -> None:
    from collections import Counter

    from dynamig.kube.inventory import GpuInventory, Instance, Occupancy, offered_devices

    model = load_catalog().model("A100-80GB")
    free = (Instance("1g.10gb", 0, Occupancy.FREE, "MIG-a"), Instance("1g.10gb", 1, Occupancy.FREE, "MIG-b"))
    gpus = [GpuInventory(0, model, "GPU-0", instances=free), GpuInventory(1, model, "GPU-1")]
    every = offered_devices(gpus)
    capped = offered_devices([dataclasses.replace(g, placements_per_profile=1) for g in gpus])
    placements = [d for d in capped if d.kind != "free"]
    per_profile = Counter((d.gpu_index, d.profile) for d in placements)
    assert set(per_profile.values()) == {1}
    assert {p for g, p in per_profile if g == 1} == {
        p.name for p in model.profiles
    }  # the idle GPU: each once
    # both free instances stay offered, beyond the cap
    assert sorted(d.start for d in capped if d.kind == "free") == [0, 1]
    # the placement kept for each (GPU, profile) is the best ranked one of the uncapped inventory
    first: dict[tuple[int, str], str] = {}
    for d in every:
        if d.kind != "free":
            first.setdefault((d.gpu_index, d.profile), d.name)
    assert {(d.gpu_index, d.profile): d.name for d in placements} == first
    assert len(capped) < len(every)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_a_whole_gpu_offered_beside_its_slices_excludes_every_one_of_them(model: GpuModel) -> None:
    """``GpuInventory.whole`` (GpuPartition ``spec.offerWhole``): the whole GPU fits its counter set alone
    and beside no other device of the GPU, so the scheduler books either it or slices, never both; it is
    guarded (the agent switches MIG off first), last; and it is not offered beside an allocated or busy
    instance (it could never fit)."""
    whole = WholeGpuDevice(0, model.product_name, "GPU-0").to_api()
    small = min(model.profiles, key=lambda p: (p.placement_size, p.name))
    one = Instance(small.name, small.placement_starts[0], Occupancy.FREE, "MIG-f")
    gpu = GpuInventory(0, model, "GPU-0", instances=(one,), whole=whole)
    sets, devices = read_slices(build_inventory_slices("node-a", 1, [gpu]))
    (offer,) = [d for d in devices if d["name"] == "gpu0"]
    assert devices[-1] is offer and len(devices) > 1
    assert offer["bindingConditions"] == [BINDING_READY]
    assert offer["bindingFailureConditions"] == [BINDING_FAILED]
    counter_set, whole_use = consumed(offer)
    assert counter_set == "gpu0" and whole_use == sets["gpu0"], "every counter, at full value"
    assert fits(sets["gpu0"], [whole_use])
    for d in devices[:-1]:
        assert not fits(sets["gpu0"], [whole_use, consumed(d)[1]]), d["name"]
    for occupancy in (Occupancy.ALLOCATED, Occupancy.BUSY):
        taken = dataclasses.replace(gpu, instances=(dataclasses.replace(one, occupancy=occupancy),))
        _, devices = read_slices(build_inventory_slices("node-a", 1, [taken]))
        assert "gpu0" not in [d["name"] for d in devices], occupancy
