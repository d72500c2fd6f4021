"""The wait budget: past capacity, refuse at arrival what would miss its TTFT budget.

A queue in front of saturated engines only makes every user late (one H100, a replay at 2x
capacity: everybody waited 35 s, 88 were refused after exactly 60 s). So the gate predicts
each arriving request's time to its first byte from what it already knows, and refuses the
request at once when the prediction is past its class's budget:

    predicted = requests ahead of it / first-byte rate

- *ahead*: the proxy's admitted requests that have no first byte yet (they are in the
  engines' queues or prefill, of any class), plus the waiters in the admission queue that
  leave before it (:meth:`pdstack.proxy.fair_queue.FairQueue.ahead_of`);
- *first-byte rate*: the larger of two views of how fast the backlog leaves. Measured: first
  bytes per *busy* second (a second in which at least one admitted request awaited its first
  byte) over the last ``RATE_WINDOW_S``; idle seconds do not dilute it. Under load that is
  what the engines deliver, whatever spreads the wait (the KV gate, the running cap, the
  engine's own queue). Current: the requests in prefill over the time a request spends
  there lately (``SOJOURN_EWMA`` over first bytes; Little's law): when a burst arrives the
  measured rate still says how fast the *earlier* traffic came, but an engine that is not
  saturated keeps its time per request, so the burst is not refused on the old rate. Only
  up to ``BURST_GROWTH`` x the concurrency the engines were seen to serve lately (the most
  requests in prefill at a first byte in the window): past that nobody knows the engines'
  time per request, and a flood of 300 at once was predicted its pre-flood TTFT, 93x low
  (one vLLM CPU stack, benchmarks/cpu_faults.py). Past capacity both views agree: the time
  in prefill grows, and so does the prediction. With fewer than ``MIN_LANDED`` first bytes
  in the window the rate is unknown and nothing is refused (the queue's deadline judges).
- *capacity*: past the concurrency of the window (a burst), neither view is trusted beyond
  the measured rate of the last time the engines were seen saturated (``SATURATED_MIN`` or
  more in prefill, each there ``SATURATED_X`` x its unloaded time), remembered
  ``CAPACITY_MEMORY_S``: lone requests' pace says nothing of what the engines deliver under
  a flood, when everyone's decode shares them (the CPU stack: quick lone requests
  extrapolated to 74 a second where its floods had been served at 14-21; 249 of 300
  admitted, TTFT P99 13 s against the 6 s SLO, benchmarks/cpu_faults.py on efc833e). Within
  the window's concurrency the live views stand (capped there too, the flood's onset, when
  few first bytes had come, predicted probes 2x late and refused them). Never seen
  saturated: no cap.

The budget of an ``interactive`` request (and of every request without tenants) is
``BUDGET_SHARE`` of the TTFT SLO (``--admission-ttft-slo``, the inventory's
``pdstack_ttft_slo_s``). A ``batch`` request's
budget is the queue's deadline (``queue_timeout_s``). Below capacity the prediction is the
engines' own TTFT, far under the budget: nothing is refused and nothing is held.

Calibration: each request's prediction and its actual time to first byte (arrival at the
gate to the first byte the client got) are exported (``pdstack_proxy_admission_ttft_*``):
their sums and a histogram of actual / predicted. The prediction is also corrected by them:
it is scaled by the recent actual / uncorrected ratio (``SCALE_EWMA``, within
``SCALE_BOUNDS``): on one H100 past its knee the uncorrected prediction was 1.3-1.7x low
(results/h200x1-overload/run1-h100), so a 1.5 s budget let TTFT P99 reach 2.4 s. Only
requests predicted at a concurrency the engines were seen serving teach the correction (a
burst's onset, extrapolated, would drive it to its bound and refuse what follows the burst).
"""

from __future__ import annotations

import math
import time
from collections import deque

