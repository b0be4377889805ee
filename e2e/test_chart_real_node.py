"""The released chart installed for real, from a registry: the release published, verified, pulled by digest.

Real: the control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager, plus a second
kube-controller-manager with the DaemonSet and root-CA-publisher controllers the first leaves out), a kubelet
and containerd 2.x with runc (CDI on), what ``make release`` writes (``hack/release.sh``: the image built from
the Dockerfile by ``hack/build-image.sh``, cached by its inputs; the chart package; the image's SBOM made by
syft), a local OCI registry (CNCF distribution, built from its Go module) that ``hack/publish.sh`` pushes the
image and the chart to and signs them in with cosign (a key pair the test makes; the SBOM attached as a signed
attestation), cosign verifying both signatures and the attestation, the node's containerd pulling the image by
digest from that registry, and helm installing the chart from it (``oci://``), upgrading and uninstalling it.
The agent (DaemonSet), the operator (Deployment) and the pre-delete hook (Job) run as pods from that image
with their own ServiceAccount tokens. Simulated: the GPUs (``agent.nvml.mode: simulated``: simnvml inside the
agent's container, its MIG state and the driver's device nodes and capability files in a host directory the
chart mounts). This node has no pod network (no CNI), so the values put the chart's pods on the host network
and point them at the API server's address (``apiServer.host``), as a cluster without kube-proxy would; every
other value is one a user writes.

One test, in steps, each timed and printed: release, publish, verify, install (pods Ready, tokens, probes, the
image pulled from the registry by digest), a workload on its MIG slice, ``helm upgrade`` to a second build of
the image (the agent rolls with maxSurge 0, the workload keeps its container and instance), ``helm uninstall``
(the hook Job's pod runs to completion inside helm's default 5-minute timeout; the node is left clean).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from dynamig.demo.cluster import claim_pod, first_available, resource_claim
from dynamig.devcluster.binaries import BinariesNotFoundError, build_tool
from dynamig.devcluster.controlplane import ControlPlane
from dynamig.devcluster.helmrelease import (
    RELEASE_NAME_ANNOTATION,
    RELEASE_NAMESPACE_ANNOTATION,
    adopt_crds,
    forget_release,
)
from dynamig.devcluster.node import (
    ContainerReport,
    RealNode,
    parse_report,
    runnable,
    start_node_controllers,
)
from dynamig.devcluster.processes import Component, free_port, stop_all
from dynamig.devcluster.progress import run_streaming
from dynamig.devcluster.pytest_plugin import unique_name
from dynamig.devcluster.registry import LocalRegistry
from dynamig.devcluster.rest import ApiError
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, VERSION

pytestmark = pytest.mark.controlplane

ROOT = Path(__file__).resolve().parents[1]
DYNAMIG_VERSION: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
UPGRADE_TAG = f"{DYNAMIG_VERSION}-second-build"
COSIGN_PASSWORD = "dynamig-e2e"  # unlocks the test's own signing key
DYNAMIG_CRDS = ("gpupartitions.dynamig.io", "gpupartitionpolicies.dynamig.io")
DEVICE_CLASS = "mig.dynamig.io"
GPUS = "A100-80GB:1"
HELM_DEFAULT_TIMEOUT_S = 300.0
T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], what: str, within_s: float, every_s: float = 0.5) -> T:
    deadline = time.monotonic() + within_s
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within_s:.0f}s waiting for {what}")
        time.sleep(every_s)


class Steps:
    """Times each step of the test and prints it, with a summary at the end."""

    def __init__(self) -> None:
        self.took: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        print(f"\n== {name}", flush=True)
        yield
        self.took.append((name, time.monotonic() - t0))
        print(f"== {name}: {self.took[-1][1]:.1f}s", flush=True)

    def summary(self) -> str:
        return "\n".join(f"  {s:6.1f}s  {name}" for name, s in self.took)


def build_image(revision: str | None = None) -> Path:
    """The image from ``hack/build-image.sh`` (cached by its inputs, as ``make image`` and
    tests/integration/test_image_build.py build it); ``revision`` makes a second build of the same tree."""
    if os.geteuid() != 0:
        pytest.fail("building the image needs root (mmdebstrap, buildah's chroot isolation)")
    env = {**os.environ, **({"DYNAMIG_REVISION": revision} if revision else {})}
    result = run_streaming(["bash", str(ROOT / "hack" / "build-image.sh")], cwd=ROOT, timeout=1800, env=env)
    if result.returncode != 0:
        pytest.fail(f"hack/build-image.sh failed ({result.returncode}):\n{result.stderr_tail}")
    return Path(result.stdout.strip().splitlines()[-1])


def make_release(out: Path, helm: str) -> Path:
    """What ``make release`` writes into ``out`` (hack/release.sh; this tree may be dirty): the image, the
    chart package, the image's SBOM."""
    if os.geteuid() != 0:
        pytest.fail("building the image needs root (mmdebstrap, buildah's chroot isolation)")
    result = run_streaming(
        ["bash", str(ROOT / "hack" / "release.sh")], cwd=ROOT, timeout=1800,
        env={**os.environ, "RELEASE_DIR": str(out), "ALLOW_DIRTY": "1", "DYNAMIG_HELM": helm,
             "PYTHON": sys.executable},
    )  # fmt: skip
    if result.returncode != 0:
        pytest.fail(f"hack/release.sh failed ({result.returncode}):\n{result.stderr_tail}")
    return out


