"""The operator's daemons carry no Kopf finalizer, through Kopf internals (Kopf has no public switch): with
the installed Kopf, Kopf's own finalizer decision says no for a policy and for the GpuPartition CRD; a Kopf
whose internals moved stops the operator at start-up with an error that names Kopf, its version and what to
do, instead of an operator that quietly puts the finalizer back (or a bare AttributeError).

Real: Kopf's registry, its handler dataclasses and its ``SpawningRegistry.requires_finalizer``, the decision
its reactor takes before adding a finalizer. The object deleted while no operator runs is shown against the
API server by tests/integration/test_policy_crd_operator.py.
"""

from __future__ import annotations

import dataclasses
import logging
from importlib.metadata import version
from typing import Any, cast

import kopf
import pytest
from kopf._cogs.structs import bodies, ephemera, patches, references
from kopf._core.intents import causes

from dynamig.geometry.catalog import load_catalog
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, POLICY_PLURAL, VERSION
from dynamig.operator.handlers import KopfChanged, _without_finalizers, build_registry
from dynamig.operator.kubeio import KubeIO
from dynamig.operator.kueue_checks import CRD as KUEUE_CRD
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.reconciler import Reconciler
from dynamig.operator.settings import OperatorSettings


def _registry() -> kopf.OperatorRegistry:
    settings = OperatorSettings(agent_lease_namespace="dynamig-system")  # the Lease watchdog daemon too
    reconciler = Reconciler(cast(KubeIO, object()), load_catalog(), OperatorMetrics(), settings)
    return build_registry(reconciler, settings)


def _spawning_cause(group: str, plural: str, name: str) -> causes.SpawningCause:
    resource = references.Resource(group=group, version="v1" if group != GROUP else VERSION, plural=plural)
    body = bodies.Body({"apiVersion": f"{group}/v1", "metadata": {"name": name}})
    return causes.SpawningCause(
        logger=logging.getLogger("test"),
        indices=cast(ephemera.Indices, {}),
        memo=ephemera.Memo(),
        resource=resource,
        patch=patches.Patch(),
        body=body,
        reset=False,
    )


def test_kopf_itself_adds_no_finalizer_for_the_daemons() -> None:
    registry = _registry()
    spawning = registry._spawning
    assert {type(h).__name__ for h in spawning._handlers} == {"DaemonHandler"}
    assert len(spawning._handlers) == 3  # the policy loop, the Lease watchdog, Kueue's AdmissionChecks
    policy = _spawning_cause(GROUP, POLICY_PLURAL, "p")
    crd = _spawning_cause(
        "apiextensions.k8s.io", "customresourcedefinitions", f"{GPU_PARTITION_PLURAL}.{GROUP}"
    )
    kueue = _spawning_cause("apiextensions.k8s.io", "customresourcedefinitions", KUEUE_CRD)
    # The daemons serve these objects (the decision is not vacuous) ...
    assert all(list(spawning.iter_handlers(cause)) for cause in (policy, crd, kueue))
    # ... and Kopf's reactor, asking the registry, adds no finalizer for them.
    assert spawning.requires_finalizer(policy) is False
    assert spawning.requires_finalizer(crd) is False
    assert spawning.requires_finalizer(kueue) is False
    # Without the guard's rewrite Kopf would (the check above can fail).
    plain = kopf.OperatorRegistry()
    kopf.daemon(GROUP, VERSION, POLICY_PLURAL, registry=plain)(lambda **_: None)
    assert plain._spawning.requires_finalizer(policy) is True


class _NoDaemonList:
    """A registry as a Kopf that moved its daemons elsewhere would have it."""


@dataclasses.dataclass
class DaemonHandler:  # same name as Kopf's, without the field the guard rewrites
    id: str


class _Spawning:
    def __init__(self, handlers: list[Any]) -> None:
        self._handlers = handlers

    def requires_finalizer(self, cause: Any) -> bool:
        return True


class _Registry:
    def __init__(self, handlers: list[Any]) -> None:
        self._spawning = _Spawning(handlers)


@pytest.mark.parametrize(
    ("registry", "what"),
    [
        (_NoDaemonList(), "its registry has no daemon list"),
        (_Registry([]), "its daemon registry holds nothing"),
        (_Registry([object()]), "its daemon registry holds ['object'], not DaemonHandlers"),
        (_Registry([DaemonHandler("policy_loop")]), "its DaemonHandler has no requires_finalizer field"),
    ],
)
def test_a_kopf_whose_internals_moved_stops_the_start_with_a_clear_error(registry: Any, what: str) -> None:
    with pytest.raises(KopfChanged) as caught:
        _without_finalizers(registry)
    message = str(caught.value)
    assert message.startswith(f"Kopf {version('kopf')} is not compatible with dynamig: {what}"), message
    assert "requirements/runtime.lock" in message
