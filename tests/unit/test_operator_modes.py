"""MIG mode on demand (operator/modes.py): which GPU's ``spec.migMode`` a policy writes for its pending
claims, and what each claim is told; the policy field that governs it; and a reconciler round that writes it.

Real: the MIG geometry catalog, CEL evaluation (cel-python) of the claims' selectors, policy and GpuPartition
parsing, the layout planner (``decide_round``) whose verdicts the switches start from, and the Prometheus
client registry. No API server: the round talks to :class:`FakeKube`, which records what it is asked to write
(tests/integration/test_policy_crd.py checks the CRD's schema on a real API server).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import ValidationError

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.generation import Generation, generation, mode_switch_needs_reset
from dynamig.kube.gpupartition import MigModeRequest
from dynamig.kube.policy import MigModeKind, parse_policy
from dynamig.kube.times import parse_time
from dynamig.operator.decide import RoundInput, decide_round
from dynamig.operator.demand import PendingClaim, extract_demand, parse_device_classes
from dynamig.operator.extended import ClassChanges
from dynamig.operator.inventory import (
    LAYOUT_WRITTEN_ANNOTATION,
    MIG_MODE_FOR_ANNOTATION,
    MIG_MODE_REQUESTED_ANNOTATION,
    MIG_MODE_RESET_ANNOTATION,
    MIG_MODE_WRITTEN_ANNOTATION,
    parse_inventory,
)
from dynamig.operator.kubeio import KubeIO, Snapshot
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.mode_round import ModeInput
from dynamig.operator.modes import ModeDecision, decide_modes
from dynamig.operator.policy_status import MAX_DRAINED_CLAIMS, drained_claims, read_drained_claims
from dynamig.operator.reconciler import Reconciler
from dynamig.operator.settings import OperatorSettings
from dynamig.operator.verdicts import Reason
from dynamig.operator.whole_keeps import WHOLE_HOLD_SECONDS

CATALOG = load_catalog()
MODELS = (CATALOG.model("H100-80GB"), CATALOG.model("A100-80GB"))
PRODUCTS = {"H100-80GB": "NVIDIA H100 80GB HBM3", "A100-80GB": "NVIDIA A100-SXM4-80GB"}
NOW = 1_800_000_000.0
PROFILE = 'device.attributes["mig.dynamig.io"].profile'
DRIVER_CLASS = {
    "metadata": {"name": "mig.dynamig.io"},
    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "mig.dynamig.io"'}}]},
}
CLASSES = parse_device_classes([DRIVER_CLASS])
NODES = {n: {"kubernetes.io/hostname": n} for n in ("node-a", "node-b")}
IDLE = (("3g.40gb", 0, "free"), ("3g.40gb", 4, "free"))
FULL = (("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "allocated"))


def stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def gpu(
    name: str,
    model: str = "H100-80GB",
    *,
    mig: str = "Enabled",
    instances: Sequence[tuple[str, int, str]] = IDLE,
    whole: str = "free",
    ask: str | None = None,
    annotations: Mapping[str, str] | None = None,
    conditions: Sequence[dict[str, Any]] = (),
    generation: int = 1,
    observed: int = 1,
    layout: Sequence[tuple[str, int]] | None = None,
) -> dict[str, Any]:
    """A GpuPartition as the agent reports it: ``mig`` the mode NVML reports, ``ask`` spec.migMode."""
    node, index = name.rsplit("-gpu", 1)
    on = mig in ("Enabled", "DisablePending")
    insts = list(instances) if on else []
    desired = [(p, s) for p, s, _ in insts] if layout is None else list(layout)
    spec: dict[str, Any] = {"layout": [{"profile": p, "start": s} for p, s in desired]}
    if ask is not None:
        spec["migMode"] = ask
    status: dict[str, Any] = {
        "node": node, "gpuIndex": int(index), "product": PRODUCTS[model], "model": model, "migMode": mig,
        "observedGeneration": observed, "phase": "Stable",
        "instances": [{"profile": p, "start": s, "deviceName": f"gpu{index}-{p}-s{s}", "state": st}
                      for p, s, st in insts],
        "conditions": list(conditions),
    }  # fmt: skip
    if not on:
        status["wholeGpu"] = {"deviceName": f"gpu{index}", "state": whole}
    return {
        "metadata": {"name": name, "generation": generation, "resourceVersion": "5", "uid": f"u-{name}",
                     "annotations": dict(annotations or {})},
        "spec": spec,
        "status": status,
    }  # fmt: skip


def claim(
    name: str, expr: str = f'{PROFILE} == "whole"', count: int = 1, node: str | None = None, minute: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    obj = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"c-{name}",
                     "creationTimestamp": f"2026-01-01T08:{minute:02d}:00Z"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "mig.dynamig.io", "count": count,
            "selectors": [{"cel": {"expression": expr}}]}}]}},
    }  # fmt: skip
    spec: dict[str, Any] = {"resourceClaims": [{"name": "gpu", "resourceClaimName": name}]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    pod = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"p-{name}"},
        "spec": spec,
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
    }
    return obj, pod


def slice_claim(
    name: str, profile: str = "3g.40gb", minute: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    return claim(name, f'{PROFILE} == "{profile}"', minute=minute)


def policy(mig_mode: Mapping[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"mode": "Dynamic", "cooldownSeconds": 60, "batchWindowSeconds": 0, **spec}
    if mig_mode is not None:
        body["migMode"] = dict(mig_mode)
    return {"metadata": {"name": "fleet", "generation": 1, "uid": "u-fleet",
                         "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": body}  # fmt: skip


DYNAMIC = {"policy": "Dynamic"}


def pending(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[PendingClaim, ...]:
    return extract_demand([c for c, _ in pairs], [p for _, p in pairs], CLASSES, MODELS, NODES).pending


def decide(
    parts: Sequence[dict[str, Any]],
    pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]],
    pol: dict[str, Any],
) -> ModeDecision:
    p = parse_policy(pol)
    gpus = parse_inventory(parts, CATALOG)
    round_ = decide_round(RoundInput(p, (), gpus, pending(pairs), NOW, {}, CATALOG))
    return decide_modes(ModeInput(p, gpus, round_, NOW))


# ------------------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Told:
    reason: Reason
    warn: bool
    says: tuple[str, ...]  # substrings of the message
    gpu: str | None = None


@dataclass(frozen=True)
class Case:
    id: str
    gpus: tuple[dict[str, Any], ...]
    claims: tuple[tuple[dict[str, Any], dict[str, Any]], ...]
    mig_mode: Mapping[str, Any] | None
    switches: tuple[tuple[str, str, str], ...]  # (GPU, spec.migMode written, claim) in order
    told: Mapping[str, Told]  # claim name -> what it is told
    spec: Mapping[str, Any] = field(default_factory=dict)  # more policy spec
    planned: tuple[tuple[str, str, str], ...] = ()  # DryRun


WHOLE_TOLD_FIXED = Told(Reason.WAITING_FOR_WHOLE_GPU, True, ("under a Fixed policy",))

CASES = [
    Case(
        "fixed-never-switches",
        (gpu("node-a-gpu0"),),
        (claim("train"),),
        None,  # the default: Fixed
        (),
        {"train": WHOLE_TOLD_FIXED},
    ),
    Case(
        "fixed-written-out-never-switches",
        (gpu("node-a-gpu0"),),
        (claim("train"),),
        {"policy": "Fixed", "allowReset": True},
        (),
        {"train": WHOLE_TOLD_FIXED},
    ),
    Case(
        "dynamic-switches-an-idle-h100-off-for-a-whole-gpu-claim",
        (gpu("node-a-gpu0"),),
        (claim("train"),),
        DYNAMIC,
        (("node-a-gpu0", "Disabled", "ml/train"),),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-a-gpu0",), "node-a-gpu0")},
    ),
    Case(
        "a-free-whole-gpu-serves-it-nothing-switched",
        (gpu("node-a-gpu0"), gpu("node-a-gpu1", mig="Disabled")),
        (claim("train"),),
        DYNAMIC,
        (),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("kube-scheduler",), "node-a-gpu1")},
    ),
    Case(
        "an-allocated-whole-gpu-does-not-serve-it-an-idle-one-is-switched",
        (gpu("node-a-gpu0"), gpu("node-a-gpu1", mig="Disabled", whole="allocated")),
        (claim("train"),),
        DYNAMIC,
        (("node-a-gpu0", "Disabled", "ml/train"),),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("none of them is free now", "switching"))},
    ),
    Case(
        "a100-without-allow-reset-never-switches-and-says-why",
        (gpu("node-a-gpu0", "A100-80GB"),),
        (claim("train"),),
        DYNAMIC,
        (),
        {
            "train": Told(
                Reason.WAITING_FOR_WHOLE_GPU,
                True,
                ("A100-80GB switches MIG mode only through a GPU reset", "spec.migMode.allowReset is false"),
            )
        },
    ),
    Case(
        "a100-with-allow-reset-switches",
        (gpu("node-a-gpu0", "A100-80GB"),),
        (claim("train"),),
        {"policy": "Dynamic", "allowReset": True},
        (("node-a-gpu0", "Disabled", "ml/train"),),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-a-gpu0",))},
    ),
    Case(
        "the-h100-goes-first-beside-an-a100-that-needs-a-reset",
        (gpu("node-a-gpu0", "A100-80GB"), gpu("node-a-gpu1")),
        (claim("train"),),
        DYNAMIC,
        (("node-a-gpu1", "Disabled", "ml/train"),),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-a-gpu1",))},
    ),
    Case(
        "min-mig-gpus-floor-holds",
        (gpu("node-a-gpu0"), gpu("node-a-gpu1")),
        (claim("train"),),
        {"policy": "Dynamic", "minMigGpus": 2},
        (),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, True, ("spec.migMode.minMigGpus", "and has 2"))},
    ),
    Case(
        "min-mig-gpus-floor-leaves-room-for-one",
        (gpu("node-a-gpu0"), gpu("node-a-gpu1")),
        (claim("train"),),
        {"policy": "Dynamic", "minMigGpus": 1},
        (("node-a-gpu0", "Disabled", "ml/train"),),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching",))},
    ),
    Case(
        "cooldown-holds-a-gpu-switched-lately",
        (gpu("node-a-gpu0", annotations={MIG_MODE_WRITTEN_ANNOTATION: stamp(NOW - 100)}),),
        (claim("train"),),
        {"policy": "Dynamic", "cooldownSeconds": 600},
        (),
        {
            "train": Told(
                Reason.WAITING_FOR_WHOLE_GPU, False, ("switched 100s ago, cooldown 600s (500s left)",)
            )
        },
    ),
    Case(
        "cooldown-over",
        (gpu("node-a-gpu0", annotations={MIG_MODE_WRITTEN_ANNOTATION: stamp(NOW - 700)}),),
        (claim("train"),),
        {"policy": "Dynamic", "cooldownSeconds": 600},
        (("node-a-gpu0", "Disabled", "ml/train"),),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching",))},
    ),
    Case(
        "busy-gpus-are-skipped",
        (gpu("node-a-gpu0", instances=(("3g.40gb", 0, "allocated"),)), gpu("node-a-gpu1")),
        (claim("train"),),
        DYNAMIC,
        (("node-a-gpu1", "Disabled", "ml/train"),),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-a-gpu1",))},
    ),
    Case(
        "only-busy-gpus-nothing-switched",
        (gpu("node-a-gpu0", instances=(("3g.40gb", 0, "in-use"),)),),
        (claim("train"),),
        DYNAMIC,
        (),
        {
            "train": Told(
                Reason.WAITING_FOR_WHOLE_GPU, True, ("node-a-gpu0: 1 MIG instance(s) allocated or in use",)
            )
        },
    ),
    Case(
        "the-gpu-with-the-fewest-instances-to-destroy-goes-first",
        (gpu("node-a-gpu0"), gpu("node-a-gpu1", instances=(("7g.80gb", 0, "free"),)), gpu("node-b-gpu0")),
        (claim("train"),),
        DYNAMIC,
        (("node-a-gpu1", "Disabled", "ml/train"),),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("7g.80gb@0",))},
    ),
    Case(
        "a-node-the-pod-may-not-use-is-no-help",
        (gpu("node-a-gpu0"),),
        (claim("train", node="node-b"),),
        DYNAMIC,
        (),
        {
            "train": Told(
                Reason.WAITING_FOR_WHOLE_GPU, True, ("on the nodes the pod may use has MIG mode on",)
            )
        },
    ),
    Case(
        "the-reverse-switch-for-mig-demand-with-no-room",
        (gpu("node-a-gpu0", instances=FULL), gpu("node-a-gpu1", mig="Disabled")),
        (slice_claim("infer"),),
        DYNAMIC,
        (("node-a-gpu1", "Enabled", "ml/infer"),),
        {
            "infer": Told(
                Reason.WAITING_FOR_MIG_MODE_SWITCH,
                False,
                ("switching node-a-gpu1", "Now: no room"),
                "node-a-gpu1",
            )
        },
    ),
    Case(
        # the MIG GPU was cut 10 s ago (cooldown 60 s) and is full: a free whole GPU is switched on now
        # rather than the claim waiting out the cooldown (a burst whose last claim came a round late)
        "the-reverse-switch-while-the-mig-gpu-cools",
        (
            gpu("node-a-gpu0", instances=FULL, annotations={LAYOUT_WRITTEN_ANNOTATION: stamp(NOW - 10)}),
            gpu("node-a-gpu1", mig="Disabled"),
        ),
        (slice_claim("infer"),),
        DYNAMIC,
        (("node-a-gpu1", "Enabled", "ml/infer"),),
        {
            "infer": Told(
                Reason.WAITING_FOR_MIG_MODE_SWITCH,
                False,
                (
                    "switching node-a-gpu1",
                    "Now: no GPU of policy fleet has room for the claim without a re-cut",
                ),
                "node-a-gpu1",
            )
        },
    ),
    Case(
        "the-reverse-switch-where-every-gpu-is-whole",
        (gpu("node-a-gpu0", mig="Disabled"),),
        (slice_claim("infer"),),
        DYNAMIC,
        (("node-a-gpu0", "Enabled", "ml/infer"),),
        {"infer": Told(Reason.WAITING_FOR_MIG_MODE_SWITCH, False, ("switching node-a-gpu0",))},
    ),
    Case(
        "fixed-no-reverse-switch",
        (gpu("node-a-gpu0", instances=FULL), gpu("node-a-gpu1", mig="Disabled")),
        (slice_claim("infer"),),
        None,
        (),
        {"infer": Told(Reason.NO_CAPACITY, True, ("no room",))},
    ),
    Case(
        "min-whole-gpus-floor-holds",
        (gpu("node-a-gpu0", instances=FULL), gpu("node-a-gpu1", mig="Disabled")),
        (slice_claim("infer"),),
        {"policy": "Dynamic", "minWholeGpus": 1},
        (),
        {"infer": Told(Reason.NO_CAPACITY, True, ("spec.migMode.minWholeGpus",))},
    ),
    Case(
        "an-allocated-whole-gpu-is-not-switched-on",
        (gpu("node-a-gpu0", instances=FULL), gpu("node-a-gpu1", mig="Disabled", whole="in-use")),
        (slice_claim("infer"),),
        DYNAMIC,
        (),
        {"infer": Told(Reason.NO_CAPACITY, True, ("node-a-gpu1: the whole GPU is in-use",))},
    ),
    Case(
        "a-free-whole-gpu-a-whole-claim-waits-for-is-not-switched-on",
        (gpu("node-a-gpu0", instances=FULL), gpu("node-a-gpu1", mig="Disabled")),
        (claim("train", minute=1), slice_claim("infer", minute=0)),
        DYNAMIC,
        (),
        {
            "train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("kube-scheduler",)),
            "infer": Told(Reason.NO_CAPACITY, True, ("a pending claim of whole GPUs could take it",)),
        },
    ),
    Case(
        "one-claim-per-policy-and-round-oldest-claim-first",
        (gpu("node-a-gpu0"), gpu("node-a-gpu1"), gpu("node-b-gpu0")),
        (claim("second", minute=5), claim("first", minute=1)),
        DYNAMIC,
        (("node-a-gpu0", "Disabled", "ml/first"),),
        {
            "first": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-a-gpu0",)),
            "second": Told(
                Reason.WAITING_FOR_WHOLE_GPU,
                False,
                ("switches of a round are for one claim on one node", "ml/first"),
            ),
        },
        spec={"disruptionBudget": {"maxGpusReshaping": 3}},
    ),
    Case(
        "a-switch-counts-against-the-disruption-budget",
        (gpu("node-a-gpu0", ask="Disabled"), gpu("node-a-gpu1")),
        (claim("first", minute=1), claim("second", minute=5)),
        DYNAMIC,
        (),
        {
            "first": Told(
                Reason.WAITING_FOR_WHOLE_GPU, False, ("node-a-gpu0 is being switched",), "node-a-gpu0"
            ),
            "second": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("the disruption budget allows 1",)),
        },
    ),
    Case(
        "a-switch-under-way-for-the-claim-is-told-not-repeated",
        (
            gpu(
                "node-a-gpu0",
                ask="Disabled",
                annotations={
                    MIG_MODE_FOR_ANNOTATION: "ml/late",
                    MIG_MODE_REQUESTED_ANNOTATION: "Disabled",
                    MIG_MODE_WRITTEN_ANNOTATION: stamp(NOW - 30),
                },
                conditions=[
                    {
                        "type": "MigMode",
                        "status": "False",
                        "reason": "MigModeDraining",
                        "message": "switching MIG off once nothing uses the GPU",
                        "observedGeneration": 1,
                    }
                ],
            ),
            gpu("node-a-gpu1"),
        ),
        (claim("early", minute=1), claim("late", minute=5)),
        {"policy": "Dynamic", "cooldownSeconds": 0},
        (("node-a-gpu1", "Disabled", "ml/early"),),
        {
            "late": Told(
                Reason.WAITING_FOR_WHOLE_GPU,
                False,
                (
                    "node-a-gpu0 is being switched to MIG mode off for it",
                    "once nothing uses",
                    "asked 30s ago",
                ),
                "node-a-gpu0",
            ),
            "early": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-a-gpu1",)),
        },
        spec={"disruptionBudget": {"maxGpusReshaping": 2}},
    ),
    Case(
        "a-gpu-reshaping-is-not-switched",
        (gpu("node-a-gpu0", generation=2, observed=1, layout=[("7g.80gb", 0)]),),
        (claim("train"),),
        DYNAMIC,
        (),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("its layout is being applied",))},
    ),
    Case(
        "dry-run-says-what-it-would-switch",
        (gpu("node-a-gpu0"),),
        (claim("train"),),
        DYNAMIC,
        (),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("is DryRun: it would switch node-a-gpu0",))},
        spec={"mode": "DryRun"},
        planned=(("node-a-gpu0", "Disabled", "ml/train"),),
    ),
    Case(
        "static-switches-nothing",
        (gpu("node-a-gpu0"),),
        (claim("train"),),
        DYNAMIC,
        (),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, True, ("Static and changes no GPU",))},
        spec={"mode": "Static"},
    ),
    Case(
        "a-mode-answered-reset-required-is-never-asked-again",
        (gpu("node-a-gpu0", "A100-80GB", annotations={MIG_MODE_RESET_ANNOTATION: "Disabled"}),),
        (claim("train"),),
        {"policy": "Dynamic", "allowReset": True},
        (),
        {"train": Told(Reason.WAITING_FOR_WHOLE_GPU, True, ("answered ResetRequired", "not asked again"))},
    ),
    Case(
        "two-whole-gpus-on-one-node-the-node-with-more-goes-first",
        (gpu("node-a-gpu0"), gpu("node-b-gpu0"), gpu("node-b-gpu1", mig="Disabled")),
        (claim("big", count=2),),
        DYNAMIC,
        (("node-b-gpu0", "Disabled", "ml/big"),),
        {"big": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-b-gpu0",))},
    ),
]


CASES.append(
    Case(
        "two-whole-gpus-on-one-node-another-node-can-get-both",
        (gpu("node-a-gpu0"), gpu("node-a-gpu1", instances=()), gpu("node-b-gpu1", mig="Disabled")),
        (claim("big", count=2),),
        DYNAMIC,
        (("node-a-gpu1", "Disabled", "ml/big"), ("node-a-gpu0", "Disabled", "ml/big")),
        {
            "big": Told(
                Reason.WAITING_FOR_WHOLE_GPU, False, ("only 1 of them free on node node-b", "switching")
            )
        },
    )
)


CASES += [
    Case(
        "four-whole-gpus-the-node-s-gpus-switched-together",
        (
            *(gpu(f"node-a-gpu{i}") for i in range(3)),
            gpu("node-a-gpu3", mig="Disabled"),
            gpu("node-b-gpu0"),
            gpu("node-b-gpu1"),
        ),
        (claim("big", count=4),),
        DYNAMIC,
        tuple((f"node-a-gpu{i}", "Disabled", "ml/big") for i in range(3)),
        {"big": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-a-gpu0", "node-a-gpu2 (H100"))},
        spec={"disruptionBudget": {"maxGpusReshaping": 4}},
    ),
    Case(
        # The node's GPUs a claim lacks switch together as one change of the disruption budget (default 1).
        "eight-whole-gpus-switched-together-as-one-change-of-the-budget",
        (*(gpu(f"node-a-gpu{i}") for i in range(8)),),
        (claim("big", count=8),),
        DYNAMIC,
        tuple((f"node-a-gpu{i}", "Disabled", "ml/big") for i in range(8)),
        {"big": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-a-gpu0", "node-a-gpu7"))},
    ),
    Case(
        # A claim's switch under way on a node is its change: the GPUs it still lacks there join it...
        "a-claim-s-switch-under-way-is-joined-not-charged-again",
        (
            gpu(
                "node-a-gpu0",
                ask="Disabled",
                annotations={MIG_MODE_FOR_ANNOTATION: "ml/big", MIG_MODE_REQUESTED_ANNOTATION: "Disabled"},
            ),
            *(gpu(f"node-a-gpu{i}") for i in (1, 2)),
        ),
        (claim("big", count=3),),
        DYNAMIC,
        (("node-a-gpu1", "Disabled", "ml/big"), ("node-a-gpu2", "Disabled", "ml/big")),
        {"big": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-a-gpu1", "node-a-gpu2"))},
    ),
    Case(
        # ...while another claim's change spends the budget of one.
        "another-claim-s-switch-spends-the-budget",
        (
            gpu(
                "node-z-gpu0",
                ask="Disabled",
                annotations={MIG_MODE_FOR_ANNOTATION: "ml/other", MIG_MODE_REQUESTED_ANNOTATION: "Disabled"},
            ),
            *(gpu(f"node-a-gpu{i}") for i in (0, 1)),
        ),
        (claim("big", count=2),),
        DYNAMIC,
        (),
        {"big": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("the disruption budget allows 1",))},
    ),
    Case(
        "four-whole-gpus-together-down-to-the-mig-floor",
        (*(gpu(f"node-a-gpu{i}") for i in range(4)), gpu("node-b-gpu0")),
        (claim("big", count=4),),
        {**DYNAMIC, "minMigGpus": 2},
        tuple((f"node-a-gpu{i}", "Disabled", "ml/big") for i in range(3)),
        {"big": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-a-gpu0",))},
        spec={"disruptionBudget": {"maxGpusReshaping": 8}},
    ),
    Case(
        "a-second-claim-waits-for-the-round-after-a-claim-s-switches",
        (*(gpu(f"node-a-gpu{i}") for i in range(2)), gpu("node-b-gpu0")),
        (claim("big", count=2, minute=1), claim("one", minute=2)),
        DYNAMIC,
        (("node-a-gpu0", "Disabled", "ml/big"), ("node-a-gpu1", "Disabled", "ml/big")),
        {
            "big": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("switching node-a-gpu0", "node-a-gpu1")),
            "one": Told(Reason.WAITING_FOR_WHOLE_GPU, False, ("for one claim on one node", "ml/big")),
        },
        spec={"disruptionBudget": {"maxGpusReshaping": 8}},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_mig_mode_decision(case: Case) -> None:
    pol = policy(case.mig_mode, **case.spec)
    decision = decide(case.gpus, case.claims, pol)
    assert [(s.gpu, s.to.value, s.claim) for s in decision.switches] == list(case.switches)
    assert [(s.gpu, s.to.value, s.claim) for s in decision.planned] == list(case.planned)
    for s in decision.switches:  # what is written
        want: dict[str, Any] = {"migMode": s.to.value}
        if s.to is MigModeRequest.DISABLED:
            want |= {"layout": [], "offeredProfiles": []}
        assert s.spec() == want
        assert s.annotations("2027-01-15T08:00:00Z") == {
            MIG_MODE_WRITTEN_ANNOTATION: "2027-01-15T08:00:00Z",
            MIG_MODE_REQUESTED_ANNOTATION: s.to.value,
            MIG_MODE_FOR_ANNOTATION: s.claim,
        }
        assert s.claim in s.message and s.gpu in s.message
    told = {v.claim.claim.name: v for v in decision.verdicts}
    assert set(told) == set(case.told)
    for name, want_told in case.told.items():
        v = told[name]
        assert v.reason is want_told.reason, (name, v.message)
        assert v.warning is want_told.warn, (name, v.message)
        for text in want_told.says:
            assert text in v.message, (name, text, v.message)
        if want_told.gpu is not None:
            assert v.gpu == want_told.gpu, (name, v.gpu)


# ------------------------------------------------------------------------------------------ ResetRequired

RESET = {"type": "MigMode", "status": "False", "reason": "ResetRequired", "observedGeneration": 1,
         "message": "NVML answered NVML_ERROR_RESET_REQUIRED switching MIG off"}  # fmt: skip


def test_reset_required_is_recorded_the_request_withdrawn_and_the_node_skipped() -> None:
    asked = {MIG_MODE_REQUESTED_ANNOTATION: "Disabled", MIG_MODE_FOR_ANNOTATION: "ml/train"}
    parts = (
        gpu(
            "node-a-gpu0",
            "A100-80GB",
            mig="DisablePending",
            ask="Disabled",
            annotations=asked,
            conditions=[RESET],
        ),
        gpu("node-a-gpu1", "A100-80GB"),  # same node, same model: same platform
        gpu("node-b-gpu0", "A100-80GB"),
    )
    decision = decide(parts, (claim("train"),), policy({"policy": "Dynamic", "allowReset": True}))
    (reset,) = decision.resets
    assert (reset.gpu, reset.mode, reset.revert) == (
        "node-a-gpu0",
        MigModeRequest.DISABLED,
        MigModeRequest.ENABLED,
    )
    assert reset.spec() == {"migMode": "Enabled"}
    assert reset.annotations() == {
        MIG_MODE_RESET_ANNOTATION: "Disabled",
        MIG_MODE_REQUESTED_ANNOTATION: "Enabled",
    }
    assert "not ask it" in reset.message and "VM reboot" in reset.message
    # The stuck GPU holds no budget; the other GPU of its node is skipped, the other node's is switched.
    assert [(s.gpu, s.to.value) for s in decision.switches] == [("node-b-gpu0", "Disabled")]


def test_reset_required_on_a_request_a_person_wrote_is_recorded_and_left() -> None:
    parts = (gpu("node-a-gpu0", "A100-80GB", mig="DisablePending", ask="Disabled", conditions=[RESET]),)
    decision = decide(parts, (), policy(None))  # Fixed: the record is kept all the same
    (reset,) = decision.resets
    assert reset.revert is None and reset.spec() == {}
    assert reset.annotations() == {MIG_MODE_RESET_ANNOTATION: "Disabled"}
    # Recorded once: with the annotation there, nothing more is written.
    parts = (
        gpu("node-a-gpu0", "A100-80GB", mig="DisablePending", ask="Disabled", conditions=[RESET],
            annotations={MIG_MODE_RESET_ANNOTATION: "Disabled"}),
    )  # fmt: skip
    assert decide(parts, (), policy(None)).resets == ()


# ------------------------------------------------------------------------------------------ the inventory


def test_a_gpu_switching_off_is_not_planned_for_mig_and_holds_the_disruption_budget() -> None:
    parts = (gpu("node-a-gpu0", ask="Disabled"), gpu("node-a-gpu1", instances=(), layout=[]))
    gpus = {g.name: g for g in parse_inventory(parts, CATALOG)}
    assert gpus["node-a-gpu0"].unusable.startswith("spec.migMode asks for MIG mode off")
    assert gpus["node-a-gpu0"].switching is MigModeRequest.DISABLED and not gpus["node-a-gpu0"].whole
    pol = parse_policy(policy(DYNAMIC))
    claims = pending((slice_claim("infer"),))
    decision = decide_round(RoundInput(pol, (), tuple(gpus.values()), claims, NOW, {}, CATALOG))
    assert decision.writes == ()  # the budget (1) is the switch's
    (v,) = decision.verdicts
    assert v.reason is Reason.WAITING_FOR_BUDGET and "disruption budget" in v.message


def test_a_claim_s_switches_on_a_node_hold_one_change_of_the_reshape_budget() -> None:
    """Two GPUs switching off for one claim on one node are one change: under a budget of two, a re-cut
    still goes ahead beside them; two switches for two claims spend the budget."""
    big = {MIG_MODE_FOR_ANNOTATION: "ml/big", MIG_MODE_REQUESTED_ANNOTATION: "Disabled"}
    free = gpu("node-b-gpu0", instances=(), layout=[])
    pol = parse_policy(policy(DYNAMIC, disruptionBudget={"maxGpusReshaping": 2}))
    claims = pending((slice_claim("infer"),))

    def writes(parts: Sequence[dict[str, Any]]) -> list[str]:
        gpus = tuple(parse_inventory(parts, CATALOG))
        return [w.gpu for w in decide_round(RoundInput(pol, (), gpus, claims, NOW, {}, CATALOG)).writes]

    one = [gpu(f"node-a-gpu{i}", ask="Disabled", annotations=big) for i in (0, 1)]
    assert writes([*one, free]) == ["node-b-gpu0"]
    other = {MIG_MODE_FOR_ANNOTATION: "ml/other", MIG_MODE_REQUESTED_ANNOTATION: "Disabled"}
    two = [one[0], gpu("node-a-gpu1", ask="Disabled", annotations=other)]
    assert writes([*two, free]) == []


def test_a_whole_gpu_asked_to_switch_on_serves_no_whole_claim() -> None:
    (g,) = parse_inventory([gpu("node-a-gpu0", mig="Disabled", ask="Enabled")], CATALOG)
    assert not g.whole and g.switching is MigModeRequest.ENABLED
    (g,) = parse_inventory([gpu("node-a-gpu0", mig="Enabled", ask="Enabled")], CATALOG)
    assert g.switching is None and g.mode_target is MigModeRequest.ENABLED and not g.unusable


def test_a_free_whole_gpu_is_kept_from_mig_claims_only_for_a_whole_claim_its_node_could_complete() -> None:
    # node-a and node-b have one GPU each, both whole and free; a claim of two whole GPUs waits (it is
    # counted on node-a, the first of the nodes with the most); a MIG claim finds no GPU with MIG mode on
    parts = [gpu("node-a-gpu0", mig="Disabled"), gpu("node-b-gpu0", mig="Disabled")]
    pair, small = claim("pair", count=2), slice_claim("small", minute=1)
    out = decide(parts, [pair, small], policy({**DYNAMIC, "cooldownSeconds": 0}))
    # node-b's one GPU cannot complete a claim of two: it is switched on for the MIG claim
    assert [(s.gpu, s.to) for s in out.switches] == [("node-b-gpu0", MigModeRequest.ENABLED)]
    # a second GPU on node-b that cannot be switched off (its instances allocated): still no room for two
    busy = [*parts, gpu("node-b-gpu1", instances=FULL)]
    out = decide(busy, [pair, small], policy({**DYNAMIC, "cooldownSeconds": 0}))
    assert [(s.gpu, s.to) for s in out.switches] == [("node-b-gpu0", MigModeRequest.ENABLED)]
    # a claim of one whole GPU could complete on either node: both free whole GPUs are kept from the MIG claim
    single = claim("single")
    out = decide(parts, [single, small], policy({**DYNAMIC, "cooldownSeconds": 0}))
    assert out.switches == ()
    told = next(v for v in out.verdicts if v.claim.claim.key == "ml/small")
    assert "a pending claim of whole GPUs could take it" in told.message, told.message


# ------------------------------------------------------------------------------------------ the policy field


def test_the_mig_mode_field_defaults_to_fixed_and_names_bad_input() -> None:
    spec = parse_policy(policy(None)).spec.mig_mode
    assert (spec.policy, spec.allow_reset, spec.min_mig_gpus, spec.min_whole_gpus, spec.cooldown_seconds) == (
        MigModeKind.FIXED, False, 0, 0, 600,
    )  # fmt: skip
    cases: list[tuple[dict[str, Any], str]] = [
        ({"policy": "Sometimes"}, "spec.migMode.policy"),
        ({"minMigGpus": -1}, "spec.migMode.minMigGpus"),
        ({"minWholeGpus": -1}, "spec.migMode.minWholeGpus"),
        ({"cooldownSeconds": 10**7}, "spec.migMode.cooldownSeconds"),
        ({"allowReset": "maybe"}, "spec.migMode.allowReset"),
    ]
    for bad, where in cases:
        with pytest.raises(ValidationError) as err:
            parse_policy(policy(bad))
        assert where in str(err.value), (bad, str(err.value))


def test_every_catalog_model_has_a_generation_and_only_ampere_needs_a_reset() -> None:
    for model in CATALOG.models():
        gen = generation(model.key)
        assert gen is not None, model.key
        assert mode_switch_needs_reset(model.key) is (gen is Generation.AMPERE), model.key
    assert mode_switch_needs_reset("A30-24GB") and not mode_switch_needs_reset("H200-141GB")
    assert mode_switch_needs_reset("Z9-1GB")  # unknown: taken as needing one


# ------------------------------------------------------------------------------------------ a round


class FakeKube:
    """The KubeIO calls a round makes, answered from one snapshot; spec writes and Events are recorded."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self.events: list[
            tuple[dict[str, Any], str, str, str]
        ] = []  # (involvedObject, type, reason, message)
        self.writes: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        # the preempter's writes of spec.holds (operator/preempting.py)
        self.hold_writes: list[tuple[str, list[dict[str, Any]]]] = []
        self.statuses: list[tuple[str, dict[str, Any]]] = []  # policy status patches

    async def snapshot(self, lease_namespace: str | None = None) -> Snapshot:
        return self.snap

    async def post_event(
        self, involved: Mapping[str, Any], event_type: str, reason: str, message: str, namespace: str
    ) -> None:
        self.events.append((dict(involved), event_type, reason, message))

    async def write_spec(self, name: str, spec: Any, annotations: Any, rv: str) -> dict[str, Any]:
        self.writes.append((name, dict(spec), dict(annotations)))
        return {"metadata": {"generation": 2}}

    async def patch_policy_status(self, name: str, status: Mapping[str, Any]) -> None:
        self.statuses.append((name, dict(status)))

    async def write_device_classes(self, changes: ClassChanges) -> None:
        pass

    async def patch_partition_conditions(self, name: str, conditions: list[dict[str, Any]]) -> None:
        pass

    async def serves_taint_rules(self) -> bool:
        return False

    async def list_running_pods(self) -> tuple[dict[str, Any], ...]:
        return self.snap.pods

    async def list_disruption_budgets(self) -> tuple[dict[str, Any], ...]:
        return ()

    async def write_holds(self, name: str, holds: list[dict[str, Any]], rv: str) -> dict[str, Any]:
        self.hold_writes.append((name, holds))
        return {"metadata": {"resourceVersion": rv}}


