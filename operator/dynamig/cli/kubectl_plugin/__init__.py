"""``kubectl dynamig``: look at a live cluster the way the operator sees it; nothing here writes to it.

kubectl runs any executable named ``kubectl-dynamig`` on ``PATH`` as ``kubectl dynamig``; the package installs
one. Connection flags follow kubectl (and Krew's conventions): ``--kubeconfig``, ``--context``, ``-n``/``-A``,
before or after the sub-command. Exit status: 0 done, 1 a GPU is off its spec (``verify``) or an error, 2 a
usage error.

Modules: ``report`` (pure: what ``plan``, ``verify`` and ``export`` print, from API dicts), ``gather`` (the
``must-gather`` archive), ``live`` (the API reads and the commands' bodies).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from dynamig.cli import add_output_argument
from dynamig.cli.args import Parser, positive_int

PROG = "kubectl dynamig"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# -o/--output is dynamig's own (dynamig.cli.add_output_argument): the same formats as every dynamig command
# that prints a table. A command refuses a format that makes no sense for it (one line, before it connects):
# export prints manifests, never a table; must-gather's -o names the archive it writes and refuses a format
# name.

DESCRIPTION = (
    "Inspect dynamig in a live cluster: what the operator would do for the pending claims, which GPUs are "
    "off their spec, the current layouts as a policy baseline or a planning scenario, and one archive for "
    "a bug report. Read-only."
)


def _add_connection_arguments(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """kubectl's connection flags. On sub-commands they default to SUPPRESS, so a flag given before the
    sub-command is not reset by the sub-parser."""

    def default(value: object) -> object:
        return value if top else argparse.SUPPRESS

    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=default(None),
        help="kubeconfig path (default: every path in $KUBECONFIG, else ~/.kube/config)",
    )
    parser.add_argument("--context", default=default(None), help="kubeconfig context (default: current)")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        default=default(None),
        help="only claims and Events of this namespace (default: all namespaces)",
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        dest="namespace",
        action="store_const",
        const=None,
        default=default(None),
        help="claims and Events of every namespace (the default)",
    )


def build_parser() -> argparse.ArgumentParser:
    from dynamig import __version__

    parser = Parser(prog=PROG, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"kubectl-dynamig {__version__}")
    _add_connection_arguments(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=description)
        _add_connection_arguments(p, top=False)
        return p

    plan = command(
        "plan",
        "what the operator would do now for the pending claims (nothing is written)",
        "Reads the cluster and runs the operator's own round for each GpuPartitionPolicy: each pending "
        "claim's verdict, the GPUs it would re-cut (with the free instances that would go) or the profiles "
        "it would offer, and whether each change would be written now or held, and why. A return to the "
        "baseline is shown as a freshly started operator sees it (idle time counted from now).",
    )
    add_output_argument(plan)
    plan.add_argument("--policy", default=None, help="only this GpuPartitionPolicy")
    plan.add_argument(
        "--agent-namespace",
        default=None,
        help="namespace of the agents' heartbeat Leases (default: where the chart's agent pods run; "
        "none found: no agent counts as silent)",
    )

    verify = command(
        "verify",
        "exit 1 when any GPU is not at its spec, with the reason",
        "Compares each GpuPartition's spec.layout with the instances its agent reports, the generation the "
        "agent has seen and its Ready condition. Exit status 1 when any GPU is off its spec.",
    )
    add_output_argument(verify)

    export = command(
        "export",
        "current layouts as a policy baseline or a `dynamig plan` scenario",
        "Prints YAML: --as policy-baseline gives a GpuPartitionPolicy (mode DryRun) whose baseline is the "
        "most common current layout of each GPU model; --as scenario gives the GPUs, their instances (busy "
        "or not), the pending claims and the policy, as `dynamig plan -f` reads them.",
    )
    export.add_argument("--as", dest="shape", required=True, choices=("policy-baseline", "scenario"))
    export.add_argument(
        "--policy", default=None, help="only GPUs (and claims) of this policy; a scenario takes its settings"
    )
    export.add_argument("--name", default="dynamig-baseline", help="name of the exported policy")
    add_output_argument(
        export,
        default="yaml",
        help_text="yaml (the default) or json; a table is refused: the output is a manifest",
        wide_hint="export prints a manifest, not a table; use -o yaml (the default) or json",
    )

    gather = command(
        "must-gather",
        "CRs, slices, claims, Events, agent/operator logs and metrics in one archive",
        "Writes a .tar.gz with what support needs (docs/operations.md lists it): the server version, the "
        "GpuPartitionPolicies, GpuPartitions, the driver's ResourceSlices, ResourceClaims (dynamig's with "
        "the pods using them), Events, DeviceClasses, the Nodes dynamig labels, the agents' heartbeat "
        "Leases, dynamig's admission policies and bindings, the Helm release's values, and the logs and "
        "/metrics of the agent and operator pods (found by the chart's labels in every namespace). An item "
        "that could not be gathered is listed in summary.txt inside the archive and is not an error; an "
        "API server that cannot be reached is, and no archive is written.",
    )
    gather.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="archive path (default: dynamig-must-gather-TIME.tar.gz); a report format name (table, "
        "wide, json, yaml) is refused",
    )
    gather.add_argument(
        "--selector",
        default="app.kubernetes.io/name=dynamig,app.kubernetes.io/component in (agent,operator)",
        help="label selector of the agent and operator pods (default: the chart's labels)",
    )
    gather.add_argument(
        "--log-lines", type=positive_int, default=10000, help="last lines of each container's log"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kubectl-dynamig``. Heavy imports wait until a command runs, so help is quick."""
    args = build_parser().parse_args(argv)
    from dynamig.cli.kubectl_plugin.live import run

    try:
        return run(args)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
