"""Progress while something slow runs or waits: a build script's own lines, and a heartbeat on a lock wait.

The build scripts (``hack/build-*.sh``) print their result (a path) on stdout and their progress on stderr:
step lines (``==> go build kubelet v1.37.2``, ``... done in 312s``) and a heartbeat while they wait on
another process's build lock (hack/lib/progress.sh). A first build takes many minutes, so
:func:`run_streaming` passes that stderr through line by line as it comes instead of holding it back until
the end; its last lines are kept for the error message when the script fails. :func:`lock_with_heartbeat` is
the same heartbeat for a lock this process takes itself.
"""

from __future__ import annotations

import collections
import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TextIO

HEARTBEAT_ENV = (
    "DYNAMIG_LOCK_HEARTBEAT_S"  # seconds between heartbeat lines, as hack/lib/progress.sh reads it
)
DEFAULT_HEARTBEAT_S = 20.0


def heartbeat_seconds() -> float:
    """The heartbeat interval: ``DYNAMIG_LOCK_HEARTBEAT_S`` when set to a positive number, else 20 s."""
    try:
        value = float(os.environ.get(HEARTBEAT_ENV, ""))
    except ValueError:
        return DEFAULT_HEARTBEAT_S
    return value if value > 0 else DEFAULT_HEARTBEAT_S


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def lock_with_heartbeat(
    file: int | IO[Any],
    what: str,
    *,
    say: Callable[[str], None] | None = None,
    every_s: float | None = None,
) -> float:
    """Takes an exclusive ``flock`` on ``file``. While another process holds it, ``say`` (a line on stderr by
    default) hears what it waits for, then every ``every_s`` seconds (:func:`heartbeat_seconds`) for how
    long, then how long it waited in all. Returns the seconds waited (0 when the lock was free, silently).
    Side effect: the lock, held until the file is closed or unlocked."""
    out = say or _stderr_line
    every = every_s if every_s is not None else heartbeat_seconds()
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return 0.0
    except BlockingIOError:
        pass
    start = time.monotonic()
    next_beat = start + every
    out(f"==> waiting for {what}: another process holds its lock")
    # Polled rather than blocking, so the heartbeat needs no second thread.
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now >= next_beat:
            out(f"==> still waiting for {what} (another process holds its lock): {int(now - start)}s")
            next_beat = now + every
        time.sleep(min(0.1, every / 4))
    waited = time.monotonic() - start
    out(f"==> waited {int(waited)}s for {what}")
    return waited


@dataclass(frozen=True)
class ScriptResult:
    returncode: int
    stdout: str
    stderr_tail: str  # the last lines of stderr, for an error message


def run_streaming(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    echo: TextIO | None = None,
    tail_lines: int = 40,
) -> ScriptResult:
    """Runs ``argv``, writing each line of its stderr to ``echo`` (this process's stderr by default) as it
    arrives, and returns its exit code, its whole stdout and the last ``tail_lines`` lines of its stderr.
    Raises :class:`subprocess.TimeoutExpired` after ``timeout`` seconds (the process is killed first).
    Side effects: the command's."""
    out = echo if echo is not None else sys.stderr
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    with subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=dict(env) if env is not None else None,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        bufsize=1,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        stdout, stderr = proc.stdout, proc.stderr
        stdout_chunks: list[str] = []
        # stdout is read beside stderr: a full pipe on either side would block the script.
        reader = threading.Thread(target=lambda: stdout_chunks.append(stdout.read()), daemon=True)
        reader.start()
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(timeout, expire) if timeout is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            for line in stderr:
                out.write(line)
                out.flush()
                tail.append(line.rstrip("\n"))
            proc.wait()
            reader.join()
        except BaseException:
            proc.kill()  # Ctrl-C or an echo that failed: stop the script rather than wait on it
            raise
        finally:
            if timer is not None:
                timer.cancel()
    if timed_out.is_set():
        raise subprocess.TimeoutExpired(list(argv), timeout or 0.0, output="".join(stdout_chunks))
    return ScriptResult(proc.returncode, "".join(stdout_chunks), "\n".join(tail))
