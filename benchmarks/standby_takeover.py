#!/usr/bin/env python3
"""A warm standby takes over from a killed engine: how fast, and at what cost? (issue 55:
"an engine back in service in seconds")

Per run: two fresh host-native vLLM CPU engines (the `vllm` tests' venv and tiny model, as
``tests/proxy/test_vllm_migration.py`` starts them): A on core 0, active; S on core 1, a warm
standby (``"standby": true`` in the backend table). The real proxy in front, in this process
(``pdstack.testing.proxy_harness``), with the production health budgets (``--health-interval``
2 s, ``--health-timeout`` 2 s; every other setting its default). Two warm-up requests go
through the proxy (to A); then an open loop of streamed completions (``--rate`` req/s for
``--duration`` s; a 60-word prompt of its own each, ``--max-tokens`` tokens, greedy,
``ignore_eos``), and at ``--kill-at`` s A's whole process group (API server and engine core)
gets SIGKILL. Then the proxy goes, S is stopped, and the next run starts two new engines.

Recorded, one clock (``time.monotonic``, seconds from the first request):

- per request: sent, first token, end, HTTP status, tokens, error events, and which engine
  served it: the proxy's legs and stream migrations, seen by wrapping its ``_stream_leg`` and
  ``_continue_on`` (in this process; nothing in pdstack/ changes) and matched to the client's
  ``X-Request-Id``;
- the proxy's log (``pdstack.*`` loggers): ``standby ... in rotation``, migrations, failed legs;
- the streams on A at the kill and what became of them; from the kill to the first token S
  served (a migrated stream's first token there, or a new request's), and to the first
  request sent after the kill that completed; TTFT P50 / P99 of the requests sent before and
  after the kill (P99 nearest rank: of 20 values the largest);
- what S costs while it waits: the CPU time and RSS / PSS of every process in its process
  group (``/proc``) from the first request to the kill (S gets no request then), A's beside
  it; and each engine's start (spawn to ``/health`` 200, polled each second).

    # takes the heavy-run lock itself; under flock(1) say it is held, or both wait forever:
    flock /tmp/pdstack-heavy.lock env PDSTACK_HEAVY_LOCK_HELD=1 .venv/bin/python \\
        benchmarks/standby_takeover.py --runs 3 --kill-at 10.05 --label "kill mid-stream"
    # ... --kill-at 10.25 --label "kill between streams"

A 64-token stream of the tiny model lasts ~0.13 s here, so at 2 req/s at most one is on A at
a time: ``--kill-at 10.05`` kills A 50 ms into the 21st request's stream (it must migrate),
``10.25`` between two streams (the next request finds A dead).

Writes the JSON (every request, log line and sample; one entry per ``--label``, merged) and
a Markdown table of every set in it beside it (``.md``). Results: benchmarks/README.md,
docs/self-healing.md ("A warm standby").
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime as dt
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdstack.proxy.app import Proxy  # noqa: E402
from pdstack.testing import proxy_harness as ph  # noqa: E402
from pdstack.testing import vllm_engines as ve  # noqa: E402
from pdstack.testing.heavy import heavy_lock  # noqa: E402
from pdstack.testing.proc_stats import cpu_seconds  # noqa: E402

GEN = "tiny-s1@cpu"
ACTIVE = "n1/engine-a"
STANDBY = "n1/engine-s"
# the proxy's production health budgets (pdstack.proxy.config.ProxyConfig defaults; the
# harness's own defaults are test values)
PROXY_CONFIG: dict[str, Any] = {"health_interval_s": 2.0, "health_timeout_s": 2.0}
# the engines' CPU and memory are read this long before the kill (the window: first request
# to then)
USAGE_LEAD_S = 0.25
PAGE = os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------ what the proxy did
@dataclass
class Seen:
    """The proxy's legs and migrations by request id, and its log, on the run's clock."""

    t0: float = 0.0
    legs: dict[str, list[tuple[str, str, float]]] = field(default_factory=dict)
    log: list[tuple[float, str, str, str]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def leg(self, request_id: str, kind: str, backend: str) -> None:
        self.legs.setdefault(request_id, []).append((kind, backend, round(self.now(), 4)))


class _Capture(logging.Handler):
    def __init__(self, seen: Seen) -> None:
        super().__init__(logging.INFO)
        self.seen = seen

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.log.append((round(self.seen.now(), 4), record.levelname, record.name,
                              record.getMessage()))


@contextmanager
def watching(seen: Seen) -> Iterator[None]:
    """The proxy's streaming legs and stream continuations recorded into ``seen`` (its
    methods wrapped on the class, put back after), and its log captured."""
    stream_leg: Callable[..., Any] = Proxy._stream_leg
    continue_on: Callable[..., Any] = Proxy._continue_on

    async def _stream_leg(self: Proxy, request: Any, ctx: Any, backend: Any,
                          payload: bytes) -> Any:
        seen.leg(ctx.request_id, "leg", backend.name)
        return await stream_leg(self, request, ctx, backend, payload)

    async def _continue_on(self: Proxy, ctx: Any, target: Any, *args: Any) -> Any:
        seen.leg(ctx.request_id, "migrate", target.name)
        return await continue_on(self, ctx, target, *args)

    handler = _Capture(seen)
    logger = logging.getLogger("pdstack")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    Proxy._stream_leg = _stream_leg  # type: ignore[method-assign,assignment]
    Proxy._continue_on = _continue_on  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Proxy._stream_leg = stream_leg  # type: ignore[method-assign]
        Proxy._continue_on = continue_on  # type: ignore[method-assign]
        logger.removeHandler(handler)
        logger.setLevel(level)


# ------------------------------------------------------------------ /proc
def group_pids(pgid: int) -> list[int]:
    """Every live process of process group ``pgid`` (an engine's: taskset execs vLLM, which
    leads its own session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def memory_mib(pids: list[int]) -> dict[str, float]:
    """RSS and PSS (shared pages split among their users) of ``pids``, MiB."""
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss += int(f.read().split()[1]) * PAGE
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return {"rss_mib": round(rss / 2**20, 1), "pss_mib": round(pss / 2**20, 1)}


@dataclass
class Usage:
    """An engine's processes: CPU time at the window's start, then its cost over it."""

    pgid: int
    pids: list[int] = field(default_factory=list)
    start_cpu: float = 0.0
    start_at: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)

    def begin(self) -> None:
        self.pids = group_pids(self.pgid)
        self.start_cpu, self.start_at = cpu_seconds(self.pids), time.monotonic()

    def end(self) -> None:
        wall = time.monotonic() - self.start_at
        used = cpu_seconds(self.pids) - self.start_cpu
        self.result = {"processes": len(self.pids), "window_s": round(wall, 2),
                       "cpu_s": round(used, 3), "cpu_pct": round(100 * used / wall, 1),
                       **memory_mib(self.pids)}


