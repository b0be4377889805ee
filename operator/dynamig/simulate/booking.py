"""Policies where a node publishes bookable MIG placements and the scheduler books one (DRA style).

``OfferAllocator`` is the common machinery: per profile it indexes which nodes can offer a device now
(a free instance, or a placement that can be created), the policy orders nodes and a node's offers, the
scheduler takes the first that matches, and a booked placement is created after a binding round trip and
a create latency (creates on one node one after another where the driver serializes them).

Peers, modelled from their documented behaviour:

- ``NvidiaDynamicMigAllocator``: NVIDIA's DRA driver for GPUs with dynamic MIG
  (github.com/NVIDIA/k8s-dra-driver-gpu, "DynamicMIG" feature): every MIG placement that fits is
  published as a device, in device-name order; the scheduler takes the first match; the instance is
  created when the claim is prepared on the node and destroyed when it is unprepared; the kubelet plugin
  prepares one claim at a time per node; nothing is ever repacked.
- ``HamiReserveAllocator``: HAMi's dynamic MIG mode (github.com/Project-HAMi/HAMi, "dynamic-mig"
  support for NVIDIA GPUs): the scheduler scores devices and reserves a specific placement on a GPU,
  preferring the one that keeps the most placements possible (fragmentation-aware) on the busiest GPU;
  the instance is created at allocation and destroyed once idle.

The dynamig policy (``dynamig.simulate.dynamig_policy``) builds on the same machinery.
Allocators mutate their cluster (side effects); they never look at the future of the trace.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from dynamig.geometry.layout import free_starts
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, normalize_layout
from dynamig.simulate.allocators import Allocation, Allocator
from dynamig.simulate.cluster import Cluster, Gpu, Instance
from dynamig.simulate.trace import Job, plain_profiles


@dataclass(frozen=True, slots=True)
class Offer:
    """One bookable device: an existing free instance (``inst``) or a placement to create."""

    gpu: Gpu
    profile: str
    start: int
    inst: Instance | None = None
    destroys: tuple[Instance, ...] = ()  # free instances removed to make room (re-cut)


class OfferAllocator(Allocator):
    """Booking of published devices; subclasses decide what is offered and in which order."""

    keeps_free = False  # True: an instance outlives its job and is offered again
    binds_free = False  # True: booking an existing instance also waits for the node agent's binding answer

    def __init__(
        self,
        cluster: Cluster,
        create_latency_s: float = 0.0,
        bind_rtt_s: float = 0.0,
        *,
        serialize_creates: bool = True,
    ) -> None:
        super().__init__(cluster)
        self.latency = create_latency_s
        self.bind = bind_rtt_s
        self.serialize = serialize_creates
        self.profiles = tuple(sorted({p.name for m in cluster.models.values() for p in plain_profiles(m)}))
        self._node_free_at = [0.0] * len(cluster.nodes)  # when the node's next create may start
        self._can: list[frozenset[str]] = [frozenset()] * len(cluster.gpus)  # profiles each GPU offers
        self._hosts: dict[str, dict[int, int]] = {p: {} for p in self.profiles}  # node -> GPUs offering
        self._heap: dict[str, list[tuple[tuple[int, ...], int, int]]] = {p: [] for p in self.profiles}
        self._version = [0] * len(cluster.nodes)
        self._starts: dict[tuple[str, Layout, str], tuple[int, ...]] = {}
        self.node_busy = [0] * len(cluster.nodes)  # compute slices held per node
        self.node_size = [len(n) for n in cluster.nodes]
        for gpu in cluster.gpus:
            self._touch_gpu(gpu)
        for node in range(len(cluster.nodes)):
            self._push_node(node)

    # -- what a GPU offers (subclasses refine) -----------------------------------------------------------
    def held(self, gpu: Gpu) -> list[Instance]:
        """Instances that stay whatever is booked (allocated, or otherwise not offered)."""
        return list(gpu.instances) if not self.keeps_free else [i for i in gpu.instances if i.job]

    def free(self, gpu: Gpu) -> list[Instance]:
        """Free instances offered as they are (and removable to make room)."""
        return [] if not self.keeps_free else [i for i in gpu.instances if not i.job]

    def starts(self, model: GpuModel, layout: Layout, profile: str) -> tuple[int, ...]:
        """Starts where ``profile`` can be created beside ``layout`` (memoised). Pure."""
        key = (model.key, layout, profile)
        got = self._starts.get(key)
        if got is None:
            # a GPU offers plain profiles of its own model only (see ``Cluster.offers``)
            got = (
                tuple(free_starts(model, layout, profile)) if profile in self.cluster.plain[model.key] else ()
            )
            self._starts[key] = got
        return got

    def _offerable(self, gpu: Gpu) -> frozenset[str]:
        held = normalize_layout([i.placed for i in self.held(gpu)])
        out = {i.profile for i in self.free(gpu)}
        out.update(p for p in self.profiles if p not in out and self.starts(gpu.model, held, p))
        return frozenset(out)

    # -- node order (subclasses refine) ------------------------------------------------------------------
    def node_key(self, node: int, profile: str) -> tuple[int, ...]:
        """Order in which the scheduler tries nodes for ``profile`` (smallest first)."""
        return (node,)

    def node_offers(self, node: int, profile: str, job: Job, now: float) -> list[Offer]:
        """The node's offers of ``profile`` in the order the scheduler books them."""
        raise NotImplementedError

    def skip_node(self, node: int, job: Job, profile: str) -> bool:
        """True: ``node`` does not offer ``profile`` to ``job`` now (beyond GPU-type constraints)."""
        return False

    # -- index maintenance ---------------------------------------------------------------------------------
    def _touch_gpu(self, gpu: Gpu) -> None:
        new = self._offerable(gpu)
        old = self._can[gpu.pos]
        if new == old:
            return
        for p in old - new:
            left = self._hosts[p][gpu.node_pos] - 1
            if left:
                self._hosts[p][gpu.node_pos] = left
            else:
                del self._hosts[p][gpu.node_pos]
        for p in new - old:
            self._hosts[p][gpu.node_pos] = self._hosts[p].get(gpu.node_pos, 0) + 1
        self._can[gpu.pos] = new

    def _push_node(self, node: int) -> None:
        self._version[node] += 1
        v = self._version[node]
        for p in self.profiles:
            if node in self._hosts[p]:
                heapq.heappush(self._heap[p], (self.node_key(node, p), node, v))

    def touch(self, gpus: Sequence[Gpu], *, republish: bool = True) -> None:
        """Re-index ``gpus`` after their state changed (and their nodes' order keys). ``republish``:
        False when only a booking changed them (the node's published list stays until it republishes)."""
        for gpu in gpus:
            self._touch_gpu(gpu)
        for node in sorted({g.node_pos for g in gpus}):
            self._push_node(node)

    def first_node(self, profile: str, count: int, job: Job) -> int | None:
        """The best node that can offer ``count`` devices of ``profile`` to ``job`` (lazy heap)."""
        hosts = self._hosts[profile]
        heap = self._heap[profile]
        found: int | None = None
        keep: list[tuple[tuple[int, ...], int, int]] = []
        while heap:
            entry = heapq.heappop(heap)
            _, node, v = entry
            if v != self._version[node] or node not in hosts:
                continue  # stale; the node's current entry is elsewhere in the heap
            keep.append(entry)
            if (
                hosts[node] >= count
                and self.cluster.allows(job, node)
                and not self.skip_node(node, job, profile)
            ):
                found = node
                break
        for entry in keep:
            heapq.heappush(heap, entry)
        return found

    # -- booking -------------------------------------------------------------------------------------------
    def choose(self, job: Job, now: float) -> list[Offer] | None:
        """The offers the scheduler books for ``job``: alternatives in order, first node that fits."""
        for profile in job.alternatives:
            if profile not in self._hosts or not self._hosts[profile]:
                continue
            node = self.first_node(profile, job.count, job)
            if node is None:
                continue
            picked: list[Offer] = []
            used: set[int] = set()
            for offer in self.node_offers(node, profile, job, now):
                if offer.gpu.pos in used:
                    continue
                picked.append(offer)
                used.add(offer.gpu.pos)
                if len(picked) == job.count:
                    return picked
        return None

    def _place(self, job: Job, now: float) -> Allocation | None:
        picked = self.choose(job, now)
        if picked is None:
            return None
        return self.book(job, picked, now)

    def book(self, job: Job, picked: Sequence[Offer], now: float) -> Allocation:
        """Take ``picked`` for ``job``: assign free instances, create the placements. Side effect: state."""
        insts: list[Instance] = []
        ready = now
        for offer in picked:
            if offer.inst is not None:
                inst = offer.inst
                if self.binds_free:
                    ready = max(ready, now + self.bind)
            else:
                for old in offer.destroys:
                    self.cluster.destroy(old, now)
                if offer.destroys:
                    self.reshapes += 1  # a re-cut: free instances made way for the booked placement
                node = offer.gpu.node_pos
                begin = now + self.bind
                if self.serialize:
                    begin = max(begin, self._node_free_at[node])
                    self._node_free_at[node] = begin + self.latency
                done = begin + self.latency
                inst = self.cluster.create(offer.gpu, offer.profile, offer.start, now, done)
                ready = max(ready, done)
            self.cluster.assign(inst, job.name, now)
            self.node_busy[inst.gpu.node_pos] += inst.slices
            insts.append(inst)
        # a re-cut destroyed instances: the agent republishes the node; other bookings use the list as is
        self.touch([i.gpu for i in insts], republish=any(o.destroys for o in picked))
        return Allocation(sum(i.slices for i in insts), tuple(insts), insts[0].gpu.node_pos, ready - now)

    def _release(self, job: Job, alloc: Allocation, now: float) -> None:
        for inst in alloc.instances:
            self.cluster.release(inst, now)
            self.node_busy[inst.gpu.node_pos] -= inst.slices
            if not self.keeps_free:
                self.cluster.destroy(inst, now)
        self.touch([i.gpu for i in alloc.instances])


