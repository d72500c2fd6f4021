"""Scrape Prometheus ``/metrics`` endpoints before and after a measurement and
report what moved: prefix-cache hits (local and external), prompt tokens by source,
preemptions, pdstack's own counters and every ``lmcache``-prefixed metric (an LMCache
MP server's HTTP port); and sample the engines' load gauges (KV usage, running,
waiting) every second during the window."""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# A sample: (name, sorted (label, value) pairs) -> value
SampleKey = tuple[str, tuple[tuple[str, str], ...]]
Samples = dict[SampleKey, float]

PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries")
EXTERNAL_HITS = ("vllm:external_prefix_cache_hits_total",)
EXTERNAL_QUERIES = ("vllm:external_prefix_cache_queries_total",)
TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
CACHE_CONFIG_INFO = "vllm:cache_config_info"
# load gauges sampled during the window: key -> the names vLLM versions export
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # 0..1
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
# pdstack's proxy: its KV gate's projection per engine, and how far its count was from the
# engine's at the last scrape (why the gate held, or let an engine preempt)
GATE_PROJECTED = ("pdstack_proxy_engine_projected_tokens",)
GATE_BASE_SCALE = ("pdstack_proxy_engine_base_scale",)
GATE_KV_MARK = ("pdstack_proxy_engine_kv_mark",)  # the watermark (learned: kv_mark.py)
GAUGES: dict[str, tuple[str, ...]] = {
    "kv_cache_usage": KV_USAGE,
    "num_requests_running": RUNNING,
    "num_requests_waiting": WAITING,
    "gate_projected_tokens": GATE_PROJECTED,
    "gate_base_scale": GATE_BASE_SCALE,
    "gate_kv_mark": GATE_KV_MARK,
}
# gauges whose total over endpoints is the largest (a fraction or a ratio), not the sum
_MAX_OVER_ENDPOINTS = ("kv_cache_usage", "gate_base_scale", "gate_kv_mark")


def parse_samples(text: str) -> Samples:
    """Every sample in a Prometheus text exposition."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


async def scrape(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(url) as resp:
        resp.raise_for_status()
        return parse_samples(await resp.text())


async def snapshot(urls: list[str], timeout_s: float = 5.0) -> dict[str, Samples | str]:
    """``{url: samples}``, or ``{url: "error text"}`` for an endpoint that failed."""
    if not urls:
        return {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        got = await asyncio.gather(*(scrape(session, u) for u in urls), return_exceptions=True)
    return {
        u: (g if isinstance(g, dict) else f"{type(g).__name__}: {g}")
        for u, g in zip(urls, got, strict=True)
    }


def delta(before: Samples, after: Samples) -> Samples:
    """after - before for counter-like samples (a reset counts from 0)."""
    out: Samples = {}
    for key, value in after.items():
        name = key[0]
        if name.endswith("_bucket") or name.endswith("_created"):
            continue
        if name.endswith(("_total", "_count", "_sum")):
            prev = before.get(key, 0.0)
            out[key] = value - prev if value >= prev else value
        else:  # a gauge: its value now
            out[key] = value
    return out


def kv_capacity_tokens(samples: Samples) -> int | None:
    """GPU KV capacity in tokens (``num_gpu_blocks * block_size`` of vLLM's
    ``cache_config_info``); the smallest engine's when the endpoint serves several."""
    caps = []
    for (name, labels), _ in samples.items():
        if name != CACHE_CONFIG_INFO:
            continue
        lab = dict(labels)
        try:
            caps.append(int(lab["num_gpu_blocks"]) * int(lab["block_size"]))
        except (KeyError, ValueError):  # "None" before the engine has sized its cache
            continue
    return min(caps) if caps else None


def _sum(samples: Samples, names: tuple[str, ...]) -> float | None:
    vals = [v for (n, _), v in samples.items() if n in names]
    return sum(vals) if vals else None


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or not den:
        return None
    return num / den


def summarize_deltas(
    before: dict[str, Samples | str], after: dict[str, Samples | str]
) -> dict[str, Any]:
    """What the endpoints say about the window: prefix-cache hit ratio (vLLM's
    block-level hits/queries and the token-level share of prompt tokens not computed
    locally), per endpoint and summed, plus pdstack's own metrics."""
    per_url: dict[str, Any] = {}
    total: Samples = defaultdict(float)
    for url, a in after.items():
        b = before.get(url)
        if isinstance(a, str) or isinstance(b, str) or b is None:
            per_url[url] = {"error": a if isinstance(a, str) else b or "no first scrape"}
            continue
        d = delta(b, a)
        per_url[url] = _describe(d)
        for key, value in d.items():
            if key[0].endswith(("_total", "_count", "_sum")):
                total[key] += value
    return {"total": _describe(dict(total)), "endpoints": per_url}


