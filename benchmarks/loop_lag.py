#!/usr/bin/env python3
"""What stalls the proxy's event loop under a GPU-like KV-event load? (issues 53, 54)

Routing run 4 (one H100, three vLLM engines, 90-150 req/s of streamed chat, KV-event
routing) saw the proxy's loop lag probe over 100 ms in 3-4 % of its samples and refusals
(decided at arrival) at P99 120-240 ms. This reproduces that load on CPU with test doubles:

- three fake engines (``FakeEngine``, one process) that each publish vLLM KV events as an
  engine with prefix caching and a native CPU tier would (``BlockStored`` for a prompt's
  blocks it did not hold, with their token ids, ``BlockRemoved`` for what its GPU cache and
  CPU tier evict; GPU and CPU capacity in blocks as on the H100: ~21.5 k and ~52 k, full
  from the start), a batch per request;
- the proxy (this tree's, or ``--old REV``'s), run through benchmarks/loop_lag_probe.py:
  garbage-collector pauses, loop-lag samples, the CPU-heavy steps per call, and the loop
  thread's stacks while it stalls;
- an open-loop load (Poisson arrivals at ``--rate``): streamed ``/v1/completions`` with
  token-id prompts of a shared prefix (``--prefixes`` of them) and a unique tail, 1.5-5 k
  tokens; and a ``GET /health`` every 20 ms, which the proxy answers itself: the time a
  refusal decided at arrival takes (its headers alone).

Fronts run one after the other, alternating over ``--rounds``; engines restart for each.

  flock /tmp/pdstack-heavy.lock .venv/bin/python benchmarks/loop_lag.py \
      --fronts before,after --old b05096c --rounds 3
  # benchmarks/results/loop_lag.json (+ .txt)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdstack.testing.ports import free_port  # noqa: E402
from pdstack.testing.proc_stats import CLK_TCK, cpu_seconds  # noqa: E402

NAMES = ("n1/engine-0", "n1/engine-1", "n1/engine-2")
BLOCK = 16


# ---------------------------------------------------------------------------- engines
class EngineCache:
    """One engine's prefix cache as its KV events tell it: GPU blocks (LRU) and a CPU tier
    that stores every computed block (vLLM's native offload), both bounded."""

    def __init__(self, gpu_blocks: int, cpu_blocks: int) -> None:
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self.gpu_blocks, self.cpu_blocks = gpu_blocks, cpu_blocks

    def fill(self, rng: random.Random) -> list[list[Any]]:
        """Full caches of other prompts' blocks (batches of 512), as after a while."""
        from pdstack.proxy.kv_events import BlockStored

        batches = []
        for medium, tier, n in (("GPU", self.gpu, self.gpu_blocks),
                                ("CPU", self.cpu, self.cpu_blocks)):
            hashes = [rng.getrandbits(64) for _ in range(n)]
            for h in hashes:
                tier[h] = None
            for i in range(0, n, 512):
                batches.append([BlockStored(block_hashes=hashes[i:i + 512],
                                            parent_block_hash=hashes[i - 1] if i else 1,
                                            token_ids=[], block_size=BLOCK, medium=medium)])
        return batches

    def prefill(self, tokens: list[int]) -> list[Any]:
        """The events of computing ``tokens``' blocks."""
        from pdstack.proxy.kv_events import BlockRemoved, BlockStored
        from pdstack.proxy.kv_index import HashScheme, block_hashes

        hashes = block_hashes(tokens, BLOCK, HashScheme("0"))
        first = 0
        while first < len(hashes) and hashes[first] in self.gpu:
            self.gpu.move_to_end(hashes[first])
            first += 1
        new = hashes[first:]
        if not new:
            return []
        events: list[Any] = [BlockStored(
            block_hashes=new, parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tokens[first * BLOCK:len(hashes) * BLOCK], block_size=BLOCK,
            medium="GPU")]
        for tier in (self.gpu, self.cpu):
            for h in new:
                tier[h] = None
        events.append(BlockStored(block_hashes=new, parent_block_hash=None, token_ids=[],
                                  block_size=BLOCK, medium="CPU"))
        for medium, tier, cap in (("GPU", self.gpu, self.gpu_blocks),
                                  ("CPU", self.cpu, self.cpu_blocks)):
            gone = [tier.popitem(last=False)[0] for _ in range(max(0, len(tier) - cap))]
            if gone:
                events.append(BlockRemoved(block_hashes=gone, medium=medium))
        return events


async def serve_engines(spec: dict[str, Any]) -> None:
    import gc

    import zmq.asyncio

    from pdstack.testing.fake_server import FakeEngine
    from pdstack.testing.kv_publisher import FakePublisher

    ctx = zmq.asyncio.Context()
    rng = random.Random(7)
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Future[None]] = set()

    class KvEngine(FakeEngine):
        cache: EngineCache
        pub: FakePublisher

        async def _serve(self, request: Any, body: dict[str, Any], *rest: Any) -> Any:
            prompt = body.get("prompt")
            if isinstance(prompt, list):
                loop.call_later(self.ttft_ms / 2000, self._computed, prompt)
            return await super()._serve(request, body, *rest)

        def _computed(self, tokens: list[int]) -> None:
            events = self.cache.prefill(tokens)
            if events:
                task = asyncio.ensure_future(self.pub.publish(*events))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if len(self.pub.buffer) > 4000:
                del self.pub.buffer[:2000]

    engines = []
    for name, port, replay in zip(NAMES, spec["ports"], spec["replays"], strict=True):
        e = KvEngine(name=name, port=port, ttft_ms=spec["ttft_ms"], itl_ms=spec["itl_ms"],
                     output_tokens=spec["output_tokens"], record=False,
                     kv_capacity_tokens=100_000_000)
        e.cache = EngineCache(spec["gpu_blocks"], spec["cpu_blocks"])
        e.pub = FakePublisher(ctx, name, f"tcp://127.0.0.1:{spec['sub_port']}",
                              f"tcp://127.0.0.1:{replay}").start()
        for events in e.cache.fill(rng):
            await e.pub.publish(*events)
        await e.start()
        engines.append(e)
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    print("engines ready", flush=True)
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------- load
class Prompts:
    def __init__(self, args: argparse.Namespace) -> None:
        self.rng = random.Random(args.seed)
        lo, hi = args.prefix_tokens
        self.prefixes = [
            ",".join(str(self.rng.randrange(10, 50_000))
                     for _ in range(self.rng.randrange(lo, hi)))
            for _ in range(args.prefixes)
        ]
        self.tail = args.tail_tokens
        self.max_tokens = args.output_tokens

    def body(self) -> bytes:
        prefix = self.rng.choice(self.prefixes)
        tail = ",".join(str(self.rng.randrange(10, 50_000))
                        for _ in range(self.rng.randrange(*self.tail)))
        return (f'{{"model":"fake","max_tokens":{self.max_tokens},"stream":true,'
                f'"prompt":[{prefix},{tail}]}}').encode()


