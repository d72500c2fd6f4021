#!/usr/bin/env python3
"""What does the P/D proxy cost? TTFT and throughput at 1/100/500 concurrent streams:

  (a) direct:      the load generator plays the NIXL P/D protocol itself (prefill leg to
                   P, then the streamed decode leg to D) -- a zero-overhead proxy;
  (b) pdstack:     through ``pdstack proxy --kv-mode nixl``;
  (c) vllm-router: through the Rust ``vllm-router --vllm-pd-disaggregation``;
  pdstack-uvloop: (b) with uvloop importable (``--uvloop-path``);
  pdstack-gc:     (b) started through benchmarks/gc_tuned.py with its thresholds (the
                  proxy freezes its collector itself since benchmarks/loop_lag.py; this
                  adds gc_tuned's 100,000 young threshold: ``--gc 100000,50,100``);
  pdstack-base:   (b) from another source tree (``--baseline-src DIR``, e.g. ``git worktree
                  add DIR main``): old and new code in the same run, on the same engines.
  pdstack-gate:   (b) with ``--admission kv`` (the KV gate; no tenants), the decode engine
                  exporting a KV capacity far above the load: every decision runs, none
                  holds; the table then adds the gate's cost against (b), admission off;
  pdstack-fifo:   (b) with ``--admission kv --admission-fairness off`` and no tenants;
  pdstack-fair:   (b) with ``--admission kv`` (fair queuing on) and tenants in its backend
                  table (every request the ``default`` tenant's, with concurrency, rpm and
                  tpm limits far above the load: every check, the tpm settlement, the
                  per-tenant metrics run, none refuses): the cost of tenants + fairness.

P and D are ``pdstack.testing.fake_engine`` processes with a fixed TTFT and
inter-token delay, so every millisecond above the direct path is the proxy's.
The load generator (this process), each proxy and each engine are separate
processes. Per-process CPU use and the machine's load are recorded beside the
numbers: on a small shared machine the proxies compete with the load generator
and the engines for the same cores.

Target: pdstack adds <= 1 ms P50 and <= 5 ms P99 TTFT at 500 streams.

  bash benchmarks/install_vllm_router.sh          # once: .venv-router/bin/vllm-router
  flock /tmp/pdstack-heavy.lock .venv/bin/python benchmarks/proxy_overhead.py
  # results: benchmarks/results/proxy_overhead.json (+ .txt with the printed table)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdstack.bench.client import BenchClient  # noqa: E402
from pdstack.bench.runner import quiet_gc, run_closed_loop  # noqa: E402
from pdstack.bench.stats import summarize  # noqa: E402
from pdstack.bench.workload import Distribution, Workload, WorkloadConfig  # noqa: E402
from pdstack.testing.http import wait_http  # noqa: E402
from pdstack.testing.proc_stats import CLK_TCK, cpu_seconds, process_tree  # noqa: E402

TARGET_P50_MS = 1.0
TARGET_P99_MS = 5.0
# the decode engine's KV in tokens (its /metrics, read by the gate): far above the load
GATE_CAPACITY_TOKENS = 100_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine_busy_seconds() -> tuple[float, float]:
    """(busy CPU seconds, total CPU seconds) of the whole machine so far."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    total = sum(vals[:8])
    return (total - idle) / CLK_TCK, total / CLK_TCK


@dataclass
class Proc:
    name: str
    cmd: list[str]
    url: str
    env: dict[str, str] | None = None
    cwd: Path = REPO
    popen: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def start(self, log_dir: Path, ready_path: str, timeout: float = 60.0) -> None:
        self.log = log_dir / f"{self.name}.log"
        with self.log.open("wb") as fh:
            self.popen = subprocess.Popen(
                self.cmd, cwd=self.cwd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self.env} if self.env else None,
            )
        wait_http(self.url + ready_path, timeout, self.popen)

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=5)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid


@dataclass
class Setup:
    prefill: Proc
    decode: Proc
    proxies: dict[str, Proc] = field(default_factory=dict)

    def all(self) -> list[Proc]:
        return [self.prefill, self.decode, *self.proxies.values()]


