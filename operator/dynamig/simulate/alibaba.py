"""The Alibaba GPU cluster trace v2023 ("openb", Weng et al., USENIX ATC '23) as simulator input.

Two CSV files from Alibaba's ``clusterdata`` repository (``cluster-trace-gpu-v2023/csv/``):

- ``openb_pod_list_default.csv``: ``name, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec, qos,
  pod_phase, creation_time, deletion_time, scheduled_time`` (seconds);
- ``openb_node_list_gpu_node.csv``: ``sn, cpu_milli, memory_mib, gpu, model``.

Mapping to MIG (stated in ``docs/benchmarks.md``):

- a task with ``num_gpu == 1`` asks for ``gpu_milli / 1000`` of one GPU; it gets the smallest plain
  profile whose compute share *and* memory share both hold that fraction (``trace.profile_for_share``);
  on an A100-80GB: <= 0.125 -> 1g.10gb, <= 0.25 -> 2g.20gb, <= 0.4286 -> 3g.40gb (3/7 compute, 4/8
  memory), <= 0.5 -> 4g.40gb, otherwise 7g.80gb;
- a task with ``num_gpu == n > 1`` (always ``gpu_milli == 1000``) gets n full-GPU instances on one node;
- tasks with ``num_gpu == 0`` (CPU only) are dropped; every node keeps its GPU count, the GPU model is
  replaced by the simulated MIG model.

Reading the files is the only side effect; everything else is pure.
"""

from __future__ import annotations

import csv
import io
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO

from dynamig.geometry.model import GpuModel
from dynamig.simulate.trace import (
    ClusterSpec,
    Job,
    NodeSpec,
    Trace,
    alternatives_for,
    full_profile,
    profile_for_share,
    sorted_jobs,
)

POD_FILE = "openb_pod_list_default.csv"
NODE_FILE = "openb_node_list_gpu_node.csv"
SAMPLE_POD_FILE = "openb_pod_list_sample.csv"
SAMPLE_NODE_FILE = "openb_node_list_sample.csv"


class TraceFormatError(ValueError):
    """A trace file is not in the expected format; the message names the file, the row and the column."""


@dataclass(frozen=True, slots=True)
class Task:
    """One GPU task as the trace records it."""

    name: str
    num_gpu: int
    gpu_milli: int
    qos: str
    creation: float
    deletion: float | None


def _int(row: dict[str, str], col: str, where: str) -> int:
    try:
        return int(row[col])
    except (KeyError, ValueError):
        raise TraceFormatError(f"{where}: column {col!r} must be an integer, got {row.get(col)!r}") from None


def read_tasks(stream: IO[str], source: str) -> list[Task]:
    """GPU tasks of a pod list (CPU-only tasks dropped). Pure apart from reading ``stream``."""
    reader = csv.DictReader(stream)
    needed = {"name", "num_gpu", "gpu_milli", "creation_time", "deletion_time"}
    missing = needed - set(reader.fieldnames or ())
    if missing:
        raise TraceFormatError(f"{source}: missing columns {', '.join(sorted(missing))}")
    tasks: list[Task] = []
    for n, row in enumerate(reader, start=2):
        where = f"{source}:{n}"
        num_gpu = _int(row, "num_gpu", where)
        if num_gpu <= 0:
            continue
        deletion = row.get("deletion_time", "")
        tasks.append(
            Task(
                name=row["name"],
                num_gpu=num_gpu,
                gpu_milli=_int(row, "gpu_milli", where),
                qos=row.get("qos", ""),
                creation=float(_int(row, "creation_time", where)),
                deletion=float(_int(row, "deletion_time", where)) if deletion else None,
            )
        )
    return tasks


def read_nodes(stream: IO[str], source: str, model: str) -> ClusterSpec:
    """Nodes with GPUs, each keeping its GPU count, with the GPU model replaced by ``model``. Pure apart from
    reading ``stream``."""
    reader = csv.DictReader(stream)
    if not {"sn", "gpu"} <= set(reader.fieldnames or ()):
        raise TraceFormatError(f"{source}: missing columns sn, gpu")
    nodes = []
    for n, row in enumerate(reader, start=2):
        gpus = _int(row, "gpu", f"{source}:{n}")
        if gpus > 0:
            nodes.append(NodeSpec(row["sn"], gpus, model))
    return ClusterSpec(tuple(nodes))