# ------------------------------------------------------------------ the client
@dataclass
class Request:
    i: int
    request_id: str
    sent: float
    max_tokens: int
    first_token: float | None = None
    end: float | None = None
    status: int = 0
    tokens: int = 0
    completion_tokens: int | None = None
    done: bool = False
    error_events: list[Any] = field(default_factory=list)
    exception: str = ""
    legs: list[tuple[str, str, float]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.status == 200 and self.done and not self.error_events
                and not self.exception and self.tokens > 0
                and self.completion_tokens == self.max_tokens)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def first_by(self) -> str:
        """The engine whose leg sent the first token (the last try's)."""
        return next((b for k, b, _ in reversed(self.legs) if k == "leg"), "")

    @property
    def served_by(self) -> str:
        """The engine that sent the last token: the last migration's target, else first_by."""
        return self.legs[-1][1] if self.legs else ""


async def one_request(session: aiohttp.ClientSession, url: str, req: Request, seen: Seen,
                      run: int) -> None:
    body = {"model": ve.SERVED_NAME, "prompt": ve.prompt_of(60, seed=1000 * run + req.i),
            "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with session.post(url + "/v1/completions", json=body,
                                headers={"X-Request-Id": req.request_id}) as resp:
            req.status = resp.status
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: "):
                        continue
                    if event == b"data: [DONE]":
                        req.done = True
                        continue
                    doc = json.loads(event[6:])
                    if "error" in doc:
                        req.error_events.append(doc["error"])
                        continue
                    if doc.get("usage"):
                        req.completion_tokens = doc["usage"].get("completion_tokens")
                    if doc.get("choices"):
                        req.tokens += 1
                        if req.first_token is None:
                            req.first_token = seen.now()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        req.exception = f"{type(exc).__name__}: {exc}"
    req.end = seen.now()


# ------------------------------------------------------------------ one run
def start_pair(run: int) -> tuple[ve.Proc, ve.Proc, dict[str, float]]:
    """A (core 0) and S (core 1), fresh; each one's spawn -> /health 200, seconds."""
    procs = [ve.start_engine(f"standby-{x}-run{run}", ve.free_port(), cpu, None)
             for x, cpu in (("a", "0"), ("s", "1"))]
    t0 = time.monotonic()

    def ready(proc: ve.Proc) -> float:
        ve.wait_ready([proc])
        return round(time.monotonic() - t0, 1)

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            times = list(pool.map(ready, procs))
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs[0], procs[1], {"a_ready_s": times[0], "s_ready_s": times[1]}


