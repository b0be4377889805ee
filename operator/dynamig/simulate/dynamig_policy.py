"""dynamig as a simulated policy: the real planner (``dynamig.planner.plan``) re-cuts free space for demand.

What the simulation does, as the operator and agents would:

- Jobs take free, ready instances first (the scheduler allocating against published devices); instances
  are kept when jobs end, so they serve the next job of that shape with no reshape.
- Jobs that do not fit become pending demand. Demand is batched for a window, then one planning round
  runs ``plan()`` over the GPUs that may change: not reshaping, out of cooldown, with some free space.
- A GPU whose layout changes loses its removed (free) instances at once; the new instances become usable
  ``reshape_latency_s`` later, and a node's agent reshapes its GPUs one after another, so the k-th GPU
  reshaped on a node in a round is ready after k times the latency. A reshaped GPU is left alone for
  ``cooldown_s``. Claims the round placed on reshaping GPUs are not planned again until those finish.
- Warm pool and baseline come from the ``Policy`` and are applied by the planner itself.

For speed on large clusters the round sees every partly used GPU with free space but only as many idle
GPUs (whole nodes at a time, in node order) as the pending devices and the warm pool could need: idle GPUs
with the same layout are interchangeable, so the planner's answer does not depend on the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.model import Layout
from dynamig.planner import ClaimDemand, CurrentInstance, GpuState, Policy, plan
from dynamig.simulate.allocators import InstancePoolAllocator, Replan
from dynamig.simulate.cluster import Cluster, Gpu, Instance
from dynamig.simulate.trace import Job, plain_profiles


class DynamigAllocator(InstancePoolAllocator):
    """Planner-driven reshaping; see the module docstring for what is simulated."""

    name = "dynamig"
    replans = True

    def __init__(
        self,
        cluster: Cluster,
        policy: Policy,
        *,
        reshape_latency_s: float,
        cooldown_s: float,
        initial: Layout = (),
        max_claims: int = 2000,
        catalog: Catalog | None = None,
    ) -> None:
        super().__init__(cluster)
        self.policy = policy
        self.latency = reshape_latency_s
        self.cooldown = cooldown_s
        self.max_claims = max_claims
        self.catalog = catalog
        self._not_ready: list[Instance] = []
        self._inflight: dict[str, float] = {}  # claim -> when the instances planned for it are ready
        self._profiles = {p.name for m in cluster.models.values() for p in plain_profiles(m)}
        for gpu in cluster.gpus:
            for placed in initial:
                self._push(cluster.create(gpu, placed.profile, placed.start, 0.0, 0.0))

    # -- engine hooks --------------------------------------------------------------------------------------
    def on_ready(self, now: float) -> None:
        still: list[Instance] = []
        for inst in self._not_ready:
            if not inst.alive:
                continue
            if inst.ready_at <= now:
                self._push(inst)
            else:
                still.append(inst)
        self._not_ready = still
        self._inflight = {c: t for c, t in self._inflight.items() if t > now}

    def wants_plan(self, now: float) -> bool:
        return any(self.free_count(p, now) < n for p, n in self.policy.warm_pool.items())

    def replan(self, now: float, pending: Sequence[Job]) -> Replan:
        claims = [
            ClaimDemand(job.name, job.alternatives, job.count)
            for job in pending
            if job.name not in self._inflight
        ][: self.max_claims]
        if not claims and not self.wants_plan(now):
            return Replan()
        gpus, cooling = self._candidates(now, claims)
        if not gpus:
            return Replan(retry_at=cooling)
        self.plan_calls += 1
        states = [
            GpuState(
                g.node,
                g.index,
                g.model.key,
                tuple(
                    CurrentInstance(i.profile, i.start, busy=bool(i.job))
                    for i in sorted(g.instances, key=lambda i: (i.start, i.profile))
                ),
            )
            for g in gpus
        ]
        result = plan(states, claims, self.policy, self.catalog)
        by_key = {(g.node, g.index): g for g in gpus}
        per_node: dict[str, int] = {}
        ready_of: dict[tuple[str, int], float] = {}
        for gp in result.gpus:
            if not gp.changed:
                continue
            gpu = by_key[(gp.node, gp.index)]
            per_node[gp.node] = per_node.get(gp.node, 0) + 1
            ready = now + self.latency * per_node[gp.node]
            ready_of[(gp.node, gp.index)] = ready
            self._apply(gpu, gp.layout, now, ready)
        for a in result.assignments:
            when = ready_of.get((a.node, a.index))
            if when is not None:
                self._inflight[a.claim] = max(self._inflight.get(a.claim, 0.0), when)
        retry = cooling if result.unsatisfied else None
        return Replan(tuple(sorted(set(ready_of.values()))), retry)

    # -- helpers -------------------------------------------------------------------------------------------
    def _apply(self, gpu: Gpu, layout: Layout, now: float, ready: float) -> None:
        """Turn ``gpu``'s instances into ``layout``: destroy the removed ones, create the new ones."""
        target = set(layout)
        current = {i.placed: i for i in gpu.instances}
        for placed, inst in current.items():
            if placed not in target:
                self.cluster.destroy(inst, now)  # the planner only removes free instances; the log proves it
        for placed in layout:
            if placed not in current:
                self._not_ready.append(self.cluster.create(gpu, placed.profile, placed.start, now, ready))
        gpu.cooldown_until = now + self.cooldown
        self.reshapes += 1

    def _has_room(self, gpu: Gpu) -> bool:
        if any(not i.job for i in gpu.instances):
            return True
        return any(self.cluster.free_starts(gpu, p) for p in self._profiles if gpu.model.has_profile(p))

    def _candidates(self, now: float, claims: Sequence[ClaimDemand]) -> tuple[list[Gpu], float | None]:
        """GPUs the round may use, and the earliest time a GPU now in cooldown becomes eligible."""
        cooling: float | None = None
        busy: list[Gpu] = []
        idle_nodes: dict[int, list[Gpu]] = {}
        for gpu in self.cluster.gpus:
            if gpu.reshaping(now):
                continue
            if gpu.cooldown_until > now:
                cooling = gpu.cooldown_until if cooling is None else min(cooling, gpu.cooldown_until)
                continue
            if gpu.busy_slices:
                if self._has_room(gpu):
                    busy.append(gpu)
            else:
                idle_nodes.setdefault(gpu.node_pos, []).append(gpu)
        # idle GPUs in node order until the single devices and the warm pool are covered, plus, for each
        # multi-device claim, one node with that many idle GPUs
        need = sum(c.count for c in claims if c.count == 1) + sum(self.policy.warm_pool.values())
        multi = sorted((c.count for c in claims if c.count > 1), reverse=True)
        idle: list[Gpu] = []
        for node in sorted(idle_nodes):
            gpus = idle_nodes[node]
            fits = next((i for i, n in enumerate(multi) if n <= len(gpus)), None)
            if fits is not None:
                multi.pop(fits)
            elif len(idle) >= need:
                if not multi:
                    break
                continue
            idle.extend(gpus)
        return sorted(busy + idle, key=lambda g: g.pos), cooling
