"""Dict-level shortcuts over the Kubernetes API for scenarios (the demo and the operator e2e test).

Side effects: every method talks to the API server it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.devcluster.waiting import eventually
from dynamig.kube.devices import device_class
from dynamig.kube.names import DEVICE_CLASS_NAME, GPU_PARTITION_PLURAL, GROUP, POLICY_PLURAL, VERSION

log = logging.getLogger(__name__)

PROFILE_ATTRIBUTE = f'device.attributes["{DEVICE_CLASS_NAME}"].profile'


def layout_text(layout: list[tuple[str, int]] | list[dict[str, Any]]) -> str:
    """``3g.40gb@0,3g.40gb@4`` for a layout given as (profile, start) pairs or API dicts. Pure."""
    items = sorted((e["start"], e["profile"]) if isinstance(e, dict) else (e[1], e[0]) for e in layout)
    return ",".join(f"{p}@{s}" for s, p in items)


def allocated_device(claim: dict[str, Any] | None) -> str | None:
    """The first device a claim's allocation names, or None while unallocated. Pure."""
    alloc = ((claim or {}).get("status") or {}).get("allocation")
    if not alloc:
        return None
    results = alloc["devices"]["results"]
    return str(results[0]["device"]) if results else None


def resource_claim(name: str, request: Mapping[str, Any]) -> dict[str, Any]:
    """A ResourceClaim (resource.k8s.io/v1) with one device request, named ``gpu``: ``request`` holds its
    ``exactly`` or ``firstAvailable`` (see :func:`exactly`, :func:`first_available`). Pure."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", **request}]}},
    }


def exactly(selector: str, count: int = 1) -> dict[str, Any]:
    """A request for exactly ``count`` devices of this driver's class matching the CEL ``selector``. Pure."""
    return {
        "exactly": {
            "deviceClassName": DEVICE_CLASS_NAME,
            "selectors": [{"cel": {"expression": selector}}],
            "allocationMode": "ExactCount",
            "count": count,
        }
    }


def first_available(profiles: Sequence[str]) -> list[dict[str, Any]]:
    """A device request's ``firstAvailable`` list: one sub-request ``c<i>`` per profile, in order. Pure."""
    return [
        {
            "name": f"c{i}",
            "deviceClassName": DEVICE_CLASS_NAME,
            "selectors": [{"cel": {"expression": f'{PROFILE_ATTRIBUTE} == "{p}"'}}],
        }
        for i, p in enumerate(profiles)
    ]


async def ensure_device_class(resource: client.ResourceV1Api) -> None:
    """Create the DeviceClass ``mig.dynamig.io`` unless it exists (409: another test or the chart made it).

    Side effect: one create call to the API server.
    """
    try:
        await resource.create_device_class(device_class())
    except ApiException as exc:
        if exc.status != 409:
            raise