def table(a: ve.Proc, s: ve.Proc) -> dict[str, Any]:
    return ph.table("colocated", [
        {"name": ACTIVE, "role": "colocated", "node": "n1", "url": a.url, "generation": GEN},
        {"name": STANDBY, "role": "colocated", "node": "n1", "url": s.url, "generation": GEN,
         "standby": True},
    ], served_model_name=ve.SERVED_NAME)


def pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None}
    return {"n": len(values), "p50": round(statistics.median(values), 3),
            "p99": round(ph.p99(values), 3)}


async def traffic(a: ve.Proc, s: ve.Proc, args: argparse.Namespace, run: int
                  ) -> dict[str, Any]:
    seen = Seen()
    usage = {ACTIVE: Usage(a.popen.pid), STANDBY: Usage(s.popen.pid)}
    with watching(seen):
        async with ph.running_proxy(table(a, s), **PROXY_CONFIG) as rp:
            reg = rp.registry.backends
            await ph.until(lambda: reg[ACTIVE].usable and reg[STANDBY].usable,
                           "both engines admitted", 60)
            for w in range(2):  # warm-up, to A (S, a standby, gets none)
                warm = Request(-1 - w, f"sb{run}-warm{w}", 0.0, args.max_tokens)
                await one_request(rp.session, rp.url, warm, seen, run)
                assert warm.ok, warm
            served_before = {n: b.served for n, b in reg.items()}
            seen.legs.clear()
            seen.log.clear()
            requests: list[Request] = []
            tasks: list[asyncio.Task[None]] = []
            kill: dict[str, Any] = {}

            def end_usage() -> None:
                for u in usage.values():
                    u.end()

            async def killer() -> None:
                # the /proc reads (~50 ms on 2 cores) off the event loop and before the
                # kill, so neither the kill nor a request is late for them
                await asyncio.sleep(max(0.0, args.kill_at - USAGE_LEAD_S - seen.now()))
                await asyncio.to_thread(end_usage)
                await asyncio.sleep(max(0.0, args.kill_at - seen.now()))
                kill["standby_served_before"] = reg[STANDBY].served - served_before[STANDBY]
                kill["a_in_flight_proxy"] = reg[ACTIVE].in_flight
                os.killpg(a.popen.pid, signal.SIGKILL)
                kill["t"] = seen.now()
                seen.log.append((round(kill["t"], 4), "BENCH", "bench", "SIGKILL engine A"))

            for u in usage.values():
                u.begin()
            seen.t0 = time.monotonic()
            kill_task = asyncio.create_task(killer())
            i = 0
            while (now := seen.now()) < args.duration:
                if i / args.rate > now:
                    await asyncio.sleep(i / args.rate - now)
                req = Request(i, f"sb{run}-{i:03d}", seen.now(), args.max_tokens)
                requests.append(req)
                tasks.append(asyncio.create_task(one_request(rp.session, rp.url, req, seen, run)))
                i += 1
            await kill_task
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
            await ph.until(lambda: rp.proxy.in_flight == 0, "every handler ended", 30)
            metrics = await rp.metrics()
            async with rp.session.get(f"{rp.url}/admin/backends",
                                      headers=rp.admin_headers()) as resp:
                backends = await resp.json()
    a.popen.wait(30)  # reaped: it was SIGKILLed
    for req in requests:
        req.legs = seen.legs.get(req.request_id, [])
    return summarize(requests, seen, kill, usage, metrics, backends, args)