def publish(release: Path, registry: LocalRegistry, helm: str, key: Path) -> tuple[str, str, str]:
    """``hack/publish.sh`` of ``release`` to ``registry``, signed with ``key``: (image reference by digest,
    chart reference, chart digest)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "hack" / "publish.sh"), registry.host, str(release)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PLAIN_HTTP": "1", "DYNAMIG_HELM": helm, "COSIGN_KEY": str(key),
             "COSIGN_PASSWORD": COSIGN_PASSWORD},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    chart_ref, _version, chart_digest = lines["chart"].split()
    return lines["image"], chart_ref, chart_digest


def cosign_key_pair(cosign: str, directory: Path) -> tuple[Path, Path]:
    """A cosign key pair made here (cosign.key encrypted with COSIGN_PASSWORD, cosign.pub)."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [cosign, "generate-key-pair"], cwd=directory, capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "COSIGN_PASSWORD": COSIGN_PASSWORD},
    )  # fmt: skip
    return directory / "cosign.key", directory / "cosign.pub"


def cosign_verify(cosign: str, public_key: Path, ref: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``cosign verify`` (or ``verify-attestation`` with ``extra``) of ``ref`` against ``public_key``, with no
    transparency log (none is written: see hack/publish.sh), over plain HTTP."""
    command = "verify-attestation" if extra else "verify"
    return subprocess.run(
        [cosign, command, "--key", str(public_key), "--insecure-ignore-tlog=true",
         "--allow-http-registry=true", "--output", "json", *extra, ref],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


class Cluster:
    """What the test reads and writes through the API server (admin), synchronously."""

    def __init__(self, cp: ControlPlane, namespace: str, release: str) -> None:
        self.cp, self.ns, self.release = cp, namespace, release
        self.rest = cp.rest()

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.rest.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def pods(self, component: str, namespace: str | None = None) -> list[dict[str, Any]]:
        selector = f"app.kubernetes.io/instance={self.release},app.kubernetes.io/component={component}"
        found = self.get(f"/api/v1/namespaces/{namespace or self.ns}/pods?labelSelector={selector}")
        return list((found or {}).get("items") or [])

    def ready_pod(self, component: str) -> dict[str, Any] | None:
        """The component's one pod once it runs and is Ready (and no other pod of it is left)."""
        pods = self.pods(component)
        if len(pods) != 1 or pods[0]["metadata"].get("deletionTimestamp"):
            return None
        pod = pods[0]
        conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
        return pod if pod["status"].get("phase") == "Running" and conditions.get("Ready") == "True" else None

    def partition(self, name: str) -> dict[str, Any] | None:
        return self.get(f"/apis/{GROUP}/{VERSION}/{GPU_PARTITION_PLURAL}/{name}")

    def token_claims(self, pod: dict[str, Any]) -> dict[str, Any]:
        """The claims of the ServiceAccount token mounted in the pod's container (read in the container)."""
        read = (
            "import base64,json;t=open('/var/run/secrets/kubernetes.io/serviceaccount/token').read();"
            "p=t.split('.')[1];print(base64.urlsafe_b64decode(p+'='*(-len(p)%4)).decode())"
        )
        out = self.cp.kubectl(
            "exec", "-n", self.ns, pod["metadata"]["name"], "--", "python", "-c", read, timeout=60
        ).stdout
        claims: dict[str, Any] = json.loads(out)
        return claims


class PodWatch:
    """Polls the pods of a label selector in a thread: the most that were pending or running at once (a pod
    whose containers ended no longer counts), and each pod's phases and node (a rollout or a hook Job may be
    quicker than any later look)."""

    def __init__(self, cluster: Cluster, component: str, namespace: str | None = None) -> None:
        self.cluster, self.component, self.namespace = cluster, component, namespace
        self.most_at_once = 0
        self.seen: dict[str, dict[str, Any]] = {}  # uid -> {name, phases, node, image}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(ApiError, OSError):
                pods = self.cluster.pods(self.component, self.namespace)
                active = [p for p in pods if p["status"].get("phase") not in ("Succeeded", "Failed")]
                self.most_at_once = max(self.most_at_once, len(active))
                for p in pods:
                    entry = self.seen.setdefault(
                        p["metadata"]["uid"], {"name": p["metadata"]["name"], "phases": []}
                    )
                    phase = p["status"].get("phase")
                    if phase and (not entry["phases"] or entry["phases"][-1] != phase):
                        entry["phases"].append(phase)
                    entry["node"] = p["spec"].get("nodeName")
                    entry["image"] = p["spec"]["containers"][0]["image"]
                    if phase in ("Succeeded", "Failed") and "log" not in entry:
                        path = f"/api/v1/namespaces/{p['metadata']['namespace']}/pods/{entry['name']}/log"
                        status, log = self.cluster.rest.raw("GET", path)
                        entry["log"] = log if status == 200 else f"({status}) {log}"
            self._stop.wait(0.2)

    def __enter__(self) -> PodWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def nvml_live(state_file: Path) -> dict[tuple[int, int], tuple[str, int]]:
    """(gpu, GI id) -> (profile, start) of the instances the simulated GPUs hold, from NVML's history."""
    live: dict[tuple[int, int], tuple[str, int]] = {}
    for e in json.loads(state_file.read_text())["history"]:
        if e["kind"] == "create-gi":
            live[(e["gpu_index"], e["gi_id"])] = (e["profile"], e["start"])
        elif e["kind"] == "destroy-gi":
            live.pop((e["gpu_index"], e["gi_id"]), None)
    return live


def nvml_history(state_file: Path) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = json.loads(state_file.read_text())["history"]
    return history


@pytest.fixture(scope="module")
def chart_node(control_plane: ControlPlane) -> Iterator[RealNode]:
    """A kubelet + containerd node with no dynamig on it (the chart puts it there), and the controllers its
    DaemonSet pods and ServiceAccount tokens need."""
    node = RealNode(control_plane, unique_name("chart"))
    controllers: Component | None = None
    try:
        controllers = start_node_controllers(control_plane, control_plane.work_dir / "node-controllers")
        node.start()
        yield node
    finally:
        node.stop()
        if controllers is not None:
            stop_all([controllers])
        with contextlib.suppress(ApiError, OSError):
            control_plane.delete_node(node.name)


@pytest.fixture(scope="module")
def oci_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    """The local OCI registry the release is published to (CNCF distribution, plain HTTP on loopback)."""
    try:
        binary = build_tool("build-oci-tool.sh", "registry")
    except BinariesNotFoundError as exc:
        pytest.fail(f"the registry could not be built from its Go module: {exc}")
    registry = LocalRegistry(binary, tmp_path_factory.mktemp("registry")).start()
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture(scope="module")
def cosign() -> str:
    try:
        return str(build_tool("build-oci-tool.sh", "cosign"))
    except BinariesNotFoundError as exc:
        pytest.fail(f"cosign could not be built from its Go module: {exc}")


def user_values(cp: ControlPlane, node: RealNode, release: str, sim_dir: Path, image: str) -> dict[str, Any]:
    """What a platform team writes for this node (paths, the image by digest from their registry, one operator
    replica pinned to it), plus simulated GPUs and the host-network settings a node without a pod network
    needs."""
    repository, digest = image.split("@")
    return {
        "image": {"repository": repository, "digest": digest},
        # No kube-proxy and no CNI here: the pods reach the API server on the host's loopback address.
        "apiServer": {"host": "127.0.0.1", "port": int(cp.server_url.rsplit(":", 1)[1])},
        "operator": {
            "replicas": 1,
            "hostNetwork": True,
            "metricsPort": free_port(),
            "healthPort": free_port(),
            "peering": {"name": release},
            "nodeSelector": {"kubernetes.io/hostname": node.name},
        },
        "agent": {
            "hostNetwork": True,
            "metricsPort": free_port(),
            "kubeletDir": str(node.kubelet_root),
            "cdiRoot": str(node.cdi_dir),
            "nvml": {"mode": "simulated", "simulated": {"gpus": GPUS, "hostDir": str(sim_dir)}},
        },
        # Each GPU left without instances (the default, baseline, keeps the layout of GPUs that have none).
        "uninstall": {"hostNetwork": True, "leave": "empty"},
    }


def test_the_published_chart_installs_from_a_registry_upgrades_and_uninstalls_on_a_real_node(
    chart_node: RealNode,
    control_plane: ControlPlane,
    helm: str,
    oci_registry: LocalRegistry,
    cosign: str,
    tmp_path: Path,
) -> None:
    cp, node, steps = control_plane, chart_node, Steps()
    release = unique_name("dynamig")  # holds the chart name: the fullname is the release name
    k = Cluster(cp, release, release)
    sim_dir = node.work_dir / "simulated-gpus"
    state = sim_dir / "nvml-state.json"
    gpu = f"{node.name}-gpu0"
    workload_ns = f"{release}-work"
    policy = release
    pool_label = f"dynamig-e2e-pool={release}"

    def run_helm(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [helm, *args, "--namespace", release],
            capture_output=True, text=True, timeout=timeout, env=cp.env(), check=False,
        )  # fmt: skip

    existing_class = cp.kubectl("get", "deviceclass", DEVICE_CLASS, "--ignore-not-found", "-o", "name").stdout
    try:
        # ---- 1. make release: the image, the chart package, the image's SBOM (syft) ----------------------
        with steps.step("release: hack/release.sh builds (or reuses) the image, packages the chart, SBOM"):
            dist = make_release(tmp_path / "release", helm)
            archive = dist / f"dynamig-image-{DYNAMIG_VERSION}.oci.tar"
            digest = (dist / f"dynamig-image-{DYNAMIG_VERSION}.oci.tar.digest").read_text().strip()
            sbom = json.loads((dist / f"dynamig-{DYNAMIG_VERSION}.spdx.json").read_text())
            assert sbom["spdxVersion"] == "SPDX-2.3", sbom.get("spdxVersion")

        # ---- 2. published to the registry and signed; the node has not got the image ----------------------
        with steps.step("publish: hack/publish.sh pushes image and chart, signs both, attests the SBOM"):
            key, public_key = cosign_key_pair(cosign, tmp_path / "keys")
            image, chart_ref, chart_digest = publish(dist, oci_registry, helm, key)
            repository = f"{oci_registry.host}/dynamig"
            assert image == f"{repository}@{digest}", (image, digest)  # pushed as built
            assert chart_ref == f"oci://{oci_registry.host}/charts/dynamig", chart_ref
            assert not [i for i in node.images() if i.startswith(repository)], node.images()
            print(f"  image {image}\n  chart {chart_ref}:{DYNAMIG_VERSION} ({chart_digest})")

        # ---- 3. what an admission controller or an auditor checks before the install ----------------------
        with steps.step("verify: cosign verifies the image's and the chart's signatures and the SBOM"):
            chart_by_digest = f"{oci_registry.host}/charts/dynamig@{chart_digest}"
            for ref, signed_digest in ((image, digest), (chart_by_digest, chart_digest)):
                verified = cosign_verify(cosign, public_key, ref)
                assert verified.returncode == 0, verified.stdout + verified.stderr
                payloads = json.loads(verified.stdout)  # each signature verified (cosign prints only those)
                signed = {p["critical"]["image"]["docker-manifest-digest"] for p in payloads}
                kinds = {p["critical"]["type"] for p in payloads}
                assert signed == {signed_digest}, payloads
                assert "https://sigstore.dev/cosign/sign/v1" in kinds, payloads
                print(f"  {ref}: {len(payloads)} verified payload(s) {sorted(kinds)}")
            # The attestation carries the release's SBOM, byte for byte as JSON.
            attested = cosign_verify(cosign, public_key, image, "--type", "spdxjson")
            assert attested.returncode == 0, attested.stdout + attested.stderr
            (envelope,) = [json.loads(line) for line in attested.stdout.splitlines() if line.strip()]
            statement = json.loads(base64.b64decode(envelope["payload"]))
            assert statement["predicateType"] == "https://spdx.dev/Document", statement["predicateType"]
            assert statement["predicate"] == sbom
            assert statement["subject"][0]["digest"]["sha256"] == digest.removeprefix("sha256:")
            # The check can fail: a key pair that did not sign refuses both.
            _, other_key = cosign_key_pair(cosign, tmp_path / "other-keys")
            for ref in (image, chart_by_digest):
                refused = cosign_verify(cosign, other_key, ref)
                assert refused.returncode != 0, refused.stdout
            print(f"  signatures of {image} and {chart_by_digest} verified; SBOM attestation verified")

        # ---- 3. helm install: the agent and the operator run as pods and go Ready -------------------------
        with steps.step("helm install --wait: agent and operator pods Ready"):
            # The node as a GPU node is labelled (opt-in label; GPU feature discovery's label).
            cp.kubectl(
                "label",
                "node",
                node.name,
                "dynamig.io/managed=true",
                "nvidia.com/gpu.present=true",
                pool_label,
            )
            # The CRDs (and the DeviceClass) exist when an earlier test of the session made them: adopted,
            # as a user moving to Helm marks them.
            crds = [
                c
                for c in DYNAMIG_CRDS
                if cp.kubectl("get", "crd", c, "--ignore-not-found", "-o", "name").stdout
            ]
            adopt_crds(cp, crds, release, release)
            if existing_class.strip():
                cp.kubectl(
                    "label", "--overwrite", "deviceclass", DEVICE_CLASS, "app.kubernetes.io/managed-by=Helm"
                )
                cp.kubectl(
                    "annotate", "--overwrite", "deviceclass", DEVICE_CLASS,
                    f"{RELEASE_NAME_ANNOTATION}={release}", f"{RELEASE_NAMESPACE_ANNOTATION}={release}",
                )  # fmt: skip
            values = tmp_path / "values.yaml"
            values.write_text(yaml.safe_dump(user_values(cp, node, release, sim_dir, image)))
            print(values.read_text())
            # The node pulls from the registry as from a mirror its admin configured (plain HTTP on loopback).
            node.trust_registry(oci_registry.host)
            chart = (chart_ref, "--version", DYNAMIG_VERSION, "--plain-http")
            done = run_helm(
                "install", release, *chart, "--create-namespace", "-f", str(values), "--wait", "--timeout=5m"
            )
            assert done.returncode == 0, done.stdout + done.stderr
            agent = wait_until(lambda: k.ready_pod("agent"), "the agent pod Ready", 60)
            operator = wait_until(lambda: k.ready_pod("operator"), "the operator pod Ready", 60)

        with steps.step("pods: own ServiceAccount tokens, probes answering"):
            for pod, sa in ((agent, f"{release}-agent"), (operator, f"{release}-operator")):
                spec = pod["spec"]
                assert spec["serviceAccountName"] == sa and spec["nodeName"] == node.name, spec
                claims = k.token_claims(pod)
                assert claims["sub"] == f"system:serviceaccount:{release}:{sa}", claims
                bound = claims["kubernetes.io"]
                assert bound["pod"]["name"] == pod["metadata"]["name"], claims  # a bound, projected token
                assert bound["node"]["name"] == node.name, claims  # what the node admission policy reads
                (status,) = pod["status"]["containerStatuses"]
                assert status["ready"] and status["started"] and status["restartCount"] == 0, status
                assert status["imageID"] == image, (status, image)  # pulled from the registry by digest
                assert spec["containers"][0]["image"] == image, spec["containers"][0]
                print(
                    f"  {pod['metadata']['name']}: token of {claims['sub']}, bound to {bound['node']['name']}"
                )
            assert image in node.images(), node.images()
            gets = oci_registry.manifest_gets("dynamig")
            pulls = [g for g in gets if g.user_agent.startswith("containerd")]
            assert pulls and {g.reference for g in pulls} == {digest}, pulls
            assert all(g.status == 200 for g in pulls), pulls
            print(f"  containerd pulled {image}: {len(pulls)} manifest GET(s)")
            # The probes the kubelet runs answer on the pods' (host) ports.
            for port, path in (
                (spec_port(agent, "metrics"), "/readyz"),
                (spec_port(agent, "metrics"), "/healthz"),
                (spec_port(operator, "health"), "/healthz"),
                (spec_port(operator, "metrics"), "/metrics"),
            ):
                assert http_status(node.ip, port, path) == 200, (port, path)
            # The agent, as its own ServiceAccount, published the node's GPU; its kubelet plugin registered.
            part = wait_until(lambda: k.partition(gpu), f"GpuPartition {gpu}", 60)
            assert part["status"].get("phase"), part
            assert (node.kubelet_root / "plugins_registry" / "mig.dynamig.io-reg.sock").exists()

        # ---- 4. a workload on its MIG slice ---------------------------------------------------------------
        with steps.step("workload: a pod on a 1g.10gb slice prints its MIG UUID"):
            cp.rest().request("POST", "/api/v1/namespaces", {"metadata": {"name": workload_ns}})
            cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(policy_object(policy, pool_label)))

            def offered() -> bool | None:
                p = k.partition(gpu) or {}
                return True if "1g.10gb" in ((p.get("spec") or {}).get("offeredProfiles") or []) else None

            wait_until(offered, "the operator to offer 1g.10gb on the GPU", 90)
            template = claim_template("slice", ["1g.10gb"])
            k.rest.request(
                "POST", f"/apis/resource.k8s.io/v1/namespaces/{workload_ns}/resourceclaimtemplates", template
            )
            pod = runnable(claim_pod("tenant", {"kubernetes.io/hostname": node.name}, template="slice"))
            k.rest.request("POST", f"/api/v1/namespaces/{workload_ns}/pods", pod)
            report = wait_until(
                lambda: workload_report(k, workload_ns, "tenant"), "the workload reporting", 180
            )
            inst = instance_of(k, gpu, workload_ns, "tenant")
            uuid = report.env.get("DYNAMIG_MIG_UUIDS")
            caps = report.capability_nodes
            print(f"  tenant: {inst['profile']}@{inst['start']} MIG UUID {uuid}; capability nodes {caps}")
            assert uuid == inst["migUUID"], (report.env, inst)
            assert len(report.capability_nodes) == 2, report.devices  # its GI's and its CI's
            container = workload_container(k, workload_ns, "tenant")

        # ---- 5. helm upgrade to a second build: the agent rolls, the workload stays -----------------------
        with steps.step("image: a second build (another revision) pushed to the registry"):
            second = build_image(revision=f"{DYNAMIG_VERSION}-second-build")
            second_digest = (second.parent / "digest").read_text().strip()
            assert second_digest != digest and image_id(second) != image_id(archive), "another image"
            subprocess.run(
                ["skopeo", "copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false",
                 f"oci-archive:{second}", f"docker://{repository}:{UPGRADE_TAG}"],
                capture_output=True, text=True, timeout=300, check=True,
            )  # fmt: skip
            second_image = f"{repository}@{second_digest}"

        with steps.step("helm upgrade --wait: the agent rolls (maxSurge 0), the workload keeps its instance"):
            events = len(nvml_history(state))
            with PodWatch(k, "agent") as agents:
                done = run_helm(
                    "upgrade", release, *chart, "-f", str(values), "--set", f"image.digest={second_digest}",
                    "--wait", "--timeout=5m",
                )  # fmt: skip
                assert done.returncode == 0, done.stdout + done.stderr
                new_agent = wait_until(
                    lambda: ready_with_image(k, "agent", second_image), "the upgraded agent Ready", 120
                )
            ds = k.get(f"/apis/apps/v1/namespaces/{release}/daemonsets/{release}-agent")
            assert ds is not None
            assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0, ds["spec"][
                "updateStrategy"
            ]
            assert agents.most_at_once == 1, f"two agent pods at once on one node: {agents.seen}"
            assert new_agent["metadata"]["uid"] != agent["metadata"]["uid"]
            (new_status,) = new_agent["status"]["containerStatuses"]
            assert new_status["imageID"] == second_image, new_status  # the second build runs
            assert {s["image"] for s in agents.seen.values()} >= {second_image}
            assert workload_container(k, workload_ns, "tenant") == container, (
                "the workload kept its container"
            )
            assert instance_of(k, gpu, workload_ns, "tenant")["migUUID"] == inst["migUUID"]
            since = nvml_history(state)[events:]
            assert not [e for e in since if e["kind"].startswith("destroy")], since
            assert (node.kubelet_root / "plugins_registry" / "mig.dynamig.io-reg.sock").exists()
            old_name, new_name = agent["metadata"]["name"], new_agent["metadata"]["name"]
            print(f"  agent {old_name} -> {new_name}; NVML events since: {since}")

        # ---- 6. helm uninstall: the hook Job's pod runs to completion; nothing left on the node ---------
        with steps.step("workload deleted (the upgraded agent unprepares its claim)"):
            k.rest.request("DELETE", f"/api/v1/namespaces/{workload_ns}/pods/tenant")
            wait_until(
                lambda: True if k.get(f"/api/v1/namespaces/{workload_ns}/pods/tenant") is None else None,
                "the workload gone",
                90,
            )

        with steps.step("helm uninstall --wait (default timeout): the pre-delete hook Job runs as a pod"):
            t0 = time.monotonic()
            with PodWatch(k, "uninstall") as hooks:
                done = run_helm("uninstall", release, "--wait", timeout=HELM_DEFAULT_TIMEOUT_S + 60)
            took = time.monotonic() - t0
            print(done.stdout.strip())
            assert done.returncode == 0, done.stdout + done.stderr
            assert took < HELM_DEFAULT_TIMEOUT_S, took
            assert hooks.seen, "no hook pod was seen"
            (hook,) = hooks.seen.values()
            assert hook["node"] == node.name and hook["phases"][-1] == "Succeeded", hook
            print(f"  hook pod {hook['name']}: {' -> '.join(hook['phases'])}; uninstall took {took:.1f}s")
            print("  " + hook.get("log", "(no log)").replace("\n", "\n  "))

        with steps.step("node clean"):

            def no_dynamig_tasks() -> bool | None:
                tasks = node.ctr("tasks", "ls", "-q").stdout.split()
                containers = node.ctr("containers", "ls").stdout
                running = [t for t in tasks if t in containers and "dynamig" in containers]
                return True if not running else None

            wait_until(no_dynamig_tasks, "the chart's containers stopped", 60)
            leftovers = [
                *node.kubelet_root.glob("plugins/mig.dynamig.io/*"),
                *node.kubelet_root.glob("plugins_registry/mig.dynamig.io*"),
                *node.cdi_dir.glob("k8s.mig.dynamig.io-*"),
                *sim_dir.glob("dev/nvidia*"),
                *sim_dir.glob("dev/nvidia-caps/*"),
                *sim_dir.glob("proc/driver/nvidia/capabilities/*"),
            ]
            assert leftovers == [], leftovers
            assert k.partition(gpu) is None
            slices = k.get(f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName={node.name}")
            assert not (slices or {}).get("items"), slices
            wait_until(
                lambda: True if not (k.pods("agent") or k.pods("operator") or k.pods("uninstall")) else None,
                "the release's pods deleted",
                60,
            )
            # uninstall.leave: empty: the GPU is left without instances (the workload's was free again).
            assert nvml_live(state) == {}, f"MIG instances left on the GPU: {nvml_live(state)}"
    except BaseException:
        print(diagnostics(cp, node, release))
        raise
    finally:
        print("\nchart on the real node, time per step:\n" + steps.summary())
        cp.kubectl("delete", "gpupartitionpolicy", policy, "--ignore-not-found", "--timeout=30s", check=False)
        cp.kubectl("delete", "namespace", workload_ns, "--ignore-not-found", "--wait=false", check=False)
        cp.kubectl("label", "node", node.name, "dynamig-e2e-pool-", check=False)
        forget_release(cp, helm, release, release, DYNAMIG_CRDS, ROOT / "crds")
        if existing_class.strip():
            from dynamig.devcluster.sandbox import install

            install(cp)


def diagnostics(cp: ControlPlane, node: RealNode, namespace: str) -> str:
    """What a failed run shows: the release's pods and events, their logs, the ends of the node's logs."""
    parts = []
    for args in (
        ("get", "pods", "-A", "-o", "wide"),
        ("get", "daemonsets,deployments,jobs", "-n", namespace, "-o", "wide"),
        ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
        ("logs", "-n", namespace, "-l", "app.kubernetes.io/name=dynamig", "--all-containers", "--tail=40"),
    ):
        proc = cp.kubectl(*args, check=False)
        parts.append(f"$ kubectl {' '.join(args)}\n{proc.stdout}{proc.stderr}")
    for log in ("kubelet.log", "containerd.log"):
        path = node.log_dir / log
        if path.exists():
            parts.append(f"--- {path} (end)\n" + "\n".join(path.read_text().splitlines()[-30:]))
    return "\n".join(parts)


def image_id(archive: Path) -> str:
    """The image's id as the container runtime reports it (``imageID``): the digest of its config."""
    with tarfile.open(archive) as tar:

        def blob(digest: str) -> Any:
            member = tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
            assert member is not None
            return json.loads(member.read())

        index_file = tar.extractfile("index.json")
        assert index_file is not None
        (manifest,) = json.loads(index_file.read())["manifests"]
        config: str = blob(manifest["digest"])["config"]["digest"]
        return config


def spec_port(pod: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == name]
    return int(port)


def http_status(host: str, port: int, path: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def policy_object(name: str, pool_label: str) -> dict[str, Any]:
    key, _, value = pool_label.partition("=")
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GpuPartitionPolicy",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"matchLabels": {key: value}},
            "gpuProducts": ["A100-80GB"],
            "mode": "Dynamic",
            "allowedProfiles": ["1g.10gb", "2g.20gb"],
        },
    }


