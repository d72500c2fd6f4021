"""Run the workload against a target: a Poisson sweep over asked rates (open loop),
or a fixed number of concurrent streams (closed loop)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import gc
import os
import platform
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from pdstack.bench import promscrape
from pdstack.bench.client import BenchClient, RequestResult, first_model
from pdstack.bench.stats import SLO_TTFT_MS, cost_per_million_output_tokens, summarize
from pdstack.bench.tenants import BenchTenant, engine_seconds, engine_time, split_rate
from pdstack.bench.workload import ChatRequest, Workload, WorkloadConfig

SCHEMA_VERSION = 1


@dataclass
class BenchConfig:
    target: str
    rates: list[float] = field(default_factory=lambda: [1.0, 2.0, 5.0])
    duration: float = 60.0
    warmup: float = 10.0
    drain_timeout: float = 60.0
    cooldown: float = 0.0
    model: str | None = None
    endpoint: str = "chat"
    ignore_eos: bool = True
    max_concurrency: int | None = None
    request_timeout: float = 600.0
    metrics_urls: list[str] = field(default_factory=list)
    prefill_url: str | None = None
    cache_salt: str | None = None  # vLLM cache_salt on every request (cold caches)
    token_ids_back: bool = True  # token-id prompts ask return_token_ids
    slo_ttft_p50_ms: float = 2000.0
    slo_ttft_p99_ms: float = 3500.0
    slo_ttft_ms: float = SLO_TTFT_MS  # per request: goodput and attainment
    gpu_hour_price: float | None = None
    gpus: int | None = None
    label: str | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    scenario: str | None = None  # the --scenario preset (None: the plain defaults)
    # how a preset sized itself (many-tenants: KV capacity, its source, prompts)
    scenario_sizing: dict[str, Any] | None = None
    gauge_interval: float = 1.0  # s between load-gauge samples of --metrics-url
    tenants: list[BenchTenant] = field(default_factory=list)  # --tenant NAME:SHARE

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        wl = self.workload
        out["workload"] = {
            "num_system_prompts": wl.num_system_prompts,
            "shared_share": wl.shared_share,
            "system_len": str(wl.system_len),
            "user_len": str(wl.user_len),
            "output_len": str(wl.output_len),
            "token_ids": wl.token_ids,
            "token_id_range": [wl.token_id_min, wl.token_id_max],
            "seed": wl.seed,
            "turns": str(wl.turns) if wl.turns is not None else None,
            "think_time_s": wl.think_time if wl.turns is not None else None,
        }
        return out


@dataclass
class Phase:
    """Live counters of one rate's run, for the progress bar."""

    sent: int = 0
    done: int = 0
    errors: int = 0

    @property
    def in_flight(self) -> int:
        return self.sent - self.done


