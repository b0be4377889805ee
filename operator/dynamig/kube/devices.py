"""The DRA device a MIG instance is published as (resource.k8s.io/v1 ``Device``), the device a GPU with MIG
mode off is published as (:class:`WholeGpuDevice`), the DeviceClass that selects this driver's devices, and
the per-profile DeviceClasses and the whole-GPU DeviceClass serving device-plugin resource names. Pure.

The agent publishes these in ResourceSlices; the operator builds the same device for a profile that does not
exist yet and evaluates claim CEL selectors against it, so both sides must use this one builder.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dynamig import DRIVER_NAME
from dynamig.geometry.model import Profile, device_name
from dynamig.kube.names import (
    ATTRIBUTE_DOMAIN,
    DEVICE_CLASS_NAME,
    PROFILE_ANNOTATION,
    PROFILE_CLASS_LABEL,
    WHOLE_CLASS_NAME,
    WHOLE_GPU_RESOURCE,
    WHOLE_PROFILE,
    extended_resource_name,
    profile_class_name,
    whole_device_name,
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
        return _api_device(self.name, self.attributes(), self.capacity())


@dataclass(frozen=True, slots=True)
class NvlinkFacts:
    """A GPU's NVLink facts as NVML gives them, whatever its MIG mode (:mod:`dynamig.agent.nvml.fabric`): its
    active links and the NVLink fabric clique it is registered in; None (empty for the cluster) where NVML
    does not say. What a whole GPU publishes as ``nvlinkActiveLinks``, ``fabricClusterUuid`` and
    ``fabricCliqueId``, and what the operator matches whole-GPU claims against before switching MIG off."""

    active_links: int | None = None
    fabric_cluster_uuid: str = ""
    fabric_clique_id: int | None = None


@dataclass(frozen=True, slots=True)
class WholeGpuDevice:
    """What is published about a GPU whose MIG mode is off: the whole GPU as one device, ``gpu<index>``.

    ``profile`` is ``whole`` so a claim tells it from every MIG profile with the same selector it already
    writes; the facts come from NVML (memory, architecture, CUDA compute capability, active NVLink links,
    the NVLink fabric clique), each published only when NVML gives it. A GPU whose MIG mode is on publishes
    no such device (its memory slices are the MIG devices')."""

    gpu_index: int
    product_name: str
    uuid: str
    memory_bytes: int | None = None
    architecture: str = ""  # "Hopper", from nvmlDeviceGetArchitecture; empty when NVML does not say
    cuda_compute_capability: str = ""  # "9.0"; empty when NVML does not say
    multiprocessors: int | None = None  # the catalog's count for the model; None when unknown
    nvlink_active_links: int | None = None  # nvmlDeviceGetNvLinkState; None: no NVLink, or NVML does not say
    fabric_cluster_uuid: str = ""  # nvmlDeviceGetGpuFabricInfoV once registered; empty when in no fabric
    fabric_clique_id: int | None = None  # the clique within that cluster; None when in no fabric

    @property
    def name(self) -> str:
        return whole_device_name(self.gpu_index)

    def with_nvlink(self, facts: NvlinkFacts) -> WholeGpuDevice:
        """This device carrying the GPU's NVLink ``facts``."""
        return replace(
            self,
            nvlink_active_links=facts.active_links,
            fabric_cluster_uuid=facts.fabric_cluster_uuid,
            fabric_clique_id=facts.fabric_clique_id,
        )

    def attributes(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {
            "profile": WHOLE_PROFILE,
            "productName": self.product_name,
            "gpuIndex": self.gpu_index,
            "uuid": self.uuid,
        }
        if self.architecture:
            out["architecture"] = self.architecture
        if self.cuda_compute_capability:
            out["cudaComputeCapability"] = self.cuda_compute_capability
        if self.nvlink_active_links is not None:
            out["nvlinkActiveLinks"] = self.nvlink_active_links
        if self.fabric_cluster_uuid:
            out["fabricClusterUuid"] = self.fabric_cluster_uuid
        if self.fabric_clique_id is not None:
            out["fabricCliqueId"] = self.fabric_clique_id
        return out

    def capacity(self) -> dict[str, int]:
        out = {}
        if self.memory_bytes is not None:
            out["memory"] = self.memory_bytes
        if self.multiprocessors is not None:
            out["multiprocessors"] = self.multiprocessors
        return out

    def to_api(self) -> dict[str, Any]:
        """The ``Device`` object as the resource.k8s.io/v1 API takes it (no counters: nothing else is carved
        from a GPU whose MIG mode is off)."""
        return _api_device(self.name, self.attributes(), self.capacity())


def _api_device(name: str, attributes: dict[str, str | int], capacity: dict[str, int]) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for key, value in attributes.items():
        typed = {"int": value} if isinstance(value, int) else {"string": value}
        attrs[f"{ATTRIBUTE_DOMAIN}/{key}"] = typed
    caps = {f"{ATTRIBUTE_DOMAIN}/{k}": {"value": str(v)} for k, v in capacity.items()}
    return {"name": name, "attributes": attrs, "capacity": caps}


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


def whole_device_class() -> dict[str, Any]:
    """The DeviceClass ``gpu.dynamig.io``: this driver's whole GPUs (the device a GPU with MIG mode off is
    published as, ``profile`` ``whole``), serving pods that ask for the device plugin's ``nvidia.com/gpu``
    (``extendedResourceName``, DRAExtendedResource). Labelled and annotated like the profile classes
    (:func:`profile_device_class`), with ``whole`` as its profile, so the operator keeps and removes it the
    same way. Pure."""
    selector = (
        f'device.driver == "{DRIVER_NAME}" && device.attributes["{ATTRIBUTE_DOMAIN}"].profile == '
        f'"{WHOLE_PROFILE}"'
    )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {
            "name": WHOLE_CLASS_NAME,
            "labels": {PROFILE_CLASS_LABEL: "true"},
            "annotations": {PROFILE_ANNOTATION: WHOLE_PROFILE},
        },
        "spec": {
            "selectors": [{"cel": {"expression": selector}}],
            "extendedResourceName": WHOLE_GPU_RESOURCE,
        },
    }
