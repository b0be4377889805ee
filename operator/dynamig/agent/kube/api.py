"""The few Kubernetes API calls the node agent makes, with transient errors retried (tenacity, backoff).

Objects are exchanged as plain dicts (``CustomObjectsApi`` serves built-in groups such as
``resource.k8s.io`` too); typed parsing happens in the callers. Every method does network I/O.
A transient error is a 5xx or 429 from the API server, or a connection/timeout error; 4xx errors
(NotFound, Conflict, Invalid) are returned to the caller at once. No wait between two tries, here or in the
agent's loop and watches (:func:`backoff_delay`), grows past :data:`API_RETRY_MAX_S`: an API server that
comes back after an outage of any length is used again within seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from tenacity import (
    AsyncRetrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from dynamig.kube.apicalls import MERGE_PATCH, delete_slice, is_transient, patch_event, put_device_status
from dynamig.kube.events import EventCorrelator, deliver
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION

log = logging.getLogger(__name__)

T = TypeVar("T")

RESOURCE_GROUP = "resource.k8s.io"
RESOURCE_VERSION = "v1"

# The longest wait before the agent tries an API server that failed it (connection refused, a timeout, a 5xx
# or 429) again: waits double from a fraction of a second up to this and stay there while the API server is
# away, so the agent is back within this of its return, however long the outage.
API_RETRY_MAX_S = 2.0


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """Seconds to wait after ``failures`` (>= 1) failures in a row: ``base`` doubled for each, at most
    ``cap``. Pure."""
    return min(cap, base * 2.0 ** min(max(failures, 0), 64))  # bounded exponent: no overflow, ever


@dataclass(frozen=True)
class NodeFacts:
    labels: dict[str, str]
    uid: str
    allocatable: dict[str, str]


def node_facts(node: dict[str, Any]) -> NodeFacts:
    """A Node as the API serves it (JSON) -> its labels, uid and allocatable resources. Pure."""
    meta = node.get("metadata") or {}
    allocatable = dict((node.get("status") or {}).get("allocatable") or {})
    return NodeFacts(dict(meta.get("labels") or {}), str(meta.get("uid") or ""), allocatable)


class KubeApi:
    """Thin async wrapper over kubernetes-asyncio for the agent's objects."""

    def __init__(
        self, api_client: client.ApiClient, attempts: int = 6, max_wait_s: float = API_RETRY_MAX_S
    ) -> None:
        self.api_client = api_client
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.events = EventCorrelator()
        self._attempts = attempts
        self._max_wait = max_wait_s

    async def _retry(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        # Waits of 0.1, 0.2, 0.4, ... s (plus up to 0.1 s of jitter), none longer than max_wait_s.
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(is_transient),
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential_jitter(multiplier=0.1, max=self._max_wait, jitter=0.1),
            before_sleep=before_sleep_log(log, logging.WARNING),
            reraise=True,
        ):
            with attempt:
                return await call()
        raise AssertionError(f"unreachable: {what}")  # AsyncRetrying either returns or raises

    # --- nodes ---------------------------------------------------------------------------------------

    async def node_meta(self, name: str) -> NodeFacts | None:
        """The node's labels, uid and allocatable resources; None when the Node does not exist."""

        async def call() -> NodeFacts | None:
            try:
                node = await self.core.read_node(name)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            allocatable = dict((node.status.allocatable if node.status else None) or {})
            return NodeFacts(dict(node.metadata.labels or {}), str(node.metadata.uid or ""), allocatable)

        return await self._retry("read node", call)

    async def pods_binding_to(self, node: str) -> list[str]:
        """``namespace/name`` of the pods in a binding cycle toward ``node``: not bound yet, with
        ``status.nominatedNodeName`` = ``node`` (kube-scheduler writes it before Permit and PreBind)."""

        async def call() -> list[str]:
            pods = await self.core.list_pod_for_all_namespaces(
                field_selector=f"status.nominatedNodeName={node},spec.nodeName="
            )
            return sorted(f"{p.metadata.namespace}/{p.metadata.name}" for p in pods.items)

        return await self._retry("list pods binding to the node", call)

    # --- GpuPartitions -------------------------------------------------------------------------------

    async def list_partitions(self, label_selector: str) -> list[dict[str, Any]]:
        async def call() -> list[dict[str, Any]]:
            res = await self.custom.list_cluster_custom_object(
                GROUP, VERSION, GPU_PARTITION_PLURAL, label_selector=label_selector
            )
            return list(res.get("items", []))

        return await self._retry("list gpupartitions", call)

    async def get_partition(self, name: str) -> dict[str, Any] | None:
        async def call() -> dict[str, Any] | None:
            try:
                obj: dict[str, Any] = await self.custom.get_cluster_custom_object(
                    GROUP, VERSION, GPU_PARTITION_PLURAL, name
                )
                return obj
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        return await self._retry("get gpupartition", call)

    async def create_partition(self, body: dict[str, Any]) -> dict[str, Any]:
        async def call() -> dict[str, Any]:
            obj: dict[str, Any] = await self.custom.create_cluster_custom_object(
                GROUP, VERSION, GPU_PARTITION_PLURAL, body
            )
            return obj

        return await self._retry("create gpupartition", call)

    async def patch_partition_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        async def call() -> dict[str, Any]:
            obj: dict[str, Any] = await self.custom.patch_cluster_custom_object_status(
                GROUP, VERSION, GPU_PARTITION_PLURAL, name, {"status": status}, _content_type=MERGE_PATCH
            )
            return obj

        return await self._retry("patch gpupartition status", call)

    async def renew_lease(self, body: dict[str, Any]) -> None:
        """Write the agent's Lease (``dynamig.kube.heartbeat.lease_body``): patch its spec, and its owner
        when the body names one (a Lease written before the agent read its Node gets it then), create it when
        missing."""
        meta = body["metadata"]
        change: dict[str, Any] = {"spec": body["spec"]}
        if meta.get("ownerReferences"):
            change["metadata"] = {"ownerReferences": meta["ownerReferences"]}

        async def call() -> None:
            try:
                await self.coordination.patch_namespaced_lease(
                    meta["name"], meta["namespace"], change, _content_type=MERGE_PATCH
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                await self.coordination.create_namespaced_lease(meta["namespace"], body)

        await self._retry("renew lease", call)

    async def post_event(self, body: dict[str, Any]) -> None:
        """Post a core/v1 Event (see :func:`dynamig.kube.events.event_body`), or count a repeat on the earlier
        one. Errors are logged, not raised: an Event that cannot be posted must not stop the round."""
        namespace = body["metadata"]["namespace"]

        async def create(b: dict[str, Any]) -> object:
            return await self._retry("post event", lambda: self.core.create_namespaced_event(namespace, b))

        async def patch(name: str, change: dict[str, Any]) -> bool:
            return await patch_event(self.core, namespace, name, change)

        try:
            await deliver(self.events, body, create, patch)
        except (TimeoutError, ApiException, aiohttp.ClientError, ConnectionError) as exc:
            log.warning(
                "could not post event %s on %s: %s", body["reason"], body["involvedObject"]["name"], exc
            )

    async def delete_partition(self, name: str) -> None:
        async def call() -> None:
            try:
                await self.custom.delete_cluster_custom_object(GROUP, VERSION, GPU_PARTITION_PLURAL, name)
            except ApiException as exc:
                if exc.status != 404:
                    raise

        await self._retry("delete gpupartition", call)

    # --- ResourceSlices ------------------------------------------------------------------------------

    async def list_slices(self, node: str) -> list[dict[str, Any]]:
        """Every ResourceSlice on ``node``, of any driver."""

        async def call() -> list[dict[str, Any]]:
            res = await self.custom.list_cluster_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", field_selector=f"spec.nodeName={node}"
            )
            return list(res.get("items", []))

        return await self._retry("list resourceslices", call)

    async def create_slice(self, body: dict[str, Any]) -> None:
        await self._retry(
            "create resourceslice",
            lambda: self.custom.create_cluster_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", body
            ),
        )

    async def server_version(self) -> str:
        """The API server's ``gitVersion`` (``/version``), e.g. ``v1.37.2``."""

        async def call() -> str:
            info = await client.VersionApi(self.api_client).get_code()
            return str(info.git_version or "")

        return await self._retry("read /version", call)

    async def dry_run_create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create ``body`` as a server-side dry run (validated and defaulted, never stored); the answer."""

        async def call() -> dict[str, Any]:
            obj: dict[str, Any] = await self.custom.create_cluster_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", body, dry_run="All"
            )
            return obj

        return await self._retry("dry-run create resourceslice", call)

    async def replace_slice(self, name: str, body: dict[str, Any]) -> None:
        await self._retry(
            "replace resourceslice",
            lambda: self.custom.replace_cluster_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", name, body
            ),
        )

    async def delete_slice(self, name: str) -> None:
        """Delete a ResourceSlice; one already gone is fine."""
        await self._retry("delete resourceslice", lambda: delete_slice(self.custom, name))

    # --- ResourceClaims ------------------------------------------------------------------------------

    async def list_claims(self) -> list[dict[str, Any]]:
        """Every ResourceClaim in every namespace."""
        return (await self.list_claims_at())[0]

    async def list_claims_at(self) -> tuple[list[dict[str, Any]], str]:
        """Every ResourceClaim in every namespace, and the list's resourceVersion (to watch from)."""

        async def call() -> tuple[list[dict[str, Any]], str]:
            res = await self.custom.list_cluster_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, "resourceclaims"
            )
            return list(res.get("items", [])), str((res.get("metadata") or {}).get("resourceVersion", ""))

        return await self._retry("list resourceclaims", call)

    async def put_device_status(self, namespace: str, name: str, entry: dict[str, Any]) -> bool:
        """Set one ``status.devices[]`` entry of a claim (matched on driver, pool, device), keeping every
        other entry: read, replace with the read ``resourceVersion``, again on a conflict. Returns False
        when the claim is gone or no longer allocates that device (nothing to answer), or when the entry is
        answered already (the operator failed it while this agent was silent: that answer stands)."""
        answers = (BINDING_READY, BINDING_FAILED)
        return await self._retry(
            "write resourceclaim device status",
            lambda: put_device_status(self.custom, namespace, name, entry, answers),
        )


def claim_results(claim: Mapping[str, Any], driver: str, pool: str) -> list[Mapping[str, Any]]:
    """The allocation results of ``claim`` in ``driver``/``pool``. Pure."""
    alloc = (claim.get("status") or {}).get("allocation") or {}
    results = (alloc.get("devices") or {}).get("results") or []
    return [r for r in results if r.get("driver") == driver and r.get("pool") == pool]


def claim_ref(claim: Mapping[str, Any]) -> str:
    """``namespace/name`` of a claim. Pure."""
    meta = claim.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def allocated_devices(claims: list[dict[str, Any]], driver: str, pool: str) -> dict[str, list[str]]:
    """Device name -> ``namespace/name`` of claims whose allocation names it in ``driver``/``pool``. Pure."""
    out: dict[str, list[str]] = {}
    for claim in claims:
        for r in claim_results(claim, driver, pool):
            out.setdefault(str(r.get("device")), []).append(claim_ref(claim))
    return out
