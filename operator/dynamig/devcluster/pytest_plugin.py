"""pytest fixtures for tests that need the real local control plane.

Registered once from the repository's root ``conftest.py`` (``pytest_plugins = [...]``) so that ``tests/`` and
``e2e/`` share one control plane per session. Fixtures:

- ``control_plane`` (session): a started :class:`~dynamig.devcluster.ControlPlane`; its work dir (logs under
  ``logs/``) lives in pytest's temporary directory, which pytest keeps for the last few runs.
- ``kube_api`` (session, async): an admin ``kubernetes_asyncio`` ApiClient for that control plane.
- ``namespace`` (function): a fresh namespace with its ``default`` ServiceAccount; on teardown its pods are
  force-deleted (no kubelet would ever confirm a graceful delete) and the namespace is deleted.
- ``crds`` (function): the control plane with the repository's ``crds/*.yaml`` applied and Established.
- ``make_node`` (function): ``make_node(prefix="node", labels=None, allocatable=None) -> str`` registers a
  Ready node with a unique name; the nodes (and, through the garbage collector, slices they own) are deleted
  on teardown.
- ``kube_target`` (session): the :class:`~dynamig.devcluster.versions.KubeTarget` the control planes run,
  chosen with ``--k8s`` (the primary version by default).
- ``lagging_cluster`` (function, over one session-wide cluster): a second control plane whose kube-scheduler
  reaches the API server only through a :class:`~dynamig.devcluster.lagproxy.LagProxy` (watch events held
  back, watches dropped, nomination writes stalled or failed, as the test chooses), with the CRDs and the
  DeviceClass installed; the proxy's settings are reset after each test.
- ``real_node`` (module): a :class:`~dynamig.devcluster.node.RealNode` (kubelet + containerd) registered in
  the session's control plane, with the CRDs and DeviceClass installed and its dynamig agent running over one
  simulated A100-80GB; its Node is deleted on teardown. It fails, never skips, when this host cannot run it.
  :func:`running_real_node` starts the same over other simulated GPUs (MIG mode off, say), for a module's
  own node fixture.

A test using ``control_plane`` (directly or through these fixtures) is marked ``controlplane`` automatically,
so ``pytest -m "not controlplane"`` runs everything that needs no Kubernetes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import pytest

from dynamig.devcluster.controlplane import ControlPlane
from dynamig.devcluster.rest import ApiError
from dynamig.devcluster.versions import MATRIX, PRIMARY, KubeTarget, current, target

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

    from dynamig.devcluster.lagproxy import LaggingCluster
    from dynamig.devcluster.node import RealNode

_CP_KEY = pytest.StashKey[ControlPlane]()
_NODE_STARTS_KEY = pytest.StashKey[list[float]]()
_FIXTURES_NEEDING_CP = {
    "control_plane", "kube_api", "namespace", "make_node", "crds", "real_node", "lagging_cluster",
}  # fmt: skip
REAL_NODE_GPUS = "A100-80GB:1"

MakeNode = Callable[..., str]


def unique_name(prefix: str, request: pytest.FixtureRequest | None = None) -> str:
    """A DNS-1123 name: ``prefix``, a slug of the test name, and random hex (at most 63 characters). Pure."""
    parts = [prefix]
    if request is not None:
        parts.append(re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:30])
    base = "-".join(p for p in parts if p)[:54].strip("-")
    return f"{base}-{uuid.uuid4().hex[:8]}"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--k8s",
        default=None,
        help=f"Kubernetes target of the control plane: {', '.join(t.name for t in MATRIX)} (default: "
        f"{PRIMARY}, or DYNAMIG_K8S_TARGET); other targets run the tests marked `matrix`",
    )


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("--k8s", default=None)
    if name:
        try:
            chosen = target(name)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from exc
        # Every control plane, hold scheduler and node the tests build or start follows it.
        os.environ["DYNAMIG_K8S_TARGET"] = chosen.name
        os.environ["DYNAMIG_K8S_VERSION"] = chosen.version


def pytest_report_header(config: pytest.Config) -> str:
    return f"dynamig Kubernetes target: {current().name}"


@pytest.fixture(scope="session")
def kube_target() -> KubeTarget:
    """The Kubernetes version (and gates) the session's control planes run."""
    return current()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    chosen = current()
    for item in items:
        needs = item.get_closest_marker("matrix")
        if needs is not None and "partitionable" in needs.args and not chosen.serves_partitionable:
            why = f"Kubernetes {chosen.name} serves no partitionable devices or binding conditions"
            item.add_marker(pytest.mark.skip(reason=why))
        if _FIXTURES_NEEDING_CP & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.controlplane)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    cp = config.stash.get(_CP_KEY, None)
    if cp is not None and cp.start_seconds is not None:
        terminalreporter.write_line(
            f"dynamig control plane: started in {cp.start_seconds:.1f}s; component logs were in {cp.log_dir}"
        )
    starts = config.stash.get(_NODE_STARTS_KEY, [])
    if starts:
        terminalreporter.write_line(
            f"dynamig real node: started {len(starts)}x, {', '.join(f'{s:.1f}s' for s in starts)} "
            "(containerd, image import, kubelet registered)"
        )


