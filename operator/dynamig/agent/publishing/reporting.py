"""What the agent tells the cluster about its node: GpuPartitions created and their status, Events on
GpuPartitions, the Node and claims, and the metrics snapshot. Writes only; it decides nothing."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from dynamig.agent.bindings.uuidwatch import UuidChange
from dynamig.agent.kube.api import KubeApi
from dynamig.agent.metrics import AgentMetrics, GpuSample, InstanceSample
from dynamig.agent.nvml.device import GpuInfo, MigInstance
from dynamig.agent.publishing.gpu_status import GpuOutcome
from dynamig.kube.apicalls import status_of
from dynamig.kube.events import AGENT_COMPONENT, claim_ref, event_body, gpu_partition_ref
from dynamig.kube.gpupartition import (
    ConditionType,
    GpuPartition,
    GpuPartitionStatus,
    Reason,
    build_gpu_partition,
    parse_gpu_partition,
)
from dynamig.kube.names import GPU_INDEX_LABEL, NODE_LABEL, PRODUCT_LABEL, gpu_partition_name
from dynamig.kube.times import now_rfc3339

log = logging.getLogger(__name__)


class NodeReporter:
    """Writes for one node's agent. Remembers only which node-wide problems it already told."""

    def __init__(self, api: KubeApi, metrics: AgentMetrics, node: str, events_namespace: str) -> None:
        self.api = api
        self.metrics = metrics
        self.node = node
        self.events_namespace = events_namespace
        self.node_owner: dict[str, Any] | None = None  # ownerReference to the Node for what we create
        self._node_problems: dict[str, str] = {}  # Event reason -> node-wide problem already told
        # (name, uid) -> the status last written and the resourceVersion the write made
        self._written: dict[tuple[str, str], tuple[int, GpuPartitionStatus]] = {}

    async def create_partition(self, gpu: GpuInfo, instances: Sequence[MigInstance]) -> GpuPartition:
        """Create the GpuPartition with the layout that exists now as its spec (adopt, destroy nothing)."""
        name = gpu_partition_name(self.node, gpu.index)
        labels = {NODE_LABEL: self.node, GPU_INDEX_LABEL: str(gpu.index)}
        if gpu.model is not None:
            labels[PRODUCT_LABEL] = gpu.model.key
        adopted = [i.placed for i in instances if i.has_compute_instance and not i.partitioned]
        body = build_gpu_partition(name, labels, adopted)
        if self.node_owner is not None:
            body["metadata"]["ownerReferences"] = [dict(self.node_owner)]
        try:
            created = await self.api.create_partition(body)
        except Exception as exc:
            if status_of(exc) != 409:
                raise
            got = await self.api.get_partition(name)
            if got is None:
                raise
            created = got
        log.info("created GpuPartition %s adopting %d instance(s)", name, len(instances))
        return parse_gpu_partition(created)

    def freshest(self, part: GpuPartition) -> GpuPartition:
        """``part``, or, when it is older than this agent's last status write (a watched copy a moment
        behind), with the status written: comparing with the older one would write it, and post its Events,
        twice. A copy as new as the write or newer wins (it may hold the operator's conditions too)."""
        written = self._written.get((part.name, part.metadata.uid))
        seen = _version(part.metadata.resource_version)
        if written is None or seen is None or seen >= written[0]:
            return part
        return part.model_copy(update={"status": written[1]})

    async def write_status(self, name: str, status: GpuPartitionStatus, uid: str = "") -> None:
        try:
            stored = await self.api.patch_partition_status(name, status.to_api())
        except Exception as exc:
            if status_of(exc) == 404:
                log.warning("GpuPartition %s vanished; it is recreated next round", name)
                self._written.pop((name, uid), None)
                return
            raise
        version = _version(str((stored.get("metadata") or {}).get("resourceVersion", "")))
        if uid and version is not None:
            self._written[(name, uid)] = (version, status)

    async def post_events(self, part: GpuPartition, o: GpuOutcome) -> None:
        """Events on the GpuPartition, where `kubectl describe` shows them: what was cut or destroyed this
        round, and each change of its Ready condition (a refused layout, a busy instance, a lost GPU, MIG
        disabled, an NVML error, and the way back to LayoutApplied)."""
        events = list(o.events)
        before = part.status.condition(ConditionType.READY)
        after = o.status.condition(ConditionType.READY) if o.status is not None else None
        if after is not None and (
            before is None or (before.status, before.reason) != (after.status, after.reason)
        ):
            calm = after.is_true or after.reason in (Reason.RESHAPING, Reason.DRAINING)
            events.append(("Normal" if calm else "Warning", after.reason, after.message))
        ref = gpu_partition_ref(o.name, part.metadata.uid)
        for kind, reason, message in events:
            await self._event(ref, kind, reason, message, self.events_namespace)

    async def tell_node(self, uid: str, reason: str, problem: str | None) -> None:
        """Node-wide states on the Node, where `kubectl describe node` shows them: a Warning when one starts
        or changes, a Normal ``<reason>Resolved`` when it ends. Each change once."""
        before = self._node_problems.get(reason)
        if problem == before:
            return
        if problem is None:
            self._node_problems.pop(reason, None)
            kind, why, text = "Normal", f"{reason}Resolved", f"resolved: {before}"
        else:
            self._node_problems[reason] = problem
            kind, why, text = "Warning", reason, problem
        log.log(logging.WARNING if problem else logging.INFO, "node %s: %s", self.node, text)
        ref = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid}
        await self._event(ref, kind, why, text, self.events_namespace)

    async def tell_holders(
        self, changes: Sequence[UuidChange], raw_claims: Sequence[Mapping[str, Any]]
    ) -> None:
        """The claims whose instance changed behind the agent's back get the Event too: their owners look at
        `kubectl describe resourceclaim`, not at GpuPartitions."""
        if not changes:
            return
        uids = {
            f"{m.get('namespace', '')}/{m.get('name', '')}": str(m.get("uid", ""))
            for m in (c.get("metadata") or {} for c in raw_claims)
        }
        for change in changes:
            for holder in change.holders:
                namespace, name = holder.split("/", 1)
                ref = claim_ref(namespace, name, uids.get(holder))
                await self._event(ref, "Warning", change.reason, change.message(), namespace)

    async def _event(self, ref: dict[str, Any], kind: str, reason: str, message: str, namespace: str) -> None:
        body = event_body(
            ref, kind, reason, message, namespace, AGENT_COMPONENT, now_rfc3339(), instance=self.node
        )
        await self.api.post_event(body)

    def export(self, outcomes: Sequence[GpuOutcome], pods: Mapping[str, Sequence[str]]) -> None:
        """The metrics snapshot of every GPU and instance, with the pods each claim is reserved for."""
        samples: list[InstanceSample] = []
        gpus: list[GpuSample] = []
        for o in outcomes:
            st = o.status
            if st is None:
                continue
            whole = str(st.whole_gpu.state) if st.whole_gpu is not None else ""
            gpus.append(GpuSample(st.gpu_index or 0, st.uuid, str(st.phase or ""), str(st.mig_mode), whole))
            for i in st.instances:
                samples.append(
                    InstanceSample(
                        gpu_index=st.gpu_index or 0,
                        gpu_uuid=st.uuid,
                        profile=i.profile,
                        gi_id=i.gpu_instance_id or 0,
                        mig_uuid=i.mig_uuid,
                        device=i.device_name,
                        state=str(i.state),
                        claims=tuple((c, pod) for c in i.claims for pod in pods.get(c) or [""]),
                    )
                )
        self.metrics.snapshot(tuple(samples), tuple(gpus))


def _version(resource_version: str) -> int | None:
    """A resourceVersion as a number to order copies of one object by (etcd's revision), None when it is not
    one (then the copy is taken as it is)."""
    return int(resource_version) if resource_version.isdigit() else None
