"""Typed model of the ``GpuPartitionPolicy`` custom resource and the rules around it. Pure: no I/O.

Raw API dicts are parsed once with :func:`parse_policy`. What the API server cannot check (CEL there has no
MIG geometry) is checked here by :func:`check_spec_against_catalog`: unknown GPU products, profiles a governed
model does not have, and baseline layouts a model cannot hold. Each problem names the spec field.

Overlapping policies: every GPU is governed by at most one policy. :func:`resolve_ownership` gives a GPU to
the oldest matching policy (``creationTimestamp``), ties broken by name; the other matching policies list the
GPU as lost, with the winner's name, in their status.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.layout import free_starts
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, normalize_layout
from dynamig.kube.gpupartition import XidEffect
from dynamig.planner.model import Policy, Strategy

log = logging.getLogger(__name__)


class Mode(StrEnum):
    DYNAMIC = "Dynamic"  # reshape GPUs to serve pending demand
    STATIC = "Static"  # never reshape; only report why claims are pending
    DRY_RUN = "DryRun"  # plan and report what would be done, change nothing


class PreemptionMode(StrEnum):
    OFF = "Off"  # nothing is preempted
    DRY_RUN = "DryRun"  # report which pods would be evicted for each waiting claim; evict none
    EVICT = "Evict"  # evict them through the Eviction API and hold the freed placement for the claim


class MigModeKind(StrEnum):
    FIXED = "Fixed"  # the operator never changes a GPU's MIG mode
    DYNAMIC = "Dynamic"  # it switches idle GPUs between MIG and whole as pending claims need


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class LabelSelectorRequirement(_Model):
    key: str
    operator: str
    values: list[str] = Field(default_factory=list)

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Kubernetes label-selector semantics for one requirement. Pure."""
        if self.operator == "In":
            return labels.get(self.key) in self.values
        if self.operator == "NotIn":
            return labels.get(self.key) not in self.values
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        return False


class LabelSelector(_Model):
    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)

    def matches(self, labels: Mapping[str, str]) -> bool:
        """True when every label and expression matches; an empty selector matches everything. Pure."""
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        return all(r.matches(labels) for r in self.match_expressions)


class BaselineEntry(_Model):
    profile: str
    start: int = Field(ge=0)


class DisruptionBudget(_Model):
    max_gpus_reshaping: int = Field(default=1, ge=1)


class Preemption(_Model):
    """``spec.preemption``: whether a claim no re-cut can serve may have lower-priority pods evicted for it
    (``Evict``), or only be told which (``DryRun``)."""

    mode: PreemptionMode = PreemptionMode.OFF
    priority_gap: int = Field(default=1, ge=1, le=1_000_000_000)  # victims at most preemptor minus this
    min_run_seconds: int = Field(default=300, ge=0, le=604_800)  # a pod younger than this is no victim
    spare_kueue_workloads: bool = True  # pods Kueue manages are left to Kueue
    # Evict: at most this many pods evicted by the policy in any hour; a GPU gets no new hold this long after
    # its last; the freed placement is kept for the waiting claim this long at most; an owner (or a pod
    # without one) evicted this many times within the hour is spared from then on.
    max_evictions_per_hour: int = Field(default=60, ge=1, le=100_000)
    gpu_cooldown_seconds: int = Field(default=300, ge=0, le=86_400)
    hold_seconds: int = Field(default=600, ge=30, le=86_400)
    spare_after_evictions: int = Field(default=2, ge=1, le=100)
    # Evict: at most this many pods of one namespace evicted in any hour (None: the policy's limit alone).
    max_evictions_per_hour_per_namespace: int | None = Field(default=None, ge=1, le=100_000)
    # Which namespaces take part: only their waiting pods preempt and only their pods are victims (None:
    # every namespace).
    namespace_selector: LabelSelector | None = None


class Drain(_Model):
    """``spec.drain``: a claim waiting longer than ``afterSeconds`` for a profile that no GPU can cut now (its
    slices busy everywhere, at any priority) gets one GPU drained for it: the placement is kept, no new
    booking goes over it, and the claim gets it once the instances running there end. Nobody is evicted."""

    after_seconds: int | None = Field(default=None, ge=0, le=604_800)  # None: no drain
    hold_seconds: int = Field(default=3600, ge=30, le=604_800)  # a drain ends after this, served or not
    max_gpus: int = Field(default=1, ge=1, le=10_000)  # GPUs of the policy draining at once


