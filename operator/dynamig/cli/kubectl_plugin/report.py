"""What ``plan``, ``verify`` and ``export`` print, computed from raw API dicts. Pure: no I/O.

``plan`` runs the operator's own round (:func:`dynamig.operator.world.parse_world` and
:func:`dynamig.operator.decide.decide_round`) on a snapshot and reports the decision instead of writing it;
under a policy that preempts, also the operator's victim search (:func:`dynamig.operator.preemption.dry_run`)
and the placements held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynamig import DRIVER_NAME, __version__
from dynamig.geometry.catalog import Catalog
from dynamig.geometry.model import Layout, normalize_layout
from dynamig.kube.gpupartition import (
    ConditionType,
    GpuPartition,
    Hold,
    Inventory,
    Phase,
    layout_summary,
    parse_gpu_partition,
)
from dynamig.kube.names import GROUP_VERSION, POLICY_KIND
from dynamig.kube.policy import GpuPartitionPolicy, PreemptionMode, check_spec_against_catalog
from dynamig.operator.decide import LayoutWrite, OfferWrite, RoundDecision, RoundInput, decide_round
from dynamig.operator.holds import Ledger, enforced, holds_of, refusal
from dynamig.operator.inventory import GpuView
from dynamig.operator.kubeio import Snapshot
from dynamig.operator.preemption import DryRunReport, Told, dry_run
from dynamig.operator.world import World, parse_world
from dynamig.textable import align


class ReportError(ValueError):
    """The cluster holds nothing the report could be made of; ``str()`` says what is missing."""


# ------------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class PreemptionReads:
    """What preemption reads beyond a round's snapshot: running pods, PodDisruptionBudgets (None: unread)
    and the namespaces' labels (None: unread or not needed); ``unread`` says what could not be read."""

    running: tuple[dict[str, Any], ...] = ()
    pdbs: tuple[dict[str, Any], ...] | None = None
    namespaces: dict[str, dict[str, str]] | None = None
    unread: str = "running pods and PodDisruptionBudgets were not read"


def _preemption(
    policy: GpuPartitionPolicy,
    decision: RoundDecision,
    mine: Sequence[GpuView],
    snap: Snapshot,
    reads: PreemptionReads,
    catalog: Catalog,
    now: float,
    namespace: str | None,
) -> dict[str, Any] | None:
    """What preemption would do this round, and the placements held now (for preemption or drains); None when
    neither preemption nor drains are on and nothing is held."""
    names = {g.name for g in mine}
    parts = [p for p in snap.partitions if p["metadata"]["name"] in names]
    holds = [(str(p["metadata"]["name"]), p, h) for p in parts for h in holds_of(p)]
    off = policy.spec.preemption.mode is PreemptionMode.OFF
    if off and policy.spec.drain.after_seconds is None and not holds:
        return None
    kept = {gpu: h.claim for gpu, _, h in holds}
    evicting = policy.spec.preemption.mode is PreemptionMode.EVICT
    # The operator's ledger, as it stored it in the policy's status (status.recentEvictions).
    raw = next((p for p in snap.policies if (p.get("metadata") or {}).get("name") == policy.name), {})
    ledger = Ledger()
    ledger.restore(policy.name, ((raw.get("status") or {}).get("recentEvictions")) or [])
    spec = policy.spec.preemption
    spared = ledger.spared(policy.name, now, spec.spare_after_evictions) if evicting else None
    found = dry_run(
        policy, decision.verdicts, mine, snap.claims, (*snap.pods, *reads.running), reads.pdbs, catalog,
        DRIVER_NAME, now, reads.unread, kept, spared, reads.namespaces,
    ) if not off else DryRunReport()  # fmt: skip
    gpu_names = {(g.node, g.index): g.name for g in mine}

    def held_back(t: Told) -> str:
        """Why the operator would not hold and evict for this answer now (its limits over the ledger)."""
        e = t.eviction
        if not evicting or e is None:
            return ""
        gpu = gpu_names.get((e.gpu.node, e.gpu.index), "")
        return refusal(
            gpu, e.victims, policy.name, ledger, now, spec.max_evictions_per_hour, spec.gpu_cooldown_seconds,
            spec.max_evictions_per_hour_per_namespace,
        ) or (f"a placement on {gpu} is held already" if gpu in kept else "")  # fmt: skip

    return {
        "mode": policy.spec.preemption.mode.value,
        "answers": [
            {
                "claim": t.claim.claim.key,
                "answer": t.reason,
                "victims": list(t.victims),
                "message": t.message,
                "heldBack": held_back(t),
            }
            for t in found.told
            if _in_namespace(t.claim.claim.key, namespace)
        ],
        "holds": [_held(gpu, part, h) for gpu, part, h in holds],
        "unread": found.unread,  # then no pod is taken for a victim
        "evictedLastHour": ledger.count(policy.name, now) if evicting else 0,
        "spared": sorted(spared or {}),
        "note": f"{ledger.count(policy.name, now)} pod(s) evicted in the last hour" if evicting else "",
    }


