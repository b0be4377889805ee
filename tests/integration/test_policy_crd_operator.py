"""The operator against the real control plane, with the node agent's part played by the test.

Real: etcd, kube-apiserver (both CRDs with their schemas and CEL rules), kube-scheduler (it marks the pods
Unschedulable because no device is published) and kube-controller-manager; the operator runs in-process
through Kopf (standalone, no peering) exactly as ``dynamig operator`` runs it, with the real planner and CEL.
Simulated: there is no node agent and no GPU here. The test creates the GpuPartitions and writes their
``status`` the way the agent reports it (an A100-80GB cut 2 x 3g.40gb, all instances free), so what is checked
is the operator's side of the contract: demand found, ``spec.layout`` written within the budget, "why
pending?" Events and policy status, completion noticed from ``observedGeneration``, invalid and overlapping
policies reported. The full loop with the agent and simulated NVML is ``e2e/test_operator.py``.

Peering: two ``python -m dynamig operator`` processes share a ClusterKopfPeering (Kopf's real peering through
the API server); each one's Prometheus endpoint tells how many planning rounds it ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from dynamig.demo.cluster import ScenarioApi, claim_pod, first_available
from dynamig.demo.inprocess import operator_running
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.waiting import event_posted
from dynamig.kube.names import GROUP, VERSION
from dynamig.operator.metrics import OperatorMetrics

REPO = Path(__file__).resolve().parents[2]


class Cluster(ScenarioApi):
    """The scenario API calls, plus the node agent's part (GPUs reported) and claims named by the test."""

    async def gpu(self, node: str, index: int, layout: list[tuple[str, int]]) -> str:
        """Create a GpuPartition and report it like the agent: instances exist and are free."""
        name = f"{node}-gpu{index}"
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "GpuPartition",
            "metadata": {
                "name": name,
                "labels": {"dynamig.io/node": node, "dynamig.io/gpu-index": str(index)},
            },
            "spec": {"layout": [{"profile": p, "start": s} for p, s in layout]},
        }
        obj = await self.custom.create_cluster_custom_object(GROUP, VERSION, "gpupartitions", body)
        await self.report(name, node, index, layout, int(obj["metadata"]["generation"]))
        return name

    async def report(self, name: str, node: str, index: int, layout: list[tuple[str, int]], gen: int) -> None:
        status = {
            "node": node,
            "gpuIndex": index,
            "uuid": f"GPU-{uuid.uuid4()}",
            "product": "NVIDIA A100-SXM4-80GB",
            "model": "A100-80GB",
            "migMode": "Enabled",
            "phase": "Stable",
            "observedGeneration": gen,
            "instances": [
                {
                    "profile": p,
                    "start": s,
                    "deviceName": f"gpu{index}-{p.replace('.', '')}-s{s}",
                    "state": "free",
                }
                for p, s in layout
            ],
        }
        await self.custom.patch_cluster_custom_object_status(
            GROUP,
            VERSION,
            "gpupartitions",
            name,
            {"status": status},
            _content_type="application/merge-patch+json",
        )

    async def inference_pod(
        self, name: str, node: str, profiles: tuple[str, ...] = ("1g.10gb", "2g.20gb")
    ) -> None:
        """A ResourceClaim asking the first available of ``profiles``, and a pod on ``node`` using it."""
        alts = first_available(profiles)
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": alts}]}},
        }
        await self.custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", self.ns, "resourceclaims", claim
        )
        pod = claim_pod(name, {"kubernetes.io/hostname": node}, claim=name)
        await self.core.create_namespaced_pod(self.ns, pod)


