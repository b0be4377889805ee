"""Tests of warm-pool sizing from observed arrivals (``dynamig.planner.warmpool``), pure functions only.

What runs for real: the sizing functions. Nothing is simulated; inputs are hand-made arrival lists.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamig.planner.warmpool import (
    WarmPoolSizing,
    cap_warm_pool,
    nearest_rank,
    size_warm_pool,
    window_counts,
)

SLICES = {"1g.10gb": 1, "2g.20gb": 2, "3g.40gb": 3, "7g.80gb": 7}


def test_window_counts_count_arrivals_in_the_trailing_refill_time() -> None:
    # windows (t - 10, t]: 0 -> {0}; 5 -> {0, 5}; 9 -> {0, 5, 9}; 12 -> {5, 9, 12}; 30 -> {30}
    assert window_counts([0.0, 5.0, 9.0, 12.0, 30.0], 10.0) == [1, 2, 3, 3, 1]
    # an arrival exactly refill_s earlier is replaced already: (t - 10, t] excludes it
    assert window_counts([0.0, 10.0], 10.0) == [1, 1]
    # simultaneous arrivals all see each other
    assert window_counts([3.0, 3.0, 3.0], 1.0) == [3, 3, 3]
    assert window_counts([], 5.0) == []


def test_nearest_rank_quantile() -> None:
    assert nearest_rank([], 0.95) == 0
    assert nearest_rank([1, 2, 3, 3, 1], 0.5) == 2  # sorted 1 1 2 3 3, rank ceil(2.5) = 3
    assert nearest_rank([1, 2, 3, 3, 1], 0.95) == 3
    assert nearest_rank(list(range(1, 101)), 0.95) == 95
    assert nearest_rank([4], 0.01) == 4


def test_burst_profile_gets_its_arrivals_per_refill_time() -> None:
    """20 claims of 1g one second apart and a refill of 9 s: from the 9th on, every claim sees 9 claims
    (itself and the 8 before) in its refill window; the 0.95 quantile (rank 19 of 20) is 9."""
    arrivals = [(100.0 + i, "1g.10gb") for i in range(20)] + [(50.0, "3g.40gb"), (500.0, "3g.40gb")]
    pool = size_warm_pool(arrivals, 1000.0, WarmPoolSizing(refill_s=9.0, history_s=3600.0))
    assert pool == {"1g.10gb": 9, "3g.40gb": 1}
    # the median claim (rank 10) saw 9 as well; the 0.25 quantile (rank 5) saw 5
    assert size_warm_pool(arrivals, 1000.0, WarmPoolSizing(9.0, 3600.0, quantile=0.25))["1g.10gb"] == 5


def test_only_the_past_history_window_counts() -> None:
    arrivals = [(10.0, "1g.10gb"), (11.0, "1g.10gb"), (5000.0, "2g.20gb"), (5000.5, "2g.20gb")]
    sizing = WarmPoolSizing(refill_s=9.0, history_s=3600.0)
    # at t=5000 the 2g arrivals at and after now are not seen (no hindsight); the 1g ones are too old
    assert size_warm_pool(arrivals, 5000.0, sizing) == {}
    assert size_warm_pool(arrivals, 5001.0, sizing) == {"2g.20gb": 2}
    assert size_warm_pool(arrivals, 100.0, sizing) == {"1g.10gb": 2}
    # nothing arrived yet: no pool
    assert size_warm_pool([], 100.0, sizing) == {}


def test_min_arrivals_and_max_per_profile() -> None:
    arrivals = [(float(i), "1g.10gb") for i in range(10)] + [(3.0, "7g.80gb")]
    sizing = WarmPoolSizing(refill_s=100.0, history_s=3600.0, min_arrivals=2, max_per_profile=4)
    assert size_warm_pool(arrivals, 20.0, sizing) == {"1g.10gb": 4}


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(ValueError):
        WarmPoolSizing(refill_s=0.0)
    with pytest.raises(ValueError):
        WarmPoolSizing(refill_s=9.0, quantile=0.0)
    with pytest.raises(ValueError):
        WarmPoolSizing(refill_s=9.0, history_s=-1.0)


def test_cap_takes_from_the_profile_holding_the_most_slices() -> None:
    pool = {"1g.10gb": 6, "3g.40gb": 3, "7g.80gb": 1}  # 6 + 9 + 7 = 22 slices
    assert cap_warm_pool(pool, SLICES.__getitem__, 22) == pool
    # 3g holds 9: one 3g goes (19 slices); then 7g and 1g hold 7 and 6, 7g goes (12)
    assert cap_warm_pool(pool, SLICES.__getitem__, 12) == {"1g.10gb": 6, "3g.40gb": 2}
    assert cap_warm_pool(pool, SLICES.__getitem__, 0) == {}


@settings(max_examples=60, deadline=None)
@given(
    times=st.lists(st.floats(min_value=0.0, max_value=3000.0, allow_nan=False), max_size=60),
    refill=st.floats(min_value=0.5, max_value=200.0),
    q=st.floats(min_value=0.05, max_value=1.0),
    cap=st.integers(min_value=0, max_value=40),
)
def test_pool_covers_the_share_q_of_past_claims_and_respects_the_cap(
    times: list[float], refill: float, q: float, cap: int
) -> None:
    """With ``k`` kept and each taken instance replaced ``refill`` later, a claim finds a warm instance iff
    at most ``k`` claims arrived in its refill window; at least a share ``q`` of the past claims did so,
    and ``k`` is the smallest such size. The cap never exceeds its slice budget."""
    now = 3000.5
    arrivals = [(t, "1g.10gb") for t in times]
    k = size_warm_pool(arrivals, now, WarmPoolSizing(refill_s=refill, history_s=now, quantile=q)).get(
        "1g.10gb", 0
    )
    counts = window_counts(times, refill)
    if counts:
        assert sum(1 for c in counts if c <= k) >= q * len(counts) - 1e-6
        assert sum(1 for c in counts if c <= k - 1) < q * len(counts) + 1e-6
        assert 1 <= k <= len(counts)
    else:
        assert k == 0
    capped = cap_warm_pool({"1g.10gb": k, "2g.20gb": k // 2}, SLICES.__getitem__, cap)
    assert sum(SLICES[p] * n for p, n in capped.items()) <= cap
    assert all(0 < n <= {"1g.10gb": k, "2g.20gb": k // 2}[p] for p, n in capped.items())
