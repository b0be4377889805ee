"""Claims of whole GPUs that select on NVLink facts (``nvlinkActiveLinks``, ``fabricClusterUuid``,
``fabricCliqueId``): the agent reports each GPU's facts in its GpuPartition status whatever its MIG mode, the
operator matches a claim against the whole GPU with each set of facts a model's GPUs report, and switches MIG
mode off only on a GPU whose own facts pass the claim's selectors.

Real: GpuPartition status writing (``gpu_status``) and parsing, the snapshot parsing of a reconciler round
(``parse_world``: the facts handed to demand matching), CEL evaluation (cel-python) of the claims' and
classes' selectors, the layout planner (``decide_round``) and the MIG mode switcher (``decide_modes``). No API
server (tests/integration/test_crds.py checks the status fields on a real one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dynamig.agent.nvml.device import GpuInfo
from dynamig.agent.publishing.gpu_status import gpu_status
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.devices import NvlinkFacts
from dynamig.kube.gpupartition import GpuPartitionStatus, Phase, parse_gpu_partition
from dynamig.operator.decide import RoundInput, decide_round
from dynamig.operator.inventory import nvlink_by_model, parse_inventory
from dynamig.operator.kubeio import Snapshot
from dynamig.operator.mode_round import ModeInput
from dynamig.operator.modes import ModeDecision, decide_modes
from dynamig.operator.verdicts import Reason
from dynamig.operator.world import World, parse_world

CATALOG = load_catalog()
H100 = CATALOG.model("H100-80GB")
NOW = 1_800_000_000.0
ATTRS = 'device.attributes["mig.dynamig.io"]'
WHOLE = f'{ATTRS}.profile == "whole"'
ALL_LINKS = f"{WHOLE} && {ATTRS}.nvlinkActiveLinks >= 18"
IN_A_CLIQUE = f"{WHOLE} && has({ATTRS}.fabricCliqueId)"
CLUSTER = "2f4d1c3e-8a8b-5d0c-9e1f-0a1b2c3d4e5f"
IDLE = (("3g.40gb", 0, "free"), ("3g.40gb", 4, "free"))
FULL = (("3g.40gb", 0, "allocated"), ("3g.40gb", 4, "allocated"))
DRIVER_CLASS = {
    "metadata": {"name": "mig.dynamig.io"},
    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "mig.dynamig.io"'}}]},
}
POLICY = {
    "metadata": {
        "name": "fleet",
        "generation": 1,
        "uid": "u-fleet",
        "creationTimestamp": "2026-01-01T00:00:00Z",
    },
    "spec": {
        "mode": "Dynamic",
        "cooldownSeconds": 60,
        "batchWindowSeconds": 0,
        "migMode": {"policy": "Dynamic"},
    },
}


def gpu(
    name: str,
    *,
    links: int | None = None,
    clique: int | None = None,
    mig: str = "Enabled",
    instances: Sequence[tuple[str, int, str]] = IDLE,
    whole: str = "free",
) -> dict[str, Any]:
    """An H100's GpuPartition as the agent reports it, with the NVLink facts given (absent: unknown)."""
    node, index = name.rsplit("-gpu", 1)
    insts = list(instances) if mig == "Enabled" else []
    status: dict[str, Any] = {
        "node": node, "gpuIndex": int(index), "product": H100.product_name, "model": H100.key, "migMode": mig,
        "observedGeneration": 1, "phase": "Stable",
        "instances": [{"profile": p, "start": s, "deviceName": f"gpu{index}-{p}-s{s}", "state": st}
                      for p, s, st in insts],
    }  # fmt: skip
    if mig != "Enabled":
        status["wholeGpu"] = {"deviceName": f"gpu{index}", "state": whole}
    if links is not None:
        status["nvlinkActiveLinks"] = links
    if clique is not None:
        status["fabricClusterUuid"], status["fabricCliqueId"] = CLUSTER, clique
    return {
        "metadata": {"name": name, "generation": 1, "resourceVersion": "5", "uid": f"u-{name}"},
        "spec": {"layout": [{"profile": p, "start": s} for p, s, _ in insts]},
        "status": status,
    }