async def test_operator_turns_pending_claims_into_layouts_and_explains(
    crds: ControlPlane, kube_api: client.ApiClient, namespace: str, make_node: Callable[..., str]
) -> None:
    k = Cluster(kube_api, namespace)
    await k.ensure_device_class()
    pool = uuid.uuid4().hex[:8]
    node = make_node("op", labels={"dynamig.io/managed": "true", "test-pool": pool})
    baseline = [("3g.40gb", 0), ("3g.40gb", 4)]
    gpu0 = await k.gpu(node, 0, baseline)
    gpu1 = await k.gpu(node, 1, baseline)
    policy, late, bad = f"op-{pool}", f"op-late-{pool}", f"op-bad-{pool}"
    metrics = OperatorMetrics()
    spec = {
        "nodeSelector": {"matchLabels": {"test-pool": pool}},
        "gpuProducts": ["A100-80GB"],
        "mode": "Dynamic",
        "baseline": {"A100-80GB": [{"profile": p, "start": s} for p, s in baseline]},
        "batchWindowSeconds": 1,
        "cooldownSeconds": 5,
        "disruptionBudget": {"maxGpusReshaping": 1},
    }
    async with operator_running(crds.kubeconfig_path, metrics):
        try:
            for i in range(3):
                await k.inference_pod(f"infer-{i}", node)

            async def unschedulable() -> bool | None:
                pods = (await k.core.list_namespaced_pod(namespace)).items
                flags = [
                    any(
                        c.type == "PodScheduled" and c.reason == "Unschedulable"
                        for c in p.status.conditions or []
                    )
                    for p in pods
                ]
                return True if len(flags) == 3 and all(flags) else None

            # The scheduler has found no device for any of them before the policy exists: one round sees all.
            await eventually(unschedulable, "three Unschedulable pods")
            await k.create_policy(policy, spec)

            # 1. One GPU (the budget) gets a new spec.layout with 1g.10gb instances for the three claims.
            async def written() -> tuple[str, dict[str, Any]] | None:
                for name in (gpu0, gpu1):
                    p = await k.partition(name)
                    profiles = [e["profile"] for e in p["spec"].get("layout", [])]
                    if "1g.10gb" in profiles:
                        return name, p
                return None

            target, part = await eventually(written, "a layout with 1g.10gb written")
            other = gpu1 if target == gpu0 else gpu0
            assert [e["profile"] for e in (await k.partition(other))["spec"]["layout"]] == [
                "3g.40gb",
                "3g.40gb",
            ]
            new_layout = [(e["profile"], e["start"]) for e in part["spec"]["layout"]]
            assert sum(1 for p, _ in new_layout if p == "1g.10gb") >= 3
            assert "dynamig.io/layout-written-at" in part["metadata"]["annotations"]

            # 2. "Why pending?": Events on each claim and its pod, and sums in the policy status.
            def told(name: str) -> Callable[[], Awaitable[list[dict[str, Any]] | None]]:
                async def probe() -> list[dict[str, Any]] | None:
                    evs = [e for e in await k.events(name) if e["reason"] == "ReshapeScheduled"]
                    kinds = {e["kind"] for e in evs}
                    return evs if {"ResourceClaim", "Pod"} <= kinds else None

                return probe

            for i in range(3):
                evs = await eventually(told(f"infer-{i}"), f"ReshapeScheduled on infer-{i} and its pod")
                assert target in evs[0]["message"] and "3g.40gb@0,3g.40gb@4" in evs[0]["message"]

            async def status_sums() -> dict[str, Any] | None:
                st = (await k.policy(policy)).get("status") or {}
                pd = st.get("pendingDemand") or {}
                sums = pd.get("total") == 3 and pd.get("byProfile") == {"1g.10gb": 3}
                # A round within the batch window reports the same sums with no reshape yet; the round that
                # wrote the layout reports it after writing it.
                return st if sums and "lastReshape" in st else None

            st = await eventually(status_sums, "pending demand and the reshape in policy status")
            assert st["matchedGpus"] == 2 and sorted(st["gpus"]) == sorted([gpu0, gpu1])
            assert st["lastReshape"]["gpus"] == [target]
            conds = {c["type"]: c for c in st["conditions"]}
            assert conds["Valid"]["status"] == "True" and conds["Overlapping"]["status"] == "False"

            # 3. The "agent" reports the new layout: the operator notices completion; claims now wait for
            #    the scheduler on free instances that exist.
            index = 0 if target == gpu0 else 1
            await k.report(target, node, index, new_layout, int(part["metadata"]["generation"]))

            async def completed() -> list[dict[str, Any]] | None:
                evs = [e for e in await k.events(policy, "default") if e["reason"] == "ReshapeCompleted"]
                return evs or None

            (done,) = await eventually(completed, "ReshapeCompleted on the policy")
            assert target in done["message"]

            async def waiting() -> dict[str, Any] | None:
                st = (await k.policy(policy)).get("status") or {}
                by_reason = (st.get("pendingDemand") or {}).get("byReason")
                return st if by_reason == {"WaitingForScheduler": 3} else None

            await eventually(waiting, "claims waiting for the scheduler")
            # Posted on the GPU after the policy's (ReshapeCompleted) and apart from its status: waited for.
            for reason in ("LayoutChanged", "ReshapeCompleted"):
                await event_posted(k.core, "default", target, reason, within_s=30)

            # 4. A later policy selecting the same GPUs loses them, and says so.
            await k.create_policy(late, {**spec, "mode": "Static"})

            async def lost() -> dict[str, Any] | None:
                st = (await k.policy(late)).get("status") or {}
                return st if st.get("lostGpus") else None

            st = await eventually(lost, "lost GPUs in the later policy's status")
            assert {g["gpu"]: g["governedBy"] for g in st["lostGpus"]} == {gpu0: policy, gpu1: policy}
            assert st["matchedGpus"] == 0
            assert {c["type"]: c["status"] for c in st["conditions"]}["Overlapping"] == "True"

            # 5. A baseline the model cannot hold passes the API server but the operator refuses it.
            await k.create_policy(
                bad,
                {
                    "nodeSelector": {"matchLabels": {"test-pool": "nothing"}},
                    "baseline": {"A100-80GB": [{"profile": "3g.40gb", "start": 2}]},
                },
            )

            async def invalid() -> dict[str, Any] | None:
                st = (await k.policy(bad)).get("status") or {}
                valid = {c["type"]: c for c in st.get("conditions") or []}.get("Valid")
                return valid if valid and valid["status"] == "False" else None

            cond = await eventually(invalid, "Valid=False on the invalid policy")
            assert cond["reason"] == "InvalidSpec" and "spec.baseline[A100-80GB]" in cond["message"]
            # The Warning is posted apart from the condition: waited for.
            warn = await event_posted(
                k.core, "default", bad, "InvalidSpec", saying=["cannot start at slice 2"]
            )
            assert warn[0]["type"] == "Warning", warn

            # 6. A claim no profile can ever satisfy gets a Warning Event that says why.
            await k.inference_pod("impossible", node, profiles=("9g.1tb",))

            async def no_match() -> list[dict[str, Any]] | None:
                evs = [e for e in await k.events("impossible") if e["reason"] == "NoMatchingProfile"]
                return evs or None

            (nm, *_) = await eventually(no_match, "NoMatchingProfile on the impossible claim")
            assert nm["type"] == "Warning" and "no MIG profile" in nm["message"], nm

            # 7. Metrics: planner time and written layouts were recorded.
            assert (
                metrics.registry.get_sample_value(
                    "dynamig_operator_reshapes_total", {"policy": policy, "result": "written"}
                )
                == 1
            )
            assert (
                metrics.registry.get_sample_value(
                    "dynamig_operator_reshapes_total", {"policy": policy, "result": "completed"}
                )
                == 1
            )
            assert (
                metrics.registry.get_sample_value(
                    "dynamig_operator_plan_duration_seconds_count", {"policy": policy}
                )
                or 0
            ) >= 2

            # 8. A warm pool with no room beside the baselines (two 3g.40gb fill an A100-80GB): reported,
            #    planning goes on.
            await k.custom.patch_cluster_custom_object(
                GROUP, VERSION, "gpupartitionpolicies", policy, {"spec": {"warmPool": {"1g.10gb": 2}}},
                _content_type="application/merge-patch+json",
            )  # fmt: skip

            async def warm_refused() -> dict[str, Any] | None:
                st = (await k.policy(policy)).get("status") or {}
                valid = {c["type"]: c for c in st.get("conditions") or []}.get("Valid")
                return valid if valid and valid["reason"] == "WarmPoolTooLarge" else None

            cond = await eventually(warm_refused, "Valid=False, WarmPoolTooLarge")
            assert cond["status"] == "False" and "2x 1g.10gb asked, 0 fit" in cond["message"], cond
            # The Warning is posted apart from the condition: waited for.
            warn = await event_posted(k.core, "default", policy, "WarmPoolTooLarge")
            assert warn[0]["type"] == "Warning", warn
        finally:
            for name in (policy, late, bad):
                await k.delete_policy(name)
            for name in (gpu0, gpu1):
                with contextlib.suppress(ApiException):
                    await k.custom.delete_cluster_custom_object(GROUP, VERSION, "gpupartitions", name)