def _held(gpu: str, part: Mapping[str, Any], h: Hold) -> dict[str, Any]:
    return {
        "gpu": gpu,
        "kind": h.kind.value,
        "claim": h.claim,
        "placement": f"{h.profile}@{h.start}",
        "victims": list(h.victims),
        "expiresAt": h.expires_at,
        "enforced": enforced(part, h),
    }


def _in_namespace(claim_key: str, namespace: str | None) -> bool:
    return namespace is None or claim_key.startswith(f"{namespace}/")


def _reshape(w: LayoutWrite, written: bool, held: str) -> dict[str, Any]:
    # Busy instances are pinned by the planner: whatever the new layout drops is a free instance.
    removes = [i for i in w.before if i not in w.layout]
    return {
        "gpu": w.gpu,
        "node": w.node,
        "model": w.model,
        "from": layout_summary(w.before),
        "to": layout_summary(w.layout),
        "removes": [f"{i.profile}@{i.start}" for i in removes],
        "claims": list(w.claims),
        "reason": w.reason,
        "action": "write" if written else "held",
        "held": "" if written else held,
    }


def _policy_report(
    policy: GpuPartitionPolicy,
    decision: RoundDecision,
    mine: Sequence[GpuView],
    problems: Sequence[Any],
    namespace: str | None,
    preemption: dict[str, Any] | None = None,
) -> dict[str, Any]:
    written = {w.gpu for w in decision.writes}
    return {
        "policy": policy.name,
        "mode": policy.spec.mode.value,
        "gpus": [g.name for g in mine],
        "unusable": {g.name: g.unusable for g in mine if g.unusable},
        "problems": [str(p) for p in problems],
        "claims": [
            {
                "claim": v.claim.claim.key,
                "reason": v.reason.value,
                "gpu": v.gpu,
                "profile": v.profile,
                "message": v.message,
            }
            for v in decision.verdicts
            if _in_namespace(v.claim.claim.key, namespace)
        ],
        "reshapes": [_reshape(w, w.gpu in written, decision.held.get(w.gpu, "")) for w in decision.planned],
        "offers": [_offer(o, "write") for o in decision.offers]
        + [_offer(o, "dry-run") for o in decision.planned_offers],
        "preemption": preemption,
    }


def _offer(o: OfferWrite, action: str) -> dict[str, Any]:
    before = None if o.before is None else list(o.before)
    return {"gpu": o.gpu, "from": before, "to": list(o.profiles), "action": action}


