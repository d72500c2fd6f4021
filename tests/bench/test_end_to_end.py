"""`pdstack bench` end to end against fake engines with known TTFT/ITL (separate processes)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

FakeFactory = Callable[..., str]
REPO = Path(__file__).resolve().parents[2]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Keys a run's JSON carries per rate (named like `vllm bench serve` where they overlap).
RESULT_KEYS = {
    "request_rate", "duration", "completed", "failed", "request_throughput",
    "output_throughput", "total_token_throughput", "total_input_tokens", "total_output_tokens",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
    "sent_rate", "served_rate", "errors", "meets_ttft_slo",
    "slo_ttft_ms", "slo_goodput_rps", "slo_attainment_pct", "refusals", "median_refusal_ms",
    "p99_refusal_ms", "other_failures",
}


def bench(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdstack.cli", "bench", "--no-progress", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
    )


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_sweep_measures_injected_ttft_and_itl(fake_engine: FakeFactory, tmp_path: Path) -> None:
    ttft_ms, itl_ms = 80.0, 15.0
    url = fake_engine(ttft_ms=ttft_ms, itl_ms=itl_ms, output_tokens=1000)
    out = tmp_path / "run.json"
    proc = bench("--target", url, "--rates", "2,4,8", "--duration", "3", "--warmup", "1",
                 "--system-len", "64", "--user-len", "uniform:8:16", "--output-len", "12",
                 "--metrics-url", url + "/metrics", "--gpu-hour-price", "3.6", "--gpus", "2",
                 "--label", "fake", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = load(out)
    assert doc["model_id"] == "fake"  # the first of /v1/models
    assert [r["request_rate"] for r in doc["results"]] == [2.0, 4.0, 8.0]
    for r in doc["results"]:
        assert set(r) >= RESULT_KEYS, RESULT_KEYS - set(r)
        assert r["failed"] == 0 and r["errors"] == {}
        assert r["completed"] > 0
        # TTFT = time to the first content token: the injected delay plus a little
        assert ttft_ms <= r["median_ttft_ms"] <= ttft_ms + 40, r["median_ttft_ms"]
        assert r["p99_ttft_ms"] >= r["median_ttft_ms"]
        assert itl_ms * 0.9 <= r["median_itl_ms"] <= itl_ms + 10, r["median_itl_ms"]
        expected_e2e = ttft_ms + 11 * itl_ms
        assert expected_e2e <= r["median_e2el_ms"] <= expected_e2e + 80
        assert r["total_output_tokens"] == 12 * r["completed"]  # from the usage event
        # a load the fake carries easily: everything asked is served
        assert r["request_throughput"] == pytest.approx(r["sent_rate"], abs=1.0)
        assert r["meets_ttft_slo"] is True
        assert r["slo_ttft_ms"] == 2000.0 and r["slo_attainment_pct"] == 100.0
        assert r["slo_goodput_rps"] == r["request_throughput"]
        prom = r["prometheus"]["total"]
        assert prom["prompt_tokens_by_source"]["local_compute"] > 0
        assert r["cost_per_1m_output_tokens"] == pytest.approx(
            3.6 * 2 / (r["output_throughput"] * 3600) * 1e6)
    # the summary table has a line per rate, all the same width
    table = proc.stdout.split("\nwrote ")[0].splitlines()
    assert len({len(line) for line in table[:5]}) == 1
    assert "SLO: TTFT p50 <= 2000 ms" in proc.stdout
    for name in ("run_served.png", "run_ttft.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000


def test_token_ids_and_client_side_pd(fake_engine: FakeFactory, tmp_path: Path) -> None:
    """--token-ids sends int lists to /v1/completions; --prefill-url plays the P/D proxy:
    TTFT = prefill time + decode's first token, and the decoder sees KV-transfer requests."""
    prefill = fake_engine(ttft_ms=60, name="p0")
    decode = fake_engine(ttft_ms=20, itl_ms=5, output_tokens=1000, name="d0")
    out = tmp_path / "pd.json"
    proc = bench("--target", decode, "--prefill-url", prefill, "--token-ids",
                 "--rates", "5", "--duration", "2", "--warmup", "0.5", "--system-len", "32",
                 "--user-len", "8", "--output-len", "6", "--metrics-url", decode + "/metrics",
                 "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    (r,) = load(out)["results"]
    assert r["failed"] == 0 and r["completed"] > 0
    assert 80 <= r["median_ttft_ms"] <= 80 + 40, r["median_ttft_ms"]
    by_source = r["prometheus"]["total"]["prompt_tokens_by_source"]
    assert by_source["external_kv_transfer"] > 0
    assert by_source["local_compute"] == 0
    assert r["prometheus"]["total"]["prompt_tokens_not_computed_ratio"] == 1.0
    assert r["total_input_tokens"] == 40 * r["completed"]  # 32 + 8 ids each


def test_errors_are_counted_by_kind(fake_engine: FakeFactory, tmp_path: Path) -> None:
    url = fake_engine(ttft_ms=5, itl_ms=1)
    req = urllib.request.Request(url + "/fake/faults", data=json.dumps({"status": 503}).encode(),
                                 method="PUT", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=5).close()
    out = tmp_path / "err.json"
    proc = bench("--target", url, "--model", "fake", "--rates", "5", "--duration", "2",
                 "--warmup", "0", "--output", str(out))
    assert proc.returncode == 1  # failures make the run fail
    (r,) = load(out)["results"]
    assert r["completed"] == 0
    assert r["failed"] > 0
    assert r["errors"] == {"http_503": r["failed"]}
    assert r["request_throughput"] == 0.0
    assert r["median_ttft_ms"] is None
    assert r["meets_ttft_slo"] is False
    assert "http_503" in proc.stdout
    # each request judged: all refused with 503, quickly; none met the per-request SLO
    assert r["refusals"] == {"503": r["failed"]} and r["other_failures"] == {}
    assert 0 < r["median_refusal_ms"] <= r["p99_refusal_ms"] < 1000
    assert r["slo_attainment_pct"] == 0.0 and r["slo_goodput_rps"] == 0.0
    assert f"5/s refusals: 503 x{r['failed']}" in proc.stdout


def test_compare_overlays_runs(fake_engine: FakeFactory, tmp_path: Path) -> None:
    url = fake_engine(ttft_ms=10, itl_ms=2)
    for name in ("a", "b"):
        out = tmp_path / f"{name}.json"
        proc = bench("--target", url, "--rates", "2,4", "--duration", "1", "--warmup", "0",
                     "--output-len", "4", "--label", name, "--output", str(out))
        assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "pdstack.cli", "bench", "compare", str(tmp_path / "a.json"),
         str(tmp_path / "b.json"), "--output", str(tmp_path / "cmp.png")],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "== a" in proc.stdout and "== b" in proc.stdout
    for name in ("cmp_served.png", "cmp_ttft.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_bad_input_is_one_clear_error(tmp_path: Path) -> None:
    proc = bench("--rates", "1")
    assert proc.returncode == 2 and "--target" in proc.stderr
    proc = bench("--target", "http://127.0.0.1:9", "--rates", "1,-2")
    assert proc.returncode == 2 and "rates" in proc.stderr
    proc = bench("--target", "http://127.0.0.1:9", "--system-len", "gamma:1:2")
    assert proc.returncode == 2 and "gamma:1:2" in proc.stderr
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "pdstack.cli", "bench", "compare", str(bad)],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "x.json" in proc.stderr


