"""The operator's Kubernetes I/O: read a snapshot, write GpuPartition specs and policy status, post Events.

Every function here does network I/O through ``kubernetes_asyncio`` and exchanges plain dicts (typed parsing
happens in the pure modules). Transient API errors (5xx, 429, connection errors) are retried with tenacity.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from dynamig.kube.apicalls import (
    MERGE_PATCH,
    delete_slice,
    is_transient,
    list_items,
    patch_event,
    put_device_status,
)
from dynamig.kube.events import OPERATOR_COMPONENT, EventCorrelator, deliver, event_body
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, NODE_LABEL, POLICY_PLURAL, VERSION
from dynamig.kube.times import now_rfc3339
from dynamig.operator.extended import ClassChanges
from dynamig.operator.fencing import FENCE_AGENT_SILENT, FENCE_LABEL

log = logging.getLogger(__name__)
T = TypeVar("T")

RESOURCE_GROUP = "resource.k8s.io"
RESOURCE_VERSION = "v1"
TAINT_RULES = "devicetaintrules"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one planning round reads, as raw API dicts."""

    policies: tuple[dict[str, Any], ...]
    partitions: tuple[dict[str, Any], ...]
    nodes: tuple[dict[str, Any], ...]
    pods: tuple[dict[str, Any], ...]
    claims: tuple[dict[str, Any], ...]
    device_classes: tuple[dict[str, Any], ...]
    leases: tuple[dict[str, Any], ...] = ()  # the agents' heartbeat Leases (dynamig.kube.heartbeat)


@dataclass(frozen=True, slots=True)
class EvictResult:
    outcome: str  # "evicted" | "gone" (no such pod, or another pod by that name) | "refused" (429)
    message: str = ""


def _server_trouble(exc: BaseException) -> bool:
    """Worth another try of an eviction: 5xx and connection errors, not a budget's 429. Pure."""
    return is_transient(exc) and not (isinstance(exc, ApiException) and exc.status == 429)