def _describe(d: Samples) -> dict[str, Any]:
    hits, queries = _sum(d, PREFIX_HITS), _sum(d, PREFIX_QUERIES)
    ext_hits, ext_queries = _sum(d, EXTERNAL_HITS), _sum(d, EXTERNAL_QUERIES)
    by_source: dict[str, float] = defaultdict(float)
    for (name, labels), value in d.items():
        if name == TOKENS_BY_SOURCE:
            by_source[dict(labels).get("source", "")] += value
    all_tokens = sum(by_source.values())
    not_computed = all_tokens - by_source.get("local_compute", 0.0)
    pdstack: dict[str, float] = defaultdict(float)
    lmcache: dict[str, float] = defaultdict(float)
    offload: dict[str, float] = defaultdict(float)  # vLLM's native tier (OffloadingConnector)
    for (name, labels), value in d.items():
        if name.startswith(("pdstack_", "pdstack:")):
            box = pdstack
        elif name.lower().startswith("lmcache"):
            box = lmcache
        elif name.startswith("vllm:kv_offload"):
            box = offload
        else:
            continue
        label = ",".join(f"{k}={v}" for k, v in labels)
        box[f"{name}{{{label}}}" if label else name] += value
    out: dict[str, Any] = {
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "prefix_cache_hit_ratio": _ratio(hits, queries),
        "external_prefix_cache_hits": ext_hits,
        "external_prefix_cache_queries": ext_queries,
        "external_prefix_cache_hit_ratio": _ratio(ext_hits, ext_queries),
        "preemptions": _sum(d, PREEMPTIONS),
        "prompt_tokens_by_source": dict(sorted(by_source.items())),
        "prompt_tokens_not_computed_ratio": _ratio(not_computed, all_tokens) if by_source else None,
    }
    if pdstack:
        out["pdstack"] = dict(sorted(pdstack.items()))
    if lmcache:
        out["lmcache"] = dict(sorted(lmcache.items()))
    if offload:
        out["kv_offload"] = dict(sorted(offload.items()))
    return out


def parse_gauges(text: str) -> dict[str, float]:
    """The load gauges of one ``/metrics`` text, cheaply (only their lines are read):
    KV usage and the gate's base scale are the largest engine's, the rest summed."""
    found: dict[str, list[float]] = defaultdict(list)
    wanted = {n: key for key, names in GAUGES.items() for n in names}
    for line in text.splitlines():
        if not line.startswith(("vllm:", "pdstack_proxy_engine_")):
            continue
        head, _, value = line.rpartition(" ")
        key = wanted.get(head.split("{", 1)[0])
        if key is None:
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        if math.isfinite(v):
            found[key].append(v)
    out = {}
    for key, values in found.items():
        out[key] = max(values) if key in _MAX_OVER_ENDPOINTS else sum(values)
    return out


def _peak_mean(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"peak": None, "mean": None}
    return {"peak": max(values), "mean": sum(values) / len(values)}


@dataclass
class GaugeSampler:
    """GETs each URL every ``interval`` s until ``stop_at`` (``perf_counter``), keeping
    only the load gauges; a tick whose GET fails or is late is left out for that URL."""

    urls: list[str]
    interval: float = 1.0
    # one row per tick: {url: gauges} of the URLs that answered
    rows: list[dict[str, dict[str, float]]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)

    async def run(self, stop_at: float) -> None:
        if not self.urls:
            return
        timeout = aiohttp.ClientTimeout(total=max(0.5, min(2.0, self.interval * 2)))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            t0 = time.perf_counter()
            k = 0
            while True:
                now = time.perf_counter()
                if now >= stop_at:
                    break
                got = await asyncio.gather(
                    *(self._one(session, u) for u in self.urls), return_exceptions=True
                )
                row = {}
                for url, g in zip(self.urls, got, strict=True):
                    if isinstance(g, dict):
                        row[url] = g
                    else:
                        self.errors[url] = f"{type(g).__name__}: {g}"
                self.rows.append(row)
                k = max(k + 1, math.ceil((time.perf_counter() - t0) / self.interval))
                delay = min(t0 + k * self.interval, stop_at) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)

    async def _one(self, session: aiohttp.ClientSession, url: str) -> dict[str, float]:
        async with session.get(url) as resp:
            resp.raise_for_status()
            return parse_gauges(await resp.text())

    def summary(self) -> dict[str, Any]:
        """Peak and mean of each gauge per endpoint; in ``total`` per tick the fullest
        KV and the summed running/waiting over the endpoints that answered."""
        endpoints: dict[str, Any] = {}
        for url in self.urls:
            ticks = [row[url] for row in self.rows if url in row]
            endpoints[url] = {
                key: _peak_mean([t[key] for t in ticks if key in t]) for key in GAUGES
            } | {"samples": len(ticks)}
            if url in self.errors:
                endpoints[url]["last_error"] = self.errors[url]
        total: dict[str, Any] = {}
        for key in GAUGES:
            per_tick = []
            for row in self.rows:
                vals = [g[key] for g in row.values() if key in g]
                if vals:
                    per_tick.append(max(vals) if key in _MAX_OVER_ENDPOINTS else sum(vals))
            total[key] = _peak_mean(per_tick)
        total["samples"] = len(self.rows)
        return {"total": total, "endpoints": endpoints}