def plan_report(
    snap: Snapshot,
    catalog: Catalog,
    now: float,
    namespace: str | None = None,
    only_policy: str | None = None,
    reads: PreemptionReads | None = None,
) -> dict[str, Any]:
    """One operator round per policy on ``snap`` at ``now`` (epoch seconds), as plain data. Claims outside
    ``namespace`` are planned (the operator plans them too) but not listed. ``reads``: what preemption reads
    beyond the snapshot (None: nothing read, so no pod is taken for a victim). Pure.

    The running operator remembers since when each GPU has been idle; here every GPU counts as idle since
    ``now``, as a freshly started operator counts it, so returns to the baseline show as held.
    """
    world: World = parse_world(snap, catalog, now)
    idle_since = {g.name: now for g in world.gpus}
    policies = sorted(world.policies, key=lambda p: p.precedence)
    if only_policy is not None:
        policies = [p for p in policies if p.name == only_policy]
        if not policies:
            raise ReportError(f"no GpuPartitionPolicy named {only_policy}")
    reports = []
    for policy in policies:
        mine = tuple(g for g in world.gpus if world.ownership.owner.get(g.name) == policy.name)
        problems = tuple(check_spec_against_catalog(policy.spec, catalog))
        claims = tuple(c for c in world.pending if world.claim_owner.get(c.claim.key) == policy.name)
        decision = decide_round(RoundInput(policy, problems, mine, claims, now, idle_since, catalog))
        preemption = _preemption(
            policy, decision, mine, snap, reads or PreemptionReads(), catalog, now, namespace
        )
        reports.append(_policy_report(policy, decision, mine, problems, namespace, preemption))
    unowned = [
        c.claim.key
        for c in world.pending
        if c.claim.key not in world.claim_owner and _in_namespace(c.claim.key, namespace)
    ]
    return {
        "policies": reports,
        "ungoverned": sorted(g.name for g in world.gpus if g.name not in world.ownership.owner),
        "claimsWithoutPolicy": unowned if only_policy is None else [],
        "silentAgents": dict(world.silent),
    }


def _preemption_lines(pre: Mapping[str, Any] | None) -> list[str]:
    if not pre:
        return []
    out = [f"  preemption {pre['mode']}" + (f" ({pre['note']})" if pre["note"] else "")]
    if pre["unread"]:
        out.append(f"    {pre['unread']}: no pod is taken for a victim")
    if pre["answers"]:
        rows: list[tuple[str, ...]] = [("WAITING CLAIM", "ANSWER", "MESSAGE")]
        rows += [
            (a["claim"], a["answer"], a["message"] + (f"; not now: {a['heldBack']}" if a["heldBack"] else ""))
            for a in pre["answers"]
        ]
        out += ["    " + line for line in align(rows)]
    if pre["spared"]:
        out.append(f"    spared after repeated evictions within the hour: {', '.join(pre['spared'])}")
    if pre["holds"]:
        rows = [("HELD ON", "KIND", "PLACEMENT", "FOR CLAIM", "VICTIMS", "EXPIRES", "AGENT ENFORCES")]
        rows += [
            (h["gpu"], h["kind"], h["placement"], h["claim"],
             ",".join(v.split("@")[0] for v in h["victims"]) or "-", h["expiresAt"],
             "yes" if h["enforced"] else "not yet")
            for h in pre["holds"]
        ]  # fmt: skip
        out += ["    " + line for line in align(rows)]
    if not (pre["answers"] or pre["holds"]):
        out.append("    no claim waits for room, no placement is held")
    return out


def plan_table(report: Mapping[str, Any]) -> str:
    """The plan report as text for a terminal. Pure."""
    out: list[str] = []
    for p in report["policies"]:
        counts = f"{len(p['gpus'])} GPU(s), {len(p['claims'])} pending claim(s)"
        out.append(f"policy {p['policy']} ({p['mode']}): {counts}")
        out += [f"  invalid: {problem}" for problem in p["problems"]]
        out += [f"  not planned: {gpu}: {why}" for gpu, why in p["unusable"].items()]
        if p["claims"]:
            rows: list[tuple[str, ...]] = [("CLAIM", "VERDICT", "GPU", "MESSAGE")]
            rows += [(c["claim"], c["reason"], c["gpu"] or "-", c["message"]) for c in p["claims"]]
            out += ["  " + line for line in align(rows)]
        if p["reshapes"]:
            rows = [("RE-CUT", "NOW", "PLANNED", "FREE INSTANCES THAT GO", "FOR CLAIMS", "ACTION")]
            rows += [
                (
                    r["gpu"],
                    r["from"],
                    r["to"],
                    ",".join(r["removes"]) or "-",
                    ",".join(r["claims"]) or "-",
                    "write now" if r["action"] == "write" else f"held: {r['held']}",
                )
                for r in p["reshapes"]
            ]
            out += ["  " + line for line in align(rows)]
        if p["offers"]:
            rows = [("OFFERS", "NOW", "PLANNED", "ACTION")]
            rows += [
                (
                    o["gpu"],
                    "unset" if o["from"] is None else ",".join(o["from"]) or "none",
                    ",".join(o["to"]) or "none",
                    "write now" if o["action"] == "write" else "DryRun: Dynamic would offer",
                )
                for o in p["offers"]
            ]
            out += ["  " + line for line in align(rows)]
        out += _preemption_lines(p.get("preemption"))
        if not (p["claims"] or p["reshapes"] or p["offers"] or p.get("preemption")):
            out.append("  nothing to do")
        out.append("")
    if report["claimsWithoutPolicy"]:
        out.append("pending claims no policy serves: " + ", ".join(report["claimsWithoutPolicy"]))
    if report["ungoverned"]:
        out.append("GPUs no policy governs: " + ", ".join(report["ungoverned"]))
    for node, why in report["silentAgents"].items():
        out.append(f"silent agent on {node}: {why}")
    if not report["policies"]:
        out.append("no GpuPartitionPolicy: the operator plans nothing")
    return "\n".join(out).rstrip()


