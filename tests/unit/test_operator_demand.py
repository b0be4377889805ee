"""Pending demand extracted from ResourceClaim, Pod and DeviceClass dicts as the API server returns them.

Real: the CEL evaluation (cel-python) of every request and DeviceClass selector, against devices built from
the real MIG geometry catalog; the dicts have the shape of resource.k8s.io/v1 and core/v1 objects. No API
server is involved (the integration and e2e tests cover that); nothing is mocked.
"""

from __future__ import annotations

from typing import Any

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import GpuModel
from dynamig.operator.demand import (
    DemandSnapshot,
    extract_demand,
    parse_device_classes,
    parse_pod,
    pod_fits_node,
)

PROFILE = 'device.attributes["mig.dynamig.io"].profile'
MEMORY = 'device.capacity["mig.dynamig.io"].memory'

DEVICE_CLASSES = parse_device_classes(
    [
        {
            "metadata": {"name": "mig.dynamig.io"},
            "spec": {"selectors": [{"cel": {"expression": 'device.driver == "mig.dynamig.io"'}}]},
        },
        {
            "metadata": {"name": "mig-small"},
            "spec": {
                "selectors": [
                    {"cel": {"expression": 'device.driver == "mig.dynamig.io"'}},
                    {"cel": {"expression": 'device.attributes["mig.dynamig.io"].computeSlices <= 2'}},
                ]
            },
        },
        {
            "metadata": {"name": "gpu.nvidia.com"},
            "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}]},
        },
    ]
)


def models() -> tuple[GpuModel, ...]:
    return (load_catalog().model("A100-80GB"),)


def alt(name: str, expr: str, device_class: str = "mig.dynamig.io", count: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "deviceClassName": device_class,
        "selectors": [{"cel": {"expression": expr}}],
        "count": count,
    }


def claim(
    name: str, requests: list[dict[str, Any]], allocated: bool = False, ns: str = "team"
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": f"uid-{name}",
            "creationTimestamp": "2026-01-01T08:00:00Z",
        },
        "spec": {"devices": {"requests": requests}},
        "status": {},
    }
    if allocated:
        obj["status"]["allocation"] = {
            "devices": {"results": [{"request": "gpu", "driver": "mig.dynamig.io"}]}
        }
    return obj


def pod(
    name: str, claim_name: str, unschedulable: bool = True, ns: str = "team", **spec: Any
) -> dict[str, Any]:
    conditions = (
        [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "cannot allocate all claims",
            }
        ]
        if unschedulable
        else [{"type": "PodScheduled", "status": "True"}]
    )
    return {
        "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}], **spec},
        "status": {"phase": "Pending", "conditions": conditions},
    }


def inference_claim(name: str) -> dict[str, Any]:
    return claim(
        name,
        [
            {
                "name": "gpu",
                "firstAvailable": [
                    alt("small", f'{PROFILE} == "1g.10gb"'),
                    alt("medium", f'{PROFILE} == "2g.20gb"'),
                ],
            }
        ],
    )


def demand(
    claims: list[dict[str, Any]], pods: list[dict[str, Any]], nodes: dict[str, dict[str, str]] | None = None
) -> DemandSnapshot:
    return extract_demand(claims, pods, DEVICE_CLASSES, models(), nodes or {"n1": {}, "n2": {}})


def test_unschedulable_claim_with_first_available_keeps_preference_order() -> None:
    snap = demand([inference_claim("c1")], [pod("p1", "c1")])
    assert len(snap.pending) == 1
    pc = snap.pending[0]
    assert pc.claim.key == "team/c1"
    assert [p.name for p in pc.pods] == ["p1"]
    (req,) = pc.requests
    assert req.alternatives() == ("1g.10gb", "2g.20gb")
    assert [m.sub_request.name for m in req.matches] == ["gpu/small", "gpu/medium"]
    (d,) = pc.planner_demands()
    assert (
        d.name == "team/c1" and d.alternatives == ("1g.10gb", "2g.20gb") and d.count == 1 and d.nodes is None
    )


def test_allocated_claim_or_scheduled_pod_is_not_demand() -> None:
    allocated = inference_claim("c1")
    allocated["status"]["allocation"] = {"devices": {"results": []}}
    snap = demand([allocated, inference_claim("c2")], [pod("p1", "c1"), pod("p2", "c2", unschedulable=False)])
    assert snap.pending == ()
    assert snap.allocated == frozenset({"uid-c1"})


