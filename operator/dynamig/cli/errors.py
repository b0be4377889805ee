"""Failures a person can fix, told in one line: ``dynamig <command>: <what went wrong and what to do>``.

:func:`dynamig.cli.main` runs every command through :func:`describe`: a :class:`CommandError`, an unusable
kubeconfig, an API server that cannot be reached, or one that refuses the credentials (401) or the request
(403) becomes that line and a non-zero exit status. Anything else keeps its traceback: it is a bug.

The commands that talk to a cluster call :func:`check_kubeconfig` and :func:`reach_api` before they change
or start anything, so a wrong kubeconfig or a server that is down fails at once, in words.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from dynamig.cli.args import non_negative_float

log = logging.getLogger(__name__)

EXIT_FAILED = 1
EXIT_USAGE = 2
DEFAULT_API_WAIT_S = 60.0


class CommandError(Exception):
    """A predictable failure; ``str()`` says what went wrong and what to do."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def describe(exc: BaseException) -> str | None:
    """The one line for ``exc`` (or the exception it was raised from), None when it is not a predictable
    failure. Pure."""
    for cause in _causes(exc):
        line = _describe_one(cause)
        if line is not None:
            return " ".join(line.split())  # messages quoted from a server may span lines
    return None


def exit_code(exc: BaseException) -> int:
    return next((c.exit_code for c in _causes(exc) if isinstance(c, CommandError)), EXIT_FAILED)


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc``, what it was raised from, and the only member of a group of one (asyncio's TaskGroup)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        if isinstance(current, BaseExceptionGroup) and len(current.exceptions) == 1:
            current = current.exceptions[0]
        else:
            current = current.__cause__
    return seen


def _describe_one(exc: BaseException) -> str | None:
    if isinstance(exc, CommandError):
        return str(exc)
    # Imported here: `dynamig plan` and `dynamig geometry` never load the Kubernetes client.
    import aiohttp
    from kubernetes_asyncio.client.exceptions import ApiException
    from kubernetes_asyncio.config import ConfigException

    if isinstance(exc, ConfigException):
        text = str(exc)
        if "Service host/port is not set" in text:
            return (
                "no kubeconfig (--kubeconfig, $KUBECONFIG or ~/.kube/config) and not running in a pod: "
                "pass --kubeconfig PATH"
            )
        return f"cannot use the kubeconfig: {text}; check it with `kubectl config view`"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return (
            f"the API server at {_where(exc)} presented a certificate that is not trusted "
            f"({exc.certificate_error}): check the kubeconfig's certificate-authority"
        )
    if isinstance(exc, aiohttp.ClientConnectorError):
        return (
            f"cannot reach the API server at {_where(exc)} ({_why(exc.os_error)}): check the server "
            "address in the kubeconfig and that the cluster is up"
        )
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return f"the API server did not answer in time ({exc}): check that the cluster is up"
    if isinstance(exc, ApiException) and exc.status == 401:
        return (
            "the API server refused the credentials (401 Unauthorized): log in again or fix the user of the "
            "kubeconfig's context"
        )
    if isinstance(exc, ApiException) and exc.status == 403:
        return (
            f"the API server forbids it (403 Forbidden: {api_message(exc)}): grant the account the RBAC "
            "the chart gives dynamig, or use another context"
        )
    return None


def _where(exc: Any) -> str:
    host = str(exc.host)
    return f"[{host}]:{exc.port}" if ":" in host else f"{host}:{exc.port}"


def _why(error: OSError) -> str:
    if isinstance(error, socket.gaierror):
        return f"name not resolved: {error.strerror}"
    if error.errno is not None and error.errno > 0:
        return os.strerror(error.errno).lower()  # "connection refused", not "Connect call failed (...)"
    return str(error)


def api_message(exc: Any) -> str:
    """The ``message`` of the Status an ApiException carries, else its body or reason."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return str(exc.body or exc.reason or "").strip()
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return str(exc.reason or "")


def check_kubeconfig(path: Path | None, context: str | None = None) -> None:
    """Raise :class:`CommandError` for a kubeconfig the Kubernetes client could not use, in words that name
    where it came from (``--kubeconfig``, ``$KUBECONFIG`` or ``~/.kube/config``): a file that cannot be read
    (kubectl skips missing ``$KUBECONFIG`` entries, but not all of them), one that is not YAML or not a
    kubeconfig, a ``--context`` it does not have, or no current context to use. With no kubeconfig anywhere
    nothing is checked (the in-cluster service account is used), unless ``context`` names one. The client
    itself would only say "Expected key current-context" or fail with a traceback. Reads the file system and
    the environment."""
    if path is not None:
        files, where = [path], "--kubeconfig"
        _check_readable(path, "pass --kubeconfig PATH of a readable kubeconfig")
    elif os.environ.get("KUBECONFIG", "").strip(os.pathsep):
        listed = [Path(p) for p in os.environ["KUBECONFIG"].split(os.pathsep) if p]
        files, where = [p for p in listed if p.exists()], "$KUBECONFIG"
        if not files:
            raise CommandError(
                f"no file named in $KUBECONFIG exists ({os.pathsep.join(map(str, listed))}): point "
                "$KUBECONFIG or --kubeconfig at a kubeconfig"
            )
        for p in files:
            _check_readable(p, "fix $KUBECONFIG or pass --kubeconfig")
    elif (home := Path("~/.kube/config").expanduser()).is_file():
        files, where = [home], "~/.kube/config"
        _check_readable(home, "fix it or pass --kubeconfig PATH")
    else:
        if context is not None:
            raise CommandError(
                f"--context {context}: no kubeconfig to find it in (none in --kubeconfig, $KUBECONFIG or "
                "~/.kube/config): pass --kubeconfig PATH"
            )
        return
    _check_contents(files, where, context)


def _check_contents(files: list[Path], where: str, context: str | None) -> None:
    import yaml

    advice = "pass --kubeconfig PATH" if where != "--kubeconfig" else "fix the file or pass another"
    names: list[str] = []
    current = ""
    for i, p in enumerate(files):
        try:
            doc = yaml.safe_load(p.read_bytes())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            raise CommandError(f"the kubeconfig {p} ({where}) is not valid YAML{at}: {advice}") from None
        if not isinstance(doc, dict):
            raise CommandError(f"the kubeconfig {p} ({where}) is empty or not a kubeconfig: {advice}")
        for entry in doc.get("contexts") or []:
            if isinstance(entry, dict) and entry.get("name"):
                names.append(str(entry["name"]))
        if i == 0:  # the Kubernetes client takes the current context of the first file only
            current = str(doc.get("current-context") or "")
    source = f"{files[0]} ({where})" if len(files) == 1 else where
    if not names:
        raise CommandError(f"the kubeconfig {source} has no contexts: {advice}")
    known = f"contexts: {', '.join(names)}"
    if context is not None:
        if context not in names:
            raise CommandError(f"--context {context}: no such context in the kubeconfig {source} ({known})")
        return
    if not current:
        raise CommandError(
            f"the kubeconfig {source} sets no current-context: pass --context NAME ({known}) or run "
            "`kubectl config use-context NAME`"
        )
    if current not in names:
        raise CommandError(
            f"the kubeconfig {source} has current-context {current}, which is not among its contexts "
            f"({known}): pass --context NAME or run `kubectl config use-context NAME`"
        )


def _check_readable(path: Path, advice: str) -> None:
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()
        raise CommandError(f"cannot read the kubeconfig {path}: {why}; {advice}") from None


def add_api_wait_argument(parser: Any) -> None:
    """``--wait-for-api``, shared by the commands that need the API server before they start."""
    parser.add_argument(
        "--wait-for-api",
        type=non_negative_float,
        default=DEFAULT_API_WAIT_S,
        metavar="SECONDS",
        help="at start, how long to retry an API server that cannot be reached before giving up "
        f"(default {DEFAULT_API_WAIT_S:.0f}; 0: try once); rejected credentials fail at once",
    )


async def reach_api(api: Any, wait_s: float) -> None:
    """Return once the API server answers ``GET /version`` with these credentials. A server that cannot be
    reached (or answers 5xx) is retried until ``wait_s`` has passed, then the last error is raised; 401 and
    403 are raised at once (waiting does not fix them). Side effect: requests to the API server."""
    import asyncio

    import aiohttp
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    deadline = time.monotonic() + wait_s
    delay = 0.5
    while True:
        try:
            await client.VersionApi(api).get_code(_request_timeout=10)
            return
        except ApiException as exc:
            if exc.status in (401, 403):
                raise
            if time.monotonic() + delay > deadline:
                raise CommandError(
                    f"the API server at {api.configuration.host} answered {exc.status} {exc.reason}: "
                    f"{api_message(exc)}"
                ) from None
            why = f"{exc.status} {exc.reason}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            why = describe(exc) or str(exc)
        log.warning("waiting for the API server at %s: %s", api.configuration.host, why)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)
