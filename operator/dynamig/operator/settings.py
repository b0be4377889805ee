"""Operator settings: one frozen dataclass, filled from command-line flags in ``dynamig.cli.operator`` (the
only place that reads the environment) or directly by a test or demo that runs the operator in-process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    """How the operator connects, coordinates with other replicas, and reports.

    - ``kubeconfig``, ``context``: a kubeconfig path and context, read the way kubectl reads them (exec
      credential plugins included); with no path, ``$KUBECONFIG`` (every path in it) or
      ``~/.kube/config``, and with neither, the in-cluster service account.
    - ``standalone``: act without Kopf peering (a single replica; tests and demos). Otherwise replicas
      coordinate through the cluster-wide ``ClusterKopfPeering`` object named ``peering_name``: only the
      replica with the highest ``priority`` acts, the others stay paused until it goes away.
    - ``peer_id``: this replica's name in the peering object (default: Kopf's, from host name and pid).
    - ``metrics_port``: port of the Prometheus ``/metrics`` endpoint on ``metrics_host``; None: no endpoint
      (the metrics still exist in the registry); 0: any free port.
    - ``metrics_tls_cert``, ``metrics_tls_key``: serve ``/metrics`` over TLS with this PEM pair (None: HTTP);
      ``metrics_authorize``: only to bearer tokens the API server allows to ``get /metrics`` (needs TLS).
    - ``resync_seconds``: how often each policy replans even when no watch event arrived.
    - ``event_repeat_seconds``: a pending claim whose verdict did not change gets its Event again after this.
    - ``liveness_endpoint``: where Kopf serves its liveness probe (None: not served).
    - ``events_namespace``: namespace of Events about cluster-scoped objects (policies, GpuPartitions).
    - ``agent_lease_namespace``: where the agents keep their heartbeat Leases; a GPU whose agent's Lease ran
      out is left out of planning and frees its policy's disruption budget (None: Leases are not read).
    - ``stranded_after_seconds``: how long a silent agent's node stays fenced before a pod bound to its
      devices that never started is given back (deleted for its controller, or told; operator/fencing.py).
    - ``device_plugin_classes``: keep a DeviceClass per offered profile that serves the NVIDIA device
      plugin's resource name for it (``nvidia.com/mig-1g.10gb``; operator/extended.py).
    """

    kubeconfig: Path | None = None
    context: str | None = None
    standalone: bool = False
    peering_name: str = "dynamig"
    priority: int = 0
    peer_id: str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_tls_cert: Path | None = None
    metrics_tls_key: Path | None = None
    metrics_authorize: bool = False
    resync_seconds: float = 30.0
    event_repeat_seconds: float = 300.0
    events_namespace: str = "default"
    agent_lease_namespace: str | None = "default"
    stranded_after_seconds: float = 60.0
    log_level: str = "INFO"
    device_plugin_classes: bool = True
    liveness_endpoint: str | None = None  # e.g. "http://0.0.0.0:8080/healthz": Kopf's probe of its own loop
