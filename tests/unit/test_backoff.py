"""Back within seconds of an API server outage: no wait between two tries of the API server grows past 2 s,
however long it stays away, in the agent (its API calls, its watches) and the operator (its API calls, its
policy loops, Kopf's requests); a watch that lists again after the outage wakes the agent at once.

Sleeps are recorded instead of slept (``asyncio.sleep`` patched), so a five-minute outage takes milliseconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, cast

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.agent.kube.api import API_RETRY_MAX_S, KubeApi, backoff_delay
from dynamig.agent.kube.cache import Source, WatchedList
from dynamig.geometry.catalog import load_catalog
from dynamig.operator.handlers import kopf_settings
from dynamig.operator.kubeio import KubeIO
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.reconciler import Reconciler
from dynamig.operator.settings import OperatorSettings

OUTAGE_S = 300.0  # the longest outage the design is held to

real_sleep = asyncio.sleep


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """Every ``asyncio.sleep`` of more than zero seconds, recorded and not slept (a zero sleep yields)."""
    waited: list[float] = []

    async def record(seconds: float, result: Any = None) -> Any:
        if seconds > 0:
            waited.append(seconds)
        return await real_sleep(0, result)

    monkeypatch.setattr(asyncio, "sleep", record)
    yield waited


def refused() -> ConnectionRefusedError:
    return ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 6443)")


# --------------------------------------------------------------------------------------------- pure


def test_backoff_doubles_up_to_its_cap_and_never_overflows() -> None:
    assert [backoff_delay(n, 0.25, 2.0) for n in range(1, 7)] == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert backoff_delay(10**9, 0.5, API_RETRY_MAX_S) == API_RETRY_MAX_S  # no OverflowError, ever
    assert API_RETRY_MAX_S <= 3.0


# --------------------------------------------------------------------------------------------- API calls


async def spent_retries(retry: Callable[[Callable[[], Awaitable[None]]], Awaitable[None]]) -> None:
    async def call() -> None:
        raise refused()

    with pytest.raises(ConnectionRefusedError):
        await retry(call)


async def test_the_agents_api_calls_wait_at_most_2s_between_tries(sleeps: list[float]) -> None:
    api = KubeApi(cast(Any, object()), attempts=30)
    await spent_retries(lambda call: api._retry("read node", call))
    assert len(sleeps) == 29
    assert max(sleeps) <= 2.0
    assert sleeps[0] <= 0.2  # the first retry is quick


async def test_the_operators_api_calls_wait_at_most_2s_between_tries(sleeps: list[float]) -> None:
    io = KubeIO(cast(Any, object()), attempts=30)
    await spent_retries(io._retry)
    assert len(sleeps) == 29
    assert max(sleeps) <= 2.0
    assert sleeps[-1] == 2.0  # capped, not stopped growing by chance


def test_kopf_retries_every_request_within_2s_long_enough_for_a_5_minute_outage() -> None:
    ks = kopf_settings(OperatorSettings(standalone=True))
    backoffs = list(cast(tuple[float, ...], ks.networking.error_backoffs))
    assert max(backoffs) <= 2.0
    assert sum(backoffs) >= OUTAGE_S  # a request (a watch, the peering keep-alive) does not escalate
    assert ks.watching.reconnect_backoff <= 0.1
    assert ks.networking.connect_timeout is not None and ks.networking.connect_timeout <= 5
    assert ks.watching.connect_timeout is not None and ks.watching.connect_timeout <= 5
    # Not shorter than the API server's own limit on a request (60 s): a long LIST is not cut.
    assert ks.networking.request_timeout is not None and ks.networking.request_timeout >= 60


# --------------------------------------------------------------------------------------------- watches


class Quiet:
    """A watch response with nothing to say: connected until cancelled."""

    def __init__(self) -> None:
        self.content = self

    async def readline(self) -> bytes:
        await asyncio.Event().wait()
        return b""

    def close(self) -> None:
        pass

    def release(self) -> None:
        pass


class Dropped(Quiet):
    """A watch response whose connection breaks: the API server went away."""

    async def readline(self) -> bytes:
        raise ConnectionResetError(104, "Connection reset by peer")


def changed(old: dict[str, Any] | None, new: dict[str, Any] | None) -> bool:
    return old != new


LISTED = {"metadata": {"resourceVersion": "7"}, "items": [{"metadata": {"name": "n1"}}]}


class ApiServer:
    """A list function (LIST, or WATCH with ``watch=True``): the first LIST answers, the first WATCH breaks,
    the next ``down`` requests are refused, then everything answers again."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.calls: list[str] = []
        self.watching = asyncio.Event()

    async def __call__(self, *_: Any, watch: bool = False, **__: Any) -> Any:
        self.calls.append("watch" if watch else "list")
        if len(self.calls) == 2:
            return Dropped()
        if len(self.calls) > 2 and self.down > 0:
            self.down -= 1
            raise refused()
        if watch:
            self.watching.set()
            return Quiet()
        return LISTED


