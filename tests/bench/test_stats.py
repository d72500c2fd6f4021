"""Statistics: percentiles, served rate, windows, errors, cost."""

from __future__ import annotations

import math

import pytest

from pdstack.bench.client import RequestResult
from pdstack.bench.stats import (
    cost_per_million_output_tokens,
    percentile,
    served_rate,
    summarize,
    tokens_in_window,
)


def _ok(send: float, ttft: float, itl: float, n: int, shared: bool = True) -> RequestResult:
    first = send + ttft
    chunks = [first + i * itl for i in range(n)]
    return RequestResult(
        index=0, shared=shared, send_time=send, prompt_tokens=10,
        first_token_time=first, end_time=chunks[-1], chunk_times=chunks, output_tokens=n,
    )


def test_percentile_linear_interpolation() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def test_served_rate_counts_completions_inside_window_only() -> None:
    results = [
        _ok(send=0.5, ttft=0.1, itl=0.1, n=10),   # ends 1.5: inside [1, 11)
        _ok(send=5.0, ttft=0.1, itl=0.1, n=10),   # ends 6.0: inside
        _ok(send=10.5, ttft=0.1, itl=0.1, n=10),  # ends 11.5: outside
        _ok(send=0.0, ttft=0.1, itl=0.1, n=2),    # ends 0.2: before the window
    ]
    failed = RequestResult(index=9, shared=False, send_time=2.0, prompt_tokens=1,
                           end_time=3.0, error="http_503")
    assert served_rate([*results, failed], 1.0, 11.0) == pytest.approx(2 / 10)
    with pytest.raises(ValueError):
        served_rate(results, 2.0, 2.0)


def test_tokens_in_window_splits_multi_token_chunks() -> None:
    r = _ok(send=0.0, ttft=1.0, itl=1.0, n=4)  # chunks at 1, 2, 3, 4
    r.output_tokens = 8  # two tokens per chunk
    assert tokens_in_window([r], 1.5, 3.5) == pytest.approx(4.0)
    assert tokens_in_window([r], 0.0, 10.0) == pytest.approx(8.0)


def test_summarize_latencies_errors_and_window() -> None:
    # 10 requests sent inside [0, 10): TTFT 100..190 ms, ITL 20 ms, 5 tokens
    results = [_ok(send=float(i), ttft=0.1 + 0.01 * i, itl=0.02, n=5, shared=i % 2 == 0)
               for i in range(10)]
    results.append(_ok(send=-1.0, ttft=5.0, itl=0.02, n=5))  # warm-up: not measured
    results.append(RequestResult(index=20, shared=True, send_time=3.0, prompt_tokens=1,
                                 error="timeout"))
    results.append(RequestResult(index=21, shared=True, send_time=4.0, prompt_tokens=1,
                                 first_token_time=4.2))  # never finished
    m = summarize(results, window_start=0.0, window_end=10.0, asked_rate=1.0,
                  slo_ttft_p50_ms=2000, slo_ttft_p99_ms=3500)
    assert m["num_prompts"] == 12
    assert m["completed"] == 10
    assert m["failed"] == 2
    assert m["errors"] == {"timeout": 1, "unfinished": 1}
    assert m["sent_rate"] == pytest.approx(1.2)
    assert m["median_ttft_ms"] == pytest.approx(145.0)
    assert m["p99_ttft_ms"] == pytest.approx(189.1)
    assert m["median_itl_ms"] == pytest.approx(20.0)
    assert m["mean_tpot_ms"] == pytest.approx(20.0)
    assert m["median_e2el_ms"] == pytest.approx(145.0 + 80.0)
    assert m["total_output_tokens"] == 50
    assert m["median_ttft_shared_prefix_ms"] == pytest.approx(140.0)
    assert m["median_ttft_unique_prefix_ms"] == pytest.approx(150.0)
    assert m["meets_ttft_slo"] is False  # latencies fine, but requests failed


def test_summarize_meets_slo_and_misses_it() -> None:
    fast = [_ok(send=float(i), ttft=0.5, itl=0.01, n=3) for i in range(5)]
    slow = [_ok(send=float(i), ttft=2.5, itl=0.01, n=3) for i in range(5)]
    kw = dict(window_start=0.0, window_end=5.0, asked_rate=1.0,
              slo_ttft_p50_ms=2000.0, slo_ttft_p99_ms=3500.0)
    assert summarize(fast, **kw)["meets_ttft_slo"] is True  # type: ignore[arg-type]
    assert summarize(slow, **kw)["meets_ttft_slo"] is False  # type: ignore[arg-type]


def test_empty_window_gives_none_not_nan() -> None:
    m = summarize([], window_start=0.0, window_end=1.0, asked_rate=1.0)
    assert m["completed"] == 0
    assert m["median_ttft_ms"] is None
    assert m["request_throughput"] == 0.0


def test_cost_per_million_output_tokens() -> None:
    # 1000 tok/s = 3.6M tok/h; 2 GPUs at 3.6/h = 7.2/h -> 2.0 per 1M
    assert cost_per_million_output_tokens(1000.0, 3.6, 2) == pytest.approx(2.0)
    assert cost_per_million_output_tokens(0.0, 3.6, 2) is None
    assert cost_per_million_output_tokens(math.inf, 3.6, 2) is None


def test_summarize_pools_several_windows() -> None:
    a = [_ok(send=float(i), ttft=0.1, itl=0.01, n=2) for i in range(5)]        # window [0, 5)
    b = [_ok(send=100.0 + i, ttft=0.3, itl=0.01, n=2) for i in range(5)]  # window [100, 105)
    gap = [_ok(send=50.0, ttft=9.0, itl=0.01, n=2)]  # between the windows: not measured
    m = summarize([*a, *gap, *b], windows=[(0.0, 5.0), (100.0, 105.0)], asked_rate=None)
    assert m["duration"] == 10.0
    assert m["completed"] == 10
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["max_ttft_ms"] == pytest.approx(300.0)
    with pytest.raises(ValueError):
        summarize(a, windows=[(5.0, 5.0)], asked_rate=None)


def test_content_tokens_counts_token_events_not_the_role_chunk() -> None:
    from pdstack.bench.client import content_tokens

    assert content_tokens({"delta": {"role": "assistant", "content": ""}}) == 0
    assert content_tokens({"delta": {"role": "assistant", "content": "Hi"}}) == 1
    assert content_tokens({"delta": {"content": ""}}) == 1  # a token with no text yet
    assert content_tokens({"delta": {"content": " t1"}}) == 1
    assert content_tokens({"delta": {"reasoning_content": "hmm"}}) == 1
    assert content_tokens({"delta": {}, "finish_reason": "stop"}) == 0
    assert content_tokens({"text": ""}) == 1
    assert content_tokens({"text": " t1", "token_ids": [5, 6]}) == 2
    assert content_tokens({"index": 0, "finish_reason": "length"}) == 0
