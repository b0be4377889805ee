"""A policy's ``migMode.offerWhole`` (operator/whole_offers.py): which governed GPUs offer their whole device
beside their slices (GpuPartition ``spec.offerWhole``), the operator's own ``Enabled`` replaced once one is
booked, how such a booking counts (operator/inventory.py) and what a waiting claim of one whole GPU is told
(operator/modes.py); and a reconciler round that writes all of it.

Real: the MIG geometry catalog, policy and GpuPartition parsing, the layout planner, CEL evaluation of the
claims' selectors. No API server: the round talks to the recording ``FakeKube`` of test_operator_modes.py
(the agent's side is tests/unit/test_agent_whole_offer.py; e2e/test_whole_offer.py runs both on the real
scheduler).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import pytest
from test_operator_modes import (
    CATALOG,
    DRIVER_CLASS,
    NODES,
    NOW,
    FakeKube,
    claim,
    gpu,
    pending,
    policy,
    stamp,
)

from dynamig.agent.modes.booked import requested_mode
from dynamig.agent.nvml.device import GpuInfo
from dynamig.kube.gpupartition import MigModeRequest, parse_gpu_partition
from dynamig.kube.policy import parse_policy
from dynamig.operator.decide import RoundInput, decide_round
from dynamig.operator.inventory import (
    MIG_MODE_REQUESTED_ANNOTATION,
    MIG_MODE_WRITTEN_ANNOTATION,
    WHOLE_OFFERED_BY_ANNOTATION,
    parse_inventory,
    switch_changes,
)
from dynamig.operator.kubeio import KubeIO, Snapshot
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.mode_round import ModeInput
from dynamig.operator.modes import decide_modes
from dynamig.operator.reconciler import Reconciler
from dynamig.operator.settings import OperatorSettings
from dynamig.operator.whole_offers import decide_whole_offers, ungoverned_whole_offers

OFFER = {"policy": "Dynamic", "offerWhole": True, "cooldownSeconds": 600}
IDLE_ONE = (("1g.10gb", 0, "free"),)
BUSY_ONE = (("1g.10gb", 0, "allocated"),)


def part(
    name: str,
    model: str = "H100-80GB",
    *,
    offered: bool = False,
    by: str = "",
    instances: Sequence[tuple[str, int, str]] = IDLE_ONE,
    annotations: Mapping[str, str] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """A GpuPartition of the partitionable inventory (``offered``: spec.offerWhole, ``by``: the policy that
    wrote it)."""
    notes = dict(annotations or {})
    if by:
        notes[WHOLE_OFFERED_BY_ANNOTATION] = by
    obj = gpu(name, model, instances=instances, annotations=notes, **kw)
    obj["status"]["inventory"] = "Partitionable"
    if offered:
        obj["spec"]["offerWhole"] = True
        obj["status"]["wholeOffered"] = not any(s != "free" for _, _, s in instances)
    return obj


def offers(
    parts: Sequence[dict[str, Any]], mig_mode: Mapping[str, Any] = OFFER, **spec: Any
) -> dict[str, bool]:
    pol = parse_policy(policy(mig_mode, **spec))
    decision = decide_whole_offers(pol, parse_inventory(parts, CATALOG), NOW)
    assert decision.booked == ()
    return {o.gpu: o.offer for o in decision.offers}


def test_a_dynamic_policy_offers_the_whole_device_of_its_partitionable_mig_gpus() -> None:
    assert offers([part("node-a-gpu0"), part("node-a-gpu1", instances=BUSY_ONE)]) == {
        "node-a-gpu0": True,
        "node-a-gpu1": True,  # the agent publishes it once nothing of the GPU is allocated
    }
    # the instances inventory: no counters keep the whole device and the slices apart
    instances = gpu("node-a-gpu0", instances=IDLE_ONE)
    assert offers([instances]) == {}
    # nothing without offerWhole, nothing under DryRun, and the policy's own offer is withdrawn
    assert offers([part("node-a-gpu0")], {"policy": "Dynamic"}) == {}
    assert offers([part("node-a-gpu0")], OFFER, mode="DryRun") == {}
    assert offers([part("node-a-gpu0", offered=True, by="fleet")], {"policy": "Dynamic"}) == {
        "node-a-gpu0": False
    }
    # written already: nothing to write
    assert offers([part("node-a-gpu0", offered=True, by="fleet")]) == {}


def test_no_offer_where_the_policy_would_not_switch_the_gpu_itself() -> None:
    a100 = part("node-a-gpu0", "A100-80GB", instances=(("1g.10gb", 0, "free"),))
    assert offers([a100]) == {}  # its switch resets the GPU
    assert offers([a100], {**OFFER, "allowReset": True}) == {"node-a-gpu0": True}
    recent = {MIG_MODE_WRITTEN_ANNOTATION: stamp(NOW - 30), MIG_MODE_REQUESTED_ANNOTATION: "Enabled"}
    switched = part("node-a-gpu0", ask="Enabled", annotations=recent)
    assert offers([switched]) == {}  # inside cooldownSeconds since it was switched on
    assert offers([switched], {**OFFER, "cooldownSeconds": 20}) == {"node-a-gpu0": True}
    off = part("node-a-gpu0", mig="Disabled")
    assert offers([off]) == {}  # published whole anyway
    # an offer of its own on a GPU that may no longer offer is withdrawn; a person's is left alone
    assert offers([part("node-a-gpu0", offered=True, by="fleet", ask="Enabled", annotations=recent)]) == {
        "node-a-gpu0": False
    }
    assert offers([part("node-a-gpu0", offered=True, ask="Enabled", annotations=recent)]) == {}


def test_min_mig_gpus_bounds_the_offers_idle_gpus_first() -> None:
    parts = [
        part("node-a-gpu0", instances=BUSY_ONE),
        part("node-a-gpu1"),
        part("node-a-gpu2", offered=True, by="fleet"),
        part("node-a-gpu3"),
    ]
    # 4 GPUs with MIG on, at least 2 kept: two offers, both on idle GPUs, the one offering already kept
    assert offers(parts, {**OFFER, "minMigGpus": 2}) == {"node-a-gpu1": True}
    assert offers(parts, {**OFFER, "minMigGpus": 3}) == {}
    assert offers(parts, {**OFFER, "minMigGpus": 4}) == {"node-a-gpu2": False}


def booked(ask: str | None, *, by_operator: bool = True, mig: str = "Enabled") -> dict[str, Any]:
    notes = {MIG_MODE_REQUESTED_ANNOTATION: ask or "", MIG_MODE_WRITTEN_ANNOTATION: stamp(NOW - 3600)}
    return part(
        "node-a-gpu0",
        offered=True,
        by="fleet",
        ask=ask,
        mig=mig,
        annotations=notes if by_operator else {},
    )


ALLOCATED = {"node-a": frozenset({"gpu0"})}


def test_a_booked_whole_device_counts_as_a_switch_off_outside_the_budget() -> None:
    (g,) = parse_inventory([booked("Enabled")], CATALOG, ALLOCATED)
    assert g.booked_whole and g.mode_asked is MigModeRequest.ENABLED
    assert g.mode_wanted is MigModeRequest.DISABLED and g.switching is MigModeRequest.DISABLED
    assert "whole device" in g.unusable  # nothing is planned on it
    assert switch_changes([g]) == set()  # the scheduler's booking: not the operator's to hold back
    (free,) = parse_inventory([booked("Enabled")], CATALOG)  # not allocated: an ordinary MIG GPU
    assert not free.booked_whole and free.switching is None and not free.unusable
    assert switch_changes(parse_inventory([booked("Disabled")], CATALOG)) == {("node-a", "node-a-gpu0")}
    # switched: the allocation keeps it whole, whatever the stale Enabled says
    (done,) = parse_inventory([booked("Enabled", mig="Disabled")], CATALOG, ALLOCATED)
    assert done.whole and done.switching is None


@pytest.mark.parametrize("ask", [None, "Enabled", "Disabled"])
@pytest.mark.parametrize("mig", ["Enabled", "Disabled"])
def test_the_operator_and_the_agent_work_toward_the_same_mode(ask: str | None, mig: str) -> None:
    """The operator plans around the mode the agent's round works toward: both read it from
    GpuPartitionSpec.pinned_whole/mode_toward; each reaches it from its own inputs (the claims' allocations
    on the node; the agent's NVML view and the claims on its devices)."""
    for offered, partitionable, allocated in itertools.product((False, True), repeat=3):
        obj = part("node-a-gpu0", offered=offered, ask=ask, mig=mig)
        if not partitionable:
            obj["status"]["inventory"] = "Instances"
        (view,) = parse_inventory([obj], CATALOG, ALLOCATED if allocated else {})
        on = int(mig == "Enabled")
        info = GpuInfo(0, "GPU-x", "NVIDIA H100 80GB HBM3", 0x2330, 0, on, on, CATALOG.model("H100-80GB"))
        claims = {"gpu0": ["ml/train"]} if allocated else {}
        agent = requested_mode(info, parse_gpu_partition(obj), partitionable, claims)
        case = f"offered={offered} partitionable={partitionable} allocated={allocated}"
        assert view.mode_wanted is agent, case
        assert view.booked_whole is (offered and partitionable and allocated), case


def test_the_operator_replaces_its_own_enabled_on_a_booked_gpu_and_keeps_the_offer() -> None:
    pol = parse_policy(policy(OFFER))
    gpus = parse_inventory([booked("Enabled")], CATALOG, ALLOCATED)
    decision = decide_whole_offers(pol, gpus, NOW)
    assert [b.gpu for b in decision.booked] == ["node-a-gpu0"]
    assert decision.booked[0].spec() == {"migMode": "Disabled", "layout": [], "offeredProfiles": []}
    assert decision.offers == ()  # never withdrawn while allocated
    # an Enabled a person wrote is theirs; nothing booked, nothing replaced
    assert (
        decide_whole_offers(
            pol, parse_inventory([booked("Enabled", by_operator=False)], CATALOG, ALLOCATED), NOW
        ).booked
        == ()
    )
    assert decide_whole_offers(pol, parse_inventory([booked("Enabled")], CATALOG), NOW).booked == ()
    # even under a policy that no longer offers, the booked GPU's offer stays
    plain = parse_policy(policy({"policy": "Dynamic"}))
    assert decide_whole_offers(plain, gpus, NOW).offers == ()


def test_offers_of_the_operator_on_gpus_no_policy_governs_are_withdrawn_unless_booked() -> None:
    gpus = parse_inventory(
        [part("node-a-gpu0", offered=True, by="fleet"), part("node-a-gpu1", offered=True)], CATALOG
    )
    assert [(w.gpu, w.offer) for w in ungoverned_whole_offers(gpus, {})] == [("node-a-gpu0", False)]
    assert ungoverned_whole_offers(gpus, {"node-a-gpu0": "fleet"}) == ()
    held = parse_inventory([booked(None)], CATALOG, ALLOCATED)
    assert ungoverned_whole_offers(held, {}) == ()


def test_a_claim_of_one_whole_gpu_waits_for_the_scheduler_where_a_gpu_offers_it() -> None:
    pol = parse_policy(policy(OFFER))
    gpus = parse_inventory([part("node-a-gpu0", offered=True, by="fleet")], CATALOG)
    pairs = [claim("train")]
    round_ = decide_round(RoundInput(pol, (), gpus, pending(pairs), NOW, {}, CATALOG))
    modes = decide_modes(ModeInput(pol, gpus, round_, NOW))
    assert modes.switches == () and modes.keeps == ()
    (v,) = modes.verdicts
    assert "offer(s) the whole GPU" in v.message and not v.warn
    # a claim of two: the offer alone cannot serve it, so the GPUs are switched as before
    two = parse_inventory(
        [part("node-a-gpu0", offered=True, by="fleet"), part("node-a-gpu1", offered=True, by="fleet")],
        CATALOG,
    )
    pairs = [claim("pair", count=2)]
    round_ = decide_round(RoundInput(pol, (), two, pending(pairs), NOW, {}, CATALOG))
    modes = decide_modes(ModeInput(pol, two, round_, NOW))
    assert {s.gpu for s in modes.switches} == {"node-a-gpu0", "node-a-gpu1"}


def round_snapshot(p: dict[str, Any], claims: Sequence[dict[str, Any]] = ()) -> Snapshot:
    return Snapshot(
        policies=(policy(OFFER),),
        partitions=(p,),
        nodes=({"metadata": {"name": "node-a", "labels": NODES["node-a"]}},),
        pods=(),
        claims=tuple(claims),
        device_classes=(DRIVER_CLASS,),
    )


def allocation(device: str) -> dict[str, Any]:
    c, _ = claim("train")
    c["status"] = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": "mig.dynamig.io", "pool": "node-a", "device": device}]}}}  # fmt: skip
    return c


async def test_a_round_writes_the_offer_then_disabled_for_the_booking() -> None:
    kube = FakeKube(round_snapshot(part("node-a-gpu0")))
    metrics = OperatorMetrics()
    rec = Reconciler(cast(KubeIO, kube), CATALOG, metrics, OperatorSettings())
    await rec.round("fleet")
    ((name, spec, annotations),) = kube.writes
    assert (name, spec.get("offerWhole"), annotations.get(WHOLE_OFFERED_BY_ANNOTATION)) == (
        "node-a-gpu0",
        True,
        "fleet",
    )
    (told,) = [e for e in kube.events if e[2] == "WholeOffered"]
    assert told[0]["kind"] == "GpuPartition" and "offers its whole device" in told[3]

    # The scheduler booked the whole device of a GPU the operator had switched on: Disabled in its place.
    kube.snap = round_snapshot(booked("Enabled"), [allocation("gpu0")])
    kube.writes.clear()
    kube.events.clear()
    before = time.time()
    await rec.round("fleet")
    ((name, spec, annotations),) = kube.writes
    assert spec["migMode"] == "Disabled" and "offerWhole" not in spec
    assert annotations[MIG_MODE_REQUESTED_ANNOTATION] == "Disabled"
    assert annotations[MIG_MODE_WRITTEN_ANNOTATION] >= stamp(before - 1)
    (event,) = [e for e in kube.events if e[2] == "WholeGpuBooked"]
    assert event[0]["kind"] == "GpuPartition" and "stays whole" in event[3]
    offers = "dynamig_operator_whole_offers"
    assert metrics.registry.get_sample_value(offers, {"policy": "fleet", "state": "booked"}) == 1
    assert metrics.registry.get_sample_value(offers, {"policy": "fleet", "state": "published"}) == 1


def test_a_gpu_switching_off_for_the_booking_of_its_whole_device_is_no_supply_for_another_claim() -> None:
    pol = parse_policy(policy(OFFER))
    gpus = parse_inventory([booked("Enabled"), part("node-a-gpu1")], CATALOG, ALLOCATED)
    pairs = [claim("other")]
    round_ = decide_round(RoundInput(pol, (), gpus, pending(pairs), NOW, {}, CATALOG))
    modes = decide_modes(ModeInput(pol, gpus, round_, NOW))
    # not "node-a-gpu0 is being switched off for it": that switch is the booking's
    (v,) = modes.verdicts
    assert "node-a-gpu0" not in v.message, v.message


def test_a_gpu_switching_off_for_the_booking_of_its_whole_device_is_never_kept_or_drained_for_another() -> (
    None
):
    """A node drained for a claim of two whole GPUs never takes a GPU whose offered whole device another
    claim booked (its switch is that booking's; a hold there would turn the booking away), nor counts its
    node as idle: with only one other GPU on the node, nothing is kept there."""
    pol = parse_policy(policy({**OFFER, "drainNodeAfterSeconds": 0}))
    gpus = parse_inventory([booked("Enabled"), part("node-a-gpu1")], CATALOG, ALLOCATED)
    pairs = [claim("big", count=2)]
    round_ = decide_round(RoundInput(pol, (), gpus, pending(pairs), NOW, {}, CATALOG))
    modes = decide_modes(ModeInput(pol, gpus, round_, NOW))
    assert modes.keeps == () and modes.switches == ()
    # the same node without the booking: drained for the pair (both GPUs kept whole for it)
    free = parse_inventory([booked("Enabled"), part("node-a-gpu1", instances=BUSY_ONE)], CATALOG)
    round_ = decide_round(RoundInput(pol, (), free, pending(pairs), NOW, {}, CATALOG))
    kept = decide_modes(ModeInput(pol, free, round_, NOW)).keeps
    assert sorted(k.gpu for k in kept) == ["node-a-gpu0", "node-a-gpu1"]
