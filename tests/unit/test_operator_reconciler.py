"""The reconciler's pure parts: a snapshot parsed into a world, claims given to policies, status patches, and
the metrics registry.

Real: policy/GpuPartition/claim parsing, CEL evaluation of selectors, ownership resolution and the Prometheus
client registry. The snapshot is made of plain dicts shaped like API objects; no API server is involved.
"""

from __future__ import annotations

from typing import Any

from dynamig.geometry.catalog import load_catalog
from dynamig.operator.kubeio import Snapshot
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.reconciler import _differs, _replacing, parse_world

PROFILE = 'device.attributes["mig.dynamig.io"].profile'


def gpu(node: str, index: int, model: str, product: str) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{node}-gpu{index}", "generation": 1},
        "spec": {"layout": []},
        "status": {
            "node": node, "gpuIndex": index, "model": model, "product": product, "migMode": "Enabled",
            "observedGeneration": 1, "phase": "Stable", "instances": [],
        },
    }  # fmt: skip


def policy(name: str, created: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": created}, "spec": spec}


def pending(name: str, profile: str, node: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    claim = {
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io",
            "selectors": [{"cel": {"expression": f'{PROFILE} == "{profile}"'}}]}}]}},
    }  # fmt: skip
    pod_spec: dict[str, Any] = {"resourceClaims": [{"name": "gpu", "resourceClaimName": name}]}
    if node:
        pod_spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    pod = {
        "metadata": {"name": name, "namespace": "ns", "uid": f"p-{name}"},
        "spec": pod_spec,
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
    }
    return claim, pod


def snapshot() -> Snapshot:
    c1, p1 = pending("small-a100", "1g.10gb")
    c2, p2 = pending("small-h100", "1g.20gb", node="h")  # 1g.20gb: A100-80GB and H100 both have it
    c3, p3 = pending("nowhere", "9g.1tb")
    return Snapshot(
        policies=(
            policy("hopper", "2026-01-01T00:00:00Z", gpuProducts=["H100-80GB"]),
            policy("ampere", "2026-02-01T00:00:00Z", gpuProducts=["A100-80GB"]),
            policy("everything", "2026-03-01T00:00:00Z"),
        ),
        partitions=(
            gpu("a", 0, "A100-80GB", "NVIDIA A100-SXM4-80GB"),
            gpu("h", 0, "H100-80GB", "NVIDIA H100 80GB HBM3"),
        ),
        nodes=(
            {"metadata": {"name": "a", "labels": {"kubernetes.io/hostname": "a"}}},
            {"metadata": {"name": "h", "labels": {"kubernetes.io/hostname": "h"}}},
        ),
        pods=(p1, p2, p3),
        claims=(c1, c2, c3),
        device_classes=(
            {
                "metadata": {"name": "mig.dynamig.io"},
                "spec": {"selectors": [{"cel": {"expression": 'device.driver == "mig.dynamig.io"'}}]},
            },
        ),
    )


def test_claims_go_to_the_first_policy_that_can_serve_them() -> None:
    world = parse_world(snapshot(), load_catalog())
    assert world.ownership.owner == {"a-gpu0": "ampere", "h-gpu0": "hopper"}
    assert world.ownership.lost["everything"] == {"a-gpu0": "ampere", "h-gpu0": "hopper"}
    # 1g.10gb exists on both models and the pod may go anywhere: the oldest policy that can serve it wins
    assert world.claim_owner["ns/small-a100"] == "hopper"
    # pinned to node h by its pod's node selector: the H100 policy
    assert world.claim_owner["ns/small-h100"] == "hopper"
    # nobody can serve it: the oldest policy reports why
    assert world.claim_owner["ns/nowhere"] == "hopper"
    assert {c.claim.key for c in world.pending} == {"ns/small-a100", "ns/small-h100", "ns/nowhere"}


def test_claim_pinned_to_a_node_goes_to_the_policy_governing_that_node() -> None:
    snap = snapshot()
    c4, p4 = pending("on-a", "1g.10gb+me", node="a")
    snap = Snapshot(snap.policies, snap.partitions, snap.nodes, (*snap.pods, p4), (*snap.claims, c4),
                    snap.device_classes)  # fmt: skip
    world = parse_world(snap, load_catalog())
    assert world.claim_owner["ns/on-a"] == "ampere"


def test_merge_patch_of_a_map_names_keys_to_drop() -> None:
    assert _replacing({"NoCapacity": 2, "ReshapeScheduled": 1}, {"ReshapeScheduled": 3}) == {
        "NoCapacity": None,
        "ReshapeScheduled": 3,
    }
    assert _replacing(None, {}) == {}


def test_status_difference_ignores_condition_times_and_empty_lists() -> None:
    cond = {"type": "Valid", "status": "True", "reason": "Valid", "message": "ok", "observedGeneration": 1}
    old = {"matchedGpus": 2, "conditions": [{**cond, "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    same = {
        "matchedGpus": 2,
        "lostGpus": [],
        "conditions": [{**cond, "lastTransitionTime": "2026-06-01T00:00:00Z"}],
    }
    assert not _differs(old, same)
    assert _differs(old, {**same, "matchedGpus": 3})
    assert _differs(old, {**same, "conditions": [{**cond, "status": "False"}]})


def test_metrics_series_are_replaced_and_forgotten() -> None:
    m = OperatorMetrics()
    m.set_pending("p", {("1g.10gb", "NoCapacity"): 3})
    m.set_pending("p", {("2g.20gb", "ReshapeScheduled"): 1})
    r = m.registry
    gone = {"policy": "p", "profile": "1g.10gb", "reason": "NoCapacity"}
    now = {"policy": "p", "profile": "2g.20gb", "reason": "ReshapeScheduled"}
    assert r.get_sample_value("dynamig_operator_pending_devices", gone) is None
    assert r.get_sample_value("dynamig_operator_pending_devices", now) == 1
    m.set_governed("p", 4, 42.5)
    assert r.get_sample_value("dynamig_operator_oldest_pending_claim_age_seconds", {"policy": "p"}) == 42.5
    m.forget_policy("p")
    assert r.get_sample_value("dynamig_operator_governed_gpus", {"policy": "p"}) is None
    assert r.get_sample_value("dynamig_operator_oldest_pending_claim_age_seconds", {"policy": "p"}) is None
    assert r.get_sample_value("dynamig_operator_build_info", {"version": "0.1.0"}) == 1
