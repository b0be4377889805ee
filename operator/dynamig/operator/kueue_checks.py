"""The AdmissionCheck controller ``dynamig.io/mig-capacity`` (``dynamig.operator.capacity_check`` decides):
marks our AdmissionChecks Active and answers the workloads that wait on them. Side effects: Kueue's API.

It runs while Kueue's AdmissionCheck CRD exists (a Kopf daemon on that CRD, on the leading replica) and acts
only on AdmissionChecks whose ``spec.controllerName`` is ours: nothing changes for a cluster without Kueue,
or with Kueue and no such check. Each pass lists the checks, the Workloads and dynamig's GPUs; a workload's
check is set through a JSON patch that first tests the entry's name, so a list Kueue rewrote meanwhile makes
the patch fail (409/422) and the next pass reads it again. An Event on the Workload says each answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from dynamig import DRIVER_NAME
from dynamig.geometry.catalog import Catalog
from dynamig.kube.apicalls import is_transient, status_of
from dynamig.kube.policy import parse_policies
from dynamig.kube.times import now_rfc3339
from dynamig.operator.capacity_check import (
    CONTROLLER,
    Answer,
    CheckedWorkload,
    Room,
    State,
    answer,
    answered_lately,
    bound_pods,
    checked_workloads,
    recuttable,
    retry_after,
    unbound,
    unbound_asks,
)
from dynamig.operator.inventory import allocated_devices, parse_inventory
from dynamig.operator.kubeio import KubeIO

log = logging.getLogger(__name__)

KUEUE = ("kueue.x-k8s.io", "v1beta2")
CRD = "admissionchecks.kueue.x-k8s.io"
PASS_SECONDS = 2.0
EVENT_REASONS = {
    State.READY: "MigCapacityReady",
    State.RETRY: "MigCapacityRetry",
    State.REJECTED: "MigCapacityRejected",
}


class KueueChecks:
    """One per operator process; :meth:`run` is the daemon's body."""

    def __init__(self, kube: KubeIO, catalog: Catalog, wall: Callable[[], float]) -> None:
        self.kube = kube
        self.catalog = catalog
        self.wall = wall

    async def run(self, stopped: Any) -> None:
        log.info("Kueue's AdmissionCheck API is served: answering the checks of controller %s", CONTROLLER)
        while not stopped:
            try:
                await self.pass_once()
            except Exception as exc:
                # An API answer or an unreachable API server: the next pass reads everything again (a raise
                # would end the daemon until Kopf's backoff restarts it).
                if not (isinstance(exc, ApiException) or is_transient(exc)):
                    raise
                log.warning("%s: a pass failed (%s); trying again", CONTROLLER, status_of(exc) or repr(exc))
            await asyncio.sleep(PASS_SECONDS)

    async def pass_once(self) -> int:
        """Mark our checks Active, answer the workloads waiting on them; the answers written."""
        custom = self.kube.custom
        checks = [
            c
            for c in (await custom.list_cluster_custom_object(*KUEUE, "admissionchecks")).get("items") or []
            if (c.get("spec") or {}).get("controllerName") == CONTROLLER
        ]
        if not checks:
            return 0
        for c in checks:
            await self._mark_active(c)
        bounds = {c["metadata"]["name"]: retry_after(c) for c in checks}
        workloads = (await custom.list_cluster_custom_object(*KUEUE, "workloads")).get("items") or []
        checked = checked_workloads(workloads, bounds)
        if not any(c.state is State.PENDING and c.quota_reserved for c in checked):
            return 0
        now = self.wall()
        # Answered Ready lately and still admitted: of those, the ones whose pods are not all bound yet hold
        # the room of the pods not bound. Pods are read before the claims, so a pod seen bound has its
        # allocation counted (and only that).
        waiting = answered_lately(checked, now)
        bound: dict[str, dict[str, int]] = {}
        if waiting:
            pods: list[dict[str, Any]] = []
            for ns in sorted({c.namespace for c in waiting}):
                pods += await self.kube.list_pods_in(ns)
            bound = bound_pods(waiting, pods)
            waiting = unbound(waiting, bound)
        snap = await self.kube.snapshot()
        views = parse_inventory(snap.partitions, self.catalog, allocated_devices(snap.claims, DRIVER_NAME))
        labels = {str(n["metadata"]["name"]): dict(n["metadata"].get("labels") or {}) for n in snap.nodes}
        room = Room.of(views, labels, recut=recuttable(parse_policies(snap.policies), views, labels))
        for c in waiting:
            room.place_all(unbound_asks(c, bound.get(c.key, {})))
        written = 0
        for c in checked:
            if c.state is not State.PENDING or not c.quota_reserved:
                continue
            got = answer(c, room, now, bounds[c.check])
            if got.state is State.PENDING and got.message == c.message:
                continue
            if await self._write(c, got):
                written += 1
        return written

    async def _mark_active(self, check: dict[str, Any]) -> None:
        conditions = (check.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Active" and c.get("status") == "True" for c in conditions):
            return
        body = {
            "status": {
                "conditions": [
                    {
                        "type": "Active",
                        "status": "True",
                        "reason": "Active",
                        "message": f"dynamig answers this check ({CONTROLLER})",
                        "lastTransitionTime": now_rfc3339(),
                        "observedGeneration": check["metadata"].get("generation", 0),
                    }
                ]
            }
        }
        await self.kube.custom.patch_cluster_custom_object_status(
            *KUEUE,
            "admissionchecks",
            check["metadata"]["name"],
            body,
            _content_type="application/merge-patch+json",
        )
        log.info("AdmissionCheck %s marked Active (controller %s)", check["metadata"]["name"], CONTROLLER)

    async def _write(self, c: CheckedWorkload, got: Answer) -> bool:
        path = f"/status/admissionChecks/{c.index}"
        patch = [
            {"op": "test", "path": f"{path}/name", "value": c.check},
            {"op": "replace", "path": f"{path}/state", "value": got.state.value},
            {"op": "replace", "path": f"{path}/message", "value": got.message[:32768]},
        ]
        if got.state is not c.state:  # a message alone keeps the time the state began (Retry counts from it)
            patch.append({"op": "replace", "path": f"{path}/lastTransitionTime", "value": now_rfc3339()})
        try:
            await self.kube.custom.patch_namespaced_custom_object_status(
                *KUEUE, c.namespace, "workloads", c.name, patch, _content_type="application/json-patch+json"
            )
        except ApiException as exc:
            if exc.status in (404, 409, 422):  # gone, or its checks changed since the list: next pass
                log.info("workload %s: check %s not written (%s)", c.key, c.check, exc.status)
                return False
            raise
        log.info("workload %s: check %s %s: %s", c.key, c.check, got.state.value, got.message)
        reason = EVENT_REASONS.get(got.state)
        if reason is not None:
            ref = {
                "apiVersion": "/".join(KUEUE),
                "kind": "Workload",
                "name": c.name,
                "namespace": c.namespace,
                "uid": c.uid,
            }
            kind = "Normal" if got.state is State.READY else "Warning"
            await self.kube.post_event(ref, kind, reason, got.message, c.namespace)
        return True
