"""Repository-wide pytest configuration: one shared control plane for ``tests/`` and ``e2e/``.

The fixtures (``control_plane``, ``kube_api``, ``namespace``, ``make_node``) live in
``dynamig.devcluster.pytest_plugin``; registering the plugin here, at the root, makes a single session-scoped
control plane serve both test trees. ``devices`` serves the tests of the agent's NVML code path: a module that
uses it defines ``nvml`` (the simulated module, configured with the GPUs it needs).
"""

from collections.abc import Iterator
from types import ModuleType

import pytest

from dynamig.agent.nvml_device import NvmlDevices
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
