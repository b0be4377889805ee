"""MIG mode on demand end to end: the operator decides (``migMode.policy: Dynamic``), the agent switches.

Real: etcd, kube-apiserver, kube-scheduler (DRA allocation, binding conditions), kube-controller-manager
(claims from templates), the operator (demand by real CEL against whole-GPU and MIG devices, the mode
decision, GpuPartition writes, Events) and the node agent's loop over the NVML code path. Simulated: the GPUs
(simnvml with MIG mode switches as nvml.h documents them: Hopper switches at once, Ampere through a reset)
and the node (no kubelet: pods bind, never run).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.backends.nvml import fresh_simulated_nvml
from dynamig.demo.cluster import PROFILE_ATTRIBUTE, ScenarioApi, exactly, resource_claim
from dynamig.demo.inprocess import agent_running, mig_modes, operator_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, POLICY_PLURAL, VERSION
from dynamig.operator.inventory import MIG_MODE_FOR_ANNOTATION
from dynamig.operator.metrics import OperatorMetrics

pytestmark = pytest.mark.controlplane


def _policy(pool: str, **mig_mode: Any) -> dict[str, Any]:
    return {
        "nodeSelector": {"matchLabels": {"test-pool": pool}},
        "mode": "Dynamic",
        "batchWindowSeconds": 1,
        "disruptionBudget": {"maxGpusReshaping": 2},
        "migMode": {"policy": "Dynamic", **mig_mode},
    }


async def _event(k: ScenarioApi, pod: str, reason: str, text: str = "") -> dict[str, Any] | None:
    for e in await k.events(pod):
        if e["reason"] == reason and text in (e["message"] or ""):
            return e
    return None


@pytest.mark.parametrize("inventory", [Inventory.PARTITIONABLE, Inventory.INSTANCES])
async def test_a_whole_gpu_pod_gets_an_idle_mig_gpu_switched_off_and_slices_get_it_back(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
    inventory: Inventory,
) -> None:
    """Two H100s with MIG on. A pod asking a whole GPU: the operator switches one idle GPU off and the pod
    binds on it. It ends, eight 1g.10gb pods come (one H100 holds seven): the whole GPU is switched back on
    and all eight bind. Nothing allocated was ever destroyed; two switches in all."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["H100-80GB", "H100-80GB"], state_file=None)
    pool = uuid.uuid4().hex[:8]
    node = make_node("modes", labels={"dynamig.io/managed": "true", "test-pool": pool})
    where = {"test-pool": pool}
    settings = dataclasses.replace(quick_agent_settings(node), inventory=inventory)
    await k.claim_template("whole", ["whole"])
    await k.claim_template("slice", ["1g.10gb"])
    policy = f"modes-{pool}"
    async with (
        agent_running(kube_api, node, sim, settings),
        operator_running(crds.kubeconfig_path, OperatorMetrics()) as metrics,
    ):
        for i in (0, 1):
            await eventually(
                functools.partial(k.stable, f"{node}-gpu{i}"), f"GpuPartition gpu{i}", within_s=60
            )
        await k.create_policy(policy, _policy(pool, cooldownSeconds=0))
        created = time.monotonic()
        await k.pod("train", "whole", where)
        assert await eventually(functools.partial(k.node_of, "train"), "the whole-GPU pod bound", within_s=60)
        print(f"\n{inventory.value}: whole-GPU pod created -> GPU switched off -> bound in "
              f"{time.monotonic() - created:.1f}s (switch latency 0 s, H100)")  # fmt: skip
        assert sorted(mig_modes(sim)) == [0, 1]
        switched = next(i for i, m in enumerate(mig_modes(sim)) if m == 0)
        claim = await k.claim_of("train")
        assert claim is not None
        assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == f"gpu{switched}"
        await eventually(
            functools.partial(_event, k, "train", "WaitingForWholeGpu"),
            "the pod told a GPU is switched for it",
        )
        part = await k.partition(f"{node}-gpu{switched}")
        assert part["spec"]["migMode"] == "Disabled"

        # The whole-GPU pod ends; eight slices come: one MIG GPU holds seven, so the whole one goes back on.
        await k.delete_pods(["train"])
        pods = [f"small-{i}" for i in range(8)]
        created = time.monotonic()
        for p in pods:
            await k.pod(p, "slice", where)
        try:
            await eventually(functools.partial(k.all_bound, pods), "all eight slice pods bound", within_s=40)
        except TimeoutError:
            for p in pods:
                print(p, await k.node_of(p), [(e["reason"], e["message"][:300]) for e in await k.events(p)])
            for i in (0, 1):
                part = await k.partition(f"{node}-gpu{i}")
                print(
                    i,
                    part["spec"],
                    part["metadata"].get("annotations"),
                    part["status"].get("wholeGpu"),
                    part["status"].get("phase"),
                )
            raise
        print(f"{inventory.value}: 8 x 1g.10gb created -> GPU switched on -> all bound in "
              f"{time.monotonic() - created:.1f}s")  # fmt: skip
        assert mig_modes(sim) == [1, 1]
        switches = [e for e in sim.history() if e.kind == "set-mig-mode"]
        assert len(switches) == 2, switches
        assert metrics is not None


