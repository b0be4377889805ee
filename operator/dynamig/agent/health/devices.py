"""Device health from NVML XID events, as the scheduler sees it.

A thread (:class:`XidWatcher`, as NVIDIA's device plugin runs its health check) registers every GPU for
``nvmlEventTypeXidCriticalError`` in one event set (``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents``) and
waits on it (``nvmlEventSetWait``, one second at a time, ``NVML_ERROR_TIMEOUT`` when nothing came). Each XID
is counted (``dynamig_xid_errors_total``) and classified (:mod:`dynamig.agent.health.xid`); a critical one
becomes a :class:`Fault` of :class:`DeviceHealth` and wakes the agent's loop. The round then:

- maps each fault to its devices (the MIG instance's device for an XID attributed to a GPU instance, every
  device of the GPU otherwise), with the GPU instances the round read;
- has the publisher taint those devices in the node's slices (key ``mig.dynamig.io/xid``, value the XID,
  the effect the GPU's GpuPartition names in ``spec.xidEffect``, which the operator writes from its policy's
  ``spec.health.xidEffect``, else the agent's ``--xid-effect``, ``NoSchedule`` by default) where the API
  server keeps device taints (asked once with a dry-run create, as :mod:`dynamig.agent.publishing.features`
  does), or leave them out;
- sets the GpuPartition's ``DevicesHealthy`` condition and posts a ``CriticalXid`` Warning Event per fault.

A fault clears when the administrator says the GPU was recovered (the GpuPartition's annotation
``mig.dynamig.io/xid-cleared`` set to an RFC 3339 time clears the faults seen before it; ``XidCleared`` Event)
or, with ``--xid-clear-after=SECONDS``, when its GPU has had no critical XID for that long. Faults live in the
agent's memory: a restarted agent publishes the devices untainted until the next XID (as the device plugin).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from dynamig import API_GROUP, DRIVER_NAME
from dynamig.agent.health.xid import (
    APPLICATION_XIDS,
    TAINT_KEY,
    Taint,
    affected_devices,
    attributed,
    classify,
    with_health,
)
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.nvml.device import GpuInfo
from dynamig.agent.publishing.gpu_status import GpuOutcome
from dynamig.geometry.model import device_name
from dynamig.kube.gpupartition import ConditionType, GpuPartition, set_condition
from dynamig.kube.names import gpu_partition_name
from dynamig.kube.times import now_rfc3339, parse_time, rfc3339

log = logging.getLogger(__name__)

CONDITION = ConditionType.DEVICES_HEALTHY
CLEAR_ANNOTATION = f"{API_GROUP}/xid-cleared"
EFFECTS = ("NoSchedule", "NoExecute")
WAIT_MS = 1000
RETRY_S = 5.0  # after NVML fails the watcher (driver reload, a GPU lost), register again this much later


@dataclass
class Fault:
    """A critical XID on one GPU, as NVML reported it."""

    gpu_uuid: str
    xid: int
    meaning: str
    gi_id: int | None
    ci_id: int | None
    whole_gpu: bool
    at: float  # wall-clock time the agent received it
    devices: frozenset[str] | None = None  # resolved by a round; None: every device of the GPU
    resolved: bool = False
    reported: bool = False  # its Event was posted

    def where(self) -> str:
        if self.devices is None:
            return "the whole GPU"
        inst = f"GPU instance {self.gi_id}" + (
            "" if self.ci_id is None else f", compute instance {self.ci_id}"
        )
        return f"{', '.join(sorted(self.devices))} ({inst})"

    def text(self) -> str:
        return f"XID {self.xid} ({self.meaning}) on {self.where()} at {rfc3339(self.at)}"


@dataclass
class DeviceHealth:
    """The node's faults: written by the watcher thread, read by the agent's rounds and its publisher."""

    node: str
    effect: str = "NoSchedule"
    clear_after_s: float = 0.0  # 0: only the annotation clears
    clock: Callable[[], float] = time.time
    on_fault: Callable[[], None] | None = None  # called from the watcher thread
    taints_served: bool | None = None  # asked once, when a fault is first published
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _faults: list[Fault] = field(default_factory=list)
    _cleared: list[tuple[str, str]] = field(default_factory=list)  # (GpuPartition, message) to report
    _index: dict[str, int] = field(default_factory=dict)  # GPU UUID -> index, from the last round
    # GPU index -> the taint effect its GpuPartition asks (spec.xidEffect, written from the policy)
    _effects: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.effect not in EFFECTS:
            raise ValueError(f"XID taint effect {self.effect!r}: one of {', '.join(EFFECTS)}")

    def effect_of(self, partition: str) -> str:
        """The taint effect of the GPU whose GpuPartition is ``partition``: its own, else the agent's."""
        for index, effect in self._effects.items():
            if gpu_partition_name(self.node, index) == partition:
                return effect
        return self.effect

    # --- the watcher's side ----------------------------------------------------------------------

    def add(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)
        log.warning("node %s: critical %s", self.node, fault.text())
        if self.on_fault is not None:
            self.on_fault()

    def faults(self) -> list[Fault]:
        with self._lock:
            return list(self._faults)

    # --- the round's side ------------------------------------------------------------------------

    def observe(
        self,
        gpus: Sequence[GpuInfo],
        instances: Mapping[int, Mapping[int, str]],
        parts: Mapping[str, GpuPartition],
    ) -> None:
        """Resolve new faults to devices (``instances``: GPU index -> GI id -> device name, as the round read
        them) and clear those the GpuPartition's annotation or the quiet period clears."""
        self._index = {g.uuid: g.index for g in gpus}
        self._effects = {}
        for g in gpus:
            part = parts.get(gpu_partition_name(self.node, g.index))
            if part is not None and part.spec.xid_effect is not None:
                self._effects[g.index] = part.spec.xid_effect.value
        now = self.clock()
        with self._lock:
            for f in self._faults:
                index = self._index.get(f.gpu_uuid)
                if not f.resolved and index is not None:
                    f.devices = affected_devices(index, f.gi_id, f.whole_gpu, instances.get(index, {}))
                    f.resolved = True
            kept = []
            for f in self._faults:
                index = self._index.get(f.gpu_uuid)
                part = None if index is None else parts.get(gpu_partition_name(self.node, index))
                mark = (part.metadata.annotations or {}).get(CLEAR_ANNOTATION) if part else None
                cleared_at = parse_time(mark) if mark else None
                latest = max(g.at for g in self._faults if g.gpu_uuid == f.gpu_uuid)
                if cleared_at is not None and f.at <= cleared_at:
                    why = f"cleared by {CLEAR_ANNOTATION}={mark}"
                elif self.clear_after_s > 0 and now - latest >= self.clear_after_s:
                    why = f"no critical XID on the GPU for {self.clear_after_s:.0f}s"
                else:
                    kept.append(f)
                    continue
                if part is not None and f.reported:
                    self._cleared.append((part.name, f"{f.text()}: {why}"))
                log.info("node %s: %s: %s", self.node, f.text(), why)
            self._faults = kept

    def sick(self) -> tuple[dict[str, Taint], dict[int, Taint]]:
        """(device name -> taint, GPU index -> taint) of the faults resolved so far; the latest XID wins."""
        devices: dict[str, Taint] = {}
        gpus: dict[int, Taint] = {}
        for f in self.faults():
            index = self._index.get(f.gpu_uuid)
            if not f.resolved or index is None:
                continue
            taint = Taint(f.xid, rfc3339(f.at), self._effects.get(index, ""))
            if f.devices is None:
                if index not in gpus or gpus[index].time_added <= taint.time_added:
                    gpus[index] = taint
                continue
            for d in f.devices:
                if d not in devices or devices[d].time_added <= taint.time_added:
                    devices[d] = taint
        return devices, gpus

    async def prepare(self, api: KubeApi, driver: str = DRIVER_NAME) -> bool:
        """Whether some device is sick. Side effect: the first time one is, asks the API server (dry run)
        whether it keeps device taints."""
        devices, gpus = self.sick()
        if not devices and not gpus:
            return False
        if self.taints_served is None:
            self.taints_served = await probe_device_taints(api, self.node, driver)
            log.info(
                "node %s: the API server %s device taints in ResourceSlices: sick devices are %s",
                self.node, "keeps" if self.taints_served else "drops",
                "tainted" if self.taints_served else "withdrawn",
            )  # fmt: skip
        return True

    def apply(self, bodies: list[dict[str, Any]], keep: Collection[str]) -> list[dict[str, Any]]:
        """``bodies`` with the sick devices tainted (where served) or left out. Pure but for the read."""
        devices, gpus = self.sick()
        return with_health(
            bodies, devices, gpus, taints=bool(self.taints_served), effect=self.effect, keep=keep
        )

    def report(self, outcome: GpuOutcome, part: GpuPartition) -> None:
        """The ``DevicesHealthy`` condition on ``outcome``'s status and an Event per new fault or clear."""
        for _, message in [c for c in self._cleared if c[0] == outcome.name]:
            outcome.events.append(("Normal", "XidCleared", message))
        self._cleared = [c for c in self._cleared if c[0] != outcome.name]
        if outcome.status is None:
            return
        with self._lock:
            mine = [f for f in self._faults if f.resolved and self._partition(f) == outcome.name]
        effect = self.effect_of(outcome.name)
        how = "withdrawn from the node's slices" if self.taints_served is False else f"tainted {effect}"
        for f in mine:
            if not f.reported:
                outcome.events.append(("Warning", "CriticalXid", f"{f.text()}: {how} ({TAINT_KEY})"))
                f.reported = True
        if mine:
            status, reason = False, "CriticalXid"
            message = "; ".join(f.text() for f in mine) + f": {how}"
        elif outcome.status.condition(CONDITION) is not None or part.status.condition(CONDITION) is not None:
            status, reason, message = True, "NoCriticalXid", "no uncleared critical XID on this GPU"
        else:
            return  # a GPU that never had one carries no such condition
        conds = set_condition(
            outcome.status.conditions,
            CONDITION,
            status,
            reason,
            message,
            part.metadata.generation,
            now_rfc3339(),
        )
        outcome.status = outcome.status.model_copy(update={"conditions": conds})

    def _partition(self, f: Fault) -> str | None:
        index = self._index.get(f.gpu_uuid)
        return None if index is None else gpu_partition_name(self.node, index)


