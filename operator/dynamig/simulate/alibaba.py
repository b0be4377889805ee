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
  replaced by the simulated MIG model, and the node's original type is kept as its ``gpu_type``;
- a task's ``gpu_spec`` (GPU types separated by ``|``, empty: any) restricts it to nodes of those types;
- ``creation_time``/``deletion_time`` are only needed by the online replay; the paper's protocol samples
  tasks without them;
- a task's priority comes from its ``qos`` (``dynamig.simulate.priority``: LS > Burstable > BE);
- with whole-GPU demand (``replay_trace(..., whole_gpu_demand=True)``, off by default) a task with
  ``num_gpu >= 2`` asks for that many whole GPUs (MIG mode off) on one node (``trace.WHOLE_ONLY``), and a
  task asking a full GPU (``num_gpu == 1``, ``gpu_milli == 1000``) for one whole GPU, then the largest MIG
  profile (``trace.WHOLE_FIRST``, as DRA ``firstAvailable``; ``single_fallback=False``: the whole GPU
  only). Its MIG alternatives stay as above, so a policy without GPUs in MIG mode off serves it as before;
- on a mixed-model cluster (``dynamig simulate --mixed``) the nodes get the models by weight
  (``trace.assign_models``) and a task lists, as DRA alternatives, every model's profile for its share,
  smallest memory first (share 0.1: 1g.5gb on an A100-40GB, 1g.10gb on an H100-80GB, 1g.18gb on an
  H200-141GB), then each model's fallbacks (``trace.mixed_alternatives``); a multi-GPU task lists each
  model's whole GPU; served slice-h stay the preferred profile's compute slices x hours.

Reading the files is the only side effect; everything else is pure.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import IO

from dynamig.geometry.model import GpuModel
from dynamig.simulate.priority import qos_priority
from dynamig.simulate.trace import (
    WHOLE_FIRST,
    WHOLE_ONLY,
    ClusterSpec,
    Job,
    NodeSpec,
    Trace,
    compute_slices_by_name,
    full_alternatives,
    mixed_alternatives,
    order_models,
    sorted_jobs,
)

Models = GpuModel | Sequence[GpuModel]  # one simulated model, or the models of a mixed cluster


def as_models(model: Models) -> tuple[GpuModel, ...]:
    """``model`` as a tuple in jobs' preference order (smallest memory first). Pure."""
    return (model,) if isinstance(model, GpuModel) else order_models(model)


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
    creation: float | None  # None: the pod list has no times (the paper protocol still runs)
    deletion: float | None
    gpu_spec: str = ""


def _int(row: dict[str, str], col: str, where: str) -> int:
    try:
        return int(row[col])
    except (KeyError, ValueError):
        raise TraceFormatError(f"{where}: column {col!r} must be an integer, got {row.get(col)!r}") from None


def read_tasks(stream: IO[str], source: str) -> list[Task]:
    """GPU tasks of a pod list (CPU-only tasks dropped). Pure apart from reading ``stream``."""
    reader = csv.DictReader(stream)
    needed = {"name", "num_gpu", "gpu_milli"}
    columns = set(reader.fieldnames or ())
    missing = needed - columns
    if missing:
        raise TraceFormatError(f"{source}: missing columns {', '.join(sorted(missing))}")
    timed = "creation_time" in columns
    tasks: list[Task] = []
    for n, row in enumerate(reader, start=2):
        where = f"{source}:{n}"
        num_gpu = _int(row, "num_gpu", where)
        if num_gpu <= 0:
            continue
        deletion = row.get("deletion_time") or ""
        tasks.append(
            Task(
                name=row["name"],
                num_gpu=num_gpu,
                gpu_milli=_int(row, "gpu_milli", where),
                qos=row.get("qos") or "",
                creation=float(_int(row, "creation_time", where)) if timed else None,
                deletion=float(_int(row, "deletion_time", where)) if deletion else None,
                gpu_spec=(row.get("gpu_spec") or "").strip(),
            )
        )
    return tasks


def with_gpu_spec(tasks: Sequence[Task], cluster: ClusterSpec, share: float, seed: int = 0) -> list[Task]:
    """A GPU-type-restricted variant of ``tasks``: each task without a ``gpu_spec`` gets one, with
    probability ``share`` (seeded, in list order), naming one GPU type of ``cluster``'s node list drawn
    with weights proportional to that type's GPUs (scarce types get few restricted tasks, but only their
    nodes can run them). Other tasks are unchanged. Pure."""
    gpus: dict[str, int] = {}
    for node in cluster.nodes:
        gpus[node.gpu_type] = gpus.get(node.gpu_type, 0) + node.gpus
    types = sorted(t for t in gpus if t)
    if not types or share <= 0:
        return list(tasks)
    weights = [gpus[t] for t in types]
    rng = random.Random(seed)
    out = []
    for task in tasks:
        draw, pick = rng.random(), rng.choices(types, weights)[0]  # both drawn for every task: stable
        out.append(replace(task, gpu_spec=pick) if draw < share and not task.gpu_spec else task)
    return out