def summarize(requests: list[Request], seen: Seen, kill: dict[str, Any],
              usage: dict[str, Usage], metrics: str, backends: Any,
              args: argparse.Namespace) -> dict[str, Any]:
    k = kill["t"]
    before = [r for r in requests if r.sent < k]
    after = [r for r in requests if r.sent >= k]
    on_a = [r for r in before if r.end is not None and r.end > k and ACTIVE in
            {b for _, b, _ in r.legs}]
    streaming = [r for r in on_a if r.first_token is not None and r.first_token < k]
    migrated_at = [t for t, _, _, msg in seen.log
                   if msg.startswith("migrated request") and f" {STANDBY} " in msg]
    s_first = [r.first_token for r in requests
               if r.first_by == STANDBY and r.first_token is not None]
    after_ok = [r.end for r in after if r.ok and r.end is not None]
    after_first = [r.first_token for r in after if r.first_token is not None]
    failed = [r for r in requests if not r.ok]

    def m(name: str, **labels: str) -> float:
        return ph.metric_value(metrics, name, **labels)

    first_s = min([*migrated_at, *s_first], default=None)
    return {
        "kill_at_s": round(k, 3),
        "requests": len(requests),
        "failed": len(failed),
        "failed_detail": [{"i": r.i, "status": r.status, "exception": r.exception,
                           "error_events": r.error_events, "tokens": r.tokens,
                           "legs": r.legs} for r in failed],
        # legs (tries and migrations) sent to S before the kill; and its served counter
        "standby_requests_before_kill": sum(
            1 for r in requests for _, b, t in r.legs if b == STANDBY and t < k),
        "standby_served_counter_at_kill": kill["standby_served_before"],
        "a_in_flight_at_kill": {
            "proxy_count": kill["a_in_flight_proxy"],
            "streams": len(on_a),
            "streaming_first_token_before_kill": len(streaming),
            "waiting_first_token": len(on_a) - len(streaming),
            "completed": sum(1 for r in on_a if r.ok),
            "migrated": sum(1 for r in on_a if any(kd == "migrate" for kd, _, _ in r.legs)),
            "retried_before_first_byte": sum(
                1 for r in on_a if sum(1 for kd, _, _ in r.legs if kd == "leg") > 1),
        },
        "kill_to_first_standby_token_s": None if first_s is None else round(first_s - k, 3),
        "kill_to_first_migrated_token_s": (round(min(migrated_at) - k, 3)
                                           if migrated_at else None),
        "kill_to_first_new_request_completed_s": (round(min(after_ok) - k, 3)
                                                  if after_ok else None),
        "kill_to_first_new_request_first_token_s": (round(min(after_first) - k, 3)
                                                    if after_first else None),
        "ttft_before_kill_s": pct([r.ttft for r in before if r.ttft is not None and r.ok]),
        "ttft_after_kill_s": pct([r.ttft for r in after if r.ttft is not None and r.ok]),
        # the engine that sent each request's last token
        "finished_by_sent_after_kill": {
            n: sum(1 for r in after if r.served_by == n) for n in (ACTIVE, STANDBY)},
        "finished_by_sent_before_kill": {
            n: sum(1 for r in before if r.served_by == n) for n in (ACTIVE, STANDBY)},
        "standby_log": [f"{t - k:+.3f}s {msg}" for t, _, _, msg in seen.log
                        if msg.startswith("standby ")],
        "proxy_metrics": {
            "migrations_continued": m("pdstack_proxy_migrations_total", outcome="continued"),
            "migrations_failed": m("pdstack_proxy_migrations_total", outcome="failed"),
            "requests_ok": m("pdstack_proxy_requests_total", outcome="ok"),
            "requests_client_disconnect": m("pdstack_proxy_requests_total",
                                            outcome="client_disconnect"),
            "ejections": m("pdstack_proxy_ejections_total"),
            "migration_gap_mean_s": round(
                m("pdstack_proxy_migration_gap_seconds_sum")
                / max(1.0, m("pdstack_proxy_migration_gap_seconds_count")), 3),
        },
        "idle_cost_before_kill": {"standby": usage[STANDBY].result,
                                  "active": usage[ACTIVE].result},
        "backends_after": backends,
        "log": [list(x) for x in seen.log],
        "per_request": [{**{k2: v for k2, v in asdict(r).items() if k2 != "legs"},
                         "ok": r.ok, "ttft": r.ttft, "first_by": r.first_by,
                         "served_by": r.served_by, "legs": r.legs} for r in requests],
    }


def one_run(args: argparse.Namespace, run: int) -> dict[str, Any]:
    a, s, ready = start_pair(run)
    try:
        result = asyncio.run(traffic(a, s, args, run))
    finally:
        a.stop()
        s.stop()
    return {"run": run, "engine_start": ready, **result}


