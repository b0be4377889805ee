"""Claims only a whole GPU (MIG mode off) serves: never planned for MIG, told why they wait; and the
DeviceClass ``gpu.dynamig.io`` the operator keeps while some governed GPU has MIG mode off.

Real: the layout planner, the MIG geometry catalog, CEL evaluation (cel-python) of the claims' and classes'
selectors against the devices the agent publishes, policy and GpuPartition parsing, and a whole reconciler
round. No API server: the round talks to :class:`FakeKube`, which records the Events and DeviceClass writes it
is asked for (the integration and e2e tests cover the API server).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from dynamig.geometry.catalog import load_catalog
from dynamig.kube.devices import profile_device_class, whole_device_class
from dynamig.kube.policy import parse_policy
from dynamig.operator.decide import RoundDecision, RoundInput, decide_round
from dynamig.operator.demand import PendingClaim, extract_demand, parse_device_classes
from dynamig.operator.extended import ClassChanges
from dynamig.operator.inventory import parse_inventory
from dynamig.operator.kubeio import KubeIO, Snapshot
from dynamig.operator.metrics import OperatorMetrics
from dynamig.operator.reconciler import Reconciler
from dynamig.operator.settings import OperatorSettings
from dynamig.operator.verdicts import Reason

CATALOG = load_catalog()
A100 = CATALOG.model("A100-80GB")
NOW = 1_800_000_000.0
PROFILE = 'device.attributes["mig.dynamig.io"].profile'
DRIVER_CLASS = {
    "metadata": {"name": "mig.dynamig.io"},
    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "mig.dynamig.io"'}}]},
}
CLASSES = parse_device_classes([DRIVER_CLASS])
NODES = {"node-a": {"kubernetes.io/hostname": "node-a"}, "node-b": {"kubernetes.io/hostname": "node-b"}}


def partition(node: str, index: int, mig: str = "Enabled", free: bool = True) -> dict[str, Any]:
    instances = (
        [{"profile": "3g.40gb", "start": s, "deviceName": f"gpu{index}-3g40gb-s{s}", "state": "free"}
         for s in (0, 4)]
        if mig == "Enabled" and free
        else []
    )  # fmt: skip
    return {
        "metadata": {"name": f"{node}-gpu{index}", "generation": 1, "resourceVersion": "7",
                     "uid": f"u-{node}-{index}"},
        "spec": {"layout": [{"profile": i["profile"], "start": i["start"]} for i in instances]},
        "status": {
            "node": node, "gpuIndex": index, "product": "NVIDIA A100-SXM4-80GB", "model": "A100-80GB",
            "migMode": mig, "observedGeneration": 1, "phase": "Stable", "instances": instances,
        },
    }  # fmt: skip


POLICY = {
    "metadata": {"name": "fleet", "generation": 1, "uid": "u-fleet",
                 "creationTimestamp": "2026-01-01T00:00:00Z"},
    "spec": {"mode": "Dynamic", "cooldownSeconds": 60, "batchWindowSeconds": 0,
             "baseline": {"A100-80GB": [{"profile": "3g.40gb", "start": 0},
                                        {"profile": "3g.40gb", "start": 4}]}},
}  # fmt: skip


def request(name: str, expr: str, count: int = 1) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": "mig.dynamig.io", "count": count,
                                      "selectors": [{"cel": {"expression": expr}}]}}  # fmt: skip


def claim_and_pod(
    name: str, requests: list[dict[str, Any]], node: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    claim = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"c-{name}",
                     "creationTimestamp": "2026-01-01T08:00:00Z"},
        "spec": {"devices": {"requests": requests}},
    }  # fmt: skip
    spec: dict[str, Any] = {"resourceClaims": [{"name": "gpu", "resourceClaimName": name}]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    pod = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"p-{name}"},
        "spec": spec,
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
    }
    return claim, pod


def pending(*pairs: tuple[dict[str, Any], dict[str, Any]]) -> tuple[PendingClaim, ...]:
    claims = [c for c, _ in pairs]
    pods = [p for _, p in pairs]
    return extract_demand(claims, pods, CLASSES, (A100,), NODES).pending


def decide(parts: list[dict[str, Any]], claims: tuple[PendingClaim, ...]) -> RoundDecision:
    pol = parse_policy(POLICY)
    gpus = parse_inventory(parts, CATALOG)
    return decide_round(RoundInput(pol, (), gpus, claims, NOW, {}, CATALOG))


WHOLE = f'{PROFILE} == "whole"'


def test_a_whole_gpu_claim_with_a_gpu_whose_mig_mode_is_off_waits_for_the_scheduler_and_cuts_nothing() -> (
    None
):
    claims = pending(claim_and_pod("train", [request("gpu", WHOLE)]))
    decision = decide([partition("node-a", 0), partition("node-b", 1, mig="Disabled")], claims)
    (v,) = decision.verdicts
    assert v.reason is Reason.WAITING_FOR_WHOLE_GPU and not v.warning
    assert v.gpu == "node-b-gpu1" and "node-b-gpu1" in v.message and "kube-scheduler" in v.message
    assert decision.writes == () and decision.planned == ()  # the MIG GPU is not re-cut for it
    assert decision.pending_by_profile() == {"whole": 1}


def test_a_whole_gpu_claim_with_no_gpu_whose_mig_mode_is_off_is_a_warning_not_no_matching_profile() -> None:
    claims = pending(claim_and_pod("train", [request("gpu", WHOLE, count=2)]))
    decision = decide([partition("node-a", 0, free=False)], claims)  # an empty A100: room for anything
    (v,) = decision.verdicts
    assert v.reason is Reason.WAITING_FOR_WHOLE_GPU and v.warning
    assert Reason.NO_MATCHING_PROFILE.value not in decision.pending_by_reason()
    assert "2 whole GPUs of A100-80GB" in v.message and "MIG mode off" in v.message
    assert "does not switch a GPU's MIG mode under a Fixed policy" in v.message
    assert decision.writes == ()  # only the idle GPU's return to its baseline is planned, for nobody
    assert all(not w.claims and "baseline" in w.reason for w in decision.planned)
    assert decision.pending_by_profile() == {"whole": 2}
    assert decision.pending_by_reason() == {"WaitingForWholeGpu": 1}


def test_a_gpu_with_mig_mode_off_on_a_node_the_pod_may_not_use_does_not_serve_it() -> None:
    claims = pending(claim_and_pod("train", [request("gpu", WHOLE)], node="node-a"))
    decision = decide([partition("node-a", 0), partition("node-b", 1, mig="Disabled")], claims)
    (v,) = decision.verdicts
    assert v.reason is Reason.WAITING_FOR_WHOLE_GPU and v.warning and v.gpu == ""
    assert "on the 1 node the pod may use" in v.message and "1 GPU with MIG mode off elsewhere" in v.message


def test_a_claim_wanting_a_whole_gpu_and_a_mig_slice_is_cut_for_only_where_a_whole_gpu_exists() -> None:
    both = [request("slice", f'{PROFILE} == "1g.10gb"'), request("whole", WHOLE)]
    claims = pending(claim_and_pod("mixed", both))
    decision = decide([partition("node-a", 0)], claims)
    (v,) = decision.verdicts
    assert v.reason is Reason.WAITING_FOR_WHOLE_GPU and v.warning
    assert "besides its 1 MIG request" in v.message and decision.writes == ()
    # With a GPU whose MIG mode is off, its MIG request is planned as any other.
    decision = decide([partition("node-a", 0), partition("node-a", 1, mig="Disabled")], claims)
    (v,) = decision.verdicts
    assert v.reason is Reason.RESHAPE_SCHEDULED and v.profile == "1g.10gb"
    (w,) = decision.writes
    assert w.gpu == "node-a-gpu0" and any(i.profile == "1g.10gb" for i in w.layout)


def test_whole_first_then_a_slice_is_planned_for_the_slice() -> None:
    first_available = {"name": "gpu", "firstAvailable": [
        {"name": "whole", "deviceClassName": "mig.dynamig.io", "selectors": [{"cel": {"expression": WHOLE}}]},
        {"name": "slice", "deviceClassName": "mig.dynamig.io",
         "selectors": [{"cel": {"expression": f'{PROFILE} == "1g.10gb"'}}]},
    ]}  # fmt: skip
    decision = decide([partition("node-a", 0)], pending(claim_and_pod("either", [first_available])))
    (v,) = decision.verdicts
    assert v.reason is Reason.RESHAPE_SCHEDULED and v.profile == "1g.10gb"


# ------------------------------------------------------------------------------------------ a whole round


class FakeKube:
    """The KubeIO calls a round makes, answered from one snapshot; Events and class writes are recorded."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self.events: list[
            tuple[dict[str, Any], str, str, str]
        ] = []  # (involvedObject, type, reason, message)
        self.classes: list[ClassChanges] = []

    async def snapshot(self, lease_namespace: str | None = None) -> Snapshot:
        return self.snap

    async def post_event(
        self, involved: Mapping[str, Any], event_type: str, reason: str, message: str, namespace: str
    ) -> None:
        self.events.append((dict(involved), event_type, reason, message))

    async def write_spec(self, name: str, spec: Any, annotations: Any, rv: str) -> dict[str, Any]:
        return {"metadata": {"generation": 2}}

    async def patch_policy_status(self, name: str, status: Mapping[str, Any]) -> None:
        pass

    async def write_device_classes(self, changes: ClassChanges) -> None:
        self.classes.append(changes)

    async def patch_partition_conditions(self, name: str, conditions: list[dict[str, Any]]) -> None:
        pass

    async def serves_taint_rules(self) -> bool:
        return False


