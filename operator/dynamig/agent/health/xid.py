"""XID errors: which ones are device faults, which devices they affect, and how a slice shows them. Pure.

Classification follows NVIDIA's k8s-device-plugin (``internal/rm/health.go``, after NVIDIA's XID catalog,
docs.nvidia.com/deploy/xid-errors): XIDs 13 (Graphics Engine Exception), 31 (GPU memory page fault), 43 (GPU
stopped processing), 45 (Preemptive cleanup, due to previous errors) and 68 (Video processor exception)
are application errors, "the GPU should still be healthy"; every other XID, including one NVML cannot name
(nvml.h: "eventData is set as 999 for unknown Xid error"), marks the device unhealthy. The agent's
``--xid-ignore`` adds XIDs to the application list, as the device plugin's ``DP_DISABLE_HEALTHCHECKS=xids``.

Scope: an XID that NVML attributes to a GPU instance (``gpuInstanceId`` not 0xFFFFFFFF, MIG on) affects that
instance's device; any other affects every device of the GPU. XIDs 79 (GPU has fallen off the bus) and 95
(uncontained ECC error: NVIDIA's catalog says every application on the GPU is affected and the GPU needs a
reset) affect the whole GPU even when attributed to an instance.

Publishing: on an API server that keeps device ``taints`` in ResourceSlices (DRADeviceTaints: beta and on in
Kubernetes 1.36, GA in 1.37; alpha and off in 1.35) each affected device carries a taint :data:`TAINT_KEY` =
the XID, effect ``NoSchedule`` (or ``NoExecute`` where the agent is told so); elsewhere the device is left out
of the slice.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynamig.kube.slices import CONTENT_ANNOTATION, ordered_content_hash

TAINT_KEY = "mig.dynamig.io/xid"
NOT_ATTRIBUTED = 0xFFFFFFFF  # nvml.h nvmlEventData_t: gpuInstanceId / computeInstanceId otherwise
MAX_DEVICES_WITH_TAINTS = 64  # resource.k8s.io/v1: a slice with any tainted device holds at most 64

# NVIDIA k8s-device-plugin internal/rm/health.go applicationErrorXids: "Application errors: the GPU should
# still be healthy".
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
GPU_WIDE_XIDS = frozenset({79, 95})

# What NVIDIA's XID catalog calls the XIDs an operator meets most (the Event and condition quote it).
MEANINGS: Mapping[int, str] = {
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors",
    48: "Double Bit ECC Error",
    61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "Video processor exception",
    69: "Graphics Engine class error",
    74: "NVLink Error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    999: "unknown Xid error (NVML)",
}


@dataclass(frozen=True, slots=True)
class XidClass:
    xid: int
    meaning: str
    critical: bool  # a device fault: taint or withdraw
    whole_gpu: bool  # affects every device of the GPU whatever instance NVML names


def classify(xid: int, ignored: Collection[int] = APPLICATION_XIDS) -> XidClass:
    """What XID ``xid`` means for the device. ``ignored``: the XIDs that are no device fault."""
    meaning = MEANINGS.get(xid, "see NVIDIA's XID catalog")
    return XidClass(xid, meaning, xid not in ignored, xid in GPU_WIDE_XIDS)


def attributed(instance_id: int | None) -> int | None:
    """An instance id from ``nvmlEventData_t``: None when NVML attributes the event to no instance."""
    return None if instance_id is None or instance_id == NOT_ATTRIBUTED else int(instance_id)


def affected_devices(
    gpu_index: int, gi_id: int | None, whole_gpu: bool, instance_devices: Mapping[int, str]
) -> frozenset[str] | None:
    """The devices an XID affects: ``{device}`` for one attributed to the GPU instance ``gi_id`` whose device
    ``instance_devices`` (GI id -> device name) names, None for every device of GPU ``gpu_index`` (not
    attributed, a whole-GPU XID, or an instance no longer known: the GPU as a whole, to be safe)."""
    if whole_gpu or gi_id is None or gi_id not in instance_devices:
        return None
    return frozenset({instance_devices[gi_id]})


@dataclass(frozen=True, slots=True)
class Taint:
    xid: int
    time_added: str  # RFC 3339
    effect: str = ""  # the GPU's own (GpuPartition spec.xidEffect); "": the agent's

    def to_api(self, effect: str) -> dict[str, Any]:
        """The taint in a slice's device; ``effect``: the agent's, used where the taint names none."""
        return {
            "key": TAINT_KEY,
            "value": str(self.xid),
            "effect": self.effect or effect,
            "timeAdded": self.time_added,
        }


def gpu_of_device(name: str) -> int | None:
    """``gpu3-1g10gb-s0`` -> 3 (the GPU index every dynamig device name starts with); None otherwise."""
    head = name.split("-", 1)[0]
    return int(head[3:]) if head.startswith("gpu") and head[3:].isdigit() else None


def taint_of(name: str, devices: Mapping[str, Taint], gpus: Mapping[int, Taint]) -> Taint | None:
    """The taint device ``name`` carries: the latest of its own and its GPU's, or None."""
    index = gpu_of_device(name)
    found = [t for t in (devices.get(name), None if index is None else gpus.get(index)) if t is not None]
    return max(found, key=lambda t: t.time_added) if found else None


def with_health(
    bodies: Sequence[dict[str, Any]],
    devices: Mapping[str, Taint],
    gpus: Mapping[int, Taint],
    *,
    taints: bool,
    effect: str = "NoSchedule",
    keep: Collection[str] = (),
) -> list[dict[str, Any]]:
    """``bodies`` (ResourceSlices as the publisher builds them) with each sick device tainted (``taints``)
    or left out (not ``taints``; a device in ``keep``, booked and not answered, stays: the publisher's rule).
    A slice that would carry taints on more devices than the API allows withdraws them instead. A slice
    changed gets a new content digest, so the change is published. New dicts; ``bodies`` untouched."""
    if not devices and not gpus:
        return list(bodies)
    out = []
    for body in bodies:
        spec = body.get("spec") or {}
        listed = spec.get("devices")
        if not listed:
            out.append(body)
            continue
        sick = {d["name"]: t for d in listed if (t := taint_of(d["name"], devices, gpus)) is not None}
        if not sick:
            out.append(body)
            continue
        taint_here = taints and len(listed) <= MAX_DEVICES_WITH_TAINTS
        new_devices = []
        for d in listed:
            t = sick.get(d["name"])
            if t is None:
                new_devices.append(d)
            elif taint_here:
                new_devices.append({**d, "taints": [t.to_api(effect)]})
            elif d["name"] in keep:
                new_devices.append(d)
        annotations = dict((body.get("metadata") or {}).get("annotations") or {})
        health = {
            n: (t.xid, t.time_added, (t.effect or effect) if taint_here else "Withdrawn")
            for n, t in sick.items()
        }
        annotations[CONTENT_ANNOTATION] = ordered_content_hash([annotations.get(CONTENT_ANNOTATION), health])
        out.append(
            {
                **body,
                "metadata": {**body["metadata"], "annotations": annotations},
                "spec": {**spec, "devices": new_devices},
            }
        )
    return out
