#!/usr/bin/env python3
"""Which lever keeps an interactive tenant fast beside a flooding batch tenant? (issue 37)

One real vLLM CPU engine at a time (the tiny llama of the ``vllm`` tests) behind pdstack's
proxy with two tenants -- ``chat`` (interactive) and ``batch`` (priority batch) -- and the
same traffic for every combination of the levers:

- the engine: ``plain`` (vLLM's own step) or ``step`` (``--max-num-batched-tokens`` STEP and
  ``--long-prefill-token-threshold`` STEP/2: a step in progress when chat arrives is short);
- the proxy: ``default`` (interactive first on, the default prefill share), ``p1`` (a small
  prefill share: the batch tenant prefills one prompt at a time while chat is active),
  ``nofirst`` (``--admission-interactive-first off``), ``p1-nofirst`` (both).

Per engine: chat alone, batch alone (its served rate under the same flood: the yardstick),
then chat + the batch flood through each proxy. Chat: CHAT_RATE req/s, one shared 400-token
prompt, 16-token answers; batch: unique 1,400-1,900-token prompts at BATCH_RATE (more than
the engine serves). What a GPU run must confirm is the shape, not these numbers: on one
core a prompt's prefill takes far longer than on an H200.

  flock /tmp/pdstack-heavy.lock ... or just:
  .venv/bin/python benchmarks/isolation_levers.py      # takes the heavy lock itself
  # results: benchmarks/results/isolation_levers.json (+ .txt with the printed table)
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdstack.proxy.engine_metrics import parse_engine_metrics  # noqa: E402
from pdstack.testing import vllm_engines as ve  # noqa: E402
from pdstack.testing.bench_results import save  # noqa: E402
from pdstack.testing.heavy import heavy_lock  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TENANTS = {"chat": {}, "batch": {"priority": "batch"}}
CHAT = ["--system-prompts", "1", "--system-len", "400", "--shared-share", "1",
        "--user-len", "uniform:16:32", "--output-len", "16"]
ENGINES = ("plain", "step")  # vLLM's own step; --step (run_engine)
PROXIES = ("default", "p1", "nofirst", "p1-nofirst")
BATCH = ["--system-prompts", "1", "--system-len", "uniform:1400:1900", "--shared-share", "0",
         "--user-len", "uniform:16:32", "--output-len", "uniform:16:48"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", default="1", help="the engine's cores (taskset list)")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--chat-rate", type=float, default=2.0)
    p.add_argument("--batch-rate", type=float, default=40.0)
    p.add_argument("--step", type=int, default=256, help="the step engine's token budget")
    p.add_argument("--p1-tokens", type=int, default=1024,
                   help="the p1 proxy's --admission-prefill-tokens")
    p.add_argument("--engines", default="plain,step", help="which engines, in order")
    p.add_argument("--runs", default="chat-alone,batch-alone,flood-default,flood-p1,flood-nofirst",
                   help="which runs per engine: chat-alone, batch-alone, flood-PROXY")
    p.add_argument("--label", default="isolation_levers")
    args = p.parse_args(argv)
    runs = ("chat-alone", "batch-alone", *(f"flood-{x}" for x in PROXIES))
    for flag, value, known in (("--engines", args.engines, ENGINES),
                               ("--runs", args.runs, runs)):
        bad = [v for v in value.split(",") if v not in known]
        if bad:
            p.error(f"{flag}: unknown {', '.join(bad)} (known: {', '.join(known)})")
    return args


def bench(target: str, tenant: str, rate: float, args: argparse.Namespace, out: Path,
          salt: str, env: dict[str, str], metrics: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(REPO / ".venv" / "bin" / "pdstack"), "bench", "--target", target,
         "--model", ve.SERVED_NAME, "--token-ids", "--token-id-range", "10:4000",
         *(CHAT if tenant == "chat" else BATCH), "--tenant", f"{tenant}:1",
         "--rates", f"{rate:g}", "--duration", f"{args.duration:g}", "--warmup", "3",
         "--drain-timeout", "30", "--request-timeout", "90", "--seed", "1",
         "--cache-salt", salt, "--metrics-url", metrics, "--no-progress",
         "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def result(out: Path) -> dict[str, Any]:
    """One bench run of one tenant: its whole result is that tenant's."""
    r = json.loads(out.read_text())["results"][0]
    total = (r.get("prometheus") or {}).get("total", {})
    return {"ttft_p50_ms": r.get("p50_ttft_ms"), "ttft_p99_ms": r.get("p99_ttft_ms"),
            "served": r.get("served_rate"), "completed": r.get("completed"),
            "failed": r.get("failed"), "errors": r.get("errors"),
            "itl_p90_ms": r.get("p90_itl_ms"),
            # the engine's counters over the run (the bench reads its /metrics)
            "preemptions": r.get("preemptions"), "kv_peak": r.get("peak_kv_cache_usage"),
            "gauges": total.get("gauges"), "proxy": total.get("pdstack")}


