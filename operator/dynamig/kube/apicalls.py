"""What the agent and the operator share about talking to the API server: which errors are worth retrying,
the merge-patch content type, counting a repeated Event on its earlier copy, and answering a booking."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection, Mapping
from typing import Any

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

MERGE_PATCH = "application/merge-patch+json"


def is_transient(exc: BaseException) -> bool:
    """5xx/429 answers, connection errors and timeouts are worth retrying. Pure."""
    if isinstance(exc, ApiException):
        return exc.status is not None and (exc.status >= 500 or exc.status in (0, 429))
    return isinstance(exc, aiohttp.ClientError | asyncio.TimeoutError | ConnectionError)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an API error, else None. Pure."""
    return exc.status if isinstance(exc, ApiException) else None


async def patch_event(core: client.CoreV1Api, namespace: str, name: str, change: dict[str, Any]) -> bool:
    """Merge ``change`` (count, lastTimestamp) into Event ``name``; False when it is gone (expired)."""
    try:
        await core.patch_namespaced_event(name, namespace, change, _content_type=MERGE_PATCH)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


async def list_items(resp: Any) -> tuple[dict[str, Any], ...]:
    """The items of a LIST read with ``_preload_content=False`` (raw JSON, no model objects: much less CPU on
    big lists). kubernetes-asyncio checks the status only when it preloads, so it is checked here: a 403 or
    a 500 is an error, not an empty list."""
    body = await resp.read()
    if not 200 <= resp.status <= 299:
        exc = ApiException(status=resp.status, reason=resp.reason)
        exc.body = body
        raise exc
    return tuple(json.loads(body).get("items") or ())


async def delete_slice(custom: client.CustomObjectsApi, name: str) -> None:
    """Delete a ResourceSlice; one already gone is fine."""
    try:
        await custom.delete_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", name)
    except ApiException as exc:
        if exc.status != 404:
            raise


def answered(entry: Mapping[str, Any] | None, conditions: Collection[str]) -> bool:
    """Whether a ``status.devices[]`` entry already carries an answer: one of ``conditions`` (the binding
    condition and binding failure condition) True, as kube-scheduler reads it. Pure."""
    return any(
        c.get("type") in conditions and c.get("status") == "True"
        for c in (entry or {}).get("conditions") or []
    )


async def put_device_status(
    custom: client.CustomObjectsApi,
    namespace: str,
    name: str,
    entry: dict[str, Any],
    unless: Collection[str] = (),
) -> bool:
    """Set one ``status.devices[]`` entry of a ResourceClaim (matched on driver, pool, device), keeping every
    other entry: read, replace with the read ``resourceVersion``, again on a conflict. Returns False when the
    claim is gone or no longer allocates that device (nothing to answer), and, with ``unless`` (the binding
    condition types), when the entry already carries one of them True: the node's agent and the operator
    (failing the bookings of a silent agent) may answer the same booking at once, and the first answer
    stands; the other's replace meets a conflict and reads it."""
    key = (entry["driver"], entry["pool"], entry["device"])
    for _ in range(5):
        try:
            claim = await custom.get_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaims", name
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        status = claim.setdefault("status", {})
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        if not any((r.get("driver"), r.get("pool"), r.get("device")) == key for r in results):
            return False
        entries = status.get("devices") or []
        if unless and any(
            answered(e, unless) for e in entries if (e.get("driver"), e.get("pool"), e.get("device")) == key
        ):
            return False
        others = [e for e in entries if (e.get("driver"), e.get("pool"), e.get("device")) != key]
        status["devices"] = [*others, entry]
        try:
            await custom.replace_namespaced_custom_object_status(
                "resource.k8s.io", "v1", namespace, "resourceclaims", name, claim
            )
            return True
        except ApiException as exc:
            if exc.status != 409:
                raise
    raise RuntimeError(f"ResourceClaim {namespace}/{name}: status kept changing under us")
