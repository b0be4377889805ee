"""A real node beside the local control plane: containerd 2.x (CDI on) with runc, and a kubelet.

The kubelet registers the Node itself, asks the DRA plugin registered under its plugin-registration socket
to prepare each pod's claims, and passes the CDI device ids it gets to containerd, which reads the CDI specs
and has runc put the devices into the container. Nothing is pulled: the sandbox and workload images are built
here (:mod:`dynamig.devcluster.images`) and imported into containerd. Pods use host networking, so no CNI is
configured (the runtime reports its network as not ready, which the kubelet tolerates for host-network pods).

What this machine needs and what is set for it, each said where it is set:

- root, overlayfs and the cgroup controllers the kubelet reads (:func:`check_host` names the first missing);
- cgroup v1 (hybrid) hosts: kubelet 1.36 refuses cgroup v1 unless ``failCgroupV1: false``;
- every path (kubelet root, containerd root/state/socket, CDI specs, pod logs) lives under the node's work
  directory, so several nodes or runs never share state; :meth:`RealNode.stop` kills the pods' containers,
  unmounts what the kubelet and runtime mounted there and stops the processes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dynamig.devcluster.binaries import BinariesNotFoundError, build_tool
from dynamig.devcluster.images import BUSYBOX_IMAGE, PAUSE_IMAGE, node_images
from dynamig.devcluster.pki import issue_client_cert
from dynamig.devcluster.processes import Component, free_port, stop_all, wait_for

if TYPE_CHECKING:
    from dynamig.devcluster.controlplane import ControlPlane

NODE_TOOLS = ("kubelet", "containerd", "containerd-shim-runc-v2", "ctr", "runc", "busybox", "pause")
CONTAINERD_NAMESPACE = "k8s.io"  # the namespace containerd's CRI plugin keeps Kubernetes' images in
REQUIRED_CGROUP_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "pids")


# What a test container reports: each NVIDIA device node with its numbers (busybox stat, hex), the NVIDIA
# and dynamig environment, and whether the driver's files from the node's base CDI spec were mounted; then
# it waits, and exits at once on SIGTERM (a shell as PID 1 ignores it otherwise).
# What the container exits with when it is sent SIGTERM: 128 + 15, the code of a process SIGTERM ended. The
# shell is PID 1 and would ignore the signal without the trap; a container killed after its grace period
# exits 137 (SIGKILL) instead, so the kubelet's report tells a graceful stop from a kill.
EXIT_ON_SIGTERM = 143

DEVICE_REPORT = rf"""
for f in /dev/nvidia* /dev/nvidia-caps/*; do [ -e "$f" ] && stat -c 'DEV %n %F %t:%T' "$f"; done
env | grep -E '^(NVIDIA|DYNAMIG)_' | sed 's/^/ENV /'
[ -e /usr/bin/nvidia-smi ] && echo 'FILE /usr/bin/nvidia-smi'
echo REPORTED
trap 'exit {EXIT_ON_SIGTERM}' TERM
sleep 3600 & wait
"""


@dataclass(frozen=True)
class ContainerReport:
    """What a container running :data:`DEVICE_REPORT` saw."""

    devices: dict[str, str]  # path -> "major:minor" (decimal)
    env: dict[str, str]
    files: set[str]

    @property
    def capability_nodes(self) -> list[str]:
        return sorted(d for d in self.devices if d.startswith("/dev/nvidia-caps/"))


def parse_report(log: str) -> ContainerReport | None:
    """The report in a container's log; None until it is complete. Pure."""
    if "REPORTED" not in log.splitlines():
        return None
    devices, env, files = {}, {}, set()
    for line in log.splitlines():
        if m := re.fullmatch(r"DEV (\S+) character special file ([0-9a-f]+):([0-9a-f]+)", line):
            devices[m[1]] = f"{int(m[2], 16)}:{int(m[3], 16)}"
        elif line.startswith("ENV ") and "=" in line:
            key, _, value = line[4:].partition("=")
            env[key] = value
        elif line.startswith("FILE "):
            files.add(line[5:])
    return ContainerReport(devices, env, files)


def runnable(pod: dict[str, Any]) -> dict[str, Any]:
    """``pod`` made to run on a real test node: host network (no CNI), the local busybox image never
    pulled, no service-account token, no restarts, each container running :data:`DEVICE_REPORT`. Pure."""
    spec = dict(pod["spec"])
    spec.update(
        hostNetwork=True,
        automountServiceAccountToken=False,
        restartPolicy="Never",
        terminationGracePeriodSeconds=10,
    )
    spec["containers"] = [
        {**c, "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never", "command": ["sh", "-c", DEVICE_REPORT]}
        for c in spec["containers"]
    ]
    return {**pod, "spec": spec}


def renamed_oci_archive(archive: Path, name: str, out: Path) -> Path:
    """A copy of the OCI image layout tar ``archive`` whose one manifest is named ``name``: the annotations
    ``ctr images import`` names an image by (``io.containerd.image.name``, and the OCI ``ref.name``).
    Side effect: writes ``out``; returns it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for member in src:
            data = src.extractfile(member) if member.isfile() else None
            if member.name.removeprefix("./") == "index.json" and data is not None:
                index = json.loads(data.read())
                if len(index.get("manifests") or []) != 1:
                    raise NodeError(f"{archive} holds {len(index.get('manifests') or [])} manifests, not one")
                notes = index["manifests"][0].setdefault("annotations", {})
                notes["io.containerd.image.name"] = notes["org.opencontainers.image.ref.name"] = name
                raw = json.dumps(index).encode()
                member.size = len(raw)
                dst.addfile(member, io.BytesIO(raw))
            else:
                dst.addfile(member, data)
    return out


class NodeError(RuntimeError):
    """The node cannot start here, or one of its processes failed; the message says which and why."""


@dataclass(frozen=True)
class NodeBinaries:
    directory: Path

    def __getitem__(self, tool: str) -> Path:
        return self.directory / tool


def find_node_binaries() -> NodeBinaries:
    """The node's binaries from ``hack/build-node.sh`` (built once per version, cached)."""
    directory = build_tool("build-node.sh")
    missing = [t for t in NODE_TOOLS if not os.access(directory / t, os.X_OK)]
    if missing:
        raise BinariesNotFoundError(f"{directory} lacks {', '.join(missing)}")
    return NodeBinaries(directory)


def _cgroup_v1_controllers(mounts: str) -> set[str]:
    found: set[str] = set()
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup":
            found.update(parts[3].split(","))
    return found


def check_host(proc_root: Path = Path("/proc")) -> str:
    """Raises :class:`NodeError` naming the first thing this host lacks for a real node; returns the cgroup
    mode, ``"v1"`` or ``"v2"``. Side effect: reads procfs."""
    if os.geteuid() != 0:
        raise NodeError(
            "a real node needs root: the kubelet and runc create cgroups, mounts and device nodes"
        )
    filesystems = (proc_root / "filesystems").read_text()
    if "overlay" not in filesystems.split():
        raise NodeError(
            "the kernel has no overlay filesystem (/proc/filesystems); containerd's snapshotter needs it"
        )
    mounts = (proc_root / "self" / "mounts").read_text()
    if any(
        line.split()[2] == "cgroup2" and line.split()[1] == "/sys/fs/cgroup" for line in mounts.splitlines()
    ):
        return "v2"
    controllers = _cgroup_v1_controllers(mounts)
    missing = [c for c in REQUIRED_CGROUP_CONTROLLERS if c not in controllers]
    if missing:
        raise NodeError(f"cgroup v1 controllers not mounted: {', '.join(missing)} (see /proc/self/mounts)")
    return "v1"


def can_lower_oom_score() -> bool:
    """Whether this process may lower its own ``oom_score_adj`` (needs CAP_SYS_RESOURCE). Side effect: writes
    the current value back, unchanged."""
    path = Path("/proc/self/oom_score_adj")
    current = int(path.read_text())
    try:
        path.write_text(str(current - 1))
    except PermissionError:
        return False
    path.write_text(str(current))
    return True


def node_ip() -> str:
    """The host's IPv4 address for the default route: the kubelet refuses a loopback node IP, and the API
    server reaches the kubelet there. Side effect: a UDP socket (no packet sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))
        except OSError as e:
            raise NodeError(f"no IPv4 route for a node IP (the kubelet refuses loopback): {e}") from e
        ip = str(s.getsockname()[0])
    if ip.startswith("127."):
        raise NodeError("the only IPv4 address is loopback, which the kubelet refuses as a node IP")
    return ip


def containerd_config(work: Path, runc: Path, cdi_dir: Path, *, restrict_oom: bool) -> str:
    """containerd 2.x configuration (version 3) for a node whose state lives under ``work``. Pure."""
    return f"""version = 3
root = "{work / "root"}"
state = "{work / "state"}"
# Plugins that need hardware or storage this node does not have would only log errors.
disabled_plugins = ["io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs"]

[grpc]
  address = "{work / "containerd.sock"}"

[ttrpc]
  address = "{work / "containerd.sock.ttrpc"}"

[plugins.'io.containerd.internal.v1.opt']
  path = "{work / "opt"}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  # Never pulled: built here and imported (dynamig.devcluster.images).
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
  # A registry is reached as its hosts.toml there says (RealNode.trust_registry); read at each pull.
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "{work / "certs.d"}"

[plugins.'io.containerd.cri.v1.runtime']
  # The kubelet asks for negative OOM score adjustments (the sandbox's -998); lowering one needs
  # CAP_SYS_RESOURCE, which some hosts (this sandbox among them) withhold: clamp at containerd's own score.
  restrict_oom_score_adj = {"true" if restrict_oom else "false"}
  enable_cdi = true
  cdi_spec_dirs = ["{cdi_dir}"]
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
"""


def kubelet_config(
    *, root: Path, address: str, port: int, healthz_port: int, runtime_socket: Path, cgroup_mode: str
) -> dict[str, Any]:
    """KubeletConfiguration for the test node. Pure."""
    config: dict[str, Any] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": address,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "containerRuntimeEndpoint": f"unix://{runtime_socket}",
        "cgroupDriver": "cgroupfs",  # no systemd runs here
        # One test node on a shared machine: no QoS cgroup tree, nothing reserved, no evictions.
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "evictionHard": {},
        "failSwapOn": False,
        "podLogsDir": str(root / "pod-logs"),
        "staticPodPath": "",
        "serializeImagePulls": False,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # The API server reaches the kubelet for logs and exec without a client certificate: this test
        # node lets anonymous requests through (its port is a free one on the node IP, for one test run).
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "syncFrequency": "5s",
        "nodeStatusUpdateFrequency": "5s",
        "resolvConf": "",
    }
    if cgroup_mode == "v1":
        # Kubelet 1.36 refuses to start on cgroup v1 unless told; this machine's kernel mounts cgroup v1
        # (hybrid), and the kubelet's v1 support is what the test node runs on.
        config["failCgroupV1"] = False
    return config


def _mounts_under(path: Path, proc_root: Path = Path("/proc")) -> list[str]:
    prefix = str(path.resolve()) + "/"
    found = []
    for line in (proc_root / "self" / "mounts").read_text().splitlines():
        mount_point = line.split()[1].replace("\\040", " ")
        if mount_point.startswith(prefix):
            found.append(mount_point)
    return found


# What the local control plane's kube-controller-manager leaves out and pods of a DaemonSet, or any pod with a
# ServiceAccount token, need: DaemonSet pods, and the kube-root-ca.crt ConfigMap of each namespace that the
# token's projected volume reads. Neither is needed by the tests that only bind pods.
NODE_CONTROLLERS = ("daemonset-controller", "root-ca-certificate-publisher-controller")


def start_node_controllers(cluster: ControlPlane, log_dir: Path, timeout: float = 60.0) -> Component:
    """A second kube-controller-manager beside ``cluster``'s, running :data:`NODE_CONTROLLERS` only (no
    leader election: their controllers are not in the first), with the first one's identity and CA; waits
    until it serves /healthz. The caller stops it. Side effects: a process, its log in ``log_dir``."""
    import ssl
    import urllib.request

    port = free_port()
    work = cluster.work_dir
    argv = [
        str(cluster.binaries.kube_controller_manager),
        f"--kubeconfig={work / 'controller-manager.kubeconfig'}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--leader-elect=false",
        f"--controllers={','.join(NODE_CONTROLLERS)}",
        "--use-service-account-credentials=true",
        f"--root-ca-file={cluster.pki.ca.cert}",
    ]
    log_dir.mkdir(parents=True, exist_ok=True)
    comp = Component.spawn("node-controllers", argv, log_path=log_dir / "node-controllers.log", cwd=log_dir)
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE  # its self-signed serving cert

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(
                f"https://127.0.0.1:{port}/healthz", timeout=2, context=insecure
            ) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    try:
        wait_for(comp, healthy, deadline=time.monotonic() + timeout, what="node controllers", fail=NodeError)
    except BaseException:
        stop_all([comp])
        raise
    return comp


class RealNode:
    """A kubelet and containerd registered as Node ``name`` in ``cluster``; see the module docstring.

    Paths the DRA plugin needs: :attr:`kubelet_root` (plugin registration and sockets), :attr:`cdi_dir`
    (containerd reads CDI specs there), :attr:`dev_root` and :attr:`proc_root` (simulated driver files).
    """

    def __init__(
        self,
        cluster: ControlPlane,
        name: str,
        *,
        work_dir: Path | None = None,
        start_timeout: float = 120.0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.name = name
        # Short paths: unix socket paths (kubelet plugins, containerd) must stay under 108 bytes.
        self.work_dir = work_dir or Path(tempfile.mkdtemp(prefix="dynamig-node-", dir="/tmp"))
        self._owns_work_dir = work_dir is None
        self._start_timeout = start_timeout
        self._progress = progress or (lambda _msg: None)
        self._bins: NodeBinaries | None = None
        self._components: dict[str, Component] = {}
        self._kubelet_argv: list[str] = []
        self.agent_args: tuple[
            Any, ...
        ] = ()  # what the agent was last started with (start_agent(*agent_args))
        self.start_seconds: float | None = None

    # ------------------------------------------------------------------------------------------ paths
    @property
    def kubelet_root(self) -> Path:
        return self.work_dir / "kubelet"

    @property
    def cdi_dir(self) -> Path:
        return self.work_dir / "cdi"

    @property
    def dev_root(self) -> Path:
        return self.work_dir / "dev"

    @property
    def proc_root(self) -> Path:
        return self.work_dir / "proc"

    @property
    def containerd_dir(self) -> Path:
        return self.work_dir / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd_dir / "containerd.sock"

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    @property
    def binaries(self) -> NodeBinaries:
        if self._bins is None:
            raise NodeError("node not started")
        return self._bins

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> RealNode:
        """Starts containerd, imports the images, starts the kubelet and waits for its Node. Raises
        :class:`NodeError` (after cleaning up) naming what failed, with the end of that process's log."""
        t0 = time.monotonic()
        cgroup_mode = check_host()
        if self._bins is None:
            self._bins = find_node_binaries()
        for d in (
            self.log_dir,
            self.kubelet_root,
            self.cdi_dir,
            self.dev_root,
            self.proc_root,
            self.containerd_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)
        try:
            self._start_containerd()
            self._import_images()
            self._start_kubelet(cgroup_mode)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        self._progress(f"node {self.name} ready in {self.start_seconds:.1f}s")
        return self

    def _spawn(self, name: str, argv: list[str]) -> Component:
        env = dict(os.environ)
        # containerd finds containerd-shim-runc-v2 on PATH.
        env["PATH"] = os.pathsep.join([str(self.binaries.directory), env.get("PATH", "")])
        comp = Component.spawn(name, argv, log_path=self.log_dir / f"{name}.log", cwd=self.work_dir, env=env)
        self._components[name] = comp
        return comp

    def _wait(self, comp: Component, what: str, probe: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self._start_timeout
        took = wait_for(comp, probe, deadline=deadline, what=what, fail=NodeError, tail_lines=40)
        self._progress(f"{what} after {took:.1f}s")

    def ctr(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Runs ``ctr`` against this node's containerd in the Kubernetes namespace."""
        cmd = [
            str(self.binaries["ctr"]),
            f"--address={self.containerd_socket}",
            f"--namespace={CONTAINERD_NAMESPACE}",
            *args,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise NodeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def _start_containerd(self) -> None:
        config = self.containerd_dir / "config.toml"
        config.write_text(
            containerd_config(
                self.containerd_dir,
                self.binaries["runc"],
                self.cdi_dir,
                restrict_oom=not can_lower_oom_score(),
            )
        )
        comp = self._spawn(
            "containerd", [str(self.binaries["containerd"]), f"--config={config}", "--log-level=info"]
        )
        self._wait(
            comp, "containerd serving", lambda: self.ctr("version", check=False, timeout=10).returncode == 0
        )

    def _import_images(self) -> None:
        archives = node_images(
            self.work_dir / "images", busybox=self.binaries["busybox"], pause=self.binaries["pause"]
        )
        for name, archive in archives.items():
            self.ctr("images", "import", "--snapshotter=overlayfs", "--platform=linux/amd64", str(archive))
            self._progress(f"imported {name}")

    def import_image(self, archive: Path, name: str) -> str:
        """Imports the OCI archive ``archive`` (one image) into this node's containerd under the name ``name``
        (e.g. ``dynamig.local/dynamig:0.1.0``, what a chart's values name), as a node that pulled it would
        hold it; returns the image's manifest digest. Nothing is pulled. Side effects: a renamed copy of the
        archive in the node's work directory, containerd's store."""
        named = renamed_oci_archive(archive, name, self.work_dir / "images" / f"{uuid.uuid4().hex}.tar")
        try:
            flags = ("--snapshotter=overlayfs", "--platform=linux/amd64")
            self.ctr("images", "import", *flags, str(named), timeout=300)
        finally:
            named.unlink(missing_ok=True)
        for line in self.ctr("images", "ls").stdout.splitlines()[1:]:
            fields = line.split()
            if fields and fields[0] == name:
                self._progress(f"imported {name} ({fields[2]})")
                return fields[2]
        raise NodeError(f"{archive} imported, but containerd lists no image {name}")

    def trust_registry(self, host: str) -> None:
        """Lets this node's containerd pull from the plain-HTTP registry at ``host`` (``127.0.0.1:5000``): a
        ``hosts.toml`` under the registry configuration directory, as an admin writes one for a mirror.
        containerd reads it at the next pull; nothing restarts."""
        hosts = self.containerd_dir / "certs.d" / host
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts.toml").write_text(
            f'server = "http://{host}"\n\n[host."http://{host}"]\n  capabilities = ["pull", "resolve"]\n'
        )

    def images(self) -> list[str]:
        """The references of the images this node's containerd holds (``ctr images ls``)."""
        return [line.split()[0] for line in self.ctr("images", "ls").stdout.splitlines()[1:] if line.strip()]

    def _start_kubelet(self, cgroup_mode: str) -> None:
        cluster = self.cluster
        pki_dir = self.work_dir / "pki"
        pki_dir.mkdir(exist_ok=True)
        cert = issue_client_cert(
            cluster.pki, pki_dir, "kubelet-client", f"system:node:{self.name}", "system:nodes"
        )
        kubeconfig = self.work_dir / "kubelet.kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(cluster.kubeconfig_for(cert, f"system:node:{self.name}"), sort_keys=False)
        )
        kubeconfig.chmod(0o600)
        self.ip = node_ip()
        self.healthz_port = free_port()
        self.kubelet_port = free_port()
        config = self.work_dir / "kubelet-config.yaml"
        settings = kubelet_config(
            root=self.work_dir,
            address=self.ip,
            port=self.kubelet_port,
            healthz_port=self.healthz_port,
            runtime_socket=self.containerd_socket,
            cgroup_mode=cgroup_mode,
        )
        header = (
            "# failCgroupV1: false because this host mounts cgroup v1 (hybrid), which kubelet 1.36 refuses\n"
            "# unless told (KEP-5573); cgroupsPerQOS off: one test node, nothing to reserve or evict.\n"
            if cgroup_mode == "v1"
            else ""
        )
        config.write_text(header + yaml.safe_dump(settings, sort_keys=False))
        self._kubelet_argv = [
            str(self.binaries["kubelet"]),
            f"--config={config}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={self.kubelet_root}",
            f"--cert-dir={pki_dir / 'kubelet'}",
            f"--hostname-override={self.name}",
            f"--node-ip={self.ip}",
            "--v=2",
        ]
        self.start_kubelet()

    def start_kubelet(self) -> None:
        """(Re)starts the kubelet with the arguments of the first start and waits for its Node to be there."""
        comp = self._spawn("kubelet", self._kubelet_argv)
        self._wait(comp, f"Node {self.name} registered", self._node_registered)

    def stop_kubelet(self) -> None:
        """Stops the kubelet only; containers keep running, as on a real node."""
        comp = self._components.pop("kubelet", None)
        if comp is not None:
            stop_all([comp], timeout=10.0)

    # ------------------------------------------------------------------------------------------ agent
    @property
    def nvml_state(self) -> Path:
        """The simulated NVML's state file: the GPUs' MIG instances, kept across agent restarts."""
        return self.work_dir / "nvml-state.json"

    def seed_nvml_state(self, gpus: str, *, mig_enabled: bool | Sequence[bool]) -> bool:
        """Writes the simulated NVML's state file with ``gpus`` (``MODEL:COUNT``, as :meth:`agent_argv` takes
        them) starting with MIG mode ``mig_enabled`` (one value, or one per GPU), for the agent to adopt, as
        :func:`dynamig.devcluster.sandbox.seed_gpu_state` does for a sandbox node; call it before the first
        :meth:`start_agent`. Seeded with the node's name, as the agent seeds it (the same GPU UUIDs). Leaves
        an existing file as it is; True when written. Side effects: the file; the simulated NVML module of
        this process is configured and reset."""
        from dynamig.agent.main import parse_simulated_gpus
        from dynamig.backends import simnvml

        if self.nvml_state.exists():
            return False
        try:
            simnvml.configure(
                list(parse_simulated_gpus(gpus)),
                state_file=self.nvml_state,
                seed=self.name,
                mig_enabled=mig_enabled,
            )
        finally:
            simnvml.reset()
        return True

    def agent_argv(self, gpus: str, kubeconfig: Path, *extra: str) -> list[str]:
        """``dynamig agent`` for this node as its DaemonSet would run it, over simulated NVML (``gpus`` as
        ``MODEL:COUNT``): the kubelet plugin registered under this kubelet's root, CDI specs where containerd
        reads them, the simulated driver's /dev entries as real character devices. Pure."""
        return [
            sys.executable, "-m", "dynamig", "agent", f"--node={self.name}", "--nvml=simulated",
            f"--simulate-gpus={gpus}", f"--state={self.nvml_state}", "--sim-char-devices",
            "--kubelet-plugin", f"--kubelet-root={self.kubelet_root}", f"--cdi-root={self.cdi_dir}",
            f"--dev-root={self.dev_root}", f"--proc-root={self.proc_root}", f"--kubeconfig={kubeconfig}",
            "--metrics-port=-1", *extra,
        ]  # fmt: skip

    def start_agent(self, gpus: str, kubeconfig: Path, *extra: str) -> Component:
        """Starts (or restarts) the node's agent; see :meth:`agent_argv`. Its log is ``logs/agent.log``."""
        self.stop_agent()
        self.agent_args = (gpus, kubeconfig, *extra)
        return self._spawn("agent", self.agent_argv(gpus, kubeconfig, *extra))

    def stop_agent(self) -> None:
        """Stops the agent (SIGTERM: it deregisters its plugin); pods and MIG instances stay."""
        comp = self._components.pop("agent", None)
        if comp is not None:
            stop_all([comp], timeout=15.0)

    def _node_registered(self) -> bool:
        try:
            status, _ = self.cluster.rest().raw("GET", f"/api/v1/nodes/{self.name}")
        except OSError:
            return False
        return status == 200

    def stop(self) -> None:
        """Stops the agent and the kubelet, kills and removes the pods' containers, stops containerd,
        unmounts what was mounted under the work directory and removes it when it made it. Idempotent."""
        self.stop_agent()
        self.stop_kubelet()
        if "containerd" in self._components and self._components["containerd"].running():
            self._remove_containers()
        stop_all(list(self._components.values()), timeout=10.0)
        self._components = {}
        for mount_point in sorted(_mounts_under(self.work_dir), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount_point], capture_output=True, check=False)
        if self._owns_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def _remove_containers(self) -> None:
        with contextlib.suppress(NodeError, subprocess.TimeoutExpired):
            tasks = self.ctr("tasks", "ls", "-q", check=False).stdout.split()
            for task in tasks:
                self.ctr("tasks", "kill", "--signal=SIGKILL", task, check=False)
            for task in tasks:
                self.ctr("tasks", "delete", "--force", task, check=False, timeout=30)
            containers = self.ctr("containers", "ls", "-q", check=False).stdout.split()
            if containers:
                self.ctr("containers", "delete", *containers, check=False)
