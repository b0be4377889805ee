"""A placement booked by the scheduler that drops out of the node's offer before the agent cuts it.

Real: etcd, kube-apiserver, kube-scheduler and kube-controller-manager (the scheduler books the placement
from the published ResourceSlice and holds the pod's binding on its binding conditions); the node agent's
whole loop in the partitionable inventory, with its NVML code path. Simulated: the GPU (simnvml, with slow
creates or destroys; its event history is the ground truth for destroys) and the node (no kubelet: the test
plays its part, calling the agent's ``MigInstances.ensure``, what NodePrepareResources calls, for the bound
pod's device until it succeeds, as the kubelet retries a prepare).

The interleaving: a change of the GpuPartition's spec makes the agent's round do a slow NVML call (a 4 s
create or destroy, held until the booking lands, so a slow scheduler cannot miss the window); the round read
the node's claims before it, so a booking made meanwhile is not in its copy. Pod A is created as that call
starts and the scheduler books placement ``X`` for it from the slice the round has not replaced yet. The offer
the round then computes lacks ``X``, three ways:

- ``floor-over-x``: a floor instance (``spec.layout``) is cut over ``X``'s memory slices; with one
  placement offered per profile, ``X`` is then a re-cut ranked below the placements still empty;
- ``profile-withdrawn``: ``spec.offeredProfiles`` narrowed to leave ``X``'s profile out (a floor instance
  elsewhere, written in the same patch, as the operator writes them, makes the round slow);
- ``re-ranked``: one placement offered per profile, and the free instance next to ``X`` is retired for a
  floor instance that needs its slice (a slow destroy); with it gone the first-fit order of an empty GPU
  puts another placement of ``X``'s profile first, and ``X`` is not offered any more.

Asserted, within 90 s of the booking: pod A is either bound with its device prepared (an instance at ``X``
whose MIG UUID is the one the claim reports) or not bound; the booking is answered, ready or failed, never
left waiting; no instance is destroyed while a claim allocates it; and ``X`` stays in the node's slices from
the booking to its answer (kube/inventory.py, "What is published": the scheduler counts an allocated
device's counters only while the device is published, so a vanished ``X`` would let it book ``X``'s slices
a second time). The test also checks that the interleaving was reached: a round after the booking computed
an offer without ``X``.

What makes it pass: the agent answers every unanswered allocation of its pool whatever its offer says
(``AllocationAnswerer.answer_all`` over ``kube.answers.unanswered``), before the round's reshape, and the
publisher reads the claims afresh before a write that would drop a published device
(``SlicePublisher.sync_inventory``, ``before_dropping``), so the booking the round's copy lacks keeps ``X``
published. Without that read, each case publishes slices without ``X`` while it is booked (the last check
fails; the pod is still served).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.agent.controller import NodeAgent
from dynamig.agent.devices_service import AgentMigInstances
from dynamig.agent.nvml.device import GpuInfo, MigInstance, NvmlDevices
from dynamig.demo.cluster import (
    AllocationWatch,
    ScenarioApi,
    allocated_device,
    claim_pod,
    exactly,
    resource_claim,
)
from dynamig.demo.inprocess import agent_running, quick_agent_settings, whole_instances
from dynamig.devcluster import ControlPlane, eventually
from dynamig.geometry.model import PlacedInstance, device_name
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY, GpuInventory, published_devices_of
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, MANAGED_NODE_LABEL, VERSION

pytestmark = pytest.mark.controlplane

DRIVER = "mig.dynamig.io"
SAFE_WITHIN_S = 90.0
SLOW_S = 4.0  # the slow NVML call of the round that drops X: the booking lands while it runs
PREBIND_POLL_S = 5.0  # kube-scheduler re-reads binding conditions this often
QUARANTINE_S = 15.0  # ``re-ranked``: the floor waits, so the round that destroys publishes the GPU empty

Spec = tuple[list[tuple[str, int]], list[str]]  # (floor spec.layout, spec.offeredProfiles)


@dataclasses.dataclass(frozen=True)
class Drop:
    """One way ``X`` drops out of the offer: the spec before and after, the agent's placements per profile,
    and the NVML call (``create`` or ``destroy`` of a placement) the round that drops ``X`` is slow in."""

    name: str
    per_profile: int
    before: Spec
    after: Spec
    x: tuple[str, int]
    slow: tuple[str, tuple[str, int]]

    def __str__(self) -> str:
        return self.name


DROPS = [
    Drop(
        "floor-over-x",
        per_profile=1,
        before=([], ["1g.10gb", "3g.40gb"]),
        after=([("3g.40gb", 4)], ["1g.10gb", "3g.40gb"]),
        x=("1g.10gb", 6),
        slow=("create", ("3g.40gb", 4)),
    ),
    Drop(
        "profile-withdrawn",
        per_profile=0,
        before=([], ["1g.10gb", "2g.20gb"]),
        after=([("2g.20gb", 0)], ["2g.20gb"]),
        x=("1g.10gb", 6),
        slow=("create", ("2g.20gb", 0)),
    ),
    Drop(
        "re-ranked",
        per_profile=1,
        before=([("1g.10gb", 6)], ["1g.10gb"]),
        after=([("1g.20gb", 6)], ["1g.10gb"]),
        x=("1g.10gb", 5),
        slow=("destroy", ("1g.10gb", 6)),
    ),
]


# --- what the test watches --------------------------------------------------------------------------------


@dataclasses.dataclass
class SlowCall:
    """Wraps the agent's NVML create and destroy to tell when the chosen call begins, and holds that call
    (it runs in a worker thread) until ``release`` is set or ``hold_s`` has passed: the booking then lands
    while the round is in it however slowly the scheduler books. The call itself is unchanged."""

    kind: str
    placed: PlacedInstance
    hold_s: float = 60.0
    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    release: threading.Event = dataclasses.field(default_factory=threading.Event)

    def _begins(self, kind: str, placed: PlacedInstance) -> None:
        if kind == self.kind and placed == self.placed and not self.started.is_set():
            self.started.set()
            self.release.wait(self.hold_s)

    def install(self, devices: NvmlDevices) -> None:
        create, destroy = devices.create, devices.destroy

        def creating(gpu: GpuInfo, placed: PlacedInstance) -> MigInstance:
            self._begins("create", placed)
            return create(gpu, placed)

        def destroying(gpu: GpuInfo, placed: PlacedInstance, *, check_processes: bool = True) -> bool:
            self._begins("destroy", placed)
            return destroy(gpu, placed, check_processes=check_processes)

        devices.create = creating  # type: ignore[method-assign]
        devices.destroy = destroying  # type: ignore[method-assign]


@dataclasses.dataclass
class Offers:
    """Every offer the agent's rounds hand the publisher (the ranked devices, before booked ones are kept),
    with when. Observation only: the publisher is called as before."""

    seen: list[tuple[float, frozenset[str]]] = dataclasses.field(default_factory=list)

    def install(self, agent: NodeAgent) -> None:
        sync = agent.publisher.sync_inventory

        async def recorded(
            gpus: Sequence[GpuInventory],
            existing: list[dict[str, Any]] | None = None,
            claims: list[dict[str, Any]] | None = None,
            whole: Sequence[dict[str, Any]] = (),
        ) -> bool:
            self.seen.append((time.time(), frozenset(d.name for d in published_devices_of(gpus))))
            return await sync(gpus, existing, claims, whole)

        agent.publisher.sync_inventory = recorded  # type: ignore[method-assign]

    def without(self, device: str, since: float) -> list[float]:
        return [t for t, names in self.seen if t >= since and device not in names]


@dataclasses.dataclass
class Sample:
    at: float
    published: bool  # X in the node's slices
    allocated: str | None  # the device A's claim allocates
    answer: str | None  # the condition answering it ("ready" / "failed"), if any


def answer_of(claim: dict[str, Any] | None, device: str) -> str | None:
    """``ready`` / ``failed`` when the claim's status answers ``device``; else None. Pure."""
    for entry in ((claim or {}).get("status") or {}).get("devices") or []:
        if entry.get("driver") != DRIVER or entry.get("device") != device:
            continue
        for c in entry.get("conditions") or []:
            if c.get("status") == "True" and c.get("type") == BINDING_READY:
                return "ready"
            if c.get("status") == "True" and c.get("type") == BINDING_FAILED:
                return "failed"
    return None


