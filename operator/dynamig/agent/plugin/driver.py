"""The DRA driver behind the kubelet gRPC surface: prepare and unprepare claims, one answer per claim.

Prepare a claim: answer from the checkpoint if it is already prepared (the kubelet repeats calls, and a
restarted plugin must give the same answer); otherwise read the claim from the API, check it names this
driver's devices in this node's pool, make each MIG instance exist through ``MigInstances``, write the CDI
spec (on top of the node's base CDI spec from NVIDIA's toolkit, see ``cdi`` and ``cdi_base``), record the
claim in the checkpoint, answer the CDI device ids. A failure is reported for that claim only, never for the
batch.

Unprepare a claim: remove its CDI spec and checkpoint entry and tell ``MigInstances`` the instance is free
(it is not destroyed; the operator decides).

On start, claims in the checkpoint that no longer exist in the API (or exist with another UID) are
unprepared, and spec files no checkpoint entry accounts for are removed.

Calls are serialised with one lock: the kubelet sends few, small batches, and serial execution keeps the
checkpoint consistent without finer locking.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dynamig.agent.plugin import cdi
from dynamig.agent.plugin.cdi_base import BaseSpecError, load_base_spec
from dynamig.agent.plugin.cdi_validation import InvalidSpecError
from dynamig.agent.plugin.checkpoint import CheckpointStore, PreparedClaim, PreparedDevice
from dynamig.agent.plugin.claims import AllocatedDevice, Claim, ClaimError, ClaimRef, devices_for_node
from dynamig.agent.plugin.instances import InstanceError, MigInstances, PlacementTaken, PreparedInstance
from dynamig.agent.plugin.settings import PluginSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrepareResult:
    """The answer for one claim: its devices, or an error message (then devices are empty)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class ClaimSource(Protocol):
    """Where the driver reads claims from: ``ClaimReader`` (the API server)."""

    async def read(self, ref: ClaimRef) -> Claim | None:
        """The claim, or None if it does not exist."""
        ...


class StrandedClaims(Protocol):
    """Hears how each claim's prepare went, to give back the pods of one whose device stays unpreparable
    (``dynamig.agent.bindings.stranded.StrandedPods``)."""

    def prepared(self, claim_uid: str) -> None: ...

    async def placement_taken(self, namespace: str, name: str, claim_uid: str, why: str) -> list[str]: ...


