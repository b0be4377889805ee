"""A real kube-scheduler that lags on purpose, against the partitionable inventory: what it books from an old
view must never leave a pod bound to a device that is never prepared, nor lose an allocated instance.

Real: etcd, kube-apiserver, kube-controller-manager, and kube-scheduler v1.37.2 reaching the API server only
through the lag proxy (devcluster/lagproxy.py), which holds back the watch events of the resources a test
chooses; the node agent's whole loop with its default settle period (5 s) and the NVML code path. Simulated:
the GPU (simnvml; its event history is the ground truth for destroys) and the node (no kubelet: the tests
play its part, calling the agent's ``MigInstances.ensure``, what the kubelet plugin's NodePrepareResources
calls, for each bound pod's device until it succeeds, as the kubelet retries a prepare).

- Hole 1, a retire seen late: the scheduler's ResourceSlice watch is held back ``L`` seconds. The agent
  retires a free 1g.10gb ``Y`` for a 7g.80gb floor (republishes it guarded), waits its settle and destroys
  it; a pod asking for 1g.10gb created right after the destroy may be allocated ``Y`` from the scheduler's
  old view, where ``Y`` is a free instance without binding conditions, and binds at once.
- The same retire with the scheduler's slices 10 s late and a pod created as the retire begins, while the
  proxy holds the scheduler's ``status.nominatedNodeName`` write 20 s: kube-scheduler waits for that write
  before PreBind, so the allocation of ``Y`` reaches the API server 20 s late, long after the agent, which
  saw neither a nomination nor an allocation, destroyed ``Y`` and cut the floor.
- Hole 2, a booking deleted mid-round: slow creates (4 s each) queue four bookings ahead of pod B's in one
  round of the agent. B books the 2g.20gb placement over a free 1g.10gb ``F`` (its cut destroys ``F``); B
  and its claim are deleted once that round is cutting, and pod C asking for ``F`` is created once the
  scheduler has dropped B (so ``F`` is free again in its view) while the round is still cutting.

Asserted, the design's safety property: within 90 s every pod is either bound with its device prepared (an
instance at the allocated placement whose MIG UUID is the one the claim reports) or not bound; and no
instance is destroyed while a claim allocates it.

Each check can fail. Against an agent that fills a retired instance's slices with the floor instance at once
and serves no pod bound to a destroyed device at prepare, hole 1 with ``L`` = 10, 30 or 60 and the 20 s
nomination leave the pod bound to ``Y`` with every prepare refused for the whole 90 s (``memory slices 0-0
of GPU 0 are held by 7g.80gb at slice 0``); against one that destroys what is in a booking's way on its
round's snapshot of the claims, hole 2 destroys ``F`` about 6 s after C was allocated it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.agent.controller import NodeAgent
from dynamig.agent.devices_service import AgentMigInstances
from dynamig.demo.cluster import (
    AllocationWatch,
    ScenarioApi,
    allocated_device,
    claim_pod,
    exactly,
    first_available,
    layout_text,
    resource_claim,
)
from dynamig.demo.inprocess import agent_running, quick_agent_settings, whole_instances
from dynamig.devcluster import eventually
from dynamig.devcluster.lagproxy import LaggingCluster
from dynamig.geometry.model import device_name
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, MANAGED_NODE_LABEL, VERSION

pytestmark = pytest.mark.controlplane

SETTLE_S = 5.0  # the agent's default settle period
SAFE_WITHIN_S = 90.0
# An unbound pod is known safe, short of SAFE_WITHIN_S, once the scheduler has seen the node's current slices
# and this long has passed with nothing bound or booked: longer than the 20 s nomination stall plus a PreBind
# poll, the longest a binding cycle started on an old view stays in flight here.
QUIET_S = 30.0
DRIVER = "mig.dynamig.io"
A100_PROFILES = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
Y = ("1g.10gb", 0)
FLOOR = [("7g.80gb", 0)]


# --- variants and the soak ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a run varies beyond the lag: the inventory, the simulated create latency, and the quarantine
    (1 s: the floor is cut over a retired instance's slices at once, so a late allocation is served by the
    prepare-time recovery; 120 s, the default: the slices stay free and the prepare creates the instance
    again)."""

    inventory: Inventory
    create_s: float
    quarantine_s: float

    def __str__(self) -> str:
        return f"{self.inventory.value}-create{self.create_s:g}s-quarantine{self.quarantine_s:g}s"


