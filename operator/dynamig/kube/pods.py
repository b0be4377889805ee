"""Whether a pod bound to a device that cannot be served may be given back to its controller. Pure; shared
by the node agent (a device its plugin cannot prepare, agent/bindings/stranded.py) and the operator (a device
on a node whose agent went silent, operator/fencing.py).

A pod is given back by deleting it, so that its controller creates it again and the scheduler books it
afresh: only a pod a controller owns and none of whose containers ever started (nothing of it ran, nothing
is lost). A pod no controller owns would be gone for good: it is only told why (a Warning Event).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REASON_RESCHEDULED = "DeviceUnavailableRescheduled"  # deleted for its controller
REASON_STRANDED = "DeviceUnavailable"  # told only: no controller owns it


def verdict(pod: Mapping[str, Any], node: str) -> tuple[str, str]:
    """What to do with ``pod`` whose device on ``node`` cannot be served: ``("delete", whose)`` for a pod a
    controller owns whose containers never started, ``("event", why)`` for one no controller owns, and
    ``("leave", why)`` otherwise (another node's, already going, or started: never deleted here). Pure."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    if spec.get("nodeName") != node:
        return "leave", f"bound to {spec.get('nodeName') or 'no node'}, not {node}"
    if meta.get("deletionTimestamp"):
        return "leave", "already being deleted"
    for c in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        state = c.get("state") or {}
        if c.get("started") or "running" in state or "terminated" in state or c.get("restartCount"):
            return "leave", f"container {c.get('name')} has started"
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    if owner is None:
        return "event", "no controller owns it: delete it to have it scheduled again"
    return "delete", f"{owner.get('kind')} {owner.get('name')}"
