"""``dynamig simulate``: replay workload traces against whole GPUs, static MIG, first-fit slicing and dynamig.

Examples::

    dynamig simulate --out sim-out                                   # the four synthetic traces
    dynamig simulate --alibaba path/to/alibaba-gpu-v2023 --out sim-out --no-synthetic
    dynamig simulate --alibaba-sample --seeds 2 --no-synthetic       # the small sample the package carries
    dynamig simulate --pod-list pods.csv --node-list nodes.csv --no-synthetic --loads 0.6,1.0,1.5
    dynamig simulate --mixed A100-40GB=1,H100-80GB=1,H200-141GB=1 --out sim-mixed   # a mixed-model cluster

Prints one table per trace (and one for the paper's protocol), writes ``results.json`` and PNG plots to
``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dynamig.cli import plain
from dynamig.cli.args import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    positive_share,
    share,
)
from dynamig.cli.errors import EXIT_USAGE, CommandError

Weights = tuple[tuple[str, float], ...]  # --mixed: (catalog key, weight), as trace.parse_model_weights gives

if TYPE_CHECKING:
    from dynamig.geometry.model import GpuModel
    from dynamig.simulate.alibaba import Models, Task
    from dynamig.simulate.runner import PaperRun, TraceReport
    from dynamig.simulate.trace import ClusterSpec, Trace


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from dynamig.simulate.preemption import PreemptSettings  # light: the defaults of its knobs

    preempt = PreemptSettings()
    p = sub.add_parser(
        "simulate",
        help="trace-driven comparison of dynamig with static MIG and first-fit",
        description=plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--traces",
        nargs="*",
        default=None,
        help="synthetic traces: built-in names or parameter files (default: all built-in)",
    )
    p.add_argument("--no-synthetic", action="store_true", help="skip the synthetic traces")
    p.add_argument(
        "--alibaba",
        type=Path,
        default=None,
        help="directory with openb_pod_list_default.csv and openb_node_list_gpu_node.csv",
    )
    p.add_argument("--alibaba-sample", action="store_true", help="use the trace sample shipped with dynamig")
    p.add_argument(
        "--pod-list", type=Path, default=None, help="an openb pod list (any variant), with --node-list"
    )
    p.add_argument("--node-list", type=Path, default=None, help="an openb node list, with --pod-list")
    p.add_argument(
        "--loads",
        default="",
        help="online replay at these loads, e.g. 0.6,0.8,1.0,1.2,1.5: arrivals compressed so that peak "
        "demand reaches about that fraction of the cluster's compute slices (default: as recorded); on the "
        "--replay-node-stride cluster when one is given, else on the full one",
    )
    p.add_argument(
        "--protocols",
        type=_protocols,
        default="both",
        help="Alibaba protocols: paper (sampled tasks, no departures), replay (online, as recorded) or both "
        "(default)",
    )
    p.add_argument(
        "--replay-node-stride",
        type=non_negative_int,
        default=0,
        help="also replay on every K-th node only (the full openb cluster never runs short of GPUs)",
    )
    p.add_argument(
        "--gpu-spec-share",
        type=share,
        default=0.0,
        help="Alibaba: restrict this share of the GPU tasks (seeded) to one GPU type of the node list, "
        "drawn in proportion to each type's GPUs (a GPU-type-limited variant; default 0: none)",
    )
    p.add_argument(
        "--whole-gpu-demand",
        action="store_true",
        help="Alibaba replay: multi-GPU tasks ask for whole GPUs (MIG mode off) on one node, and full-GPU "
        "tasks for a whole GPU first, the model's largest profile next (compare with --policies dynamig,"
        "dynamig-modes,whole-split-nodes,nvidia-toggle; docs/benchmarks.md)",
    )
    p.add_argument("--seeds", type=positive_int, default=10, help="seeds for the paper protocol (default 10)")
    p.add_argument("--model", default="A100-80GB", help="simulated GPU model for the Alibaba trace")
    p.add_argument(
        "--mixed",
        default="",
        help="a mixed-model cluster instead, e.g. A100-40GB=1,H100-80GB=1,H200-141GB=1: the nodes of the "
        "synthetic traces' clusters and of the Alibaba node list get these models, each model about its "
        "weighted share of the GPUs (nodes in order, deterministic), and each job lists every model's "
        "profile for its share, smallest memory first (overrides --model and the traces' own model)",
    )
    p.add_argument(
        "--fallbacks",
        type=non_negative_int,
        default=0,
        help="Alibaba: next-larger profiles a fractional task also accepts (default 0)",
    )
    p.add_argument(
        "--policies",
        default="whole-gpu,static,first-fit,nvidia-dynamic-mig,hami-reserve,dynamig,pool",
        help="comma-separated subset of whole-gpu, static, first-fit, nvidia-dynamic-mig, hami-reserve, "
        "hami-default (HAMi with its own scheduler's default node binpack instead of the run's node "
        "order), dynamig, dynamig-warm (dynamig with a warm pool sized from the trace's history; online "
        "replays only), pool",
    )
    p.add_argument(
        "--window-s", type=non_negative_float, default=None, help="dynamig batching window (default 2)"
    )
    p.add_argument(
        "--reshape-latency-s",
        type=non_negative_float,
        default=None,
        help="create latency: seconds per instance created (per reshaped GPU in a planning round), default 6",
    )
    p.add_argument(
        "--cooldown-s", type=non_negative_float, default=None, help="dynamig per-GPU cooldown (default 300)"
    )
    p.add_argument(
        "--bind-rtt-s",
        type=non_negative_float,
        default=None,
        help="seconds from a booking to the node starting the create, charged to every policy that "
        "creates (default 0)",
    )
    p.add_argument(
        "--prebind-poll-s",
        type=non_negative_float,
        default=None,
        help="kube-scheduler's PreBind re-check of binding conditions, waited by dynamig's cuts (default 5)",
    )
    p.add_argument(
        "--placements-per-profile",
        type=_placements_per_profile,
        default=0,
        help="dynamig's nodes publish, per GPU and profile, every free instance and only the best-ranked N "
        "placements to cut, as the agent's flag of that name: 0 every placement (default), auto the "
        "operator's choice for the simulated cluster's GPU nodes (every placement up to 64, one above)",
    )
    p.add_argument(
        "--node-orders",
        default="pack,spread",
        help="the scheduler's node orders, each applied to every policy in turn: pack (nodes in use first, "
        "then the smallest idle node) and spread (least busy first, kube-scheduler's default); the paper "
        "protocol runs under the first (default pack,spread)",
    )
    p.add_argument(
        "--create-latencies",
        default="",
        help="also run the load levels at these create latencies (policies that create instances only), "
        "e.g. 1.5,3: the sensitivity table",
    )
    p.add_argument("--warm-pool", default="", help="dynamig warm pool, e.g. 1g.10gb=4,2g.20gb=2")
    p.add_argument(
        "--warm-history-h",
        type=positive_float,
        default=6.0,
        help="dynamig-warm: hours of past arrivals the pool is sized from (default 6)",
    )
    p.add_argument(
        "--warm-quantile",
        type=positive_share,
        default=0.95,
        help="dynamig-warm: share of past claims a pool of that size would have served warm (default 0.95)",
    )
    p.add_argument(
        "--warm-resize-min",
        type=positive_float,
        default=5.0,
        help="dynamig-warm: minutes of virtual time between two re-sizings (default 5)",
    )
    p.add_argument(
        "--warm-refill-s",
        type=non_negative_float,
        default=None,
        help="dynamig-warm: seconds until a taken pool instance is replaced, the sliding window the pool is "
        "sized over (default: bind round trip + window + create latency)",
    )
    p.add_argument(
        "--warm-max-share",
        type=share,
        default=0.1,
        help="dynamig-warm: the pool holds at most this share of the cluster's compute slices (default 0.1)",
    )
    p.add_argument(
        "--preempt-gap",
        type=int,
        default=preempt.gap,
        help="dynamig-preempt: a victim's priority is at most the preemptor's minus this (default 1)",
    )
    p.add_argument(
        "--preempt-min-run-s",
        type=non_negative_float,
        default=preempt.min_run_s,
        help="dynamig-preempt: a job that has run less than this is not a victim (default 600)",
    )
    p.add_argument(
        "--preempt-rate-per-h",
        type=non_negative_float,
        default=preempt.rate_per_h,
        help="dynamig-preempt: evictions per hour over the cluster, a token bucket (default 60; 0: none)",
    )
    p.add_argument("--out", type=Path, default=Path("simulate-out"), help="output directory")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run)


PROTOCOLS = ("paper", "replay")


def _protocols(text: str) -> frozenset[str]:
    """``paper``, ``replay`` or ``both`` (a comma-separated list of them is taken too)."""
    names = {x.strip() for x in text.split(",") if x.strip()}
    if not names or names - {*PROTOCOLS, "both"}:
        raise argparse.ArgumentTypeError(f"expected paper, replay or both, got {text!r}")
    return frozenset(PROTOCOLS) if "both" in names else frozenset(names)


def _placements_per_profile(text: str) -> int | None:
    """``auto`` (None) or a whole number >= 0, as the agent's flag takes it, or argparse's usage error."""
    from dynamig.planner.offerlimit import parse_limit  # light: pure

    try:
        return parse_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _loads(text: str) -> list[float]:
    out = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--loads: expected numbers like 0.6,1.0,1.5, got {part!r}") from None
        if value <= 0:
            raise ValueError(f"--loads: a load must be positive, got {part!r}")
        out.append(value)
    return out


def _warm_pool(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        name, _, n = part.partition("=")
        if not n.isdigit():
            raise ValueError(f"--warm-pool: expected PROFILE=COUNT, got {part!r}")
        out[name] = int(n)
    return out


def _text(exc: BaseException) -> str:
    """An exception's message (a KeyError's without the quotes ``str()`` adds)."""
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


@dataclass(frozen=True)
class AlibabaInput:
    """The Alibaba tasks and cluster a run replays, read once before any simulation starts."""

    tasks: list[Task]
    spec: ClusterSpec  # the node list's cluster, models assigned when --mixed
    single_spec: ClusterSpec  # the same with the one --model (every_kth_node works on it)
    label: str
    source: str
    sim: Models  # the model, or a mixed cluster's models, that jobs are mapped to


def _alibaba_input(
    args: argparse.Namespace, mixed: Weights | None, mixed_models: tuple[GpuModel, ...]
) -> AlibabaInput | None:
    """The trace of --alibaba, --alibaba-sample or --pod-list/--node-list (None without one); CommandError
    naming the flag for an unknown --model or a file that cannot be read. Side effect: reads the files."""
    from dynamig.geometry.catalog import load_catalog
    from dynamig.simulate import alibaba
    from dynamig.simulate.trace import assign_models

    if (args.pod_list is None) != (args.node_list is None):
        raise CommandError("--pod-list and --node-list go together: give both", EXIT_USAGE)
    if args.alibaba is None and not args.alibaba_sample and args.pod_list is None:
        return None
    try:
        model = load_catalog().model(args.model)
    except KeyError as exc:
        raise CommandError(f"--model: {_text(exc)}", EXIT_USAGE) from None
    try:
        if args.pod_list is not None and args.node_list is not None:
            flag = "--pod-list/--node-list"
            tasks, spec = alibaba.load_files(args.pod_list, args.node_list, model)
            label = args.pod_list.stem.removesuffix(".csv").replace("_pod_list", "")
            source = str(args.pod_list)
        elif args.alibaba_sample:
            flag = "--alibaba-sample"
            tasks, spec = alibaba.load_sample(model)
            label = "alibaba-openb-sample"
            source = alibaba.SAMPLE_POD_FILE
        else:
            assert args.alibaba is not None
            flag = "--alibaba"
            tasks, spec = alibaba.load(args.alibaba, model)
            label = "alibaba-openb"
            source = str(args.alibaba / alibaba.POD_FILE)
    except alibaba.TraceFormatError as exc:
        raise CommandError(f"{flag}: {exc}", EXIT_USAGE) from None
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()
        raise CommandError(f"{flag}: cannot read {exc.filename}: {why}", EXIT_USAGE) from None
    if args.gpu_spec_share > 0:
        tasks = alibaba.with_gpu_spec(tasks, spec, args.gpu_spec_share)
        label += f"-gpuspec{round(100 * args.gpu_spec_share)}"
    # the model (or models) jobs are mapped to: one model, or a mixed cluster's models; models are assigned
    # on each simulated cluster (the full one, the --replay-node-stride one), so that each gets the weighted
    # share of its own GPUs
    if mixed:
        return AlibabaInput(tasks, assign_models(spec, mixed), spec, label, source, mixed_models)
    return AlibabaInput(tasks, spec, spec, label, source, model)


def _strided(single: ClusterSpec, stride: int, mixed: Weights | None) -> ClusterSpec:
    """Every ``stride``-th node of ``single``, its models assigned when ``mixed``. Pure."""
    from dynamig.simulate import alibaba
    from dynamig.simulate.trace import assign_models

    small = alibaba.every_kth_node(single, stride)
    return assign_models(small, mixed) if mixed else small


def _check_alibaba_flags(
    args: argparse.Namespace,
    trace_input: AlibabaInput | None,
    protocols: frozenset[str],
    loads: list[float],
    sweep_latencies: list[float],
) -> None:
    """CommandError for a run that would do nothing, or flags that would be ignored. Pure."""
    if trace_input is None and args.no_synthetic:
        raise CommandError(
            "nothing to simulate: --no-synthetic without --alibaba DIR, --alibaba-sample or "
            "--pod-list/--node-list",
            EXIT_USAGE,
        )
    replay_only = {
        "--loads": bool(loads),
        "--replay-node-stride": args.replay_node_stride > 1,
    }
    trace_only = {"--gpu-spec-share": args.gpu_spec_share > 0, "--fallbacks": args.fallbacks > 0}
    if trace_input is None:
        given = [flag for flag, on in {**replay_only, **trace_only}.items() if on]
        if given:
            raise CommandError(
                f"{given[0]} applies to the Alibaba trace: add --alibaba DIR, --alibaba-sample or "
                "--pod-list FILE --node-list FILE",
                EXIT_USAGE,
            )
    elif "replay" not in protocols:
        given = [flag for flag, on in replay_only.items() if on]
        if given:
            raise CommandError(
                f"{given[0]} applies to the online replay, which --protocols paper leaves out: use "
                "--protocols replay or both",
                EXIT_USAGE,
            )
    if sweep_latencies and not loads:
        raise CommandError(
            "--create-latencies reruns the load levels: give --loads too (e.g. --loads 0.6,1.0,1.5)",
            EXIT_USAGE,
        )


def _check_loads(loads: list[float], trace_input: AlibabaInput, stride: int, mixed: Weights | None) -> None:
    """CommandError for a load level the replay cannot reach on its cluster (the --replay-node-stride one
    when given), naming the nearest stride that reaches it (alibaba.max_load). Reads the catalog."""
    from dynamig.simulate import alibaba
    from dynamig.simulate.runner import total_compute_slices

    if not loads:
        return
    demand = alibaba.all_at_once_slices(trace_input.tasks, trace_input.sim)
    single = trace_input.single_spec

    def top(cluster: ClusterSpec) -> float:
        return demand / alibaba.LOAD_HEADROOM / max(1, total_compute_slices(cluster))

    cluster = _strided(single, stride, mixed) if stride > 1 else trace_input.spec
    reachable = top(cluster)
    load = max(loads)
    if load <= reachable:
        return
    where = f"the {cluster.gpu_count:,} GPUs of {trace_input.label}"
    if stride > 1:
        where += f" (--replay-node-stride {stride})"
    why = (
        f"--loads {load:g}: {where} reach at most load {reachable:.2f}, half of what all "
        f"{len(trace_input.tasks):,} tasks ask for at once (closer to that, the whole trace arrives in one "
        "burst)"
    )
    for k in range(max(2, stride + 1), len(single.nodes) + 1):
        smaller = _strided(single, k, mixed)
        if load <= top(smaller):
            raise CommandError(
                f"{why}; use --replay-node-stride {k} ({smaller.gpu_count:,} GPUs, loads up to "
                f"{top(smaller):.2f}) or a lower --loads",
                EXIT_USAGE,
            )
    raise CommandError(f"{why}; no --replay-node-stride reaches it: use a lower --loads", EXIT_USAGE)


def _synthetic_trace(name: str, mixed: Weights | None) -> Trace:
    """The --traces entry ``name``: a parameter file, else a built-in trace; CommandError naming --traces
    when it is neither. Side effect: reads the file."""
    from dynamig.simulate import synthetic

    path = Path(name)
    try:
        if path.suffix in (".yaml", ".yml") or path.exists():
            if not path.is_file():
                raise synthetic.TraceSpecError(
                    f"{name}: no such file" if not path.exists() else f"{name}: not a file"
                )
            try:
                return synthetic.load_trace_file(path, mixed)
            except OSError as exc:
                raise synthetic.TraceSpecError(f"{name}: {(exc.strerror or str(exc)).lower()}") from None
        return synthetic.load_builtin_trace(name, mixed)
    except synthetic.TraceSpecError as exc:
        raise CommandError(f"--traces: {exc}", EXIT_USAGE) from None


def _make_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()
        raise CommandError(f"--out {out}: cannot create the directory: {why}", EXIT_USAGE) from None


def run(args: argparse.Namespace) -> int:
    """Run the requested simulations. Side effects: prints tables, writes files under ``--out``."""
    from dataclasses import replace

    from dynamig.geometry.catalog import load_catalog
    from dynamig.simulate import alibaba, report, synthetic
    from dynamig.simulate.booking import NODE_ORDERS
    from dynamig.simulate.engine import SimConfig
    from dynamig.simulate.preemption import PreemptSettings
    from dynamig.simulate.runner import (
        CREATING,
        POLICIES,
        DynamigSettings,
        run_paper_protocol,
        run_trace,
        total_compute_slices,
    )
    from dynamig.simulate.trace import (
        compute_slices_by_name,
        describe_cluster,
        order_models,
        parse_model_weights,
        share_mapping_table,
    )

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    cfg = SimConfig()
    if args.window_s is not None:
        cfg = replace(cfg, window_s=args.window_s)
    if args.reshape_latency_s is not None:
        cfg = replace(cfg, reshape_latency_s=args.reshape_latency_s)
    if args.cooldown_s is not None:
        cfg = replace(cfg, cooldown_s=args.cooldown_s)
    if args.bind_rtt_s is not None:
        cfg = replace(cfg, bind_rtt_s=args.bind_rtt_s)
    if args.prebind_poll_s is not None:
        cfg = replace(cfg, prebind_poll_s=args.prebind_poll_s)
    try:
        dyn = DynamigSettings(
            warm_pool=_warm_pool(args.warm_pool),
            warm_history_s=args.warm_history_h * 3600.0,
            warm_quantile=args.warm_quantile,
            warm_resize_s=args.warm_resize_min * 60.0,
            warm_max_share=args.warm_max_share,
            warm_refill_s=args.warm_refill_s,
            preempt=PreemptSettings(
                gap=args.preempt_gap, min_run_s=args.preempt_min_run_s, rate_per_h=args.preempt_rate_per_h
            ),
            placements_per_profile=args.placements_per_profile,
        )
        loads = _loads(args.loads)
        sweep_latencies = _loads(args.create_latencies)
        orders = [x.strip() for x in args.node_orders.split(",") if x.strip()]
        bad = [o for o in orders if o not in NODE_ORDERS[:2]]
        if bad or not orders:
            raise ValueError(f"--node-orders: choose from pack, spread, not {', '.join(bad) or '(none)'}")
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    try:
        mixed = parse_model_weights(args.mixed) if args.mixed else None
        mixed_models = order_models(load_catalog().model(k) for k, _ in mixed) if mixed else ()
    except (ValueError, KeyError) as exc:
        raise CommandError(f"--mixed {args.mixed}: {_text(exc)}", EXIT_USAGE) from None
    policies = tuple(x.strip() for x in args.policies.split(",") if x.strip())
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        raise CommandError(
            f"--policies: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(POLICIES)}",
            EXIT_USAGE,
        )
    protocols: frozenset[str] = args.protocols
    trace_input = _alibaba_input(args, mixed, mixed_models)
    _check_alibaba_flags(args, trace_input, protocols, loads, sweep_latencies)
    if trace_input is not None and "replay" in protocols:
        _check_loads(loads, trace_input, args.replay_node_stride, mixed)
    _make_out_dir(args.out)

    reports: list[TraceReport] = []
    sweep: list[TraceReport] = []  # the load levels again at the other create latencies (creating policies)
    paper: list[PaperRun] = []
    timings: dict[str, float] = {}
    wall0 = time.perf_counter()
    try:
        for order in orders:
            ocfg = replace(cfg, node_order=order)
            first_order = order == orders[0]
            if not args.no_synthetic:
                names = args.traces if args.traces else list(synthetic.builtin_trace_names())
                for name in names:
                    trace = _synthetic_trace(name, mixed)
                    t0 = time.perf_counter()
                    reports.append(run_trace(trace, ocfg, dyn, policies, progress=say))
                    timings[f"{trace.name} [{order}]"] = time.perf_counter() - t0
            if trace_input is not None:
                tasks, spec, single_spec = trace_input.tasks, trace_input.spec, trace_input.single_spec
                label, source, sim = trace_input.label, trace_input.source, trace_input.sim
                say(
                    f"{label}: {len(tasks)} GPU tasks, {spec.gpu_count} GPUs on {len(spec.nodes)} nodes "
                    f"({describe_cluster(spec)})"
                )
                if "replay" in protocols:
                    clusters = [(spec, f"{label}-replay")]
                    if args.replay_node_stride > 1:
                        small = _strided(single_spec, args.replay_node_stride, mixed)
                        clusters.append((small, f"{label}-replay-{small.gpu_count}gpus"))
                        if mixed:
                            say(f"{label}-replay-{small.gpu_count}gpus: {describe_cluster(small)}")
                    for cluster, name in clusters:
                        trace = alibaba.replay_trace(
                            tasks, cluster, sim, fallbacks=args.fallbacks, name=name, source=source,
                            whole_gpu_demand=args.whole_gpu_demand,
                        )  # fmt: skip
                        t0 = time.perf_counter()
                        reports.append(run_trace(trace, ocfg, dyn, policies, progress=say))
                        timings[f"{trace.name} [{order}]"] = time.perf_counter() - t0
                    if loads:
                        # the full openb cluster cannot reach much more than its own size in demand (all tasks
                        # at once), so load levels run on the smaller cluster when one is asked for
                        cluster, name = clusters[-1]
                        for load in loads:
                            capacity = total_compute_slices(cluster)
                            compress = alibaba.compression_for_load(tasks, sim, capacity, load, source)
                            trace = alibaba.replay_trace(
                                tasks,
                                cluster,
                                sim,
                                fallbacks=args.fallbacks,
                                name=f"{name}-load{load:g}",
                                compress=compress,
                                source=source,
                                until_last_arrival=True,
                                whole_gpu_demand=args.whole_gpu_demand,
                            )
                            slices = compute_slices_by_name(alibaba.as_models(sim))
                            reached = alibaba.peak_demand(trace.jobs, slices) / capacity
                            say(
                                f"{trace.name}: arrivals compressed {compress:.3g}x, "
                                f"peak demand {reached:.2f}"
                            )
                            t0 = time.perf_counter()
                            rep = run_trace(trace, ocfg, dyn, policies, progress=say, load=load)
                            rep.reached_load = reached
                            reports.append(rep)
                            timings[f"{trace.name} [{order}]"] = time.perf_counter() - t0
                            creating = [p for p in policies if p in CREATING]
                            for latency in sweep_latencies:
                                if latency == cfg.reshape_latency_s or not creating:
                                    continue
                                t0 = time.perf_counter()
                                lcfg = replace(ocfg, reshape_latency_s=latency)
                                srep = run_trace(trace, lcfg, dyn, creating, progress=say, load=load)
                                srep.reached_load = reached
                                sweep.append(srep)
                                key = f"{trace.name} [{order}, create {latency:g}s]"
                                timings[key] = time.perf_counter() - t0
                if "paper" in protocols and first_order:
                    t0 = time.perf_counter()
                    for seed in range(args.seeds):
                        say(f"{label}: paper protocol, seed {seed}")
                        jobs = alibaba.sampled_tasks(tasks, sim, spec.gpu_count, 1.3, seed, args.fallbacks)
                        paper.extend(run_paper_protocol(jobs, spec, seed, ocfg, dyn, policies))
                    timings[f"{label}-paper ({args.seeds} seeds)"] = time.perf_counter() - t0
                for m in alibaba.as_models(sim) if first_order else ():
                    mapping = share_mapping_table(m)
                    print(
                        f"\nAlibaba share -> {m.key} profile: "
                        + ", ".join(f"({lo:.3f}, {hi:.3f}] -> {name}" for name, lo, hi in mapping)
                    )
                if first_order:
                    print(
                        "tasks per profile: "
                        + ", ".join(
                            f"{k}: {v}" for k, v in sorted(alibaba.mapping_counts(tasks, sim).items())
                        )
                    )
    except (synthetic.TraceSpecError, alibaba.TraceFormatError, KeyError) as exc:
        raise CommandError(_text(exc), EXIT_USAGE) from None

    for rep in reports:
        first = rep.results[0] if rep.results else None
        print(
            f"\n== {report.heading(rep)}: {len(rep.trace.jobs)} jobs, {rep.trace.cluster.gpu_count} GPUs"
            + (f" ({describe_cluster(rep.trace.cluster)})" if mixed else "")
            + ", "
            f"{rep.trace.horizon / 3600:.1f} h, offered {first.offered_slice_h:,.0f} slice-h"
            if first
            else ""
        )
        print(report.text_table(report.TRACE_HEADER, report.trace_rows(rep)))
        for line in report.goals(rep):
            print(f"  {line}")
        print(f"  best-fit static layout: {report.static_summary(rep)}")
        print("  served by job size (of what jobs of that size asked for):")
        print("  " + report.text_table(*report.size_rows(rep)).replace("\n", "\n  "))
        print("  wait per first-choice profile (single-device jobs, p50 / p95):")
        print("  " + report.text_table(*report.profile_wait_rows(rep)).replace("\n", "\n  "))
        if (by_class := report.priority_rows(rep)) is not None:
            print("  per priority class (preemption):")
            print("  " + report.text_table(*by_class).replace("\n", "\n  "))
    if any(rep.load is not None for rep in reports):
        print("\n== served share of offered demand by load")
        print(report.text_table(*report.load_rows(reports)))
    if sweep:
        print("\n== create latency sweep (load levels, policies that create instances)")
        print(report.text_table(*report.sensitivity_rows([*reports, *sweep])))
    if paper:
        print(
            f"\n== Alibaba openb, paper protocol ({args.seeds} seeds): "
            "allocation rate = requested GPU share of "
            "allocated tasks / GPUs"
        )
        print(report.text_table(report.PAPER_HEADER, report.paper_rows(paper)))
    total = time.perf_counter() - wall0
    print("\nrun times: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()) + f"; total {total:.1f}s")

    meta = {
        "config": {
            "window_s": cfg.window_s,
            "reshape_latency_s": cfg.reshape_latency_s,
            "cooldown_s": cfg.cooldown_s,
            "bind_rtt_s": cfg.bind_rtt_s,
            "prebind_poll_s": cfg.prebind_poll_s,
            "placements_per_profile": "auto"
            if args.placements_per_profile is None
            else args.placements_per_profile,
            "node_orders": orders,
            "create_latencies_swept": sweep_latencies,
            "warm_pool": dict(dyn.warm_pool),
            "history_warm_pool": {
                "history_s": dyn.warm_history_s,
                "quantile": dyn.warm_quantile,
                "resize_s": dyn.warm_resize_s,
                "max_share": dyn.warm_max_share,
                "refill_s": dyn.sizing(cfg).refill_s,
            },
            "loads": loads,
            "seeds": args.seeds,
            "model": args.model,
            "mixed": dict(mixed) if mixed else None,
        },
        "timings_s": timings,
        "total_s": total,
    }
    report.write_json(args.out / "results.json", reports, paper, meta, sweep)
    (args.out / "tables.md").write_text(_markdown(reports, paper, sweep))
    if not args.no_plots:  # plots: the first node order's runs
        shown = [rep for rep in reports if rep.node_order == orders[0]]
        for path in report.write_plots(args.out, shown, paper):
            say(f"wrote {path}")
    return 0


def _markdown(reports: list[TraceReport], paper: list[PaperRun], sweep: list[TraceReport]) -> str:
    from dynamig.simulate import report

    parts = []
    for rep in reports:
        parts.append(
            f"### {report.heading(rep)}\n\n"
            + report.markdown_table(report.TRACE_HEADER, report.trace_rows(rep))
        )
        lines = [*report.goals(rep), f"best-fit static layout: {report.static_summary(rep)}"]
        parts.append("\n".join(f"- {g}" for g in lines))
        parts.append("Served by job size:\n\n" + report.markdown_table(*report.size_rows(rep)))
        parts.append(
            "Wait per first-choice profile (single-device jobs, p50 / p95):\n\n"
            + report.markdown_table(*report.profile_wait_rows(rep))
        )
        if (by_class := report.priority_rows(rep)) is not None:
            parts.append("Per priority class (preemption):\n\n" + report.markdown_table(*by_class))
    if any(rep.load is not None for rep in reports):
        parts.append(
            "### Served share of offered demand by load\n\n"
            + report.markdown_table(*report.load_rows(reports))
        )
    if sweep:
        parts.append(
            "### Create latency sweep\n\n"
            + report.markdown_table(*report.sensitivity_rows([*reports, *sweep]))
        )
    runs = paper
    if runs:
        parts.append(
            "### Alibaba openb, paper protocol\n\n"
            + report.markdown_table(report.PAPER_HEADER, report.paper_rows(runs))
        )
    return "\n\n".join(parts) + "\n"
