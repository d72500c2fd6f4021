#!/usr/bin/env python3
"""What does pdstack's proxy add to one request on a real vLLM engine, with nothing queued?
(issue 53: below the knee the proxy added 6-35 ms TTFT P50 on one H100, overload run 3)

One host-native vLLM CPU engine (the `vllm` tests' venv and tiny model, pinned to core 1),
two proxies in front of it on core 0 (colocated backend table, ``--admission kv``): the
default, and ``--max-migrations 0`` (its requests carry no ``return_token_ids``). Streamed
chat requests, one at a time, interleaved straight / proxy / proxy without migration, each
with its own ~1,100-token system prompt (no prefix shared between requests) and 32 output
tokens; TTFT is the first content delta, E2E the stream's end. The first 3 rounds are
warm-up and not counted.

This isolates the per-request path (parse, gate, route, relay, the first chunk's prompt token
ids); what it cannot show is load: the GPU gap grew from 12 to 24 req/s.

    .venv/bin/python benchmarks/proxy_path_cost.py [--rounds 40]   # takes the heavy lock
    # benchmarks/results/proxy_path_cost.json (+ .txt: the table)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdstack.testing import vllm_engines as ve  # noqa: E402
from pdstack.testing.heavy import heavy_lock  # noqa: E402
from pdstack.testing.http import wait_http  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
WARMUP = 3
PROXIES = (("proxy", []), ("proxy-nomigr", ["--max-migrations", "0"]))


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, float]:
    """(TTFT ms, E2E ms) of one streamed chat request."""
    t0 = time.perf_counter()
    first = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for chunk in resp.content.iter_any():
            if first is None and b'"content":"' in chunk and b'"content":""' not in chunk:
                first = time.perf_counter()
    assert first is not None, f"{url}: no content"
    return (first - t0) * 1000, (time.perf_counter() - t0) * 1000


async def _measure(urls: dict[str, str], rounds: int) -> dict[str, list[tuple[float, float]]]:
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in urls}
    async with aiohttp.ClientSession() as session:
        for url in urls.values():
            await asyncio.to_thread(wait_http, url + "/health", 60.0)
        for i in range(rounds):
            for k, (name, url) in enumerate(urls.items()):
                system = ve.prompt_of(900, seed=1000 * i + 7 * k + 1)
                body = {"model": ve.SERVED_NAME, "max_tokens": 32, "ignore_eos": True,
                        "temperature": 0, "stream": True,
                        "messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": "hi"}]}
                res[name].append(await _one(session, url, body))
    return res


def _summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    ttft = sorted(s[0] for s in samples[WARMUP:])
    e2e = sorted(s[1] for s in samples[WARMUP:])
    return {"ttft_p50_ms": statistics.median(ttft), "ttft_mean_ms": statistics.mean(ttft),
            "ttft_max_ms": ttft[-1], "e2e_p50_ms": statistics.median(e2e)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--out", type=Path, default=RESULTS / "proxy_path_cost.json")
    args = p.parse_args()
    ve.require_venv()
    procs: list[subprocess.Popen[bytes]] = []
    with heavy_lock():
        engine = ve.start_engine("pathcost", ve.free_port(), "1", None)
        try:
            ve.wait_ready([engine])
            table = {"kv_mode": "colocated", "served_model_name": ve.SERVED_NAME,
                     "backends": [{"name": "e0", "role": "colocated", "node": "n1",
                                   "url": engine.url, "generation": "g1"}],
                     "pairings": [], "skip_prefill_threshold_tokens": 0}
            backends = Path("/tmp/pdstack-proxy-path-cost.json")
            backends.write_text(json.dumps(table))
            urls = {"straight": engine.url}
            for name, extra in PROXIES:
                port = ve.free_port()
                procs.append(subprocess.Popen(
                    ["taskset", "-c", "0", str(REPO / ".venv" / "bin" / "pdstack"), "proxy",
                     "--backends", str(backends), "--host", "127.0.0.1", "--port", str(port),
                     "--admission", "kv", "--admission-ttft-slo", "30", *extra],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                urls[name] = f"http://127.0.0.1:{port}"
            raw = asyncio.run(_measure(urls, args.rounds))
        finally:
            for proc in procs:
                proc.terminate()
            engine.stop()
    summary = {name: _summary(samples) for name, samples in raw.items()}
    base = summary["straight"]
    lines = ["| path | TTFT P50 ms | mean | max | vs straight P50 | E2E P50 ms |",
             "|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['ttft_p50_ms']:.1f} | {s['ttft_mean_ms']:.1f} | "
                     f"{s['ttft_max_ms']:.1f} | {s['ttft_p50_ms'] - base['ttft_p50_ms']:+.1f} | "
                     f"{s['e2e_p50_ms']:.1f} |")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    doc = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit,
           "rounds": args.rounds, "warmup": WARMUP, "summary": summary, "samples": raw}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    table_text = "\n".join(lines)
    args.out.with_suffix(".txt").write_text(
        f"{table_text}\n\n{doc['date']}, commit {commit}, "
        f"{args.rounds} rounds ({WARMUP} warm-up)\n")
    print(table_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
