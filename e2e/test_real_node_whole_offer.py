"""A whole GPU offered beside its MIG slices (GpuPartition ``spec.offerWhole``) on a real node: a pod booked
on it runs on one whole GPU whose MIG mode the agent switched off for it.

Real: the control plane (kube-scheduler with DRA allocation of partitionable devices and binding conditions),
a kubelet and containerd 2.x with runc (CDI on), the busybox image, the dynamig agent as its own process
(its partitionable inventory, the kubelet DRA plugin, the CDI specs containerd reads). Simulated: the GPU
(simnvml: one H100-80GB with MIG mode on; its state file's history is the ground truth for the switch) and
the NVIDIA driver's files (real character devices). The container lists its NVIDIA device nodes and prints
its environment; the test reads that from the pod's log.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator

import pytest
from kubernetes_asyncio import client

from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.node import RealNode
from dynamig.devcluster.pytest_plugin import running_real_node
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION
from real_node_scenario import node_scenario
from test_real_node_whole_gpu import WholeScenario

pytestmark = pytest.mark.controlplane


@pytest.fixture(scope="module")
def offer_node(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[RealNode]:
    """A real node whose agent runs over one H100-80GB with MIG mode on."""
    with running_real_node(control_plane, request, "H100-80GB:1", prefix="offer") as node:
        yield node


async def test_a_pod_booked_on_the_whole_gpu_offered_beside_its_slices_runs_on_the_whole_gpu(
    offer_node: RealNode, kube_api: client.ApiClient, namespace: str
) -> None:
    async with node_scenario(offer_node, kube_api, namespace):
        s = WholeScenario(kube_api, namespace, offer_node)
        await s.k.claim_template("whole", ["whole"])
        part = await eventually(functools.partial(s.k.stable, s.gpu), f"GpuPartition {s.gpu}", within_s=90)
        assert part["status"]["inventory"] == "Partitionable", part["status"]
        assert part["status"]["migMode"] == "Enabled", part["status"]
        await s.k.custom.patch_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL, s.gpu, {"spec": {"offerWhole": True}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip

        async def offered() -> bool | None:
            return True if (await s.k.partition(s.gpu))["status"].get("wholeOffered") else None

        await eventually(offered, "the whole GPU published beside its slices", within_s=60)
        t0 = time.monotonic()
        await s.run_whole("trainer")
        reported = functools.partial(s.reported, "trainer")
        got = await eventually(reported, "pod trainer reporting", within_s=120)
        took = time.monotonic() - t0
        device, part = await s.check_sees_its_gpu("trainer", got)
        assert device == "gpu0"
        state = json.loads(s.node.nvml_state.read_text())
        assert [(g["mig_current"], g["mig_pending"]) for g in state["gpus"]] == [(0, 0)], state["gpus"]
        switches = [e for e in state["history"] if e["kind"] == "set-mig-mode"]
        assert len(switches) == 1, state["history"]
        print(
            f"\nreal node: whole GPU offered beside its slices: pod created -> MIG off -> container "
            f"reporting in {took:.1f}s: {device} {part['status']['uuid']} -> {sorted(got.devices)}"
        )
        await s.finish_whole("trainer")
