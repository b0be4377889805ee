"""The policies the simulator compares, each as an allocator over one ``Cluster``.

- ``WholeGpuAllocator``: no MIG; every device request takes a whole GPU.
- ``StaticAllocator``: MIG layouts fixed up front; jobs take free instances of an acceptable profile.
- ``FirstFitAllocator`` (in ``dynamig.simulate.booking``, with the peers): per-request slicing without
  repacking.
- ``DynamigAllocator`` (in ``dynamig.simulate.dynamig_policy``): instances are kept, the planner re-cuts
  free space for pending demand.
- ``PoolAllocator``: ignores placement rules; each node is a pool of compute slices (the reference that
  shows what placement rules cost).

Jobs are placed the way the Kubernetes scheduler allocates DRA claims: alternatives in order, the first
that has a free device anywhere wins (the fixed layouts here: the lowest-numbered GPU with a free instance;
the booking policies follow the run's node order); the devices of a multi-device claim sit on one node, on
distinct GPUs.
Allocators mutate their cluster (side effects); they never look at the future of the trace.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dynamig.geometry.model import Layout
from dynamig.simulate.cluster import Cluster, Instance
from dynamig.simulate.trace import Job, full_profile, preferred_on


@dataclass(frozen=True, slots=True)
class Allocation:
    slices: int  # compute slices held (what the job occupies, not what it asked for)
    instances: tuple[Instance, ...]
    node: int
    delay: float = 0.0  # seconds from allocation until the job can run (instance creation)


@dataclass(frozen=True, slots=True)
class Replan:
    """What a planning round changed: when new instances become usable, and when to try again."""

    ready_times: tuple[float, ...] = ()
    retry_at: float | None = None


class Allocator:
    """Base: a policy's name, its cluster, and the hooks the engine calls."""

    name = "base"
    replans = False  # True: the engine runs planning rounds (batched) while demand is pending

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.reshapes = 0
        self.plan_calls = 0
        self._holding: set[str] = set()

    @property
    def total_slices(self) -> int:
        return self.cluster.total_slices

    def busy_slices(self) -> int:
        return self.cluster.busy_slices

    def place(self, job: Job, now: float) -> Allocation | None:
        """Allocate devices for ``job`` now, or None. Side effect: the cluster state."""
        alloc = self._place(job, now)
        if alloc is not None:
            self._holding.add(job.name)
        return alloc

    def release(self, job: Job, alloc: Allocation, now: float) -> None:
        """``job`` ended. Side effect: the cluster state."""
        self._holding.discard(job.name)
        self._release(job, alloc, now)

    def placed_jobs(self) -> frozenset[str]:
        return frozenset(self._holding)

    def _place(self, job: Job, now: float) -> Allocation | None:
        raise NotImplementedError

    def _release(self, job: Job, alloc: Allocation, now: float) -> None:
        raise NotImplementedError

    def on_ready(self, now: float) -> None:
        """Instances created by a reshape became usable at ``now``."""

    def set_pending(self, jobs: Iterable[Job]) -> None:
        """The jobs waiting now, before a scheduling pass (for policies that keep room for them)."""

    def observe_arrival(self, job: Job, now: float) -> None:
        """``job`` arrived at ``now`` (before its scheduling pass): policies that learn from the past."""

    def warm_pool_coverage(self, horizon: float) -> dict[str, tuple[float, float]]:
        """Per profile: (share of the horizon with a warm-pool target > 0, time-mean target); {}: none."""
        return {}

    def withdraw(self, job: Job, now: float) -> None:
        """``job`` stopped waiting (gave up) before it was placed."""

    def replan(self, now: float, pending: Sequence[Job]) -> Replan:
        return Replan()

    def wants_plan(self, now: float) -> bool:
        """True when a planning round is due even without pending jobs (e.g. warm pool below minimum)."""
        return False


