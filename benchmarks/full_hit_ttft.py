#!/usr/bin/env python3
"""Where a full-hit request's time to first token goes (issue 12, step 3).

One request at a time (no load), token-id prompts of ``--prefix`` shared tokens plus
``--suffix`` new ones, ``max_tokens`` 1, against each engine given with ``--engine
NAME=URL`` (``NAME=URL,LMCACHE_URL`` for an engine on an LMCache MP server). For every
prompt the phases run in this order:

- ``cold``: the prefix is new everywhere (the engine computes it; LMCache stores it);
- ``tier_hit`` (engines with an LMCache URL): the engine's GPU prefix cache is reset
  (``POST /reset_prefix_cache``), so the prefix comes from LMCache's host-RAM L1;
- ``gpu_hit``: the same prefix again: vLLM's own GPU prefix cache.

Per phase it reports the client's TTFT next to the engine's own per-request histograms
(their deltas over the phase: ``vllm:time_to_first_token_seconds``,
``vllm:request_queue_time_seconds`` = arrival to first scheduled, which includes a wait
for an external KV load, ``vllm:request_prefill_time_seconds`` = first scheduled to first
token), the prompt tokens by source, and every ``lmcache_mp_*`` sum/count that moved.
The rest (client TTFT - engine TTFT) is HTTP, tokenisation-free input handling and the
output path. Prints a table and writes ``--output`` JSON.

    python benchmarks/full_hit_ttft.py --model deepseek-v2-lite \\
        --engine alone=http://127.0.0.1:8111 \\
        --engine tier=http://127.0.0.1:8121,http://127.0.0.1:6021 --output full_hit.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdstack.bench.promscrape import Samples, delta, parse_samples

HISTOGRAMS = {
    "engine_ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"


async def scrape(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(f"{url}/metrics") as resp:
        resp.raise_for_status()
        return parse_samples(await resp.text())


async def post(session: aiohttp.ClientSession, url: str) -> int:
    async with session.post(url) as resp:
        await resp.read()
        return resp.status


async def ttft_of(session: aiohttp.ClientSession, url: str, model: str, ids: list[int]) -> float:
    body = {"model": model, "prompt": ids, "max_tokens": 1, "stream": True, "temperature": 0.0,
            "ignore_eos": True}
    t0 = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                ttft = time.perf_counter() - t0
                async for _ in resp.content:  # drain to the end
                    pass
                return ttft
    raise RuntimeError(f"{url}: no token came back")


def hist_means(d: Samples) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, name in HISTOGRAMS.items():
        total = sum(v for (n, _), v in d.items() if n == f"{name}_sum")
        count = sum(v for (n, _), v in d.items() if n == f"{name}_count")
        out[f"{key}_mean_ms"] = total / count * 1000.0 if count else None
    return out


def by_source(d: Samples) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in d.items():
        if n == TOKENS_BY_SOURCE:
            source = dict(labels).get("source", "?")
            out[source] = out.get(source, 0.0) + v
    return out


def lmcache_moved(d: Samples) -> dict[str, float]:
    return {
        n + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else ""): v
        for (n, labels), v in d.items()
        if n.startswith("lmcache") and n.endswith(("_sum", "_count", "_total")) and v
    }


async def run_engine(
    session: aiohttp.ClientSession, name: str, url: str, lmcache: str | None,
    args: argparse.Namespace, rng: random.Random,
) -> dict[str, Any]:
    phases = ["cold", *(["tier_hit"] if lmcache else []), "gpu_hit"]
    ttfts: dict[str, list[float]] = {p: [] for p in phases}
    moved: dict[str, Samples] = {p: {} for p in phases}
    lm_moved: dict[str, Samples] = {p: {} for p in phases}
    await post(session, f"{url}/reset_prefix_cache")
    if lmcache:
        await post(session, f"{lmcache}/cache/clear")
    for i in range(args.prompts):
        prefix = [rng.randrange(10, 4000) for _ in range(args.prefix)]
        for phase in phases:
            if phase == "tier_hit":
                await asyncio.sleep(args.settle)  # LMCache's store of the cold request
                await post(session, f"{url}/reset_prefix_cache")
            suffix = [rng.randrange(10, 4000) for _ in range(args.suffix)]
            before = await scrape(session, url)
            lm_before = await scrape(session, lmcache) if lmcache else {}
            ttfts[phase].append(await ttft_of(session, url, args.model, prefix + suffix))
            await asyncio.sleep(0.2)  # the engine's histograms are updated after the request
            d = delta(before, await scrape(session, url))
            for k, v in d.items():
                moved[phase][k] = moved[phase].get(k, 0.0) + v
            if lmcache:
                ld = delta(lm_before, await scrape(session, lmcache))
                for k, v in ld.items():
                    lm_moved[phase][k] = lm_moved[phase].get(k, 0.0) + v
        print(f"  {name} prompt {i + 1}/{args.prompts}: "
              + ", ".join(f"{p} {ttfts[p][-1] * 1000:.0f} ms" for p in phases), flush=True)
    out: dict[str, Any] = {"url": url, "lmcache": lmcache, "phases": {}}
    for phase in phases:
        vals = ttfts[phase][1:] if len(ttfts[phase]) > 1 else ttfts[phase]  # first: warm-up
        out["phases"][phase] = {
            "client_ttft_ms": [round(v * 1000, 2) for v in ttfts[phase]],
            "client_ttft_p50_ms": statistics.median(vals) * 1000,
            **hist_means(moved[phase]),
            "prompt_tokens_by_source": by_source(moved[phase]),
            "lmcache": lmcache_moved(lm_moved[phase]),
        }
    return out


def table(doc: dict[str, Any]) -> str:
    rows = ["| engine | phase | client TTFT p50 | engine TTFT | queue (incl. KV load wait) "
            "| prefill | client - engine | tokens computed / cached / external |",
            "|---|---|---|---|---|---|---|---|"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    for name, eng in doc["engines"].items():
        for phase, p in eng["phases"].items():
            src = p["prompt_tokens_by_source"]
            gap = (p["client_ttft_p50_ms"] - p["engine_ttft_mean_ms"]
                   if p["engine_ttft_mean_ms"] is not None else None)
            rows.append(
                f"| {name} | {phase} | {ms(p['client_ttft_p50_ms'])} | "
                f"{ms(p['engine_ttft_mean_ms'])} | {ms(p['queue_mean_ms'])} | "
                f"{ms(p['prefill_mean_ms'])} | {ms(gap)} | "
                f"{src.get('local_compute', 0):.0f} / {src.get('local_cache_hit', 0):.0f} / "
                f"{src.get('external_kv_transfer', 0):.0f} |")
    return "\n".join(rows)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    doc: dict[str, Any] = {
        "tool": "benchmarks/full_hit_ttft.py", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                     time.gmtime()),
        "model": args.model, "prefix_tokens": args.prefix, "suffix_tokens": args.suffix,
        "prompts": args.prompts, "seed": args.seed, "engines": {},
    }
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for spec in args.engine:
            name, _, urls = spec.partition("=")
            url, _, lmcache = urls.partition(",")
            print(f"{name}: {url}" + (f" (LMCache {lmcache})" if lmcache else ""), flush=True)
            doc["engines"][name] = await run_engine(
                session, name, url.rstrip("/"), lmcache.rstrip("/") or None, args, rng)
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", action="append", required=True, metavar="NAME=URL[,LMCACHE]")
    p.add_argument("--model", required=True)
    p.add_argument("--prefix", type=int, default=6000, help="shared prefix tokens")
    p.add_argument("--suffix", type=int, default=200, help="new tokens per request")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds between the cold request and the tier hit (LMCache stores)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args(argv)
    for spec in args.engine:
        if "=" not in spec or not spec.split("=", 1)[1].startswith("http"):
            p.error(f"--engine {spec!r}: expected NAME=URL[,LMCACHE_URL]")
    doc = asyncio.run(main_async(args))
    doc["table"] = table(doc)
    args.output.write_text(json.dumps(doc, indent=1))
    print(doc["table"])
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
