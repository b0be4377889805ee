"""Planning scenarios as data: the ``dynamig plan -f scenario.yaml`` format, parsed and checked.

A scenario is the planner's input written by hand::

    gpus:
    - {node: node-a, index: 0, model: A100-80GB,
       instances: [{profile: 3g.40gb, start: 0, busy: true}, {profile: 3g.40gb, start: 4}]}
    claims:
    - {name: infer-1, count: 1, alternatives: [1g.10gb, 2g.20gb], nodes: [node-a]}
    policy: {allowedProfiles: [1g.10gb, 2g.20gb], warmPool: {1g.10gb: 1},
             baseline: {A100-80GB: [{profile: 7g.80gb, start: 0}]}, maxGpusReshaped: 2, strategy: pack}

``parse_scenario`` takes the already-loaded document (no file I/O here) and either returns planner inputs or
raises ``ScenarioError`` with one line that names the offending GPU/claim, the instance and the broken rule.
Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.model import PlacedInstance, normalize_layout
from dynamig.planner._geo import GeoCache
from dynamig.planner.model import ClaimDemand, CurrentInstance, GpuState, Policy, Strategy
from dynamig.planner.validation import PlanInputError, validate_inputs


class ScenarioError(ValueError):
    """The scenario cannot be planned; ``str()`` is one line naming what and where."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class InstanceSpec(_Strict):
    profile: str = Field(min_length=1)
    start: int = Field(ge=0)
    busy: bool = False


class GpuSpec(_Strict):
    node: str = Field(min_length=1)
    index: int = Field(ge=0)
    model: str = Field(min_length=1)
    instances: list[InstanceSpec] = Field(default_factory=list)


class ClaimSpec(_Strict):
    name: str = Field(min_length=1)
    count: int = Field(default=1, ge=1)
    alternatives: list[str] = Field(min_length=1)
    nodes: list[str] | None = None


class PlacementSpec(_Strict):
    profile: str = Field(min_length=1)
    start: int = Field(ge=0)


class PolicySpec(_Strict):
    allowed_profiles: list[str] | None = Field(default=None, alias="allowedProfiles")
    warm_pool: dict[str, int] = Field(default_factory=dict, alias="warmPool")
    baseline: dict[str, list[PlacementSpec]] = Field(default_factory=dict)
    max_gpus_reshaped: int | None = Field(default=None, ge=0, alias="maxGpusReshaped")
    strategy: Strategy = Strategy.PACK


class ScenarioSpec(_Strict):
    gpus: list[GpuSpec] = Field(min_length=1)
    claims: list[ClaimSpec] = Field(default_factory=list)
    policy: PolicySpec = Field(default_factory=PolicySpec)


@dataclass(frozen=True, slots=True)
class Scenario:
    gpus: tuple[GpuState, ...]
    claims: tuple[ClaimDemand, ...]
    policy: Policy


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "scenario"
    return f"{where}: {err['msg']}"


def parse_scenario(document: Any, catalog: Catalog) -> Scenario:
    """Check ``document`` (a loaded YAML/JSON value) and turn it into planner inputs. Pure.

    Raises ``ScenarioError`` naming the GPU (``node-gpuN``) or claim, the instance and the rule.
    """
    if not isinstance(document, Mapping):
        raise ScenarioError("scenario: expected a mapping with gpus, claims and policy")
    try:
        spec = ScenarioSpec.model_validate(document)
    except ValidationError as exc:
        raise ScenarioError(_first_error(exc)) from None
    gpus = tuple(
        GpuState(
            g.node, g.index, g.model,
            tuple(CurrentInstance(i.profile, i.start, i.busy) for i in g.instances),
        )
        for g in spec.gpus
    )  # fmt: skip
    claims = tuple(
        ClaimDemand(c.name, tuple(c.alternatives), c.count, None if c.nodes is None else frozenset(c.nodes))
        for c in spec.claims
    )
    p = spec.policy
    policy = Policy(
        allowed_profiles=None if p.allowed_profiles is None else frozenset(p.allowed_profiles),
        warm_pool=dict(p.warm_pool),
        baseline={
            k: normalize_layout([PlacedInstance(i.start, i.profile) for i in v])
            for k, v in p.baseline.items()
        },
        max_gpus_reshaped=p.max_gpus_reshaped,
        strategy=p.strategy,
    )
    geo = GeoCache(catalog)
    try:
        validate_inputs(gpus, claims, policy, geo)
    except PlanInputError as exc:
        raise ScenarioError(str(exc)) from None
    _check_names(gpus, claims, policy, catalog)
    return Scenario(gpus, claims, policy)


def _check_names(
    gpus: tuple[GpuState, ...], claims: tuple[ClaimDemand, ...], policy: Policy, catalog: Catalog
) -> None:
    """Profiles named by claims and policy must exist on some GPU model in the scenario."""
    models = [catalog.model(k) for k in sorted({g.model for g in gpus})]
    known = sorted({p.name for m in models for p in m.profiles})

    def check(name: str, where: str) -> None:
        if not any(m.has_profile(name) for m in models):
            raise ScenarioError(
                f"{where}: unknown-profile: no GPU model in the scenario "
                f"({', '.join(m.key for m in models)}) has MIG profile {name!r} (known: {', '.join(known)})"
            )

    for claim in claims:
        for alt in claim.alternatives:
            check(alt, f"claim {claim.name}: alternative {alt}")
    for name in sorted(policy.allowed_profiles or ()):
        check(name, f"policy.allowedProfiles: {name}")
    for name in sorted(policy.warm_pool):
        check(name, f"policy.warmPool: {name}")
        if policy.warm_pool[name] < 0:
            raise ScenarioError(f"policy.warmPool: {name}: must be at least 0, got {policy.warm_pool[name]}")
