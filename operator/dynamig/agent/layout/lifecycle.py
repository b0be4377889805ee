"""The states a device of this node goes through and the moves allowed between them, as data. Pure.

Why a free instance may bind in the scheduling cycle, and when the agent may still destroy it
-----------------------------------------------------------------------------------------------
A device published without binding conditions (``FREE_UNGUARDED``) binds as soon as the scheduler writes
its allocation: kube-scheduler's PreBind waits only when an allocated device carries conditions
(k8s.io/kubernetes v1.36.3 and v1.37.2, pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go,
``hasBindingConditions``). The scheduler keeps an allocation in memory from Reserve until its PreBind
writes it (``SignalClaimPendingAllocation`` .. ``bindClaim``), and in between the binding cycle may wait on
Permit plugins (up to 15 minutes, pkg/scheduler/framework/runtime/framework.go ``maxTimeout``) and on
earlier PreBind plugins (volume binding). Nothing in PreBind re-reads the ResourceSlices. So an allocation
made from an older slice can surface long after the slice changed, and the agent must never destroy an
instance that such an allocation may name. Two destroys are allowed, and only these:

- ``DESTROY_IN_WAY``: a booked placement needs the instance's memory slices. Safe from any state in which
  the instance is free: the scheduler counts the counters of in-flight allocations as used (the allocator's
  allocated state includes its in-flight allocations, dra_manager.go ``GatherAllocatedState``), so it cannot
  have booked both the placement and an overlapping free instance; the allocation being answered proves no
  other allocation of the slices is in flight (one scheduler; see docs/architecture.md).
- ``DESTROY_RETIRED``: the agent's own initiative (a floor, a warm pool or an uninstall wants the slices).
  Only from ``GUARDED``: the instance was first republished with binding conditions (partitionable) or
  withdrawn (instances inventory), so every allocation the scheduler makes after it saw that slice waits for
  the agent; and :func:`retired_may_go` then asks for evidence that no allocation made from the older slice
  can still bind: the guard has stood for the settle period (the scheduler's watch lag plus the moment
  between Reserve and its binding cycle's first write), no pod is in a binding cycle toward this node, and
  then no claim names the instance (read in that order: a pod that finishes binding between the two reads
  has its allocation in the second). kube-scheduler writes ``status.nominatedNodeName`` before WaitOnPermit
  and PreBind whenever PreBind has work (pkg/scheduler/schedule_one.go ``bindingCycle``,
  NominatedNodeNameForExpectation, beta and on since 1.35; the DRA plugin's PreBindPreFlight says it has
  work for every pod with claims), so a hold in Permit or PreBind, however long, is visible on the pod.

A third destroy is the last line of defence, not a plan: ``DESTROY_FOR_BOUND``. A pod bound to a device
whose memory slices another free instance now holds (the scheduler allocated it from a slice older than a
retire or a cut, past every guard) would wait in ContainerCreating for ever; so the kubelet plugin's prepare
destroys the free instances in the way and creates the device, on the evidence a retire needs
(:func:`bound_may_clear`: no pod in a binding cycle toward the node, then no claim naming them, read just
now under the agent's lock, which every prepare takes). Anything busy in the way refuses the prepare, and
the kubelet tries again.

Every other move keeps or adds guards. :func:`move` refuses a move the table does not list, so a code path
that would destroy an unguarded instance on its own initiative raises instead of acting.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from dynamig.geometry.model import PlacedInstance


class State(StrEnum):
    FREE_UNGUARDED = "free-unguarded"  # exists, free, published without binding conditions
    GUARDED = "guarded"  # published with conditions (a placement, or an instance being retired) or withdrawn
    BOOKED = "booked"  # allocated with binding conditions, no answer yet
    CUTTING = "cutting"  # the agent destroys what is in the way and creates the instance
    READY = "ready"  # exists and is allocated: answered ready, or allocated from an unguarded slice
    FAILED = "failed"  # answered failed: the scheduler releases the allocation and books again
    DESTROYED = "destroyed"  # no instance at this placement


class Event(StrEnum):
    RETIRE = "retire"  # the agent wants the instance gone: republish it guarded (or withdraw it)
    KEEP = "keep"  # the agent no longer wants it gone: publish it unguarded again
    ALLOCATE = "allocate"  # an allocation without binding conditions (from an unguarded slice)
    BOOK = "book"  # an allocation with binding conditions
    ANSWER_READY = "answer-ready"  # the instance exists whole: ready, no NVML work
    START_CUT = "start-cut"
    CUT_DONE = "cut-done"
    ANSWER_FAILED = "answer-failed"
    RELEASE = "release"  # the allocation is gone (pod done, or the scheduler released a failed booking)
    DESTROY_IN_WAY = "destroy-in-way"  # a booked placement needs its memory slices
    DESTROY_RETIRED = "destroy-retired"  # the agent's own initiative, after the guard (retired_may_go)
    DESTROY_FOR_BOUND = "destroy-for-bound"  # a bound pod's device needs its slices (bound_may_clear)
    CREATE = "create"  # created for a floor or warm pool: free and unguarded from its first publish
    OFFER = "offer"  # the placement is published again (guarded: nothing exists there yet)


# state -> {event: next state}. A move that is not here is refused (IllegalMove).
MOVES: Mapping[State, Mapping[Event, State]] = {
    State.FREE_UNGUARDED: {
        Event.RETIRE: State.GUARDED,
        Event.ALLOCATE: State.READY,
        Event.DESTROY_IN_WAY: State.DESTROYED,
        Event.DESTROY_FOR_BOUND: State.DESTROYED,
        # no DESTROY_RETIRED: an allocation from the unguarded slice may be in flight
    },
    State.GUARDED: {
        Event.KEEP: State.FREE_UNGUARDED,
        Event.ALLOCATE: State.READY,  # made from the older, unguarded slice: what the guard waits out
        Event.BOOK: State.BOOKED,
        Event.DESTROY_IN_WAY: State.DESTROYED,
        Event.DESTROY_RETIRED: State.DESTROYED,
        Event.DESTROY_FOR_BOUND: State.DESTROYED,
        Event.CREATE: State.FREE_UNGUARDED,  # a placement nobody booked, created for the floor
    },
    State.BOOKED: {
        Event.ANSWER_READY: State.READY,
        Event.START_CUT: State.CUTTING,
        Event.ANSWER_FAILED: State.FAILED,
    },
    State.CUTTING: {
        Event.CUT_DONE: State.READY,
        Event.ANSWER_FAILED: State.FAILED,
    },
    State.READY: {
        Event.RELEASE: State.FREE_UNGUARDED,
    },
    State.FAILED: {
        Event.RELEASE: State.GUARDED,
    },
    State.DESTROYED: {
        Event.OFFER: State.GUARDED,
        Event.CREATE: State.FREE_UNGUARDED,
    },
}


class IllegalMove(RuntimeError):
    """A move the table does not allow: a bug in the caller, never acted on."""


def move(state: State, event: Event) -> State:
    """The state after ``event``; IllegalMove when the table does not allow it. Pure."""
    nxt = MOVES.get(state, {}).get(event)
    if nxt is None:
        raise IllegalMove(f"{event.value} is not allowed from {state.value}")
    return nxt


def free_state(guarded: bool) -> State:
    """The state of an existing, unallocated instance: guarded (republished with conditions, or withdrawn)
    or not. Pure."""
    return State.GUARDED if guarded else State.FREE_UNGUARDED


def retired_may_go(
    guarded_for: float | None, settle_seconds: float, holders: Sequence[str], binding_pods: Sequence[str]
) -> str | None:
    """None when an instance the agent retired may be destroyed; otherwise why it waits. Pure.

    ``guarded_for``: seconds since the guarded slice (or the withdrawal) was written, None when it has not
    been; ``holders``: claims whose allocation names the instance (read just now); ``binding_pods``: pods in
    a binding cycle toward this node (unbound, ``status.nominatedNodeName`` = this node, read just now).
    """
    if guarded_for is None:
        return "not yet republished guarded"
    if holders:
        return "allocated to " + ", ".join(holders)
    if guarded_for < settle_seconds:
        return f"guarded {guarded_for:.1f}s of {settle_seconds:.1f}s"
    return bound_may_clear(holders, binding_pods)


def bound_may_clear(holders: Sequence[str], binding_pods: Sequence[str]) -> str | None:
    """None when a free instance may go, on the evidence read just now (``binding_pods`` before
    ``holders``, as for :func:`retired_may_go`); otherwise why it stays. Pure."""
    if holders:
        return "allocated to " + ", ".join(holders)
    if binding_pods:
        shown = ", ".join(binding_pods[:3]) + (" ..." if len(binding_pods) > 3 else "")
        return f"pods binding to this node may hold an allocation from an older slice: {shown}"
    return None


@dataclass(frozen=True, slots=True)
class Kept:
    """A planned destroy that may not happen now, and why."""

    placed: PlacedInstance
    why: str
    won_by: tuple[str, ...] = ()  # claims whose allocation names it (or the kubelet's prepare): busy now


def destroys_now(
    planned: Sequence[PlacedInstance],
    bookable: Collection[PlacedInstance],
    guarded_since: Mapping[PlacedInstance, float],
    now: float,
    settle_seconds: float,
    holders: Mapping[PlacedInstance, Sequence[str]],
    prepared: Collection[PlacedInstance],
    binding_pods: Sequence[str],
) -> tuple[tuple[PlacedInstance, ...], tuple[Kept, ...]]:
    """Which of a GPU's ``planned`` own-initiative destroys may happen now, from reads made right before
    (``binding_pods`` read before ``holders``: a pod that finishes binding between the two reads shows in
    the second). ``bookable``: instances that were whole, hence published; one that never was (a GPU
    instance without its compute instance) needs no guard. Pure."""
    go: list[PlacedInstance] = []
    kept: list[Kept] = []
    for p in planned:
        claims = tuple(holders.get(p, ()))
        if claims or p in prepared:
            won_by = claims or ("prepared by the kubelet",)
            kept.append(Kept(p, f"a claim won the race ({', '.join(won_by)})", won_by))
            continue
        if p in bookable:
            since = guarded_since.get(p)
            wait = retired_may_go(
                None if since is None else now - since, settle_seconds, claims, binding_pods
            )
            if wait is not None:
                kept.append(Kept(p, wait))
                continue
            move(free_state(guarded=since is not None), Event.DESTROY_RETIRED)  # refuses an unguarded one
        go.append(p)
    return tuple(go), tuple(kept)
