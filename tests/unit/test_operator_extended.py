"""Pods that ask for MIG the device-plugin way (``nvidia.com/mig-1g.10gb: 1``): the DeviceClass per offered
profile the operator keeps, and such pods as pending demand while they have no claim.

Real: the MIG geometry catalog, cel-python evaluating the classes' selectors on devices as the agent
publishes them, the operator's own snapshot parser. The API server, the scheduler and the kubelet serving
these classes are in e2e/test_extended_resources.py.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from dynamig.geometry.catalog import load_catalog
from dynamig.kube.cel import device_view, device_view_from_api, evaluate_selector
from dynamig.kube.devices import MigDevice, WholeGpuDevice, profile_device_class, whole_device_class
from dynamig.kube.names import (
    WHOLE_CLASS_NAME,
    WHOLE_GPU_RESOURCE,
    WHOLE_PROFILE,
    extended_resource_name,
    profile_class_name,
)
from dynamig.operator.demand import (
    extended_resource_demand,
    extract_demand,
    parse_device_classes,
    pod_extended_requests,
    resource_classes,
)
from dynamig.operator.extended import class_changes, offered_profiles, whole_offered
from dynamig.operator.kubeio import Snapshot
from dynamig.operator.world import parse_world

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


# ------------------------------------------------------------------------------------------ whole GPUs


def test_the_whole_gpu_class_selects_exactly_whole_gpus_and_serves_nvidia_com_gpu() -> None:
    cls = whole_device_class()
    assert cls["metadata"]["name"] == WHOLE_CLASS_NAME == "gpu.dynamig.io"
    assert cls["spec"]["extendedResourceName"] == WHOLE_GPU_RESOURCE == "nvidia.com/gpu"
    # Recognised as dynamig's own as the profile classes are (the chart's admission policy reads the label).
    assert cls["metadata"]["labels"] == {"dynamig.io/profile-class": "true"}
    assert cls["metadata"]["annotations"] == {"dynamig.io/profile": "whole"}
    (selector,) = [s["cel"]["expression"] for s in cls["spec"]["selectors"]]
    whole = WholeGpuDevice(3, "NVIDIA H100 80GB HBM3", "GPU-3", 85899345920, "Hopper", "9.0")
    assert evaluate_selector(selector, device_view_from_api("mig.dynamig.io", whole.to_api())).matched
    p = H100.profile("7g.80gb")
    mig = device_view(MigDevice(3, p, 0, "NVIDIA H100 80GB HBM3", "GPU-3"))
    assert not evaluate_selector(selector, mig).matched
    assert not evaluate_selector(selector, device_view_from_api("gpu.nvidia.com", whole.to_api())).matched


def _mig_off(part: dict[str, Any]) -> dict[str, Any]:
    part["status"]["migMode"] = "Disabled"
    return part


def test_the_whole_class_is_wanted_while_a_governed_gpu_has_mig_mode_off() -> None:
    snap = _snapshot()
    assert whole_offered(*_offer_args(snap)) == ()
    on_h = dataclasses.replace(snap, partitions=(snap.partitions[0], _mig_off(_gpu("h", "H100-80GB"))))
    assert whole_offered(*_offer_args(on_h)) == ("hopper",)
    # A GPU no policy governs (the A30) does not count.
    ungoverned = dataclasses.replace(snap, partitions=(_mig_off(_gpu("x", "A30-24GB")),))
    assert whole_offered(*_offer_args(ungoverned)) == ()
    world = parse_world(on_h, load_catalog())
    h = next(g for g in world.gpus if g.node == "h")
    assert h.whole and h.unusable == "MIG mode is Disabled"  # served whole, never planned for MIG


def _offer_args(snap: Snapshot) -> tuple[Any, ...]:
    world = parse_world(snap, load_catalog())
    return world.policies, world.gpus, world.ownership.owner


def test_class_changes_keep_the_whole_class_like_a_profile_class() -> None:
    changes = class_changes(["1g.10gb", WHOLE_PROFILE], [_ours("1g.10gb")])
    (made,) = changes.create
    assert made == whole_device_class()
    kept = {**whole_device_class(), "metadata": {**whole_device_class()["metadata"], "resourceVersion": "3"}}
    assert class_changes([WHOLE_PROFILE], [kept]).writes == 0  # idempotent
    drifted = copy.deepcopy(kept)
    drifted["spec"]["extendedResourceName"] = "nvidia.com/gpu-old"
    (replaced,) = class_changes([WHOLE_PROFILE], [drifted]).replace
    assert replaced["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert replaced["metadata"]["resourceVersion"] == "3"
    # No GPU with MIG mode off any more (or the operator uninstalled): removed.
    assert class_changes(["1g.10gb"], [kept, _ours("1g.10gb")]).delete == ("gpu.dynamig.io",)
    assert class_changes((), [kept]).delete == ("gpu.dynamig.io",)


def test_the_whole_class_never_contests_another_owners_nvidia_com_gpu() -> None:
    nvidia = {
        "metadata": {"name": "gpu.nvidia.com"},
        "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}],
                 "extendedResourceName": "nvidia.com/gpu"},
    }  # fmt: skip
    ours = whole_device_class()
    changes = class_changes([WHOLE_PROFILE, "1g.10gb"], [nvidia, ours])
    assert changes.refused == {WHOLE_PROFILE: "gpu.nvidia.com"}
    assert changes.delete == ("gpu.dynamig.io",)  # ours backs off
    assert [c["metadata"]["name"] for c in changes.create] == ["mig-1g.10gb.dynamig.io"]
    squatter = {"metadata": {"name": "gpu.dynamig.io"}, "spec": {"selectors": []}}  # a person's, unlabelled
    changes = class_changes([WHOLE_PROFILE], [squatter])
    assert changes.refused == {WHOLE_PROFILE: "gpu.dynamig.io"} and changes.writes == 0


def test_a_pod_asking_nvidia_com_gpu_from_the_whole_class_is_whole_gpu_demand() -> None:
    classes = parse_device_classes([whole_device_class(), profile_device_class("1g.10gb")])
    pods = [
        _pod("trainer", [{"nvidia.com/gpu": "2"}]),
        _pod("both", [{"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "1"}]),
    ]
    got = {p.claim.name: p for p in extended_resource_demand(pods, classes, (A100,), {"a": {}})}
    trainer = got["trainer"]
    assert trainer.claim.is_pod and trainer.requests == () and trainer.planner_demands() == ()
    assert trainer.whole_gpus == 2 and trainer.whole_by_model() == {"A100-80GB": 2}
    both = got["both"]
    assert [r.request for r in both.requests] == ["nvidia.com/mig-1g.10gb"]
    assert [r.request for r in both.whole] == ["nvidia.com/gpu"]
    # nvidia.com/gpu served from the NVIDIA DRA driver's newer class: not this driver's demand.
    nvidia = {
        "metadata": {"name": "gpu.nvidia.com", "creationTimestamp": "2030-01-01T00:00:00Z"},
        "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}],
                 "extendedResourceName": "nvidia.com/gpu"},
    }  # fmt: skip
    theirs = parse_device_classes([whole_device_class(), nvidia])
    assert extended_resource_demand(pods[:1], theirs, (A100,), {"a": {}}) == []


def test_a_whole_gpu_pod_goes_to_the_policy_with_a_gpu_whose_mig_mode_is_off() -> None:
    pod = _pod("trainer", [{"nvidia.com/gpu": "1"}])
    snap = _snapshot((whole_device_class(),), (pod,))
    # Both models' whole GPUs pass; only the H100 (policy hopper, the younger) has MIG mode off.
    snap = dataclasses.replace(snap, partitions=(snap.partitions[0], _mig_off(_gpu("h", "H100-80GB"))))
    world = parse_world(snap, load_catalog())
    (pending,) = world.pending
    assert pending.whole_gpus == 1 and pending.requests == ()
    assert world.claim_owner["team/pod/trainer"] == "hopper"