def test_a_claim_the_scheduler_fails_on_is_kept_with_its_error_unless_another_pod_just_waits() -> None:
    failing = pod("p1", "c1")
    failing["status"]["conditions"][0] |= {"reason": "SchedulerError", "message": "no such key: rack"}
    (pc,) = demand([inference_claim("c1")], [failing]).pending
    assert pc.scheduler_error == "no such key: rack"
    assert not pc.pods[0].unschedulable
    # A second pod of the same claim that is merely unschedulable: plannable demand again.
    (pc,) = demand([inference_claim("c1")], [failing, pod("p2", "c1")]).pending
    assert pc.scheduler_error == ""
    # Bound already (nodeName set): not pending, whatever the stale condition says.
    bound = pod("p3", "c2", nodeName="n1")
    bound["status"]["conditions"][0]["reason"] = "SchedulerError"
    assert demand([inference_claim("c2")], [bound]).pending == ()


def test_claim_without_a_pod_is_not_demand() -> None:
    assert demand([inference_claim("lonely")], []).pending == ()


def test_request_for_another_driver_is_not_demand() -> None:
    other = claim("c1", [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 1}}])
    assert demand([other], [pod("p1", "c1")]).pending == ()


def test_capacity_selector_accepts_every_big_enough_profile_smallest_first() -> None:
    big = claim(
        "c1", [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io", "selectors": [
            {"cel": {"expression": f'{MEMORY}.compareTo(quantity("20Gi")) >= 0'}}]}}]
    )  # fmt: skip
    (pc,) = demand([big], [pod("p1", "c1")]).pending
    # 2g.20gb/1g.20gb publish 19.5 GiB on A100-80GB: below 20Gi
    assert pc.requests[0].alternatives() == ("3g.40gb", "4g.40gb", "7g.80gb")


def test_device_class_selectors_and_request_selectors_both_apply() -> None:
    c = claim(
        "c1", [{"name": "gpu", "exactly": {"deviceClassName": "mig-small", "selectors": [
            {"cel": {"expression": f'{MEMORY}.isGreaterThan(quantity("15Gi"))'}}]}}]
    )  # fmt: skip
    (pc,) = demand([c], [pod("p1", "c1")]).pending
    # class: at most 2 compute slices; request: more than 15Gi -> only the 20gb profiles
    assert pc.requests[0].alternatives() == ("1g.20gb", "2g.20gb")


def test_count_and_claims_generated_from_templates() -> None:
    c = claim("pod-a-gpu-x7k2", [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io", "count": 2,
        "selectors": [{"cel": {"expression": f'{PROFILE} == "3g.40gb"'}}]}}])  # fmt: skip
    p = pod("pod-a", "unused")
    p["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "training"}]
    p["status"]["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": "pod-a-gpu-x7k2"}]
    (pc,) = demand([c], [p]).pending
    (d,) = pc.planner_demands()
    assert d.count == 2 and d.alternatives == ("3g.40gb",)


def test_node_selector_and_required_affinity_restrict_nodes() -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n4"]}]},
                ]
            }
        }
    }
    nodes = {
        "n1": {"pool": "gpu", "zone": "a"},
        "n2": {"pool": "gpu", "zone": "b"},
        "n3": {"pool": "cpu", "zone": "a"},
        "n4": {"pool": "gpu", "zone": "c"},
    }
    p = pod("p1", "c1", nodeSelector={"pool": "gpu"}, affinity=affinity)
    (pc,) = demand([inference_claim("c1")], [p], nodes).pending
    assert pc.nodes == frozenset({"n1", "n4"})
    assert pc.planner_demands()[0].nodes == frozenset({"n1", "n4"})
    ref = parse_pod(p)
    assert pod_fits_node(ref, "n1", nodes["n1"]) and not pod_fits_node(ref, "n3", nodes["n3"])


def test_numeric_affinity_operators() -> None:
    p = pod("p1", "c1", affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["3"]}]}]}}})  # fmt: skip
    ref = parse_pod(p)
    assert pod_fits_node(ref, "a", {"gpus": "8"})
    assert not pod_fits_node(ref, "b", {"gpus": "2"})
    assert not pod_fits_node(ref, "c", {})


def test_claim_no_profile_can_satisfy_keeps_the_reason() -> None:
    c = claim(
        "c1",
        [
            {
                "name": "gpu",
                "firstAvailable": [
                    alt("huge", f'{PROFILE} == "9g.1tb"'),
                    alt("broken", 'device.attributes["mig.dynamig.io"].colour == "red"'),
                ],
            }
        ],
    )
    (pc,) = demand([c], [pod("p1", "c1")]).pending
    (req,) = pc.requests
    assert req.alternatives() == ()
    assert pc.planner_demands() == ()
    assert any("colour" in e for e in req.errors)