DEFAULT_VARIANT = Variant(Inventory.PARTITIONABLE, 0.5, 1.0)
SOAK_VARIANTS = [
    Variant(inventory, create_s, quarantine_s)
    for quarantine_s in (1.0, 120.0)
    for create_s in (0.5, 3.0)
    for inventory in (Inventory.PARTITIONABLE, Inventory.INSTANCES)
]
# DYNAMIG_LAG_VARIANTS picks soak variants by index ("0,3" or "all"; a soak loops over rounds of them, each
# round a control plane of its own); DYNAMIG_LAG_REPORT=path appends one JSON line per run (case, variant,
# outcome, destroys of allocated instances, seconds from the first refused prepare to the prepared device).
REPORT = os.environ.get("DYNAMIG_LAG_REPORT")


def chosen_variants(spec: str) -> list[Variant]:
    if not spec:
        return [DEFAULT_VARIANT]
    if spec == "all":
        return SOAK_VARIANTS
    return [SOAK_VARIANTS[int(i) % len(SOAK_VARIANTS)] for i in spec.split(",")]


VARIANTS = chosen_variants(os.environ.get("DYNAMIG_LAG_VARIANTS", ""))


# --- set-up on the lagging cluster ------------------------------------------------------------------------


@dataclasses.dataclass
class Site:
    k: ScenarioApi
    node: str
    gpu: str


@contextlib.asynccontextmanager
async def site(cluster: LaggingCluster, api: client.ApiClient, prefix: str) -> AsyncIterator[Site]:
    """A namespace and a managed node of their own on the lagging cluster; both deleted afterwards."""
    cp = cluster.cp
    ns = f"{prefix}-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(cp.kubectl, "create", "namespace", ns)
    with contextlib.suppress(client.ApiException):  # pod admission needs it; the controller may be first
        await client.CoreV1Api(api).create_namespaced_service_account(ns, {"metadata": {"name": "default"}})
    node = f"{ns}-node"
    await cp.aregister_node(node, labels={MANAGED_NODE_LABEL: "true"})
    k = ScenarioApi(api, ns)
    await k.ensure_device_class()
    try:
        yield Site(k, node, f"{node}-gpu0")
    finally:
        with contextlib.suppress(Exception):
            await k.core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        with contextlib.suppress(Exception):
            await k.core.delete_namespace(ns)
        with contextlib.suppress(Exception):
            await cp.adelete_node(node)


@pytest.fixture
async def lagging_api(lagging_cluster: LaggingCluster) -> AsyncIterator[client.ApiClient]:
    async with lagging_cluster.cp.api_client() as api:
        yield api


async def scheduler_sees_slices(cluster: LaggingCluster, k: ScenarioApi, node: str) -> None:
    """Wait until every ResourceSlice of ``node``, as stored now, went through the proxy to the scheduler: the
    view a lag then keeps it in."""
    res = await k.custom.list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
    )
    now = [(sl["metadata"]["name"], sl["metadata"]["resourceVersion"]) for sl in res["items"]]
    assert now, f"no ResourceSlice of {node}"

    async def seen() -> bool | None:
        return True if all(cluster.proxy.delivered("resourceslices", n, v) for n, v in now) else None

    try:
        await eventually(seen, "the scheduler seeing the node's slices", within_s=30)
    except TimeoutError as exc:
        proxy = cluster.proxy
        asked = [
            (round(r.at, 1), r.method, r.query[:60], r.status) for r in proxy.seen("resourceslices")[-5:]
        ]
        got = [(d.type, d.name, d.version) for d in proxy.events if d.resource == "resourceslices"][-5:]
        raise AssertionError(
            f"{exc}: want {now}; open watches {proxy.open_watches('resourceslices')}, "
            f"last requests {asked}, last events {got}"
        ) from exc


def settings(node: str, variant: Variant) -> Any:
    """The variant's inventory and quarantine with the agent's default settle period; other periods quick."""
    return dataclasses.replace(
        quick_agent_settings(node),
        settle_seconds=SETTLE_S,
        quarantine_seconds=variant.quarantine_s,
        inventory=variant.inventory,
    )


