"""An upper bound on the demand any policy can serve on a trace, from slice arithmetic alone.

No placement rule, no node boundary, no queue discipline: split ``[0, horizon]`` into equal intervals; in
one interval no policy serves more than the cluster's compute slices times the interval's length, nor more
than the jobs could use there: a job that arrives at ``a``, runs ``d`` seconds and gives up after waiting
``w`` can only run inside ``[a, a + w + d]`` and for at most ``d`` of it, holding its asked-for slices.
Summing the smaller of the two over the intervals bounds what any schedule serves; the bound reported is
the smallest over several interval widths. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynamig.simulate.trace import Trace

PARTITIONS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def served_upper_bound(
    trace: Trace, slices_of: Mapping[str, int], total_slices: int, start_slack_s: float = 0.0
) -> float:
    """Slice-hours no policy can exceed on ``trace`` with ``total_slices`` compute slices. ``start_slack_s``
    widens each job's window by the longest a policy may take between placing a job and starting it (an
    instance being created), so the bound also holds for policies that charge that latency. Pure."""
    horizon = trace.horizon
    if horizon <= 0:
        return 0.0
    spans: list[tuple[float, float, float, float]] = []  # (earliest, latest end, duration, slices)
    for job in trace.jobs:
        if job.arrival >= horizon:
            continue
        duration = horizon - job.arrival if job.duration is None else job.duration
        patience = trace.patience if job.patience is None else job.patience
        latest = (
            horizon if patience is None else min(horizon, job.arrival + patience + start_slack_s + duration)
        )
        spans.append((job.arrival, latest, duration, float(job.count * slices_of[job.preferred])))
    best = float("inf")
    for parts in PARTITIONS:
        width = horizon / parts
        usable = [0.0] * parts
        middle = [0.0] * (parts + 1)  # difference array: full inner intervals all get the same amount
        for start, end, duration, slices in spans:
            first, last = int(start / width), min(parts - 1, int(end / width))
            for b in {first, last}:
                lo, hi = max(start, b * width), min(end, (b + 1) * width)
                if hi > lo:
                    usable[b] += slices * min(duration, hi - lo)
            if last - first >= 2:
                middle[first + 1] += slices * min(duration, width)
                middle[last] -= slices * min(duration, width)
        running = 0.0
        for b in range(parts):
            running += middle[b]
            usable[b] += running
        total = sum(min(u, total_slices * width) for u in usable)
        best = min(best, total)
    return best / 3600.0