async def load(url: str, args: argparse.Namespace, prompts: Prompts,
               window: tuple[float, float]) -> dict[str, Any]:
    import aiohttp

    t_start, t_end = window
    first: list[float] = []
    health: list[float] = []
    status: dict[str, int] = {}
    tasks: set[asyncio.Task[None]] = set()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def one(body: bytes) -> None:
            t0 = time.monotonic()
            try:
                async with s.post(url + "/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    got = False
                    async for _ in r.content.iter_any():
                        if not got and t0 >= t_start:
                            first.append(time.monotonic() - t0)
                            got = True
                    key = str(r.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                key = type(exc).__name__
            if t0 >= t_start:
                status[key] = status.get(key, 0) + 1

        async def probe() -> None:
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with s.get(url + "/health") as r:
                        await r.read()
                    if t0 >= t_start:
                        health.append(time.monotonic() - t0)
                await asyncio.sleep(0.02)

        prober = asyncio.create_task(probe())
        rng = random.Random(args.seed + 1)
        nxt = time.monotonic()
        while nxt < t_end:
            nxt += rng.expovariate(args.rate)
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            task = asyncio.create_task(one(prompts.body()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await prober
        if tasks:
            await asyncio.wait(tasks, timeout=60)
    return {"first_byte": first, "health": health, "status": status}


# ---------------------------------------------------------------------------- a round
def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def summarize(probe: dict[str, Any], got: dict[str, Any], window: tuple[float, float],
              cpu: float) -> dict[str, Any]:
    t0, t1 = window
    lags = [(t, lag) for t, lag in probe.get("lag", []) if t0 <= t <= t1]
    lag = [x for _, x in lags]
    pauses = [(t, g, d) for t, g, d, _ in probe.get("gc", []) if t0 <= t <= t1]
    by_gen: dict[str, dict[str, Any]] = {}
    for g in (0, 1, 2):
        ds = [d for _, gen, d in pauses if gen == g]
        by_gen[str(g)] = {"n": len(ds), "max_ms": ms(max(ds, default=0.0)),
                          "p50_ms": ms(pct(ds, 0.5)), "sum_ms": ms(sum(ds))}
    # each late sample (> 20 ms): how much of it the collector's pauses explain
    stalls = [(t, x) for t, x in lags if x > 0.02]
    gc_in = []
    for t, x in stalls:
        start = t - x - 0.05
        gc_in.append(sum(d for ts, _, d in pauses if start <= ts <= t))
    stall_total = sum(x for _, x in stalls)
    big = [(g, x) for g, (_, x) in zip(gc_in, stalls, strict=True) if x > 0.1]
    timers = {}
    for name, calls in probe.get("timers", {}).items():
        ds = [d for t, d in calls if t0 <= t <= t1]
        timers[name] = {"n": len(ds), "mean_us": round(1e6 * sum(ds) / len(ds), 1) if ds
                        else None, "p99_ms": ms(pct(ds, 0.99)), "max_ms": ms(max(ds, default=0)),
                        "over_5ms": sum(d > 0.005 for d in ds),
                        "over_20ms": sum(d > 0.02 for d in ds),
                        "share_of_window": round(sum(ds) / (t1 - t0), 4)}
    return {
        "lag_samples": len(lag),
        "lag_p50_ms": ms(pct(lag, 0.5)), "lag_p90_ms": ms(pct(lag, 0.9)),
        "lag_p99_ms": ms(pct(lag, 0.99)), "lag_max_ms": ms(max(lag, default=None)),
        "lag_over_25ms": sum(x > 0.025 for x in lag), "lag_over_100ms": sum(x > 0.1 for x in lag),
        "stall_ms_total": ms(stall_total),
        "stall_ms_gc": ms(min(stall_total, sum(min(g, x) for g, (_, x) in zip(gc_in, stalls,
                                                                             strict=True)))),
        "over_100ms_with_gc": sum(g > 0.02 for g, _ in big),
        "over_100ms_gc_share": round(sum(min(g, x) for g, x in big) / sum(x for _, x in big), 3)
        if big else None,
        "gc": by_gen, "gc_frozen": probe.get("gc_frozen"),
        "gc_threshold": probe.get("gc_threshold"),
        "health_p50_ms": ms(pct(got["health"], 0.5)), "health_p99_ms": ms(pct(got["health"], 0.99)),
        "health_max_ms": ms(max(got["health"], default=None)),
        "first_byte_p50_ms": ms(pct(got["first_byte"], 0.5)),
        "first_byte_p99_ms": ms(pct(got["first_byte"], 0.99)),
        "status": got["status"], "proxy_cpu_share": round(cpu / (t1 - t0), 3),
        "heap": probe.get("heap"),
        "timers": timers,
    }


IDLE = "runners.py:run"  # the loop thread's innermost Python frame while uvloop waits
SKIP = ("runners.py:", "cli.py:", "<frozen runpy>", "loop_lag_probe.py:", "base_events.py:",
        "events.py:_run")


def stall_profile(probe: dict[str, Any], top: int = 15) -> dict[str, Any]:
    """The loop thread's samples in the window, over all of them and while stalled: the
    share in uvloop's C code (idle, or C callbacks), then per Python function its inclusive
    share (in any frame of the sample) and its own (the innermost frame)."""
    out = {}
    for key in ("all_stacks", "stall_stacks"):
        stacks = probe.get(key, {})
        total = sum(stacks.values()) or 1
        incl: dict[str, int] = {}
        own: dict[str, int] = {}
        idle = 0
        for stack, n in stacks.items():
            frames = stack.split(" < ")
            if frames[0] == IDLE:
                idle += n
                continue
            own[frames[0]] = own.get(frames[0], 0) + n
            for fn in dict.fromkeys(f for f in frames if not f.startswith(SKIP)):
                incl[fn] = incl.get(fn, 0) + n
        out[key] = {"samples": sum(stacks.values()), "in_c_or_idle": round(idle / total, 3),
                    "inclusive": [(fn, round(n / total, 3)) for fn, n in
                                  sorted(incl.items(), key=lambda kv: -kv[1])[:top]],
                    "own": [(fn, round(n / total, 3)) for fn, n in
                            sorted(own.items(), key=lambda kv: -kv[1])[:top]]}
    return out


def machine_busy() -> tuple[float, float]:
    """(busy, all) CPU ticks of the machine so far (``/proc/stat``)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    return sum(vals) - vals[3] - vals[4], sum(vals)


def spy_profile(raw: str, top: int = 25) -> dict[str, Any]:
    """py-spy's collapsed stacks (``frame;frame;... count``, outermost first): each Python
    function's share of the samples, inclusive and own."""
    incl: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, n_text = line.rpartition(" ")
        if not stack or not n_text.isdigit():
            continue
        n = int(n_text)
        total += n
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1]
                  + ")" for f in stack.split(";")]
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for fn in dict.fromkeys(frames):
            incl[fn] = incl.get(fn, 0) + n
    share = max(total, 1)
    return {"samples": total,
            "inclusive": [(fn, round(n / share, 3)) for fn, n in
                          sorted(incl.items(), key=lambda kv: -kv[1])[:top]],
            "own": [(fn, round(n / share, 3)) for fn, n in
                    sorted(own.items(), key=lambda kv: -kv[1])[:top]]}


def wait_idle(max_wait: float, quiet_s: int = 5, below: float = 0.1) -> float:
    """Wait (at most ``max_wait`` s) for the machine to be quiet (under ``below`` of its
    CPUs busy for ``quiet_s`` seconds in a row: another session's tests share it); the
    seconds waited."""
    started = time.monotonic()
    quiet = 0
    last = machine_busy()
    while quiet < quiet_s and time.monotonic() - started < max_wait:
        time.sleep(1.0)
        now = machine_busy()
        share = (now[0] - last[0]) / max(now[1] - last[1], 1)
        quiet = quiet + 1 if share < below else 0
        last = now
    return time.monotonic() - started


def run_round(front: str, code: Path, env_extra: dict[str, str], args: argparse.Namespace,
              tmp: Path) -> dict[str, Any]:
    py = sys.executable
    waited = wait_idle(args.idle_wait) if args.idle_wait > 0 else 0.0
    sub_port = free_port()
    spec = {"ports": [free_port() for _ in NAMES], "replays": [free_port() for _ in NAMES],
            "sub_port": sub_port, "ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms,
            "output_tokens": args.output_tokens, "gpu_blocks": args.gpu_blocks,
            "cpu_blocks": args.cpu_blocks}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    engines = subprocess.Popen([py, __file__, "engines", json.dumps(spec)], env=env,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    proxy = None
    try:
        assert engines.stdout is not None
        engines.stdout.readline()
        backends = [{"name": n, "role": "colocated", "node": "n1",
                     "url": f"http://127.0.0.1:{p}", "generation": "g",
                     "kv_events": {"topic": n, "replay": f"tcp://127.0.0.1:{r}"}}
                    for n, p, r in zip(NAMES, spec["ports"], spec["replays"], strict=True)]
        from pdstack.testing import proxy_harness as ph

        table = ph.table("colocated", backends)
        table["kv_events"] = {"host": "127.0.0.1", "port": sub_port, "hash_seed": "0"}
        (tmp / "table.json").write_text(json.dumps(table))
        port = free_port()
        probe_out = tmp / f"probe-{front}.json"
        probe_out.unlink(missing_ok=True)
        (tmp / "window").unlink(missing_ok=True)
        log = open(tmp / f"proxy-{front}.log", "w")  # noqa: SIM115 - the child owns it
        proxy = subprocess.Popen(
            [py, str(REPO / "benchmarks/loop_lag_probe.py"), "pdstack.cli", "proxy",
             "--backends", str(tmp / "table.json"), "--host", "127.0.0.1", "--port", str(port),
             "--admission", "kv", "--log-level", "WARNING"],
            cwd=code, env={**os.environ, "PYTHONPATH": str(code), **env_extra,
                           "LOOP_PROBE_OUT": str(probe_out),
                           "LOOP_PROBE_WINDOW": str(tmp / "window"),
                           "LOOP_PROBE_SAMPLER": "1" if args.sampler else "0"},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        from pdstack.testing.http import wait_http

        wait_http(url + "/health", 60)
        time.sleep(3.0)  # the replays: every engine's index full, fresh
        prompts = Prompts(args)
        now = time.monotonic()
        window = (now + args.warmup, now + args.warmup + args.duration)
        (tmp / "window").write_text(f"{window[0]} {window[1]}")
        cpu0 = [0.0, 0.0, 0.0, 0.0]
        ours = [proxy.pid, engines.pid, os.getpid()]
        spy_out = tmp / f"py-spy-{front}.txt"
        spy: list[subprocess.Popen[bytes]] = []

        async def go() -> dict[str, Any]:
            async def mark() -> None:
                await asyncio.sleep(max(0.0, window[0] - time.monotonic()))
                cpu0[0] = cpu_seconds([proxy.pid])
                cpu0[1], cpu0[2] = machine_busy()
                cpu0[3] = cpu_seconds(ours)
                if args.py_spy:  # nonblocking: it never stops the proxy to read it
                    spy.append(subprocess.Popen(
                        [args.py_spy, "record", "--pid", str(proxy.pid), "--duration",
                         str(int(args.duration)), "--rate", "250", "--format", "raw",
                         "--nonblocking", "--output", str(spy_out)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            marker = asyncio.create_task(mark())
            got = await load(url, args, prompts, window)
            await marker
            return got

        got = asyncio.run(go())
        cpu = cpu_seconds([proxy.pid]) - cpu0[0]  # includes the drain: an upper bound
        busy, total = machine_busy()
        machine = (busy - cpu0[1]) / max(total - cpu0[2], 1e-9)
        # the other processes' CPU over the window, in cores (the machine is shared)
        others = (busy - cpu0[1]) / CLK_TCK - (cpu_seconds(ours) - cpu0[3])
        others /= time.monotonic() - window[0]
        for sp in spy:
            sp.wait(30)
        for _ in range(100):  # the probe's dump, 1 s after the window
            if probe_out.exists():
                break
            time.sleep(0.2)
        probe = json.loads(probe_out.read_text())
        row = {"front": front, **summarize(probe, got, window, cpu),
               "machine_busy": round(machine, 3), "others_cores": round(others, 2),
               "waited_idle_s": round(waited, 1),
               "profile": stall_profile(probe)}
        if spy and spy_out.exists():
            row["py_spy"] = spy_profile(spy_out.read_text())
    finally:
        for p in (proxy, engines):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
    return row


def fronts_of(args: argparse.Namespace, tmp: Path) -> list[tuple[str, Path, dict[str, str]]]:
    known: dict[str, tuple[Path, dict[str, str]]] = {
        "after": (REPO, {}),
        "gc-off": (REPO, {"PDSTACK_PROXY_GC": "default"}),
    }
    if args.old:
        old = tmp / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.old], cwd=REPO,
                       check=True, capture_output=True)
        known["before"] = (old, {})
    out = []
    for f in args.fronts.split(","):
        if f.startswith("gc="):  # this tree, the collector frozen with these thresholds
            out.append((f, REPO, {"PDSTACK_PROXY_GC": f[3:].replace(":", ",")}))
        else:
            out.append((f, *known[f]))
    return out


def table_text(rows: list[dict[str, Any]]) -> str:
    head = ("front      rnd  lag p50/p99/max ms     >25ms >100ms (gc)  stall ms (gc)   "
            "gc n0/n1/n2  gc max0/1/2 ms     /health p50/p99/max ms  first byte p50/p99  "
            "cpu busy others")
    lines = [head]
    for r in rows:
        g = r["gc"]
        lines.append(
            f"{r['front']:<10} {r['round']:>3}  {r['lag_p50_ms']:>5} / {r['lag_p99_ms']:>6} / "
            f"{r['lag_max_ms']:>6}  {r['lag_over_25ms']:>5} {r['lag_over_100ms']:>6} "
            f"({r['over_100ms_with_gc']:>2})  "
            f"{r['stall_ms_total']:>7} ({r['stall_ms_gc']:>7})  "
            f"{g['0']['n']:>3}/{g['1']['n']:>3}/{g['2']['n']:>2}  "
            f"{g['0']['max_ms']:>5}/{g['1']['max_ms']:>5}/{g['2']['max_ms']:>6}  "
            f"{r['health_p50_ms']:>6} / {r['health_p99_ms']:>6} / {r['health_max_ms']:>6}  "
            f"{r['first_byte_p50_ms']:>6} / {r['first_byte_p99_ms']:>6}  "
            f"{r['proxy_cpu_share']:.2f} {r['machine_busy']:.2f} {r['others_cores']:.2f}")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "engines":
        try:
            import uvloop  # type: ignore[import-not-found]

            uvloop.install()
        except ImportError:
            pass
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_engines(json.loads(sys.argv[2])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fronts", default="gc-off,after",
                   help="of before (needs --old), after (this tree), gc-off (this tree, "
                   "PDSTACK_PROXY_GC=default), gc=T0:T1:T2 (this tree, frozen, those "
                   "thresholds)")
    p.add_argument("--old", default=None, help="the commit whose proxy is 'before'")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--prefixes", type=int, default=60)
    p.add_argument("--prefix-tokens", type=int, nargs=2, default=(1000, 4000))
    p.add_argument("--tail-tokens", type=int, nargs=2, default=(300, 1000))
    p.add_argument("--output-tokens", type=int, default=100)
    p.add_argument("--ttft-ms", type=float, default=150.0)
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--gpu-blocks", type=int, default=21_500)
    p.add_argument("--cpu-blocks", type=int, default=52_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sampler", action="store_true",
                   help="the probe's stack sampler in the proxy (biased: --py-spy is not)")
    p.add_argument("--py-spy", default=None, metavar="PATH",
                   help="py-spy's binary: profile the proxy over the window (nonblocking)")
    p.add_argument("--idle-wait", type=float, default=600.0,
                   help="before each round, wait up to this long for a quiet machine")
    p.add_argument("--label", default="loop_lag")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="loop-lag-"))
    fronts = fronts_of(args, tmp)
    rows = []
    try:
        for rnd in range(args.rounds):
            for front, code, env in fronts:
                row = run_round(front, code, env, args, tmp)
                row["round"] = rnd + 1
                rows.append(row)
                print(table_text([row]).splitlines()[1], flush=True)
    finally:
        if args.old:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "old")],
                           cwd=REPO, check=False, capture_output=True)
    text = table_text(rows)
    for r in rows:
        text += f"\n\n{r['front']} round {r['round']}: timers {json.dumps(r['timers'])}"
        if "py_spy" in r:
            prof = r["py_spy"]
            text += (f"\n  py-spy ({prof['samples']} samples)\n    inclusive: "
                     + ", ".join(f"{fn} {share:.1%}" for fn, share in prof["inclusive"])
                     + "\n    own: " + ", ".join(f"{fn} {share:.1%}" for fn, share in prof["own"]))
        for key, prof in r["profile"].items():
            text += (f"\n  {key} ({prof['samples']} samples, {prof['in_c_or_idle']:.0%} in C "
                     "or idle)\n    inclusive: " + ", ".join(
                         f"{fn} {share:.1%}" for fn, share in prof["inclusive"])
                     + "\n    own: " + ", ".join(f"{fn} {share:.1%}" for fn, share in prof["own"]))
    from pdstack.testing.bench_results import save

    save(REPO / "benchmarks" / "results", args,
         {"fronts": [f for f, _, _ in fronts], "commit": subprocess.run(
             ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
             text=True).stdout.strip()}, rows, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