class WithoutMig(StrEnum):
    IGNORE = "Ignore"  # GPUs whose model has no MIG (an L4, a T4) are left alone
    WHOLE = "Whole"  # they are governed and served whole (GpuPartition spec.migMode: Disabled)


class MigModeSpec(_Model):
    """``spec.migMode``: whether the operator may switch a governed GPU's MIG mode (``GpuPartition``
    ``spec.migMode``) for pending claims: an idle MIG GPU off for a claim of whole GPUs, a free whole GPU on
    for MIG claims nothing else can place (``dynamig.operator.modes``)."""

    policy: MigModeKind = MigModeKind.FIXED
    # Models whose switch resets the GPU (Ampere: dynamig.geometry.generation) are switched only when true.
    allow_reset: bool = False
    # Floors: governed GPUs kept in each mode (no switch takes the count below them; none is made by them).
    min_mig_gpus: int = Field(default=0, ge=0, le=100_000)
    min_whole_gpus: int = Field(default=0, ge=0, le=100_000)
    # A GPU switched is not switched again for this long (no ping-pong).
    cooldown_seconds: int = Field(default=600, ge=0, le=604_800)
    # GPUs whose model has no MIG: left alone, or governed and served whole (never as MIG).
    gpus_without_mig: WithoutMig = WithoutMig.IGNORE
    # Idle MIG GPUs also offer their whole device beside their slices (GpuPartition spec.offerWhole): the
    # scheduler books it and the agent switches MIG off for that booking (dynamig.operator.whole_offers).
    offer_whole: bool = False
    # A claim of several whole GPUs that no idle node serves and that waited this long gets a node drained:
    # as many of its GPUs as it asks kept whole for it though busy (operator/whole_keeps.py). None: never.
    drain_node_after_seconds: int | None = Field(default=None, ge=0, le=604_800)
    # How long a drained node is kept for its claim; a claim is drained once (by one operator process).
    drain_node_hold_seconds: int = Field(default=3600, ge=60, le=604_800)

    @property
    def dynamic(self) -> bool:
        return self.policy is MigModeKind.DYNAMIC


class HealthSpec(_Model):
    """``spec.health``: how the node agents of the policy's GPUs show a critical XID to the scheduler."""

    # The taint effect on the affected devices (GpuPartition spec.xidEffect); None: each agent's --xid-effect.
    xid_effect: XidEffect | None = None


class PolicySpec(_Model):
    node_selector: LabelSelector = Field(default_factory=LabelSelector)
    gpu_products: list[str] = Field(default_factory=list)
    mode: Mode = Mode.DYNAMIC
    allowed_profiles: list[str] | None = None
    baseline: dict[str, list[BaselineEntry]] = Field(default_factory=dict)
    warm_pool: dict[str, int] = Field(default_factory=dict)
    strategy: Strategy = Strategy.PACK
    batch_window_seconds: int = Field(default=2, ge=0)
    cooldown_seconds: int = Field(default=300, ge=0)
    disruption_budget: DisruptionBudget = Field(default_factory=DisruptionBudget)
    preemption: Preemption = Field(default_factory=Preemption)
    drain: Drain = Field(default_factory=Drain)
    mig_mode: MigModeSpec = Field(default_factory=MigModeSpec)
    health: HealthSpec = Field(default_factory=HealthSpec)

    def baseline_layout(self, model_key: str) -> Layout | None:
        entries = self.baseline.get(model_key)
        if entries is None:
            return None
        return normalize_layout([PlacedInstance(e.start, e.profile) for e in entries])

    def to_planner(self) -> Policy:
        """The planner's view of this policy. Pure."""
        return Policy(
            allowed_profiles=frozenset(self.allowed_profiles) if self.allowed_profiles is not None else None,
            warm_pool=dict(self.warm_pool),
            baseline={k: v for k in self.baseline if (v := self.baseline_layout(k)) is not None},
            max_gpus_reshaped=self.disruption_budget.max_gpus_reshaping,
            strategy=self.strategy,
        )

    def governs_model(self, model: GpuModel) -> bool:
        """Whether ``gpuProducts`` includes this model (by catalog key or one of its product names). Pure."""
        if not self.gpu_products:
            return True
        wanted = {_norm(p) for p in self.gpu_products}
        return _norm(model.key) in wanted or any(_norm(n) in wanted for n in model.product_names)


