"""Removing dynamig from a cluster without leaving anything behind: what the chart's pre-delete hook runs
(``dynamig uninstall``).

1. The operator is scaled to zero, so nothing writes layouts any more.
2. Every GpuPartition gets the layout it is left with (its policy's baseline, or empty; a GPU with no
   baseline keeps its layout), no offered profiles, and the ``dynamig.io/uninstall`` annotation. Its agent
   then withdraws the node's ResourceSlices, applies that layout (never destroying an allocated or busy
   instance: running workloads keep their MIG instances), removes the plugin's files from the node and sets
   ``Uninstalled=True`` on the GpuPartition.
3. Once every GPU reported (or its agent is silent, or the timeout passed), the remaining ResourceSlices of
   the driver and the GpuPartitions are deleted and dynamig's finalizers are removed from policies, so that
   deleting the CRDs never hangs. Policies themselves stay: they are the user's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig import DRIVER_NAME
from dynamig.geometry.catalog import Catalog
from dynamig.kube.apicalls import MERGE_PATCH
from dynamig.kube.gpupartition import ConditionType, layout_summary, parse_gpu_partition
from dynamig.kube.names import (
    GPU_PARTITION_PLURAL,
    GROUP,
    NODE_LABEL,
    POLICY_PLURAL,
    UNINSTALL_ANNOTATION,
    VERSION,
)
from dynamig.operator.extended import class_changes
from dynamig.operator.kubeio import KubeIO
from dynamig.operator.world import World, parse_world

log = logging.getLogger(__name__)

Leave = Literal["baseline", "empty"]
# Finalizers dynamig (through Kopf) may have put on its objects in earlier versions.
OWN_FINALIZER_PREFIXES = ("operator.dynamig.io/", "kopf.zalando.org/")


@dataclass
class TeardownReport:
    layouts: dict[str, str] = field(default_factory=dict)  # GPU -> the layout it is left with
    cleaned: list[str] = field(default_factory=list)  # GPUs whose agent reported Uninstalled
    orphaned: list[str] = field(default_factory=list)  # GPUs of nodes that no longer exist: nothing to clean
    unreported: dict[str, str] = field(default_factory=dict)  # GPU -> why its agent did not report
    slices_deleted: int = 0
    partitions_deleted: int = 0
    classes_deleted: int = 0
    finalizers_removed: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.unreported


def left_layout(world: World, partition: Mapping[str, Any], leave: Leave) -> list[dict[str, Any]] | None:
    """The ``spec.layout`` a GPU is left with: empty, or its governing policy's baseline for its model;
    None to keep the layout it has (no policy or no baseline). Pure."""
    if leave == "empty":
        return []
    name = str(partition["metadata"]["name"])
    owner = world.ownership.owner.get(name)
    policy = next((p for p in world.policies if p.name == owner), None)
    model = next((g.model for g in world.gpus if g.name == name), None)
    if policy is None or model is None:
        return None
    base = policy.spec.baseline_layout(model.key)
    return None if base is None else [{"profile": i.profile, "start": i.start} for i in base]


def uninstalled(partition: Mapping[str, Any]) -> bool:
    """The node's agent reported that it withdrew this GPU and cleaned the node. Pure."""
    part = parse_gpu_partition(dict(partition))
    cond = part.status.condition(ConditionType.UNINSTALLED)
    return cond is not None and cond.is_true


async def _scale_to_zero(api: client.ApiClient, namespace: str, deployment: str) -> None:
    try:
        await client.AppsV1Api(api).patch_namespaced_deployment_scale(
            deployment, namespace, {"spec": {"replicas": 0}}, _content_type=MERGE_PATCH
        )
        log.info("scaled the operator %s/%s to zero", namespace, deployment)
    except ApiException as exc:
        if exc.status != 404:
            raise
        log.info("no operator deployment %s/%s", namespace, deployment)