def instance_devices(outcomes: Iterable[GpuOutcome]) -> dict[int, dict[int, str]]:
    """GPU index -> GI id -> device name of every instance the round read."""
    out: dict[int, dict[int, str]] = {}
    for o in outcomes:
        for i in o.instances:
            out.setdefault(i.gpu_index, {})[i.gi_id] = device_name(i.gpu_index, i.profile, i.start)
    return out


async def probe_device_taints(api: KubeApi, node: str, driver: str = DRIVER_NAME) -> bool:
    """Whether the API server keeps ``taints`` on a ResourceSlice device (a dry run: nothing is stored).
    A server whose DRADeviceTaints gate is off drops the field on write, like every disabled field."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}-feature-probe-taints"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
            "devices": [{"name": "probe", "taints": [Taint(999, now_rfc3339()).to_api("NoSchedule")]}],
        },
    }
    try:
        got = await api.dry_run_create_slice(body)
    except Exception as exc:  # an older schema refusing the field: withdraw instead
        log.warning("node %s: the device-taint probe failed (%s): sick devices are withdrawn", node, exc)
        return False
    devices = (got.get("spec") or {}).get("devices") or [{}]
    return bool(devices[0].get("taints"))


class XidWatcher:
    """Waits for XID events on every GPU in a thread of its own, through the ``pynvml`` API."""

    def __init__(
        self,
        nvml: ModuleType,
        health: DeviceHealth,
        registry: CollectorRegistry,
        ignored: Collection[int] = APPLICATION_XIDS,
    ) -> None:
        self.nvml = nvml
        self.health = health
        self.ignored = frozenset(ignored)
        self.errors = Counter(
            "dynamig_xid_errors_total",
            "XID errors NVML reported on this node's GPUs, by XID and whether dynamig treats it as a device "
            "fault (critical).",
            ["Hostname", "gpu", "UUID", "GPU_I_ID", "xid", "critical"],
            registry=registry,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered = threading.Event()  # set once an event set holds the GPUs

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"xid-watch-{self.health.node}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * WAIT_MS / 1000)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch()
            except self.nvml.NVMLError as exc:
                log.warning(
                    "node %s: XID watch: NVML %s; registering again in %.0fs", self.health.node, exc, RETRY_S
                )
                self.registered.clear()
                self._stop.wait(RETRY_S)
            except Exception:
                log.exception(
                    "node %s: XID watch failed; registering again in %.0fs", self.health.node, RETRY_S
                )
                self.registered.clear()
                self._stop.wait(RETRY_S)

    def _watch(self) -> None:
        nv = self.nvml
        event_set = nv.nvmlEventSetCreate()
        try:
            indices: dict[str, int] = {}
            for i in range(nv.nvmlDeviceGetCount()):
                try:
                    handle = nv.nvmlDeviceGetHandleByIndex(i)
                    nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, event_set)
                    indices[nv.nvmlDeviceGetUUID(handle)] = i
                except (nv.NVMLError_NotSupported, nv.NVMLError_GpuIsLost) as exc:
                    log.warning("node %s: GPU %d gives no XID events: %s", self.health.node, i, exc)
            self.registered.set()
            while not self._stop.is_set():
                try:
                    data = nv.nvmlEventSetWait(event_set, WAIT_MS)
                except nv.NVMLError_Timeout:
                    continue
                if data.eventType & nv.nvmlEventTypeXidCriticalError:
                    uuid = nv.nvmlDeviceGetUUID(data.device)
                    self.received(uuid, indices.get(uuid), int(data.eventData), data.gpuInstanceId,
                                  data.computeInstanceId)  # fmt: skip
        finally:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(event_set)

    def received(self, uuid: str, index: int | None, xid: int, gi: int | None, ci: int | None) -> None:
        """Count one XID and, when it is a device fault, record it."""
        kind = classify(xid, self.ignored)
        gi_id, ci_id = attributed(gi), attributed(ci)
        self.errors.labels(
            self.health.node, "" if index is None else str(index), uuid, "" if gi_id is None else str(gi_id),
            str(xid), "true" if kind.critical else "false",
        ).inc()  # fmt: skip
        if not kind.critical:
            log.info("node %s: GPU %s: XID %d (%s): an application error, not a device fault",
                     self.health.node, uuid, xid, kind.meaning)  # fmt: skip
            return
        self.health.add(Fault(uuid, xid, kind.meaning, gi_id, ci_id, kind.whole_gpu, self.health.clock()))
