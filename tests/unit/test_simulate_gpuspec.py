"""The GPU-type-limited variant of an openb pod list (``alibaba.with_gpu_spec``) and its replay.

What runs for real: the simulator's trace loading, the variant derivation and the replay of every booking
policy. What is simulated: the cluster (the sample node list the package carries, its nodes' GPU types
kept) and virtual time. Deterministic, a few seconds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from dynamig.geometry.catalog import load_catalog
from dynamig.simulate import alibaba
from dynamig.simulate.booking import FirstFitAllocator
from dynamig.simulate.cluster import Cluster
from dynamig.simulate.engine import SimConfig, simulate
from dynamig.simulate.runner import DynamigSettings, run_trace


def test_variant_restricts_a_seeded_share_to_the_clusters_types_by_their_gpus() -> None:
    model = load_catalog().model("A100-80GB")
    tasks, spec = alibaba.load_sample(model)
    types = {n.gpu_type for n in spec.nodes}
    fixed = replace(tasks[0], gpu_spec=sorted(types)[0])  # a task that names its type already keeps it
    variant = alibaba.with_gpu_spec([fixed, *tasks[1:]], spec, 1 / 3)
    assert variant == alibaba.with_gpu_spec([fixed, *tasks[1:]], spec, 1 / 3)  # seeded
    assert variant[0] == fixed
    restricted = [t for t in variant[1:] if t.gpu_spec]
    assert 0.2 < len(restricted) / len(tasks) < 0.45
    assert {t.gpu_spec for t in restricted} <= types
    assert [replace(t, gpu_spec="") for t in variant[1:]] == [replace(t, gpu_spec="") for t in tasks[1:]]
    gpus = Counter[str]()
    for n in spec.nodes:
        gpus[n.gpu_type] += n.gpus
    most = max(gpus, key=lambda t: gpus[t])
    drawn = Counter(t.gpu_spec for t in restricted)
    assert drawn[most] == max(drawn.values())  # the type with the most GPUs gets the most tasks
    assert alibaba.with_gpu_spec(tasks, spec, 0.0) == tasks


def test_restricted_jobs_run_only_on_their_type_in_every_booking_policy() -> None:
    model = load_catalog().model("A100-80GB")
    tasks, spec = alibaba.load_sample(model)
    variant = alibaba.with_gpu_spec(tasks, spec, 0.5)
    trace = alibaba.replay_trace(variant, spec, model, fallbacks=0, name="gpuspec", source="sample")
    by_name = {j.name: j for j in trace.jobs}
    assert any(j.gpu_types for j in trace.jobs)
    policies = ("first-fit", "nvidia-dynamic-mig", "hami-reserve", "dynamig")
    for order in ("pack", "spread"):
        rep = run_trace(trace, SimConfig(node_order=order), DynamigSettings(), policies, log=True)
        for r in rep.results:
            assert r.started > 0 and r.destroyed_busy == 0
    # the event log of one run: every assignment of a restricted job is on a node of its type
    alloc = FirstFitAllocator(Cluster(spec, log=True), 6.0, node_order="spread")
    simulate(trace, alloc, SimConfig(node_order="spread"))
    checked = 0
    for e in alloc.cluster.log or []:
        job = by_name.get(e.job)
        if e.op == "assign" and job is not None and job.gpu_types:
            node = alloc.cluster.gpus[e.gpu].node_pos
            assert alloc.cluster.node_types[node] in job.gpu_types
            checked += 1
    assert checked > 0
