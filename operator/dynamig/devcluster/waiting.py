"""Waiting for the cluster to reach a state: the one polling helper scenarios and tests share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T | None]], what: str, within_s: float = 60.0, every_s: float = 0.1
) -> T:
    """Await ``probe`` every ``every_s`` until it returns something other than None; TimeoutError naming
    ``what`` after ``within_s``. Side effects: only the probe's."""
    deadline = time.monotonic() + within_s
    while True:
        value = await probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within_s:.0f}s waiting for {what}")
        await asyncio.sleep(every_s)
