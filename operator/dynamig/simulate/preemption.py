"""Preemption in the simulator: its knobs, the ledger that enforces them, and what a run counts.

- ``PreemptSettings``: the victims' rules (``gap``, ``min_run_s``), how often evictions may happen (a
  token bucket of ``rate_per_h`` evictions per hour over the cluster, a ``gpu_cooldown_s`` per GPU after
  one of its cuts evicted) and which jobs are spared (``spare_s``: a job evicted twice within it is not a
  victim again until its older eviction is that old, the ledger of evicted owners).
- ``EvictionLedger``: those limits as state, for one run.
- ``PingPong``: counts a job evicted that then evicts its evictor (thrash).
- ``PriorityTally``: jobs, starts, waits and served slice-seconds per priority class.

Pure apart from the state of the objects themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamig.simulate.priority import CLASSES, class_of
from dynamig.simulate.trace import Job, percentile

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class PreemptSettings:
    gap: int = 1  # a victim's priority is at most the preemptor's minus this
    min_run_s: float = 600.0  # a job that has run less than this is not a victim
    rate_per_h: float = 60.0  # evictions per hour over the cluster (token bucket); 0: none
    burst: float = 5.0  # the bucket's size (evictions at once after a quiet spell)
    gpu_cooldown_s: float = 300.0  # a GPU one eviction cut for is not cut by evicting again for this long
    spare_s: float = 3600.0  # a job evicted twice within this long is not a victim a third time
    retry_s: float = 60.0  # preemptors still waiting: asked again this long after (min run, rate limit)

    def __post_init__(self) -> None:
        for name in ("min_run_s", "rate_per_h", "burst", "gpu_cooldown_s", "spare_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.gap < 1:
            raise ValueError(f"gap must be at least 1 (equal priorities never evict), got {self.gap}")
        if self.retry_s <= 0:
            raise ValueError(f"retry_s must be positive, got {self.retry_s}")

    def label(self) -> str:
        """``gap 1, min run 10m, 60/h, GPU cooldown 5m, spared 60m`` for tables. Pure."""
        return (
            f"gap {self.gap}, min run {self.min_run_s / 60:g}m, {self.rate_per_h:g}/h, "
            f"GPU cooldown {self.gpu_cooldown_s / 60:g}m, spared {self.spare_s / 60:g}m"
        )


class EvictionLedger:
    """The rate limit, the per-GPU cooldown and the evicted jobs of one run."""

    def __init__(self, settings: PreemptSettings) -> None:
        self.settings = settings
        self._tokens = settings.burst if settings.rate_per_h else 0.0  # full after the quiet before a run
        self._at = 0.0
        self._gpu_until: dict[int, float] = {}
        self._evicted_at: dict[str, list[float]] = {}  # job -> its evictions, oldest first

    def tokens(self, now: float) -> float:
        """Evictions the bucket allows at ``now``. Side effect: refills it."""
        s = self.settings
        if now > self._at:
            self._tokens = min(s.burst, self._tokens + (now - self._at) * s.rate_per_h / 3600.0)
            self._at = now
        return self._tokens

    def allows(self, now: float, evictions: int = 1) -> bool:
        """Whether the bucket holds ``evictions`` at ``now``, within rounding (a refill computed in small
        steps may end a hair short of a whole token). Side effect: refills it."""
        return self.tokens(now) >= evictions - _EPS

    def next_token_at(self, now: float, need: float = 1.0) -> float | None:
        """When the bucket next holds ``need`` evictions (None: never, a zero rate); at least a second
        after ``now`` when it does not hold them now, so a caller asking again then moves on. Side effect:
        refills the bucket."""
        s = self.settings
        if s.rate_per_h <= 0 or need > s.burst:
            return None
        short = need - self.tokens(now)
        return now if short <= _EPS else now + max(1.0, short * 3600.0 / s.rate_per_h)

    def gpu_ready(self, gpu: int, now: float) -> bool:
        return self._gpu_until.get(gpu, -1.0) <= now

    def spared(self, job: str, now: float) -> bool:
        """Whether ``job`` was evicted twice within ``spare_s`` before ``now``. Pure."""
        recent = [at for at in self._evicted_at.get(job, ()) if now - at < self.settings.spare_s]
        return len(recent) >= 2

    def record(self, gpu: int, victims: list[str], now: float) -> None:
        """``victims`` were evicted for a cut on GPU ``gpu``. Side effect: the bucket, cooldown, ledger."""
        self.tokens(now)
        self._tokens -= len(victims)
        self._gpu_until[gpu] = now + self.settings.gpu_cooldown_s
        for v in victims:
            self._evicted_at.setdefault(v, []).append(now)


class PingPong:
    """Counts thrash: ``evicted(victim, by)`` where ``by`` was itself evicted by ``victim`` before."""

    def __init__(self) -> None:
        self._pairs: set[tuple[str, str]] = set()  # (evictor, victim)
        self.count = 0

    def evicted(self, victim: str, by: str) -> None:
        if (victim, by) in self._pairs:
            self.count += 1
        self._pairs.add((by, victim))


class PriorityTally:
    """Per priority class: jobs arrived, jobs started, waits to the first start, served slice-seconds."""

    def __init__(self) -> None:
        self._jobs: dict[str, int] = {}
        self._waits: dict[str, list[float]] = {}
        self._served: dict[str, float] = {}
        self._unstarted: dict[str, dict[str, float]] = {}  # class -> job -> arrival, not started yet

    def arrived(self, job: Job, *, waits: bool = True) -> None:
        """``job`` is one of the trace's; ``waits``: it arrives within the horizon (its wait counts)."""
        c = class_of(job.priority)
        self._jobs[c] = self._jobs.get(c, 0) + 1
        if waits:
            self._unstarted.setdefault(c, {})[job.name] = job.arrival

    def started(self, job: Job, wait: float) -> None:
        c = class_of(job.priority)
        self._waits.setdefault(c, []).append(wait)
        self._unstarted.get(c, {}).pop(job.name, None)

    def served(self, job: Job, slice_s: float) -> None:
        c = class_of(job.priority)
        self._served[c] = self._served.get(c, 0.0) + slice_s

    def table(self, horizon: float) -> dict[str, dict[str, float]]:
        """class -> jobs, started, p50_s, p95_s (every job that arrived; one never started waits until the
        horizon), served_slice_h; classes in priority order, only those with jobs. Pure."""
        out: dict[str, dict[str, float]] = {}
        for c in CLASSES:
            if not self._jobs.get(c):
                continue
            waits = self._waits.get(c, []) + [horizon - a for a in self._unstarted.get(c, {}).values()]
            out[c] = {
                "jobs": self._jobs[c],
                "started": len(self._waits.get(c, [])),
                "p50_s": percentile(waits, 50),
                "p95_s": percentile(waits, 95),
                "served_slice_h": self._served.get(c, 0.0) / 3600.0,
            }
        return out
