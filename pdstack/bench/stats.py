"""Per-rate statistics from request results (field names follow ``vllm bench serve``).

Definitions, for a measurement window ``[start, end)`` of ``duration`` seconds:

- asked rate (``request_rate``): the Poisson rate the run asked for; the sent
  rate is how many requests were actually sent in the window / duration.
- served rate (``request_throughput``): successful requests that *finished*
  inside the window / duration. Under a load the stack can carry, it equals the
  sent rate; past saturation it is the stack's capacity.
- ``output_throughput``: output tokens that *arrived* inside the window / duration.
- latencies (TTFT, TPOT, ITL, E2E) are over the successful requests *sent* in
  the window; percentiles are numpy's linear interpolation (as vllm bench).
- each request judged against the per-request TTFT SLO (``slo_ttft_ms``): it *met* it
  when it completed without error and its TTFT was at most the SLO.
  ``slo_goodput_rps``: the served rate, counting only those (finished in the window);
  ``slo_attainment_pct``: the share of the requests sent in the window that met it.
- refusals: requests sent in the window that got an HTTP error status, counted per
  status, and their time from send to the error answer; ``other_failures``: every
  other error, by kind.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pdstack.bench.client import RequestResult

PERCENTILES = (50, 90, 99)
SLO_TTFT_MS = 2000.0  # the per-request TTFT SLO of ``pdstack bench --slo-ttft-ms``


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation); None for no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


Window = tuple[float, float]


def _inside(t: float, windows: Sequence[Window]) -> bool:
    return any(start <= t < end for start, end in windows)


def _total(windows: Sequence[Window]) -> float:
    if not windows or any(end <= start for start, end in windows):
        raise ValueError("empty window")
    return sum(end - start for start, end in windows)


def served_rate(results: Iterable[RequestResult], start: float, end: float) -> float:
    """Successful completions inside ``[start, end)`` per second."""
    return _served(results, [(start, end)])


def _served(
    results: Iterable[RequestResult], windows: Sequence[Window], slo_ttft_ms: float | None = None
) -> float:
    """Successful completions inside the windows per second; with ``slo_ttft_ms``, only
    those whose TTFT met it."""
    duration = _total(windows)
    done = sum(
        1 for r in results if r.ok and r.end_time is not None and _inside(r.end_time, windows)
        and (slo_ttft_ms is None or met_slo(r, slo_ttft_ms))
    )
    return done / duration


def failures(measured: Iterable[RequestResult]) -> Counter[str]:
    """How many requests failed, by error kind (``unfinished``: no answer, no error)."""
    out = Counter(r.error for r in measured if r.error is not None)
    unfinished = sum(1 for r in measured if r.error is None and r.end_time is None)
    if unfinished:
        out["unfinished"] += unfinished
    return out


def met_slo(r: RequestResult, slo_ttft_ms: float) -> bool:
    """Completed without error, with a TTFT of at most ``slo_ttft_ms``."""
    return r.ok and r.ttft is not None and r.ttft * 1000.0 <= slo_ttft_ms


def judged(
    results: Sequence[RequestResult], measured: Sequence[RequestResult],
    windows: Sequence[Window], slo_ttft_ms: float | None,
) -> dict[str, Any]:
    """Each request judged: SLO-attained throughput and attainment (with ``slo_ttft_ms``),
    refusals by HTTP status with their time to refusal, and the other failures by kind.
    ``measured``: the requests sent in the windows; ``results``: all of them."""
    refusals = Counter(r.refusal_status for r in measured if r.refusal_status is not None)
    refusal_ms = [
        (r.error_time - r.send_time) * 1000.0
        for r in measured if r.refusal_status is not None and r.error_time is not None
    ]
    refused = {r.error for r in measured if r.refusal_status is not None}
    other = {k: n for k, n in failures(measured).items() if k not in refused}
    out: dict[str, Any] = {}
    if slo_ttft_ms is not None:
        met = sum(1 for r in measured if met_slo(r, slo_ttft_ms))
        out["slo_ttft_ms"] = slo_ttft_ms
        out["slo_goodput_rps"] = _served(results, windows, slo_ttft_ms)
        out["slo_attainment_pct"] = 100.0 * met / len(measured) if measured else None
    out["refusals"] = dict(sorted(refusals.items()))
    out["median_refusal_ms"] = percentile(refusal_ms, 50)
    out["p99_refusal_ms"] = percentile(refusal_ms, 99)
    out["other_failures"] = dict(sorted(other.items()))
    return out


def tokens_in_window(results: Iterable[RequestResult], start: float, end: float) -> float:
    """Output tokens whose chunk arrived inside ``[start, end)`` (multi-token chunks
    split evenly by the request's output token count)."""
    return _tokens(results, [(start, end)])


def _tokens(results: Iterable[RequestResult], windows: Sequence[Window]) -> float:
    total = 0.0
    for r in results:
        if not r.chunk_times or r.output_tokens <= 0:
            continue
        per_chunk = r.output_tokens / len(r.chunk_times)
        inside = sum(1 for t in r.chunk_times if _inside(t, windows))
        total += inside * per_chunk
    return total


def _ms_stats(name: str, seconds: Sequence[float]) -> dict[str, float | None]:
    vals = [s * 1000.0 for s in seconds]
    out: dict[str, float | None] = {
        f"mean_{name}_ms": float(np.mean(vals)) if vals else None,
        f"median_{name}_ms": percentile(vals, 50),
        f"std_{name}_ms": float(np.std(vals)) if vals else None,
    }
    for q in PERCENTILES:
        out[f"p{q}_{name}_ms"] = percentile(vals, q)
    out[f"max_{name}_ms"] = max(vals) if vals else None
    return out


def summarize(
    results: Sequence[RequestResult],
    *,
    window_start: float | None = None,
    window_end: float | None = None,
    windows: Sequence[Window] | None = None,
    asked_rate: float | None,
    max_concurrency: int | None = None,
    slo_ttft_p50_ms: float | None = None,
    slo_ttft_p99_ms: float | None = None,
    slo_ttft_ms: float | None = None,
) -> dict[str, Any]:
    """The per-rate metrics dict that goes into the JSON file. The measurement is
    ``[window_start, window_end)``, or several ``windows`` pooled (interleaved runs).
    ``slo_ttft_ms``: the per-request TTFT SLO of the goodput and attainment keys."""
    if windows is None:
        if window_start is None or window_end is None:
            raise ValueError("need window_start and window_end, or windows")
        windows = [(window_start, window_end)]
    duration = _total(windows)
    measured = [r for r in results if _inside(r.send_time, windows)]
    ok = [r for r in measured if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    itls = [gap for r in ok for gap in r.itls]
    tpots = [
        (r.e2e - r.ttft) / (r.output_tokens - 1)  # type: ignore[operator]
        for r in ok
        if r.output_tokens > 1 and r.ttft is not None and r.e2e is not None
    ]
    errors = failures(measured)
    out_tokens = _tokens(results, windows)
    in_tokens = sum(r.prompt_tokens for r in ok)
    served = _served(results, windows)
    metrics: dict[str, Any] = {
        "request_rate": asked_rate,
        "max_concurrency": max_concurrency,
        "duration": duration,
        "num_prompts": len(measured),
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "sent_rate": len(measured) / duration,
        "request_throughput": served,
        "served_rate": served,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + in_tokens) / duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "errors": dict(sorted(errors.items())),
    }
    metrics.update(_ms_stats("ttft", ttfts))
    metrics.update(_ms_stats("tpot", tpots))
    metrics.update(_ms_stats("itl", itls))
    metrics.update(_ms_stats("e2el", e2es))
    metrics.update(judged(results, measured, windows, slo_ttft_ms))
    shared = [r.ttft for r in ok if r.shared and r.ttft is not None]
    unique = [r.ttft for r in ok if not r.shared and r.ttft is not None]
    metrics["median_ttft_shared_prefix_ms"] = percentile([t * 1000 for t in shared], 50)
    metrics["median_ttft_unique_prefix_ms"] = percentile([t * 1000 for t in unique], 50)
    if slo_ttft_p50_ms is not None and slo_ttft_p99_ms is not None:
        p50, p99 = metrics["median_ttft_ms"], metrics["p99_ttft_ms"]
        metrics["meets_ttft_slo"] = bool(
            p50 is not None and p99 is not None and p50 <= slo_ttft_p50_ms
            and p99 <= slo_ttft_p99_ms and not metrics["failed"]
        )
    return metrics


def cost_per_million_output_tokens(
    output_throughput: float, gpu_hour_price: float, gpus: int
) -> float | None:
    """Dollars (or whatever unit the price is in) per 1M output tokens at this throughput."""
    if output_throughput <= 0 or not math.isfinite(output_throughput):
        return None
    return gpu_hour_price * gpus / (output_throughput * 3600.0) * 1e6
