"""Preemption, report-only (operator/preemption.py): from what the operator reads to the victim search's input
and back to what the waiting pod is told.

Real: the MIG geometry catalog, claim and GpuPartition parsing, CEL evaluation of the claims' selectors, a
planning round (``decide_round``) and the victim search. The cluster is plain API dicts (no API server);
time is a value.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from dynamig.cli.kubectl_plugin.report import PreemptionReads, plan_report, plan_table
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.gpupartition import HoldKind
from dynamig.kube.policy import GpuPartitionPolicy, PreemptionMode, parse_policy
from dynamig.kube.times import parse_time
from dynamig.operator.decide import RoundInput, decide_round
from dynamig.operator.demand import extract_demand, parse_device_classes
from dynamig.operator.draining import plan_drains
from dynamig.operator.holds import Ledger
from dynamig.operator.inventory import GpuView, allocated_devices, parse_inventory
from dynamig.operator.kubeio import Snapshot
from dynamig.operator.preemption import (
    REASON_NO_VICTIMS,
    REASON_WOULD_PREEMPT,
    DryRunReport,
    Memory,
    dry_run,
    holdings,
    parse_budgets,
    protection,
)
from dynamig.operator.verdicts import ClaimVerdict, Reason

CATALOG = load_catalog()
A100 = CATALOG.model("A100-80GB")
DRIVER = "mig.dynamig.io"
NOW = 1_800_000_000.0
LONG_AGO = "2026-01-01T00:00:00Z"  # started long before NOW
PROFILE = 'device.attributes["mig.dynamig.io"].profile'
CLASS = {
    "metadata": {"name": DRIVER},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
}
CLASSES = parse_device_classes([CLASS])


def policy(**preemption: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "tenants", "generation": 1, "creationTimestamp": LONG_AGO},
        "spec": {
            "mode": "Dynamic",
            "cooldownSeconds": 0,
            "preemption": {"mode": "DryRun", "minRunSeconds": 0, **preemption},
        },
    }


def partition(allocated: list[int], busy_unclaimed: tuple[int, ...] = ()) -> dict[str, Any]:
    """node-a's gpu0: seven 1g.10gb; those at ``allocated`` starts allocated, ``busy_unclaimed`` in use."""
    instances = []
    for s in range(7):
        state = "allocated" if s in allocated else "in-use" if s in busy_unclaimed else "free"
        instances.append(
            {"profile": "1g.10gb", "start": s, "deviceName": f"gpu0-1g10gb-s{s}", "state": state}
        )
    return {
        "metadata": {"name": "node-a-gpu0", "generation": 1},
        "spec": {"layout": [{"profile": "1g.10gb", "start": s} for s in range(7)]},
        "status": {
            "node": "node-a", "gpuIndex": 0, "product": "NVIDIA A100-SXM4-80GB", "model": "A100-80GB",
            "migMode": "Enabled", "observedGeneration": 1, "phase": "Stable", "instances": instances,
        },
    }  # fmt: skip


