"""Warm-pool sizing from observed arrivals: how many free instances of each profile to keep ready.

A claim that finds a free instance of its profile waits only the binding round trip; one that does not
waits for a create (binding, the batching window, the create latency). ``size_warm_pool`` sizes the pool
from the claims seen in a trailing history window, ``cap_warm_pool`` bounds it. Both are pure: no clock,
no Kubernetes, no randomness; the caller passes the time ``now`` and the arrivals it saw before it.

Why the sliding-window quantile covers the arrivals that land while a taken instance is replaced: keep
``k`` free instances of a profile and replace each one that a claim takes; the replacement is usable
``refill_s`` later (binding + batching window + create latency). At the moment a claim arrives, the
instances still missing from the pool are those taken by earlier claims whose replacement is not ready yet,
that is the claims of that profile that arrived in the ``refill_s`` before it. So the claim finds a free
instance exactly when the number of arrivals of its profile in ``(t - refill_s, t]`` (itself included) is
at most ``k``. Taking ``k`` as the ``q``-quantile of that count over the history's arrivals (every arrival
counts once) means that, were the future like the history, a fraction ``q`` of the claims would find a warm
instance. (Instances freed by ending jobs and kept only add to the pool, so this is conservative; re-cuts
that delay a replacement, such as a GPU cooldown, make it optimistic.)
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

_N = TypeVar("_N", int, float)


@dataclass(frozen=True, slots=True)
class WarmPoolSizing:
    """Parameters of ``size_warm_pool``.

    ``refill_s``: seconds from a claim taking a pooled instance until its replacement is usable (binding
    round trip + batching window + create latency). ``history_s``: only arrivals in ``[now - history_s,
    now)`` count. ``quantile``: share of the history's claims that would have found a warm instance.
    ``min_arrivals``: a profile with fewer arrivals than this in the history gets no pool.
    ``max_per_profile``: upper bound per profile (None: none).
    """

    refill_s: float
    history_s: float = 6 * 3600.0
    quantile: float = 0.95
    min_arrivals: int = 1
    max_per_profile: int | None = None

    def __post_init__(self) -> None:
        if self.refill_s <= 0:
            raise ValueError(f"refill_s must be positive, got {self.refill_s}")
        if self.history_s <= 0:
            raise ValueError(f"history_s must be positive, got {self.history_s}")
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")


def window_counts(times: Iterable[float], width: float) -> list[int]:
    """For each arrival (sorted by time), the arrivals in ``(t - width, t]``, itself included. Pure.

    Arrivals at the same instant all count each other (each sees the whole group).
    """
    ts = sorted(times)
    out: list[int] = []
    for t in ts:
        lo = bisect.bisect_right(ts, t - width)
        hi = bisect.bisect_right(ts, t)
        out.append(hi - lo)
    return out


def nearest_rank(values: Iterable[_N], q: float) -> _N | int:
    """The ``q``-quantile by nearest rank: the smallest value with at least ``q`` of the values at or
    below it (0 for no values). The simulator's percentiles use it too. Pure."""
    xs = sorted(values)
    if not xs:
        return 0
    rank = max(1, math.ceil(round(q * len(xs), 9)))  # round: 0.95 * 20 is 19, not 19.000000000000004
    return xs[min(rank, len(xs)) - 1]


def size_warm_pool(
    arrivals: Iterable[tuple[float, str]], now: float, sizing: WarmPoolSizing
) -> dict[str, int]:
    """Free instances to keep per profile, from the ``(arrival time, profile)`` of past claims. Pure.

    Only arrivals in ``[now - sizing.history_s, now)`` count (none at or after ``now``: no hindsight).
    Per profile: the ``sizing.quantile`` (nearest rank) over those arrivals of the number of arrivals of
    that profile in the ``refill_s`` before each (itself included), see the module docstring; 0 when the
    profile had fewer than ``min_arrivals`` arrivals; at most ``max_per_profile``. Profiles that get 0 are
    left out. Capping to what the cluster can hold is the caller's (``cap_warm_pool``).
    """
    lo = now - sizing.history_s
    by_profile: dict[str, list[float]] = {}
    for t, profile in arrivals:
        if lo <= t < now:
            by_profile.setdefault(profile, []).append(t)
    out: dict[str, int] = {}
    for profile in sorted(by_profile):
        times = by_profile[profile]
        if len(times) < max(1, sizing.min_arrivals):
            continue
        k = nearest_rank(window_counts(times, sizing.refill_s), sizing.quantile)
        if sizing.max_per_profile is not None:
            k = min(k, sizing.max_per_profile)
        if k > 0:
            out[profile] = k
    return out


def cap_warm_pool(
    pool: Mapping[str, int], slices_of: Callable[[str], int], max_slices: int
) -> dict[str, int]:
    """``pool`` reduced until its instances hold at most ``max_slices`` compute slices. Pure.

    One instance at a time is taken from the profile holding the most slices in the pool (ties: the larger
    profile, then the name), so small, cheap pools survive a cap that large ones exceed.
    """
    out = {p: n for p, n in pool.items() if n > 0}
    total = sum(slices_of(p) * n for p, n in out.items())
    while out and total > max(0, max_slices):
        worst = max(out, key=lambda p: (slices_of(p) * out[p], slices_of(p), p))
        out[worst] -= 1
        total -= slices_of(worst)
        if out[worst] == 0:
            del out[worst]
    return dict(sorted(out.items()))
