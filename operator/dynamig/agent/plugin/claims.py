"""ResourceClaims as the plugin sees them: read from the API, turned into typed values once, checked.

``parse_claim`` and ``devices_for_node`` are pure; ``ClaimReader`` reads claims through the API server
(``resource.k8s.io/v1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient


class ClaimError(Exception):
    """The claim cannot be prepared on this node; the message says why. Per claim."""


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it in NodePrepareResources / NodeUnprepareResources."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One entry of ``status.allocation.devices.results``."""

    request: str  # "gpu" or, for a firstAvailable subrequest, "gpu/small"
    driver: str
    pool: str
    device: str

    @property
    def base_request(self) -> str:
        """The request name without a subrequest suffix (what containers reference). Pure."""
        return self.request.split("/", 1)[0]


@dataclass(frozen=True, slots=True)
class Claim:
    namespace: str
    name: str
    uid: str
    allocated: bool
    devices: tuple[AllocatedDevice, ...]


def parse_claim(obj: dict[str, Any]) -> Claim:
    """A ResourceClaim JSON object (as the API returns it) as a typed value. Pure."""
    meta = obj.get("metadata") or {}
    allocation = (obj.get("status") or {}).get("allocation")
    results = ((allocation or {}).get("devices") or {}).get("results") or []
    devices = tuple(
        AllocatedDevice(
            request=str(r.get("request", "")),
            driver=str(r.get("driver", "")),
            pool=str(r.get("pool", "")),
            device=str(r.get("device", "")),
        )
        for r in results
    )
    return Claim(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        allocated=allocation is not None,
        devices=devices,
    )


def devices_for_node(ref: ClaimRef, claim: Claim, *, driver: str, node: str) -> tuple[AllocatedDevice, ...]:
    """This driver's devices of an allocated claim, checked to belong to this node. Pure.

    Raises ClaimError when the claim is not the one the kubelet means (UID), is not allocated, names none
    of this driver's devices, or names one from another node's pool.
    """
    if claim.uid != ref.uid:
        raise ClaimError(
            f"ResourceClaim {ref} has UID {claim.uid}, not {ref.uid}: it was deleted and re-created"
        )
    if not claim.allocated:
        raise ClaimError(f"ResourceClaim {ref} is not allocated")
    ours = tuple(d for d in claim.devices if d.driver == driver)
    if not ours:
        raise ClaimError(f"ResourceClaim {ref} has no device of driver {driver} in its allocation")
    foreign = [d for d in ours if d.pool != node]
    if foreign:
        names = ", ".join(f"{d.pool}/{d.device}" for d in foreign)
        raise ClaimError(
            f"ResourceClaim {ref} is allocated device(s) {names} of another node's pool; this is node {node}"
        )
    return ours


class ClaimReader:
    """Reads ResourceClaims from the API server. Side effects: API reads."""

    def __init__(self, api_client: ApiClient, *, timeout_s: float) -> None:
        self._api = api_client
        self._timeout_s = timeout_s

    async def read(self, ref: ClaimRef) -> Claim | None:
        """The claim, or None if it does not exist. Other API errors propagate (``ApiException``)."""
        from kubernetes_asyncio.client import ResourceV1Api
        from kubernetes_asyncio.client.exceptions import ApiException

        api = ResourceV1Api(self._api)
        try:
            obj = await api.read_namespaced_resource_claim(
                ref.name, ref.namespace, _request_timeout=self._timeout_s
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        # Back to the API's JSON shape (camelCase keys), which parse_claim takes.
        data: dict[str, Any] = self._api.sanitize_for_serialization(obj)
        return parse_claim(data)