class InstancePoolAllocator(Allocator):
    """Jobs take existing free, ready instances; released instances stay (they are not destroyed)."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster)
        self._seq = itertools.count()
        self._free: dict[str, list[tuple[int, int, int, Instance]]] = {}
        # the same per (profile, node GPU type), for jobs restricted to some types
        self._free_typed: dict[tuple[str, str], list[tuple[int, int, int, Instance]]] = {}
        # profile -> node -> its free instances of that profile (for multi-GPU claims, which need one node)
        self._free_by_node: dict[str, dict[int, set[Instance]]] = {}

    def _push(self, inst: Instance) -> None:
        entry = (inst.gpu.pos, inst.start, next(self._seq), inst)
        heapq.heappush(self._free.setdefault(inst.profile, []), entry)
        kind = self.cluster.node_types[inst.gpu.node_pos]
        heapq.heappush(self._free_typed.setdefault((inst.profile, kind), []), entry)
        self._free_by_node.setdefault(inst.profile, {}).setdefault(inst.gpu.node_pos, set()).add(inst)

    @staticmethod
    def _usable(inst: Instance, now: float) -> bool:
        return inst.alive and not inst.job and inst.ready_at <= now

    def free_count(self, profile: str, now: float) -> int:
        return sum(1 for e in self._free.get(profile, ()) if self._usable(e[3], now))

    def _first_free(self, profile: str, now: float, job: Job | None = None) -> Instance | None:
        if job is not None and job.gpu_types:  # restricted to some types: the first of their heaps' heads
            heads = [self._head(self._free_typed.get((profile, kind)), now) for kind in job.gpu_types]
            found = [h for h in heads if h is not None]
            return min(found, key=lambda i: (i.gpu.pos, i.start)) if found else None
        return self._head(self._free.get(profile), now)

    def _head(self, heap: list[tuple[int, int, int, Instance]] | None, now: float) -> Instance | None:
        """The first usable instance of ``heap``, dropping stale entries. Side effect: pops them."""
        while heap:
            inst = heap[0][3]
            if self._usable(inst, now):
                return inst
            heapq.heappop(heap)  # stale: destroyed or held; re-pushed when it becomes free again
        return None

    def _free_on_one_node(
        self, profile: str, count: int, now: float, job: Job | None = None
    ) -> list[Instance] | None:
        nodes = self._free_by_node.get(profile, {})
        for node in sorted(nodes):
            free = nodes[node]
            if len(free) < count or (job is not None and not self.cluster.allows(job, node)):
                continue
            by_gpu: dict[int, Instance] = {}
            for inst in sorted(free, key=lambda i: (i.gpu.pos, i.start)):
                if self._usable(inst, now):
                    by_gpu.setdefault(inst.gpu.pos, inst)
            if len(by_gpu) >= count:
                return list(by_gpu.values())[:count]
        return None

    def alternatives(self, job: Job) -> tuple[str, ...]:
        return job.alternatives

    def _place(self, job: Job, now: float) -> Allocation | None:
        for profile in self.alternatives(job):
            if job.count == 1:
                inst = self._first_free(profile, now, job)
                chosen = None if inst is None else [inst]
            else:
                chosen = self._free_on_one_node(profile, job.count, now, job)
            if chosen:
                for inst in chosen:
                    self.cluster.assign(inst, job.name, now)
                    self._free_by_node[inst.profile][inst.gpu.node_pos].discard(inst)
                return Allocation(sum(i.slices for i in chosen), tuple(chosen), chosen[0].gpu.node_pos)
        return None

    def _release(self, job: Job, alloc: Allocation, now: float) -> None:
        for inst in alloc.instances:
            self.cluster.release(inst, now)
            if inst.alive:
                self._push(inst)


class StaticAllocator(InstancePoolAllocator):
    """Fixed MIG layouts: ``layouts[i]`` is cut on GPU ``i`` (cycled) before the first job, never changed.
    On a cluster of several models ``layouts`` maps a model key to its layouts, cycled over the GPUs of
    that model in cluster order."""

    name = "static"

    def __init__(
        self, cluster: Cluster, layouts: Sequence[Layout] | Mapping[str, Sequence[Layout]], label: str
    ) -> None:
        super().__init__(cluster)
        self.name = f"static:{label}"
        if isinstance(layouts, Mapping):
            cycles = {key: itertools.cycle(lays) for key, lays in layouts.items() if lays}
            per_gpu = [next(cycles[g.model.key]) for g in cluster.gpus]
        else:
            per_gpu = [lay for _, lay in zip(cluster.gpus, itertools.cycle(layouts), strict=False)]
        for gpu, layout in zip(cluster.gpus, per_gpu, strict=True):
            for placed in layout:
                if not gpu.model.has_profile(placed.profile):
                    raise ValueError(f"static layout: {gpu.model.key} has no profile {placed.profile}")
                self._push(cluster.create(gpu, placed.profile, placed.start, 0.0, 0.0))


class WholeGpuAllocator(InstancePoolAllocator):
    """No MIG: each GPU is one device; a job's every device takes a whole GPU whatever it asked for."""

    name = "whole-gpu"

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster)
        self._full: dict[str, str] = {key: full_profile(m).name for key, m in cluster.models.items()}
        for gpu in cluster.gpus:
            self._push(cluster.create(gpu, self._full[gpu.model.key], 0, 0.0, 0.0))
        self._whole = tuple(sorted(set(self._full.values())))
        self._by_alternatives: dict[tuple[str, ...], tuple[str, ...]] = {}

    def alternatives(self, job: Job) -> tuple[str, ...]:
        if len(self._full) == 1:
            return self._whole
        # several models: the whole GPUs of the models the job accepts, in the job's order of preference
        got = self._by_alternatives.get(job.alternatives)
        if got is None:
            ranked = []
            for m in self.cluster.models.values():
                plain = self.cluster.plain[m.key]
                first = next((i for i, a in enumerate(job.alternatives) if a in plain), None)
                if first is not None:
                    ranked.append((first, m.memory_mib, m.key))
            got = tuple(dict.fromkeys(self._full[key] for _, _, key in sorted(ranked))) or self._whole
            self._by_alternatives[job.alternatives] = got
        return got


