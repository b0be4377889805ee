"""The DeviceTaintRule that keeps new bookings off a fenced node's devices, and which rules to make or delete
(operator/fencing.py ``taint_rule``, ``taint_changes``). Pure: rules as the API server returns them."""

from __future__ import annotations

from dynamig.operator.fencing import (
    FENCE_AGENT_SILENT,
    FENCE_LABEL,
    taint_changes,
    taint_rule,
    taint_rule_name,
)

DRIVER = "mig.dynamig.io"


def test_the_rule_taints_the_nodes_pool_of_the_driver_no_schedule() -> None:
    rule = taint_rule("gpu-a", DRIVER, "2026-12-04T16:00:00Z")
    assert rule["apiVersion"] == "resource.k8s.io/v1" and rule["kind"] == "DeviceTaintRule"
    assert rule["metadata"] == {
        "name": "dynamig-agent-silent-gpu-a",
        "labels": {FENCE_LABEL: FENCE_AGENT_SILENT},
    }
    assert rule["spec"]["deviceSelector"] == {"driver": DRIVER, "pool": "gpu-a"}
    taint = rule["spec"]["taint"]
    assert (taint["key"], taint["effect"]) == ("dynamig.io/agent-silent", "NoSchedule")


def test_a_long_node_name_still_makes_a_valid_unique_rule_name() -> None:
    long_a, long_b = "a" * 250, "a" * 249 + "b"
    assert len(taint_rule_name(long_a)) <= 253 and taint_rule_name(long_a) != taint_rule_name(long_b)


def test_a_rule_per_fenced_node_and_none_for_a_node_that_is_back() -> None:
    rules = [
        taint_rule("back", DRIVER, "t"),
        taint_rule("still", DRIVER, "t"),
        {"metadata": {"name": "someone-elses", "labels": {}}, "spec": {"deviceSelector": {"pool": "other"}}},
    ]
    create, delete = taint_changes({"still", "new"}, rules)
    assert create == ["new"]
    assert delete == ["dynamig-agent-silent-back"]  # another owner's rule is never touched
    assert taint_changes(set(), []) == ([], [])
