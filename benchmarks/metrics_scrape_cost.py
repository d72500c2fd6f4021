#!/usr/bin/env python3
"""What does reading a vLLM API server's ``/metrics`` cost the requests it streams? (issue 36)

vLLM renders ``/metrics`` (prometheus_client: every histogram bucket of every series) on the
same asyncio loop that streams tokens, so a scrape may hold back a token. This starts one
real vLLM CPU engine (the tiny llama of the ``vllm`` tests, ``pdstack.testing.vllm_engines``),
sends it traffic so its histograms are populated, then measures:

  1. one ``GET /metrics``: client-side time (P50 / P90 / max over ``--scrapes``) and size;
  2. streaming requests (``--concurrency`` at once, ``--rounds`` blocks): TTFT and ITL with
     no scraper, with a scraper at 4 Hz (KV-aware admission's fast ``scrape_interval_s``,
     0.25 s) and at ``--hot-hz`` (exaggerated, to make a cost visible); the three modes
     alternate block by block, so drift on a shared machine hits each alike.

  flock /tmp/pdstack-heavy.lock .venv/bin/python benchmarks/metrics_scrape_cost.py
  # results: benchmarks/results/metrics_scrape_cost.json (+ .txt with the printed table)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import aiohttp

from pdstack.proxy.engine_metrics import parse_engine_metrics
from pdstack.testing import vllm_engines as ve
from pdstack.testing.heavy import heavy_lock

RESULTS = Path(__file__).parent / "results"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> dict:
    """One streamed completion: TTFT (first token event) and the gaps between events, ms."""
    body = {"model": ve.SERVED_NAME, "prompt": prompt, "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    start = time.perf_counter()
    stamps: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
    return {"ttft_ms": (stamps[0] - start) * 1000, "itl_ms": gaps}


async def scraper(session: aiohttp.ClientSession, url: str, hz: float, took: list[float]) -> None:
    """GET /metrics every 1/hz s (the proxy's loop: sleep, then read), until cancelled."""
    while True:
        await asyncio.sleep(1.0 / hz)
        start = time.perf_counter()
        async with session.get(f"{url}/metrics") as resp:
            await resp.read()
        took.append((time.perf_counter() - start) * 1000)


async def scrape_times(session: aiohttp.ClientSession, url: str, n: int) -> dict:
    """``n`` reads one after another; and what parsing one costs the proxy (its loop)."""
    took, parsed, size = [], [], 0
    for _ in range(n):
        start = time.perf_counter()
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        took.append((time.perf_counter() - start) * 1000)
        size = len(text)
        start = time.perf_counter()
        parse_engine_metrics(text)
        parsed.append((time.perf_counter() - start) * 1000)
        await asyncio.sleep(0.05)
    return {"n": n, "bytes": size, "p50_ms": pct(took, 0.5), "p90_ms": pct(took, 0.9),
            "max_ms": max(took), "mean_ms": statistics.fmean(took),
            "proxy_parse_p50_ms": pct(parsed, 0.5)}  # fmt: skip


async def block(
    session: aiohttp.ClientSession, url: str, hz: float, args: argparse.Namespace, seed: int
) -> tuple[list[dict], list[float]]:
    """``args.concurrency`` streams at once, ``args.per_block`` each, with a scraper at
    ``hz`` (0 = none) running the whole time."""
    took: list[float] = []
    task = asyncio.create_task(scraper(session, url, hz, took)) if hz else None

    async def worker(w: int) -> list[dict]:
        out = []
        for i in range(args.per_block):
            prompt = ve.prompt_of(args.prompt_words, seed * 1000 + w * 100 + i)
            out.append(await stream_one(session, url, prompt, args.output_tokens))
        return out

    try:
        per_worker = await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return [r for rs in per_worker for r in rs], took


def summary(results: list[dict], took: list[float]) -> dict:
    ttft = [r["ttft_ms"] for r in results]
    itl = [g for r in results for g in r["itl_ms"]]
    return {
        "requests": len(results),
        "ttft_mean_ms": statistics.fmean(ttft), "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p90_ms": pct(ttft, 0.9), "ttft_p99_ms": pct(ttft, 0.99),
        "itl_mean_ms": statistics.fmean(itl), "itl_p50_ms": pct(itl, 0.5),
        "itl_p99_ms": pct(itl, 0.99), "itl_max_ms": max(itl),
        "scrapes": len(took), "scrape_p50_ms": pct(took, 0.5) if took else None,
    }  # fmt: skip


async def measure(url: str, args: argparse.Namespace) -> dict:
    modes = {"none": 0.0, "4hz": 4.0, f"{args.hot_hz:g}hz": args.hot_hz}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        before = await scrape_times(session, url, 10)
        prompts = [ve.prompt_of(args.prompt_words, 900_000 + i) for i in range(args.warmup)]
        warm = await asyncio.gather(
            *(stream_one(session, url, p, args.output_tokens) for p in prompts)
        )
        after = await scrape_times(session, url, args.scrapes)
        got: dict[str, tuple[list[dict], list[float]]] = {m: ([], []) for m in modes}
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for m in order:  # every prompt unique: no block gets another's prefix-cache hits
                seed = r * len(modes) + list(modes).index(m) + 1
                res, took = await block(session, url, modes[m], args, seed)
                got[m][0].extend(res)
                got[m][1].extend(took)
    return {
        "scrape_cold": before, "scrape_after_traffic": after, "warmup_requests": len(warm),
        "modes": {m: summary(*got[m]) for m in modes},
    }  # fmt: skip


def table(out: dict) -> str:
    s = out["result"]["scrape_after_traffic"]
    c = out["result"]["scrape_cold"]
    lines = [
        f"GET /metrics, idle engine: cold {c['p50_ms']:.2f} ms P50 ({c['bytes']} B); after "
        f"{out['result']['warmup_requests']} requests: P50 {s['p50_ms']:.2f}, P90 "
        f"{s['p90_ms']:.2f}, max {s['max_ms']:.2f} ms ({s['bytes']} B); the proxy parses it "
        f"in {s['proxy_parse_p50_ms']:.2f} ms",
        "",
        "scraper   reqs  TTFT mean   p50     p90     p99  | ITL mean   p50     p99     max"
        "  | scrapes  scrape p50",
        "-" * 104,
    ]
    for m, v in out["result"]["modes"].items():
        sp = "-" if v["scrape_p50_ms"] is None else f"{v['scrape_p50_ms']:.2f}"
        lines.append(
            f"{m:8} {v['requests']:5} {v['ttft_mean_ms']:9.2f} {v['ttft_p50_ms']:7.2f} "
            f"{v['ttft_p90_ms']:7.2f} {v['ttft_p99_ms']:7.2f} | {v['itl_mean_ms']:7.2f} "
            f"{v['itl_p50_ms']:7.2f} {v['itl_p99_ms']:7.2f} {v['itl_max_ms']:7.2f} | "
            f"{v['scrapes']:7} {sp:>10}"
        )
    lines.append("ms; client-side times; one vLLM CPU engine (tiny llama), scraper in the client")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", default="1", help="cores of the engine (taskset list)")
    p.add_argument("--warmup", type=int, default=64, help="requests before measuring")
    p.add_argument("--scrapes", type=int, default=50)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--per-block", type=int, default=30, help="requests per stream per block")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--hot-hz", type=float, default=20.0)
    p.add_argument("--label", default="metrics_scrape_cost")
    p.add_argument(
        "--engine-arg", action="append", default=[],
        help="extra vllm serve argument (repeat), e.g. --engine-arg=--enable-server-load-tracking",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    ve.require_venv()
    with heavy_lock():
        port = ve.free_port()
        proc = ve.start_engine("scrape-cost", port, args.cpu, None, extra_args=args.engine_arg)
        try:
            ve.wait_ready([proc])
            result = asyncio.run(measure(proc.url, args))
        finally:
            proc.stop()
    out = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "args": vars(args), "cores": os.cpu_count(), "loadavg": os.getloadavg(),
        "result": result,
    }  # fmt: skip
    text = table(out)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.label}.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / f"{args.label}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
