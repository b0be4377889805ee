"""The agent's answer to an allocation (``dynamig.agent.bindings.decide.decide``): ready, cut, or failed.
Pure."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamig.agent.bindings.answering import admin_allocations, ordinary_holders
from dynamig.agent.bindings.decide import (
    REASON_ADMIN_NO_INSTANCE,
    REASON_LAYOUT_RULE,
    REASON_MIG_DISABLED,
    REASON_PLACEMENT_TAKEN,
    REASON_UNKNOWN_DEVICE,
    Cut,
    Enumerate,
    Failed,
    GpuState,
    Ready,
    decide,
)
from dynamig.agent.bindings.holds import REASON_PLACEMENT_HELD
from dynamig.agent.layout.reconcile import Observed
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import check_layout, parse_layout
from dynamig.geometry.model import PlacedInstance, device_name
from dynamig.kube.gpupartition import Hold, HoldKind

A100 = load_catalog().model("A100-80GB")
A30 = load_catalog().model("A30-24GB")
ME = "team/claim-a"


def gpu(*observed: Observed, index: int = 0, mig: bool = True) -> GpuState:
    uuids = {o.placed: f"MIG-{o.placed.profile}-{o.placed.start}" for o in observed if o.has_compute_instance}
    return GpuState(index, A100, mig, tuple(observed), uuids)


def free(layout: str) -> tuple[Observed, ...]:
    return tuple(Observed(p) for p in parse_layout(layout))


def test_an_existing_free_instance_is_ready_at_once() -> None:
    answer = decide("gpu0-1g10gb-s6", ME, [gpu(*free("3g.40gb@0,1g.10gb@6"))])
    assert answer == Ready(0, PlacedInstance(6, "1g.10gb"), "MIG-1g.10gb-6")


def test_an_allocation_by_the_claim_itself_does_not_block_it() -> None:
    mine = Observed(PlacedInstance(6, "1g.10gb"), claims=(ME,))
    assert isinstance(decide("gpu0-1g10gb-s6", ME, [gpu(mine)]), Ready)


def test_a_free_placement_is_cut_and_free_instances_in_the_way_are_destroyed() -> None:
    assert decide("gpu0-1g10gb-s2", ME, [gpu()]) == Cut(0, PlacedInstance(2, "1g.10gb"))
    answer = decide("gpu0-3g40gb-s4", ME, [gpu(*free("1g.10gb@0,1g.10gb@4,2g.20gb@6"))])
    assert answer == Cut(0, PlacedInstance(4, "3g.40gb"), parse_layout("1g.10gb@4,2g.20gb@6"))


@pytest.mark.parametrize(
    ("busy", "why"),
    [
        (Observed(PlacedInstance(2, "1g.10gb"), claims=("team/other",)), "allocated to team/other"),
        (Observed(PlacedInstance(2, "1g.10gb"), processes=2), "2 process(es)"),
        (Observed(PlacedInstance(2, "1g.10gb"), prepared=True), "prepared for a pod"),
        (Observed(PlacedInstance(2, "2g.20gb"), partitioned="2 compute instance(s)"), "outside dynamig"),
    ],
)
def test_a_busy_instance_in_the_way_fails_the_binding_and_is_never_touched(busy: Observed, why: str) -> None:
    answer = decide("gpu0-4g40gb-s0", ME, [gpu(busy)])
    assert isinstance(answer, Failed) and answer.reason == REASON_PLACEMENT_TAKEN and why in answer.message


def test_the_instance_itself_held_by_another_claim_or_used_outside_dra_fails() -> None:
    other = Observed(PlacedInstance(6, "1g.10gb"), claims=("team/other",))
    assert decide("gpu0-1g10gb-s6", ME, [gpu(other)]) == Failed(
        REASON_PLACEMENT_TAKEN, "gpu0-1g10gb-s6: allocated to team/other"
    )
    used = Observed(PlacedInstance(6, "1g.10gb"), processes=1)
    assert isinstance(decide("gpu0-1g10gb-s6", ME, [gpu(used)]), Failed)


def test_a_gpu_instance_missing_its_compute_instance_is_completed() -> None:
    bare = Observed(PlacedInstance(6, "1g.10gb"), has_compute_instance=False)
    assert decide("gpu0-1g10gb-s6", ME, [gpu(bare)]) == Cut(0, PlacedInstance(6, "1g.10gb"))


def test_unknown_names_other_gpus_and_mig_off() -> None:
    assert decide("gpu0-1g10gb-s7", ME, [gpu()]).reason == REASON_UNKNOWN_DEVICE  # type: ignore[union-attr]
    assert decide("gpu3-1g10gb-s0", ME, [gpu()]).reason == REASON_UNKNOWN_DEVICE  # type: ignore[union-attr]
    assert decide("gpu1-1g10gb-s0", ME, [gpu(), gpu(index=1)]) == Cut(1, PlacedInstance(0, "1g.10gb"))
    answer = decide("gpu0-1g10gb-s0", ME, [gpu(mig=False)])
    assert isinstance(answer, Failed) and answer.reason == REASON_MIG_DISABLED


def test_a_rule_beyond_overlap_fails_the_binding() -> None:
    """A30: one media-engine (+me) instance per GPU. Counters make the scheduler respect it; the answer
    re-checks it against the catalog's rules anyway."""
    state = GpuState(0, A30, True, free("1g.6gb+me@0"), {})
    answer = decide(device_name(0, "2g.12gb+me", 2), ME, [state])
    assert isinstance(answer, Failed) and answer.reason == REASON_LAYOUT_RULE


