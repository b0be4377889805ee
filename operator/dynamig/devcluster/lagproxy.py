"""A proxy between kube-scheduler and kube-apiserver that makes the real scheduler lag on purpose (tests).

The design assumes kube-scheduler's informers may lag by tens of seconds and that nothing acknowledges which
ResourceSlice it holds (DESIGN.md, "Never assume what the scheduler has seen"). This proxy turns that lag,
and a few other interleavings, into something a test can choose:

- **hold** the watch events of chosen resources (``resourceslices``, ``pods``, ...) ``L`` seconds each, in
  order: every newline-delimited JSON event is delivered ``L`` seconds after the API server sent it;
- **drop** the open watches of a resource: the client gets a 410 ``Expired`` ERROR event, which makes a
  client-go reflector list again (a plain closed stream would only make it watch again from where it was);
- **stall or fail** a pod status patch that sets ``status.nominatedNodeName`` (what kube-scheduler writes at
  the start of a binding cycle).

It listens on plain HTTP on 127.0.0.1 and forwards every request to the API server over TLS with the
scheduler's client certificate, so the scheduler needs no credentials of its own and keeps its RBAC. Watch
responses must be JSON: :func:`lagging_control_plane` sets ``clientConnection.contentType`` so. The proxy
runs its own event loop in a thread, so a test's loop (agent, NVML calls) never slows it down, and its
settings are changed from the test at any time (plain attribute writes and thread-safe methods).

Usage::

    with lagging_control_plane(tmp_path) as (cp, proxy):
        proxy.hold("resourceslices", 30)      # the scheduler sees every slice change 30 s late
        ...
        proxy.reset()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qs

import aiohttp
import yaml
from aiohttp import web

from dynamig.devcluster.controlplane import ControlPlane

log = logging.getLogger(__name__)

# Headers that belong to one hop, never forwarded (RFC 9110 7.6.1), and the ones the proxy sets itself.
_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length", "authorization",
}  # fmt: skip
_EXPIRED = {
    "type": "ERROR",
    "object": {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "watch dropped by the lag proxy",
        "reason": "Expired",
        "code": 410,
    },
}


@dataclasses.dataclass(frozen=True)
class Upstream:
    """Where the proxy forwards to, and as whom."""

    url: str  # https://127.0.0.1:PORT
    ca: Path
    cert: Path
    key: Path


def scheduler_upstream(cp: ControlPlane) -> Upstream:
    """The API server of ``cp``, as kube-scheduler (its client certificate). Read when first needed."""
    pki = cp.pki
    return Upstream(cp.server_url, pki.ca.cert, pki.scheduler.cert, pki.scheduler.key)


@dataclasses.dataclass(frozen=True)
class Seen:
    """One request the proxy answered (``status`` 0: the watch is still open or was cut)."""

    at: float  # time.monotonic() when it arrived
    method: str
    path: str
    query: str
    resource: str
    watch: bool
    status: int


@dataclasses.dataclass(frozen=True)
class Delivered:
    """One watch event (or one item of a list, type ``LIST``): when the API server sent it and when the proxy
    passed it on."""

    resource: str
    type: str
    name: str
    version: str  # the object's resourceVersion
    received: float  # time.monotonic()
    delivered: float


def resource_of(path: str) -> str:
    """The plural resource a request path names: ``pods`` for ``/api/v1/namespaces/ns/pods/p/status``,
    ``resourceslices`` for ``/apis/resource.k8s.io/v1/resourceslices``; '' for anything else. Pure."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        rest = parts[2:]
    elif parts[:1] == ["apis"]:
        rest = parts[3:]
    else:
        return ""
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    return rest[0] if rest else ""


def is_watch(query: str) -> bool:
    """``?watch=true`` or ``watch=1`` (client-go and kubectl spell it both ways). Pure."""
    values = parse_qs(query).get("watch", [])
    return any(v.lower() in ("true", "1") for v in values)


def sets_nomination(method: str, path: str, body: bytes) -> bool:
    """A pod status write that sets ``status.nominatedNodeName`` to a node (a clear does not count). Pure."""
    parts = [p for p in path.split("/") if p]
    if method not in ("PATCH", "PUT") or len(parts) < 3 or parts[-1] != "status" or parts[-3] != "pods":
        return False
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        return False
    status = doc.get("status") if isinstance(doc, dict) else None
    return isinstance(status, dict) and bool(status.get("nominatedNodeName"))