def require_times(tasks: Sequence[Task], source: str) -> None:
    """Raise ``TraceFormatError`` naming the missing columns when the tasks have no creation times. Pure."""
    if any(t.creation is None for t in tasks):
        raise TraceFormatError(
            f"{source}: the online replay needs columns creation_time and deletion_time, which this pod list "
            "lacks (the paper protocol runs without them: --protocols paper)"
        )


def read_nodes(stream: IO[str], source: str, model: str) -> ClusterSpec:
    """Nodes with GPUs, each keeping its GPU count, with the GPU model replaced by ``model``. Pure apart from
    reading ``stream``."""
    reader = csv.DictReader(stream)
    missing = {"sn", "gpu"} - set(reader.fieldnames or ())
    if missing:
        raise TraceFormatError(f"{source}: missing columns {', '.join(sorted(missing))}")
    nodes = []
    for n, row in enumerate(reader, start=2):
        gpus = _int(row, "gpu", f"{source}:{n}")
        if gpus > 0:
            nodes.append(NodeSpec(row["sn"], gpus, model, (row.get("model") or "").strip()))
    return ClusterSpec(tuple(nodes))


def every_kth_node(cluster: ClusterSpec, k: int) -> ClusterSpec:
    """Nodes 0, k, 2k, ... of ``cluster``: a smaller cluster with the same mix of node sizes. Pure."""
    return ClusterSpec(cluster.nodes[:: max(1, k)])


def whole_demand(task: Task, single_fallback: bool = True) -> str:
    """The whole-GPU demand of ``task`` in a replay with ``whole_gpu_demand`` (``Job.whole``):
    ``WHOLE_ONLY`` for several GPUs, for one full GPU ``WHOLE_FIRST`` (``WHOLE_ONLY`` without
    ``single_fallback``), "" for a fraction of a GPU. Pure."""
    if task.num_gpu > 1:
        return WHOLE_ONLY
    if task.num_gpu == 1 and task.gpu_milli >= 1000:
        return WHOLE_FIRST if single_fallback else WHOLE_ONLY
    return ""


def task_job(
    task: Task,
    model: Models,
    fallbacks: int,
    *,
    arrival: float,
    duration: float | None,
    whole_gpu_demand: bool = False,
    single_fallback: bool = True,
) -> Job:
    """The simulator job for a trace task under the stated mapping; with several models (a mixed
    cluster) the alternatives list each model's profile for the share, smallest memory first, then each
    model's fallbacks (``trace.mixed_alternatives``); a multi-GPU task lists each model's whole GPU.
    ``whole_gpu_demand``: multi-GPU and full-GPU tasks also ask for GPUs with MIG mode off
    (``whole_demand``). Pure."""
    models = as_models(model)
    if task.num_gpu == 1 and task.gpu_milli < 1000:
        share = task.gpu_milli / 1000.0
        alternatives = mixed_alternatives(models, share, fallbacks)
    else:
        share = 1.0
        alternatives = full_alternatives(models)
    return Job(
        name=task.name,
        arrival=arrival,
        duration=duration,
        alternatives=alternatives,
        count=task.num_gpu,
        kind=task.qos or "task",
        share=share,
        gpu_types=tuple(sorted(x.strip() for x in task.gpu_spec.split("|") if x.strip())),
        priority=qos_priority(task.qos),
        whole=whole_demand(task, single_fallback) if whole_gpu_demand else "",
    )


def replay_trace(
    tasks: Sequence[Task],
    cluster: ClusterSpec,
    model: Models,
    *,
    fallbacks: int = 0,
    name: str = "alibaba-openb",
    compress: float = 1.0,
    source: str = "pod list",
    until_last_arrival: bool = False,
    whole_gpu_demand: bool = False,
    single_fallback: bool = True,
) -> Trace:
    """Online replay: each task arrives at its creation time divided by ``compress`` (1: as recorded; 2:
    arrivals twice as dense) and runs as long as it lived in the trace (deletion - creation, at least one
    second); the horizon is the last departure (``until_last_arrival``: the last arrival).
    ``whole_gpu_demand``: multi-GPU and full-GPU tasks ask for whole GPUs (``whole_demand``; the same
    jobs, arrivals and profiles otherwise). TraceFormatError when the tasks carry no times. Pure."""
    require_times(tasks, source)
    end = max(max(t.deletion or 0.0, t.creation or 0.0) for t in tasks) if tasks else 0.0
    jobs = []
    for t in tasks:
        created = t.creation or 0.0
        duration = max(1.0, (t.deletion if t.deletion is not None else end) - created)
        jobs.append(
            task_job(
                t,
                model,
                fallbacks,
                arrival=created / compress,
                duration=duration,
                whole_gpu_demand=whole_gpu_demand,
                single_fallback=single_fallback,
            )
        )
    horizon = max((j.arrival + (j.duration or 0.0) for j in jobs), default=0.0)
    if until_last_arrival:
        # a load level is measured while demand arrives: otherwise the tasks that live for months set a
        # horizon long enough for every delayed task to finish, and every policy serves 100%
        horizon = max((j.arrival for j in jobs), default=0.0)
    return Trace(
        name=name,
        cluster=cluster,
        jobs=sorted_jobs(jobs),
        horizon=horizon,
        description="Alibaba openb trace replayed with its own creation and deletion times"
        + (f", arrivals compressed {compress:.3g}x" if compress != 1.0 else ""),
    )