@contextlib.contextmanager
def quiet_gc(gen0_threshold: int = 100_000) -> Iterator[None]:
    """Keep the cyclic garbage collector from pausing the load generator mid-run:
    what exists now is frozen (never scanned again), young collections run 50x less
    often. Pauses of tens of ms would otherwise land in the measured latencies."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(gen0_threshold, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def machine_load() -> dict[str, Any]:
    """Load conditions, recorded beside the numbers (the machine may be shared)."""
    out: dict[str, Any] = {"cpu_count": os.cpu_count(), "platform": platform.platform()}
    with contextlib.suppress(OSError):
        out["loadavg_1_5_15"] = list(os.getloadavg())
    return out


async def _tick(
    progress: Progress | None, task_id: Any, phase: Phase, t0: float, total: float
) -> None:
    if progress is None:
        return
    while True:
        progress.update(
            task_id,
            completed=min(time.perf_counter() - t0, total),
            stats=(
                f"sent {phase.sent} done {phase.done} err {phase.errors} "
                f"in-flight {phase.in_flight}"
            ),
        )
        await asyncio.sleep(0.25)


async def _drain(tasks: set[asyncio.Task[Any]], timeout: float) -> None:
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5)


async def run_open_loop(
    client: BenchClient,
    workload: Workload,
    rate: float,
    *,
    duration: float,
    warmup: float,
    drain_timeout: float,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    on_window_start: Callable[[], Awaitable[Any]] | None = None,
) -> tuple[list[RequestResult], float, float]:
    """The workload's schedule at ``rate`` for ``warmup + duration`` s (Poisson arrivals,
    or conversations), sent open loop; returns the results and the measurement window
    ``(start, end)`` in ``perf_counter`` seconds."""
    schedule = workload.schedule(rate, warmup + duration, seed)
    results: list[RequestResult] = []
    phase = Phase()
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    tasks: set[asyncio.Task[Any]] = set()
    total = warmup + duration
    task_id = (
        progress.add_task(f"{rate:g} req/s", total=total, stats="") if progress else None
    )

    async def one(req: ChatRequest) -> None:
        phase.sent += 1
        try:
            if sem is None:
                r = await client.send(req, results)
            else:
                async with sem:
                    r = await client.send(req, results)
            if r.error:
                phase.errors += 1
        finally:
            phase.done += 1

    t0 = time.perf_counter()
    window = (t0 + warmup, t0 + total)
    ticker = asyncio.create_task(_tick(progress, task_id, phase, t0, total))
    window_hook: asyncio.Task[Any] | None = None
    if on_window_start is not None:
        window_hook = asyncio.create_task(_at(window[0], on_window_start))
    try:
        for offset, req in schedule:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(req))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await _close_window(window[1], window_hook, tasks, drain_timeout)
    finally:
        _stop(ticker, tasks, progress, task_id, total)
    return results, window[0], window[1]


async def _close_window(end: float, hook: Awaitable[Any] | None, tasks: set[asyncio.Task[Any]],
                        drain_timeout: float) -> None:
    """Wait for the measured window's end and its scrape hook, then for the requests still
    in flight (at most ``drain_timeout`` s)."""
    rest = end - time.perf_counter()
    if rest > 0:
        await asyncio.sleep(rest)
    if hook is not None:
        await hook
    await _drain(tasks, drain_timeout)


def _stop(ticker: asyncio.Task[Any], tasks: set[asyncio.Task[Any]], progress: Progress | None,
          task_id: TaskID | None, total: float) -> None:
    """End a load loop: stop the progress ticker and every request still running."""
    ticker.cancel()
    for t in tasks:
        t.cancel()
    if progress is not None and task_id is not None:
        progress.update(task_id, completed=total)


async def _at(when: float, hook: Callable[[], Awaitable[Any]]) -> Any:
    delay = when - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    return await hook()


async def run_closed_loop(
    client: BenchClient,
    workload: Workload,
    concurrency: int,
    *,
    duration: float,
    warmup: float,
    drain_timeout: float = 30.0,
    ramp: float | None = None,
    progress: Progress | None = None,
    on_window_start: Callable[[], Awaitable[Any]] | None = None,
) -> tuple[list[RequestResult], float, float]:
    """``concurrency`` streams, each sending its next request as soon as the last ends,
    for ``warmup + duration`` s. Stream starts are spread over ``ramp`` s (default: half
    the warm-up, at most 2 s), so new connections do not overflow listen backlogs."""
    results: list[RequestResult] = []
    phase = Phase()
    total = warmup + duration
    task_id = (
        progress.add_task(f"{concurrency} streams", total=total, stats="") if progress else None
    )
    t0 = time.perf_counter()
    window = (t0 + warmup, t0 + total)

    spread = min(2.0, warmup / 2) if ramp is None else ramp

    async def stream(i: int) -> None:
        await asyncio.sleep(spread * i / concurrency)
        while time.perf_counter() < window[1]:
            phase.sent += 1
            r = await client.send(workload.next_request(), results)
            phase.done += 1
            if r.error:
                phase.errors += 1
                await asyncio.sleep(0.01)  # a failing target must not turn into a busy loop

    ticker = asyncio.create_task(_tick(progress, task_id, phase, t0, total))
    hook = asyncio.create_task(_at(window[0], on_window_start)) if on_window_start else None
    tasks = {asyncio.create_task(stream(i)) for i in range(concurrency)}
    try:
        await _close_window(window[1], hook, tasks, drain_timeout)
    finally:
        _stop(ticker, tasks, progress, task_id, total)
    return results, window[0], window[1]


def make_progress(console: Console | None = None, enabled: bool = True) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:>12}"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[stats]}"),
        console=console,
        disable=not enabled,
        transient=False,
    )


async def _add_prometheus(entry: dict[str, Any], urls: list[str], scrapes: dict[str, Any],
                          sampler: promscrape.GaugeSampler) -> None:
    """The engines' counters over the window (after minus before) and the gauges sampled
    during it, into one rate's result entry."""
    after = await promscrape.snapshot(urls)
    if "gauges" in scrapes:
        await scrapes["gauges"]
    prom = promscrape.summarize_deltas(scrapes.get("before", {}), after)
    gauges = sampler.summary()
    prom["total"]["gauges"] = gauges["total"]
    for url, g in gauges["endpoints"].items():
        prom["endpoints"].setdefault(url, {})["gauges"] = g
    entry["prometheus"] = prom
    total = prom["total"]
    entry["prefix_cache_hit_ratio"] = total["prefix_cache_hit_ratio"]
    entry["external_prefix_cache_hit_ratio"] = total["external_prefix_cache_hit_ratio"]
    entry["preemptions"] = total["preemptions"]
    entry["peak_kv_cache_usage"] = total["gauges"]["kv_cache_usage"]["peak"]


