"""Prometheus metrics of one node agent, on a registry passed in (no module globals).

Names follow Prometheus conventions: ``dynamig_`` prefix, base units (seconds), ``_total`` counters, and a
``dynamig_build_info`` gauge. Per-instance series carry the DCGM exporter's labels for a MIG instance
(``gpu``, ``UUID`` of the parent GPU, ``GPU_I_PROFILE``, ``GPU_I_ID``, as its rendermetrics template writes
them); the DRA device is ``dra_device`` (DCGM's ``device`` is ``nvidia<N>``). ``Hostname`` is this agent's
node, not a join key: dcgm-exporter's host label is ``Hostname`` or ``hostname`` depending on its version,
holding ``$NODE_NAME`` or the exporter pod's name. ``dynamig_mig_instance_claim_info`` names the claim and pod
of each allocated instance, so :data:`DCGM_JOIN` attributes DCGM's per-instance utilisation to pods, which
the DCGM exporter cannot do for MIG devices created on the fly. Error counters are created at zero for this
node, so the first failure is a change an alert sees.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamig import __version__

# The labels a DCGM per-instance series and dynamig_mig_instance_claim_info share, whatever the exporter's
# version or host label, and the join that attributes a DCGM series to the pods holding the instance.
DCGM_JOIN_LABELS = ("UUID", "GPU_I_ID")
DCGM_JOIN = f"on({', '.join(DCGM_JOIN_LABELS)}) group_left(namespace, pod) dynamig_mig_instance_claim_info"


@dataclass(frozen=True, slots=True)
class InstanceSample:
    """One MIG instance as the metrics report it."""

    gpu_index: int
    gpu_uuid: str
    profile: str
    gi_id: int
    mig_uuid: str
    device: str
    state: str  # free | allocated | in-use
    claims: tuple[tuple[str, str], ...] = ()  # (namespace/claim, pod) holding the instance


@dataclass(frozen=True, slots=True)
class GpuSample:
    gpu_index: int
    gpu_uuid: str
    phase: str
    mig_mode: str = ""  # Enabled, Disabled, EnablePending, DisablePending
    whole_state: str = ""  # MIG mode off: the whole GPU's state (free, allocated, in-use); "" otherwise


class _SnapshotCollector(Collector):
    """Yields gauges from the latest snapshot, so vanished instances vanish from the output."""

    def __init__(self, hostname: str) -> None:
        self.hostname = hostname
        self.instances: tuple[InstanceSample, ...] = ()
        self.gpus: tuple[GpuSample, ...] = ()

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily("dynamig_build_info", "dynamig build information.", labels=["version"])
        build.add_metric([__version__], 1.0)
        yield build
        counts: dict[tuple[str, str, str], int] = {}
        dcgm = ["Hostname", "gpu", "UUID", "GPU_I_PROFILE", "GPU_I_ID"]
        info = GaugeMetricFamily(
            "dynamig_mig_instance_info",
            "One series per MIG instance; labels compatible with the DCGM exporter.",
            labels=[*dcgm, "mig_uuid", "dra_device", "state"],
        )
        claim_info = GaugeMetricFamily(
            "dynamig_mig_instance_claim_info",
            "One series per allocated MIG instance and claim (and pod, once reserved); attribute a DCGM "
            f"exporter per-instance series to pods with: <DCGM series> * {DCGM_JOIN}",
            labels=[*dcgm, "mig_uuid", "dra_device", "namespace", "claim", "pod"],
        )
        for i in self.instances:
            key = (str(i.gpu_index), i.profile, i.state)
            counts[key] = counts.get(key, 0) + 1
            labels = [self.hostname, str(i.gpu_index), i.gpu_uuid, i.profile, str(i.gi_id)]
            info.add_metric([*labels, i.mig_uuid, i.device, i.state], 1.0)
            for claim, pod in i.claims:
                namespace, _, name = claim.partition("/")
                claim_info.add_metric([*labels, i.mig_uuid, i.device, namespace, name, pod], 1.0)
        by_state = GaugeMetricFamily(
            "dynamig_mig_instances",
            "MIG instances that exist, by GPU, profile and state (free, allocated, in-use).",
            labels=["Hostname", "gpu", "profile", "state"],
        )
        for (gpu, profile, state), n in sorted(counts.items()):
            by_state.add_metric([self.hostname, gpu, profile, state], float(n))
        yield by_state
        yield info
        yield claim_info
        phase = GaugeMetricFamily(
            "dynamig_gpu_partition_phase",
            "1 for the current phase of each GPU's partition.",
            labels=["Hostname", "gpu", "UUID", "phase"],
        )
        mode = GaugeMetricFamily(
            "dynamig_gpu_mig_mode",
            "1 for the MIG mode NVML reports for each GPU: Enabled, Disabled, EnablePending, DisablePending.",
            labels=["Hostname", "gpu", "UUID", "mode"],
        )
        whole = GaugeMetricFamily(
            "dynamig_whole_gpus",
            "GPUs with MIG mode off, published whole, by GPU and state (free, allocated, in-use).",
            labels=["Hostname", "gpu", "UUID", "state"],
        )
        for g in self.gpus:
            phase.add_metric([self.hostname, str(g.gpu_index), g.gpu_uuid, g.phase], 1.0)
            if g.mig_mode:
                mode.add_metric([self.hostname, str(g.gpu_index), g.gpu_uuid, g.mig_mode], 1.0)
            if g.whole_state:
                whole.add_metric([self.hostname, str(g.gpu_index), g.gpu_uuid, g.whole_state], 1.0)
        yield phase
        yield mode
        yield whole


class AgentMetrics:
    """Every metric of one agent, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry, hostname: str) -> None:
        # No `<counter>_created` / `<histogram>_created` series: one more series per counter child that no
        # rule or dashboard reads. The switch is the client library's, for the whole process (one agent).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry
        self.hostname = hostname
        self._snapshot = _SnapshotCollector(hostname)
        registry.register(self._snapshot)
        self.reshape_operations = Counter(
            "dynamig_reshape_operations_total",
            "MIG instance operations carried out by the agent.",
            ["Hostname", "operation", "result"],
            registry=registry,
        )
        self.reshape_duration = Histogram(
            "dynamig_reshape_duration_seconds",
            "Time from a GPU leaving Stable to being Stable again.",
            ["Hostname"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )
        self.nvml_errors = Counter(
            "dynamig_nvml_errors_total",
            "NVML calls that failed, by operation and NVML error.",
            ["Hostname", "operation", "error"],
            registry=registry,
        )
        self.kept_busy = Counter(
            "dynamig_busy_instances_kept_total",
            "Times an instance marked for removal was kept because a claim or a process held it.",
            ["Hostname"],
            registry=registry,
        )
        self.bound_recovered = Counter(
            "dynamig_bound_device_recovered_total",
            "Free instances destroyed so that a pod bound to a device whose memory slices they took (an "
            "allocation made from an older slice) could be prepared.",
            ["Hostname"],
            registry=registry,
        )
        self.slice_publishes = Counter(
            "dynamig_resourceslice_publishes_total",
            "Pool generations written to the API.",
            ["Hostname"],
            registry=registry,
        )
        self.binding_answers = Counter(
            "dynamig_binding_answers_total",
            "Allocations answered through binding conditions: ready (the instance exists), failed (the "
            "scheduler releases the allocation and retries).",
            ["Hostname", "answer"],
            registry=registry,
        )
        self.reconcile_errors = Counter(
            "dynamig_reconcile_errors_total",
            "Reconcile rounds that ended in an error.",
            ["Hostname"],
            registry=registry,
        )

        self.plugin_requests = Counter(
            "dynamig_kubelet_plugin_requests_total",
            "Claims the kubelet asked the DRA plugin to prepare or unprepare, by result (ok, error).",
            ["Hostname", "operation", "result"],
            registry=registry,
        )
        self.plugin_request_duration = Histogram(
            "dynamig_kubelet_plugin_request_duration_seconds",
            "Time the DRA plugin took to answer one NodePrepareResources or NodeUnprepareResources call.",
            ["Hostname", "operation"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=registry,
        )
        # Zero series for this node: an alert on increase() fires at the first failure, not the second.
        self.reconcile_errors.labels(hostname)
        self.kept_busy.labels(hostname)
        self.bound_recovered.labels(hostname)
        self.slice_publishes.labels(hostname)
        for answer in ("ready", "failed"):
            self.binding_answers.labels(hostname, answer)
        for op in ("prepare", "unprepare"):
            self.plugin_request_duration.labels(hostname, op)
            for result in ("ok", "error"):
                self.plugin_requests.labels(hostname, op, result)

    def plugin_request(self, operation: str, results: list[str], seconds: float) -> None:
        """One kubelet call: each claim's result (ok, error), and how long the call took."""
        for result in results:
            self.plugin_requests.labels(self.hostname, operation, result).inc()
        self.plugin_request_duration.labels(self.hostname, operation).observe(seconds)

    def operation(self, operation: str, result: str) -> None:
        self.reshape_operations.labels(self.hostname, operation, result).inc()

    def nvml_error(self, operation: str, error: str) -> None:
        self.nvml_errors.labels(self.hostname, operation, error).inc()

    def snapshot(self, instances: tuple[InstanceSample, ...], gpus: tuple[GpuSample, ...]) -> None:
        self._snapshot.instances = instances
        self._snapshot.gpus = gpus
