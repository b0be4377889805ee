"""Every command line refuses what it cannot honour: a bad number, a value out of range, an unknown choice,
a file that is missing or malformed, a kubeconfig or context that cannot be used. Each case must exit
non-zero with exactly one line on stderr that names the flag (or the environment variable) to fix, and no
traceback.

Real: the entry points ``dynamig.cli.main`` and ``dynamig.cli.kubectl_plugin.main`` with these arguments,
files written here, the catalog and the Alibaba sample the package carries. No cluster is contacted: every
case is refused before a command connects (a cluster command is given no kubeconfig it could use, or one
whose server is a closed port or whose exec credential plugin cannot run or fails), and no command that
would start something (agent, operator, demo, dev-cluster) gets valid arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import yaml

from dynamig import cli
from dynamig.cli import kubectl_plugin

SCENARIO = """\
gpus:
- {node: n1, index: 0, model: A100-80GB, instances: []}
claims:
- {name: a, alternatives: [1g.10gb]}
"""
KUBECONFIG_WITHOUT_CURRENT = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: a, context: {cluster: c, user: u}}]
"""


def kubeconfig_with_exec(command: str, args: list[str]) -> str:
    """A kubeconfig whose user gets its credentials from an exec plugin, the server a closed port."""
    exec_ = {"apiVersion": "client.authentication.k8s.io/v1", "command": command, "args": args}
    doc = yaml.safe_load(KUBECONFIG_WITHOUT_CURRENT) | {"current-context": "a"}
    doc["users"] = [{"name": "u", "user": {"exec": exec_}}]
    return str(yaml.safe_dump(doc))


def files(tmp: Path) -> dict[str, str]:
    """The files the cases name, written into ``tmp``: {placeholder: path}."""
    written = {
        "BAD_YAML": "a: [\n",
        "EMPTY": "",
        "SCENARIO": SCENARIO,
        "BAD_POLICY": SCENARIO + "policy: {maxGpusReshaped: many}\n",
        "BAD_PROFILE": SCENARIO.replace("[1g.10gb]", "[9g.99gb]"),
        "NO_CURRENT": KUBECONFIG_WITHOUT_CURRENT,
        "CLOSED_PORT": KUBECONFIG_WITHOUT_CURRENT + "current-context: a\n",
        "EXEC_MISSING": kubeconfig_with_exec("no-such-credential-plugin", []),
        "EXEC_FAILS": kubeconfig_with_exec("sh", ["-c", "echo token expired >&2; exit 3"]),
        "TRACE_LIST": "name: x\n- y\n",
        "PODS": "name,num_gpu,gpu_milli\np0,1,1000\n",
    }
    out = {}
    for name, text in written.items():
        path = tmp / f"{name.lower()}.yaml"
        path.write_text(text)
        out[name] = str(path)
    out["MISSING"] = str(tmp / "no-such-file.yaml")
    out["MISSING_DIR"] = str(tmp / "no-such-dir")
    out["NO_PARENT"] = str(tmp / "no-such-dir" / "gather.tar.gz")
    out["NEW_ARCHIVE"] = str(tmp / "gather.tar.gz")
    out["TMP"] = str(tmp)
    return out


