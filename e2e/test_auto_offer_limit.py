"""Placements per profile left on ``auto``: the operator chooses from the number of GPU nodes, the agent
offers that many, and ``kubectl get gpupartitions -o wide`` says so.

Real: etcd and kube-apiserver with the repository's CRDs, the operator's round (``Reconciler.round`` over
the real API: it counts the GPU nodes and writes ``spec.autoPlacementsPerProfile``), the node agent's whole
loop on the partitionable inventory with ``placements_per_profile=None`` (the CLI's ``auto``), the real
kubectl. Simulated: one A100-80GB (simnvml) on a registered Node, and the other GPU nodes of a large cluster:
GpuPartitions of 64 more nodes, created with a status as their agents would write it (no agent runs there).

The cluster grows past the threshold (65 GPU nodes, one placement per profile) and shrinks below it again
(every placement): each time the GPU shows the new limit, the count it was chosen from, and offers that many.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.demo.cluster import ScenarioApi
from dynamig.demo.inprocess import agent_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, POLICY_PLURAL, VERSION
from dynamig.operator.kubeio import KubeIO
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.reconciler import Reconciler
from dynamig.operator.settings import OperatorSettings
from dynamig.planner.offerlimit import EVERY_PLACEMENT_UP_TO, auto_limit
from test_partitionable import partitionable

pytestmark = [pytest.mark.controlplane, pytest.mark.matrix("partitionable")]

CRDS = Path(__file__).resolve().parents[1] / "crds"


@pytest.fixture(scope="module")
def crds(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    cp = control_plane
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    yield cp


async def gpu_nodes(k: ScenarioApi) -> int:
    """What the operator counts: the nodes of every GpuPartition in the cluster (other tests' too)."""
    res = await k.custom.list_cluster_custom_object(GROUP, VERSION, GPU_PARTITION_PLURAL)
    return len({(p.get("status") or {}).get("node") for p in res["items"]} - {None, ""})


async def add_filler(k: ScenarioApi, node: str) -> None:
    name = f"{node}-gpu0"
    await k.custom.create_cluster_custom_object(
        GROUP, VERSION, GPU_PARTITION_PLURAL,
        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuPartition",
         "metadata": {"name": name, "labels": {"dynamig.io/node": node}}, "spec": {"layout": []}},
    )  # fmt: skip
    status = {"node": node, "gpuIndex": 0, "model": "A100-80GB", "inventory": "Partitionable"}
    await k.custom.patch_cluster_custom_object_status(
        GROUP, VERSION, GPU_PARTITION_PLURAL, name, {"status": status},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


async def remove_fillers(k: ScenarioApi, nodes: list[str]) -> None:
    for node in nodes:
        try:
            await k.custom.delete_cluster_custom_object(GROUP, VERSION, GPU_PARTITION_PLURAL, f"{node}-gpu0")
        except ApiException as exc:
            if exc.status != 404:
                raise


def wide_row(cp: ControlPlane, gpu: str) -> dict[str, str]:
    """``kubectl get gpupartitions -o wide``'s row, by column: kubectl aligns each cell under its header, and
    headers and cells such as "PER PROFILE" or "auto (66 GPU nodes)" hold single spaces."""
    header, row = cp.kubectl("get", "gpupartitions", gpu, "-o", "wide").stdout.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=\s\s))\S", header)]
    bounds = [*zip(starts, [*starts[1:], None], strict=True)]
    return {header[a:b].strip(): row[a:b].strip() for a, b in bounds}


async def shows(
    cp: ControlPlane, k: ScenarioApi, rec: Reconciler, policy: str, gpu: str, limit: int, nodes: int
) -> dict[str, Any] | None:
    """One operator round, then the GpuPartition once its agent reports ``limit`` chosen from ``nodes``."""
    await rec.round(policy)
    part = await k.partition(gpu)
    st = part.get("status") or {}
    if (
        st.get("placementsPerProfile") != limit
        or st.get("observedGeneration") != part["metadata"]["generation"]
    ):
        return None
    if st.get("placementsPerProfileChoice") != f"auto ({nodes} GPU nodes)" or not st.get("offeredPlacements"):
        return None
    row = await asyncio.to_thread(wide_row, cp, gpu)
    assert row["PER PROFILE"] == str(limit), row
    assert row["CHOSEN"] == f"auto ({nodes} GPU nodes)", row
    return part


async def test_auto_follows_the_number_of_gpu_nodes_and_kubectl_shows_it(
    crds: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
    sim: ModuleType,
) -> None:
    cp, k = crds, ScenarioApi(kube_api, namespace)
    pool = f"auto-{uuid.uuid4().hex[:6]}"
    await k.ensure_device_class()
    sim.configure(gpus=["A100-80GB"], state_file=None)
    node = make_node("auto-limit", labels={"dynamig.io/managed": "true", "dynamig.io/test-pool": pool})
    gpu = f"{node}-gpu0"
    policy = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuPartitionPolicy", "metadata": {"name": pool},
        "spec": {"nodeSelector": {"matchLabels": {"dynamig.io/test-pool": pool}}, "mode": "Dynamic",
                 "batchWindowSeconds": 1, "cooldownSeconds": 0},
    }  # fmt: skip
    await k.custom.create_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL, policy)
    rec = Reconciler(
        KubeIO(kube_api), load_catalog(), OperatorMetrics(), OperatorSettings(agent_lease_namespace=None)
    )
    settings = dataclasses.replace(partitionable(node), placements_per_profile=None)  # the CLI's auto
    fillers = [f"{pool}-filler-{i}" for i in range(EVERY_PLACEMENT_UP_TO)]
    try:
        async with agent_running(kube_api, node, sim, settings):
            await eventually(functools.partial(k.stable, gpu), f"GpuPartition {gpu}", within_s=60)
            # Grown: this node and 64 more at least, past the threshold.
            for filler in fillers:
                await add_filler(k, filler)
            large = await gpu_nodes(k)
            assert large > EVERY_PLACEMENT_UP_TO and auto_limit(large) == 1
            part = await eventually(
                functools.partial(shows, cp, k, rec, pool, gpu, 1, large), "one per profile", within_s=60
            )
            assert part["spec"]["autoPlacementsPerProfile"] == {"limit": 1, "gpuNodes": large}
            profiles = part["spec"].get("offeredProfiles") or []
            assert 0 < part["status"]["offeredPlacements"] <= len(profiles), part["status"]
            one_each = part["status"]["offeredPlacements"]

            # Shrunk below it again (unless the cluster holds that many GPU nodes without the fillers).
            await remove_fillers(k, fillers)
            small = await gpu_nodes(k)
            want = auto_limit(small)
            part = await eventually(
                functools.partial(shows, cp, k, rec, pool, gpu, want, small), "the new choice", within_s=60
            )
            assert part["spec"]["autoPlacementsPerProfile"] == {"limit": want, "gpuNodes": small}
            if want == 0:  # every placement: more than one of some profile on an idle A100
                assert part["status"]["offeredPlacements"] > one_each, part["status"]
    finally:
        await remove_fillers(k, fillers)
        await k.custom.delete_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL, pool)
