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
that has a free device on some node wins, nodes tried in the run's node order (``NODE_ORDERS``, the same for
every policy; on a node the fixed layouts take the lowest-numbered GPU with a free instance); the devices of
a multi-device claim sit on one node, on distinct GPUs.
Allocators mutate their cluster (side effects); they never look at the future of the trace.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from dynamig.geometry.model import Layout
from dynamig.simulate.cluster import Cluster, Gpu, Instance
from dynamig.simulate.trace import Job, full_profile, preferred_on

# The scheduler's node order, applied alike to every policy of a run:
# "pack": nodes in use first (in node order), then idle nodes, smallest first (kube-scheduler with a
#   packing score, NodeResourcesFit MostAllocated, the configuration docs/install.md recommends);
# "spread": the least busy node first (kube-scheduler's default NodeResourcesFit LeastAllocated,
#   pkg/scheduler/apis/config/v1/defaults.go);
# "binpack": the busiest node first (HAMi's own default node policy; used for its labelled row).
NODE_ORDERS = ("pack", "spread", "binpack")


def check_node_order(node_order: str) -> str:
    """``node_order`` if it is one of ``NODE_ORDERS``. Raises ValueError otherwise."""
    if node_order not in NODE_ORDERS:
        raise ValueError(f"node_order must be one of {', '.join(NODE_ORDERS)}, not {node_order!r}")
    return node_order