def _api_message(exc: ApiException) -> str:
    """The Status message of an API error, or its reason. Pure."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        body = {}
    return str(body.get("message") or exc.reason or exc.status)


class KubeIO:
    """The operator's API calls. One instance per operator, built from one ApiClient."""

    def __init__(self, api_client: client.ApiClient, attempts: int = 5) -> None:
        self.api_client = api_client
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.events = EventCorrelator()
        self._attempts = attempts

    async def _retry(
        self, call: Callable[[], Awaitable[T]], retry_on: Callable[[BaseException], bool] = is_transient
    ) -> T:
        # Waits of 0.1, 0.2, 0.4, ... s plus up to 1 s of jitter, none longer than 2 s: a call in flight when
        # the API server returns goes through within 2 s. Once the attempts are spent the error reaches the
        # policy loop, whose retries are capped alike (Reconciler.run_policy).
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(retry_on),
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential_jitter(multiplier=0.1, max=2.0),
            reraise=True,
        ):
            with attempt:
                return await call()
        raise AssertionError("unreachable")

    async def _list_custom(self, group: str, version: str, plural: str) -> tuple[dict[str, Any], ...]:
        async def call() -> tuple[dict[str, Any], ...]:
            body = await self.custom.list_cluster_custom_object(group, version, plural)
            return tuple(body.get("items") or ())

        return await self._retry(call)

    async def _list_core(self, what: str, **kwargs: Any) -> tuple[dict[str, Any], ...]:
        async def call() -> tuple[dict[str, Any], ...]:
            method = getattr(self.core, what)
            return await list_items(await method(_preload_content=False, **kwargs))

        return await self._retry(call)

    async def _list_leases(self, namespace: str) -> tuple[dict[str, Any], ...]:
        async def call() -> tuple[dict[str, Any], ...]:
            resp = await self.coordination.list_namespaced_lease(
                namespace, label_selector=NODE_LABEL, _preload_content=False
            )
            return await list_items(resp)

        try:
            return await self._retry(call)
        except ApiException as exc:  # not allowed to read them: no agent is judged silent
            log.warning("cannot list agent leases in namespace %s: %s", namespace, exc.reason)
            return ()

    async def snapshot(self, lease_namespace: str | None = None) -> Snapshot:
        """List everything a round needs, concurrently (the agents' Leases from ``lease_namespace``)."""

        async def no_leases() -> tuple[dict[str, Any], ...]:
            return ()

        leases_call = self._list_leases(lease_namespace) if lease_namespace else no_leases()
        policies, partitions, nodes, pods, claims, classes, leases = await asyncio.gather(
            self._list_custom(GROUP, VERSION, POLICY_PLURAL),
            self._list_custom(GROUP, VERSION, GPU_PARTITION_PLURAL),
            self._list_core("list_node"),
            self._list_core("list_pod_for_all_namespaces", field_selector="status.phase=Pending"),
            self._list_custom(RESOURCE_GROUP, RESOURCE_VERSION, "resourceclaims"),
            self._list_custom(RESOURCE_GROUP, RESOURCE_VERSION, "deviceclasses"),
            leases_call,
        )
        return Snapshot(policies, partitions, nodes, pods, claims, classes, leases)

    async def list_running_pods(self) -> tuple[dict[str, Any], ...]:
        """Every pod in phase Running (the snapshot has the Pending ones): preemption's possible victims."""
        return await self._list_core("list_pod_for_all_namespaces", field_selector="status.phase=Running")

    async def list_pods_in(self, namespace: str) -> tuple[dict[str, Any], ...]:
        """Every pod of ``namespace``, whatever its phase (the AdmissionCheck's Ready workloads' pods)."""
        return await self._list_core("list_namespaced_pod", namespace=namespace)

    async def list_namespace_labels(self) -> dict[str, dict[str, str]]:
        """Every namespace's labels, by name (preemption's ``namespaceSelector``)."""
        return {
            str(ns["metadata"]["name"]): dict(ns["metadata"].get("labels") or {})
            for ns in await self._list_core("list_namespace")
        }

    async def list_disruption_budgets(self) -> tuple[dict[str, Any], ...]:
        """Every PodDisruptionBudget (policy/v1)."""

        async def call() -> tuple[dict[str, Any], ...]:
            api = client.PolicyV1Api(self.api_client)
            return await list_items(
                await api.list_pod_disruption_budget_for_all_namespaces(_preload_content=False)
            )

        return await self._retry(call)

    async def list_node_slices(self, node: str) -> tuple[dict[str, Any], ...]:
        """The ResourceSlices of ``node`` (every driver)."""

        async def call() -> tuple[dict[str, Any], ...]:
            body = await self.custom.list_cluster_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", field_selector=f"spec.nodeName={node}"
            )
            return tuple(body.get("items") or ())

        return await self._retry(call)

    async def delete_slice(self, name: str) -> None:
        """Delete a ResourceSlice; one already gone is fine."""
        await self._retry(lambda: delete_slice(self.custom, name))

    async def serves_taint_rules(self) -> bool:
        """Whether the API server serves resource.k8s.io/v1 DeviceTaintRules (Kubernetes 1.37 on, by
        default; 1.36 serves them only as an off-by-default beta, 1.35 as alpha)."""

        async def call() -> bool:
            found = await client.ResourceV1Api(self.api_client).get_api_resources()
            return any(r.name == TAINT_RULES for r in found.resources or [])

        try:
            return await self._retry(call)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def list_taint_rules(self) -> tuple[dict[str, Any], ...]:
        """The DeviceTaintRules the operator keeps for fenced nodes (by their label)."""

        async def call() -> tuple[dict[str, Any], ...]:
            body = await self.custom.list_cluster_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, TAINT_RULES,
                label_selector=f"{FENCE_LABEL}={FENCE_AGENT_SILENT}",
            )  # fmt: skip
            return tuple(body.get("items") or ())

        return await self._retry(call)

    async def create_taint_rule(self, body: dict[str, Any]) -> None:
        """Create a DeviceTaintRule; one already there (another replica, an earlier round) is fine."""
        call = partial(
            self.custom.create_cluster_custom_object, RESOURCE_GROUP, RESOURCE_VERSION, TAINT_RULES
        )
        await self._tolerating(partial(call, body), 409)

    async def delete_taint_rule(self, name: str) -> None:
        """Delete a DeviceTaintRule; one already gone is fine."""
        call = partial(
            self.custom.delete_cluster_custom_object, RESOURCE_GROUP, RESOURCE_VERSION, TAINT_RULES
        )
        await self._tolerating(partial(call, name), 404)

    async def delete_pod(self, namespace: str, name: str, uid: str) -> bool:
        """Delete the pod ``namespace/name`` if it is still the one with ``uid`` (a precondition: a pod made
        again under the same name is not touched), with its own grace period. False when it is gone or is
        another pod."""

        async def call() -> None:
            options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
            await self.core.delete_namespaced_pod(name, namespace, body=options)

        try:
            await self._retry(call)
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    async def evict_pod(self, namespace: str, name: str, uid: str) -> EvictResult:
        """Evict the pod ``namespace/name`` through the ``policy/v1`` Eviction API, if it is still the one
        with ``uid``: PodDisruptionBudgets are enforced and the pod keeps its own grace period. A refusal
        (429: a budget allows no disruption now) is returned, not retried; 5xx and connection errors are
        retried with backoff, then raised. Never replaced by a plain delete."""
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": uid}} if uid else {},
        }

        async def call() -> None:
            await self.core.create_namespaced_pod_eviction(name, namespace, body)

        try:
            await self._retry(call, _server_trouble)
        except ApiException as exc:
            if exc.status in (404, 409):
                return EvictResult("gone")
            if exc.status == 429:
                return EvictResult("refused", _api_message(exc))
            raise
        return EvictResult("evicted")

    async def read_partition(self, name: str) -> dict[str, Any]:
        """One GpuPartition as the API server has it now."""

        async def call() -> dict[str, Any]:
            obj: dict[str, Any] = await self.custom.get_cluster_custom_object(
                GROUP, VERSION, GPU_PARTITION_PLURAL, name
            )
            return obj

        return await self._retry(call)

    async def write_holds(
        self, name: str, holds: list[dict[str, Any]], resource_version: str
    ) -> dict[str, Any]:
        """Replace a GpuPartition's ``spec.holds`` (merge patch; 409 when it changed since it was read)."""
        return await self.write_spec(name, {"holds": holds}, {}, resource_version)

    async def put_device_status(self, namespace: str, name: str, entry: dict[str, Any]) -> bool:
        """Answer a booking (``dynamig.kube.apicalls.put_device_status``); False when nothing is to answer,
        or when it is answered already (its agent's answer is never overwritten)."""
        answers = (BINDING_READY, BINDING_FAILED)
        return await self._retry(lambda: put_device_status(self.custom, namespace, name, entry, answers))

    async def write_spec(
        self,
        name: str,
        spec: Mapping[str, Any],
        annotations: Mapping[str, str],
        resource_version: str = "",
    ) -> dict[str, Any]:
        """Merge-patch fields of a GpuPartition's ``spec`` (``layout``, ``offeredProfiles``) and annotations.
        With ``resource_version`` the patch fails with 409 if the object changed since it was read."""
        meta: dict[str, Any] = {}
        if annotations:
            meta["annotations"] = dict(annotations)
        if resource_version:
            meta["resourceVersion"] = resource_version
        body: dict[str, Any] = {"spec": dict(spec)}
        if meta:
            body["metadata"] = meta

        async def call() -> dict[str, Any]:
            result: dict[str, Any] = await self.custom.patch_cluster_custom_object(
                GROUP, VERSION, GPU_PARTITION_PLURAL, name, body, _content_type=MERGE_PATCH
            )
            return result

        return await self._retry(call)

    async def write_layout(
        self,
        name: str,
        layout: list[dict[str, Any]],
        annotations: Mapping[str, str],
        resource_version: str = "",
    ) -> dict[str, Any]:
        """Merge-patch a GpuPartition's ``spec.layout`` (and annotations); see :meth:`write_spec`."""
        return await self.write_spec(name, {"layout": layout}, annotations, resource_version)

    async def patch_partition_conditions(self, name: str, conditions: list[dict[str, Any]]) -> None:
        """Replace a GpuPartition's ``status.conditions`` (the whole list, as read and edited)."""

        async def call() -> None:
            await self.custom.patch_cluster_custom_object_status(
                GROUP, VERSION, GPU_PARTITION_PLURAL, name, {"status": {"conditions": conditions}},
                _content_type=MERGE_PATCH,
            )  # fmt: skip

        try:
            await self._retry(call)
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def patch_policy_status(self, name: str, status: Mapping[str, Any]) -> None:
        async def call() -> None:
            await self.custom.patch_cluster_custom_object_status(
                GROUP, VERSION, POLICY_PLURAL, name, {"status": dict(status)}, _content_type=MERGE_PATCH
            )

        try:
            await self._retry(call)
        except ApiException as exc:
            if exc.status != 404:  # the policy was deleted meanwhile
                raise

    async def write_device_classes(self, changes: ClassChanges) -> None:
        """Create, replace and delete DeviceClasses (dynamig's profile classes). One already made or already
        gone is fine (another replica, a person), and so is one changed meanwhile: the next round sees it."""
        args = (RESOURCE_GROUP, RESOURCE_VERSION, "deviceclasses")
        for body in changes.create:
            await self._tolerating(partial(self.custom.create_cluster_custom_object, *args, body), 409)
        for body in changes.replace:
            name = body["metadata"]["name"]
            await self._tolerating(
                partial(self.custom.replace_cluster_custom_object, *args, name, body), 404, 409
            )
        for name in changes.delete:
            await self._tolerating(partial(self.custom.delete_cluster_custom_object, *args, name), 404)

    async def _tolerating(self, call: Callable[[], Awaitable[Any]], *statuses: int) -> None:
        try:
            await self._retry(call)
        except ApiException as exc:
            if exc.status not in statuses:
                raise

    async def post_event(
        self,
        involved: Mapping[str, Any],
        event_type: str,
        reason: str,
        message: str,
        namespace: str,
    ) -> None:
        """Post a core/v1 Event about ``involved`` (apiVersion, kind, name, namespace, uid), or count a repeat
        on the earlier one. Errors are logged, not raised: an Event that cannot be posted must not stop the
        round."""
        body = event_body(involved, event_type, reason, message, namespace, OPERATOR_COMPONENT, now_rfc3339())

        async def create(b: dict[str, Any]) -> object:
            return await self._retry(lambda: self.core.create_namespaced_event(namespace, b))

        async def patch(name: str, change: dict[str, Any]) -> bool:
            return await patch_event(self.core, namespace, name, change)

        try:
            await deliver(self.events, body, create, patch)
        except (TimeoutError, ApiException, aiohttp.ClientError) as exc:
            log.warning("could not post event %s on %s: %s", reason, involved.get("name"), exc)


def ref_of(obj: Mapping[str, Any], api_version: str, kind: str) -> dict[str, str]:
    """The involvedObject reference of an API object. Pure."""
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": str(meta.get("name", "")),
        "namespace": str(meta.get("namespace", "")),
        "uid": str(meta.get("uid", "")),
    }
