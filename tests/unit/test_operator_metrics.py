"""The operator's reshape counters exist at zero before anything happens, so the alert on their increase
(``DynamigReshapeFailures``: ``increase(dynamig_operator_reshapes_total{result="failed"}[30m]) > 0``) sees the
first failure: a series born at 1 has no increase. Real: the Prometheus client registry."""

from __future__ import annotations

from typing import cast

from dynamig.geometry.catalog import load_catalog
from dynamig.operator.kubeio import KubeIO
from dynamig.operator.metrics import RESHAPE_RESULTS, OperatorMetrics
from dynamig.operator.reconciler import Reconciler
from dynamig.operator.settings import OperatorSettings

RESHAPES = "dynamig_operator_reshapes_total"


def test_every_result_of_a_policy_starts_at_zero() -> None:
    m = OperatorMetrics()
    assert m.registry.get_sample_value(RESHAPES, {"policy": "p", "result": "failed"}) is None
    m.policy_seen("p")
    m.reshapes.labels(policy="p", result="written").inc()
    m.policy_seen("p")  # seen again: nothing is reset
    got = {r: m.registry.get_sample_value(RESHAPES, {"policy": "p", "result": r}) for r in RESHAPE_RESULTS}
    assert got == {"written": 1.0, "completed": 0.0, "blocked": 0.0, "failed": 0.0}
    assert set(RESHAPE_RESULTS) == {"written", "completed", "blocked", "failed"}


def test_a_policy_governed_or_forgotten_keeps_its_counters() -> None:
    m = OperatorMetrics()
    m.set_governed("q", 2, 0.0)  # each round: the policy is known from here on
    assert m.registry.get_sample_value(RESHAPES, {"policy": "q", "result": "failed"}) == 0
    m.forget_policy("q")  # gauges go, counters stay
    assert m.registry.get_sample_value("dynamig_operator_governed_gpus", {"policy": "q"}) is None
    assert (
        m.registry.get_sample_value("dynamig_operator_whole_offers", {"policy": "q", "state": "booked"})
        is None
    )
    assert m.registry.get_sample_value(RESHAPES, {"policy": "q", "result": "failed"}) == 0


class _Stopped:
    def is_set(self) -> bool:
        return True


async def test_the_policy_loop_starts_its_counters_before_its_first_round() -> None:
    m = OperatorMetrics()
    rec = Reconciler(cast(KubeIO, object()), load_catalog(), m, OperatorSettings())
    await rec.run_policy("r", _Stopped())  # stopped at once: no round, no API call
    for result in RESHAPE_RESULTS:
        assert m.registry.get_sample_value(RESHAPES, {"policy": "r", "result": result}) == 0, result
