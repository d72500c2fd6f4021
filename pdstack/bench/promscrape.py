"""Scrape Prometheus ``/metrics`` endpoints before and after a measurement and
report what moved: prefix-cache hits, prompt tokens by source, pdstack's own counters."""

from __future__ import annotations

import asyncio
from collections import defaultdict
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
    for (name, labels), value in d.items():
        if name.startswith(("pdstack_", "pdstack:")):
            label = ",".join(f"{k}={v}" for k, v in labels)
            pdstack[f"{name}{{{label}}}" if label else name] += value
    out: dict[str, Any] = {
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "prefix_cache_hit_ratio": _ratio(hits, queries),
        "external_prefix_cache_hit_ratio": _ratio(ext_hits, ext_queries),
        "prompt_tokens_by_source": dict(sorted(by_source.items())),
        "prompt_tokens_not_computed_ratio": _ratio(not_computed, all_tokens) if by_source else None,
    }
    if pdstack:
        out["pdstack"] = dict(sorted(pdstack.items()))
    return out