_A100_PLACEMENTS = [PlacedInstance(s, p.name) for p in A100.profiles for s in p.placement_starts]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(_A100_PLACEMENTS), max_size=6, unique=True),
    st.sets(st.integers(0, 5)),
    st.sampled_from(_A100_PLACEMENTS),
)
def test_a_cut_never_destroys_anything_busy_and_always_yields_a_valid_layout(
    existing: list[PlacedInstance], busy_idx: set[int], target: PlacedInstance
) -> None:
    # Keep only a valid existing layout (NVML would never report anything else).
    layout: list[PlacedInstance] = []
    for p in existing:
        if check_layout(A100, [*layout, p]) is None:
            layout.append(p)
    observed = tuple(Observed(p, processes=1 if i in busy_idx else 0) for i, p in enumerate(layout))
    answer = decide(device_name(0, target.profile, target.start), ME, [gpu(*observed)])
    busy = {o.placed for o in observed if o.busy}
    if isinstance(answer, Cut):
        assert not busy & set(answer.destroy)
        after = [p for p in layout if p not in answer.destroy]
        assert answer.create == target
        assert check_layout(A100, [*(p for p in after if p != target), target]) is None
    elif isinstance(answer, Ready):
        assert target in layout and target not in busy
    else:
        assert isinstance(answer, Failed), answer  # every whole instance here has its UUID: no Enumerate
        assert answer.reason in (REASON_PLACEMENT_TAKEN, REASON_LAYOUT_RULE)


# --- admin access, refused GPUs, MIG devices not yet enumerated ------------------------------------------


@pytest.mark.parametrize("target", _A100_PLACEMENTS)
def test_an_admin_access_allocation_never_cuts_nor_destroys(target: PlacedInstance) -> None:
    # Free instances everywhere a cut could destroy them, one of them held by an ordinary claim.
    held = Observed(PlacedInstance(6, "1g.10gb"), claims=("team/other",))
    state = gpu(*free("3g.40gb@0,2g.20gb@4"), held)
    answer = decide(device_name(0, target.profile, target.start), "ops/monitor", [state], admin=True)
    existing = {o.placed for o in state.observed}
    if target in existing:  # shared with whoever holds it: admin access ignores ordinary claims
        assert answer == Ready(0, target, f"MIG-{target.profile}-{target.start}")
    else:
        assert isinstance(answer, Failed) and answer.reason == REASON_ADMIN_NO_INSTANCE, answer
    # The same allocation without admin access would have cut somewhere: admin access is what stops it.
    ordinary = [decide(device_name(0, p.profile, p.start), ME, [state]) for p in _A100_PLACEMENTS]
    assert any(isinstance(a, Cut) and a.destroy for a in ordinary)