async def test_an_a100_whose_policy_forbids_resets_never_switches_and_the_claim_is_told_why(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["A100-80GB"], state_file=None)
    pool = uuid.uuid4().hex[:8]
    node = make_node("ampere", labels={"dynamig.io/managed": "true", "test-pool": pool})
    await k.claim_template("whole", ["whole"])
    async with (
        agent_running(kube_api, node, sim, quick_agent_settings(node)),
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        await eventually(functools.partial(k.stable, f"{node}-gpu0"), "GpuPartition gpu0", within_s=60)
        await k.create_policy(f"ampere-{pool}", _policy(pool, cooldownSeconds=0))  # allowReset: false
        await k.pod("train", "whole", {"test-pool": pool})
        event = await eventually(
            functools.partial(_event, k, "train", "WaitingForWholeGpu", "reset"),
            "the pod told the A100 needs a reset the policy does not allow",
            within_s=60,
        )
        assert "allowReset" in event["message"], event
        assert await k.node_of("train") is None and mig_modes(sim) == [1]
        assert [e for e in sim.history() if e.kind == "set-mig-mode"] == []
        part = await k.partition(f"{node}-gpu0")
        assert "migMode" not in part["spec"]


async def test_a_policy_serving_gpus_without_mig_has_an_l4_served_whole(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """An L4 (no MIG) under a policy with ``migMode.gpusWithoutMig: Whole``: the operator asks it served
    whole, the agent publishes it as gpu0, and a whole-GPU pod binds on it."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["L4-24GB"], state_file=None)
    pool = uuid.uuid4().hex[:8]
    node = make_node("l4", labels={"dynamig.io/managed": "true", "test-pool": pool})
    await k.claim_template("whole", ["whole"])
    async with (
        agent_running(kube_api, node, sim, quick_agent_settings(node)),
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        spec = {"nodeSelector": {"matchLabels": {"test-pool": pool}}, "migMode": {"gpusWithoutMig": "Whole"}}
        await k.create_policy(f"l4-{pool}", spec)
        await k.pod("infer", "whole", {"test-pool": pool})
        assert await eventually(functools.partial(k.node_of, "infer"), "the pod bound on the L4", within_s=60)

        async def served_whole() -> dict[str, Any] | None:  # the agent's status write follows its publish
            part = await k.partition(f"{node}-gpu0")
            return part if ((part.get("status") or {}).get("wholeGpu") or {}).get("deviceName") else None

        part = await eventually(served_whole, "the L4's status says it is served whole")
        assert part["spec"]["migMode"] == "Disabled" and part["status"]["wholeGpu"]["deviceName"] == "gpu0"
        assert [e for e in sim.history() if e.kind == "set-mig-mode"] == []  # nothing to switch on an L4


async def _pair_template(k: ScenarioApi) -> None:
    """The ResourceClaimTemplate ``pair``: two whole GPUs on one node."""
    pair = resource_claim("pair", exactly(f'{PROFILE_ATTRIBUTE} == "whole"', count=2))
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "pair"},
        "spec": {"spec": pair["spec"]},
    }
    await k.custom.create_namespaced_custom_object(
        "resource.k8s.io", "v1", k.ns, "resourceclaimtemplates", template
    )


@dataclasses.dataclass
class _PairOnTwoH100s:
    """A node of two simulated H100s (``mig_enabled``, ``switch_latency_s`` per GPU) under a policy whose MIG
    mode is Dynamic, and a pod ``train`` asking two whole GPUs on one node (template ``pair``)."""

    k: ScenarioApi
    node_name: str
    mig_enabled: list[bool]
    switch_latency_s: list[float]

    @contextlib.asynccontextmanager
    async def running(
        self,
        kube_api: client.ApiClient,
        crds: ControlPlane,
        make_node: Callable[..., str],
        sim: ModuleType,
        inventory: Inventory,
        spec: dict[str, Any],
        before: Callable[[dict[str, str]], Awaitable[None]] | None = None,
    ) -> AsyncIterator[tuple[str, dict[str, str], str]]:
        """Agent and operator running, the policy (``spec`` merged in) made, ``before`` awaited (given the
        pods' node selector), ``train`` created: yields the node, the pods' node selector and the pair's claim
        (namespace/name)."""
        k = self.k
        await k.ensure_device_class()
        sim.configure(
            gpus=["H100-80GB", "H100-80GB"],
            state_file=None,
            mig_enabled=self.mig_enabled,
            switch_latency_s=self.switch_latency_s,
        )
        pool = uuid.uuid4().hex[:8]
        node = make_node(self.node_name, labels={"dynamig.io/managed": "true", "test-pool": pool})
        where = {"test-pool": pool}
        settings = dataclasses.replace(quick_agent_settings(node), inventory=inventory)
        await _pair_template(k)
        async with (
            agent_running(kube_api, node, sim, settings),
            operator_running(crds.kubeconfig_path, OperatorMetrics()),
        ):
            for i in (0, 1):
                await eventually(
                    functools.partial(k.stable, f"{node}-gpu{i}"), f"GpuPartition gpu{i}", within_s=60
                )
            await k.create_policy(f"{self.node_name}-{pool}", {**_policy(pool, cooldownSeconds=0), **spec})
            if before is not None:
                await before(where)
            await k.pod("train", "pair", where)
            train = await eventually(functools.partial(k.claim_of, "train"), "the pair's claim", within_s=30)
            yield node, where, f"{k.ns}/{train['metadata']['name']}"


async def test_gpus_switched_for_a_claim_of_two_whole_gpus_are_kept_for_it(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """Two H100s: gpu0 whole and free, gpu1 with MIG on (its switch takes 8 s). A pod asks two whole GPUs on
    one node: the operator switches gpu1 off for it and keeps both whole for its claim (spec.holds, kind
    Whole), and the agent publishes them guarded. A pod asking one whole GPU, made while gpu1 switches, is
    booked on gpu0 by the scheduler and answered failed (PlacementHeld): it never binds there. The two-GPU
    pod binds on gpu0 and gpu1, the holds end (served), and the single pod binds once the pair is gone.
    The partitionable inventory (where the agent knows binding conditions are kept): the instances one
    publishes whole GPUs unguarded, so a hold there keeps nothing (agent/modes/whole.py)."""
    k = ScenarioApi(kube_api, namespace)
    await k.claim_template("whole", ["whole"])
    pair = _PairOnTwoH100s(k, "kept", mig_enabled=[False, True], switch_latency_s=[0, 8])
    async with pair.running(kube_api, crds, make_node, sim, Inventory.PARTITIONABLE, {}) as (
        node,
        where,
        key,
    ):

        async def enforced_on_gpu0() -> bool | None:
            part = await k.partition(f"{node}-gpu0")
            held = [h["claim"] for h in (part.get("status") or {}).get("holds") or []]
            return True if held == [key] else None

        await eventually(
            enforced_on_gpu0, "gpu0 kept whole for the pair (the agent enforces it)", within_s=30
        )
        gpu1 = await k.partition(f"{node}-gpu1")
        assert gpu1["spec"]["migMode"] == "Disabled", gpu1["spec"]
        assert [(h["claim"], h["kind"]) for h in gpu1["spec"]["holds"]] == [(key, "Whole")]
        assert await k.node_of("train") is None  # gpu1 still switching

        await k.pod("single", "whole", where)
        single = await eventually(functools.partial(k.claim_of, "single"), "the single's claim", within_s=30)

        async def refused() -> dict[str, Any] | None:
            for e in await k.events(single["metadata"]["name"]):
                if e["reason"] == "AllocationFailed" and "PlacementHeld" in (e["message"] or ""):
                    return e
            return None

        event = await eventually(refused, "the single's booking of gpu0 answered PlacementHeld", within_s=30)
        assert key in event["message"], event
        assert await eventually(functools.partial(k.node_of, "train"), "the pair bound", within_s=60)
        claim = await k.claim_of("train")
        assert claim is not None
        got = sorted(r["device"] for r in claim["status"]["allocation"]["devices"]["results"])
        assert got == ["gpu0", "gpu1"], got
        assert await k.node_of("single") is None
        assert mig_modes(sim) == [0, 0]

        async def released() -> bool | None:
            for i in (0, 1):
                if (await k.partition(f"{node}-gpu{i}"))["spec"].get("holds"):
                    return None
            return True

        await eventually(released, "the holds released once the pair is allocated", within_s=30)
        await k.delete_pods(["train"])
        assert await eventually(functools.partial(k.node_of, "single"), "the single bound", within_s=60)


@pytest.mark.parametrize("inventory", [Inventory.PARTITIONABLE, Inventory.INSTANCES])
async def test_a_claim_of_two_whole_gpus_gets_its_node_s_gpus_switched_together_under_a_budget_of_one(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
    inventory: Inventory,
) -> None:
    """Two H100s with MIG on (each switch takes 20 s) under a disruption budget of one GPU: a pod
    asking two whole GPUs gets both switched off in the first round, one change of the budget (they are idle
    and kept whole for it: spec.holds, kind Whole), not one after the other. A 1g.10gb pod made meanwhile
    gets no slice of either. The pair binds on gpu0 and gpu1 once both are whole, about one switch after it
    was made, not two."""
    k = ScenarioApi(kube_api, namespace)
    await k.claim_template("small", ["1g.10gb"])
    pair = _PairOnTwoH100s(k, "keepnode", mig_enabled=[True, True], switch_latency_s=[20, 20])
    budget = {"disruptionBudget": {"maxGpusReshaping": 1}}
    async with pair.running(kube_api, crds, make_node, sim, inventory, budget) as (node, where, key):
        made = time.monotonic()

        async def first_round() -> tuple[dict[str, Any], dict[str, Any]] | None:
            parts = [await k.partition(f"{node}-gpu{i}") for i in (0, 1)]
            held = [[h["claim"] for h in p["spec"].get("holds") or []] for p in parts]
            return (parts[0], parts[1]) if held == [[key], [key]] else None

        gpu0, gpu1 = await eventually(first_round, "both GPUs kept whole for the pair", within_s=30)
        # Both asked in the round that kept them: the pair's switches on the node are one change.
        asked = [p["spec"].get("migMode") for p in (gpu0, gpu1)]
        assert asked == ["Disabled", "Disabled"], asked
        for p in (gpu0, gpu1):
            assert p["metadata"]["annotations"][MIG_MODE_FOR_ANNOTATION] == key, p["metadata"]

        await k.pod("small", "small", where)
        assert await eventually(functools.partial(k.node_of, "train"), "the pair bound", within_s=90)
        took = time.monotonic() - made
        claim = await k.claim_of("train")
        assert claim is not None
        got = sorted(r["device"] for r in claim["status"]["allocation"]["devices"]["results"])
        assert got == ["gpu0", "gpu1"], got
        assert mig_modes(sim) == [0, 0]
        # One after the other would take both switches (40 s) and a round between them.
        assert took < 20 + 20, f"the pair bound {took:.1f}s after it was made"
        print(f"pair bound {took:.1f}s after it was made (two switches of 20 s, together)")
        assert await k.node_of("small") is None  # never given a slice of either GPU
        cuts = [e for e in sim.history() if e.kind == "create-gi"]
        assert cuts == [], cuts


@pytest.mark.parametrize("inventory", [Inventory.PARTITIONABLE, Inventory.INSTANCES])
async def test_a_mig_gpu_kept_whole_keeps_its_free_instances_until_its_switch_is_asked(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
    inventory: Inventory,
) -> None:
    """An H100 with two free 3g.40gb instances is kept whole for a claim of whole GPUs (spec.holds, kind
    Whole, as the operator writes it while the claim's switch waits for the budget or a cooldown). The agent
    books nobody else there (the instances inventory withdraws the free instances from the slice) but destroys
    nothing: a keep that ends without a switch gives them back as they were. Once spec.migMode asks for MIG
    mode off, they are destroyed and the GPU switched. The agent alone, the operator's writes made by hand."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["H100-80GB"], state_file=None)
    node = make_node("kept", labels={"dynamig.io/managed": "true"})
    settings = dataclasses.replace(quick_agent_settings(node), inventory=inventory)
    name = f"{node}-gpu0"
    async with agent_running(kube_api, node, sim, settings):
        await eventually(functools.partial(k.stable, name), "the GpuPartition", within_s=60)
        generation = await k.set_layout(name, [("3g.40gb", 0), ("3g.40gb", 4)])

        async def cut() -> list[str] | None:
            part = await k.stable(name)
            instances = ((part or {}).get("status") or {}).get("instances") or []
            if part is None or part["status"]["observedGeneration"] < generation or len(instances) != 2:
                return None
            names = [i["deviceName"] for i in instances]
            return names if set(names) <= set(await k.published(node)) else None

        devices = await eventually(cut, "two 3g.40gb instances cut and published", within_s=60)
        before = len(sim.history())
        expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=15)
        hold = {"claim": f"{namespace}/big", "kind": "Whole", "profile": "whole", "start": 0,
                "expiresAt": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}  # fmt: skip
        await k.custom.patch_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL, name, {"spec": {"holds": [hold]}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip

        async def withdrawn() -> bool | None:
            published = await k.published(node)
            if inventory is Inventory.INSTANCES:
                return True if not set(devices) & set(published) else None
            guarded = [d for n, d in published.items() if n in devices and d.get("bindingConditions")]
            return True if len(guarded) == len(devices) else None

        await eventually(withdrawn, "the kept GPU's free instances booked by nobody else", within_s=30)
        await asyncio.sleep(3.0)  # ten agent rounds, ten settle periods
        since = sim.history()[before:]
        assert not [e for e in since if e.kind.startswith("destroy")], since
        assert len((await k.partition(name))["status"]["instances"]) == 2

        # The operator asks for the switch: now the instances go and the GPU's MIG mode is switched off.
        await k.custom.patch_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL, name,
            {"spec": {"migMode": "Disabled", "layout": [], "offeredProfiles": []}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip

        async def switched() -> bool | None:
            return True if mig_modes(sim) == [0] else None

        await eventually(switched, "MIG mode off", within_s=60)
        destroyed = [e for e in sim.history()[before:] if e.kind == "destroy-gi"]
        assert len(destroyed) == 2, destroyed


async def test_whole_gpus_kept_on_a_node_the_claim_cannot_use_are_released_when_it_switches_elsewhere(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """Node a: two idle H100s with MIG on. Node b: three, gpu0 of which a pod asking one whole GPU on b gets
    switched off for it (30 s) under a disruption budget of one. A pod asking two whole GPUs, made while that
    switch spends the budget, gets node a kept for it (spec.holds, kind Whole: a's GPUs are the only idle
    node's). A critical XID on a's gpu0 leaves a unable to complete the pair; once the budget is free, the
    pair's GPUs are switched on b and it binds there, and a's holds are released then (Event
    WholeGpuReleased), not left to their 15 min expiry; a's GPUs are never switched."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    await k.claim_template("whole", ["whole"])
    await _pair_template(k)
    pool = uuid.uuid4().hex[:8]
    labels = {"dynamig.io/managed": "true", "test-pool": pool}
    node_a, node_b = make_node("stale-a", labels=labels), make_node("stale-b", labels=labels)
    sim_a = fresh_simulated_nvml()
    sim_a.configure(gpus=["H100-80GB"] * 2, state_file=None, seed=node_a, switch_latency_s=[2, 2])
    sim.configure(gpus=["H100-80GB"] * 3, state_file=None, seed=node_b, switch_latency_s=[30, 2, 2])
    async with (
        agent_running(kube_api, node_a, sim_a, quick_agent_settings(node_a)),
        agent_running(kube_api, node_b, sim, quick_agent_settings(node_b)),
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        gpus_a = [f"{node_a}-gpu{i}" for i in (0, 1)]
        for gpu in (*gpus_a, *(f"{node_b}-gpu{i}" for i in (0, 1, 2))):
            await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
        budget = {"disruptionBudget": {"maxGpusReshaping": 1}}
        await k.create_policy(f"stale-{pool}", {**_policy(pool, cooldownSeconds=0), **budget})
        await k.pod("single", "whole", {"kubernetes.io/hostname": node_b})

        async def asked_on_b() -> bool | None:
            spec = (await k.partition(f"{node_b}-gpu0"))["spec"]
            return True if spec.get("migMode") == "Disabled" else None

        await eventually(asked_on_b, "b's gpu0 asked to switch off for the single pod", within_s=30)
        await k.pod("train", "pair", {"test-pool": pool})
        train = await eventually(functools.partial(k.claim_of, "train"), "the pair's claim", within_s=30)
        key = f"{k.ns}/{train['metadata']['name']}"

        async def kept_on_a() -> bool | None:
            for gpu in gpus_a:
                holds = (await k.partition(gpu))["spec"].get("holds") or []
                if [(h["claim"], h["kind"]) for h in holds] != [(key, "Whole")]:
                    return None
            return True

        await eventually(kept_on_a, "node a kept whole for the pair while the budget is spent", within_s=30)
        assert await k.node_of("single") is None, "b's gpu0 is still switching"
        for gpu in gpus_a:
            assert (await k.partition(gpu))["spec"].get("migMode") is None, gpu

        sim_a.inject_xid(0, 48)  # a double-bit ECC error: gpu0 of a is unfit, a cannot hold the pair

        bound = await eventually(functools.partial(k.node_of, "train"), "the pair bound", within_s=120)
        assert bound == node_b, bound
        claim = await k.claim_of("train")
        assert claim is not None
        got = sorted(r["device"] for r in claim["status"]["allocation"]["devices"]["results"])
        assert got == ["gpu1", "gpu2"], got
        assert await k.node_of("single") == node_b

        async def released() -> dict[str, Any] | None:
            if (await k.partition(gpus_a[1]))["spec"].get("holds"):
                return None
            for e in await k.events(gpus_a[1], namespace="default"):
                if e["reason"] == "WholeGpuReleased" and key in (e["message"] or ""):
                    return e
            return None

        event = await eventually(released, "a's gpu1 released from the pair's hold", within_s=30)
        print(f"released: {event['message']}")
        assert mig_modes(sim_a) == [1, 1]


async def test_a_node_is_drained_for_a_claim_of_two_whole_gpus_when_no_node_is_idle(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """One node of two H100s with MIG on, and a 1g.10gb pod running on one of them: no node is idle. A pod
    asking two whole GPUs under a policy with migMode.drainNodeAfterSeconds gets the node drained: both GPUs
    kept whole for its claim (spec.holds, kind Whole, lasting drainNodeHoldSeconds; WholeGpuKept says
    drained; the policy's status.drainedClaims lists the claim). Nothing is switched or destroyed while the
    small pod runs, and a second 1g.10gb pod gets no slice there. Once the small pod is deleted, both GPUs are
    switched off and the pair binds on them (and the claim leaves status.drainedClaims)."""
    k = ScenarioApi(kube_api, namespace)
    await k.claim_template("small", ["1g.10gb"])

    async def first(where: dict[str, str]) -> None:
        await k.pod("first", "small", where)
        assert await eventually(
            functools.partial(k.node_of, "first"), "the first 1g.10gb pod bound", within_s=60
        )

    pair = _PairOnTwoH100s(k, "drained", mig_enabled=[True, True], switch_latency_s=[2, 2])
    drain = {"migMode": {"policy": "Dynamic", "cooldownSeconds": 0, "drainNodeAfterSeconds": 0,
                         "drainNodeHoldSeconds": 600}}  # fmt: skip
    async with pair.running(kube_api, crds, make_node, sim, Inventory.PARTITIONABLE, drain, first) as (
        node,
        where,
        key,
    ):

        async def drained() -> list[dict[str, Any]] | None:
            parts = [await k.partition(f"{node}-gpu{i}") for i in (0, 1)]
            held = [[(h["claim"], h["kind"]) for h in p["spec"].get("holds") or []] for p in parts]
            return parts if held == [[(key, "Whole")], [(key, "Whole")]] else None

        parts = await eventually(drained, "both GPUs kept whole for the pair", within_s=30)
        switches_before = [e for e in sim.history() if e.kind == "set-mig-mode"]
        for p in parts:
            (hold,) = p["spec"]["holds"]
            created = datetime.datetime.fromisoformat(hold["createdAt"].replace("Z", "+00:00"))
            expires = datetime.datetime.fromisoformat(hold["expiresAt"].replace("Z", "+00:00"))
            assert abs((expires - created).total_seconds() - 600) < 2, hold
            assert "migMode" not in p["spec"] or p["spec"]["migMode"] != "Disabled", p["spec"]

        async def told(gpu: str) -> dict[str, Any] | None:
            for e in await k.events(gpu, "default"):
                if e["reason"] == "WholeGpuKept" and f"node {node} is drained for it" in (e["message"] or ""):
                    return e
            return None

        for i in (0, 1):
            await eventually(
                functools.partial(told, f"{node}-gpu{i}"), f"WholeGpuKept on gpu{i}", within_s=30
            )

        async def in_status(present: bool) -> bool | None:
            """Whether the policy's status.drainedClaims lists the pair's claim is ``present``."""
            got = await k.custom.list_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL)
            listed = {
                e["claim"] for p in got["items"] for e in (p.get("status") or {}).get("drainedClaims") or []
            }
            return True if (key in listed) == present else None

        await eventually(functools.partial(in_status, True), "the drain in the policy's status", within_s=30)
        await k.pod("second", "small", where)
        for _ in range(10):  # 5 s of agent and operator rounds: the drain holds, nothing is switched
            await asyncio.sleep(0.5)
            assert await k.node_of("second") is None
            assert await k.node_of("train") is None
            assert mig_modes(sim) == [1, 1]
        assert [e for e in sim.history() if e.kind == "set-mig-mode"] == switches_before == []
        await k.delete_pods(["first"])
        made = time.monotonic()
        assert await eventually(functools.partial(k.node_of, "train"), "the pair bound", within_s=90)
        print(f"pair bound {time.monotonic() - made:.1f}s after the small pod was deleted")
        claim = await k.claim_of("train")
        assert claim is not None
        got = sorted(r["device"] for r in claim["status"]["allocation"]["devices"]["results"])
        assert got == ["gpu0", "gpu1"], got
        assert mig_modes(sim) == [0, 0]
        assert await k.node_of("second") is None
        await eventually(
            functools.partial(in_status, False), "the served claim out of the status", within_s=30
        )
