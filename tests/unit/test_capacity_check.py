"""Kueue's AdmissionCheck dynamig.io/mig-capacity: what a workload asks, whether it fits the GPUs, and the
answer (``dynamig.operator.capacity_check``). Pure."""

from __future__ import annotations

from typing import Any

import pytest

from dynamig.geometry.catalog import load_catalog
from dynamig.kube.policy import parse_policies
from dynamig.operator.capacity_check import (
    CONTROLLER,
    DEFAULT_RETRY_S,
    READY_RESERVE_S,
    RETRY_ANNOTATION,
    Room,
    State,
    answer,
    answered_lately,
    bound_pods,
    checked_workloads,
    pod_set_asks,
    recuttable,
    retry_after,
    unbound,
    unbound_asks,
)
from dynamig.operator.inventory import parse_inventory

CATALOG = load_catalog()
NOW = 1_800_000_000.0
T0 = "2027-01-15T08:00:00Z"  # NOW


def container(**asks: str) -> dict[str, Any]:
    return {"name": "c", "resources": {"limits": {f"nvidia.com/mig-{p}": n for p, n in asks.items()}}}


def pod_set(count: int, *containers: dict[str, Any], init: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    return {"name": "main", "count": count,
            "template": {"spec": {"containers": list(containers), "initContainers": list(init)}}}  # fmt: skip


def workload(name: str, *pod_sets: dict[str, Any], state: str = "Pending", at: str = T0,
             reserved: bool = True, check: str = "mig") -> dict[str, Any]:  # fmt: skip
    return {
        "metadata": {"name": name, "namespace": "ml", "uid": f"u-{name}"},
        "spec": {"podSets": list(pod_sets)},
        "status": {
            "conditions": [{"type": "QuotaReserved", "status": "True" if reserved else "False"}],
            "admissionChecks": [
                {"name": "other", "state": "Pending", "lastTransitionTime": at, "message": ""},
                {"name": check, "state": state, "lastTransitionTime": at, "message": ""},
            ],
        },
    }


def a100(
    name: str, busy: tuple[tuple[str, int], ...] = (), free: tuple[tuple[str, int], ...] = ()
) -> dict[str, Any]:
    node, index = name.rsplit("-gpu", 1)
    instances = [
        {
            "profile": p,
            "start": s,
            "deviceName": f"gpu{index}-{p.replace('.', '')}-s{s}",
            "state": state,
        }
        for state, placed in (("allocated", busy), ("free", free))
        for p, s in placed
    ]
    return {
        "metadata": {"name": name, "generation": 1},
        "spec": {"layout": [{"profile": p, "start": s} for p, s in (*busy, *free)]},
        "status": {"node": node, "gpuIndex": int(index), "model": "A100-80GB", "migMode": "Enabled",
                   "observedGeneration": 1, "phase": "Stable", "instances": instances},
    }  # fmt: skip


def room(*parts: dict[str, Any]) -> Room:
    """Every GPU re-cuttable, as under a Dynamic policy."""
    return Room.of(parse_inventory(parts, CATALOG), recut={p["metadata"]["name"] for p in parts})


def test_demand_sums_containers_takes_the_larger_init_container_and_multiplies_by_the_count() -> None:
    sets = [
        pod_set(2, container(**{"1g.10gb": "1"}), container(**{"1g.10gb": "1", "3g.40gb": "1"})),
        pod_set(1, container(), init=(container(**{"1g.10gb": "3"}),)),
    ]
    (w,) = checked_workloads([workload("w", *sets)], ["mig"])
    assert w.demand == {"1g.10gb": 7, "3g.40gb": 2}
    assert [a.demand for a in w.asks] == [{"1g.10gb": 4, "3g.40gb": 2}, {"1g.10gb": 3}]
    assert pod_set_asks([pod_set(3, {"name": "c", "resources": {"limits": {"cpu": "1"}}})])[0].demand == {}


def test_only_our_checks_are_read_oldest_first_with_their_index() -> None:
    late = workload("late", pod_set(1, container(**{"3g.40gb": "1"})), at="2027-01-15T08:00:09Z")
    early = workload("early", pod_set(1, container(**{"3g.40gb": "1"})))
    foreign = workload("foreign", pod_set(1, container(**{"3g.40gb": "1"})), check="someone-else")
    got = checked_workloads([late, early, foreign], ["mig"])
    assert [(c.name, c.index, c.state, c.quota_reserved) for c in got] == [
        ("early", 1, State.PENDING, True),
        ("late", 1, State.PENDING, True),
    ]
    assert got[0].since == NOW and got[0].demand == {"3g.40gb": 1}


def test_room_takes_what_fits_beside_the_busy_instances_and_nothing_when_one_slice_does_not() -> None:
    r = room(a100("n-gpu0", busy=(("3g.40gb", 0),)))
    assert r.place({"3g.40gb": 2}) is None
    assert r.place({"3g.40gb": 1}) == ["n-gpu0"]  # the failed try placed nothing
    assert r.place({"1g.10gb": 1}) is None  # slices 4-7 are taken now
    two = room(a100("n-gpu0"), a100("n-gpu1", busy=(("4g.40gb", 0),)))
    assert two.place({"3g.40gb": 1, "1g.10gb": 2}) is not None
    assert two.place({"7g.80gb": 1}) is None  # gpu0 has two 1g.10gb or a 3g.40gb on it by now


def test_the_answers() -> None:
    asks = pod_set(1, container(**{"3g.40gb": "1"}))
    (w,) = checked_workloads([workload("w", asks)], ["mig"])
    r = room(a100("n-gpu0", busy=(("3g.40gb", 0), ("3g.40gb", 4))))
    pending = answer(w, r, NOW + 10, 60.0)
    assert pending.state is State.PENDING and "no room for 1 x 3g.40gb" in pending.message, pending
    retry = answer(w, r, NOW + 60, 60.0)
    assert retry.state is State.RETRY and "quota released" in retry.message and "60s" in retry.message
    ready = answer(w, room(a100("n-gpu0", busy=(("3g.40gb", 0),))), NOW + 60, 60.0)
    assert ready.state is State.READY and ready.message == f"{CONTROLLER}: room for 1 x 3g.40gb (n-gpu0)"
    (odd,) = checked_workloads([workload("odd", pod_set(1, container(**{"2g.12gb": "1"})))], ["mig"])
    rejected = answer(odd, r, NOW, 60.0)
    assert rejected.state is State.REJECTED and "nvidia.com/mig-2g.12gb" in rejected.message


def test_workloads_answered_ready_hold_their_room_until_their_pods_are_bound() -> None:
    """A workload answered Ready and still admitted is counted as placed until all its pods are bound (then
    their allocations count), for at most READY_RESERVE_S; its pods are those its owner (a Job) owns, or the
    owner itself (a plain pod); finished pods and other namespaces' pods do not count."""
    asks = pod_set(2, container(**{"3g.40gb": "1"}))
    job = [{"uid": "job-a", "controller": True, "kind": "Job"}]
    a = workload("a", asks, state="Ready")
    a["metadata"]["ownerReferences"] = job
    single = workload("solo", pod_set(1, container(**{"1g.10gb": "1"})), state="Ready")
    single["metadata"]["ownerReferences"] = [{"uid": "pod-solo", "controller": True, "kind": "Pod"}]
    gone = workload("gone", asks, state="Ready", reserved=False)  # evicted or finished: quota released
    checked = checked_workloads([a, single, gone, workload("b", asks)], ["mig"])
    assert {c.name: (c.owner_uid, c.pods) for c in checked} == {
        "a": ("job-a", 2), "solo": ("pod-solo", 1), "gone": ("", 2), "b": ("", 2)
    }  # fmt: skip

    def pod(uid: str, ns: str = "ml", node: str = "n", phase: str = "Running", owner: str = "job-a") -> Any:
        return {"metadata": {"uid": uid, "namespace": ns, "ownerReferences": [{"uid": owner}]},
                "spec": {"nodeName": node}, "status": {"phase": phase}}  # fmt: skip

    lately = answered_lately(checked, NOW + 10)
    assert [c.name for c in lately] == ["a", "solo"]
    one = [pod("p1"), pod("p2", node=""), pod("p3", ns="other"), pod("p4", phase="Succeeded")]
    assert bound_pods(checked, one) == {"ml/a": {"": 1}}
    assert [c.name for c in unbound(lately, bound_pods(checked, one))] == ["a", "solo"]
    # a's one bound pod has its own allocation counted: only the other pod's 3g.40gb is held (was both)
    assert [x.demand for x in unbound_asks(lately[0], bound_pods(checked, one)["ml/a"])] == [{"3g.40gb": 1}]
    assert [x.demand for x in unbound_asks(lately[1], {})] == [{"1g.10gb": 1}]
    both = [pod("p1"), pod("p2", phase="Pending"), pod("pod-solo", owner="")]
    assert bound_pods(checked, both) == {"ml/a": {"": 2}, "ml/solo": {"": 1}}
    assert unbound(lately, bound_pods(checked, both)) == []
    assert unbound_asks(lately[0], {"": 2}) == ()
    assert answered_lately(checked, NOW + READY_RESERVE_S + 1) == []  # pods that never come hold nothing


def test_a_partly_bound_workload_holds_the_room_of_its_unbound_pods_in_each_pod_set() -> None:
    """A Job's pods carry the pod set Kueue admitted them in (label kueue.x-k8s.io/podset), a pod group's
    in annotation kueue.x-k8s.io/role-hash: each bound pod frees its own pod set's share (its allocation
    counts instead). A bound pod that names no pod set frees nothing where the workload has several."""
    workers = {**pod_set(3, container(**{"1g.10gb": "2"})), "name": "workers"}
    driver = {**pod_set(1, container(**{"3g.40gb": "1"})), "name": "driver"}
    w = workload("train", driver, workers, state="Ready")
    w["metadata"]["ownerReferences"] = [{"uid": "job-t", "controller": True, "kind": "Job"}]
    (c,) = checked_workloads([w], ["mig"])
    assert [(a.name, a.count, a.demand) for a in c.asks] == [
        ("driver", 1, {"3g.40gb": 1}), ("workers", 3, {"1g.10gb": 6})
    ]  # fmt: skip

    def pod(uid: str, pod_set: str = "", role: str = "") -> Any:
        meta: dict[str, Any] = {"uid": uid, "namespace": "ml", "ownerReferences": [{"uid": "job-t"}]}
        if pod_set:
            meta["labels"] = {"kueue.x-k8s.io/podset": pod_set}
        if role:
            meta["annotations"] = {"kueue.x-k8s.io/role-hash": role}
        return {"metadata": meta, "spec": {"nodeName": "n"}, "status": {"phase": "Running"}}

    bound = bound_pods([c], [pod("w1", "workers"), pod("d", role="driver"), pod("x")])
    assert bound == {"ml/train": {"workers": 1, "driver": 1, "": 1}}
    assert [(a.name, a.count, a.demand) for a in unbound_asks(c, bound["ml/train"])] == [
        ("workers", 2, {"1g.10gb": 4})
    ]
    assert unbound([c], bound) == [c]  # three of four bound
    # gpu0 holds the bound pods' allocations (w1's two 1g.10gb, the driver's 3g.40gb); gpu1 is empty
    r = room(a100("n-gpu0", busy=(("1g.10gb", 0), ("1g.10gb", 1), ("3g.40gb", 4))), a100("n-gpu1"))
    assert r.place_all(c.asks) is None  # the whole workload again beside its own allocations: no room
    held = r.place_all(unbound_asks(c, bound["ml/train"]))
    assert held == ["n-gpu0", "n-gpu0", "n-gpu1", "n-gpu1"], held  # the four 1g.10gb not bound yet
    assert r.place({"3g.40gb": 1}) == ["n-gpu1"]  # and the rest of gpu1 is the next workload's


@pytest.mark.parametrize(("value", "bound"), [(None, DEFAULT_RETRY_S), ("15", 15.0), ("x", DEFAULT_RETRY_S),
                                              ("-3", DEFAULT_RETRY_S)])  # fmt: skip
def test_the_bound_comes_from_the_check_annotation(value: str | None, bound: float) -> None:
    annotations = {RETRY_ANNOTATION: value} if value is not None else {}
    assert retry_after({"metadata": {"name": "mig", "annotations": annotations}}) == bound


def test_a_pod_set_fits_only_on_the_nodes_its_node_selector_names() -> None:
    """Room on another node is no room: the pod set's nodeSelector (with the flavor's node labels Kueue adds)
    keeps it to matching nodes, and a workload of two pod sets fits whole or not at all."""
    labels = {"a": {"pool": "x"}, "b": {"pool": "y"}}
    full = a100("a-gpu0", busy=(("3g.40gb", 0), ("3g.40gb", 4)))
    r = Room.of(parse_inventory([full, a100("b-gpu0")], CATALOG), labels, recut={"a-gpu0", "b-gpu0"})
    on_x = pod_set(1, container(**{"3g.40gb": "1"}))
    on_x["template"]["spec"]["nodeSelector"] = {"pool": "x"}
    (w,) = checked_workloads([workload("w", on_x)], ["mig"])
    assert w.asks[0].node_selector == {"pool": "x"}
    assert answer(w, r, NOW, 60.0).state is State.PENDING  # node b has room, but the pods may not go there
    anywhere = pod_set(1, container(**{"3g.40gb": "1"}))
    (both,) = checked_workloads([workload("both", anywhere, on_x)], ["mig"])
    assert r.place_all(both.asks) is None and r.place({"7g.80gb": 1}) == ["b-gpu0"]  # nothing was kept


def test_a_pod_set_fits_only_on_the_nodes_its_required_node_affinity_admits() -> None:
    """A required node affinity narrows the nodes as kube-scheduler's filter does: any term, every
    expression of it (matchFields on the node's name too)."""
    labels = {"a": {"zone": "z1", "pool": "x"}, "b": {"zone": "z2", "pool": "x"}}
    r = Room.of(
        parse_inventory([a100("a-gpu0"), a100("b-gpu0")], CATALOG), labels, recut={"a-gpu0", "b-gpu0"}
    )
    ps = pod_set(1, container(**{"7g.80gb": "1"}))
    in_z2 = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z2"]}]}
    required = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [in_z2]}}
    ps["template"]["spec"]["affinity"] = {"nodeAffinity": required}
    (w,) = checked_workloads([workload("w", ps, ps)], ["mig"])
    assert w.asks[0].node_terms and r.place_all(w.asks[:1]) == ["b-gpu0"]
    assert r.place_all(w.asks[1:]) is None  # b-gpu0 is taken; a-gpu0 is in zone z1
    by_name = [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a"]}]}]
    assert r.place({"7g.80gb": 1}, {"pool": "x"}, by_name) == ["a-gpu0"]


def _policy(name: str, mode: str, pool: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "generation": 1, "creationTimestamp": "2027-01-01T00:00:00Z"},
            "spec": {"mode": mode, "nodeSelector": {"matchLabels": {"pool": pool}}}}  # fmt: skip


