"""Drains (``spec.drain``): which claims starve, and which GPU is drained for each. Pure: turns what the
operator read into the drain choice's input (``dynamig.planner.drain``) and words the answer;
operator/preempting.py writes the holds (kind ``Drain``) and tells the waiting pods.

A claim starves when the round found no room for it without evicting (``NoCapacity``) and it was created
``drain.afterSeconds`` ago or more. Like preemption, a drain frees one placement for a claim of one device
whose pod waits for no other claim. Claims already holding a placement, and GPUs holding one, are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynamig.kube.gpupartition import Hold, HoldKind
from dynamig.kube.policy import GpuPartitionPolicy
from dynamig.kube.times import micro_time, parse_time
from dynamig.operator.demand import PendingClaim
from dynamig.operator.inventory import GpuView
from dynamig.operator.preemption import holdings, pod_key, waiting_claims
from dynamig.operator.verdicts import ClaimVerdict
from dynamig.planner.drain import DrainChoice, choose_drains
from dynamig.planner.model import GpuKey

REASON_DRAINING = "Draining"  # on the waiting pod: a GPU is drained for it


@dataclass(frozen=True, slots=True)
class Drain:
    """A drain to start: the claim, how long it has waited, where, and what the pod is told."""

    claim: PendingClaim
    waited_s: float
    priority: int
    choice: DrainChoice
    gpu_name: str

    def hold(self, claim_uid: str, now: float, hold_seconds: float) -> Hold:
        return Hold(
            claim=self.claim.claim.key,
            claim_uid=claim_uid,
            kind=HoldKind.DRAIN,
            profile=self.choice.profile,
            start=self.choice.start,
            priority=self.priority,
            created_at=micro_time(now),
            expires_at=micro_time(now + hold_seconds),
        )

    def message(self, expires_at: str) -> str:
        c = self.choice
        running = ", ".join(f"{i.profile}@{i.start}" for i in c.waiting_for)
        return (
            f"waited {self.waited_s:.0f}s for {c.profile}, which no GPU can cut now: {c.gpu.node}/gpu"
            f"{c.gpu.index} ({self.gpu_name}) takes no new booking over {c.profile} at slice {c.start}, kept "
            f"for this claim until {expires_at}, and cuts it once {running} end; nobody is evicted"
        )


def plan_drains(
    policy: GpuPartitionPolicy,
    verdicts: Sequence[ClaimVerdict],
    gpus: Sequence[GpuView],
    claims: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    driver: str,
    now: float,
    kept: Mapping[str, str],
    room: int,
) -> tuple[Drain, ...]:
    """The drains to start this round for ``policy``: starving claims, oldest first, at most ``room``.
    ``kept``: GPU name -> the claim a placement on it is held for; ``pods``: every pod not finished (a pod
    we do not see holds its instance for ever, as far as a drain knows). Pure."""
    after = policy.spec.drain.after_seconds
    if after is None or room <= 0:
        return ()
    usable = [g for g in gpus if not g.unusable and g.model is not None]
    models = {g.model.key: g.model for g in usable if g.model is not None}
    pod_list = list(pods)
    by_uid = {str((p.get("metadata") or {}).get("uid", "")): p for p in pod_list}
    holding = frozenset(kept.values())
    starving: list[tuple[float, str, Any, PendingClaim]] = []
    for w in waiting_claims(verdicts, by_uid, policy, frozenset(models)):
        c = w.verdict.claim
        created = parse_time(c.created)
        if w.preemptor is None or c.claim.key in holding or created is None or now - created < after:
            continue
        starving.append((created, c.claim.key, w.preemptor, c))
    if not starving:
        return ()
    starving.sort(key=lambda s: (s[0], s[1]))
    held = holdings([g for g in usable if g.name not in kept], claims, driver)
    known = frozenset(pod_key(p) for p in pod_list)
    choices = choose_drains([s[2] for s in starving], held.gpus, known, models, room)
    names = {GpuKey(g.node, g.index): g.name for g in usable}
    by_key = {s[1]: s for s in starving}
    out = []
    for choice in choices:
        created, _, pre, c = by_key[choice.claim]
        out.append(Drain(c, now - created, pre.priority, choice, names.get(choice.gpu, "")))
    return tuple(out)


def draining_count(holds: Iterable[Hold]) -> int:
    """How many of ``holds`` are drains. Pure."""
    return sum(1 for h in holds if h.kind is HoldKind.DRAIN)
