"""A real Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver, kube-scheduler, controller manager.

No kubelet runs: nodes are Node objects registered through the API (:meth:`ControlPlane.register_node`), which
is all the scheduler looks at. The controller manager runs only what dynamig's tests need:

- ``resourceclaim-controller`` creates ResourceClaims from ResourceClaimTemplates and cleans them up,
- ``garbage-collector-controller`` follows ownerReferences (e.g. ResourceSlices owned by a deleted Node),
- ``namespace-controller`` finishes namespace deletion,
- ``serviceaccount-controller`` creates each namespace's ``default`` ServiceAccount,
- ``clusterrole-aggregation-controller`` fills aggregated ClusterRoles such as ``view`` and ``edit``;

and deliberately no node-lifecycle controller, so registered nodes stay Ready without heartbeats. The
``TaintNodesByCondition`` admission plugin is disabled for the same reason: with no kubelet to clear it, the
``node.kubernetes.io/not-ready`` taint would keep every pod off the fake nodes.

Every component logs to ``<work_dir>/logs/<component>.log``; a failed start raises with the tail of the log of
the component that failed. ``stop()`` (also run by the context managers and at interpreter exit) leaves no
process or port behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import http.client
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import yaml

from dynamig.devcluster.binaries import Binaries, find_binaries
from dynamig.devcluster.pki import CertPair, ClusterPki, generate_pki
from dynamig.devcluster.processes import Component, free_port, stop_all, wait_for
from dynamig.devcluster.rest import ApiError, RestClient
from dynamig.devcluster.versions import KubeTarget, current

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient, Configuration

KUBE_CONTROLLERS = (
    "resourceclaim-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "clusterrole-aggregation-controller",
    # Workloads people apply to the dev cluster (the examples' Deployment and Job) get their pods.
    "deployment-controller",
    "replicaset-controller",
    "job-controller",
    # PodDisruptionBudget status (disruptionsAllowed), which preemption reads.
    "disruption-controller",
    # Evicts pods from devices tainted NoExecute (DRADeviceTaints; skipped where the gate is off): what moves
    # a pod off a device the agent taints for a critical XID.
    "device-taint-eviction-controller",
)
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
DEFAULT_ALLOCATABLE: Mapping[str, str] = {"cpu": "64", "memory": "512Gi", "pods": "110"}
# Taints a kubelet-less node must not carry, or nothing would schedule onto it.
_NODE_CONDITION_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


class ControlPlaneError(RuntimeError):
    """The control plane failed to start (the message carries the failing component's log tail)."""


class _PortInUseError(ControlPlaneError):
    pass


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _kubeconfig(server: str, ca: CertPair, client: CertPair, user: str) -> dict[str, Any]:
    """A kubeconfig dict with paths to the PEM files (pure)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "dynamig-dev", "cluster": {"server": server, "certificate-authority": str(ca.cert)}},
        ],
        "users": [
            {"name": user, "user": {"client-certificate": str(client.cert), "client-key": str(client.key)}},
        ],
        "contexts": [{"name": "dynamig-dev", "context": {"cluster": "dynamig-dev", "user": user}}],
        "current-context": "dynamig-dev",
    }


class ControlPlane:
    """A local control plane. Use as a (sync or async) context manager, or call :meth:`start`/:meth:`stop`.

    ``work_dir`` holds certificates, kubeconfigs, etcd data and logs; when not given a temporary directory is
    made and removed on stop (unless ``keep_work_dir``). ``progress`` receives one-line status messages.
    """

    def __init__(
        self,
        *,
        work_dir: Path | None = None,
        binaries: Binaries | None = None,
        keep_work_dir: bool = False,
        apiserver_args: Sequence[str] = (),
        scheduler_args: Sequence[str] = (),
        scheduler_config: Mapping[str, Any] | None = None,
        controller_manager_args: Sequence[str] = (),
        target: KubeTarget | None = None,
        start_timeout: float = 90.0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self._requested_work_dir = work_dir
        self._binaries = binaries
        self._keep_work_dir = keep_work_dir
        self.target = target or current()
        gates = self.target.gate_flags()  # before the callers' flags: a later --feature-gates adds to it
        self._extra = {
            "kube-apiserver": [*gates, *apiserver_args],
            "kube-scheduler": [*gates, *scheduler_args],
            "kube-controller-manager": [*gates, *controller_manager_args],
        }
        self._scheduler_config = dict(scheduler_config or {})  # more KubeSchedulerConfiguration fields
        self._start_timeout = start_timeout
        self._progress = progress or (lambda _msg: None)
        self._components: dict[str, Component] = {}
        self._work_dir: Path | None = None
        self._owns_work_dir = False
        self._pki: ClusterPki | None = None
        self._api_port = 0
        self.ports: dict[str, int] = {}  # kube-scheduler's and kube-controller-manager's secure ports
        self.start_seconds: float | None = None  # wall time of the last successful start

    # ----------------------------------------------------------------------------------------- properties
    @property
    def work_dir(self) -> Path:
        if self._work_dir is None:
            raise ControlPlaneError("control plane not started")
        return self._work_dir

    @property
    def log_dir(self) -> Path:
        """Directory with one ``<component>.log`` per process."""
        return self.work_dir / "logs"

    @property
    def log_paths(self) -> dict[str, Path]:
        """Log file of each component, by component name."""
        return {name: comp.log_path for name, comp in self._components.items()}

    @property
    def kubeconfig_path(self) -> Path:
        """Admin kubeconfig (user ``dynamig-admin`` in group ``system:masters``)."""
        return self.work_dir / "kubeconfig"

    @property
    def server_url(self) -> str:
        return f"https://127.0.0.1:{self._api_port}"

    @property
    def pki(self) -> ClusterPki:
        if self._pki is None:
            raise ControlPlaneError("control plane not started")
        return self._pki

    @property
    def binaries(self) -> Binaries:
        if self._binaries is None:
            raise ControlPlaneError("control plane not started")
        return self._binaries

    @property
    def pids(self) -> dict[str, int]:
        return {name: comp.pid for name, comp in self._components.items()}

    def running(self) -> bool:
        """True when every component process is alive."""
        return bool(self._components) and all(c.running() for c in self._components.values())

    # ----------------------------------------------------------------------------------------- lifecycle
    def start(self) -> ControlPlane:
        """Start all components and wait until each is healthy. Side effects: processes, files, ports.

        Raises :class:`ControlPlaneError` (after cleaning up) when a component does not come up in time.
        """
        if self._components:
            raise ControlPlaneError("control plane already started")
        t0 = time.monotonic()
        if self._binaries is None:
            self._binaries = find_binaries(progress=self._progress, version=self.target.version)
        if self._requested_work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix="dynamig-cp-"))
            self._owns_work_dir = True
        else:
            self._work_dir = self._requested_work_dir
            self._work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.log_dir.mkdir(exist_ok=True)
            pki_dir = self.work_dir / "pki"
            pki_dir.mkdir(exist_ok=True)
            self._pki = generate_pki(pki_dir)
            for attempt in range(3):
                try:
                    self._start_components()
                    break
                except _PortInUseError:
                    # Another process took a port between our probe and the bind: new ports, new try.
                    self._stop_components()
                    if attempt == 2:
                        raise
                    self._progress("a port was taken meanwhile; retrying with new ports")
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        self._progress(f"control plane ready at {self.server_url} in {self.start_seconds:.1f}s")
        return self

    def stop(self) -> None:
        """Stop every component (SIGTERM, then SIGKILL) and remove an owned work dir. Idempotent."""
        self._stop_components()
        if self._work_dir is not None and self._owns_work_dir and not self._keep_work_dir:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None

    def _stop_components(self) -> None:
        comps = self._components
        upper = [
            comps[n] for n in ("kube-controller-manager", "kube-scheduler", "kube-apiserver") if n in comps
        ]
        stop_all(upper, timeout=5.0)
        if "etcd" in comps:
            stop_all([comps["etcd"]], timeout=5.0)
        self._components = {}

    def restart(self, *names: str, down_seconds: float = 0.0) -> float:
        """Stop the named components (SIGTERM, then SIGKILL), leave them down ``down_seconds``, start them
        again with the same arguments, ports and etcd data, and wait until the API server is ready. Returns
        the seconds from the restart to ready. Side effects: processes (a fault for chaos tests)."""
        stop_all([self._components[n] for n in names], timeout=5.0)
        time.sleep(down_seconds)
        t0 = time.monotonic()
        for name in ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"):
            if name in names:
                old = self._components[name]
                argv = old.popen.args
                assert isinstance(argv, list)  # spawned from a list (_spawn)
                self._components[name] = Component.spawn(name, argv, log_path=old.log_path, cwd=self.work_dir)
        admin = self.rest()
        deadline = time.monotonic() + self._start_timeout
        self._wait(self._components["kube-apiserver"], deadline, lambda: self._rest_ok(admin, "/readyz"))
        return time.monotonic() - t0

    def upgrade(self, target: KubeTarget) -> float:
        """Upgrade the running control plane to ``target`` in place, as an admin does: kube-apiserver first,
        then kube-scheduler and kube-controller-manager (the order Kubernetes' version skew policy asks),
        each stopped and started from ``target``'s binaries with its gates and the same flags, ports, PKI and
        etcd data (etcd is not a Kubernetes binary and stays up). Returns the seconds it took. Side effects:
        processes; ``target`` and ``binaries`` change."""
        t0 = time.monotonic()
        new = find_binaries(progress=self._progress, version=target.version)
        old_gates, new_gates = self.target.gate_flags(), target.gate_flags()
        admin = self.rest()
        probes: dict[str, tuple[Path, Callable[[], bool]]] = {
            "kube-apiserver": (new.kube_apiserver, lambda: self._rest_ok(admin, "/readyz")),
            "kube-scheduler": (
                new.kube_scheduler,
                lambda: self._http_ok(self.ports["kube-scheduler"], "/readyz", tls=True),
            ),
            "kube-controller-manager": (
                new.kube_controller_manager,
                lambda: self._http_ok(self.ports["kube-controller-manager"], "/healthz", tls=True),
            ),
        }
        for name, (binary, probe) in probes.items():
            old = self._components[name]
            argv = old.popen.args
            assert isinstance(argv, list)  # spawned from a list (_spawn)
            extra = self._extra[name]
            own = argv[1 : len(argv) - len(extra)]  # the flags _start_components gave, binary and extra apart
            self._extra[name] = [*new_gates, *extra[len(old_gates) :]]  # the callers' flags stay last
            stop_all([old], timeout=5.0)
            self._progress(f"upgrading {name} to {target.version}")
            comp = self._spawn(name, [str(binary), *own])
            self._wait(comp, time.monotonic() + self._start_timeout, probe)
        self.target, self._binaries = target, new
        return time.monotonic() - t0

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> ControlPlane:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)

    # ----------------------------------------------------------------------------------------- start-up
    def _spawn(self, name: str, argv: list[str]) -> Component:
        comp = Component.spawn(
            name, argv + self._extra.get(name, []), log_path=self.log_dir / f"{name}.log", cwd=self.work_dir
        )
        self._components[name] = comp
        return comp

    def _start_components(self) -> None:
        pki, bins, wd = self.pki, self.binaries, self.work_dir
        deadline = time.monotonic() + self._start_timeout

        etcd_port, peer_port = free_port(), free_port()
        etcd_data = wd / "etcd"
        shutil.rmtree(etcd_data, ignore_errors=True)
        self._progress("starting etcd and kube-apiserver")
        etcd = self._spawn(
            "etcd",
            [
                str(bins.etcd),
                "--name=dynamig",
                f"--data-dir={etcd_data}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=dynamig=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",  # throw-away data: skip fsync, a large start-up and latency win
                # A single member elects itself after one election timeout: 200 ms instead of the default 1 s.
                "--heartbeat-interval=20",
                "--election-timeout=200",
                "--log-level=warn",
            ],
        )
        # The API server retries etcd until it answers, so both start together and etcd's start is hidden.
        self._api_port = free_port()
        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(bins.kube_apiserver),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self._api_port}",
                f"--cert-dir={wd / 'pki'}",
                f"--tls-cert-file={pki.apiserver.cert}",
                f"--tls-private-key-file={pki.apiserver.key}",
                f"--client-ca-file={pki.ca.cert}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--disable-admission-plugins=TaintNodesByCondition",
                "--runtime-config=resource.k8s.io/v1=true",
                "--allow-privileged=true",
                # The default reconciler publishes the advertise address as the endpoint of the `kubernetes`
                # Service, and Endpoints reject loopback addresses: nothing here needs that endpoint.
                "--endpoint-reconciler-type=none",
                # Real nodes (devcluster.node) are reached by IP: their names do not resolve here.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--profiling=false",
            ],
        )
        admin = self.rest()
        self._wait(etcd, deadline, lambda: self._http_ok(etcd_port, "/health"))
        self._wait(apiserver, deadline, lambda: self._rest_ok(admin, "/readyz"))

        self._write_kubeconfigs()
        sched_port, kcm_port = free_port(), free_port()
        self.ports = {"kube-scheduler": sched_port, "kube-controller-manager": kcm_port}
        sched_config = wd / "scheduler-config.yaml"
        sched_config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": str(wd / "scheduler.kubeconfig")},
                    "leaderElection": {"leaderElect": False},
                    **self._scheduler_config,
                }
            )
        )
        self._progress("starting kube-scheduler and kube-controller-manager")
        scheduler = self._spawn(
            "kube-scheduler",
            [
                str(bins.kube_scheduler),
                f"--config={sched_config}",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                "--v=2",
            ],
        )
        kcm = self._spawn(
            "kube-controller-manager",
            [
                str(bins.kube_controller_manager),
                f"--kubeconfig={wd / 'controller-manager.kubeconfig'}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                "--leader-elect=false",
                f"--controllers={','.join(KUBE_CONTROLLERS)}",
                # Each controller acts as its own service account, with its bootstrap RBAC role.
                "--use-service-account-credentials=true",
                f"--root-ca-file={pki.ca.cert}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
            ],
        )
        self._wait(scheduler, deadline, lambda: self._http_ok(sched_port, "/readyz", tls=True))
        self._wait(kcm, deadline, lambda: self._http_ok(kcm_port, "/healthz", tls=True))

    def _wait(self, comp: Component, deadline: float, probe: Callable[[], bool]) -> None:
        """Poll ``probe`` until it passes; fail fast when the process exits or the deadline passes."""

        def fail(message: str) -> ControlPlaneError:
            return (_PortInUseError if "address already in use" in message else ControlPlaneError)(message)

        took = wait_for(comp, probe, deadline=deadline, what=f"{comp.name} healthy", fail=fail)
        self._progress(f"{comp.name} healthy after {took:.1f}s")

    @staticmethod
    def _http_ok(port: int, path: str, *, tls: bool = False) -> bool:
        try:
            if tls:
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    "127.0.0.1", port, timeout=2, context=_insecure_context()
                )
            else:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            try:
                conn.request("GET", path)
                return conn.getresponse().status == 200
            finally:
                conn.close()
        except OSError:
            return False

    @staticmethod
    def _rest_ok(client: RestClient, path: str) -> bool:
        try:
            status, _ = client.raw("GET", path)
        except OSError:
            return False
        return status == 200

    def _write_kubeconfigs(self) -> None:
        pki, wd = self.pki, self.work_dir
        for filename, pair, user in (
            ("kubeconfig", pki.admin, "dynamig-admin"),
            ("scheduler.kubeconfig", pki.scheduler, "system:kube-scheduler"),
            ("controller-manager.kubeconfig", pki.controller_manager, "system:kube-controller-manager"),
        ):
            path = wd / filename
            path.write_text(yaml.safe_dump(_kubeconfig(self.server_url, pki.ca, pair, user), sort_keys=False))
            path.chmod(0o600)

    def kubeconfig_for(self, client: CertPair, user: str) -> dict[str, Any]:
        """A kubeconfig dict for this cluster with ``client``'s certificate as ``user`` (no I/O)."""
        return _kubeconfig(self.server_url, self.pki.ca, client, user)

    # ----------------------------------------------------------------------------------------- clients
    def rest(self) -> RestClient:
        """A synchronous admin client (standard library only) for simple JSON calls."""
        pki = self.pki
        return RestClient("127.0.0.1", self._api_port, ca=pki.ca.cert, cert=pki.admin.cert, key=pki.admin.key)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for child processes: ``KUBECONFIG`` set and the binaries' directory first on PATH."""
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig_path)
        env["PATH"] = os.pathsep.join([str(self.binaries.directory), env.get("PATH", "")])
        return env

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; text stdout/stderr captured. Raises on failure when ``check``."""
        cmd = [str(self.binaries.kubectl), f"--kubeconfig={self.kubeconfig_path}", *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def client_configuration(self) -> Configuration:
        """A ``kubernetes_asyncio`` Configuration for the admin user (no I/O)."""
        from kubernetes_asyncio.client import Configuration

        pki = self.pki
        conf = Configuration(host=self.server_url)
        conf.ssl_ca_cert = str(pki.ca.cert)
        conf.cert_file = str(pki.admin.cert)
        conf.key_file = str(pki.admin.key)
        return conf

    @contextlib.asynccontextmanager
    async def api_client(self) -> AsyncIterator[ApiClient]:
        """``async with cp.api_client() as api:`` gives an admin ``kubernetes_asyncio`` ApiClient."""
        from kubernetes_asyncio.client import ApiClient

        async with ApiClient(configuration=self.client_configuration()) as api:
            yield api

    def service_account_kubeconfig(
        self, namespace: str, name: str, *, expiration_seconds: int = 3600
    ) -> Path:
        """A kubeconfig that acts as ServiceAccount ``namespace/name`` (token from the TokenRequest API).

        For running a component with exactly the RBAC its manifests grant. The ServiceAccount must exist.
        Side effects: requests a token and writes ``<work_dir>/sa-<namespace>-<name>.kubeconfig``.
        """
        status = self.rest().request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": expiration_seconds},
            },
        )["status"]
        user = f"system:serviceaccount:{namespace}:{name}"
        config = _kubeconfig(self.server_url, self.pki.ca, self.pki.admin, user)
        config["users"] = [{"name": user, "user": {"token": status["token"]}}]
        config["contexts"][0]["context"]["namespace"] = namespace
        path = self.work_dir / f"sa-{namespace}-{name}.kubeconfig"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path

    # ----------------------------------------------------------------------------------------- nodes
    def register_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        allocatable: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Create (or refresh) a Node the scheduler accepts: Ready, allocatable pods/cpu/memory, untainted.

        ``allocatable`` entries override the defaults (64 cpu, 512Gi memory, 110 pods) and also become the
        capacity. Idempotent. Side effects: writes the Node and its status; returns the Node as stored.
        """
        api = self.rest()
        node_labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **(labels or {}),
        }
        try:
            node = api.request(
                "POST",
                "/api/v1/nodes",
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": name, "labels": node_labels},
                },
            )
        except ApiError as exc:
            if exc.status != 409:
                raise
            node = api.request(
                "PATCH",
                f"/api/v1/nodes/{name}",
                {"metadata": {"labels": node_labels}},
                content_type="application/merge-patch+json",
            )
        taints = node.get("spec", {}).get("taints") or []
        kept = [t for t in taints if t.get("key") not in _NODE_CONDITION_TAINTS]
        if kept != taints:
            api.request(
                "PATCH",
                f"/api/v1/nodes/{name}",
                {"spec": {"taints": kept or None}},
                content_type="application/merge-patch+json",
            )
        resources = {**DEFAULT_ALLOCATABLE, **(allocatable or {})}
        now = _now()

        def condition(kind: str, status: str, reason: str) -> dict[str, str]:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": "registered by dynamig devcluster",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }

        return api.request(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            {
                "status": {
                    "capacity": resources,
                    "allocatable": resources,
                    "conditions": [
                        condition("Ready", "True", "KubeletReady"),
                        condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                        condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                        condition("PIDPressure", "False", "KubeletHasSufficientPID"),
                    ],
                    "addresses": [
                        {"type": "InternalIP", "address": "127.0.0.1"},
                        {"type": "Hostname", "address": name},
                    ],
                    "nodeInfo": {
                        "architecture": "amd64",
                        "operatingSystem": "linux",
                        "kubeletVersion": self.target.version,
                        "containerRuntimeVersion": "none://0",
                        "kernelVersion": "",
                        "osImage": "dynamig fake node",
                        "machineID": "",
                        "systemUUID": "",
                        "bootID": "",
                    },
                }
            },
            content_type="application/merge-patch+json",
        )

    def delete_node(self, name: str) -> None:
        """Delete a Node (its owned ResourceSlices follow through the garbage collector). Missing is fine."""
        try:
            self.rest().request("DELETE", f"/api/v1/nodes/{name}")
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def aregister_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        allocatable: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """:meth:`register_node` without blocking the event loop."""
        return await asyncio.to_thread(self.register_node, name, labels=labels, allocatable=allocatable)

    async def adelete_node(self, name: str) -> None:
        """:meth:`delete_node` without blocking the event loop."""
        await asyncio.to_thread(self.delete_node, name)


def _insecure_context() -> Any:
    # Health endpoints of scheduler and controller manager use self-signed certificates: nothing to verify.
    import ssl

    return ssl._create_unverified_context()
