"""The kubelet-facing gRPC servers: plugin registration and DRAPlugin (v1 and v1beta1), on unix sockets.

The kubelet's plugin watcher finds ``<kubelet-root>/plugins_registry/<driver>-reg.sock``, calls ``GetInfo``
and learns the DRA endpoint ``<kubelet-root>/plugins/<driver>/dra.sock`` and the services it serves
(``v1.DRAPlugin``, ``v1beta1.DRAPlugin``); it then calls NodePrepareResources / NodeUnprepareResources there.
The DRA socket is served before the registration socket appears, and the registration socket is removed
first on stop, so the kubelet never learns of an endpoint that does not answer. Both sockets also serve the
standard gRPC health service (``grpc.health.v1.Health``): the agent's liveness probe calls it over the
sockets, so a gRPC server that stopped answering fails the probe, not only a socket file that disappeared.

Start it with :func:`serve_plugin`; stop it with :meth:`PluginServer.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import _async as health_aio  # health.aio; the type stubs predate it
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dynamig.agent.plugin.checkpoint import CheckpointStore
from dynamig.agent.plugin.claims import ClaimReader, ClaimRef
from dynamig.agent.plugin.driver import MigDriver, StrandedClaims
from dynamig.agent.plugin.instances import MigInstances
from dynamig.agent.plugin.settings import PluginSettings
from dynamig.agent.plugin.stubs import load_stubs

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
# What the kubelet expects in PluginInfo.supported_versions for DRA: the gRPC services at the endpoint.
SUPPORTED_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


def _refs(request: Any) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in request.claims]


# Told after each kubelet call: the operation (prepare, unprepare), each claim's result (ok, error), seconds.
RequestObserver = Callable[[str, list[str], float], None]


class DraServicer:
    """``DRAPlugin`` for one API version; ``pb`` is that version's generated messages module."""

    def __init__(self, driver: MigDriver, pb: ModuleType, observe: RequestObserver | None = None) -> None:
        self._driver = driver
        self._pb = pb
        self._observe = observe or (lambda _op, _results, _seconds: None)

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        t0 = time.monotonic()
        results = await self._driver.prepare(_refs(request))
        self._observe(
            "prepare", ["error" if r.error else "ok" for r in results.values()], time.monotonic() - t0
        )
        response = self._pb.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]  # creates the map entry
            if result.error:
                entry.error = result.error
                continue
            for dev in result.devices:
                entry.devices.add(
                    request_names=list(dev.request_names),
                    pool_name=dev.pool_name,
                    device_name=dev.device_name,
                    cdi_device_ids=list(dev.cdi_device_ids),
                )
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        t0 = time.monotonic()
        errors = await self._driver.unprepare(_refs(request))
        self._observe("unprepare", ["error" if e else "ok" for e in errors.values()], time.monotonic() - t0)
        response = self._pb.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            entry = response.claims[uid]
            if error:
                entry.error = error
        return response


class RegistrationServicer:
    """``pluginregistration.Registration``: tells the kubelet who we are and hears whether it took us."""

    def __init__(self, settings: PluginSettings, pb: ModuleType) -> None:
        self._settings = settings
        self._pb = pb
        self.registered = asyncio.Event()
        self.error = ""

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return self._pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self._settings.driver_name,
            endpoint=str(self._settings.dra_socket),
            supported_versions=list(SUPPORTED_SERVICES),
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        if request.plugin_registered:
            self.error = ""
            self.registered.set()
            log.info("kubelet registered DRA plugin %s", self._settings.driver_name)
        else:
            self.error = request.error
            self.registered.clear()
            log.error("kubelet refused DRA plugin %s: %s", self._settings.driver_name, request.error)
        return self._pb.RegistrationStatusResponse()


