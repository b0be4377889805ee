"""``--gpu-node NAME=MODEL:COUNT[,MODEL:COUNT]`` as `dynamig dev-cluster up` reads it: pure parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamig.devcluster.sandbox import GpuNode, clear_gpu_state, owned_by_chart_release, parse_gpu_node


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