def round_snapshot(part: dict[str, Any]) -> Snapshot:
    c, p = claim("train")
    return Snapshot(
        policies=(policy(DYNAMIC),),
        partitions=(part,),
        nodes=({"metadata": {"name": "node-a", "labels": NODES["node-a"]}},),
        pods=(p,),
        claims=(c,),
        device_classes=(DRIVER_CLASS,),
    )


SWITCHES = "dynamig_operator_mig_mode_switches_total"


async def test_a_round_writes_the_switch_tells_the_gpu_and_the_pod_and_counts_it() -> None:
    metrics = OperatorMetrics()
    kube = FakeKube(round_snapshot(gpu("node-a-gpu0")))
    rec = Reconciler(cast(KubeIO, kube), CATALOG, metrics, OperatorSettings())
    await rec.round("fleet")
    ((name, spec, annotations),) = kube.writes
    spec.pop("autoPlacementsPerProfile", None)  # the operator's choice for agents on auto, in the same patch
    (hold,) = spec.pop("holds")  # kept whole for the claim it is switched for (agent/bindings/holds.py)
    assert (hold["claim"], hold["claimUid"], hold["kind"], hold["profile"], hold["start"]) == (
        "ml/train",
        "c-train",
        "Whole",
        "whole",
        0,
    )
    assert (name, spec) == ("node-a-gpu0", {"migMode": "Disabled", "layout": [], "offeredProfiles": []})
    assert any(e[0]["kind"] == "GpuPartition" and e[2] == "WholeGpuKept" for e in kube.events)
    assert annotations[MIG_MODE_REQUESTED_ANNOTATION] == "Disabled"
    assert annotations[MIG_MODE_FOR_ANNOTATION] == "ml/train" and MIG_MODE_WRITTEN_ANNOTATION in annotations
    by_kind = {(e[0]["kind"], e[2]): e for e in kube.events}
    gpu_event = by_kind[("GpuPartition", "MigModeSwitchRequested")]
    assert gpu_event[1] == "Normal" and "ml/train" in gpu_event[3] and gpu_event[0]["uid"] == "u-node-a-gpu0"
    assert ("GpuPartitionPolicy", "MigModeSwitchRequested") in by_kind
    pod_event = by_kind[("Pod", "WaitingForWholeGpu")]
    assert pod_event[1] == "Normal" and "switching node-a-gpu0" in pod_event[3]
    assert metrics.registry.get_sample_value(SWITCHES, {"policy": "fleet", "to": "Disabled"}) == 1
    assert metrics.registry.get_sample_value(SWITCHES, {"policy": "fleet", "to": "Enabled"}) == 0

    # The agent switched: the next round tells the GPU and writes nothing more.
    done = gpu("node-a-gpu0", mig="Disabled", ask="Disabled", annotations=annotations)
    kube.snap = round_snapshot(done)
    kube.events.clear()
    kube.writes.clear()
    await rec.round("fleet")
    assert [w for w in kube.writes if set(w[1]) - {"autoPlacementsPerProfile"}] == []
    assert any(e[0]["kind"] == "GpuPartition" and e[2] == "MigModeSwitched" for e in kube.events)