def claim_template(name: str, alternatives: list[str]) -> dict[str, Any]:
    claim = resource_claim(name, {"firstAvailable": first_available(alternatives)})
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": claim["spec"]},
    }


def workload_report(k: Cluster, ns: str, name: str) -> ContainerReport | None:
    pod = k.get(f"/api/v1/namespaces/{ns}/pods/{name}")
    if pod is None or pod["status"].get("phase") != "Running":
        assert pod is None or pod["status"].get("phase") not in ("Failed", "Succeeded"), pod
        return None
    status, log = k.rest.raw("GET", f"/api/v1/namespaces/{ns}/pods/{name}/log")
    return parse_report(log) if status == 200 else None


def workload_container(k: Cluster, ns: str, name: str) -> tuple[str, int]:
    pod = k.get(f"/api/v1/namespaces/{ns}/pods/{name}")
    assert pod is not None
    (status,) = pod["status"]["containerStatuses"]
    assert "running" in status["state"], status
    return status["containerID"], status["restartCount"]


def instance_of(k: Cluster, gpu: str, ns: str, pod_name: str) -> dict[str, Any]:
    """The GpuPartition's status entry of the instance the pod's claim was allocated."""
    pod = k.get(f"/api/v1/namespaces/{ns}/pods/{pod_name}")
    assert pod is not None
    (claim_status,) = pod["status"]["resourceClaimStatuses"]
    claim = k.get(
        f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{claim_status['resourceClaimName']}"
    )
    assert claim is not None
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    part = k.partition(gpu)
    assert part is not None
    for inst in part["status"]["instances"]:
        if inst["deviceName"] == result["device"]:
            return dict(inst)
    raise AssertionError(f"{result['device']} not in {gpu}'s status: {part['status']['instances']}")


def ready_with_image(k: Cluster, component: str, image: str) -> dict[str, Any] | None:
    pod = k.ready_pod(component)
    return pod if pod and pod["spec"]["containers"][0]["image"] == image else None