RATE_WINDOW_S = 10.0  # first bytes counted over this window
MIN_LANDED = 4  # first bytes in the window below which the rate is unknown
SOJOURN_EWMA = 0.2  # weight of the newest first byte in the time a request spends in prefill
# the current view trusts up to this x the concurrency served lately: an engine that batches
# serves twice the requests in about the time of one; a CPU engine hardly batches
# (--admission-burst-growth; the planner's CPU profile: 1, pdstack.specs)
BURST_GROWTH = 2.0
SCALE_EWMA = 0.05  # weight of the newest first byte in the correction
SCALE_BOUNDS = (0.5, 4.0)  # the correction's range (an outlier cannot run away with it)
RATE_MAX_LANDED = 4096  # first-byte stamps kept (bounded memory at any rate)
# the engines are saturated when at least SATURATED_MIN requests are in prefill at a first
# byte and the time in prefill is SATURATED_X x its unloaded value (its lowest, lately): the
# measured rate then is their capacity, remembered this long
SATURATED_MIN = 4
SATURATED_X = 4.0
CAPACITY_MEMORY_S = 300.0
CAPACITY_EWMA = 0.2  # weight of the newest saturated measurement in the capacity
# an interactive request's budget on its predicted TTFT, as a share of the TTFT SLO (a P99)
# (the prediction is a mean, the SLO a P99; at the default 2 s SLO: 1.5 s)
BUDGET_SHARE = 0.75
TTFT_SLO_S = 2.0  # the default TTFT SLO: chat on GPUs (a CPU deployment's: pdstack.specs)
# actual / predicted time to first byte, histogram bounds
RATIO_BUCKETS = (0.25, 0.5, 0.8, 1.25, 2.0, 4.0, math.inf)
ARRIVALS_MAX = 100_000  # predictions kept for calibration (requests in flight)