def test_two_mig_requests_become_two_planner_demands() -> None:
    c = claim(
        "c1",
        [
            {
                "name": "a",
                "exactly": {
                    "deviceClassName": "mig.dynamig.io",
                    "selectors": [{"cel": {"expression": f'{PROFILE} == "1g.10gb"'}}],
                },
            },
            {
                "name": "b",
                "exactly": {
                    "deviceClassName": "mig.dynamig.io",
                    "selectors": [{"cel": {"expression": f'{PROFILE} == "3g.40gb"'}}],
                },
            },
        ],
    )
    (pc,) = demand([c], [pod("p1", "c1")]).pending
    assert [(d.name, d.alternatives) for d in pc.planner_demands()] == [
        ("team/c1/a", ("1g.10gb",)),
        ("team/c1/b", ("3g.40gb",)),
    ]


def test_allowed_profiles_filter_alternatives() -> None:
    (pc,) = demand([inference_claim("c1")], [pod("p1", "c1")]).pending
    assert pc.planner_demands(frozenset({"2g.20gb", "3g.40gb"}))[0].alternatives == ("2g.20gb",)
    assert pc.planner_demands(frozenset({"3g.40gb"})) == ()


def test_each_first_available_alternative_keeps_its_own_count() -> None:
    # "two 1g.10gb, else one 7g.80gb": planned as such, not as two of either.
    two_or_one = {
        "name": "gpu",
        "firstAvailable": [
            alt("two-small", f'{PROFILE} == "1g.10gb"', count=2),
            alt("one-whole", f'{PROFILE} == "7g.80gb"', count=1),
        ],
    }
    snap = demand([claim("c1", [two_or_one])], [pod("p1", "c1")])
    (req,) = snap.pending[0].requests
    assert req.alternatives() == ("1g.10gb", "7g.80gb") and req.alternative_counts() == (2, 1)
    assert (req.count, req.min_count, req.count_for("7g.80gb")) == (2, 1, 1)
    (d,) = snap.pending[0].planner_demands()
    assert d.count == 2 and d.alt_counts == (2, 1) and d.count_for("7g.80gb") == 1
    # Only the whole-GPU alternative allowed: one device.
    (whole,) = snap.pending[0].planner_demands(frozenset({"7g.80gb"}))
    assert (whole.alternatives, whole.count, whole.alt_counts) == (("7g.80gb",), 1, ())


# ------------------------------------------------------------------------------------------ whole GPUs
# A GPU with MIG mode off is published whole (gpu<index>, profile "whole"); the selectors are evaluated on it
# as on the MIG devices, with the real CEL library.

WHOLE = f'{PROFILE} == "whole"'


def test_an_alternative_only_the_whole_gpu_passes_is_whole_demand_not_mig() -> None:
    c = claim("c1", [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io", "count": 2,
        "selectors": [{"cel": {"expression": WHOLE}}]}}])  # fmt: skip
    (pc,) = demand([c], [pod("p1", "c1")]).pending
    assert pc.requests == ()  # nothing for the MIG planner
    assert pc.planner_demands() == ()
    (req,) = pc.whole
    assert req.alternatives() == () and req.whole_models() == ("A100-80GB",)
    assert req.errors == ()  # not a claim "no profile matches"
    assert pc.whole_gpus == 2
    assert pc.whole_by_model() == {"A100-80GB": 2}


def test_a_capacity_selector_only_a_whole_gpu_meets_is_whole_demand() -> None:
    # 7g.80gb publishes 79 GiB on A100-80GB; the whole GPU its 80 GiB.
    c = claim("c1", [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io", "selectors": [
        {"cel": {"expression": f'{MEMORY}.compareTo(quantity("80Gi")) >= 0'}}]}}])  # fmt: skip
    (pc,) = demand([c], [pod("p1", "c1")]).pending
    assert pc.requests == () and pc.whole_gpus == 1
    # 79Gi: the 7g.80gb and the whole GPU both pass -> MIG demand, the whole GPU only noted.
    c = claim("c2", [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io", "selectors": [
        {"cel": {"expression": f'{MEMORY}.compareTo(quantity("79Gi")) >= 0'}}]}}])  # fmt: skip
    (pc,) = demand([c], [pod("p2", "c2")]).pending
    (req,) = pc.requests
    assert req.alternatives() == ("7g.80gb",) and req.whole_models() == ("A100-80GB",)
    assert pc.whole == () and pc.whole_gpus == 0