def test_only_gpus_a_dynamic_policy_governs_are_re_cut_elsewhere_only_free_instances_serve() -> None:
    """A GPU under a Static or DryRun policy, or under none, is never cut for a workload: only a free
    instance of the profile asked serves there, and each serves one slice."""
    labels = {"a": {"pool": "dyn"}, "b": {"pool": "static"}, "c": {"pool": "dry"}, "d": {}}
    parts = [a100("a-gpu0", busy=(("4g.40gb", 0),)), a100("b-gpu0", free=(("3g.40gb", 4),)),
             a100("c-gpu0"), a100("d-gpu0", free=(("1g.10gb", 6),))]  # fmt: skip
    views = parse_inventory(parts, CATALOG)
    bad = {"metadata": {"name": "bad"}, "spec": {"mode": 7}}
    modes = (("p1", "Dynamic", "dyn"), ("p2", "Static", "static"), ("p3", "DryRun", "dry"))
    policies = parse_policies([*(_policy(*m) for m in modes), bad])
    recut = recuttable(policies, views, labels)
    assert recut == {"a-gpu0"}  # the malformed policy is left out, not fatal
    r = Room.of(views, labels, recut=recut)
    assert r.place({"3g.40gb": 1}) == ["a-gpu0"]  # a-gpu0 cut beside its 4g.40gb (the least room)
    assert r.place({"3g.40gb": 1}) == ["b-gpu0"]  # b-gpu0's free 3g.40gb as it is
    assert r.place({"3g.40gb": 1}) is None  # c-gpu0 is idle, but nothing is cut under DryRun
    assert r.place({"1g.10gb": 1}) == ["d-gpu0"] and r.place({"1g.10gb": 1}) is None  # no policy: as it is
    # With every GPU under a Dynamic policy, c-gpu0 takes the 3g.40gb.
    everywhere = Room.of(views, labels, recut={p["metadata"]["name"] for p in parts})
    assert everywhere.place({"3g.40gb": 3}) is not None