class Replica:
    """``python -m dynamig operator`` as a child process with peering, its /metrics read over HTTP."""

    def __init__(self, cp: ControlPlane, name: str, peering: str, priority: int, log: Path) -> None:
        argv = [
            sys.executable, "-m", "dynamig", "operator", "--kubeconfig", str(cp.kubeconfig_path),
            "--peering", peering, "--priority", str(priority), "--metrics-port", "0", "--metrics-host",
            "127.0.0.1", "--resync-seconds", "1",
        ]  # fmt: skip
        self.name, self.log = name, log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        self._metrics_port = 0

    def port(self) -> int:
        if not self._metrics_port:
            found = re.search(
                r"metrics on http://127\.0\.0\.1:(\d+)/metrics", self.log.read_text(errors="replace")
            )
            self._metrics_port = int(found.group(1)) if found else 0
        return self._metrics_port

    def rounds(self, policy: str) -> float:
        """Planning rounds this replica ran for ``policy`` (from its /metrics)."""
        port = self.port()
        if not port:
            return 0.0
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (
                    sample.name == "dynamig_operator_plan_duration_seconds_count"
                    and sample.labels.get("policy") == policy
                ):
                    return float(sample.value)
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


async def test_with_peering_only_the_highest_priority_replica_acts(
    crds: ControlPlane, kube_api: client.ApiClient, make_node: Callable[..., str], tmp_path: Path
) -> None:
    k = Cluster(kube_api, "default")  # no namespaced object here
    crds.kubectl("apply", "-f", str(REPO / "manifests" / "helm" / "dynamig" / "crds" / "kopf-peerings.yaml"))
    crds.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/clusterkopfpeerings.kopf.dev")
    pool = uuid.uuid4().hex[:8]
    peering = f"peers-{pool}"
    await k.custom.create_cluster_custom_object(
        "kopf.dev", "v1", "clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}},
    )  # fmt: skip
    node = make_node("peer", labels={"test-pool": pool})
    gpu = await k.gpu(node, 0, [("3g.40gb", 0), ("3g.40gb", 4)])
    policy = f"peer-{pool}"
    # The high-priority replica is up and acting before the other starts: two replicas starting in the same
    # instant may both act until each has seen the other in the peering object (Kopf's documented behaviour).
    high = Replica(crds, "high", peering, 20, tmp_path / "high.log")
    low: Replica | None = None
    try:
        await k.create_policy(policy, {"nodeSelector": {"matchLabels": {"test-pool": pool}}})

        async def high_acts() -> bool | None:
            return True if high.rounds(policy) >= 3 else None

        await eventually(high_acts, "rounds by the high-priority replica", within_s=60)
        low = Replica(crds, "low", peering, 10, tmp_path / "low.log")
        started = high.rounds(policy)

        async def low_serving_while_high_acts() -> bool | None:
            return True if low is not None and low.port() and high.rounds(policy) >= started + 3 else None

        await eventually(low_serving_while_high_acts, "the low replica up, the high one acting", within_s=60)
        assert low.rounds(policy) == 0, "the low-priority replica acted while a higher one was alive"

        # The high-priority replica exits cleanly (it leaves the peering object): the other one takes over.
        high.stop()

        async def low_acts() -> bool | None:
            return True if low is not None and low.rounds(policy) >= 1 else None

        await eventually(low_acts, "rounds by the remaining replica after the other left", within_s=60)
        await k.delete_policy(policy)  # the acting replica releases Kopf's finalizer
    finally:
        high.stop()
        if low is not None:
            low.stop()
        for group, version, plural, name in (
            (GROUP, VERSION, "gpupartitions", gpu),
            ("kopf.dev", "v1", "clusterkopfpeerings", peering),
        ):
            with contextlib.suppress(ApiException):
                await k.custom.delete_cluster_custom_object(group, version, plural, name)