def claim(
    name: str, expr: str, device_class: str = "mig.dynamig.io"
) -> tuple[dict[str, Any], dict[str, Any]]:
    obj = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"c-{name}",
                     "creationTimestamp": "2026-01-01T08:00:00Z"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": device_class, "selectors": [{"cel": {"expression": expr}}]}}]}},
    }  # fmt: skip
    pod = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"p-{name}"},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": name}]},
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
    }
    return obj, pod


def world(
    parts: Sequence[dict[str, Any]],
    pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]],
    classes: Sequence[dict[str, Any]] = (DRIVER_CLASS,),
) -> World:
    """A reconciler round's parsed snapshot: the facts reach demand matching as they do in the operator."""
    snap = Snapshot(
        policies=(POLICY,),
        partitions=tuple(parts),
        nodes=({"metadata": {"name": "node-a", "labels": {"kubernetes.io/hostname": "node-a"}}},),
        pods=tuple(p for _, p in pairs),
        claims=tuple(c for c, _ in pairs),
        device_classes=tuple(classes),
    )
    return parse_world(snap, CATALOG)


def decide(
    parts: Sequence[dict[str, Any]], pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]]
) -> ModeDecision:
    w = world(parts, pairs)
    policy = w.policies[0]
    round_ = decide_round(RoundInput(policy, (), w.gpus, w.pending, NOW, {}, CATALOG))
    return decide_modes(ModeInput(policy, w.gpus, round_, NOW))


def switched(d: ModeDecision) -> list[str]:
    return [s.gpu for s in d.switches]


# ------------------------------------------------------------------------------------------ the agent


def test_the_agent_reports_the_facts_of_a_gpu_with_mig_mode_on_and_drops_them_once_unknown() -> None:
    part = parse_gpu_partition({"metadata": {"name": "node-a-gpu0", "generation": 1}})
    facts = NvlinkFacts(18, CLUSTER, 7)
    on = GpuInfo(0, "GPU-0", H100.product_name, 0x2330, 0, 1, 1, H100, facts)  # MIG mode on
    status = gpu_status("node-a", None, on, part, (), {}, (), (), Phase.STABLE, "")
    wire = status.to_api()
    assert (wire["nvlinkActiveLinks"], wire["fabricClusterUuid"], wire["fabricCliqueId"]) == (18, CLUSTER, 7)
    assert GpuPartitionStatus.model_validate(wire).nvlink() == facts
    # NVML no longer says: the merge patch removes what was written before (null deletes a field).
    written = part.model_copy(update={"status": status})
    unknown = GpuInfo(0, "GPU-0", H100.product_name, 0x2330, 0, 1, 1, H100)
    wire = gpu_status("node-a", None, unknown, written, (), {}, (), (), Phase.STABLE, "").to_api()
    assert {
        k: wire[k] for k in ("nvlinkActiveLinks", "fabricClusterUuid", "fabricCliqueId")
    } == dict.fromkeys(("nvlinkActiveLinks", "fabricClusterUuid", "fabricCliqueId"))


def test_the_operator_sees_each_gpus_facts_and_each_distinct_set_per_model() -> None:
    gpus = parse_inventory(
        [gpu("node-a-gpu0", links=12), gpu("node-a-gpu1", links=18, clique=1), gpu("node-a-gpu2", links=12)],
        CATALOG,
    )
    assert [g.nvlink for g in gpus] == [NvlinkFacts(12), NvlinkFacts(18, CLUSTER, 1), NvlinkFacts(12)]
    assert nvlink_by_model(gpus) == {H100.key: (NvlinkFacts(12), NvlinkFacts(18, CLUSTER, 1))}


# ------------------------------------------------------------------------------------------ the links


def test_a_claim_on_links_gets_the_gpu_whose_links_pass_switched_off() -> None:
    """gpu0 has no instance (the least disturbing switch), but only 12 active links: gpu1 is switched."""
    parts = [gpu("node-a-gpu0", links=12, instances=()), gpu("node-a-gpu1", links=18)]
    d = decide(parts, [claim("train", ALL_LINKS)])
    assert switched(d) == ["node-a-gpu1"]
    [told] = d.verdicts
    assert told.reason is Reason.WAITING_FOR_WHOLE_GPU and "switching node-a-gpu1" in told.message


