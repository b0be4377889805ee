"""Carries out one GPU's reshape plan through NVML: destroys what may go now (read again right before, the
decision :func:`dynamig.agent.layout.lifecycle.destroys_now`'s), plans again from what really went, creates.
Returns what happened as data; the round turns it into status, Events and the published inventory.
A layout whose NVML operations keep failing is retried on a back-off and reported failed after a few tries
(:mod:`dynamig.agent.layout.retry`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from dynamig.agent.kube.api import KubeApi, allocated_devices
from dynamig.agent.layout.lifecycle import destroys_now
from dynamig.agent.layout.reconcile import GpuPlan, Observed, observe, plan_gpu, without_creates_over
from dynamig.agent.layout.retry import Attempts, after_attempt, current, gave_up, holding
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml.device import GpuInfo, MigInstance, NvmlDevices
from dynamig.agent.publishing.gpu_status import Problem
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, device_name
from dynamig.kube.apicalls import status_of
from dynamig.kube.gpupartition import Reason
from dynamig.kube.times import now_rfc3339

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Reshaped:
    """One GPU after its plan was carried out."""

    instances: list[MigInstance]
    plan: GpuPlan  # planned again when something was destroyed: what the GPU looks like now decides
    claims: dict[str, list[str]]  # the round's claims plus those that won a race against a destroy
    destroyed: set[PlacedInstance] = field(default_factory=set)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    blocker: Problem | None = None  # an NVML operation that failed
    failed: Problem | None = None  # the layout failed too often in a row: the GPU is reported failed


@dataclass(frozen=True, slots=True)
class Reshaper:
    """The NVML and API handles a reshape needs."""

    node: str
    driver: str
    api: KubeApi
    devices: NvmlDevices
    metrics: AgentMetrics
    prepared: Collection[str]  # device names the kubelet plugin prepared
    clock: Callable[[], float]
    attempts: dict[str, Attempts] = field(default_factory=dict)  # GPU UUID -> failed tries of its layout
    progress: Callable[[], None] = lambda: None  # told after each NVML operation done (the agent's heartbeat)
    quarantine_seconds: float = 0.0  # AgentSettings.quarantine_seconds
    # GPU UUID -> retired instances destroyed, and when: no create of the agent's own over their slices yet
    quarantined: dict[str, dict[PlacedInstance, float]] = field(default_factory=dict)

    def observe(
        self, instances: Sequence[MigInstance], claims: Mapping[str, Sequence[str]]
    ) -> tuple[Observed, ...]:
        return observe(instances, claims, self.prepared)

    async def carry_out(
        self,
        gpu: GpuInfo,
        model: GpuModel,
        desired: Layout,
        plan: GpuPlan,
        observed: tuple[Observed, ...],
        instances: list[MigInstance],
        claims: Mapping[str, Sequence[str]],
        guarded_since: Mapping[PlacedInstance, float],
        settle_seconds: float,
        keep_undesired: bool,
    ) -> Reshaped:
        out = Reshaped(instances, plan, {k: list(v) for k, v in claims.items()})
        att = current(self.attempts.get(gpu.uuid), desired)
        if not plan.acts:
            if plan.converged or att is None:
                self.attempts.pop(gpu.uuid, None)  # applied (or another layout): nothing failing any more
            return out
        if holding(att, self.clock()):
            assert att is not None
            out.blocker, out.failed = att.error, gave_up(att)  # nothing is tried before retry_at
            return out
        await self._act(
            gpu, model, desired, plan, observed, guarded_since, settle_seconds, keep_undesired, out
        )
        att = after_attempt(att, desired, out.blocker, self.clock(), now_rfc3339())
        if att is None:
            self.attempts.pop(gpu.uuid, None)
            return out
        self.attempts[gpu.uuid] = att
        out.failed = gave_up(att)  # Ready turns LayoutFailed: the round's Event on that change says so
        if out.failed is not None:
            log.warning("%s GPU %d: %s", self.node, gpu.index, out.failed[1])
        return out

    async def _act(
        self,
        gpu: GpuInfo,
        model: GpuModel,
        desired: Layout,
        plan: GpuPlan,
        observed: tuple[Observed, ...],
        guarded_since: Mapping[PlacedInstance, float],
        settle_seconds: float,
        keep_undesired: bool,
        out: Reshaped,
    ) -> None:
        """Destroy, plan again, create, plan again; NVML failures land in ``out.blocker``."""

        async def plan_again() -> GpuPlan:
            """From what NVML shows now: what was really destroyed or created decides what fits."""
            out.instances = await asyncio.to_thread(self.devices.instances, gpu)
            quiet = {p: t for p, t in guarded_since.items() if p not in out.destroyed}
            observed_now = self.observe(out.instances, out.claims)
            return plan_gpu(model, desired, observed_now, quiet, self.clock(), settle_seconds, keep_undesired)

        spared: list[PlacedInstance] = []  # retired instances that may not go yet
        if plan.destroy:
            # Observed again before each destroy, not once for all: each NVML destroy takes its time, and a
            # booking of a retired (guarded) instance made meanwhile keeps it (lifecycle.py, won_by).
            pending = plan.destroy
            while pending:
                go = await self._destroys_now(
                    gpu, pending, observed, guarded_since, settle_seconds, out, spared
                )
                if not go:
                    break
                await self._destroy(gpu, go[0], out)
                pending = go[1:]
            if keep_undesired:  # partitionable: what the agent creates there is a floor, never a pod's wait
                gone = self.quarantined.setdefault(gpu.uuid, {})
                gone.update((p, self.clock()) for p in out.destroyed)
            out.plan = without_creates_over(model, await plan_again(), spared)
        out.plan = self._held_back(model, gpu, out.plan, keep_undesired)
        for p in (*out.plan.complete, *out.plan.create):
            await self._create(gpu, p, out)
        out.plan = self._held_back(model, gpu, await plan_again(), keep_undesired)

    def _held_back(self, model: GpuModel, gpu: GpuInfo, plan: GpuPlan, keep_undesired: bool) -> GpuPlan:
        """``plan`` with the creates over quarantined slices waiting (partitionable inventory only)."""
        if not keep_undesired:
            return plan
        return without_creates_over(model, plan, self._quarantined(gpu), self._quarantine_note())

    def _quarantined(self, gpu: GpuInfo) -> list[PlacedInstance]:
        """The retired instances of ``gpu`` destroyed less than ``quarantine_seconds`` ago (older ones are
        forgotten). Only the agent's own floor creates in the partitionable inventory wait for them: a booked
        cut proves the scheduler counts the slices as taken, a prepare creates the very instance a late
        allocation names, and in the instances inventory the create is what a waiting pod waits for."""
        now = self.clock()
        gone = self.quarantined.get(gpu.uuid, {})
        for p in [p for p, at in gone.items() if now - at >= self.quarantine_seconds]:
            del gone[p]
        return list(gone)

    def _quarantine_note(self) -> str:
        return (
            "memory slices of {names}, destroyed less than "
            f"{self.quarantine_seconds:.0f}s ago, kept free that long (a scheduler lagging behind may still "
            "allocate it, and its pod's prepare then creates it again)"
        )

    async def _destroys_now(
        self,
        gpu: GpuInfo,
        planned: Layout,
        observed: tuple[Observed, ...],
        guarded_since: Mapping[PlacedInstance, float],
        settle_seconds: float,
        out: Reshaped,
        spared: list[PlacedInstance],
    ) -> tuple[PlacedInstance, ...]:
        """Observe right before destroying (pods first, then claims), decide (lifecycle.py)."""

        def dev(p: PlacedInstance) -> str:
            return device_name(gpu.index, p.profile, p.start)

        binding_pods = await self._pods_binding()
        fresh = allocated_devices(await self.api.list_claims(), self.driver, self.node)
        go, kept = destroys_now(
            planned,
            {o.placed for o in observed if o.has_compute_instance},
            guarded_since,  # since when each was guarded: unchanged since the plan was made
            self.clock(),
            settle_seconds,
            {o.placed: fresh.get(dev(o.placed), []) for o in observed},
            {p for p in planned if dev(p) in self.prepared},
            binding_pods,
        )
        for k in kept:
            if k.won_by:
                out.notes.append(f"kept {dev(k.placed)}: {k.why}")
                self.metrics.kept_busy.labels(self.node).inc()
                held = out.claims.setdefault(dev(k.placed), [])
                held.extend(h for h in fresh.get(dev(k.placed), []) if h not in held)
            else:
                out.notes.append(f"kept {dev(k.placed)} for now: {k.why}")
                spared.append(k.placed)
        return go

    async def _pods_binding(self) -> list[str]:
        """The pods in a binding cycle toward this node; one stand-in entry when the agent may not list pods
        (whether a booking is in flight cannot be known then, so nothing retired may go)."""
        try:
            return await self.api.pods_binding_to(self.node)
        except Exception as exc:
            if status_of(exc) not in (401, 403):
                raise
            return [f"(cannot list pods: {status_of(exc)}; the agent needs list on pods)"]

    async def _nvml(self, op: str, gpu: GpuInfo, p: PlacedInstance, out: Reshaped) -> bool:
        """Destroy or create ``p`` through NVML, counted in the metrics; an error becomes a note (an instance
        in use: retried) or the GPU's blocker. True when NVML did it."""
        dev = device_name(gpu.index, p.profile, p.start)
        call = self.devices.destroy if op == "destroy" else self.devices.create
        try:
            await asyncio.to_thread(call, gpu, p)
        except self.devices.error_type as exc:
            err = self.devices.error_name(exc)
            self.metrics.operation(op, "error")
            self.metrics.nvml_error(op, err)
            if op == "destroy" and self.devices.is_error(exc, "InUse"):
                out.notes.append(f"kept {dev}: NVML reports it in use; will retry")
                self.metrics.kept_busy.labels(self.node).inc()
            elif op == "create" and self.devices.is_error(exc, "InsufficientResources"):
                out.blocker = (
                    Reason.INSUFFICIENT_RESOURCES,
                    f"NVML refused to create {p.profile} at memory slice {p.start} "
                    "(insufficient resources: the placement or an engine is taken)",
                )
            else:
                out.blocker = (Reason.NVML_ERROR, f"{op.rstrip('e')}ing {dev} failed: {err}")
            return False
        self.progress()
        self.metrics.operation(op, "success")
        log.info("%sed %s on %s", op.rstrip("e"), dev, self.node)
        return True

    async def _destroy(self, gpu: GpuInfo, p: PlacedInstance, out: Reshaped) -> None:
        if await self._nvml("destroy", gpu, p, out):
            out.destroyed.add(p)
            dev = device_name(gpu.index, p.profile, p.start)
            out.events.append(
                ("Normal", "InstanceDestroyed", f"destroyed free {p.profile} at slice {p.start} ({dev})")
            )

    async def _create(self, gpu: GpuInfo, p: PlacedInstance, out: Reshaped) -> None:
        if await self._nvml("create", gpu, p, out):
            dev = device_name(gpu.index, p.profile, p.start)
            out.events.append(
                ("Normal", "InstanceCreated", f"created {p.profile} at slice {p.start} ({dev})")
            )