def round_snapshot(classes: tuple[dict[str, Any], ...], mig_off: bool) -> Snapshot:
    trainer = {
        "metadata": {"name": "trainer", "namespace": "ml", "uid": "p-trainer",
                     "creationTimestamp": "2026-01-01T08:00:00Z"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
    }  # fmt: skip
    parts = [partition("node-a", 0)] + ([partition("node-a", 1, mig="Disabled")] if mig_off else [])
    return Snapshot(
        policies=(POLICY,),
        partitions=tuple(parts),
        nodes=({"metadata": {"name": "node-a", "labels": NODES["node-a"]}},),
        pods=(trainer,),
        claims=(),
        device_classes=classes,
    )


async def run_round(snap: Snapshot) -> FakeKube:
    kube = FakeKube(snap)
    rec = Reconciler(cast(KubeIO, kube), CATALOG, OperatorMetrics(), OperatorSettings())
    await rec.round("fleet")
    return kube


async def test_a_round_makes_the_whole_class_and_tells_a_pod_asking_nvidia_com_gpu_why_it_waits() -> None:
    kube = await run_round(round_snapshot((DRIVER_CLASS, whole_device_class()), mig_off=True))
    made = [c["metadata"]["name"] for ch in kube.classes for c in ch.create]
    assert "gpu.dynamig.io" not in made  # already there, as wanted
    told = [(e[0]["kind"], e[0]["name"], e[1], e[2]) for e in kube.events if e[0]["kind"] == "Pod"]
    assert told == [("Pod", "trainer", "Normal", "WaitingForWholeGpu")]
    # The first round with a GPU whose MIG mode is off makes the class.
    kube = await run_round(round_snapshot((DRIVER_CLASS,), mig_off=True))
    (changes,) = kube.classes
    assert "gpu.dynamig.io" in [c["metadata"]["name"] for c in changes.create]


async def test_a_round_removes_the_whole_class_when_no_gpu_has_mig_mode_off() -> None:
    kube = await run_round(round_snapshot((DRIVER_CLASS, whole_device_class()), mig_off=False))
    (changes,) = kube.classes
    assert changes.delete == ("gpu.dynamig.io",)
    # The pod (nvidia.com/gpu served by the class) is told it waits, as a Warning, never NoMatchingProfile.
    (event,) = [e for e in kube.events if e[0]["kind"] == "Pod"]
    assert event[1:3] == ("Warning", "WaitingForWholeGpu") and "Fixed" in event[3]


async def test_a_round_backs_off_from_another_owners_nvidia_com_gpu_and_says_so() -> None:
    nvidia = {
        "metadata": {"name": "gpu.nvidia.com", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}],
                 "extendedResourceName": "nvidia.com/gpu"},
    }  # fmt: skip
    kube = await run_round(round_snapshot((DRIVER_CLASS, nvidia, whole_device_class()), mig_off=True))
    (changes,) = kube.classes
    assert changes.delete == ("gpu.dynamig.io",) and changes.refused == {"whole": "gpu.nvidia.com"}
    (taken,) = [e for e in kube.events if e[2] == "ExtendedResourceTaken"]
    assert taken[0]["name"] == "fleet" and taken[1] == "Warning"
    assert "nvidia.com/gpu is already served by DeviceClass gpu.nvidia.com" in taken[3]
    assert "whole GPU" in taken[3]
    # The device plugin's MIG classes are kept all the same.
    assert profile_device_class("1g.10gb")["metadata"]["name"] in [
        c["metadata"]["name"] for c in changes.create
    ]
