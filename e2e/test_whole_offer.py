"""A whole GPU offered beside its MIG slices (GpuPartition ``spec.offerWhole``), on the real scheduler: the
scheduler chooses, and a booking of the whole GPU waits on binding conditions while the agent switches MIG
off. Written by a person, and by a policy's ``migMode.offerWhole`` with the operator running.

Real: etcd, kube-apiserver, kube-scheduler (DRA allocation with partitionable devices and binding
conditions), kube-controller-manager, the node agent's whole loop over the NVML code path. Simulated: the GPU
(simnvml: an H100-80GB with MIG mode on; mode switches as nvml.h documents them, ``dynamig.backends.simmode``,
whose history is the ground truth for what NVML was asked) and the node (no kubelet: pods bind, never run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.demo.cluster import ScenarioApi
from dynamig.demo.inprocess import agent_running, mig_modes, operator_running, quick_agent_settings
from dynamig.devcluster import ControlPlane, eventually
from dynamig.kube.gpupartition import Inventory
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION
from dynamig.operator.inventory import MIG_MODE_REQUESTED_ANNOTATION, WHOLE_OFFERED_BY_ANNOTATION
from dynamig.operator.metrics import OperatorMetrics

pytestmark = pytest.mark.controlplane

FREE_1G = "gpu0-1g10gb-s0"


async def _published(k: ScenarioApi, node: str, *names: str) -> dict[str, dict[str, Any]] | None:
    devices = await k.published(node)
    return devices if set(names) <= set(devices) else None


async def _ready_answer(k: ScenarioApi, pod: str) -> dict[str, Any] | None:
    claim = await k.claim_of(pod)
    for entry in ((claim or {}).get("status") or {}).get("devices") or []:
        for c in entry.get("conditions") or []:
            if c["type"] == "mig.dynamig.io/ready" and c["status"] == "True":
                return dict(entry)
    return None


async def test_a_booking_of_the_whole_gpu_offered_beside_its_slices_switches_mig_off_before_the_pod_binds(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """An H100 with MIG on and a free 1g.10gb, ``spec.offerWhole``: its whole device ``gpu0`` is published
    beside the slices, with every counter of the GPU and binding conditions. A whole-GPU pod is booked on it
    and waits (not bound) while the agent retires the free instance and switches MIG off through NVML; then
    the booking is answered ready with the GPU's UUID and the pod binds. A slice pod made after the booking
    never gets a slice of that GPU."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["H100-80GB"], state_file=None)
    node = make_node("offer", labels={"dynamig.io/managed": "true"})
    gpu, where = f"{node}-gpu0", {"kubernetes.io/hostname": node}
    settings = dataclasses.replace(quick_agent_settings(node), inventory=Inventory.PARTITIONABLE)
    async with agent_running(kube_api, node, sim, settings):
        await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
        spec = {"layout": [{"profile": "1g.10gb", "start": 0}], "offeredProfiles": ["1g.10gb"]}
        await k.custom.patch_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL, gpu, {"spec": {**spec, "offerWhole": True}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        devices = await eventually(
            functools.partial(_published, k, node, "gpu0", FREE_1G), "the whole GPU beside its slices"
        )
        whole = devices["gpu0"]
        assert whole["bindingConditions"] == ["mig.dynamig.io/ready"], whole
        (use,) = whole["consumesCounters"]
        assert use["counterSet"] == "gpu0" and {f"mem-{i}" for i in range(8)} <= set(use["counters"]), use
        assert whole["attributes"]["mig.dynamig.io/profile"] == {"string": "whole"}
        assert mig_modes(sim) == [1]

        async def offered() -> bool | None:
            return True if (await k.partition(gpu))["status"].get("wholeOffered") else None

        await eventually(offered, "status.wholeOffered on the GpuPartition")

        await k.claim_template("whole", ["whole"])
        await k.claim_template("slice", ["1g.10gb"])
        created = time.monotonic()
        await k.pod("train", "whole", where)
        claim = await eventually(lambda: k.claim_of("train"), "the whole-GPU pod's claim")

        async def booked() -> dict[str, Any] | None:
            c = await k.claim_of("train")
            alloc = ((c or {}).get("status") or {}).get("allocation")
            return alloc["devices"]["results"][0] if alloc else None

        result = await eventually(booked, "the whole GPU booked")
        assert result["device"] == "gpu0" and result["bindingConditions"] == ["mig.dynamig.io/ready"], result
        await k.pod("small", "slice", where)

        entry = await eventually(
            functools.partial(_ready_answer, k, "train"), "the booking answered ready", within_s=60
        )
        assert mig_modes(sim) == [0], "MIG off before the answer"
        assert entry["data"]["profile"] == "whole", entry
        assert await eventually(functools.partial(k.node_of, "train"), "the whole-GPU pod bound") == node
        print(f"\nwhole GPU offered beside its slices: pod created -> MIG off, bound in "
              f"{time.monotonic() - created:.1f}s")  # fmt: skip

        async def whole_allocated() -> dict[str, Any] | None:
            part = await k.partition(gpu)
            whole = part["status"].get("wholeGpu") or {}
            return part if whole.get("state") == "allocated" else None

        part = await eventually(whole_allocated, "the whole GPU reported allocated on its GpuPartition")
        assert "wholeOffered" not in part["status"], "MIG off: published whole, not offered beside slices"
        assert claim["metadata"]["name"] in " ".join(part["status"]["wholeGpu"]["claims"])
        history = [e.kind for e in sim.history()]
        assert history.count("set-mig-mode") == 1, history
        assert history.index("set-mig-mode") > max(
            i for i, kind in enumerate(history) if kind.startswith("destroy")
        )
        await eventually(functools.partial(k.unschedulable, "small"), "the slice pod waits: no slice is left")
        assert await k.node_of("small") is None
        await k.delete_pods(["train", "small"])


async def _gpu_event(k: ScenarioApi, gpu: str, reason: str) -> dict[str, Any] | None:
    return next((e for e in await k.events(gpu, namespace="default") if e["reason"] == reason), None)


async def _spec_says(k: ScenarioApi, gpu: str, **fields: Any) -> dict[str, Any] | None:
    part = await k.partition(gpu)
    return part if all(part["spec"].get(f) == v for f, v in fields.items()) else None


async def test_a_policy_offers_the_whole_gpu_of_a_gpu_it_switched_on_and_keeps_it_whole_once_booked(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """An H100 with MIG off under a policy with ``migMode.offerWhole`` (cooldown 0). A 1g.10gb pod has the
    operator switch it on (its ``spec.migMode: Enabled``) and binds. Once it ends, the operator offers the
    GPU's whole device (``spec.offerWhole``, annotated with the policy). A whole-GPU pod is then booked on it
    by the scheduler and binds after the agent switched MIG off; the operator replaces its ``Enabled`` with
    ``Disabled`` (``WholeGpuBooked``), so when that pod ends the GPU stays whole: two switches in all."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["H100-80GB"], state_file=None, mig_enabled=False)
    node = make_node("offerpol", labels={"dynamig.io/managed": "true", "test-pool": namespace})
    gpu, where = f"{node}-gpu0", {"kubernetes.io/hostname": node}
    settings = dataclasses.replace(quick_agent_settings(node), inventory=Inventory.PARTITIONABLE)
    await k.claim_template("whole", ["whole"])
    await k.claim_template("slice", ["1g.10gb"])
    policy = f"offer-{namespace}"[:60]
    async with (
        agent_running(kube_api, node, sim, settings),
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
        await k.create_policy(policy, {
            "nodeSelector": {"matchLabels": {"test-pool": namespace}}, "mode": "Dynamic",
            "batchWindowSeconds": 1, "disruptionBudget": {"maxGpusReshaping": 2},
            "migMode": {"policy": "Dynamic", "offerWhole": True, "cooldownSeconds": 0},
        })  # fmt: skip
        await k.pod("small", "slice", where)
        assert await eventually(functools.partial(k.node_of, "small"), "the slice pod bound", within_s=60)
        assert mig_modes(sim) == [1]
        part = await k.partition(gpu)
        assert part["spec"]["migMode"] == "Enabled"
        assert part["metadata"]["annotations"][MIG_MODE_REQUESTED_ANNOTATION] == "Enabled"

        await k.delete_pods(["small"])
        part = await eventually(
            functools.partial(_spec_says, k, gpu, offerWhole=True), "spec.offerWhole written", within_s=60
        )
        assert part["metadata"]["annotations"][WHOLE_OFFERED_BY_ANNOTATION] == policy
        assert await eventually(functools.partial(_gpu_event, k, gpu, "WholeOffered"), "WholeOffered")

        async def offered() -> bool | None:
            return True if (await k.partition(gpu))["status"].get("wholeOffered") else None

        await eventually(offered, "status.wholeOffered: the agent publishes the whole device", within_s=60)
        created = time.monotonic()
        await k.pod("train", "whole", where)
        assert await eventually(functools.partial(k.node_of, "train"), "the whole-GPU pod bound", within_s=60)
        print(f"\npolicy offerWhole: whole-GPU pod created -> booked, MIG off, bound in "
              f"{time.monotonic() - created:.1f}s")  # fmt: skip
        assert mig_modes(sim) == [0]
        claim = await k.claim_of("train")
        assert claim is not None
        assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu0"
        booked = await eventually(
            functools.partial(_gpu_event, k, gpu, "WholeGpuBooked"), "WholeGpuBooked", within_s=30
        )
        assert "stays whole" in booked["message"], booked
        part = await k.partition(gpu)
        assert part["spec"]["migMode"] == "Disabled", part["spec"]
        assert part["metadata"]["annotations"][MIG_MODE_REQUESTED_ANNOTATION] == "Disabled"

        await k.delete_pods(["train"])

        async def whole_free() -> dict[str, Any] | None:
            st = (await k.partition(gpu))["status"]
            whole = st.get("wholeGpu") or {}
            return st if whole.get("state") == "free" and not whole.get("claims") else None

        await eventually(whole_free, "the whole GPU free again", within_s=60)
        # Several agent and operator rounds (1 s batch window, quick agent): nothing switches it back on.
        await asyncio.sleep(5)
        assert mig_modes(sim) == [0]
        switches = [e for e in sim.history() if e.kind == "set-mig-mode"]
        assert len(switches) == 2, switches
        await k.custom.delete_cluster_custom_object(GROUP, VERSION, "gpupartitionpolicies", policy)


async def test_a_booking_whose_switch_needs_a_reset_the_platform_lacks_is_failed_not_left_waiting(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """An A100 in a pass-through VM (simnvml ``vm``: a switch that needs a GPU reset stays pending until a
    reboot) offers its whole device. A booking of it gets the switch tried; NVML answers
    NVML_ERROR_RESET_REQUIRED, and the booking is answered failed (booked again elsewhere) rather than left
    waiting on binding conditions until kube-scheduler's binding timeout."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    sim.configure(gpus=["A100-80GB"], state_file=None, vm=True)
    node = make_node("offervm", labels={"dynamig.io/managed": "true"})
    gpu, where = f"{node}-gpu0", {"kubernetes.io/hostname": node}
    settings = dataclasses.replace(quick_agent_settings(node), inventory=Inventory.PARTITIONABLE)
    async with agent_running(kube_api, node, sim, settings):
        await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
        await k.custom.patch_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL, gpu, {"spec": {"offerWhole": True}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        await eventually(functools.partial(_published, k, node, "gpu0"), "the whole GPU offered")
        await k.claim_template("whole", ["whole"])
        await k.pod("train", "whole", where)
        claim = await eventually(lambda: k.claim_of("train"), "the whole-GPU pod's claim")
        name = claim["metadata"]["name"]

        async def failed() -> dict[str, Any] | None:
            return next((e for e in await k.events(name) if e["reason"] == "AllocationFailed"), None)

        told = await eventually(failed, "the booking answered failed", within_s=60)
        assert "pending" in told["message"], told
        kinds = [e.kind for e in sim.history()]
        assert kinds.count("set-mig-mode") == 1, kinds  # tried once
        # and never again: 20 agent rounds (0.5 s each) after the answer, while the scheduler retries the pod
        for _ in range(20):
            await asyncio.sleep(0.5)
            kinds = [e.kind for e in sim.history()]
            assert kinds.count("set-mig-mode") == 1, kinds
            assert await k.node_of("train") is None

        # what holds it back, told on the GPU: Degraded until a VM reboot applies the pending mode, and
        # neither its whole device nor any MIG device is published meanwhile
        async def degraded() -> dict[str, Any] | None:
            status = (await k.partition(gpu))["status"]
            return status if status["phase"] == "Degraded" and not await k.published(node) else None

        status = await eventually(degraded, "the GPU Degraded with nothing published", within_s=30)
        assert "pending" in status["message"], status
        await k.delete_pods(["train"])