async def _run_tenants(
    cfg: BenchConfig, model: str, rate: float, progress: Progress,
    hook: Callable[[], Awaitable[Any]] | None,
) -> tuple[list[RequestResult], float, float, dict[str, Any]]:
    """Every tenant open loop at once, each its share of ``rate``, its key and its own
    prompt mix (workload seed + 1000 x its position); results merged and per tenant."""
    rates = split_rate(cfg.tenants, rate)
    before = await engine_seconds(cfg.target)
    clients = [
        BenchClient(cfg.target, model, endpoint=cfg.endpoint, token_ids=cfg.workload.token_ids,
                    ignore_eos=cfg.ignore_eos, timeout_s=cfg.request_timeout,
                    prefill_url=cfg.prefill_url, api_key=t.key(),
                    token_ids_back=cfg.token_ids_back)
        for t in cfg.tenants
    ]
    try:
        runs = await asyncio.gather(*(
            run_open_loop(
                c, Workload(replace(cfg.workload, seed=cfg.workload.seed + 1000 * (i + 1))), r,
                duration=cfg.duration, warmup=cfg.warmup, drain_timeout=cfg.drain_timeout,
                max_concurrency=cfg.max_concurrency, seed=cfg.workload.seed + i,
                progress=progress, on_window_start=hook if i == 0 else None,
            )
            for i, (c, r) in enumerate(zip(clients, rates, strict=True))
        ))
    finally:
        for c in clients:
            await c.close()
    start, end = min(r[1] for r in runs), max(r[2] for r in runs)
    per: dict[str, Any] = {}
    for t, r, (results, s0, s1) in zip(cfg.tenants, rates, runs, strict=True):
        e = summarize(results, window_start=s0, window_end=s1, asked_rate=r,
                      max_concurrency=cfg.max_concurrency, slo_ttft_p50_ms=cfg.slo_ttft_p50_ms,
                      slo_ttft_p99_ms=cfg.slo_ttft_p99_ms, slo_ttft_ms=cfg.slo_ttft_ms)
        per[t.name] = {k: e.get(k) for k in TENANT_KEYS}
        per[t.name]["share"] = t.share
    for name, spent in engine_time(cfg.tenants, before, await engine_seconds(cfg.target)).items():
        per[name].update(spent)
    return [x for rs, _, _ in runs for x in rs], start, end, per


TENANT_KEYS = ("request_rate", "request_throughput", "output_throughput", "completed",
               "errors", "median_ttft_ms", "p99_ttft_ms", "slo_goodput_rps",
               "slo_attainment_pct", "refusals", "median_refusal_ms", "p99_refusal_ms",
               "other_failures")