def claim(
    name: str, profile: str, *, device: str = "", pods: tuple[str, ...] = (), count: int = 1
) -> dict[str, Any]:
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": DRIVER,
            "count": count,
            "selectors": [{"cel": {"expression": f'{PROFILE} == "{profile}"'}}],
        },
    }
    obj: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"c-{name}", "creationTimestamp": LONG_AGO},
        "spec": {"devices": {"requests": [request]}},
    }
    if device:
        result = {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": device}
        obj["status"] = {
            "allocation": {"devices": {"results": [result]}},
            "reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods],
        }
    return obj


def pod(
    name: str,
    claim_name: str,
    priority: int = 0,
    *,
    pending: bool = False,
    labels: dict[str, str] | None = None,
    started: str | None = LONG_AGO,
    **spec: Any,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "labels": labels or {}},
        "spec": {
            "priority": priority,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
            **spec,
        },
        "status": {"phase": "Pending" if pending else "Running"},
    }
    if pending:
        obj["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    else:
        obj["spec"]["nodeName"] = "node-a"
        if started:
            obj["status"]["startTime"] = started
    return obj


def full_gpu(priorities: list[int], **pod_kw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Seven running pods, one per 1g.10gb of gpu0, at ``priorities`` (by slice)."""
    claims = [
        claim(f"small-{s}", "1g.10gb", device=f"gpu0-1g10gb-s{s}", pods=(f"small-{s}",)) for s in range(7)
    ]
    pods = [pod(f"small-{s}", f"small-{s}", priorities[s], **pod_kw) for s in range(7)]
    return claims, pods


def report(
    pol: dict[str, Any],
    claims: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    pdbs: list[dict[str, Any]] | None = [],  # noqa: B006 - never mutated
    busy_unclaimed: tuple[int, ...] = (),
    unread: str = "",
    kept: dict[str, str] | None = None,
    spared: dict[str, str] | None = None,
    namespaces: dict[str, dict[str, str]] | None = None,
) -> DryRunReport:
    """One round of ``decide_round`` on node-a's gpu0, then the DryRun report on its verdicts."""
    p = parse_policy(pol)
    devices = allocated_devices(claims, DRIVER).get("node-a", frozenset())
    allocated = [s for s in range(7) if f"gpu0-1g10gb-s{s}" in devices]
    gpus = parse_inventory([partition(allocated, busy_unclaimed)], CATALOG, allocated_devices(claims, DRIVER))
    pending = extract_demand(claims, pods, CLASSES, (A100,), {"node-a": {}}).pending
    decision = decide_round(RoundInput(p, (), gpus, pending, NOW, {}, CATALOG))
    return dry_run(
        p, decision.verdicts, gpus, claims, pods, pdbs, CATALOG, DRIVER, NOW, unread, kept, spared, namespaces
    )


def preemptor(priority: int = 1000, **spec: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return claim("big", "3g.40gb"), pod("big", "big", priority, pending=True, **spec)


def pdb(
    name: str, labels: dict[str, str] | None, allowed: int, generation: int = 1, observed: int | None = 1
) -> dict[str, Any]:
    status: dict[str, Any] = {"disruptionsAllowed": allowed}
    if observed is not None:
        status["observedGeneration"] = observed
    return {
        "metadata": {"name": name, "namespace": "ml", "generation": generation},
        "spec": {"selector": None if labels is None else {"matchLabels": labels}},
        "status": status,
    }


# ------------------------------------------------------------------------------------------------ policy


def test_preemption_defaults_off_and_bad_values_name_the_field() -> None:
    spec = parse_policy({"metadata": {"name": "p"}, "spec": {}}).spec.preemption
    assert (spec.mode, spec.priority_gap, spec.min_run_seconds, spec.spare_kueue_workloads) == (
        PreemptionMode.OFF, 1, 300, True,
    )  # fmt: skip
    bad = [
        ({"mode": "Enabled"}, "mode"),
        ({"priorityGap": 0}, "priorityGap"),
        ({"minRunSeconds": -1}, "minRunSeconds"),
        ({"spareKueueWorkloads": "sometimes"}, "spareKueueWorkloads"),
    ]
    for value, field in bad:
        with pytest.raises(ValidationError) as err:
            parse_policy({"metadata": {"name": "p"}, "spec": {"preemption": value}})
        assert f"spec.preemption.{field}" in str(err.value).replace("\n", "."), err.value


# ------------------------------------------------------------------------------------------------ the search


def test_would_preempt_the_fewest_lowest_pods_and_says_where() -> None:
    claims, pods = full_gpu([0] * 7)
    big_claim, big_pod = preemptor()
    out = report(policy(), [*claims, big_claim], [*pods, big_pod])
    (told,) = out.told
    assert told.reason == REASON_WOULD_PREEMPT
    # 3g.40gb at slice 4 frees slices 4-7: three pods, not the four under slice 0.
    assert told.victims == ("ml/small-4", "ml/small-5", "ml/small-6")
    assert told.message.startswith(
        "would evict ml/small-4, ml/small-5, ml/small-6 (priority 0 < 1000) on node-a/gpu0"
    )
    assert "to cut 3g.40gb at slice 4" in told.message and "nothing is evicted" in told.message
    assert (out.victims, out.would_preempt, out.no_victims) == (3, 1, 0)


def test_higher_priority_pods_are_spared_for_lower_ones() -> None:
    claims, pods = full_gpu([0, 0, 0, 0, 500, 500, 500])
    big_claim, big_pod = preemptor()
    (told,) = report(policy(), [*claims, big_claim], [*pods, big_pod]).told
    assert told.victims == ("ml/small-0", "ml/small-1", "ml/small-2", "ml/small-3")
    assert "at slice 0" in told.message


@pytest.mark.parametrize(
    ("pol", "pods_kw", "pre_kw", "words"),
    [
        (policy(), {}, {"preemptionPolicy": "Never"}, "its preemptionPolicy is Never"),
        (policy(), {}, {"priority": 0}, "priority not below 0 by the gap 1"),  # equal priority
        (policy(priorityGap=1001), {}, {}, "priority not below 1000 by the gap 1001"),
        (
            policy(minRunSeconds=600),
            {"started": "2027-01-15T07:55:00Z"},
            {},
            "minRunSeconds 600",
        ),  # 300 s ago
        (
            policy(minRunSeconds=600),
            {"started": None},
            {},
            "minRunSeconds 600",
        ),  # not started: runs since now
        (policy(), {"labels": {"kueue.x-k8s.io/queue-name": "q"}}, {}, "Kueue manages it"),
        (policy(), {"labels": {"scheduling.x-k8s.io/pod-group": "g"}}, {}, "pod group g"),
    ],
)
def test_no_victims_and_why(
    pol: dict[str, Any], pods_kw: dict[str, Any], pre_kw: dict[str, Any], words: str
) -> None:
    priority = pre_kw.pop("priority", 1000)
    claims, pods = full_gpu([0] * 7, **pods_kw)
    big_claim, big_pod = preemptor(priority, **pre_kw)
    out = report(pol, [*claims, big_claim], [*pods, big_pod])
    (told,) = out.told
    assert told.reason == REASON_NO_VICTIMS, told.message
    assert words in told.message, told.message
    assert (out.victims, out.would_preempt, out.no_victims) == (0, 0, 1)


def test_kueue_pods_are_victims_when_not_spared() -> None:
    claims, pods = full_gpu([0] * 7, labels={"kueue.x-k8s.io/queue-name": "q"})
    big_claim, big_pod = preemptor()
    (told,) = report(policy(spareKueueWorkloads=False), [*claims, big_claim], [*pods, big_pod]).told
    assert told.reason == REASON_WOULD_PREEMPT


def test_a_budget_allowing_no_disruption_protects_what_it_selects_only() -> None:
    claims, pods = full_gpu([0] * 7)
    for p in pods[4:]:
        p["metadata"]["labels"] = {"app": "keep"}
    big_claim, big_pod = preemptor()
    pdbs = [pdb("keep", {"app": "keep"}, 0)]
    (told,) = report(policy(), [*claims, big_claim], [*pods, big_pod], pdbs).told
    assert told.victims == ("ml/small-0", "ml/small-1", "ml/small-2", "ml/small-3")
    for p in pods[:4]:
        p["metadata"]["labels"] = {"app": "keep"}
    (told,) = report(policy(), [*claims, big_claim], [*pods, big_pod], pdbs).told
    assert told.reason == REASON_NO_VICTIMS
    assert "7 pod(s): PodDisruptionBudget keep allows no disruption (disruptionsAllowed 0)" in told.message
    # One that allows a disruption does not protect (the Eviction API counts further ones when it evicts).
    (told,) = report(policy(), [*claims, big_claim], [*pods, big_pod], [pdb("keep", {"app": "keep"}, 2)]).told
    assert told.reason == REASON_WOULD_PREEMPT


def test_unreadable_budgets_keep_every_pod() -> None:
    claims, pods = full_gpu([0] * 7)
    big_claim, big_pod = preemptor()
    out = report(policy(), [*claims, big_claim], [*pods, big_pod], None, unread="cannot list: 403 Forbidden")
    (told,) = out.told
    assert told.reason == REASON_NO_VICTIMS and "403 Forbidden" in told.message
    assert "403 Forbidden" in out.summary()


def test_a_busy_instance_no_claim_names_is_never_freed() -> None:
    claims, pods = full_gpu([0] * 7)
    claims, pods = claims[:6], pods[:6]  # slice 6 is busy with a process, no claim
    big_claim, big_pod = preemptor()
    (told,) = report(policy(), [*claims, big_claim], [*pods, big_pod], busy_unclaimed=(6,)).told
    assert told.victims == ("ml/small-0", "ml/small-1", "ml/small-2", "ml/small-3")


def test_pods_sharing_a_claim_go_together() -> None:
    claims, pods = full_gpu([0] * 7)
    claims[4]["status"]["reservedFor"].append({"resource": "pods", "name": "reader", "uid": "uid-reader"})
    reader = pod("reader", "small-4", 0)
    # Kept safe: a pod of the shared claim at priority 2000 cannot go, so neither can its peer.
    reader["spec"]["priority"] = 2000
    big_claim, big_pod = preemptor()
    (told,) = report(policy(), [*claims, big_claim], [*pods, reader, big_pod]).told
    assert told.victims == ("ml/small-0", "ml/small-1", "ml/small-2", "ml/small-3")
    reader["spec"]["priority"] = 0
    pods[0]["spec"]["priority"] = 1  # slice 0's four now rank below the shared claim's unit of four
    (told,) = report(policy(), [*claims, big_claim], [*pods, reader, big_pod]).told
    assert told.victims == ("ml/reader", "ml/small-4", "ml/small-5", "ml/small-6")


def test_only_claims_of_one_device_are_preemptors() -> None:
    claims, pods = full_gpu([0] * 7)
    two = claim("two", "3g.40gb", count=2)
    out = report(policy(), [*claims, two], [*pods, pod("two", "two", 1000, pending=True)])
    (told,) = out.told
    assert told.reason == REASON_NO_VICTIMS and "one device" in told.message


def test_claims_with_room_are_not_preemptors() -> None:
    claims, pods = full_gpu([0] * 7)
    small = claim("new", "1g.10gb")
    out = report(policy(), [*claims[:6], small], [*pods[:6], pod("new", "new", 1000, pending=True)])
    assert out.told == () and out.summary().startswith("DryRun: 0 waiting claim(s)")


# ------------------------------------------------------------------------------------------------ parts


def test_budgets_parse_as_the_eviction_api_reads_them() -> None:
    stale, null, ok = parse_budgets(
        [pdb("stale", {"a": "b"}, 3, generation=2, observed=1), pdb("null", None, 0), pdb("ok", {}, 1)]
    )
    assert "no status for its current spec" in stale.blocks
    assert not null.selects("ml", {"a": "b"})  # a null selector selects nothing
    assert ok.selects("ml", {"x": "y"}) and not ok.selects("other", {}) and ok.blocks == ""
    two = parse_budgets([pdb("one", {}, 1), pdb("two", {}, 1)])
    assert "more than one PodDisruptionBudget" in protection(pod("p", "c"), two, True)
    owned = pod("p", "c")
    owned["metadata"]["ownerReferences"] = [
        {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload", "name": "w"}
    ]
    assert "Kueue Workload w" in protection(owned, (), True) and protection(owned, (), False) == ""
    gone = pod("p", "c")
    gone["metadata"]["deletionTimestamp"] = LONG_AGO
    assert "being deleted" in protection(gone, (), True)


def test_holdings_name_who_holds_each_instance() -> None:
    claims, _ = full_gpu([0] * 7)
    claims[0]["status"]["reservedFor"] = []  # allocated, reserved by no pod yet
    gpus = parse_inventory([partition(list(range(7)))], CATALOG, allocated_devices(claims, DRIVER))
    held = holdings(gpus, claims, DRIVER)
    (g,) = held.gpus
    by_start = {i.placed.start: i.holders for i in g.instances}
    assert by_start[0] == ("claim ml/small-0, reserved by no pod we know",)
    assert by_start[1] == ("ml/small-1",)
    assert ("ml/small-1", "uid-small-1") in held.holders and len(held.holders) == 6


def test_memory_tells_once_per_change() -> None:
    m = Memory()
    assert m.due("u", REASON_WOULD_PREEMPT, "a", 0.0, 300.0)
    assert not m.due("u", REASON_WOULD_PREEMPT, "a", 10.0, 300.0)
    assert m.due("u", REASON_NO_VICTIMS, "b", 20.0, 300.0)
    assert m.due("u", REASON_NO_VICTIMS, "b", 400.0, 300.0)  # stale: told again
    m.keep_only(())
    assert m.due("u", REASON_NO_VICTIMS, "b", 401.0, 300.0)


def test_verdict_is_no_capacity_where_preemption_is_asked() -> None:
    """The hook's premise: a claim nothing fits without evicting is NoCapacity in the round itself."""
    claims, pods = full_gpu([0] * 7)
    big_claim, big_pod = preemptor()
    p = parse_policy(policy())
    gpus = parse_inventory([partition(list(range(7)))], CATALOG, allocated_devices(claims, DRIVER))
    pending = extract_demand([*claims, big_claim], [*pods, big_pod], CLASSES, (A100,), {"node-a": {}}).pending
    (v,) = decide_round(RoundInput(p, (), gpus, pending, NOW, {}, CATALOG)).verdicts
    assert v.reason is Reason.NO_CAPACITY


def test_the_search_skips_held_gpus_and_claims_and_spares_the_ledgers_owners() -> None:
    claims, pods = full_gpu([0] * 7)
    big_claim, big_pod = preemptor()
    pol = policy(mode="Evict")
    out = report(pol, [*claims, big_claim], [*pods, big_pod])
    (told,) = out.told
    assert told.reason == REASON_WOULD_PREEMPT and told.eviction is not None
    assert told.message.startswith("evicts ") and "DryRun" not in told.message
    assert told.priority == 1000 and set(told.victim_uids.values()) == {
        f"uid-{v.split('/')[1]}" for v in told.victims
    }
    # The GPU holds a placement already: no other preemptor is served there.
    assert report(pol, [*claims, big_claim], [*pods, big_pod], kept={"node-a-gpu0": "ml/other"}).told[
        0
    ].reason == (REASON_NO_VICTIMS)
    # The claim holds one: it waits for it, nothing more is searched for it.
    assert report(pol, [*claims, big_claim], [*pods, big_pod], kept={"node-a-gpu0": "ml/big"}).told == ()
    # Every pod's owner was evicted too often: none is a victim.
    spared = {f"Pod ml/small-{s}": "spared by the ledger" for s in range(7)}
    (none,) = report(pol, [*claims, big_claim], [*pods, big_pod], spared=spared).told
    assert none.reason == REASON_NO_VICTIMS and "spared by the ledger" in none.message


def test_only_selected_namespaces_preempt_and_lose_pods() -> None:
    claims, pods = full_gpu([0] * 7)
    for obj in (*claims, *pods):
        obj["metadata"]["namespace"] = "batch"  # the seven small pods; the waiting one is in ml
    big_claim, big_pod = preemptor()
    world = ([*claims, big_claim], [*pods, big_pod])
    labels = {"ml": {"tier": "prod"}, "batch": {"tier": "batch"}}
    both = {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["prod", "batch"]}]}
    (told,) = report(policy(namespaceSelector=both), *world, namespaces=labels).told
    assert told.reason == REASON_WOULD_PREEMPT and told.victims[0].startswith("batch/"), told
    # batch not selected: its pods are no victims, and the answer says why.
    prod, batch = {"matchLabels": {"tier": "prod"}}, {"matchLabels": {"tier": "batch"}}
    (kept,) = report(policy(namespaceSelector=prod), *world, namespaces=labels).told
    assert kept.reason == REASON_NO_VICTIMS
    assert "7 pod(s): namespace batch is not selected by spec.preemption.namespaceSelector" in kept.message
    # ml not selected: the waiting pod preempts nobody.
    (out,) = report(policy(namespaceSelector=batch), *world, namespaces=labels).told
    assert out.reason == REASON_NO_VICTIMS and "namespace ml is not selected" in out.message, out.message
    # Namespaces unread: nobody takes part; unset selector: everybody does, without reading them.
    (unread,) = report(policy(namespaceSelector=both), *world, namespaces=None).told
    assert "namespaces could not be read" in unread.message
    assert report(policy(), *world).told[0].reason == REASON_WOULD_PREEMPT


def test_kubectl_dynamig_plan_shows_what_preemption_would_do_and_what_is_held() -> None:
    claims, pods = full_gpu([0] * 7)
    big_claim, big_pod = preemptor()
    part = partition(list(range(7)))
    node = {"metadata": {"name": "node-a", "labels": {}}}

    def plan(pol: dict[str, Any], reads: PreemptionReads | None) -> dict[str, Any]:
        snap = Snapshot((pol,), (part,), (node,), (big_pod,), (*claims, big_claim), (CLASS,))
        return plan_report(snap, CATALOG, NOW, reads=reads)

    report = plan(policy(), PreemptionReads(tuple(pods), (), None, ""))
    (p,) = report["policies"]
    (answer,) = p["preemption"]["answers"]
    assert answer["answer"] == REASON_WOULD_PREEMPT and answer["claim"] == "ml/big"
    assert answer["victims"] == ["ml/small-4", "ml/small-5", "ml/small-6"]
    text = plan_table(report)
    assert "preemption DryRun" in text and "would evict ml/small-4, ml/small-5, ml/small-6" in text, text
    # Running pods unread (RBAC): nobody is a victim, and the answer says why.
    unread = plan(policy(), None)
    (answer,) = unread["policies"][0]["preemption"]["answers"]
    assert answer["answer"] == REASON_NO_VICTIMS
    assert "were not read: no pod is taken for a victim" in plan_table(unread)
    # Evict with a placement held and enforced: the hold is listed, and the claim holding it is not searched.
    hold = {"claim": "ml/big", "profile": "3g.40gb", "start": 4, "victims": ["ml/small-4@uid-small-4"],
            "createdAt": "2027-01-15T08:00:00Z", "expiresAt": "2027-01-15T08:10:00Z"}  # fmt: skip
    part["spec"]["holds"] = [hold]
    part["status"]["holds"] = [hold]
    held = plan(policy(mode="Evict"), PreemptionReads(tuple(pods), (), None, ""))["policies"][0]
    assert held["preemption"]["answers"] == []
    (row,) = held["preemption"]["holds"]
    assert (row["gpu"], row["placement"], row["enforced"]) == ("node-a-gpu0", "3g.40gb@4", True)
    text = plan_table({**report, "policies": [held]})
    assert "HELD ON" in text and "ml/small-4" in text and "0 pod(s) evicted in the last hour" in text, text
    # The operator's ledger as it stored it in the policy's status: counted, and its limits said per answer.
    part["spec"]["holds"] = part["status"]["holds"] = []
    ledger = Ledger()
    ledger.record("tenants", NOW - 60, "node-a-gpu0", ["Pod ml/small-1", "Pod ml/small-1"])
    stored = policy(mode="Evict", gpuCooldownSeconds=300)
    stored["status"] = {"recentEvictions": ledger.stored("tenants")}
    later = plan(stored, PreemptionReads(tuple(pods), (), None, ""))["policies"][0]["preemption"]
    assert later["evictedLastHour"] == 2 and later["spared"] == ["Pod ml/small-1"]
    (answer,) = later["answers"]
    assert answer["answer"] == REASON_WOULD_PREEMPT
    assert "gpuCooldownSeconds 300" in answer["heldBack"], answer
    text = plan_table({**report, "policies": [{**held, "preemption": later}]})
    assert "2 pod(s) evicted in the last hour" in text and "not now: GPU node-a-gpu0 had pods evicted" in text
    assert "spared after repeated evictions within the hour: Pod ml/small-1" in text, text


# ------------------------------------------------------------------------------------------------ drains


def round_of(
    pol: dict[str, Any], claims: list[dict[str, Any]], pods: list[dict[str, Any]], part: dict[str, Any]
) -> tuple[GpuPartitionPolicy, tuple[GpuView, ...], tuple[ClaimVerdict, ...]]:
    """(policy, GPUs, the round's verdicts) on ``part``."""
    p = parse_policy(pol)
    gpus = parse_inventory([part], CATALOG, allocated_devices(claims, DRIVER))
    pending = extract_demand(claims, pods, CLASSES, (A100,), {"node-a": {}}).pending
    return p, gpus, decide_round(RoundInput(p, (), gpus, pending, NOW, {}, CATALOG)).verdicts


def test_a_claim_starving_at_equal_priority_gets_a_gpu_drained_and_nobody_evicted() -> None:
    claims, pods = full_gpu([1000] * 7)
    big_claim, big_pod = preemptor(1000)
    drain = policy(mode="Off")
    drain["spec"]["drain"] = {"afterSeconds": 60}
    world = ([*claims, big_claim], [*pods, big_pod])
    p, gpus, verdicts = round_of(drain, *world, partition(list(range(7))))
    (d,) = plan_drains(p, verdicts, gpus, world[0], world[1], DRIVER, NOW, {}, 1)
    assert (d.gpu_name, d.choice.profile, d.choice.start, d.priority) == ("node-a-gpu0", "3g.40gb", 4, 1000)
    hold = d.hold("c-big", NOW, 3600)
    assert hold.kind is HoldKind.DRAIN and hold.victims == [] and hold.claim == "ml/big"
    text = d.message(hold.expires_at)
    assert "no GPU can cut now" in text and "1g.10gb@4, 1g.10gb@5, 1g.10gb@6 end" in text
    assert "nobody is evicted" in text
    # Not yet starving, no room left, the GPU or the claim holding a placement already, or drains off.
    created = parse_time(LONG_AGO)
    assert created is not None
    assert plan_drains(p, verdicts, gpus, world[0], world[1], DRIVER, created + 30, {}, 1) == ()
    assert plan_drains(p, verdicts, gpus, world[0], world[1], DRIVER, NOW, {}, 0) == ()
    assert plan_drains(p, verdicts, gpus, world[0], world[1], DRIVER, NOW, {"node-a-gpu0": "ml/x"}, 1) == ()
    assert plan_drains(p, verdicts, gpus, world[0], world[1], DRIVER, NOW, {"node-b-gpu0": "ml/big"}, 1) == ()
    off = parse_policy(policy(mode="Off"))
    assert plan_drains(off, verdicts, gpus, world[0], world[1], DRIVER, NOW, {}, 1) == ()


def test_a_held_placement_is_planned_busy_so_no_other_claim_is_planned_over_it() -> None:
    # Slices 0-3 busy, 4-6 free under a hold of 3g.40gb@4: a 1g.10gb claim finds no room on the GPU.
    claims, pods = full_gpu([0] * 7)
    claims, pods = claims[:4], pods[:4]
    small_claim = claim("late", "1g.10gb")
    small_pod = pod("late", "late", 0, pending=True)
    world = ([*claims, small_claim], [*pods, small_pod])
    part = partition(list(range(4)))
    _, gpus, verdicts = round_of(policy(), *world, part)
    assert verdicts[0].reason is not Reason.NO_CAPACITY  # free 1g.10gb at 4, 5, 6: served there
    part["spec"]["holds"] = [{"claim": "ml/big", "profile": "3g.40gb", "start": 4,
                              "expiresAt": "2099-01-01T00:00:00Z"}]  # fmt: skip
    _, gpus, verdicts = round_of(policy(), *world, part)
    assert verdicts[0].reason is Reason.NO_CAPACITY, verdicts[0]
    (g,) = gpus
    state = g.state()
    assert [(i.profile, i.start, i.busy) for i in state.instances if i.start >= 4] == [("3g.40gb", 4, True)]