class _Watch:
    def __init__(self, resource: str) -> None:
        self.resource = resource
        self.dropped = asyncio.Event()
        self.flush_before = 0.0  # events received before this (time.monotonic()) go out without waiting
        self.flushed = asyncio.Event()  # wakes the writer when that moves


class LagProxy:
    """The proxy. :meth:`start` it (a thread with its own event loop), point a client at :attr:`url`, change
    what it does with :meth:`hold`, :meth:`drop`, :meth:`stall_nominations`, :meth:`fail_nominations`,
    :meth:`reset`; :meth:`stop` it. ``upstream`` is called at each request (the API server's port and
    certificates may not exist yet when the proxy starts, and change when a start is retried)."""

    def __init__(self, upstream: Callable[[], Upstream], *, port: int = 0) -> None:
        self._upstream_factory = upstream
        self._port = port
        self.lag_s: dict[str, float] = {}  # resource -> seconds each watch event is held
        self.nomination_stall_s = 0.0
        self.nomination_fail_status: int | None = None
        self.requests: list[Seen] = []
        self.events: list[Delivered] = []
        self.nominations: list[tuple[float, str]] = []  # (time.monotonic(), pod path) of each one seen
        self._watches: set[_Watch] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None
        self._upstream: Upstream | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None

    # ----------------------------------------------------------------------------------------- control
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def hold(self, resource: str, seconds: float) -> None:
        """Deliver each watch event of ``resource`` ``seconds`` after it arrives (0: at once). Takes effect
        for events arriving from now on; events already held keep their time, and the order is kept."""
        self.lag_s[resource] = float(seconds)

    def stall_nominations(self, seconds: float) -> None:
        """Hold each pod status write that sets ``status.nominatedNodeName`` ``seconds``, then forward it."""
        self.nomination_stall_s = float(seconds)

    def fail_nominations(self, status: int | None = 500) -> None:
        """Answer every pod status write that sets ``status.nominatedNodeName`` with HTTP ``status`` (not
        forwarded); None forwards them again."""
        self.nomination_fail_status = status

    def reset(self) -> None:
        """No lag, no stall, no failure; what open watches still hold is delivered now, in order. (Dropping
        them instead would make the client's reflector back off, up to 30 s after a few drops.)"""
        self.lag_s.clear()
        self.nomination_stall_s = 0.0
        self.nomination_fail_status = None
        loop = self._loop
        if loop is None or not self._ready.is_set() or self._thread is None:
            return

        async def flush() -> None:
            now = time.monotonic()
            for w in self._watches:
                w.flush_before = now
                w.flushed.set()

        asyncio.run_coroutine_threadsafe(flush(), loop).result(timeout=10)

    def drop(self, resource: str) -> int:
        """End every open watch of ``resource`` with a 410 Expired event (the client lists again); returns
        how many were dropped. Events the proxy still held for them are lost, as on a broken connection."""
        loop = self._loop
        assert loop is not None, "proxy not started"

        async def cut() -> int:
            hit = [w for w in self._watches if w.resource == resource]
            for w in hit:
                w.dropped.set()
            return len(hit)

        return asyncio.run_coroutine_threadsafe(cut(), loop).result(timeout=10)

    def open_watches(self, resource: str) -> int:
        return sum(1 for w in list(self._watches) if w.resource == resource)

    def delivered(self, resource: str, name: str, version: str) -> bool:
        """Whether an event of object ``name`` at ``version`` or later went through to a client: what it has
        seen of that object at least (resourceVersions compared as numbers, as etcd issues them)."""
        want = int(version)
        return any(
            d.resource == resource and d.name == name and d.version.isdigit() and int(d.version) >= want
            for d in list(self.events)
        )

    def seen(self, resource: str, *, since: float = 0.0) -> list[Seen]:
        """Requests for ``resource`` that arrived at or after ``since`` (time.monotonic())."""
        return [s for s in list(self.requests) if s.resource == resource and s.at >= since]

    # ----------------------------------------------------------------------------------------- lifecycle
    def start(self) -> LagProxy:
        """Bind 127.0.0.1 (``port``, or a free one); serve in a daemon thread. Side effects: thread, port."""
        self._thread = threading.Thread(target=self._run, name="lagproxy", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if self._failed is not None:
            raise RuntimeError(f"lag proxy did not start: {self._failed}") from self._failed
        if not self._ready.is_set():
            raise RuntimeError("lag proxy did not start in 30 s")
        return self

    def stop(self) -> None:
        """Close the listener, every open watch and the upstream session; join the thread. Idempotent."""
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stopping.set)
        if self._thread is not None:
            self._thread.join(timeout=15)
            self._thread = None

    def __enter__(self) -> LagProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start(); a thread has no one else to tell
            self._failed = exc
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # Open watches end when dropped below; nothing else needs the default 60 s of grace.
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self._port)
        await site.start()
        server = getattr(site, "_server", None)
        if self._port == 0 and server is not None and server.sockets:
            self._port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stopping.wait()
        finally:
            for w in list(self._watches):
                w.dropped.set()
            await runner.cleanup()
            if self._session is not None:
                await self._session.close()

    def _client(self) -> tuple[aiohttp.ClientSession, Upstream]:
        up = self._upstream_factory()  # per request: a control plane may retry its start on new ports
        if self._session is None or self._upstream != up:
            if self._session is not None:
                asyncio.get_running_loop().create_task(self._session.close())
            ctx = ssl.create_default_context(cafile=str(up.ca))
            ctx.load_cert_chain(str(up.cert), str(up.key))
            self._upstream = up
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ctx, limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                auto_decompress=False,  # bytes pass through as the API server encoded them
            )
        return self._session, self._upstream

    # ----------------------------------------------------------------------------------------- forwarding
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        path, query = request.path, request.query_string
        resource, watch = resource_of(path), is_watch(query)
        body = await request.read()
        if sets_nomination(request.method, path, body):
            self.nominations.append((arrived, path))
            if self.nomination_stall_s > 0:
                await asyncio.sleep(self.nomination_stall_s)
            failing = self.nomination_fail_status
            if failing is not None:
                self.requests.append(Seen(arrived, request.method, path, query, resource, watch, failing))
                status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                          "message": "nomination refused by the lag proxy", "code": failing}  # fmt: skip
                return web.json_response(status, status=failing)
        session, up = self._client()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        if watch:  # one event per line, readable here (aiohttp would ask for gzip of its own accord)
            headers = {k: v for k, v in headers.items() if k.lower() != "accept-encoding"}
            headers["Accept-Encoding"] = "identity"
        url = f"{up.url}{path}" + (f"?{query}" if query else "")
        try:
            upstream = await session.request(request.method, url, headers=headers, data=body or None)
        except (aiohttp.ClientError, OSError) as exc:
            self.requests.append(Seen(arrived, request.method, path, query, resource, watch, 502))
            return web.Response(status=502, text=f"lag proxy: API server unreachable: {exc}")
        async with upstream:
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
            if not watch or upstream.status != 200:
                data = await upstream.read()
                self.requests.append(
                    Seen(arrived, request.method, path, query, resource, watch, upstream.status)
                )
                if request.method == "GET" and upstream.status == 200 and resource:
                    # A list hands the client objects too: on record like events, so delivered() holds
                    # after a re-list. Read-only: the bytes go on unchanged.
                    now = time.monotonic()
                    for name, version in _listed(data, upstream.headers.get("Content-Encoding", "")):
                        self.events.append(Delivered(resource, "LIST", name, version, arrived, now))
                return web.Response(status=upstream.status, body=data, headers=out_headers)
            self.requests.append(Seen(arrived, request.method, path, query, resource, watch, 0))
            response = web.StreamResponse(status=upstream.status, headers=out_headers)
            await response.prepare(request)
            await self._stream(resource, upstream, response)
            return response

    async def _stream(
        self, resource: str, upstream: aiohttp.ClientResponse, response: web.StreamResponse
    ) -> None:
        """Pass the watch's events on, each when its time comes; stop on drop, end of stream or stop()."""
        w = _Watch(resource)
        self._watches.add(w)
        held: asyncio.Queue[tuple[float, float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            # Split by hand: an event (a ResourceSlice with every placement) may exceed readline()'s limit.
            buf = b""
            try:
                async for chunk in upstream.content.iter_any():
                    buf += chunk
                    while (cut := buf.find(b"\n")) >= 0:
                        line, buf = buf[: cut + 1], buf[cut + 1 :]
                        now = time.monotonic()
                        held.put_nowait((now, now + self.lag_s.get(resource, 0.0), line))
            except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError):
                pass
            held.put_nowait(None)

        async def write() -> None:
            while (item := await held.get()) is not None:
                received, due, line = item
                while received > w.flush_before and (wait := due - time.monotonic()) > 0:
                    w.flushed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(w.flushed.wait(), wait)
                await response.write(line)
                self.events.append(Delivered(resource, *_event_head(line), received, time.monotonic()))

        reader = asyncio.create_task(read())
        writer = asyncio.create_task(write())
        dropped = asyncio.create_task(w.dropped.wait())
        try:
            done, _ = await asyncio.wait({writer, dropped}, return_when=asyncio.FIRST_COMPLETED)
            if dropped in done and not writer.done():
                writer.cancel()
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await response.write(json.dumps(_EXPIRED).encode() + b"\n")
            elif writer.done():
                with contextlib.suppress(ConnectionError, RuntimeError):
                    writer.result()
        except (ConnectionError, RuntimeError):
            pass  # the client went away
        finally:
            for task in (reader, writer, dropped):
                task.cancel()
            await asyncio.gather(reader, writer, dropped, return_exceptions=True)
            self._watches.discard(w)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write_eof()


def _event_head(line: bytes) -> tuple[str, str, str]:
    """(type, object name, resourceVersion) of one JSON watch event; empty strings when it is not one."""
    try:
        ev = json.loads(line)
        meta = (ev.get("object") or {}).get("metadata") or {}
        return str(ev.get("type", "")), str(meta.get("name", "")), str(meta.get("resourceVersion", ""))
    except (ValueError, AttributeError):
        return "", "", ""


class LaggingCluster(NamedTuple):
    """A control plane whose kube-scheduler goes through ``proxy``."""

    cp: ControlPlane
    proxy: LagProxy


def _listed(data: bytes, encoding: str) -> list[tuple[str, str]]:
    """(name, resourceVersion) of each item of a JSON list response; [] for anything else."""
    try:
        if encoding == "gzip":
            data = gzip.decompress(data)
        doc = json.loads(data)
        items = doc.get("items") if isinstance(doc, dict) else None
        metas = [(i.get("metadata") or {}) for i in items or [] if isinstance(i, dict)]
        return [(str(m.get("name", "")), str(m.get("resourceVersion", ""))) for m in metas]
    except (ValueError, OSError, AttributeError):
        return []


def scheduler_kubeconfig(url: str) -> dict[str, Any]:
    """A kubeconfig for kube-scheduler that talks plain HTTP to the proxy (no credentials: the proxy
    authenticates as the scheduler upstream). Pure."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "via-lagproxy", "cluster": {"server": url}}],
        "users": [{"name": "scheduler", "user": {}}],
        "contexts": [{"name": "via-lagproxy", "context": {"cluster": "via-lagproxy", "user": "scheduler"}}],
        "current-context": "via-lagproxy",
    }


@contextlib.contextmanager
def lagging_control_plane(work_dir: Path, **control_plane_kwargs: Any) -> Iterator[LaggingCluster]:
    """A control plane whose kube-scheduler reaches the API server only through a :class:`LagProxy`
    (everything else talks to the API server directly). Side effects: processes, a thread, ports, files
    under ``work_dir``; all stopped on exit."""
    work_dir.mkdir(parents=True, exist_ok=True)
    cp: ControlPlane | None = None
    proxy = LagProxy(lambda: scheduler_upstream(_started(cp)))
    proxy.start()
    try:
        kubeconfig = work_dir / "scheduler-via-lagproxy.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(scheduler_kubeconfig(proxy.url), sort_keys=False))
        # JSON, not protobuf: the proxy cuts watch streams into events at newlines.
        connection = {"kubeconfig": str(kubeconfig), "contentType": "application/json"}
        config = {**control_plane_kwargs.pop("scheduler_config", {}), "clientConnection": connection}
        cp = ControlPlane(work_dir=work_dir, scheduler_config=config, **control_plane_kwargs)
        cp.start()
        try:
            yield LaggingCluster(cp, proxy)
        finally:
            cp.stop()
    finally:
        proxy.stop()


def _started(cp: ControlPlane | None) -> ControlPlane:
    if cp is None:
        raise RuntimeError("the control plane has not been made yet")
    return cp