def test_a_claim_on_links_never_gets_a_gpu_whose_links_fail() -> None:
    """The GPU with all links is busy; the idle one with links down is not switched instead."""
    parts = [gpu("node-a-gpu0", links=12, instances=()), gpu("node-a-gpu1", links=18, instances=FULL)]
    d = decide(parts, [claim("train", ALL_LINKS)])
    assert switched(d) == []
    [told] = d.verdicts
    assert told.reason is Reason.WAITING_FOR_WHOLE_GPU and told.warn
    assert "node-a-gpu0: its whole GPU would not pass the claim's selectors" in told.message
    assert "node-a-gpu1: 2 MIG instance(s) allocated or in use" in told.message


def test_no_gpu_of_the_model_with_the_links_leaves_the_claim_unservable() -> None:
    parts = [gpu("node-a-gpu0", links=12, instances=()), gpu("node-a-gpu1")]  # gpu1: NVML does not say
    w = world(parts, [claim("train", ALL_LINKS)])
    assert w.pending[0].whole == ()  # no whole GPU of any model serves it
    assert switched(decide(parts, [claim("train", ALL_LINKS)])) == []


def test_a_free_whole_gpu_whose_links_fail_does_not_serve_the_claim() -> None:
    """gpu0 has MIG mode off and is free, but the scheduler would not give it to the claim: gpu1 is
    switched rather than the claim told to wait for kube-scheduler."""
    parts = [gpu("node-a-gpu0", links=12, mig="Disabled"), gpu("node-a-gpu1", links=18)]
    d = decide(parts, [claim("train", ALL_LINKS)])
    assert switched(d) == ["node-a-gpu1"]
    assert "node-a-gpu0: MIG mode off, their NVLink facts fail" in d.verdicts[0].message


def test_a_device_class_selecting_on_links_is_demand_of_the_model_with_them() -> None:
    linked = {
        "metadata": {"name": "linked-gpus.example.com"},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "mig.dynamig.io" && {ALL_LINKS}'}}]},
    }
    pair = claim("train", "true", device_class="linked-gpus.example.com")
    without = world([gpu("node-a-gpu0", links=12)], [pair], (DRIVER_CLASS, linked))
    assert without.pending == ()  # the class selects none of the devices its GPUs would publish
    parts = [gpu("node-a-gpu0", links=12), gpu("node-a-gpu1", links=18)]
    w = world(parts, [pair], (DRIVER_CLASS, linked))
    assert [r.whole_models() for r in w.pending[0].whole] == [(H100.key,)]


# ------------------------------------------------------------------------------------------ the fabric


def test_a_claim_on_the_fabric_clique_gets_a_gpu_in_the_fabric_switched() -> None:
    parts = [gpu("node-a-gpu0", links=18, instances=()), gpu("node-a-gpu1", links=18, clique=1)]
    assert switched(decide(parts, [claim("train", IN_A_CLIQUE)])) == ["node-a-gpu1"]


def test_a_claim_on_the_fabric_clique_is_unservable_without_a_fabric() -> None:
    parts = [gpu("node-a-gpu0", links=18, instances=()), gpu("node-a-gpu1", links=18)]
    d = decide(parts, [claim("train", IN_A_CLIQUE)])
    assert switched(d) == []
    assert d.verdicts[0].reason is Reason.NO_MATCHING_PROFILE


# ------------------------------------------------------------------------------------------ as before


def test_a_claim_not_mentioning_the_facts_is_decided_as_without_them() -> None:
    """The least disturbing GPU goes first, whatever its links: the decision is the one made for GPUs that
    report no NVLink facts at all."""
    with_facts = [gpu("node-a-gpu0", links=12, instances=()), gpu("node-a-gpu1", links=18, clique=1)]
    without = [gpu("node-a-gpu0", instances=()), gpu("node-a-gpu1")]
    pairs = [claim("train", WHOLE)]
    d = decide(with_facts, pairs)
    assert switched(d) == ["node-a-gpu0"]
    assert d == decide(without, pairs)