D = "dynamig"
K = "kubectl"
QUIET = ["--quiet", "--no-plots"]
# (entry point, argv, what the line must name, environment): placeholders are replaced by files(tmp)
CASES: list[tuple[str, list[str], str, dict[str, str]]] = [
    # dynamig plan
    (D, ["plan"], "-f/--file", {}),
    (D, ["plan", "-f", "MISSING"], "-f", {}),
    (D, ["plan", "-f", "BAD_YAML"], "-f", {}),
    (D, ["plan", "-f", "EMPTY"], "-f", {}),
    (D, ["plan", "-f", "BAD_POLICY"], "-f", {}),
    (D, ["plan", "-f", "BAD_PROFILE"], "-f", {}),
    (D, ["plan", "-f", "SCENARIO", "-o", "xml"], "-o/--output", {}),
    # dynamig geometry
    (D, ["geometry", "profiles"], "--model", {}),
    (D, ["geometry", "profiles", "--model", "B300-1TB"], "--model", {}),
    (D, ["geometry", "layouts", "--model", "A100-80GB", "--profiles", "9g.99gb"], "--profiles", {}),
    (D, ["geometry", "check", "--model", "A100-80GB", "3g.40gb@x"], "LAYOUT", {}),
    (D, ["geometry", "shapes"], "COMMAND", {}),
    # dynamig doctor
    (D, ["doctor", "--nvml", "fake"], "--nvml", {}),
    (D, ["doctor", "-o", "wide"], "-o/--output: wide", {}),
    (D, ["geometry", "models", "-o", "xml"], "-o/--output", {}),
    (D, ["geometry", "profiles", "--model", "A100-80GB", "-o", "wide"], "-o/--output: wide", {}),
    (D, ["doctor", "--nvml", "simulated", "--simulate-gpus", "B300-1TB:1"], "--simulate-gpus", {}),
    (D, ["doctor", "--nvml", "simulated", "--simulate-gpus", "A100-80GB:x"], "--simulate-gpus", {}),
    (D, ["doctor", "--simulate-gpus", "A100-80GB:1"], "--nvml simulated", {}),
    # dynamig simulate
    (D, ["simulate", "--seeds", "0"], "--seeds", {}),
    (D, ["simulate", "--seeds", "ten"], "--seeds", {}),
    (D, ["simulate", "--loads", "x"], "--loads", {}),
    (D, ["simulate", "--loads", "-1"], "--loads", {}),
    (D, ["simulate", "--gpu-spec-share", "1.5"], "--gpu-spec-share", {}),
    (D, ["simulate", "--fallbacks", "-1"], "--fallbacks", {}),
    (D, ["simulate", "--window-s", "nan"], "--window-s", {}),
    (D, ["simulate", "--warm-quantile", "0"], "--warm-quantile", {}),
    (D, ["simulate", "--warm-pool", "1g.10gb=many"], "--warm-pool", {}),
    (D, ["simulate", "--protocols", "all"], "--protocols", {}),
    (D, ["simulate", "--policies", "magic"], "--policies", {}),
    (D, ["simulate", "--node-orders", "random"], "--node-orders", {}),
    (D, ["simulate", "--mixed", "B300-1TB=1"], "--mixed", {}),
    (D, ["simulate", "--alibaba-sample", "--model", "B300-1TB"], "--model", {}),
    (D, ["simulate", "--alibaba", "MISSING_DIR"], "--alibaba", {}),
    (D, ["simulate", "--pod-list", "PODS"], "--node-list", {}),
    (D, ["simulate", "--pod-list", "MISSING", "--node-list", "MISSING"], "--pod-list", {}),
    (D, ["simulate", "--traces", "MISSING"], "--traces", {}),
    (D, ["simulate", "--traces", "BAD_YAML"], "--traces", {}),
    (D, ["simulate", "--traces", "TRACE_LIST"], "--traces", {}),
    (D, ["simulate", "--traces", "no-such-trace"], "--traces", {}),
    (D, ["simulate", "--no-synthetic"], "--no-synthetic", {}),
    (D, ["simulate", "--loads", "1.0"], "--alibaba", {}),
    (D, ["simulate", "--alibaba-sample", "--no-synthetic", "--loads", "1.0"], "--replay-node-stride", {}),
    (D, ["simulate", "--alibaba-sample", "--protocols", "paper", "--loads", "0.2"], "--protocols", {}),
    (D, ["simulate", "--create-latencies", "3"], "--loads", {}),
    (D, ["simulate", "--traces", "fragmentation", "--out", "SCENARIO"], "--out", {}),
    # dynamig agent, operator, uninstall, demo, dev-cluster: refused before anything starts
    (D, ["agent", "--interval", "0"], "--interval", {}),
    (D, ["agent", "--metrics-port", "70000"], "--metrics-port", {}),
    (D, ["agent", "--lease-seconds", "0"], "--lease-seconds", {}),
    (D, ["agent", "--nvml", "fake"], "--nvml", {}),
    (D, ["agent", "--inventory", "all"], "--inventory", {}),
    (D, ["agent", "--log-level", "loud"], "--log-level", {}),
    (D, ["agent", "--wait-for-api", "-1"], "--wait-for-api", {}),
    (D, ["agent", "--settle-seconds", "soon"], "--settle-seconds", {}),
    (D, ["agent", "--placements-per-profile", "-2"], "--placements-per-profile", {}),
    (D, ["operator", "--resync-seconds", "0"], "--resync-seconds", {}),
    (D, ["operator", "--metrics-port", "-5"], "--metrics-port", {}),
    (D, ["operator", "--priority", "high"], "--priority", {}),
    (D, ["operator", "--log-format", "xml"], "--log-format", {}),
    (D, ["operator", "--stranded-after-seconds", "-1"], "--stranded-after-seconds", {}),
    (D, ["uninstall", "--leave", "nothing"], "--leave", {}),
    (D, ["uninstall", "--timeout", "-1"], "--timeout", {}),
    (D, ["demo", "--inference-pods", "0"], "--inference-pods", {}),
    (D, ["demo", "--cooldown", "-1"], "--cooldown", {}),
    (D, ["dev-cluster", "up", "--gpu-node", "n1"], "--gpu-node", {}),
    (D, ["dev-cluster", "up", "--gpu-node", "n1=B300-1TB:2"], "--gpu-node", {}),
    (D, ["dev-cluster", "up", "--gpu-node", "n1=A100-80GB:0"], "--gpu-node", {}),
    (D, ["frobnicate"], "COMMAND", {}),
    (D, ["agent", "--nvml", "simulated", "--simulate-gpus", "A100-80GB:x"], "--simulate-gpus", {}),
    # kubectl dynamig: flags
    (K, ["verify", "-o", "wide"], "-o/--output", {}),
    (K, ["plan", "-n", "a", "-A"], "-A/--all-namespaces", {}),
    (K, ["export", "--as", "chart"], "--as", {}),
    (K, ["export", "--as", "scenario", "-o", "table"], "-o table", {}),
    (K, ["export", "--as", "scenario", "-o", "wide"], "-o/--output: wide: export prints a manifest", {}),
    (K, ["plan", "-o", "wide"], "-o/--output: wide", {}),
    (K, ["must-gather", "-o", "json"], "-o json", {}),
    (K, ["must-gather", "-o", "wide"], "-o wide", {}),
    (K, ["must-gather", "-o", "TMP"], "-o", {}),
    (K, ["must-gather", "-o", "NO_PARENT"], "-o", {}),
    (K, ["must-gather", "--log-lines", "0"], "--log-lines", {}),
    # kubectl dynamig: kubeconfig and context
    (K, ["--kubeconfig", "MISSING", "verify"], "--kubeconfig", {}),
    (K, ["--kubeconfig", "TMP", "verify"], "--kubeconfig", {}),
    (K, ["--kubeconfig", "BAD_YAML", "plan"], "--kubeconfig", {}),
    (K, ["--kubeconfig", "EMPTY", "export", "--as", "scenario"], "--kubeconfig", {}),
    (K, ["--kubeconfig", "NO_CURRENT", "verify"], "--context", {}),
    (K, ["verify", "--kubeconfig", "NO_CURRENT", "--context", "nope"], "--context nope", {}),
    (K, ["verify"], "$KUBECONFIG", {"KUBECONFIG": "MISSING"}),
    (K, ["verify"], "--kubeconfig", {"KUBECONFIG": "BAD_YAML"}),
    (K, ["plan"], "--kubeconfig", {}),  # no kubeconfig anywhere, not in a pod
    (K, ["--context", "prod", "plan"], "--context", {}),
    # an exec credential plugin that cannot run or fails: the kubeconfig's user, in one line
    (K, ["--kubeconfig", "EXEC_MISSING", "verify"], "exec credential plugin no-such-credential-plugin", {}),
    (K, ["--kubeconfig", "EXEC_FAILS", "must-gather"], "plugin failed: process returned 3", {}),
    (D, ["uninstall", "--kubeconfig", "EXEC_MISSING", "--dry-run"], "plugin no-such-credential-plugin", {}),
    # an API server that cannot be reached (a closed port): every command, must-gather too, says so and
    # writes nothing
    (K, ["--kubeconfig", "CLOSED_PORT", "must-gather", "-o", "NEW_ARCHIVE"], "cannot reach the API", {}),
    (K, ["--kubeconfig", "CLOSED_PORT", "verify"], "cannot reach the API server", {}),
    (D, ["uninstall", "--kubeconfig", "CLOSED_PORT", "--dry-run", "--wait-for-api", "0"], "cannot reach", {}),
]


def _run(entry: str, argv: Sequence[str]) -> int:
    main: Callable[[Sequence[str]], int] = cli.main if entry == D else kubectl_plugin.main
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's exit, where main() lets it through
        return exc.code if isinstance(exc.code, int) else 1


@pytest.mark.parametrize(
    ("entry", "argv", "names", "env"), CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES]
)
def test_bad_input_is_one_line_naming_the_flag(
    entry: str,
    argv: list[str],
    names: str,
    env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    paths = files(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.kube/config
    for var in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "NODE_NAME"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, paths.get(value, value))
    monkeypatch.chdir(tmp_path)  # whatever a refused command might still write lands here
    args = [paths.get(a, a) for a in argv]
    if entry == D and args[0] == "simulate" and "--out" not in args:
        args += ["--out", str(tmp_path / "out"), *QUIET]

    status = _run(entry, args)

    err = capsys.readouterr().err
    assert status != 0, err
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert names in err, err
    prog = "kubectl dynamig" if entry == K else "dynamig"
    assert err.startswith(prog), err
    assert not Path(paths["NEW_ARCHIVE"]).exists()  # nothing written for a refused must-gather