class WaitBudget:
    """First-byte accounting and the prediction (single-threaded, asyncio)."""

    def __init__(self, burst_growth: float = BURST_GROWTH) -> None:
        self.burst_growth = burst_growth  # see BURST_GROWTH (a CPU profile's engines: 1)
        self._waiting: dict[str, float] = {}  # admitted, no first byte: request id -> since
        self._busy_cum = 0.0  # busy seconds so far (something awaited a first byte)
        self._busy_since: float | None = None
        self.sojourn = 0.0  # admission to first byte, lately (EWMA; 0 before the first)
        # (monotonic time, busy seconds so far, requests in prefill) at each first byte,
        # last RATE_WINDOW_S
        self._landed: deque[tuple[float, float, int]] = deque(maxlen=RATE_MAX_LANDED)
        # the window's most requests in prefill at a first byte, as (time, count) in falling
        # counts (a sliding maximum: rate() runs at every arrival, a scan of _landed would not)
        self._served_max: deque[tuple[float, int]] = deque()
        # request id -> (arrival, prediction used, uncorrected or 0.0 where it extrapolated
        # past the concurrency seen: it does not teach the correction), for calibration
        self._arrivals: dict[str, tuple[float, float, float]] = {}
        self.scale = 1.0  # actual / uncorrected prediction, lately (the correction)
        self.unloaded = (0.0, 0.0)  # (the lowest time in prefill lately, when)
        self.capacity = (0.0, 0.0)  # (first bytes a second when last saturated, when)
        self.calibrated = 0  # requests with a prediction and a first byte
        self.predicted_sum = 0.0
        self.actual_sum = 0.0
        self.ratio_counts = [0] * len(RATIO_BUCKETS)
        self.ratio_sum = 0.0

    # ------------------------------------------------------------ accounting
    def _busy_now(self, now: float) -> float:
        since = self._busy_since
        return self._busy_cum + (now - since if since is not None else 0.0)

    def admitted(self, request_id: str) -> None:
        """``request_id`` goes to the engines: it awaits its first byte."""
        if not request_id or request_id in self._waiting:
            return
        now = time.monotonic()
        if not self._waiting:
            self._busy_since = now
        self._waiting[request_id] = now

    def _leave(self, request_id: str, now: float, landed: bool = False) -> bool:
        since = self._waiting.pop(request_id, None)
        if since is None:
            return False
        if landed:
            spent, old = now - since, self.sojourn
            self.sojourn = old + SOJOURN_EWMA * (spent - old) if old else spent
        if not self._waiting and self._busy_since is not None:
            self._busy_cum += now - self._busy_since
            self._busy_since = None
        return True

    def landed(self, request_id: str) -> None:
        """The request's first byte reached its client."""
        now = time.monotonic()
        served = len(self._waiting)  # requests in prefill alongside it, itself included
        if self._leave(request_id, now, landed=True):
            self._landed.append((now, self._busy_now(now), served))
            peaks = self._served_max
            while peaks and peaks[-1][1] <= served:
                peaks.pop()
            peaks.append((now, served))
            self._learn_capacity(now, served)
        arrival = self._arrivals.pop(request_id, None)
        if arrival is not None:
            actual = now - arrival[0]
            self._calibrate(actual, arrival[1])
            if arrival[2] > 0:  # a prediction where the engines' concurrency was known
                lo, hi = SCALE_BOUNDS
                ratio = min(hi, max(lo, actual / arrival[2]))
                self.scale += SCALE_EWMA * (ratio - self.scale)

    def ended(self, request_id: str) -> None:
        """The request is over (answered, failed, cancelled) without a first byte counted."""
        self._leave(request_id, time.monotonic())
        self._arrivals.pop(request_id, None)

    def _calibrate(self, actual: float, predicted: float) -> None:
        """One request's prediction (> 0) against its actual time to first byte."""
        self.calibrated += 1
        self.actual_sum += actual
        self.predicted_sum += predicted
        ratio = actual / predicted
        self.ratio_sum += ratio
        for i, bound in enumerate(RATIO_BUCKETS):
            if ratio <= bound:
                self.ratio_counts[i] += 1
                break

    # ------------------------------------------------------------ prediction
    @property
    def in_prefill(self) -> int:
        """The proxy's admitted requests with no first byte yet."""
        return len(self._waiting)

    def rate(self) -> float:
        """How fast the backlog leaves, first bytes a second (see the module); 0.0 when
        unknown."""
        now = time.monotonic()
        landed, peaks = self._trim(now)
        if len(landed) < MIN_LANDED:
            return 0.0
        measured = self._measured(now)
        served = self.burst_growth * peaks[0][1]
        current = min(len(self._waiting), served) / self.sojourn if self.sojourn > 0 else 0.0
        rate = max(measured, current)
        capacity, when = self.capacity
        if (capacity > 0 and now - when <= CAPACITY_MEMORY_S
                and len(self._waiting) > peaks[0][1]):
            return min(rate, capacity)  # past the concurrency of the window: a burst
        return rate

    def _trim(self, now: float) -> tuple[deque[tuple[float, float, int]], deque[tuple[float, int]]]:
        """The window's first-byte stamps and concurrency peaks, older ones dropped."""
        landed = self._landed
        while landed and landed[0][0] < now - RATE_WINDOW_S:
            landed.popleft()
        peaks = self._served_max
        while peaks and (not landed or peaks[0][0] < landed[0][0]):
            peaks.popleft()  # older than the window's (or the bounded deque's) oldest
        return landed, peaks

    def _measured(self, now: float) -> float:
        """First bytes per busy second over the window (its stamps already trimmed)."""
        landed = self._landed
        busy = self._busy_now(now) - landed[0][1]  # busy seconds since the oldest one
        return (len(landed) - 1) / busy if busy > 0 else 0.0

    def _learn_capacity(self, now: float, served: int) -> None:
        """At a first byte: the unloaded time in prefill, and the capacity when saturated."""
        low, seen = self.unloaded
        if not low or self.sojourn < low or now - seen > CAPACITY_MEMORY_S:
            self.unloaded = (self.sojourn, now)
            return
        landed, _ = self._trim(now)
        if served < SATURATED_MIN or self.sojourn < SATURATED_X * low or len(landed) < MIN_LANDED:
            return
        measured = self._measured(now)
        if measured <= 0:
            return
        old, when = self.capacity
        fresh = old > 0 and now - when <= CAPACITY_MEMORY_S
        self.capacity = (old + CAPACITY_EWMA * (measured - old) if fresh else measured, now)

    def predict(self, ahead_in_queue: int) -> float:
        """Seconds an arriving request would wait for its first byte behind
        ``ahead_in_queue`` waiters (corrected); 0.0 when the rate is unknown."""
        rate = self.rate()
        return (ahead_in_queue + self.in_prefill) / rate * self.scale if rate else 0.0

    def arrived(self, request_id: str, predicted: float, ahead_in_queue: int = 0) -> None:
        """Remember the prediction (corrected) until its first byte (calibration). It will
        teach the correction only if the engines were seen serving as many at once lately
        (see :meth:`known_concurrency`)."""
        if request_id and predicted > 0 and len(self._arrivals) < ARRIVALS_MAX:
            uncorrected = predicted / self.scale
            teaches = self.known_concurrency(ahead_in_queue)
            self._arrivals[request_id] = (time.monotonic(), predicted,
                                          uncorrected if teaches else 0.0)

    def known_concurrency(self, ahead_in_queue: int) -> bool:
        """Whether a request arriving behind ``ahead_in_queue`` waiters would be served at a
        concurrency the engines were seen serving in the window (itself included). Past it
        the prediction extrapolates (the time per request at that concurrency is unknown), and
        its miss says nothing about the prediction where it is known: the first 30 of a flood
        of 300 on the CPU stack came 4x late (the bound), which drove the correction to ~3x
        and refused probes for seconds after the flood had drained (benchmarks/cpu_faults.py,
        results cpu_faults_slo6_arrival: probes 3-4 s after it, refused on ~4.5 s predicted,
        came in 0.5-1.5 s)."""
        peak = self._served_max[0][1] if self._served_max else 0
        return ahead_in_queue + self.in_prefill + 1 <= max(peak, 1)
