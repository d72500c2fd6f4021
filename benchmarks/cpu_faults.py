#!/usr/bin/env python3
"""Issue 54's acceptance on the real CPU stack: a loaded machine, a flood or a crash never costs
a request the stack could have served.

Brings up compose/cpu (LMCache, prefill-0, decode-0, decode-1, the proxy; real vLLM CPU with the
tiny llama) once, runs the scenarios asked for one after another, takes it down. Traffic is this
script's own aiohttp client: streamed chat (a ~420-token system prompt shared by every request,
longer than one LMCache chunk, + a unique question; ``max_tokens`` answers with ``ignore_eos``),
one record per request: HTTP status, time to the response headers, TTFT (first content delta),
whether the stream completed (a ``finish_reason`` and ``[DONE]``), its error.

Scenarios (acceptance in brackets; every run also reads the proxy's ``/metrics`` before and after
and its log lines of the run):

- ``steady``: ``--runs`` x ``--duration`` s at ``--rate`` req/s, no fault.
  [0 failed; 0 wedge flags: ``pdstack_proxy_wedged_total`` and ``pdstack_proxy_ejections_total``
  unchanged, no "wedged" / "ejected" line in the proxy's log]
- ``flood``: a probe request every 1 s throughout; at t=5 s, 300 concurrent streams at once and
  100 half-open TCP connections to the proxy (a partial HTTP request each, then held).
  [no 5xx but admission's fast 503/429 (each within 100 ms of arrival, with Retry-After); every
  admitted stream completes; probes answered, TTFT P99 <= 5 s; no engine ejected. A probe
  sent while the proxy still judges the flood (its requests being sent, its refusals not all
  answered: ~0.1-0.2 s) is one of 301 identical requests, without a key to tell it from
  them: it counts with the flood (admitted or fast 503) and the table says how many]
- ``lmcache-kill``: ``--rate`` req/s; at t=20 s (then ``--kill-after``, default 40 s, more)
  the LMCache server's main process is SIGKILLed
  (a crash: its restart policy starts it again; ``docker kill`` would count as a manual stop
  and leave it down); ``--runs`` runs, each waits for LMCache healthy and every backend
  routable first. [requests in flight at the kill and arriving within 5 s of it wait <= 5 s
  for their first token; 0 failed; 0 wedge flags]
- ``engine-kill``: ``--rate`` req/s; prefill-0's vLLM SIGKILLed at t=15 s, load on for
  ``--kill-after`` s more (the measured runs: 60), wait until it is re-admitted; then the same
  for decode-0.
  [0 failed apart from a stream that was on the killed decoder]

  .venv/bin/python benchmarks/cpu_faults.py --scenarios steady,flood,lmcache-kill,engine-kill
  # (it takes the heavy-run lock itself: no flock around it)
  # benchmarks/results/cpu_faults.json (one entry per scenario, replaced by a new run of it)
  # benchmarks/results/cpu_faults.md (the table, rewritten from every entry in the JSON)

``--proxy-image`` runs another proxy image (e.g. one built from ``git archive HEAD``); the JSON
records which, and the commit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdstack.compose_up import compose_base, compose_down, compose_up  # noqa: E402
from pdstack.testing.heavy import heavy_lock  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SYSTEM = "You answer in one short sentence. " * 60
FAST_REFUSAL_S = 0.1
WATCHED = ("pdstack_proxy_wedged_total", "pdstack_proxy_ejections_total",
           "pdstack_proxy_admission_rejected_total", "pdstack_proxy_retries_total",
           "pdstack_proxy_decode_fallback", "pdstack_proxy_requests_total",
           "pdstack_proxy_outcome", "pdstack_proxy_admission_")


# ---------------------------------------------------------------- the client


class Client:
    """Streamed chat through the proxy; every request's record in ``self.records``."""

    def __init__(self, proxy: str, model: str, max_tokens: int) -> None:
        self.proxy, self.model, self.max_tokens = proxy, model, max_tokens
        self.records: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        # when each request's headers left this client (its arrival at the proxy, which
        # judges a request on its headers): 300 requests started at once leave over ~0.1-0.2 s
        # of this client's own work (connections, bodies), which is not the proxy's
        trace = aiohttp.TraceConfig()

        async def headers_sent(_s: Any, ctx: Any, _p: Any) -> None:
            rec = ctx.trace_request_ctx
            if rec is not None and rec.get("sent") is None:
                rec["sent"] = self.now() - rec["start"]

        trace.on_request_headers_sent.append(headers_sent)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None),
                                             trace_configs=[trace])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def one(self, kind: str, i: int, max_tokens: int | None = None,
                  timeout: float = 300.0) -> dict[str, Any]:
        assert self.session is not None
        body = {"model": self.model, "stream": True, "temperature": 0, "ignore_eos": True,
                "max_tokens": max_tokens or self.max_tokens,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"{kind} question {i}"}]}
        rec: dict[str, Any] = {"kind": kind, "i": i, "start": self.now(), "wall": time.time(),
                               "status": None, "headers": None, "ttft": None, "end": None,
                               "tokens": 0, "times": [], "completed": False, "error": "",
                               "retry_after": None, "body": "", "sent": None}
        self.records.append(rec)
        finish = done = False
        try:
            async with asyncio.timeout(timeout):
                async with self.session.post(self.proxy + "/v1/chat/completions",
                                             json=body, trace_request_ctx=rec) as r:
                    rec["status"] = r.status
                    rec["headers"] = self.now() - rec["start"]
                    rec["retry_after"] = r.headers.get("Retry-After")
                    if r.status != 200:
                        rec["body"] = (await r.text())[:300]
                        rec["error"] = f"http_{r.status}"
                    else:
                        async for raw in r.content:
                            line = raw.decode(errors="replace").strip()
                            if not line.startswith("data:"):
                                continue
                            data = line[5:].strip()
                            if data == "[DONE]":
                                done = True
                                break
                            event = json.loads(data)
                            if "error" in event:
                                rec["error"] = "stream_error"
                                rec["body"] = json.dumps(event)[:300]
                                break
                            for choice in event.get("choices", []):
                                if (choice.get("delta") or {}).get("content"):
                                    rec["tokens"] += 1
                                    rec["times"].append(round(self.now() - rec["start"], 3))
                                    if rec["ttft"] is None:
                                        rec["ttft"] = self.now() - rec["start"]
                                if choice.get("finish_reason"):
                                    finish = True
                        if not rec["error"]:
                            rec["completed"] = finish and done
                            if not rec["completed"]:
                                rec["error"] = "unfinished"
        except TimeoutError:
            rec["error"] = "timeout"
        except Exception as exc:  # counted, never raised
            rec["error"] = f"{exc.__class__.__name__}: {exc}"[:200]
        rec["end"] = self.now() - rec["start"]
        return rec

    async def paced(self, kind: str, rate: float, duration: float, **kw: Any) -> None:
        """A request every 1/rate s for ``duration`` s (open loop), then wait for them all."""
        tasks = []
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < duration:
            tasks.append(asyncio.create_task(self.one(kind, i, **kw)))
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        await asyncio.gather(*tasks)