# ------------------------------------------------------------------ report
def span(values: list[Any], fmt: str = "{:.2f}") -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def markdown(doc: dict[str, Any]) -> str:
    runs = doc["runs"]
    rows: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
        ("requests (failed)", lambda r: f"{r['requests']} ({r['failed']})", "{}"),
        ("standby's requests before the kill", lambda r: r["standby_requests_before_kill"],
         "{}"),
        ("streams on A at the kill: streaming / waiting for a first token",
         lambda r: (f"{r['a_in_flight_at_kill']['streaming_first_token_before_kill']} / "
                    f"{r['a_in_flight_at_kill']['waiting_first_token']}"), "{}"),
        ("... completed (migrated, retried)",
         lambda r: (f"{r['a_in_flight_at_kill']['completed']} "
                    f"({r['a_in_flight_at_kill']['migrated']}, "
                    f"{r['a_in_flight_at_kill']['retried_before_first_byte']})"), "{}"),
        ("kill -> S's first token, s", lambda r: r["kill_to_first_standby_token_s"], "{:.3f}"),
        ("kill -> first token of a request sent after it, s",
         lambda r: r["kill_to_first_new_request_first_token_s"], "{:.3f}"),
        ("kill -> first request sent after it completed, s",
         lambda r: r["kill_to_first_new_request_completed_s"], "{:.3f}"),
        ("TTFT P50 / P99 before the kill, ms",
         lambda r: _ms(r["ttft_before_kill_s"]), "{}"),
        ("TTFT P50 / P99 after the kill, ms", lambda r: _ms(r["ttft_after_kill_s"]), "{}"),
        ("requests sent after the kill served by S",
         lambda r: f"{r['finished_by_sent_after_kill'][STANDBY]} of "
                   f"{sum(r['finished_by_sent_after_kill'].values())}", "{}"),
        ("S idle before the kill: CPU %", lambda r: r["idle_cost_before_kill"]["standby"]
         ["cpu_pct"], "{}"),
        ("S idle: RSS / PSS MiB",
         lambda r: (f"{r['idle_cost_before_kill']['standby']['rss_mib']:.0f} / "
                    f"{r['idle_cost_before_kill']['standby']['pss_mib']:.0f}"), "{}"),
        ("A serving 2 req/s: CPU %", lambda r: r["idle_cost_before_kill"]["active"]
         ["cpu_pct"], "{}"),
        ("engine start (spawn -> /health 200), A / S, s",
         lambda r: f"{r['engine_start']['a_ready_s']} / {r['engine_start']['s_ready_s']}",
         "{}"),
    ]
    head = "| | " + " | ".join(f"run {r['run']}" for r in runs) + " |"
    lines = [f"## standby_takeover: {doc['label']} ({doc['when']}, {doc['commit']})", "",
             f"`{doc['command']}`", "", head, "|---" * (len(runs) + 1) + "|"]
    for label, get, fmt in rows:
        cells = []
        for r in runs:
            v = get(r)
            cells.append("-" if v is None else (fmt.format(v) if fmt != "{}" else str(v)))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Proxy log (`standby ...`), seconds from the kill:", ""]
    for r in runs:
        lines += [f"- run {r['run']}: " + "; ".join(f"`{x}`" for x in r["standby_log"])]
    return "\n".join(lines) + "\n"


def _ms(p: dict[str, Any]) -> str:
    if p["p50"] is None:
        return "-"
    return f"{1000 * p['p50']:.0f} / {1000 * p['p99']:.0f} (n={p['n']})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", type=float, default=2.0, help="requests a second")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    parser.add_argument("--kill-at", type=float, default=10.0,
                        help="SIGKILL engine A this many seconds after the first request")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--label", default="kill mid-stream",
                        help="this set's name: sets merge into the JSON by label")
    parser.add_argument("--json", type=Path,
                        default=REPO / "benchmarks/results/standby_takeover_cpu.json")
    args = parser.parse_args()
    if not 0 < args.kill_at < args.duration:
        parser.error("--kill-at must fall inside --duration")
    ve.require_venv()
    runs = []
    with heavy_lock():
        for run in range(1, args.runs + 1):
            print(f"run {run}: starting engines", file=sys.stderr, flush=True)
            runs.append(one_run(args, run))
            r = runs[-1]
            print(f"run {run}: {r['requests']} requests, {r['failed']} failed; kill -> S's "
                  f"first token {r['kill_to_first_standby_token_s']} s, -> first new "
                  f"request done {r['kill_to_first_new_request_completed_s']} s; "
                  f"{r['standby_log']}", file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    doc = {
        "label": args.label,
        "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "command": "benchmarks/standby_takeover.py " + " ".join(sys.argv[1:]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "proxy_config": PROXY_CONFIG,
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "engines": "fresh pair each run: A on core 0 (active), S on core 1 (standby)",
        "runs": runs,
    }
    merged: dict[str, Any] = {"benchmark": "standby_takeover", "sets": {}}
    if args.json.exists():
        merged = json.loads(args.json.read_text())
    merged["sets"][args.label] = doc
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(merged, indent=1) + "\n")
    args.json.with_suffix(".md").write_text(
        "\n".join(markdown(d) for d in merged["sets"].values()))
    print(markdown(doc))


if __name__ == "__main__":
    main()
