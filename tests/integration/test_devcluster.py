"""The local control plane itself: what it serves, the nodes it registers, its controllers, its clean-up.

Real: etcd, kube-apiserver, kube-scheduler and kube-controller-manager built from the Kubernetes sources, the
``dynamig dev-cluster`` command run as a subprocess, and real signals and process groups. Simulated: nodes are
Node objects written through the API (no kubelet), so pods get bound but never run.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from dynamig.devcluster import BinariesNotFoundError, ControlPlane, find_binaries, sandbox
from dynamig.devcluster.binaries import TOOLS, find_repo_root

pytestmark = pytest.mark.controlplane


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it no longer runs.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def port_open(url: str) -> bool:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


async def poll(probe: Callable[[], Awaitable[bool]], seconds: float = 30.0) -> None:
    """Await ``probe`` until it returns True."""
    deadline = time.monotonic() + seconds
    while not await probe():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.2)


# ------------------------------------------------------------------------------------------ what it serves
async def test_serves_resource_v1_and_enforces_rbac(kube_api: client.ApiClient) -> None:
    groups = await client.ApisApi(kube_api).get_api_versions()
    resource_group = next(g for g in groups.groups if g.name == "resource.k8s.io")
    assert "v1" in [v.version for v in resource_group.versions]
    served = await client.ResourceV1Api(kube_api).get_api_resources()
    assert {"deviceclasses", "resourceclaims", "resourceclaimtemplates", "resourceslices"} <= {
        r.name for r in served.resources
    }

    auth = client.AuthorizationV1Api(kube_api)

    async def allowed(user: str, verb: str, resource: str, group: str = "") -> bool:
        review = await auth.create_subject_access_review(
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": user,
                    "resourceAttributes": {"verb": verb, "resource": resource, "group": group},
                },
            }
        )
        return bool(review.status.allowed)

    # The scheduler's bootstrap role lets it allocate claims, and RBAC (not AlwaysAllow) denies the rest.
    assert await allowed("system:kube-scheduler", "update", "resourceclaims/status", "resource.k8s.io")
    assert not await allowed("system:kube-scheduler", "delete", "namespaces")
    assert not await allowed("someone", "list", "pods")


# ------------------------------------------------------------------------------------------ nodes
async def test_registered_node_is_ready_untainted_and_schedulable(
    control_plane: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    make_node: Callable[..., str],
) -> None:
    core = client.CoreV1Api(kube_api)
    node_name = make_node("plain", labels={"example.com/pool": "a"}, allocatable={"cpu": "2"})
    node = await core.read_node(node_name)
    assert node.spec.taints is None
    assert node.metadata.labels["example.com/pool"] == "a"
    assert node.metadata.labels["kubernetes.io/hostname"] == node_name
    assert node.status.allocatable["cpu"] == "2" and node.status.allocatable["pods"] == "110"
    assert [(c.type, c.status) for c in node.status.conditions if c.type == "Ready"] == [("Ready", "True")]

    def pod(name: str, cpu: str) -> dict[str, object]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node_name},
                "containers": [
                    {"name": "c", "image": "example.invalid/x:1", "resources": {"requests": {"cpu": cpu}}},
                ],
            },
        }

    await core.create_namespaced_pod(namespace, pod("fits", "1"))
    await core.create_namespaced_pod(namespace, pod("too-big", "3"))

    async def fits_bound() -> bool:
        return bool((await core.read_namespaced_pod("fits", namespace)).spec.node_name == node_name)

    async def too_big_rejected() -> bool:
        p = await core.read_namespaced_pod("too-big", namespace)
        return any(
            c.type == "PodScheduled" and c.reason == "Unschedulable" and "Insufficient cpu" in c.message
            for c in p.status.conditions or []
        )

    await poll(fits_bound)
    await poll(too_big_rejected)
    # Registering again is idempotent and keeps the node usable.
    assert control_plane.register_node(node_name, allocatable={"cpu": "2"})["metadata"]["name"] == node_name


# ------------------------------------------------------------------------------------------ controllers
async def test_controller_manager_runs_gc_namespace_and_serviceaccount_controllers(
    kube_api: client.ApiClient,
) -> None:
    core = client.CoreV1Api(kube_api)
    ns = f"ctrl-{os.getpid()}-{time.monotonic_ns() % 100000}"
    await core.create_namespace({"metadata": {"name": ns}})

    async def default_sa() -> bool:
        sas = await core.list_namespaced_service_account(ns)
        return "default" in [s.metadata.name for s in sas.items]

    await poll(default_sa)  # serviceaccount-controller

    owner = await core.create_namespaced_config_map(ns, {"metadata": {"name": "owner"}})
    await core.create_namespaced_config_map(
        ns,
        {
            "metadata": {
                "name": "dependent",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid},
                ],
            }
        },
    )
    await core.delete_namespaced_config_map("owner", ns)

    async def dependent_collected() -> bool:
        names = [c.metadata.name for c in (await core.list_namespaced_config_map(ns)).items]
        return "dependent" not in names

    await poll(dependent_collected)  # garbage-collector-controller

    await core.delete_namespace(ns)

    async def namespace_gone() -> bool:
        return ns not in [n.metadata.name for n in (await core.list_namespace()).items]

    await poll(namespace_gone, seconds=60)  # namespace-controller


def test_service_account_kubeconfig_has_only_granted_rights(
    control_plane: ControlPlane,
    namespace: str,
) -> None:
    control_plane.kubectl("-n", namespace, "create", "serviceaccount", "robot")
    kubeconfig = control_plane.service_account_kubeconfig(namespace, "robot")

    def can_i(*args: str) -> str:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/")}
        argv = [str(control_plane.binaries.kubectl), f"--kubeconfig={kubeconfig}", "auth", "can-i", *args]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        return proc.stdout.strip()

    assert can_i("list", "pods") == "no"
    control_plane.kubectl(
        "-n",
        namespace,
        "create",
        "rolebinding",
        "robot-view",
        "--clusterrole=view",
        f"--serviceaccount={namespace}:robot",
    )
    assert can_i("list", "pods") == "yes"
    assert can_i("delete", "pods") == "no"


def test_kubectl_and_env(control_plane: ControlPlane, make_node: Callable[..., str]) -> None:
    name = make_node("kubectl")
    out = control_plane.kubectl("get", "node", name, "-o", "json")
    assert json.loads(out.stdout)["metadata"]["name"] == name
    env = control_plane.env({"PATH": "/usr/bin"})
    assert env["KUBECONFIG"] == str(control_plane.kubeconfig_path)
    assert env["PATH"].split(os.pathsep)[0] == str(control_plane.binaries.directory)
    failed = control_plane.kubectl("get", "node", "no-such-node", check=False)
    assert failed.returncode != 0 and "not found" in failed.stderr


# ------------------------------------------------------------------------------------------ binaries
def test_binary_lookup_order(control_plane: ControlPlane, tmp_path: Path) -> None:
    bin_dir = control_plane.binaries.directory
    found = find_binaries({"KUBEBUILDER_ASSETS": str(bin_dir)}, build=False)
    assert found.source == "KUBEBUILDER_ASSETS" and found.kube_apiserver == bin_dir / "kube-apiserver"

    partial = tmp_path / "assets"
    partial.mkdir()
    (partial / "kube-apiserver").symlink_to(bin_dir / "kube-apiserver")
    missing = "lacks kube-scheduler, kube-controller-manager, etcd, kubectl"
    with pytest.raises(BinariesNotFoundError, match=missing):
        find_binaries({"KUBEBUILDER_ASSETS": str(partial)}, build=False)

    assert find_binaries({"PATH": str(bin_dir)}, build=False).source == "PATH"
    with pytest.raises(BinariesNotFoundError):
        find_binaries({"PATH": str(partial)}, build=False)

    assert find_repo_root() is not None
    assert find_repo_root(tmp_path) is None
    assert set(TOOLS) == {"kube-apiserver", "kube-scheduler", "kube-controller-manager", "etcd", "kubectl"}


# ------------------------------------------------------------------------------------------ clean-up
async def test_async_use_and_stop_after_a_failure_leave_no_process_port_or_files(
    control_plane: ControlPlane,
) -> None:
    cp = ControlPlane(binaries=control_plane.binaries)
    with pytest.raises(RuntimeError, match="test body failed"):
        async with cp:
            pids = cp.pids
            server = cp.server_url
            work_dir = cp.work_dir
            assert set(pids) == {"etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"}
            assert port_open(server)
            async with cp.api_client() as api:
                namespaces = await client.CoreV1Api(api).list_namespace()
            assert "kube-system" in [n.metadata.name for n in namespaces.items]
            raise RuntimeError("test body failed")
    assert not [name for name, pid in pids.items() if pid_alive(pid)]
    assert not port_open(server)
    assert not work_dir.exists()
    cp.stop()  # idempotent


def test_owner_killed_with_sigkill_takes_components_down(control_plane: ControlPlane, tmp_path: Path) -> None:
    assets = str(control_plane.binaries.directory)
    script = textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from dynamig.devcluster import ControlPlane, find_binaries
        cp = ControlPlane(work_dir=Path({str(tmp_path / "cp")!r}),
                          binaries=find_binaries({{"KUBEBUILDER_ASSETS": {assets!r}}}))
        cp.start()
        print(json.dumps(cp.pids), flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        pids: dict[str, int] = json.loads(owner.stdout.readline())
        assert all(pid_alive(p) for p in pids.values())
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    # No atexit hook runs after SIGKILL: the kernel's parent-death signal must end the components.
    assert wait_for(lambda: not any(pid_alive(p) for p in pids.values()), 10), {
        n: p for n, p in pids.items() if pid_alive(p)
    }


# ------------------------------------------------------------------------------------------ CLI
def test_dev_cluster_cli_up_env_down(control_plane: ControlPlane, tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    env = dict(os.environ, KUBEBUILDER_ASSETS=str(control_plane.binaries.directory))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "dynamig", "dev-cluster", f"--state-dir={state_dir}", *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)

    up = cli("up")
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig = up.stdout.strip()
        assert kubeconfig == str(state_dir / "cluster" / "kubeconfig")
        assert "ready in" in up.stderr
        assert cli("up").stdout.strip() == kubeconfig  # second up: same cluster
        exports = cli("env").stdout.splitlines()
        assert exports[0] == f"export KUBECONFIG={kubeconfig}"
        assert exports[1].startswith(f"export PATH={control_plane.binaries.directory}:")
        kubectl = [str(control_plane.binaries.kubectl), f"--kubeconfig={kubeconfig}"]
        got = subprocess.run(
            [*kubectl, "get", "ns", "kube-system", "-o", "name"], capture_output=True, text=True, check=True
        )
        assert got.stdout.strip() == "namespace/kube-system"
        state = json.loads((state_dir / "state.json").read_text())
        pids = [state["supervisor_pid"], *state["component_pids"].values()]
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), 10)
    assert sorted(p.name for p in state_dir.iterdir()) == ["lock"]
    assert cli("env").returncode == 1


def test_dev_cluster_with_gpu_nodes_runs_dynamig_you_can_kubectl(
    control_plane: ControlPlane, helm: str, tmp_path: Path
) -> None:
    """`up --gpu-node` gives a cluster a newcomer can `kubectl apply -k manifests/examples` against: the CRDs,
    the DeviceClass, Ready managed nodes, an agent per node, the operator, each serving its metrics; the
    examples apply in order (no claim made before its template) and their pods get MIG slices, those written
    for the device plugin too; `kubectl dynamig` is found the README's way; the chart installs into it; the
    GPUs a run left cut start clean next time."""
    state_dir = tmp_path / "state"
    # As a newcomer's shell: this installation's scripts (kubectl-dynamig) are not on PATH.
    scripts = str(Path(sys.executable).parent)
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep) if d != scripts)
    env = dict(os.environ, KUBEBUILDER_ASSETS=str(control_plane.binaries.directory), PATH=path)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "dynamig", "dev-cluster", f"--state-dir={state_dir}", *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False)

    bad = cli("up", "--gpu-node", "n1=B200-999GB:1")
    assert bad.returncode == 2 and "unknown GPU model 'B200-999GB'" in bad.stderr, bad.stderr
    assert not (state_dir / "state.json").exists()  # nothing started

    up = cli(
        "up", "--gpu-node", "gpu-a=A100-80GB:2", "--gpu-node", "gpu-b=H100-80GB:1",
        "--gpu-node", "gpu-c=H100-80GB:1:mig-off",
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig = up.stdout.strip()

        def kubectl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
            argv = [str(control_plane.binaries.kubectl), f"--kubeconfig={kubeconfig}", *args]
            return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=check)

        assert kubectl("get", "deviceclass", "mig.dynamig.io", "-o", "name").stdout.strip()
        nodes = kubectl("get", "nodes", "-l", "dynamig.io/managed=true", "-o", "name").stdout.split()
        assert sorted(nodes) == ["node/gpu-a", "node/gpu-b", "node/gpu-c"]
        want = {"gpu-a-gpu0", "gpu-a-gpu1", "gpu-b-gpu0", "gpu-c-gpu0"}
        assert wait_for(
            lambda: (
                want
                <= set(
                    kubectl("get", "gpart", "-o", "name")
                    .stdout.replace("gpupartition.dynamig.io/", "")
                    .split()
                )
            ),
            60,
        ), kubectl("get", "gpart").stdout

        # :mig-off: gpu-c's H100 starts with MIG mode off and is published whole.
        def whole_state() -> str:
            return kubectl("get", "gpart", "gpu-c-gpu0", "-o", "jsonpath={.status.wholeGpu.state}").stdout

        assert wait_for(lambda: whole_state() == "free", 60), kubectl(
            "get", "gpart", "gpu-c-gpu0", "-o", "yaml"
        ).stdout
        # inject xid: a double-bit ECC error on that GPU reaches its agent (NVML event set) and taints it.
        injected = cli("inject", "xid", "gpu-c", "0", "48")
        assert injected.returncode == 0 and "XID 48 on GPU 0 of gpu-c" in injected.stderr, injected.stderr

        def devices_healthy() -> str:
            path = '{.status.conditions[?(@.type=="DevicesHealthy")].message}'
            return kubectl("get", "gpart", "gpu-c-gpu0", "-o", f"jsonpath={path}").stdout

        assert wait_for(lambda: "XID 48" in devices_healthy(), 30), devices_healthy()
        no_node = cli("inject", "xid", "gpu-z", "0", "48")
        assert no_node.returncode == 1 and "NODE 'gpu-z'" in no_node.stderr, no_node.stderr
        no_instance = cli("inject", "xid", "gpu-b", "0", "gpu0-1g10gb-s5", "94")
        assert no_instance.returncode == 1 and "INSTANCE 'gpu0-1g10gb-s5'" in no_instance.stderr
        status = cli("status").stdout
        for name in ("agent-gpu-a", "agent-gpu-b", "agent-gpu-c", "operator"):
            assert f"{name}: pid" in status and "running" in status, status
        assert "operator" in cli("logs").stdout.split()
        assert "inventory for node gpu-a" in cli("logs", "agent-gpu-a").stdout

        # What the README tells a newcomer to do next: the examples, and the pods get their MIG slices.
        kubectl("create", "namespace", "dynamig-examples")
        root = find_repo_root()
        assert root is not None
        kubectl("apply", "-k", str(root / "manifests" / "examples"))

        def bound(app: str, replicas: int) -> bool:
            pods = json.loads(
                kubectl("get", "pods", "-n", "dynamig-examples", "-l", f"app={app}", "-o", "json").stdout
            )
            return len(pods["items"]) == replicas and all(p["spec"].get("nodeName") for p in pods["items"])

        def inference_bound() -> bool:  # the claim form, and the device-plugin form served unchanged
            return bound("inference", 7) and bound("inference-device-plugin", 2)

        assert wait_for(inference_bound, 120), kubectl(
            "get", "pods,resourceclaims", "-n", "dynamig-examples"
        ).stdout
        failed = kubectl(
            "get", "events", "-n", "dynamig-examples", "-o", "name",
            "--field-selector=reason=FailedResourceClaimCreation",
        ).stdout.split()  # fmt: skip
        assert failed == [], kubectl("get", "events", "-n", "dynamig-examples").stdout

        state = json.loads((state_dir / "state.json").read_text())
        pids = [state["supervisor_pid"], *state["component_pids"].values(), *state["dynamig_pids"].values()]
        assert sorted(state["metrics"]) == ["agent-gpu-a", "agent-gpu-b", "agent-gpu-c", "operator"]
        for name, url in state["metrics"].items():
            assert f"{name}: pid" in status and url in status, status
            with urllib.request.urlopen(url, timeout=10) as resp:
                served = resp.read().decode()
            # The agent's own series (a phase per GPU of its node; instances come and go), the operator's.
            family = (
                f'dynamig_gpu_partition_phase{{Hostname="{name.removeprefix("agent-")}"'
                if name != "operator"
                else "dynamig_operator_build_info{"
            )
            assert family in served, (name, served[:500])

        # The README's next line: eval the exports, and kubectl finds the plugin.
        shell = f'eval "$({shlex.quote(sys.executable)} -m dynamig dev-cluster --state-dir={state_dir} env)"'
        plugin = subprocess.run(
            ["bash", "-c", f"{shell} && kubectl dynamig verify"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert "unknown command" not in plugin.stderr and "gpu-a-gpu0" in plugin.stdout + plugin.stderr, (
            plugin.stdout,
            plugin.stderr,
        )

        # The chart, as the install docs write it, adopts the CRDs and the DeviceClass the sandbox applied.
        installed = subprocess.run(
            [
                helm, "install", sandbox.CHART_RELEASE, str(root / "manifests" / "helm" / "dynamig"),
                "--namespace", sandbox.CHART_NAMESPACE, "--create-namespace", f"--kubeconfig={kubeconfig}",
            ],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert installed.returncode == 0, installed.stderr
        owner = kubectl(
            "get", "deviceclass", "mig.dynamig.io", "-o",
            "jsonpath={.metadata.annotations.meta\\.helm\\.sh/release-namespace}",
        ).stdout  # fmt: skip
        assert owner == sandbox.CHART_NAMESPACE
        assert "running" in cli("status").stdout  # the processes serve on beside the chart's objects
        gpu_state = sorted(p.name for p in state_dir.glob("nvml-*.json"))
        assert gpu_state == ["nvml-gpu-a.json", "nvml-gpu-b.json", "nvml-gpu-c.json"]
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), 15)
    # The simulated GPUs' instances outlive `down` (for `up --keep-gpu-state`); a plain `up` clears them.
    assert sorted(p.name for p in state_dir.glob("nvml-*.json")) == gpu_state
    again = cli("up", "--gpu-node", "gpu-a=A100-80GB:2", "--gpu-node", "gpu-b=H100-80GB:1")
    try:
        assert again.returncode == 0, again.stderr
        removed = "nvml-gpu-a.json, nvml-gpu-b.json, nvml-gpu-c.json"
        assert f"simulated GPUs start clean: removed the last run's {removed}" in again.stderr, again.stderr
    finally:
        assert cli("down").returncode == 0
