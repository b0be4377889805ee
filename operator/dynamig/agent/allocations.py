"""Answers allocations of this node's devices that wait on binding conditions. Side effects: NVML, API.

For each allocation with no answer yet (:func:`dynamig.kube.answers.unanswered`) the agent observes its
GPUs afresh, decides (:func:`dynamig.agent.binding.decide`), carries out a cut (destroy the free instances
in the way, create the instance at its placement) and writes the answer into the claim's
``status.devices[]``. It runs inside the agent's round, under the agent's lock, so no reshape of its own
runs at the same time; a crash before the status write leaves the allocation unanswered and the next
round answers it once (a cut that already happened is then simply ready).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

from dynamig.agent.binding import Cut, Failed, GpuState, Ready, decide, device_status, locate
from dynamig.agent.kubeapi import KubeApi, allocated_devices
from dynamig.agent.metrics import AgentMetrics
from dynamig.agent.nvml_device import GpuInfo, NvmlDevices
from dynamig.agent.reconcile import observe
from dynamig.geometry.model import device_name
from dynamig.kube.answers import Pending, data_entry, unanswered, unreported
from dynamig.kube.events import AGENT_COMPONENT, claim_ref, event_body
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY
from dynamig.kube.times import now_rfc3339

log = logging.getLogger(__name__)

REASON_GPU_UNAVAILABLE = "GpuUnavailable"


class AllocationAnswerer:
    """Answers the binding conditions of one node's (pool ``node`` of ``driver``) allocated devices.
    ``prepared``: the device names the kubelet plugin prepared, shared with the agent (read, not kept)."""

    def __init__(
        self,
        driver: str,
        node: str,
        api: KubeApi,
        devices: NvmlDevices,
        metrics: AgentMetrics,
        prepared: Collection[str],
    ) -> None:
        self.driver, self.node = driver, node
        self.api, self.devices, self.metrics = api, devices, metrics
        self.prepared = prepared

    async def answer_all(
        self, claims: list[dict[str, Any]], unavailable: str | None = None
    ) -> list[tuple[Pending, Ready | Failed]]:
        """Answer every unanswered allocation in ``claims``: ``failed`` with ``unavailable`` as the reason
        when the node's GPUs cannot be read (the pod is booked again elsewhere instead of waiting for the
        scheduler's binding timeout). Call under the agent's lock. Returns the answers written."""
        written: list[tuple[Pending, Ready | Failed]] = []
        for p in unanswered(claims, self.driver, self.node, BINDING_READY, BINDING_FAILED):
            answer = await self._answer(p, claims, unavailable)
            entry = device_status(
                self.driver,
                self.node,
                p.device,
                answer,
                BINDING_READY,
                BINDING_FAILED,
                now_rfc3339(),
                p.generation,
            )
            if not await self.api.put_device_status(p.namespace, p.name, entry):
                log.info("claim %s no longer allocates %s; nothing to answer", p.claim, p.device)
                continue
            written.append((p, answer))
            if isinstance(answer, Ready):
                log.info("allocation of %s to %s: ready (%s)", p.device, p.claim, answer.mig_uuid)
                event = ("Normal", "AllocationReady", f"{p.device} on node {self.node} is {answer.mig_uuid}")
            else:
                log.warning(
                    "allocation of %s to %s failed: %s: %s", p.device, p.claim, answer.reason, answer.message
                )
                why = f"{p.device} on node {self.node}: {answer.reason}: {answer.message}"
                event = ("Warning", "AllocationFailed", f"{why}; the scheduler books again")
            # On the claim, where `kubectl describe resourceclaim` shows what its pod got or why it waits.
            ref = claim_ref(p.namespace, p.name, p.uid)
            await self.api.post_event(
                event_body(ref, *event, p.namespace, AGENT_COMPONENT, now_rfc3339(), self.node)
            )
        return written

    async def report_bound(self, claims: list[dict[str, Any]]) -> int:
        """Write the MIG UUID of each instance booked without binding conditions (its pod bound in the
        scheduling cycle) into its claim's ``status.devices[].data``, as a ready answer carries it, so
        ``kubectl get resourceclaim -o yaml`` shows what the pod got. After the fact: nothing waits on it.
        Call under the agent's lock. Returns how many were written."""
        todo = unreported(claims, self.driver, self.node)
        if not todo:
            return 0
        _, states = await self._observe(claims)
        written = 0
        for p in todo:
            found = locate(p.device, states)
            uuid = found[0].mig_uuids.get(found[1], "") if found is not None else ""
            if found is None or not uuid:
                continue  # not a whole instance now: the kubelet plugin says so at prepare
            placed = found[1]
            data = {"migUUID": uuid, "profile": placed.profile, "placementStart": placed.start}
            entry = data_entry(self.driver, self.node, p.device, data)
            if await self.api.put_device_status(p.namespace, p.name, entry):
                written += 1
        return written

    async def _answer(
        self, p: Pending, claims: list[dict[str, Any]], unavailable: str | None
    ) -> Ready | Failed:
        """Decide, and cut when that is the answer; an NVML error on the way is a failed answer, never
        silence."""
        if unavailable is not None:
            return Failed(REASON_GPU_UNAVAILABLE, f"{p.device}: {unavailable}")
        devices = self.devices
        try:
            gpus, states = await self._observe(claims)
        except devices.error_type as exc:
            self.metrics.nvml_error("answer", devices.error_name(exc))
            return Failed(REASON_GPU_UNAVAILABLE, f"{p.device}: NVML cannot read the GPUs: {exc}")
        answer = decide(p.device, p.claim, states)
        return await self._cut(answer, gpus) if isinstance(answer, Cut) else answer

    async def _observe(self, claims: list[dict[str, Any]]) -> tuple[dict[int, GpuInfo], list[GpuState]]:
        gpus, _ = await asyncio.to_thread(self.devices.discover)
        holders = allocated_devices(claims, self.driver, self.node)
        states = []
        for gpu in gpus:
            instances = await asyncio.to_thread(self.devices.instances, gpu)
            uuids = {i.placed: i.mig_uuid for i in instances if i.whole is not None}
            states.append(
                GpuState(
                    gpu.index, gpu.model, gpu.mig_enabled, observe(instances, holders, self.prepared), uuids
                )
            )
        return {g.index: g for g in gpus}, states

    async def _cut(self, cut: Cut, gpus: dict[int, GpuInfo]) -> Ready | Failed:
        """Destroy what is in the way, then create; any NVML refusal fails the binding (nothing busy is
        destroyed: NVML's own in-use check stands behind the decision's)."""
        devices = self.devices
        gpu = gpus[cut.gpu_index]
        what = device_name(gpu.index, cut.create.profile, cut.create.start)
        try:
            for p in cut.destroy:
                await asyncio.to_thread(devices.destroy, gpu, p)
                self.metrics.operation("destroy", "success")
                log.info("destroyed free %s to cut %s", device_name(gpu.index, p.profile, p.start), what)
            made = await asyncio.to_thread(devices.create, gpu, cut.create)
            self.metrics.operation("create", "success")
        except devices.error_type as exc:
            err = devices.error_name(exc)
            self.metrics.nvml_error("cut", err)
            reason = "InstanceBusy" if devices.is_error(exc, "InUse") else "NvmlError"
            if devices.is_error(exc, "InsufficientResources"):
                reason = "PlacementTaken"
            return Failed(reason, f"{what}: NVML refused ({err}): {exc}")
        except ValueError as exc:  # e.g. a GPU instance split by someone else
            return Failed("PlacementTaken", f"{what}: {exc}")
        log.info("created %s for an allocation", what)
        return Ready(gpu.index, cut.create, made.mig_uuid)
