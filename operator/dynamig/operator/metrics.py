"""Prometheus metrics of the operator, in a registry of their own (passed explicitly, never global).

Names follow Prometheus conventions: ``dynamig_operator_`` prefix, base units (seconds), ``_total`` counters.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynamig import __version__

RESHAPE_RESULTS = ("written", "completed", "blocked", "failed")
FENCE_ACTIONS = ("slice-withdrawn", "booking-failed", "pod-deleted", "pod-told")
PREEMPTOR_RESULTS = ("would-preempt", "no-victims")
EVICTION_RESULTS = ("evicted", "gone", "refused", "error")
HOLD_ENDS = ("served", "gone", "expired", "refused", "off", "moved")
MIG_MODES = ("Disabled", "Enabled")  # the `to` of a MIG mode switch (GpuPartition spec.migMode)
WHOLE_OFFER_STATES = ("published", "booked")  # a whole device offered beside the MIG devices


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self._pending_series: set[tuple[str, str, str]] = set()
        self._governed_series: set[str] = set()
        self.build_info = Gauge("dynamig_operator_build_info", "Operator build", ["version"], registry=r)
        self.build_info.labels(version=__version__).set(1)
        self.pending_devices = Gauge(
            "dynamig_operator_pending_devices",
            "MIG devices asked for by pending claims, by policy, preferred profile and reason",
            ["policy", "profile", "reason"],
            registry=r,
        )
        self.reshapes = Counter(
            "dynamig_operator_reshapes_total",
            f"GpuPartition layouts written and their outcome (result={'|'.join(RESHAPE_RESULTS)})",
            ["policy", "result"],
            registry=r,
        )
        self.pending_to_allocated = Histogram(
            "dynamig_operator_claim_pending_to_allocated_seconds",
            "Time from a claim first seen pending to its allocation",
            buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
            registry=r,
        )
        self.plan_duration = Histogram(
            "dynamig_operator_plan_duration_seconds",
            "Time the planner took for one policy round",
            ["policy"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.governed_gpus = Gauge(
            "dynamig_operator_governed_gpus", "GPUs governed by each policy", ["policy"], registry=r
        )
        self.whole_offers = Gauge(
            "dynamig_operator_whole_offers",
            "GPUs of a policy with spec.offerWhole, by state: published (the agent publishes the whole "
            "device beside the MIG devices) or booked (a claim allocated it: switched off, or kept whole, "
            "for it)",
            ["policy", "state"],
            registry=r,
        )
        self.oldest_pending = Gauge(
            "dynamig_operator_oldest_pending_claim_age_seconds",
            "Age of the oldest claim a policy has pending (since the claim's creation; 0 when none)",
            ["policy"],
            registry=r,
        )
        self.silent_agents = Gauge(
            "dynamig_operator_silent_agents",
            "Nodes whose agent stopped renewing its heartbeat Lease (their GPUs are left out of planning).",
            registry=r,
        )
        self.fenced = Counter(
            "dynamig_operator_silent_node_actions_total",
            "What the operator did for nodes whose agent went silent "
            "(action=slice-withdrawn|booking-failed|pod-deleted|pod-told)",
            ["action"],
            registry=r,
        )
        for action in FENCE_ACTIONS:
            self.fenced.labels(action=action)
        self._preemption_series: set[str] = set()
        self.dryrun_victims = Gauge(
            "dynamig_operator_preemption_dryrun_victims",
            "Pods a policy with preemption DryRun would evict in its latest round (none is evicted)",
            ["policy"],
            registry=r,
        )
        self.dryrun_preemptors = Gauge(
            "dynamig_operator_preemption_dryrun_preemptors",
            "Claims no re-cut serves without evicting, in a policy's latest round with preemption DryRun, "
            f"by whether victims were found (result={'|'.join(PREEMPTOR_RESULTS)})",
            ["policy", "result"],
            registry=r,
        )

        self.evictions = Counter(
            "dynamig_operator_evictions_total",
            "Pods a policy with preemption Evict asked the Eviction API to evict, by result "
            f"(result={'|'.join(EVICTION_RESULTS)})",
            ["policy", "result"],
            registry=r,
        )
        self.holds = Gauge(
            "dynamig_operator_preemption_holds",
            "Placements held for waiting claims (GpuPartition spec.holds) of a policy",
            ["policy"],
            registry=r,
        )
        self.oldest_hold = Gauge(
            "dynamig_operator_preemption_oldest_hold_seconds",
            "Age of the oldest placement a policy holds for a waiting claim (0: none)",
            ["policy"],
            registry=r,
        )
        self.spared = Gauge(
            "dynamig_operator_preemption_spared_workloads",
            "Workloads a policy with preemption Evict spares because they were evicted spareAfterEvictions "
            "times within the hour (ping-pong)",
            ["policy"],
            registry=r,
        )
        self.drains = Counter(
            "dynamig_operator_drains_total",
            "GPUs a policy drained for a claim starving behind small ones (spec.drain): a placement held, "
            "no pod evicted",
            ["policy"],
            registry=r,
        )
        self.mig_mode_switches = Counter(
            "dynamig_operator_mig_mode_switches_total",
            "GPU MIG mode switches a policy asked for (GpuPartition spec.migMode written under spec.migMode "
            f"Dynamic), by the mode asked (to={'|'.join(MIG_MODES)})",
            ["policy", "to"],
            registry=r,
        )
        self.holds_released = Counter(
            "dynamig_operator_preemption_holds_released_total",
            f"Holds a policy released, by why (why={'|'.join(HOLD_ENDS)})",
            ["policy", "why"],
            registry=r,
        )

    def evicted(self, policy: str, result: str) -> None:
        for r in EVICTION_RESULTS:
            self.evictions.labels(policy=policy, result=r)  # every series starts at 0
        self.evictions.labels(policy=policy, result=result).inc()

    def set_holds(self, policy: str, holds: int, oldest_s: float) -> None:
        self.holds.labels(policy=policy).set(holds)
        self.oldest_hold.labels(policy=policy).set(oldest_s)
        self._preemption_series.add(policy)

    def set_spared(self, policy: str, workloads: int) -> None:
        self.spared.labels(policy=policy).set(workloads)
        self._preemption_series.add(policy)

    def set_preemption_dry_run(self, policy: str, victims: int, would_preempt: int, no_victims: int) -> None:
        """The figures of a DryRun preemption round of ``policy``."""
        self.dryrun_victims.labels(policy=policy).set(victims)
        self.dryrun_preemptors.labels(policy=policy, result="would-preempt").set(would_preempt)
        self.dryrun_preemptors.labels(policy=policy, result="no-victims").set(no_victims)
        self._preemption_series.add(policy)

    def forget_preemption(self, policy: str, holds_too: bool = True) -> None:
        """Drop the preemption series of a policy whose preemption is off (or that is gone); the holds' too
        unless it still drains."""
        if policy in self._preemption_series:
            held = (self.holds, self.oldest_hold) if holds_too else ()
            for gauge in (self.dryrun_victims, self.spared, *held):
                with contextlib.suppress(KeyError):
                    gauge.remove(policy)
            for result in PREEMPTOR_RESULTS:
                with contextlib.suppress(KeyError):
                    self.dryrun_preemptors.remove(policy, result)
            self._preemption_series.discard(policy)

    def set_pending(self, policy: str, counts: dict[tuple[str, str], int]) -> None:
        """Replace the policy's pending-demand series with ``(profile, reason) -> devices``."""
        for labels in [x for x in self._pending_series if x[0] == policy and (x[1], x[2]) not in counts]:
            self.pending_devices.remove(*labels)  # drop series that no longer exist
            self._pending_series.discard(labels)
        for (profile, reason), n in counts.items():
            self.pending_devices.labels(policy=policy, profile=profile, reason=reason).set(n)
            self._pending_series.add((policy, profile, reason))

    def policy_seen(self, policy: str) -> None:
        """Start the policy's reshape and MIG mode switch counters at zero for every label value, so that an
        alert on their increase sees the first one (a series born at 1 has no increase). Counters outlive a
        deleted policy, as counters do; idempotent."""
        for result in RESHAPE_RESULTS:
            self.reshapes.labels(policy=policy, result=result)
        for mode in MIG_MODES:
            self.mig_mode_switches.labels(policy=policy, to=mode)

    def mig_mode_switched(self, policy: str, to: str) -> None:
        """A switch of one GPU's MIG mode to ``to`` asked by ``policy``."""
        self.policy_seen(policy)
        self.mig_mode_switches.labels(policy=policy, to=to).inc()

    def forget_policy(self, policy: str) -> None:
        """Drop the gauge series of a deleted policy (its counters stay, as counters do)."""
        self.set_pending(policy, {})
        self.forget_preemption(policy)
        if policy in self._governed_series:
            self.governed_gpus.remove(policy)
            self.oldest_pending.remove(policy)
            for state in WHOLE_OFFER_STATES:
                self.whole_offers.remove(policy, state)
            self._governed_series.discard(policy)

    def set_governed(
        self, policy: str, gpus: int, oldest_pending_s: float, whole_published: int = 0, whole_booked: int = 0
    ) -> None:
        self.policy_seen(policy)
        self.governed_gpus.labels(policy=policy).set(gpus)
        self.oldest_pending.labels(policy=policy).set(oldest_pending_s)
        self.whole_offers.labels(policy=policy, state="published").set(whole_published)
        self.whole_offers.labels(policy=policy, state="booked").set(whole_booked)
        self._governed_series.add(policy)
