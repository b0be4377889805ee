"""Times as the Kubernetes API writes them. Pure but for the clock in :func:`now_rfc3339`."""

from __future__ import annotations

from datetime import UTC, datetime


def now_rfc3339() -> str:
    """Current UTC time in the RFC 3339 form Kubernetes uses (seconds precision)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339(epoch: float) -> str:
    """Epoch seconds in the RFC 3339 form Kubernetes uses (UTC, seconds precision). Pure."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(epoch: float) -> str:
    """A ``MicroTime`` as the API writes it: RFC 3339 UTC with microseconds. Pure."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> float | None:
    """RFC 3339 (``2026-01-01T10:00:00Z``, with or without fractions) to epoch seconds; None if empty or
    malformed. Pure."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
