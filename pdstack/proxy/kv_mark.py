"""The KV watermark of one engine, learned from its own first bytes.

The gate holds a request that would push an engine's projected peak KV past a watermark
(:mod:`pdstack.proxy.kv_gate`), because past it vLLM preempts. A preemption costs only
what the engine must compute again: on one H100 near its knee (one engine, long prompts)
the preempted prompts had left the prefix cache and TTFT P99 reached 3.2-5.5 s, while in
front of three engines of the same card at 120 req/s (results/h200x1-routing/run2-h100)
a router with no gate let 448 preemptions through at TTFT P99 0.72 s, and the fixed mark of
0.97 held ~1,700 requests and refused ~400. No fixed mark fits both; the engine's time to
first byte tells which case it is in. So the mark is a controller per engine:

- it starts at ``floor`` (``--admission-kv-high``) and never leaves [floor, ceiling]
  (``--admission-kv-learn-max``; equal to the floor: a fixed mark, the default);
- each first byte from the engine updates its time to first byte (the proxy's send of the
  final leg to its first byte: the engine's queue and prefill, not the proxy's; an EWMA);
- while the mark binds (it held a request within ``BOUND_S``) and that time is under
  ``FAST`` x the TTFT SLO, each first byte raises the mark by ``GROW``: the engine takes
  more than the mark lets through and answers fast;
- whenever that time is over ``SLOW`` x the SLO, each first byte lowers it by ``SHRINK``
  (ten times faster than it grows: preemption that costs shows up in new requests' first
  bytes, and the mark retreats within a fraction of a second at tens of first bytes/s).

The preemption caution (``kv_preempting``) applies at the floor only: above it, the
engine's first bytes have shown its preemptions cheap, and a mark that falls back reaches
the floor, where the caution holds again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GROW = 0.002  # mark added per fast first byte while the mark binds (~35/s: +0.07/s)
SHRINK = 0.02  # mark taken per slow first byte
# of the TTFT SLO: an engine's own time to first byte below it is fast, above SLOW slow (at
# the default 2 s SLO: 0.5 s and 1 s). 0.15 / 0.35 were too strict: past capacity on three
# engines of one H100 (routing run 3, 120 req/s) the engines' own time was 0.29-0.72 s with
# the SLO met by far, and the mark rose only to 1.00-1.08
FAST = 0.25
SLOW = 0.5
EWMA = 0.1  # weight of the newest first byte in the engine's time to first byte
BOUND_S = 2.0  # the mark binds while it held a request this recently


@dataclass(slots=True)
class KvMark:
    """One engine's watermark (a fraction of its KV capacity)."""

    floor: float
    ceiling: float
    value: float = math.nan  # nan: the floor (set in __post_init__)
    first_byte_s: float = 0.0  # the engine's time to first byte lately (EWMA; 0: none yet)
    bound_at: float = -math.inf  # monotonic time the mark last held a request

    def __post_init__(self) -> None:
        self.ceiling = max(self.floor, self.ceiling)
        if math.isnan(self.value):
            self.value = self.floor

    @property
    def at_floor(self) -> bool:
        return self.value <= self.floor

    def held(self, now: float) -> None:
        """The mark held a request (kv_full or kv_preempting) at ``now``."""
        self.bound_at = now

    def first_byte(self, seconds: float, now: float, slo_s: float) -> None:
        """A first byte came ``seconds`` after the final leg went to the engine."""
        if seconds < 0 or not math.isfinite(seconds):
            return
        t = self.first_byte_s
        self.first_byte_s = t = seconds if t <= 0 else (1 - EWMA) * t + EWMA * seconds
        if self.ceiling <= self.floor or slo_s <= 0:
            return  # a fixed mark (the time is still shown in the metrics)
        if t > SLOW * slo_s:
            self.value = max(self.floor, self.value - SHRINK)
        elif t < FAST * slo_s and now - self.bound_at < BOUND_S:
            self.value = min(self.ceiling, self.value + GROW)
