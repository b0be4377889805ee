"""``--gpu-node NAME=MODEL:COUNT[,MODEL:COUNT]`` as `dynamig dev-cluster up` reads it: pure parsing."""

from __future__ import annotations

import pytest

from dynamig.devcluster.sandbox import GpuNode, parse_gpu_node


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
