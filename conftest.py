"""Repository-wide pytest configuration: one shared control plane for ``tests/`` and ``e2e/``.

The fixtures (``control_plane``, ``kube_api``, ``namespace``, ``make_node``) live in
``dynamig.devcluster.pytest_plugin``; registering the plugin here, at the root, makes a single session-scoped
control plane serve both test trees. ``devices`` serves the tests of the agent's NVML code path: a module that
uses it defines ``nvml`` (the simulated module, configured with the GPUs it needs). ``helm``: the helm
binary the chart tests run.
"""

from collections.abc import Iterator
from types import ModuleType

import pytest

from dynamig.agent.nvml.device import NvmlDevices
from dynamig.devcluster.binaries import BinariesNotFoundError, build_tool
from dynamig.geometry.catalog import load_catalog

pytest_plugins = ["dynamig.devcluster.pytest_plugin"]


@pytest.fixture
def devices(nvml: ModuleType) -> Iterator[NvmlDevices]:
    """The agent's NVML session over the ``nvml`` module a test module provides (the simulated one)."""
    d = NvmlDevices(nvml, load_catalog())
    d.init()
    yield d
    d.shutdown()


@pytest.fixture
def sim() -> Iterator[ModuleType]:
    """The simulated NVML module (the test configures its GPUs), emptied afterwards."""
    from dynamig.backends.nvml import load_nvml

    module: ModuleType = load_nvml("simulated")
    yield module
    module.configure(gpus=[], state_file=None)


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of the helm binary (built once from its Go module; cached). A failed build fails the tests
    (``make test`` builds helm first), never skips them."""
    try:
        return str(build_tool("build-helm.sh"))
    except BinariesNotFoundError as exc:
        pytest.fail(f"helm could not be built from its Go module (make helm): {exc}")
