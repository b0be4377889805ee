"""The MIG UUID each allocated device was given, as recorded apart from what NVML shows now. Pure.

:mod:`dynamig.agent.bindings.uuidwatch` compares an allocated instance's MIG UUID with the one its claims were
given. A round that first sees a claim allocated would otherwise take whatever NVML shows then, and miss an
instance replaced between the allocation and that round. Two records outlive such a replacement:

- the claim's ``status.devices[].data.migUUID``: the agent's answer (partitionable inventory) or the UUID it
  reported for a booking bound without one;
- in the instances inventory, the ``mig.dynamig.io/uuid`` attribute of the device in the node's
  ResourceSlice: the scheduler allocated the instance it describes, and the agent republishes it only in a
  later round. In the partitionable inventory the answer, not the slice, says which instance the claim got
  (an allocation answered after a replacement is given the new instance).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dynamig.kube.names import ATTRIBUTE_DOMAIN

UUID_ATTRIBUTE = f"{ATTRIBUTE_DOMAIN}/uuid"


def given_uuids(
    slices: Sequence[Mapping[str, Any]],
    claims: Sequence[Mapping[str, Any]],
    driver: str,
    pool: str,
    *,
    from_slices: bool,
) -> dict[str, str]:
    """Device name -> the MIG UUID allocated with it, for the devices of ``driver``/``pool`` some record
    names one for: a claim's status data first, else (``from_slices``) the newest slice of the pool."""
    given: dict[str, str] = {}
    if from_slices:
        given.update(_published(slices, driver, pool))
    given.update(_answered(claims, driver, pool))
    return given


def _published(slices: Sequence[Mapping[str, Any]], driver: str, pool: str) -> dict[str, str]:
    ours = [s.get("spec") or {} for s in slices]
    ours = [s for s in ours if s.get("driver") == driver and (s.get("pool") or {}).get("name") == pool]
    if not ours:
        return {}
    newest = max(int((s.get("pool") or {}).get("generation") or 0) for s in ours)
    out: dict[str, str] = {}
    for spec in ours:
        if int((spec.get("pool") or {}).get("generation") or 0) != newest:
            continue  # an older generation the scheduler ignores
        for dev in spec.get("devices") or []:
            uuid = ((dev.get("attributes") or {}).get(UUID_ATTRIBUTE) or {}).get("string") or ""
            if uuid:
                out[str(dev.get("name", ""))] = str(uuid)
    return out


def _answered(claims: Sequence[Mapping[str, Any]], driver: str, pool: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for claim in claims:
        for entry in (claim.get("status") or {}).get("devices") or []:
            if entry.get("driver") != driver or entry.get("pool") != pool:
                continue
            uuid = (entry.get("data") or {}).get("migUUID") or ""
            if uuid:
                out.setdefault(str(entry.get("device", "")), str(uuid))
    return out
