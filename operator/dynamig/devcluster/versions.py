"""The Kubernetes versions the local control plane is built at and the tests run against.

``PRIMARY`` is what ``make demo``, the real node and the full test suite use (hack/lib/k8s-module.sh names the
same version for the build scripts; a test keeps the two equal). The other targets run the tests marked
``matrix`` (what differs by version: inventory detection, binding, partitionable devices, the DRA path),
chosen with ``pytest --k8s=<target>``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dynamig.agent.publishing.features import SCALES_FROM, parse_version

PRIMARY = "v1.37.2"

# On 1.35 partitionable devices (KEP-4815) and binding conditions (KEP-5007) are alpha and off; with these
# gates on the API server, scheduler and controller manager dynamig can use the partitionable inventory.
ALPHA_DRA_GATES = ("DRAPartitionableDevices", "DRADeviceBindingConditions")


@dataclass(frozen=True, slots=True)
class KubeTarget:
    """One Kubernetes version with the feature gates turned on for every control-plane component."""

    version: str
    feature_gates: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.version}+alpha" if self.feature_gates else self.version

    @property
    def minor(self) -> int:
        return int(self.version.lstrip("v").split(".")[1])

    @property
    def serves_partitionable(self) -> bool:
        """Whether this target's API server keeps counters and binding conditions: on by default from 1.36,
        with the alpha gates before."""
        return self.minor >= 36 or set(ALPHA_DRA_GATES) <= set(self.feature_gates)

    @property
    def chooses_partitionable(self) -> bool:
        """Whether the agent's ``--inventory=auto`` picks the partitionable inventory here: served, and a
        scheduler that carries it at any size (v1.37.2 on; dynamig.agent.publishing.features)."""
        version = parse_version(self.version)
        return self.serves_partitionable and version is not None and version >= SCALES_FROM

    def gate_flags(self) -> list[str]:
        """``--feature-gates`` for a component ([] when none are turned on)."""
        return (
            [f"--feature-gates={','.join(f'{g}=true' for g in self.feature_gates)}"]
            if self.feature_gates
            else []
        )


MATRIX = (
    KubeTarget(PRIMARY),
    KubeTarget("v1.36.3"),
    KubeTarget("v1.35.4", ALPHA_DRA_GATES),
    KubeTarget("v1.35.4"),
)


def target(name: str) -> KubeTarget:
    """The matrix entry named ``name`` (``v1.36.3``, ``v1.35.4+alpha``, ...); ValueError for any other."""
    for t in MATRIX:
        if t.name == name:
            return t
    raise ValueError(f"unknown Kubernetes target {name!r}; known: {', '.join(t.name for t in MATRIX)}")


def current(env: Mapping[str, str] | None = None) -> KubeTarget:
    """The target named by ``DYNAMIG_K8S_TARGET`` (a matrix name), else the version ``DYNAMIG_K8S_VERSION``
    names (no gates), else the primary one."""
    env = os.environ if env is None else env
    if env.get("DYNAMIG_K8S_TARGET"):
        return target(env["DYNAMIG_K8S_TARGET"])
    return KubeTarget(env.get("DYNAMIG_K8S_VERSION") or PRIMARY)
