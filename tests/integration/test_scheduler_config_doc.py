"""The scheduler configurations docs/install.md recommends (packing score, binding timeout; for large
clusters, the share of nodes visited and the score weights) are ones the kube-scheduler of every Kubernetes
target accepts (1.35 without the alpha gates: without the binding timeout, as the docs say).

Real: the kube-scheduler binary the control plane uses, with ``--write-config-to`` (it loads and validates the
file, writes the defaulted result and exits without contacting an API server). The snippet is read from the
docs, so an edit that breaks it fails here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from dynamig.devcluster import find_binaries
from dynamig.devcluster.versions import KubeTarget

pytestmark = [pytest.mark.controlplane, pytest.mark.matrix]

DOC = Path(__file__).resolve().parents[2] / "docs" / "install.md"
DUMMY_KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: x}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def documented_config() -> dict[str, object]:
    section = DOC.read_text().split("### Multi-GPU jobs: give the scheduler a packing score", 1)[1]
    match = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert match is not None, "no yaml block in the section"
    loaded: dict[str, object] = yaml.safe_load(match.group(1))
    return loaded


def write_config(
    tmp_path: Path, config: dict[str, object], gates: list[str]
) -> subprocess.CompletedProcess[str]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(DUMMY_KUBECONFIG)
    path = tmp_path / "scheduler.yaml"
    path.write_text(yaml.safe_dump({**config, "clientConnection": {"kubeconfig": str(kubeconfig)}}))
    scheduler = find_binaries().kube_scheduler
    out = tmp_path / "effective.yaml"
    # --secure-port=0: nothing is served, so runs at once (the matrix targets run together) never meet on
    # the default port 10259, which kube-scheduler binds before it writes the config and exits
    return subprocess.run(
        [str(scheduler), "--config", str(path), "--write-config-to", str(out), "--secure-port=0", *gates],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_documented_packing_score_is_accepted_by_kube_scheduler(
    tmp_path: Path, kube_target: KubeTarget
) -> None:
    config = documented_config()
    gates = kube_target.gate_flags()
    if not kube_target.serves_partitionable:
        refused = write_config(tmp_path, config, gates)
        assert refused.returncode != 0
        assert (
            "DRADeviceBindingConditions or DRAResourceClaimDeviceStatus feature gate is disabled"
            in refused.stderr
        )
        assert (
            "DRADeviceBindingConditions or DRAResourceClaimDeviceStatus feature gate is disabled"
            in DOC.read_text()
        )
        for profile in config["profiles"]:  # type: ignore[attr-defined]
            profile["pluginConfig"] = [c for c in profile["pluginConfig"] if c["name"] != "DynamicResources"]
    done = write_config(tmp_path, config, gates)
    assert done.returncode == 0, done.stderr[-2000:]
    effective = yaml.safe_load((tmp_path / "effective.yaml").read_text())
    (profile,) = [p for p in effective["profiles"] if p["schedulerName"] == "default-scheduler"]
    (fit,) = [c["args"] for c in profile["pluginConfig"] if c["name"] == "NodeResourcesFit"]
    assert fit["scoringStrategy"]["type"] == "MostAllocated"
    if kube_target.serves_partitionable:
        (dra,) = [c["args"] for c in profile["pluginConfig"] if c["name"] == "DynamicResources"]
        assert dra["bindingTimeout"] == "1m0s"  # the default would be 10m0s

    # the check can fail: the same file with a misspelt strategy is refused
    bad = yaml.safe_load(yaml.safe_dump(config).replace("MostAllocated", "MostAlocated"))
    refused = write_config(tmp_path, bad, gates)
    assert refused.returncode != 0 and "MostAlocated" in refused.stderr


def large_cluster_config() -> dict[str, object]:
    section = DOC.read_text().split("### Large clusters", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "one yaml block in the section"
    loaded: dict[str, object] = yaml.safe_load(blocks[0])
    return loaded


def test_the_documented_large_cluster_settings_are_what_kube_scheduler_runs_with(
    tmp_path: Path, kube_target: KubeTarget
) -> None:
    config = large_cluster_config()
    done = write_config(tmp_path, config, kube_target.gate_flags())
    assert done.returncode == 0, done.stderr[-2000:]
    effective = yaml.safe_load((tmp_path / "effective.yaml").read_text())
    assert effective["percentageOfNodesToScore"] == 10  # the default leaves it unset (adaptive)
    (profile,) = [p for p in effective["profiles"] if p["schedulerName"] == "default-scheduler"]
    weights = {p["name"]: p.get("weight") for p in profile["plugins"]["multiPoint"]["enabled"]}
    assert weights["DynamicResources"] == 2
    assert weights["NodeResourcesFit"] == 2  # 1 by default
    (fit,) = [c["args"] for c in profile["pluginConfig"] if c["name"] == "NodeResourcesFit"]
    assert fit["scoringStrategy"]["type"] == "MostAllocated"

    # the check can fail: a share over 100 and a plugin that does not exist are refused
    over = {**config, "percentageOfNodesToScore": 150}
    refused = write_config(tmp_path, over, kube_target.gate_flags())
    assert refused.returncode != 0 and "percentageOfNodesToScore" in refused.stderr, refused.stderr[-2000:]
    typo = yaml.safe_load(yaml.safe_dump(config).replace("name: DynamicResources", "name: DynamicResource"))
    refused = write_config(tmp_path, typo, kube_target.gate_flags())
    assert refused.returncode != 0 and "DynamicResource" in refused.stderr, refused.stderr[-2000:]
