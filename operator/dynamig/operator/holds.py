"""Preemption that evicts (``spec.preemption.mode: Evict``): the placements held for waiting claims, the
ledger of evictions, and what may start now. Pure; the reconciler reads and writes.

The order, one step per round, each step restartable from what the API server stores:

1. **Hold.** A claim the victim search (operator/preemption.py) serves gets a hold on its GPU's GpuPartition
   (``spec.holds``: the claim, the placement, the victims with their uids, an expiry). At most one hold per
   GPU; a GPU gets none within ``gpuCooldownSeconds`` of its last; the victims count against
   ``maxEvictionsPerHour`` when the hold is made.
2. **Evict**, once the node agent shows the hold in ``status.holds``: from then on it answers failed every
   other claim's booking of the held slices and publishes the victims' instances guarded as they are freed
   (agent/bindings/holds.py), so a freed slice is not handed to the next small pod. Victims still there, not
   being deleted and with the uid the search saw, are evicted through the Eviction API every round until gone.
   A PodDisruptionBudget's refusal (429) releases the hold: the search runs again next round.
3. **Release**, when the claim is allocated (served, wherever), deleted or replaced, or the hold expires.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamig.kube.gpupartition import Hold
from dynamig.kube.times import micro_time, parse_time

LEDGER_WINDOW_S = 3600.0  # the rate limit and the ping-pong rule count evictions of the last hour
MAX_ENTRIES = 1000  # holds kept in status.recentEvictions (the CRD's maxItems)
MAX_OWNERS = 256  # owners kept per hold there (the CRD's maxItems)
_SAME_S = 0.001  # two records of one GPU this close are one hold (a stored time has microseconds)


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One hold made to evict: when, on which GPU, and the workloads (owner keys) evicted for it."""

    at: float
    gpu: str
    owners: tuple[str, ...]

    def stored(self) -> dict[str, Any]:
        return {"time": micro_time(self.at), "gpu": self.gpu, "owners": list(self.owners[:MAX_OWNERS])}


@dataclass
class Ledger:
    """The holds each policy made to evict, with the workloads evicted for each. The operator stores it in
    the policy's ``status.recentEvictions`` every round and a new operator process (a restart, a new leader)
    reads it back, so the hourly limits, the GPU cooldown and the sparing of repeat victims outlive the
    process; a hold found on a GpuPartition that the stored ledger lacks (the process stopped between the
    two writes) is counted too."""

    entries: dict[str, list[LedgerEntry]] = field(default_factory=dict)
    restored: set[str] = field(default_factory=set)

    def _recent(self, policy: str, now: float) -> list[tuple[float, str]]:
        return [
            (e.at, o) for e in self.entries.get(policy, []) if now - e.at < LEDGER_WINDOW_S for o in e.owners
        ]

    def count(self, policy: str, now: float, namespace: str | None = None) -> int:
        """Pods the policy evicted in the last hour (of ``namespace`` only, when given)."""
        recent = self._recent(policy, now)
        if namespace is None:
            return len(recent)
        return sum(1 for _, o in recent if owner_namespace(o) == namespace)

    def record(self, policy: str, now: float, gpu: str, owners: Iterable[str]) -> None:
        """A hold made on ``gpu`` at ``now``, evicting pods of ``owners`` (one key per pod); a hold already
        recorded (same GPU and time) is not counted twice."""
        kept = self.entries.setdefault(policy, [])
        if not any(e.gpu == gpu and abs(e.at - now) < _SAME_S for e in kept):
            kept.append(LedgerEntry(now, gpu, tuple(owners)))
            kept.sort(key=lambda e: e.at)

    def last_hold(self, gpu: str) -> float | None:
        """When the latest hold on ``gpu`` was made, under any policy; None when none is remembered."""
        times = [e.at for es in self.entries.values() for e in es if e.gpu == gpu]
        return max(times) if times else None

    def spared(self, policy: str, now: float, after: int) -> dict[str, str]:
        """Owner key -> why it is spared: evicted ``after`` times or more within the hour."""
        counts: dict[str, int] = {}
        for _, owner in self._recent(policy, now):
            counts[owner] = counts.get(owner, 0) + 1
        return {
            o: f"{o} was evicted {n} times within the hour (spareAfterEvictions {after}): spared"
            for o, n in counts.items()
            if n >= after
        }

    def prune(self, policy: str, now: float, keep_s: float) -> None:
        """Forget the entries older than ``keep_s`` (the hour, or the GPU cooldown when longer), and all but
        the newest ``MAX_ENTRIES``."""
        kept = [e for e in self.entries.get(policy, []) if now - e.at < keep_s]
        self.entries[policy] = kept[-MAX_ENTRIES:]

    def restore(self, policy: str, stored: Sequence[Any]) -> int:
        """Read ``status.recentEvictions`` back, once per policy and process; unreadable entries are skipped.
        Returns how many entries were read."""
        if policy in self.restored:
            return 0
        self.restored.add(policy)
        read = 0
        for item in stored:
            at = parse_time(item.get("time")) if isinstance(item, Mapping) else None
            gpu = item.get("gpu") if isinstance(item, Mapping) else None
            owners = item.get("owners") if isinstance(item, Mapping) else None
            if at is None or not isinstance(gpu, str) or not isinstance(owners, list):
                continue
            self.record(policy, at, gpu, [str(o) for o in owners])
            read += 1
        return read

    def stored(self, policy: str) -> list[dict[str, Any]]:
        """What ``status.recentEvictions`` holds for ``policy``, oldest first."""
        return [e.stored() for e in self.entries.get(policy, [])]


