"""The DRA device a MIG instance is published as (resource.k8s.io/v1 ``Device``), the DeviceClass that
selects this driver's devices, and the per-profile DeviceClasses serving device-plugin resource names. Pure.

The agent publishes these in ResourceSlices; the operator builds the same device for a profile that does not
exist yet and evaluates claim CEL selectors against it, so both sides must use this one builder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynamig import DRIVER_NAME
from dynamig.geometry.model import Profile, device_name
from dynamig.kube.names import (
    ATTRIBUTE_DOMAIN,
    DEVICE_CLASS_NAME,
    PROFILE_ANNOTATION,
    PROFILE_CLASS_LABEL,
    extended_resource_name,
    profile_class_name,
)

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class MigDevice:
    """What is published about one MIG instance (or one that could be created)."""

    gpu_index: int
    profile: Profile
    placement_start: int
    product_name: str
    parent_uuid: str
    uuid: str = ""  # MIG UUID; empty for a device that does not exist yet
    memory_bytes: int | None = None  # from NVML when it exists; catalog MiB otherwise
    multiprocessors: int | None = None

    @property
    def name(self) -> str:
        return device_name(self.gpu_index, self.profile.name, self.placement_start)

    def attributes(self) -> dict[str, str | int]:
        """Attribute values keyed by their name in the ``mig.dynamig.io`` domain."""
        p = self.profile
        return {
            "profile": p.name,
            "productName": self.product_name,
            "gpuIndex": self.gpu_index,
            "parentUUID": self.parent_uuid,
            "uuid": self.uuid,
            "placementStart": self.placement_start,
            "placementSize": p.placement_size,
            "computeSlices": p.compute_slices,
            "memorySlices": p.placement_size,
            "profileId": p.profile_id,
        }

    def capacity(self) -> dict[str, int]:
        """Capacity values (memory in bytes, multiprocessors) keyed by name in the domain."""
        memory = self.memory_bytes if self.memory_bytes is not None else self.profile.memory_mib * MIB
        sms = self.multiprocessors if self.multiprocessors is not None else self.profile.multiprocessors
        return {"memory": memory, "multiprocessors": sms}

    def to_api(self) -> dict[str, Any]:
        """The ``Device`` object as the resource.k8s.io/v1 API takes it."""
        attrs: dict[str, Any] = {}
        for key, value in self.attributes().items():
            typed = {"int": value} if isinstance(value, int) else {"string": value}
            attrs[f"{ATTRIBUTE_DOMAIN}/{key}"] = typed
        capacity = {f"{ATTRIBUTE_DOMAIN}/{k}": {"value": str(v)} for k, v in self.capacity().items()}
        return {"name": self.name, "attributes": attrs, "capacity": capacity}


def device_class() -> dict[str, Any]:
    """The DeviceClass ``mig.dynamig.io``, selecting every device this driver publishes, as the
    resource.k8s.io/v1 API takes it. Pure."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS_NAME},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER_NAME}"'}}]},
    }


def profile_device_class(profile: str) -> dict[str, Any]:
    """The DeviceClass ``mig-<profile>.dynamig.io``: this driver's devices of one profile, serving pods that
    ask for the NVIDIA device plugin's resource name of it (``extendedResourceName``, DRAExtendedResource:
    the scheduler then allocates such a request from this class, k8s.io/api resource/v1 DeviceClassSpec).
    Pure."""
    selector = (
        f'device.driver == "{DRIVER_NAME}" && device.attributes["{ATTRIBUTE_DOMAIN}"].profile == "{profile}"'
    )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {
            "name": profile_class_name(profile),
            "labels": {PROFILE_CLASS_LABEL: "true"},
            "annotations": {PROFILE_ANNOTATION: profile},
        },
        "spec": {
            "selectors": [{"cel": {"expression": selector}}],
            "extendedResourceName": extended_resource_name(profile),
        },
    }
