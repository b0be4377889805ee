"""The DeviceClasses that serve the NVIDIA device plugin's MIG resource names from dynamig's devices: one per
profile the policies offer (``mig-1g.10gb.dynamig.io``, ``extendedResourceName: nvidia.com/mig-1g.10gb``), so
a pod asking ``nvidia.com/mig-1g.10gb: 1`` is served unchanged (DRAExtendedResource). Pure.

The operator keeps them rather than the chart: which profiles exist follows the GPU models the policies govern
and their ``allowedProfiles`` (an A100-80GB pool offers ``1g.10gb``, an H200 pool ``1g.18gb``), which only the
operator sees, and it is the one that can see a class of another owner. kube-scheduler serves a resource name
from the newest class that names it (k8s.io/dynamic-resource-allocation v0.37.2, extendedresourcecache), so a
class dynamig did not make that already names the resource (the NVIDIA DRA driver's, a person's) is never
contested: dynamig makes none for that profile, removes its own if it has one, and says so.

Whole GPUs are kept the same way: while some GPU a policy governs has MIG mode off (and is published whole,
``gpu<index>``, profile ``whole``), the operator keeps the class ``gpu.dynamig.io`` serving ``nvidia.com/gpu``
(:func:`dynamig.kube.devices.whole_device_class`); :func:`class_changes` takes it as the pseudo-profile
``whole`` (``WHOLE_PROFILE``), under the same label, the same never-contest rule and the same removal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamig.kube.devices import profile_device_class, whole_device_class
from dynamig.kube.names import (
    PROFILE_ANNOTATION,
    PROFILE_CLASS_LABEL,
    WHOLE_GPU_RESOURCE,
    WHOLE_PROFILE,
    extended_resource_name,
)
from dynamig.kube.policy import GpuPartitionPolicy
from dynamig.operator.inventory import GpuView


def offered_profiles(
    policies: Sequence[GpuPartitionPolicy], gpus: Iterable[GpuView], owner: Mapping[str, str]
) -> dict[str, tuple[str, ...]]:
    """Profile -> the policies offering it: each profile of the model of each GPU a policy governs, within the
    policy's ``allowedProfiles``. Pure."""
    by_name = {p.name: p for p in policies}
    out: dict[str, set[str]] = {}
    for g in gpus:
        policy = by_name.get(owner.get(g.name, ""))
        if policy is None or g.model is None:
            continue
        allowed = policy.spec.allowed_profiles
        for profile in g.model.profiles:
            if allowed is None or profile.name in allowed:
                out.setdefault(profile.name, set()).add(policy.name)
    return {profile: tuple(sorted(names)) for profile, names in sorted(out.items())}


def whole_offered(
    policies: Sequence[GpuPartitionPolicy], gpus: Iterable[GpuView], owner: Mapping[str, str]
) -> tuple[str, ...]:
    """The policies governing some GPU with MIG mode off (served whole, ``gpu.dynamig.io``), by name. Pure."""
    names = {p.name for p in policies}
    return tuple(sorted({owner[g.name] for g in gpus if g.whole and owner.get(g.name) in names}))


def served_resource(profile: str) -> str:
    """The extended resource the class of ``profile`` serves: ``nvidia.com/gpu`` for ``whole``, the device
    plugin's MIG name otherwise. Pure."""
    return WHOLE_GPU_RESOURCE if profile == WHOLE_PROFILE else extended_resource_name(profile)


def desired_class(profile: str) -> dict[str, Any]:
    """dynamig's DeviceClass for ``profile`` (``whole``: the whole-GPU class). Pure."""
    return whole_device_class() if profile == WHOLE_PROFILE else profile_device_class(profile)


@dataclass(frozen=True)
class ClassChanges:
    """What to write so the profile classes match the offered profiles."""

    create: tuple[dict[str, Any], ...] = ()
    replace: tuple[dict[str, Any], ...] = ()  # ours whose spec drifted, with their resourceVersion
    delete: tuple[str, ...] = ()  # ours no longer offered, or contested by another owner's class
    refused: Mapping[str, str] = field(default_factory=dict)  # profile -> the other class naming its resource

    @property
    def writes(self) -> int:
        return len(self.create) + len(self.replace) + len(self.delete)


def class_changes(profiles: Iterable[str], existing: Iterable[Mapping[str, Any]]) -> ClassChanges:
    """The writes that make the cluster's DeviceClasses (``existing``, every class) hold one of dynamig's
    profile classes per profile in ``profiles`` (``whole``: the whole-GPU class) and none other, contesting
    no class of another owner. Pure."""
    ours: dict[str, Mapping[str, Any]] = {}
    others_by_resource: dict[str, str] = {}
    others_by_name: set[str] = set()
    for obj in existing:
        meta = obj.get("metadata") or {}
        if (meta.get("labels") or {}).get(PROFILE_CLASS_LABEL) == "true":
            ours[str((meta.get("annotations") or {}).get(PROFILE_ANNOTATION, ""))] = obj
            continue
        others_by_name.add(str(meta.get("name", "")))
        resource = (obj.get("spec") or {}).get("extendedResourceName")
        if resource:
            others_by_resource.setdefault(str(resource), str(meta.get("name", "")))
    create: list[dict[str, Any]] = []
    replace: list[dict[str, Any]] = []
    refused: dict[str, str] = {}
    wanted = set(profiles)
    for profile in sorted(wanted):
        desired = desired_class(profile)
        other = others_by_resource.get(served_resource(profile))
        if other is None and desired["metadata"]["name"] in others_by_name:
            other = desired["metadata"]["name"]  # the name is taken by a class that is not ours
        if other is not None:
            refused[profile] = other
            continue
        have = ours.get(profile)
        if have is None:
            create.append(desired)
        elif have.get("spec") != desired["spec"]:
            desired["metadata"]["resourceVersion"] = have["metadata"].get("resourceVersion", "")
            replace.append(desired)
    delete = tuple(
        sorted(
            str(obj["metadata"]["name"])
            for profile, obj in ours.items()
            if profile not in wanted or profile in refused
        )
    )
    return ClassChanges(tuple(create), tuple(replace), delete, refused)
