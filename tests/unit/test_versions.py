"""The Kubernetes targets: one primary version named the same in the build scripts and in Python."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dynamig.devcluster.versions import ALPHA_DRA_GATES, MATRIX, PRIMARY, KubeTarget, current, target

ROOT = Path(__file__).resolve().parents[2]


def test_the_build_scripts_default_to_the_primary_version() -> None:
    text = (ROOT / "hack" / "lib" / "k8s-module.sh").read_text()
    assert re.findall(r"^K8S_PRIMARY_VERSION=(\S+)$", text, re.M) == [PRIMARY]
    for script in ("build-control-plane.sh", "build-node.sh", "build-hold-scheduler.sh"):
        body = (ROOT / "hack" / script).read_text()
        assert 'K8S_VERSION="${DYNAMIG_K8S_VERSION:-$K8S_PRIMARY_VERSION}"' in body, script


def test_matrix_names_are_unique_and_the_primary_comes_first() -> None:
    names = [t.name for t in MATRIX]
    assert names[0] == PRIMARY and len(set(names)) == len(names)
    assert target("v1.35.4+alpha").feature_gates == ALPHA_DRA_GATES
    with pytest.raises(ValueError, match="unknown Kubernetes target"):
        target("v1.30.0")


def test_what_each_target_serves() -> None:
    assert [t.serves_partitionable for t in MATRIX] == [True, True, True, False]
    assert [t.chooses_partitionable for t in MATRIX] == [True, False, False, False]
    assert KubeTarget("v1.35.4").gate_flags() == []
    assert target("v1.35.4+alpha").gate_flags() == [
        "--feature-gates=DRAPartitionableDevices=true,DRADeviceBindingConditions=true"
    ]


def test_current_follows_the_environment() -> None:
    assert current({}) == KubeTarget(PRIMARY)
    assert current({"DYNAMIG_K8S_VERSION": "v1.36.3"}) == KubeTarget("v1.36.3")
    assert current({"DYNAMIG_K8S_TARGET": "v1.35.4+alpha", "DYNAMIG_K8S_VERSION": "v1.35.4"}).feature_gates
