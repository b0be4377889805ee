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
    _made_room(out)
    _whole_gpu(out)
    assert "(all of them free at the time)" in out, out
    assert "nothing is left running" in out
    assert _control_plane_pids_under(str(tmp_path)) == []


def _made_room(out: str) -> None:
    """The preemption chapter: the critical pod got a 3g.40gb by evicting the three 1g.10gb pods under it
    (at slice 4: three in the way, not four), and the batch pod that found no slice still waits."""
    got = re.search(
        r"critical-0 -> (gpu\d-3g40gb-s4); evicted ((?:batch-\d+(?:, )?)+) \(priority 0 < 1000\)", out
    )
    assert got, out
    assert len(got.group(2).split(", ")) == 3, got.group(0)
    assert re.search(r"^\s+14 batch pods got a slice; 1 wait", out, re.M), out
    assert re.search(r"^\s+1 batch pod\(s\) still wait", out, re.M), out


def _whole_gpu(out: str) -> None:
    """The whole-GPU chapter: one GPU switched off (one call to NVML), the pod got it whole."""
    got = re.search(r"train-whole -> (gpu(\d)); NVML asked to switch MIG mode 1 time\(s\)", out)
    assert got, out
    assert re.search(rf"^\s+gpu-node-a-{got.group(1)}\s+Disabled\s+whole\s*$", out, re.M), out


def _real_node_pids() -> set[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if "/dynamig-node-" in line}


def test_demo_on_a_real_node_runs_every_pod_on_its_own_slice(tmp_path: os.PathLike[str]) -> None:
    """``dynamig demo --real-node``: the same story with a kubelet and containerd; each container prints the
    MIG UUID and the capability device nodes it got, and all eight are distinct."""
    before = _real_node_pids()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "dynamig", "demo", "--real-node", "--cooldown", "3",
         "--log-file", f"{tmp_path}/demo.log"],
        capture_output=True, text=True, timeout=420, env=env, check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    print(out)
    seen = re.findall(
        r"^\s+((?:infer|train)-\d)\s+\+(\d+\.\d)s\s+(MIG-[0-9a-f-]+)\s+(nvidia-cap\d+) (nvidia-cap\d+)",
        out,
        re.M,
    )
    assert sorted(p for p, *_ in seen) == [*(f"infer-{i}" for i in range(7)), "train-0"], out
    assert len({uuid for _, _, uuid, *_ in seen}) == 8, "eight containers, eight MIG UUIDs"
    caps = [c for *_, gi, ci in seen for c in (gi, ci)]
    assert len(set(caps)) == 16, "no capability node shared between two containers"
    _made_room(out)
    assert re.search(r"^\s+critical-0\s+\+\d+\.\ds\s+MIG-", out, re.M), "the critical pod's container ran"
    _whole_gpu(out)
    # the whole GPU's container: its GPU UUID, no capability node
    assert re.search(r"^\s+train-whole\s+\+\d+\.\ds\s+GPU-[0-9a-f-]+\s*$", out, re.M), out
    assert "(all of them free at the time)" in out, out
    assert "nothing is left running" in out
    assert _real_node_pids() - before == set(), "the kubelet, containerd and shims are gone"
    assert _control_plane_pids_under(str(tmp_path)) == []