def owner_namespace(owner: str) -> str:
    """The namespace of an owner key (``Kind namespace/name``, operator/preemption.py ``owner_key``). Pure."""
    return owner.partition(" ")[2].partition("/")[0]


def refusal(
    gpu: str,
    victims: Sequence[str],
    policy: str,
    ledger: Ledger,
    now: float,
    max_per_hour: int,
    cooldown_s: float,
    max_per_namespace: int | None = None,
) -> str:
    """Why no hold may be made on ``gpu`` for evicting ``victims`` (``namespace/name``) now, or "". Pure but
    for the ledger's pruning."""
    last = ledger.last_hold(gpu)
    if last is not None and now - last < cooldown_s:
        return f"GPU {gpu} had pods evicted {now - last:.0f}s ago (gpuCooldownSeconds {cooldown_s:.0f})"
    done = ledger.count(policy, now)
    if done + len(victims) > max_per_hour:
        return (
            f"{done} pod(s) evicted in the last hour, {len(victims)} more would pass maxEvictionsPerHour "
            f"{max_per_hour}"
        )
    if max_per_namespace is not None:
        more: dict[str, int] = {}
        for v in victims:
            more[v.partition("/")[0]] = more.get(v.partition("/")[0], 0) + 1
        for namespace, n in sorted(more.items()):
            had = ledger.count(policy, now, namespace)
            if had + n > max_per_namespace:
                return (
                    f"namespace {namespace} had {had} pod(s) evicted in the last hour, {n} more would pass "
                    f"maxEvictionsPerHourPerNamespace {max_per_namespace}"
                )
    return ""


def new_hold(
    claim: Mapping[str, Any],
    profile: str,
    start: int,
    priority: int,
    victims: Sequence[str],
    now: float,
    hold_seconds: float,
) -> Hold:
    meta = claim.get("metadata") or {}
    return Hold(
        claim=f"{meta.get('namespace', '')}/{meta.get('name', '')}",
        claim_uid=str(meta.get("uid", "")),
        profile=profile,
        start=start,
        priority=priority,
        victims=list(victims),
        created_at=micro_time(now),
        expires_at=micro_time(now + hold_seconds),
    )


def victim_ref(text: str) -> tuple[str, str, str]:
    """``namespace/name@uid`` (as a hold stores a victim) -> (namespace, name, uid). Pure."""
    key, _, uid = text.partition("@")
    namespace, _, name = key.partition("/")
    return namespace, name, uid


def released(hold: Hold, claims: Mapping[str, Mapping[str, Any]], now: float) -> tuple[str, str]:
    """Why ``hold`` ends now as (kind, text), kind one of ``served``, ``gone``, ``expired``; ("", "") while
    it stands. ``claims``: ``namespace/name`` -> ResourceClaim. Pure."""
    claim = claims.get(hold.claim)
    if claim is None or (hold.claim_uid and (claim.get("metadata") or {}).get("uid") != hold.claim_uid):
        return "gone", f"claim {hold.claim} is gone"
    if (claim.get("metadata") or {}).get("deletionTimestamp"):
        return "gone", f"claim {hold.claim} is being deleted"
    if (claim.get("status") or {}).get("allocation"):
        return "served", f"claim {hold.claim} is allocated"
    if hold.expires() <= now:
        return "expired", f"it expired at {hold.expires_at} before claim {hold.claim} was allocated"
    return "", ""


def enforced(part: Mapping[str, Any], hold: Hold) -> bool:
    """Whether the node agent shows ``hold`` in the GpuPartition's ``status.holds`` (it enforces it). Pure."""
    for raw in (part.get("status") or {}).get("holds") or []:
        if (raw.get("claim"), raw.get("profile"), raw.get("start")) == (hold.claim, hold.profile, hold.start):
            return True
    return False


def holds_of(part: Mapping[str, Any]) -> list[Hold]:
    """The holds in a GpuPartition's spec (unreadable entries dropped). Pure."""
    out = []
    for raw in (part.get("spec") or {}).get("holds") or []:
        try:
            out.append(Hold.model_validate(raw))
        except ValueError:
            continue
    return out


def age(hold: Hold, now: float) -> float:
    made = parse_time(hold.created_at)
    return 0.0 if made is None else max(0.0, now - made)
