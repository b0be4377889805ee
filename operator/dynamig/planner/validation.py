"""What the planner refuses before planning: unknown models or profiles, current layouts that break the
geometry, duplicate names, a baseline that is not a valid layout; each refused with one precise line
(``PlanInputError``). Pure."""

from __future__ import annotations

from collections.abc import Sequence

from dynamig.geometry.layout import LayoutViolation, check_layout
from dynamig.geometry.model import PlacedInstance, normalize_layout
from dynamig.planner._geo import GeoCache
from dynamig.planner.model import (
    ClaimDemand,
    GpuState,
    Policy,
)


class PlanInputError(ValueError):
    """The planner's input breaks a rule (unknown model/profile, invalid current layout, duplicate names)."""


def fmt_instance(inst: PlacedInstance) -> str:
    return f"{inst.profile}@{inst.start}"


def validate_inputs(
    gpus: Sequence[GpuState], claims: Sequence[ClaimDemand], policy: Policy, geo: GeoCache
) -> None:
    """Raise ``PlanInputError`` with one precise line if the input is unusable. Pure."""
    seen: set[tuple[str, int]] = set()
    for gpu in gpus:
        label = f"{gpu.node}-gpu{gpu.index}"
        if (gpu.node, gpu.index) in seen:
            raise PlanInputError(f"gpu {label}: listed twice")
        seen.add((gpu.node, gpu.index))
        try:
            model = geo.model(gpu.model)
        except KeyError as exc:
            raise PlanInputError(f"gpu {label}: {exc.args[0]}") from None
        for current in gpu.instances:
            if not model.has_profile(current.profile):
                raise PlanInputError(
                    f"gpu {label}: instance {current.profile}@{current.start}: unknown-profile: "
                    f"{model.key} has no MIG profile {current.profile!r}"
                )
        layout = normalize_layout([i.placed for i in gpu.instances])
        violation = check_layout(model, layout)
        if violation is not None:
            raise PlanInputError(f"gpu {label}: {violation_line(violation)}")
    names: set[str] = set()
    for claim in claims:
        if claim.name in names:
            raise PlanInputError(f"claim {claim.name}: listed twice")
        names.add(claim.name)
        if claim.count < 1 or any(n < 1 for n in claim.alt_counts):
            raise PlanInputError(f"claim {claim.name}: count must be at least 1, got {claim.count}")
        if not claim.alternatives:
            raise PlanInputError(f"claim {claim.name}: no profile alternatives")
        if claim.alt_counts and len(claim.alt_counts) != len(claim.alternatives):
            raise PlanInputError(f"claim {claim.name}: one count per alternative, got {claim.alt_counts}")
    for key in sorted(policy.baseline):
        try:
            model = geo.model(key)
        except KeyError as exc:
            raise PlanInputError(f"baseline {key}: {exc.args[0]}") from None
        base = normalize_layout(list(policy.baseline[key]))
        for inst in base:
            if not model.has_profile(inst.profile):
                raise PlanInputError(
                    f"baseline {key}: instance {fmt_instance(inst)}: unknown-profile: "
                    f"{key} has no MIG profile {inst.profile!r}"
                )
        violation = check_layout(model, base)
        if violation is not None:
            raise PlanInputError(f"baseline {key}: {violation_line(violation)}")


def violation_line(violation: LayoutViolation) -> str:
    """``instance <profile>@<start>: <rule>: <message>`` for a layout violation. Pure."""
    message = violation.message
    if violation.instance is None:
        return f"{violation.rule}: {message}"
    where = fmt_instance(violation.instance)
    message = message.removeprefix(f"{where}: ")
    return f"instance {where}: {violation.rule}: {message}"
