#!/usr/bin/env python3
"""How fast does a busy vLLM CPU engine answer ``/health``? (issue 55, with issue 54's "slow
is not dead")

The proxy tells a frozen engine from a slow one by a short ``/health`` probe
(``--stall-probe-timeout``, :mod:`pdstack.proxy.migration_stall`): a frozen engine answers
nothing, a busy one must answer well within the budget. This starts one host-native vLLM CPU
engine (the `vllm` tests' venv and tiny model, pinned to core 0 with its API server, as the
tests run it), loads it in phases and polls its ``/health`` and ``/metrics`` every 0.1 s
meanwhile, printing each one's latency (P50 / P99 / max) and the streams' longest waits
between chunks:

- 6 concurrent streams of 60-word prompts (the migration test's load);
- a flood: 48 concurrent streams of 1000-word prompts, 160 tokens each;
- the same flood with 6 busy-loop processes over the machine's 2 cores (a loaded machine);
- 2 req/s of 300-word prompts with the busy loops.

    .venv/bin/python benchmarks/busy_health.py    # takes the heavy-run lock itself
Results: docs/self-healing.md.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdstack.testing import vllm_engines as ve
from pdstack.testing.heavy import heavy_lock


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def summary(xs: list[float]) -> str:
    return f"n={len(xs)} p50={pct(xs, .5):.3f} p99={pct(xs, .99):.3f} max={max(xs, default=0):.3f}"


async def stream(session: aiohttp.ClientSession, url: str, body: dict, gaps: list[float]) -> None:
    last = None
    async with session.post(url + "/v1/completions", json=body) as resp:
        async for _ in resp.content.iter_any():
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now


async def poll(session: aiohttp.ClientSession, url: str, path: str, lat: list[float],
               stop: asyncio.Event) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=30)) as r:
                await r.read()
            lat.append(time.monotonic() - t0)
        except (TimeoutError, aiohttp.ClientError) as exc:
            lat.append(float("inf"))
            print(path, "failed:", exc)
        await asyncio.sleep(0.1)


async def phase(name: str, url: str, concurrency: int, prompt_words: int, secs: float,
                rate: float = 0.0) -> None:
    gaps: list[float] = []
    health: list[float] = []
    metrics: list[float] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        pollers = [asyncio.create_task(poll(s, url, "/health", health, stop)),
                   asyncio.create_task(poll(s, url, "/metrics", metrics, stop))]
        end = time.monotonic() + secs
        tasks: set[asyncio.Task[None]] = set()
        sent = 0

        def one() -> asyncio.Task[None]:
            body = {"model": ve.SERVED_NAME, "prompt": ve.prompt_of(prompt_words, seed=sent),
                    "max_tokens": 160, "ignore_eos": True, "stream": True, "temperature": 0}
            return asyncio.create_task(stream(s, url, body, gaps))

        while time.monotonic() < end:
            if rate:
                tasks.add(one())
                sent += 1
                await asyncio.sleep(1 / rate)
                continue
            tasks = {t for t in tasks if not t.done()}
            while len(tasks) < concurrency:
                tasks.add(one())
                sent += 1
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        stop.set()
        await asyncio.gather(*pollers)
    print(f"[{name}] /health {summary(health)} | /metrics {summary(metrics)} | "
          f"stream gaps {summary(gaps)} | requests {sent}", flush=True)


async def main() -> None:
    ve.require_venv()
    hogs: list[subprocess.Popen] = []
    with heavy_lock():
        engine = ve.start_engine("busy-health", ve.free_port(), "0", None)
        try:
            ve.wait_ready([engine])
            await phase("6 streams", engine.url, 6, 60, 15)
            await phase("flood: 48 streams, 1000-word prompts", engine.url, 48, 1000, 30)
            hogs = [subprocess.Popen(["taskset", "-c", str(i % 2), sys.executable, "-c",
                                      "while 1: pass"]) for i in range(6)]
            await phase("flood + 6 busy loops", engine.url, 48, 1000, 30)
            await phase("2 req/s + 6 busy loops", engine.url, 0, 300, 30, rate=2)
        finally:
            for hog in hogs:
                hog.kill()
            engine.stop()


if __name__ == "__main__":
    asyncio.run(main())