def device_plugin_pod(
    name: str, node_selector: Mapping[str, str], resource: str = "nvidia.com/mig-1g.10gb", count: int = 1
) -> dict[str, Any]:
    """A Pod written for the NVIDIA device plugin: ``resource`` in its limits, no claim. Pure."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": dict(node_selector),
            "containers": [
                {
                    "name": "main",
                    "image": "example.invalid/app:1",
                    "resources": {"limits": {resource: str(count)}},
                }
            ],
        },
    }


def claim_pod(
    name: str,
    node_selector: Mapping[str, str],
    *,
    claim: str | None = None,
    template: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Pod whose one container uses one ResourceClaim: ``claim`` by name, or one made from ``template``.

    No kubelet runs it here; the scheduler allocates its claim and binds it. Pure.
    """
    source = {"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": template}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": {
            "nodeSelector": dict(node_selector),
            "resourceClaims": [{"name": "gpu", **source}],
            "containers": [
                {"name": "main", "image": "example.invalid/app:1", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
    }


def unplaceable_operator_pod(labels: Mapping[str, str]) -> dict[str, Any]:
    """A Pod labelled like the chart's operator pod that never runs (no node matches it), so it has no log
    and no metrics: what support tooling finds when the operator cannot be scheduled. Pure."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "dynamig-operator-x", "labels": dict(labels)},
        "spec": {
            "nodeSelector": {"no-such-label": "x"},
            "containers": [
                {"name": "main", "image": "example.invalid/app:1",
                 "ports": [{"name": "metrics", "containerPort": 8080}]}
            ],
        },
    }  # fmt: skip


class ScenarioApi:
    """The handful of API calls a scenario makes, in one namespace."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        pod_shape: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.resource = client.ResourceV1Api(api)
        self.scheduling = client.SchedulingV1Api(api)
        self.ns = namespace
        # Pods are bound, never run, unless a real node runs them: then this makes them runnable there.
        self.pod_shape = pod_shape

    async def ensure_device_class(self) -> None:
        await ensure_device_class(self.resource)

    async def partition(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = await self.custom.get_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL, name
        )
        return obj

    async def set_layout(self, name: str, layout: list[tuple[str, int]]) -> int:
        obj = await self.custom.patch_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL, name,
            {"spec": {"layout": [{"profile": p, "start": s} for p, s in layout]}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        return int(obj["metadata"]["generation"])

    async def stable(self, name: str, layout: str | None = None) -> dict[str, Any] | None:
        """The GpuPartition once its agent reported the current generation Stable (and ``layout``)."""
        try:
            part = await self.partition(name)
        except ApiException:
            return None
        st = part.get("status") or {}
        if st.get("phase") != "Stable" or st.get("observedGeneration") != part["metadata"]["generation"]:
            return None
        if layout is not None and layout_text(st.get("instances") or []) != layout:
            return None
        return part

    async def policy(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = await self.custom.get_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL, name)
        return obj

    async def create_policy(self, name: str, spec: dict[str, Any]) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "GpuPartitionPolicy",
            "metadata": {"name": name},
            "spec": spec,
        }
        await self.custom.create_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL, body)

    async def set_mode(self, name: str, mode: str) -> None:
        await self.custom.patch_cluster_custom_object(
            GROUP, VERSION, POLICY_PLURAL, name, {"spec": {"mode": mode}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip

    async def delete_policy(self, name: str) -> None:
        with contextlib.suppress(ApiException):
            await self.custom.delete_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL, name)

        async def gone() -> bool | None:
            try:
                await self.policy(name)
            except ApiException as exc:
                return True if exc.status == 404 else None
            return None

        await eventually(gone, f"policy {name} deleted", within_s=30)

    async def claim_template(self, name: str, alternatives: list[str]) -> None:
        """A ResourceClaimTemplate asking one device: the first of ``alternatives`` available."""
        claim = resource_claim(name, {"firstAvailable": first_available(alternatives)})
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {"spec": claim["spec"]},
        }
        await self.custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", self.ns, "resourceclaimtemplates", body
        )

    async def priority_classes(self, classes: Mapping[str, Mapping[str, Any]]) -> None:
        """PriorityClasses (cluster-wide) by name: their ``value`` and, when given, ``preemptionPolicy``."""
        for name, fields in classes.items():
            await self.scheduling.create_priority_class(
                {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
                 **fields}
            )  # fmt: skip

    async def delete_priority_classes(self, names: Iterable[str]) -> None:
        for name in names:
            with contextlib.suppress(ApiException):
                await self.scheduling.delete_priority_class(name)

    async def pod(
        self, name: str, template: str, node_selector: dict[str, str], priority_class: str | None = None
    ) -> None:
        body = claim_pod(name, node_selector, template=template, labels={"app": name.rsplit("-", 1)[0]})
        if priority_class is not None:
            body["spec"]["priorityClassName"] = priority_class
        await self.core.create_namespaced_pod(self.ns, self.pod_shape(body) if self.pod_shape else body)

    async def delete_pods(self, names: list[str]) -> None:
        """Delete: gracefully where a kubelet runs the pods, at once where none would finish a deletion."""
        grace = None if self.pod_shape else 0
        for n in names:
            with contextlib.suppress(ApiException):
                await self.core.delete_namespaced_pod(n, self.ns, grace_period_seconds=grace)

    async def node_of(self, pod: str) -> str | None:
        """The node ``pod`` is bound to, or None while it is not (for ``eventually``)."""
        got = await self.core.read_namespaced_pod(pod, self.ns)
        return got.spec.node_name or None

    async def all_bound(self, pods: Iterable[str]) -> bool | None:
        """True once every pod of ``pods`` is bound, else None (for ``eventually``)."""
        for p in pods:
            if await self.node_of(p) is None:
                return None
        return True

    async def published(self, node: str) -> dict[str, dict[str, Any]]:
        """Device name -> device of every ResourceSlice of ``node`` (any driver)."""
        res = await self.custom.list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
        )
        return {d["name"]: d for s in res["items"] for d in s["spec"].get("devices") or []}

    async def unschedulable(self, pod: str) -> bool | None:
        """True once the scheduler has marked ``pod`` Unschedulable, else None (for ``eventually``)."""
        got = await self.core.read_namespaced_pod(pod, self.ns)
        conds = (got.status.conditions if got.status else None) or []
        return True if any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in conds) else None

    async def claims(self) -> list[dict[str, Any]]:
        res = await self.custom.list_namespaced_custom_object(
            "resource.k8s.io", "v1", self.ns, "resourceclaims"
        )
        return list(res["items"])

    async def claim_of(self, pod: str) -> dict[str, Any] | None:
        for c in await self.claims():
            owners = c["metadata"].get("ownerReferences") or []
            if any(o.get("kind") == "Pod" and o.get("name") == pod for o in owners):
                return c
        return None

    async def events(self, name: str, namespace: str | None = None) -> list[dict[str, Any]]:
        resp = await self.core.list_namespaced_event(
            namespace or self.ns, field_selector=f"involvedObject.name={name}"
        )
        return [
            {"reason": e.reason, "message": e.message, "type": e.type, "kind": e.involved_object.kind}
            for e in resp.items
        ]