async def test_a_round_withdraws_a_request_the_agent_answered_reset_required_for() -> None:
    asked = {MIG_MODE_REQUESTED_ANNOTATION: "Disabled", MIG_MODE_FOR_ANNOTATION: "ml/train",
             MIG_MODE_WRITTEN_ANNOTATION: stamp(time.time() - 5)}  # fmt: skip
    part = gpu("node-a-gpu0", "A100-80GB", mig="DisablePending", ask="Disabled", annotations=asked,
               conditions=[RESET])  # fmt: skip
    kube = FakeKube(round_snapshot(part))
    rec = Reconciler(cast(KubeIO, kube), CATALOG, OperatorMetrics(), OperatorSettings())
    await rec.round("fleet")
    ((name, spec, annotations),) = kube.writes
    spec.pop("autoPlacementsPerProfile", None)
    assert (name, spec) == ("node-a-gpu0", {"migMode": "Enabled"})
    assert annotations == {MIG_MODE_RESET_ANNOTATION: "Disabled", MIG_MODE_REQUESTED_ANNOTATION: "Enabled"}
    warned = [e for e in kube.events if e[2] == "MigModeResetRequired"]
    assert {e[0]["kind"] for e in warned} == {"GpuPartition", "GpuPartitionPolicy"}
    assert all(e[1] == "Warning" for e in warned)