def _remove_socket(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class PluginServer:
    """A running plugin: both gRPC servers and the driver behind them. Stop with :meth:`stop`."""

    def __init__(
        self,
        settings: PluginSettings,
        driver: MigDriver,
        dra_server: _UnixServer,
        registration_server: _UnixServer,
        registration: RegistrationServicer,
    ) -> None:
        self.settings = settings
        self.driver = driver
        self._dra_server = dra_server
        self._registration_server = registration_server
        self._registration = registration
        self._stopped = False
        self.sockets = (settings.dra_socket, settings.registration_socket)

    @property
    def registered(self) -> asyncio.Event:
        """Set once the kubelet reported a successful registration."""
        return self._registration.registered

    @property
    def registration_error(self) -> str:
        """The kubelet's last registration error, empty if none."""
        return self._registration.error

    async def stop(self, grace_s: float = 5.0) -> None:
        """Deregisters (removes the registration socket), then stops serving. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for server in (self._registration_server, self._dra_server):
            await server.health.enter_graceful_shutdown()  # NOT_SERVING to anyone still asking
        await self._registration_server.grpc.stop(grace_s)
        _remove_socket(self.settings.registration_socket)
        await self._dra_server.grpc.stop(grace_s)
        _remove_socket(self.settings.dra_socket)

    async def wait(self) -> None:
        """Returns when the DRA server terminates."""
        await self._dra_server.grpc.wait_for_termination()


@dataclass(frozen=True)
class _UnixServer:
    grpc: grpc.aio.Server
    health: health_aio.HealthServicer


async def _start_unix_server(path: Path, register: list[tuple[Any, Any]]) -> _UnixServer:
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_socket(path)  # a stale socket from a previous run would make bind fail
    server = grpc.aio.server()
    for add, servicer in register:
        add(servicer, server)
    checker = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    await checker.set(health.OVERALL_HEALTH, health_pb2.HealthCheckResponse.SERVING)
    return _UnixServer(server, checker)


async def probe_sockets(paths: Sequence[Path], timeout_s: float = 2.0) -> str:
    """ "ok" when every socket answers the gRPC health check with SERVING, else why not (the first failure).
    Side effect: connects to the sockets."""
    for path in paths:
        if not path.exists():
            return f"socket gone: {path}"
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            try:
                answer = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=health.OVERALL_HEALTH), timeout=timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                return f"{path}: health check failed: {exc.code().name}: {exc.details()}"
        if answer.status != health_pb2.HealthCheckResponse.SERVING:
            return f"{path}: {health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)}"
    return "ok"


async def serve_plugin(
    settings: PluginSettings,
    instances: MigInstances,
    api_client: ApiClient,
    observe: RequestObserver | None = None,
    stranded: StrandedClaims | None = None,
) -> PluginServer:
    """Starts the kubelet DRA plugin for ``settings.node_name`` and returns it running.

    Loads the checkpoint and unprepares claims that no longer exist, then serves DRAPlugin v1 and v1beta1 on
    the DRA socket and the registration service on the registry socket. Side effects: sockets, CDI specs,
    checkpoint, NVML through ``instances``, API reads. Raises ``StubsMissingError`` when ``make proto`` has
    not run, ``CheckpointError`` when the checkpoint cannot be trusted, ``ValueError`` for bad settings.
    """
    settings.validate()
    stubs = load_stubs()
    driver = MigDriver(
        settings,
        instances,
        ClaimReader(api_client, timeout_s=settings.api_timeout_s),
        CheckpointStore(settings.checkpoint_path),
        stranded,
    )
    await driver.start()
    dra_server = await _start_unix_server(
        settings.dra_socket,
        [
            (stubs.dra_v1_grpc.add_DRAPluginServicer_to_server, DraServicer(driver, stubs.dra_v1, observe)),
            (
                stubs.dra_v1beta1_grpc.add_DRAPluginServicer_to_server,
                DraServicer(driver, stubs.dra_v1beta1, observe),
            ),
        ],
    )
    registration = RegistrationServicer(settings, stubs.registration)
    try:
        registration_server = await _start_unix_server(
            settings.registration_socket,
            [(stubs.registration_grpc.add_RegistrationServicer_to_server, registration)],
        )
    except BaseException:
        await dra_server.grpc.stop(None)
        _remove_socket(settings.dra_socket)
        raise
    log.info(
        "DRA plugin %s serving on %s (registration %s)",
        settings.driver_name,
        settings.dra_socket,
        settings.registration_socket,
    )
    return PluginServer(settings, driver, dra_server, registration_server, registration)
