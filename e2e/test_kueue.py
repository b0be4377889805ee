"""dynamig under Kueue quotas, on the real API server and kube-scheduler with Kueue's own controller manager
(built from its Go module, ``dynamig.devcluster.kueue``).

A team's ClusterQueue holds a quota of ``nvidia.com/mig-1g.10gb``: pods that ask that extended resource (as
the device plugin's ``mixed`` strategy names MIG, served by dynamig's per-profile DeviceClass) and carry the
team's queue label are admitted up to the quota and no further; Kueue holds the rest behind its scheduling
gate. The admitted ones are cut for and bound by dynamig; when one goes, Kueue admits the next and dynamig
serves it too. No kubelet: pods bind and never run.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.demo.cluster import ScenarioApi
from dynamig.demo.inprocess import agent_running, operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.kueue import API, MANAGED_NAMESPACE_LABEL, QUEUE_LABEL, KueueProcess, kueue_running
from dynamig.devcluster.waiting import event_posted
from dynamig.operator.capacity_check import (
    CONTROLLER,
    POD_SET_LABEL,
    RETRY_ANNOTATION,
    State,
    bound_pods,
    checked_workloads,
    unbound_asks,
)
from dynamig.operator.metrics import OperatorMetrics
from test_extended_resources import _claim, _classes_exist
from test_partitionable import bound_node, partitionable

RESOURCE = "nvidia.com/mig-1g.10gb"
KUEUE_GATE = "kueue.x-k8s.io/admission"


@pytest.fixture(scope="module")
def kueue(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KueueProcess]:
    with kueue_running(control_plane, tmp_path_factory.mktemp("kueue")) as running:
        yield running


def queued_pod(name: str, queue: str, pool: str, resource: str = RESOURCE) -> dict[str, Any]:
    """A pod that asks one ``resource`` (``nvidia.com/mig-1g.10gb``) and names its Kueue LocalQueue. Pure."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: queue}},
        "spec": {
            "nodeSelector": {"test-pool": pool},
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": "main", "image": "example.invalid/app:1", "resources": {"limits": {resource: "1"}}}
            ],
        },
    }


async def _gated(k: ScenarioApi, pod: str) -> bool | None:
    p = await k.core.read_namespaced_pod(pod, k.ns)
    gates = [g.name for g in p.spec.scheduling_gates or []]
    return True if KUEUE_GATE in gates and not p.spec.node_name else None


async def _admitted(k: ScenarioApi, cluster_queue: str) -> int:
    cq = await k.custom.get_cluster_custom_object(*API, "clusterqueues", cluster_queue)
    return int((cq.get("status") or {}).get("admittedWorkloads") or 0)


async def _admitted_count(k: ScenarioApi, cluster_queue: str, n: int) -> bool | None:
    return True if await _admitted(k, cluster_queue) == n else None


async def _pending_in_queue(k: ScenarioApi, cluster_queue: str, n: int) -> bool | None:
    cq = await k.custom.get_cluster_custom_object(*API, "clusterqueues", cluster_queue)
    return True if (cq.get("status") or {}).get("pendingWorkloads") == n else None


async def _gone(k: ScenarioApi, pod: str) -> bool | None:
    pods = await k.core.list_namespaced_pod(k.ns, field_selector=f"metadata.name={pod}")
    return True if not pods.items else None


