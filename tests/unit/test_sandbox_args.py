"""``--gpu-node NAME=MODEL:COUNT[:mig-off][:vm][,MODEL:COUNT...]`` as `dynamig dev-cluster up` reads it: pure
parsing, and the simulated GPUs' state file the options are written to."""

from __future__ import annotations

import argparse
from pathlib import Path

import pynvml
import pytest

from dynamig.backends import simnvml
from dynamig.cli.args import gpu_node
from dynamig.devcluster.sandbox import (
    GpuNode,
    clear_gpu_state,
    owned_by_chart_release,
    parse_gpu_node,
    seed_gpu_state,
)


def test_a_node_with_two_models() -> None:
    assert parse_gpu_node("n1=A100-80GB:2,H100-80GB:1") == GpuNode("n1", "A100-80GB:2,H100-80GB:1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("n1", "expected NAME=MODEL:COUNT"),
        ("N_1=A100-80GB:1", "is not a valid node name"),
        ("n1=B200-999GB:1", "unknown GPU model 'B200-999GB' (known: "),
        ("n1=A100-80GB", "needs a GPU count from 1 to 8"),
        ("n1=A100-80GB:9", "needs a GPU count from 1 to 8"),
    ],
)
def test_bad_input_is_refused_naming_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_gpu_node(text)


def test_objects_the_sandbox_applies_carry_the_documented_release_as_owner() -> None:
    obj = {"kind": "DeviceClass", "metadata": {"name": "mig.dynamig.io", "labels": {"a": "b"}}}
    owned = owned_by_chart_release(obj)
    assert owned["metadata"]["labels"] == {"a": "b", "app.kubernetes.io/managed-by": "Helm"}
    assert owned["metadata"]["annotations"] == {
        "meta.helm.sh/release-name": "dynamig",
        "meta.helm.sh/release-namespace": "dynamig-system",
    }
    assert obj["metadata"] == {"name": "mig.dynamig.io", "labels": {"a": "b"}}  # the input is left alone


def test_clearing_gpu_state_removes_only_the_simulated_gpus_files(tmp_path: Path) -> None:
    for name in ("nvml-n1.json", "nvml-n2.json", "state.json", "lock"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in clear_gpu_state(tmp_path)] == ["nvml-n1.json", "nvml-n2.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock", "state.json"]
    assert clear_gpu_state(tmp_path) == []


# --- MODEL:COUNT[:mig-off][:vm] --------------------------------------------------------------------------


def test_gpu_options_name_the_gpus_they_apply_to() -> None:
    node = parse_gpu_node("n1=A100-80GB:2:mig-off,H100-80GB:1,A30-24GB:1:vm:mig-off")
    assert node == GpuNode("n1", "A100-80GB:2,H100-80GB:1,A30-24GB:1", mig_off=(0, 1, 3), vm=(3,))
    assert node.keys() == ["A100-80GB", "A100-80GB", "H100-80GB", "A30-24GB"]
    assert parse_gpu_node("n1=A30-24GB:1:vm") == GpuNode("n1", "A30-24GB:1", vm=(0,))  # either order, alone
    assert parse_gpu_node("n1=H100-80GB:2:mig-off").mig_off == (0, 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("n1=A100-80GB:2:off", "unknown option 'off' in 'A100-80GB:2:off' \\(known: mig-off, vm\\)"),
        ("n1=A100-80GB:2:vm:vm", "'vm' given twice in 'A100-80GB:2:vm:vm'"),
        ("n1=A100-80GB:mig-off", "'A100-80GB:mig-off' needs a GPU count from 1 to 8"),
        ("n1=A100-80GB::vm", "needs a GPU count from 1 to 8"),
        ("n1=H100-80GB:1:vm", "vm \\(no GPU reset\\) changes nothing on H100-80GB"),
        ("n1=A100-80GB:1,B200-180GB:1:vm:mig-off", "changes nothing on B200-180GB"),
    ],
)
def test_bad_gpu_options_are_refused_in_one_line_naming_the_flag(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_gpu_node(text)
    assert str(err.value).startswith(f"--gpu-node {text!r}: ") and "\n" not in str(err.value)
    with pytest.raises(argparse.ArgumentTypeError, match=message):  # as `dev-cluster up` reads the flag
        gpu_node(text)


def test_the_agent_finds_its_gpus_options_in_the_state_file_the_sandbox_seeds(tmp_path: Path) -> None:
    node = parse_gpu_node("n1=A100-80GB:1:mig-off:vm,H100-80GB:1:mig-off,A30-24GB:1")
    state = tmp_path / "nvml-n1.json"
    assert seed_gpu_state(node, state)
    try:
        # What the agent does with --simulate-gpus and --state (dynamig.agent.main.load_nvml_module).
        simnvml.configure(node.keys(), state_file=state, seed=node.name)
        simnvml.nvmlInit()
        hs = [simnvml.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
        assert [simnvml.nvmlDeviceGetMigMode(h) for h in hs] == [[0, 0], [0, 0], [1, 1]]
        enable = pynvml.NVML_DEVICE_MIG_ENABLE
        assert simnvml.nvmlDeviceSetMigMode(hs[0], enable) == pynvml.NVML_ERROR_RESET_REQUIRED  # the VM
        assert simnvml.nvmlDeviceSetMigMode(hs[1], enable) == pynvml.NVML_SUCCESS
        seeded = [simnvml.nvmlDeviceGetUUID(h) for h in hs]
        # The GPU UUIDs are those the agent gives the node's GPUs without options.
        simnvml.configure(node.keys(), state_file=tmp_path / "plain.json", seed=node.name)
        simnvml.nvmlInit()
        assert [simnvml.nvmlDeviceGetUUID(simnvml.nvmlDeviceGetHandleByIndex(i)) for i in range(3)] == seeded
    finally:
        simnvml.reset()
    before = state.read_bytes()
    assert not seed_gpu_state(node, state) and state.read_bytes() == before  # a kept file is left alone
    assert not seed_gpu_state(parse_gpu_node("n2=A100-80GB:1"), tmp_path / "nvml-n2.json")  # no options
    assert not (tmp_path / "nvml-n2.json").exists()