def test_admin_access_holders_do_not_block_an_ordinary_answer() -> None:
    claims = [
        {
            "metadata": {"namespace": "ops", "name": "monitor"},
            "status": {"allocation": {"devices": {"results": [
                {"driver": "mig.dynamig.io", "pool": "n1", "device": "gpu0-1g10gb-s6", "adminAccess": True},
            ]}}},
        },
        {
            "metadata": {"namespace": "team", "name": "claim-a"},
            "status": {"allocation": {"devices": {"results": [
                {"driver": "mig.dynamig.io", "pool": "n1", "device": "gpu0-1g10gb-s6"},
                {"driver": "other.example", "pool": "n1", "device": "gpu0-1g10gb-s5", "adminAccess": True},
            ]}}},
        },
    ]  # fmt: skip
    assert admin_allocations(claims, "mig.dynamig.io", "n1") == {("ops/monitor", "gpu0-1g10gb-s6")}
    holders = ordinary_holders(claims, "mig.dynamig.io", "n1")
    assert holders == {"gpu0-1g10gb-s6": [ME]}
    inst = Observed(PlacedInstance(6, "1g.10gb"), claims=tuple(holders["gpu0-1g10gb-s6"]))
    assert isinstance(decide("gpu0-1g10gb-s6", ME, [gpu(inst)]), Ready)


@pytest.mark.parametrize(
    "refused",
    [
        ("MigModePending", "MIG mode change pending; the GPU needs a reset"),
        ("GpuReplaced", "this GpuPartition describes GPU GPU-old, but index 0 is now GPU-new"),
        ("ForeignMigOwner", "not managing this GPU: driver gpu.nvidia.com publishes MIG devices"),
    ],
)
def test_an_allocation_on_a_refused_gpu_fails_with_the_refusal_and_is_never_cut(
    refused: tuple[str, str],
) -> None:
    state = dataclasses.replace(gpu(*free("1g.10gb@0,1g.10gb@1")), refused=refused)
    for device in ("gpu0-1g10gb-s0", "gpu0-7g80gb-s0", "gpu0-1g10gb-s4"):  # ready, cut over, cut
        answer = decide(device, ME, [state])
        assert isinstance(answer, Failed) and answer.reason == refused[0], answer
        assert refused[1] in answer.message and device in answer.message
        assert isinstance(decide(device, ME, [dataclasses.replace(state, refused=None)]), Ready | Cut)


def test_a_whole_instance_without_a_mig_uuid_is_read_again_never_answered_ready_empty() -> None:
    state = GpuState(0, A100, True, free("1g.10gb@6"), {PlacedInstance(6, "1g.10gb"): ""})
    assert decide("gpu0-1g10gb-s6", ME, [state]) == Enumerate(0, PlacedInstance(6, "1g.10gb"))
    assert decide("gpu0-1g10gb-s6", "ops/monitor", [state], admin=True) == Enumerate(
        0, PlacedInstance(6, "1g.10gb")
    )


def test_a_mig_gpu_kept_whole_for_a_claim_of_whole_gpus_answers_every_other_booking_held() -> None:
    """A GPU the operator keeps whole for a claim of whole GPUs (a hold of kind Whole) while its MIG mode is
    still on: a booking of its free instance or of a placement by any claim fails PlacementHeld naming the
    claim, so the scheduler books it elsewhere; the same GPU without the hold answers as before."""
    kept = Hold(
        claim="ml/big", kind=HoldKind.WHOLE, profile="whole", start=0, expires_at="2099-01-01T00:00:00Z"
    )
    state = dataclasses.replace(gpu(*free("3g.40gb@0,1g.10gb@6")), whole_hold=kept)
    for device in ("gpu0-1g10gb-s6", "gpu0-1g10gb-s5"):
        answer = decide(device, ME, [state])
        assert isinstance(answer, Failed) and answer.reason == REASON_PLACEMENT_HELD, answer
        assert "kept whole for claim ml/big" in answer.message, answer.message
    assert isinstance(decide("gpu0-1g10gb-s6", ME, [gpu(*free("3g.40gb@0,1g.10gb@6"))]), Ready)