def refusal_s(r: dict[str, Any]) -> float:
    """A refusal's time from the request's arrival (its headers sent) to the answer's
    headers; from the request's start where the send was not seen."""
    return r["headers"] - (r.get("sent") or 0.0)


def refused_fast(r: dict[str, Any]) -> bool:
    """Admission's refusal at arrival: 503/429 with Retry-After within FAST_REFUSAL_S of
    the request's arrival."""
    return (r["status"] in (503, 429) and r["retry_after"] is not None
            and r["headers"] is not None and refusal_s(r) <= FAST_REFUSAL_S)


def failed(r: dict[str, Any]) -> bool:
    """Not served and not admission's fast refusal."""
    return not r["completed"] and not refused_fast(r)


def wait_of(r: dict[str, Any]) -> float:
    """Seconds to the first token, or to the end for a request that got none."""
    return r["ttft"] if r["ttft"] is not None else r["end"]


def stall_after(r: dict[str, Any], at: float) -> float:
    """The longest a request waited for its next token (or its end) in an interval that ends
    after ``at`` (seconds on the client's clock): what a fault at ``at`` made it wait."""
    marks = [r["start"], *(r["start"] + t for t in r["times"]), r["start"] + r["end"]]
    return max((b - a for a, b in itertools.pairwise(marks) if b >= at), default=0.0)


