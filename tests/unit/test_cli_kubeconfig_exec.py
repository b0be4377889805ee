"""The kubeconfig's exec credential plugin, as every command that logs in meets it
(``dynamig.operator.handlers.client_configuration``): a plugin that cannot be started or that fails is one
ConfigException naming it (the commands print it as one line), with no ERROR record of kubernetes-asyncio
beside it; a plugin that runs is used, and what kubernetes-asyncio logs about its output is still logged.

Real: kubernetes-asyncio's kubeconfig loader and exec provider, running this Python as the plugin.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio.config import ConfigException

from dynamig.operator.handlers import KUBECONFIG_LOGGER, client_configuration
from dynamig.operator.settings import OperatorSettings


def kubeconfig(tmp: Path, command: str, *args: str) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [
            {
                "name": "u",
                "user": {
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1",
                        "command": command,
                        "args": list(args),
                    }
                },
            }
        ],
        "contexts": [{"name": "a", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "a",
    }
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


def credential(status: dict[str, str]) -> str:
    """A plugin (Python source) that prints an ExecCredential with ``status``."""
    doc = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": status}
    return f"print({json.dumps(json.dumps(doc))})"


@pytest.mark.parametrize(
    ("command", "args", "message"),
    [
        (
            "no-such-credential-plugin",
            (),
            "its user's exec credential plugin no-such-credential-plugin cannot be run (no such file or "
            "directory)",
        ),
        (
            sys.executable,
            ("-c", "import sys; sys.stderr.write('token expired, log in again'); sys.exit(3)"),
            "its user's exec credential plugin failed: process returned 3. token expired, log in again",
        ),
    ],
)
async def test_a_plugin_that_cannot_run_or_fails_is_one_error_and_no_log_line(
    command: str, args: tuple[str, ...], message: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = OperatorSettings(kubeconfig=kubeconfig(tmp_path, command, *args))
    with caplog.at_level(logging.DEBUG, logger=KUBECONFIG_LOGGER), pytest.raises(ConfigException) as raised:
        await client_configuration(settings)
    assert str(raised.value) == message
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_plugin_that_runs_gives_its_token_and_its_loader_still_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = kubeconfig(tmp_path, sys.executable, "-c", credential({"token": "t0k3n"}))
    conf = await client_configuration(OperatorSettings(kubeconfig=good))
    assert conf.api_key["BearerToken"] == "Bearer t0k3n"
    # A plugin that answers without a token: kubernetes-asyncio logs it and goes on; so does dynamig.
    empty = kubeconfig(tmp_path, sys.executable, "-c", credential({}))
    with caplog.at_level(logging.DEBUG, logger=KUBECONFIG_LOGGER):
        await client_configuration(OperatorSettings(kubeconfig=empty))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["exec: missing token or clientCertificateData field in plugin output"]