def test_whole_first_then_mig_keeps_the_mig_profiles_of_the_later_alternatives() -> None:
    c = claim("c1", [{"name": "gpu", "firstAvailable": [
        alt("whole", WHOLE, count=1),
        alt("small", f'{PROFILE} == "1g.10gb"', count=2),
        alt("medium", f'{PROFILE} == "3g.40gb"', count=1),
    ]}])  # fmt: skip
    (pc,) = demand([c], [pod("p1", "c1")]).pending
    (req,) = pc.requests
    assert req.alternatives() == ("1g.10gb", "3g.40gb") and req.alternative_counts() == (2, 1)
    assert req.whole_models() == ("A100-80GB",) and req.whole_count() == 1
    (d,) = pc.planner_demands()
    assert (d.alternatives, d.count, d.alt_counts) == (("1g.10gb", "3g.40gb"), 2, (2, 1))
    assert pc.whole == ()


def test_the_driver_class_without_selectors_stays_mig_demand() -> None:
    c = claim("c1", [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io"}}])
    (pc,) = demand([c], [pod("p1", "c1")]).pending
    (req,) = pc.requests
    assert req.alternatives()[0] == "1g.10gb"  # smallest first, as before
    assert req.whole_models() == ("A100-80GB",) and pc.whole == ()


def test_a_claim_of_the_whole_gpu_class_is_whole_demand_even_before_the_class_exists() -> None:
    c = claim("c1", [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dynamig.io"}}])
    # DEVICE_CLASSES has no gpu.dynamig.io: the operator makes it only while a GPU has MIG mode off.
    (pc,) = demand([c], [pod("p1", "c1")]).pending
    assert pc.requests == () and pc.whole_gpus == 1
    # A class of that name the operator did not make is evaluated as it is: here, another driver's.
    theirs = parse_device_classes([{"metadata": {"name": "gpu.dynamig.io"}, "spec": {"selectors": [
        {"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}]}}])  # fmt: skip
    assert extract_demand([c], [pod("p1", "c1")], theirs, models(), {"n1": {}}).pending == ()


def test_whole_and_mig_requests_of_one_claim_are_kept_apart() -> None:
    c = claim("c1", [
        {"name": "a", "exactly": {"deviceClassName": "mig.dynamig.io",
                                  "selectors": [{"cel": {"expression": f'{PROFILE} == "1g.10gb"'}}]}},
        {"name": "b", "exactly": {"deviceClassName": "mig.dynamig.io", "count": 3,
                                  "selectors": [{"cel": {"expression": WHOLE}}]}},
    ])  # fmt: skip
    (pc,) = demand([c], [pod("p1", "c1")]).pending
    assert [(d.name, d.alternatives) for d in pc.planner_demands()] == [("team/c1/a", ("1g.10gb",))]
    assert [r.demand_name for r in pc.whole] == ["team/c1/b"] and pc.whole_gpus == 3


def test_whole_gpu_demand_is_counted_per_model_its_selectors_accept() -> None:
    catalog = load_catalog()
    both = (catalog.model("A100-80GB"), catalog.model("H100-80GB"))
    hopper = f'{WHOLE} && device.attributes["mig.dynamig.io"].productName == "NVIDIA H100 80GB HBM3"'
    c = claim("c1", [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io", "count": 2,
        "selectors": [{"cel": {"expression": hopper}}]}}])  # fmt: skip
    snap = extract_demand([c], [pod("p1", "c1")], DEVICE_CLASSES, both, {"n1": {}})
    (pc,) = snap.pending
    assert pc.whole_by_model() == {"H100-80GB": 2}
    assert pc.whole_by_model(frozenset({"A100-80GB"})) == {}
    any_whole = claim("c2", [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io",
        "selectors": [{"cel": {"expression": WHOLE}}]}}])  # fmt: skip
    (pc,) = extract_demand([any_whole], [pod("p2", "c2")], DEVICE_CLASSES, both, {"n1": {}}).pending
    assert pc.whole_by_model() == {"A100-80GB": 1, "H100-80GB": 1}


def test_a_selector_nothing_of_this_driver_passes_is_still_no_matching_profile() -> None:
    c = claim("c1", [{"name": "gpu", "exactly": {"deviceClassName": "mig.dynamig.io",
        "selectors": [{"cel": {"expression": f'{PROFILE} == "9g.1tb"'}}]}}])  # fmt: skip
    (pc,) = demand([c], [pod("p1", "c1")]).pending
    (req,) = pc.requests
    assert req.alternatives() == () and req.whole_models() == () and pc.whole == ()
