"""``dynamig-drain``: dynamig with the operator's drains (GpuPartitionPolicy ``spec.drain``), evicting nobody.

A stream of small jobs can keep every GPU partly busy, so that a large profile never finds its slices free
together. Each planning round, the single-device jobs that have waited ``after_s`` or more (oldest first,
none holding a placement already) are drains' candidates, and ``dynamig.planner.drain.choose_drains`` (the
operator's own choice) picks for each a GPU and a placement whose busy instances block the fewest slices,
at most ``max_gpus`` drains at a time. While a GPU drains, what lies over the held placement is kept for the
claim: the free instances there are offered to nobody, and the published offers see the placement as one
held instance standing in for everything over its slices (as the operator's planner and the agent's offers
do), so no other job books or cuts there; the rest of the GPU is offered as usual. Once the busy instances
in the way have ended, the next round cuts the placement for the claim and keeps it for it, the hold that
``dynamig-preempt`` uses (``CutsForClaim``). A drain ends when its claim is served (anywhere) or gives up,
or ``hold_s`` after it began; the claim may then be drained for again, as the operator would.

The drains are looked at after every scheduling pass (the engine's ``preempt`` hook; ``drains`` keeps the
queue in arrival order, so priorities play no part), and again when a waiting job reaches ``after_s`` or a
hold expires: a placement is cut as soon as what ran in its way has ended, as the agent cuts a held one.
Allocators mutate their cluster (side effects).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynamig.planner.drain import choose_drains
from dynamig.planner.model import GpuKey
from dynamig.planner.victims import GpuHolding, HeldInstance, Preemptor
from dynamig.simulate.allocators import Allocation, Replan
from dynamig.simulate.cluster import Cluster, Gpu, Instance
from dynamig.simulate.preempt_policies import CutsForClaim
from dynamig.simulate.trace import Job


@dataclass(frozen=True, slots=True)
class DrainSettings:
    """``spec.drain``'s knobs: a job waiting ``after_s`` or more gets a GPU drained for it, at most
    ``max_gpus`` draining at a time, each drain kept at most ``hold_s``."""

    after_s: float = 300.0
    max_gpus: int = 1
    hold_s: float = 3600.0


@dataclass(slots=True)
class _Drain:
    claim: str
    gpu: Gpu
    profile: str
    start: int
    mask: int  # the placement's memory slices
    until: float  # when the hold expires

    def over(self, inst: Instance) -> bool:
        """True when ``inst`` lies over the held placement."""
        return bool(self.gpu.model.profile(inst.profile).mask(inst.start) & self.mask)


class DynamigDrainAllocator(CutsForClaim):
    """dynamig with ``spec.drain``; see the module docstring for what is simulated."""

    name = "dynamig-drain"
    drains = True

    def __init__(self, cluster: Cluster, *args: object, drain: DrainSettings, **kw: object) -> None:
        self.settings = drain
        self._drains: dict[int, _Drain] = {}  # GPU position -> its drain (one per GPU)
        super().__init__(cluster, *args, **kw)
        self.drains_started = 0
        self.drains_expired = 0

    # -- what a draining GPU offers -----------------------------------------------------------------------
    def _kept(self, inst: Instance) -> bool:
        drain = self._drains.get(inst.gpu.pos)
        return super()._kept(inst) or (drain is not None and drain.over(inst))

    def held(self, gpu: Gpu) -> list[Instance]:
        held = super().held(gpu)
        drain = self._drains.get(gpu.pos)
        if drain is None:
            return held
        over = [i for i in held if drain.over(i)]
        if any(i.gpu.model.profile(i.profile).mask(i.start) & ~drain.mask for i in over):
            return held  # an instance over the placement reaches beyond it: it keeps the slices itself
        # the placement stands in for what lies over it, so that its free slices are offered to nobody;
        # never part of the cluster (it is not cut until the instances in its way end)
        slices = self.cluster.slices_of[(gpu.model.key, drain.profile)]
        standin = Instance(gpu, drain.profile, drain.start, slices, 0.0)
        return [i for i in held if i not in over] + [standin]

    # -- the drains ---------------------------------------------------------------------------------------
    def _end(self, drain: _Drain) -> None:
        del self._drains[drain.gpu.pos]
        self.touch([drain.gpu])

    def _drain_of(self, claim: str) -> _Drain | None:
        return next((d for d in self._drains.values() if d.claim == claim), None)

    def place(self, job: Job, now: float) -> Allocation | None:
        alloc = super().place(job, now)
        drain = self._drain_of(job.name)
        if alloc is not None and drain is not None:  # served elsewhere before its drain was done
            self._end(drain)
        return alloc

    def withdraw(self, job: Job, now: float) -> None:
        drain = self._drain_of(job.name)
        if drain is not None:
            self._end(drain)
        super().withdraw(job, now)

    def preempt(self, now: float, waiting: Sequence[Job]) -> Replan:
        """After each scheduling pass (the engine's hook for what frees room): end the holds that expired,
        cut the placements whose busy instances have ended, and drain for the jobs that starve."""
        s = self.settings
        readies: list[float] = []
        for drain in list(self._drains.values()):
            if drain.until <= now:
                self.drains_expired += 1
                self._end(drain)
            elif not any(i.job for i in drain.gpu.instances if drain.over(i)):
                # what ran there has ended: the claim's placement is cut and kept for it
                del self._drains[drain.gpu.pos]
                readies.append(self.cut_for(drain.claim, drain.gpu, drain.profile, drain.start, now))
        # oldest first, as the operator takes them (``waiting`` comes highest priority first)
        alone = sorted(
            (j for j in waiting if j.count == 1 and j.name not in self._claims), key=lambda j: j.arrival
        )
        draining = {d.claim for d in self._drains.values()}
        starving = [j for j in alone if now - j.arrival >= s.after_s and j.name not in draining]
        room = s.max_gpus - len(self._drains)
        if starving and room > 0:
            self._start_drains(starving, room, now)
        # asked again when the next waiting job starves or a hold expires, if nothing changes before
        later = [j.arrival + s.after_s for j in alone if j.arrival + s.after_s > now]
        later += [d.until for d in self._drains.values()]
        return Replan(tuple(readies), min(later, default=None))

    def _start_drains(self, starving: Sequence[Job], room: int, now: float) -> None:
        running = frozenset(i.job for g in self.cluster.gpus for i in g.instances if i.job)
        gpus = [
            GpuHolding(
                GpuKey(g.node, g.index),
                g.model.key,
                tuple(
                    # an instance kept but not by a job (being cut, reserved for a claim) never ends as far
                    # as a drain knows, as a pod the operator does not see
                    HeldInstance(i.placed, (i.job,) if i.job else (("held",) if self._kept(i) else ()))
                    for i in g.instances
                ),
            )
            for g in self.cluster.gpus
            if g.pos not in self._drains and g.instances
        ]
        by_key = {GpuKey(g.node, g.index): g for g in self.cluster.gpus}
        claims = [Preemptor(j.name, j.priority, j.alternatives, self._allowed_names(j)) for j in starving]
        for choice in choose_drains(claims, gpus, running, self.cluster.models, room):
            gpu = by_key[choice.gpu]
            mask = gpu.model.profile(choice.profile).mask(choice.start)
            self._drains[gpu.pos] = _Drain(
                choice.claim, gpu, choice.profile, choice.start, mask, now + self.settings.hold_s
            )
            self.drains_started += 1
            self.touch([gpu])
