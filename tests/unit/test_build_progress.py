"""Progress of the long first set-up: hack/lib/progress.sh's step lines and build-lock heartbeat, and the
Python side (dynamig.devcluster.progress): the same heartbeat on a lock, and a build script's progress
passed through while it runs.

Nothing is built: the shell functions run around ``sleep`` and a lock another process holds.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamig.devcluster.progress import heartbeat_seconds, lock_with_heartbeat, run_streaming

ROOT = Path(__file__).resolve().parents[2]
PROGRESS = ROOT / "hack" / "lib" / "progress.sh"
STEP = ROOT / "hack" / "step.sh"

# Holds an exclusive flock on argv[1] (the kind flock(1) takes) for argv[2] seconds, saying when it has it.
HOLDER = """
import fcntl, sys, time
with open(sys.argv[1], "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _bash(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; source "{PROGRESS}"; {script}'],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
        check=False,
    )


def test_lock_wait_prints_a_heartbeat_while_another_process_builds_then_how_long_it_waited(
    tmp_path: Path,
) -> None:
    lock = tmp_path / ".lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock), "2.5"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        proc = _bash(
            f'exec 9>"{lock}"; wait_for_lock 9 "the test tool"; echo got-it',
            env={"DYNAMIG_LOCK_HEARTBEAT_S": "0.4"},
        )
        waited = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "got-it"  # stdout stays the script's result; progress is on stderr
    assert waited > 1.0  # it did wait for the holder
    lines = proc.stderr.splitlines()
    assert lines[0] == "==> waiting for the test tool: another process holds its build lock"
    beats = [
        int(m[1])
        for line in lines
        if (
            m := re.fullmatch(
                r"==> still waiting for the test tool \(another process is building it\): (\d+)s", line
            )
        )
    ]
    assert len(beats) >= 2, proc.stderr  # about one per 0.4 s of the ~2.5 s wait
    assert beats == sorted(beats) and beats[-1] <= 3
    final = re.fullmatch(r"==> waited (\d+)s for the test tool", lines[-1])
    assert final is not None, proc.stderr
    assert 1 <= int(final[1]) <= 3
    assert len(lines) == 2 + len(beats)  # nothing else


def test_a_free_lock_is_taken_without_a_word(tmp_path: Path) -> None:
    proc = _bash(f'exec 9>"{tmp_path / ".lock"}"; wait_for_lock 9 "the test tool"; echo got-it')
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "got-it", "")


def test_python_lock_wait_has_the_same_heartbeat(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock), "2.5"], stdout=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with open(lock, "w") as fh:
            waited = lock_with_heartbeat(fh, "the test cluster's state", say=lines.append, every_s=0.4)
    finally:
        holder.kill()
        holder.wait()
    assert waited > 1.0
    assert lines[0] == "==> waiting for the test cluster's state: another process holds its lock"
    beats = [
        line for line in lines[1:-1] if line.startswith("==> still waiting for the test cluster's state")
    ]
    assert len(beats) >= 2 and len(beats) == len(lines) - 2, lines
    assert re.fullmatch(r"==> waited [123]s for the test cluster's state", lines[-1]), lines


def test_python_lock_wait_is_silent_when_the_lock_is_free(tmp_path: Path) -> None:
    lines: list[str] = []
    with open(tmp_path / ".lock", "w") as fh:
        assert lock_with_heartbeat(fh, "x", say=lines.append, every_s=0.1) == 0.0
    assert lines == []


def test_the_heartbeat_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNAMIG_LOCK_HEARTBEAT_S", "0.5")
    assert heartbeat_seconds() == 0.5
    for bad in ("", "soon", "0", "-3"):
        monkeypatch.setenv("DYNAMIG_LOCK_HEARTBEAT_S", bad)
        assert heartbeat_seconds() == 20.0


def test_step_prints_its_name_then_its_elapsed_time() -> None:
    proc = subprocess.run(
        [
            "bash",
            str(STEP),
            "building the test tool v1.2.3",
            "sh",
            "-c",
            "echo compiling >&2; sleep 1.1; echo out",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "out\n"
    first, middle, last = proc.stderr.splitlines()
    assert (first, middle) == ("==> building the test tool v1.2.3", "compiling")
    assert re.fullmatch(r"==> building the test tool v1\.2\.3 \.\.\. done in [12]s", last), last


def test_a_failed_step_says_so_with_its_exit_status() -> None:
    proc = subprocess.run(
        ["bash", str(STEP), "the failing step", "sh", "-c", "exit 3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 3
    assert proc.stderr.splitlines() == [
        "==> the failing step",
        "==> the failing step ... failed after 0s (exit 3)",
    ]


def test_nested_steps_and_the_exit_trap_of_a_failing_build_script() -> None:
    # The build scripts' shape: an outer step, inner ones, `trap 'step_abort; ...' EXIT`, set -e.
    proc = _bash(
        "trap 'step_abort; echo cleaned >&2' EXIT; "
        'step_begin "building the tools"; step_begin "go mod tidy"; step_end; '
        'step_begin "go build"; false; step_end; step_end'
    )
    assert proc.returncode == 1  # the trap keeps the script's exit status
    assert proc.stderr.splitlines() == [
        "==> building the tools",
        "==> go mod tidy",
        "==> go mod tidy ... done in 0s",
        "==> go build",
        "==> go build ... failed after 0s (exit 1)",
        "==> building the tools ... failed after 0s (exit 1)",
        "cleaned",
    ]


def test_a_successful_script_leaves_no_failure_lines() -> None:
    proc = _bash("trap step_abort EXIT; step_begin outer; step_begin inner; step_end; step_end; exit 0")
    assert proc.returncode == 0
    assert proc.stderr.splitlines() == [
        "==> outer",
        "==> inner",
        "==> inner ... done in 0s",
        "==> outer ... done in 0s",
    ]


def test_run_streaming_passes_stderr_through_as_it_comes_and_keeps_stdout(tmp_path: Path) -> None:
    echo = io.StringIO()
    script = "echo '==> step' >&2; echo /the/result; for i in 1 2 3; do echo line$i >&2; done"
    result = run_streaming(["bash", "-c", script], cwd=tmp_path, echo=echo, tail_lines=2)
    assert result.returncode == 0
    assert result.stdout == "/the/result\n"
    assert echo.getvalue() == "==> step\nline1\nline2\nline3\n"
    assert result.stderr_tail == "line2\nline3"


def test_run_streaming_shows_a_line_before_the_script_ends(tmp_path: Path) -> None:
    class Clock(io.StringIO):
        first_at: float | None = None

        def write(self, s: str) -> int:
            if self.first_at is None:
                self.first_at = time.monotonic()
            return super().write(s)

    echo = Clock()
    started = time.monotonic()
    run_streaming(["bash", "-c", "echo early >&2; sleep 1.5"], cwd=tmp_path, echo=echo)
    assert echo.first_at is not None and echo.first_at - started < 1.2


def test_run_streaming_times_out(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_streaming(["sleep", "30"], cwd=tmp_path, echo=io.StringIO(), timeout=0.5)
