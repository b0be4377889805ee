"""The ``dynamig`` command line as a person meets it: --version, help without reST markup, checked log
levels, model keys in any case, and a closed pipe that is not a crash. Runs the installed entry point."""

from __future__ import annotations

import subprocess
import sys

from dynamig import __version__
from dynamig.cli import plain


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