async def uninstall(
    api: client.ApiClient,
    catalog: Catalog,
    *,
    leave: Leave,
    namespace: str | None,
    operator_deployment: str | None,
    timeout_s: float,
    nodes: frozenset[str] | None = None,
    poll_s: float = 1.0,
) -> TeardownReport:
    """Runs steps 1-3 above; with ``nodes``, only for the GPUs and slices of those nodes (the operator is
    left running then). Side effects: API writes; the agents act on the nodes."""
    report = TeardownReport()
    io = KubeIO(api)
    custom = client.CustomObjectsApi(api)
    if namespace and operator_deployment and nodes is None:
        await _scale_to_zero(api, namespace, operator_deployment)

    snap = await io.snapshot(namespace)
    world = parse_world(snap, catalog, time.time())
    for part in snap.partitions:
        name = str(part["metadata"]["name"])
        if nodes is not None and _node_of(part) not in nodes:
            continue
        layout = left_layout(world, part, leave)
        spec: dict[str, Any] = {"offeredProfiles": []}
        if layout is not None:
            spec["layout"] = layout
        written = await io.write_spec(name, spec, {UNINSTALL_ANNOTATION: leave})
        report.layouts[name] = layout_summary(parse_gpu_partition(written).spec.desired())
        log.info("%s: left with %s", name, report.layouts[name])

    # Wait for the agents. A GPU whose agent's Lease ran out, or whose Node is gone, will not report.
    deadline = time.monotonic() + timeout_s
    waiting = set(report.layouts)
    while waiting:
        listed = await custom.list_cluster_custom_object(GROUP, VERSION, GPU_PARTITION_PLURAL)
        by_name = {str(p["metadata"]["name"]): p for p in listed.get("items") or []}
        for name in sorted(waiting):
            found = by_name.get(name)
            meta = (found or {}).get("metadata") or {}
            node = str(
                ((found or {}).get("status") or {}).get("node")
                or (meta.get("labels") or {}).get(NODE_LABEL, "")
            )
            if found is None:
                report.unreported[name] = "deleted meanwhile"
            elif uninstalled(found):
                report.cleaned.append(name)
            elif node not in world.node_labels:
                report.orphaned.append(name)
            elif node in world.silent:
                report.unreported[name] = f"its agent is silent ({world.silent[node]})"
            else:
                continue
            waiting.discard(name)
        if not waiting:
            break
        if time.monotonic() >= deadline:
            for name in waiting:
                report.unreported[name] = f"its agent did not report within {timeout_s:.0f}s"
            break
        await asyncio.sleep(poll_s)

    # What no agent is left to remove.
    slices = await client.ResourceV1Api(api).list_resource_slice(field_selector=f"spec.driver={DRIVER_NAME}")
    for s in slices.items or []:
        if nodes is not None and s.spec.node_name not in nodes:
            continue
        await _delete(client.ResourceV1Api(api).delete_resource_slice(s.metadata.name))
        report.slices_deleted += 1
    for name in report.layouts:
        await _delete(custom.delete_cluster_custom_object(GROUP, VERSION, GPU_PARTITION_PLURAL, name))
        report.partitions_deleted += 1
    if nodes is None:  # the profile DeviceClasses; pods already served keep their claims
        classes = class_changes((), snap.device_classes)
        await io.write_device_classes(classes)
        report.classes_deleted = len(classes.delete)
    policies = await custom.list_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL)
    for pol in policies.get("items") or []:
        meta = pol["metadata"]
        finalizers = list(meta.get("finalizers") or [])
        kept = [f for f in finalizers if not f.startswith(OWN_FINALIZER_PREFIXES)]
        if kept != finalizers:
            await custom.patch_cluster_custom_object(
                GROUP, VERSION, POLICY_PLURAL, meta["name"], {"metadata": {"finalizers": kept or None}},
                _content_type=MERGE_PATCH,
            )  # fmt: skip
            report.finalizers_removed.append(str(meta["name"]))
    return report


def _node_of(partition: Mapping[str, Any]) -> str:
    meta = partition.get("metadata") or {}
    return str((partition.get("status") or {}).get("node") or (meta.get("labels") or {}).get(NODE_LABEL, ""))


async def _delete(call: Any) -> None:
    try:
        await call
    except ApiException as exc:
        if exc.status != 404:
            raise
