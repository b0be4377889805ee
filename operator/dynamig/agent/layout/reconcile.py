"""The reshape protocol for one GPU as a pure function: observed instances + desired layout -> a plan.

Nothing here does I/O. The caller (``agent.controller``) observes NVML and the API, feeds the facts in
(which instances exist, which are busy, since when each removal candidate has been out of the
ResourceSlice and unallocated, ``now``), and carries out the returned :class:`GpuPlan`:

1. an invalid desired layout -> ``violation`` set, nothing else (touch nothing, keep publishing what exists);
2. an instance that exists but is not desired is never published again; it is destroyed only when it is not
   busy and has been out of the slice and unallocated for ``settle_seconds`` (``destroy``), otherwise it
   waits (``draining``) or is kept because a claim or a process holds it (``kept_busy``);
3. a desired instance that does not exist is created when its memory slices are free once this round's
   destroys are done (``create``), otherwise it waits (``blocked``);
4. a GPU instance without its compute instance (a crash between the two NVML calls) is completed when it is
   desired (``complete``) and destroyed like any other undesired free instance otherwise;
5. a GPU instance someone else split into several or partial compute instances is never published, completed
   or destroyed: it is kept as busy outside DRA (``kept_busy``).

With ``keep_undesired=True`` (the partitionable inventory, where the scheduler books placements itself)
``desired`` is a floor, not the whole layout: instances outside it stay (free ones remain bookable at zero
wait); a free one is retired only when a missing desired instance needs its memory slices and nothing busy
blocks that instance. A retired instance is ``draining``: the caller republishes it guarded (with binding
conditions) and it is destroyed once it has been so for ``settle_seconds``, as in the instances
inventory (see :mod:`dynamig.agent.layout.lifecycle` for why a free instance published without conditions
cannot go at once).

Because every input is observed afresh each round, a crash at any point converges on the next round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynamig.geometry.layout import check_layout
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, device_name, normalize_layout

if TYPE_CHECKING:
    from dynamig.agent.nvml.device import MigInstance


@dataclass(frozen=True, slots=True)
class Observed:
    """One GPU instance that exists, with what makes it busy."""

    placed: PlacedInstance
    claims: tuple[str, ...] = ()  # "namespace/name" of ResourceClaims whose allocation names the device
    processes: int = 0  # compute processes NVML reports on the MIG device
    has_compute_instance: bool = True
    prepared: bool = False  # the kubelet plugin prepared it for a pod
    partitioned: str = ""  # how someone else split it into compute instances; empty when dynamig-shaped

    @property
    def busy(self) -> bool:
        return bool(self.claims) or self.processes > 0 or self.prepared or bool(self.partitioned)

    def busy_reason(self) -> str:
        parts = []
        if self.partitioned:
            parts.append(f"split into {self.partitioned} outside dynamig")
        if self.prepared:
            parts.append("prepared for a pod by the kubelet")
        if self.claims:
            parts.append("allocated to " + ", ".join(self.claims))
        if self.processes:
            parts.append(f"{self.processes} process(es) running")
        return "; ".join(parts)


def observe(
    instances: Sequence[MigInstance], claims: Mapping[str, Sequence[str]], prepared: Collection[str]
) -> tuple[Observed, ...]:
    """NVML's instances as the reshape protocol and the binding answer see them: with the claims that
    allocate them (device name -> ``namespace/name``), processes, whether the kubelet prepared them
    (``prepared`` device names), how someone else split them. Pure."""
    out = []
    for i in instances:
        dev = device_name(i.gpu_index, i.profile, i.start)
        out.append(
            Observed(
                i.placed,
                claims=tuple(claims.get(dev, ())),
                processes=i.processes,
                has_compute_instance=i.has_compute_instance,
                prepared=dev in prepared,
                partitioned=i.describe_compute() if i.partitioned else "",
            )
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Waiting:
    placed: PlacedInstance
    reason: str


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """What to do on one GPU this round. Every tuple is sorted by placement."""

    violation: str | None = None
    publish: Layout = ()  # instances the ResourceSlice should offer after this round
    destroy: Layout = ()
    create: Layout = ()
    complete: Layout = ()  # GIs missing their CI, to finish
    draining: tuple[Waiting, ...] = ()  # undesired, free, still settling
    kept_busy: tuple[Waiting, ...] = ()  # undesired but busy: kept
    blocked: tuple[Waiting, ...] = ()  # desired, cannot be created yet
    notes: tuple[str, ...] = field(default=())

    @property
    def converged(self) -> bool:
        """True when nothing is left to do and nothing is waiting (busy instances kept count as done)."""
        return not (self.destroy or self.create or self.complete or self.draining or self.blocked)

    @property
    def acts(self) -> bool:
        """True when the plan changes NVML state this round."""
        return bool(self.destroy or self.create or self.complete)


def _span(model: GpuModel, p: PlacedInstance) -> range:
    if model.has_profile(p.profile):
        return model.profile(p.profile).span(p.start)
    return range(p.start, p.start + 1)


def overlaps(model: GpuModel, a: PlacedInstance, b: PlacedInstance) -> bool:
    span_a, span_b = _span(model, a), _span(model, b)
    return span_a.start < span_b.stop and span_b.start < span_a.stop


def _creatable(
    model: GpuModel,
    wanted: Sequence[PlacedInstance],
    held: Sequence[PlacedInstance],
    why: str = "memory slices held by {names}",
) -> tuple[list[PlacedInstance], list[Waiting]]:
    """``wanted`` split into those whose memory slices no ``held`` instance overlaps, and the rest as
    waiting (``why``, with ``{names}`` the instances in the way, is the reason). Pure."""
    create: list[PlacedInstance] = []
    blocked: list[Waiting] = []
    for p in wanted:
        in_way = [r for r in held if overlaps(model, p, r)]
        if in_way:
            names = ", ".join(f"{r.profile}@{r.start}" for r in in_way)
            blocked.append(Waiting(p, why.format(names=names)))
        else:
            create.append(p)
    return create, blocked


def without_creates_over(
    model: GpuModel,
    plan: GpuPlan,
    spared: Sequence[PlacedInstance],
    why: str = "memory slices held by {names} (retiring)",
) -> GpuPlan:
    """``plan`` with the creates that need a ``spared`` instance's slices (one the agent may not destroy
    yet, or a destroyed one whose slices are kept free: ``why`` says which, as for :func:`_creatable`) moved
    to ``blocked``. Pure."""
    if not spared:
        return plan
    create, blocked = _creatable(model, plan.create, spared, why)
    return dataclasses.replace(plan, create=tuple(create), blocked=(*plan.blocked, *blocked))


def plan_gpu(
    model: GpuModel,
    desired: Layout,
    observed: tuple[Observed, ...],
    quiet_since: Mapping[PlacedInstance, float],
    now: float,
    settle_seconds: float,
    keep_undesired: bool = False,
) -> GpuPlan:
    """Plan one round of the reshape protocol for one GPU. Pure.

    ``quiet_since[p]`` is when instance ``p`` was last seen both out of the published slice and unallocated;
    absent means it is still published (or was allocated a moment ago), so its settle period has not begun.
    ``keep_undesired``: treat ``desired`` as a floor (see the module docstring).
    """
    desired = normalize_layout(desired)
    violation = check_layout(model, desired)
    complete_existing = normalize_layout(
        [o.placed for o in observed if o.has_compute_instance and not o.partitioned]
    )
    if violation is not None:
        return GpuPlan(violation=violation.message, publish=complete_existing)

    wanted = set(desired)
    present = {o.placed for o in observed}
    # Keep mode: the missing desired instances that nothing busy stands in the way of.
    creatable = [
        p
        for p in desired
        if p not in present
        and not any(o.busy and o.placed not in wanted and overlaps(model, p, o.placed) for o in observed)
    ]
    destroy: list[PlacedInstance] = []
    draining: list[Waiting] = []
    kept: list[Waiting] = []
    complete: list[PlacedInstance] = []
    publish: list[PlacedInstance] = []
    remaining: list[PlacedInstance] = []  # instances that still exist after this round's destroys
    for o in sorted(observed, key=lambda x: x.placed):
        p = o.placed
        if o.partitioned:
            kept.append(Waiting(p, o.busy_reason()))
            remaining.append(p)
            continue
        if p in wanted:
            remaining.append(p)
            if o.has_compute_instance:
                publish.append(p)
            else:
                complete.append(p)
            continue
        in_nobodys_way = not any(overlaps(model, p, q) for q in desired if q not in present)
        if keep_undesired and in_nobodys_way and (o.has_compute_instance or o.busy):
            remaining.append(p)  # stays; bookable while free
            if o.has_compute_instance and not o.busy:
                publish.append(p)
            continue
        if o.busy:
            kept.append(Waiting(p, o.busy_reason()))
            remaining.append(p)
            continue
        if not o.has_compute_instance:
            destroy.append(p)  # never published, nothing can hold it
            continue
        if keep_undesired and not any(overlaps(model, p, q) for q in creatable):
            remaining.append(p)  # only a busy instance's removal would let the desired one in
            publish.append(p)
            continue
        since = quiet_since.get(p)
        if since is not None and now - since >= settle_seconds:
            destroy.append(p)
        else:
            left = settle_seconds if since is None else max(0.0, settle_seconds - (now - since))
            where = "published guarded" if keep_undesired else "out of the ResourceSlice"
            draining.append(Waiting(p, f"{where}, settling ({left:.1f}s left)"))
            remaining.append(p)

    existing = {o.placed for o in observed}
    create, blocked = _creatable(model, [p for p in desired if p not in existing], remaining)
    return GpuPlan(
        publish=normalize_layout(publish),
        destroy=normalize_layout(destroy),
        create=normalize_layout(create),
        complete=normalize_layout(complete),
        draining=tuple(draining),
        kept_busy=tuple(kept),
        blocked=tuple(blocked),
    )
