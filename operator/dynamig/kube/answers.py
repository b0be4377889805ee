"""The claim side of binding conditions (KEP-5007): which allocations of a pool wait for an answer, and an
answer as ``ResourceClaim.status.devices[]`` takes it. Pure; shared by the node agent (which answers its own
node's bookings) and the operator (which fails the bookings of a node whose agent went silent).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Pending:
    """One allocated device of a pool that carries binding conditions and has no answer yet."""

    namespace: str
    name: str
    device: str
    generation: int = 0
    uid: str = ""
    # Whether some consumer (a pod) is still reserved on the claim. kube-scheduler writes the reservation with
    # the allocation; it is taken away when the pod goes, e.g. preempted in PreBind while it waited for this
    # answer (kube-scheduler 1.37 rejects such a pod and keeps the claim allocated, reserved for nobody).
    reserved: bool = True

    @property
    def claim(self) -> str:
        return f"{self.namespace}/{self.name}"


def _answered(entry: Mapping[str, Any], ready: str, failed: str) -> bool:
    return any(
        c.get("type") in (ready, failed) and c.get("status") == "True" for c in entry.get("conditions") or []
    )


def _allocations(
    claims: Sequence[Mapping[str, Any]],
    driver: str,
    pool: str,
    keep: Callable[[Mapping[str, Any], Mapping[str, Any] | None], bool],
) -> list[Pending]:
    """Allocated devices of ``driver``/``pool`` for which ``keep(result, status entry or None)``, oldest
    claim first. Pure."""
    out: list[tuple[str, Pending]] = []
    for claim in claims:
        meta = claim.get("metadata") or {}
        status = claim.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        entries = {(e.get("driver"), e.get("pool"), e.get("device")): e for e in status.get("devices") or []}
        for r in results:
            if r.get("driver") != driver or r.get("pool") != pool:
                continue
            if keep(r, entries.get((driver, pool, r.get("device")))):
                pending = Pending(
                    str(meta.get("namespace", "")),
                    str(meta.get("name", "")),
                    str(r["device"]),
                    int(meta.get("generation") or 0),
                    str(meta.get("uid", "")),
                    bool(status.get("reservedFor")),
                )
                out.append((str(meta.get("creationTimestamp", "")), pending))
    return [p for _, p in sorted(out, key=lambda x: x[0])]


def unanswered(
    claims: Sequence[Mapping[str, Any]], driver: str, pool: str, ready: str, failed: str
) -> list[Pending]:
    """Allocations of ``driver``/``pool`` devices with binding conditions and no True ``ready``/``failed``
    condition in ``status.devices`` yet, oldest claim first. Pure."""
    return _allocations(
        claims,
        driver,
        pool,
        lambda r, e: bool(r.get("bindingConditions")) and not _answered(e or {}, ready, failed),
    )


def unreported(claims: Sequence[Mapping[str, Any]], driver: str, pool: str) -> list[Pending]:
    """Allocations of ``driver``/``pool`` devices without binding conditions (bound in the scheduling cycle)
    that have no ``status.devices`` entry yet, oldest claim first. Pure."""
    return _allocations(claims, driver, pool, lambda r, e: not r.get("bindingConditions") and e is None)


def data_entry(driver: str, pool: str, device: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """A ``status.devices[]`` entry that only reports ``data`` (no condition: nothing waits on it). Pure."""
    return {"driver": driver, "pool": pool, "device": device, "data": dict(data)}


def answer_entry(
    driver: str,
    pool: str,
    device: str,
    condition: str,
    reason: str,
    message: str,
    now: str,
    generation: int,
    data: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``status.devices[]`` entry (resource.k8s.io/v1 AllocatedDeviceStatus) that sets ``condition`` (a
    binding condition or binding failure condition of the device) True, with ``data`` when given. Pure."""
    cond = {
        "type": condition,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": now,
        "observedGeneration": generation,
    }
    entry: dict[str, Any] = {"driver": driver, "pool": pool, "device": device, "conditions": [cond]}
    if data is not None:
        entry["data"] = dict(data)
    return entry


def still_waits(
    claims: Sequence[Mapping[str, Any]], booking: Pending, driver: str, pool: str, ready: str, failed: str
) -> bool:
    """Whether ``booking`` is still an unanswered allocation in ``claims`` (the same claim, by uid, still
    allocating the same device of ``driver``/``pool``) that a pod is still reserved on. Pure."""
    key = (booking.namespace, booking.name, booking.uid, booking.device)
    return any(
        (p.namespace, p.name, p.uid, p.device) == key and p.reserved
        for p in unanswered(claims, driver, pool, ready, failed)
    )
