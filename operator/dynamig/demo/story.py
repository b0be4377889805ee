"""``dynamig demo``: the morning-burst story on a local control plane with simulated GPUs.

Side effects: builds (first run only) and starts etcd, kube-apiserver, kube-scheduler and
kube-controller-manager on 127.0.0.1, runs one node agent (over the simulated NVML) and the operator in this
process, creates pods, and tears everything down when it ends or is interrupted.

The story, as a platform engineer lives it:
1. 8 AM: an admin pre-cuts each of a node's two A100-80GB GPUs into 2 x 3g.40gb.
2. A burst of small inference pods arrives, each asking ``1g.10gb`` with fallback ``2g.20gb``. Under a
   ``Dynamic`` policy dynamig re-cuts the free 3g.40gb instances and the scheduler books every pod.
3. A training pod asking ``3g.40gb`` fits into what is still free.
4. The inference pods finish; after the cooldown the idle GPU returns to the baseline layout.
5. Best-effort batch pods (priority 0) take every slice; a latency-critical pod (priority 1000) asks for a
   ``3g.40gb``. kube-scheduler cannot preempt for a DRA device; the policy's ``preemption.mode: Evict`` holds
   a placement for it, evicts the fewest batch pods in its way, and the pod gets the cut.
6. A training pod asks for a whole GPU (MIG mode off: NCCL across MIG instances has no peer-to-peer). No GPU
   has MIG off; the policy's ``migMode.policy: Dynamic`` (with ``allowReset``: an A100's switch resets it)
   switches an idle GPU off and the pod gets it whole.

With ``real_node`` the node is real (:class:`~dynamig.devcluster.node.RealNode`: a kubelet and containerd,
root needed) and its agent runs as its own process beside it, as the DaemonSet would: the pods run, and the
story prints when each container started and the MIG UUID and capability device nodes it saw. Without a
real node no kubelet finishes an evicted pod's deletion: the story does it, as a kubelet would once the
pod's containers exited, and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from kubernetes_asyncio.client.exceptions import ApiException

from dynamig.backends.simnvml import SimEvent
from dynamig.demo.cluster import AllocationWatch, ScenarioApi, allocated_device, layout_text
from dynamig.demo.inprocess import agent_running, operator_running
from dynamig.devcluster import eventually
from dynamig.devcluster.node import ContainerReport, RealNode, parse_report, runnable
from dynamig.devcluster.processes import Component
from dynamig.geometry.catalog import load_catalog
from dynamig.kube.names import MANAGED_NODE_LABEL, WHOLE_PROFILE, gpu_partition_name
from dynamig.simulate.trace import percentile
from dynamig.textable import align

log = logging.getLogger(__name__)
T = TypeVar("T")

NAMESPACE = "demo"
NODE = "gpu-node-a"
POOL_LABEL = "dynamig.io/demo-pool"
POLICY = "morning"
BEST_EFFORT, CRITICAL = "dynamig-demo-best-effort", "dynamig-demo-critical"  # PriorityClasses: 0 and 1000
BATCH_PROFILE = "1g.10gb"


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    gpus: tuple[str, ...] = ("A100-80GB", "A100-80GB")
    baseline: tuple[tuple[str, int], ...] = (("3g.40gb", 0), ("3g.40gb", 4))
    inference_pods: int = 7
    inference_profiles: tuple[str, ...] = ("1g.10gb", "2g.20gb")
    training_profile: str = "3g.40gb"
    cooldown_s: int = 10
    step_timeout_s: float = 180.0
    return_to_baseline: bool = True
    log_file: Path | None = None
    real_node: bool = False


class Reporter:
    """Prints the story: step headings, tables and timings."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self.write = write
        self.timings: list[tuple[str, float]] = []
        self._t0 = time.monotonic()

    def step(self, text: str) -> None:
        self.write(f"\n==> {text}")

    def info(self, text: str) -> None:
        self.write(f"    {text}")

    def timed(self, label: str, seconds: float) -> None:
        self.timings.append((label, seconds))
        self.info(f"{label}: {seconds:.1f}s")

    def table(self, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
        for line in align([header, *rows], trim=False):
            self.info(line)


async def _layouts(api: ScenarioApi, gpu_count: int) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for i in range(gpu_count):
        part = await api.partition(gpu_partition_name(NODE, i))
        st = part.get("status") or {}
        instances = st.get("instances") or []
        used = sum(1 for x in instances if x.get("state") in ("allocated", "in-use"))
        rows.append((
            part["metadata"]["name"],
            st.get("product", "?"),
            layout_text(instances) or "(no instances)",
            f"{used}/{len(instances)}",
            st.get("phase", "?"),
        ))  # fmt: skip
    return rows


async def _show_layouts(
    api: ScenarioApi, report: Reporter, gpu_count: int, in_use: int | None = None
) -> None:
    """Print every GPU's layout; with ``in_use``, first give the agent a moment to report that many
    allocated instances (its status follows the scheduler's allocations by one reconcile round)."""

    async def reported() -> list[tuple[str, ...]] | None:
        rows = await _layouts(api, gpu_count)
        return rows if sum(int(r[3].split("/")[0]) for r in rows) >= (in_use or 0) else None

    with contextlib.suppress(TimeoutError):
        await eventually(reported, f"{in_use} instances reported in use", within_s=10)
    report.table(
        ("GPU", "PRODUCT", "LAYOUT (profile@start)", "IN USE", "PHASE"), await _layouts(api, gpu_count)
    )


async def _show_containers(
    api: ScenarioApi, report: Reporter, pods: list[str], since: float, within: float, label: str
) -> None:
    """Waits until each pod's container reported what it saw, then prints when it started (seconds after
    ``since``, a wall-clock time), the MIG UUID it was given and its capability device nodes."""

    async def reports() -> dict[str, tuple[float, ContainerReport]] | None:
        seen = {}
        for name in pods:
            pod = await api.core.read_namespaced_pod(name, api.ns)
            if pod.status.phase in ("Failed", "Succeeded"):
                raise RuntimeError(f"pod {name} ended ({pod.status.phase}): {pod.status.message or ''}")
            states = pod.status.container_statuses or []
            if pod.status.phase != "Running" or not states or states[0].state.running is None:
                return None
            got = parse_report(await api.core.read_namespaced_pod_log(name, api.ns))
            if got is None:
                return None
            # The kubelet reports start times to the second (truncated): a container that started within
            # the second ``since`` fell in would read as started before it.
            seen[name] = (max(since, states[0].state.running.started_at.timestamp()), got)
        return seen

    seen = await eventually(reports, "every container running and reporting its devices", within, every_s=0.5)
    report.timed(label, max(t for t, _ in seen.values()) - since)
    report.table(
        ("POD", "STARTED", "MIG (or GPU) UUID as the container saw it", "CAPABILITY NODES"),
        [
            (
                name,
                f"+{started - since:.1f}s",
                got.env.get("DYNAMIG_MIG_UUIDS") or got.env.get("DYNAMIG_GPU_UUIDS", "-"),
                " ".join(n.rsplit("/", 1)[1] for n in got.capability_nodes),
            )
            for name, (started, got) in sorted(seen.items())
        ],
    )


async def run_demo(options: DemoOptions, write: Callable[[str], None]) -> int:
    """Run the whole story; 0 when every step happened as told, 1 otherwise. Leaves nothing running."""
    from dynamig.backends.nvml import load_nvml
    from dynamig.devcluster import ControlPlane
    from dynamig.devcluster.sandbox import install_crds

    report = Reporter(write)
    report.step("Local control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager)")
    started = time.monotonic()
    cp = ControlPlane(progress=lambda msg: report.info(msg))
    await asyncio.to_thread(cp.start)
    nvml: ModuleType = load_nvml("simulated")
    nvml.configure(gpus=list(options.gpus), state_file=None)
    node: RealNode | None = None
    try:
        report.timed("control plane ready", time.monotonic() - started)
        install_crds(cp)  # from the source checkout's crds/
        cp.kubectl("create", "namespace", NAMESPACE)
        labels = {MANAGED_NODE_LABEL: "true", POOL_LABEL: "morning"}
        if options.real_node:
            report.step("A real node: kubelet and containerd (CDI on), images built here")
            node = RealNode(cp, NODE, progress=report.info)
            await asyncio.to_thread(node.start)
            cp.kubectl("label", "node", NODE, *(f"{k}={v}" for k, v in labels.items()))
        else:
            await cp.aregister_node(NODE, labels=labels)
        report.info(
            f"node {NODE} registered with {len(options.gpus)} simulated GPU(s): {', '.join(options.gpus)}"
        )
        async with cp.api_client() as api_client:
            return await _story(options, report, cp, api_client, _NodeAgent(nvml, node))
    finally:
        nvml.configure(gpus=[], state_file=None)
        if node is not None:
            await asyncio.to_thread(node.stop)
        await asyncio.to_thread(cp.stop)
        write("\nEverything stopped; nothing is left running.")


class AgentExitedError(RuntimeError):
    """The node agent's process exited while the story waited for it; the message carries its log's end."""


def agent_report(comp: Component, lines: int = 20) -> str:
    """The agent process's exit status (or that it still runs) and the last ``lines`` lines of its log, for
    an error message: the log lives in the node's work directory, which is removed when the demo ends.
    Side effect: reads the log."""
    code = comp.popen.poll()
    state = f"exited with code {code}" if code is not None else "is still running"
    tail = comp.log_tail(lines).rstrip()
    body = "\n".join(f"    {line}" for line in tail.splitlines()) if tail else "    (its log is empty)"
    return f"the node agent (pid {comp.pid}) {state}; the last {lines} lines of its log:\n{body}"


class _NodeAgent:
    """The node's agent and the simulated GPUs' history: in this process over ``nvml``, or, on a real node,
    the agent's own process, whose simulated NVML keeps its state (and history) in a file."""

    def __init__(self, nvml: ModuleType, node: RealNode | None) -> None:
        self.nvml = nvml
        self.node = node
        self.process: Component | None = None  # the agent's process on a real node, once started

    @contextlib.asynccontextmanager
    async def running(self, api_client: Any, cp: Any, gpus: tuple[str, ...]) -> AsyncIterator[None]:
        if self.node is None:
            async with agent_running(api_client, NODE, self.nvml):
                yield
            return
        quick = ("--interval=0.5", "--settle-seconds=0.3", "--quarantine-seconds=1", "--reshape-poll=0.1")
        spec = ",".join(f"{m}:1" for m in gpus)
        self.process = await asyncio.to_thread(self.node.start_agent, spec, cp.kubeconfig_path, *quick)
        try:
            yield
        except AgentExitedError:
            raise
        except (TimeoutError, RuntimeError) as exc:
            # Read before stop_agent (its SIGTERM would hide the exit status) and before the node's work
            # directory, which holds the log, is removed.
            message = f"{exc}\n{agent_report(self.process)}"
            raise (TimeoutError(message) if isinstance(exc, TimeoutError) else RuntimeError(message)) from exc
        finally:
            await asyncio.to_thread(self.node.stop_agent)

    async def wait(self, probe: Callable[[], Awaitable[T | None]], what: str, within_s: float) -> T:
        """:func:`eventually` for a step the agent must take; on a real node it fails at once with
        :class:`AgentExitedError` when the agent's process has exited, instead of waiting out the timeout."""

        async def checked() -> T | None:
            if self.process is not None and not self.process.running():
                raise AgentExitedError(f"waiting for {what}: {agent_report(self.process)}")
            return await probe()

        return await eventually(checked, what, within_s)

    def history(self) -> list[SimEvent]:
        if self.node is None:
            return list(self.nvml.history())
        doc = json.loads(self.node.nvml_state.read_text())
        return [SimEvent(**e) for e in doc["history"]]


async def _story(options: DemoOptions, report: Reporter, cp: Any, api_client: Any, agent: _NodeAgent) -> int:
    api = ScenarioApi(api_client, NAMESPACE, pod_shape=runnable if agent.node is not None else None)
    await api.ensure_device_class()
    await api.claim_template("inference", list(options.inference_profiles))
    await api.claim_template("training", [options.training_profile])
    await api.claim_template("batch", [BATCH_PROFILE])
    await api.claim_template("whole", [WHOLE_PROFILE])
    await api.priority_classes({BEST_EFFORT: {"value": 0}, CRITICAL: {"value": 1000}})
    gpus = [gpu_partition_name(NODE, i) for i in range(len(options.gpus))]
    baseline = list(options.baseline)
    within = options.step_timeout_s
    selector = {POOL_LABEL: "morning"}
    watch = AllocationWatch(api)

    async with agent.running(api_client, cp, options.gpus):
        report.step("8 AM: the admin pre-cuts every GPU as " + layout_text(baseline))
        t = time.monotonic()
        for name in gpus:
            await agent.wait(functools.partial(api.stable, name), f"the agent's GpuPartition {name}", within)
        for name in gpus:
            await api.set_layout(name, baseline)
        for name in gpus:
            probe = functools.partial(api.stable, name, layout_text(baseline))
            await agent.wait(probe, f"{name} pre-cut", within)
        report.timed("agent applied the layout through NVML", time.monotonic() - t)
        await _show_layouts(api, report, len(gpus))
        history_start = len(agent.history())

        async with operator_running(cp.kubeconfig_path):
            report.step(f"GpuPartitionPolicy {POLICY!r}: Dynamic, baseline {layout_text(baseline)}")
            await api.create_policy(POLICY, {
                "nodeSelector": {"matchLabels": selector},
                "mode": "Dynamic",
                "baseline": {options.gpus[0]: [{"profile": p, "start": s} for p, s in baseline]},
                "batchWindowSeconds": 1,
                "cooldownSeconds": options.cooldown_s,
                "disruptionBudget": {"maxGpusReshaping": len(gpus)},
                "preemption": {"mode": "Evict", "minRunSeconds": 0, "gpuCooldownSeconds": 0},
                "migMode": {"policy": "Dynamic", "allowReset": True, "cooldownSeconds": 0},
            })  # fmt: skip

            async def governs() -> bool | None:
                st = (await api.policy(POLICY)).get("status") or {}
                return True if st.get("matchedGpus") == len(gpus) else None

            await eventually(governs, "the policy to govern the GPUs", within)
            watch.start()
            try:
                await _burst_training_release(options, report, api, agent, watch, gpus)
                await _make_room(options, report, api, agent, watch)
                await _whole_gpu(options, report, api, agent, watch, gpus)
            finally:
                await watch.stop()
            ok = _summary(report, agent, watch, history_start)
    return 0 if ok else 1


async def _bound_waits(watch: AllocationWatch, created_at: dict[str, float], within: float) -> list[float]:
    """Seconds from each pod's creation to the watch first seeing it bound (what its user waits for)."""

    async def all_bound() -> bool | None:
        watch.raise_if_stopped()
        return True if all(p in watch.first_bound for p in created_at) else None

    await eventually(all_bound, "every pod bound", within)
    return [max(0.0, watch.first_bound[p] - t) for p, t in created_at.items()]


async def _burst_training_release(
    options: DemoOptions,
    report: Reporter,
    api: ScenarioApi,
    agent: _NodeAgent,
    watch: AllocationWatch,
    gpus: list[str],
) -> None:
    within = options.step_timeout_s
    selector = {POOL_LABEL: "morning"}
    inference = [f"infer-{i}" for i in range(options.inference_pods)]
    alternatives = " then ".join(options.inference_profiles)
    report.step(f"9 AM burst: {len(inference)} inference pods, each asking {alternatives}")
    burst_at = time.time()
    created_at: dict[str, float] = {}
    for name in inference:
        await api.pod(name, "inference", selector)
        created_at[name] = time.time()

    async def all_allocated() -> dict[str, str] | None:
        devices = {p: allocated_device(await api.claim_of(p)) for p in inference}
        return {p: d for p, d in devices.items() if d} if all(devices.values()) else None

    devices = await eventually(all_allocated, "every inference pod allocated", within)
    names = [str((await api.claim_of(p) or {})["metadata"]["name"]) for p in inference]
    seen = await watch.seen_allocated(names, within)
    report.timed("burst to last allocation", max(seen.values()) - burst_at)
    waits = await _bound_waits(watch, created_at, within)
    report.timed("burst: pod created to bound, p50", percentile(waits, 50))
    report.timed("burst: pod created to bound, slowest", max(waits))
    report.table(("POD", "DEVICE (MIG slice)"), sorted(devices.items()))
    await _show_layouts(api, report, len(gpus), in_use=len(devices))
    if agent.node is not None:
        await _show_containers(api, report, inference, burst_at, within, "burst to last container started")

    report.step(f"10 AM: a training pod asking {options.training_profile}")
    train_at = time.time()
    await api.pod("train-0", "training", selector)
    train_created = {"train-0": time.time()}

    async def training_allocated() -> str | None:
        return allocated_device(await api.claim_of("train-0"))

    train_dev = await eventually(training_allocated, "the training pod allocated", within)
    report.timed("training pod to allocation", time.time() - train_at)
    report.timed("training pod created to bound", (await _bound_waits(watch, train_created, within))[0])
    report.info(f"train-0 -> {train_dev}")
    await _show_layouts(api, report, len(gpus), in_use=len(devices) + 1)
    if agent.node is not None:
        await _show_containers(
            api, report, ["train-0"], train_at, within, "training pod to container started"
        )

    if options.return_to_baseline:
        report.step(
            f"Noon: the inference pods finish; idle GPUs return to baseline after {options.cooldown_s}s"
        )
        release_at = time.time()
        await api.delete_pods(inference)
        train_gpu = gpu_partition_name(NODE, int(train_dev.split("-")[0][3:]))
        for name in [g for g in gpus if g != train_gpu]:
            await eventually(
                functools.partial(api.stable, name, layout_text(list(options.baseline))),
                f"{name} back at the baseline",
                within + options.cooldown_s,
            )
        report.timed("release to baseline", time.time() - release_at)
        await _show_layouts(api, report, len(gpus))
        await api.delete_pods(["train-0"])


async def _make_room(
    options: DemoOptions, report: Reporter, api: ScenarioApi, agent: _NodeAgent, watch: AllocationWatch
) -> None:
    """Batch pods at priority 0 take every slice; a pod at priority 1000 asks for the training profile and
    gets it by the policy's preemption. Prints whom it evicted and how long the pod waited."""
    within = options.step_timeout_s
    selector = {POOL_LABEL: "morning"}
    catalog = load_catalog()
    room = sum(catalog.model(gpu).profile(BATCH_PROFILE).max_instances for gpu in options.gpus)
    batch = [f"batch-{i}" for i in range(room + 1)]  # one more than the GPUs hold
    morning = [p.metadata.name for p in (await api.core.list_namespaced_pod(api.ns)).items]
    await api.delete_pods(morning)  # what is left of the morning (with --skip-baseline) ends first

    async def gone() -> bool | None:
        return None if (await api.core.list_namespaced_pod(api.ns)).items else True

    await eventually(gone, "the morning's pods gone", within)
    report.step(f"1 PM: {len(batch)} best-effort batch pods (priority 0), each asking {BATCH_PROFILE}")
    for name in batch:
        await api.pod(name, "batch", selector, priority_class=BEST_EFFORT)

    async def full() -> tuple[int, int] | None:
        allocated = waiting = 0
        for name in batch:
            if allocated_device(await api.claim_of(name)):
                allocated += 1
            elif await api.unschedulable(name):
                waiting += 1
        return (allocated, waiting) if allocated == room and waiting == len(batch) - room else None

    running, waiting = await eventually(full, f"{room} batch pods allocated, the rest waiting", within)
    report.info(f"{running} batch pods got a slice; {waiting} wait: no GPU has room for another")

    report.step(
        f"2 PM: a latency-critical pod (priority 1000) asks {options.training_profile}; kube-scheduler "
        "cannot preempt for a DRA device, the policy's preemption (mode Evict) makes room"
    )
    if agent.node is None:
        report.info("(no kubelet here: the story finishes each evicted pod's deletion, as a kubelet would)")
    created = time.time()
    await api.pod("critical-0", "training", selector, priority_class=CRITICAL)
    kubelet = None if agent.node is not None else asyncio.create_task(_finish_evictions(api, batch))
    try:

        async def critical_allocated() -> str | None:
            return allocated_device(await api.claim_of("critical-0"))

        device = await eventually(critical_allocated, "the critical pod allocated", within)
        waited = (await _bound_waits(watch, {"critical-0": created}, within))[0]
        report.timed("critical pod created to bound", waited)
    finally:
        if kubelet is not None:
            kubelet.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await kubelet
    # Evicted: deleted or being deleted (the Eviction API sets the deletion first; nothing else deletes
    # batch pods here). Read from the pods, not from Events, which are posted after the fact.
    left = {p.metadata.name: p for p in (await api.core.list_namespaced_pod(api.ns)).items}
    evicted = [n for n in batch if n not in left or left[n].metadata.deletion_timestamp is not None]
    report.info(f"critical-0 -> {device}; evicted {', '.join(evicted)} (priority 0 < 1000) for it")
    waiting_now = [n for n in batch if n not in evicted and not allocated_device(await api.claim_of(n))]
    report.info(f"{len(waiting_now)} batch pod(s) still wait")
    if agent.node is not None:
        await _show_containers(
            api, report, ["critical-0"], created, within, "critical pod created to container started"
        )
    await api.delete_pods([*batch, "critical-0"])


async def _whole_gpu(
    options: DemoOptions,
    report: Reporter,
    api: ScenarioApi,
    agent: _NodeAgent,
    watch: AllocationWatch,
    gpus: list[str],
) -> None:
    """A pod asks for a whole GPU; the policy switches an idle MIG GPU off for it. Prints which GPU, how long
    the pod waited, and (on a real node) the GPU its container saw."""
    within = options.step_timeout_s

    async def quiet() -> bool | None:
        return None if (await api.core.list_namespaced_pod(api.ns)).items else True

    await eventually(quiet, "the afternoon's pods gone", within)
    report.step(
        "4 PM: a training pod asks for a whole GPU (MIG mode off); every GPU is cut into MIG, so the "
        "policy's migMode Dynamic switches an idle one off"
    )
    created = time.time()
    await api.pod("train-whole", "whole", {POOL_LABEL: "morning"})

    async def allocated() -> str | None:
        return allocated_device(await api.claim_of("train-whole"))

    device = await eventually(allocated, "the whole-GPU pod allocated", within)
    waited = (await _bound_waits(watch, {"train-whole": created}, within))[0]
    report.timed("whole-GPU pod created to bound (GPU switched off first)", waited)
    switched = [e for e in agent.history() if e.kind == "set-mig-mode"]

    async def reported() -> list[dict[str, Any]] | None:
        # the pod binds once the agent publishes the whole GPU; its status write may come a round later
        states = [(await api.partition(name)).get("status") or {} for name in gpus]
        whole = [st for name, st in zip(gpus, states, strict=True) if name.endswith(f"-{device}")]
        return states if whole and whole[0].get("migMode") == "Disabled" else None

    states = await eventually(reported, f"{device}'s status reporting MIG mode off", within)
    modes: list[tuple[str, ...]] = [
        (name, str(st.get("migMode", "?")), str(st.get("layoutSummary", "-")))
        for name, st in zip(gpus, states, strict=True)
    ]
    report.info(f"train-whole -> {device}; NVML asked to switch MIG mode {len(switched)} time(s)")
    report.table(("GPU", "MIG MODE", "LAYOUT"), modes)
    if agent.node is not None:
        await _show_containers(
            api, report, ["train-whole"], created, within, "whole-GPU pod created to container started"
        )
    await api.delete_pods(["train-whole"])


async def _finish_evictions(api: ScenarioApi, pods: list[str]) -> None:
    """What a kubelet does for an evicted pod once its containers exit: finish its deletion. Runs until
    cancelled."""
    while True:
        for name in pods:
            with contextlib.suppress(ApiException):
                pod = await api.core.read_namespaced_pod(name, api.ns)
                if pod.metadata.deletion_timestamp is not None:
                    await api.core.delete_namespaced_pod(name, api.ns, grace_period_seconds=0)
        await asyncio.sleep(0.5)


def _summary(report: Reporter, agent: _NodeAgent, watch: AllocationWatch, history_start: int) -> bool:
    """Prints what NVML did and the story's timings; False when an allocated instance was destroyed."""
    history = agent.history()[history_start:]
    created = sum(1 for ev in history if ev.kind == "create-gi")
    destroyed = sum(1 for ev in history if ev.kind == "destroy-gi")
    bad = watch.destroyed_while_allocated(history)
    report.step("Summary")
    report.info(
        f"MIG instances created {created}, destroyed {destroyed} (all of them free at the time)"
        if not bad
        else f"ALLOCATED INSTANCES DESTROYED: {bad}"
    )
    report.table(("STEP", "SECONDS"), [(label, f"{s:.1f}") for label, s in report.timings])
    return not bad
