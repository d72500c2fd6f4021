"""Synthetic ``pdstack bench`` documents with known answers (test data, not measurements)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DURATION = 30.0
WORKLOAD = {
    "num_system_prompts": 4, "shared_share": 0.8, "system_len": "uniform:2000:6000",
    "user_len": "uniform:32:256", "output_len": "uniform:64:256", "token_ids": True,
    "token_id_range": [10, 4000], "seed": 1,
}


def point(
    rate: float, served: float, p50: float, p99: float, *,
    prefill: tuple[float, float] | None = None, first_byte: tuple[float, float] | None = None,
    out_tokens: float = 160.0, skip: float = 0.0,
) -> dict[str, Any]:
    """One results[] entry. ``prefill`` / ``first_byte``: (legs per second, mean ms) of the
    proxy's prefill and decode_first_byte legs."""
    pd: dict[str, float] = {"pdstack_proxy_skip_prefill_total": skip}
    for leg, got in (("prefill", prefill), ("decode_first_byte", first_byte)):
        if got is not None:
            count = got[0] * DURATION
            pd[f"pdstack_proxy_leg_seconds_count{{leg={leg}}}"] = count
            pd[f"pdstack_proxy_leg_seconds_sum{{leg={leg}}}"] = count * got[1] / 1000
    return {
        "request_rate": rate, "duration": DURATION, "sent_rate": rate, "served_rate": served,
        "request_throughput": served, "output_throughput": served * out_tokens,
        "completed": int(served * DURATION), "failed": 0,
        "p50_ttft_ms": p50, "p99_ttft_ms": p99,
        "prometheus": {"total": {"pdstack": pd}, "endpoints": {}},
    }


def bench_doc(
    label: str, gpus: int, points: list[dict[str, Any]], *, model: str = "deepseek-v2-lite",
    scenario: str | None = None, workload: dict[str, Any] | None = None,
) -> dict[str, Any]:
    config: dict[str, Any] = {"duration": DURATION, "gpus": gpus, "label": label,
                              "workload": workload or WORKLOAD}
    if scenario is not None:
        config["scenario"] = scenario
    return {"schema_version": 1, "tool": "pdstack bench", "label": label, "model_id": model,
            "config": config, "slo": {"ttft_p50_ms": 2000.0, "ttft_p99_ms": 3500.0},
            "results": points}


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def decode_bound(label: str = "nixl") -> dict[str, Any]:
    """1P1D: knee at 10 req/s; at 20 req/s the prefiller kept up (20 legs/s, 150 ms) but the
    decoder queued (served 12, first byte 2.8 s)."""
    return bench_doc(label, 2, [
        point(5, 5, 200, 400, prefill=(5, 90), first_byte=(5, 30)),
        point(10, 10, 300, 600, prefill=(10, 100), first_byte=(10, 50)),
        point(20, 12, 3000, 5000, prefill=(20, 150), first_byte=(12, 2800)),
    ])


def prefill_bound_1p2d(label: str = "nixl") -> dict[str, Any]:
    """1P2D: knee at 10 req/s; at 20 req/s the prefiller queued (handed over 16/s, leg 2.5 s)
    while the two decoders delivered all 16/s with a flat first byte."""
    return bench_doc(label, 3, [
        point(10, 10, 300, 600, prefill=(10, 150), first_byte=(10, 40)),
        point(20, 16, 2600, 4200, prefill=(16, 2500), first_byte=(16, 45)),
    ])
