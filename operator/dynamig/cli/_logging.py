"""Log set-up shared by the long-running commands (agent, operator): text for people, JSON for collectors.

Both carry RFC 3339 UTC timestamps with milliseconds, and the Kubernetes object a record is about where Kopf
attaches one (its per-object loggers set ``k8s_ref``): JSON puts it under ``object``, text prefixes
``[kind/name]``, so one policy's or GpuPartition's lines can be followed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def rfc3339(created: float) -> str:
    """``2026-12-02T01:02:03.456Z`` for a record's creation time. Pure."""
    return (
        datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat(timespec="milliseconds")[:-6] + "Z"
    )


def _object_ref(record: logging.LogRecord) -> dict[str, str] | None:
    ref = getattr(record, "k8s_ref", None)
    if not isinstance(ref, dict) or not ref.get("name"):
        return None
    return {k: str(v) for k, v in ref.items() if v and k in ("kind", "namespace", "name", "uid")}


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return rfc3339(record.created)

    def format(self, record: logging.LogRecord) -> str:
        ref = _object_ref(record)
        if ref is not None:
            record = logging.makeLogRecord(record.__dict__)
            record.msg = f"[{ref.get('kind', '')}/{ref['name']}] {record.msg}"
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; the message is escaped properly whatever it contains."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        ref = _object_ref(record)
        if ref is not None:
            entry["object"] = ref
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Side effect: replaces the root logger's handlers with one stderr handler in ``log_format``."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` (any case, checked) and ``--log-format``, as both long-running commands take them."""
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level (default INFO)",
    )
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