def peak_demand(jobs: Sequence[Job], slices_of: Mapping[str, int]) -> float:
    """Most compute slices the jobs ask for at one instant if each ran from its arrival. Pure."""
    edges: list[tuple[float, int]] = []
    for j in jobs:
        need = j.count * slices_of[j.preferred]
        edges.append((j.arrival, need))
        if j.duration is not None:
            edges.append((j.arrival + j.duration, -need))
    peak = level = 0
    for _, delta in sorted(edges, key=lambda e: (e[0], e[1])):  # departures first at a tie
        level += delta
        peak = max(peak, level)
    return float(peak)


def compression_for_load(
    tasks: Sequence[Task], model: Models, capacity_slices: int, load: float, source: str = "pod list"
) -> float:
    """The smallest arrival compression at which the replay's peak demand reaches ``load`` x
    ``capacity_slices`` (bisection in log space; durations are kept, so the peak grows with the
    compression). When even all tasks at once fall short, the largest compression tried (1e6). Pure."""
    require_times(tasks, source)
    slices = compute_slices_by_name(as_models(model))
    base = [task_job(t, model, 0, arrival=t.creation or 0.0, duration=None) for t in tasks]
    end = max(t.deletion or t.creation or 0.0 for t in tasks) if tasks else 0.0
    spans = [
        (t.creation or 0.0, max(1.0, (end if t.deletion is None else t.deletion) - (t.creation or 0.0)))
        for t in tasks
    ]
    target = load * capacity_slices

    def peak(f: float) -> float:
        return peak_demand(
            [Job(j.name, a / f, d, j.alternatives, j.count) for j, (a, d) in zip(base, spans, strict=True)],
            slices,
        )

    lo, hi = 1e-3, 1e6
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if peak(mid) < target:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.001:
            break
    return hi  # the first compression found whose peak reaches the target


# A load level must be at most this fraction of what all the tasks ask for at once. Compressing the arrivals
# raises the replay's peak towards that sum; close to it, the level is reached only by the whole trace
# arriving at once (the full openb cluster at load 1.0: 25,000x, every task within 8 minutes, fewer than
# one median task lifetime), which measures one burst, not a load the cluster carries.
LOAD_HEADROOM = 2.0


def all_at_once_slices(tasks: Sequence[Task], model: Models) -> float:
    """Compute slices the tasks ask for if all of them ran at once, each on its first-choice profile: the
    peak no compression of the arrivals can pass. Pure."""
    slices = compute_slices_by_name(as_models(model))
    jobs = (task_job(t, model, 0, arrival=0.0, duration=None) for t in tasks)
    return float(sum(j.count * slices[j.preferred] for j in jobs))


def max_load(tasks: Sequence[Task], model: Models, capacity_slices: int) -> float:
    """The highest load level a replay of ``tasks`` may be run at on a cluster of ``capacity_slices``:
    what all of them ask for at once over the capacity, divided by :data:`LOAD_HEADROOM`. Pure."""
    return all_at_once_slices(tasks, model) / LOAD_HEADROOM / capacity_slices if capacity_slices else 0.0


def sampled_tasks(
    tasks: Sequence[Task], model: Models, capacity_gpus: int, limit: float, seed: int, fallbacks: int = 0
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
                gpu_types=job.gpu_types,
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
    return load_files(pods, nodes, model)


def load_files(pods: Path, nodes: Path, model: GpuModel) -> tuple[list[Task], ClusterSpec]:
    """Read any openb variant: a pod list and a node list. Side effect: reads two files."""
    for p in (pods, nodes):
        if not p.is_file():
            raise TraceFormatError(f"{p}: not found")
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


def mapping_counts(tasks: Iterable[Task], model: Models) -> dict[str, int]:
    """How many tasks map to each profile (multi-GPU tasks counted as ``n x profile``). Pure."""
    counts: dict[str, int] = {}
    for t in tasks:
        job = task_job(t, model, 0, arrival=0.0, duration=None)
        key = job.preferred if job.count == 1 else f"{job.count}x{job.preferred}"
        counts[key] = counts.get(key, 0) + 1
    return counts
