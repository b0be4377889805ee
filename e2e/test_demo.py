"""``dynamig demo`` as a newcomer runs it: a subprocess that starts its own control plane and stops it.

Real: the whole command (control plane built from the Kubernetes sources, scheduler, controller manager,
operator, node agent). Simulated: the node's two A100-80GB GPUs (simulated NVML) and the node itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.controlplane


def _control_plane_pids_under(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if marker in line and ("kube-" in line or "etcd" in line)]


def test_demo_tells_the_story_and_leaves_nothing_running(tmp_path: os.PathLike[str]) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the demo's control plane lives under this directory
    proc = subprocess.run(
        [sys.executable, "-m", "dynamig", "demo", "--cooldown", "3", "--log-file", f"{tmp_path}/demo.log"],
        capture_output=True, text=True, timeout=420, env=env, check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    pods = re.findall(r"^\s+(infer-\d)\s+(gpu\d-\S+)", out, flags=re.MULTILINE)
    assert len(pods) == 7 and len({dev for _, dev in pods}) == 7, out  # seven pods, seven distinct slices
    assert all(re.search(r"-(1g10gb|2g20gb)-", dev) for _, dev in pods), pods
    assert re.search(r"train-0 -> gpu\d-3g40gb-s[04]", out), out
    assert "(all of them free at the time)" in out, out
    assert "nothing is left running" in out
    assert _control_plane_pids_under(str(tmp_path)) == []
