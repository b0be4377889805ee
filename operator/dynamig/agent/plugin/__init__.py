"""The kubelet DRA plugin of the node agent for driver ``mig.dynamig.io``.

Split by concern, like the DRA example driver: ``settings`` (paths), ``instances`` (the ``MigInstances``
protocol the agent implements over NVML), ``claims`` (reading and checking ResourceClaims), ``cdi`` (specs
and NVIDIA capability files), ``checkpoint`` (prepared claims on disk), ``driver`` (prepare / unprepare),
``server`` (gRPC on unix sockets), ``stubs`` (lazy import of the code ``make proto`` generates from
``proto/*.proto``), ``nvml_instances`` (``MigInstances`` over the agent's NVML layer).

Entry point for the agent: ``server = await serve_plugin(settings, instances, api_client)``, later
``await server.stop()``.
"""

from dynamig.agent.plugin.checkpoint import CheckpointError
from dynamig.agent.plugin.instances import (
    InstanceError,
    MigInstances,
    PlacementTaken,
    PreparedInstance,
    UnknownDevice,
)
from dynamig.agent.plugin.server import PluginServer, probe_sockets, serve_plugin
from dynamig.agent.plugin.settings import PluginSettings
from dynamig.agent.plugin.stubs import StubsMissingError

__all__ = [
    "CheckpointError",
    "InstanceError",
    "MigInstances",
    "PlacementTaken",
    "PluginServer",
    "PluginSettings",
    "PreparedInstance",
    "StubsMissingError",
    "UnknownDevice",
    "probe_sockets",
    "serve_plugin",
]