def build_setup(args: argparse.Namespace) -> Setup:
    py = sys.executable
    p_port, d_port = free_port(), free_port()
    gc_tuned = [py, str(REPO / "benchmarks/gc_tuned.py")]
    engine = [*gc_tuned, "pdstack.testing.fake_engine", "--no-record",
              "--output-tokens", str(2 * args.output_tokens),
              "--kv-capacity-tokens", str(GATE_CAPACITY_TOKENS)]
    prefill = Proc("prefill", [*engine, "--port", str(p_port), "--name", "p0",
                               "--ttft-ms", str(args.prefill_ttft_ms)],
                   f"http://127.0.0.1:{p_port}")
    decode = Proc("decode", [*engine, "--port", str(d_port), "--name", "d0",
                             "--ttft-ms", str(args.decode_ttft_ms),
                             "--itl-ms", str(args.itl_ms)],
                  f"http://127.0.0.1:{d_port}")
    setup = Setup(prefill, decode)
    uv_env = None
    if args.uvloop_path is not None:
        uv_env = {"PYTHONPATH": os.pathsep.join(
            [str(args.uvloop_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
        prefill.env = decode.env = uv_env  # the fake engines use uvloop when importable
    for name in ("pdstack", "pdstack-uvloop", "pdstack-gc", "pdstack-gate"):
        if name not in args.targets:
            continue
        port = free_port()
        launcher = gc_tuned if name == "pdstack-gc" else [py, "-m"]
        extra = {"pdstack-gate": ["--admission", "kv"],
                 # the proxy's own tuning would set CPython's thresholds again
                 "pdstack-gc": ["--gc", "100000,50,100"]}.get(name, [])
        setup.proxies[name] = Proc(
            name,
            [*launcher, "pdstack.cli", "proxy", "--prefill", prefill.url, "--decode", decode.url,
             "--kv-mode", "nixl", "--host", "127.0.0.1", "--port", str(port),
             *extra, *args.pdstack_arg],
            f"http://127.0.0.1:{port}",
            env=uv_env if name == "pdstack-uvloop" else None,
        )
    for name in ("pdstack-fifo", "pdstack-fair"):
        if name in args.targets:
            setup.proxies[name] = tenant_proxy(name, prefill.url, decode.url, args)
    if "pdstack-base" in args.targets:
        port = free_port()
        src = args.baseline_src.resolve()
        setup.proxies["pdstack-base"] = Proc(
            "pdstack-base",
            [py, "-m", "pdstack.cli", "proxy", "--prefill", prefill.url, "--decode", decode.url,
             "--kv-mode", "nixl", "--host", "127.0.0.1", "--port", str(port)],
            f"http://127.0.0.1:{port}",
            env={"PYTHONPATH": str(src)},
            cwd=src,
        )
    if "vllm-router" in args.targets:
        port = free_port()
        setup.proxies["vllm-router"] = Proc(
            "vllm-router",
            [str(args.router_bin), "--vllm-pd-disaggregation", "--kv-connector", "nixl",
             "--prefill", prefill.url, "--decode", decode.url, "--policy", "round_robin",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
             "--max-concurrent-requests", "32768", "--queue-size", "4096"],
            f"http://127.0.0.1:{port}",
        )
    return setup


def tenant_proxy(name: str, prefill: str, decode: str, args: argparse.Namespace) -> Proc:
    """``pdstack proxy`` from a backend table file, with KV admission; ``pdstack-fair``
    adds tenants and fair queuing, ``pdstack-fifo`` is one FIFO without tenants."""
    from pdstack.plan import BackendTable
    from pdstack.topology import TenantSpec

    table = BackendTable.adhoc([prefill], [decode], "nixl", "fake")
    fair = name == "pdstack-fair"
    if fair:
        big = 10**9
        table = table.model_copy(update={"tenants": {
            "default": TenantSpec(weight=1, max_concurrency=100_000, rpm=big, tpm=big),
            "acme": TenantSpec(weight=3, max_queued=4096),
            "nightly": TenantSpec(weight=1, priority="batch"),
        }})
    path = Path(tempfile.mkdtemp(prefix="pdstack-bench-")) / f"{name}.json"
    path.write_text(table.model_dump_json())
    port = free_port()
    return Proc(
        name,
        [sys.executable, "-m", "pdstack.cli", "proxy", "--backends", str(path),
         "--host", "127.0.0.1", "--port", str(port), "--admission", "kv",
         "--admission-fairness", "on" if fair else "off", *args.pdstack_arg],
        f"http://127.0.0.1:{port}",
    )


def output_len(args: argparse.Namespace, streams: int) -> Distribution:
    """Answer lengths: uniform over [n/2, 3n/2] (varied, so closed-loop streams do not
    fall into lockstep waves); at one stream ``--single-stream-output-tokens``."""
    if streams == 1:
        return Distribution.parse(str(args.single_stream_output_tokens))
    n = args.output_tokens
    return Distribution.parse(f"uniform:{max(1, n // 2)}:{max(1, n + n // 2)}")


@dataclass
class Collected:
    """One target at one stream count: its interleaved segments, pooled."""

    results: list[Any] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds in the segments
    machine_busy: float = 0.0
    wall: float = 0.0


async def segment(
    args: argparse.Namespace, setup: Setup, target: str, streams: int, seconds: float,
    seed: int, into: Collected,
) -> None:
    """One closed-loop segment of ``seconds`` (after the warm-up) against ``target``."""
    if target == "direct":
        client = BenchClient(setup.decode.url, "fake", endpoint="chat",
                             prefill_url=setup.prefill.url, timeout_s=120)
    else:
        client = BenchClient(setup.proxies[target].url, "fake", endpoint="chat", timeout_s=120)
    workload = Workload(WorkloadConfig(
        num_system_prompts=4, shared_share=0.8,
        system_len=Distribution.parse(str(args.prompt_words)),
        user_len=Distribution.parse("uniform:16:64"),
        output_len=output_len(args, streams),
        seed=seed,
    ))
    watched = {"load generator": os.getpid(), "prefill engine": setup.prefill.pid,
               "decode engine": setup.decode.pid}
    if target != "direct":
        watched[target] = setup.proxies[target].pid
    marks: dict[str, Any] = {}

    async def window_start() -> None:
        marks["t"] = time.perf_counter()
        marks["cpu"] = {k: cpu_seconds(process_tree(p)) for k, p in watched.items()}
        marks["machine"] = machine_busy_seconds()[0]

    async with client:
        results, start, end = await run_closed_loop(
            client, workload, streams, duration=seconds, warmup=args.warmup,
            on_window_start=window_start,
        )
    # CPU use is counted from the window's start to the end of the drain
    into.wall += time.perf_counter() - marks["t"]
    for k, p in watched.items():
        into.cpu[k] = into.cpu.get(k, 0.0) + cpu_seconds(process_tree(p)) - marks["cpu"][k]
    into.machine_busy += machine_busy_seconds()[0] - marks["machine"]
    into.results.extend(results)
    into.windows.append((start, end))


def describe(target: str, streams: int, c: Collected) -> dict[str, Any]:
    m = summarize(c.results, windows=c.windows, asked_rate=None, max_concurrency=streams)
    cpu = {k: v / c.wall for k, v in c.cpu.items()}
    machine = c.machine_busy / c.wall
    return {
        "target": target,
        "streams": streams,
        "segments": len(c.windows),
        "measured_s": m["duration"],
        "completed": m["completed"],
        "failed": m["failed"],
        "errors": m["errors"],
        "request_throughput": m["request_throughput"],
        "output_throughput": m["output_throughput"],
        **{k: m[k] for k in ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                             "max_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms",
                             "p99_e2el_ms")},
        "cpu_cores_used": {k: round(v, 3) for k, v in cpu.items()},
        "machine_cpu_cores_busy": round(machine, 3),
        "other_processes_cpu_cores": round(max(0.0, machine - sum(cpu.values())), 3),
    }


def ratio_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run with its deltas and ratios against the direct run at the same streams."""
    direct = {r["streams"]: r for r in runs if r["target"] == "direct"}
    rows = []
    for r in runs:
        d = direct.get(r["streams"])
        row = dict(r)
        if d is not None and r["median_ttft_ms"] is not None and d["median_ttft_ms"] is not None:
            row["delta_p50_ttft_ms"] = r["median_ttft_ms"] - d["median_ttft_ms"]
            row["delta_p99_ttft_ms"] = r["p99_ttft_ms"] - d["p99_ttft_ms"]
            row["p50_ttft_ratio"] = r["median_ttft_ms"] / d["median_ttft_ms"]
            row["throughput_ratio"] = (r["request_throughput"] / d["request_throughput"]
                                       if d["request_throughput"] else None)
        rows.append(row)
    return rows


def fmt(v: Any, spec: str, width: int) -> str:
    return ("-" if v is None else format(v, spec)).rjust(width)


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'streams':>7} {'target':<14} {'TTFT p50':>9} {'p90':>8} {'p99':>8} "
            f"{'dP50':>8} {'dP99':>8} {'p50 x':>6} {'req/s':>8} {'tok/s':>8} {'thr x':>6} "
            f"{'err':>5} {'proxy cpu':>9} {'gen cpu':>7} {'other':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        proxy_cpu = r["cpu_cores_used"].get(r["target"])
        lines.append(
            f"{r['streams']:>7} {r['target']:<14} {fmt(r['median_ttft_ms'], '.2f', 9)} "
            f"{fmt(r['p90_ttft_ms'], '.2f', 8)} {fmt(r['p99_ttft_ms'], '.2f', 8)} "
            f"{fmt(r.get('delta_p50_ttft_ms') if r['target'] != 'direct' else None, '+.2f', 8)} "
            f"{fmt(r.get('delta_p99_ttft_ms') if r['target'] != 'direct' else None, '+.2f', 8)} "
            f"{fmt(r.get('p50_ttft_ratio'), '.3f', 6)} {fmt(r['request_throughput'], '.1f', 8)} "
            f"{fmt(r['output_throughput'], '.0f', 8)} {fmt(r.get('throughput_ratio'), '.3f', 6)} "
            f"{r['failed']:>5} {fmt(proxy_cpu, '.0%', 9)} "
            f"{fmt(r['cpu_cores_used']['load generator'], '.0%', 7)} "
            f"{fmt(r['other_processes_cpu_cores'], '.2f', 6)}"
        )
    lines.append("TTFT in ms; dP50/dP99 = added TTFT vs direct; x = ratio vs direct; cpu in "
                 "cores (100% = one core); other = cores busy with processes outside this run")
    return "\n".join(lines)


def gate_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The KV gate's cost: pdstack-gate against pdstack (admission off), per stream count."""
    off = {r["streams"]: r for r in rows if r["target"] == "pdstack"}
    out = []
    for r in rows:
        o = off.get(r["streams"])
        if r["target"] != "pdstack-gate" or o is None or r["median_ttft_ms"] is None \
                or o["median_ttft_ms"] is None:
            continue
        out.append({
            "streams": r["streams"],
            "off_p50_ttft_ms": o["median_ttft_ms"], "gate_p50_ttft_ms": r["median_ttft_ms"],
            "off_p99_ttft_ms": o["p99_ttft_ms"], "gate_p99_ttft_ms": r["p99_ttft_ms"],
            "gate_minus_off_p50_ms": r["median_ttft_ms"] - o["median_ttft_ms"],
            "gate_minus_off_p99_ms": r["p99_ttft_ms"] - o["p99_ttft_ms"],
            "throughput_ratio": (r["request_throughput"] / o["request_throughput"]
                                 if o["request_throughput"] else None),
            "gate_failed": r["failed"],
        })
    return out


def gate_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'streams':>7} {'off p50':>9} {'gate p50':>9} {'gate-off':>9} {'off p99':>9} "
            f"{'gate p99':>9} {'gate-off':>9} {'req/s x':>8}")
    lines = ["KV gate (--admission kv) against admission off, same run:", head, "-" * len(head)]
    for g in rows:
        lines.append(
            f"{g['streams']:>7} {g['off_p50_ttft_ms']:>9.2f} {g['gate_p50_ttft_ms']:>9.2f} "
            f"{g['gate_minus_off_p50_ms']:>+9.2f} {g['off_p99_ttft_ms']:>9.2f} "
            f"{g['gate_p99_ttft_ms']:>9.2f} {g['gate_minus_off_p99_ms']:>+9.2f} "
            f"{fmt(g['throughput_ratio'], '.3f', 8)}"
        )
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]], streams: int, target: str) -> dict[str, Any]:
    row = next((r for r in rows if r["target"] == target and r["streams"] == streams), None)
    if row is None or "delta_p50_ttft_ms" not in row:
        return {"streams": streams, "met": None, "why": f"no {target}/direct pair at that load"}
    met = (row["delta_p50_ttft_ms"] <= TARGET_P50_MS and row["delta_p99_ttft_ms"] <= TARGET_P99_MS
           and row["failed"] == 0)
    return {
        "streams": streams,
        "target_p50_ms": TARGET_P50_MS,
        "target_p99_ms": TARGET_P99_MS,
        "delta_p50_ttft_ms": row["delta_p50_ttft_ms"],
        "delta_p99_ttft_ms": row["delta_p99_ttft_ms"],
        "met": met,
    }


