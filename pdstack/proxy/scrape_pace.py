"""How often KV-aware admission reads each engine's ``/metrics``: fast only when it matters.

vLLM renders ``/metrics`` on the asyncio loop that streams its tokens, so every scrape costs
the engine a little latency. The gate decides from the proxy's own accounting; a scrape only
corrects it (prefix reuse, traffic that does not pass the proxy). So an engine is read
every ``scrape_idle_interval_s`` while it is far from its watermark and nobody waits, and
every ``scrape_interval_s`` once either view of its load (the proxy's own sum, or the last
scrape's projection) reaches ``NEAR`` of the watermark, or requests are held, or its
capacity is not known yet (nothing to compare with). The loop ticks at the shorter
interval, so an engine turns fast within one tick of crossing; a tick scrapes only the
engines that are due.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdstack.proxy.kv_gate import EngineLoad

NEAR = 0.5  # of the watermark (kv_high x capacity): from here on, read at the fast interval


def near_mark(load: EngineLoad, kv_high: float) -> bool:
    """Either view of ``load`` (see the module) is at ``NEAR`` of the watermark or past it,
    or its capacity is unknown."""
    if load.capacity_tokens <= 0:
        return True
    scraped = load.projected(True) if load.scraped_at > 0 else 0.0
    seen = max(load.projected(False), scraped)
    return seen >= NEAR * kv_high * load.capacity_tokens


@dataclass
class ScrapePace:
    """Per engine: when it was last read (tried: the caller notes it), and whether it is due."""

    fast_s: float
    idle_s: float
    tried: dict[str, float] = field(default_factory=dict)  # engine -> monotonic time

    @property
    def tick_s(self) -> float:
        return min(self.fast_s, self.idle_s)

    def interval(self, load: EngineLoad, kv_high: float, held: bool) -> float:
        if held or near_mark(load, kv_high):
            return self.fast_s
        return self.idle_s

    def due(self, name: str, load: EngineLoad, kv_high: float, held: bool, now: float) -> bool:
        """``name`` is to be read now (its last read was tried an interval ago, or never)."""
        last = self.tried.get(name)
        # a tick may come a little early (the sleep's rounding): 5 % of slack
        return last is None or now - last >= 0.95 * self.interval(load, kv_high, held)