class Queues:
    """A ResourceFlavor, ClusterQueues and their LocalQueues (one per ClusterQueue, in the test's
    namespace, named after it) made for one test and removed after it."""

    def __init__(self, k: ScenarioApi, pool: str) -> None:
        self.k, self.flavor = k, f"mig-{pool}"
        self.cluster_queues: list[str] = []

    async def __aenter__(self) -> Queues:
        flavor = {"apiVersion": "/".join(API), "kind": "ResourceFlavor", "metadata": {"name": self.flavor}}
        await self.k.custom.create_cluster_custom_object(*API, "resourceflavors", flavor)
        return self

    async def add(
        self,
        name: str,
        quota: int,
        cohort: str = "",
        reclaim: bool = False,
        resource: str = RESOURCE,
        checks: tuple[str, ...] = (),
    ) -> None:
        """A ClusterQueue ``name`` with ``quota`` of ``resource`` (in ``cohort``, reclaiming its lent quota
        by preemption when ``reclaim``; its workloads waiting on the AdmissionChecks ``checks``) and its
        LocalQueue ``name``."""
        spec: dict[str, Any] = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.k.ns}},
            "resourceGroups": [
                {
                    "coveredResources": [resource],
                    "flavors": [
                        {"name": self.flavor, "resources": [{"name": resource, "nominalQuota": quota}]}
                    ],
                }
            ],
        }
        if checks:
            spec["admissionChecksStrategy"] = {"admissionChecks": [{"name": c} for c in checks]}
        if cohort:
            spec["cohortName"] = cohort
        if reclaim:
            spec["preemption"] = {"reclaimWithinCohort": "Any"}
        body = {"apiVersion": "/".join(API), "kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec}
        await self.k.custom.create_cluster_custom_object(*API, "clusterqueues", body)
        self.cluster_queues.append(name)
        local = {"apiVersion": "/".join(API), "kind": "LocalQueue", "metadata": {"name": name}}
        local["spec"] = {"clusterQueue": name}
        await self.k.custom.create_namespaced_custom_object(*API, self.k.ns, "localqueues", local)

    async def __aexit__(self, *exc: object) -> None:
        for name in self.cluster_queues:
            await self.k.custom.delete_namespaced_custom_object(*API, self.k.ns, "localqueues", name)
            await self.k.custom.delete_cluster_custom_object(*API, "clusterqueues", name)
        await self.k.custom.delete_cluster_custom_object(*API, "resourceflavors", self.flavor)


async def _managed_a100(
    k: ScenarioApi, sim: ModuleType, make_node: Callable[..., str], prefix: str
) -> tuple[str, str, str]:
    """(pool, node, GPU): a labelled node with one simulated A100-80GB, in a namespace Kueue manages."""
    await k.core.patch_namespace(k.ns, {"metadata": {"labels": {MANAGED_NAMESPACE_LABEL: "true"}}})
    await k.ensure_device_class()
    sim.configure(gpus=["A100-80GB"], state_file=None)
    pool = uuid.uuid4().hex[:8]
    node = make_node(prefix, labels={"dynamig.io/managed": "true", "test-pool": pool})
    return pool, node, f"{node}-gpu0"


async def _dynamic_policy(k: ScenarioApi, pool: str, gpu: str, profile: str = "1g.10gb") -> None:
    await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
    spec = {
        "nodeSelector": {"matchLabels": {"test-pool": pool}},
        "mode": "Dynamic",
        "batchWindowSeconds": 1,
        "cooldownSeconds": 0,  # pods admitted one by one: each may need its own cut (instances)
    }
    await k.create_policy(f"kq-{pool}", spec)
    await eventually(lambda: _classes_exist(k, [profile]), "the profile DeviceClasses")


async def _served(k: ScenarioApi, pod: str, node: str, profile: str = "1g.10gb") -> None:
    """``pod`` is bound to ``node`` with a ``profile`` of dynamig's from the claim the scheduler made."""
    assert await eventually(functools.partial(bound_node, k, pod), f"{pod} bound", within_s=120) == node
    claim = await eventually(functools.partial(_claim, k, pod), f"{pod}'s extended-resource claim")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    tag = f"-{profile.replace('.', '')}-"
    assert result["driver"] == "mig.dynamig.io" and tag in result["device"], result


@pytest.mark.parametrize("inventory", ["partitionable", "instances"])
async def test_kueue_admits_mig_pods_up_to_the_quota_and_dynamig_serves_the_admitted_ones(
    inventory: str,
    kueue: KueueProcess,
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """A ClusterQueue with a quota of two ``nvidia.com/mig-1g.10gb``; three pods of its LocalQueue on an
    A100-80GB: two are admitted, cut for and bound; the third waits behind Kueue's gate, pending in the
    ClusterQueue and unbound; when one admitted pod is deleted, Kueue admits the third and dynamig binds
    it."""
    k = ScenarioApi(kube_api, namespace)
    pool, node, gpu = await _managed_a100(k, sim, make_node, f"kq-{inventory[:4]}")
    settings = partitionable(node) if inventory == "partitionable" else None
    async with (
        Queues(k, pool) as queues,
        agent_running(kube_api, node, sim, settings),
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        cq = f"team-{pool}"
        await queues.add(cq, quota=2)
        await _dynamic_policy(k, pool, gpu)
        for n, name in enumerate(["first", "second"], start=1):  # one at a time: admitted in this order
            await k.core.create_namespaced_pod(namespace, queued_pod(name, cq, pool))
            await eventually(functools.partial(_admitted_count, k, cq, n), f"{name} admitted")
        await k.core.create_namespaced_pod(namespace, queued_pod("third", cq, pool))
        for name in ("first", "second"):
            await _served(k, name, node)
        assert await _admitted(k, cq) == 2
        await eventually(lambda: _pending_in_queue(k, cq, 1), "the third pod pending in the ClusterQueue")
        assert await _gated(k, "third"), "over quota, the third pod must wait behind Kueue's gate"

        await k.core.delete_namespaced_pod("first", namespace, grace_period_seconds=0)
        await eventually(lambda: _gone(k, "first"), "the first pod gone", within_s=60)
        await _served(k, "third", node)
        await k.delete_pods(["second", "third"])
        await k.delete_policy(f"kq-{pool}")


async def test_a_team_reclaims_its_lent_quota_through_kueue_and_dynamig_serves_its_pod(
    kueue: KueueProcess,
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """Two teams' ClusterQueues in one cohort, one ``nvidia.com/mig-1g.10gb`` each; team B reclaims
    within the cohort. Team A's two pods are admitted (one on the quota it borrows from B) and bound to
    slices dynamig cut. When team B's pod comes, Kueue preempts A's borrowing pod (gone), keeps A's other
    one, and admits B's, which dynamig binds to a slice of the same GPU."""
    k = ScenarioApi(kube_api, namespace)
    pool, node, gpu = await _managed_a100(k, sim, make_node, "kq-cohort")
    async with (
        Queues(k, pool) as queues,
        agent_running(kube_api, node, sim, partitionable(node)),
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        team_a, team_b, cohort = f"a-{pool}", f"b-{pool}", f"c-{pool}"
        await queues.add(team_a, quota=1, cohort=cohort)
        await queues.add(team_b, quota=1, cohort=cohort, reclaim=True)
        await _dynamic_policy(k, pool, gpu)
        for n, name in enumerate(["a-own", "a-borrowed"], start=1):
            await k.core.create_namespaced_pod(namespace, queued_pod(name, team_a, pool))
            await eventually(functools.partial(_admitted_count, k, team_a, n), f"{name} admitted")
        for name in ("a-own", "a-borrowed"):
            await _served(k, name, node)

        await k.core.create_namespaced_pod(namespace, queued_pod("b-reclaims", team_b, pool))
        await eventually(lambda: _gone(k, "a-borrowed"), "team A's borrowing pod preempted", within_s=60)
        await _served(k, "b-reclaims", node)
        assert await bound_node(k, "a-own") == node  # within its own quota: never a victim
        assert await _admitted(k, team_a) == 1 and await _admitted(k, team_b) == 1
        await k.delete_pods(["a-own", "b-reclaims"])
        await k.delete_policy(f"kq-{pool}")


BIG = "nvidia.com/mig-3g.40gb"


async def _workload_of(k: ScenarioApi, pod: str) -> str | None:
    """The name of the Workload Kueue made for ``pod``, or None."""
    workloads = await k.custom.list_namespaced_custom_object(*API, k.ns, "workloads")
    for w in workloads.get("items") or []:
        if pod in [o["name"] for o in w["metadata"].get("ownerReferences") or []]:
            return str(w["metadata"]["name"])
    return None


async def _capacity_check(k: ScenarioApi, name: str, retry_s: int) -> None:
    """dynamig's AdmissionCheck ``name`` (``dynamig.io/mig-capacity``), answering Retry after ``retry_s``."""
    body = {"apiVersion": "/".join(API), "kind": "AdmissionCheck",
            "metadata": {"name": name, "annotations": {RETRY_ANNOTATION: str(retry_s)}},
            "spec": {"controllerName": CONTROLLER}}  # fmt: skip
    await k.custom.create_cluster_custom_object(*API, "admissionchecks", body)


async def _bound_pods(k: ScenarioApi, pods: list[str], n: int) -> list[str] | None:
    bound = [p for p in pods if await bound_node(k, p)]
    return bound if len(bound) >= n else None


@pytest.mark.parametrize("with_check", [False, True], ids=["plain-kueue", "mig-capacity-check"])
async def test_the_mig_capacity_check_admits_only_what_the_gpus_can_hold(
    with_check: bool,
    kueue: KueueProcess,
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """An A100-80GB holds two ``3g.40gb``; the ClusterQueue's quota allows three. A burst of three pods.
    Plain Kueue admits all three by quota: two are cut for and bound, the third is admitted though no GPU
    can hold it (ungated, unschedulable, its quota taken). With dynamig's AdmissionCheck
    (``dynamig.io/mig-capacity``, bound 10 s) two are answered Ready and bound; the third's check stays
    Pending, then Retry: Kueue never admits it and releases its quota. Either way, once a bound pod goes the
    third is served."""
    k = ScenarioApi(kube_api, namespace)
    pool, node, gpu = await _managed_a100(k, sim, make_node, "kq-check" if with_check else "kq-plain")
    check = f"mig-{pool}"
    pods = ["a", "b", "c"]
    async with (
        Queues(k, pool) as queues,
        agent_running(kube_api, node, sim, partitionable(node)),
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        if with_check:
            await _capacity_check(k, check, retry_s=10)
        try:
            cq = f"team-{pool}"
            await queues.add(cq, quota=3, resource=BIG, checks=(check,) if with_check else ())
            await _dynamic_policy(k, pool, gpu, "3g.40gb")
            for name in pods:
                await k.core.create_namespaced_pod(namespace, queued_pod(name, cq, pool, BIG))
            bound = await eventually(lambda: _bound_pods(k, pods, 2), "two pods bound", within_s=120)
            for name in bound:
                await _served(k, name, node, "3g.40gb")
            (third,) = [p for p in pods if p not in bound]
            if with_check:
                workload = await eventually(lambda: _workload_of(k, third), "the third pod's workload")
                (retry, *_) = await event_posted(
                    k.core, namespace, workload, "MigCapacityRetry", event_type="Warning", within_s=60
                )
                assert "quota released" in retry["message"] and "3g.40gb" in retry["message"], retry
                assert await _admitted(k, cq) == 2, "the check keeps the third workload from admission"
                assert await _gated(k, third), "never admitted, the third pod stays behind Kueue's gate"
                unplaceable = 0
            else:
                await eventually(functools.partial(_admitted_count, k, cq, 3), "all three admitted by quota")

                async def ungated() -> bool | None:  # Kueue's pod controller ungates it after admission
                    pod = await k.core.read_namespaced_pod(third, namespace)
                    return None if pod.spec.scheduling_gates else True

                await eventually(ungated, "the third pod ungated by Kueue", within_s=30)
                assert await bound_node(k, third) is None, "admitted, and no GPU can hold it"
                unplaceable = 1
            how = "with" if with_check else "without"
            print(f"\nKueue {how} {CONTROLLER}: admitted though no GPU can hold it: {unplaceable} of 3")

            t0 = time.monotonic()
            await k.core.delete_namespaced_pod(bound[0], namespace, grace_period_seconds=0)
            await eventually(lambda: _gone(k, bound[0]), "a bound pod gone", within_s=60)
            await _served(k, third, node, "3g.40gb")
            print(f"  a pod gone -> the third bound in {time.monotonic() - t0:.1f}s")
            await k.delete_pods([bound[1], third])
            await k.delete_policy(f"kq-{pool}")
        finally:
            if with_check:
                await k.custom.delete_cluster_custom_object(*API, "admissionchecks", check)


async def test_a_burst_under_the_capacity_check_is_admitted_no_faster_than_the_gpu_holds_it(
    kueue: KueueProcess,
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """A scripted burst: six pods asking a ``3g.40gb`` each, a quota of six, one A100-80GB that holds two,
    dynamig's AdmissionCheck on (bound 10 s). Sampled every 0.2 s while the pods are served two at a time
    (a bound pod goes, the next is admitted): never more than two pods are ungated at once, every ungated pod
    is bound soon after (no admitted pod waits for room), and all six are served in the end."""
    k = ScenarioApi(kube_api, namespace)
    pool, node, gpu = await _managed_a100(k, sim, make_node, "kq-burst")
    check = f"mig-{pool}"
    pods = [f"burst-{i}" for i in range(6)]
    ungated_at: dict[str, float] = {}
    waited: dict[str, float] = {}  # pod -> seconds from ungated to bound, as sampled
    most = 0

    async def sample(stop: asyncio.Event) -> None:
        nonlocal most
        while not stop.is_set():
            listed = await k.core.list_namespaced_pod(namespace)
            now = time.monotonic()
            live = [p for p in listed.items if p.metadata.name in pods and not p.metadata.deletion_timestamp]
            ungated = [p for p in live if not p.spec.scheduling_gates]
            most = max(most, len(ungated))
            for p in ungated:
                ungated_at.setdefault(p.metadata.name, now)
                if p.spec.node_name and p.metadata.name not in waited:
                    waited[p.metadata.name] = now - ungated_at[p.metadata.name]
            await asyncio.sleep(0.2)

    async with (
        Queues(k, pool) as queues,
        agent_running(kube_api, node, sim, partitionable(node)),
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        await _capacity_check(k, check, retry_s=10)
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(stop))
        try:
            cq = f"team-{pool}"
            await queues.add(cq, quota=6, resource=BIG, checks=(check,))
            await _dynamic_policy(k, pool, gpu, "3g.40gb")
            for name in pods:
                await k.core.create_namespaced_pod(namespace, queued_pod(name, cq, pool, BIG))
            served: list[str] = []
            while len(served) < len(pods):
                need = min(2, len(pods) - len(served))
                waiting = [p for p in pods if p not in served]
                bound = await eventually(
                    functools.partial(_bound_pods, k, waiting, need),
                    f"{need} more pod(s) bound ({len(served)} served so far)",
                    within_s=180,
                )
                going = bound[0]
                await k.core.delete_namespaced_pod(going, namespace, grace_period_seconds=0)
                await eventually(functools.partial(_gone, k, going), f"{going} gone", within_s=60)
                served.append(going)
            stop.set()
            await sampler
            print(f"\nburst of 6 on a GPU holding 2: at most {most} ungated at once; ungated -> bound "
                  f"{max(waited.values()):.1f}s at most")  # fmt: skip
            assert most <= 2, f"{most} pods admitted at once where the GPU holds 2"
            assert sorted(served) == sorted(pods)
            assert waited and max(waited.values()) < 30, waited  # admitted with room: cut and bound at once
            await k.delete_policy(f"kq-{pool}")
        finally:
            stop.set()
            if not sampler.done():
                sampler.cancel()
            await k.custom.delete_cluster_custom_object(*API, "admissionchecks", check)


def queued_job(name: str, queue: str, pool: str, pods: int, resource: str = BIG) -> dict[str, Any]:
    """A Job of ``pods`` pods run at once, each asking one ``resource``, in Kueue's LocalQueue ``queue``
    (Kueue's webhook suspends it until its workload is admitted). Pure."""
    template = queued_pod(name, queue, pool, resource)
    template["spec"]["restartPolicy"] = "Never"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: queue}},
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "template": {"metadata": {"labels": {"app": name}}, "spec": template["spec"]},
        },
    }


async def _job_pods(k: ScenarioApi, job: str, n: int) -> list[dict[str, Any]] | None:
    """``job``'s pods (as the API serves them, plain dicts) once ``n`` are bound, else None."""
    listed = await k.core.list_namespaced_pod(k.ns, label_selector=f"batch.kubernetes.io/job-name={job}")
    pods = [k.core.api_client.sanitize_for_serialization(p) for p in listed.items]
    return pods if sum(1 for p in pods if p["spec"].get("nodeName")) >= n else None


async def _job_workload(k: ScenarioApi, job: str) -> dict[str, Any] | None:
    """The Workload Kueue made for Job ``job``, or None."""
    workloads = await k.custom.list_namespaced_custom_object(*API, k.ns, "workloads")
    for w in workloads.get("items") or []:
        if any(o["kind"] == "Job" and o["name"] == job for o in w["metadata"].get("ownerReferences") or []):
            return dict(w)
    return None


async def test_a_kueue_job_under_the_capacity_check_is_served_and_its_bound_pods_count_as_its_pod_set(
    kueue: KueueProcess,
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """Kueue's ``batch/job`` integration: a Job of two pods asking a ``3g.40gb`` each, a quota of three, one
    A100-80GB that holds two, dynamig's AdmissionCheck on (bound 10 s). Its workload is answered Ready, the
    job controller makes its pods, dynamig cuts for and binds both. Kueue labels each pod with its pod set
    (:data:`POD_SET_LABEL`), and the check's reading of the real objects attributes both bound pods to that
    pod set, so the workload holds no room beside their allocations. A second Job of one pod fits the quota
    but no GPU: its check answers Retry and Kueue never unsuspends it."""
    k = ScenarioApi(kube_api, namespace)
    batch = client.BatchV1Api(kube_api)
    pool, node, gpu = await _managed_a100(k, sim, make_node, "kq-job")
    check = f"mig-{pool}"
    async with (
        Queues(k, pool) as queues,
        agent_running(kube_api, node, sim, partitionable(node)),
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        await _capacity_check(k, check, retry_s=10)
        try:
            cq = f"team-{pool}"
            await queues.add(cq, quota=3, resource=BIG, checks=(check,))
            await _dynamic_policy(k, pool, gpu, "3g.40gb")
            await batch.create_namespaced_job(namespace, queued_job("train", cq, pool, pods=2))
            pods = await eventually(lambda: _job_pods(k, "train", 2), "the Job's pods bound", within_s=120)
            for pod in pods:
                await _served(k, pod["metadata"]["name"], node, "3g.40gb")
            workload = await eventually(lambda: _job_workload(k, "train"), "the Job's workload")
            (pod_set,) = [ps["name"] for ps in workload["spec"]["podSets"]]
            assert [p["metadata"]["labels"].get(POD_SET_LABEL) for p in pods] == [pod_set, pod_set], pods
            (checked,) = checked_workloads([workload], [check])
            assert checked.state is State.READY, checked
            key = f"{namespace}/{workload['metadata']['name']}"
            assert bound_pods([checked], pods) == {key: {pod_set: 2}}
            assert unbound_asks(checked, {pod_set: 2}) == (), "both pods bound: it holds no more room"

            await batch.create_namespaced_job(namespace, queued_job("more", cq, pool, pods=1))
            more = await eventually(lambda: _job_workload(k, "more"), "the second Job's workload")
            (retry, *_) = await event_posted(
                k.core, namespace, more["metadata"]["name"], "MigCapacityRetry", event_type="Warning",
                within_s=60,
            )  # fmt: skip
            assert "3g.40gb" in retry["message"], retry
            job = await batch.read_namespaced_job("more", namespace)
            assert job.spec.suspend, "never admitted, the second Job stays suspended"
            assert await _job_pods(k, "more", 0) == [], "a suspended Job has no pods"
            for name in ("train", "more"):
                await batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
            await k.delete_policy(f"kq-{pool}")
        finally:
            await k.custom.delete_cluster_custom_object(*API, "admissionchecks", check)
