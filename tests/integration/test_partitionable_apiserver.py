"""The inventory's ResourceSlices against the real API server and the real scheduler.

Real: etcd, kube-apiserver, kube-scheduler (its DRA allocator with partitionable devices and binding
conditions, both on by default in 1.36) and kube-controller-manager, built from the Kubernetes v1.36.3
sources; the slices are built by ``dynamig.kube.inventory`` from the packaged geometry catalog. Simulated:
GPU nodes are Node objects registered through the API (no kubelet, no node agent), and the test itself
plays the agent's part of reporting a device ready in the claim's status.

All requests go through the raw JSON client so that no field is lost in a client model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dynamig.demo.cluster import claim_pod, exactly, resource_claim
from dynamig.devcluster import ControlPlane
from dynamig.devcluster.rest import ApiError, RestClient
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import enumerate_layouts
from dynamig.geometry.model import GpuModel, device_name
from dynamig.kube.devices import WholeGpuDevice, device_class
from dynamig.kube.inventory import (
    BINDING_FAILED,
    BINDING_READY,
    GpuInventory,
    Instance,
    Occupancy,
    build_inventory_slices,
    offered_devices,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.matrix("partitionable")]

CAT = load_catalog()
DRIVER = "mig.dynamig.io"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def mix(model: GpuModel, label: str, gpu: int) -> tuple[Instance, ...]:
    """Existing instances for GPU ``gpu`` under mix ``label``: idle GPUs, free + busy, or all three kinds."""
    if label == "idle" or gpu % 2 == 0:
        return ()
    layout = max(enumerate_layouts(model, maximal=True), key=lambda lay: (len(lay), lay))
    kinds = {
        "free-busy": [Occupancy.FREE, Occupancy.BUSY],
        "mixed": [Occupancy.FREE, Occupancy.BUSY, Occupancy.ALLOCATED],
    }[label]
    return tuple(
        Instance(i.profile, i.start, kinds[n % len(kinds)], uuid=f"MIG-{gpu}-{n}", memory_bytes=(n + 1) << 30)
        for n, i in enumerate(layout)
    )


def inventory(model: GpuModel, label: str, gpus: int) -> list[GpuInventory]:
    return [
        GpuInventory(i, model, f"GPU-{model.key}-{i}", instances=mix(model, label, i)) for i in range(gpus)
    ]


@contextlib.contextmanager
def published(
    api: RestClient, slices: list[dict[str, Any]], owner: dict[str, Any] | None = None
) -> Iterator[None]:
    """Create ``slices`` (each one must be accepted), delete them afterwards."""
    created: list[str] = []
    try:
        for body in slices:
            if owner is not None:
                body["metadata"]["ownerReferences"] = [owner]
            api.request("POST", SLICES, body)
            created.append(body["metadata"]["name"])
        yield
    finally:
        for name in created:
            with contextlib.suppress(ApiError):
                api.request("DELETE", f"{SLICES}/{name}")


def comparable(spec: dict[str, Any]) -> dict[str, Any]:
    """The parts of a slice spec the scheduler acts on, with quantities as integers."""

    def counters(c: dict[str, Any]) -> dict[str, int]:
        return {k: int(v["value"]) for k, v in c.items()}

    return {
        "pool": spec["pool"],
        "nodeName": spec["nodeName"],
        "sharedCounters": [(s["name"], counters(s["counters"])) for s in spec.get("sharedCounters", [])],
        "devices": [
            (
                d["name"],
                d["attributes"],
                [(c["counterSet"], counters(c["counters"])) for c in d["consumesCounters"]],
                d.get("bindingConditions"),  # absent on instances that exist (they bind at once)
                d.get("bindingFailureConditions"),
            )
            for d in spec.get("devices", [])
        ],
    }


@pytest.mark.parametrize("model", CAT.models(), ids=[m.key for m in CAT.models()])
def test_api_server_accepts_the_slices_of_every_model(
    control_plane: ControlPlane, make_node: Callable[..., str], model: GpuModel
) -> None:
    api = control_plane.rest()
    node = make_node("inv")
    cases = [("idle", 8), ("free-busy", 8), ("mixed", 8), ("idle", 16), ("mixed", 16)]
    for generation, (label, gpus) in enumerate(cases, 1):
        slices = build_inventory_slices(node, generation, inventory(model, label, gpus))
        with published(api, slices):
            for body in slices:
                stored = api.request("GET", f"{SLICES}/{body['metadata']['name']}")
                # Nothing dropped (no disabled feature gate, no unknown field): counters and binding
                # conditions come back as sent.
                assert comparable(stored["spec"]) == comparable(body["spec"]), (label, gpus)
                assert stored["metadata"]["annotations"] == body["metadata"]["annotations"]


def test_api_server_refuses_what_the_builder_avoids(
    control_plane: ControlPlane, make_node: Callable[..., str]
) -> None:
    """The limits the builder splits for are the server's: 65 counter-consuming devices in one slice, or
    devices and counter sets in one slice, are refused."""
    api = control_plane.rest()
    node = make_node("inv")
    model = CAT.model("A100-80GB")
    counters, first, second, *_ = build_inventory_slices(node, 1, inventory(model, "idle", 8))
    too_many = {**first, "metadata": {"name": f"{node}-too-many"}}
    too_many["spec"] = {**first["spec"], "devices": first["spec"]["devices"] + second["spec"]["devices"][:1]}
    with pytest.raises(ApiError, match="64"):
        api.request("POST", SLICES, too_many)
    both = {**first, "metadata": {"name": f"{node}-both"}}
    both["spec"] = {**first["spec"], "sharedCounters": counters["spec"]["sharedCounters"]}
    with pytest.raises(ApiError, match="only one of"):
        api.request("POST", SLICES, both)


# ------------------------------------------------------------------------------------------ the scheduler
def wait(probe: Callable[[], Any], what: str, seconds: float = 60.0) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {seconds:.0f}s waiting for {what}")
        time.sleep(0.2)


def claim(name: str, selector: str) -> dict[str, Any]:
    return resource_claim(name, exactly(selector))


def scheduled_false(api: RestClient, pod: str) -> dict[str, Any] | None:
    """The ``PodScheduled=False`` condition of the pod at API path ``pod``, or None."""
    conditions = (api.request("GET", pod).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "PodScheduled" and c["status"] == "False"), None)


def attr(name: str) -> str:
    return f'device.attributes["{DRIVER}"].{name}'


def booking_node(
    control_plane: ControlPlane, make_node: Callable[..., str], prefix: str
) -> tuple[RestClient, str, dict[str, Any]]:
    """The DeviceClass and a managed node; (API client, node, an ownerReference to the node)."""
    api = control_plane.rest()
    node = make_node(prefix, labels={"dynamig.io/managed": "true"})
    node_uid = api.request("GET", f"/api/v1/nodes/{node}")["metadata"]["uid"]
    with contextlib.suppress(ApiError):
        api.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", device_class())
    return api, node, {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}


def test_scheduler_books_the_first_ranked_device_and_waits_for_ready(
    control_plane: ControlPlane, make_node: Callable[..., str], namespace: str
) -> None:
    api, node, owner = booking_node(control_plane, make_node, "gpu-node")
    model = CAT.model("A100-80GB")
    # gpu0: a 3g.40gb busy outside DRA; gpu1: a free 2g.20gb; gpu2 idle. Three GPUs, so that every device
    # is in one ResourceSlice: the devices are ranked across the node's slices, but which slice of a pool
    # the allocator reads first is not fixed (kube-scheduler v1.35.4 with its alpha gates gathers them from
    # its informer cache in map order, and was seen to book the first 1g.10gb of a third slice of 8 GPUs).
    gpus = [
        GpuInventory(
            i,
            model,
            f"GPU-sched-{i}",
            instances=(
                (Instance("3g.40gb", 0, Occupancy.BUSY, uuid="MIG-busy"),)
                if i == 0
                else (Instance("2g.20gb", 2, Occupancy.FREE, uuid="MIG-free"),)
                if i == 1
                else ()
            ),
        )
        for i in range(3)
    ]
    ranked = [d for d in offered_devices(gpus) if d.profile == "1g.10gb"]
    expected = ranked[0].name
    # The gap beside the free 2g.20gb on gpu1, which is cut already: that breaks no larger placement there,
    # while a 1g on gpu0 would break its last 3g and one on an idle GPU its 7g.
    assert expected == device_name(1, "1g.10gb", 1)
    assert len([sl for sl in build_inventory_slices(node, 1, gpus) if sl["spec"].get("devices")]) == 1
    ns = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
    pods = f"/api/v1/namespaces/{namespace}/pods"
    with published(api, build_inventory_slices(node, 1, gpus), owner):
        api.request("POST", ns, claim("small", f'{attr("profile")} == "1g.10gb"'))
        api.request("POST", pods, claim_pod("small", {"kubernetes.io/hostname": node}, claim="small"))

        def allocation() -> dict[str, Any] | None:
            status = api.request("GET", f"{ns}/small").get("status") or {}
            return status.get("allocation")

        result = wait(allocation, "allocation of claim small")["devices"]["results"][0]
        assert (result["driver"], result["pool"], result["device"]) == (DRIVER, node, expected)
        assert result["bindingConditions"] == [BINDING_READY]
        assert result["bindingFailureConditions"] == [BINDING_FAILED]
        # The scheduler holds the binding until the device is reported ready.
        time.sleep(2)
        assert not api.request("GET", f"{pods}/small")["spec"].get("nodeName")

        # Counters: a 1g.20gb at 0 would share memory slice 1 with the allocated 1g, so it cannot be
        # booked; the one at 2 overlaps only the *free* 2g.20gb, which holds no counters (destroy, re-cut).
        on_gpu1 = f'{attr("profile")} == "1g.20gb" && {attr("gpuIndex")} == 1'
        api.request("POST", ns, claim("overlap", f"{on_gpu1} && {attr('placementStart')} == 0"))
        api.request("POST", pods, claim_pod("overlap", {"kubernetes.io/hostname": node}, claim="overlap"))
        api.request("POST", ns, claim("beside", f"{on_gpu1} && {attr('placementStart')} == 2"))
        api.request("POST", pods, claim_pod("beside", {"kubernetes.io/hostname": node}, claim="beside"))

        cond = wait(lambda: scheduled_false(api, f"{pods}/overlap"), "pod overlap unschedulable")
        assert "cannot allocate all claims" in cond["message"], cond
        beside = wait(
            lambda: (api.request("GET", f"{ns}/beside").get("status") or {}).get("allocation"), "beside"
        )
        assert beside["devices"]["results"][0]["device"] == device_name(1, "1g.20gb", 2)

        # The agent's answer: the instance exists. Then the pod binds to the node.
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ready = {
            "type": BINDING_READY,
            "status": "True",
            "reason": "InstanceReady",
            "message": "MIG instance created at its placement",
            "lastTransitionTime": now,
        }
        api.request(
            "PATCH",
            f"{ns}/small/status",
            {
                "status": {
                    "devices": [{"driver": DRIVER, "pool": node, "device": expected, "conditions": [ready]}]
                }
            },
            content_type="application/merge-patch+json",
        )
        bound = wait(lambda: api.request("GET", f"{pods}/small")["spec"].get("nodeName"), "pod small bound")
        assert bound == node
        assert not api.request("GET", f"{pods}/beside")["spec"].get("nodeName")  # still waiting for its agent
        # Busy outside DRA: nothing on gpu0's slices 0-3 is offered, so a claim for it cannot be booked.
        api.request("POST", ns, claim("busy", f"{attr('gpuIndex')} == 0 && {attr('placementStart')} < 4"))
        api.request("POST", pods, claim_pod("busy", {"kubernetes.io/hostname": node}, claim="busy"))
        cond = wait(lambda: scheduled_false(api, f"{pods}/busy"), "pod busy unschedulable")
        assert "cannot allocate all claims" in cond["message"], cond


def test_a_free_instance_binds_in_the_scheduling_cycle_and_a_retiring_one_waits_for_its_agent(
    control_plane: ControlPlane, make_node: Callable[..., str], namespace: str
) -> None:
    # No agent runs: nobody answers binding conditions. A pod whose device carries them would wait the
    # scheduler's bindingTimeout (600 s); a pod on a free instance published without them binds at once.
    api, node, owner = booking_node(control_plane, make_node, "gpu-free")
    model = CAT.model("A100-80GB")
    gpus = [
        GpuInventory(
            0,
            model,
            "GPU-free-0",
            instances=(
                Instance("2g.20gb", 0, Occupancy.FREE, uuid="MIG-free"),
                Instance("2g.20gb", 2, Occupancy.FREE, uuid="MIG-retiring", guarded=True),
                Instance("3g.40gb", 4, Occupancy.BUSY, uuid="MIG-busy"),
            ),
            allowed_profiles=frozenset(),  # existing instances only: the claims can name nothing else
        )
    ]
    ns = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
    pods = f"/api/v1/namespaces/{namespace}/pods"
    with published(api, build_inventory_slices(node, 1, gpus), owner):
        at_0 = f'{attr("profile")} == "2g.20gb" && {attr("placementStart")} == 0'
        api.request("POST", ns, claim("free", at_0))
        api.request("POST", pods, claim_pod("free", {"kubernetes.io/hostname": node}, claim="free"))
        bound = wait(lambda: api.request("GET", f"{pods}/free")["spec"].get("nodeName"), "pod free bound")
        assert bound == node
        result = api.request("GET", f"{ns}/free")["status"]["allocation"]["devices"]["results"][0]
        assert result["device"] == device_name(0, "2g.20gb", 0)
        assert "bindingConditions" not in result and "bindingFailureConditions" not in result

        at_2 = f'{attr("profile")} == "2g.20gb" && {attr("placementStart")} == 2'
        api.request("POST", ns, claim("retiring", at_2))
        api.request("POST", pods, claim_pod("retiring", {"kubernetes.io/hostname": node}, claim="retiring"))
        alloc = wait(
            lambda: (api.request("GET", f"{ns}/retiring").get("status") or {}).get("allocation"), "retiring"
        )
        assert alloc["devices"]["results"][0]["bindingConditions"] == [BINDING_READY]
        time.sleep(2)  # the scheduler holds this one until the agent answers
        assert not api.request("GET", f"{pods}/retiring")["spec"].get("nodeName")


def test_a_whole_gpu_offered_beside_its_slices_shares_their_counters(
    control_plane: ControlPlane, make_node: Callable[..., str], namespace: str
) -> None:
    """GpuPartition ``spec.offerWhole``: gpu0 (a free 2g.20gb, MIG on) publishes its whole device beside
    its placements; gpu1 has an allocated instance, so its whole GPU is not offered. The scheduler books the
    whole gpu0 (binding conditions: the agent switches MIG off first); then no slice of gpu0 can be booked,
    since the whole device consumes every counter of its set, while gpu1's free placements still can."""
    api, node, owner = booking_node(control_plane, make_node, "gpu-whole-offer")
    model = CAT.model("A100-80GB")
    gpus = [
        GpuInventory(
            i,
            model,
            f"GPU-offer-{i}",
            instances=(
                Instance("2g.20gb", 0, Occupancy.FREE if i == 0 else Occupancy.ALLOCATED, f"MIG-{i}"),
            ),
            whole=WholeGpuDevice(i, model.product_name, f"GPU-offer-{i}", 80 << 30).to_api(),
        )
        for i in range(2)
    ]
    slices = build_inventory_slices(node, 1, gpus)
    devices = [d for sl in slices for d in sl["spec"].get("devices", [])]
    names = [d["name"] for d in devices]
    assert "gpu0" in names and "gpu1" not in names, names
    assert names[-1] == "gpu0", "offered last, after every MIG device"
    ns = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
    pods = f"/api/v1/namespaces/{namespace}/pods"
    with published(api, slices, owner):
        api.request("POST", ns, claim("whole", f'{attr("profile")} == "whole"'))
        api.request("POST", pods, claim_pod("whole", {"kubernetes.io/hostname": node}, claim="whole"))

        def allocation(name: str) -> dict[str, Any] | None:
            return (api.request("GET", f"{ns}/{name}").get("status") or {}).get("allocation")

        (result,) = wait(lambda: allocation("whole"), "claim whole allocated")["devices"]["results"]
        assert result["device"] == "gpu0" and result["bindingConditions"] == [BINDING_READY], result

        on_gpu0 = f'{attr("profile")} == "1g.10gb" && {attr("gpuIndex")} == 0'
        api.request("POST", ns, claim("slice0", on_gpu0))
        api.request("POST", pods, claim_pod("slice0", {"kubernetes.io/hostname": node}, claim="slice0"))
        on_gpu1 = f'{attr("profile")} == "1g.10gb" && {attr("gpuIndex")} == 1'
        api.request("POST", ns, claim("slice1", on_gpu1))
        api.request("POST", pods, claim_pod("slice1", {"kubernetes.io/hostname": node}, claim="slice1"))

        cond = wait(lambda: scheduled_false(api, f"{pods}/slice0"), "pod slice0 unschedulable")
        assert "cannot allocate all claims" in cond["message"], cond
        other = wait(lambda: allocation("slice1"), "claim slice1 allocated")
        assert other["devices"]["results"][0]["device"].startswith("gpu1-1g10gb-"), other