@contextlib.asynccontextmanager
async def sampled(k: ScenarioApi, node: str, claim: str, device: str) -> AsyncIterator[list[Sample]]:
    """Every 100 ms: whether ``device`` is in ``node``'s slices, what ``claim`` allocates, and its answer."""
    samples: list[Sample] = []

    async def run() -> None:
        while True:
            with contextlib.suppress(client.ApiException, TimeoutError):
                res = await k.custom.list_cluster_custom_object(
                    "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}",
                    _request_timeout=5,
                )  # fmt: skip
                names = {d.get("name") for s in res["items"] for d in s["spec"].get("devices") or []}
                got = await read_claim(k, claim)
                samples.append(
                    Sample(time.time(), device in names, allocated_device(got), answer_of(got, device))
                )
            await asyncio.sleep(0.1)

    task = asyncio.create_task(run(), name="slice-sampler")
    try:
        yield samples
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- helpers ---------------------------------------------------------------------------------------------


def at(profile: str, start: int) -> dict[str, Any]:
    """A request for exactly the device of ``profile`` at placement ``start``. Pure."""
    attr = f'device.attributes["{DRIVER}"]'
    return exactly(f'{attr}.profile == "{profile}" && {attr}.placementStart == {start}')


async def set_spec(k: ScenarioApi, gpu: str, spec: Spec) -> None:
    layout, profiles = spec
    await k.custom.patch_cluster_custom_object(
        GROUP, VERSION, GPU_PARTITION_PLURAL, gpu,
        {"spec": {"layout": [{"profile": p, "start": s} for p, s in layout], "offeredProfiles": profiles}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


async def read_claim(k: ScenarioApi, name: str) -> dict[str, Any] | None:
    with contextlib.suppress(client.ApiException):
        got: dict[str, Any] = await k.custom.get_namespaced_custom_object(
            "resource.k8s.io", "v1", k.ns, "resourceclaims", name, _request_timeout=5
        )
        return got
    return None


async def bound(k: ScenarioApi, pod: str) -> str | None:
    with contextlib.suppress(client.ApiException):
        got = await k.core.read_namespaced_pod(pod, k.ns)
        return got.spec.node_name or None
    return None


async def published(k: ScenarioApi, node: str, device: str) -> bool | None:
    res = await k.custom.list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
    )
    names = {d.get("name") for s in res["items"] for d in s["spec"].get("devices") or []}
    return True if device in names else None


async def floor_in_place(k: ScenarioApi, gpu: str, layout: list[tuple[str, int]]) -> bool | None:
    """The GpuPartition reports the current generation with every floor instance of ``layout`` present."""
    part = await k.stable(gpu)
    if part is None:
        return None
    have = {(i.get("profile"), i.get("start")) for i in (part.get("status") or {}).get("instances") or []}
    return True if set(layout) <= have else None


async def prepared_or_unbound(
    k: ScenarioApi, agent: NodeAgent, pod: str, answer: Callable[[], str | None], within_s: float
) -> str:
    """Plays the kubelet for ``pod`` for up to ``within_s`` seconds: once bound, its device is prepared
    through the agent's ``MigInstances`` (what NodePrepareResources calls), again every second until that
    succeeds. Returns ``prepared <device> <MIG UUID>``; ``unbound`` (not bound: the booking was failed and
    the pod stayed unbound for two PreBind polls since, or nothing bound it within ``within_s``); or
    ``stuck ...`` (bound, never prepared: the last error)."""
    instances = AgentMigInstances(agent)
    deadline = time.monotonic() + within_s
    failed_at: float | None = None
    outcome = "unbound"
    while time.monotonic() < deadline:
        if await bound(k, pod):
            dev = allocated_device(await read_claim(k, pod))
            if dev is None:
                outcome = "stuck: bound, claim not allocated"
            else:
                try:
                    made = await instances.ensure(dev)
                    return f"prepared {dev} {made.mig_uuid}"
                except Exception as exc:  # what the kubelet would retry, and show in the pod's events
                    outcome = f"stuck: bound to {dev}, prepare failed: {exc}"
        elif answer() == "failed":
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > 2 * PREBIND_POLL_S:
                return "unbound"
        await asyncio.sleep(1.0)
    return outcome


# --- the test --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop", DROPS, ids=str)
async def test_a_placement_dropped_from_the_offer_while_booked_is_answered_and_never_strands_its_pod(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    make_node: Callable[..., str],
    namespace: str,
    sim: ModuleType,
    drop: Drop,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    create_s, destroy_s = (SLOW_S, 0.0) if drop.slow[0] == "create" else (1.0, SLOW_S)
    sim.configure(gpus=["A100-80GB"], state_file=None, create_latency_s=create_s, destroy_latency_s=destroy_s)
    node = make_node(f"drop-{drop.name}", labels={MANAGED_NODE_LABEL: "true"})
    gpu = f"{node}-gpu0"
    x = device_name(0, *drop.x)
    settings = dataclasses.replace(
        quick_agent_settings(node),
        inventory=Inventory.PARTITIONABLE,
        placements_per_profile=drop.per_profile,
        quarantine_seconds=QUARANTINE_S,
    )
    watch = AllocationWatch(k)
    async with agent_running(kube_api, node, sim, settings) as agent:
        await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
        await set_spec(k, gpu, drop.before)
        await eventually(functools.partial(floor_in_place, k, gpu, drop.before[0]), "the first floor", 60)
        await eventually(functools.partial(published, k, node, x), f"{x} offered", within_s=60)
        slow = SlowCall(drop.slow[0], PlacedInstance(drop.slow[1][1], drop.slow[1][0]))
        slow.install(agent.devices)
        offers = Offers()
        offers.install(agent)
        since = len(sim.history())
        watch.start()
        try:
            async with sampled(k, node, "a", x) as samples:
                t0 = time.time()
                await set_spec(k, gpu, drop.after)
                await eventually(
                    lambda: _now(True if slow.started.is_set() else None),
                    f"the round's {drop.slow[0]} of {drop.slow[1]}", within_s=60, every_s=0.05,
                )  # fmt: skip
                t_slow = time.time()
                await k.custom.create_namespaced_custom_object(
                    "resource.k8s.io", "v1", k.ns, "resourceclaims", resource_claim("a", at(*drop.x))
                )
                await k.core.create_namespaced_pod(
                    k.ns, claim_pod("a", {"kubernetes.io/hostname": node}, claim="a")
                )
                try:
                    claim = await eventually(
                        lambda: _allocated_claim(k, "a"), "a booked", within_s=SAFE_WITHIN_S, every_s=0.05
                    )
                    t_booked = time.time()
                    booked, held = allocated_device(claim), _held_for_answer(claim)
                finally:
                    slow.release.set()

                def answer() -> str | None:
                    return next((s.answer for s in samples if s.answer), None)

                outcome = await prepared_or_unbound(k, agent, "a", answer, SAFE_WITHIN_S)
                got = await read_claim(k, "a")
            now = whole_instances(sim)
            lost = watch.destroyed_while_allocated(sim.history()[since:])
        finally:
            await watch.stop()

    # The interleaving: the booking of X, then a round's offer without X.
    assert booked == x, f"the scheduler booked {booked}, not {x}: the case was not set up"
    assert held, f"{x} was booked without binding conditions (an existing instance): the case was not set up"
    dropped_at = offers.without(x, t_booked)
    assert dropped_at, (
        f"no round after the booking offered the GPU without {x} (offers since: "
        f"{[(round(t - t0, 1), sorted(n)) for t, n in offers.seen if t >= t_booked]}): not reached"
    )
    # The safety property.
    assert not outcome.startswith("stuck"), f"pod a bound to a device never prepared: {outcome}"
    if outcome.startswith("prepared"):
        _, dev, mig = outcome.split()
        assert dev == x and now.get(x) == mig, (outcome, now)
        reported = {
            e.get("data", {}).get("migUUID")
            for e in ((got or {}).get("status") or {}).get("devices") or []
            if e.get("device") == x
        } - {None}
        assert reported <= {mig}, f"the claim reports {reported}, the instance at {x} is {mig}"
    answers = [s for s in samples if s.answer]
    assert answers, f"the booking of {x} was never answered within {SAFE_WITHIN_S:.0f}s: {outcome}"
    assert lost == [], lost
    # X stays published from the booking until its answer.
    t_answer = answers[0].at
    gaps = [round(s.at - t0, 2) for s in samples if t_booked <= s.at < t_answer and not s.published]
    assert not gaps, (
        f"{x} was missing from the node's slices while booked and unanswered, at {gaps}s (booked at "
        f"{t_booked - t0:.1f}s, answered {answers[0].answer} at {t_answer - t0:.1f}s)"
    )
    print(
        f"\n  {drop}: slow {drop.slow[0]} began {t_slow - t0:.1f}s after the spec change; {x} booked at "
        f"{t_booked - t0:.1f}s; offered without it at {[round(t - t0, 1) for t in dropped_at]}s; answered "
        f"{answers[0].answer} at {t_answer - t0:.1f}s; {outcome}"
    )


async def _allocated_claim(k: ScenarioApi, name: str) -> dict[str, Any] | None:
    """The claim once it is allocated (the allocation and its binding conditions are written together)."""
    claim = await read_claim(k, name)
    return claim if allocated_device(claim) else None


def _held_for_answer(claim: dict[str, Any] | None) -> bool:
    """Whether the claim's allocation carries binding conditions: its pod waits for the agent's answer.
    Pure."""
    results = (((claim or {}).get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
    return bool(results and results[0].get("bindingConditions"))


async def _now(value: Any) -> Any:
    return value
