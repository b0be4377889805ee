"""Pods that run: a real kubelet and containerd put each pod's MIG slice into its container.

Real: the control plane (etcd, kube-apiserver, kube-scheduler with DRA allocation and binding conditions,
kube-controller-manager), a kubelet and containerd 2.x with runc (CDI on) built from their modules, the
pause and busybox images (built here, imported into containerd), the dynamig agent as its own process
(feature probe, partitionable inventory, allocation answers, the kubelet DRA plugin registered through the
kubelet's plugin-registration socket, CDI specs read by containerd's CDI cache).
Simulated: the GPUs (simnvml, one A100-80GB; its state file's event history is the ground truth for what was
created and destroyed) and the NVIDIA driver's files, which the agent writes as real character devices
(major 195 for the GPU, the nvidia-caps major it lists in its /proc/devices) so runc can create them in
the container. The container lists its NVIDIA device nodes with their numbers and prints its environment;
the test reads that from the pod's log through the API server and the kubelet.
"""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.demo.cluster import device_plugin_pod
from dynamig.devcluster import eventually
from dynamig.devcluster.node import RealNode, runnable
from dynamig.kube.devices import profile_device_class
from real_node_scenario import NodeScenario, node_scenario

pytestmark = pytest.mark.controlplane


@pytest.fixture
async def scenario(
    real_node: RealNode, kube_api: client.ApiClient, namespace: str
) -> AsyncIterator[NodeScenario]:
    async with node_scenario(real_node, kube_api, namespace) as s:
        yield s


