"""One planning round of the operator: modes, cooldown, disruption budget, drift to baseline, and the
"why pending?" verdicts.

Real: the layout planner, the MIG geometry catalog, CEL evaluation of the claims' selectors, and the parsing
of GpuPartition and policy dicts. The cluster is described by plain values (no API server); time is a value.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance
from dynamig.kube.policy import (
    check_spec_against_catalog,
    parse_policy,
    resolve_ownership,
    warm_pool_shortfall,
)
from dynamig.operator.decide import RoundDecision, RoundInput, decide_round
from dynamig.operator.demand import PendingClaim, extract_demand, parse_device_classes
from dynamig.operator.inventory import GpuView, allocated_devices, parse_inventory
from dynamig.operator.verdicts import Reason

CATALOG = load_catalog()
NOW = 1_800_000_000.0
PROFILE = 'device.attributes["mig.dynamig.io"].profile'
CLASSES = parse_device_classes(
    [
        {
            "metadata": {"name": "mig.dynamig.io"},
            "spec": {"selectors": [{"cel": {"expression": 'device.driver == "mig.dynamig.io"'}}]},
        }
    ]
)
BASELINE = [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]


def partition(
    index: int, instances: list[tuple[str, int, str]], written: str | None = None, gen: int = 1
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"node-a-gpu{index}", "generation": gen, "resourceVersion": "7"}
    if written:
        meta["annotations"] = {"dynamig.io/layout-written-at": written}
    return {
        "metadata": meta,
        "spec": {"layout": [{"profile": p, "start": s} for p, s, _ in instances]},
        "status": {
            "node": "node-a",
            "gpuIndex": index,
            "product": "NVIDIA A100-SXM4-80GB",
            "model": "A100-80GB",
            "migMode": "Enabled",
            "observedGeneration": gen,
            "phase": "Stable",
            "instances": [
                {"profile": p, "start": s, "deviceName": f"gpu{index}-{p}-s{s}", "state": st}
                for p, s, st in instances
            ],
        },
    }


def baseline_gpu(index: int, **kw: Any) -> dict[str, Any]:
    return partition(index, [("3g.40gb", 0, "free"), ("3g.40gb", 4, "free")], **kw)


def policy(**spec: Any) -> dict[str, Any]:
    base = {
        "mode": "Dynamic",
        "baseline": {"A100-80GB": BASELINE},
        "cooldownSeconds": 60,
        "batchWindowSeconds": 1,
    }
    return {
        "metadata": {"name": "morning", "generation": 3, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {**base, **spec},
    }


def burst(n: int, first: str = "1g.10gb", fallback: str = "2g.20gb") -> tuple[PendingClaim, ...]:
    claims, pods = [], []
    for i in range(n):
        alts = [
            {
                "name": "a",
                "deviceClassName": "mig.dynamig.io",
                "selectors": [{"cel": {"expression": f'{PROFILE} == "{first}"'}}],
            },
            {
                "name": "b",
                "deviceClassName": "mig.dynamig.io",
                "selectors": [{"cel": {"expression": f'{PROFILE} == "{fallback}"'}}],
            },
        ]
        claims.append({
            "metadata": {"name": f"infer-{i}", "namespace": "ml", "uid": f"u{i}",
                         "creationTimestamp": f"2026-01-01T08:00:{i:02d}Z"},
            "spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": alts}]}},
        })  # fmt: skip
        pods.append({
            "metadata": {"name": f"infer-{i}", "namespace": "ml", "uid": f"p{i}"},
            "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": f"infer-{i}"}]},
            "status": {"conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
        })  # fmt: skip
    model = CATALOG.model("A100-80GB")
    return extract_demand(claims, pods, CLASSES, (model,), {"node-a": {}}).pending


def run(
    pol: dict[str, Any],
    parts: list[dict[str, Any]],
    claims: tuple[PendingClaim, ...],
    idle: dict[str, float] | None = None,
) -> tuple[RoundDecision, tuple[GpuView, ...]]:
    p = parse_policy(pol)
    gpus = parse_inventory(parts, CATALOG)
    problems = tuple(check_spec_against_catalog(p.spec, CATALOG))
    return decide_round(RoundInput(p, problems, gpus, claims, NOW, idle or {}, CATALOG)), gpus


def test_dynamic_burst_reshapes_within_the_budget_and_explains_each_claim() -> None:
    decision, _ = run(policy(), [baseline_gpu(0), baseline_gpu(1)], burst(7))
    assert len(decision.writes) == 1  # budget: one GPU at a time
    (w,) = decision.writes
    assert w.before == (PlacedInstance(0, "3g.40gb"), PlacedInstance(4, "3g.40gb"))
    assert all(i.profile in ("1g.10gb", "2g.20gb") for i in w.layout)
    reasons = decision.pending_by_reason()
    assert sum(reasons.values()) == 7
    assert reasons.get(Reason.RESHAPE_SCHEDULED.value, 0) == len(w.claims) > 0
    for v in decision.verdicts:
        if v.reason is Reason.RESHAPE_SCHEDULED:
            assert v.gpu == w.gpu and "3g.40gb@0,3g.40gb@4" in v.message
    assert decision.pending_by_profile() == {"1g.10gb": 7}


def test_budget_of_two_lets_both_gpus_change() -> None:
    decision, _ = run(
        policy(disruptionBudget={"maxGpusReshaping": 2}), [baseline_gpu(0), baseline_gpu(1)], burst(9)
    )
    assert sum(1 for v in decision.verdicts if v.reason is Reason.RESHAPE_SCHEDULED) == 9
    assert len(decision.writes) == 2


def test_busy_instances_are_never_in_a_write_that_drops_them() -> None:
    busy = partition(0, [("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "free")])
    decision, _ = run(policy(), [busy], burst(3))
    (w,) = decision.writes
    assert PlacedInstance(0, "3g.40gb") in w.layout


def test_static_policy_writes_nothing_and_says_why() -> None:
    decision, _ = run(policy(mode="Static"), [baseline_gpu(0), baseline_gpu(1)], burst(7))
    assert decision.writes == () and decision.planned == ()
    assert decision.pending_by_reason() == {"ReshapeDisabled": 7}
    msg = decision.verdicts[0].message
    assert "Static" in msg and "4x 3g.40gb" in msg and "1g.10gb or 2g.20gb" in msg


def test_static_policy_points_at_existing_free_instances() -> None:
    gpu = partition(0, [("1g.10gb", 0, "free"), ("3g.40gb", 4, "free")])
    decision, _ = run(policy(mode="Static"), [gpu], burst(1))
    assert decision.verdicts[0].reason is Reason.WAITING_FOR_SCHEDULER


def test_dry_run_plans_but_writes_nothing() -> None:
    decision, _ = run(policy(mode="DryRun"), [baseline_gpu(0), baseline_gpu(1)], burst(2))
    assert decision.writes == ()
    assert decision.planned
    assert {v.reason for v in decision.verdicts} == {Reason.WOULD_RESHAPE}


def test_recently_reshaped_gpu_waits_for_cooldown() -> None:
    recent = "2027-01-15T08:00:00Z"  # NOW is 2027-01-15T08:00:00Z
    decision, _ = run(policy(), [baseline_gpu(0, written=recent)], burst(2))
    assert decision.writes == ()
    v1, _ = decision.verdicts
    assert v1.reason is Reason.WAITING_FOR_COOLDOWN
    assert "cooldown 60s (60s left)" in v1.message


def test_a_gpu_in_its_cooldown_gains_instances_in_free_slices_and_re_cuts_go_elsewhere() -> None:
    # gpu0 was cut for earlier claims 2 s ago: memory slices 2-3 are free and a free 3g.40gb sits at 4. Two
    # of the four new claims get 1g.10gb instances cut into slices 2 and 3 at once (nothing on gpu0 is
    # destroyed, so the cooldown does not hold them); the free 3g.40gb may not be destroyed for the other
    # two, which are planned and written on gpu1, at the baseline and free to be cut.
    cut = [("1g.10gb", 0, "allocated"), ("1g.10gb", 1, "allocated"), ("3g.40gb", 4, "free")]
    recent = partition(0, cut, written="2027-01-15T07:59:58Z")
    decision, _ = run(policy(disruptionBudget={"maxGpusReshaping": 2}), [recent, baseline_gpu(1)], burst(4))
    by_gpu = {w.gpu: w for w in decision.writes}
    assert set(by_gpu) == {"node-a-gpu0", "node-a-gpu1"}
    gpu0 = by_gpu["node-a-gpu0"]
    assert set(gpu0.before) <= set(gpu0.layout)  # every instance gpu0 had is kept
    assert set(gpu0.layout) - set(gpu0.before) == {PlacedInstance(2, "1g.10gb"), PlacedInstance(3, "1g.10gb")}
    assert len(gpu0.claims) == 2 and len(by_gpu["node-a-gpu1"].claims) == 2
    assert {v.reason for v in decision.verdicts} == {Reason.RESHAPE_SCHEDULED}


def test_a_burst_split_across_two_rounds_is_cut_on_the_same_gpu_within_its_cooldown() -> None:
    # The first claim of a burst got gpu0 cut to a 1g.10gb 2 s ago (cooldown 60 s); the rest of the burst
    # comes a round later and gpu0 is the only GPU. Before, it waited out the cooldown; now gpu0 gains the
    # instances in its free slices and nothing it has is touched.
    first = partition(0, [("1g.10gb", 0, "allocated")], written="2027-01-15T07:59:58Z")
    decision, _ = run(policy(), [first], burst(3))
    (w,) = decision.writes
    assert w.gpu == "node-a-gpu0" and len(w.claims) == 3
    assert PlacedInstance(0, "1g.10gb") in w.layout and len(w.layout) == 4
    assert {v.reason for v in decision.verdicts} == {Reason.RESHAPE_SCHEDULED}


def test_a_gpu_in_its_cooldown_is_not_re_cut_and_the_claim_is_told_why() -> None:
    # gpu0 holds a free 3g.40gb at slice 0; a 4g.40gb needs it destroyed, which waits for the cooldown.
    cut = [("3g.40gb", 0, "free"), ("1g.10gb", 4, "allocated")]
    recent = partition(0, cut, written="2027-01-15T07:59:58Z")
    decision, _ = run(policy(), [recent], burst(1, "4g.40gb", "4g.40gb"))
    assert decision.writes == ()
    (v,) = decision.verdicts
    assert v.reason is Reason.WAITING_FOR_COOLDOWN
    assert "without a re-cut" in v.message and "cooldown 60s (58s left)" in v.message


def test_a_layout_the_agent_could_not_apply_is_not_rewritten_and_claims_go_elsewhere() -> None:
    # gpu0's spec asks for 1g.10gb instances the agent could not create (NVML refused); rewriting the same
    # layout each round would loop. The claims are planned on gpu1 instead; gpu0 is held with the reason.
    failed = partition(0, [("3g.40gb", 0, "free"), ("3g.40gb", 4, "free")])
    failed["spec"]["layout"] = [{"profile": "1g.10gb", "start": s} for s in range(7)]
    failed["status"]["conditions"] = [
        {"type": "Ready", "status": "False", "reason": "InsufficientResources", "observedGeneration": 1,
         "message": "NVML refused to create 1g.10gb at memory slice 0",
         "lastTransitionTime": "2027-01-15T07:00:00Z"}
    ]  # fmt: skip
    decision, gpus = run(
        policy(disruptionBudget={"maxGpusReshaping": 2}), [failed, baseline_gpu(1)], burst(2)
    )
    assert gpus[0].failure and not gpus[0].in_flight
    (w,) = decision.writes
    assert w.gpu == "node-a-gpu1" and len(w.claims) == 2
    assert (
        "could not apply" in decision.held["node-a-gpu0"]
        and "InsufficientResources" in decision.held["node-a-gpu0"]
    )
    alone, _ = run(policy(), [failed], burst(1))
    assert alone.writes == ()
    (v,) = alone.verdicts
    assert v.reason is Reason.NO_CAPACITY and "the agent could not apply" in v.message


def test_in_flight_gpu_is_not_written_again_and_its_new_instances_serve_claims() -> None:
    gpu = partition(0, [("1g.10gb", s, "free") for s in range(7)], gen=2)
    gpu["status"]["observedGeneration"] = 1  # the agent is still cutting: actual is still the baseline
    gpu["status"]["instances"] = baseline_gpu(0)["status"]["instances"]
    decision, gpus = run(policy(disruptionBudget={"maxGpusReshaping": 2}), [gpu, baseline_gpu(1)], burst(2))
    assert gpus[0].in_flight
    assert decision.writes == ()  # nothing new: gpu0's coming 1g.10gb instances serve both claims
    assert {v.reason for v in decision.verdicts} == {Reason.RESHAPE_IN_PROGRESS}
    assert all(v.gpu == "node-a-gpu0" for v in decision.verdicts)


def test_idle_gpu_returns_to_baseline_only_after_cooldown() -> None:
    cut = partition(0, [("1g.10gb", s, "free") for s in range(7)])
    early, _ = run(policy(), [cut], (), idle={"node-a-gpu0": NOW - 10})
    assert early.writes == () and "returns to baseline after 60s" in early.held["node-a-gpu0"]
    late, _ = run(policy(), [cut], (), idle={"node-a-gpu0": NOW - 61})
    (w,) = late.writes
    assert w.layout == (PlacedInstance(0, "3g.40gb"), PlacedInstance(4, "3g.40gb"))
    assert w.claims == ()


def test_gpu_with_an_allocated_instance_does_not_drift() -> None:
    cut = partition(0, [("1g.10gb", 0, "in-use")] + [("1g.10gb", s, "free") for s in range(1, 7)])
    decision, _ = run(policy(), [cut], (), idle={"node-a-gpu0": NOW - 1000})
    assert all(PlacedInstance(0, "1g.10gb") in w.layout for w in decision.writes)


def test_profile_not_allowed_and_no_capacity() -> None:
    decision, _ = run(
        policy(allowedProfiles=["3g.40gb", "7g.80gb"], baseline={}), [baseline_gpu(0)], burst(1)
    )
    (v,) = decision.verdicts
    assert v.reason is Reason.PROFILE_NOT_ALLOWED and v.warning
    assert "1g.10gb, 2g.20gb" in v.message and "3g.40gb, 7g.80gb" in v.message

    full = partition(0, [("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "allocated")])
    decision, _ = run(policy(), [full], burst(1))
    (v,) = decision.verdicts
    assert v.reason is Reason.NO_CAPACITY
    assert "6 of 7 compute slices are allocated" in v.message


def test_invalid_baseline_is_reported_against_the_field() -> None:
    bad = policy(baseline={"A100-80GB": [{"profile": "3g.40gb", "start": 2}]})
    p = parse_policy(bad)
    (problem,) = check_spec_against_catalog(p.spec, CATALOG)
    assert problem.field == "spec.baseline[A100-80GB]"
    assert "cannot start at slice 2" in problem.message
    decision, _ = run(bad, [baseline_gpu(0)], burst(1))
    assert decision.writes == ()
    assert decision.verdicts[0].reason is Reason.POLICY_INVALID


def test_overlapping_policies_oldest_wins() -> None:
    old = parse_policy(
        {"metadata": {"name": "zeta", "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {}}
    )
    new = parse_policy(
        {
            "metadata": {"name": "alpha", "creationTimestamp": "2026-02-01T00:00:00Z"},
            "spec": {"gpuProducts": ["A100-80GB"]},
        }
    )
    other = parse_policy(
        {
            "metadata": {"name": "beta", "creationTimestamp": "2026-02-01T00:00:00Z"},
            "spec": {"gpuProducts": ["H100-80GB"]},
        }
    )
    gpus = parse_inventory([baseline_gpu(0), baseline_gpu(1)], CATALOG)
    own = resolve_ownership([new, other, old], [g.identity({}) for g in gpus])
    assert own.governed_by("zeta") == ("node-a-gpu0", "node-a-gpu1")
    assert own.lost["alpha"] == {"node-a-gpu0": "zeta", "node-a-gpu1": "zeta"}
    assert own.lost["beta"] == {}


def test_warm_pool_is_topped_up_on_a_busy_gpu_without_waiting_for_idle() -> None:
    gpu = partition(0, [("3g.40gb", 0, "allocated")])
    decision, _ = run(policy(warmPool={"1g.10gb": 2}, baseline={}), [gpu], (), idle={})
    (w,) = decision.writes
    assert sum(1 for i in w.layout if i.profile == "1g.10gb") == 2
    assert PlacedInstance(0, "3g.40gb") in w.layout
    recent, _ = run(
        policy(warmPool={"1g.10gb": 2}, baseline={}),
        [partition(0, [("3g.40gb", 0, "allocated")], written="2027-01-15T07:59:50Z")],
        (),
    )
    assert recent.writes == () and "cooldown 60s" in recent.held["node-a-gpu0"]


def test_an_instance_a_claim_allocation_names_is_busy_before_the_agent_says_so() -> None:
    claims = [
        {"metadata": {"name": "c"}, "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "mig.dynamig.io", "pool": "node-a", "device": "gpu0-3g40gb-s0"},
            {"request": "x", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu0-3g40gb-s4"},
        ]}}}},
    ]  # fmt: skip
    taken = allocated_devices(claims, "mig.dynamig.io")
    assert taken == {"node-a": frozenset({"gpu0-3g40gb-s0"})}
    (g,) = parse_inventory([baseline_gpu(0)], CATALOG, taken)
    assert g.busy == frozenset({PlacedInstance(0, "3g.40gb")})
    decision = decide_round(RoundInput(parse_policy(policy()), (), (g,), burst(3), NOW, {}, CATALOG))
    assert all(PlacedInstance(0, "3g.40gb") in w.layout for w in decision.planned)


# ------------------------------------------------------------------------------ partitionable inventory
A100_PROFILES = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")


def booked_gpu(
    index: int,
    instances: list[tuple[str, int, str]],
    offered: tuple[str, ...] | None = A100_PROFILES,
    **kw: Any,
) -> dict[str, Any]:
    """A GpuPartition whose agent publishes the partitionable inventory (the scheduler books placements)."""
    part = partition(index, instances, **kw)
    part["status"]["inventory"] = "Partitionable"
    if offered is not None:
        part["spec"]["offeredProfiles"] = list(offered)
    return part


def booked_baseline(index: int, **kw: Any) -> dict[str, Any]:
    return booked_gpu(index, [("3g.40gb", 0, "free"), ("3g.40gb", 4, "free")], **kw)


def on_nodes(claims: tuple[PendingClaim, ...], *nodes: str) -> tuple[PendingClaim, ...]:
    return tuple(dataclasses.replace(c, nodes=frozenset(nodes)) for c in claims)


def test_partitionable_gpus_are_offered_the_allowed_profiles_of_their_model_in_dynamic_only() -> None:
    # 1g.12gb is an H100-94GB profile: not offered on an A100
    allowed = policy(allowedProfiles=["3g.40gb", "1g.10gb", "1g.12gb"])
    decision, _ = run(allowed, [booked_baseline(0, offered=None), baseline_gpu(1)], ())
    (o,) = decision.offers  # the Instances GPU gets no offers
    assert (o.gpu, o.before, o.profiles) == ("node-a-gpu0", None, ("1g.10gb", "3g.40gb"))
    assert decision.writes == () and decision.planned_offers == ()

    everything, _ = run(policy(), [booked_baseline(0, offered=("1g.10gb",))], ())
    assert [o.profiles for o in everything.offers] == [A100_PROFILES]
    for mode in ("Static", "DryRun"):
        decision, _ = run(policy(mode=mode), [booked_baseline(0)], ())
        assert [(o.before, o.profiles) for o in decision.offers] == [(A100_PROFILES, ())]
        assert decision.writes == ()


def test_a_pending_claim_on_a_partitionable_gpu_is_left_to_the_scheduler() -> None:
    decision, _ = run(policy(), [booked_baseline(0)], burst(2))
    assert decision.writes == () and decision.planned == () and decision.offers == ()
    assert {v.reason for v in decision.verdicts} == {Reason.WAITING_FOR_SCHEDULER}
    v = decision.verdicts[0]
    assert v.gpu == "node-a-gpu0" and not v.warning
    # the free 3g.40gb instances do not block: a booking over them destroys them first
    assert "offered placements 1g.10gb@0, 1g.10gb@1" in v.message and "kube-scheduler" in v.message


def test_allocated_instances_decide_between_waiting_for_scheduler_and_no_capacity() -> None:
    half = booked_gpu(0, [("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "free")])
    decision, _ = run(policy(), [half], burst(1))
    (v,) = decision.verdicts
    assert v.reason is Reason.WAITING_FOR_SCHEDULER
    assert "1g.10gb@4, 1g.10gb@5, 1g.10gb@6 on node-a-gpu0" in v.message and "1g.10gb@0" not in v.message

    full = booked_gpu(0, [("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "in-use")])
    decision, _ = run(policy(), [full], burst(1))
    (v,) = decision.verdicts
    assert v.reason is Reason.NO_CAPACITY and v.warning
    assert "1 partitionable GPUs" in v.message and "6 of 7 compute slices are allocated" in v.message
    assert decision.writes == () and decision.planned == ()

    # two devices on one node: one placement left beside the busy 4g.40gb is not enough
    tight = booked_gpu(0, [("4g.40gb", 0, "allocated"), ("2g.20gb", 4, "allocated"), ("1g.10gb", 6, "free")])
    (claim,) = burst(1)
    two = dataclasses.replace(
        claim,
        requests=tuple(dataclasses.replace(r, matches=_with_count(r.matches, 2)) for r in claim.requests),
    )
    decision, _ = run(policy(), [tight], (two,))
    assert decision.verdicts[0].reason is Reason.NO_CAPACITY
    assert "no room for 2 x 1g.10gb or 2g.20gb" in decision.verdicts[0].message


def _with_count(matches: Any, count: int) -> Any:
    return tuple(
        dataclasses.replace(m, sub_request=dataclasses.replace(m.sub_request, count=count)) for m in matches
    )


def test_warm_pool_and_baseline_are_still_written_on_a_partitionable_gpu() -> None:
    empty = booked_gpu(0, [])
    decision, _ = run(policy(warmPool={"1g.10gb": 2}, baseline={}), [empty], burst(3), idle={})
    (w,) = decision.writes  # the warm pool, not the claims
    assert w.claims == () and [i.profile for i in w.layout] == ["1g.10gb", "1g.10gb"]
    assert {v.reason for v in decision.verdicts} == {Reason.WAITING_FOR_SCHEDULER}

    recent = booked_gpu(0, [], written="2027-01-15T07:59:50Z")
    decision, _ = run(policy(warmPool={"1g.10gb": 2}, baseline={}), [recent], ())
    assert decision.writes == () and "cooldown 60s" in decision.held["node-a-gpu0"]

    # leftovers of earlier bookings on an idle GPU: back to the baseline once idle for the cooldown
    leftovers = booked_gpu(0, [("1g.10gb", s, "free") for s in range(7)])
    early, _ = run(policy(), [leftovers], (), idle={"node-a-gpu0": NOW - 10})
    assert early.writes == ()
    late, _ = run(policy(), [leftovers], (), idle={"node-a-gpu0": NOW - 61})
    (w,) = late.writes
    assert w.layout == (PlacedInstance(0, "3g.40gb"), PlacedInstance(4, "3g.40gb"))


def test_leftover_instances_beside_spec_layout_are_neither_in_flight_nor_rewritten() -> None:
    base = [{"profile": "3g.40gb", "start": 0}]
    kept = booked_gpu(0, [("3g.40gb", 0, "free"), ("1g.10gb", 6, "free")], gen=2)
    kept["spec"]["layout"] = base
    kept["status"]["observedGeneration"] = 1  # e.g. an offers-only write the agent has not seen yet
    decision, (g,) = run(policy(baseline={"A100-80GB": base}), [kept], (), idle={"node-a-gpu0": NOW - 1000})
    assert not g.in_flight and not g.reshaping
    assert decision.writes == () and decision.planned == ()

    missing = booked_gpu(0, [("1g.10gb", 6, "free")], gen=2)
    missing["spec"]["layout"] = base
    missing["status"]["observedGeneration"] = 1
    (g,) = parse_inventory([missing], CATALOG)
    assert g.in_flight and g.reshaping

    # the same leftover on an Instances GPU is a layout still being applied
    same = partition(0, [("3g.40gb", 0, "free"), ("1g.10gb", 6, "free")], gen=2)
    same["spec"]["layout"] = base
    same["status"]["observedGeneration"] = 1
    (g,) = parse_inventory([same], CATALOG)
    assert g.in_flight and g.reshaping


def test_mixed_policy_plans_ahead_only_on_the_instances_gpu() -> None:
    # one node, one GPU of each inventory: claims may go to either, and are planned on the Instances one
    decision, _ = run(
        policy(disruptionBudget={"maxGpusReshaping": 2}), [baseline_gpu(0), booked_baseline(1)], burst(3)
    )
    (w,) = decision.writes
    assert w.gpu == "node-a-gpu0" and len(w.claims) == 3
    assert all(v.reason is Reason.RESHAPE_SCHEDULED and v.gpu == "node-a-gpu0" for v in decision.verdicts)
    assert all(p.gpu == "node-a-gpu0" for p in decision.planned)

    # more claims than the Instances GPU can take: the rest wait for the scheduler to book gpu1
    decision, _ = run(
        policy(disruptionBudget={"maxGpusReshaping": 2}), [baseline_gpu(0), booked_baseline(1)], burst(9)
    )
    assert [w.gpu for w in decision.writes] == ["node-a-gpu0"]
    reasons = decision.pending_by_reason()
    assert reasons[Reason.RESHAPE_SCHEDULED.value] == 7 and reasons[Reason.WAITING_FOR_SCHEDULER.value] == 2


def test_claim_only_a_partitionable_gpu_can_serve_in_a_mixed_policy() -> None:
    inst = baseline_gpu(0)
    other = booked_baseline(0)
    other["metadata"]["name"] = "node-b-gpu0"
    other["status"]["node"] = "node-b"
    decision, _ = run(policy(), [inst, other], on_nodes(burst(2), "node-b"))
    assert decision.writes == () and decision.planned == ()
    assert {(v.reason, v.gpu) for v in decision.verdicts} == {(Reason.WAITING_FOR_SCHEDULER, "node-b-gpu0")}

    # pinned to the Instances GPU's node: planned ahead as before
    decision, _ = run(policy(), [inst, other], on_nodes(burst(2), "node-a"))
    assert [w.gpu for w in decision.writes] == ["node-a-gpu0"]


def test_static_partitionable_gpu_offers_nothing_and_points_at_free_instances() -> None:
    free = booked_gpu(0, [("1g.10gb", 0, "free"), ("3g.40gb", 4, "free")], offered=())
    decision, _ = run(policy(mode="Static"), [free], burst(1))
    assert decision.offers == () and decision.writes == ()
    assert decision.verdicts[0].reason is Reason.WAITING_FOR_SCHEDULER
    decision, _ = run(policy(mode="Static"), [booked_baseline(0, offered=())], burst(1))
    assert decision.verdicts[0].reason is Reason.RESHAPE_DISABLED


def test_dry_run_reports_what_it_would_offer_and_offers_only_existing_instances() -> None:
    pol = policy(mode="DryRun", allowedProfiles=["1g.10gb", "2g.20gb", "3g.40gb"])
    decision, _ = run(pol, [booked_baseline(0, offered=None)], burst(1))
    (o,) = decision.offers
    assert o.profiles == ()
    (p,) = decision.planned_offers
    assert (p.gpu, p.profiles) == ("node-a-gpu0", ("1g.10gb", "2g.20gb", "3g.40gb"))
    (v,) = decision.verdicts
    assert v.reason is Reason.WOULD_RESHAPE and "it would offer 1g.10gb@0" in v.message
    assert decision.writes == ()

    free = booked_gpu(0, [("1g.10gb", 0, "free"), ("3g.40gb", 4, "free")], offered=())
    decision, _ = run(pol, [free], burst(1))
    assert decision.offers == ()
    assert decision.verdicts[0].reason is Reason.WAITING_FOR_SCHEDULER


def _apply(parts: list[dict[str, Any]], decision: RoundDecision) -> list[dict[str, Any]]:
    """The API server and the agents after a round: specs written, then applied (a partitionable GPU keeps
    the instances outside spec.layout, an Instances GPU gets exactly spec.layout)."""
    out = []
    for part in parts:
        part = copy.deepcopy(part)
        name, st = part["metadata"]["name"], part["status"]
        for o in decision.offers:
            if o.gpu == name:
                part["spec"]["offeredProfiles"] = list(o.profiles)
        for w in decision.writes:
            if w.gpu != name:
                continue
            part["spec"]["layout"] = [{"profile": i.profile, "start": i.start} for i in w.layout]
            part["metadata"]["annotations"] = {"dynamig.io/layout-written-at": "2027-01-15T08:00:00Z"}
            now = {(i["profile"], i["start"]): i for i in st["instances"]}
            floor = st.get("inventory") == "Partitionable"
            kept = [i for (p, s), i in now.items() if floor and PlacedInstance(s, p) not in w.layout]
            st["instances"] = kept + [
                now.get((i.profile, i.start))
                or {"profile": i.profile, "start": i.start, "deviceName": f"d{i.start}", "state": "free"}
                for i in w.layout
            ]
        out.append(part)
    return out


def test_a_second_round_with_the_written_state_writes_nothing() -> None:
    pol = policy(warmPool={"1g.10gb": 2}, baseline={})
    full = partition(1, [("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "allocated")])
    parts = [booked_gpu(0, [("3g.40gb", 0, "allocated"), ("1g.10gb", 6, "free")], offered=None), full]
    first, _ = run(pol, parts, burst(1), idle={})
    assert [o.gpu for o in first.offers] == ["node-a-gpu0"]
    (w,) = first.writes  # warm pool on the partitionable GPU; the claim is left to the scheduler
    assert w.gpu == "node-a-gpu0" and w.claims == ()
    assert [(v.reason, v.gpu) for v in first.verdicts] == [(Reason.WAITING_FOR_SCHEDULER, "node-a-gpu0")]
    second, gpus = run(pol, _apply(parts, first), burst(1), idle={})
    assert second.offers == () and second.writes == () and second.planned == ()
    assert not any(g.in_flight for g in gpus)


def test_a_warm_pool_that_cannot_fit_beside_the_baselines_is_reported() -> None:
    a100 = CATALOG.model("A100-80GB")
    # Two 3g.40gb halves use every memory slice of an A100-80GB: no 1g.10gb fits beside them.
    full = parse_policy(policy(warmPool={"1g.10gb": 2})).spec
    why = warm_pool_shortfall(full, [a100, a100])
    assert why is not None and "2x 1g.10gb asked, 0 fit" in why and "2 governed GPU(s)" in why
    # A 3g.40gb and a 1g.10gb: three more 1g.10gb fit beside them, and the baseline's own one counts too.
    half = [{"profile": "3g.40gb", "start": 4}, {"profile": "1g.10gb", "start": 0}]
    roomy = parse_policy(policy(warmPool={"1g.10gb": 4}, baseline={"A100-80GB": half})).spec
    assert warm_pool_shortfall(roomy, [a100]) is None
    too_many = parse_policy(policy(warmPool={"1g.10gb": 5}, baseline={"A100-80GB": half})).spec
    assert "5x 1g.10gb asked, 4 fit" in (warm_pool_shortfall(too_many, [a100]) or "")
    # No baseline: the whole GPU is there for it.
    bare = parse_policy(policy(warmPool={"1g.10gb": 7}, baseline={})).spec
    assert warm_pool_shortfall(bare, [a100]) is None


def on_node(part: dict[str, Any], node: str) -> dict[str, Any]:
    part["metadata"]["name"] = f"{node}-gpu{part['status']['gpuIndex']}"
    part["status"]["node"] = node
    return part


def multi(count: int, first: str = "7g.80gb", fallback: str = "4g.40gb") -> PendingClaim:
    (claim,) = burst(1, first, fallback)
    return dataclasses.replace(
        claim,
        requests=tuple(dataclasses.replace(r, matches=_with_count(r.matches, count)) for r in claim.requests),
    )


def test_an_idle_node_is_kept_for_a_waiting_multi_gpu_claim_and_released_after() -> None:
    empty: list[tuple[str, int, str]] = []
    parts = [
        on_node(booked_gpu(0, [("1g.10gb", 6, "allocated")]), "node-a"),  # busy: never kept
        on_node(booked_gpu(1, empty), "node-a"),
        *(on_node(booked_gpu(i, empty), "node-b") for i in range(2)),  # smallest idle node that holds 2
        *(on_node(booked_gpu(i, empty), "node-c") for i in range(4)),
    ]
    decision, _ = run(policy(), parts, (multi(2),))
    kept = {o.gpu: o for o in decision.offers}
    # only node-b's GPUs change: they offer just what the claim accepts, and say for whom
    assert sorted(kept) == ["node-b-gpu0", "node-b-gpu1"]
    assert {(o.profiles, o.kept_for) for o in kept.values()} == {(("4g.40gb", "7g.80gb"), "ml/infer-0")}
    assert decision.writes == ()

    # a claim held to node-c keeps node-c instead; a claim of one device keeps nothing
    decision, _ = run(policy(), parts, on_nodes((multi(2),), "node-c"))
    assert sorted(o.gpu for o in decision.offers) == [f"node-c-gpu{i}" for i in range(4)]
    assert run(policy(), parts, burst(3, "7g.80gb", "4g.40gb"))[0].offers == ()
    # "two 7g.80gb, else one 4g.40gb": its smallest alternative needs one device, so nothing is kept
    (claim,) = burst(1, "7g.80gb", "4g.40gb")
    two_or_one = dataclasses.replace(
        claim,
        requests=tuple(
            dataclasses.replace(r, matches=(*_with_count(r.matches[:1], 2), *_with_count(r.matches[1:], 1)))
            for r in claim.requests
        ),
    )
    assert run(policy(), parts, (two_or_one,))[0].offers == ()
    # four devices fit node-c only; two claims of two take node-b, then node-c
    assert sorted({o.gpu[:6] for o in run(policy(), parts, (multi(4),))[0].offers}) == ["node-c"]
    two_claims = (
        multi(2),
        dataclasses.replace(multi(2), claim=dataclasses.replace(multi(2).claim, name="x")),
    )
    assert sorted({o.gpu[:6] for o in run(policy(), parts, two_claims)[0].offers}) == ["node-b", "node-c"]

    # once the claim is no longer pending (allocated there), the next round offers everything again
    for part in parts[2:4]:
        part["spec"]["offeredProfiles"] = ["4g.40gb", "7g.80gb"]
    parts[2]["status"]["instances"] = [
        {"profile": "7g.80gb", "start": 0, "deviceName": "gpu0-7g.80gb-s0", "state": "allocated"}
    ]
    decision, _ = run(policy(), parts, ())
    assert {o.gpu: o.profiles for o in decision.offers} == {
        "node-b-gpu0": A100_PROFILES,
        "node-b-gpu1": A100_PROFILES,
    }
    assert all(o.kept_for == "" for o in decision.offers)


def test_the_claims_of_one_pod_are_planned_onto_one_node_or_not_at_all() -> None:
    # One pod, two claims of one 3g.40gb each (4g.40gb, the fallback, never fits beside the busy halves).
    first, second = burst(2, "3g.40gb", "4g.40gb")
    pair = (first, dataclasses.replace(second, pods=first.pods))
    half_busy = [("4g.40gb", 0, "allocated")]
    parts = [on_node(partition(0, half_busy), n) for n in ("node-a", "node-b")]
    wide = policy(disruptionBudget={"maxGpusReshaping": 4})
    # Each node has room for one: two pods of one claim each get a node each...
    assert sorted(w.gpu for w in run(wide, parts, (first, second))[0].writes) == [
        "node-a-gpu0",
        "node-b-gpu0",
    ]
    # ...but the scheduler binds one pod to one node with both its claims: no node is cut for half of it.
    decision, _ = run(wide, parts, pair)
    assert decision.writes == ()
    assert {v.claim.claim.key: v.reason for v in decision.verdicts} == {
        "ml/infer-0": "NoCapacity",
        "ml/infer-1": "NoCapacity",
    }
    # A node with room for both takes both.
    idle = on_node(partition(0, []), "node-c")
    decision, _ = run(wide, [*parts, idle], pair)
    (w,) = decision.writes
    assert w.gpu == "node-c-gpu0" and sorted(w.claims) == ["ml/infer-0", "ml/infer-1"]


def _devices(claim: PendingClaim, count: int, requests: int = 1) -> PendingClaim:
    """``claim`` asking ``count`` devices in each of ``requests`` requests (copies of its first)."""
    (r,) = claim.requests
    one = dataclasses.replace(r, matches=_with_count(r.matches, count))
    copies = tuple(
        dataclasses.replace(one, demand_name=f"{one.demand_name}/r{i}", request=f"r{i}")
        for i in range(requests)
    )
    return dataclasses.replace(claim, requests=copies)


def test_a_pod_whose_devices_fit_no_single_partitionable_node_together_has_no_capacity() -> None:
    # One A100 per node: seven 1g.10gb at most. Each claim of the pod (four 1g.10gb) fits alone; both do not.
    first, second = (_devices(c, 4) for c in burst(2, "1g.10gb", "1g.10gb"))
    pair = (first, dataclasses.replace(second, pods=first.pods))
    small = [on_node(booked_gpu(0, []), n) for n in ("node-a", "node-b")]
    apart, _ = run(policy(), small, (first, second))  # two pods: a node each
    assert {v.reason for v in apart.verdicts} == {Reason.WAITING_FOR_SCHEDULER}
    decision, _ = run(policy(), small, pair)
    assert {v.claim.claim.key: v.reason for v in decision.verdicts} == {
        "ml/infer-0": Reason.NO_CAPACITY,
        "ml/infer-1": Reason.NO_CAPACITY,
    }
    v = decision.verdicts[0]
    assert v.warning and "the 2 claims of its pod need 8 devices on one node" in v.message
    assert decision.pending_by_reason() == {"NoCapacity": 2}
    # A node of two A100s holds all eight.
    wide = [*small, *(on_node(booked_gpu(i, []), "node-c") for i in range(2))]
    decision, _ = run(policy(), wide, pair)
    assert {v.reason for v in decision.verdicts} == {Reason.WAITING_FOR_SCHEDULER}
    # Busy instances count: with a 1g.10gb allocated on each of node-c's GPUs, six fit beside them, not eight.
    busy = [*small, *(on_node(booked_gpu(i, [("1g.10gb", 0, "allocated")]), "node-c") for i in range(2))]
    busy[3]["status"]["instances"][0]["start"] = 6
    decision, _ = run(policy(), busy, pair)
    assert {v.reason for v in decision.verdicts} == {Reason.WAITING_FOR_SCHEDULER}  # 6 + 6 >= 8
    full = [*small, *(on_node(booked_gpu(i, [("4g.40gb", 0, "allocated")]), "node-c") for i in range(2))]
    decision, _ = run(policy(), full, pair)
    assert {v.reason for v in decision.verdicts} == {Reason.NO_CAPACITY}  # 3 + 3 < 8

    # One claim of two requests of four: the same.
    (two,) = (_devices(c, 4, requests=2) for c in burst(1, "1g.10gb", "1g.10gb"))
    (v,) = run(policy(), small, (two,))[0].verdicts
    assert v.reason is Reason.NO_CAPACITY and "its 2 requests need 8 devices on one node" in v.message
    (v,) = run(policy(), wide, (two,))[0].verdicts
    assert v.reason is Reason.WAITING_FOR_SCHEDULER


def test_pending_demand_by_profile_leaves_out_claims_the_scheduler_fails_on() -> None:
    """A claim whose pod is PodScheduled=False/SchedulerError (a selector the scheduler cannot evaluate) is
    counted by reason, not as demand for a profile: no layout serves it."""
    claims = burst(3)
    refused = tuple(
        dataclasses.replace(
            c,
            pods=tuple(
                dataclasses.replace(
                    p, unschedulable=False, scheduler_error=True, scheduling_message="no such key: rack"
                )
                for p in c.pods
            ),
        )
        for c in burst(50)[3:]
    )
    for parts in ([baseline_gpu(0)], [booked_baseline(0)]):
        decision, _ = run(policy(), parts, claims + refused)
        assert decision.pending_by_reason()["SchedulerError"] == 47
        assert sum(decision.pending_by_profile().values()) == 3, decision.pending_by_profile()
        assert "1g.10gb" in decision.pending_by_profile()


def test_a_gpu_with_an_uncleared_critical_xid_is_never_cut() -> None:
    """The agent sets ``DevicesHealthy`` False on a GPU with a critical XID and taints its devices: the
    operator plans nothing there (no new layout, no floor), and the burst goes to the healthy GPU."""
    sick = baseline_gpu(0)
    sick["status"]["conditions"] = [
        {
            "type": "DevicesHealthy",
            "status": "False",
            "reason": "CriticalXid",
            "message": "XID 79 on GPU-1 at 2026-12-05T08:00:00Z: NoSchedule",
            "lastTransitionTime": "2026-12-05T08:00:00Z",
        }
    ]
    (g,) = parse_inventory([sick], CATALOG)
    assert g.unusable == "critical XID, devices tainted: XID 79 on GPU-1 at 2026-12-05T08:00:00Z: NoSchedule"
    decision, _ = run(policy(disruptionBudget={"maxGpusReshaping": 2}), [sick, baseline_gpu(1)], burst(3))
    assert [w.gpu for w in decision.writes] == ["node-a-gpu1"]

    # cleared (True, as the agent writes after the administrator's annotation): planned again
    sick["status"]["conditions"][0].update(status="True", reason="NoCriticalXid", message="")
    (g,) = parse_inventory([sick], CATALOG)
    assert g.unusable == ""
