"""Policies where a node publishes bookable MIG placements and the scheduler books one (DRA style).

``OfferAllocator`` is the common machinery: per profile it indexes which nodes can offer a device now
(a free instance, or a placement that can be created), the scheduler tries nodes in one node order shared
by every policy of a run (``NODE_ORDERS``), takes the first device that matches in the order the node
offers them, and a booked placement is created after the create latency (creates on one node one after
another where the driver serializes them). What each policy waits after the scheduler allocated is what
its real system charges:

- ``FirstFitAllocator``: the reference for per-request slicing: the first free valid placement (GPUs of
  the node in order, lowest start), created when allocated, running once created, destroyed at the end.
- ``NvidiaDynamicMigAllocator``: NVIDIA's DRA driver with the DynamicMIG feature gate
  (github.com/NVIDIA/k8s-dra-driver-gpu, at 22407113): its devices carry no binding conditions, so the
  pod is bound at once; the instance is created in NodePrepareResources (``createMigDevice`` in
  ``prepareDevices``, cmd/gpu-kubelet-plugin/device_state.go:867) and the container runs after it;
  prepares never interleave on a node (the node-global ``pu.lock`` taken by ``nodePrepareResource``,
  cmd/gpu-kubelet-plugin/driver.go:43-46 and 381), so creates on a node queue behind each other. Every
  placement that fits is published as a device, in device-name order (``gpu-%d-mig-%s-%d-%d``: GPU minor,
  profile, profile ID, start; cmd/gpu-kubelet-plugin/mig.go:113); nothing is repacked; the instance is
  destroyed at unprepare.
- ``HamiReserveAllocator``: HAMi's dynamic MIG mode (github.com/Project-HAMi/HAMi, at 4707fb02): not DRA;
  its own scheduler picks the node and the GPU and the device plugin creates the instance when the
  container is allocated (running after the create; no binding conditions). Defaults: node policy
  ``binpack`` and GPU policy ``spread`` (cmd/scheduler/main.go:70-71); ``spread`` takes the least-used GPU
  of the node (pkg/scheduler/policy/gpu_policy.go:122-126, the device list is walked from its end,
  pkg/device/nvidia/device.go:727); on a GPU the placement is the first free one in a fixed start order,
  highest start first for ``1g.*`` and ``3g.*`` profiles, lowest first otherwise
  (``orderedMigPlacements`` and ``selectMigPlacement``, pkg/device/nvidia/mig_topology.go:26-76). HAMi
  picks the profile by the memory asked for (``selectMigCandidate``, device.go:621); here a job's profile
  is taken as asked, as for every policy. In the main tables its node order is the run's, like every
  policy's; ``hami-default`` is HAMi with its own node binpack (the busiest node first,
  pkg/scheduler/policy/node_policy.go:48-54 and 106-128).

The dynamig policy (``dynamig.simulate.dynamig_policy``) builds on the same machinery.
Allocators mutate their cluster (side effects); they never look at the future of the trace.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from dynamig.geometry.layout import free_starts
from dynamig.geometry.model import GpuModel, Layout, normalize_layout
from dynamig.simulate.allocators import NODE_ORDERS as NODE_ORDERS  # re-exported: the run's node orders
from dynamig.simulate.allocators import Allocation, Allocator, check_node_order, node_order_key
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

    # One create at a time per node (NVIDIA's prepare lock); the peers that create at allocation do not.
    serialize_creates = True

    def __init__(
        self,
        cluster: Cluster,
        create_latency_s: float = 0.0,
        bind_rtt_s: float = 0.0,
        *,
        node_order: str = "pack",
    ) -> None:
        super().__init__(cluster)
        self.node_order = check_node_order(node_order)
        self.latency = create_latency_s
        self.bind = bind_rtt_s
        self.profiles = tuple(sorted({p.name for m in cluster.models.values() for p in plain_profiles(m)}))
        self._node_free_at = [0.0] * len(cluster.nodes)  # when the node's next create may start
        self._can: list[frozenset[str]] = [frozenset()] * len(cluster.gpus)  # profiles each GPU offers
        self._hosts: dict[str, dict[int, int]] = {p: {} for p in self.profiles}  # node -> GPUs offering
        self._heap: dict[str, list[tuple[tuple[int, ...], int, int]]] = {p: [] for p in self.profiles}
        self._typed_heap: dict[tuple[str, str], list[tuple[tuple[int, ...], int, int]]] = {}
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
        """Order in which the scheduler tries nodes for ``profile`` (smallest first): ``node_order``."""
        return node_order_key(self.node_order, node, self.node_busy[node], self.node_size[node])

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
        kind = self.cluster.node_types[node]
        for p in self.profiles:
            if node in self._hosts[p]:
                entry = (self.node_key(node, p), node, v)
                heapq.heappush(self._heap[p], entry)
                # the same per GPU type, for jobs restricted to some types
                heapq.heappush(self._typed_heap.setdefault((p, kind), []), entry)

    def touch(self, gpus: Sequence[Gpu], *, republish: bool = True) -> None:
        """Re-index ``gpus`` after their state changed (and their nodes' order keys). ``republish``:
        False when only a booking changed them (the node's published list stays until it republishes)."""
        for gpu in gpus:
            self._touch_gpu(gpu)
        for node in sorted({g.node_pos for g in gpus}):
            self._push_node(node)

    def first_node(self, profile: str, count: int, job: Job) -> int | None:
        """The best node that can offer ``count`` devices of ``profile`` to ``job`` (lazy heaps: one per
        profile, and one per profile and GPU type for jobs restricted to some types)."""
        if not job.gpu_types:
            got = self._first_in(self._heap[profile], profile, count, job)
            return None if got is None else got[1]
        found = [
            got
            for kind in job.gpu_types
            if (got := self._first_in(self._typed_heap.get((profile, kind), []), profile, count, job))
        ]
        return min(found)[1] if found else None

    def _first_in(
        self, heap: list[tuple[tuple[int, ...], int, int]], profile: str, count: int, job: Job
    ) -> tuple[tuple[int, ...], int, int] | None:
        """The first current entry of ``heap`` whose node fits ``job``. Side effect: drops stale entries."""
        hosts = self._hosts[profile]
        found: tuple[tuple[int, ...], int, int] | None = None
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
                found = entry
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

    def running_at(self, now: float, created: float | None) -> float:
        """When a job allocated at ``now`` runs, its last create done at ``created`` (None: it took
        existing instances only, which carry no binding conditions and bind at once): by default once the
        create is done (the pod was bound at once, the container waits for its device). Pure."""
        return now if created is None else max(now, created)

    def before_create(self, gpu: Gpu, now: float) -> float:
        """Seconds a create on ``gpu`` waits beyond the create latency (NVIDIA's MIG mode toggle,
        ``dynamig.simulate.modes``); 0 by default. May change state (the GPU's MIG mode)."""
        return 0.0

    def book(self, job: Job, picked: Sequence[Offer], now: float) -> Allocation:
        """Take ``picked`` for ``job``: assign free instances, create the placements. Side effect: state."""
        insts: list[Instance] = []
        created: float | None = None
        for offer in picked:
            if offer.inst is not None:
                inst = offer.inst
            else:
                for old in offer.destroys:
                    self.cluster.destroy(old, now)
                if offer.destroys:
                    self.reshapes += 1  # a re-cut: free instances made way for the booked placement
                node = offer.gpu.node_pos
                latency = self.latency + self.before_create(offer.gpu, now)
                begin = now + self.bind
                if self.serialize_creates:
                    begin = max(begin, self._node_free_at[node])
                    self._node_free_at[node] = begin + latency
                done = begin + latency
                inst = self.cluster.create(offer.gpu, offer.profile, offer.start, now, done)
                created = done if created is None else max(created, done)
            self.cluster.assign(inst, job.name, now)
            self.node_busy[inst.gpu.node_pos] += inst.slices
            insts.append(inst)
        # a re-cut destroyed instances: the agent republishes the node; other bookings use the list as is
        self.touch([i.gpu for i in insts], republish=any(o.destroys for o in picked))
        delay = self.running_at(now, created) - now
        return Allocation(sum(i.slices for i in insts), tuple(insts), insts[0].gpu.node_pos, delay)

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


class FirstFitAllocator(OfferAllocator):
    """Per-request slicing: on the node the scheduler picks, the first free valid placement (GPUs in
    order, lowest start), created at allocation (creates not serialized), destroyed when the job ends."""

    name = "first-fit"
    serialize_creates = False

    def node_offers(self, node: int, profile: str, job: Job, now: float) -> list[Offer]:
        out: list[Offer] = []
        for gpu in self.cluster.nodes[node]:
            if profile not in self._can[gpu.pos]:
                continue
            starts = self.starts(gpu.model, gpu.layout(), profile)
            if starts:
                out.append(Offer(gpu, profile, starts[0]))
        return out


def _hami_start(profile: str, starts: Sequence[int]) -> int:
    """HAMi's fixed start order: highest start first for 1g and 3g profiles, lowest otherwise
    (``preferHighMigPlacement``, pkg/device/nvidia/mig_topology.go:26-39). Pure."""
    return max(starts) if profile.startswith(("1g.", "3g.")) else min(starts)


class HamiReserveAllocator(OfferAllocator):
    """HAMi's defaults: GPU spread within the node (the least-used GPU first, then GPU index), the first
    free placement in its fixed start order; created at allocation (no binding wait, creates not
    serialized), destroyed when the job ends (see the module docstring for the sources)."""

    name = "hami-reserve"

    serialize_creates = False

    def __init__(
        self,
        cluster: Cluster,
        create_latency_s: float = 0.0,
        bind_rtt_s: float = 0.0,
        *,
        node_order: str = "pack",
    ) -> None:
        super().__init__(cluster, create_latency_s, bind_rtt_s, node_order=node_order)
        if node_order == "binpack":
            self.name = "hami-reserve (HAMi's node binpack)"

    def node_offers(self, node: int, profile: str, job: Job, now: float) -> list[Offer]:
        ranked: list[tuple[tuple[int, int], Offer]] = []
        for gpu in self.cluster.nodes[node]:
            if profile not in self._can[gpu.pos]:
                continue
            starts = self.starts(gpu.model, gpu.layout(), profile)
            if starts:
                ranked.append(
                    ((gpu.busy_slices, gpu.index), Offer(gpu, profile, _hami_start(profile, starts)))
                )
        ranked.sort(key=lambda x: x[0])
        return [o for _, o in ranked]
