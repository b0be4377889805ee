"""A GpuPartitionPolicy's status as one round leaves it: its conditions (Valid, Overlapping, Reshaping, Ready,
Preemption), what it governs, the pending demand and, under DryRun, what it would write. Pure: the
reconciler writes it when :func:`status_differs` says it changed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dynamig.kube.gpupartition import Condition, layout_summary, set_condition
from dynamig.kube.policy import GpuPartitionPolicy, Mode
from dynamig.kube.times import parse_time, rfc3339
from dynamig.operator.decide import LayoutWrite, RoundDecision
from dynamig.operator.inventory import GpuView
from dynamig.operator.preemption import DryRunReport


def policy_status(
    policy: GpuPartitionPolicy,
    raw: Mapping[str, Any],
    lost: Mapping[str, str],
    mine: Sequence[GpuView],
    decision: RoundDecision,
    written: Sequence[LayoutWrite],
    problems: Sequence[Any],
    warm_shortfall: str | None,
    recent_evictions: Sequence[dict[str, Any]],
    stamp: str,
    preemption: DryRunReport | None = None,
    drained: Sequence[dict[str, str]] = (),
) -> dict[str, Any]:
    """The status to write (``raw``: the policy as read; ``lost``: its selected GPUs an older policy governs,
    GPU -> that policy; ``stamp``: now, RFC 3339; ``drained``: :func:`drained_claims`). Pure."""
    old: dict[str, Any] = dict(raw.get("status") or {})
    conds = [Condition.model_validate(c) for c in old.get("conditions") or []]
    gen = policy.metadata.generation
    if problems:
        text = "; ".join(str(p) for p in problems)
        conds = set_condition(conds, "Valid", False, "InvalidSpec", text, gen, stamp)
    elif warm_shortfall:
        conds = set_condition(conds, "Valid", False, "WarmPoolTooLarge", warm_shortfall, gen, stamp)
    else:
        conds = set_condition(
            conds, "Valid", True, "Valid", "the spec fits the GPU models it governs", gen, stamp
        )
    if lost:
        winners = sorted(set(lost.values()))
        msg = f"{len(lost)} selected GPU(s) are governed by older policy {', '.join(winners)}"
        conds = set_condition(conds, "Overlapping", True, "GovernedByOlderPolicy", msg, gen, stamp)
    else:
        conds = set_condition(
            conds, "Overlapping", False, "NoOverlap", "no other policy selects its GPUs", gen, stamp
        )
    reshaping = [g.name for g in mine if g.reshaping]
    if reshaping:
        conds = set_condition(
            conds,
            "Reshaping",
            True,
            "AgentsApplying",
            f"waiting for agents on {', '.join(reshaping)}",
            gen,
            stamp,
        )
    elif written:
        conds = set_condition(
            conds,
            "Reshaping",
            True,
            "LayoutWritten",
            f"wrote {', '.join(w.gpu for w in written)}",
            gen,
            stamp,
        )
    else:
        conds = set_condition(
            conds, "Reshaping", False, "Stable", "no GpuPartition is being reshaped", gen, stamp
        )
    # Ready: valid and every governed GPU at its layout, so `kubectl wait --for=condition=Ready` works.
    if problems:
        ready = (False, "InvalidSpec", f"the spec is invalid: {'; '.join(str(p) for p in problems)}")
    elif reshaping or written:
        moving = reshaping or [w.gpu for w in written]
        ready = (False, "Reshaping", f"waiting for agents on {', '.join(moving)}")
    else:
        ready = (True, "Stable", f"{len(mine)} governed GPU(s) at their layouts")
    conds = set_condition(conds, "Ready", *ready, gen, stamp)
    if preemption is not None:
        text = preemption.summary()
        reason = "DryRun" if not preemption.evicting else "Sparing" if preemption.spared else "Evict"
        conds = set_condition(conds, "Preemption", True, reason, text, gen, stamp)
    else:  # Off: no condition
        conds = [c for c in conds if c.type != "Preemption"]
    old_demand: dict[str, Any] = dict(old.get("pendingDemand") or {})
    status: dict[str, Any] = {
        "observedGeneration": gen,
        "matchedGpus": len(mine),
        "gpus": [g.name for g in mine],
        "lostGpus": [{"gpu": g, "governedBy": p} for g, p in sorted(lost.items())],
        "pendingDemand": {
            "total": len(decision.verdicts),
            # a merge patch keeps map keys it does not name: null removes the ones that went away
            "byProfile": replacing_keys(old_demand.get("byProfile"), decision.pending_by_profile()),
            "byReason": replacing_keys(old_demand.get("byReason"), decision.pending_by_reason()),
        },
        "plannedLayouts": [
            {"gpu": w.gpu, "layout": layout_summary(w.layout), "reason": w.reason} for w in decision.planned
        ]
        if policy.spec.mode == Mode.DRY_RUN
        else [],
        # GPUs whose agent does not report an inventory yet are re-cut ahead, like Instances ones.
        "inventory": {
            "partitionable": sum(1 for g in mine if g.partitionable),
            "instances": sum(1 for g in mine if not g.partitionable),
        },
        "plannedOffers": [{"gpu": o.gpu, "profiles": list(o.profiles)} for o in decision.planned_offers]
        if policy.spec.mode == Mode.DRY_RUN
        else [],
        "conditions": [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in conds],
        # the eviction ledger, read back by the next operator process (operator/holds.py Ledger)
        "recentEvictions": list(recent_evictions),
        # claims a node was drained for (migMode.drainNodeAfterSeconds), read back by a new operator process
        "drainedClaims": list(drained),
    }
    if written:
        status["lastReshape"] = {
            "time": stamp,
            "gpus": [w.gpu for w in written],
            "reason": "; ".join(f"{w.gpu}: {w.reason}" for w in written)[:1024],
        }
    return status


MAX_DRAINED_CLAIMS = 1000  # the CRD's maxItems: the newest are kept


def drained_claims(drained: Mapping[str, float]) -> list[dict[str, str]]:
    """``status.drainedClaims``: claim key -> when a node was drained for it (epoch seconds), oldest first,
    the newest :data:`MAX_DRAINED_CLAIMS`. Pure."""
    ordered = sorted(drained.items(), key=lambda kv: (kv[1], kv[0]))[-MAX_DRAINED_CLAIMS:]
    return [{"claim": key, "time": rfc3339(when)} for key, when in ordered]


def read_drained_claims(raw: Any) -> dict[str, float]:
    """``status.drainedClaims`` as written by :func:`drained_claims`, back to claim key -> epoch seconds;
    entries that do not parse are skipped. Pure."""
    out: dict[str, float] = {}
    for entry in raw if isinstance(raw, list) else []:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("claim"), str):
            continue
        when = parse_time(entry.get("time"))
        if when is not None:
            out[entry["claim"]] = when
    return out


def replacing_keys(old: Mapping[str, Any] | None, new: Mapping[str, int]) -> dict[str, int | None]:
    """``new`` plus ``None`` for each key of ``old`` it lacks (a merge patch that replaces the map). Pure."""
    out: dict[str, int | None] = {k: None for k in old or {} if k not in new}
    out.update(new)
    return out


def status_differs(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether writing ``new`` would change the status (condition timestamps aside). Pure."""

    def strip(conds: Any) -> list[tuple[Any, ...]]:
        return sorted(
            (c.get("type"), c.get("status"), c.get("reason"), c.get("message"), c.get("observedGeneration"))
            for c in conds or []
        )

    for key, value in new.items():
        if key == "conditions":
            if strip(old.get(key)) != strip(value):
                return True
        elif old.get(key) != value and not (value == [] and key not in old):
            return True
    return False
