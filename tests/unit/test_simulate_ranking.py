"""The simulator's per-profile ranking is the agent's ``rank_offers`` restricted to one profile.

What runs for real: ``dynamig.planner.ranking.rank_offers``, in full (the agent's publishing order) and for
one profile (what the simulator books from). What is simulated: the node states, built by booking and ending
seeded random jobs on a simulated 4-GPU A100-80GB node (kept free instances included). Deterministic, under
a second."""

from __future__ import annotations

import random

from dynamig.planner import Policy
from dynamig.planner.ranking import rank_offers
from dynamig.simulate.allocators import Allocation
from dynamig.simulate.cluster import Cluster
from dynamig.simulate.dynamig_policy import DynamigAllocator
from dynamig.simulate.trace import Job, uniform_cluster

PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")


def test_ranking_one_profile_equals_the_full_ranking_filtered_on_many_node_states() -> None:
    rng = random.Random(7)
    alloc = DynamigAllocator(
        Cluster(uniform_cluster(1, 4, "A100-80GB")), Policy(), reshape_latency_s=0.0, cooldown_s=0.0
    )
    running: list[tuple[Job, Allocation]] = []
    compared = recuts = 0
    for step in range(120):
        if running and rng.random() < 0.45:
            job, got = running.pop(rng.randrange(len(running)))
            alloc.release(job, got, float(step))
        else:
            job = Job(f"j{step}", float(step), None, (rng.choice(PROFILES),))
            placed = alloc.place(job, float(step))
            if placed is not None:
                running.append((job, placed))
        offers = [alloc._gpu_offers(g) for g in alloc.cluster.nodes[0]]
        full = rank_offers(offers)
        recuts += sum(1 for r in full if r.destroys)
        for profile in PROFILES:
            assert rank_offers(offers, profile) == tuple(r for r in full if r.profile == profile)
            compared += 1
    assert compared == 600 and recuts > 0  # re-cut offers (free instances destroyed) were compared too
