"""Child processes that never outlive their owner.

Every component runs in its own process group (so a stop reaches anything it forked) with its output in a
log file. Three layers make sure nothing is left behind:

- ``Component.stop`` sends SIGTERM to the group, waits, then SIGKILLs it;
- an ``atexit`` hook stops every component still running when the interpreter exits;
- on Linux the child asks the kernel for SIGKILL when its parent thread dies (``PR_SET_PDEATHSIG``), which
  covers an owner killed with SIGKILL. This is only armed when spawning from the main thread, because the
  kernel ties it to the spawning *thread*, and a worker thread may exit while the component should live on.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_live: set[Component] = set()  # strong refs: a forgotten component must still be stopped at exit
_live_lock = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 free a moment ago, picked by the kernel. Side effect: binds briefly."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pdeathsig_preexec() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child should do little
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return arm


class Component:
    """One running control-plane process. Created by :meth:`spawn`."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self.started_at = time.monotonic()

    @classmethod
    def spawn(
        cls, name: str, argv: Sequence[str], *, log_path: Path, cwd: Path, env: dict[str, str] | None = None
    ) -> Component:
        """Start ``argv`` in a new session with stdout and stderr appended to ``log_path``. Side effects."""
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                start_new_session=True,
                preexec_fn=_pdeathsig_preexec(),
            )
        comp = cls(name, popen, log_path)
        with _live_lock:
            _live.add(comp)
        return comp

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        """The last ``lines`` lines of the component's log (for error messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the component's process group; a group already gone is fine."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the group, wait up to ``timeout`` seconds, then SIGKILL it and reap. Idempotent."""
        stop_all([self], timeout)


def wait_for(
    comp: Component,
    probe: Callable[[], bool],
    *,
    deadline: float,
    what: str,
    fail: Callable[[str], BaseException],
    tail_lines: int = 25,
) -> float:
    """Polls ``probe`` until it passes; returns the seconds since ``comp`` started. Raises ``fail(message)``,
    the message naming ``what`` with the end of the component's log, when the process exits first or the
    monotonic ``deadline`` passes."""
    delay = 0.05
    while not probe():
        if not comp.running():
            code = comp.popen.returncode
            raise fail(
                f"{comp.name} exited with code {code}; log {comp.log_path}:\n{comp.log_tail(tail_lines)}"
            )
        if time.monotonic() > deadline:
            raise fail(f"{what} not seen in time; log {comp.log_path}:\n{comp.log_tail(tail_lines)}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
    return time.monotonic() - comp.started_at


def stop_all(components: Sequence[Component], timeout: float = 5.0) -> None:
    """Stop several components at once (SIGTERM all, one shared wait, SIGKILL the rest). Side effects."""
    for comp in components:
        comp.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for comp in components:
        with contextlib.suppress(subprocess.TimeoutExpired):
            comp.popen.wait(max(0.0, deadline - time.monotonic()))
    for comp in components:
        # The leader may have exited while a forked child lives on in the group: always sweep the group.
        comp.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            comp.popen.wait(5)
        with _live_lock:
            _live.discard(comp)


def _stop_leftovers() -> None:
    with _live_lock:
        leftovers = list(_live)
    if leftovers:
        stop_all(leftovers, timeout=3.0)


atexit.register(_stop_leftovers)
