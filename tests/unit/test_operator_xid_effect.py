"""The policy's spec.health.xidEffect, parsed and written to its GPUs' GpuPartition spec.xidEffect
(``dynamig.operator.xid_effects``). Pure."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from dynamig.geometry.catalog import load_catalog
from dynamig.kube.policy import parse_policy
from dynamig.operator.inventory import parse_inventory
from dynamig.operator.xid_effects import ungoverned_xid_effects, xid_effect_writes

CATALOG = load_catalog()


def _policy(mode: str = "Dynamic", **health: Any) -> Any:
    spec: dict[str, Any] = {"mode": mode}
    if health:
        spec["health"] = health
    return parse_policy({"metadata": {"name": "fleet", "generation": 1}, "spec": spec})


def _part(name: str, effect: str | None = None) -> dict[str, Any]:
    node, index = name.rsplit("-gpu", 1)
    spec: dict[str, Any] = {"layout": []}
    if effect is not None:
        spec["xidEffect"] = effect
    return {
        "metadata": {"name": name, "generation": 1},
        "spec": spec,
        "status": {"node": node, "gpuIndex": int(index), "model": "A100-80GB", "migMode": "Enabled",
                   "observedGeneration": 1, "phase": "Stable", "instances": []},
    }  # fmt: skip


def test_the_policy_field_takes_the_two_effects_and_names_a_bad_one() -> None:
    assert _policy().spec.health.xid_effect is None
    assert _policy(xidEffect="NoExecute").spec.health.xid_effect == "NoExecute"
    with pytest.raises(ValidationError, match="xidEffect"):
        _policy(xidEffect="PreferNoSchedule")


@pytest.mark.parametrize(
    ("mode", "health", "have", "writes"),
    [
        ("Dynamic", {"xidEffect": "NoExecute"}, (None, "NoExecute"), {"n-gpu0": "NoExecute"}),
        (
            "Static",
            {"xidEffect": "NoSchedule"},
            ("NoExecute", None),
            {"n-gpu0": "NoSchedule", "n-gpu1": "NoSchedule"},
        ),
        ("Dynamic", {}, ("NoExecute", None), {"n-gpu0": None}),  # unset: removed, the agent's flag again
        ("DryRun", {"xidEffect": "NoExecute"}, (None, None), {}),  # DryRun changes nothing
        ("Dynamic", {"xidEffect": "NoExecute"}, ("NoExecute", "NoExecute"), {}),  # written already
    ],
)
def test_each_governed_gpu_gets_the_policys_effect_once(
    mode: str, health: dict[str, str], have: tuple[str | None, str | None], writes: dict[str, str | None]
) -> None:
    parts = [_part("n-gpu0", have[0]), _part("n-gpu1", have[1])]
    mine = parse_inventory(parts, CATALOG)
    by_name = {p["metadata"]["name"]: p for p in parts}
    assert xid_effect_writes(_policy(mode, **health), mine, by_name) == writes


def test_a_gpu_no_policy_governs_has_its_effect_removed() -> None:
    """A GPU that left every policy (not in the ownership map) keeps no spec.xidEffect: its agent's flag
    applies again; a governed GPU, or one naming none, is left to the policy's own writes."""
    parts = [_part("n-gpu0", "NoExecute"), _part("n-gpu1", "NoSchedule"), _part("n-gpu2")]
    gpus = parse_inventory(parts, CATALOG)
    by_name = {p["metadata"]["name"]: p for p in parts}
    assert ungoverned_xid_effects(gpus, {"n-gpu1": "fleet"}, by_name) == ("n-gpu0",)
    assert ungoverned_xid_effects(gpus, {g.name: "fleet" for g in gpus}, by_name) == ()
