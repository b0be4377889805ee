"""Whole GPUs beside MIG: the policies that run GPUs with MIG mode off, and switch them.

A job with whole-GPU demand (``Job.whole``, ``trace.WHOLE_ONLY`` / ``WHOLE_FIRST``; the openb replay's
``whole_gpu_demand``) takes ``count`` GPUs with MIG mode off on one node (``Cluster.assign_whole``); a GPU
with MIG mode off holds one such job or nothing and offers no MIG device. A ``WHOLE_FIRST`` job falls back to
its MIG alternatives (the model's largest profile) when no whole GPU is free. Every other policy ignores the
demand and serves the job's MIG alternatives, as before.

- ``whole-split:<share>`` (``DynamigModesAllocator``, ``dynamic=False``): on every node a fixed share of the
  GPUs has MIG mode off for good (its lowest-numbered GPUs; the counts rounded cumulatively in node order,
  so that the cluster has ``share`` of its GPUs off); the other GPUs are dynamig's, as the ``dynamig``
  policy runs them. ``whole-split-nodes:<share>``: the same with whole nodes off, that share of the nodes of
  each size (spread evenly in node order), so that multi-GPU jobs find whole nodes.
- ``dynamig-modes`` (``DynamigModesAllocator``): dynamig's MIG side plus the operator's MIG mode on demand
  (``dynamig.operator.modes``, policy ``spec.migMode.policy: Dynamic``), as a round after the batch window:
  claims oldest first, the switches of a round for one claim (a claim of several whole GPUs gets those it
  lacks on its node switched together), at most ``ModeSettings.max_switching`` changes under way (the
  disruption budget, ``maxGpusReshaping``, 1 by default: the GPUs switched for one claim on one node are one
  change, as ``dynamig.operator.inventory.switch_changes`` counts them).
  *Off* for a claim of whole GPUs (``WHOLE_ONLY``; a claim that also accepts a MIG profile is MIG demand,
  as ``dynamig.operator.demand`` sorts it) that the free GPUs with MIG mode off (and those switching off,
  those switching for it counted first) cannot take on one node: an idle MIG GPU (no instance held,
  reserved or being created; its free instances are destroyed) on the node that completes the claim with
  the fewest switches, the GPU with the fewest instances first. *On* for a MIG claim nothing can place: a
  free GPU with MIG mode off that an empty GPU of its model serves the claim on, unless a GPU is already
  switching on for it or a waiting claim of whole GPUs could take that GPU and complete on its node (as many
  of the node's GPUs as it asks could be whole for it); the lowest node and GPU first.
  A GPU is not switched again within ``cooldown_s`` (600 s, ``cooldownSeconds``) of its last switch; the
  floors ``min_mig_gpus`` / ``min_whole_gpus`` (0) are never crossed; a model whose switch resets the GPU
  (Ampere, ``dynamig.geometry.generation``) is switched only with ``allow_reset``. A switch takes
  ``switch_s`` (10 s by default, a parameter: the simulated NVML's 2 s for Ampere and 0 for Hopper leave out
  the agent's withdrawal and the reset itself), during which the GPU serves nothing. Whole GPUs carry no
  binding conditions and bind at once. The operator's holds of kind Whole (``_whole_held``): the GPUs
  switched off for a claim, the free whole GPUs counted for it on that node and the node's idle MIG GPUs it
  still lacks there are kept whole for it; a claim of several whole GPUs with nothing switched or kept for it
  that no node's free whole GPUs serve gets an idle node kept (``keep_idle_nodes``, as many of its GPUs as
  it asks), even while the budget is spent. A kept MIG GPU offers no MIG device and is planned for nobody;
  a kept whole GPU takes only its claim; switches for a claim go to the node kept for it first; the holds
  end when the claim starts. A switch written is itself a change: the next round runs a batch window later
  where the budget has room, else when a switch ends.
- ``dynamig-modes-offer`` (``offer_whole=True``): ``dynamig-modes`` under ``migMode.offerWhole``
  (``dynamig.operator.whole_offers``): an idle MIG GPU (no instance held, reserved or being created) that the
  policy could switch off now (its cooldown over, a reset allowed) also offers its whole device, as many as
  leave ``min_mig_gpus`` with MIG on. A whole-GPU job the scheduler books on one takes it at once (as a free
  whole GPU: lowest-numbered usable GPUs of the first node in the run's order, MIG-off GPUs and offered ones
  alike); the GPU's free instances are destroyed and its MIG mode switched off for the job, which runs once
  the switch (``switch_s``) is done and the scheduler's binding-conditions check after it passed (the whole
  device carries binding conditions, as a cut does). The switch spends no disruption budget (the scheduler
  made it) and starts the GPU's cooldown; the GPU stays whole after the job, as the operator leaves it.
- ``dynamig-modes-keep`` (``keep_whole=True``; labelled, a proposal, not what the operator does): as
  ``dynamig-modes`` before its node keeps, and while a multi-GPU claim of whole GPUs waits, one whole idle
  node is kept for it (the choice ``dynamig.planner.reserve.keep_idle_nodes`` makes for MIG claims): the
  node offers no MIG device and its whole GPUs to that claim only, and as many of its GPUs as the claim
  needs are switched off in one round, within ``ModeSettings.keep_budget`` (8) GPUs switching at once.
- ``nvidia-toggle`` (``NvidiaToggleAllocator``): NVIDIA's DRA driver with the DynamicMIG feature gate
  (github.com/NVIDIA/k8s-dra-driver-gpu at 22407113, cmd/gpu-kubelet-plugin; the same code in
  kubernetes-sigs/dra-driver-nvidia-gpu at 95932046). On a GPU that toggles MIG mode without a reset
  (``supportsMIGModeToggle``: Hopper and later, nvlib.go:1461) the full GPU is published beside every MIG
  placement (nvlib.go:271, ``isDynamicMIGCapable`` nvlib.go:1493) and consumes all of the GPU's counters
  (partitions.go:86-89), so it is bookable exactly when no MIG device is on the GPU, and no MIG device while
  it is held. MIG mode follows the allocations: the prepare of a MIG device on a GPU with MIG mode off
  enables it first (``createMigDevice``, nvlib.go:959-963), and the unprepare that deletes the GPU's last MIG
  device disables it (``deleteMigDevice`` -> ``maybeDisableMigMode``, nvlib.go:1149 and 1156-1183); at start
  every GPU without MIG devices has it disabled (``obliterateStaleMIGDevices``, nvlib.go:445). Both run under
  the node-global prepare lock, as every create (``booking.NvidiaDynamicMigAllocator``): a create after an
  enable waits ``switch_s`` more, and a disable holds the lock ``switch_s``, which the node's next prepare
  (MIG or whole) waits out. On a GPU that needs a reset (Ampere: the A100 of the openb tables) nothing is
  toggled: with MIG mode on at start only the MIG placements are published (nvlib.go:1499, the full GPU is
  not, nvlib.go:266-271), so a job that only a whole GPU serves never runs there; that is how the driver
  behaves, modelled as such. Not confirmed from the source: how long ``SetMigMode`` takes (the driver logs
  it, ``t_disable_mig``; here ``switch_s``), and whether an ``activationStatus`` of "in use" (nvlib.go:1187)
  ever leaves MIG mode on after the last device is gone (here never).

Allocators mutate their cluster (side effects); they never look at the future of the trace.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dynamig.geometry.generation import mode_switch_needs_reset
from dynamig.geometry.layout import remaining_capacity
from dynamig.geometry.model import GpuModel
from dynamig.planner import ClaimDemand, Policy
from dynamig.planner.reserve import IdleNode, WaitingClaim, keep_idle_nodes
from dynamig.simulate.allocators import Allocation, Replan, node_order_key
from dynamig.simulate.booking import NvidiaDynamicMigAllocator, Offer, OfferAllocator
from dynamig.simulate.cluster import WHOLE, Cluster, Gpu
from dynamig.simulate.dynamig_policy import DynamigAllocator
from dynamig.simulate.trace import WHOLE_ONLY, Job, full_profile


@dataclass(frozen=True, slots=True)
class ModeSettings:
    """The knobs of the policies with GPUs in MIG mode off (defaults: the operator's, see the module)."""

    switch_s: float = 10.0  # a MIG mode switch, until the GPU serves in its new mode
    cooldown_s: float = 600.0  # spec.migMode.cooldownSeconds
    min_mig_gpus: int = 0  # spec.migMode.minMigGpus
    min_whole_gpus: int = 0  # spec.migMode.minWholeGpus
    max_switching: int = 1  # spec.disruptionBudget.maxGpusReshaping: changes under way (keep: GPUs)
    allow_reset: bool = (
        True  # spec.migMode.allowReset (false in the CRD; the A100 replay switches nothing without)
    )
    split_shares: tuple[float, ...] = (0.5,)  # whole-split / whole-split-nodes: one policy per share
    keep_budget: int = 8  # dynamig-modes-keep: GPUs switching at once (a node's worth)
    drain_node_after_s: float | None = None  # spec.migMode.drainNodeAfterSeconds (None: unset)
    drain_hold_s: float = 3600.0  # spec.migMode.drainNodeHoldSeconds


# DynamigModesAllocator._supply: (enough, the node with the most, its GPUs counted for the claim, such GPUs
# per node)
Supply = tuple[bool, int | None, list[Gpu], dict[int, int]]

SPLITS = ("gpu", "node")  # whole-split: a share of each node's GPUs; whole-split-nodes: a share of the nodes


def _round(x: float) -> int:
    return math.floor(x + 0.5)


def split_whole_gpus(cluster: Cluster, share: float, by: str = "gpu") -> frozenset[int]:
    """The GPUs (positions) with MIG mode off under a fixed split of ``share``. ``by="gpu"``: on every node
    its lowest-numbered GPUs, as many as the cumulative rounding in node order gives it (a node of 8 at 0.25
    has 2; the cluster has ``round(share x GPUs)``). ``by="node"``: whole nodes, ``round(share x n)`` of the
    n nodes of each size, spread evenly in node order. Pure."""
    if by not in SPLITS:
        raise ValueError(f"split by {by!r}: expected one of {', '.join(SPLITS)}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"split share {share}: expected a number in [0, 1]")
    off: list[int] = []
    if by == "gpu":
        seen = 0
        for gpus in cluster.nodes:
            k = _round(share * (seen + len(gpus))) - _round(share * seen)
            seen += len(gpus)
            off.extend(g.pos for g in gpus[:k])
        return frozenset(off)
    index: dict[int, int] = {}  # node size -> nodes of that size seen
    for gpus in cluster.nodes:
        i = index.get(len(gpus), 0)
        index[len(gpus)] = i + 1
        if _round(share * (i + 1)) > _round(share * i):
            off.extend(g.pos for g in gpus)
    return frozenset(off)


def fits_empty(model: GpuModel, job: Job, plain: frozenset[str]) -> bool:
    """An empty GPU of ``model`` holds the job's devices in one of its MIG alternatives (as
    ``dynamig.operator.modes`` asks before switching a GPU on for a claim). Pure."""
    return any(remaining_capacity(model, (), p) >= job.count for p in job.alternatives if p in plain)


class WholeGpuBooking(OfferAllocator):
    """Whole GPUs booked beside the MIG offers of an ``OfferAllocator`` (a mixin, first in the bases): the
    scheduler tries nodes in the run's node order, and on a node takes its lowest-numbered usable GPUs.
    A concrete class sets ``_init_whole`` up before its own base's ``__init__`` and calls ``_recount_all``
    after it."""

    def _init_whole(self, cluster: Cluster) -> None:
        self._full = {key: full_profile(m).name for key, m in cluster.models.items()}
        self._whole_free = [0] * len(cluster.nodes)  # per node, GPUs a whole-GPU job could take now

    def whole_usable(self, gpu: Gpu) -> bool:
        """Whether a whole-GPU job can take ``gpu`` now."""
        raise NotImplementedError

    def whole_delay(self, node: int, now: float) -> float:
        """Seconds from booking whole GPUs of ``node`` to the job running (none: no binding conditions)."""
        return 0.0

    def whole_node_ok(self, job: Job, node: int) -> bool:
        """Whether ``node``'s whole GPUs are offered to ``job`` (a node kept for another claim: not)."""
        return True

    def bookable_whole(self, job: Job, gpu: Gpu, now: float) -> bool:
        """Whether ``job`` can book ``gpu`` whole at ``now``."""
        return self.whole_usable(gpu) and self.accepts_whole(job, gpu)

    def before_whole(self, gpu: Gpu, job: Job, now: float) -> float:
        """When ``job``, booking ``gpu`` whole at ``now``, may run as far as ``gpu`` goes (``now``: at once).
        May change state (a MIG GPU offering its whole device is switched off for the booking)."""
        return now

    def accepts_whole(self, job: Job, gpu: Gpu) -> bool:
        """Whether ``job`` takes ``gpu``'s model whole (its alternatives name that model's full GPU)."""
        return self._full[gpu.model.key] in job.alternatives

    def _recount(self, node: int) -> None:
        self._whole_free[node] = sum(1 for g in self.cluster.nodes[node] if self.whole_usable(g))

    def _recount_all(self) -> None:
        for node in range(len(self.cluster.nodes)):
            self._recount(node)

    def touch(self, gpus: Sequence[Gpu], *, republish: bool = True) -> None:
        super().touch(gpus, republish=republish)
        for node in {g.node_pos for g in gpus}:
            self._recount(node)

    def place_whole(self, job: Job, now: float) -> Allocation | None:
        """``job.count`` whole GPUs on the first node in the run's order that has them, or None. Side
        effect: the cluster state."""
        best: list[Gpu] | None = None
        best_key: tuple[int, ...] | None = None
        for node, free in enumerate(self._whole_free):
            if free < job.count or not self.cluster.allows(job, node) or not self.whole_node_ok(job, node):
                continue
            key = node_order_key(self.node_order, node, self.node_busy[node], self.node_size[node])
            if best_key is not None and key >= best_key:
                continue
            gpus = [g for g in self.cluster.nodes[node] if self.bookable_whole(job, g, now)]
            if len(gpus) >= job.count:
                best, best_key = gpus[: job.count], key
        if best is None:
            return None
        node = best[0].node_pos
        delay = self.whole_delay(node, now)
        for g in best:
            delay = max(delay, self.before_whole(g, job, now) - now)
            self.cluster.assign_whole(g, job.name, now)
        slices = sum(g.model.compute_slices for g in best)
        self.node_busy[node] += slices
        self.touch(best, republish=False)
        return Allocation(slices, (), node, delay, tuple(best))

    def _place(self, job: Job, now: float) -> Allocation | None:
        """A whole-GPU job on GPUs with MIG mode off (its MIG fallback, if any, next); the rest as the
        policy below books them."""
        if job.whole:
            got = self.place_whole(job, now)
            if got is not None or job.whole == WHOLE_ONLY:
                return got
        return super()._place(job, now)

    def _release(self, job: Job, alloc: Allocation, now: float) -> None:
        if alloc.gpus:
            self.release_whole(alloc, now)
        else:
            super()._release(job, alloc, now)

    def release_whole(self, alloc: Allocation, now: float) -> None:
        for g in alloc.gpus:
            self.cluster.release_whole(g, now)
        self.node_busy[alloc.node] -= alloc.slices
        self.touch(list(alloc.gpus), republish=False)


class DynamigModesAllocator(WholeGpuBooking, DynamigAllocator):
    """dynamig's MIG side beside GPUs with MIG mode off: switched on demand (``dynamic``) or a fixed split
    (``split``: share, ``"gpu"`` or ``"node"``). See the module docstring for the rules."""

    def __init__(
        self,
        cluster: Cluster,
        policy: Policy,
        *,
        modes: ModeSettings | None = None,
        dynamic: bool = True,
        split: tuple[float, str] | None = None,
        window_s: float = 2.0,
        keep_whole: bool = False,
        offer_whole: bool = False,
        **kwargs: Any,
    ) -> None:
        self.modes = modes or ModeSettings()
        self.offer_whole = offer_whole  # dynamig-modes-offer: idle MIG GPUs offer their whole device
        self.dynamic = dynamic
        # dynamig-modes-keep (a proposal, not the operator): an idle node kept for each waiting multi-GPU
        # claim of whole GPUs, switched off at once
        self.keep_whole = keep_whole
        self._whole_kept: dict[int, str] = {}  # node -> the claim of whole GPUs it is kept for
        # GPU position -> the claim of whole GPUs it is kept whole for (the operator's holds of kind Whole)
        self._whole_held: dict[int, str] = {}
        self._drained: dict[str, float] = {}  # claim of whole GPUs -> when its drained node's keep ends
        # GPUs whose offered whole device a job booked, while it runs (the operator's booked_whole)
        self._offer_booked: set[int] = set()
        self.window_s = window_s  # the operator's batch window: its own switch write starts a round after it
        if split is not None:
            for pos in split_whole_gpus(cluster, *split):
                cluster.gpus[pos].mig = False  # the starting mode, not a switch
        self._init_whole(cluster)
        self._switching: set[Gpu] = set()
        self._plain_of = {key: frozenset(plain) for key, plain in cluster.plain.items()}
        self._needs_reset = {key: mode_switch_needs_reset(key) for key in cluster.models}
        super().__init__(cluster, policy, **kwargs)
        if dynamic:
            variant = "-keep" if keep_whole else "-offer" if offer_whole else ""
            self.name = f"dynamig-modes{variant}"
        elif split is not None:
            self.name = f"whole-split{'-nodes' if split[1] == 'node' else ''}:{split[0]:g}"
        self._recount_all()

    # -- what a GPU offers ---------------------------------------------------------------------------------
    def mig_ready(self, gpu: Gpu) -> bool:
        """MIG mode on, not switching, and not kept whole for a claim of whole GPUs (the operator's hold of
        kind Whole on a MIG GPU: the planner cuts nothing there and the agent books nobody else)."""
        return gpu.mig and not gpu.switching and gpu.pos not in self._whole_held

    def whole_usable(self, gpu: Gpu) -> bool:
        if gpu.mig:
            return self._may_offer(gpu)
        return not gpu.switching and not gpu.whole_job

    def _may_offer(self, gpu: Gpu) -> bool:
        """dynamig-modes-offer: ``gpu`` (MIG mode on) offers its whole device as far as its state goes (its
        cooldown and the floor are checked at the booking, ``bookable_whole``: a count made at any other time
        must not leave out a GPU whose cooldown ended since)."""
        return (
            self.offer_whole
            and self.dynamic
            and not gpu.switching
            and gpu.pos not in self._whole_held
            and not any(self._kept(i) for i in gpu.instances)
            and not (self._needs_reset[gpu.model.key] and not self.modes.allow_reset)
        )

    def before_whole(self, gpu: Gpu, job: Job, now: float) -> float:
        if not gpu.mig:
            return now
        # the booking of an offered whole device: free instances destroyed, MIG switched off for it (no
        # budget spent, the cooldown starts); the pod binds at the binding-conditions check after the switch
        for inst in list(gpu.instances):
            self.cluster.destroy(inst, now)
        self.cluster.set_mode(gpu, False, now, now, job.name)
        self._offer_booked.add(gpu.pos)
        self.touch([gpu])  # its MIG offers go
        return self.running_at(now, now + self.modes.switch_s)

    def release_whole(self, alloc: Allocation, now: float) -> None:
        self._offer_booked.difference_update(g.pos for g in alloc.gpus)
        super().release_whole(alloc, now)

    def _offerable(self, gpu: Gpu) -> frozenset[str]:
        return super()._offerable(gpu) if self.mig_ready(gpu) else frozenset()

    def node_offers(self, node: int, profile: str, job: Job, now: float) -> list[Offer]:
        return [o for o in super().node_offers(node, profile, job, now) if self.mig_ready(o.gpu)]

    def set_pending(self, jobs: Iterable[Job]) -> None:
        # whole-GPU demand is not MIG demand: its keeps are holds of kind Whole (_keep_idle_nodes, _off_for)
        jobs = list(jobs)
        super().set_pending([j for j in jobs if j.whole != WHOLE_ONLY])
        if self.keep_whole:
            self._keep_for_whole([j for j in jobs if j.whole == WHOLE_ONLY and j.count > 1])

    def _keep_for_whole(self, claims: Sequence[Job]) -> None:
        """dynamig-modes-keep: one idle node kept for each waiting multi-GPU claim of whole GPUs
        (``keep_idle_nodes``, the same choice as for MIG claims): nothing runs or is held on it and none of
        its GPUs is switching on. Side effect: ``_whole_kept``."""
        self._whole_kept = {}
        if not claims:
            return
        idle: list[IdleNode] = []
        for n, gpus in enumerate(self.cluster.nodes):
            if self.node_busy[n] or n in self._kept_for:
                continue
            if any(
                g.whole_job or (g.mig and (g.switching or any(self._kept(i) for i in g.instances)))
                for g in gpus
            ):
                continue
            idle.append(IdleNode(self.cluster.node_names[n], tuple(frozenset({WHOLE}) for _ in gpus)))
        waiting = [WaitingClaim(j.name, j.count, frozenset({WHOLE}), self._allowed_names(j)) for j in claims]
        self._whole_kept = {
            self._node_pos[name]: c.name for name, c in keep_idle_nodes(idle, waiting).items()
        }

    def skip_node(self, node: int, job: Job, profile: str) -> bool:
        return node in self._whole_kept or super().skip_node(node, job, profile)

    def whole_node_ok(self, job: Job, node: int) -> bool:
        kept = self._whole_kept.get(node)
        return kept is None or kept == job.name

    def accepts_whole(self, job: Job, gpu: Gpu) -> bool:
        # a GPU kept whole for a claim is that claim's alone (the agent answers others PlacementHeld)
        return super().accepts_whole(job, gpu) and self._whole_held.get(gpu.pos, job.name) == job.name

    def bookable_whole(self, job: Job, gpu: Gpu, now: float) -> bool:
        if not super().bookable_whole(job, gpu, now):
            return False
        if not gpu.mig:
            return True
        # offered: not within its cooldown, nor while the floor of MIG GPUs would be crossed
        mig_n = sum(1 for g in self.cluster.gpus if g.mig)
        return (
            not self._busy(gpu, now)
            and self._blocked_gpu(gpu, now) is None
            and mig_n > self.modes.min_mig_gpus
        )

    def place_whole(self, job: Job, now: float) -> Allocation | None:
        got = super().place_whole(job, now)
        if got is None:
            return None
        held = [g for g in got.gpus if self._whole_held.get(g.pos) == job.name]
        self._release_holds(job.name)
        if not held:
            return got
        # a held whole GPU is published guarded: the pod binds at the PreBind check after the agent's answer
        binds = self.running_at(now, now + max(self.bind, 1e-6))
        return replace(got, delay=max(got.delay, binds - now))

    def _release_holds(self, name: str) -> None:
        released = [p for p, j in self._whole_held.items() if j == name]
        for pos in released:
            del self._whole_held[pos]
        mig = [self.cluster.gpus[p] for p in released if self.cluster.gpus[p].mig]
        if mig:
            self.touch(mig)  # MIG GPUs kept whole offer their slices again

    def _hold(self, gpus: Sequence[Gpu], job: Job) -> None:
        """Keep ``gpus`` whole for ``job`` (republishing the MIG GPUs among them: they offer nothing)."""
        for g in gpus:
            self._whole_held[g.pos] = job.name
        mig = [g for g in gpus if g.mig and not g.switching]
        if mig:
            self.touch(mig)

    def _could_keep(self, job: Job, gpu: Gpu, now: float) -> bool:
        """Whether ``gpu`` could be kept whole for ``job`` (``dynamig.operator.whole_keeps.could_keep``): a
        free whole GPU, or an idle MIG GPU that could be switched off now or after a cooldown."""
        if self._whole_held.get(gpu.pos, job.name) != job.name or not self.accepts_whole(job, gpu):
            return False
        if not self.cluster.allows(job, gpu.node_pos) or gpu.switching:
            return False
        if not gpu.mig:
            return not gpu.whole_job
        return not self._busy(gpu, now) and self._blocked_gpu(gpu, now) != math.inf

    def _keep_idle_nodes(self, now: float, pending: Sequence[Job]) -> None:
        """The operator's node keep (``dynamig.operator.whole_keeps.kept_nodes``): each waiting claim of
        several whole GPUs with nothing kept or switching for it, that the free whole GPUs on no node serve,
        gets an idle node (``keep_idle_nodes``), as many of its GPUs held whole for it as it asks, free whole
        GPUs first. Side effect: the holds."""
        for name in [n for n, until in self._drained.items() if until <= now]:
            self._drained[name] = math.inf
            self._release_holds(name)  # a drain lasts drain_hold_s; a claim is drained once
        started = set(self._whole_held.values()) | {g.mode_for for g in self._switching}
        wanting: list[Job] = []
        for j in pending:
            if j.whole != WHOLE_ONLY or j.count < 2 or j.name in started:
                continue
            free = [0] * len(self.cluster.nodes)
            for g in self.cluster.gpus:
                if not g.mig and self._could_keep(j, g, now):
                    free[g.node_pos] += 1
            if max(free, default=0) < j.count:
                wanting.append(j)
        if not wanting:
            return
        held_nodes = {self.cluster.gpus[p].node_pos for p in self._whole_held}
        idle: list[IdleNode] = []
        for n, gpus in enumerate(self.cluster.nodes):
            if self.node_busy[n] or n in held_nodes:
                continue
            if any(g.whole_job or g.switching or (g.mig and self._busy(g, now)) for g in gpus):
                continue
            offers = tuple(frozenset(j.name for j in wanting if self._could_keep(j, g, now)) for g in gpus)
            idle.append(IdleNode(self.cluster.node_names[n], offers))
        waiting = [
            WaitingClaim(j.name, j.count, frozenset({j.name}), self._allowed_names(j)) for j in wanting
        ]
        by_name = {j.name: j for j in wanting}
        kept = keep_idle_nodes(idle, waiting)
        for name, w in kept.items():
            job = by_name[w.name]
            fit = [g for g in self.cluster.nodes[self._node_pos[name]] if self._could_keep(job, g, now)]
            fit.sort(key=lambda g: (g.mig, len(g.instances), g.index))
            self._hold(fit[: job.count], job)
        self._drain_nodes(now, [j for j in wanting if j.name not in {w.name for w in kept.values()}])

    def _drain_nodes(self, now: float, claims: Sequence[Job]) -> None:
        """``drainNodeAfterSeconds`` (``dynamig.operator.whole_keeps.drained_nodes``): each of ``claims`` (no
        idle node kept for it) that waited ``drain_node_after_s``, oldest first, gets the node whose GPUs it
        would take hold the fewest busy slices: as many of them as it asks held whole for it though busy (no
        other job books them; each switches off for it once idle), for ``drain_hold_s``, once per claim.
        Side effect: the holds."""
        after = self.modes.drain_node_after_s
        if after is None:
            return
        held_nodes = {self.cluster.gpus[p].node_pos for p in self._whole_held}
        for j in claims:
            if now - j.arrival < after or j.name in self._drained:
                continue
            best: tuple[tuple[int, int], list[Gpu]] | None = None
            for n, gpus in enumerate(self.cluster.nodes):
                if n in held_nodes or not self.cluster.allows(j, n):
                    continue
                fit = [g for g in gpus if self._could_drain(j, g)]
                if len(fit) < j.count:
                    continue
                fit.sort(key=lambda g: (g.busy_slices, g.index))
                key = (sum(g.busy_slices for g in fit[: j.count]), n)
                if best is None or key < best[0]:
                    best = (key, fit[: j.count])
            if best is not None:
                self._drained[j.name] = now + self.modes.drain_hold_s
                self._hold(best[1], j)
                held_nodes.add(best[1][0].node_pos)

    def _could_drain(self, job: Job, gpu: Gpu) -> bool:
        """``dynamig.operator.whole_keeps.could_drain``: a GPU ``job`` takes whole, held for nothing else, not
        switching on, not running a job that booked its offered whole device, and with MIG mode on one the
        policy may switch (a reset it allows)."""
        if not self.accepts_whole(job, gpu) or gpu.pos in self._whole_held or gpu.pos in self._offer_booked:
            return False
        if gpu.mig and gpu.switching:
            return False
        return not gpu.mig or not (self._needs_reset[gpu.model.key] and not self.modes.allow_reset)

    def candidates(self, now: float, claims: Sequence[ClaimDemand]) -> tuple[list[Gpu], float | None]:
        gpus, cooling = super().candidates(now, claims)
        return [g for g in gpus if self.mig_ready(g)], cooling

    # -- engine hooks --------------------------------------------------------------------------------------
    def on_ready(self, now: float) -> None:
        done = [g for g in self._switching if g.mode_until <= now]
        for g in done:
            self.cluster.mode_done(g)
            self._switching.discard(g)
        super().on_ready(now)
        if done:
            self.touch(sorted(done, key=lambda g: g.pos))

    def replan(self, now: float, pending: Sequence[Job]) -> Replan:
        out = super().replan(now, pending)
        if not self.dynamic:
            return out
        waiting = {j.name for j in pending}
        for name in {j for j in self._whole_held.values() if j not in waiting}:
            self._release_holds(name)  # its claim started elsewhere or gave up: the hold is released
        modes = self._mode_round(now, pending)
        retry = [t for t in (out.retry_at, modes.retry_at) if t is not None]
        return Replan(tuple(sorted({*out.ready_times, *modes.ready_times})), min(retry) if retry else None)

    # -- the MIG mode round ----------------------------------------------------------------------------------
    def _busy(self, gpu: Gpu, now: float) -> bool:
        """Something on the GPU stops a switch off: an instance held, reserved or being created."""
        return any(self._kept(i) for i in gpu.instances) or gpu.reshaping(now)

    def _blocked_gpu(self, gpu: Gpu, now: float) -> float | None:
        """None when ``gpu`` may be switched now as far as time and its model go; else when it may be
        (``math.inf``: never, a reset the policy forbids)."""
        if self._needs_reset[gpu.model.key] and not self.modes.allow_reset:
            return math.inf
        ready = gpu.mode_at + self.modes.cooldown_s
        return ready if now < ready else None

    def _switch(self, gpu: Gpu, mig: bool, job: Job, now: float) -> float:
        """Start switching ``gpu`` for ``job``; returns when it is done. Side effect: its free instances
        destroyed (switching off), the cluster state, the offers."""
        for inst in list(gpu.instances):
            self.cluster.destroy(inst, now)
        done = now + self.modes.switch_s
        self.cluster.set_mode(gpu, mig, now, done, job.name)
        if done > now:
            self._switching.add(gpu)
        self.touch([gpu])
        return done

    def _changes(self) -> int:
        """What the switches under way spend of the disruption budget: one per node and claim, as the operator
        counts them (the keep proposal counts GPUs)."""
        if self.keep_whole:
            return len(self._switching)
        return len({(g.node_pos, g.mode_for) for g in self._switching})

    def _joins(self, job: Job, node: int) -> bool:
        """Whether switches for ``job`` on ``node`` are under way: more of them spend nothing more."""
        return not self.keep_whole and any(
            g.node_pos == node and g.mode_for == job.name for g in self._switching
        )

    def _mode_round(self, now: float, pending: Sequence[Job]) -> Replan:
        """One MIG mode round over the jobs still waiting (oldest first): the switches for one job. Side
        effect: the switches, the holds."""
        if not self.keep_whole:
            self._keep_idle_nodes(now, pending)
        joinable = {g.mode_for for g in self._switching} if not self.keep_whole else set()
        if self._changes() >= self.modes.max_switching and not any(j.name in joinable for j in pending):
            return Replan()  # the budget is spent: the switch under way ends with a READY, and a round
        whole_claims = [j for j in pending if j.whole == WHOLE_ONLY]
        mig_claims = [j for j in pending if j.whole != WHOLE_ONLY and j.name not in self._claims]
        if not whole_claims and not mig_claims:
            return Replan()
        gpus = self.cluster.gpus
        mig_n = sum(1 for g in gpus if g.mig)  # by the mode each GPU has or is switching to
        off = [g for g in gpus if not g.mig]
        taken: set[int] = set()
        names = {j.name for j in whole_claims}
        for g in off:  # GPUs switching off for a claim are counted for it first
            if g.switching and g.mode_for in names:
                taken.add(g.pos)
        supply = {j.name: self._supply(j, off, taken) for j in whole_claims}
        retry: float | None = None
        tried: set[tuple[tuple[str, ...], int, tuple[str, ...]]] = set()
        kept: set[int] | None = None
        idle: tuple[list[Gpu], float | None] | None = (
            None  # idle MIG GPUs switchable now; the next cooldown end
        )
        kept_node = {name: n for n, name in self._whole_kept.items()}
        for job in pending:
            if job.whole == WHOLE_ONLY and job.name in kept_node:
                done, wait = self._off_for_kept(job, kept_node[job.name], now, mig_n)
            elif job.whole == WHOLE_ONLY:
                if supply[job.name][0]:
                    continue  # free whole GPUs (or some switching off) are enough for it
                if idle is None:
                    idle = self._idle_mig(now)
                done, wait = self._off_for(job, supply[job.name], taken, idle, mig_n, now)
            elif job.name in self._claims or self._changes() >= self.modes.max_switching:
                continue  # (the budget spent: only a claim's own switches under way are joined)
            else:
                shape = (job.alternatives, job.count, job.gpu_types)
                if shape in tried:
                    continue
                tried.add(shape)
                if kept is None:  # free whole GPUs a waiting claim of whole GPUs could take: not switched on
                    wanted = {(c.alternatives, c.gpu_types, c.count): c for c in whole_claims}.values()
                    hosts: dict[tuple[str, int], bool] = {}
                    kept = {
                        g.pos
                        for g in off
                        if any(
                            self.accepts_whole(c, g)
                            and self.cluster.allows(c, g.node_pos)
                            and self._could_host(c, g.node_pos, now, hosts)
                            for c in wanted
                        )
                    }
                done, wait = self._on_for(job, off, kept | taken, now, len(gpus) - mig_n)
            if done is not None:
                # the switch written is itself a change: the next round runs a batch window later, where the
                # budget leaves room for another switch (otherwise the switch's end starts it)
                more = self._changes() < self.modes.max_switching
                return Replan((done,), now + self.window_s if more else None)
            if wait is not None and wait < math.inf:
                retry = wait if retry is None else min(retry, wait)
        return Replan((), retry)

    def _supply(self, job: Job, off: Sequence[Gpu], taken: set[int]) -> Supply:
        """GPUs with MIG mode off (free, or switching off) counted for ``job``, all on one node: whether
        they are enough, the node (the one with the most), the GPUs, and such GPUs per node. Side effect:
        ``taken``."""
        by_node: dict[int, list[Gpu]] = {}
        for g in off:
            if not self.accepts_whole(job, g) or not self.cluster.allows(job, g.node_pos):
                continue
            mine = g.pos in taken and g.switching and g.mode_for == job.name
            if mine or (g.pos not in taken and (g.switching or not g.whole_job)):
                by_node.setdefault(g.node_pos, []).append(g)
        if not by_node:
            return False, None, [], {}
        names = self.cluster.node_names
        node = min(by_node, key=lambda n: (-len(by_node[n]), names[n]))
        have = sorted(by_node[node], key=lambda g: (g.switching, g.mode_for != job.name, g.index))[
            : job.count
        ]
        taken.update(g.pos for g in have)
        return len(have) >= job.count, node, have, {n: len(gs) for n, gs in by_node.items()}

    def _idle_mig(self, now: float) -> tuple[list[Gpu], float | None]:
        """The idle GPUs with MIG mode on that may be switched off now, and the earliest time one more may
        (a cooldown ending; None: none waits for one)."""
        fit: list[Gpu] = []
        wait: float | None = None
        for g in self.cluster.gpus:
            if not g.mig or g.switching or self._busy(g, now):
                continue
            blocked = self._blocked_gpu(g, now)
            if blocked is None:
                fit.append(g)
            elif blocked < math.inf:
                wait = blocked if wait is None else min(wait, blocked)
        return fit, wait

    def _off_for(
        self,
        job: Job,
        supply: Supply,
        taken: set[int],
        idle: tuple[list[Gpu], float | None],
        mig_n: int,
        now: float,
    ) -> tuple[float | None, float | None]:
        """Switch idle MIG GPUs (of ``idle``) off for ``job`` if its supply is short and a node can complete
        it, as many as it lacks there within the budget, as the operator does: (when the last switch is done,
        None) or (None, when to try again for a cooldown)."""
        enough, _, have, per_node = supply
        if enough:
            return None, None
        need = job.count
        by_node: dict[int, list[Gpu]] = {}
        fit, wait = idle
        for g in fit:
            if (
                g.pos in taken
                or not self.accepts_whole(job, g)
                or not self.cluster.allows(job, g.node_pos)
                or self._whole_held.get(g.pos, job.name) != job.name  # kept whole for another claim
            ):
                continue
            by_node.setdefault(g.node_pos, []).append(g)
        have_on = per_node  # as the operator counts them: free whole GPUs (or switching off) on each node
        complete = [n for n in by_node if have_on.get(n, 0) + len(by_node[n]) >= need]
        if not complete:
            return None, wait
        names = self.cluster.node_names
        kept_on = (
            set()
            if self.keep_whole
            else {self.cluster.gpus[p].node_pos for p, j in self._whole_held.items() if j == job.name}
        )
        node = min(complete, key=lambda n: (n not in kept_on, need - have_on.get(n, 0), names[n]))
        # the GPUs the job lacks on the node, switched together (one change of the budget), to the MIG floor
        budget = self._joins(job, node) or self._changes() < self.modes.max_switching
        room = min(need - have_on.get(node, 0), mig_n - self.modes.min_mig_gpus) if budget else 0
        if room <= 0:
            return None, None  # the floor of MIG GPUs, or another claim's switches (their end starts a round)
        done = now
        order = sorted(
            by_node[node], key=lambda g: (self._whole_held.get(g.pos) != job.name, len(g.instances), g.index)
        )
        for g in order[:room]:
            taken.add(g.pos)
            done = max(done, self._switch(g, False, job, now))
            self._whole_held[g.pos] = job.name
        for g in have:  # the free whole GPUs counted for it there, kept too while the rest switch
            if g.node_pos == node:
                self._whole_held[g.pos] = job.name
        if not self.keep_whole:  # and the node's idle MIG GPUs it still lacks there (the operator's _keeps)
            mine = sum(1 for g in self.cluster.nodes[node] if self._whole_held.get(g.pos) == job.name)
            lacking = [
                g
                for g in self.cluster.nodes[node]
                if g.pos not in self._whole_held and self._could_keep(job, g, now)
            ]
            lacking.sort(key=lambda g: (g.mig, len(g.instances), g.index))
            self._hold(lacking[: max(0, need - mine)], job)
        return done, None

    def _off_for_kept(self, job: Job, node: int, now: float, mig_n: int) -> tuple[float | None, float | None]:
        """dynamig-modes-keep: switch off at once as many of the kept ``node``'s idle MIG GPUs as ``job``
        still needs there (within the budget): (when the last is done, None) or (None, when to try again)."""
        gpus = self.cluster.nodes[node]
        short = job.count - sum(
            1 for g in gpus if not g.mig and not g.whole_job and self.accepts_whole(job, g)
        )
        if short <= 0:
            return None, None
        fit: list[Gpu] = []
        wait: float | None = None
        for g in gpus:
            if not g.mig or g.switching or self._busy(g, now) or not self.accepts_whole(job, g):
                continue
            blocked = self._blocked_gpu(g, now)
            if blocked is None:
                fit.append(g)
            elif blocked < math.inf:
                wait = blocked if wait is None else min(wait, blocked)
        room = min(short, self.modes.max_switching - self._changes(), mig_n - self.modes.min_mig_gpus)
        if len(fit) < short or room <= 0:
            return None, wait
        done = now
        for g in sorted(fit, key=lambda g: (len(g.instances), g.index))[:room]:
            done = max(done, self._switch(g, False, job, now))
        return done, None

    def _could_host(self, job: Job, node: int, now: float, seen: dict[tuple[str, int], bool]) -> bool:
        """Whether ``node`` has as many GPUs as ``job`` asks that could be whole for it (``_could_keep``, or
        switching off for it):
        a free whole GPU is kept from MIG claims only for a claim of whole GPUs that could complete on its
        node (``dynamig.operator.whole_keeps.could_host``). Memoised in ``seen``."""
        key = (job.name, node)
        if key not in seen:
            room = sum(
                1
                for g in self.cluster.nodes[node]
                if self._could_keep(job, g, now) or (g.switching and not g.mig and g.mode_for == job.name)
            )
            seen[key] = room >= job.count
        return seen[key]

    def _on_for(
        self, job: Job, off: Sequence[Gpu], kept: set[int], now: float, whole_n: int
    ) -> tuple[float | None, float | None]:
        """Switch one free GPU with MIG mode off on for the MIG claim ``job`` that nothing places: (when the
        switch is done, None) or (None, when to try again for a cooldown)."""

        def serves(g: Gpu) -> bool:
            return self.cluster.allows(job, g.node_pos) and fits_empty(
                g.model, job, self._plain_of[g.model.key]
            )

        if any(g.mig and serves(g) for g in self._switching):
            return None, None  # one is switching on for it already
        fit: list[Gpu] = []
        wait: float | None = None
        for g in off:
            if g.switching or g.whole_job or g.pos in kept or not serves(g):
                continue
            blocked = self._blocked_gpu(g, now)
            if blocked is not None:
                wait = blocked if wait is None else min(wait, blocked)
                continue
            fit.append(g)
        if not fit:
            return None, wait
        names = self.cluster.node_names
        best = min(fit, key=lambda g: (names[g.node_pos], g.index))
        if whole_n - 1 < self.modes.min_whole_gpus:
            return None, None  # the floor of whole GPUs
        return self._switch(best, True, job, now), None


class NvidiaToggleAllocator(WholeGpuBooking, NvidiaDynamicMigAllocator):
    """NVIDIA's DRA driver with DynamicMIG, its full GPU included: MIG mode toggled per allocation on the
    GPUs that switch without a reset (see the module docstring for the source)."""

    name = "nvidia-toggle"

    def __init__(
        self,
        cluster: Cluster,
        create_latency_s: float = 0.0,
        bind_rtt_s: float = 0.0,
        *,
        node_order: str = "pack",
        switch_s: float = 10.0,
    ) -> None:
        self.switch_s = switch_s
        self._toggles = {key: not mode_switch_needs_reset(key) for key in cluster.models}
        for g in cluster.gpus:
            # at start a GPU without MIG devices has MIG mode disabled where it toggles; elsewhere MIG mode
            # stays as it is, on (the MIG placements published, the full GPU not)
            g.mig = not self._toggles[g.model.key]
        self._init_whole(cluster)
        super().__init__(cluster, create_latency_s, bind_rtt_s, node_order=node_order)
        self._recount_all()

    def whole_usable(self, gpu: Gpu) -> bool:
        # the full GPU consumes every counter of the GPU: bookable when no MIG device is on it
        return self._toggles[gpu.model.key] and not gpu.instances and not gpu.whole_job

    def whole_delay(self, node: int, now: float) -> float:
        # its prepare takes the node's prepare lock (behind a disable, or a create, in progress)
        return max(0.0, self._node_free_at[node] - now)

    def _offerable(self, gpu: Gpu) -> frozenset[str]:
        return frozenset() if gpu.whole_job else super()._offerable(gpu)

    def before_create(self, gpu: Gpu, now: float) -> float:
        if gpu.mig:
            return 0.0
        self.cluster.set_mode(gpu, True, now, now)  # enabled in the prepare, before the create
        return self.switch_s

    def _release(self, job: Job, alloc: Allocation, now: float) -> None:
        super()._release(job, alloc, now)
        if alloc.gpus:
            return
        emptied = [
            g
            for g in {i.gpu for i in alloc.instances}
            if self._toggles[g.model.key] and g.mig and not g.instances
        ]
        for g in sorted(emptied, key=lambda g: g.pos):
            # the unprepare that deleted the last MIG device disables MIG mode, under the node's lock
            self.cluster.set_mode(g, False, now, now)
            self._node_free_at[g.node_pos] = max(self._node_free_at[g.node_pos], now) + self.switch_s
