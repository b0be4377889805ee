"""The ``dynamig`` command line as a person meets it: --version, help without reST markup, checked log
levels, model keys in any case, a closed pipe that is not a crash, one line (no traceback) for a failure a
person can fix, one ``-o`` for every report, and an uninstall that says what it would do and asks first.
Runs the installed entry point; API servers are local fakes or closed ports."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pty
import re
import socket
import subprocess
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from dynamig import __version__
from dynamig.cli import build_parser, plain, render
from dynamig.cli.errors import CommandError, describe, exit_code
from dynamig.cli.uninstall import confirmation
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, POLICY_PLURAL, VERSION

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "scenarios"


def dynamig(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamig", *args], capture_output=True, text=True, timeout=60
    )


def test_version_and_plain_help() -> None:
    assert dynamig("--version").stdout.strip() == f"dynamig {__version__}"
    for command in ("--help", "plan --help", "simulate --help", "doctor --help", "agent --help"):
        out = dynamig(*command.split()).stdout
        assert out and "``" not in out and ":func:" not in out, command
    assert plain("``dynamig plan`` calls :func:`plan_round`") == "dynamig plan calls plan_round"


def test_log_levels_are_checked_and_model_keys_take_any_case() -> None:
    bad = dynamig("agent", "--node", "n1", "--log-level", "loud")
    assert bad.returncode == 2 and "invalid choice: 'LOUD'" in bad.stderr
    assert dynamig("geometry", "profiles", "--model", "h100-80gb").stdout.startswith("H100-80GB:")


def test_lease_seconds_outside_what_admission_and_the_operator_accept_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dynamig.kube.heartbeat import MAX_LEASE_SECONDS

    parse = build_parser().parse_args
    top = int(MAX_LEASE_SECONDS)
    assert parse(["agent", f"--lease-seconds={top}"]).lease_seconds == top
    assert parse(["agent", "--lease-seconds=1"]).lease_seconds == 1
    for bad in (str(top + 1), "0", "-5", "30s", "2000000000"):
        with pytest.raises(SystemExit) as exited:
            parse(["agent", f"--lease-seconds={bad}"])
        assert exited.value.code == 2, bad
        err = capsys.readouterr().err
        assert f"argument --lease-seconds: {bad!r} is not a whole number of seconds from 1 to {top}" in err


@pytest.mark.parametrize("command", ["agent", "operator"])
def test_metrics_tls_flags_come_in_pairs_and_tokens_never_travel_in_the_clear(command: str) -> None:
    from dynamig.cli._metrics import metrics_tls_files

    parse = build_parser().parse_args
    pair = ["--metrics-tls-cert-file=/tls/tls.crt", "--metrics-tls-key-file=/tls/tls.key"]
    assert metrics_tls_files(parse([command, *pair, "--metrics-authorize"])) == (
        Path("/tls/tls.crt"),
        Path("/tls/tls.key"),
    )
    assert metrics_tls_files(parse([command])) is None
    with pytest.raises(CommandError, match="go together") as half:
        metrics_tls_files(parse([command, pair[0]]))
    assert half.value.exit_code == 2
    with pytest.raises(CommandError, match="must not travel in the clear"):
        metrics_tls_files(parse([command, "--metrics-authorize"]))


def test_a_closed_pipe_ends_quietly() -> None:
    proc = subprocess.run(
        f"{sys.executable} -m dynamig geometry profiles --model A100-80GB | head -1",
        shell=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.stdout.startswith("A100-80GB:") and "Traceback" not in proc.stderr


def test_log_lines_carry_utc_time_and_the_object_they_are_about() -> None:
    import json
    import logging

    from dynamig.cli._logging import JsonFormatter, TextFormatter

    ref = {"apiVersion": "dynamig.io/v1alpha1", "kind": "GpuPartitionPolicy", "name": "morning", "uid": "u-1"}
    record = logging.makeLogRecord(
        {"name": "kopf.objects", "levelname": "WARNING", "msg": "Handler %s failed", "args": ("policy_loop",),
         "created": 1_800_000_000.25, "k8s_ref": {**ref, "namespace": None}}
    )  # fmt: skip
    entry = json.loads(JsonFormatter().format(record))
    assert entry["time"] == "2027-01-15T08:00:00.250Z"
    assert entry["object"] == {"kind": "GpuPartitionPolicy", "name": "morning", "uid": "u-1"}
    assert entry["msg"] == "Handler policy_loop failed"
    text = TextFormatter().format(record)
    assert text.startswith(
        "2027-01-15T08:00:00.250Z WARNING kopf.objects: [GpuPartitionPolicy/morning] Handler"
    )


def test_a_dev_only_command_without_its_extra_says_which_extra_to_install() -> None:
    """As in the runtime image, where cryptography (the local control plane's PKI) is not installed."""
    code = (
        "import sys; sys.modules['cryptography'] = None\n"  # makes `import cryptography` fail as if absent
        "from dynamig.cli import main\n"
        "sys.exit(main(['dev-cluster', 'status']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "pip install 'dynamig[devcluster]'" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------- failures a person can fix

VERSION_INFO = {
    "major": "1", "minor": "36", "gitVersion": "v1.36.0", "gitCommit": "0", "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25", "compiler": "gc", "platform": "linux/amd64",
}  # fmt: skip


class FakeApiServer:
    """An API server on a local port, over plain HTTP: a GET of a path in ``routes`` is answered 200 with
    its body, any other GET with ``otherwise`` (a Status naming the path), any write with ``writes``. Every
    request is recorded as (method, path)."""

    def __init__(self, routes: dict[str, Any] | None = None, otherwise: int = 404, writes: int = 405) -> None:
        self.seen: list[tuple[str, str]] = []
        fake, table = self, dict(routes or {})

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def answer(self) -> None:
                path = urlsplit(self.path).path.rstrip("/")  # the client asks for /version/
                fake.seen.append((self.command, path))
                code = writes if self.command != "GET" else 200 if path in table else otherwise
                body = table[path] if code == 200 else {
                    "kind": "Status", "status": "Failure", "code": code, "reason": HTTPStatus(code).phrase,
                    "message": f'{path} is {HTTPStatus(code).phrase.lower()}: User "tester" may not',
                }  # fmt: skip
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_DELETE = do_POST = do_PUT = answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def writes(self) -> list[tuple[str, str]]:
        return [(method, path) for method, path in self.seen if method != "GET"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_api() -> Any:
    servers: list[FakeApiServer] = []

    def start(routes: dict[str, Any] | None = None, otherwise: int = 404, writes: int = 405) -> FakeApiServer:
        servers.append(FakeApiServer(routes, otherwise, writes))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1", "kind": "Config", "current-context": "test",
                "clusters": [{"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
                "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
                "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )  # fmt: skip
    return path


def closed_port() -> int:
    """A local port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Each command with what it needs to get as far as the cluster. --wait-for-api 0 gives up at the first
# refused connection: the operator and the agent wait a minute for the API server by default.
CLUSTER_COMMANDS = {
    "operator": ["operator", "--standalone", "--wait-for-api", "0"],
    "agent": ["agent", "--node", "n1", "--nvml", "simulated", "--metrics-port", "-1", "--wait-for-api", "0"],
    "uninstall": ["uninstall", "--yes", "--wait-for-api", "0"],
}


def offline(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`dynamig` with no kubeconfig of this machine in reach, stdin not a terminal: only what the test
    passes counts."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = "/nonexistent"
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    argv = [sys.executable, "-m", "dynamig", *args]
    return subprocess.run(argv, text=True, timeout=60, env=env, **kwargs)


def one_line(proc: subprocess.CompletedProcess[str], command: str) -> str:
    """The only stderr line of a failed command, checked to name the command and carry no traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"dynamig {command}: "), line
    return line


@pytest.mark.parametrize("command", sorted(CLUSTER_COMMANDS))
def test_a_missing_kubeconfig_is_one_line(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-kubeconfig"
    proc = offline(*CLUSTER_COMMANDS[command], "--kubeconfig", str(missing))
    assert proc.returncode == 1
    assert one_line(proc, command) == (
        f"dynamig {command}: cannot read the kubeconfig {missing}: no such file or directory; "
        "pass --kubeconfig PATH of a readable kubeconfig"
    )


def test_an_unreadable_kubeconfig_or_none_at_all_is_one_line(tmp_path: Path) -> None:
    # A directory: unreadable as a kubeconfig even for root, whom file modes do not stop.
    proc = offline(*CLUSTER_COMMANDS["uninstall"], "--kubeconfig", str(tmp_path))
    assert f"cannot read the kubeconfig {tmp_path}: is a directory" in one_line(proc, "uninstall")
    # No flag, no $KUBECONFIG, no ~/.kube/config, not in a pod.
    proc = offline(*CLUSTER_COMMANDS["uninstall"])
    assert one_line(proc, "uninstall").endswith("not running in a pod: pass --kubeconfig PATH")


@pytest.mark.parametrize("command", sorted(CLUSTER_COMMANDS))
def test_an_api_server_that_refuses_connections_is_one_line(command: str, tmp_path: Path) -> None:
    port = closed_port()
    t0 = time.monotonic()
    proc = offline(
        *CLUSTER_COMMANDS[command], "--kubeconfig", str(kubeconfig(tmp_path, f"https://127.0.0.1:{port}"))
    )
    assert one_line(proc, command) == (
        f"dynamig {command}: cannot reach the API server at 127.0.0.1:{port} (connection refused): check "
        "the server address in the kubeconfig and that the cluster is up"
    )
    assert proc.returncode == 1 and time.monotonic() - t0 < 30


@pytest.mark.parametrize("command", sorted(CLUSTER_COMMANDS))
def test_rejected_credentials_are_one_line_at_once(command: str, tmp_path: Path, fake_api: Any) -> None:
    server = fake_api(otherwise=401)
    # Without --wait-for-api 0: waiting does not fix credentials, so even the default minute is not spent.
    argv = [a for a in CLUSTER_COMMANDS[command] if a not in ("--wait-for-api", "0")]
    t0 = time.monotonic()
    proc = offline(*argv, "--kubeconfig", str(kubeconfig(tmp_path, server.url)))
    assert "refused the credentials (401 Unauthorized): log in again" in one_line(proc, command)
    assert proc.returncode == 1 and time.monotonic() - t0 < 30
    assert server.seen == [("GET", "/version")]


def test_a_forbidden_request_is_one_line_with_the_servers_reason(tmp_path: Path, fake_api: Any) -> None:
    server = fake_api({"/version": VERSION_INFO}, otherwise=403)  # reachable, but the account may not list
    proc = offline(*CLUSTER_COMMANDS["uninstall"], "--kubeconfig", str(kubeconfig(tmp_path, server.url)))
    line = one_line(proc, "uninstall")
    # Which list is refused first depends on the order the concurrent reads come back in.
    assert re.fullmatch(
        r"dynamig uninstall: the API server forbids it \(403 Forbidden: /apis?/\S+ is forbidden: "
        r'User "tester" may not\): grant the account the RBAC the chart gives dynamig, '
        r"or use another context",
        line,
    ), line
    assert server.writes() == []


def test_every_command_reports_through_the_same_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main() words the failures of whichever command raised them; what nobody predicted keeps its
    traceback."""
    from kubernetes_asyncio.config import ConfigException

    from dynamig import cli
    from dynamig.cli import plan

    def broken(args: Any) -> int:
        raise ConfigException("Invalid kube-config file. No configuration found.")

    monkeypatch.setattr(plan, "run", broken)
    assert cli.main(["plan", "-f", "x.yaml"]) == 1
    assert capsys.readouterr().err == (
        "dynamig plan: cannot use the kubeconfig: Invalid kube-config file. No configuration found.; "
        "check it with `kubectl config view`\n"
    )

    def bug(args: Any) -> int:
        raise KeyError("a bug")

    monkeypatch.setattr(plan, "run", bug)
    with pytest.raises(KeyError):
        cli.main(["plan", "-f", "x.yaml"])
    assert describe(RuntimeError("x")) is None
    # Raised from a predictable failure, or alone in an exception group: still predictable.
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = CommandError("inner\nsecond line", 5)
    group = BaseExceptionGroup("tasks", [wrapped])
    assert (describe(group), exit_code(group)) == ("inner second line", 5)


# ---------------------------------------------------------------------------------------------- -o


def output_flags(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[str, argparse.Action]:
    """Every command's -o/--output action, by command path ("plan", "geometry profiles"), read from the
    parsers, sub-commands at any depth."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if "-o" in action.option_strings and path:
            found[" ".join(path)] = action
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= output_flags(sub, (*path, name))
    return found


# The commands that print a table, each with the one -o of dynamig.cli.add_output_argument.
TABLES = {
    "dynamig": {"plan", "doctor", "geometry models", "geometry profiles"},
    "kubectl dynamig": {"plan", "verify"},
}


def test_every_command_that_prints_a_table_has_the_same_output_flag() -> None:
    from dynamig.cli.kubectl_plugin import build_parser as plugin_parser

    flags = {"dynamig": output_flags(build_parser()), "kubectl dynamig": output_flags(plugin_parser())}
    for prog, tables in TABLES.items():
        assert tables <= set(flags[prog]), f"{prog}: no -o on {sorted(tables - set(flags[prog]))}"
        for command in tables:
            action = flags[prog][command]
            assert action.option_strings == ["-o", "--output"] and action.default == "table", (prog, command)
            assert tuple(action.choices or ()) == ("table", "json", "yaml"), (prog, command)
    # The others: export takes the same names (yaml by default; a table refused when it runs), must-gather's
    # -o is the archive's path; nothing else has an -o.
    export = flags["kubectl dynamig"]["export"]
    assert tuple(export.choices or ()) == ("table", "json", "yaml") and export.default == "yaml"
    assert flags["kubectl dynamig"]["must-gather"].choices is None
    assert set(flags["dynamig"]) == TABLES["dynamig"]
    assert set(flags["kubectl dynamig"]) == TABLES["kubectl dynamig"] | {"export", "must-gather"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["plan", "-f", str(EXAMPLES / "issue-example.yaml")], "gpus"),
        (["plan", "-f", str(EXAMPLES / "issue-example.yaml"), "--offers"], "offers"),
        (["geometry", "models"], None),
        (["geometry", "profiles", "--model", "A100-40GB"], "profiles"),
        (["doctor", "--nvml", "simulated", "--simulate-gpus", "A100-40GB:1"], None),
    ],
)
def test_json_and_yaml_print_the_same_data(
    argv: list[str], expected: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dynamig import cli

    if argv[0] == "doctor":
        argv = [*argv, "--state", str(tmp_path / "state.json")]
    printed = {}
    for output in ("json", "yaml"):
        assert cli.main([*argv, "-o", output]) == 0, capsys.readouterr().err
        text = capsys.readouterr().out
        printed[output] = json.loads(text) if output == "json" else yaml.safe_load(text)
    assert printed["json"] == printed["yaml"]
    if expected is not None:
        assert expected in printed["json"], printed["json"]
    else:
        assert isinstance(printed["json"], list) and printed["json"]


def test_wide_and_unknown_formats_are_one_line_naming_the_flag() -> None:
    wide = offline("geometry", "models", "-o", "wide")
    assert wide.returncode == 2 and wide.stderr.count("\n") == 1, wide.stderr
    assert "argument -o/--output: wide: the table already shows every column" in wide.stderr
    xml = offline("plan", "-f", str(EXAMPLES / "issue-example.yaml"), "-o", "xml")
    assert xml.returncode == 2 and xml.stderr.count("\n") == 1
    assert (
        "argument -o/--output: invalid choice: 'xml'" in xml.stderr
        and "see dynamig plan --help" in xml.stderr
    )


def test_json_shows_null_for_empty_values(capsys: pytest.CaptureFixture[str]) -> None:
    from dynamig import cli

    assert cli.main(["plan", "-f", str(EXAMPLES / "mixed-cluster.yaml"), "-o", "json"]) == 0
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    unchanged = [g for g in gpus if not g["changed"]]
    assert unchanged and all(g["reason"] is None for g in unchanged)  # was ""
    assert cli.main(["plan", "-f", str(EXAMPLES / "mixed-cluster.yaml")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert any(line.split()[-2:] == ["no", "-"] for line in table)  # the table keeps its "-"
    data = {"gpu": "n-gpu0", "node": None, "actual": "-", "reason": "", "layout": [], "claims": ["-x"]}
    expected = {"gpu": "n-gpu0", "node": None, "actual": None, "reason": None, "layout": [], "claims": ["-x"]}
    assert json.loads(render(data, "json")) == expected
    assert render(data, "yaml").splitlines()[1:4] == ["node: null", "actual: null", "reason: null"]


# ------------------------------------------------------------------------------------------ uninstall

HOOK_ARGS = [  # manifests/helm/dynamig/templates/uninstall-hook.yaml, rendered with the chart's defaults
    "uninstall", "--operator-deployment=dynamig-operator", "--leave=baseline", "--timeout=120",
    "--allow-unreported", "--yes", "--wait-for-api=30", "--log-level=INFO", "--log-format=text",
]  # fmt: skip


def test_uninstall_asks_first_and_without_a_terminal_needs_yes() -> None:
    parse = build_parser().parse_args
    # Unattended callers say --yes (the chart's hook does); naming nodes or tolerating silence is no consent.
    assert confirmation(parse(HOOK_ARGS), interactive=False) == "go"
    for unconfirmed in (["--node=n1", "--timeout=30"], ["--allow-unreported"]):
        with pytest.raises(CommandError, match="pass --yes"):
            confirmation(parse(["uninstall", *unconfirmed]), interactive=False)
    assert confirmation(parse(["uninstall", "--yes"]), interactive=False) == "go"
    assert confirmation(parse(["uninstall", "--dry-run"]), interactive=False) == "go"
    with pytest.raises(CommandError, match="pass --yes") as refused:
        confirmation(parse(["uninstall", "--namespace=dynamig-system"]), interactive=False)
    assert refused.value.exit_code == 2
    # A person at a terminal is asked, whatever else is given, unless --yes says not to.
    assert confirmation(parse([a for a in HOOK_ARGS if a != "--yes"]), interactive=True) == "ask"
    assert confirmation(parse(["uninstall"]), interactive=True) == "ask"
    assert confirmation(parse(["uninstall", "-y"]), interactive=True) == "go"


def cluster() -> dict[str, Any]:
    """The API paths `dynamig uninstall` reads: a policy with a baseline governing n1's GPU (whole now),
    an ungoverned GPU on n2, and each node's ResourceSlice."""

    def partition(node: str, layout: list[tuple[str, int]]) -> dict[str, Any]:
        entries = [{"profile": p, "start": s} for p, s in layout]
        instances = [{**e, "deviceName": f"gpu0-{str(e['profile']).replace('.', '')}-s{e['start']}",
                      "state": "free"} for e in entries]  # fmt: skip
        return {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuPartition",
            "metadata": {"name": f"{node}-gpu0", "generation": 1, "labels": {}},
            "spec": {"layout": entries},
            "status": {"node": node, "gpuIndex": 0, "product": "NVIDIA A100-SXM4-80GB", "model": "A100-80GB",
                       "migMode": "Enabled", "phase": "Stable", "observedGeneration": 1,
                       "instances": instances},
        }  # fmt: skip

    halves = [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]
    policy = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuPartitionPolicy",
        "metadata": {"name": "p", "uid": "uid-p", "generation": 1,
                     "creationTimestamp": "2026-01-01T00:00:00Z",
                     "finalizers": ["kopf.zalando.org/KopfFinalizerMarker"]},
        "spec": {"mode": "Dynamic", "cooldownSeconds": 0, "nodeSelector": {"matchLabels": {"pool": "a"}},
                 "baseline": {"A100-80GB": halves}},
    }  # fmt: skip
    nodes = [{"metadata": {"name": n, "labels": {"pool": pool, "kubernetes.io/hostname": n}}}
             for n, pool in (("n1", "a"), ("n2", "b"))]  # fmt: skip
    slices = [{"metadata": {"name": f"{n}-mig.dynamig.io-x"}, "spec": {"nodeName": n}} for n in ("n1", "n2")]
    empty: dict[str, list[Any]] = {"items": []}
    return {
        "/version": VERSION_INFO,
        f"/apis/{GROUP}/{VERSION}/{POLICY_PLURAL}": {"items": [policy]},
        f"/apis/{GROUP}/{VERSION}/{GPU_PARTITION_PLURAL}": {
            "items": [partition("n1", [("7g.80gb", 0)]), partition("n2", [("1g.10gb", 0)])]
        },
        "/api/v1/nodes": {"items": nodes},
        "/api/v1/pods": empty,
        "/apis/resource.k8s.io/v1/resourceclaims": empty,
        "/apis/resource.k8s.io/v1/deviceclasses": empty,
        "/apis/resource.k8s.io/v1/resourceslices": {"items": slices},
        "/apis/coordination.k8s.io/v1/namespaces/dynamig-system/leases": empty,
    }


def test_uninstall_dry_run_says_what_it_would_do_and_changes_nothing(tmp_path: Path, fake_api: Any) -> None:
    server = fake_api(cluster())
    config = str(kubeconfig(tmp_path, server.url))
    scope = ["--namespace=dynamig-system", "--operator-deployment=dynamig-operator"]
    proc = offline("uninstall", "--dry-run", f"--kubeconfig={config}", *scope)  # no --yes, no terminal
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"dry run on the cluster at {server.url}: nothing is changed",
        "would scale the operator Deployment dynamig-system/dynamig-operator to zero replicas",
        "would leave n1-gpu0 with 3g.40gb@0,3g.40gb@4 (its policy's baseline)",
        "would leave n2-gpu0 with 1g.10gb@0 (no baseline: keeps its layout)",
        "would wait up to 300s for the agents of 2 node(s) to withdraw their GPUs and clean the node: n1, n2",
        "would delete 2 ResourceSlice(s) of mig.dynamig.io (those the agents leave): n1-mig.dynamig.io-x, "
        "n2-mig.dynamig.io-x",
        "would delete 2 GpuPartition(s): n1-gpu0, n2-gpu0",
        "would remove dynamig's finalizers from GpuPartitionPolicy(ies): p",
    ]
    # One node, left empty: the operator keeps running, only that node's objects go.
    proc = offline("uninstall", "--dry-run", f"--kubeconfig={config}", *scope, "--node=n1", "--leave=empty")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:-1] == [
        "would leave n1-gpu0 with - (empty)",
        "would wait up to 300s for the agents of 1 node(s) to withdraw their GPUs and clean the node: n1",
        "would delete 1 ResourceSlice(s) of mig.dynamig.io (those the agents leave): n1-mig.dynamig.io-x",
        "would delete 1 GpuPartition(s): n1-gpu0",
    ]
    assert server.seen and server.writes() == []


def test_uninstall_without_a_terminal_or_yes_refuses_before_reading(tmp_path: Path, fake_api: Any) -> None:
    server = fake_api(cluster())
    proc = offline("uninstall", f"--kubeconfig={kubeconfig(tmp_path, server.url)}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_line(proc, "uninstall") == (
        "dynamig uninstall: not run from a terminal, so nobody can confirm: pass --yes to uninstall "
        "(or --dry-run to see what it would do)"
    )
    assert server.seen == []


def on_terminal(answer: str, *args: str) -> tuple[int, str]:
    """`dynamig` with stdin and stderr on a terminal where a person types ``answer``: the exit status and
    what the terminal showed."""
    parent, child = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    try:
        os.write(parent, answer.encode() + b"\n")  # waits in the terminal's line buffer until read
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamig", *args],
            stdin=child,
            stderr=child,
            stdout=subprocess.DEVNULL,
            env=env,
        )
        os.close(child)
        shown = b""
        with contextlib.suppress(OSError):  # EIO once the command has exited and closed its side
            while chunk := os.read(parent, 4096):
                shown += chunk
        code = proc.wait(timeout=60)
    finally:
        os.close(parent)
    return code, shown.decode().replace("\r\n", "\n")


def test_uninstall_on_a_terminal_shows_the_plan_and_asks(tmp_path: Path, fake_api: Any) -> None:
    server = fake_api(cluster(), writes=403)
    config = f"--kubeconfig={kubeconfig(tmp_path, server.url)}"
    code, shown = on_terminal("n", "uninstall", config)
    assert code == 1, shown
    assert f"dynamig uninstall on the cluster at {server.url}:\n" in shown
    assert "  would leave n1-gpu0 with 3g.40gb@0,3g.40gb@4 (its policy's baseline)\n" in shown
    assert "Proceed? [y/N] " in shown and "Traceback" not in shown
    assert shown.rstrip().endswith("dynamig uninstall: not confirmed: nothing was changed")
    assert server.seen and server.writes() == []
    # "y": it goes on to write (this server forbids the write: one line, nothing else changed).
    code, shown = on_terminal("y", "uninstall", config)
    assert code == 1 and "Traceback" not in shown, shown
    # (The typed answer was echoed before the question: here the error follows it on the same line.)
    refused = (
        f"dynamig uninstall: the API server forbids it (403 Forbidden: /apis/{GROUP}/{VERSION}/"
        f'{GPU_PARTITION_PLURAL}/n1-gpu0 is forbidden: User "tester" may not): grant the account the '
        "RBAC the chart gives dynamig, or use another context"
    )
    assert shown.rstrip().splitlines()[-1].endswith(refused), shown
    assert server.writes() == [("PATCH", f"/apis/{GROUP}/{VERSION}/{GPU_PARTITION_PLURAL}/n1-gpu0")]