class MigDriver:
    """Prepares and unprepares claims for one node. Side effects: NVML (through ``instances``), CDI specs,
    checkpoint file, API reads."""

    def __init__(
        self,
        settings: PluginSettings,
        instances: MigInstances,
        claims: ClaimSource,
        checkpoint: CheckpointStore,
        stranded: StrandedClaims | None = None,
    ) -> None:
        self._settings = settings
        self._stranded = stranded
        self._instances = instances
        self._claims = claims
        self._checkpoint = checkpoint
        self._prepared: dict[str, PreparedClaim] = {}
        self._lock = asyncio.Lock()

    @property
    def prepared(self) -> dict[str, PreparedClaim]:
        """A copy of the prepared claims by UID."""
        return dict(self._prepared)

    async def start(self) -> None:
        """Loads the checkpoint and drops claims that no longer exist. CheckpointError if it is corrupt."""
        async with self._lock:
            self._prepared = self._checkpoint.load()
            for uid, prepared in list(self._prepared.items()):
                ref = ClaimRef(prepared.namespace, prepared.name, uid)
                try:
                    claim = await self._claims.read(ref)
                except Exception as exc:
                    # Unknown is not gone: keep it and let the kubelet's unprepare clean it up later.
                    log.warning("cannot check claim %s (%s) at start, keeping it: %s", ref, uid, exc)
                    continue
                if claim is None or claim.uid != uid:
                    log.info("claim %s (%s) no longer exists; unpreparing it", ref, uid)
                    try:
                        await self._unprepare_locked(ref)
                    except Exception:
                        # Kept in the checkpoint: the next start (or the kubelet) tries again.
                        log.exception("unpreparing vanished claim %s (%s) failed; keeping it", ref, uid)
            for uid in cdi.spec_claim_uids(self._settings.cdi_root) - set(self._prepared):
                log.info("removing CDI spec of unknown claim %s", uid)
                cdi.remove_spec(self._settings.cdi_root, uid)
            self._instances.mark_prepared(
                d.device_name for claim in self._prepared.values() for d in claim.devices
            )

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """One result per claim UID. Never raises for a single claim's failure."""
        results: dict[str, PrepareResult] = {}
        async with self._lock:
            for ref in refs:
                try:
                    results[ref.uid] = PrepareResult(devices=await self._prepare_one(ref))
                    if self._stranded is not None:
                        self._stranded.prepared(ref.uid)
                except PlacementTaken as exc:
                    log.warning("prepare %s (%s) failed: %s", ref, ref.uid, exc)
                    results[ref.uid] = PrepareResult(error=str(exc))
                    if self._stranded is not None:
                        await self._stranded.placement_taken(ref.namespace, ref.name, ref.uid, str(exc))
                except (
                    ClaimError,
                    InstanceError,
                    cdi.CapabilityError,
                    BaseSpecError,
                    InvalidSpecError,
                ) as exc:
                    log.warning("prepare %s (%s) failed: %s", ref, ref.uid, exc)
                    results[ref.uid] = PrepareResult(error=str(exc))
                except Exception as exc:
                    log.exception("prepare %s (%s) failed unexpectedly", ref, ref.uid)
                    results[ref.uid] = PrepareResult(error=f"preparing {ref}: {type(exc).__name__}: {exc}")
        return results

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """An error message per claim UID; empty string for success. Never raises for a single claim."""
        results: dict[str, str] = {}
        async with self._lock:
            for ref in refs:
                try:
                    await self._unprepare_locked(ref)
                    results[ref.uid] = ""
                except Exception as exc:
                    log.exception("unprepare %s (%s) failed", ref, ref.uid)
                    results[ref.uid] = f"unpreparing {ref}: {type(exc).__name__}: {exc}"
        return results

    async def _prepare_one(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        known = self._prepared.get(ref.uid)
        if known is not None:
            stale = await self._stale_devices(known)
            if not stale:
                self._ensure_spec_file(known)
                return known.devices
            # The checkpoint names instances that are gone or were re-made (other GI/CI ids or MIG UUID):
            # its spec would hand the container the wrong device. Forget it and prepare afresh.
            log.warning("checkpoint of claim %s is stale (%s); preparing it again", ref, "; ".join(stale))
            for stale_dev in known.devices:  # its counts go: preparing it again counts each once more
                await self._instances.release(stale_dev.device_name)
            del self._prepared[ref.uid]
            cdi.remove_spec(self._settings.cdi_root, ref.uid)
            self._checkpoint.save(self._prepared)
        claim = await self._claims.read(ref)
        if claim is None:
            raise ClaimError(f"ResourceClaim {ref} does not exist")
        s = self._settings
        allocated = devices_for_node(ref, claim, driver=s.driver_name, node=s.node_name)

        ensured: list[str] = []
        try:
            instances: list[PreparedInstance] = []
            for dev in allocated:
                inst = await self._instances.ensure(dev.device)
                ensured.append(dev.device)
                instances.append(inst)
            devices, spec = self._build(ref.uid, allocated, instances)
            cdi.write_spec(self._settings.cdi_root, ref.uid, spec)
            prepared = PreparedClaim(uid=ref.uid, namespace=ref.namespace, name=ref.name, devices=devices)
            self._prepared[ref.uid] = prepared
            try:
                self._checkpoint.save(self._prepared)
            except BaseException:
                del self._prepared[ref.uid]
                cdi.remove_spec(self._settings.cdi_root, ref.uid)
                raise
        except BaseException:
            # Nothing is left half-prepared: the instances stay (they are never destroyed here) but are
            # reported free again.
            for name in ensured:
                try:
                    await self._instances.release(name)
                except Exception:
                    log.exception("releasing %s after a failed prepare of %s", name, ref)
            raise
        return devices

    async def _stale_devices(self, prepared: PreparedClaim) -> list[str]:
        """Why each checkpointed device no longer is the instance NVML has at its placement (empty: all
        still are). Reads only."""
        out = []
        for d in prepared.devices:
            now = await self._instances.lookup(d.device_name)
            was = d.instance
            if now is None:
                out.append(f"{d.device_name} no longer exists")
            elif (now.gi_id, now.ci_id, now.mig_uuid) != (was.gi_id, was.ci_id, was.mig_uuid):
                out.append(
                    f"{d.device_name} is now GI {now.gi_id}/CI {now.ci_id} {now.mig_uuid}, "
                    f"was GI {was.gi_id}/CI {was.ci_id} {was.mig_uuid}"
                )
        return out

    def _build(
        self,
        claim_uid: str,
        allocated: Sequence[AllocatedDevice],
        instances: Sequence[PreparedInstance],
    ) -> tuple[tuple[PreparedDevice, ...], dict[str, Any]]:
        pairs = list(zip(allocated, instances, strict=True))
        uuids_by_request: dict[str, list[str]] = {}
        for d, i in pairs:  # per request and kind: MIG UUIDs and whole GPUs' UUIDs go in separate variables
            key = f"{d.base_request}/{i.whole_gpu}"
            uuids_by_request.setdefault(key, []).append(i.parent_uuid if i.whole_gpu else i.mig_uuid)
        cdi_devices: list[cdi.CdiDevice] = []
        prepared: list[PreparedDevice] = []
        s = self._settings
        # Read at every prepare: a base spec regenerated after a driver upgrade is used at once.
        base = load_base_spec(s.base_spec_path, allow_missing=s.allow_missing_base_spec)
        for d, inst in pairs:
            minors = cdi.read_capability_minors(s.proc_root, inst)
            try:
                created = cdi.create_capability_nodes(s.dev_root, s.proc_root, minors)
                for node in created:
                    log.info("created capability device node %s for %s", node, d.device)
                cdi.record_created_nodes(s.device_node_ledger, created)
            except OSError as exc:
                raise InstanceError(f"device {d.device}: cannot create its nvidia-caps node: {exc}") from exc
            nodes = cdi.device_nodes(inst, minors) + (cdi.CONTROL_NODES if base is None else ())
            missing = cdi.missing_device_nodes(s.dev_root, nodes)
            if missing:
                raise InstanceError(
                    f"device {d.device} ({inst.mig_uuid or inst.parent_uuid}): device node(s) missing on the "
                    "node: " + ", ".join(str(p) for p in missing)
                )
            request_uuids = tuple(uuids_by_request[f"{d.base_request}/{inst.whole_gpu}"])
            cdi_devices.append(cdi.CdiDevice(inst, minors, request_uuids))
            prepared.append(
                PreparedDevice(
                    request_names=(d.base_request,),
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=(cdi.cdi_device_id(claim_uid, d.device),),
                    instance=inst,
                )
            )
        spec = cdi.build_spec(claim_uid, cdi_devices, s.dev_root, base)
        return tuple(prepared), spec

    def _ensure_spec_file(self, prepared: PreparedClaim) -> None:
        """Re-writes a prepared claim's spec if it vanished (e.g. ``/var/run/cdi`` is a tmpfs)."""
        if cdi.spec_path(self._settings.cdi_root, prepared.uid).exists():
            return
        uuids_by_request: dict[str, list[str]] = {}
        for d in prepared.devices:
            for r in d.request_names:
                uuids_by_request.setdefault(r, []).append(d.instance.mig_uuid)
        devs = [
            cdi.CdiDevice(
                d.instance,
                cdi.read_capability_minors(self._settings.proc_root, d.instance),
                tuple(u for r in d.request_names for u in uuids_by_request[r]),
            )
            for d in prepared.devices
        ]
        s = self._settings
        base = load_base_spec(s.base_spec_path, allow_missing=s.allow_missing_base_spec)
        cdi.write_spec(s.cdi_root, prepared.uid, cdi.build_spec(prepared.uid, devs, s.dev_root, base))

    async def _unprepare_locked(self, ref: ClaimRef) -> None:
        # Release first: if it fails the entry stays, the kubelet retries, and the release is not lost.
        prepared = self._prepared.get(ref.uid)
        if prepared is not None:
            for dev in prepared.devices:
                await self._instances.release(dev.device_name)
        cdi.remove_spec(self._settings.cdi_root, ref.uid)
        if prepared is not None:
            del self._prepared[ref.uid]
            self._checkpoint.save(self._prepared)
