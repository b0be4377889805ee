"""A GPU's NVLink links and its place in an NVLink fabric, read through NVML (the ``pynvml`` module interface)
for every GPU the agent lists (:meth:`dynamig.agent.nvml.device.NvmlDevices.gpus`), whatever its MIG mode:
published on the device a GPU with MIG mode off is published as, so that a claim for several GPUs can
select GPUs that NVLink joins, and reported in every GpuPartition's status, so that the operator switches
MIG off only on a GPU whose links such a claim accepts. Every function does NVML I/O, reads only, and
answers None for a fact NVML does not give rather than failing the GPU.

Both queries take the parent GPU's handle, and nvml.h names no MIG mode condition for either (unlike the
queries it documents as unsupported on MIG-enabled GPUs), so they are asked with MIG mode on too; a GPU
that answers NOT_SUPPORTED there simply reports no NVLink facts.

- ``nvmlDeviceGetNvLinkState`` for each link up to ``NVML_NVLINK_MAX_LINKS``: nvml.h, "NVML_FEATURE_ENABLED
  indicates that the link is active"; a link that answers "NVML_ERROR_INVALID_ARGUMENT if device or link is
  invalid" is not one the GPU has, "NVML_ERROR_NOT_SUPPORTED if the device doesn't support this feature" is
  a GPU without NVLink. The count is unknown when no link answers at all, or when any answers another error.
- ``nvmlDeviceGetGpuFabricInfoV`` (``nvmlDeviceGetGpuFabricInfo`` on a driver that lacks it): the cluster
  UUID ("Uuid of the cluster to which this GPU belongs") and clique ("ID of the fabric clique to which this
  GPU belongs"), only once the probe has completed and succeeded (nvml.h on ``status``: "Must be checked
  only if state returns "complete"."). A cluster UUID of all zeros is no fabric either: NVIDIA's DRA driver
  reads it as an NVLink system that is not a multi-node one ("Cluster UUID with zero value: treat as MNNVL
  not supported", kubernetes-sigs/dra-driver-nvidia-gpu ``cmd/compute-domain-kubelet-plugin/nvlib.go``),
  and every such system answers the same zeros, so publishing them would join GPUs that no NVLink joins.
"""

from __future__ import annotations

import ctypes
import logging
import uuid
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from dynamig.kube.devices import NvlinkFacts

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FabricClique:
    """The NVLink fabric a GPU is registered in: its cluster UUID and the clique within it."""

    cluster_uuid: str  # "c0ffee00-...", the UUID's usual text form
    clique_id: int


def active_nvlinks(nv: ModuleType, h: Any) -> int | None:
    """How many of the GPU's NVLink links are active; None when NVML does not say (no NVLink, or an error).
    ``h``: a GPU's parent handle. Reads only."""
    active = answered = 0
    for link in range(int(nv.NVML_NVLINK_MAX_LINKS)):
        try:
            state = nv.nvmlDeviceGetNvLinkState(h, link)
        except (nv.NVMLError_InvalidArgument, nv.NVMLError_NotSupported):
            continue  # not a link of this GPU, or a GPU without NVLink
        except nv.NVMLError as exc:
            log.debug("nvmlDeviceGetNvLinkState(link %d): %s; NVLink left out", link, exc)
            return None
        answered += 1
        if int(state) == int(nv.NVML_FEATURE_ENABLED):
            active += 1
    return active if answered else None


def _fabric_info(nv: ModuleType, h: Any) -> Any | None:
    info = nv.c_nvmlGpuFabricInfoV_t()  # pynvml sets its version
    try:
        nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
        return info
    except nv.NVMLError_FunctionNotFound:
        pass  # a driver from before the versioned call
    except nv.NVMLError as exc:
        log.debug("nvmlDeviceGetGpuFabricInfoV: %s; fabric left out", exc)
        return None
    info = nv.c_nvmlGpuFabricInfo_t()
    try:
        nv.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
    except nv.NVMLError as exc:
        log.debug("nvmlDeviceGetGpuFabricInfo: %s; fabric left out", exc)
        return None
    return info


def fabric_clique(nv: ModuleType, h: Any) -> FabricClique | None:
    """The NVLink fabric clique the GPU is registered in; None when it is in none NVML reports (not
    supported, the probe not completed or failed, the all-zero cluster UUID). Reads only."""
    info = _fabric_info(nv, h)
    if info is None:
        return None
    if int(info.state) != int(nv.NVML_GPU_FABRIC_STATE_COMPLETED) or int(info.status) != int(nv.NVML_SUCCESS):
        log.debug("fabric probe state %d, status %d: fabric left out", int(info.state), int(info.status))
        return None
    raw = bytes(info.clusterUuid)
    if not any(raw):
        return None
    return FabricClique(str(uuid.UUID(bytes=raw)), int(info.cliqueId))


def nvlink_facts(nv: ModuleType, h: Any) -> NvlinkFacts:
    """The GPU's active NVLink links and fabric clique, each left out when NVML does not give it. ``h``: a
    GPU's parent handle. Reads only."""
    links, clique = active_nvlinks(nv, h), fabric_clique(nv, h)
    if clique is None:
        return NvlinkFacts(links)
    return NvlinkFacts(links, clique.cluster_uuid, clique.clique_id)