# ----------------------------------------------------------------------------------------------- verify


def off_spec(gp: GpuPartition) -> str:
    """Why this GPU is not at its spec ("" when it is). Pure.

    At spec: the agent has seen the current generation, reports Ready=True, and has the instances of
    ``spec.layout`` (exactly; on the ``Partitionable`` inventory at least those, since the scheduler books
    the rest).
    """
    st = gp.status
    if st.observed_generation is None:
        return "no status from its agent yet"
    why: list[str] = []
    if st.phase == Phase.DEGRADED:
        why.append(f"phase Degraded: {st.message}".rstrip(": "))
    if st.observed_generation < gp.metadata.generation:
        why.append(
            f"the agent has seen generation {st.observed_generation} of {gp.metadata.generation} "
            "(spec.layout not applied yet)"
        )
    desired, actual = gp.spec.desired(), st.actual()
    missing = [i for i in desired if i not in actual]
    extra = [] if st.inventory is Inventory.PARTITIONABLE else [i for i in actual if i not in desired]
    if missing:
        why.append(f"missing {layout_summary(missing)}")
    if extra:
        why.append(f"not in spec {layout_summary(extra)}")
    ready = st.condition(ConditionType.READY)
    if ready is None:
        why.append("no Ready condition")
    elif not ready.is_true:
        why.append(f"Ready={ready.status} {ready.reason}: {ready.message}".rstrip(": "))
    return "; ".join(why)


