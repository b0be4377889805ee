"""Allocated instances changed behind the agent's back. A MIG instance that a claim holds is only destroyed by
dynamig when no claim holds it; if it disappears anyway, or comes back under a new MIG UUID (someone ran
``nvidia-smi mig -dgi``/``-cgi``), the pod's containers still point at the old device. The agent reports each
such change once, on the GpuPartition and the claim. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class UuidChange:
    device: str
    holders: tuple[str, ...]  # namespace/name of the claims that hold it
    before: str  # the MIG UUID the claim was given
    after: str  # the MIG UUID now; "" while the instance is gone

    def message(self) -> str:
        held = f"{self.device} (allocated to {', '.join(self.holders)})"
        if not self.after:
            return (
                f"{held} was MIG {self.before} and was destroyed outside dynamig: the pod's containers lost "
                "their GPU"
            )
        return (
            f"{held} is now MIG {self.after}, was {self.before}: it was destroyed and re-created outside "
            "dynamig; the pod's containers still point at the old device: restart the pod"
        )

    @property
    def reason(self) -> str:
        return "AllocatedInstanceLost" if not self.after else "AllocatedInstanceReplaced"


@dataclass(slots=True)
class _Held:
    uuid: str  # the last MIG UUID seen while held
    holders: tuple[str, ...]
    present: bool


class AllocatedUuids:
    """The MIG UUID each allocated instance had when first seen held, per device name."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def update(
        self,
        prefix: str,
        uuids: Mapping[str, str],
        claims: Mapping[str, Sequence[str]],
        given: Mapping[str, str] | None = None,
    ) -> list[UuidChange]:
        """One GPU, whose device names start with ``prefix`` (``gpu<index>-``): ``uuids`` maps each instance
        that exists now to its MIG UUID, ``claims`` each allocated device to its holders, ``given`` the MIG
        UUID a device was allocated with where that is recorded (:mod:`dynamig.agent.bindings.given_uuids`).
        Returns the changes since the last call for that GPU, each reported once."""
        given = given or {}
        changes: list[UuidChange] = []
        scope = {d for d in claims if d.startswith(prefix)} | {d for d in self._held if d.startswith(prefix)}
        for dev in sorted(scope):
            holders = tuple(sorted(claims.get(dev, ())))
            if not holders:
                self._held.pop(dev, None)  # released: whatever happens to it now is dynamig's business
                continue
            now = uuids.get(dev, "")
            seen = self._held.get(dev)
            if seen is None or seen.holders != holders:
                # First seen held: the UUID recorded with the allocation, else the one there now (an instance
                # replaced before this sighting is then told from the one the claims got). Held by new
                # claims: the instance there now is theirs.
                first = (given.get(dev, "") if seen is None else "") or now
                if not first:
                    continue
                seen = self._held[dev] = _Held(first, holders, True)
            if not now and seen.present:
                changes.append(UuidChange(dev, holders, seen.uuid, ""))
                seen.present = False
            elif now and now != seen.uuid:
                changes.append(UuidChange(dev, holders, seen.uuid, now))
                self._held[dev] = _Held(now, holders, True)
            elif now:
                seen.present = True
        return changes
