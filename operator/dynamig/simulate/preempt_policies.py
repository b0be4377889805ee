"""Policies that evict lower-priority jobs to make room: ``dynamig-preempt`` and static MIG with
kube-scheduler's preemption.

- ``DynamigPreemptAllocator`` (``dynamig-preempt``): dynamig as it books and plans (``DynamigAllocator``);
  after a scheduling pass, a single-device job still waiting (no offer, so no plan that evicts nothing,
  serves it) is a preemptor. ``dynamig.planner.victims.find_victims`` picks, in kube-scheduler's order,
  the running jobs of lower priority (by ``gap``, run at least ``min_run_s``, not evicted twice within
  ``spare_s``) whose instances, once freed, let a re-cut serve it, on GPUs not reshaping and out of their
  eviction cooldown, as many as the rate limit's bucket holds. The victims are evicted (their work lost,
  they queue again as new pods and restart from zero), the instances in the way destroyed, the preemptor's
  instance cut and held for it; it binds at the first PreBind check after the cut, as any cut. Victims are
  strictly lower, so a victim never evicts its evictor (the engine counts it if it did).
- ``StaticPreemptAllocator`` (``static-preempt:<layout>``): what the device-plugin world gives. Fixed
  layouts as ``StaticAllocator``; kube-scheduler's priority preemption (``DefaultPreemption``) over the
  static slices: a waiting pod evicts one running pod of lower priority holding an instance of a profile
  it accepts (its alternatives in order), the lowest priority first, then the latest start, then the GPU;
  no minimum run time, rate limit or cooldown (kube-scheduler has none). The freed instance goes to the
  preemptor at the next scheduling pass (the queue is walked highest priority first, as PrioritySort).

Multi-GPU jobs never preempt (openb's are whole GPUs on one node; neither policy evicts for them). Victims
are evicted at once: no termination grace period is simulated, for either policy.
Allocators mutate their cluster (side effects).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dynamig.geometry.model import Layout
from dynamig.planner.model import GpuKey
from dynamig.planner.victims import GpuHolding, HeldInstance, Preemptor, Rules, RunningPod, find_victims
from dynamig.simulate.allocators import Allocation, Allocator, Replan, StaticAllocator
from dynamig.simulate.cluster import Cluster, Gpu
from dynamig.simulate.dynamig_policy import DynamigAllocator
from dynamig.simulate.preemption import EvictionLedger, PreemptSettings
from dynamig.simulate.trace import Job

MAX_PREEMPTORS = 200  # preemptors considered per pass, highest priority first


class _Running:
    """Running jobs: when each began and at what priority (the victims' side)."""

    def __init__(self) -> None:
        self.jobs: dict[str, tuple[Job, float]] = {}
        self._counts: dict[int, int] = {}

    def add(self, job: Job, begin: float) -> None:
        self.jobs[job.name] = (job, begin)
        self._counts[job.priority] = self._counts.get(job.priority, 0) + 1

    def remove(self, job: Job) -> None:
        if self.jobs.pop(job.name, None) is not None:
            self._counts[job.priority] -= 1
            if not self._counts[job.priority]:
                del self._counts[job.priority]

    def lowest(self) -> int | None:
        return min(self._counts) if self._counts else None


class _TracksRunning(Allocator):
    """Keeps ``running`` (who runs since when, at what priority) beside the allocator it is mixed into."""

    running: _Running

    def place(self, job: Job, now: float) -> Allocation | None:
        alloc = super().place(job, now)
        if alloc is not None:
            self.running.add(job, now + alloc.delay)
        return alloc

    def release(self, job: Job, alloc: Allocation, now: float) -> None:
        self.running.remove(job)
        super().release(job, alloc, now)


class CutsForClaim(DynamigAllocator):
    """dynamig that cuts a placement for one waiting claim and keeps it for that claim (a hold): the
    instances in its way, free by then, are destroyed, the placement cut and reserved for the claim, which
    binds at the cut's first PreBind check (a READY event) rather than booking a second placement
    meanwhile. For a preemptor (``dynamig-preempt``) and a drained GPU's claim (``dynamig-drain``)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self._binds_at: dict[str, float] = {}  # claim -> when it binds to the placement cut for it

    def place(self, job: Job, now: float) -> Allocation | None:
        if now < self._binds_at.get(job.name, now):
            return None
        self._binds_at.pop(job.name, None)
        return super().place(job, now)

    def cut_for(self, claim: str, gpu: Gpu, profile: str, start: int, now: float) -> float:
        """Cut ``profile`` at ``start`` on ``gpu`` for ``claim``, destroying the (free) instances in its
        way; when the claim binds. Side effect: cluster state."""
        need = gpu.model.profile(profile).mask(start)
        for inst in [i for i in gpu.instances if gpu.model.profile(i.profile).mask(i.start) & need]:
            self.cluster.destroy(inst, now)
        ready = self._cut_done_at(gpu.node_pos, now)
        inst = self.cluster.create(gpu, profile, start, now, ready)
        self._not_ready.add(inst)
        self._reserved[inst] = claim
        self._claims.setdefault(claim, []).append(inst)
        self.reshapes += 1
        self.touch([gpu])
        binds = self.running_at(now, ready)  # the first PreBind check after the cut
        self._binds_at[claim] = binds
        return binds


class DynamigPreemptAllocator(_TracksRunning, CutsForClaim):
    name = "dynamig-preempt"
    preempts = True

    def __init__(self, cluster: Cluster, *args: object, preempt: PreemptSettings, **kw: object) -> None:
        super().__init__(cluster, *args, **kw)
        self.settings = preempt
        self.ledger = EvictionLedger(preempt)
        self.running = _Running()

    def preempt(self, now: float, waiting: Sequence[Job]) -> Replan:
        s = self.settings
        lowest = self.running.lowest()
        if lowest is None or self.evictor is None:
            return Replan()
        wanted = [
            j for j in waiting if j.count == 1 and j.priority - s.gap >= lowest and j.name not in self._claims
        ][:MAX_PREEMPTORS]
        if not wanted:
            return Replan()
        if not self.ledger.allows(now):
            return Replan(retry_at=self.ledger.next_token_at(now))
        reach = max(j.priority for j in wanted) - s.gap
        pods = {
            name: RunningPod(
                name,
                job.priority,
                begin,
                protected="evicted twice within the hour" if self.ledger.spared(name, now) else "",
            )
            for name, (job, begin) in self.running.jobs.items()
        }
        gpus = []
        by_key = {}
        for gpu in self.cluster.gpus:
            if not gpu.busy_slices or gpu.reshaping(now) or not self.ledger.gpu_ready(gpu.pos, now):
                continue
            if not any(i.job and pods[i.job].priority <= reach for i in gpu.instances if i.job in pods):
                continue
            key = GpuKey(gpu.node, gpu.index)
            by_key[key] = gpu
            gpus.append(
                GpuHolding(
                    key,
                    gpu.model.key,
                    tuple(
                        HeldInstance(i.placed, (i.job,) if i.job else (("held",) if self._kept(i) else ()))
                        for i in gpu.instances
                    ),
                )
            )
        preemptors = [Preemptor(j.name, j.priority, j.alternatives, self._allowed_names(j)) for j in wanted]
        found = find_victims(preemptors, gpus, pods, Rules(s.gap, s.min_run_s, now), self.cluster.models)
        readies: list[float] = []
        for ev in found.evictions:
            # a multi-GPU victim holds instances on several GPUs: evicted for one of them, it is gone for all
            victims = [v for v in ev.victims if v in self.running.jobs]
            if not self.ledger.allows(now, len(victims)):
                break
            gpu = by_key[ev.gpu]
            for victim in victims:
                self.evictor(victim, now, ev.preemptor)
            self.ledger.record(gpu.pos, victims, now)
            readies.append(self.cut_for(ev.preemptor, gpu, ev.profile, ev.start, now))
        retry = now + s.retry_s if found.refused or len(found.evictions) > len(readies) else None
        return Replan(tuple(readies), retry)


class StaticPreemptAllocator(_TracksRunning, StaticAllocator):
    preempts = True

    def __init__(
        self,
        cluster: Cluster,
        layouts: Sequence[Layout] | Mapping[str, Sequence[Layout]],
        label: str,
        node_order: str = "pack",
        gap: int = 1,
    ) -> None:
        super().__init__(cluster, layouts, label, node_order)
        self.name = f"static-preempt:{label}"
        self.gap = gap
        self.running = _Running()

    def preempt(self, now: float, waiting: Sequence[Job]) -> Replan:
        lowest = self.running.lowest()
        if lowest is None or self.evictor is None:
            return Replan()
        wanted = [j for j in waiting if j.count == 1 and j.priority - self.gap >= lowest][:MAX_PREEMPTORS]
        if not wanted:
            return Replan()
        # busy instances per profile, best victim first: lowest priority, latest start, GPU, start
        by_profile: dict[str, list[tuple[int, float, int, int, str]]] = {}
        for gpu in self.cluster.gpus:
            for i in gpu.instances:
                if i.job in self.running.jobs:
                    job, begin = self.running.jobs[i.job]
                    by_profile.setdefault(i.profile, []).append(
                        (job.priority, -begin, gpu.pos, i.start, i.job)
                    )
        for cands in by_profile.values():
            cands.sort()
        taken: set[str] = set()
        for pre in wanted:
            victim = self._victim(pre, by_profile, taken)
            if victim is not None:
                taken.add(victim)
                self.evictor(victim, now, pre.name)
        return Replan()

    def _victim(
        self, pre: Job, by_profile: Mapping[str, list[tuple[int, float, int, int, str]]], taken: set[str]
    ) -> str | None:
        ceiling = pre.priority - self.gap
        for profile in pre.alternatives:
            for prio, _, pos, _, name in by_profile.get(profile, ()):
                if prio > ceiling:
                    break
                if name not in taken and self.cluster.allows(pre, self.cluster.gpus[pos].node_pos):
                    return name
        return None