async def test_closed_loop_keeps_n_streams(fake_engine: FakeFactory) -> None:
    """N closed-loop streams: throughput = N / request time (Little's law), and the
    measured TTFT/ITL are the injected ones."""
    from pdstack.bench.client import BenchClient
    from pdstack.bench.runner import run_closed_loop
    from pdstack.bench.stats import summarize
    from pdstack.bench.workload import Distribution, Workload, WorkloadConfig

    url = fake_engine(ttft_ms=50, itl_ms=10, output_tokens=1000)
    workload = Workload(WorkloadConfig(system_len=Distribution.parse("16"),
                                       user_len=Distribution.parse("4"),
                                       output_len=Distribution.parse("6")))
    async with BenchClient(url, "fake", endpoint="completions") as client:
        results, start, end = await run_closed_loop(client, workload, 8, duration=3.0,
                                                    warmup=1.0)
    m = summarize(results, window_start=start, window_end=end, asked_rate=None)
    assert m["failed"] == 0
    assert 50 <= m["median_ttft_ms"] <= 90
    assert 10 <= m["median_itl_ms"] <= 20
    expected = 8 / (m["mean_e2el_ms"] / 1000)
    assert m["request_throughput"] == pytest.approx(expected, rel=0.2)
    # never more than 8 in flight: at any send, fewer than 8 earlier requests still open
    spans = sorted((r.send_time, r.end_time or end) for r in results)
    for i, (t, _) in enumerate(spans):
        assert sum(1 for s, e in spans[:i] if e > t) < 8


def test_multi_turn_scenario_sends_sessions_and_records_gauges(
    fake_engine: FakeFactory, tmp_path: Path
) -> None:
    """The multi-turn scenario end to end against the fake engine (a test double):
    every turn carries its conversation's id as ``user`` and ``X-Session-ID``, a later
    turn's prompt extends the earlier one's, and the load gauges were sampled."""
    url = fake_engine(ttft_ms=5.0, itl_ms=1.0, output_tokens=1000, record=True)
    out = tmp_path / "mt.json"
    proc = bench("--target", url, "--rates", "6", "--duration", "3", "--warmup", "1",
                 "--scenario", "multi-turn", "--turns", "4", "--think-time", "0.4",
                 "--system-len", "24", "--user-len", "6", "--output-len", "5", "--token-ids",
                 "--metrics-url", url + "/metrics", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = load(out)
    assert doc["config"]["scenario"] == "multi-turn"
    assert (doc["config"]["workload"]["turns"], doc["config"]["workload"]["think_time_s"]) == (
        "4", 0.4)
    r = doc["results"][0]
    assert r["failed"] == 0 and r["completed"] > 5
    gauges = r["prometheus"]["total"]["gauges"]
    assert gauges["samples"] >= 3  # one a second over the 3 s window
    assert gauges["num_requests_running"]["peak"] >= 0.0
    assert gauges["kv_cache_usage"] == {"peak": None, "mean": None}  # the fake has none
    assert "preempt" in proc.stdout.splitlines()[0]
    with urllib.request.urlopen(url + "/fake/requests") as resp:
        seen = json.loads(resp.read())
    by_session: dict[str, list[list[int]]] = {}
    for s in seen:
        if s["body"] is None or "prompt" not in s["body"]:
            continue
        session = s["headers"]["x-session-id"]
        assert s["body"]["user"] == session
        by_session.setdefault(session, []).append(s["body"]["prompt"])
    assert len(by_session) >= 3
    extended = 0
    for prompts in by_session.values():
        prompts.sort(key=len)
        for a, b in itertools.pairwise(prompts):
            assert b[: len(a)] == a
            extended += 1
    assert extended >= 3