class AllocationWatch:
    """Polls the namespace's claims every 50 ms and keeps, per device, when it was seen allocated.

    Together with the simulated NVML's event history it answers "was an allocated instance ever destroyed?".
    """

    def __init__(self, scenario: ScenarioApi) -> None:
        self.scenario = scenario
        # (device, claim uid) -> [first, last] time seen allocated: a device name comes back when its place is
        # cut again for another claim, and the gap between the two is when the agent may destroy it.
        self.seen: dict[tuple[str, str], list[float]] = {}
        self.first_allocated: dict[str, float] = {}  # claim name -> first time seen allocated
        self.first_bound: dict[str, float] = {}  # pod name -> first time seen bound to a node
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            try:
                await self._poll()
            except (TimeoutError, ApiException, aiohttp.ClientError) as exc:
                # A slow or restarting API server must not end the watch: the next poll catches up.
                log.info("allocation watch: poll failed (%s); retrying", exc)
            await asyncio.sleep(0.05)

    async def _poll(self) -> None:
        now = time.time()
        for c in await self.scenario.claims():
            dev = allocated_device(c)
            if dev is None:
                continue
            span = self.seen.setdefault((dev, c["metadata"].get("uid", "")), [now, now])
            span[1] = now
            self.first_allocated.setdefault(c["metadata"]["name"], now)
        for pod in (await self.scenario.core.list_namespaced_pod(self.scenario.ns)).items:
            if pod.spec.node_name:
                self.first_bound.setdefault(pod.metadata.name, now)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="allocation-watch")

    async def seen_allocated(self, claims: Iterable[str], within_s: float = 30.0) -> dict[str, float]:
        """When the watch first saw each of ``claims`` allocated, once it has seen them all: its polls lag
        the API on a busy machine, so a claim read allocated directly may not be in :attr:`first_allocated`
        yet."""
        names = set(claims)

        async def seen() -> dict[str, float] | None:
            self.raise_if_stopped()
            got = {n: self.first_allocated[n] for n in names if n in self.first_allocated}
            return got if len(got) == len(names) else None

        what = f"the allocation watch to see {len(names)} claim(s) allocated"
        return await eventually(seen, what, within_s)

    def raise_if_stopped(self) -> None:
        """Raise what ended the watch early, so a wait on its figures fails with the cause, not a timeout."""
        if self._task is not None and self._task.done():
            self._task.result()
            raise RuntimeError("allocation watch stopped")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def destroyed_while_allocated(self, history: list[Any]) -> list[str]:
        """Destroy events (GI or CI) of a device that was allocated at that moment (50 ms margin)."""
        from dynamig.geometry.model import device_name

        bad = []
        for ev in history:
            if ev.kind not in ("destroy-gi", "destroy-ci") or ev.profile is None or ev.start is None:
                continue
            name = device_name(ev.gpu_index, ev.profile, ev.start)
            for (device, _), (first, last) in self.seen.items():
                if device == name and first - 0.05 <= ev.timestamp <= last + 0.05:
                    held = f"{first:.2f}-{last:.2f}"
                    bad.append(f"{name} destroyed at {ev.timestamp:.2f} while allocated {held}")
        return bad
