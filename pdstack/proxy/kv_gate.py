"""The KV gate: would sending a request to an engine now push it into preemption?

vLLM admits a request as soon as its prompt fits in free KV blocks, so under load it fills
GPU KV with prompts and then preempts running requests to find room for their decode
tokens (one H200 with a CPU tier: 20-30x more preemptions, served load flat). The gate
answers one question per engine, from state current at the moment of the decision:

    projected KV tokens + this request's prompt + expected output <= kv_high x capacity

The projection is the proxy's own accounting, updated at admission, first byte and end,
corrected by the engine's ``/metrics`` (a slower, periodic read; never the gate itself):

- every request the proxy sends (or holds) for an engine counts its prompt + expected
  output (``max_tokens``, at most ``output_tokens``) there from its admission to its end;
- a scrape that began at ``t`` reads the engine's KV usage ``U`` (tokens: ``U x capacity``),
  which holds the requests whose first byte came before ``t``, with whatever prefix reuse
  the engine found among them, plus any traffic that does not pass the proxy. The
  projection is then ``U x capacity`` + the expected output still to come of those
  requests + everything sent since (not in ``U`` yet), and a request of ``U`` that ends
  frees its share of it (``U x capacity x its size / their sizes``: shared prefixes free
  less). With no trustworthy scrape (none yet, stale, failed) it is the proxy's own sum.
- with no known capacity (never scraped, not a vLLM engine) the gate cannot judge and
  does not hold; an engine with nothing of the proxy's in flight is always open (a
  request larger than the watermark still runs).

The engine's waiting and running gauges and its preemption counter are read for the
metrics (why it holds what it holds), not for decisions: a waiting queue that is
non-zero for one step is no reason to hold a request the engine schedules next step.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

GATED_ROLES = ("decode", "colocated")
# why a request went or was held (labels of the proxy's admission counters)
OPEN_IDLE = "idle"  # nothing of the proxy's on the engine
OPEN_FITS = "fits"  # projected KV within the watermark
OPEN_UNKNOWN = "no_capacity"  # capacity not known: not judged
HELD_KV = "kv_full"  # would push the engine past the watermark (into preemption)
HELD_RUNNING = "running_cap"  # the engine runs all it can at once (it would queue there)
HELD_QUEUE = "behind_queue"  # earlier requests wait: it goes behind them (fair order)
HELD_SHARE = "tenant_share"  # its tenant holds its share of the engines (.shares)


@dataclass(slots=True)
class InFlight:
    """One of the proxy's requests on an engine."""

    prompt: int
    output: int
    landed_at: float | None = None  # monotonic time of its first byte

    @property
    def size(self) -> int:
        return self.prompt + self.output


