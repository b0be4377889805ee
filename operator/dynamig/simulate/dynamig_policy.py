"""dynamig as a simulated policy, as it will run: nodes publish ranked offers, the planner fills the gaps.

What the simulation does, as the operator, the agents and the scheduler would:

- Each node publishes its free instances and the placements that fit beside what is held, in the order
  ``dynamig.planner.ranking.rank_offers`` gives (the same pure function the agent publishes with): free
  instances first, then new placements, then re-cuts that destroy free instances. The scheduler books the
  first that matches on the node it picks. A free instance carries no binding conditions and binds at
  once. A placement to be cut carries them: the agent creates it (one instance after another per node)
  and answers, and kube-scheduler's PreBind, which checked at once and then re-checks every 5 s
  (``SimConfig.prebind_poll_s``), binds the pod at its first check after the answer.
- ``placements_per_profile`` limits what each GPU publishes as the agent's flag of that name does
  (``dynamig.kube.inventory.offered_devices``): every free instance, and of the placements to cut only the
  best-ranked N per profile (0: every placement; None: the operator's ``auto`` choice for the cluster's GPU
  nodes, ``dynamig.planner.offerlimit.auto_limit``). A node whose published devices can no longer serve a
  claim (its one placement booked since it published) is passed over, as kube-scheduler's filter would.
- Node choice is the run's node order, the same for every policy (``booking.NODE_ORDERS``).
  While multi-GPU claims wait, one idle node is kept for each and offers only that claim's profiles
  (``dynamig.planner.reserve.keep_idle_nodes``, the function the operator writes ``offeredProfiles`` with).
- Instances are kept when jobs end, so they serve the next job of that shape with no create.
- Jobs that nothing on offer fits stay pending. With a warm pool or a baseline (or ``plan_pending``),
  demand is batched for a window and one planning round (``dynamig.planner.plan``) re-cuts free space,
  applying the warm pool and baseline of the ``Policy``. Without them a round would find nothing the
  offers did not already show (the same free space, re-cuts included), so none is run. The
  instances a round creates are reserved for the claims it assigned them to (the scheduler books what
  the operator planned) and become usable after the create latency, one GPU after another per node. A
  reshaped GPU is not re-cut by a planning round again for ``cooldown_s``; meanwhile it may only gain
  instances for claims in its free memory slices (the planner's ``Policy.additive``, as the operator plans
  a GPU in its cooldown).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.model import Layout, normalize_layout
from dynamig.planner import ClaimDemand, CurrentInstance, GpuKey, GpuState, Policy, plan
from dynamig.planner.offerlimit import EVERY_PLACEMENT, auto_limit
from dynamig.planner.ranking import GpuOffers, OfferKind, RankedOffer, rank_offers
from dynamig.planner.reserve import IdleNode, WaitingClaim, keep_idle_nodes
from dynamig.planner.warmpool import WarmPoolSizing, cap_warm_pool, size_warm_pool
from dynamig.simulate.allocators import Allocation, Replan
from dynamig.simulate.booking import Offer, OfferAllocator
from dynamig.simulate.cluster import Cluster, Gpu, Instance
from dynamig.simulate.trace import Job, compute_slices_by_name

_RankKey = tuple[tuple[tuple[int, str, Layout, Layout], ...], str]


def limit_placements(ranked: Iterable[RankedOffer], per_profile: int) -> tuple[RankedOffer, ...]:
    """``ranked`` as an agent with ``--placements-per-profile=per_profile`` publishes it: every free
    instance, and the first ``per_profile`` placements to cut (new or re-cut) of each GPU and profile, in
    ranked order; 0 keeps every placement. Pure."""
    if not per_profile:
        return tuple(ranked)
    seen: dict[tuple[int, str], int] = {}
    out: list[RankedOffer] = []
    for r in ranked:
        if r.kind is not OfferKind.FREE:
            n = seen[(r.gpu_index, r.profile)] = seen.get((r.gpu_index, r.profile), 0) + 1
            if n > per_profile:
                continue  # ranked order: the ones kept are the best
        out.append(r)
    return tuple(out)


def gpu_node_count(cluster: Cluster) -> int:
    """The nodes of ``cluster`` with a GPU: what the operator counts for its ``auto`` choice."""
    return sum(1 for gpus in cluster.nodes if gpus)


class DynamigAllocator(OfferAllocator):
    """Ranked offers plus planner rounds; see the module docstring for what is simulated."""

    name = "dynamig"
    replans = True
    keeps_free = True

    def __init__(
        self,
        cluster: Cluster,
        policy: Policy,
        *,
        reshape_latency_s: float,
        cooldown_s: float,
        bind_rtt_s: float = 0.0,
        prebind_poll_s: float = 0.0,
        initial: Layout = (),
        max_claims: int = 500,
        catalog: Catalog | None = None,
        plan_pending: bool = False,
        node_order: str = "pack",
        warm_sizing: WarmPoolSizing | None = None,
        resize_every_s: float = 300.0,
        warm_max_slices: int | None = None,
        placements_per_profile: int | None = EVERY_PLACEMENT,
    ) -> None:
        self.prebind_poll_s = prebind_poll_s
        # None: the operator's auto rule for this cluster's size, as an agent left on ``auto`` follows it
        self.placements_per_profile = (
            auto_limit(gpu_node_count(cluster)) if placements_per_profile is None else placements_per_profile
        )
        self._choosing_at = 0.0  # the clock of the scheduling pass in progress (choose)
        self.policy = policy
        # Offers already include every placement free space allows (re-cuts too), so a round for claims
        # they could not place finds nothing new; by default rounds run for the warm pool and baseline only.
        self.plan_pending = (
            plan_pending or bool(policy.warm_pool) or bool(policy.baseline) or warm_sizing is not None
        )
        # history warm pool: re-sized every ``resize_every_s`` from the single-device claims seen so far
        self.warm_sizing = warm_sizing
        self.resize_every_s = resize_every_s
        self.warm_max_slices = warm_max_slices
        self._arrivals: list[tuple[float, str]] = []
        self._next_resize = 0.0
        self._pool_since = 0.0
        self._pool_time: dict[str, tuple[float, float]] = {}  # profile -> (seconds > 0, size x seconds)
        if warm_sizing is not None:
            self.name = "dynamig (history warm pool)"
        self.cooldown = cooldown_s
        self.max_claims = max_claims
        self.catalog = catalog
        self._reserved: dict[Instance, str] = {}  # instance -> claim the planner assigned it to
        self._claims: dict[str, list[Instance]] = {}
        self._not_ready: set[Instance] = set()
        self._rank_cache: dict[_RankKey, tuple[RankedOffer, ...]] = {}
        # node -> (its state when it published, profile -> its offers of that profile) since it republished
        self._published: dict[int, tuple[tuple[GpuOffers, ...], dict[str, tuple[RankedOffer, ...]]]] = {}
        self._kept_for: dict[int, frozenset[str]] = {}  # idle node kept for a multi-GPU claim -> its profiles
        self._node_pos = {name: n for n, name in enumerate(cluster.node_names)}
        self._idle_nodes: list[IdleNode] | None = None
        self._names_of_types: dict[tuple[str, ...], frozenset[str]] = {}
        super().__init__(cluster, reshape_latency_s, bind_rtt_s, node_order=node_order)
        self._allowed = (
            frozenset(self.profiles)
            if policy.allowed_profiles is None
            else frozenset(policy.allowed_profiles) & frozenset(self.profiles)
        )
        # per model, the profiles its GPUs offer: allowed plain profiles of that model (on a mixed cluster a
        # name another model has, such as the A100-40GB's double-memory 1g.10gb, is not offered)
        self._model_profiles = {key: self._allowed & plain for key, plain in cluster.plain.items()}
        self._slices = compute_slices_by_name(cluster.models.values())
        for gpus in cluster.nodes:
            for gpu in gpus:
                for placed in initial:
                    cluster.create(gpu, placed.profile, placed.start, 0.0, 0.0)
            if initial:
                self.touch(gpus)

    @property
    def planned_claims(self) -> frozenset[str]:
        """Claims that instances are reserved for (planned by a round, not yet booked)."""
        return frozenset(self._claims)

    # -- what a GPU offers ---------------------------------------------------------------------------------
    def _kept(self, inst: Instance) -> bool:
        return bool(inst.job) or inst in self._reserved or inst in self._not_ready

    def held(self, gpu: Gpu) -> list[Instance]:
        return [i for i in gpu.instances if self._kept(i)]

    def free(self, gpu: Gpu) -> list[Instance]:
        return [i for i in gpu.instances if not self._kept(i)]

    def running_at(self, now: float, created: float | None) -> float:
        """A booking of free instances binds at once (no binding conditions). A cut carries binding
        conditions: PreBind checks at ``now`` and then every ``prebind_poll_s``
        (``wait.PollUntilContextTimeout(ctx, 5*time.Second, pl.bindingTimeout, true, ...)``,
        pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go:1726 in v1.37.2), and the pod
        binds at the first check at or after the agent's answer, given once the instance exists. Pure."""
        if created is None or created <= now:
            return now
        poll = self.prebind_poll_s
        if poll <= 0:
            return created
        return now + poll * math.ceil((created - now) / poll - 1e-9)

    def set_pending(self, jobs: Iterable[Job]) -> None:
        # idle nodes kept for the waiting multi-GPU claims, chosen as the operator chooses them
        multi = [j for j in jobs if j.count > 1]
        self._kept_for = {}
        if not multi:
            return
        if self._idle_nodes is None:  # what each node offers when idle: fixed per node, built once
            self._idle_nodes = [
                IdleNode(name, tuple(self._model_profiles[g.model.key] for g in self.cluster.nodes[n]))
                for n, name in enumerate(self.cluster.node_names)
            ]
        idle = [node for n, node in enumerate(self._idle_nodes) if not self.node_busy[n]]
        waiting = [
            WaitingClaim(j.name, j.count, frozenset(j.alternatives), self._allowed_names(j)) for j in multi
        ]
        kept = keep_idle_nodes(idle, waiting)
        self._kept_for = {self._node_pos[name]: claim.profiles for name, claim in kept.items()}

    def _allowed_names(self, job: Job) -> frozenset[str] | None:
        """The names of the nodes ``job``'s GPU types admit (None: any node), memoised per type set."""
        if not job.gpu_types:
            return None
        got = self._names_of_types.get(job.gpu_types)
        if got is None:
            names = self.cluster.node_names
            got = frozenset(names[n] for n in range(len(names)) if self.cluster.allows(job, n))
            self._names_of_types[job.gpu_types] = got
        return got

    def skip_node(self, node: int, job: Job, profile: str) -> bool:
        # a kept node offers only the profiles of the claim it is kept for (its spec.offeredProfiles)
        kept = self._kept_for.get(node)
        if kept is not None and profile not in kept:
            return True
        if not self.placements_per_profile:
            # every placement published: a GPU the index lists for the profile has a valid one in the list
            return False
        # kube-scheduler filters out a node whose published devices cannot serve the claim (the one
        # placement of a GPU booked since the node published) and tries the next
        gpus = {o.gpu.pos for o in self.node_offers(node, profile, job, self._choosing_at)}
        return len(gpus) < job.count

    def choose(self, job: Job, now: float) -> list[Offer] | None:
        self._choosing_at = now
        return super().choose(job, now)

    def _gpu_offers(self, gpu: Gpu) -> GpuOffers:
        return GpuOffers(
            gpu.index,
            gpu.model,
            held=normalize_layout([i.placed for i in self.held(gpu)]),
            free=normalize_layout([i.placed for i in self.free(gpu)]),
            allowed=self._model_profiles[gpu.model.key],
        )

    def touch(self, gpus: Sequence[Gpu], *, republish: bool = True) -> None:
        if republish:
            for node in {g.node_pos for g in gpus}:
                self._published.pop(node, None)
        super().touch(gpus, republish=republish)

    def _publish(self, node: int, profile: str) -> tuple[RankedOffer, ...]:
        """What the node's agent published of ``profile``, in its order (``rank_offers`` for that profile;
        memoised by state). The node's state is read at its first publish since it last republished, as the
        agent publishes every profile at once."""
        published = self._published.get(node)
        if published is None:
            offers = tuple(self._gpu_offers(g) for g in self.cluster.nodes[node])
            published = self._published[node] = (offers, {})
        offers, lists = published
        ranked = lists.get(profile)
        if ranked is not None:
            return ranked
        state = tuple((o.index, o.model.key, o.held, o.free) for o in offers)  # model: mixed clusters
        key: _RankKey = (state, profile)
        ranked = self._rank_cache.get(key)
        if ranked is None:
            # the agent's own publishing order, cut to its placements per profile
            ranked = limit_placements(rank_offers(offers, profile), self.placements_per_profile)
            if len(self._rank_cache) > 50_000:
                self._rank_cache.clear()
            self._rank_cache[key] = ranked
        lists[profile] = ranked
        return ranked

    def node_offers(self, node: int, profile: str, job: Job, now: float) -> list[Offer]:
        # Between two republishes the scheduler books from the list as published; an offer that a
        # booking since made impossible (shared counters) is skipped, as the allocator would.
        ranked = self._publish(node, profile)
        gpus = {g.index: g for g in self.cluster.nodes[node]}
        out: list[Offer] = []
        for r in ranked:
            if r.profile != profile:
                continue
            gpu = gpus[r.gpu_index]
            free = {i.placed: i for i in self.free(gpu)}
            if r.kind == OfferKind.FREE:
                inst = free.get(r.placed)
                if inst is not None:
                    out.append(Offer(gpu, profile, r.start, inst=inst))
                continue
            if any(d not in free for d in r.destroys):
                continue
            rest = normalize_layout(
                [i.placed for i in self.held(gpu)] + [p for p in free if p not in r.destroys]
            )
            if r.start in self.starts(gpu.model, rest, profile):
                out.append(Offer(gpu, profile, r.start, destroys=tuple(free[d] for d in r.destroys)))
        return out

    # -- booking -------------------------------------------------------------------------------------------
    def _drop(self, claim: str) -> list[Gpu]:
        insts = self._claims.pop(claim, [])
        for inst in insts:
            self._reserved.pop(inst, None)
        return [i.gpu for i in insts]

    def _place(self, job: Job, now: float) -> Allocation | None:
        mine = self._claims.get(job.name)
        if mine and all(i.alive and not i.job and i not in self._not_ready for i in mine):
            self._drop(job.name)
            return self.book(job, [Offer(i.gpu, i.profile, i.start, inst=i) for i in mine], now)
        if mine and not all(i.alive for i in mine):
            self.touch(self._drop(job.name))
        picked = self.choose(job, now)
        if picked is None:
            return None
        if job.name in self._claims:  # booked something else at once: its planned instances go free
            self.touch(self._drop(job.name))
        return self.book(job, picked, now)

    def withdraw(self, job: Job, now: float) -> None:
        self.touch(self._drop(job.name))

    # -- engine hooks --------------------------------------------------------------------------------------
    def on_ready(self, now: float) -> None:
        done = [i for i in self._not_ready if i.ready_at <= now]
        for inst in done:
            self._not_ready.discard(inst)
        self.touch([i.gpu for i in done if i.alive])

    def observe_arrival(self, job: Job, now: float) -> None:
        """A claim arrived at ``now`` (engine hook). With history sizing, the pool is first re-sized from
        the arrivals before ``now`` when ``resize_every_s`` has passed, then ``job`` joins the history
        (single-device claims only: pooled instances are scattered, a multi-GPU claim needs one node)."""
        if self.warm_sizing is None:
            return
        if now >= self._next_resize:
            self._next_resize = now + self.resize_every_s
            lo = now - self.warm_sizing.history_s
            cut = next((i for i, (t, _) in enumerate(self._arrivals) if t >= lo), len(self._arrivals))
            del self._arrivals[:cut]  # older than any future history window
            pool = size_warm_pool(self._arrivals, now, self.warm_sizing)
            pool = {p: n for p, n in pool.items() if p in self._allowed}
            if self.warm_max_slices is not None:
                pool = cap_warm_pool(pool, self._slices.__getitem__, self.warm_max_slices)
            self._account_pool(now)
            self.policy = replace(self.policy, warm_pool=pool)
        if job.count == 1:
            self._arrivals.append((now, job.preferred))

    def _account_pool(self, now: float) -> None:
        span = max(0.0, now - self._pool_since)
        for profile, n in self.policy.warm_pool.items():
            pos, area = self._pool_time.get(profile, (0.0, 0.0))
            self._pool_time[profile] = (pos + (span if n > 0 else 0.0), area + n * span)
        self._pool_since = now

    def warm_pool_coverage(self, horizon: float) -> dict[str, tuple[float, float]]:
        """Per profile: share of ``[0, horizon]`` with a warm-pool target > 0, and the time-mean target."""
        self._account_pool(max(horizon, self._pool_since))
        if horizon <= 0:
            return {}
        return {p: (pos / horizon, area / horizon) for p, (pos, area) in sorted(self._pool_time.items())}

    def wants_plan(self, now: float) -> bool:
        pool = self.policy.warm_pool
        if not pool:
            return False
        # one pass over the instances for every profile of the pool, stopping once none is short
        short = {p: n for p, n in pool.items() if n > 0}
        for g in self.cluster.gpus:
            if not short:
                return False
            for i in g.instances:
                if i.profile in short and not self._kept(i):
                    short[i.profile] -= 1
                    if not short[i.profile]:
                        del short[i.profile]
        return bool(short)

    def replan(self, now: float, pending: Sequence[Job]) -> Replan:
        if not self.plan_pending:
            return Replan()
        claims = [
            ClaimDemand(job.name, job.alternatives, job.count, self._allowed_names(job))
            for job in pending
            if job.name not in self._claims
        ][: self.max_claims]
        if not claims and not self.wants_plan(now):
            return Replan()
        gpus, cooling = self.candidates(now, claims)
        if not gpus:
            return Replan(retry_at=cooling)
        self.plan_calls += 1
        states = [
            GpuState(
                g.node,
                g.index,
                g.model.key,
                tuple(
                    CurrentInstance(i.profile, i.start, busy=self._kept(i))
                    for i in sorted(g.instances, key=lambda i: (i.start, i.profile))
                ),
            )
            for g in gpus
        ]
        additive = frozenset(GpuKey(g.node, g.index) for g in gpus if g.cooldown_until > now)
        result = plan(states, claims, replace(self.policy, additive=additive), self.catalog)
        by_key = {(g.node, g.index): g for g in gpus}
        readies: list[float] = []
        touched: list[Gpu] = []
        for gp in result.gpus:
            if not gp.changed:
                continue
            gpu = by_key[(gp.node, gp.index)]
            ready = self._cut_done_at(gpu.node_pos, now)
            readies.append(ready)
            self._apply(gpu, gp.layout, now, ready)
            touched.append(gpu)
        for a in result.assignments:
            target = by_key.get((a.node, a.index))
            inst = None
            if target is not None:
                inst = next(
                    (
                        i
                        for i in target.instances
                        if i.start == a.start
                        and i.profile == a.profile
                        and not i.job
                        and i not in self._reserved
                    ),
                    None,
                )
            if inst is None:
                continue
            self._reserved[inst] = a.claim  # the scheduler books what the round planned for the claim
            self._claims.setdefault(a.claim, []).append(inst)
            touched.append(inst.gpu)
        self.touch(touched)
        retry = cooling if result.unsatisfied else None
        return Replan(tuple(sorted(set(readies))), retry)

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
                inst = self.cluster.create(gpu, placed.profile, placed.start, now, ready)
                if ready > now:
                    self._not_ready.add(inst)
        gpu.cooldown_until = now + self.cooldown
        self.reshapes += 1

    def _cut_done_at(self, node: int, now: float) -> float:
        """When a re-cut of one GPU of ``node`` that starts now is done: the agent re-cuts one GPU after
        another. Side effect: the node is busy until then."""
        ready = max(now, self._node_free_at[node]) + self.latency
        self._node_free_at[node] = ready
        return ready

    def _has_room(self, gpu: Gpu) -> bool:
        return bool(self._can[gpu.pos])

    def candidates(self, now: float, claims: Sequence[ClaimDemand]) -> tuple[list[Gpu], float | None]:
        """GPUs a round may use, and the earliest time a GPU now in cooldown may be re-cut.

        Every partly used GPU with room (one in its cooldown may only gain instances), and idle nodes: first
        one node per multi-GPU claim and per claim tied to some nodes (largest claim first, smallest allowed
        node that holds it), then more idle nodes until the other single devices and the warm pool are
        covered. Nodes taken for the first group do not count towards the single devices.
        """
        cooling: float | None = None
        busy: list[Gpu] = []
        idle_nodes: dict[int, list[Gpu]] = {}
        for gpu in self.cluster.gpus:
            if gpu.reshaping(now):
                continue
            if gpu.cooldown_until > now:
                cooling = gpu.cooldown_until if cooling is None else min(cooling, gpu.cooldown_until)
                if self._has_room(gpu):
                    busy.append(gpu)
                continue
            if gpu.busy_slices or any(self._kept(i) for i in gpu.instances):
                if self._has_room(gpu):
                    busy.append(gpu)
            else:
                idle_nodes.setdefault(gpu.node_pos, []).append(gpu)
        names = self.cluster.node_names
        chosen: set[int] = set()
        # one idle node for each multi-GPU claim and each claim tied to some nodes (largest first,
        # smallest node that holds it); these do not count towards the single devices below
        tied = [c for c in claims if c.count > 1 or c.nodes is not None]
        for c in sorted(tied, key=lambda c: -c.count):
            fit = [
                n
                for n, gs in idle_nodes.items()
                if n not in chosen and len(gs) >= c.count and (c.nodes is None or names[n] in c.nodes)
            ]
            if fit:
                chosen.add(min(fit, key=lambda n: (len(idle_nodes[n]), n)))
        need = sum(c.count for c in claims if c.count == 1 and c.nodes is None)
        need += sum(self.policy.warm_pool.values())
        covered = 0
        for node in sorted(idle_nodes):
            if covered >= need:
                break
            if node not in chosen:
                chosen.add(node)
                covered += len(idle_nodes[node])
        idle = [g for n in chosen for g in idle_nodes[n]]
        return sorted(busy + idle, key=lambda g: g.pos), cooling
