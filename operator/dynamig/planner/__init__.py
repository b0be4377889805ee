"""Layout planner: a pure, deterministic function from (GPUs, pending claims, policy) to a plan.

``plan`` is the entry point; ``exhaustive.best_plan`` is the reference search used to measure its quality.
"""

from dynamig.planner.core import plan
from dynamig.planner.model import (
    Assignment,
    ClaimDemand,
    CurrentInstance,
    GpuKey,
    GpuPlan,
    GpuState,
    PlanResult,
    Policy,
    Strategy,
)
from dynamig.planner.validation import PlanInputError

__all__ = [
    "Assignment",
    "ClaimDemand",
    "CurrentInstance",
    "GpuKey",
    "GpuPlan",
    "GpuState",
    "PlanInputError",
    "PlanResult",
    "Policy",
    "Strategy",
    "plan",
]
