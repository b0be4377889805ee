"""Preemption that evicts: the holds (operator/holds.py, agent/bindings/holds.py), the answer on held slices
(``dynamig.agent.bindings.decide.decide``), the partitionable offer over a hold (``offered_devices``) and the
search with holds and the ledger is tested with the rest of the search in test_preemption_dryrun.py. Pure.

Real: the MIG geometry catalog, claim and GpuPartition parsing, a planning round and the victim search. The
cluster is plain API dicts; time is a value.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from dynamig.agent.bindings.decide import Cut, Failed, GpuState, decide
from dynamig.agent.bindings.holds import (
    REASON_PLACEMENT_HELD,
    guarded_by_holds,
    held_against,
    held_desired,
    valid_holds,
)
from dynamig.agent.layout.reconcile import Observed
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import parse_layout
from dynamig.geometry.model import PlacedInstance
from dynamig.kube.gpupartition import GpuPartitionSpec, Hold
from dynamig.kube.inventory import GpuInventory, Instance, Occupancy, offered_devices
from dynamig.kube.policy import PreemptionMode, parse_policy
from dynamig.kube.times import micro_time
from dynamig.operator.holds import (
    Ledger,
    enforced,
    holds_of,
    new_hold,
    refusal,
    released,
    victim_ref,
)
from dynamig.operator.preemption import owner_key

A100 = load_catalog().model("A100-80GB")
BIG = "ml/big"
NOW = 1_800_000_000.0


def hold(profile: str = "3g.40gb", start: int = 4, claim: str = BIG, expires: float = NOW + 600) -> Hold:
    return Hold(claim=claim, claim_uid="c-big", profile=profile, start=start, expires_at=micro_time(expires))


# ------------------------------------------------------------------------------------------------ agent


def test_a_hold_turns_away_every_other_claim_on_its_slices_only() -> None:
    h = (hold(),)
    taken = held_against(A100, PlacedInstance(5, "1g.10gb"), "ml/small", h)
    assert taken == h[0]
    assert held_against(A100, PlacedInstance(4, "3g.40gb"), BIG, h) is None  # its own claim
    assert held_against(A100, PlacedInstance(2, "1g.10gb"), "ml/small", h) is None  # other slices
    state = GpuState(
        0, A100, True, tuple(Observed(p) for p in parse_layout("1g.10gb@4,1g.10gb@5")), {}, None, h
    )
    answer = decide("gpu0-1g10gb-s5", "ml/small", [state])
    assert isinstance(answer, Failed) and answer.reason == REASON_PLACEMENT_HELD, answer
    assert "kept for claim ml/big" in answer.message
    assert decide("gpu0-3g40gb-s4", BIG, [state]) == Cut(
        0, PlacedInstance(4, "3g.40gb"), parse_layout("1g.10gb@4,1g.10gb@5")
    )
    # Admin access (monitoring) shares what exists and cuts nothing: a hold does not refuse it.
    admin = decide("gpu0-1g10gb-s5", "ml/watch", [state], admin=True)
    assert not isinstance(admin, Failed) or admin.reason != REASON_PLACEMENT_HELD


def test_the_floor_leaves_held_slices_alone_and_instances_inventory_cuts_the_hold() -> None:
    floor = parse_layout("1g.10gb@0,1g.10gb@4,1g.10gb@5,1g.10gb@6")
    h = (hold(),)
    assert held_desired(A100, floor, h, partitionable=True) == parse_layout("1g.10gb@0")
    assert held_desired(A100, floor, h, partitionable=False) == parse_layout("1g.10gb@0,3g.40gb@4")
    assert guarded_by_holds(A100, floor, h) == frozenset(parse_layout("1g.10gb@4,1g.10gb@5,1g.10gb@6"))


def test_expired_or_foreign_holds_hold_nothing() -> None:
    spec = GpuPartitionSpec(holds=[hold(expires=NOW - 1), hold(start=0, expires=NOW + 1)])
    assert [h.start for h in spec.active_holds(NOW)] == [0]
    unknown = Hold(claim=BIG, profile="9g.90gb", start=0, expires_at=micro_time(NOW + 60))
    assert valid_holds(A100, [unknown, hold(start=1)]) == ()  # no such profile; 3g.40gb cannot start at 1
    with pytest.raises(ValidationError):
        Hold.model_validate({"claim": BIG, "profile": "3g.40gb", "start": -1, "expiresAt": "x"})


def test_the_partitionable_offer_over_a_hold_is_the_held_placement_alone() -> None:
    instances = tuple(Instance("1g.10gb", s, Occupancy.ALLOCATED, f"MIG-{s}") for s in range(4)) + tuple(
        Instance("1g.10gb", s, Occupancy.FREE, f"MIG-{s}") for s in (4, 5, 6)
    )
    offered = frozenset({"1g.10gb", "3g.40gb"})
    plain = GpuInventory(0, A100, "GPU-0", "", instances, offered)
    held = GpuInventory(0, A100, "GPU-0", "", instances, offered, held=(PlacedInstance(4, "3g.40gb"),))
    before = {d.name for d in offered_devices([plain])}
    after = {d.name: d for d in offered_devices([held])}
    assert {"gpu0-1g10gb-s4", "gpu0-1g10gb-s5", "gpu0-1g10gb-s6"} <= before
    assert not {"gpu0-1g10gb-s4", "gpu0-1g10gb-s5", "gpu0-1g10gb-s6", "gpu0-2g20gb-s4"} & set(after)
    assert after["gpu0-3g40gb-s4"].guarded and after["gpu0-3g40gb-s4"].kind == "recut"
    assert {f"gpu0-1g10gb-s{s}" for s in range(4)} <= set(after)  # the allocated ones, for their counters


# ------------------------------------------------------------------------------------------------ operator


def test_evict_mode_and_its_limits_parse_and_bad_values_name_the_field() -> None:
    spec = parse_policy(
        {"metadata": {"name": "p"}, "spec": {"preemption": {"mode": "Evict"}}}
    ).spec.preemption
    assert spec.mode is PreemptionMode.EVICT
    assert (spec.max_evictions_per_hour, spec.gpu_cooldown_seconds, spec.hold_seconds) == (60, 300, 600)
    assert spec.max_evictions_per_hour_per_namespace is None and spec.namespace_selector is None
    for value, field in (
        ({"maxEvictionsPerHour": 0}, "maxEvictionsPerHour"),
        ({"gpuCooldownSeconds": -1}, "gpuCooldownSeconds"),
        ({"holdSeconds": 5}, "holdSeconds"),
        ({"spareAfterEvictions": 0}, "spareAfterEvictions"),
        ({"maxEvictionsPerHourPerNamespace": 0}, "maxEvictionsPerHourPerNamespace"),
        ({"namespaceSelector": {"matchLabels": "tier"}}, "namespaceSelector"),
    ):
        with pytest.raises(ValidationError) as err:
            parse_policy({"metadata": {"name": "p"}, "spec": {"preemption": value}})
        assert f"spec.preemption.{field}" in str(err.value).replace("\n", "."), err.value


def test_a_hold_ends_when_its_claim_is_served_gone_replaced_or_it_expires() -> None:
    claim = {"metadata": {"namespace": "ml", "name": "big", "uid": "c-big"}}
    h = new_hold(claim, "3g.40gb", 4, 1000, ["ml/a@u-a"], NOW, 600)
    assert (h.claim, h.claim_uid) == (BIG, "c-big")
    assert h.expires() == pytest.approx(NOW + 600)
    assert released(h, {BIG: claim}, NOW) == ("", "")
    assert released(h, {}, NOW)[0] == "gone"
    assert released(h, {BIG: {"metadata": {"uid": "other"}}}, NOW)[0] == "gone"
    served = {**claim, "status": {"allocation": {"devices": {"results": []}}}}
    assert released(h, {BIG: served}, NOW)[0] == "served"
    assert released(h, {BIG: claim}, NOW + 601)[0] == "expired"
    assert victim_ref("ml/a@u-a") == ("ml", "a", "u-a")


def test_victims_are_evicted_only_once_the_agent_shows_the_hold() -> None:
    h = hold()
    api = h.model_dump(mode="json", by_alias=True, exclude_none=True)
    status: dict[str, Any] = {}
    part = {"metadata": {"name": "g"}, "spec": {"holds": [api, {"claim": "broken"}]}, "status": status}
    assert holds_of(part) == [h]  # the unreadable entry is dropped
    assert not enforced(part, h)
    status["holds"] = [api]
    assert enforced(part, h)


def test_cooldown_rate_and_ledger() -> None:
    ledger = Ledger()
    three = ["ml/a", "ml/b", "ml/c"]
    assert refusal("g0", three, "p", ledger, NOW, 4, 300) == ""
    ledger.record("p", NOW, "g0", ["ReplicaSet ml/web", "ReplicaSet ml/web", "Pod ml/x"])
    assert "gpuCooldownSeconds 300" in refusal("g0", ["ml/a"], "p", ledger, NOW + 10, 4, 300)
    assert "maxEvictionsPerHour 4" in refusal("g1", ["ml/a", "ml/b"], "p", ledger, NOW + 10, 4, 300)
    assert refusal("g1", ["ml/a"], "p", ledger, NOW + 10, 4, 300) == ""
    # Per namespace: ml lost 3 pods this hour; a 4th passes a limit of 3, a pod of another namespace not.
    why = refusal("g1", ["ml/a"], "p", ledger, NOW + 10, 60, 300, 3)
    assert "namespace ml had 3 pod(s) evicted" in why and "PerNamespace 3" in why, why
    assert refusal("g1", ["web/a", "web/b", "web/c"], "p", ledger, NOW + 10, 60, 300, 3) == ""
    assert "namespace web" in refusal("g1", ["web/a"] * 4, "p", ledger, NOW + 10, 60, 300, 3)
    assert ledger.count("p", NOW + 10, "ml") == 3 and ledger.count("p", NOW + 10, "web") == 0
    spared = ledger.spared("p", NOW + 10, 2)
    assert list(spared) == ["ReplicaSet ml/web"] and "evicted 2 times" in spared["ReplicaSet ml/web"]
    assert refusal("g1", ["ml/a", "ml/b"], "p", ledger, NOW + 3601, 4, 300) == ""  # the hour has passed
    assert refusal("g1", ["ml/a"], "p", ledger, NOW + 3601, 60, 300, 1) == ""
    assert ledger.spared("p", NOW + 3601, 2) == {}
    owned = {"metadata": {"namespace": "ml", "name": "web-1", "ownerReferences": [
        {"kind": "ReplicaSet", "name": "web", "controller": True}]}}  # fmt: skip
    assert owner_key(owned) == "ReplicaSet ml/web"
    assert owner_key({"metadata": {"namespace": "ml", "name": "x"}}) == "Pod ml/x"


def test_the_ledger_outlives_the_process_through_the_policy_status() -> None:
    """What one operator process stores in ``status.recentEvictions`` a new one reads back: the same counts,
    cooldown and sparing; entries older than the hour (or the cooldown) are dropped, unreadable ones skipped,
    and a hold recorded twice (restored, then seen on its GpuPartition) counts once."""
    first = Ledger()
    first.record("p", NOW - 4000, "g9", ["Pod ml/old"])  # past the hour
    first.record("p", NOW - 100, "g0", ["ReplicaSet ml/web", "ReplicaSet ml/web"])
    first.record("p", NOW - 50, "g1", ["ReplicaSet ml/web", "Pod web/x"])
    first.prune("p", NOW, 3600)
    stored = first.stored("p")
    assert [e["gpu"] for e in stored] == ["g0", "g1"]
    assert stored[0] == {"time": micro_time(NOW - 100), "gpu": "g0", "owners": ["ReplicaSet ml/web"] * 2}

    second = Ledger()
    junk = [{"time": "yesterday", "gpu": "g2", "owners": []}, {"gpu": "g3"}, "g4"]
    assert second.restore("p", [*stored, *junk]) == 2
    assert second.restore("p", stored) == 0  # once per process: later rounds keep what it counts itself
    second.record("p", NOW - 50, "g1", ["ReplicaSet ml/web", "Pod web/x"])  # the live hold, seen again
    assert second.count("p", NOW) == first.count("p", NOW) == 4
    assert second.count("p", NOW, "web") == 1
    assert second.spared("p", NOW, 3) == first.spared("p", NOW, 3) != {}
    assert "gpuCooldownSeconds 300" in refusal("g1", ["ml/a"], "p", second, NOW, 60, 300)
    assert refusal("g1", ["ml/a"], "p", second, NOW + 251, 60, 300) == ""
    # A cooldown longer than the hour keeps its hold past the hour; the counts still end with the hour.
    second.prune("p", NOW + 3700, 7200)
    assert second.count("p", NOW + 3700) == 0
    assert "gpuCooldownSeconds 7200" in refusal("g1", ["ml/a"], "p", second, NOW + 3700, 60, 7200)


def test_the_stored_ledger_is_bounded() -> None:
    ledger = Ledger()
    for i in range(1200):
        ledger.record("p", NOW + i, f"g{i}", ["Pod ml/x"] * 300)
    ledger.prune("p", NOW + 1200, 3600)
    stored = ledger.stored("p")
    assert len(stored) == 1000 and stored[0]["gpu"] == "g200"
    assert all(len(e["owners"]) == 256 for e in stored)