def l4(name: str, *, ask: str | None = None, annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A GPU without MIG (no catalog model) as the agent reports it: mode Disabled, refused (UnknownModel)
    until its GpuPartition asks spec.migMode Disabled."""
    node, index = name.rsplit("-gpu", 1)
    spec: dict[str, Any] = {"layout": []}
    if ask is not None:
        spec["migMode"] = ask
    return {
        "metadata": {"name": name, "generation": 1, "resourceVersion": "5", "uid": f"u-{name}",
                     "annotations": dict(annotations or {})},
        "spec": spec,
        "status": {"node": node, "gpuIndex": int(index), "product": "NVIDIA L4", "model": "",
                   "migMode": "Disabled", "observedGeneration": 1, "phase": "Degraded"},
    }  # fmt: skip


def l4_snapshot(part: dict[str, Any], without_mig: str | None) -> Snapshot:
    mig_mode = {"gpusWithoutMig": without_mig} if without_mig else None
    return Snapshot(
        policies=(policy(mig_mode),),
        partitions=(part,),
        nodes=({"metadata": {"name": "node-a", "labels": NODES["node-a"]}},),
        pods=(),
        claims=(),
        device_classes=(DRIVER_CLASS,),
    )


async def test_a_gpu_without_mig_is_served_whole_only_under_gpus_without_mig_whole() -> None:
    kube = FakeKube(l4_snapshot(l4("node-a-gpu0"), None))  # default Ignore: left alone, not governed
    rec = Reconciler(cast(KubeIO, kube), CATALOG, OperatorMetrics(), OperatorSettings())
    await rec.round("fleet")
    assert kube.writes == []
    kube.snap = l4_snapshot(l4("node-a-gpu0"), "Whole")
    await rec.round("fleet")
    ((name, spec, annotations),) = [w for w in kube.writes if "migMode" in w[1]]
    assert (name, spec["migMode"]) == ("node-a-gpu0", "Disabled")
    assert annotations[MIG_MODE_REQUESTED_ANNOTATION] == "Disabled"
    assert any(e[2] == "ServedWhole" and e[0]["kind"] == "GpuPartition" for e in kube.events)
    # Asked already: nothing more written.
    kube.writes.clear()
    kube.snap = l4_snapshot(l4("node-a-gpu0", ask="Disabled", annotations=annotations), "Whole")
    await rec.round("fleet")
    assert [w for w in kube.writes if "migMode" in w[1]] == []
    # The policy no longer serves them: the operator's own request is withdrawn, a person's is left.
    kube.writes.clear()
    kube.snap = l4_snapshot(l4("node-a-gpu0", ask="Disabled", annotations=annotations), "Ignore")
    await rec.round("fleet")
    assert [(w[0], w[1]) for w in kube.writes] == [("node-a-gpu0", {"migMode": None})]
    kube.writes.clear()
    kube.snap = l4_snapshot(l4("node-a-gpu0", ask="Disabled"), "Ignore")
    await rec.round("fleet")
    assert kube.writes == []


def test_gpus_without_mig_match_by_product_name() -> None:
    from dynamig.kube.policy import GpuIdentity, policy_matches

    whole = parse_policy(policy({"gpusWithoutMig": "Whole"}))
    named = parse_policy(policy({"gpusWithoutMig": "Whole"}, gpuProducts=["NVIDIA L4"]))
    other = parse_policy(policy({"gpusWithoutMig": "Whole"}, gpuProducts=["H100-80GB"]))
    ignore = parse_policy(policy({"gpusWithoutMig": "Ignore"}))
    gpu_l4 = GpuIdentity("node-a-gpu0", "node-a", NODES["node-a"], None, "NVIDIA L4")
    assert policy_matches(whole, gpu_l4) and policy_matches(named, gpu_l4)
    assert not policy_matches(other, gpu_l4) and not policy_matches(ignore, gpu_l4)
    assert not policy_matches(whole, GpuIdentity("node-a-gpu0", "node-a", NODES["node-a"], None, ""))


def _kept_for(part: dict[str, Any], claim: str) -> dict[str, Any]:
    """``part`` with a hold of its whole GPU for ``claim`` in spec.holds."""
    hold = {
        "claim": claim,
        "kind": "Whole",
        "profile": "whole",
        "start": 0,
        "expiresAt": "2099-01-01T00:00:00Z",
    }
    part["spec"]["holds"] = [hold]
    return part


def test_gpus_switched_for_a_claim_of_whole_gpus_are_kept_whole_for_it() -> None:
    """The GPUs switched off for a claim, and the free whole GPUs counted for it on the same node, are kept
    whole for it (holds of kind Whole), so nobody else books them while the rest switch; a GPU kept for one
    claim is not counted for another, nor switched back on; a claim free whole GPUs serve gets no hold."""
    pol = policy(DYNAMIC, disruptionBudget={"maxGpusReshaping": 4})
    node_a = [gpu("node-a-gpu0"), gpu("node-a-gpu1", mig="Disabled"), gpu("node-b-gpu0", mig="Disabled")]
    d = decide(node_a, [claim("big", count=2)], pol)
    assert [(s.gpu, s.claim) for s in d.switches] == [("node-a-gpu0", "ml/big")]
    assert sorted((k.gpu, k.claim, k.claim_uid) for k in d.keeps) == [
        ("node-a-gpu0", "ml/big", "c-big"),
        ("node-a-gpu1", "ml/big", "c-big"),
    ]
    hold = d.keeps[0].hold(NOW)
    assert (hold.kind.value, hold.profile, hold.start, hold.whole) == ("Whole", "whole", 0, True)
    assert hold.expires() - NOW == pytest.approx(WHOLE_HOLD_SECONDS)

    # The next round: gpu0 switching for big, both kept for it: nothing more is written.
    asked = {MIG_MODE_REQUESTED_ANNOTATION: "Disabled", MIG_MODE_FOR_ANNOTATION: "ml/big",
             MIG_MODE_WRITTEN_ANNOTATION: stamp(NOW - 1)}  # fmt: skip
    switching = _kept_for(gpu("node-a-gpu0", ask="Disabled", annotations=asked), "ml/big")
    kept = _kept_for(gpu("node-a-gpu1", mig="Disabled"), "ml/big")
    d = decide([switching, kept, gpu("node-b-gpu0", mig="Disabled")], [claim("big", count=2)], pol)
    assert d.switches == () and d.keeps == ()
    # A claim of one whole GPU arriving now gets node-b's free GPU, never node-a's kept one, and no hold.
    d = decide(
        [switching, kept, gpu("node-b-gpu0", mig="Disabled")],
        [claim("big", count=2, minute=1), claim("one", minute=2)],
        pol,
    )
    assert d.switches == () and d.keeps == ()
    # With node-b busy, "one" gets a MIG GPU switched for it, not the GPU kept for big.
    busy_b = gpu("node-b-gpu0", mig="Disabled", whole="allocated")
    d = decide(
        [switching, kept, busy_b, gpu("node-c-gpu0")],
        [claim("big", count=2, minute=1), claim("one", minute=2)],
        pol,
    )
    assert [(s.gpu, s.claim) for s in d.switches] == [("node-c-gpu0", "ml/one")]
    assert [(k.gpu, k.claim) for k in d.keeps] == [("node-c-gpu0", "ml/one")]
    # A whole GPU kept for a waiting claim is not switched back on for MIG claims.
    d = decide([kept], [claim("big", count=2, minute=1), slice_claim("small", minute=2)], pol)
    assert d.switches == ()
    verdict = next(v for v in d.verdicts if v.claim.claim.name == "small")
    assert "a pending claim of whole GPUs could take it" in verdict.message, verdict.message
    # Kept for a claim that no longer waits (allocated or gone; the hold is released later in the round):
    # nothing kept, it is switched on.
    d = decide([kept], [slice_claim("small")], pol)
    assert [(s.gpu, s.to.value) for s in d.switches] == [("node-a-gpu1", "Enabled")]


def test_a_claim_of_several_whole_gpus_keeps_the_gpus_it_lacks_on_its_node_while_one_switches() -> None:
    """Under a floor of MIG GPUs that lets one GPU switch at a time, a claim of three whole GPUs gets one
    switch a round; the node's other idle GPUs it lacks are kept whole for it from the first round, so MIG
    claims do not take them one by one while it waits; a GPU busy with a MIG workload is not kept."""
    pol = policy({**DYNAMIC, "minMigGpus": 3})
    parts = [gpu(f"node-a-gpu{i}") for i in range(3)] + [gpu("node-a-gpu3", instances=FULL)]
    d = decide(parts, [claim("big", count=3)], pol)
    assert [(s.gpu, s.claim) for s in d.switches] == [("node-a-gpu0", "ml/big")]
    assert sorted((k.gpu, k.claim) for k in d.keeps) == [
        ("node-a-gpu0", "ml/big"),
        ("node-a-gpu1", "ml/big"),
        ("node-a-gpu2", "ml/big"),
    ]
    (v,) = d.verdicts
    assert "node-a-gpu0, node-a-gpu1, node-a-gpu2 kept whole for it" in v.message, v.message

    # The next round: gpu0 switching, gpu1 and gpu2 kept (MIG mode still on): a MIG claim is planned on none
    # of them, nothing more is kept, and the switches go on where the claim is kept once the floor allows
    # (node-b's idle GPU is no choice: the claim needs three on one node).
    asked = {MIG_MODE_REQUESTED_ANNOTATION: "Disabled", MIG_MODE_FOR_ANNOTATION: "ml/big",
             MIG_MODE_WRITTEN_ANNOTATION: stamp(NOW - 1)}  # fmt: skip
    switching = _kept_for(gpu("node-a-gpu0", ask="Disabled", annotations=asked), "ml/big")
    kept = [_kept_for(gpu(f"node-a-gpu{i}"), "ml/big") for i in (1, 2)]
    busy = gpu("node-a-gpu3", instances=FULL)
    d = decide([switching, *kept, busy], [claim("big", count=3), slice_claim("small", minute=1)], pol)
    assert d.switches == () and d.keeps == ()
    small = next(v for v in d.verdicts if v.claim.claim.name == "small")
    assert small.reason is Reason.NO_CAPACITY and "among the 1 GPUs" in small.message, small  # gpu3: full
    assert "node-a-gpu1, node-a-gpu2 kept whole for claims of whole GPUs" in small.message, small.message
    done = gpu("node-a-gpu0", mig="Disabled", ask="Disabled", annotations=asked)
    d = decide([_kept_for(done, "ml/big"), *kept, busy, gpu("node-b-gpu0")], [claim("big", count=3)], pol)
    assert [(s.gpu, s.claim) for s in d.switches] == [("node-a-gpu1", "ml/big")]
    assert d.keeps == ()


def test_a_mig_gpu_kept_whole_is_planned_for_no_mig_claim() -> None:
    """The planner sees no GPU kept whole for a claim of whole GPUs: a MIG claim is cut for elsewhere."""
    kept = _kept_for(gpu("node-a-gpu0", instances=(), layout=[]), "ml/big")
    parts = (kept, gpu("node-b-gpu0", instances=(), layout=[]))
    gpus = parse_inventory(parts, CATALOG)
    pol = parse_policy(policy(DYNAMIC))
    decision = decide_round(RoundInput(pol, (), gpus, pending((slice_claim("infer"),)), NOW, {}, CATALOG))
    assert [w.gpu for w in decision.writes] == ["node-b-gpu0"]
    decision = decide_round(RoundInput(pol, (), gpus[:1], pending((slice_claim("infer"),)), NOW, {}, CATALOG))
    assert decision.writes == ()


def test_an_idle_node_is_kept_for_a_claim_of_several_whole_gpus_whose_switch_must_wait() -> None:
    """With the disruption budget spent elsewhere, nothing is switched for the claim, but the smallest idle
    node that holds it is kept: as many of its GPUs as it asks, held whole, and the claim is told. A node
    with a busy GPU is not idle; a claim of one GPU keeps no node; DryRun keeps nothing."""
    pol = policy(DYNAMIC)
    other = {MIG_MODE_REQUESTED_ANNOTATION: "Disabled", MIG_MODE_FOR_ANNOTATION: "ml/gone",
             MIG_MODE_WRITTEN_ANNOTATION: stamp(NOW - 1)}  # fmt: skip
    budget = gpu("node-z-gpu0", ask="Disabled", annotations=other)  # switching: the budget's one GPU
    small = [gpu("node-a-gpu0"), gpu("node-a-gpu1", instances=FULL), gpu("node-a-gpu2")]
    large = [gpu(f"node-b-gpu{i}") for i in range(4)]
    middle = [gpu(f"node-c-gpu{i}") for i in range(3)]
    d = decide([budget, *small, *large, *middle], [claim("big", count=2)], pol)
    assert d.switches == ()
    assert sorted((k.gpu, k.claim, k.claim_uid) for k in d.keeps) == [
        ("node-c-gpu0", "ml/big", "c-big"),
        ("node-c-gpu1", "ml/big", "c-big"),
    ]
    assert all("node node-c is kept for it until 2 of its GPUs are whole" in k.why for k in d.keeps)
    (v,) = d.verdicts
    assert "disruption budget" in v.message and "kept whole for it" in v.message, v.message
    assert not decide([budget, *small, *large, *middle], [claim("one")], pol).keeps
    dry = policy(DYNAMIC, mode="DryRun")
    assert not decide([budget, *small, *large, *middle], [claim("big", count=2)], dry).keeps


def test_a_node_is_drained_for_a_claim_of_several_whole_gpus_that_waited_long_enough() -> None:
    """migMode.drainNodeAfterSeconds: with no idle node for a claim of two whole GPUs, the node whose two
    least busy GPUs hold the fewest busy compute slices is kept for it though work runs there (nothing new
    is booked on those GPUs; each switches once idle). Not before the claim has waited that long, not when
    unset, not under DryRun, not for one GPU, never on a node with a GPU kept for another claim, and never on
    GPUs whose switch needs a reset the policy does not allow."""
    one = (("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "free"))
    a = [
        gpu("node-a-gpu0", instances=FULL),
        gpu("node-a-gpu1", instances=one),
        gpu("node-a-gpu2", instances=FULL),
    ]
    b = [gpu("node-b-gpu0", instances=FULL), gpu("node-b-gpu1", instances=FULL)]
    c = [_kept_for(gpu("node-c-gpu0", instances=one), "ml/other"), gpu("node-c-gpu1", instances=one)]
    drain = policy({**DYNAMIC, "drainNodeAfterSeconds": 300})
    other = claim("other", count=2, minute=1)  # waiting too, kept on node-c already
    d = decide([*a, *b, *c], [claim("big", count=2), other], drain)
    assert d.switches == ()
    assert sorted((k.gpu, k.claim, k.claim_uid) for k in d.keeps if k.claim == "ml/big") == [
        ("node-a-gpu0", "ml/big", "c-big"),
        ("node-a-gpu1", "ml/big", "c-big"),
    ]
    mine = [k for k in d.keeps if k.claim == "ml/big"]
    assert all("node node-a is drained for it" in k.why and "9 compute slice(s) busy" in k.why for k in mine)
    assert all(k.drain and k.seconds == 3600 for k in mine)  # drainNodeHoldSeconds' default
    assert mine[0].hold(NOW).expires() == NOW + 3600
    # once per claim: a claim drained for before (by this operator) is not drained again
    p = parse_policy(drain)
    gpus = parse_inventory([*a, *b, *c], CATALOG)
    round_ = decide_round(RoundInput(p, (), gpus, pending([claim("big", count=2), other]), NOW, {}, CATALOG))
    again = decide_modes(ModeInput(p, gpus, round_, NOW, {"ml/big": NOW - 3600}))
    assert not [k for k in again.keeps if k.claim == "ml/big"]
    v = next(v for v in d.verdicts if v.claim.claim.key == "ml/big")
    assert "kept whole for it" in v.message, v.message
    # the same cluster without the setting, or with the claim younger than it, or DryRun: nothing kept
    assert not decide([*a, *b, *c], [claim("big", count=2)], policy(DYNAMIC)).keeps
    young, pod = claim("big", count=2)
    young["metadata"]["creationTimestamp"] = stamp(NOW - 299)
    assert not decide([*a, *b, *c], [(young, pod)], drain).keeps
    young["metadata"]["creationTimestamp"] = stamp(NOW - 301)
    assert len(decide([*a, *b, *c], [(young, pod)], drain).keeps) == 2
    assert not decide(
        [*a, *b, *c], [claim("big", count=2)], {**drain, "spec": {**drain["spec"], "mode": "DryRun"}}
    ).keeps
    assert not decide([*a, *b, *c], [claim("one")], drain).keeps
    # an idle node goes first, as without the setting: switched for it (and kept), no node drained
    idle = [gpu("node-d-gpu0"), gpu("node-d-gpu1")]
    d = decide([*a, *b, *c, *idle], [claim("big", count=2)], drain)
    assert {k.gpu for k in d.keeps} == {s.gpu for s in d.switches} == {"node-d-gpu0", "node-d-gpu1"}
    # A100s switch only through a reset: drained only where the policy allows it
    a100 = [gpu(f"node-e-gpu{i}", "A100-80GB", instances=one) for i in range(2)]
    assert not decide(a100, [claim("big", count=2)], drain).keeps
    reset = policy({**DYNAMIC, "drainNodeAfterSeconds": 300, "allowReset": True})
    assert len(decide(a100, [claim("big", count=2)], reset).keeps) == 2
    # nor where the platform refused the reset: on that GPU, and (the platform is the node's) beside it
    vm = {MIG_MODE_RESET_ANNOTATION: "Disabled"}
    stuck = [
        gpu("node-e-gpu0", "A100-80GB", instances=one, annotations=vm),
        *(gpu(f"node-e-gpu{i}", "A100-80GB", instances=one) for i in (1, 2)),
    ]
    assert not decide(stuck, [claim("big", count=2)], reset).keeps


def test_gpus_kept_for_a_claim_switched_for_on_another_node_are_released() -> None:
    """A claim of two whole GPUs kept on node-c, where one GPU became busy, gets its switches on node-d,
    which completes it: node-c's holds are released in the same round (not left for their 15 minutes),
    and node-d's GPUs are kept for it instead."""
    pol = policy(DYNAMIC, disruptionBudget={"maxGpusReshaping": 4})
    kept = [_kept_for(gpu("node-c-gpu0"), "ml/big"), _kept_for(gpu("node-c-gpu1", instances=FULL), "ml/big")]
    other = [gpu("node-d-gpu0"), gpu("node-d-gpu1")]
    d = decide([*kept, *other], [claim("big", count=2)], pol)
    on_d = [("node-d-gpu0", "ml/big"), ("node-d-gpu1", "ml/big")]
    assert sorted((s.gpu, s.claim) for s in d.switches) == on_d
    assert sorted((k.gpu, k.claim) for k in d.keeps) == on_d
    assert sorted((x.gpu, x.claim, x.node) for x in d.releases) == [
        ("node-c-gpu0", "ml/big", "node-d"),
        ("node-c-gpu1", "ml/big", "node-d"),
    ]
    assert d.releases[0].why == "claim ml/big is kept on node node-d now"
    # Where the kept node can still complete it, nothing is released: the switch goes there.
    d = decide([_kept_for(gpu("node-c-gpu0"), "ml/big"), _kept_for(gpu("node-c-gpu1"), "ml/big"), *other],
               [claim("big", count=2)], pol)  # fmt: skip
    assert {s.gpu for s in d.switches} == {"node-c-gpu0", "node-c-gpu1"}
    assert d.releases == ()


async def test_a_round_takes_out_the_holds_of_a_claim_kept_on_another_node_now() -> None:
    """The round writes node-c's holds without the claim's whole hold (another hold there stays), tells
    each GPU why (WholeGpuReleased) and counts the releases as moved."""
    c, p = claim("big", count=2)
    drain = {"claim": "ml/other", "kind": "Drain", "profile": "3g.40gb", "start": 4,
             "expiresAt": "2099-01-01T00:00:00Z"}  # fmt: skip
    kept = [_kept_for(gpu("node-c-gpu0"), "ml/big"), _kept_for(gpu("node-c-gpu1", instances=FULL), "ml/big")]
    kept[0]["spec"]["holds"].append(drain)
    snap = Snapshot(
        policies=(policy(DYNAMIC, disruptionBudget={"maxGpusReshaping": 4}),),
        partitions=(*kept, gpu("node-d-gpu0"), gpu("node-d-gpu1")),
        nodes=tuple(
            {"metadata": {"name": n, "labels": {"kubernetes.io/hostname": n}}} for n in ("node-c", "node-d")
        ),
        pods=(p,),
        claims=(c,),
        device_classes=(DRIVER_CLASS,),
    )
    metrics = OperatorMetrics()
    kube = FakeKube(snap)
    rec = Reconciler(cast(KubeIO, kube), CATALOG, metrics, OperatorSettings())
    await rec.round("fleet")
    holds = {name: spec["holds"] for name, spec, _ in kube.writes if "holds" in spec}
    assert holds["node-c-gpu0"] == [drain] and holds["node-c-gpu1"] == []
    assert [h["claim"] for h in holds["node-d-gpu0"]] == ["ml/big"]
    told = sorted(e[0]["name"] for e in kube.events if e[2] == "WholeGpuReleased")
    assert told == ["node-c-gpu0", "node-c-gpu1"]
    assert "kept on node node-d now" in next(e[3] for e in kube.events if e[2] == "WholeGpuReleased")
    released = "dynamig_operator_preemption_holds_released_total"
    assert metrics.registry.get_sample_value(released, {"policy": "fleet", "why": "moved"}) == 2


def test_drained_claims_round_trip_skip_what_does_not_parse_and_keep_the_newest() -> None:
    stored = drained_claims({"ml/b": 1_800_000_060.0, "ml/a": 1_800_000_000.0})
    assert stored == [
        {"claim": "ml/a", "time": "2027-01-15T08:00:00Z"},
        {"claim": "ml/b", "time": "2027-01-15T08:01:00Z"},
    ]
    assert read_drained_claims(stored) == {"ml/a": 1_800_000_000.0, "ml/b": 1_800_000_060.0}
    junk = [{"claim": "ml/c"}, {"time": "2027-01-15T08:00:00Z"}, {"claim": 7, "time": "x"}, "ml/d"]
    assert read_drained_claims([*junk, stored[0]]) == {"ml/a": 1_800_000_000.0}
    assert read_drained_claims(None) == {} and read_drained_claims({"claim": "ml/a"}) == {}
    many = drained_claims({f"ml/c{i}": 1_800_000_000.0 + i for i in range(MAX_DRAINED_CLAIMS + 5)})
    assert len(many) == MAX_DRAINED_CLAIMS and many[0]["claim"] == "ml/c5"


class _ConflictingKube(FakeKube):
    """FakeKube whose spec writes are answered 409 Conflict while ``fail`` is set."""

    def __init__(self, snap: Snapshot) -> None:
        super().__init__(snap)
        self.fail, self.conflicts = True, 0

    async def write_spec(self, name: str, spec: Any, annotations: Any, rv: str) -> dict[str, Any]:
        if self.fail:
            self.conflicts += 1
            raise ApiException(status=409, reason="Conflict")
        return await super().write_spec(name, spec, annotations, rv)


async def test_a_round_drains_a_node_once_per_claim() -> None:
    """drainNodeAfterSeconds through a reconciler round: the drained GPUs' whole holds are written to last
    drainNodeHoldSeconds, each GPU is told why (WholeGpuKept), and once those holds are gone (expired) while
    the claim still waits, the next round drains nothing for it again."""
    c, p = claim("big", count=2)
    one = (("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "free"))
    busy = (gpu("node-a-gpu0", instances=FULL), gpu("node-a-gpu1", instances=one))
    snap = Snapshot(
        policies=(policy({**DYNAMIC, "drainNodeAfterSeconds": 300, "drainNodeHoldSeconds": 1200}),),
        partitions=busy,
        nodes=({"metadata": {"name": "node-a", "labels": {"kubernetes.io/hostname": "node-a"}}},),
        pods=(p,),
        claims=(c,),
        device_classes=(DRIVER_CLASS,),
    )
    kube = _ConflictingKube(snap)
    rec = Reconciler(cast(KubeIO, kube), CATALOG, OperatorMetrics(), OperatorSettings())
    await rec.round("fleet")  # the holds' writes answered 409: not drained yet, so not remembered
    assert kube.conflicts and not [e for e in kube.events if e[2] == "WholeGpuKept"]
    kube.conflicts = 0
    kube.fail = False
    before = time.time()
    await rec.round("fleet")
    holds = {name: spec["holds"] for name, spec, _ in kube.writes if "holds" in spec}
    assert sorted(holds) == ["node-a-gpu0", "node-a-gpu1"]
    for (h,) in holds.values():
        assert h["claim"] == "ml/big" and h["kind"] == "Whole"
        lasts = parse_time(h["expiresAt"]) - parse_time(h["createdAt"])  # type: ignore[operator]
        assert lasts == pytest.approx(1200, abs=1)
        assert parse_time(h["createdAt"]) >= before - 1  # type: ignore[operator]
    kept = [e for e in kube.events if e[2] == "WholeGpuKept"]
    assert len(kept) == 2 and all("node node-a is drained for it for up to 1200s" in e[3] for e in kept)
    # the holds expired (the snapshot has none), the claim still waits: not drained again
    kube.writes.clear()
    await rec.round("fleet")
    assert not [spec for _, spec, _ in kube.writes if spec.get("holds")]
    # the drain is in the policy's status, and a new operator process (a restart, a new leader) reads it
    # back: it does not drain the claim again either
    assert kube.statuses[0][1]["drainedClaims"] == []  # the round answered 409 stored nothing
    (entry,) = kube.statuses[-1][1]["drainedClaims"]
    assert entry["claim"] == "ml/big" and parse_time(entry["time"]) >= before - 1  # type: ignore[operator]
    raw = {**snap.policies[0], "status": {"drainedClaims": [entry]}}
    again = _ConflictingKube(replace(snap, policies=(raw,)))
    again.fail = False
    restarted = Reconciler(cast(KubeIO, again), CATALOG, OperatorMetrics(), OperatorSettings())
    await restarted.round("fleet")
    assert not [spec for _, spec, _ in again.writes if spec.get("holds")]
    assert again.statuses[-1][1]["drainedClaims"] == [entry]  # still waiting: kept
    # without it in the status, a new process would drain the node for the claim a second time
    fresh = _ConflictingKube(snap)
    fresh.fail = False
    await Reconciler(cast(KubeIO, fresh), CATALOG, OperatorMetrics(), OperatorSettings()).round("fleet")
    assert sorted(n for n, spec, _ in fresh.writes if spec.get("holds")) == ["node-a-gpu0", "node-a-gpu1"]
