"""The proxy's event-loop lag probe (pdstack.proxy.periodic.LoopLag): a stretch of blocking
work on the loop shows in ``pdstack_proxy_loop_lag_seconds`` (its length, in the histogram's
sum). No bound on an idle tick: a starved 2-core machine may wake any of them late."""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import CollectorRegistry

from pdstack.proxy.periodic import LoopLag


def _count(registry: CollectorRegistry, le: str) -> float:
    value = registry.get_sample_value("pdstack_proxy_loop_lag_seconds_bucket", {"le": le})
    assert value is not None
    return value


async def test_a_blocked_loop_shows_as_lag() -> None:
    registry = CollectorRegistry()
    probe = asyncio.create_task(LoopLag(registry).run())
    try:
        await asyncio.sleep(0.2)
        assert _count(registry, "+Inf") >= 1, "the probe ticks"
        late = _count(registry, "+Inf") - _count(registry, "0.25")
        lag = registry.get_sample_value("pdstack_proxy_loop_lag_seconds_sum") or 0.0
        time.sleep(0.4)  # blocking work on the loop (a test's stand-in for a slow handler)
        await asyncio.sleep(0.12)
        assert _count(registry, "+Inf") - _count(registry, "0.25") >= late + 1
        added = (registry.get_sample_value("pdstack_proxy_loop_lag_seconds_sum") or 0.0) - lag
        assert added >= 0.3
    finally:
        probe.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probe