@dataclass
class EngineLoad:
    """One gated engine: the proxy's requests there, and its last scrape."""

    capacity_tokens: int = 0
    kv_usage: float = 0.0  # the engine's own, at its last good scrape (0..1)
    waiting: float = 0.0  # read for the metrics only
    running: float = 0.0
    preemptions: float = 0.0
    scraped_at: float = 0.0  # monotonic time the last good scrape started
    requests: dict[str, InFlight] = field(default_factory=dict)
    # the scrape's base: requests landed before it began (their KV is in kv_usage)
    base: dict[str, int] = field(default_factory=dict)  # request id -> size then
    base_sum: int = 0
    base_tokens: float = 0.0  # kv_usage x capacity
    freed: float = 0.0  # base tokens freed by base requests ended since
    base_output: int = 0  # expected output of active base requests (still to come)
    fresh: int = 0  # sizes of active requests not in the base
    total: int = 0  # sizes of every active request

    def add(self, request_id: str, prompt: int, output: int) -> None:
        """The request counts here from now (its admission or its leg)."""
        if request_id in self.requests:
            return
        r = self.requests[request_id] = InFlight(prompt, output)
        self.fresh += r.size
        self.total += r.size

    def land(self, request_id: str) -> None:
        r = self.requests.get(request_id)
        if r is not None and r.landed_at is None:
            r.landed_at = time.monotonic()

    def drop(self, request_id: str) -> bool:
        """The request no longer counts here; True when it did."""
        r = self.requests.pop(request_id, None)
        if r is None:
            return False
        self.total -= r.size
        size = self.base.pop(request_id, None)
        if size is None:
            self.fresh -= r.size
        else:
            self.base_output -= r.output
            if self.base_sum > 0:
                self.freed += self.base_tokens * size / self.base_sum
        return True

    def rebase(self, usage: float, capacity: int, started: float) -> None:
        """A scrape that began at ``started`` read ``usage``: the new base."""
        self.kv_usage = usage
        if capacity:
            self.capacity_tokens = capacity
        self.scraped_at = started
        self.base_tokens = usage * self.capacity_tokens
        self.base = {
            rid: r.size
            for rid, r in self.requests.items()
            if r.landed_at is not None and r.landed_at < started
        }
        self.base_sum = sum(self.base.values())
        self.base_output = sum(self.requests[rid].output for rid in self.base)
        self.fresh = self.total - self.base_sum
        self.freed = 0.0

    def projected(self, fresh_scrape: bool) -> float:
        """KV tokens the engine will hold for what it has now (see the module)."""
        if not fresh_scrape:
            return float(self.total)
        return max(0.0, self.base_tokens - self.freed) + self.base_output + self.fresh

    @property
    def active(self) -> int:
        return len(self.requests)


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The few vLLM series the gate reads. Request counts are summed over label sets
    (an API server fronting data-parallel engines lists one per engine); KV usage is the
    fullest engine's (a fraction per engine: summing would pass 1 and read as percent)."""
    out: dict[str, float] = {}
    wanted = {
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_requests_running": "running",
        "vllm:num_preemptions_total": "preemptions",
    }
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        head, _, raw_value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        if name == "vllm:cache_config_info":
            capacity = _capacity(rest)
            if capacity:
                out["capacity_tokens"] = float(capacity)
            continue
        key = wanted.get(name)
        if key is None:
            continue
        try:
            value = float(raw_value)
        except ValueError:
            continue
        if key == "kv_usage":
            out[key] = max(out.get(key, 0.0), value)
        else:
            out[key] = out.get(key, 0.0) + value
    return out


def _capacity(rest: str) -> int:
    labels = _labels(rest)
    try:
        blocks = int(float(labels.get("num_gpu_blocks", "0")))
        size = int(float(labels.get("block_size", "0")))
    except ValueError:
        return 0
    return blocks * size


def _labels(rest: str) -> dict[str, str]:
    body = rest.split("}", 1)[0]
    labels: dict[str, str] = {}
    for part in body.split('",'):
        key, _, value = part.partition("=")
        if key:
            labels[key.strip()] = value.strip().strip('"')
    return labels


def prompt_tokens(body: dict[str, Any], text_len: int, chars_per_token: float) -> int:
    """The request's prompt in tokens: exact for token-id prompts, else estimated."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    return max(1, int(text_len / chars_per_token))


async def scrape(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    load: EngineLoad,
    timeout_s: float,
) -> bool:
    """Read one engine's ``/metrics`` into ``load`` (True when it was read). A failed or
    foreign scrape changes nothing: its last numbers age until they are stale."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(f"{url}/metrics", headers=headers) as resp:
                if resp.status != 200:
                    return False
                text = await resp.text()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False
    values = parse_engine_metrics(text)
    if "kv_usage" not in values:
        return False
    usage = values["kv_usage"]
    load.waiting = values.get("waiting", 0.0)
    load.running = values.get("running", 0.0)
    load.preemptions = values.get("preemptions", load.preemptions)
    usage = usage / 100.0 if usage > 1.0 else usage
    load.rebase(usage, int(values.get("capacity_tokens", 0)), started)
    return True