async def watched_through(down: int, on_reconnect: bool) -> tuple[WatchedList, ApiServer, list[str]]:
    """Run a copy through an outage of ``down`` refused requests until it watches again."""
    server = ApiServer(down)
    told: list[str] = []
    copy = WatchedList(Source("nodes", server), dict, lambda: told.append("wake"), changed)
    if on_reconnect:
        copy.on_reconnect = lambda: told.append("reconnect")
    stop = asyncio.Event()
    task = asyncio.create_task(copy.run(stop))
    try:
        await asyncio.wait_for(server.watching.wait(), timeout=10)
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return copy, server, told


async def test_a_watch_retries_within_2s_through_a_long_outage_then_lists_and_wakes_a_round(
    sleeps: list[float],
) -> None:
    down = 200  # refused requests: 200 waits of at most 2 s, about 6.5 minutes of outage
    copy, server, told = await watched_through(down, on_reconnect=True)
    assert max(sleeps) <= API_RETRY_MAX_S
    assert sum(sleeps) >= OUTAGE_S
    # The dropped stream is resumed once; then the API server is out of reach, and it is listed again.
    assert server.calls[:3] == ["list", "watch", "watch"]
    assert server.calls[3:-1] == ["list"] * down  # 199 refused, then the one that answers
    assert server.calls[-1] == "watch"
    assert copy.lists == 2
    # The first LIST filled the copy; the second changed nothing in it: only the reconnect starts a round.
    assert told == ["wake", "reconnect"]


async def test_one_dropped_stream_resumes_the_watch_without_a_list(sleeps: list[float]) -> None:
    copy, server, told = await watched_through(0, on_reconnect=True)
    assert server.calls == ["list", "watch", "watch"]
    assert copy.lists == 1
    assert sleeps == [0.25]
    assert told == ["wake"]  # the first LIST only


async def test_without_on_reconnect_the_reconnect_wakes(sleeps: list[float]) -> None:
    _, _, told = await watched_through(3, on_reconnect=False)
    assert told == ["wake", "wake"]


# --------------------------------------------------------------------------------------------- policy loop