async def run_sweep(
    cfg: BenchConfig, console: Console | None = None, show_progress: bool = True
) -> dict[str, Any]:
    """The whole benchmark: one entry per asked rate, in the JSON document's shape."""
    model = cfg.model or await first_model(cfg.target)
    doc = _sweep_doc(cfg, model)
    workload = Workload(cfg.workload)
    client = BenchClient(
        cfg.target,
        model,
        endpoint=cfg.endpoint,
        token_ids=cfg.workload.token_ids,
        ignore_eos=cfg.ignore_eos,
        timeout_s=cfg.request_timeout,
        prefill_url=cfg.prefill_url,
        cache_salt=cfg.cache_salt,
        token_ids_back=cfg.token_ids_back,
    )
    progress = make_progress(console, enabled=show_progress)
    async with client:
        with progress, quiet_gc():
            for i, rate in enumerate(cfg.rates):
                if i and cfg.cooldown > 0:
                    await asyncio.sleep(cfg.cooldown)
                entry = await _run_rate(cfg, client, workload, model, rate, progress)
                doc["results"].append(entry)
    doc["load_after"] = machine_load()
    return doc


def _sweep_doc(cfg: BenchConfig, model: str) -> dict[str, Any]:
    """The JSON document's head, before any rate ran (``results`` empty)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "pdstack bench",
        "label": cfg.label,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "target": cfg.target,
        "model_id": model,
        "backend": "openai-chat" if cfg.endpoint == "chat" and not cfg.workload.token_ids
        else "openai",
        "config": cfg.to_json(),
        "slo": {"ttft_p50_ms": cfg.slo_ttft_p50_ms, "ttft_p99_ms": cfg.slo_ttft_p99_ms,
                "ttft_ms": cfg.slo_ttft_ms},
        "load_before": machine_load(),
        "results": [],
    }


async def _run_rate(
    cfg: BenchConfig, client: BenchClient, workload: Workload, model: str, rate: float,
    progress: Progress,
) -> dict[str, Any]:
    """One asked rate: its open-loop run (per tenant, with tenants), summarized, with the
    Prometheus deltas, cost and a few error samples."""
    scrapes: dict[str, Any] = {}
    sampler = promscrape.GaugeSampler(cfg.metrics_urls, cfg.gauge_interval)

    async def scrape_before(
        box: dict[str, Any] = scrapes, sampler: promscrape.GaugeSampler = sampler
    ) -> None:
        stop_at = time.perf_counter() + cfg.duration
        box["gauges"] = asyncio.create_task(sampler.run(stop_at))
        box["before"] = await promscrape.snapshot(cfg.metrics_urls)

    hook = scrape_before if cfg.metrics_urls else None
    if cfg.tenants:
        results, start, end, by_tenant = await _run_tenants(
            cfg, model, rate, progress, hook
        )
    else:
        by_tenant = {}
        results, start, end = await run_open_loop(
            client,
            workload,
            rate,
            duration=cfg.duration,
            warmup=cfg.warmup,
            drain_timeout=cfg.drain_timeout,
            max_concurrency=cfg.max_concurrency,
            seed=cfg.workload.seed,
            progress=progress,
            on_window_start=hook,
        )
    entry = summarize(
        results,
        window_start=start,
        window_end=end,
        asked_rate=rate,
        max_concurrency=cfg.max_concurrency,
        slo_ttft_p50_ms=cfg.slo_ttft_p50_ms,
        slo_ttft_p99_ms=cfg.slo_ttft_p99_ms,
        slo_ttft_ms=cfg.slo_ttft_ms,
    )
    if by_tenant:
        entry["tenants"] = by_tenant
    if cfg.metrics_urls:
        await _add_prometheus(entry, cfg.metrics_urls, scrapes, sampler)
    if cfg.gpu_hour_price is not None and cfg.gpus:
        entry["cost_per_1m_output_tokens"] = cost_per_million_output_tokens(
            entry["output_throughput"], cfg.gpu_hour_price, cfg.gpus
        )
    entry["error_samples"] = sorted(
        {f"{r.error}: {r.error_detail}"[:200] for r in results if r.error}
    )[:5]
    return entry
