"""The DRA device taint effect a policy asks for a critical XID on its GPUs (``spec.health.xidEffect``), as
the GpuPartitions' ``spec.xidEffect`` the node agents taint with. Pure.

The agent taints the devices an XID affects with its own ``--xid-effect`` unless the GpuPartition names one;
the operator writes the policy's choice to each GPU the policy governs, in ``Dynamic`` and ``Static`` (a
taint's effect changes no layout), not in ``DryRun``, and removes it where the policy no longer sets one, and
from a GPU no policy governs any more (the field is the policies' to set: a GPU left alone taints with its
agent's flag).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dynamig.kube.policy import GpuPartitionPolicy, Mode
from dynamig.operator.inventory import GpuView


def xid_effect_writes(
    policy: GpuPartitionPolicy, mine: Sequence[GpuView], partitions: Mapping[str, Mapping[str, Any]]
) -> dict[str, str | None]:
    """GPU -> the ``spec.xidEffect`` to write (None: remove it), for the GPUs of ``mine`` whose GpuPartition
    does not say it yet. Pure."""
    if policy.spec.mode == Mode.DRY_RUN:
        return {}
    want = policy.spec.health.xid_effect
    value = want.value if want is not None else None
    out: dict[str, str | None] = {}
    for g in mine:
        have = ((partitions.get(g.name) or {}).get("spec") or {}).get("xidEffect")
        if have != value:
            out[g.name] = value
    return out


def ungoverned_xid_effects(
    gpus: Sequence[GpuView], owner: Mapping[str, str], partitions: Mapping[str, Mapping[str, Any]]
) -> tuple[str, ...]:
    """GPUs no policy governs (not in ``owner``) whose GpuPartition still names a ``spec.xidEffect``: to
    remove. Pure."""
    return tuple(
        g.name
        for g in gpus
        if g.name not in owner and ((partitions.get(g.name) or {}).get("spec") or {}).get("xidEffect")
    )
