"""The second half of the last line of defence: a pod bound to a device that cannot be prepared.

A pod the scheduler bound to a device whose memory slices a busy instance now holds (allocated from a slice
older than a retire, past the guard and the quarantine; docs/architecture.md) cannot get its device: the
kubelet's NodePrepareResources fails with ``PlacementTaken`` and is retried for as long as the pod exists.
Rather than leave it in ContainerCreating, once its prepare has kept failing so for
:data:`STRANDED_AFTER_S` the agent gives the pod back to its controller: a pod that a controller owns and
whose containers never started is deleted (with its uid as precondition), so the controller creates it
again and the scheduler books it afresh; the reason is posted as a Warning Event on the pod first. A pod no
controller owns is never deleted: it gets the Event, telling its owner to delete it. So a pod stranded this
way waits at most :data:`STRANDED_AFTER_S` plus the kubelet's retry interval.

:func:`~dynamig.kube.pods.verdict` (pure, shared with the operator) decides; :class:`StrandedPods` reads the
claim and its pods and acts (API).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.agent.kube.api import KubeApi
from dynamig.kube.events import AGENT_COMPONENT, event_body
from dynamig.kube.pods import REASON_RESCHEDULED, REASON_STRANDED, verdict
from dynamig.kube.times import now_rfc3339

log = logging.getLogger(__name__)

# How long a claim's prepare may keep failing with PlacementTaken before its pod is given back: long enough
# for the free-instance case to clear (a pod binding toward the node holds that for seconds) and for a busy
# instance that is about to be released, short enough that a user sees the pod rescheduled, not stuck.
STRANDED_AFTER_S = 60.0


@dataclass
class StrandedPods:
    """Counts how long each claim's prepare has failed with PlacementTaken and gives its pods back once that
    passes ``after_s`` (module docstring). Side effects: Events, pod deletions."""

    api: KubeApi
    node: str
    after_s: float = STRANDED_AFTER_S
    clock: Callable[[], float] = time.monotonic
    first_failed: dict[str, float] = field(default_factory=dict)  # claim uid -> first PlacementTaken

    def prepared(self, claim_uid: str) -> None:
        """The claim's prepare succeeded (or failed otherwise): its count starts again."""
        self.first_failed.pop(claim_uid, None)

    async def placement_taken(self, namespace: str, name: str, claim_uid: str, why: str) -> list[str]:
        """The claim's prepare failed with PlacementTaken (``why``); past ``after_s`` of such failures its
        pods on this node are given back. Returns the pods deleted."""
        now = self.clock()
        since = self.first_failed.setdefault(claim_uid, now)
        if now - since < self.after_s:
            return []
        try:
            claim = await client.ResourceV1Api(self.api.api_client).read_namespaced_resource_claim(
                name, namespace
            )
        except ApiException as exc:
            log.warning("cannot read claim %s/%s to give its pods back: %s", namespace, name, exc.reason)
            return []
        reserved = (claim.status.reserved_for if claim.status else None) or []
        cause = (
            f"device of claim {name} on node {self.node} cannot be prepared ({why}) for {now - since:.0f}s"
        )
        deleted = []
        for user in (r for r in reserved if r.resource == "pods"):
            if await self._give_back(namespace, user.name, user.uid, cause):
                deleted.append(f"{namespace}/{user.name}")
        return deleted

    async def _give_back(self, namespace: str, name: str, uid: str, cause: str) -> bool:
        """Event, and delete the pod when :func:`verdict` says so. True when it was deleted."""
        core = client.CoreV1Api(self.api.api_client)
        try:
            pod = self.api.api_client.sanitize_for_serialization(
                await core.read_namespaced_pod(name, namespace)
            )
        except ApiException as exc:
            if exc.status != 404:
                log.warning("cannot read pod %s/%s: %s", namespace, name, exc.reason)
            return False
        if str((pod.get("metadata") or {}).get("uid")) != uid:
            return False  # another pod of the same name: not the one the claim is reserved for
        action, detail = verdict(pod, self.node)
        if action == "leave":
            return False
        ref = {"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": namespace, "uid": uid}
        if action == "event":
            await self._event(ref, REASON_STRANDED, f"{cause}; {detail}")
            return False
        text = (
            f"{cause}; the pod never started, so it is deleted for its controller ({detail}) to create it "
            "again and the scheduler to book it afresh"
        )
        await self._event(ref, REASON_RESCHEDULED, text)
        try:
            await core.delete_namespaced_pod(
                name, namespace, body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning(
                    "could not delete stranded pod %s/%s: %s %s", namespace, name, exc.status, exc.reason
                )
            return False
        log.warning("pod %s/%s: %s", namespace, name, text)
        return True

    async def _event(self, ref: dict[str, Any], reason: str, text: str) -> None:
        namespace = str(ref["namespace"])
        body = event_body(ref, "Warning", reason, text, namespace, AGENT_COMPONENT, now_rfc3339(), self.node)
        await self.api.post_event(body)
