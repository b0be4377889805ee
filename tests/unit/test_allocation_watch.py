"""The demo's and the e2e tests' check that no allocated instance was destroyed (``AllocationWatch``): spans
are kept per claim, so a device name cut again for another claim after a destroy is not read as one long
allocation. Pure: spans and simulated NVML history events, no API."""

from __future__ import annotations

from typing import Any, cast

from dynamig.backends.simnvml import SimEvent
from dynamig.demo.cluster import AllocationWatch


def destroy(at: float, profile: str = "1g.10gb", start: int = 0) -> SimEvent:
    return SimEvent(0, at, "destroy-gi", 0, "GPU-0", gi_id=1, profile=profile, start=start)


def watch(spans: dict[tuple[str, str], list[float]]) -> AllocationWatch:
    w = AllocationWatch(cast(Any, None))
    w.seen = spans
    return w


def test_a_destroy_between_two_claims_of_the_same_device_name_is_no_loss() -> None:
    # The morning's claim held gpu0-1g10gb-s0 until 10.0; the slice was destroyed at 12.0 and cut again
    # for a later claim at 15.0.
    w = watch({("gpu0-1g10gb-s0", "uid-a"): [1.0, 10.0], ("gpu0-1g10gb-s0", "uid-b"): [15.0, 20.0]})
    assert w.destroyed_while_allocated([destroy(12.0)]) == []


def test_a_destroy_while_a_claim_holds_the_device_is_reported() -> None:
    w = watch({("gpu0-1g10gb-s0", "uid-a"): [1.0, 10.0], ("gpu0-1g10gb-s0", "uid-b"): [15.0, 20.0]})
    (bad,) = w.destroyed_while_allocated([destroy(16.0)])
    assert bad == "gpu0-1g10gb-s0 destroyed at 16.00 while allocated 15.00-20.00"
    # 50 ms either side of a span still counts (the watch polls every 50 ms)
    assert w.destroyed_while_allocated([destroy(10.04)])
    # another device at another place is not this one
    assert w.destroyed_while_allocated([destroy(16.0, start=1), destroy(16.0, "3g.40gb")]) == []