async def offer(k: ScenarioApi, gpu: str, layout: list[tuple[str, int]], profiles: list[str]) -> None:
    """What a Dynamic policy's operator writes: the floor layout and the offered profiles."""
    await k.custom.patch_cluster_custom_object(
        GROUP, VERSION, GPU_PARTITION_PLURAL, gpu,
        {"spec": {"layout": [{"profile": p, "start": s} for p, s in layout], "offeredProfiles": profiles}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


async def offering(
    k: ScenarioApi, gpu: str, layout: list[tuple[str, int]], inventory: Inventory = Inventory.PARTITIONABLE
) -> dict[str, Any] | None:
    """The GpuPartition once stable at ``layout`` and, in the partitionable inventory, offering placements."""
    part = await k.stable(gpu, layout_text(layout))
    st = (part or {}).get("status") or {}
    return part if st.get("offeredPlacements") or inventory is Inventory.INSTANCES else None


async def pin(k: ScenarioApi, name: str, node: str, request: dict[str, Any]) -> None:
    """A claim of its own and a pod using it, pinned to ``node``."""
    await k.custom.create_namespaced_custom_object(
        "resource.k8s.io", "v1", k.ns, "resourceclaims", resource_claim(name, request)
    )
    await k.core.create_namespaced_pod(k.ns, claim_pod(name, {"kubernetes.io/hostname": node}, claim=name))


async def claim(k: ScenarioApi, name: str) -> dict[str, Any] | None:
    with contextlib.suppress(client.ApiException):
        got: dict[str, Any] = await k.custom.get_namespaced_custom_object(
            "resource.k8s.io", "v1", k.ns, "resourceclaims", name
        )
        return got
    return None


async def booked(k: ScenarioApi, name: str) -> str | None:
    return allocated_device(await claim(k, name))


async def bound(k: ScenarioApi, pod: str) -> str | None:
    with contextlib.suppress(client.ApiException):
        got = await k.core.read_namespaced_pod(pod, k.ns)
        return got.spec.node_name or None
    return None


def destroyed(sim: ModuleType, since: int, profile: str, start: int) -> bool | None:
    hit = any(
        e.kind == "destroy-gi" and e.profile == profile and e.start == start for e in sim.history()[since:]
    )
    return True if hit else None


# --- the safety property ----------------------------------------------------------------------------------


async def prepared_or_unbound(
    k: ScenarioApi,
    agent: NodeAgent,
    pods: list[str],
    settled: Callable[[], Awaitable[bool]],
    within_s: float = SAFE_WITHIN_S,
) -> tuple[dict[str, str], dict[str, float]]:
    """Plays the kubelet for ``pods`` for up to ``within_s`` seconds: each bound pod's device is prepared
    through the agent's ``MigInstances`` (what NodePrepareResources calls), again every second until that
    succeeds. Returns, per pod, what it ended as: ``prepared <device> <MIG UUID>``, ``unbound``, or
    ``stuck ...`` (bound, never prepared: the last error); and, per prepared pod, the seconds from its first
    failed prepare to its prepared device (0 when the first try served it).

    It stops early once no pod is stuck and ``settled()`` (the scheduler has seen the node's current slices,
    nothing held back) has stayed true for ``QUIET_S`` with the outcomes unchanged: an unbound pod then
    cannot bind from an old view any more."""
    instances = AgentMigInstances(agent)
    outcome: dict[str, str] = {}
    first_refused: dict[str, float] = {}
    served_after: dict[str, float] = {}
    deadline = time.monotonic() + within_s
    quiet_since: float | None = None
    while True:
        before = dict(outcome)
        for pod in pods:
            if outcome.get(pod, "").startswith("prepared"):
                continue
            if not await bound(k, pod):
                outcome[pod] = "unbound"
                continue
            dev = await booked(k, pod)
            if dev is None:  # bound with its claim deallocated: nothing to prepare, never runs
                outcome[pod] = "stuck: bound, claim not allocated"
                continue
            try:
                made = await instances.ensure(dev)
                outcome[pod] = f"prepared {dev} {made.mig_uuid}"
                served_after[pod] = max(0.0, time.monotonic() - first_refused.get(pod, time.monotonic()))
            except Exception as exc:  # what the kubelet would retry, and show in the pod's events
                outcome[pod] = f"stuck: bound to {dev}, prepare failed: {exc}"
                first_refused.setdefault(pod, time.monotonic())
        now = time.monotonic()
        if all(o.startswith("prepared") for o in outcome.values()) or now > deadline:
            return outcome, served_after
        calm = outcome == before and not any(o.startswith("stuck") for o in outcome.values())
        if calm and await settled():
            quiet_since = now if quiet_since is None else quiet_since
            if now - quiet_since >= QUIET_S:
                return outcome, served_after
        else:
            quiet_since = None
        await asyncio.sleep(1.0)


def scheduler_caught_up(cluster: LaggingCluster, k: ScenarioApi, node: str) -> Callable[[], Awaitable[bool]]:
    """Whether every ResourceSlice of ``node``, as stored now, went through the proxy to the scheduler."""

    async def caught_up() -> bool:
        res = await k.custom.list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
        )
        now = [(sl["metadata"]["name"], sl["metadata"]["resourceVersion"]) for sl in res["items"]]
        return bool(now) and all(cluster.proxy.delivered("resourceslices", n, v) for n, v in now)

    return caught_up


async def assert_safe(
    case: str,
    variant: Variant,
    k: ScenarioApi,
    agent: NodeAgent,
    sim: ModuleType,
    watch: AllocationWatch,
    pods: list[str],
    since: int,
    settled: Callable[[], Awaitable[bool]],
) -> dict[str, str]:
    t0 = time.monotonic()
    outcome, served_after = await prepared_or_unbound(k, agent, pods, settled)
    now = whole_instances(sim)
    lost = watch.destroyed_while_allocated(sim.history()[since:])
    report(case, variant, outcome, served_after, lost, time.monotonic() - t0)
    stuck = {p: o for p, o in outcome.items() if o.startswith("stuck")}
    assert not stuck, f"pods bound to a device never prepared within {SAFE_WITHIN_S:.0f}s: {stuck}"
    for pod, o in outcome.items():
        if not o.startswith("prepared"):
            continue
        _, dev, mig = o.split()
        assert now.get(dev) == mig, (pod, dev, mig, now)
        reported = [e for e in ((await claim(k, pod)) or {}).get("status", {}).get("devices") or []]
        uuids = {e.get("data", {}).get("migUUID") for e in reported if e.get("device") == dev} - {None}
        assert uuids <= {mig}, f"{pod}: the claim reports {uuids}, the instance at {dev} is {mig}"
    assert lost == [], lost
    return outcome


def report(
    case: str,
    variant: Variant,
    outcome: dict[str, str],
    served_after: dict[str, float],
    lost: list[str],
    waited_s: float,
) -> None:
    """One JSON line per run to ``DYNAMIG_LAG_REPORT``, when set."""
    if not REPORT:
        return
    line = {
        "case": case,
        "inventory": variant.inventory.value,
        "create_s": variant.create_s,
        "quarantine_s": variant.quarantine_s,
        "outcome": outcome,
        "served_after_s": {p: round(s, 1) for p, s in served_after.items()},
        "destroyed_while_allocated": lost,
        "waited_s": round(waited_s, 1),
    }
    with open(REPORT, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


# --- hole 1: a retire the scheduler sees late --------------------------------------------------------------


RETIRE_LAGS = [0, 10, 30, 60]


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("lag_s", RETIRE_LAGS)
async def test_a_free_instance_retired_behind_the_schedulers_back_leaves_no_pod_on_a_missing_device(
    lagging_cluster: LaggingCluster,
    lagging_api: client.ApiClient,
    sim: ModuleType,
    lag_s: int,
    variant: Variant,
) -> None:
    proxy = lagging_cluster.proxy
    async with site(lagging_cluster, lagging_api, f"retire{lag_s}") as s:
        k = s.k
        sim.configure(gpus=["A100-80GB"], state_file=None, seed=s.node, create_latency_s=variant.create_s)
        watch = AllocationWatch(k)
        async with agent_running(lagging_api, s.node, sim, settings(s.node, variant)) as agent:
            await eventually(functools.partial(k.stable, s.gpu), f"GpuPartition {s.gpu}", within_s=60)
            await offer(k, s.gpu, [Y], ["1g.10gb"])
            y_offered = functools.partial(offering, k, s.gpu, [Y], variant.inventory)
            await eventually(y_offered, "Y free and offered", within_s=60)
            y = device_name(0, *Y)
            assert y in whole_instances(sim)
            await scheduler_sees_slices(lagging_cluster, k, s.node)  # Y as a free instance

            proxy.hold("resourceslices", lag_s)
            since = len(sim.history())
            watch.start()
            try:
                t0 = time.monotonic()
                await offer(k, s.gpu, FLOOR, ["1g.10gb"])  # the floor needs Y's slices: Y is retired
                await eventually(
                    lambda: _async(destroyed(sim, since, *Y)), "Y destroyed after its settle", within_s=60
                )
                retired_s = time.monotonic() - t0
                # Y's destroy came before the pod existed: what may not be lost is what follows (the claim
                # watch's 50 ms margin would otherwise count a destroy just before the allocation).
                pinned = len(sim.history())
                await pin(k, "late", s.node, {"firstAvailable": first_available(["1g.10gb"])})
                outcome = await assert_safe(
                    f"retire-lag{lag_s}", variant, k, agent, sim, watch, ["late"], pinned,
                    scheduler_caught_up(lagging_cluster, k, s.node),
                )  # fmt: skip
            finally:
                await watch.stop()
        print(f"\n  retire seen {lag_s}s late: Y destroyed {retired_s:.1f}s after the retire; {outcome}")


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("stall_s", [0, 20])
async def test_a_binding_cycle_whose_nomination_write_is_late_leaves_no_pod_on_a_missing_device(
    lagging_cluster: LaggingCluster,
    lagging_api: client.ApiClient,
    sim: ModuleType,
    stall_s: int,
    variant: Variant,
) -> None:
    """The same retire, the scheduler's slices 10 s late, and a pod created right as the retire begins: the
    scheduler books ``Y`` from its old view, where it is free. Its write of the pod's
    ``status.nominatedNodeName``, what tells the agent a binding cycle is under way, is held ``stall_s``
    seconds, longer than the settle period."""
    proxy = lagging_cluster.proxy
    async with site(lagging_cluster, lagging_api, f"nominate{stall_s}") as s:
        k = s.k
        sim.configure(gpus=["A100-80GB"], state_file=None, seed=s.node, create_latency_s=variant.create_s)
        watch = AllocationWatch(k)
        async with agent_running(lagging_api, s.node, sim, settings(s.node, variant)) as agent:
            await eventually(functools.partial(k.stable, s.gpu), f"GpuPartition {s.gpu}", within_s=60)
            await offer(k, s.gpu, [Y], ["1g.10gb"])
            y_offered = functools.partial(offering, k, s.gpu, [Y], variant.inventory)
            await eventually(y_offered, "Y free and offered", within_s=60)
            await scheduler_sees_slices(lagging_cluster, k, s.node)  # Y as a free instance

            proxy.hold("resourceslices", 10)
            proxy.stall_nominations(stall_s)
            since, nominations = len(sim.history()), len(proxy.nominations)
            watch.start()
            try:
                t0 = time.time()
                await offer(k, s.gpu, FLOOR, ["1g.10gb"])
                await pin(k, "early", s.node, {"firstAvailable": first_available(["1g.10gb"])})
                outcome = await assert_safe(
                    f"nomination-stall{stall_s}", variant, k, agent, sim, watch, ["early"], since,
                    scheduler_caught_up(lagging_cluster, k, s.node),
                )  # fmt: skip
            finally:
                await watch.stop()
        gone = [
            f"{e.profile}@{e.start} at {e.timestamp - t0:.1f}s"
            for e in sim.history()[since:]
            if e.kind == "destroy-gi"
        ]
        allocated = watch.first_allocated.get("early", t0) - t0
        print(
            f"\n  nomination held {stall_s}s: {len(proxy.nominations) - nominations} nomination write(s); "
            f"claim allocated at {allocated:.1f}s; destroyed: {gone}; {outcome}"
        )


# --- hole 2: a booking deleted while slow bookings ahead of it are being cut -----------------------------


CREATE_LATENCY_S = 4.0
PREBIND_POLL_S = 5.0  # kube-scheduler's DRA PreBind re-reads binding conditions this often
F = ("1g.10gb", 0)  # a free instance, kept by the floor
B = ("2g.20gb", 0)  # B's placement: F is in its way
AHEAD = [("1g.10gb", 6), ("1g.10gb", 5), ("1g.10gb", 4), ("1g.10gb", 3)]  # clear of F and B


def at(profile: str, start: int) -> dict[str, Any]:
    """A request for exactly the device of ``profile`` at placement ``start``. Pure."""
    return exactly(
        f'device.attributes["{DRIVER}"].profile == "{profile}" && '
        f'device.attributes["{DRIVER}"].placementStart == {start}'
    )


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
async def test_a_booking_deleted_mid_round_never_costs_the_next_pod_its_instance(
    lagging_cluster: LaggingCluster, lagging_api: client.ApiClient, sim: ModuleType, variant: Variant
) -> None:
    """A free 1g.10gb ``F``; three pods book placements clear of it, each a slow create; pod B books the
    2g.20gb over ``F`` (cutting it means destroying ``F``) and is deleted, with its claim, while the agent is
    still cutting for the others; pod C then gets ``F`` itself, free again in the scheduler's view once it
    has dropped B (its binding cycle notices the claim gone at its next 5 s poll of the binding conditions,
    so the cuts ahead must outlast that). Whatever the agent still had in hand for B must not take ``F`` from
    C. The scheduler does not lag here: the interleaving comes from the slow creates."""
    if variant.inventory is not Inventory.PARTITIONABLE:
        pytest.skip("bookings exist only in the partitionable inventory")
    async with site(lagging_cluster, lagging_api, "midround") as s:
        k = s.k
        sim.configure(gpus=["A100-80GB"], state_file=None, seed=s.node, create_latency_s=CREATE_LATENCY_S)
        watch = AllocationWatch(k)
        variant = dataclasses.replace(variant, create_s=CREATE_LATENCY_S)  # the slow creates above
        async with agent_running(lagging_api, s.node, sim, settings(s.node, variant)) as agent:
            await eventually(functools.partial(k.stable, s.gpu), f"GpuPartition {s.gpu}", within_s=60)
            await offer(k, s.gpu, [F], ["1g.10gb", "2g.20gb"])
            await eventually(functools.partial(offering, k, s.gpu, [F]), "F free and offered", within_s=60)
            f = device_name(0, *F)
            f_uuid = whole_instances(sim)[f]
            await scheduler_sees_slices(lagging_cluster, k, s.node)  # F free, the offer

            since = len(sim.history())
            watch.start()
            try:
                ahead = [f"a{i}" for i in range(len(AHEAD))]
                async with agent.lock:  # between rounds: its next one finds all four bookings waiting
                    for name, placed in zip(ahead, AHEAD, strict=True):
                        await pin(k, name, s.node, at(*placed))
                    await pin(k, "b", s.node, at(*B))
                    for name in [*ahead, "b"]:
                        await eventually(functools.partial(booked, k, name), f"{name} booked", within_s=30)
                # B goes once that round is cutting for the pods ahead of it.
                await eventually(lambda: _async(_created(sim, since)), "the round's first create", 30)
                await k.core.delete_namespaced_pod("b", k.ns, grace_period_seconds=0)
                await k.custom.delete_namespaced_custom_object(
                    "resource.k8s.io", "v1", k.ns, "resourceclaims", "b"
                )
                t_b = time.time()
                await eventually(lambda: _gone(k, "b"), "b's claim gone", within_s=30)
                # B's binding cycle waits in PreBind, which reads the binding conditions every 5 s: at the
                # next read it finds the claim gone and gives up; from then on the scheduler holds nothing
                # for B, and a new pod asking for F gets it at once.
                await asyncio.sleep(PREBIND_POLL_S + 1.0)
                cut_by_then = _created(sim, since) or 0
                assert cut_by_then < len(AHEAD), "the round ended before C: the interleaving was not reached"
                t_c = time.time()
                await pin(k, "c", s.node, at(*F))
                c_dev = await eventually(lambda: booked(k, "c"), "c booked", within_s=60)
                outcome = await assert_safe(
                    "booking-deleted-mid-round", variant, k, agent, sim, watch, [*ahead, "c"], since,
                    scheduler_caught_up(lagging_cluster, k, s.node),
                )  # fmt: skip
                assert outcome["c"].startswith(f"prepared {f} "), outcome
            finally:
                await watch.stop()
        f_gone = [round(e.timestamp - t_b, 1) for e in sim.history()[since:] if e.kind == "destroy-gi"]
        c_at = watch.first_allocated.get("c", 0.0) - t_b
        print(
            f"\n  booking deleted mid-round: c created {t_c - t_b:.1f}s after b, {cut_by_then} of "
            f"{len(AHEAD)} ahead cut by then; c allocated {c_dev} at {c_at:.1f}s; "
            f"destroys at {f_gone}s; F's instance kept: {outcome['c'] == f'prepared {f} {f_uuid}'}; {outcome}"
        )


def _created(sim: ModuleType, since: int) -> int | None:
    """GPU instances created since history entry ``since``; None while none."""
    return sum(1 for e in sim.history()[since:] if e.kind == "create-gi") or None


async def _gone(k: ScenarioApi, name: str) -> bool | None:
    return True if await claim(k, name) is None else None


async def _async(value: Any) -> Any:
    return value