def _norm(name: str) -> str:
    return " ".join(name.split()).lower().removeprefix("nvidia ")


class PolicyMeta(_Model):
    name: str
    uid: str = ""
    generation: int = 0
    resource_version: str = ""
    creation_timestamp: str = ""


class GpuPartitionPolicy(_Model):
    metadata: PolicyMeta
    spec: PolicySpec = Field(default_factory=PolicySpec)

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def precedence(self) -> tuple[str, str]:
        """Sort key for overlapping policies: oldest first, then by name."""
        return (self.metadata.creation_timestamp, self.metadata.name)


def parse_policy(obj: Mapping[str, Any]) -> GpuPartitionPolicy:
    """Parse a GpuPartitionPolicy as the API returns it. pydantic.ValidationError if it is malformed."""
    data = dict(obj)
    if data.get("spec") is None:
        data["spec"] = {}
    return GpuPartitionPolicy.model_validate(data)


def parse_policies(objs: Iterable[Mapping[str, Any]]) -> tuple[GpuPartitionPolicy, ...]:
    """Every well-formed policy of ``objs``; a malformed one is logged and left out (the operator's rounds
    report it on the policy)."""
    out: list[GpuPartitionPolicy] = []
    for raw in objs:
        try:
            out.append(parse_policy(raw))
        except ValidationError as exc:
            log.warning("skipping malformed policy %s: %s", (raw.get("metadata") or {}).get("name"), exc)
    return tuple(out)


# ------------------------------------------------------------------------------------------ catalog checks


@dataclass(frozen=True, slots=True)
class SpecProblem:
    """One thing wrong with a spec that the API server could not see. ``field`` is the JSON path."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def governed_models(spec: PolicySpec, catalog: Catalog) -> tuple[GpuModel, ...]:
    """Catalog models the policy's ``gpuProducts`` covers (all models when it is empty). Pure."""
    return tuple(m for m in catalog.models() if spec.governs_model(m))


def check_layout_fits(model: GpuModel, layout: Layout) -> str | None:
    """Why ``layout`` cannot exist on ``model`` (unknown profile, start not allowed, overlap, over the
    per-profile cap), or None if it can. Pure."""
    used = 0
    counts: dict[str, int] = {}
    for inst in layout:
        if not model.has_profile(inst.profile):
            return f"{model.key} has no MIG profile {inst.profile}"
        profile = model.profile(inst.profile)
        if inst.start not in profile.placement_starts:
            starts = ", ".join(str(s) for s in profile.placement_starts)
            return (
                f"{inst.profile} cannot start at slice {inst.start} on {model.key} (allowed starts: {starts})"
            )
        mask = ((1 << profile.placement_size) - 1) << inst.start
        if used & mask:
            return f"{inst.profile}@{inst.start} overlaps another instance on {model.key}"
        used |= mask
        counts[inst.profile] = counts.get(inst.profile, 0) + 1
        if counts[inst.profile] > profile.max_instances:
            return f"{model.key} holds at most {profile.max_instances} x {inst.profile}"
    compute = sum(model.profile(i.profile).compute_slices for i in layout)
    if compute > model.compute_slices:
        return f"the layout needs {compute} compute slices, {model.key} has {model.compute_slices}"
    return None


