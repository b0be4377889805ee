"""The agent's per-GPU decisions as pure functions: no NVML, no API server."""

from __future__ import annotations

from dynamig.agent.gpu_status import (
    degraded_status,
    gpu_status,
    managed_status,
    mig_device,
    partitionable_offer,
    readiness,
    refusal,
    refused_status,
)
from dynamig.agent.nvml_device import ComputeInstance, GpuInfo, MigInstance
from dynamig.agent.reconcile import GpuPlan, Waiting
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance, device_name
from dynamig.kube.gpupartition import (
    ConditionType,
    GpuPartition,
    InstanceState,
    Inventory,
    Phase,
    Reason,
)

MODEL = load_catalog().model("A100-40GB")
STAMP = "2026-12-03T08:00:00Z"


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


def partition(uuid: str = "", offered: list[str] | None = None) -> GpuPartition:
    spec: dict[str, object] = {"node": "n1", "gpuIndex": 0, "layout": []}
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