def _device_name(gpu: Gpu, profile: str, start: int) -> str:
    return f"gpu-{gpu.index}-mig-{profile}-{start}"


class NvidiaDynamicMigAllocator(OfferAllocator):
    """Every fitting placement published in device-name order; created at prepare, destroyed at
    unprepare; one prepare at a time per node; no repacking (see the module docstring for the source)."""

    name = "nvidia-dynamic-mig"

    def node_offers(self, node: int, profile: str, job: Job, now: float) -> list[Offer]:
        out: list[tuple[str, Offer]] = []
        for gpu in self.cluster.nodes[node]:
            if profile not in self._can[gpu.pos]:
                continue
            for start in self.starts(gpu.model, gpu.layout(), profile):
                out.append((_device_name(gpu, profile, start), Offer(gpu, profile, start)))
        out.sort(key=lambda x: x[0])
        return [o for _, o in out]


class HamiReserveAllocator(OfferAllocator):
    """A specific placement reserved by a fragmentation-aware score: on the most-used GPU that fits
    (binpack), the start that leaves the most placements creatable; created at allocation, destroyed when
    idle."""

    name = "hami-reserve"

    def __init__(self, cluster: Cluster, create_latency_s: float = 0.0, bind_rtt_s: float = 0.0) -> None:
        self._score: dict[tuple[str, Layout, str], tuple[int, int]] = {}
        super().__init__(cluster, create_latency_s, bind_rtt_s, serialize_creates=False)

    def _best(self, gpu: Gpu, profile: str) -> tuple[int, int] | None:
        """(placements left creatable after it, start) of the best start for ``profile``; memoised."""
        layout = gpu.layout()
        key = (gpu.model.key, layout, profile)
        got = self._score.get(key)
        if got is None:
            best: tuple[int, int] | None = None
            for start in self.starts(gpu.model, layout, profile):
                after = normalize_layout([*layout, PlacedInstance(start, profile)])
                left = sum(len(self.starts(gpu.model, after, p)) for p in self.profiles)
                if best is None or left > best[0]:
                    best = (left, start)
            got = best if best is not None else (-1, -1)
            self._score[key] = got
        return None if got[1] < 0 else got

    def _gpu_key(self, gpu: Gpu, profile: str) -> tuple[int, int, int] | None:
        best = self._best(gpu, profile)
        if best is None:
            return None
        return (-gpu.busy_slices, -best[0], gpu.index)

    def node_key(self, node: int, profile: str) -> tuple[int, ...]:
        keys = [k for g in self.cluster.nodes[node] if (k := self._gpu_key(g, profile)) is not None]
        return (*min(keys), node) if keys else (0, 0, 0, node)

    def node_offers(self, node: int, profile: str, job: Job, now: float) -> list[Offer]:
        ranked = []
        for gpu in self.cluster.nodes[node]:
            key = self._gpu_key(gpu, profile)
            best = self._best(gpu, profile)
            if key is not None and best is not None:
                ranked.append((key, Offer(gpu, profile, best[1])))
        ranked.sort(key=lambda x: x[0])
        return [o for _, o in ranked]