async def run_all(args: argparse.Namespace, setup: Setup) -> list[dict[str, Any]]:
    """Per stream count: ``rounds`` rounds, each running every target for
    duration/rounds s, the order rotated each round (so drift in the machine's
    load falls on all targets alike); the segments are pooled per target."""
    runs = []
    seconds = args.duration / args.rounds
    for streams in args.streams:
        collected = {t: Collected() for t in args.targets}
        for rnd in range(args.rounds):
            k = rnd % len(args.targets)
            for target in args.targets[k:] + args.targets[:k]:
                print(f"-- {streams} streams, round {rnd + 1}/{args.rounds}: {target}", flush=True)
                await segment(args, setup, target, streams, seconds, seed=streams * 100 + rnd,
                              into=collected[target])
                await asyncio.sleep(args.pause)
        for target in args.targets:
            run = describe(target, streams, collected[target])
            print(f"   {target:<14} TTFT p50 {run['median_ttft_ms'] or 0:.2f} ms p99 "
                  f"{run['p99_ttft_ms'] or 0:.2f} ms, {run['request_throughput']:.1f} req/s, "
                  f"errors {run['errors']}", flush=True)
            runs.append(run)
    return runs


def _check_targets(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every asked target known, and what each one needs given (else argparse's exit 2)."""
    unknown = set(args.targets) - {"direct", "pdstack", "pdstack-uvloop", "pdstack-gc",
                                   "pdstack-base", "pdstack-gate", "pdstack-fifo",
                                   "pdstack-fair", "vllm-router"}
    if unknown:
        p.error(f"unknown targets {sorted(unknown)}")
    if args.rounds < 1 or args.duration <= 0:
        p.error("need --rounds >= 1 and --duration > 0")
    if "pdstack-base" in args.targets and (
        args.baseline_src is None or not (args.baseline_src / "pdstack" / "cli.py").is_file()
    ):
        p.error("target pdstack-base needs --baseline-src DIR (a pdstack source tree)")
    if "pdstack-uvloop" in args.targets and args.uvloop_path is None:
        p.error("target pdstack-uvloop needs --uvloop-path")
    if args.uvloop_path is not None and not (args.uvloop_path / "uvloop").is_dir():
        p.error(f"no uvloop package in {args.uvloop_path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--streams", default="1,100,500",
                   type=lambda s: [int(x) for x in s.split(",")],
                   help="concurrent streams, comma-separated (default 1,100,500)")
    p.add_argument("--targets", default=None,
                   type=lambda s: [x.strip() for x in s.split(",")],
                   help="of direct, pdstack, pdstack-uvloop, pdstack-gc, pdstack-base, "
                   "pdstack-gate, pdstack-fifo, pdstack-fair, vllm-router "
                   "(default: all, pdstack-uvloop only when uvloop is there)")
    p.add_argument("--duration", type=float, default=20.0,
                   help="measured seconds per target and stream count (default 20)")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaved segments the duration is split into (default 2)")
    p.add_argument("--warmup", type=float, default=6.0,
                   help="seconds before each segment (default 6: longer than one request)")
    p.add_argument("--pause", type=float, default=1.0, help="seconds between points")
    # Defaults: a ~5.5 s request (1 s prefill, ~16 tokens at 300 ms), so 500 streams ask
    # ~90 req/s and ~1,500 SSE events/s: what 2 shared cores can carry with Python
    # engines and load generator beside the proxy. Shorter delays measure CPU saturation.
    p.add_argument("--prefill-ttft-ms", type=float, default=1000.0)
    p.add_argument("--decode-ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=300.0)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--single-stream-output-tokens", type=int, default=1,
                   help="answer length at 1 stream: with nothing else loading the machine only "
                   "TTFT matters there, and short answers give more samples (default 1)")
    p.add_argument("--prompt-words", type=int, default=256, help="system prompt length")
    p.add_argument("--router-bin", type=Path, default=REPO / ".venv-router/bin/vllm-router")
    p.add_argument("--pdstack-arg", action="append", default=[],
                   help="extra argument for `pdstack proxy` (repeatable)")
    p.add_argument("--uvloop-path", type=Path, default=None,
                   help="a folder with uvloop (pip install --target DIR uvloop; default "
                   ".venv-uvloop when present): the load generator and the fake engines use "
                   "it, and target pdstack-uvloop runs the pdstack proxy with it")
    p.add_argument("--no-uvloop", action="store_true", help="plain asyncio everywhere")
    p.add_argument("--baseline-src", type=Path, default=None,
                   help="pdstack source tree for target pdstack-base (old code, same run)")
    p.add_argument("--nice", type=int, default=-10,
                   help="niceness increment for this run and the processes it starts "
                   "(default -10 as root: shields the measurement from unrelated work on a "
                   "shared machine; 0 = leave as is)")
    p.add_argument("--output", type=Path,
                   default=REPO / "benchmarks/results/proxy_overhead.json")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when pdstack misses the target at the largest stream count")
    args = p.parse_args(argv)
    default_uvloop = REPO / ".venv-uvloop"
    if args.no_uvloop:
        args.uvloop_path = None
    elif args.uvloop_path is None and (default_uvloop / "uvloop").is_dir():
        args.uvloop_path = default_uvloop
    if args.targets is None:
        args.targets = ["direct", "pdstack", "pdstack-gc", "vllm-router"]
        if args.uvloop_path is not None:
            args.targets.insert(2, "pdstack-uvloop")
    _check_targets(p, args)
    if "direct" not in args.targets:
        args.targets.insert(0, "direct")
    if "vllm-router" in args.targets and not args.router_bin.exists():
        found = shutil.which("vllm-router")
        if found is None:
            p.error(f"{args.router_bin} missing: run bash benchmarks/install_vllm_router.sh "
                    "(or --targets direct,pdstack)")
        args.router_bin = Path(found)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    niceness = os.nice(0)
    if args.nice:
        try:
            niceness = os.nice(args.nice)  # inherited by every process started below
        except PermissionError:
            print(f"cannot change niceness by {args.nice} (not root): running at {niceness}")
    setup = build_setup(args)
    log_dir = Path(tempfile.mkdtemp(prefix="proxy_overhead-"))
    load_before = list(os.getloadavg())
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    try:
        for proc in setup.all():
            proc.start(log_dir, "/health")
        loop_factory = None
        if args.uvloop_path is not None:
            sys.path.insert(0, str(args.uvloop_path))
            import uvloop  # type: ignore[import-not-found]

            loop_factory = uvloop.new_event_loop
        with asyncio.Runner(loop_factory=loop_factory) as runner, quiet_gc():
            runs = runner.run(run_all(args, setup))
    finally:
        for proc in reversed(setup.all()):
            proc.stop()
    rows = ratio_rows(runs)
    top = max(args.streams)
    verdicts = {t: verdict(rows, top, t) for t in args.targets if t.startswith("pdstack")}
    result: dict[str, Any] = {
        "benchmark": "proxy_overhead",
        "date": started,
        "config": {
            "streams": args.streams, "targets": args.targets, "duration_s": args.duration,
            "warmup_s": args.warmup, "rounds": args.rounds, "prefill_ttft_ms": args.prefill_ttft_ms,
            "decode_ttft_ms": args.decode_ttft_ms, "itl_ms": args.itl_ms,
            "output_tokens": f"uniform over [n/2, 3n/2], n = {args.output_tokens}",
            "single_stream_output_tokens": args.single_stream_output_tokens,
            "system_prompt_words": args.prompt_words,
            "kv_mode": "nixl", "pdstack_args": args.pdstack_arg,
            "vllm_router": str(args.router_bin),
            "uvloop": args.uvloop_path is not None,
            "baseline_src": str(args.baseline_src) if args.baseline_src else None,
        },
        "load_conditions": {
            "cpu_count": os.cpu_count(),
            "niceness": niceness,
            "loadavg_before": load_before,
            "loadavg_after": list(os.getloadavg()),
            "note": "one machine for load generator, proxy and both fake engines, all separate "
                    "processes; the machine is shared with other work (see "
                    "other_processes_cpu_cores per run)",
        },
        "runs": rows,
        "target": verdicts,
    }
    text = table(rows)
    gates = gate_rows(rows)
    if gates:
        result["gate_vs_off"] = gates
        text += "\n\n" + gate_table(gates)
    for t, v in verdicts.items():
        if v["met"] is not None:
            text += (f"\n{t} at {top} streams: {v['delta_p50_ttft_ms']:+.2f} ms P50, "
                     f"{v['delta_p99_ttft_ms']:+.2f} ms P99 TTFT vs direct (target <= "
                     f"{TARGET_P50_MS:g} / <= {TARGET_P99_MS:g} ms): "
                     f"{'MET' if v['met'] else 'MISSED'}")
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    args.output.with_suffix(".txt").write_text(text + "\n")
    print(f"wrote {args.output} and {args.output.with_suffix('.txt')} (process logs: {log_dir})")
    missed = any(v["met"] is False for v in verdicts.values())
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
