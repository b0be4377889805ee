"""The event half of the simulated NVML: event sets and XID critical-error events, as nvml.h documents them.

:mod:`dynamig.backends.simnvml` serves ``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents``,
``nvmlDeviceGetSupportedEventTypes``, ``nvmlEventSetWait`` (``_v2``) and ``nvmlEventSetFree`` through an
:class:`EventSets` of its own (one per simulated machine, so every copy of the module has its own sets) and
records each injected XID as an ``xid`` entry of its history, which is shared through the state file: an XID a
test injects from another process reaches an agent waiting on its set. The rules modelled (nvml.h, "Event
Handling Methods"; ``tests/unit/test_simnvml_fidelity.py`` quotes each):

- ``nvmlDeviceRegisterEvents``: "All events that occurred before this call are not recorded"; a type the
  device does not support fails with ``NOT_SUPPORTED`` and then "None of the requested eventTypes are
  registered"; bits outside ``nvmlEventTypeAll`` are ``INVALID_ARGUMENT``; a lost GPU ``GPU_IS_LOST``.
- ``nvmlEventSetWait``: returns at once when an event is ready, else sleeps until one arrives or the timeout
  passes (``NVML_ERROR_TIMEOUT``); "On Linux, every Xid error event would return the associated event data",
  one per call, oldest first; ``GPU_IS_LOST`` when a registered GPU has fallen off the bus.
- ``nvmlEventData_t``: ``device`` is the parent GPU's handle ("This API does not currently support
  per-instance event reporting using MIG device handles"), ``eventData`` the XID, ``gpuInstanceId`` and
  ``computeInstanceId`` the instance an XID is attributable to when MIG is enabled, ``0xFFFFFFFF`` otherwise.

Simplification, stated: the simulated GPUs support XID critical-error events only (no ECC, clock or power
events), and every caller has the privileges nvml.h says per-instance events need.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pynvml import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVMLError,
    c_nvmlEventData_t,
    c_nvmlEventSet_t,
    nvmlEventTypeXidCriticalError,
)

# nvml.h ``nvmlEventTypeAll``: every event type bit the header defines.
EVENT_TYPE_ALL = (
    0x1 | 0x2 | 0x4 | 0x8 | 0x10 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800 | 0x1000 | 0x2000 | 0x4000 | 0x8000
)
SUPPORTED_EVENT_TYPES = int(nvmlEventTypeXidCriticalError)
NOT_ATTRIBUTED = 0xFFFFFFFF  # nvml.h: gpuInstanceId / computeInstanceId "set to 0xFFFFFFFF otherwise"
UNKNOWN_XID = 999  # nvml.h: "eventData is set as 999 for unknown Xid error"
POLL_S = 0.02  # how often a waiting set looks at the (possibly shared) state again

_SET_BASE = 0xE7E5 << 40  # event set handle addresses: never dereferenced


@dataclass(frozen=True, slots=True)
class XidRecord:
    """One XID the simulated driver reported: the history entry's sequence number, GPU and instance ids
    (None where not attributable to an instance)."""

    seq: int
    gpu_index: int
    xid: int
    gi_id: int | None = None
    ci_id: int | None = None


@dataclass
class _EventSet:
    registered: dict[int, tuple[int, int]] = field(default_factory=dict)  # GPU index -> (types, from seq)
    delivered: int = 0  # the last sequence number this set returned


def _error(code: int) -> Exception:
    err: Exception = NVMLError(code)
    return err


class EventSets:
    """The event sets of one simulated machine, in this process (handles are process-local, as NVML's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: dict[int, _EventSet] = {}
        self._next = 1

    def create(self) -> Any:
        with self._lock:
            number, self._next = self._next, self._next + 1
            self._sets[number] = _EventSet()
        return ctypes.cast(ctypes.c_void_p(_SET_BASE | number), c_nvmlEventSet_t)

    def _set(self, handle: Any) -> _EventSet:
        if handle is None:
            raise _error(NVML_ERROR_INVALID_ARGUMENT)
        try:
            address = ctypes.cast(handle, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            raise _error(NVML_ERROR_INVALID_ARGUMENT) from None
        if address is None or address & ~((1 << 40) - 1) != _SET_BASE:
            raise _error(NVML_ERROR_INVALID_ARGUMENT)
        found = self._sets.get(address & ((1 << 40) - 1))
        if found is None:
            raise _error(NVML_ERROR_INVALID_ARGUMENT)  # freed
        return found

    def register(self, handle: Any, gpu_index: int, event_types: int, last_seq: int) -> None:
        """Record ``event_types`` of GPU ``gpu_index`` from after history entry ``last_seq`` on."""
        if event_types & ~EVENT_TYPE_ALL:
            raise _error(NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            s = self._set(handle)
            if event_types & ~SUPPORTED_EVENT_TYPES:
                raise _error(NVML_ERROR_NOT_SUPPORTED)  # none of the requested types is registered
            types, since = s.registered.get(gpu_index, (0, last_seq))
            s.registered[gpu_index] = (types | event_types, since)

    def free(self, handle: Any) -> None:
        with self._lock:
            self._set(handle)
            address = ctypes.cast(handle, ctypes.c_void_p).value or 0
            del self._sets[address & ((1 << 40) - 1)]

    def wait(
        self,
        handle: Any,
        timeout_ms: int,
        xids: Callable[[], Sequence[XidRecord]],
        lost: Callable[[int], bool],
        gpu_handle: Callable[[int], Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> Any:
        """The next XID of a registered GPU, as ``c_nvmlEventData_t``; ``NVML_ERROR_TIMEOUT`` when none
        arrives within ``timeout_ms``. ``xids`` reads the history (oldest first), ``lost`` whether a GPU
        fell off the bus."""
        deadline = clock() + max(0, int(timeout_ms)) / 1000.0
        while True:
            with self._lock:
                s = self._set(handle)
                registered = dict(s.registered)
                delivered = s.delivered
            if any(lost(i) for i in registered):
                raise _error(NVML_ERROR_GPU_IS_LOST)
            for r in xids():
                types, since = registered.get(r.gpu_index, (0, 0))
                if r.seq <= max(since, delivered) or not types & SUPPORTED_EVENT_TYPES:
                    continue
                with self._lock:
                    s.delivered = max(s.delivered, r.seq)
                return event_data(r, gpu_handle(r.gpu_index))
            left = deadline - clock()
            if left <= 0:
                raise _error(NVML_ERROR_TIMEOUT)
            time.sleep(min(POLL_S, left))


def event_data(record: XidRecord, device: Any) -> Any:
    """``nvmlEventData_t`` of one XID: the parent device, the XID, the instance ids or 0xFFFFFFFF. Pure."""
    data = c_nvmlEventData_t()
    data.device = device
    data.eventType = SUPPORTED_EVENT_TYPES
    data.eventData = record.xid if record.xid > 0 else UNKNOWN_XID
    data.gpuInstanceId = NOT_ATTRIBUTED if record.gi_id is None else record.gi_id
    data.computeInstanceId = NOT_ATTRIBUTED if record.ci_id is None else record.ci_id
    return data