def verify_report(partitions: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per GpuPartition (by name): spec and actual layouts and why it is off spec. Pure."""
    rows = []
    for raw in sorted(partitions, key=lambda p: str(p["metadata"]["name"])):
        gp = parse_gpu_partition(dict(raw))
        why = off_spec(gp)
        rows.append(
            {
                "gpu": gp.name,
                "node": gp.status.node,
                "spec": layout_summary(gp.spec.desired()),
                "actual": layout_summary(gp.status.actual()),
                "atSpec": not why,
                "reason": why,
            }
        )
    return rows


def verify_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The verify rows as text, with a last line that counts. Pure."""
    if not rows:
        return "no GpuPartitions"
    table = [("GPU", "NODE", "SPEC", "ACTUAL", "STATE")]
    table += [
        (r["gpu"], r["node"] or "-", r["spec"], r["actual"], "at spec" if r["atSpec"] else r["reason"])
        for r in rows
    ]
    off = sum(1 for r in rows if not r["atSpec"])
    return "\n".join([*align(table), "", f"{len(rows) - off} of {len(rows)} GPU(s) at spec, {off} off spec"])


# ----------------------------------------------------------------------------------------------- export


def _governed(world: World, only_policy: str | None) -> tuple[GpuView, ...]:
    if only_policy is None:
        return tuple(g for g in world.gpus if g.model is not None)
    if not any(p.name == only_policy for p in world.policies):
        raise ReportError(f"no GpuPartitionPolicy named {only_policy}")
    return tuple(
        g for g in world.gpus if g.model is not None and world.ownership.owner.get(g.name) == only_policy
    )


def _entries(layout: Layout) -> list[dict[str, Any]]:
    return [{"profile": i.profile, "start": i.start} for i in layout]


def export_policy_baseline(
    snap: Snapshot, catalog: Catalog, now: float, name: str, only_policy: str | None = None
) -> tuple[dict[str, Any], list[str]]:
    """(a GpuPartitionPolicy in mode DryRun whose baseline per GPU model is the most common current layout
    of that model's GPUs, comment lines naming the GPUs that differ). Pure."""
    gpus = _governed(parse_world(snap, catalog, now), only_policy)
    if not gpus:
        raise ReportError("no GpuPartition of a known GPU model to export")
    by_model: dict[str, list[GpuView]] = {}
    for g in gpus:
        assert g.model is not None
        by_model.setdefault(g.model.key, []).append(g)
    baseline: dict[str, list[dict[str, Any]]] = {}
    notes = [f"Exported by kubectl-dynamig {__version__} from {len(gpus)} GPU(s): the current layouts."]
    for key, members in sorted(by_model.items()):
        counts = Counter(normalize_layout(g.actual) for g in members)
        # most_common keeps first-seen order among equals: the first GPU by name wins a tie
        chosen, n = counts.most_common(1)[0]
        baseline[key] = _entries(chosen)
        notes.append(f"{key}: {n} of {len(members)} GPU(s) have {layout_summary(chosen)}")
        notes += [
            f"  {g.name} differs: {layout_summary(g.actual)}"
            for g in members
            if normalize_layout(g.actual) != chosen
        ]
    policy = {
        "apiVersion": GROUP_VERSION,
        "kind": POLICY_KIND,
        "metadata": {"name": name},
        "spec": {"mode": "DryRun", "gpuProducts": sorted(baseline), "baseline": baseline},
    }
    return policy, notes


def export_scenario(
    snap: Snapshot, catalog: Catalog, now: float, only_policy: str | None = None
) -> dict[str, Any]:
    """The GPUs (current instances, busy ones marked), the pending claims as the planner sees them and the
    policy's planner settings (with ``only_policy``, or when exactly one policy exists), in the format of
    ``dynamig plan -f``. Pure."""
    world = parse_world(snap, catalog, now)
    gpus = _governed(world, only_policy)
    if not gpus:
        raise ReportError("no GpuPartition of a known GPU model to export")
    policy = next((p for p in world.policies if p.name == only_policy), None)
    if policy is None and only_policy is None and len(world.policies) == 1:
        policy = world.policies[0]
    allowed = None
    if policy is not None and policy.spec.allowed_profiles is not None:
        allowed = frozenset(policy.spec.allowed_profiles)
    models = frozenset(g.model.key for g in gpus if g.model is not None)
    claims = [
        d
        for c in world.pending
        if policy is None or world.claim_owner.get(c.claim.key) == policy.name
        for d in c.planner_demands(allowed, models)
    ]
    doc: dict[str, Any] = {
        "gpus": [
            {
                "node": g.node,
                "index": g.index,
                "model": g.model.key,
                "instances": [
                    {"profile": i.profile, "start": i.start, **({"busy": True} if i in g.busy else {})}
                    for i in g.actual
                ],
            }
            for g in gpus
            if g.model is not None
        ],
        "claims": [
            {
                "name": d.name,
                "count": d.count,
                "alternatives": list(d.alternatives),
                **({} if d.nodes is None else {"nodes": sorted(d.nodes)}),
            }
            for d in claims
        ],
    }
    if policy is not None:
        planner = policy.spec.to_planner()
        # A scenario names only profiles of its GPUs' models; the policy may cover models not exported.
        known = {p.name for key in models for p in catalog.model(key).profiles}
        settings: dict[str, Any] = {
            "warmPool": {p: n for p, n in planner.warm_pool.items() if p in known},
            "baseline": {k: _entries(v) for k, v in planner.baseline.items() if k in models},
            "maxGpusReshaped": planner.max_gpus_reshaped,
            "strategy": planner.strategy.value,
        }
        if planner.allowed_profiles is not None:
            settings["allowedProfiles"] = sorted(p for p in planner.allowed_profiles if p in known)
        doc["policy"] = settings
    return doc