def _sigterm_to_exit(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so fixture finalizers (control-plane stop) run.
    raise SystemExit(128 + signum)


@pytest.fixture(scope="session")
def control_plane(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ControlPlane]:
    """The session's control plane (started on first use, stopped at session end, even after failures)."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
            signal.signal(signal.SIGTERM, _sigterm_to_exit)
    work_dir = tmp_path_factory.mktemp("controlplane", numbered=True)
    cp = ControlPlane(work_dir=work_dir)
    cp.start()
    request.config.stash[_CP_KEY] = cp
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
async def kube_api(control_plane: ControlPlane) -> AsyncIterator[ApiClient]:
    """An admin ``kubernetes_asyncio`` ApiClient for the session's control plane."""
    async with control_plane.api_client() as api:
        yield api


@pytest.fixture
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (with its ``default`` ServiceAccount) for one test; deleted afterwards."""
    api = control_plane.rest()
    name = unique_name("t", request)
    api.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    # Pod admission needs the default ServiceAccount; the controller creates it too, so 409 is expected.
    with contextlib.suppress(ApiError):
        api.request("POST", f"/api/v1/namespaces/{name}/serviceaccounts", {"metadata": {"name": "default"}})
    try:
        yield name
    finally:
        with contextlib.suppress(ApiError, OSError):
            api.request("DELETE", f"/api/v1/namespaces/{name}/pods?gracePeriodSeconds=0")
            api.request("DELETE", f"/api/v1/namespaces/{name}")


@pytest.fixture
def make_node(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[MakeNode]:
    """Factory: ``make_node(prefix="node", labels=None, allocatable=None) -> name`` of a new Ready node."""
    created: list[str] = []

    def make(
        prefix: str = "node",
        labels: Mapping[str, str] | None = None,
        allocatable: Mapping[str, str] | None = None,
    ) -> str:
        name = unique_name(prefix)
        control_plane.register_node(name, labels=labels, allocatable=allocatable)
        created.append(name)
        return name

    try:
        yield make
    finally:
        for name in created:
            with contextlib.suppress(ApiError, OSError):
                control_plane.delete_node(name)


@pytest.fixture
def crds(control_plane: ControlPlane) -> ControlPlane:
    """Apply the repository's CRDs (idempotent) and wait until the API server serves them."""
    from dynamig.devcluster.sandbox import install_crds

    try:
        install_crds(control_plane)
    except RuntimeError as exc:
        pytest.fail(f"the crds fixture needs a dynamig source checkout: {exc}")
    return control_plane


@pytest.fixture(scope="session")
def _lagging_cluster_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaggingCluster]:
    from dynamig.devcluster.lagproxy import lagging_control_plane
    from dynamig.devcluster.sandbox import install

    with lagging_control_plane(tmp_path_factory.mktemp("lagging-controlplane")) as cluster:
        install(cluster.cp)
        yield cluster


@pytest.fixture
def lagging_cluster(_lagging_cluster_session: LaggingCluster) -> Iterator[LaggingCluster]:
    """The session's control plane with a lagging kube-scheduler (see above); the proxy reset afterwards."""
    _lagging_cluster_session.proxy.reset()
    try:
        yield _lagging_cluster_session
    finally:
        _lagging_cluster_session.proxy.reset()


@contextlib.contextmanager
def running_real_node(
    control_plane: ControlPlane,
    request: pytest.FixtureRequest,
    gpus: str = REAL_NODE_GPUS,
    *,
    mig_enabled: bool | Sequence[bool] = True,
    prefix: str = "real",
) -> Iterator[RealNode]:
    """What ``real_node`` yields, over other simulated GPUs: ``gpus`` (``MODEL:COUNT``) starting with MIG mode
    ``mig_enabled`` (one value, or one per GPU: the node's simulated NVML state is seeded with it before its
    agent first starts). For a module's own node fixture; the node is stopped and its Node deleted after."""
    from dynamig.devcluster.node import RealNode
    from dynamig.devcluster.sandbox import install
    from dynamig.kube.names import MANAGED_NODE_LABEL

    install(control_plane)
    node = RealNode(control_plane, unique_name(prefix))
    node.start()
    if node.start_seconds is not None:
        request.config.stash.setdefault(_NODE_STARTS_KEY, []).append(node.start_seconds)
    try:
        control_plane.kubectl("label", "node", node.name, f"{MANAGED_NODE_LABEL}=true")
        if mig_enabled is not True:
            node.seed_nvml_state(gpus, mig_enabled=mig_enabled)
        node.start_agent(
            gpus,
            control_plane.kubeconfig_path,
            "--interval=0.5",
            "--settle-seconds=0.3",
            "--quarantine-seconds=1",
        )
        yield node
    finally:
        node.stop()
        with contextlib.suppress(ApiError, OSError):
            control_plane.delete_node(node.name)


@pytest.fixture(scope="module")
def real_node(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[RealNode]:
    """A kubelet + containerd node with dynamig's agent (simulated GPUs, real device nodes); see above."""
    with running_real_node(control_plane, request) as node:
        yield node
