"""The agent's per-GPU decisions as pure functions: no NVML, no API server."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from dynamig.agent.layout.reconcile import GpuPlan, Waiting
from dynamig.agent.nvml.device import ComputeInstance, GpuInfo, MigInstance
from dynamig.agent.publishing.gpu_status import (
    degraded_status,
    gpu_status,
    managed_status,
    mig_device,
    partitionable_offer,
    readiness,
    refusal,
    refused_status,
)
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance, device_name
from dynamig.kube.gpupartition import (
    ConditionType,
    GpuPartition,
    GpuPartitionStatus,
    InstanceState,
    Inventory,
    Phase,
    Reason,
)

MODEL = load_catalog().model("A100-40GB")
STAMP = "2026-12-03T08:00:00Z"
CRD = Path(__file__).resolve().parents[2] / "crds" / "gpupartitions.yaml"
EVERY_PROFILE = ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]  # 7 + 3 + 2 + 1 + 1 placements


def gpu(**kw: object) -> GpuInfo:
    base: dict[str, object] = dict(
        index=0, uuid="GPU-a", product="NVIDIA A100-SXM4-40GB", pci_device_id=0x20B0, minor=0,
        mig_current=1, mig_pending=1, model=MODEL,
    )  # fmt: skip
    base.update(kw)
    return GpuInfo(**base)  # type: ignore[arg-type]


def instance(profile: str, start: int, processes: int = 0, ci_slices: int | None = None) -> MigInstance:
    p = MODEL.profile(profile)
    ci = ComputeInstance(1, ci_slices or p.compute_slices, f"MIG-{profile}-{start}", 1 << 30, 14, processes)
    return MigInstance(0, profile, start, p.placement_size, 1, p.compute_slices, (ci,))


def partition(
    uuid: str = "",
    offered: list[str] | None = None,
    layout: Sequence[tuple[str, int]] = (),
) -> GpuPartition:
    spec: dict[str, object] = {
        "node": "n1",
        "gpuIndex": 0,
        "layout": [{"profile": p, "start": s} for p, s in layout],
    }
    if offered is not None:
        spec["offeredProfiles"] = offered
    return GpuPartition.model_validate(
        {"metadata": {"name": "n1-gpu0", "generation": 3}, "spec": spec, "status": {"uuid": uuid}}
    )


def reason(problem: tuple[str, str] | None) -> str | None:
    return None if problem is None else problem[0]


def test_refusal_order_and_reasons() -> None:
    assert refusal(gpu(), partition(), None) is None
    assert reason(refusal(gpu(uuid="GPU-b"), partition(uuid="GPU-a"), "mig-manager")) == Reason.GPU_REPLACED
    assert refusal(gpu(), partition(), "mig-manager") == (
        Reason.FOREIGN_MIG_OWNER,
        "not managing this GPU: mig-manager",
    )
    assert reason(refusal(gpu(model=None), partition(), None)) == Reason.UNKNOWN_MODEL
    assert reason(refusal(gpu(mig_pending=0), partition(), None)) == Reason.MIG_MODE_PENDING
    assert reason(refusal(gpu(mig_current=0, mig_pending=0), partition(), None)) == Reason.MIG_DISABLED


def test_refused_replaced_gpu_keeps_the_recorded_uuid() -> None:
    part = partition(uuid="GPU-a")
    problem = refusal(gpu(uuid="GPU-b"), part, None)
    assert problem is not None
    status = gpu_status("n1", None, gpu(uuid="GPU-b"), part, [], {}, (), (), Phase.DEGRADED, problem[1])
    assert status.uuid == "GPU-b"
    refused = refused_status(status, part, problem, STAMP)
    assert refused.uuid == "GPU-a"
    for ctype in (ConditionType.MANAGED, ConditionType.READY):
        cond = refused.condition(ctype)
        assert cond is not None and not cond.is_true and cond.reason == Reason.GPU_REPLACED


def test_status_states_follow_processes_prepared_and_claims() -> None:
    insts = [
        instance("1g.5gb", 0, processes=1),
        instance("1g.5gb", 1),
        instance("1g.5gb", 2),
        instance("1g.5gb", 3),
    ]
    claims = {device_name(0, "1g.5gb", 2): ["ns/a"]}
    prepared = {device_name(0, "1g.5gb", 1)}
    published = {PlacedInstance(3, "1g.5gb"), PlacedInstance(2, "1g.5gb")}
    status = gpu_status(
        "n1", Inventory.INSTANCES, gpu(), partition(), insts, claims, prepared, published, Phase.STABLE, "ok"
    )
    states = [i.state for i in status.instances]
    assert states == [InstanceState.IN_USE, InstanceState.IN_USE, InstanceState.ALLOCATED, InstanceState.FREE]
    assert status.instances[2].claims == ["ns/a"]
    assert status.free_slices == 1  # only the free and published one
    assert status.total_slices == 4 and status.observed_generation == 3


def test_readiness_explains_what_holds_the_gpu() -> None:
    busy = Waiting(PlacedInstance(0, "3g.20gb"), "allocated to ns/a")
    assert readiness(0, GpuPlan(), None, []) == ("GPU matches spec.layout", True, Reason.LAYOUT_APPLIED)
    assert readiness(0, GpuPlan(violation="overlap"), None, [])[1:] == (False, Reason.INVALID_LAYOUT)
    assert readiness(0, GpuPlan(), (Reason.NVML_ERROR, "boom"), []) == ("boom", False, Reason.NVML_ERROR)
    assert readiness(0, GpuPlan(draining=(busy,)), None, [])[2] == Reason.DRAINING
    assert readiness(0, GpuPlan(blocked=(busy,)), None, [])[2] == Reason.RESHAPING
    assert readiness(0, GpuPlan(blocked=(busy,), kept_busy=(busy,)), None, [])[2] == Reason.INSTANCE_BUSY
    message, ready, reason = readiness(0, GpuPlan(), None, ["kept a device for now: guarded 1 s"])
    assert (ready, reason) == (False, Reason.INSTANCE_BUSY) and "guarded" in message


def test_managed_status_sets_four_conditions_and_the_reshape_time() -> None:
    plan = GpuPlan()
    base = gpu_status("n1", None, gpu(), partition(), [], {}, (), (), Phase.STABLE, "m")
    out = managed_status(
        base, partition(), MODEL.key, plan, readiness(0, plan, None, []), STAMP,
        reshape_finished=True, offered_placements=5,
    )  # fmt: skip
    for ctype in (
        ConditionType.MANAGED,
        ConditionType.HEALTHY,
        ConditionType.LAYOUT_VALID,
        ConditionType.READY,
    ):
        cond = out.condition(ctype)
        assert cond is not None and cond.is_true, ctype
    assert out.last_reshape_time == STAMP and out.offered_placements == 5
    bad = managed_status(
        base, partition(), MODEL.key, GpuPlan(violation="x"), ("r", False, Reason.INVALID_LAYOUT), STAMP,
        reshape_finished=False, offered_placements=0,
    )  # fmt: skip
    layout = bad.condition(ConditionType.LAYOUT_VALID)
    assert layout is not None and not layout.is_true and bad.last_reshape_time == base.last_reshape_time


def test_degraded_offers_nothing() -> None:
    st = degraded_status(partition(), "gone", Reason.GPU_LOST, (ConditionType.HEALTHY,), STAMP)
    assert st.phase == Phase.DEGRADED and st.free_slices == 0 and st.message == "gone"
    cond = st.condition(ConditionType.HEALTHY)
    assert cond is not None and cond.reason == Reason.GPU_LOST


def test_offer_guards_only_retiring_free_instances() -> None:
    insts = [instance("1g.5gb", 0), instance("1g.5gb", 1), instance("1g.5gb", 2, processes=2)]
    claims = {device_name(0, "1g.5gb", 1): ["ns/a"]}
    offer = partitionable_offer(
        gpu(), partition(offered=["1g.5gb"]), insts, claims, (), {PlacedInstance(0, "1g.5gb")}, False
    )
    assert offer.inventory is not None and not offer.problem
    # the retiring free one is guarded, the allocated one is published plainly, the busy one not at all
    assert offer.unguarded == frozenset({PlacedInstance(1, "1g.5gb")})
    assert offer.placements > 0
    everything = partitionable_offer(gpu(), partition(offered=["1g.5gb"]), insts[:1], {}, (), (), True)
    assert everything.unguarded == frozenset()  # guard_free: every free instance carries conditions


def test_a_free_instance_nvml_lists_no_mig_device_for_yet_is_guarded_not_bookable_at_once() -> None:
    """A booking of it waits for the agent, which answers ready only once NVML lists the MIG device."""
    p = MODEL.profile("1g.5gb")
    unlisted = MigInstance(
        0, "1g.5gb", 0, p.placement_size, 1, p.compute_slices, (ComputeInstance(1, 1, "", 0, 14, 0),)
    )
    offer = partitionable_offer(
        gpu(), partition(offered=["1g.5gb"]), [unlisted, instance("1g.5gb", 1)], {}, (), (), False
    )
    assert offer.unguarded == frozenset({PlacedInstance(1, "1g.5gb")})


def test_offer_skips_profiles_the_model_lacks_and_split_instances_are_busy() -> None:
    split = instance("2g.10gb", 0, ci_slices=1)  # one 1-slice compute instance in a 2-slice GPU instance
    offer = partitionable_offer(gpu(), partition(offered=["1g.5gb", "9g.99gb"]), [split], {}, (), (), False)
    assert offer.inventory is not None
    assert offer.inventory.allowed_profiles == frozenset({"1g.5gb"})
    assert offer.unguarded == frozenset()


def test_mig_device_names_the_instance() -> None:
    dev = mig_device(gpu(), instance("3g.20gb", 4))
    assert dev["name"] == device_name(0, "3g.20gb", 4)
    assert dev["attributes"]["mig.dynamig.io/uuid"] == {"string": "MIG-3g.20gb-4"}
    assert dev["attributes"]["mig.dynamig.io/placementStart"] == {"int": 4}


def round_status(
    inventory: Inventory, part: GpuPartition, insts: list[MigInstance], claims: dict[str, list[str]]
) -> GpuPartitionStatus:
    """The status a round of the agent writes for a GPU with nothing left to do, as the controller makes it:
    the partitionable offer (none under Instances), gpu_status, readiness, managed_status."""
    offer, published = None, {i.placed for i in insts}
    if inventory is Inventory.PARTITIONABLE:
        offer = partitionable_offer(gpu(), part, insts, claims, (), (), False)
        published = set(offer.unguarded)
    plan = GpuPlan()
    ready = readiness(0, plan, None, [])
    status = gpu_status("n1", inventory, gpu(), part, insts, claims, (), published, Phase.STABLE, ready[0])
    return managed_status(
        status, part, MODEL.key, plan, ready, STAMP,
        reshape_finished=False, offered_placements=offer.placements if offer else 0,
    )  # fmt: skip


def test_ready_message_says_what_is_true_in_each_inventory() -> None:
    insts = [
        instance("1g.5gb", 0, processes=1),
        instance("1g.5gb", 1),
        instance("1g.5gb", 2),
        instance("1g.5gb", 3),
    ]
    claims = {device_name(0, "1g.5gb", 1): ["ns/a"]}
    # Partitionable: spec.layout is a floor and pods book the rest, so it is not "the layout" of the GPU.
    floorless = round_status(Inventory.PARTITIONABLE, partition(offered=["1g.5gb"]), insts, claims)
    ready = floorless.condition(ConditionType.READY)
    assert ready is not None and ready.is_true and ready.reason == Reason.LAYOUT_APPLIED
    assert (
        ready.message
        == "4 instances (2 booked or in use), 3 placements offered to cut; floor spec.layout empty"
    )
    assert floorless.message == ready.message  # the phase message says the same
    floored = round_status(
        Inventory.PARTITIONABLE, partition(offered=["1g.5gb"], layout=[("1g.5gb", 0)]), insts, claims
    )
    assert floored.message.endswith("; floor spec.layout (1 instance) kept")
    # Instances: the GPU is cut to spec.layout, which lists every instance.
    exact = round_status(
        Inventory.INSTANCES, partition(layout=[("1g.5gb", s) for s in range(4)]), insts, claims
    )
    ready = exact.condition(ConditionType.READY)
    assert ready is not None and ready.message == exact.message == "GPU matches spec.layout"


def printer_columns() -> list[dict[str, Any]]:
    (version,) = yaml.safe_load(CRD.read_text())["spec"]["versions"]
    return list(version["additionalPrinterColumns"])


def resolve(obj: dict[str, Any], path: str) -> Any:
    """The value kubectl prints for a printer column's ``jsonPath``: the three forms the CRD uses (a dotted
    path; a condition's field picked by type; a field of every item of a list, comma-joined); None where
    kubectl prints <none>."""
    picked = re.fullmatch(r'\.status\.conditions\[\?\(@\.type=="(\w+)"\)\]\.(\w+)', path)
    if picked:
        cond = [c for c in obj["status"].get("conditions", []) if c["type"] == picked[1]]
        return cond[0].get(picked[2]) if cond else None
    every = re.fullmatch(r"((?:\.\w+)+)\[\*\]\.(\w+)", path)
    if every:
        items = resolve(obj, every[1]) or []
        return ",".join(str(i.get(every[2])) for i in items) or None
    assert re.fullmatch(r"(\.\w+)+", path), f"printer column path this test cannot read: {path}"
    value: Any = obj
    for key in path[1:].split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def test_default_columns_show_what_a_partitionable_gpu_offers() -> None:
    # An idle partitionable GPU has no instance: FREE 0 and TOTAL 0 alone would read as "nothing here".
    part = partition(offered=EVERY_PROFILE)
    status = round_status(Inventory.PARTITIONABLE, part, [], {})
    obj = {"metadata": {"name": part.name, "creationTimestamp": STAMP}, "status": status.to_api()}
    row = {c["name"]: resolve(obj, c["jsonPath"]) for c in printer_columns() if not c.get("priority")}
    assert row == {
        "Free": 0,
        "Total": 0,
        "Offered": 14,
        "Ready": "True",
        "Reason": "LayoutApplied",
        "Age": STAMP,
    }
    wide = {c["name"]: resolve(obj, c["jsonPath"]) for c in printer_columns()}
    assert wide["Inventory"] == "Partitionable" and wide["Model"] == MODEL.key
    assert wide["Held For"] is None
    held = {"claim": "ml/big", "profile": "3g.40gb", "start": 4, "expiresAt": STAMP}
    obj["status"]["holds"] = [held, {**held, "claim": "ml/other", "start": 0}]
    assert resolve(obj, next(c["jsonPath"] for c in printer_columns() if c["name"] == "Held For")) == (
        "ml/big,ml/other"
    )
    del obj["status"]["holds"]
    assert (
        wide["Message"]
        == "0 instances (0 booked or in use), 14 placements offered to cut; floor spec.layout empty"
    )
    # Instances inventory: the same columns count instances, and nothing is offered to cut.
    insts = [instance("3g.20gb", 0), instance("3g.20gb", 4)]
    claims = {device_name(0, "3g.20gb", 0): ["ns/a"]}
    exact = round_status(
        Inventory.INSTANCES, partition(layout=[("3g.20gb", 0), ("3g.20gb", 4)]), insts, claims
    )
    obj = {"metadata": {"name": part.name, "creationTimestamp": STAMP}, "status": exact.to_api()}
    row = {c["name"]: resolve(obj, c["jsonPath"]) for c in printer_columns() if not c.get("priority")}
    assert (row["Free"], row["Total"], row["Offered"], row["Ready"]) == (1, 2, 0, "True")


def floor_round(
    inventory: Inventory, insts: list[MigInstance], claims: dict[str, list[str]], notes: Sequence[str] = ()
) -> GpuPartitionStatus:
    """A round's status for a GPU whose floor (spec.layout 3g.20gb@0) overlaps ``insts``, planned by the
    reshape protocol as the controller plans it (spec.layout a floor under Partitionable)."""
    from dynamig.agent.layout.reconcile import observe, plan_gpu

    part = partition(offered=["1g.5gb"], layout=[("3g.20gb", 0)])
    keep = inventory is Inventory.PARTITIONABLE
    plan = plan_gpu(MODEL, part.spec.desired(), observe(insts, claims, ()), {}, 0.0, 1.0, keep)
    offer = partitionable_offer(gpu(), part, insts, claims, (), (), False) if keep else None
    ready = readiness(0, plan, None, notes)
    status = gpu_status("n1", inventory, gpu(), part, insts, claims, (), (), Phase.STABLE, ready[0])
    return managed_status(
        status, part, MODEL.key, plan, ready, STAMP,
        reshape_finished=False, offered_placements=offer.placements if offer else 0,
    )  # fmt: skip


def test_a_floor_held_by_bookings_is_ready_and_anything_else_holding_it_is_not() -> None:
    booked = {device_name(0, "1g.5gb", 1): ["ns/a"]}
    insts = [instance("1g.5gb", 1), instance("1g.5gb", 5)]
    # Partitionable: the scheduler booked 1g.5gb@1 over the floor's slices. Expected: Ready, FloorHeld.
    held = floor_round(Inventory.PARTITIONABLE, insts, booked)
    ready = held.condition(ConditionType.READY)
    assert ready is not None and ready.is_true and ready.reason == Reason.FLOOR_HELD, ready
    assert "waiting to create gpu0-3g20gb-s0" in ready.message and "allocated to ns/a" in ready.message
    assert "placements offered to cut" in ready.message and held.message == ready.message
    assert held.phase == Phase.STABLE
    # A process outside DRA, a split outside dynamig, a claim that won a race: not bookings: InstanceBusy.
    for insts_, claims, notes in (
        ([instance("1g.5gb", 1, processes=1)], {}, ()),
        ([instance("2g.10gb", 0, ci_slices=1)], {}, ()),
        (insts, booked, ("kept gpu0-1g5gb-s5: allocated to ns/b a moment ago",)),
    ):
        other = floor_round(Inventory.PARTITIONABLE, insts_, claims, notes).condition(ConditionType.READY)
        assert other is not None and not other.is_true and other.reason == Reason.INSTANCE_BUSY, other
    # Instances: spec.layout is the whole layout the operator planned; an allocation in its way is a race.
    exact = floor_round(Inventory.INSTANCES, insts[:1], booked).condition(ConditionType.READY)
    assert exact is not None and not exact.is_true and exact.reason == Reason.INSTANCE_BUSY
