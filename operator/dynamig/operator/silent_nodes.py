"""Nodes whose agent went silent: their GPUs reported, their devices withdrawn and tainted, their bookings
failed, and their bound pods that never started given back (the I/O around the decisions of
operator/fencing.py). One per operator process, driven by the reconciler's reading of the agents' Leases;
what it remembers lives in memory only (a restart tells and withdraws again, which is idempotent)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from kubernetes_asyncio.client.exceptions import ApiException

from dynamig import DRIVER_NAME
from dynamig.kube.events import gpu_partition_ref
from dynamig.kube.inventory import BINDING_FAILED, BINDING_READY
from dynamig.kube.pods import REASON_RESCHEDULED, REASON_STRANDED
from dynamig.kube.times import now_rfc3339
from dynamig.operator.fencing import (
    REASON_AGENT_SILENT,
    StrandedPod,
    disrupted,
    failed_answer,
    fences,
    taint_changes,
    taint_rule,
    taint_rule_name,
    to_give_back,
)
from dynamig.operator.inventory import GpuView
from dynamig.operator.kubeio import KubeIO, Snapshot
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.settings import OperatorSettings

log = logging.getLogger(__name__)


class SilentNodes:
    """Acts on the nodes whose agents the reconciler found silent."""

    def __init__(
        self,
        kube: KubeIO,
        metrics: OperatorMetrics,
        settings: OperatorSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube, self.metrics, self.settings, self.clock = kube, metrics, settings, clock
        self.reported: set[str] = set()  # GPUs already reported as having a silent agent
        self.fenced_since: dict[str, float] = {}  # fenced node -> when first fenced
        self.stranded: dict[str, str] = {}  # pod uid given back or told -> its fenced node
        self.tainted: set[str] | None = (
            None  # nodes whose DeviceTaintRule exists, as last listed (None: unknown)
        )
        self._taints_checked: tuple[float, bool] | None = None  # (monotonic time, DeviceTaintRules served)
        self._taints_listed = -float("inf")  # monotonic time the DeviceTaintRules were last listed

    async def report(self, silent: Mapping[str, str], gpus: Sequence[GpuView], snap: Snapshot) -> list[str]:
        """Once per GPU whose agent went silent: Ready becomes Unknown (reason AgentSilent) and a Warning
        Event says why its policy no longer waits for it; forgotten when the agent is back (it then writes
        Ready itself). Returns the GPUs reported this time (their layouts are no longer awaited)."""
        self.metrics.silent_agents.set(len(silent))
        reported = []
        raw = {p["metadata"]["name"]: p for p in snap.partitions}
        for g in gpus:
            if g.node not in silent:
                self.reported.discard(g.name)
                continue
            if g.name in self.reported:
                continue
            reason = silent[g.node]
            conditions = [
                c
                for c in ((raw.get(g.name) or {}).get("status") or {}).get("conditions") or []
                if c.get("type") != "Ready"
            ]
            conditions.append(
                {
                    "type": "Ready",
                    "status": "Unknown",
                    "reason": "AgentSilent",
                    "message": f"{reason}; its layout is not planned or awaited until it is back",
                    "lastTransitionTime": now_rfc3339(),
                    "observedGeneration": g.generation,
                }
            )
            await self.kube.patch_partition_conditions(g.name, conditions)
            self.reported.add(g.name)  # only once written: a failed patch is tried again next round
            uid = str(((raw.get(g.name) or {}).get("metadata") or {}).get("uid", ""))
            await self.kube.post_event(
                gpu_partition_ref(g.name, uid), "Warning", "AgentSilent",
                f"{reason}: {g.name} is left out of planning", self.settings.events_namespace,
            )  # fmt: skip
            reported.append(g.name)
            log.warning("%s: %s; left out of planning", g.name, reason)
        return reported

    async def fence(self, silent: Mapping[str, str], snap: Snapshot, agents: int) -> None:
        """A node whose agent went silent offers nothing and its waiting bookings fail, so no pod waits for
        an agent that cannot answer (operator/fencing.py). Each round while it stays silent, so a slice
        written meanwhile is withdrawn too; a refusal (RBAC) is logged and the round goes on. A booking its
        agent answered meanwhile keeps that answer (the write is refused, kube/apicalls.py).

        Every agent silent at once (more than one; ``agents``: the Leases of nodes that exist) is taken as
        the API server's or the network's doing, as kube-controller-manager stops evicting from a fully
        disrupted zone: right after an outage no agent has renewed yet, and withdrawing every node then would
        only churn. They are withdrawn once one renews.

        A node fenced for ``settings.stranded_after_seconds`` has its bound pods that never started given
        back (:meth:`_give_back_stranded`); the count starts again when its agent is back."""
        fenced = self.fenced_since
        if not silent or disrupted(silent, agents):
            fenced.clear()
            self.stranded.clear()
            if silent:
                log.warning(
                    "every agent (%d) is silent at once: taken as an API server or network disruption, not "
                    "as dead agents; no node is withdrawn until one of them renews its Lease",
                    len(silent),
                )
            await self._keep_taints()
            return
        now = self.clock()
        for node in [n for n in fenced if n not in silent]:
            del fenced[node]
        for node in silent:
            fenced.setdefault(node, now)
        tainted = await self._keep_taints()
        try:
            slices = [s for node in sorted(silent) for s in await self.kube.list_node_slices(node)]
            for fence in fences(silent, slices, snap.claims, DRIVER_NAME, BINDING_READY, BINDING_FAILED):
                if fence.empty:
                    continue
                for name in fence.slices:
                    await self.kube.delete_slice(name)
                    self.metrics.fenced.labels(action="slice-withdrawn").inc()
                failed = []
                for booking in fence.bookings:
                    entry = failed_answer(fence, booking, DRIVER_NAME, BINDING_FAILED, now_rfc3339())
                    if await self.kube.put_device_status(booking.namespace, booking.name, entry):
                        self.metrics.fenced.labels(action="booking-failed").inc()
                        failed.append(booking.claim)
                text = (
                    f"{fence.why}: withdrew {len(fence.slices)} ResourceSlice(s) of {DRIVER_NAME}"
                    + (f" and failed the bookings of {', '.join(failed)}" if failed else "")
                    + (
                        f"; its devices are tainted NoSchedule (DeviceTaintRule "
                        f"{taint_rule_name(fence.node)})"
                        if fence.node in tainted
                        else ""
                    )
                    + "; the node is offered again when its agent is back"
                )
                log.warning("node %s: %s", fence.node, text)
                uid = next(
                    (
                        str(n["metadata"].get("uid", ""))
                        for n in snap.nodes
                        if n["metadata"]["name"] == fence.node
                    ),
                    "",
                )
                ref = {"apiVersion": "v1", "kind": "Node", "name": fence.node, "uid": uid}
                await self.kube.post_event(
                    ref, "Warning", REASON_AGENT_SILENT, text, self.settings.events_namespace
                )
        except ApiException as exc:
            log.warning(
                "could not withdraw the devices of silent agents' nodes: %s %s", exc.status, exc.reason
            )
        await self._give_back_stranded(silent, snap)

    async def _keep_taints(self) -> set[str]:
        """Where the API server serves DeviceTaintRules, one per fenced node (``NoSchedule`` on its devices of
        the driver, operator/fencing.py ``taint_rule``) and none for a node that is not: deleted when its
        agent is back. Listed again when the fenced nodes change and at least once a resync. Returns the
        nodes tainted. A refusal (RBAC) is logged and the round goes on."""
        fenced = set(self.fenced_since)
        if not await self._taints_served():
            return set()
        fresh = time.monotonic() - self._taints_listed < self.settings.resync_seconds
        if self.tainted == fenced and fresh:
            return fenced
        try:
            create, delete = taint_changes(fenced, await self.kube.list_taint_rules())
            for node in create:
                await self.kube.create_taint_rule(taint_rule(node, DRIVER_NAME, now_rfc3339()))
                log.warning(
                    "node %s: its devices of %s tainted NoSchedule while its agent is silent",
                    node,
                    DRIVER_NAME,
                )
            for name in delete:
                await self.kube.delete_taint_rule(name)
                log.info("DeviceTaintRule %s deleted: its node's agent is back", name)
        except ApiException as exc:
            log.warning("could not keep the DeviceTaintRules of fenced nodes: %s %s", exc.status, exc.reason)
            self.tainted = None
            return set()
        self.tainted = fenced
        self._taints_listed = time.monotonic()
        return fenced

    async def _taints_served(self) -> bool:
        """Whether the API server serves DeviceTaintRules, asked again every 5 minutes (an upgrade)."""
        if self._taints_checked is None or time.monotonic() - self._taints_checked[0] > 300:
            try:
                self._taints_checked = (time.monotonic(), await self.kube.serves_taint_rules())
            except ApiException as exc:
                log.warning("cannot tell whether DeviceTaintRules are served: %s %s", exc.status, exc.reason)
                return False
        return self._taints_checked[1]

    async def _give_back_stranded(self, silent: Mapping[str, str], snap: Snapshot) -> None:
        """Pods bound to a node fenced for ``settings.stranded_after_seconds`` through claims of its pool,
        that never started (operator/fencing.py ``to_give_back``): a Warning Event on each, once, and the
        ones a controller owns deleted (uid precondition, their own grace period) so that their controller
        creates them again and the scheduler books them on a node whose agent answers."""
        now = self.clock()
        fenced, told = self.fenced_since, self.stranded
        for uid in [u for u, node in told.items() if node not in fenced]:
            del told[uid]
        after = self.settings.stranded_after_seconds
        for pod in to_give_back(fenced, now, after, snap.pods, snap.claims, DRIVER_NAME):
            if pod.uid in told:
                continue
            told[pod.uid] = pod.node  # once: a refused delete (RBAC) is not tried every round
            cause = (
                f"node {pod.node} was fenced {now - fenced[pod.node]:.0f}s ago ({silent.get(pod.node)}): the "
                f"device of claim {', '.join(pod.claims)} there cannot be prepared until its agent is back"
            )
            await self._give_back(pod, cause)

    async def _give_back(self, pod: StrandedPod, cause: str) -> None:
        ref = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod.name,
            "namespace": pod.namespace,
            "uid": pod.uid,
        }
        if pod.action != "delete":
            await self.kube.post_event(
                ref, "Warning", REASON_STRANDED, f"{cause}; {pod.detail}", pod.namespace
            )
            self.metrics.fenced.labels(action="pod-told").inc()
            log.warning("pod %s/%s: %s; %s", pod.namespace, pod.name, cause, pod.detail)
            return
        text = (
            f"{cause}; the pod never started, so it is deleted for its controller ({pod.detail}) to create "
            "it again and the scheduler to book it elsewhere"
        )
        await self.kube.post_event(ref, "Warning", REASON_RESCHEDULED, text, pod.namespace)
        try:
            deleted = await self.kube.delete_pod(pod.namespace, pod.name, pod.uid)
        except ApiException as exc:
            log.warning("could not delete pod %s/%s: %s %s", pod.namespace, pod.name, exc.status, exc.reason)
            return
        if deleted:
            self.metrics.fenced.labels(action="pod-deleted").inc()
            log.warning("pod %s/%s: %s", pod.namespace, pod.name, text)
