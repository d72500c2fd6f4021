"""One background loop for the proxy's periodic work (health probes, admission scrapes)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("pdstack.proxy")


async def every(
    interval_s: Callable[[], float], step: Callable[[], Awaitable[None]], failed: str
) -> None:
    """Sleep ``interval_s()`` then await ``step()``, until cancelled; a step that raises is
    logged (``failed``) and the loop goes on: it never dies."""
    while True:
        await asyncio.sleep(interval_s())
        try:
            await step()
        except Exception:  # never let the loop die
            log.exception(failed)
