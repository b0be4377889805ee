"""A whole GPU offered beside its MIG slices (GpuPartition ``spec.offerWhole``): when it is offered, the MIG
mode its booking asks, what holds that switch back, and how the booking is answered. Pure functions
(agent/modes/booked.py, agent/modes/switch.py, agent/bindings/decide.py, agent/bindings/answering.py); the
e2e test ``e2e/test_whole_offer.py`` runs them on the real scheduler."""

from __future__ import annotations

from dynamig.agent.bindings.answering import refusals
from dynamig.agent.bindings.decide import (
    REASON_MIG_ENABLED,
    REASON_PLACEMENT_TAKEN,
    Failed,
    GpuState,
    Ready,
    SwitchFirst,
    decide,
)
from dynamig.agent.bindings.holds import REASON_PLACEMENT_HELD
from dynamig.agent.layout.reconcile import Observed
from dynamig.agent.modes.booked import booked_by, offers_whole, requested_mode, whole_bookable
from dynamig.agent.modes.switch import gpu_users
from dynamig.agent.nvml.device import GpuInfo
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance
from dynamig.kube.gpupartition import GpuPartition, Hold, MigModeRequest, Reason

MODEL = load_catalog().model("H100-80GB")
UUID = "GPU-x"
FREE = Observed(PlacedInstance(0, "1g.10gb"), has_compute_instance=True)


def gpu(mig: int = 1, pending: int | None = None) -> GpuInfo:
    return GpuInfo(
        0, UUID, "NVIDIA H100 80GB HBM3", 0x2330, 0, mig, mig if pending is None else pending, MODEL
    )


def part(**spec: object) -> GpuPartition:
    return GpuPartition.model_validate({"metadata": {"name": "n1-gpu0"}, "spec": spec})


def test_offered_only_in_the_partitionable_inventory_with_mig_on_and_not_asked_off() -> None:
    offer = part(offerWhole=True)
    assert offers_whole(gpu(), offer, partitionable=True)
    assert not offers_whole(gpu(), offer, partitionable=False)  # no counters: nothing could exclude it
    assert not offers_whole(gpu(mig=0), offer, partitionable=True)  # MIG off: published whole anyway
    assert not offers_whole(gpu(), part(), partitionable=True)
    # a GPU a policy switched on (spec.migMode Enabled, the operator's) offers too
    assert offers_whole(gpu(), part(offerWhole=True, migMode="Enabled"), partitionable=True)
    assert not offers_whole(gpu(), part(offerWhole=True, migMode="Disabled"), partitionable=True)
    assert offers_whole(gpu(pending=0), offer, partitionable=True)  # its own switch under way
    # a booking made while offered stays the switch's when the operator then writes Disabled
    assert whole_bookable(gpu(), part(offerWhole=True, migMode="Disabled"), partitionable=True)
    assert not whole_bookable(gpu(mig=0), offer, partitionable=True)


def test_a_booking_of_the_whole_device_asks_mig_off_and_nothing_else_does() -> None:
    offer = part(offerWhole=True)
    booked = {"gpu0": ["ml/train"], "gpu1": ["ml/other"]}
    assert booked_by(gpu(), offer, True, booked) == ("ml/train",)
    assert requested_mode(gpu(), offer, True, booked) is MigModeRequest.DISABLED
    assert requested_mode(gpu(), offer, True, {"gpu0-1g10gb-s0": ["ml/a"]}) is None
    assert booked_by(gpu(mig=0), offer, True, booked) == ()  # switched: served whole from here on
    assert requested_mode(gpu(mig=0), part(migMode="Enabled"), True, booked) is MigModeRequest.ENABLED
    # Enabled asked before the booking (by a policy that switched the GPU on): the booking's switch first,
    # and once MIG is off its allocation pins the GPU whole; the Enabled applies again once it ends
    enabled = part(offerWhole=True, migMode="Enabled")
    assert booked_by(gpu(), enabled, True, booked) == ("ml/train",)
    assert requested_mode(gpu(), enabled, True, booked) is MigModeRequest.DISABLED
    assert requested_mode(gpu(mig=0), enabled, True, booked) is MigModeRequest.DISABLED
    assert requested_mode(gpu(mig=0), enabled, True, {}) is MigModeRequest.ENABLED
    assert requested_mode(gpu(mig=0), enabled, False, booked) is MigModeRequest.ENABLED  # no offer there
    # the operator wrote Disabled for the booking while MIG is still on: still the booking's switch
    disabled = part(offerWhole=True, migMode="Disabled")
    assert booked_by(gpu(), disabled, True, booked) == ("ml/train",)
    assert requested_mode(gpu(), disabled, True, booked) is MigModeRequest.DISABLED