def quiesce(url: str) -> None:
    """Wait (<= 60 s) until the engine runs and queues nothing (the flood's aborts)."""
    import urllib.request

    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
        except OSError:
            time.sleep(1)
            continue
        gauges = parse_engine_metrics(text)
        if gauges.get("running", 0) + gauges.get("waiting", 0) == 0:
            return
        time.sleep(1)


def run_engine(name: str, extra: list[str], args: argparse.Namespace, tmp: Path,
               keys: dict[str, str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    eng = ve.start_engine(f"iso-{name}", ve.free_port(), args.cpu, None, extra_args=extra)
    proxies: dict[str, subprocess.Popen] = {}
    try:
        ve.wait_ready([eng])
        table_file = tmp / f"backends-{name}.json"
        table_file.write_text(json.dumps({
            "kv_mode": "colocated", "served_model_name": ve.SERVED_NAME,
            "backends": [{"name": "e0", "role": "colocated", "node": "n", "url": eng.url}],
            "pairings": [], "skip_prefill_threshold_tokens": 0, "tenants": TENANTS}))
        p1 = ["--admission-prefill-tokens", str(args.p1_tokens)]
        nofirst = ["--admission-interactive-first", "off"]
        flags = dict(zip(PROXIES, ([], p1, nofirst, p1 + nofirst), strict=True))
        runs = args.runs.split(",")
        flags = {k: v for k, v in flags.items() if f"flood-{k}" in runs or k == "default"}
        penv = {**os.environ,
                "PDSTACK_TENANT_KEYS": ",".join(f"{t}:{k}" for t, k in keys.items())}
        benv = {**os.environ, **{f"PDSTACK_BENCH_KEY_{t.upper()}": k for t, k in keys.items()}}
        ports: dict[str, int] = {}
        for proxy, extra_flags in flags.items():
            ports[proxy] = ve.free_port()
            proxies[proxy] = subprocess.Popen(
                [str(REPO / ".venv" / "bin" / "python"), "-m", "pdstack.cli", "proxy",
                 "--backends", str(table_file), "--host", "127.0.0.1",
                 "--port", str(ports[proxy]), "--admission", "kv", *extra_flags],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=penv)
        time.sleep(3)
        metrics = f"{eng.url}/metrics"

        def one(variant: str, proxy: str, chat: bool, batch: bool) -> None:
            quiesce(eng.url)
            target = f"http://127.0.0.1:{ports[proxy]}"
            runs = {}
            for tenant, rate, on in (("batch", args.batch_rate, batch),
                                     ("chat", args.chat_rate, chat)):
                if on:  # batch first: the flood is on when chat starts
                    out = tmp / f"{name}-{variant}-{tenant}.json"
                    runs[tenant] = (out, bench(target, tenant, rate, args, out,
                                               f"{name}-{variant}-{tenant}", benv, metrics))
            row: dict[str, Any] = {"engine": name, "variant": variant}
            for tenant, (out, proc) in runs.items():
                proc.wait(timeout=args.duration + 200)
                row[tenant] = result(out) if out.exists() else None
            rows.append(row)
            print(line(row), flush=True)

        for run in runs:
            if run == "chat-alone":
                one(run, "default", True, False)
            elif run == "batch-alone":
                one(run, "default", False, True)
            else:
                one(run, run.removeprefix("flood-"), True, True)
    finally:
        for p in proxies.values():
            p.terminate()
        eng.stop()
    return rows


def line(r: dict[str, Any]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)
    c, b = r.get("chat") or {}, r.get("batch") or {}
    return (f"{r['engine']:6} {r['variant']:14} {f(c.get('ttft_p50_ms'), '8.0f')} "
            f"{f(c.get('ttft_p99_ms'), '8.0f')} {f(c.get('served'), '7.2f')} "
            f"{f(c.get('failed'), '5')} {f(b.get('served'), '8.2f')} {f(b.get('failed'), '6')}")


def table(rows: list[dict[str, Any]]) -> str:
    head = ("engine variant        chat P50  chat P99  served  fail  batch/s  bfail")
    return "\n".join([head, "-" * len(head), *(line(r) for r in rows),
                      "ms; req/s; chat via the proxy's tenant chat, batch via batch"])


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    ve.require_venv()
    keys = {t: f"sk-{secrets.token_hex(16)}" for t in TENANTS}
    engines = {"plain": [],
               "step": ["--max-num-batched-tokens", str(args.step),
                        "--long-prefill-token-threshold", str(args.step // 2)]}
    engines = {name: engines[name] for name in args.engines.split(",")}
    rows: list[dict[str, Any]] = []
    with heavy_lock(), tempfile.TemporaryDirectory() as tmp:
        for name, extra in engines.items():
            rows += run_engine(name, extra, args, Path(tmp), keys)
    save(RESULTS, args, {"engines": engines}, rows, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
