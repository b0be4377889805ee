"""Chaos: faults injected at random (seeded) points while claims come and go; after each, all converges.

Real: etcd, kube-apiserver, kube-scheduler (DRA allocation of the agent's devices), kube-controller-manager
(claims from templates, removed with their pods); the node agent (``python -m dynamig agent``) and the
operator (``python -m dynamig operator --standalone``) as processes of their own, so SIGKILL hits them where
they are. Simulated: two A100-80GB GPUs (simnvml, shared with the agent through its state file, with create
and destroy latencies) and the node (no kubelet).

Every fault runs in each inventory (``--inventory``): ``partitionable`` (the scheduler books placements,
binding held until the agent cuts and answers) and ``instances`` (the scheduler allocates existing instances,
the operator re-cuts free ones ahead of demand).

Faults, each injected while (for ``nvml-change`` and ``allocated-replaced``: just before) a change of the
workload is carried out (pods deleted and created, which makes the scheduler book placements the agent must
cut or the operator re-cut GPUs, and the operator move free GPUs back to the baseline):

- ``agent-kill``: SIGKILL the agent once NVML shows 1 to 4 changes since the workload changed, restart it;
- ``operator-kill``: SIGKILL the operator after a random delay, restart it;
- ``slice-delete`` / ``partition-delete``: delete one of the node's ResourceSlices / GpuPartitions by hand;
- ``nvml-change``: behind the agent's back, destroy a free instance or create a stray one;
- ``allocated-replaced``: behind the agent's back, stop the workload on an allocated instance, destroy it and
  create it again at the same place (a new MIG UUID); the agent must say so on the claim
  (``AllocatedInstanceReplaced``, or ``AllocatedInstanceLost`` if a round saw it gone), after which the
  pod is restarted, as its owner would;
- ``claim-storm``: release every pod and create a burst of new ones while the GPUs are being re-cut;
- ``control-plane-restart`` (on a control plane of the test's own): stop kube-apiserver and etcd, or one of
  them, for a few seconds and start them again.

After each fault the system must converge within ``CONVERGE_S``: both processes alive, every GpuPartition
Stable at its generation, NVML holding exactly the instances the GpuPartitions report (each with its compute
instance), the node's ResourceSlices one complete pool generation, every pod bound with its claim answered by
an instance that exists, no claim without its pod. Over the whole run, no instance is destroyed by dynamig
while a claim that held it was still allocated, or while a process ran on it (the simulated NVML's history
against the claims seen every 50 ms, each with the MIG UUID at its device then and the one it was answered).

Each seed runs every fault once per inventory, in an order drawn from the seed, on a control plane of its
own. The default run is one seed (``SHORT_SEEDS``) in each inventory; ``DYNAMIG_CHAOS_SEEDS=N`` runs seeds
0..N-1; ``DYNAMIG_CHAOS_REPORT=path`` appends one JSON line per fault (inventory, kind, seed, convergence
seconds) for the figures in docs/operations.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig import DRIVER_NAME
from dynamig.agent.nvml.device import NvmlDevices
from dynamig.backends.nvml import fresh_simulated_nvml
from dynamig.demo.cluster import ScenarioApi, allocated_device
from dynamig.devcluster import ControlPlane, eventually
from dynamig.devcluster.processes import free_port
from dynamig.devcluster.rest import ApiError
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.layout import free_starts
from dynamig.geometry.model import PlacedInstance, device_name, placement_of
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, NODE_LABEL, VERSION
from dynamig.simulate.trace import percentile
from test_agent import kill, start_agent_process

pytestmark = pytest.mark.chaos

REPO = Path(__file__).resolve().parent.parent
SEEDS_ENV = "DYNAMIG_CHAOS_SEEDS"
REPORT_ENV = "DYNAMIG_CHAOS_REPORT"
SHORT_SEEDS = [7]
GPU = "A100-80GB"
GPU_COUNT = 2
BASELINE = [("3g.40gb", 0), ("3g.40gb", 4)]
CONVERGE_S = 60.0  # the stated bound: every fault must be repaired within this
MAX_PODS = 6
MAX_LARGE_PODS = 2
TEMPLATES = {"small": ["1g.10gb", "2g.20gb"], "large": ["3g.40gb", "2g.20gb"]}
FAULTS = (
    "agent-kill",
    "operator-kill",
    "slice-delete",
    "partition-delete",
    "nvml-change",
    "allocated-replaced",
    "claim-storm",
    "control-plane-restart",
)
AGENT_FLAGS = (
    "--settle-seconds", "0.3", "--quarantine-seconds", "1",
    "--sim-create-latency", "0.2", "--sim-destroy-latency", "0.2",
)  # fmt: skip
INVENTORIES = ("instances", "partitionable")
REPLACED_REASONS = ("AllocatedInstanceReplaced", "AllocatedInstanceLost")


def chaos_seeds() -> list[int]:
    """The seeds to run: ``SHORT_SEEDS``, or 0..N-1 with ``DYNAMIG_CHAOS_SEEDS=N``."""
    n = int(os.environ.get(SEEDS_ENV, "0") or 0)
    return list(range(n)) if n > 0 else SHORT_SEEDS


@dataclasses.dataclass
class FaultRecord:
    inventory: str
    kind: str
    seed: int
    converge_s: float
    detail: str
    blocker: str  # what the system was last waiting for before it converged


@dataclasses.dataclass
class ClaimSeen:
    """One claim as the watch saw it: its device, the MIG UUID the agent answered (partitionable), and each
    MIG UUID it held (the answered one, and the instance at its device in NVML) with when it was last seen
    allocated holding it."""

    name: str
    device: str | None = None
    mig_uuid: str | None = None
    held: dict[str, float] = dataclasses.field(default_factory=dict)
    holding: set[str] = dataclasses.field(default_factory=set)  # held since its allocation was last seen

    def seen(self, device: str | None, uuids: set[str], now: float) -> None:
        """One sighting: allocated ``device`` (None: not allocated), the MIG UUIDs it holds now. An instance
        once held stays held while the allocation lasts (dynamig must not destroy it even if it was replaced
        behind its back)."""
        if device is None or device != self.device:
            self.holding = set()
        self.device = device if device is not None else self.device
        if device is None:
            return
        self.holding |= uuids
        for mig in self.holding:
            self.held[mig] = now


# --------------------------------------------------------------------------------------------- NVML


def placement(device: str) -> tuple[int, PlacedInstance]:
    """GPU index and placement a device name of ours denotes (``gpu1-3g40gb-s4``). Pure."""
    index = int(device.split("-", 1)[0].removeprefix("gpu"))
    placed = placement_of(device, index, load_catalog().model(GPU))
    assert placed is not None, device
    return index, placed


def booked(claim: dict[str, Any], device: str) -> bool:
    """Whether the claim's allocation of ``device`` waits on binding conditions. Pure."""
    results = (
        (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
    ) or []
    return any(r.get("device") == device and r.get("bindingConditions") for r in results)


def read_nvml(state: Path) -> dict[str, Any]:
    """The simulated NVML's whole state from its file (written by atomic rename: always complete)."""
    doc: dict[str, Any] = json.loads(state.read_bytes())
    return doc


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


def nvml_instances(doc: dict[str, Any]) -> dict[tuple[int, str, int], list[str]]:
    """(GPU index, profile, start) -> MIG UUIDs of its compute instances, for every GI in the state. Pure."""
    catalog = load_catalog()
    out: dict[tuple[int, str, int], list[str]] = {}
    for gpu in doc["gpus"]:
        model = catalog.model(gpu["model"])
        for gi in gpu["gpu_instances"]:
            profile = model.profile_by_id(gi["profile_id"]).name
            out[(gpu["index"], profile, gi["start"])] = [ci["uuid"] for ci in gi["compute_instances"]]
    return out


def losses(
    history: list[dict[str, Any]], claims: dict[str, ClaimSeen], outside: frozenset[str] = frozenset()
) -> list[str]:
    """Destroys of an instance while a claim that held it was still seen allocated, or while a process ran
    on it, from the simulated NVML's history; ``outside``: MIG UUIDs the test itself destroyed behind the
    agent's back (not dynamig's doing). Pure."""
    held_until: dict[str, tuple[float, str]] = {}  # a free instance may serve several claims in turn
    for c in claims.values():
        for held_mig, last in c.held.items():
            if last > held_until.get(held_mig, (0.0, ""))[0]:
                held_until[held_mig] = (last, c.name)
    running: dict[str, set[int]] = {}
    bad = []
    for ev in history:
        mig = ev.get("mig_uuid")
        if ev["kind"] == "attach-process" and mig:
            running.setdefault(mig, set()).add(ev["pid"])
        elif ev["kind"] == "detach-process" and mig:
            running.get(mig, set()).discard(ev["pid"])
        elif ev["kind"] == "destroy-ci" and mig and mig not in outside:
            if running.get(mig):
                bad.append(f"{mig} destroyed at {ev['timestamp']:.2f} with processes {sorted(running[mig])}")
            until = held_until.get(mig)
            if until is not None and ev["timestamp"] < until[0]:
                bad.append(
                    f"{mig} destroyed at {ev['timestamp']:.2f}, claim {until[1]} allocated to {until[0]:.2f}"
                )
    return bad


class Admin:
    """An administrator's NVML session over the agent's simulated GPUs (``nvidia-smi`` behind its back)."""

    def __init__(self, state: Path) -> None:
        self.module: ModuleType = fresh_simulated_nvml()
        self.module.configure(gpus=[GPU] * GPU_COUNT, state_file=state)
        self.devices = NvmlDevices(self.module, load_catalog())

    def change(self, rng: random.Random, keep: set[tuple[int, str, int]]) -> str:
        """Destroy a free instance (not in ``keep``, no process) or create a stray 1g.10gb; what was done."""
        self.devices.init()
        try:
            gpus = self.devices.gpus()
            free = [
                (g, i) for g in gpus for i in self.devices.instances(g)
                if (g.index, i.profile, i.start) not in keep and not i.processes
            ]  # fmt: skip
            if free and rng.random() < 0.5:
                gpu, inst = rng.choice(free)
                self.devices.destroy(gpu, inst.placed)
                return f"destroyed free {inst.profile}@{inst.start} on gpu{gpu.index}"
            options = []
            for g in gpus:
                assert g.model is not None
                layout = [i.placed for i in self.devices.instances(g)]
                options += [(g, s) for s in free_starts(g.model, layout, "1g.10gb")]
            if not options:
                return "no change possible: GPUs full"
            gpu, start = rng.choice(options)
            self.devices.create(gpu, PlacedInstance(start, "1g.10gb"))
            return f"created stray 1g.10gb@{start} on gpu{gpu.index}"
        finally:
            self.devices.shutdown()

    def destroy(self, gpu_index: int, placed: PlacedInstance) -> None:
        """Destroy one instance, processes or not (a negative control of the loss check)."""
        self.devices.init()
        try:
            self.devices.destroy(self.devices.gpu(gpu_index), placed, check_processes=False)
        finally:
            self.devices.shutdown()

    def replace(self, gpu_index: int, placed: PlacedInstance) -> str:
        """Destroy one instance and create it again at once at the same place (``nvidia-smi mig -dci -dgi``
        then ``-cgi -C``); what was done. The agent may re-create it first (instances inventory: it is in
        spec.layout), which also gives it a new MIG UUID."""
        self.devices.init()
        try:
            gpu = self.devices.gpu(gpu_index)
            self.devices.destroy(gpu, placed, check_processes=False)
            what = f"{placed.profile}@{placed.start} on gpu{gpu_index}"
            try:
                made = self.devices.create(gpu, placed)
            except (self.devices.error_type, ValueError) as exc:  # taken: the agent re-created it first
                return f"destroyed {what}; re-created first by the agent ({exc})"
            return f"replaced {what}: now {made.mig_uuid}"
        finally:
            self.devices.shutdown()

    def attach(self, mig_uuid: str, pid: int) -> None:
        self.module.attach_process(mig_uuid, pid)

    def detach(self, mig_uuid: str, pid: int) -> None:
        with contextlib.suppress(KeyError):  # gone: the loss check reports it
            self.module.detach_process(mig_uuid, pid)


# --------------------------------------------------------------------------------------------- the system


class System:
    """One managed node: the agent and operator processes, a Dynamic policy, pods coming and going."""

    def __init__(
        self,
        cp: ControlPlane,
        api: client.ApiClient,
        namespace: str,
        node: str,
        pool: str,
        work: Path,
        inventory: str,
    ) -> None:
        self.cp, self.node, self.pool, self.work, self.inventory = cp, node, pool, work, inventory
        self.k = ScenarioApi(api, namespace)
        self.state = work / "simnvml.json"
        self.agent: subprocess.Popen[bytes] | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.operator_port = free_port()
        self.admin: Admin | None = None
        self.pods: dict[str, str] = {}  # live pod -> template
        self.processes: dict[str, tuple[str, int]] = {}  # pod -> (MIG UUID, pid) of its simulated process
        self.claims: dict[str, ClaimSeen] = {}  # claim uid -> what the watch saw
        self.outside: set[str] = set()  # MIG UUIDs the test destroyed behind the agent's back
        self.serial = 0
        self._watch: asyncio.Task[None] | None = None

    # -- processes --------------------------------------------------------------------------------------
    def start_agent(self) -> None:
        log = self.work / "agent.log"
        health = ("--metrics-port", "0", "--metrics-address", "127.0.0.1")
        self.agent = start_agent_process(
            self.cp, self.node, f"{GPU}:{GPU_COUNT}", self.state, log, *AGENT_FLAGS, *health,
            f"--inventory={self.inventory}",
        )  # fmt: skip

    def start_operator(self) -> None:
        argv = [
            sys.executable, "-m", "dynamig", "operator", "--standalone",
            "--kubeconfig", str(self.cp.kubeconfig_path), "--resync-seconds", "1",
            "--liveness", f"http://127.0.0.1:{self.operator_port}/healthz",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with (self.work / "operator.log").open("ab") as out:
            self.operator = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for proc in (self.operator, self.agent):
            if proc is not None:
                await asyncio.to_thread(kill, proc, signal.SIGTERM)

    async def healthy(self) -> str | None:
        """None when the agent (since its last start) has finished a round and the operator's loop runs."""
        log = await asyncio.to_thread((self.work / "agent.log").read_text)
        ports = re.findall(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log)
        for what, url in (
            ("agent", f"http://127.0.0.1:{ports[-1]}/readyz" if ports else ""),
            ("operator", f"http://127.0.0.1:{self.operator_port}/healthz"),
        ):
            if not url or not await asyncio.to_thread(http_ok, url):
                return f"the {what} not ready"
        return None

    def alive(self) -> None:
        for name, proc in (("agent", self.agent), ("operator", self.operator)):
            if proc is None or proc.poll() is not None:
                log = (self.work / f"{name}.log").read_text(errors="replace").splitlines()[-30:]
                raise AssertionError(f"the {name} process is not running:\n" + "\n".join(log))

    # -- set-up ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.k.ensure_device_class()
        for name, profiles in TEMPLATES.items():
            await self.k.claim_template(name, profiles)
        self.start_agent()

        async def partitions() -> bool | None:
            with contextlib.suppress(ApiException):  # the CRD's storage may still be starting
                return True if len(await self.partitions()) == GPU_COUNT else None
            return None

        await eventually(partitions, "the agent's GpuPartitions", within_s=60)
        self.admin = Admin(self.state)
        self.start_operator()
        await self.k.create_policy(
            f"chaos-{self.pool}",
            {
                "nodeSelector": {"matchLabels": {"test-pool": self.pool}},
                "mode": "Dynamic",
                "baseline": {GPU: [{"profile": p, "start": s} for p, s in BASELINE]},
                "batchWindowSeconds": 1,
                "cooldownSeconds": 2,
                "disruptionBudget": {"maxGpusReshaping": 2},
            },
        )
        self._watch = asyncio.create_task(self._watch_claims(), name="chaos-claim-watch")

    async def delete_policy(self) -> None:
        await self.k.delete_policy(f"chaos-{self.pool}")

    # -- the claim watch ------------------------------------------------------------------------------
    async def _watch_claims(self) -> None:
        while True:
            try:
                now = time.time()
                claims = await self.k.claims()
                # NVML after the claims: an instance at a claim's device now was there while it was allocated.
                at = {device_name(g, p, st): us[0] for (g, p, st), us in (await self.nvml()).items() if us}
                for c in claims:
                    seen = self.claims.setdefault(c["metadata"]["uid"], ClaimSeen(c["metadata"]["name"]))
                    device = allocated_device(c)
                    # A booking (a result with binding conditions) holds no instance until it is answered: its
                    # pod waits in PreBind for the answer, which names the instance it gets (held below).
                    uuids = {at[device]} if device in at and not booked(c, device) else set()
                    for entry in (c.get("status") or {}).get("devices") or []:
                        mig = (entry.get("data") or {}).get("migUUID")
                        if device is not None and entry.get("device") == device and mig:
                            seen.mig_uuid = mig
                            uuids.add(mig)
                    seen.seen(device, uuids, now)
            except (TimeoutError, ApiException, aiohttp.ClientError, OSError, ValueError):
                pass  # the API server is down or slow: the next poll catches up
            await asyncio.sleep(0.05)

    # -- reads ----------------------------------------------------------------------------------------
    async def partitions(self) -> list[dict[str, Any]]:
        res = await self.k.custom.list_cluster_custom_object(
            GROUP, VERSION, GPU_PARTITION_PLURAL, label_selector=f"{NODE_LABEL}={self.node}"
        )
        return list(res["items"])

    async def slices(self) -> list[dict[str, Any]]:
        res = await self.k.custom.list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={self.node}"
        )
        return [s for s in res["items"] if s["spec"]["driver"] == DRIVER_NAME]

    async def nvml(self) -> dict[tuple[int, str, int], list[str]]:
        return nvml_instances(await asyncio.to_thread(read_nvml, self.state))

    async def history(self) -> list[dict[str, Any]]:
        return list((await asyncio.to_thread(read_nvml, self.state))["history"])

    async def allocated_placements(self) -> set[tuple[int, str, int]]:
        """(GPU, profile, start) of every device a claim of the namespace is allocated now."""
        out = set()
        for c in await self.k.claims():
            dev = allocated_device(c)
            if dev is not None:
                gpu, placed = placement(dev)
                out.add((gpu, placed.profile, placed.start))
        return out

    # -- convergence ----------------------------------------------------------------------------------
    async def converged(self) -> str | None:
        """None when converged, else what is not yet (for the timeout message)."""
        self.alive()
        if why := await self.healthy():
            return why
        parts = await self.partitions()
        if len(parts) != GPU_COUNT:
            return f"{len(parts)} GpuPartitions"
        nvml = await self.nvml()
        reported: dict[tuple[int, str, int], str] = {}
        for p in parts:
            st = p.get("status") or {}
            if st.get("phase") != "Stable" or st.get("observedGeneration") != p["metadata"]["generation"]:
                return f"{p['metadata']['name']} {st.get('phase')} at {st.get('observedGeneration')}"
            for i in st.get("instances") or []:
                reported[(st["gpuIndex"], i["profile"], i["start"])] = i.get("migUUID", "")
        if {k: [u] for k, u in reported.items()} != nvml:
            return f"NVML {sorted(nvml)} != GpuPartition status {sorted(reported)}"
        slices = await self.slices()
        generations = {s["spec"]["pool"]["generation"] for s in slices}
        if len(generations) != 1 or len(slices) != slices[0]["spec"]["pool"]["resourceSliceCount"]:
            return f"slices at pool generations {sorted(generations)} ({len(slices)} slices)"
        claims = await self.k.claims()
        owners = {o["name"] for c in claims for o in c["metadata"].get("ownerReferences") or []}
        if stale := owners - set(self.pods):
            return f"claims of deleted pods {sorted(stale)}"
        uuids = {u for us in nvml.values() for u in us}
        existing = {device_name(g, p, s) for (g, p, s) in nvml}
        for pod in self.pods:
            got = await self.k.core.read_namespaced_pod(pod, self.k.ns)
            if not got.spec.node_name:
                return f"pod {pod} not bound"
            claim = next(
                (
                    c
                    for c in claims
                    if any(o["name"] == pod for o in c["metadata"].get("ownerReferences") or [])
                ),
                None,
            )
            answered = [
                (e.get("data") or {}).get("migUUID")
                for e in (claim or {}).get("status", {}).get("devices") or []
            ]
            device = allocated_device(claim) if claim is not None else None
            if answered and answered[0] not in uuids:
                return f"pod {pod}: claim answered {answered}, not an instance in NVML"
            if not answered and device not in existing:
                # No answer: booked without binding conditions, so it must name an instance that exists.
                return f"pod {pod}: bound to {device} with no answer, not an instance in NVML"
        return None

    async def wait_converged(self, since: float, what: str) -> tuple[float, str]:
        """Seconds from ``since`` (monotonic) until converged, and what was last missing; fails after
        ``CONVERGE_S``."""
        last = [""]

        async def probe() -> bool | None:
            try:
                why = await self.converged()
            except (ApiException, aiohttp.ClientError, OSError) as exc:
                why = f"API: {type(exc).__name__}"
            if why is not None:
                last[0] = why
            return True if why is None else None

        try:
            await eventually(probe, what, within_s=CONVERGE_S - (time.monotonic() - since), every_s=0.2)
        except TimeoutError as exc:
            raise AssertionError(f"not converged {CONVERGE_S:.0f}s after {what}: {last[0]}") from exc
        return time.monotonic() - since, last[0]

    # -- workload -------------------------------------------------------------------------------------
    async def release(self, pods: list[str]) -> None:
        """The workloads end: their processes exit, then the pods are deleted."""
        for pod in pods:
            if pod in self.processes and self.admin is not None:
                mig, pid = self.processes.pop(pod)
                await asyncio.to_thread(self.admin.detach, mig, pid)
            self.pods.pop(pod, None)
        await self.k.delete_pods(pods)

    async def create(self, rng: random.Random, n: int) -> None:
        """Up to ``n`` new pods at once, small or large at random, within ``MAX_PODS``/``MAX_LARGE_PODS``."""
        names = []
        for _ in range(min(n, MAX_PODS - len(self.pods))):
            large = sum(1 for t in self.pods.values() if t == "large")
            template = "large" if large < MAX_LARGE_PODS and rng.random() < 0.3 else "small"
            self.serial += 1
            name = f"{template}-{self.serial}"
            self.pods[name] = template
            names.append(name)
        await asyncio.gather(*(self.k.pod(n, self.pods[n], {"test-pool": self.pool}) for n in names))

    async def churn(self, rng: random.Random) -> None:
        """Some pods end and others arrive: creates on the scheduler's bookings, re-cuts of free space."""
        live = sorted(self.pods)
        await self.release(rng.sample(live, rng.randint(min(1, len(live)), len(live))))
        await self.create(rng, rng.randint(1, MAX_PODS))

    async def run_processes(self, rng: random.Random) -> None:
        """Start a simulated process on about half the pods' instances that have none yet (workloads
        running, which NVML itself protects)."""
        assert self.admin is not None
        for c in await self.k.claims():
            pod = next((o["name"] for o in c["metadata"].get("ownerReferences") or []), None)
            if pod is None or pod in self.processes or pod not in self.pods or rng.random() < 0.5:
                continue
            mig = next(((e.get("data") or {}).get("migUUID") for e in c["status"].get("devices") or []), None)
            if mig:
                pid = 10_000 + self.serial * 10 + rng.randint(0, 9)
                await asyncio.to_thread(self.admin.attach, mig, pid)
                self.processes[pod] = (mig, pid)

    # -- faults ---------------------------------------------------------------------------------------
    async def nvml_changes_since(self, count: int) -> int:
        return len(await self.history()) - count

    async def inject(self, kind: str, rng: random.Random) -> tuple[float, str]:
        """Inject one fault of ``kind`` during a workload change; (monotonic time of the fault, detail)."""
        if kind == "agent-kill":
            before = len(await self.history())
            target = rng.randint(1, 4)

            # Every pod ends and new ones come: the GPUs are re-cut, each instance in two to four steps.
            async def change() -> None:
                await self.release(sorted(self.pods))
                await self.create(rng, rng.randint(2, MAX_PODS))

            changing = asyncio.create_task(change())

            async def changes() -> int | None:
                n = await self.nvml_changes_since(before)
                return n if n >= target else None

            with contextlib.suppress(TimeoutError):
                await eventually(changes, "NVML changes", within_s=8, every_s=0.02)
            assert self.agent is not None
            await asyncio.to_thread(kill, self.agent)
            at = time.monotonic()
            await changing
            done = await self.nvml_changes_since(before)
            half = [k for k, cis in (await self.nvml()).items() if not cis]
            await asyncio.sleep(rng.uniform(0, 1))
            self.start_agent()
            left = f", left {half} without compute instance" if half else ""
            return at, f"killed after {done} NVML changes (aimed at {target}){left}"
        if kind == "operator-kill":
            await self.churn(rng)
            delay = rng.uniform(0, 2)
            await asyncio.sleep(delay)
            assert self.operator is not None
            await asyncio.to_thread(kill, self.operator)
            at = time.monotonic()
            await asyncio.sleep(rng.uniform(0, 1))
            self.start_operator()
            return at, f"killed {delay:.2f}s into the change"
        if kind in ("slice-delete", "partition-delete"):
            await self.churn(rng)
            delay = rng.uniform(0, 1)
            await asyncio.sleep(delay)
            if kind == "slice-delete":
                victims = [(("resource.k8s.io", "v1", "resourceslices"), s) for s in await self.slices()]
            else:
                victims = [((GROUP, VERSION, GPU_PARTITION_PLURAL), p) for p in await self.partitions()]
            if not victims:
                return time.monotonic(), "nothing to delete"
            (group, version, plural), obj = rng.choice(victims)
            with contextlib.suppress(ApiException):
                await self.k.custom.delete_cluster_custom_object(
                    group, version, plural, obj["metadata"]["name"]
                )
            return time.monotonic(), f"deleted {obj['metadata']['name']} {delay:.2f}s into the change"
        if kind == "nvml-change":
            assert self.admin is not None
            keep = await self.allocated_placements()
            detail = await asyncio.to_thread(self.admin.change, rng, keep)
            at = time.monotonic()
            await self.churn(rng)
            return at, detail
        if kind == "allocated-replaced":
            return await self.replace_allocated(rng)
        if kind == "control-plane-restart":
            which = rng.choice([("etcd", "kube-apiserver"), ("kube-apiserver",), ("etcd",)])
            await self.churn(rng)
            await asyncio.sleep(rng.uniform(0, 1))
            down = rng.uniform(0.5, 3)
            stopped = time.monotonic()
            back = await asyncio.to_thread(self.cp.restart, *which, down_seconds=down)
            # Measured from the API's return: nothing can converge without it.
            at = time.monotonic()
            return at, (
                f"{' and '.join(which)} stopped, down {down:.1f}s, API ready {back:.1f}s after the restart "
                f"({at - stopped:.1f}s without it)"
            )
        if kind == "claim-storm":
            await self.release(sorted(self.pods))
            delay = rng.uniform(0, 1.5)
            await asyncio.sleep(delay)
            at = time.monotonic()
            await self.create(rng, MAX_PODS)
            return at, f"{len(self.pods)} pods at once, {delay:.2f}s after releasing all"
        raise ValueError(kind)

    async def replace_allocated(self, rng: random.Random) -> tuple[float, str]:
        """An allocated instance destroyed and created again behind the agent's back: the agent says so on
        the claim; then its pod is restarted, as the owner told so would, and the rest converges."""
        assert self.admin is not None
        held = []
        for c in await self.k.claims():
            pod = next((o["name"] for o in c["metadata"].get("ownerReferences") or []), None)
            device = allocated_device(c)
            if pod in self.pods and device is not None:
                held.append((pod, c["metadata"]["name"], device))
        if not held:
            return time.monotonic(), "nothing allocated"
        pod, claim, device = rng.choice(sorted(held))
        index, placed = placement(device)
        # The agent learns which MIG UUID a claim was given when a round first sees it allocated (or, in the
        # partitionable inventory, from its answer): a replacement before that cannot be told apart from the
        # instance the claim got. Its GpuPartition listing the claim on the instance says it has seen it.
        holder = f"{self.k.ns}/{claim}"

        async def seen_held() -> bool | None:
            for p in await self.partitions():
                st = p.get("status") or {}
                for i in st.get("instances") or [] if st.get("gpuIndex") == index else []:
                    here = (i["profile"], i["start"]) == (placed.profile, placed.start)
                    if here and holder in (i.get("claims") or []):
                        return True
            return None

        await eventually(seen_held, f"the agent to see {device} held by {claim}", within_s=30)
        if pod in self.processes:  # the workload dies with its GPU
            mig, pid = self.processes.pop(pod)
            await asyncio.to_thread(self.admin.detach, mig, pid)
        self.outside.update((await self.nvml()).get((index, placed.profile, placed.start)) or [])
        detail = await asyncio.to_thread(self.admin.replace, index, placed)
        at = time.monotonic()

        async def told() -> str | None:
            events = await self.k.core.list_namespaced_event(
                self.k.ns, field_selector=f"involvedObject.name={claim}"
            )
            return next((e.reason for e in events.items if e.reason in REPLACED_REASONS), None)

        try:
            reason = await eventually(told, f"an Event on claim {claim} about {device}", within_s=CONVERGE_S)
        except TimeoutError as exc:
            raise AssertionError(
                f"claim {claim}: no {' or '.join(REPLACED_REASONS)} Event ({detail})"
            ) from exc
        took = time.monotonic() - at
        template = self.pods[pod]
        await self.release([pod])
        self.serial += 1
        name = f"{template}-{self.serial}"
        self.pods[name] = template
        await self.k.pod(name, template, {"test-pool": self.pool})
        return (
            at,
            f"{pod}'s {device}: {detail}; {reason} on the claim after {took:.2f}s, pod restarted as {name}",
        )


def record(faults: list[FaultRecord]) -> None:
    """Append the faults' figures to ``$DYNAMIG_CHAOS_REPORT`` (JSON lines) when set."""
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as out:
            for f in faults:
                out.write(json.dumps(dataclasses.asdict(f)) + "\n")


def summary(faults: list[FaultRecord]) -> str:
    times = [f.converge_s for f in faults]
    kinds: dict[str, int] = {}
    for f in faults:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
    return (
        f"{len(faults)} faults ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}); converged "
        f"p50 {percentile(times, 50):.2f}s, p99 {percentile(times, 99):.2f}s, max {max(times):.2f}s"
    )


async def run_faults(system: System, seed: int, kinds: list[str]) -> list[FaultRecord]:
    """Inject ``kinds`` in turn, each once the system has converged; check for losses after each."""
    rng = random.Random(seed)
    faults = []
    await system.create(rng, rng.randint(2, MAX_PODS))
    await system.wait_converged(time.monotonic(), f"seed {seed}: the first pods")
    await system.run_processes(rng)
    for kind in kinds:
        at, detail = await system.inject(kind, rng)
        took, blocker = await system.wait_converged(at, f"seed {seed}: {kind} ({detail})")
        faults.append(FaultRecord(system.inventory, kind, seed, took, detail, blocker))
        bad = losses(await system.history(), system.claims, frozenset(system.outside))
        assert bad == [], f"seed {seed}, after {kind} ({detail}): {bad}"
        await system.run_processes(rng)
    return faults


@pytest.fixture
def own_control_plane(tmp_path: Path) -> Iterator[ControlPlane]:
    """A control plane of this test's own (the session's is shared: it must not go down), with the CRDs and
    a namespace ``chaos``. Started from the main thread, so its processes die with this one."""
    from dynamig.devcluster.sandbox import install_crds

    cp = ControlPlane(work_dir=tmp_path / "controlplane")
    cp.start()
    try:
        install_crds(cp)
        rest = cp.rest()
        rest.request("POST", "/api/v1/namespaces", {"metadata": {"name": "chaos"}})
        with contextlib.suppress(ApiError):  # the controller may have made it first
            rest.request(
                "POST", "/api/v1/namespaces/chaos/serviceaccounts", {"metadata": {"name": "default"}}
            )
        yield cp
    finally:
        cp.stop()


@pytest.mark.controlplane
@pytest.mark.parametrize("seed", chaos_seeds())
@pytest.mark.parametrize("inventory", INVENTORIES)
async def test_faults_converge_without_losses(
    own_control_plane: ControlPlane,
    tmp_path: Path,
    inventory: str,
    seed: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cp = own_control_plane
    started = time.monotonic()
    kinds = list(FAULTS)
    random.Random(seed).shuffle(kinds)
    pool = uuid.uuid4().hex[:8]
    node = f"chaos-{pool}"
    await asyncio.to_thread(cp.register_node, node, labels={"dynamig.io/managed": "true", "test-pool": pool})
    async with cp.api_client() as api:
        system = System(cp, api, "chaos", node, pool, tmp_path, inventory)
        try:
            await system.start()
            faults = await run_faults(system, seed, kinds)
            history = await system.history()
            # The check can fail: an instance destroyed behind the agent's back while its claim is allocated
            # is reported as a loss.
            assert system.admin is not None
            pod = sorted(system.pods)[0]
            if pod in system.processes:
                await asyncio.to_thread(system.admin.detach, *system.processes.pop(pod))
            claim = next(
                c
                for c in await system.k.claims()
                if any(o["name"] == pod for o in c["metadata"].get("ownerReferences") or [])
            )
            held = system.claims[claim["metadata"]["uid"]]
            assert held.device is not None
            index, placed = placement(held.device)
            (mig,) = (await system.nvml())[(index, placed.profile, placed.start)]
            await asyncio.to_thread(system.admin.destroy, index, placed)
            found: list[str] = []

            async def reported() -> bool | None:  # once the watch saw the claim allocated after the destroy
                found[:] = losses(await system.history(), system.claims)
                return True if any(mig in line for line in found) else None

            try:
                await eventually(reported, f"the destroy of {mig} reported as a loss", within_s=10)
            except TimeoutError as exc:
                raise AssertionError(f"{mig} destroyed under claim {held.name}, losses: {found}") from exc
        finally:
            try:
                with contextlib.suppress(ApiException, aiohttp.ClientError, TimeoutError, OSError):
                    await system.release(sorted(system.pods))
                    await system.delete_policy()
            finally:
                await system.stop()
    record(faults)
    destroys = sum(1 for ev in history if ev["kind"] == "destroy-ci")
    creates = sum(1 for ev in history if ev["kind"] == "create-ci")
    served = sum(1 for c in system.claims.values() if c.held)
    with capsys.disabled():
        print(
            f"\n[chaos {inventory} seed {seed}] {summary(faults)}; NVML {creates} creates, {destroys} "
            f"destroys; {served} claims served; losses 0; {time.monotonic() - started:.0f}s"
        )
        for f in faults:
            print(f"  {f.kind}: {f.converge_s:.2f}s, last waiting on {f.blocker!r} ({f.detail})")
    # The faults hit a system at work: instances were cut, claims served (and answered where they are booked).
    assert creates > 0 and served > 0
    if inventory == "partitionable":
        assert any(c.mig_uuid for c in system.claims.values())


def test_the_loss_check_reports_destroys_of_held_or_busy_instances() -> None:
    """``losses`` on a history in the simulated NVML's format: a destroy while the claim was still seen
    allocated, or while a process ran, is reported; a destroy after the claim was last seen is not."""
    claims = {"a": ClaimSeen("held", "gpu0-1g10gb-s0", "MIG-a", held={"MIG-a": 100.0})}
    ok = [
        {"kind": "attach-process", "mig_uuid": "MIG-b", "pid": 1, "timestamp": 90.0},
        {"kind": "detach-process", "mig_uuid": "MIG-b", "pid": 1, "timestamp": 95.0},
        {"kind": "destroy-ci", "mig_uuid": "MIG-b", "timestamp": 96.0},
        {"kind": "destroy-ci", "mig_uuid": "MIG-a", "timestamp": 100.5},
    ]
    assert losses(ok, claims) == []
    held = [{"kind": "destroy-ci", "mig_uuid": "MIG-a", "timestamp": 99.0}]
    assert len(losses(held, claims)) == 1
    # The same free instance served a second claim later: held until that claim's end.
    claims["b"] = ClaimSeen("later", "gpu0-1g10gb-s0", "MIG-a", held={"MIG-a": 200.0})
    assert "claim later" in losses(ok, claims)[0]
    # Destroyed behind the agent's back by the test itself: not dynamig's doing.
    assert losses(held, claims, frozenset({"MIG-a"})) == []
    busy = [
        {"kind": "attach-process", "mig_uuid": "MIG-c", "pid": 7, "timestamp": 1.0},
        {"kind": "destroy-ci", "mig_uuid": "MIG-c", "timestamp": 2.0},
    ]
    assert "processes [7]" in losses(busy, {})[0]


def test_an_instance_a_claim_held_stays_held_while_its_allocation_lasts() -> None:
    """The watch's sightings: a MIG UUID seen at a claim's device stays held while the claim stays allocated
    (replaced behind the agent's back or not), and is let go when the allocation ends or moves."""
    c = ClaimSeen("c")
    c.seen("gpu0-1g10gb-s0", {"MIG-a"}, 1.0)
    c.seen("gpu0-1g10gb-s0", {"MIG-b"}, 2.0)  # replaced: both held at 2.0
    assert c.held == {"MIG-a": 2.0, "MIG-b": 2.0}
    c.seen(None, set(), 3.0)  # deallocated (a failed booking)
    c.seen("gpu0-1g10gb-s0", set(), 4.0)  # booked again at the same place: nothing held yet
    assert c.held == {"MIG-a": 2.0, "MIG-b": 2.0}
    c.seen("gpu0-1g10gb-s0", {"MIG-c"}, 5.0)
    c.seen("gpu1-1g10gb-s0", {"MIG-d"}, 6.0)  # moved: the earlier one is no longer held
    assert c.held == {"MIG-a": 2.0, "MIG-b": 2.0, "MIG-c": 5.0, "MIG-d": 6.0}
    destroyed = [{"kind": "destroy-ci", "mig_uuid": "MIG-b", "timestamp": 1.5}]
    assert "claim c allocated to 2.00" in losses(destroyed, {"c": c})[0]


def test_a_booking_holds_no_instance_until_it_is_answered() -> None:
    """The watch's reading of an allocation: a result with binding conditions is a booking (its pod waits for
    the agent's answer), one without binds at once and holds the instance at its device."""
    results = [
        {"device": "gpu0-1g10gb-s0", "bindingConditions": ["mig.dynamig.io/ready"]},
        {"device": "gpu0-1g10gb-s1"},
    ]
    claim = {"status": {"allocation": {"devices": {"results": results}}}}
    assert booked(claim, "gpu0-1g10gb-s0")
    assert not booked(claim, "gpu0-1g10gb-s1")
    assert not booked({"status": {}}, "gpu0-1g10gb-s0")
