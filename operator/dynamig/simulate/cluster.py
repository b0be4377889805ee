"""Simulated cluster state: GPUs, their MIG instances, which job holds each, and an event log.

The state is mutable and owned by one allocator during one run. Every change goes through ``Cluster``
methods so that the event log (create, destroy, assign, release, and for whole GPUs mig-on, mig-off) is
complete: tests replay it to prove, for example, that no instance was destroyed while a job held it.

MIG mode (``dynamig.simulate.modes``): a GPU has MIG mode on (``Gpu.mig``, the default) or off. A GPU with
MIG mode off has no instances and holds one whole-GPU job or nothing (``assign_whole``); a switch
(``set_mode``) needs the GPU idle (no instance, no whole job: ``switched_busy`` counts the violations and
must stay 0) and takes until ``Gpu.mode_until``, during which the GPU serves nothing (``Gpu.switching``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import free_starts
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance, normalize_layout
from dynamig.simulate.trace import ClusterSpec, Job, plain_profiles

WHOLE = "whole"  # the profile name a whole GPU's assignment is logged with (the operator's, too)


@dataclass(frozen=True, slots=True)
class LogEntry:
    time: float
    op: str  # "create" | "destroy" | "assign" | "release" | "mig-on" | "mig-off"
    gpu: int  # position of the GPU in the cluster
    profile: str
    start: int
    job: str = ""


class Instance:
    """A MIG instance (or, for the whole-GPU policy, a whole GPU). ``job`` is the holder, ``""`` when free."""

    __slots__ = ("alive", "gpu", "job", "profile", "ready_at", "slices", "start")

    def __init__(self, gpu: Gpu, profile: str, start: int, slices: int, ready_at: float) -> None:
        self.gpu = gpu
        self.profile = profile
        self.start = start
        self.slices = slices
        self.ready_at = ready_at
        self.job = ""
        self.alive = True

    @property
    def placed(self) -> PlacedInstance:
        return PlacedInstance(self.start, self.profile)


class Gpu:
    __slots__ = (
        "busy_slices",
        "cooldown_until",
        "index",
        "instances",
        "mig",
        "mode_at",
        "mode_for",
        "mode_until",
        "model",
        "node",
        "node_pos",
        "pos",
        "switches",
        "switching",
        "whole_job",
    )

    def __init__(self, pos: int, node: str, node_pos: int, index: int, model: GpuModel) -> None:
        self.pos = pos
        self.node = node
        self.node_pos = node_pos
        self.index = index
        self.model = model
        self.instances: list[Instance] = []
        self.cooldown_until = 0.0
        self.busy_slices = 0
        self.mig = True  # MIG mode on (or being switched on)
        self.switching = False  # a MIG mode switch is under way (until ``mode_until``): it serves nothing
        self.mode_until = 0.0
        self.mode_at = -math.inf  # when its MIG mode was last switched (a cooldown counts from there)
        self.mode_for = ""  # the job it was last switched for
        self.switches = 0
        self.whole_job = ""  # the job holding it whole (MIG mode off); "" when none

    def layout(self) -> Layout:
        return normalize_layout([i.placed for i in self.instances])

    def reshaping(self, now: float) -> bool:
        return any(i.ready_at > now for i in self.instances)

    def has_busy(self) -> bool:
        return any(i.job for i in self.instances)


class Cluster:
    """GPUs of a ``ClusterSpec`` and their instances; counts creations and destructions; logs every change."""

    def __init__(self, spec: ClusterSpec, *, log: bool = False) -> None:
        catalog = load_catalog()
        self.models: dict[str, GpuModel] = {key: catalog.model(key) for key in spec.models()}
        self.gpus: list[Gpu] = []
        self.nodes: list[list[Gpu]] = []
        self.node_names: list[str] = []
        self.node_types: list[str] = []  # the trace's GPU type per node (jobs' gpu_types match it)
        for node_pos, node in enumerate(spec.nodes):
            model = self.models[node.model]
            gpus = [Gpu(len(self.gpus) + i, node.name, node_pos, i, model) for i in range(node.gpus)]
            self.gpus.extend(gpus)
            self.nodes.append(gpus)
            self.node_names.append(node.name)
            self.node_types.append(node.gpu_type)
        self.slices_of: dict[tuple[str, str], int] = {
            (m.key, p.name): p.compute_slices for m in self.models.values() for p in m.profiles
        }
        # what a GPU offers: the plain profiles of its own model (an alternative naming another model's
        # profile does not match there, even where the name exists: the A100-40GB's double-memory 1g.10gb)
        self.plain: dict[str, frozenset[str]] = {
            m.key: frozenset(p.name for p in plain_profiles(m)) for m in self.models.values()
        }
        self.total_slices = sum(g.model.compute_slices for g in self.gpus)
        self.busy_slices = 0
        self.created = 0
        self.destroyed = 0
        self.destroyed_busy = 0  # must stay 0: destroying a held instance loses a workload
        self.switches = 0  # MIG mode switches
        self.switched_busy = 0  # must stay 0: a GPU switched while an instance or a whole job was on it
        self.log: list[LogEntry] | None = [] if log else None
        self._free_starts: dict[tuple[str, Layout, str], tuple[int, ...]] = {}

    def offers(self, gpu: Gpu, profile: str) -> bool:
        """Whether ``gpu`` can offer ``profile`` at all (a plain profile of its model). Pure."""
        return profile in self.plain[gpu.model.key]

    def allows(self, job: Job, node_pos: int) -> bool:
        """Whether ``job``'s GPU-type constraint admits node ``node_pos``. Pure."""
        return not job.gpu_types or self.node_types[node_pos] in job.gpu_types

    def _log(self, time: float, op: str, inst: Instance, job: str = "") -> None:
        if self.log is not None:
            self.log.append(LogEntry(time, op, inst.gpu.pos, inst.profile, inst.start, job))

    def create(self, gpu: Gpu, profile: str, start: int, now: float, ready_at: float) -> Instance:
        """Add an instance to ``gpu`` (the caller has checked the placement). Side effect: state, log."""
        inst = Instance(gpu, profile, start, self.slices_of[(gpu.model.key, profile)], ready_at)
        gpu.instances.append(inst)
        self.created += 1
        self._log(now, "create", inst)
        return inst

    def destroy(self, inst: Instance, now: float) -> None:
        """Remove an instance. Side effect: state, log; a held instance is counted in ``destroyed_busy``."""
        if inst.job:
            self.destroyed_busy += 1
        inst.gpu.instances.remove(inst)
        inst.alive = False
        self.destroyed += 1
        self._log(now, "destroy", inst, inst.job)

    def assign(self, inst: Instance, job: str, now: float) -> None:
        inst.job = job
        inst.gpu.busy_slices += inst.slices
        self.busy_slices += inst.slices
        self._log(now, "assign", inst, job)

    def release(self, inst: Instance, now: float) -> None:
        self._log(now, "release", inst, inst.job)
        inst.job = ""
        inst.gpu.busy_slices -= inst.slices
        self.busy_slices -= inst.slices

    # -- MIG mode and whole GPUs ----------------------------------------------------------------------------
    def set_mode(self, gpu: Gpu, mig: bool, now: float, until: float, job: str = "") -> None:
        """Switch ``gpu``'s MIG mode to ``mig`` at ``now``, done at ``until`` (``switching`` until the
        allocator calls ``mode_done``). The caller destroyed its instances first. Side effect: state, log."""
        if gpu.instances or gpu.whole_job:
            self.switched_busy += 1
        gpu.mig = mig
        gpu.mode_at = now
        gpu.mode_until = until
        gpu.mode_for = job
        gpu.switching = until > now
        gpu.switches += 1
        self.switches += 1
        if self.log is not None:
            self.log.append(LogEntry(now, "mig-on" if mig else "mig-off", gpu.pos, "", 0, job))

    def mode_done(self, gpu: Gpu) -> None:
        """``gpu``'s switch finished: it serves in its new mode."""
        gpu.switching = False

    def assign_whole(self, gpu: Gpu, job: str, now: float) -> None:
        """``job`` takes ``gpu`` whole (MIG mode off, idle, not switching: the caller checked)."""
        gpu.whole_job = job
        gpu.busy_slices += gpu.model.compute_slices
        self.busy_slices += gpu.model.compute_slices
        if self.log is not None:
            self.log.append(LogEntry(now, "assign", gpu.pos, WHOLE, 0, job))

    def release_whole(self, gpu: Gpu, now: float) -> None:
        if self.log is not None:
            self.log.append(LogEntry(now, "release", gpu.pos, WHOLE, 0, gpu.whole_job))
        gpu.whole_job = ""
        gpu.busy_slices -= gpu.model.compute_slices
        self.busy_slices -= gpu.model.compute_slices

    def free_starts(self, gpu: Gpu, profile: str) -> tuple[int, ...]:
        """Starts where ``profile`` fits next to ``gpu``'s instances (geometry rules), memoised per layout."""
        key = (gpu.model.key, gpu.layout(), profile)
        found = self._free_starts.get(key)
        if found is None:
            found = tuple(free_starts(gpu.model, key[1], profile))
            self._free_starts[key] = found
        return found