def test_the_answer_refuses_a_gpu_switching_for_anything_but_the_booking_it_answers() -> None:
    def refuse(p: GpuPartition, allocated: dict[str, list[str]], g: GpuInfo | None = None) -> object:
        check = refusals("n1", {"n1-gpu0": p}, None, {}, part(), True, allocated)
        found = check(g or gpu())
        return found[0] if found else None

    booked = {"gpu0": ["ml/train"]}
    assert refuse(part(offerWhole=True), booked) is None
    assert refuse(part(offerWhole=True, migMode="Enabled"), booked) is None
    assert refuse(part(offerWhole=True, migMode="Disabled"), booked) is None
    # MIG off, the whole device allocated under a stale Enabled: served whole (the answer's MigDisabled)
    assert refuse(part(offerWhole=True, migMode="Enabled"), booked, gpu(mig=0)) == Reason.MIG_DISABLED
    # a switch nobody booked: bookings from older slices fail
    assert refuse(part(migMode="Disabled"), {"gpu0-1g10gb-s0": ["ml/a"]}) == Reason.MIG_MODE_DRAINING
    assert refuse(part(offerWhole=True, migMode="Disabled"), {}) == Reason.MIG_MODE_DRAINING
    assert refuse(part(offerWhole=True, migMode="Disabled"), booked, gpu()) is None  # booked: answered


def test_the_booking_a_switch_is_for_does_not_hold_it_back() -> None:
    claims = {"gpu0": ["ml/train"], "gpu0-1g10gb-s0": ["ml/a"]}
    assert gpu_users(0, claims, (), 0, booked=("ml/train",)) == ["gpu0-1g10gb-s0 allocated to ml/a"]
    assert gpu_users(0, {"gpu0": ["ml/train", "ml/b"]}, (), 0, booked=("ml/train",)) == [
        "gpu0 allocated to ml/b, ml/train"
    ]
    assert gpu_users(0, {"gpu0": ["ml/train"]}, (), 0) == ["gpu0 allocated to ml/train"]


def test_the_booking_waits_for_the_switch_after_its_free_instances_go() -> None:
    offering = GpuState(0, MODEL, True, (FREE,), uuid=UUID, offers_whole=True)
    answer = decide("gpu0", "ml/train", [offering])
    assert answer == SwitchFirst(0, (FREE.placed,))
    assert decide(
        "gpu0", "ml/train", [GpuState(0, MODEL, True, uuid=UUID, offers_whole=True)]
    ) == SwitchFirst(0)
    # NVML reports the switch pending (an Ampere reset): still the switch under way, not a refusal
    pending = GpuState(0, MODEL, True, refused=(Reason.MIG_MODE_PENDING, "pending"), offers_whole=True)
    assert decide("gpu0", "ml/train", [pending]) == SwitchFirst(0)
    # Not offered: MIG on is no whole GPU
    refused = decide("gpu0", "ml/train", [GpuState(0, MODEL, True, uuid=UUID)])
    assert isinstance(refused, Failed) and refused.reason == REASON_MIG_ENABLED
    # Work arrived on the GPU since: booked again elsewhere, nothing destroyed
    busy = Observed(PlacedInstance(0, "1g.10gb"), processes=2, has_compute_instance=True)
    taken = decide("gpu0", "ml/train", [GpuState(0, MODEL, True, (busy,), uuid=UUID, offers_whole=True)])
    assert isinstance(taken, Failed) and taken.reason == REASON_PLACEMENT_TAKEN
    # Kept whole for another claim
    hold = Hold.model_validate(
        {"claim": "ml/other", "profile": "whole", "start": 0, "expiresAt": "2099-01-01T00:00:00Z"}
    )
    kept = GpuState(0, MODEL, True, uuid=UUID, offers_whole=True, whole_hold=hold)
    held = decide("gpu0", "ml/train", [kept])
    assert isinstance(held, Failed) and held.reason == REASON_PLACEMENT_HELD
    # MIG off: ready with the GPU's UUID
    off = GpuState(0, MODEL, False, refused=(Reason.MIG_DISABLED, "off"), uuid=UUID)
    ready = decide("gpu0", "ml/train", [off])
    assert isinstance(ready, Ready) and ready.whole and ready.mig_uuid == UUID
