"""Unchanged device-plugin workloads: pods that ask ``nvidia.com/mig-1g.10gb: 1`` in their resource limits, as
the NVIDIA device plugin's ``mixed`` strategy names MIG, served by dynamig on the real API server and
kube-scheduler (DRAExtendedResource, GA in 1.37).

The operator keeps a DeviceClass per offered profile whose ``extendedResourceName`` is that name; the
scheduler then allocates such a request from the class's devices in a ResourceClaim it makes for the pod
(``status.extendedResourceClaimStatus``). In the partitionable inventory it books a placement directly and
the agent cuts it; in the instances inventory the operator sees the unschedulable pod's request as demand
(there is no claim yet) and re-cuts ahead. Both start from a GPU cut for something else (one 7g.80gb). No
kubelet: pods bind and never run.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamig.demo.cluster import ScenarioApi, allocated_device, claim_pod
from dynamig.demo.inprocess import agent_running, operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.kube.names import profile_class_name
from dynamig.operator.metrics import OperatorMetrics
from test_partitionable import _instances, _no_pods, bound_node, partitionable

PRE_CUT = [("7g.80gb", 0)]


def device_plugin_deployment(name: str, resource: str, pool: str) -> dict[str, Any]:
    """A Deployment written for the NVIDIA device plugin, as teams have them today. Pure.

    No kubelet runs its pods: ``terminationGracePeriodSeconds: 0`` lets a deletion by its ReplicaSet or the
    garbage collector (a replacement made while the Deployment's deletion propagates, and bound by then)
    finish without one."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"test-pool": pool},
                    "terminationGracePeriodSeconds": 0,
                    "containers": [
                        {
                            "name": "server",
                            "image": "inference-server:1.0",
                            "resources": {"limits": {resource: "1"}},
                        }
                    ],
                },
            },
        },
    }


async def _pod_of(k: ScenarioApi, app: str) -> str | None:
    pods = await k.core.list_namespaced_pod(k.ns, label_selector=f"app={app}")
    return pods.items[0].metadata.name if pods.items else None


async def _claim(k: ScenarioApi, pod: str, extended: bool = True) -> dict[str, Any] | None:
    """Once allocated, the ResourceClaim the scheduler made for the pod's extended resources (or, not
    ``extended``, the one made from the pod's own claim template)."""
    raw = await k.core.read_namespaced_pod(pod, k.ns, _preload_content=False)
    status = (await raw.json()).get("status") or {}
    if extended:
        name = (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    else:
        name = next((s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []), None)
    if not name:
        return None
    claim = await k.custom.get_namespaced_custom_object("resource.k8s.io", "v1", k.ns, "resourceclaims", name)
    return claim if (claim.get("status") or {}).get("allocation") else None


async def _classes_exist(k: ScenarioApi, profiles: list[str]) -> bool | None:
    listed = await k.custom.list_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses")
    names = {c["metadata"]["name"] for c in listed["items"]}
    return True if {profile_class_name(p) for p in profiles} <= names else None


async def _all_free(k: ScenarioApi, gpu: str) -> bool | None:
    part = await k.partition(gpu)
    rows = (part.get("status") or {}).get("instances") or []
    return True if rows and all(not r.get("claims") for r in rows) else None


@pytest.mark.parametrize("inventory", ["partitionable", "instances"])
async def test_unchanged_device_plugin_pods_get_mig_slices_recut_for_them(
    inventory: str,
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    """A Deployment asking ``nvidia.com/mig-1g.10gb: 1``, one asking ``nvidia.com/mig-3g.40gb: 1`` and a pod
    mixing ``nvidia.com/mig-1g.10gb: 1`` with a ResourceClaim, on an A100-80GB cut as one 7g.80gb: the GPU is
    re-cut, every pod binds with its devices from dynamig's driver, and deleting the pods frees them."""
    k = ScenarioApi(kube_api, namespace)
    await k.ensure_device_class()
    await k.claim_template("small", ["1g.10gb"])
    sim.configure(gpus=["A100-80GB"], state_file=None)
    pool = uuid.uuid4().hex[:8]
    node = make_node(f"dp-{inventory[:4]}", labels={"dynamig.io/managed": "true", "test-pool": pool})
    gpu = f"{node}-gpu0"
    settings = partitionable(node) if inventory == "partitionable" else None
    apps = client.AppsV1Api(kube_api)
    policy = f"dp-{pool}"
    async with (
        agent_running(kube_api, node, sim, settings),
        operator_running(crds.kubeconfig_path, OperatorMetrics()),
    ):
        await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
        await k.set_layout(gpu, PRE_CUT)
        await eventually(functools.partial(k.stable, gpu, "7g.80gb@0"), f"{gpu} cut for something else")
        history_start = len(sim.history())
        spec = {
            "nodeSelector": {"matchLabels": {"test-pool": pool}},
            "mode": "Dynamic",
            "batchWindowSeconds": 1,
        }
        await k.create_policy(policy, spec)
        await eventually(lambda: _classes_exist(k, ["1g.10gb", "3g.40gb"]), "the profile DeviceClasses")

        for app, resource in (("small", "nvidia.com/mig-1g.10gb"), ("big", "nvidia.com/mig-3g.40gb")):
            await apps.create_namespaced_deployment(namespace, device_plugin_deployment(app, resource, pool))
        mixed = claim_pod("mixed", {"test-pool": pool}, template="small")
        mixed["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/mig-1g.10gb": "1"}
        await k.core.create_namespaced_pod(namespace, mixed)

        pods = {
            "small": await eventually(lambda: _pod_of(k, "small"), "the small Deployment's pod"),
            "big": await eventually(lambda: _pod_of(k, "big"), "the big Deployment's pod"),
            "mixed": "mixed",
        }
        got: dict[str, dict[str, Any]] = {}
        for app, pod in pods.items():
            bound = functools.partial(bound_node, k, pod)
            assert await eventually(bound, f"{app} bound", within_s=120) == node
            got[app] = await eventually(functools.partial(_claim, k, pod), f"{app}'s extended-resource claim")
        devices = {app: allocated_device(claim) for app, claim in got.items()}
        assert devices["small"] and "-1g10gb-" in devices["small"], devices
        assert devices["big"] and "-3g40gb-" in devices["big"], devices
        assert devices["mixed"] and "-1g10gb-" in devices["mixed"], devices
        for claim in got.values():
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            assert result["driver"] == "mig.dynamig.io"
            assert any(r["kind"] == "Pod" for r in claim["metadata"]["ownerReferences"])
        own = allocated_device(await _claim(k, "mixed", extended=False))  # its own ResourceClaim, beside
        assert own and "-1g10gb-" in own and own != devices["mixed"]
        assert len({devices["small"], devices["mixed"], own}) == 3
        history = sim.history()[history_start:]
        assert any(ev.kind.startswith("destroy") and ev.profile == "7g.80gb" for ev in history)
        assert sorted(i.profile for i in _instances(sim)) == ["1g.10gb", "1g.10gb", "1g.10gb", "3g.40gb"]

        # Gone: the Deployments and the pod; their claims follow (owned by the pods), the instances are free.
        for app in ("small", "big"):
            await apps.delete_namespaced_deployment(app, namespace, propagation_policy="Foreground")
        await k.delete_pods(["mixed", pods["small"], pods["big"]])
        await eventually(lambda: _no_pods(k), "the pods gone", within_s=60)
        await eventually(lambda: _all_free(k, gpu), f"{gpu}'s instances free", within_s=60)
        await k.delete_policy(policy)
