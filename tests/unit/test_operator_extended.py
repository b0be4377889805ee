"""Pods that ask for MIG the device-plugin way (``nvidia.com/mig-1g.10gb: 1``): the DeviceClass per offered
profile the operator keeps, and such pods as pending demand while they have no claim.

Real: the MIG geometry catalog, cel-python evaluating the classes' selectors on devices as the agent
publishes them, the operator's own snapshot parser. The API server, the scheduler and the kubelet serving
these classes are in e2e/test_extended_resources.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from dynamig.geometry.catalog import load_catalog
from dynamig.kube.cel import device_view, evaluate_selector
from dynamig.kube.devices import MigDevice, profile_device_class
from dynamig.kube.names import extended_resource_name, profile_class_name
from dynamig.operator.demand import (
    extended_resource_demand,
    extract_demand,
    parse_device_classes,
    pod_extended_requests,
    resource_classes,
)
from dynamig.operator.extended import class_changes, offered_profiles
from dynamig.operator.kubeio import Snapshot
from dynamig.operator.reconciler import parse_world

A100 = load_catalog().model("A100-80GB")
H100 = load_catalog().model("H100-80GB")


def test_names_follow_the_device_plugins_mixed_strategy() -> None:
    # k8s-device-plugin internal/rm/rm.go: strings.ReplaceAll("mig-"+profile, "+", ".") under nvidia.com/
    assert extended_resource_name("1g.10gb") == "nvidia.com/mig-1g.10gb"
    assert extended_resource_name("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"
    assert profile_class_name("3g.40gb") == "mig-3g.40gb.dynamig.io"
    assert profile_class_name("1g.24gb+me.all") == "mig-1g.24gb.me.all.dynamig.io"


def test_a_profile_class_selects_exactly_that_profiles_devices() -> None:
    cls = profile_device_class("1g.10gb")
    assert cls["spec"]["extendedResourceName"] == "nvidia.com/mig-1g.10gb"
    (selector,) = [s["cel"]["expression"] for s in cls["spec"]["selectors"]]

    def device(profile: str) -> Any:
        p = A100.profile(profile)
        return device_view(MigDevice(0, p, p.placement_starts[0], "NVIDIA A100-SXM4-80GB", "GPU-0"))

    assert evaluate_selector(selector, device("1g.10gb")).matched
    assert not evaluate_selector(selector, device("1g.20gb")).matched
    assert not evaluate_selector(selector, device("1g.10gb+me")).matched
    other = device_view(
        MigDevice(0, A100.profile("1g.10gb"), 0, "NVIDIA A100-SXM4-80GB", "GPU-0"), driver="gpu.nvidia.com"
    )
    assert not evaluate_selector(selector, other).matched  # another driver's device of the same name


def _gpu(node: str, model: str) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{node}-gpu0", "generation": 1},
        "spec": {"layout": []},
        "status": {"node": node, "gpuIndex": 0, "model": model, "product": model, "migMode": "Enabled",
                   "observedGeneration": 1, "phase": "Stable", "instances": []},
    }  # fmt: skip


def _snapshot(classes: tuple[dict[str, Any], ...] = (), pods: tuple[dict[str, Any], ...] = ()) -> Snapshot:
    return Snapshot(
        policies=(
            {
                "metadata": {"name": "ampere", "creationTimestamp": "2026-01-01T00:00:00Z"},
                "spec": {"gpuProducts": ["A100-80GB"], "allowedProfiles": ["1g.10gb", "3g.40gb"]},
            },
            {
                "metadata": {"name": "hopper", "creationTimestamp": "2026-02-01T00:00:00Z"},
                "spec": {"gpuProducts": ["H100-80GB"]},
            },
        ),
        partitions=(_gpu("a", "A100-80GB"), _gpu("h", "H100-80GB"), _gpu("x", "A30-24GB")),
        nodes=tuple({"metadata": {"name": n, "labels": {"kubernetes.io/hostname": n}}} for n in "ahx"),
        pods=pods,
        claims=(),
        device_classes=classes,
    )


def test_the_profiles_offered_are_the_governed_models_within_allowed_profiles() -> None:
    world = parse_world(_snapshot(), load_catalog())
    offered = offered_profiles(world.policies, world.gpus, world.ownership.owner)
    assert offered["1g.10gb"] == ("ampere", "hopper")  # both models have it
    assert offered["3g.40gb"] == ("ampere", "hopper")
    assert offered["2g.20gb"] == ("hopper",)  # outside ampere's allowedProfiles
    assert set(offered) == {"1g.10gb", "3g.40gb"} | {p.name for p in H100.profiles}
    assert "1g.6gb" not in offered  # the A30's: no policy governs it


def _ours(profile: str, version: str = "7", **spec: Any) -> dict[str, Any]:
    obj = profile_device_class(profile)
    obj["metadata"]["resourceVersion"] = version
    obj["spec"].update(spec)
    return obj


def test_class_changes_create_update_and_delete_only_dynamigs_own() -> None:
    existing = [
        _ours("1g.10gb"),  # as wanted: untouched
        _ours("3g.40gb", extendedResourceName="nvidia.com/mig-3g.40gb-old"),  # drifted: replaced
        _ours("7g.80gb"),  # no longer offered: deleted
        {"metadata": {"name": "mig.dynamig.io"}, "spec": {"selectors": []}},  # the chart's: not ours
    ]
    changes = class_changes(["1g.10gb", "3g.40gb", "2g.20gb"], existing)
    assert [c["metadata"]["name"] for c in changes.create] == ["mig-2g.20gb.dynamig.io"]
    (replaced,) = changes.replace
    assert replaced["metadata"]["resourceVersion"] == "7"  # a concurrent change fails with 409, not lost
    assert replaced["spec"]["extendedResourceName"] == "nvidia.com/mig-3g.40gb"
    assert changes.delete == ("mig-7g.80gb.dynamig.io",)
    assert not changes.refused
    assert class_changes(["1g.10gb"], [_ours("1g.10gb")]).writes == 0  # idempotent


def test_a_resource_name_another_owner_serves_is_refused_and_ours_backs_off() -> None:
    theirs = {
        "metadata": {"name": "mig-1g10gb.nvidia.com"},
        "spec": {"selectors": [], "extendedResourceName": "nvidia.com/mig-1g.10gb"},
    }
    squatter = {"metadata": {"name": "mig-2g.20gb.dynamig.io"}, "spec": {"selectors": []}}  # a person's
    changes = class_changes(["1g.10gb", "2g.20gb"], [theirs, squatter, _ours("1g.10gb")])
    assert changes.refused == {"1g.10gb": "mig-1g10gb.nvidia.com", "2g.20gb": "mig-2g.20gb.dynamig.io"}
    assert not changes.create and not changes.replace
    assert changes.delete == ("mig-1g.10gb.dynamig.io",)  # the scheduler would pick one of two: ours goes


def test_the_scheduler_serves_a_resource_name_from_the_newest_class_then_the_first_by_name() -> None:
    def cls(name: str, created: str, resource: str = "nvidia.com/mig-1g.10gb") -> dict[str, Any]:
        return {
            "metadata": {"name": name, "creationTimestamp": created},
            "spec": {"extendedResourceName": resource},
        }

    classes = parse_device_classes(
        [
            cls("b-old", "2026-01-01T00:00:00Z"),
            cls("c-new", "2026-02-01T00:00:00Z"),
            cls("a-new", "2026-02-01T00:00:00Z"),
            cls("solo", "2026-01-01T00:00:00Z", "example.com/thing"),
        ]
    )
    served = resource_classes(classes)
    assert served["nvidia.com/mig-1g.10gb"] == "a-new"
    assert served["example.com/thing"] == "solo"
    assert served["deviceclass.resource.kubernetes.io/b-old"] == "b-old"  # the implicit name of every class


def _pod(
    name: str,
    containers: list[dict[str, str]],
    init: list[dict[str, str]] = (),  # type: ignore[assignment]
    unschedulable: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    status.update(extra.pop("status", {}))
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}",
                     "creationTimestamp": "2026-03-01T00:00:00Z"},
        "spec": {
            "containers": [{"name": f"c{i}", "resources": {"limits": r}} for i, r in enumerate(containers)],
            "initContainers": [{"name": f"i{i}", "resources": {"requests": r}} for i, r in enumerate(init)],
            **extra,
        },
        "status": status,
    }  # fmt: skip


CLASSES = parse_device_classes([profile_device_class("1g.10gb"), profile_device_class("3g.40gb")])


def test_a_pods_extended_requests_count_as_the_scheduler_counts_them() -> None:
    served = resource_classes(CLASSES)
    pod = _pod(
        "p",
        [{"nvidia.com/mig-1g.10gb": "1", "cpu": "2"}, {"nvidia.com/mig-1g.10gb": "2"}],
        init=[{"nvidia.com/mig-1g.10gb": "2", "nvidia.com/mig-3g.40gb": "1"}],
    )
    # Containers add up; an init container runs alone before them, so it counts only when larger.
    assert pod_extended_requests(pod, served) == {"nvidia.com/mig-1g.10gb": 3, "nvidia.com/mig-3g.40gb": 1}
    assert pod_extended_requests(_pod("q", [{"nvidia.com/gpu": "1"}]), served) == {}


def test_an_unschedulable_device_plugin_pod_is_demand_of_its_own() -> None:
    pods = [
        _pod("small", [{"nvidia.com/mig-1g.10gb": "2"}], nodeSelector={"kubernetes.io/hostname": "a"}),
        _pod("mixed", [{"nvidia.com/mig-1g.10gb": "1", "nvidia.com/mig-3g.40gb": "1"}]),
        _pod("waiting", [{"nvidia.com/mig-1g.10gb": "1"}], unschedulable=False),  # not tried yet
        _pod("served", [{"nvidia.com/mig-1g.10gb": "1"}],
             status={"extendedResourceClaimStatus": {"resourceClaimName": "served-extended-resources-x"}}),
        _pod("plugin", [{"nvidia.com/gpu": "1"}]),  # no class serves it
    ]  # fmt: skip
    nodes = {"a": {"kubernetes.io/hostname": "a"}, "b": {"kubernetes.io/hostname": "b"}}
    got = {p.claim.name: p for p in extended_resource_demand(pods, CLASSES, (A100,), nodes)}
    assert set(got) == {"small", "mixed"}
    small = got["small"]
    assert small.claim.is_pod and small.claim.key == "team/pod/small" and small.claim.uid == "uid-small"
    assert small.nodes == frozenset({"a"})
    (req,) = small.requests
    assert req.alternatives() == ("1g.10gb",) and req.count == 2
    (demand,) = small.planner_demands()
    assert (demand.name, demand.alternatives, demand.count) == ("team/pod/small", ("1g.10gb",), 2)
    mixed = got["mixed"]
    assert mixed.nodes is None
    assert [r.demand_name for r in mixed.requests] == [
        "team/pod/mixed/nvidia.com/mig-1g.10gb",
        "team/pod/mixed/nvidia.com/mig-3g.40gb",
    ]
    # The same pods through the operator's whole demand extraction, beside claims.
    snap = extract_demand([], pods, CLASSES, (A100,), nodes)
    assert [p.claim.key for p in snap.pending] == ["team/pod/mixed", "team/pod/small"]


@pytest.mark.parametrize("profile", ["1g.10gb", "3g.40gb"])
def test_the_operator_plans_for_device_plugin_pods_in_its_world(profile: str) -> None:
    pod = _pod("burst", [{extended_resource_name(profile): "1"}])
    classes = (profile_device_class("1g.10gb"), profile_device_class("3g.40gb"))
    world = parse_world(_snapshot(classes, (pod,)), load_catalog())
    (pending,) = world.pending
    assert pending.claim.key == "team/pod/burst"
    assert world.claim_owner["team/pod/burst"] == "ampere"  # the oldest policy with a GPU that has it
    assert pending.planner_demands(None, frozenset({"A100-80GB"}))[0].alternatives == (profile,)