def node_order_key(node_order: str, node: int, busy: int, size: int) -> tuple[int, ...]:
    """Sort key of ``node`` (``busy`` compute slices held, ``size`` GPUs) in ``node_order``: the
    scheduler tries the smallest first. Pure."""
    if node_order == "spread":  # LeastAllocated, on GPU slices; 840 is divisible by 1..8
        return (busy * 840 // size, node)
    if node_order == "binpack":  # the busiest node first
        return (-(busy * 840 // size), node)
    # nodes in use first, in node order (measured: ordering them busiest first packed no better and
    # served less on the fragmentation and heavy-tailed traces), then idle nodes smallest first, so
    # whole big nodes stay whole for multi-GPU claims
    return (0, node) if busy else (1, size, node)


@dataclass(frozen=True, slots=True)
class Allocation:
    slices: int  # compute slices held (what the job occupies, not what it asked for)
    instances: tuple[Instance, ...]
    node: int
    delay: float = 0.0  # seconds from allocation until the job can run (instance creation)
    gpus: tuple[Gpu, ...] = ()  # whole GPUs (MIG mode off) the job holds (``dynamig.simulate.modes``)


@dataclass(frozen=True, slots=True)
class Replan:
    """What a planning round changed: when new instances become usable, and when to try again."""

    ready_times: tuple[float, ...] = ()
    retry_at: float | None = None


class Allocator:
    """Base: a policy's name, its cluster, and the hooks the engine calls."""

    name = "base"
    replans = False  # True: the engine runs planning rounds (batched) while demand is pending
    # True: the engine asks ``preempt`` after each scheduling pass, and the queue is walked highest
    # priority first (kube-scheduler's PrioritySort); False: priorities are ignored, arrival order
    preempts = False
    # True: the engine asks ``preempt`` after each scheduling pass too, but walks the queue in arrival order
    # (a drain evicts nobody: dynamig.simulate.drain_policy)
    drains = False

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.reshapes = 0
        self.plan_calls = 0
        self._holding: set[str] = set()
        # set by the engine: evict(victim, now, preemptor) ends a running job, its work lost, and queues it
        # again (the allocator's ``release`` is called for it)
        self.evictor: Callable[[str, float, str], None] | None = None

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

    def preempt(self, now: float, waiting: Sequence[Job]) -> Replan:
        """Evict (through ``evictor``) to make room for ``waiting`` (highest priority first), after a
        scheduling pass left them waiting. ``ready_times``: instances created for them; ``retry_at``: when
        to ask again though nothing changed. Only for ``preempts`` and ``drains`` allocators."""
        return Replan()


class InstancePoolAllocator(Allocator):
    """Jobs take existing free, ready instances; released instances stay (they are not destroyed).
    Nodes are tried in ``node_order`` (the run's, as for every policy); on a node, the lowest-numbered GPU
    with a free instance, lowest start first."""

    def __init__(self, cluster: Cluster, node_order: str = "pack") -> None:
        super().__init__(cluster)
        self.node_order = check_node_order(node_order)
        self.node_busy = [0] * len(cluster.nodes)  # compute slices held per node
        self.node_size = [len(n) for n in cluster.nodes]
        self._version = [0] * len(cluster.nodes)
        # profile -> node -> its free instances of that profile
        self._free_by_node: dict[str, dict[int, set[Instance]]] = {}
        # lazy heaps of nodes with a free instance, (order key, node, version): per profile, and per
        # (profile, node GPU type) for jobs restricted to some types
        self._nodes: dict[str, list[tuple[tuple[int, ...], int, int]]] = {}
        self._nodes_typed: dict[tuple[str, str], list[tuple[tuple[int, ...], int, int]]] = {}

    def _push(self, inst: Instance) -> None:
        """``inst`` is free (again). Side effect: the indexes."""
        node = inst.gpu.node_pos
        self._free_by_node.setdefault(inst.profile, {}).setdefault(node, set()).add(inst)
        self._push_node(node, (inst.profile,))

    def _push_node(self, node: int, profiles: Iterable[str]) -> None:
        entry = (
            node_order_key(self.node_order, node, self.node_busy[node], self.node_size[node]),
            node,
            self._version[node],
        )
        kind = self.cluster.node_types[node]
        for profile in profiles:
            heapq.heappush(self._nodes.setdefault(profile, []), entry)
            heapq.heappush(self._nodes_typed.setdefault((profile, kind), []), entry)

    def _busy_changed(self, node: int, delta: int) -> None:
        """``delta`` compute slices were taken (or given back) on ``node``: its order key changed."""
        self.node_busy[node] += delta
        self._version[node] += 1
        self._push_node(node, [p for p, nodes in self._free_by_node.items() if nodes.get(node)])

    @staticmethod
    def _usable(inst: Instance, now: float) -> bool:
        return inst.alive and not inst.job and inst.ready_at <= now

    def free_count(self, profile: str, now: float) -> int:
        nodes = self._free_by_node.get(profile, {})
        return sum(1 for free in nodes.values() for i in free if self._usable(i, now))

    def _on_node(self, profile: str, node: int, now: float) -> Instance | None:
        """The node's first usable free instance of ``profile`` (lowest GPU, lowest start)."""
        free = [i for i in self._free_by_node.get(profile, {}).get(node, ()) if self._usable(i, now)]
        return min(free, key=lambda i: (i.gpu.pos, i.start)) if free else None

    def _head(
        self, heap: list[tuple[tuple[int, ...], int, int]] | None, profile: str, now: float
    ) -> tuple[tuple[int, ...], int] | None:
        """(order key, node) of the first node of ``heap`` with a usable free instance of ``profile``,
        dropping stale entries (re-pushed when the node changes). Side effect: pops them."""
        while heap:
            key, node, version = heap[0]
            if version == self._version[node] and self._on_node(profile, node, now) is not None:
                return key, node
            heapq.heappop(heap)
        return None

    def _first_free(self, profile: str, now: float, job: Job | None = None) -> Instance | None:
        if job is not None and job.gpu_types:  # restricted to some types: the best of their heaps' heads
            heads = [self._head(self._nodes_typed.get((profile, k)), profile, now) for k in job.gpu_types]
            found = [h for h in heads if h is not None]
            if not found:
                return None
            return self._on_node(profile, min(found)[1], now)
        head = self._head(self._nodes.get(profile), profile, now)
        return None if head is None else self._on_node(profile, head[1], now)

    def _free_on_one_node(
        self, profile: str, count: int, now: float, job: Job | None = None
    ) -> list[Instance] | None:
        nodes = self._free_by_node.get(profile, {})
        order = sorted(
            (n for n, free in nodes.items() if len(free) >= count),
            key=lambda n: node_order_key(self.node_order, n, self.node_busy[n], self.node_size[n]),
        )
        for node in order:
            if job is not None and not self.cluster.allows(job, node):
                continue
            by_gpu: dict[int, Instance] = {}
            for inst in sorted(nodes[node], key=lambda i: (i.gpu.pos, i.start)):
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
                node = chosen[0].gpu.node_pos
                slices = sum(i.slices for i in chosen)
                self._busy_changed(node, slices)
                return Allocation(slices, tuple(chosen), node)
        return None

    def _release(self, job: Job, alloc: Allocation, now: float) -> None:
        for inst in alloc.instances:
            self.cluster.release(inst, now)
            if inst.alive:
                self._free_by_node.setdefault(inst.profile, {}).setdefault(inst.gpu.node_pos, set()).add(inst)
        self._busy_changed(alloc.node, -alloc.slices)


class StaticAllocator(InstancePoolAllocator):
    """Fixed MIG layouts: ``layouts[i]`` is cut on GPU ``i`` (cycled) before the first job, never changed.
    On a cluster of several models ``layouts`` maps a model key to its layouts, cycled over the GPUs of
    that model in cluster order."""

    name = "static"

    def __init__(
        self,
        cluster: Cluster,
        layouts: Sequence[Layout] | Mapping[str, Sequence[Layout]],
        label: str,
        node_order: str = "pack",
    ) -> None:
        super().__init__(cluster, node_order)
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

    def __init__(self, cluster: Cluster, node_order: str = "pack") -> None:
        super().__init__(cluster, node_order)
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
    profile's slices from one node's pool, nodes tried in ``node_order`` (the run's)."""

    name = "pool (no placement rules)"

    def __init__(self, cluster: Cluster, node_order: str = "pack") -> None:
        super().__init__(cluster)
        self.node_order = check_node_order(node_order)
        self._size = [sum(g.model.compute_slices for g in node) for node in cluster.nodes]
        self._gpus = [len(node) for node in cluster.nodes]
        self._free = list(self._size)
        self._total_free = sum(self._free)
        self._busy = 0
        self._model = {i: node[0].model for i, node in enumerate(cluster.nodes) if node}
        self._need: dict[tuple[tuple[str, ...], int, str], int | None] = {}  # (alternatives, count, model)
        # nodes in node order, with their keys (kept sorted: a node moves when what it holds changes)
        self._keys = sorted(self._key(n) for n in range(len(self._free)))
        self._order = [key[-1] for key in self._keys]

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

    def _key(self, node: int) -> tuple[int, ...]:
        return node_order_key(self.node_order, node, self._size[node] - self._free[node], self._gpus[node])

    def _take(self, node: int, slices: int) -> None:
        """``slices`` taken from ``node``'s pool (negative: given back); the node moves in the order."""
        old = self._key(node)
        self._free[node] -= slices
        self._total_free -= slices
        self._busy += slices
        new = self._key(node)
        if new != old:
            i = bisect.bisect_left(self._keys, old)
            del self._keys[i], self._order[i]
            j = bisect.bisect_left(self._keys, new)
            self._keys.insert(j, new)
            self._order.insert(j, node)

    def _place(self, job: Job, now: float) -> Allocation | None:
        for node in self._order:
            free = self._free[node]
            if free <= 0 or not self.cluster.allows(job, node):
                continue
            need = self._need_on(job, node)
            if need is None:
                continue
            if need > self._total_free:
                return None  # (equal-size alternatives on every model: no other node needs less)
            if free >= need:
                self._take(node, need)
                return Allocation(need, (), node)
        return None

    def _release(self, job: Job, alloc: Allocation, now: float) -> None:
        self._take(alloc.node, -alloc.slices)