class PoolAllocator(Allocator):
    """No placement rules: a node is a pool of compute slices; a job takes ``count`` x its preferred
    profile's slices from one node's pool."""

    name = "pool (no placement rules)"

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster)
        self._free = [sum(g.model.compute_slices for g in node) for node in cluster.nodes]
        self._total_free = sum(self._free)
        self._busy = 0
        self._model = {i: node[0].model for i, node in enumerate(cluster.nodes) if node}
        self._need: dict[tuple[tuple[str, ...], int, str], int | None] = {}  # (alternatives, count, model)

    def _need_on(self, job: Job, node: int) -> int | None:
        """Compute slices ``job`` takes from ``node``'s pool: ``count`` x the slices of its first
        alternative the node's model offers (its preferred profile on a one-model cluster); None: none."""
        model = self._model[node]
        key = (job.alternatives, job.count, model.key)
        if key not in self._need:
            profile = preferred_on(job, model)
            self._need[key] = (
                None if profile is None else job.count * self.cluster.slices_of[(model.key, profile)]
            )
        return self._need[key]

    def busy_slices(self) -> int:
        return self._busy

    def busy_gpus_estimate(self) -> int:
        """GPUs' worth of busy slices, rounded up per node (the pool has no GPUs of its own)."""
        out = 0
        for node, free in enumerate(self._free):
            size = self.cluster.nodes[node][0].model.compute_slices
            out += -(-(sum(g.model.compute_slices for g in self.cluster.nodes[node]) - free) // size)
        return out

    def _place(self, job: Job, now: float) -> Allocation | None:
        for node, free in enumerate(self._free):
            if free <= 0 or not self.cluster.allows(job, node):
                continue
            need = self._need_on(job, node)
            if need is None:
                continue
            if need > self._total_free:
                return None  # (equal-size alternatives on every model: no other node needs less)
            if free >= need:
                self._free[node] -= need
                self._total_free -= need
                self._busy += need
                return Allocation(need, (), node)
        return None

    def _release(self, job: Job, alloc: Allocation, now: float) -> None:
        self._free[alloc.node] += alloc.slices
        self._total_free += alloc.slices
        self._busy -= alloc.slices