def check_spec_against_catalog(spec: PolicySpec, catalog: Catalog) -> list[SpecProblem]:
    """Everything wrong with ``spec`` that needs the MIG geometry tables; empty when valid. Pure."""
    problems: list[SpecProblem] = []
    known_products = {_norm(m.key) for m in catalog.models()} | {
        _norm(n) for m in catalog.models() for n in m.product_names
    }
    for i, product in enumerate(spec.gpu_products):
        if _norm(product) not in known_products:
            problems.append(
                SpecProblem(
                    f"spec.gpuProducts[{i}]", f"{product!r} is neither a catalog key nor a known product"
                )
            )
    models = governed_models(spec, catalog)
    all_profiles = {p.name for m in models for p in m.profiles}
    for i, name in enumerate(spec.allowed_profiles or []):
        if name not in all_profiles:
            problems.append(
                SpecProblem(f"spec.allowedProfiles[{i}]", f"no governed GPU model has MIG profile {name}")
            )
    for name in spec.warm_pool:
        if name not in all_profiles:
            problems.append(
                SpecProblem(f"spec.warmPool[{name}]", f"no governed GPU model has MIG profile {name}")
            )
    for key in spec.baseline:
        field_name = f"spec.baseline[{key}]"
        if key not in catalog:
            problems.append(
                SpecProblem(field_name, f"unknown GPU model (catalog keys: {', '.join(catalog.keys())})")
            )
            continue
        layout = spec.baseline_layout(key) or ()
        why = check_layout_fits(catalog.model(key), layout)
        if why is not None:
            problems.append(SpecProblem(field_name, why))
    return problems


def warm_pool_shortfall(spec: PolicySpec, models: Sequence[GpuModel]) -> str | None:
    """Why the warm pool cannot be kept on the governed GPUs (one model per GPU), each at its baseline, or
    None when it fits. Instances go into free slices beside the baseline, as the planner keeps them. Pure."""
    layouts = [list(spec.baseline_layout(m.key) or ()) for m in models]
    short: list[str] = []
    for name in sorted(spec.warm_pool):
        want = spec.warm_pool[name]
        placed = sum(1 for layout in layouts for i in layout if i.profile == name)  # the planner counts these
        for model, layout in zip(models, layouts, strict=True):
            while placed < want and model.has_profile(name):
                starts = free_starts(model, layout, name)
                if not starts:
                    break
                layout.append(PlacedInstance(starts[0], name))
                placed += 1
        if placed < want:
            short.append(f"{want}x {name} asked, {placed} fit")
    if not short:
        return None
    return (
        f"spec.warmPool does not fit the {len(models)} governed GPU(s) beside their baselines: "
        f"{'; '.join(short)}"
    )


# ---------------------------------------------------------------------------------- overlapping policies


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """What policy matching looks at for one GPU: its GpuPartition name, node labels and catalog model."""

    name: str
    node: str
    node_labels: Mapping[str, str]
    model: GpuModel | None
    product: str = ""  # NVML's product name (what matches a GPU without a catalog model)


@dataclass(frozen=True, slots=True)
class Ownership:
    """GPU name -> governing policy name, and for each policy the GPUs it matched but lost (-> winner)."""

    owner: Mapping[str, str]
    lost: Mapping[str, Mapping[str, str]]

    def governed_by(self, policy: str) -> tuple[str, ...]:
        return tuple(sorted(g for g, p in self.owner.items() if p == policy))


def policy_matches(policy: GpuPartitionPolicy, gpu: GpuIdentity) -> bool:
    """Whether ``policy`` selects ``gpu`` (node labels and product). A GPU without a catalog model (no MIG: an
    L4) only under ``migMode.gpusWithoutMig: Whole``, by product name where ``gpuProducts`` is set. Pure."""
    if not policy.spec.node_selector.matches(gpu.node_labels):
        return False
    if gpu.model is None:
        spec = policy.spec
        if spec.mig_mode.gpus_without_mig is not WithoutMig.WHOLE or not gpu.product:
            return False
        return not spec.gpu_products or _norm(gpu.product) in {_norm(p) for p in spec.gpu_products}
    return policy.spec.governs_model(gpu.model)


def resolve_ownership(policies: Sequence[GpuPartitionPolicy], gpus: Iterable[GpuIdentity]) -> Ownership:
    """Give each GPU to the oldest matching policy (then by name). Pure and deterministic."""
    ordered = sorted(policies, key=lambda p: p.precedence)
    owner: dict[str, str] = {}
    lost: dict[str, dict[str, str]] = {p.name: {} for p in ordered}
    for gpu in gpus:
        matching = [p for p in ordered if policy_matches(p, gpu)]
        if not matching:
            continue
        owner[gpu.name] = matching[0].name
        for loser in matching[1:]:
            lost[loser.name][gpu.name] = matching[0].name
    return Ownership(owner=owner, lost=lost)