def pct(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    vals = sorted(vals)
    return round(vals[min(len(vals) - 1, round(q * (len(vals) - 1)))], 3)


def summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["ttft"] for r in recs if r["ttft"] is not None]
    bad = [r for r in recs if failed(r)]
    refused = [r for r in recs if r["status"] in (503, 429)]
    return {
        "sent": len(recs), "completed": sum(r["completed"] for r in recs),
        "refused_fast": sum(refused_fast(r) for r in recs),
        "refused_slow": sum(not refused_fast(r) for r in refused),
        "refusal_s_max": round(max((refusal_s(r) for r in refused), default=0), 3),
        # the same from the request's start in this client (its own queue included)
        "refusal_s_max_from_start": round(max((r["headers"] for r in refused), default=0), 3),
        "failed": len(bad),
        "errors": sorted({f"{r['error']} {r['body'][:120]}".strip() for r in bad})[:10],
        "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
        "ttft_max": round(max(ttfts), 3) if ttfts else None,
    }


# ---------------------------------------------------------------- the stack


def docker(*args: str, timeout: float = 60) -> str:
    res = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


class Stack:
    def __init__(self, stack: Path, env: dict[str, str]) -> None:
        self.dir, self.env = stack, env
        self.proxy_container = ""
        text = (stack / "compose.yaml").read_text()
        m = re.search(r'"pdstack", "proxy",[^\]]*"--host", "([^"]+)", "--port", "(\d+)"', text)
        if not m:
            raise SystemExit(f"no proxy command in {stack}/compose.yaml")
        self.proxy = f"http://{m.group(1)}:{m.group(2)}"
        self.table = json.loads((stack / "backends.json").read_text())
        self.model = self.table["served_model_name"]

    def compose(self, *args: str, timeout: float = 60) -> str:
        res = subprocess.run([*compose_base(self.dir), *args], capture_output=True, text=True,
                             timeout=timeout, env=self.env)
        return res.stdout + res.stderr

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).strip().splitlines()[0]

    def health(self, service: str) -> str:
        return docker("inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{end}}",
                      self.container(service)).strip()

    def main_pid(self, service: str) -> int:
        """The container's main process: the child of its init (``init: true``)."""
        init = int(docker("inspect", "-f", "{{.State.Pid}}", self.container(service)))
        children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
        return int(children[0]) if children else init

    def crash(self, service: str) -> int:
        pid = self.main_pid(service)
        os.kill(pid, signal.SIGKILL)
        return pid

    async def metrics(self) -> dict[str, float]:
        async with aiohttp.ClientSession() as s, s.get(self.proxy + "/metrics") as r:
            text = await r.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)", line)
            if m and m.group(1).startswith(WATCHED) and not m.group(1).endswith("_created"):
                out[m.group(1)] = float(m.group(2))
        return out

    async def health_status(self) -> str:
        try:
            async with aiohttp.ClientSession() as s, s.get(
                    self.proxy + "/health", timeout=aiohttp.ClientTimeout(total=3)) as r:
                return str((await r.json(content_type=None)).get("status"))
        except Exception as exc:
            return f"error {exc.__class__.__name__}"

    async def wait_routable(self, budget: float, also: str = "") -> float:
        """Until the proxy says ``ok`` (every backend healthy) and ``also`` is healthy."""
        t0 = time.monotonic()
        while True:
            ok = await self.health_status() == "ok"
            if ok and also:
                ok = await asyncio.to_thread(self.health, also) == "healthy"
            if ok:
                return time.monotonic() - t0
            if time.monotonic() - t0 > budget:
                raise RuntimeError(f"stack not routable (and {also or '-'} healthy) "
                                   f"within {budget:.0f} s")
            await asyncio.sleep(1)

    def proxy_log(self, since: float) -> list[str]:
        iso = dt.datetime.fromtimestamp(since, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
        if self.proxy_container:
            res = subprocess.run(["docker", "logs", "--since", iso, self.proxy_container],
                                 capture_output=True, text=True, timeout=120)
            text = res.stdout + res.stderr
        else:
            text = self.compose("logs", "--no-color", "--since", iso, "proxy", timeout=120)
        return [ln for ln in text.splitlines() if re.search(r" (WARNING|ERROR|CRITICAL) ", ln)]


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def flags(d: dict[str, float], log: list[str]) -> dict[str, Any]:
    wedged = sum(v for k, v in d.items() if k.startswith("pdstack_proxy_wedged_total"))
    ejected = {k: v for k, v in d.items() if k.startswith("pdstack_proxy_ejections_total")}
    lines = [ln for ln in log if re.search(r"wedged|ejected backend", ln)]
    return {"wedged": wedged, "ejections": ejected, "log_flags": lines[:20]}


async def measured(stack: Stack, body: Any) -> dict[str, Any]:
    """Metrics and log around ``body()`` (a coroutine function returning a dict)."""
    before = await stack.metrics()
    wall = time.time()
    out = await body()
    await asyncio.sleep(3)  # one health round, so a late flag shows
    d = delta(await stack.metrics(), before)
    log = await asyncio.to_thread(stack.proxy_log, wall - 2)
    out.update({"metrics_delta": d, "proxy_warnings": log[:60], "date": dt.datetime.fromtimestamp(
        wall, dt.UTC).isoformat(timespec="seconds"), "load_avg_1m": os.getloadavg()[0]})
    out.update(flags(d, log))
    return out


# ---------------------------------------------------------------- scenarios


async def steady(stack: Stack, args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    for n in range(args.runs):
        await stack.wait_routable(300)

        async def body() -> dict[str, Any]:
            async with Client(stack.proxy, stack.model, args.max_tokens) as c:
                await c.paced("steady", args.rate, args.duration)
            return {"summary": summary(c.records), "records": c.records}

        run = await measured(stack, body)
        s = run["summary"]
        run["pass"] = s["failed"] == 0 and s["refused_fast"] + s["refused_slow"] == 0 \
            and not run["wedged"] and not run["ejections"] and not run["log_flags"]
        print(f"steady {n + 1}: {json.dumps(s)} wedged={run['wedged']} "
              f"ejections={run['ejections']} flags={len(run['log_flags'])}", flush=True)
        runs.append(run)
    return runs


async def half_open(host: str, port: int, n: int, hold: asyncio.Event,
                    out: dict[str, Any]) -> None:
    """``n`` connections that send a partial request (headers promise a body never sent)."""
    conns = []
    out.update(opened=0, closed_by_proxy=0, closed_at=[], open_failed=0)
    t0 = time.monotonic()
    for _ in range(n):
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            out["open_failed"] += 1
            continue
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
                     b'{"model": "tiny", "messa')
        await writer.drain()
        conns.append((reader, writer))
        out["opened"] += 1

    async def watch(reader: asyncio.StreamReader) -> None:
        try:
            data = await reader.read(65536)
        except OSError:
            data = b""
        out["closed_by_proxy"] += 1
        out["closed_at"].append(round(time.monotonic() - t0, 1))
        if data:
            out.setdefault("answers", []).append(data[:80].decode(errors="replace"))

    watchers = [asyncio.create_task(watch(r)) for r, _ in conns]
    await hold.wait()
    for t in watchers:
        t.cancel()
    for _, w in conns:
        w.close()
    out["closed_at"] = sorted(out["closed_at"])[:10]
    out["answers"] = sorted(set(out.get("answers", [])))[:5]


async def flood(stack: Stack, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [await flood_run(stack, args) for _ in range(args.runs)]


async def flood_run(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    await stack.wait_routable(300)
    host, port = stack.proxy.removeprefix("http://").rsplit(":", 1)

    async def body() -> dict[str, Any]:
        async with Client(stack.proxy, stack.model, args.max_tokens) as c:
            stop = asyncio.Event()
            ho: dict[str, Any] = {}

            async def probes() -> None:
                tasks, i = [], 0
                while not stop.is_set():
                    tasks.append(asyncio.create_task(c.one("probe", i, max_tokens=4)))
                    i += 1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
                await asyncio.gather(*tasks)

            prober = asyncio.create_task(probes())
            await asyncio.sleep(5)
            flood_at = c.now()
            holder = asyncio.create_task(half_open(host, int(port), args.half_open, stop, ho))
            streams = [asyncio.create_task(c.one("flood", i)) for i in range(args.flood)]
            await asyncio.gather(*streams)
            flood_done = c.now()
            await asyncio.sleep(5)
            stop.set()
            await asyncio.gather(prober, holder)
        recs = c.records
        fl = [r for r in recs if r["kind"] == "flood"]
        pr = [r for r in recs if r["kind"] == "probe"]
        # a probe sent while the proxy still judges the flood (its 300 being sent, its
        # refusals not all answered) is one of 301 identical requests (no key tells it from
        # them): judged with the flood, shown apart
        burst_end = max([r["start"] for r in fl]
                        + [r["start"] + r["headers"] for r in fl
                           if r["status"] != 200 and r["headers"] is not None]) + 0.01
        in_burst = [r for r in pr if flood_at - 0.01 <= r["start"] <= burst_end]
        after = [r for r in pr if r not in in_burst]
        return {"flood_at": flood_at, "flood_done_s": round(flood_done - flood_at, 1),
                "burst_s": round(burst_end - flood_at, 3),
                "summary": summary(fl + in_burst), "probes": summary(after),
                "probes_in_burst": summary(in_burst), "half_open": ho, "records": recs}

    run = await measured(stack, body)
    fl, pr = run["summary"], run["probes"]
    admitted = [r for r in run["records"] if r["kind"] == "flood" and r["status"] == 200]
    run["admitted"] = len(admitted)
    run["admitted_completed"] = sum(r["completed"] for r in admitted)
    run["pass"] = (fl["failed"] == 0 and run["admitted_completed"] == len(admitted)
                   and pr["failed"] == 0 and pr["refused_fast"] == 0
                   and (pr["ttft_p99"] or 1e9) <= 5.0 and not run["ejections"])
    print(f"  probes sent in the flood's own {run['burst_s']} s (judged with it): "
          f"{json.dumps(run['probes_in_burst'])}", flush=True)
    print(f"flood: {json.dumps(fl)}\n  probes: {json.dumps(pr)}\n  admitted "
          f"{run['admitted_completed']}/{len(admitted)} completed, half-open "
          f"{json.dumps({k: v for k, v in run['half_open'].items() if k != 'closed_at'})}, "
          f"ejections={run['ejections']} wedged={run['wedged']}", flush=True)
    return run


async def kill_run(stack: Stack, args: argparse.Namespace, service: str, kill_at: float,
                   after: float, window: float = 5.0) -> dict[str, Any]:
    async def body() -> dict[str, Any]:
        async with Client(stack.proxy, stack.model, args.max_tokens) as c:
            traffic = asyncio.create_task(c.paced("load", args.rate, kill_at + after))
            await asyncio.sleep(kill_at)
            killed_at = c.now()
            pid = await asyncio.to_thread(stack.crash, service)
            await traffic
        recs = c.records
        # in flight at the kill, or arriving within ``window`` s of it
        hit = [r for r in recs if r["start"] <= killed_at + window
               and r["start"] + r["end"] >= killed_at]
        return {"service": service, "pid": pid, "killed_at": round(killed_at, 2),
                "summary": summary(recs), "window": summary(hit),
                "window_wait_max": round(max((wait_of(r) for r in hit), default=0), 3),
                # what the kill made them wait: their longest wait for a token (or their end)
                # in an interval that ends after the kill (a first token already there before
                # it does not count; an inter-token stall across it does)
                "window_stall_max": round(max((stall_after(r, killed_at) for r in hit),
                                              default=0), 3),
                "slowest_in_window": sorted(
                    ({"start": round(r["start"] - killed_at, 2), "wait": round(wait_of(r), 2),
                      "stall": round(stall_after(r, killed_at), 2),
                      "error": r["error"]} for r in hit), key=lambda x: -x["wait"])[:5],
                "failed_detail": [{"start": round(r["start"] - killed_at, 2),
                                   "status": r["status"], "tokens": r["tokens"],
                                   "ttft": r["ttft"], "end": round(r["end"], 2),
                                   "error": r["error"], "body": r["body"][:200]}
                                  for r in recs if failed(r)][:20],
                "records": recs}

    return await measured(stack, body)


async def lmcache_kill(stack: Stack, args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    for n in range(args.runs):
        await stack.wait_routable(300, also="lmcache")
        run = await kill_run(stack, args, "lmcache", 20.0, args.kill_after)
        run["back_s"] = round(await stack.wait_routable(300, also="lmcache"), 1)
        s = run["summary"]
        run["pass"] = (s["failed"] == 0 and run["window_wait_max"] <= 5.0
                       and not run["wedged"] and not run["ejections"] and not run["log_flags"])
        print(f"lmcache-kill {n + 1}: {json.dumps(s)} window wait max "
              f"{run['window_wait_max']} wedged={run['wedged']} ejections={run['ejections']} "
              f"slowest={run['slowest_in_window'][:3]}", flush=True)
        runs.append(run)
    return runs


async def engine_kill(stack: Stack, args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    for service in args.engines.split(","):
        await stack.wait_routable(400)
        run = await kill_run(stack, args, service, 15.0, args.kill_after)
        t0 = time.monotonic()
        try:
            await stack.wait_routable(args.readmit_budget, also=service)
            run["readmitted_after_load_s"] = round(time.monotonic() - t0, 1)
        except RuntimeError as exc:
            run["readmitted_after_load_s"] = None
            run["readmit_error"] = str(exc)
        k = run["killed_at"]
        # a stream that was on the killed decoder: answering (status 200, tokens flowing or
        # its headers sent) when the decoder died, and cut
        on_killed = [r for r in run["records"] if failed(r) and service.startswith("decode")
                     and r["status"] == 200 and r["start"] <= k <= r["start"] + r["end"]]
        run["failed_on_killed_decoder"] = len(on_killed)
        run["failed_other"] = run["summary"]["failed"] - len(on_killed)
        run["pass"] = run["failed_other"] == 0
        print(f"engine-kill {service}: {json.dumps(run['summary'])} on the killed decoder "
              f"{len(on_killed)}, other failed {run['failed_other']}, ejections="
              f"{run['ejections']} readmitted {run['readmitted_after_load_s']} s after the load "
              f"failed={run['failed_detail'][:4]}", flush=True)
        runs.append(run)
    return runs


SCENARIOS = {"steady": steady, "flood": flood, "lmcache-kill": lmcache_kill,
             "engine-kill": engine_kill}


# ---------------------------------------------------------------- results


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}".rstrip("0").rstrip(".") if v != int(v) else str(int(v))
    return str(v)


def ej(run: dict[str, Any]) -> str:
    e = run.get("ejections") or {}
    if not e:
        return "0"
    out = []
    for k, v in e.items():
        backend = re.search(r'backend="(?:[^/"]*/)?([^"]+)"', k)
        reason = re.search(r'reason="([^"]+)"', k)
        out.append(f"{backend.group(1) if backend else k} {reason.group(1) if reason else ''} "
                   f"{fmt(v)}")
    return ", ".join(out)


def table(data: dict[str, Any]) -> str:
    head = ("| scenario | run | sent | completed | refused (fast / slow, slowest s) | failed | "
            "TTFT P50 / P99 / max s | fault window: wait / stall max s | wedged | ejections | "
            "acceptance |")
    lines = [head, "|" + "---|" * 11]
    for name in SCENARIOS:
        entry = data.get(name)
        if not entry:
            continue
        for n, run in enumerate(entry["runs"], 1):
            rows = [(f"{n}", run["summary"])]
            if name == "flood":
                rows = [(f"{n}: flood", run["summary"]), (f"{n}: probes", run["probes"])]
                if "probes_in_burst" in run:
                    rows[0] = (f"{n}: flood + {run['probes_in_burst']['sent']} probe(s) sent "
                               f"in its {run['burst_s']} s", run["summary"])
                    rows[1] = (f"{n}: probes after", run["probes"])
            elif name == "engine-kill":
                rows = [(run["service"], run["summary"])]
            for label, s in rows:
                window = "-"
                if name in ("lmcache-kill", "engine-kill"):
                    window = f"{fmt(run.get('window_wait_max'))} / " \
                             f"{fmt(run.get('window_stall_max'))}"
                lines.append(
                    f"| {name} | {label} | {s['sent']} | {s['completed']} | "
                    f"{s['refused_fast']} / {s['refused_slow']}, {fmt(s['refusal_s_max'])} | "
                    f"{s['failed']} | {fmt(s['ttft_p50'])} / {fmt(s['ttft_p99'])} / "
                    f"{fmt(s['ttft_max'])} | {window} | {fmt(run['wedged'])} | {ej(run)} | "
                    f"{'pass' if run['pass'] else 'FAIL'} |")
    notes = []
    for name, entry in data.items():
        if name in SCENARIOS:
            notes.append(f"- {name}: {entry['date']}, {entry['proxy_image']} "
                         f"(commit {entry['commit']}), {entry['note']}")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stack", type=Path, default=REPO / "compose" / "cpu")
    p.add_argument("--scenarios", default="steady,flood,lmcache-kill,engine-kill")
    p.add_argument("--runs", type=int, default=3, help="runs of steady, flood, lmcache-kill")
    p.add_argument("--duration", type=float, default=90.0, help="s of a steady run")
    p.add_argument("--rate", type=float, default=2.0, help="req/s of steady and the kills")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--flood", type=int, default=300, help="concurrent streams of the flood")
    p.add_argument("--half-open", type=int, default=100)
    p.add_argument("--kill-after", type=float, default=40.0,
                   help="s of load after a kill (lmcache-kill: 40, engine-kill: 60 recommended)")
    p.add_argument("--engines", default="prefill-0,decode-0")
    p.add_argument("--readmit-budget", type=float, default=400.0)
    p.add_argument("--proxy-image", default="", help="PDSTACK_PROXY_IMAGE for this run")
    p.add_argument("--proxy-container", default="",
                   help="read the proxy's log from this container (a proxy started by hand "
                        "in place of the stack's, e.g. with other flags) instead of the stack's")
    p.add_argument("--client-nice", type=int, default=-10,
                   help="this process's nice increment (root: < 0 runs the clients ahead of "
                        "the engines' spinning workers, as clients on machines of their own)")
    p.add_argument("--no-up", action="store_true", help="use the stack already running")
    p.add_argument("--keep-up", action="store_true", help="leave the stack running")
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_faults.json")
    return p.parse_args(argv)


async def run_all(stack: Stack, args: argparse.Namespace, data: dict[str, Any]) -> None:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    for name in args.scenarios.split(","):
        t0 = time.monotonic()
        runs = await SCENARIOS[name](stack, args)
        data[name] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                      "proxy_image": stack.env.get("PDSTACK_PROXY_IMAGE", "pdstack/proxy:dev")
                      + (f" (container {stack.proxy_container})" if stack.proxy_container
                         else ""),
                      "commit": commit, "note": args.note, "took_s": round(
                          time.monotonic() - t0), "args": {k: str(v) for k, v in
                                                           vars(args).items()},
                      "runs": runs}
        args.out.write_text(json.dumps(data, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table(data))
        print(f"{name}: {round(time.monotonic() - t0)} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    env = dict(os.environ)
    if args.proxy_image:
        env["PDSTACK_PROXY_IMAGE"] = args.proxy_image
    # the clients are users on machines of their own: here they share 2 cores with three
    # engines that spin (load 14-17), and at normal priority a refusal's time was mostly the
    # client's wait for a core; this process (probes, flood, half-open) runs ahead of them
    if args.client_nice:
        os.nice(args.client_nice)
    stack = Stack(args.stack.resolve(), env)
    stack.proxy_container = args.proxy_container
    with heavy_lock():
        data = json.loads(args.out.read_text()) if args.out.exists() else {}
        try:
            if not args.no_up:
                took = compose_up(stack.dir, timeout=900, env=env, echo=print)
                print(f"up --wait: {took:.0f} s", flush=True)
            asyncio.run(run_all(stack, args, data))
        finally:
            if not args.keep_up:
                compose_down(stack.dir, env=env)
    print(table(data))
    return 0 if all(r["pass"] for k in args.scenarios.split(",") for r in data[k]["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