def every_kth_node(cluster: ClusterSpec, k: int) -> ClusterSpec:
    """Nodes 0, k, 2k, ... of ``cluster``: a smaller cluster with the same mix of node sizes. Pure."""
    return ClusterSpec(cluster.nodes[:: max(1, k)])


def task_job(task: Task, model: GpuModel, fallbacks: int, *, arrival: float, duration: float | None) -> Job:
    """The simulator job for a trace task under the stated mapping. Pure."""
    if task.num_gpu == 1 and task.gpu_milli < 1000:
        share = task.gpu_milli / 1000.0
        profile = profile_for_share(model, share).name
        alternatives = alternatives_for(model, profile, fallbacks)
    else:
        share = 1.0
        alternatives = (full_profile(model).name,)
    return Job(
        name=task.name,
        arrival=arrival,
        duration=duration,
        alternatives=alternatives,
        count=task.num_gpu,
        kind=task.qos or "task",
        share=share,
    )


def replay_trace(
    tasks: Sequence[Task],
    cluster: ClusterSpec,
    model: GpuModel,
    *,
    fallbacks: int = 0,
    name: str = "alibaba-openb",
) -> Trace:
    """Online replay: each task arrives at its creation time and runs as long as it lived in the trace
    (deletion - creation, at least one second); the horizon is the last deletion. Pure."""
    horizon = max((t.deletion or t.creation) for t in tasks) if tasks else 0.0
    jobs = [
        task_job(
            t,
            model,
            fallbacks,
            arrival=t.creation,
            duration=max(1.0, (t.deletion if t.deletion is not None else horizon) - t.creation),
        )
        for t in tasks
    ]
    return Trace(
        name=name,
        cluster=cluster,
        jobs=sorted_jobs(jobs),
        horizon=horizon,
        description="Alibaba openb trace replayed with its own creation and deletion times",
    )


def sampled_tasks(
    tasks: Sequence[Task], model: GpuModel, capacity_gpus: int, limit: float, seed: int, fallbacks: int = 0
) -> list[Job]:
    """The paper's protocol: tasks drawn uniformly with replacement from the trace until the GPUs they ask
    for reach ``limit`` x capacity (plus the one that crosses it); no departures. Pure (seeded)."""
    rng = random.Random(seed)
    jobs: list[Job] = []
    arrived = 0.0
    while arrived < limit * capacity_gpus and tasks:
        task = rng.choice(tasks)
        job = task_job(task, model, fallbacks, arrival=float(len(jobs)), duration=None)
        jobs.append(
            Job(
                f"{task.name}#{len(jobs)}",
                job.arrival,
                None,
                job.alternatives,
                job.count,
                job.kind,
                job.share,
            )
        )
        arrived += job.count * job.share
    return jobs


def load(directory: Path, model: GpuModel, *, sample: bool = False) -> tuple[list[Task], ClusterSpec]:
    """Read the pod and node lists from ``directory``. Side effect: reads two files."""
    pod_name, node_name = (SAMPLE_POD_FILE, SAMPLE_NODE_FILE) if sample else (POD_FILE, NODE_FILE)
    pods, nodes = directory / pod_name, directory / node_name
    for p in (pods, nodes):
        if not p.is_file():
            raise TraceFormatError(f"{p}: not found (expected {POD_FILE} and {NODE_FILE} in {directory})")
    with pods.open(newline="") as f:
        tasks = read_tasks(f, str(pods))
    with nodes.open(newline="") as f:
        cluster = read_nodes(f, str(nodes), model.key)
    return tasks, cluster


def load_sample(model: GpuModel) -> tuple[list[Task], ClusterSpec]:
    """The small sample shipped with the package (see ``simulate/data/README.md``). Side effect: reads
    package data."""
    root = resources.files("dynamig.simulate") / "data"
    tasks = read_tasks(io.StringIO((root / SAMPLE_POD_FILE).read_text(), newline=""), SAMPLE_POD_FILE)
    cluster = read_nodes(
        io.StringIO((root / SAMPLE_NODE_FILE).read_text(), newline=""), SAMPLE_NODE_FILE, model.key
    )
    return tasks, cluster


def mapping_counts(tasks: Iterable[Task], model: GpuModel) -> dict[str, int]:
    """How many tasks map to each profile (multi-GPU tasks counted as ``n x profile``). Pure."""
    counts: dict[str, int] = {}
    for t in tasks:
        job = task_job(t, model, 0, arrival=0.0, duration=None)
        key = job.preferred if job.count == 1 else f"{job.count}x{job.preferred}"
        counts[key] = counts.get(key, 0) + 1
    return counts
