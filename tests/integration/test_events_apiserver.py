"""The operator's API plumbing against the real API server: repeated Events are one Event with a count, which
`kubectl describe` shows as "(xN over ...)", and an Event deleted meanwhile (the API server's TTL) is created
again; a LIST that RBAC refuses raises instead of reading as empty; an eviction reads as the API server
answers it (evicted, gone, refused by a budget).

Real: kube-apiserver (Events, merge patch), kubectl describe (its own Event rendering)."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio import config as config_loader

from dynamig.devcluster.controlplane import ControlPlane
from dynamig.operator.kubeio import KubeIO, ref_of

pytestmark = pytest.mark.controlplane


async def test_a_repeated_event_is_counted_on_one_object(
    control_plane: ControlPlane, kube_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(kube_api)
    cm = await core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "subject"}, "data": {"k": "v"}}
    )
    ref = ref_of(kube_api.sanitize_for_serialization(cm), "v1", "ConfigMap")
    io = KubeIO(kube_api)
    for _ in range(3):
        await io.post_event(ref, "Warning", "NoPolicy", "no policy governs this claim", namespace)
    await io.post_event(ref, "Normal", "Other", "a different event", namespace)

    events = (await core.list_namespaced_event(namespace)).items
    by_reason = {e.reason: e for e in events}
    assert len(events) == 2, [(e.reason, e.count) for e in events]
    assert by_reason["NoPolicy"].count == 3
    assert by_reason["Other"].count == 1

    out = await asyncio.to_thread(control_plane.kubectl, "describe", "configmap", "subject", "-n", namespace)
    line = next(x for x in out.stdout.splitlines() if "NoPolicy" in x)
    assert "(x3 over" in line, out.stdout

    # Gone (expired) meanwhile: the next repeat creates a fresh Event instead of failing.
    await core.delete_namespaced_event(by_reason["NoPolicy"].metadata.name, namespace)
    await io.post_event(ref, "Warning", "NoPolicy", "no policy governs this claim", namespace)
    again = [e for e in (await core.list_namespaced_event(namespace)).items if e.reason == "NoPolicy"]
    assert [e.count for e in again] == [1]
    assert again[0].metadata.name != by_reason["NoPolicy"].metadata.name


async def test_a_refused_list_is_an_error_not_an_empty_list(crds: ControlPlane, namespace: str) -> None:
    """The operator reads pods and nodes as raw JSON; with every read of a round allowed but pods, the 403
    must raise, not read as "no pods" (a round on a world without pods would see no pending demand)."""
    cp = crds
    who = f"nobody-{namespace}"
    await asyncio.to_thread(cp.kubectl, "create", "serviceaccount", "nobody", "-n", namespace)
    await asyncio.to_thread(
        cp.kubectl, "create", "clusterrole", who, "--verb=list",
        "--resource=nodes,gpupartitionpolicies.dynamig.io,gpupartitions.dynamig.io,"
        "resourceclaims.resource.k8s.io,deviceclasses.resource.k8s.io",
    )  # fmt: skip
    await asyncio.to_thread(
        cp.kubectl, "create", "clusterrolebinding", who, f"--clusterrole={who}",
        f"--serviceaccount={namespace}:nobody",
    )  # fmt: skip
    try:
        kubeconfig = await asyncio.to_thread(cp.service_account_kubeconfig, namespace, "nobody")
        config = client.Configuration()
        await config_loader.load_kube_config(config_file=str(kubeconfig), client_configuration=config)
        async with client.ApiClient(config) as api:
            io = KubeIO(api, attempts=1)
            with pytest.raises(client.ApiException) as refused:
                await io.snapshot()
        assert refused.value.status == 403
        assert "pods" in str(refused.value.body), refused.value.body
    finally:
        await asyncio.to_thread(cp.kubectl, "delete", "clusterrolebinding,clusterrole", who, check=False)


async def test_eviction_outcomes_as_the_api_server_answers(
    control_plane: ControlPlane, kube_api: client.ApiClient, namespace: str
) -> None:
    """Preemption evicts through the Eviction API: a pod evicted is gone; a pod replaced under the same name
    (another uid: 409 from the precondition) or already gone (404) reads as gone, never evicted by name; a
    running pod its PodDisruptionBudget keeps is refused (429), with the API server's words, not retried."""
    core = client.CoreV1Api(kube_api)
    io = KubeIO(kube_api, attempts=2)

    async def pod(name: str) -> str:
        spec = {"containers": [{"name": "c", "image": "busybox"}]}
        made = await core.create_namespaced_pod(
            namespace, {"metadata": {"name": name, "labels": {"app": name}}, "spec": spec}
        )
        return str(made.metadata.uid)

    uid = await pod("victim")
    assert (await io.evict_pod(namespace, "victim", uid)).outcome == "evicted"
    # Never bound to a node: deleted at once, so a second eviction finds nothing.
    names = [p.metadata.name for p in (await core.list_namespaced_pod(namespace)).items]
    assert "victim" not in names, names
    assert (await io.evict_pod(namespace, "victim", uid)).outcome == "gone"

    await pod("replaced")
    assert (await io.evict_pod(namespace, "replaced", "0000-not-its-uid")).outcome == "gone"
    assert (await core.read_namespaced_pod("replaced", namespace)).metadata.deletion_timestamp is None

    # A Pending pod is evicted whatever its budgets say (the API server's rule): make it Running.
    kept = await pod("kept")
    await core.patch_namespaced_pod_status("kept", namespace, {"status": {"phase": "Running"}})
    policy = client.PolicyV1Api(kube_api)
    budget = {"minAvailable": 1, "selector": {"matchLabels": {"app": "kept"}}}
    await policy.create_namespaced_pod_disruption_budget(
        namespace, {"metadata": {"name": "keep"}, "spec": budget}
    )
    refused = await io.evict_pod(namespace, "kept", kept)
    assert refused.outcome == "refused", refused
    assert "disruption budget" in refused.message, refused.message
    assert (await core.read_namespaced_pod("kept", namespace)).metadata.deletion_timestamp is None
