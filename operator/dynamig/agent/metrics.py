"""Prometheus metrics of one node agent, on a registry passed in (no module globals).

Names follow Prometheus conventions: ``dynamig_`` prefix, base units (seconds), ``_total`` counters, and a
``dynamig_build_info`` gauge. MIG instance series carry the DCGM exporter's labels (``UUID`` of the parent
GPU, ``GPU_I_PROFILE``, ``GPU_I_ID``, ``hostname``) so dashboards can join them with DCGM's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamig import __version__


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


@dataclass(frozen=True, slots=True)
class GpuSample:
    gpu_index: int
    gpu_uuid: str
    phase: str


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
        info = GaugeMetricFamily(
            "dynamig_mig_instance_info",
            "One series per MIG instance; labels compatible with the DCGM exporter.",
            labels=["hostname", "gpu", "UUID", "GPU_I_PROFILE", "GPU_I_ID", "mig_uuid", "device", "state"],
        )
        for i in self.instances:
            key = (str(i.gpu_index), i.profile, i.state)
            counts[key] = counts.get(key, 0) + 1
            labels = [self.hostname, str(i.gpu_index), i.gpu_uuid, i.profile, str(i.gi_id)]
            info.add_metric([*labels, i.mig_uuid, i.device, i.state], 1.0)
        by_state = GaugeMetricFamily(
            "dynamig_mig_instances",
            "MIG instances that exist, by GPU, profile and state (free, allocated, in-use).",
            labels=["hostname", "gpu", "profile", "state"],
        )
        for (gpu, profile, state), n in sorted(counts.items()):
            by_state.add_metric([self.hostname, gpu, profile, state], float(n))
        yield by_state
        yield info
        phase = GaugeMetricFamily(
            "dynamig_gpu_partition_phase",
            "1 for the current phase of each GPU's partition.",
            labels=["hostname", "gpu", "UUID", "phase"],
        )
        for g in self.gpus:
            phase.add_metric([self.hostname, str(g.gpu_index), g.gpu_uuid, g.phase], 1.0)
        yield phase


class AgentMetrics:
    """Every metric of one agent, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry, hostname: str) -> None:
        self.registry = registry
        self.hostname = hostname
        self._snapshot = _SnapshotCollector(hostname)
        registry.register(self._snapshot)
        self.reshape_operations = Counter(
            "dynamig_reshape_operations_total",
            "MIG instance operations carried out by the agent.",
            ["hostname", "operation", "result"],
            registry=registry,
        )
        self.reshape_duration = Histogram(
            "dynamig_reshape_duration_seconds",
            "Time from a GPU leaving Stable to being Stable again.",
            ["hostname"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )
        self.nvml_errors = Counter(
            "dynamig_nvml_errors_total",
            "NVML calls that failed, by operation and NVML error.",
            ["hostname", "operation", "error"],
            registry=registry,
        )
        self.kept_busy = Counter(
            "dynamig_busy_instances_kept_total",
            "Times an instance marked for removal was kept because a claim or a process held it.",
            ["hostname"],
            registry=registry,
        )
        self.slice_publishes = Counter(
            "dynamig_resourceslice_publishes_total",
            "Pool generations written to the API.",
            ["hostname"],
            registry=registry,
        )
        self.binding_answers = Counter(
            "dynamig_binding_answers_total",
            "Allocations answered through binding conditions: ready (the instance exists), failed (the "
            "scheduler releases the allocation and retries).",
            ["hostname", "answer"],
            registry=registry,
        )
        self.reconcile_errors = Counter(
            "dynamig_reconcile_errors_total",
            "Reconcile rounds that ended in an error.",
            ["hostname"],
            registry=registry,
        )

    def operation(self, operation: str, result: str) -> None:
        self.reshape_operations.labels(self.hostname, operation, result).inc()

    def nvml_error(self, operation: str, error: str) -> None:
        self.nvml_errors.labels(self.hostname, operation, error).inc()

    def snapshot(self, instances: tuple[InstanceSample, ...], gpus: tuple[GpuSample, ...]) -> None:
        self._snapshot.instances = instances
        self._snapshot.gpus = gpus
