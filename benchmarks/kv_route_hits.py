#!/usr/bin/env python3
"""Do routed prompts land where their prefix is? (issue 56, routing run 1's question on CPU)

Three real vLLM CPU engines (the tiny model, a small KV each: the shared prompts fit in three
engines, not in one), publishing their KV events as pdstack plans them (PUB connecting to the
proxy's SUB, a replay ROUTER each), behind one pdstack proxy at a time:

- ``events``: this tree's proxy, routing on the engines' KV events (cost routing);
- ``ring``: the same with ``--kv-events off`` (the prefix hash ring, bounded load);
- ``events@REV`` (``--old REV``): the proxy of an older commit (``git worktree``), e.g. the
  cost routing before stop 63 (every request in flight counted as a prefill).

Each front gets the same many-tenants-like workload through ``pdstack bench`` (token-id
prompts, cold caches by ``--prompt-salt``, the same seed), and the result per front and rate
is the engines' prefix-cache hit ratio (their own counters, summed over the three) beside
TTFT. A CPU engine's speed says nothing about a GPU's: the hit ratio is the point.

  flock /tmp/pdstack-heavy.lock .venv/bin/python benchmarks/kv_route_hits.py --old 965ed2c
  # benchmarks/results/kv_route_hits.json, benchmarks/results/kv_route_hits.txt
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdstack.bench.promscrape import kv_capacity_tokens, parse_samples  # noqa: E402
from pdstack.proxy.kv_events_route import DECISIONS  # noqa: E402
from pdstack.testing import proxy_harness as ph  # noqa: E402
from pdstack.testing import vllm_engines as ve  # noqa: E402
from pdstack.testing.ports import free_port  # noqa: E402

NAMES = ("n1/engine-0", "n1/engine-1", "n1/engine-2")
CORES = ("0", "1", "0")


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def start_engines(kv_bytes: int, sub_port: int) -> tuple[list[ve.Proc], list[int]]:
    procs, replays = [], []
    for name, cpu in zip(NAMES, CORES, strict=True):
        replay = free_port()
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{sub_port}",
                  "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": name}
        procs.append(ve.start_engine(
            name.replace("/", "-"), ve.free_port(), cpu, None, {"PYTHONHASHSEED": "0"},
            ["--kv-events-config", json.dumps(config), "--kv-cache-memory-bytes", str(kv_bytes)],
        ))
        replays.append(replay)
    ve.wait_ready(procs)
    return procs, replays


def table_file(procs: list[ve.Proc], replays: list[int], sub_port: int, path: Path) -> None:
    backends = [{"name": n, "role": "colocated", "node": "n1", "url": p.url, "generation": "g",
                 "kv_events": {"topic": n, "replay": f"tcp://127.0.0.1:{r}"}}
                for n, p, r in zip(NAMES, procs, replays, strict=True)]
    table = ph.table("colocated", backends, served_model_name=ve.SERVED_NAME)
    table["kv_events"] = {"host": "127.0.0.1", "port": sub_port, "hash_seed": "0"}
    path.write_text(json.dumps(table))


def run_front(label: str, code: Path, table: Path, flags: list[str], engines: list[ve.Proc],
              args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(code)}
    log = open(out_dir / f"proxy-{label}.log", "w")  # noqa: SIM115 - the child owns it
    proxy = subprocess.Popen(
        [sys.executable, "-m", "pdstack.cli", "proxy", "--backends", str(table),
         "--host", "127.0.0.1", "--port", str(port), *flags],
        cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(60):
            with contextlib.suppress(OSError):
                http_get(url + "/health")
                break
            time.sleep(0.5)
        time.sleep(3.0)  # the subscriber's first replay: every engine fresh
        result = out_dir / f"bench-{label}.json"
        cmd = [sys.executable, "-m", "pdstack.cli", "bench", "--target", url, "--token-ids",
               "--model", ve.SERVED_NAME, "--system-prompts", str(args.prompts),
               "--system-len", args.system_len, "--shared-share", "0.85",
               "--user-len", "uniform:16:64", "--output-len", args.output_len,
               "--rates", args.rates, "--duration", str(args.duration), "--warmup", "3",
               "--drain-timeout", "60", "--seed", "1", "--prompt-salt", label,
               "--token-id-range", "10:4000", "--label", label, "--output", str(result),
               "--no-progress", *[f for e in engines for f in ("--metrics-url",
                                                                 e.url + "/metrics")]]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        print(done.stdout[-1500:], done.stderr[-1500:], flush=True)
        doc = json.loads(result.read_text())
        metrics = http_get(url + "/metrics")
        decisions = {d: ph.metric_value(metrics, "pdstack_proxy_kv_route_total", decision=d)
                     for d in DECISIONS}
        decisions["waited"] = ph.metric_value(metrics, "pdstack_proxy_admission_waited_total")
    finally:
        proxy.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proxy.wait(15)
        log.close()
    rows = []
    for r in doc["results"]:
        total = (r.get("prometheus") or {}).get("total") or {}
        rows.append({
            "rate": r["request_rate"], "ok": r["completed"], "failed": r["failed"],
            "ttft_p50_ms": r["p50_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
            "hit_ratio": total.get("prefix_cache_hit_ratio"),
            "per_engine": [e.get("prefix_cache_hit_ratio") for e in
                           (r.get("prometheus") or {}).get("endpoints", {}).values()],
        })
    return {"front": label, "flags": flags, "rows": rows, "decisions": decisions}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default=None, help="also the proxy of this commit (events@REV)")
    p.add_argument("--fronts", default="events,ring",
                   help="of events, ring, events-w1, events-63, events-cost (and --old's)")
    p.add_argument("--rates", default="4,8")
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--system-len", default="uniform:400:800")
    p.add_argument("--output-len", default="uniform:32:96")
    p.add_argument("--kv-bytes", type=int, default=24 * 2**20,
                   help="each engine's KV (default 24 MiB: the prompts ~2x one engine's)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" /
                   "kv_route_hits.json")
    args = p.parse_args()
    ve.require_venv()
    tmp = Path(tempfile.mkdtemp(prefix="kv-route-hits-"))
    fronts = [f for f in [("events", REPO, []), ("ring", REPO, ["--kv-events", "off"]),
                          # the cost's parts (routing run 2): a miss weighs 1, and stop 63's
                          ("events-w1", REPO, ["--kv-miss-weight", "1"]),
                          ("events-63", REPO, ["--kv-miss-weight", "1", "--kv-pending-s", "0"]),
                          # stop 65: a prompt held alike goes to the least queued, not home
                          ("events-cost", REPO, ["--kv-unheld", "cost"]),
                          # stop 68: the KV gate on, an engine without headroom filtered
                          # out (the default) or costed (--kv-headroom cost)
                          ("gated", REPO, ["--admission", "kv"]),
                          ("gated-hr", REPO, ["--admission", "kv", "--kv-headroom", "cost"])]
              if f[0] in args.fronts.split(",")]
    if args.old:
        old = tmp / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.old], cwd=REPO,
                       check=True, capture_output=True)
        fronts.append((f"events@{args.old}", old, []))
    sub_port = free_port()
    procs, replays = start_engines(args.kv_bytes, sub_port)
    results = []
    try:
        table = tmp / "backends.json"
        table_file(procs, replays, sub_port, table)
        capacity = kv_capacity_tokens(parse_samples(http_get(procs[0].url + "/metrics")))
        for label, code, flags in fronts:
            results.append(run_front(label, code, table, flags, procs, args, tmp))
    finally:
        for proc in procs:
            proc.stop()
        if args.old:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "old")], cwd=REPO,
                           check=False, capture_output=True)
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                    capture_output=True, text=True).stdout.strip(),
           "engines": {"count": 3, "kv_bytes": args.kv_bytes, "cores": CORES,
                       "kv_capacity_tokens": capacity},
           "workload": {"prompts": args.prompts, "system_len": args.system_len,
                        "shared_share": 0.85, "output_len": args.output_len,
                        "rates": args.rates, "duration_s": args.duration},
           "fronts": results}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["front                 rate   ok  fail  TTFT p50/p99 ms   hit ratio (engines)"]
    for f in results:
        for r in f["rows"]:
            per = " / ".join("-" if h is None else f"{h:.2f}" for h in r["per_engine"])
            lines.append(f"{f['front']:<20} {r['rate']:>5g} {r['ok']:>4} {r['failed']:>5}  "
                         f"{r['ttft_p50_ms'] or 0:>7.0f} / {r['ttft_p99_ms'] or 0:<7.0f}"
                         f"  {r['hit_ratio'] or 0:.2f} ({per})")
        lines.append(f"{'':<20} decisions {f['decisions']}")
    text = "\n".join(lines)
    args.out.with_suffix(".txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
