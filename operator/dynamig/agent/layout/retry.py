"""A layout NVML keeps refusing: retried on a back-off, then reported failed with a way out. Pure.

Without this a GPU whose ``spec.layout`` NVML refuses every time (a placement taken by an instance made
outside dynamig, a GPU in an error state) would be retried every round for ever, as Reshaping, and the
operator, which does not rewrite a layout the agent could not apply, would wait on it for ever too.

Each failed attempt (an NVML create or destroy of the plan that failed: the round's ``blocker``) of the same
desired layout doubles the wait before the next one, from :data:`RETRY_BASE_S` up to :data:`RETRY_MAX_S`;
rounds in between touch nothing. After :data:`GIVE_UP_AFTER` failures in a row the GPU is reported
``Degraded`` with Ready=False ``LayoutFailed``, the error and what to do (the operator then plans around the
GPU), and one Warning Event says so; it is still retried every :data:`RETRY_MAX_S`. A success, or another
desired layout, starts over.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamig.agent.publishing.gpu_status import Problem
from dynamig.geometry.model import Layout
from dynamig.kube.gpupartition import Reason

RETRY_BASE_S = 2.0
RETRY_MAX_S = 300.0
GIVE_UP_AFTER = 5

WAY_OUT = (
    "to clear it, remove what makes NVML refuse (`nvidia-smi mig -lgi` shows instances made outside dynamig; "
    "a GPU in an error state needs a reset), or write another spec.layout (tried at once)"
)


@dataclass(frozen=True, slots=True)
class Attempts:
    """The failed attempts in a row at one GPU's desired layout."""

    layout: Layout
    failures: int
    retry_at: float  # clock time before which the layout is not tried again
    since: str  # RFC 3339 time of the first failure
    error: Problem  # the last failure


def backoff(failures: int) -> float:
    """Seconds to wait after ``failures`` failed attempts in a row. Pure."""
    return float(min(RETRY_MAX_S, RETRY_BASE_S * 2.0 ** max(0, failures - 1)))


def current(prev: Attempts | None, desired: Layout) -> Attempts | None:
    """``prev`` if it is about ``desired``; None when the layout changed (it starts over). Pure."""
    return prev if prev is not None and prev.layout == tuple(desired) else None


def holding(att: Attempts | None, now: float) -> bool:
    """True while the layout waits out its back-off (the round must not act on it). Pure."""
    return att is not None and now < att.retry_at


def after_attempt(
    prev: Attempts | None, desired: Layout, error: Problem | None, now: float, stamp: str
) -> Attempts | None:
    """The record after a round acted on ``desired``: None when nothing failed (a success starts over).
    Pure."""
    if error is None:
        return None
    prev = current(prev, desired)
    failures = (prev.failures if prev is not None else 0) + 1
    since = prev.since if prev is not None else stamp
    return Attempts(tuple(desired), failures, now + backoff(failures), since, error)


def gave_up(att: Attempts | None) -> Problem | None:
    """(``LayoutFailed``, the error, how often, and the way out) once the layout failed
    :data:`GIVE_UP_AFTER` times in a row; None before. The same words every round while nothing changes (no
    status write per round). Pure."""
    if att is None or att.failures < GIVE_UP_AFTER:
        return None
    reason, message = att.error
    return (
        Reason.LAYOUT_FAILED,
        f"spec.layout failed {att.failures} times in a row since {att.since} ({reason}: {message}); "
        f"retried every {backoff(att.failures):.0f}s; {WAY_OUT}",
    )