class Stopped:
    def __init__(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag


RESYNC_S = 30.0
WINDOW_S = 5


def recording_reconciler(
    outcomes: list[BaseException | None], stopped: Stopped, log: list[Any]
) -> Reconciler:
    """A Reconciler whose rounds end as ``outcomes`` say (None: a good round; the last one stops the loop),
    and whose waits are recorded, not waited: ``("wait", s)`` can be cut short by a wake, ``("sleep", s)``
    cannot."""
    r = Reconciler(
        cast(KubeIO, object()), load_catalog(), OperatorMetrics(), OperatorSettings(resync_seconds=RESYNC_S)
    )

    async def rounds(name: str) -> None:
        outcome = outcomes[len([e for e in log if e[0] == "round"])]
        log.append(("round", type(outcome).__name__))
        if len([e for e in log if e[0] == "round"]) == len(outcomes):
            stopped.flag = True
        if outcome is not None:
            raise outcome

    async def wait(waker: asyncio.Event, stopped: Any, seconds: float) -> None:
        log.append(("wait", seconds))

    async def sleep(seconds: float, stopped: Any) -> None:
        log.append(("sleep", seconds))

    r.round = rounds  # type: ignore[method-assign]
    r._wait = wait  # type: ignore[method-assign]
    r._sleep = sleep  # type: ignore[method-assign]
    r._windows["p"] = WINDOW_S
    return r


async def test_a_policy_loop_rides_out_an_outage_retrying_within_2s_without_its_batch_window() -> None:
    """Connection errors and 5xx answers are retried by the loop itself (an error out of the daemon would
    wait Kopf's 60 s), at most 2 s apart, a connection error's wait cut short by a wake; a retry does not wait
    the batch window again; the first good round ends the outage."""
    stopped, log = Stopped(), cast(list[tuple[str, Any]], [])
    outcomes: list[BaseException | None] = [refused()] * 150 + [ApiException(status=503)] * 5 + [None]
    r = recording_reconciler(outcomes, stopped, log)
    await asyncio.wait_for(r.run_policy("p", stopped), timeout=30)
    steps = [e for e in log if e != ("wait", RESYNC_S)]  # the loop's wait for a wake or the resync
    assert steps[:2] == [("sleep", WINDOW_S), ("round", "ConnectionRefusedError")]  # the first round's window
    after = {"ConnectionRefusedError": "wait", "ApiException": "sleep"}
    retries = [(steps[i][1], steps[i + 1]) for i in range(1, len(steps) - 1) if steps[i][0] == "round"]
    assert len(retries) == 155
    for failed, (how, seconds) in retries:
        assert how == after[failed] and 0 < seconds <= 2.0, (failed, how, seconds)
    assert retries[-1][1] == ("sleep", 2.0)
    assert steps[-1] == ("round", "NoneType")
    assert ("sleep", WINDOW_S) not in steps[2:]


@pytest.mark.parametrize(("error", "cut_short"), [(refused(), True), (ApiException(status=503), False)])
async def test_a_wake_cuts_the_wait_short_only_after_a_connection_error(
    error: Exception, cut_short: bool
) -> None:
    """While the API server is out of reach no watch event comes; one that does shows it answers again, and
    the failed round is retried at once. An API server that answers with errors is not retried faster for
    its events."""
    stopped = Stopped()
    started: list[float] = []
    failed = asyncio.Event()

    async def rounds(name: str) -> None:
        started.append(time.monotonic())
        if len(started) == 1:
            failed.set()
            raise error  # the first failure: a 0.5 s wait
        stopped.flag = True

    r = Reconciler(cast(KubeIO, object()), load_catalog(), OperatorMetrics(), OperatorSettings())
    r.round = rounds  # type: ignore[method-assign]
    loop = asyncio.create_task(r.run_policy("p", stopped))
    await asyncio.wait_for(failed.wait(), timeout=10)
    await asyncio.sleep(0.05)
    r.wake()
    await asyncio.wait_for(loop, timeout=10)
    gap = started[1] - started[0]
    assert (gap < 0.4) if cut_short else (gap >= 0.5), gap


async def test_a_bug_still_ends_the_policy_loop() -> None:
    async def rounds(name: str) -> None:
        raise KeyError("a bug")

    r = Reconciler(cast(KubeIO, object()), load_catalog(), OperatorMetrics(), OperatorSettings())
    r.round = rounds  # type: ignore[method-assign]
    with pytest.raises(KeyError):
        await asyncio.wait_for(r.run_policy("p", Stopped()), timeout=10)
