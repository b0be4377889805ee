"""``dynamig demo``: the embedded default — a local control plane, simulated GPUs, the morning-burst story."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from pathlib import Path

from dynamig.cli.args import non_negative_int, positive_int


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo", help="run the morning-burst story on a local control plane with simulated GPUs"
    )
    p.add_argument(
        "--inference-pods", type=positive_int, default=7, help="size of the burst of inference pods"
    )
    p.add_argument(
        "--cooldown",
        type=non_negative_int,
        default=10,
        help="policy cooldown before idle GPUs return to baseline",
    )
    p.add_argument("--skip-baseline", action="store_true", help="stop after the training pod")
    p.add_argument(
        "--real-node",
        action="store_true",
        help="run the pods on a real node (kubelet + containerd built from their modules; needs root) and "
        "print what each container saw of its MIG slice",
    )
    p.add_argument(
        "--log-file",
        type=Path,
        default=None,
        help="where the operator's and agent's logs go (default: a temporary file)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynamig.demo.story import DemoOptions, run_demo

    log_file: Path = args.log_file or Path(tempfile.mkstemp(prefix="dynamig-demo-", suffix=".log")[1])
    logging.basicConfig(
        filename=log_file,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    print(f"dynamig demo (component logs: {log_file})", flush=True)
    options = DemoOptions(
        inference_pods=args.inference_pods,
        cooldown_s=args.cooldown,
        return_to_baseline=not args.skip_baseline,
        log_file=log_file,
        real_node=args.real_node,
    )
    try:
        return asyncio.run(run_demo(options, lambda line: print(line, flush=True)))
    except KeyboardInterrupt:
        print("\ninterrupted; everything stopped", file=sys.stderr)
        return 130
    except (TimeoutError, RuntimeError) as exc:
        print(f"\ndemo failed: {exc}\n(see {log_file})", file=sys.stderr)
        return 1
