"""The placements per profile a GPU offers when the user does not say (planner/offerlimit.py), the agent's
``--placements-per-profile`` flag (``auto`` or a number, anything else refused in one line naming the flag),
and what the agent reports beside the limit in force.

Real: the pure choice, the ``dynamig`` entry point's parser, the operator's choice over parsed GpuPartitions
(``auto_limits``). The API server's side (the CRD's columns, the agent's status) is
tests/integration/test_offer_limit_apiserver.py.
"""

from __future__ import annotations

import pytest

from dynamig import cli
from dynamig.kube.gpupartition import AutoPlacementsSpec, parse_gpu_partition
from dynamig.operator.reconciler import auto_limits
from dynamig.planner.offerlimit import (
    EVERY_PLACEMENT_UP_TO,
    AutoChoice,
    auto_limit,
    choose,
    in_force,
    needs_rewrite,
    parse_limit,
)


@pytest.mark.parametrize(
    ("gpu_nodes", "limit"),
    [
        (0, 0),  # nothing counted yet: every placement, as before the choice existed
        (1, 0),
        (50, 0),  # measured: every placement 1.8x the instances inventory's CPU per pod
        (64, 0),  # the last size below the interpolated 2x crossing (~70 nodes)
        (65, 1),
        (200, 1),  # measured: every placement 2.8x, one per profile 1.7x
        (500, 1),  # 3.2x against 1.6x
        (1_000, 1),  # 5.9x against 1.9x: the goal is at most 2x
        (5_000, 1),
    ],
)
def test_the_choice_from_the_number_of_gpu_nodes(gpu_nodes: int, limit: int) -> None:
    assert auto_limit(gpu_nodes) == limit
    assert choose(gpu_nodes) == AutoChoice(limit, gpu_nodes)


def test_the_threshold_is_the_documented_one() -> None:
    assert EVERY_PLACEMENT_UP_TO == 64
    assert [auto_limit(n) for n in range(60, 70)] == [0] * 5 + [1] * 5


@pytest.mark.parametrize(
    ("written", "chosen", "rewrite"),
    [
        (None, AutoChoice(0, 3), True),  # never written
        (AutoChoice(0, 64), AutoChoice(1, 65), True),  # the limit changed: at once
        (AutoChoice(1, 65), AutoChoice(0, 64), True),
        (AutoChoice(1, 1_000), AutoChoice(1, 1_001), False),  # one node more: no 8,000 rewrites
        (AutoChoice(1, 1_000), AutoChoice(1, 1_100), False),  # a tenth: still the same
        (AutoChoice(1, 1_000), AutoChoice(1, 1_101), True),  # more than a tenth: recounted
        (AutoChoice(1, 1_000), AutoChoice(1, 900), False),
        (AutoChoice(1, 1_000), AutoChoice(1, 899), True),
        (AutoChoice(0, 0), AutoChoice(0, 1), True),
        (AutoChoice(0, 3), AutoChoice(0, 4), True),  # small clusters follow each node
        (AutoChoice(0, 4), AutoChoice(0, 4), False),
    ],
)
def test_when_the_operator_writes_the_choice_again(
    written: AutoChoice | None, chosen: AutoChoice, rewrite: bool
) -> None:
    assert needs_rewrite(written, chosen) is rewrite


@pytest.mark.parametrize(
    ("flag", "written", "limit", "says"),
    [
        (None, AutoChoice(1, 1_000), 1, "auto (1000 GPU nodes)"),
        (None, AutoChoice(0, 12), 0, "auto (12 GPU nodes)"),
        (None, None, 0, "auto (not chosen yet)"),  # no operator choice: every placement
        (3, AutoChoice(1, 1_000), 3, "set"),  # the user's number wins
        (0, AutoChoice(1, 1_000), 0, "set"),
        (2, None, 2, "set"),
    ],
)
def test_the_limit_in_force_and_how_it_was_chosen(
    flag: int | None, written: AutoChoice | None, limit: int, says: str
) -> None:
    assert in_force(flag, written) == (limit, says)


@pytest.mark.parametrize(
    ("text", "value"), [("auto", None), ("AUTO", None), (" auto ", None), ("0", 0), ("1", 1), ("12", 12)]
)
def test_the_flag_takes_auto_or_a_whole_number(text: str, value: int | None) -> None:
    assert parse_limit(text) == value
    args = cli.build_parser().parse_args(["agent", "--placements-per-profile", text])
    assert args.placements_per_profile == value


def test_the_flag_defaults_to_auto() -> None:
    assert cli.build_parser().parse_args(["agent"]).placements_per_profile is None


@pytest.mark.parametrize("text", ["-1", "-2", "1.5", "lots", "", "all", "autox"])
def test_bad_values_are_refused_in_one_line_naming_the_flag(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="'auto' or a whole number >= 0"):
        parse_limit(text)
    try:
        status = cli.main(["agent", "--node", "n1", f"--placements-per-profile={text}"])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "--placements-per-profile" in err and repr(text) in err, err


def _partition(node: str, index: int, written: dict[str, int] | None = None) -> dict[str, object]:
    spec: dict[str, object] = {"layout": []}
    if written is not None:
        spec["autoPlacementsPerProfile"] = written
    return {
        "metadata": {"name": f"{node}-gpu{index}", "generation": 1, "labels": {"dynamig.io/node": node}},
        "spec": spec,
        "status": {"node": node, "gpuIndex": index, "model": "A100-80GB", "inventory": "Partitionable"},
    }


def test_the_operator_counts_gpu_nodes_not_gpus_and_writes_only_what_changed() -> None:
    from dynamig.geometry.catalog import load_catalog
    from dynamig.operator.inventory import parse_inventory

    # 70 nodes of 2 GPUs: 140 GPUs, 70 GPU nodes, past the threshold.
    raws = [_partition(f"n{i}", g) for i in range(70) for g in range(2)]
    raws[0]["spec"]["autoPlacementsPerProfile"] = {"limit": 1, "gpuNodes": 70}  # type: ignore[index]
    raws[1]["spec"]["autoPlacementsPerProfile"] = {"limit": 0, "gpuNodes": 70}  # type: ignore[index]
    raws[2]["spec"]["autoPlacementsPerProfile"] = {"limit": 1, "gpuNodes": 60}  # type: ignore[index]
    gpus = parse_inventory(tuple(raws), load_catalog(), {}, {})
    assert len(gpus) == 140
    partitions = {str(r["metadata"]["name"]): r for r in raws}  # type: ignore[index]
    mine = tuple(g for g in gpus if g.node in {"n0", "n1", "n2"})
    out = auto_limits(gpus, mine, partitions)
    assert set(out) == {"n0-gpu1", "n1-gpu0", "n1-gpu1", "n2-gpu0", "n2-gpu1"}  # n0-gpu0 already says so
    assert set(out.values()) == {AutoChoice(1, 70)}
    # the choice is only written to the GPUs of the policy at hand
    assert auto_limits(gpus, (), partitions) == {}


def test_the_spec_field_parses_as_the_agent_reads_it() -> None:
    part = parse_gpu_partition(_partition("n1", 0, {"limit": 1, "gpuNodes": 1_000}))
    assert part.spec.auto_placements_per_profile == AutoPlacementsSpec(limit=1, gpu_nodes=1_000)
    assert in_force(None, part.spec.auto_placements_per_profile.choice()) == (1, "auto (1000 GPU nodes)")
    assert parse_gpu_partition(_partition("n1", 0)).spec.auto_placements_per_profile is None