async def test_deleting_a_policy_never_waits_for_the_operator(
    crds: ControlPlane, kube_api: client.ApiClient
) -> None:
    """Policies carry no finalizer: one the operator served is deleted at once while no operator runs, and a
    finalizer left by an older version is taken off by the running operator."""
    k = ScenarioApi(kube_api, "default")
    served, legacy = f"served-{uuid.uuid4().hex[:6]}", f"legacy-{uuid.uuid4().hex[:6]}"
    spec = {"mode": "DryRun", "nodeSelector": {"matchLabels": {"no-such-pool": "x"}}}
    old_finalizer = "operator.dynamig.io/finalizer"
    async with operator_running(crds.kubeconfig_path, OperatorMetrics()):
        await k.create_policy(served, spec)
        await k.custom.create_cluster_custom_object(
            GROUP, VERSION, "gpupartitionpolicies",
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuPartitionPolicy",
             "metadata": {"name": legacy, "finalizers": [old_finalizer]}, "spec": spec},
        )  # fmt: skip

        async def served_by_operator(name: str) -> dict[str, Any] | None:
            p = await k.policy(name)
            conditions = {c["type"] for c in (p.get("status") or {}).get("conditions") or []}
            return p if "Ready" in conditions and not p["metadata"].get("finalizers") else None

        for name in (served, legacy):
            await eventually(functools.partial(served_by_operator, name), f"{name} served", within_s=60)
    # No operator now: the delete returns as soon as the object is gone.
    done = await asyncio.to_thread(
        crds.kubectl, "delete", "gpp", served, legacy, "--timeout=20s", check=False, timeout=60
    )
    assert done.returncode == 0, done.stderr
    got = crds.kubectl("get", "gpp", served, legacy, "--ignore-not-found", "-o", "name").stdout
    assert got.strip() == ""
