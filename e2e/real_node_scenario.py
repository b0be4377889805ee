"""What the real-node tests share: a scenario's reads and writes against one kubelet + containerd node with
dynamig's agent (see ``dynamig.devcluster.node``), and the cleanup that lets the next test book the GPU."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.agent.plugin import cdi
from dynamig.demo.cluster import ScenarioApi, allocated_device, claim_pod
from dynamig.devcluster import eventually
from dynamig.devcluster.node import ContainerReport, RealNode, parse_report, runnable
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION


def report_pod(name: str, node: str, template: str) -> dict[str, Any]:
    """A pod on ``node`` with one claim from ``template``, whose container reports what it sees. Pure."""
    return runnable(claim_pod(name, {"kubernetes.io/hostname": node}, template=template))


class NodeScenario:
    """API reads and writes of one test against the real node."""

    def __init__(self, api: client.ApiClient, namespace: str, node: RealNode) -> None:
        self.k = ScenarioApi(api, namespace)
        self.node = node
        self.gpu = f"{node.name}-gpu0"

    async def offer(self, profiles: list[str]) -> None:
        """What a Dynamic policy's operator writes: the profiles pods may book on the GPU."""
        await eventually(functools.partial(self.k.stable, self.gpu), f"GpuPartition {self.gpu}", within_s=60)
        await self.k.custom.patch_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL, self.gpu, {"spec": {"offeredProfiles": profiles}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip

    async def run(self, name: str, profile: str) -> None:
        template = f"{name}-{profile.replace('.', '-')}"
        await self.k.claim_template(template, [profile])
        await self.k.core.create_namespaced_pod(self.k.ns, report_pod(name, self.node.name, template))

    async def reported(self, name: str) -> ContainerReport | None:
        pod = await self.k.core.read_namespaced_pod(name, self.k.ns)
        if pod.status.phase in ("Failed", "Succeeded"):
            raise AssertionError(f"pod {name} ended: {pod.status}")
        if pod.status.phase != "Running":
            return None
        return parse_report(await self.k.core.read_namespaced_pod_log(name, self.k.ns))

    async def claim(self, pod_name: str) -> dict[str, Any]:
        """The pod's one claim: from its template, or the scheduler's for its extended resources."""
        raw = await self.k.core.read_namespaced_pod(pod_name, self.k.ns, _preload_content=False)
        status = (await raw.json()).get("status") or {}
        names = [s["resourceClaimName"] for s in status.get("resourceClaimStatuses") or []]
        extended = (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
        (name,) = names or [extended]
        claim: dict[str, Any] = await self.k.custom.get_namespaced_custom_object(
            "resource.k8s.io", "v1", self.k.ns, "resourceclaims", name
        )
        return claim

    async def instance_of(self, pod_name: str, state: str | None = None) -> dict[str, Any]:
        """The GpuPartition's status entry for the instance the pod's claim was allocated. With ``state``,
        waits for the entry to say it: the agent writes its status after the kubelet's prepare returns, so a
        container can report before its instance reads ``in-use``."""
        device = allocated_device(await self.claim(pod_name))

        async def entry() -> dict[str, Any] | None:
            part = await self.k.partition(self.gpu)
            for inst in part["status"]["instances"]:
                if inst["deviceName"] == device:
                    return dict(inst) if state is None or inst["state"] == state else None
            raise AssertionError(f"{device} not in {self.gpu}'s status: {part['status']['instances']}")

        if state is None:
            found = await entry()
            assert found is not None
            return found
        return await eventually(entry, f"{device} {state} in {self.gpu}'s status", within_s=30)

    def expected_devices(self, inst: dict[str, Any]) -> dict[str, str]:
        """The device nodes a container of this instance must get: the control nodes, the parent GPU, and
        the GI and CI capabilities with the minors the driver's capability files give. Side effect: reads
        the simulated driver's procfs files."""
        gi, ci = inst["gpuInstanceId"], inst["computeInstanceId"]
        proc = self.node.proc_root
        minors = [
            int(path.read_text().split("DeviceFileMinor:")[1].split()[0])
            for path in (cdi.gi_access_path(proc, 0, gi), cdi.ci_access_path(proc, 0, gi, ci))
        ]
        caps_major = cdi.parse_char_major((proc / "devices").read_text(), "nvidia-caps")
        nvidia_major = cdi.parse_char_major((proc / "devices").read_text(), "nvidia")
        uvm_major = cdi.parse_char_major((proc / "devices").read_text(), "nvidia-uvm")
        return {
            "/dev/nvidia0": f"{nvidia_major}:0",
            "/dev/nvidiactl": f"{nvidia_major}:255",
            "/dev/nvidia-modeset": f"{nvidia_major}:254",
            "/dev/nvidia-uvm": f"{uvm_major}:0",
            "/dev/nvidia-uvm-tools": f"{uvm_major}:1",
            **{f"/dev/nvidia-caps/nvidia-cap{m}": f"{caps_major}:{m}" for m in minors},
        }

    async def container(self, pod_name: str) -> tuple[str, int]:
        """The pod's one container: its runtime id and restart count, while it runs."""
        pod = await self.k.core.read_namespaced_pod(pod_name, self.k.ns)
        (status,) = pod.status.container_statuses
        assert status.state.running is not None, status
        return status.container_id, status.restart_count

    async def running(self, name: str, profile: str) -> tuple[dict[str, Any], tuple[str, int]]:
        """Run a pod on ``profile`` until it reports; its instance's status entry and its container."""
        await self.run(name, profile)
        await eventually(functools.partial(self.reported, name), "pod reporting", within_s=120)
        return await self.instance_of(name, state="in-use"), await self.container(name)

    async def has_instance(self, profile: str, start: int) -> bool | None:
        part = await self.k.partition(self.gpu)
        found = any(i["profile"] == profile and i["start"] == start for i in part["status"]["instances"])
        return True if found else None

    async def observed(self, generation: int) -> bool | None:
        part = await self.k.partition(self.gpu)
        return True if part["status"].get("observedGeneration") == generation else None

    async def finish(self, pod_name: str) -> None:
        """Deletes the pod and checks what its kubelet and the plugin do: the pod goes, NodeUnprepareResources
        removes the claim's CDI spec, the instance is free again and was not destroyed."""
        uid = (await self.claim(pod_name))["metadata"]["uid"]
        inst = await self.instance_of(pod_name)
        spec = cdi.spec_path(self.node.cdi_dir, uid)
        assert spec.exists(), f"the claim's CDI spec {spec} is where containerd reads it"
        await self.k.core.delete_namespaced_pod(pod_name, self.k.ns)

        async def pod_gone() -> bool | None:
            try:
                await self.k.core.read_namespaced_pod(pod_name, self.k.ns)
            except ApiException as e:
                return True if e.status == 404 else None
            return None

        await eventually(pod_gone, f"pod {pod_name} deleted by its kubelet", within_s=60, every_s=0.3)
        assert not spec.exists(), "NodeUnprepareResources removes the claim's CDI spec"

        async def freed() -> dict[str, Any] | None:
            part = await self.k.partition(self.gpu)
            for i in part["status"]["instances"]:
                if i["migUUID"] == inst["migUUID"] and i["state"] == "free" and not i.get("claims"):
                    return dict(i)
            return None

        await eventually(freed, f"{pod_name}'s instance free again", within_s=60, every_s=0.3)
        history = self.nvml_history()
        destroyed = [e for e in history if e["kind"] == "destroy-ci" and e["mig_uuid"] == inst["migUUID"]]
        assert not destroyed, "unprepare keeps the instance (free, bookable again)"

    def nvml_history(self) -> list[dict[str, Any]]:
        history: list[dict[str, Any]] = json.loads(self.node.nvml_state.read_text())["history"]
        return history


@asynccontextmanager
async def node_scenario(node: RealNode, api: client.ApiClient, namespace: str) -> AsyncIterator[NodeScenario]:
    """A test's scenario on ``node``; afterwards its pods are deleted and waited for, so the kubelet has
    finished each (unprepared its claims) before the next test books the GPU again."""
    s = NodeScenario(api, namespace, node)
    yield s
    for p in (await s.k.core.list_namespaced_pod(namespace)).items:
        await s.k.core.delete_namespaced_pod(p.metadata.name, namespace)

    async def gone() -> bool | None:
        return True if not (await s.k.core.list_namespaced_pod(namespace)).items else None

    await eventually(gone, "the test's pods gone", within_s=60, every_s=0.5)