async def test_each_pod_sees_exactly_its_own_mig_slice(scenario: NodeScenario) -> None:
    s = scenario
    await s.offer(["1g.10gb", "2g.20gb"])
    t0 = time.monotonic()
    await s.run("small", "1g.10gb")
    await s.run("medium", "2g.20gb")
    seen = {
        name: await eventually(functools.partial(s.reported, name), f"pod {name} reporting", within_s=120)
        for name in ("small", "medium")
    }
    print(f"\nreal node: two MIG pods created -> both containers reporting in {time.monotonic() - t0:.1f}s")
    uuids = set()
    for name, got in seen.items():
        inst = await s.instance_of(name, state="in-use")  # prepared by the kubelet for a running container
        assert got.devices == s.expected_devices(inst), (name, got.devices, inst)
        assert got.env["DYNAMIG_MIG_UUIDS"] == inst["migUUID"], (name, got.env, inst)
        # The node's base CDI spec (the toolkit's, simulated) applied too: its env and the driver files.
        assert got.env["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert "/usr/bin/nvidia-smi" in got.files
        uuids.add(inst["migUUID"])
        print(f"  {name}: {inst['profile']}@{inst['start']} {inst['migUUID']} -> {sorted(got.devices)}")
    assert len(uuids) == 2
    # Neither container has the other's capability nodes.
    small_caps, medium_caps = set(seen["small"].capability_nodes), set(seen["medium"].capability_nodes)
    assert small_caps and medium_caps and not small_caps & medium_caps


async def test_a_pod_written_for_the_device_plugin_runs_on_its_mig_slice(scenario: NodeScenario) -> None:
    """``nvidia.com/mig-1g.10gb: 1`` in the limits, no claim: the scheduler books it from the profile's
    DeviceClass (the one the operator keeps), the kubelet prepares the claim it made through dynamig's plugin,
    and the container gets that instance's device nodes and MIG UUID; deleting it frees the instance."""
    s = scenario
    try:
        await s.k.custom.create_cluster_custom_object(
            "resource.k8s.io", "v1", "deviceclasses", profile_device_class("1g.10gb")
        )
    except ApiException as exc:
        if exc.status != 409:  # made by an operator of another test
            raise
    await s.offer(["1g.10gb"])
    pod = runnable(device_plugin_pod("plugin-way", {"kubernetes.io/hostname": s.node.name}))
    await s.k.core.create_namespaced_pod(s.k.ns, pod)
    got = await eventually(functools.partial(s.reported, "plugin-way"), "pod reporting", within_s=120)
    claim = await s.claim("plugin-way")
    assert any(r["kind"] == "Pod" for r in claim["metadata"]["ownerReferences"])  # the scheduler's claim
    inst = await s.instance_of("plugin-way", state="in-use")
    assert inst["profile"] == "1g.10gb", inst
    assert got.devices == s.expected_devices(inst), (got.devices, inst)
    assert got.env["DYNAMIG_MIG_UUIDS"] == inst["migUUID"], (got.env, inst)
    await s.finish("plugin-way")


async def test_deleting_the_pod_unprepares_its_claim_and_frees_the_instance(scenario: NodeScenario) -> None:
    s = scenario
    await s.offer(["1g.10gb"])
    await s.run("short", "1g.10gb")
    await eventually(functools.partial(s.reported, "short"), "pod reporting", within_s=120)
    await s.finish("short")


async def test_kubelet_and_agent_restarts_leave_a_running_pod_alone(scenario: NodeScenario) -> None:
    """Each restart: the pod keeps running in the same container, the plugin registers again (the next
    pod's claim is prepared by the restarted side), and no instance is destroyed or re-created."""
    s = scenario
    await s.offer(["1g.10gb"])
    inst, container = await s.running("steady", "1g.10gb")
    events = len(s.nvml_history())

    t0 = time.monotonic()
    await asyncio.to_thread(s.node.stop_kubelet)
    await asyncio.to_thread(s.node.start_kubelet)
    await s.run("after-kubelet", "1g.10gb")
    await eventually(functools.partial(s.reported, "after-kubelet"), "a pod after the kubelet restart", 120)
    print(f"\nreal node: kubelet restarted, next MIG pod reporting after {time.monotonic() - t0:.1f}s")

    t0 = time.monotonic()
    await asyncio.to_thread(s.node.start_agent, *s.node.agent_args)
    await s.run("after-agent", "1g.10gb")
    await eventually(functools.partial(s.reported, "after-agent"), "a pod after the agent restart", 120)
    print(f"real node: agent restarted, next MIG pod reporting after {time.monotonic() - t0:.1f}s")

    assert await s.container("steady") == container, "the pod's container kept running through both restarts"
    assert (await s.instance_of("steady"))["migUUID"] == inst["migUUID"]
    since = s.nvml_history()[events:]
    assert not [e for e in since if e["kind"].startswith("destroy")], since
    created = [e["start"] for e in since if e["kind"] == "create-gi"]
    assert inst["start"] not in created, f"the running pod's instance was re-created: {since}"
    assert len(created) <= 2, f"at most one instance per new pod, nothing else: {since}"
    # The restarted agent unprepares the claim it prepared before the restart: its checkpoint answers.
    await s.finish("steady")


async def test_a_reshape_next_to_a_running_pod_never_touches_its_instance(scenario: NodeScenario) -> None:
    s = scenario
    await s.offer(["1g.10gb", "3g.40gb", "7g.80gb"])
    inst, container = await s.running("tenant", "1g.10gb")
    events = len(s.nvml_history())

    # A layout that keeps the pod's slice: the other half of the GPU becomes one 3g.40gb.
    other_half = 4 if inst["start"] < 4 else 0
    generation = await s.k.set_layout(s.gpu, [("3g.40gb", other_half)])
    await eventually(
        functools.partial(s.has_instance, "3g.40gb", other_half),
        "the 3g.40gb cut next to the pod",
        within_s=60,
    )
    # A layout that would need the pod's slice: refused for as long as the pod holds it.
    generation = await s.k.set_layout(s.gpu, [("7g.80gb", 0)])
    await eventually(functools.partial(s.observed, generation), "the agent's answer to 7g.80gb", within_s=60)
    part = await s.k.partition(s.gpu)
    st = part["status"]
    print(f"\nreal node: 7g.80gb over a running pod -> {st.get('phase')}: {st.get('message')}")

    assert await s.container("tenant") == container
    since = s.nvml_history()[events:]
    touched = [e for e in since if e.get("mig_uuid") == inst["migUUID"] or e.get("start") == inst["start"]]
    assert not touched, f"the running pod's instance was touched: {touched}"
    assert not [e for e in since if e["kind"] == "create-gi" and e["profile"] == "7g.80gb"]


# Keep this test last in the module: it uninstalls dynamig from the module's node.
async def test_uninstall_leaves_the_gpu_at_its_baseline_and_nothing_on_the_node(
    scenario: NodeScenario,
) -> None:
    """What the chart's pre-delete hook runs, against the real kubelet and containerd: the running pod keeps
    its container and its MIG instance, the rest of the GPU goes to the policy's baseline, and the node is
    left without dynamig's slices, sockets, checkpoint, CDI specs or device nodes; the GpuPartitions are gone
    and the policy deletes at once."""
    s, node, cp = scenario, scenario.node, scenario.node.cluster
    await s.offer(["1g.10gb"])
    inst, container = await s.running("stays", "1g.10gb")
    events = len(s.nvml_history())
    other_half = 4 if inst["start"] < 4 else 0
    label = f"uninstall-test={s.k.ns}"
    await asyncio.to_thread(cp.kubectl, "label", "node", node.name, label)
    policy = f"uninstall-{s.k.ns}"[:63]
    await s.k.create_policy(
        policy,
        {
            "mode": "Static",
            "nodeSelector": {"matchLabels": {"uninstall-test": s.k.ns}},
            "baseline": {"A100-80GB": [{"profile": "3g.40gb", "start": other_half}]},
        },
    )
    assert (node.kubelet_root / "plugins_registry" / "mig.dynamig.io-reg.sock").exists()
    assert list(node.cdi_dir.glob("k8s.mig.dynamig.io-claim_*")), "the running pod's claim has a CDI spec"

    t0 = time.monotonic()
    argv = [
        sys.executable,
        "-m",
        "dynamig",
        "uninstall",
        f"--kubeconfig={cp.kubeconfig_path}",
        "--timeout=90",
        f"--node={node.name}",  # the session's other nodes are other tests' business
        "--yes",
    ]
    done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=180)
    print(f"\nreal node: dynamig uninstall took {time.monotonic() - t0:.1f}s:\n{done.stdout}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{s.gpu}: left with 3g.40gb@{other_half}; cleaned by its agent" in done.stdout, done.stdout

    # The workload: same container, same instance; the other half cut to the baseline.
    assert await s.container("stays") == container
    since = s.nvml_history()[events:]
    assert not [e for e in since if e.get("mig_uuid") == inst["migUUID"]], since
    live: dict[tuple[int, int], tuple[str, int]] = {}  # (gpu, GI id) -> (profile, start), from NVML's history
    for e in s.nvml_history():
        if e["kind"] == "create-gi":
            live[(e["gpu_index"], e["gi_id"])] = (e["profile"], e["start"])
        elif e["kind"] == "destroy-gi":
            live.pop((e["gpu_index"], e["gi_id"]), None)
    assert set(live.values()) == {(inst["profile"], inst["start"]), ("3g.40gb", other_half)}, live

    # The node: nothing of dynamig's left on its paths.
    leftovers = [
        *node.kubelet_root.glob("plugins/mig.dynamig.io/*"),
        *node.kubelet_root.glob("plugins_registry/mig.dynamig.io*"),
        *node.cdi_dir.glob("k8s.mig.dynamig.io-*"),
        *node.dev_root.glob("nvidia*"),
        *node.dev_root.glob("nvidia-caps/*"),
        *node.proc_root.glob("driver/nvidia/capabilities/*"),
    ]
    assert leftovers == [], leftovers
    # The cluster: no slices or GpuPartitions of the node, and the policy goes without waiting.
    gparts = await asyncio.to_thread(cp.kubectl, "get", "gpupartitions", "-o", "name")
    assert s.gpu not in gparts.stdout
    slices = await asyncio.to_thread(
        cp.kubectl, "get", "resourceslices", f"--field-selector=spec.nodeName={node.name}", "-o", "name"
    )
    assert slices.stdout.strip() == "", slices.stdout
    await asyncio.to_thread(cp.kubectl, "delete", "gpupartitionpolicy", policy, "--timeout=10s")
    # Without the plugin the kubelet cannot unprepare the pod's claim (SyncTerminatingPod retries
    # NodeUnprepareResources before finishing the pod): a pod left running at uninstall is force-deleted.
    await s.k.core.delete_namespaced_pod("stays", s.k.ns, grace_period_seconds=0)
