"""Markdown tables of the h200x1 sweeps (issue 12): one row per variant and asked rate.

    python gpu/summarize_h200x1.py results/h200x1       # prints the tables

Every number comes from the variant's ``pdstack bench`` JSON: the client's own timings and
the deltas of the engines' (and proxy's, LMCache server's) /metrics over the window.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GROUPS = {
    "Step 1 - one engine, many-tenants, V2-Lite": (
        ("mt-v2-alone", "vLLM alone"),
        ("mt-v2-alone-adm", "vLLM alone + admission"),
        ("mt-v2-tier", "+ LMCache tier"),
        ("mt-v2-tier-adm", "+ LMCache tier + admission"),
    ),
    "Step 1 - one engine, many-tenants, V3-shaped": (
        ("mt-v3-alone", "vLLM alone"),
        ("mt-v3-tier-adm", "+ LMCache tier + admission"),
    ),
    "Step 1 - one engine, multi-turn, V2-Lite": (
        ("mtt-v2-alone", "vLLM alone"),
        ("mtt-v2-tier-adm", "+ LMCache tier + admission"),
    ),
    "Step 2 - 1P1D on one GPU (both engines share it), seed, V2-Lite": (
        ("pd-nixl", "NIXL"),
        ("pd-nixl-adm", "NIXL + admission"),
        ("pd-nixl-l1", "NIXL + L1 tier"),
        ("pd-nixl-l1-adm", "NIXL + L1 tier + admission"),
        ("pd-shared-l1", "shared L1"),
        ("pd-shared-l1-adm", "shared L1 + admission"),
    ),
    # run 2 (RUN=2 gpu/run_h200x1.sh): its own baseline; NIXL with cuda_ipc GET forced on;
    # admission with max_waiting 2 ("adm2"), a running cap ("cap 64")
    "Run 2, step 1 - one engine, many-tenants, V2-Lite": (
        ("r2-mt-v2-alone", "vLLM alone"),
        ("r2-mt-v2-tier", "+ LMCache tier"),
        ("r2-mt-v2-tier-adm", "+ LMCache tier + admission (max_waiting 0)"),
        ("r2-mt-v2-tier-adm2", "+ LMCache tier + admission (max_waiting 2)"),
        ("r2-mt-v2-tier-adm2-cap", "+ LMCache tier + admission (max_waiting 2, cap 128)"),
    ),
    "Run 2, step 1 - one engine, multi-turn, V2-Lite": (
        ("r2-mtt-v2-alone", "vLLM alone"),
        ("r2-mtt-v2-tier-adm-cap", "+ LMCache tier + admission (max_waiting 2, cap 64)"),
        ("r2-mtt-v2-tier-adm-cap128", "+ LMCache tier + admission (max_waiting 2, cap 128)"),
    ),
    "Run 2, step 2 - 1P1D on one GPU, seed, V2-Lite, NIXL with cuda_ipc GET": (
        ("r2-pd-nixl", "NIXL"),
        ("r2-pd-nixl-adm", "NIXL + admission (max_waiting 2)"),
        ("r2-pd-nixl-l1", "NIXL + L1 tier"),
        ("r2-pd-nixl-l1-adm", "NIXL + L1 tier + admission (max_waiting 2)"),
        ("r2-pd-nixl-adm-cap", "NIXL + admission (max_waiting 2, cap 128)"),
        ("r2-pd-nixl-l1-adm-cap", "NIXL + L1 tier + admission (max_waiting 2, cap 128)"),
        ("r2-pd-shared-l1", "shared L1"),
        ("r2-pd-shared-l1-adm-cap", "shared L1 + admission (max_waiting 2, cap 128)"),
    ),
}
HEAD = (
    "| variant | asked | sent | served | ok/failed | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
    "| preempt | KV peak % | running peak | GPU hit % | ext hit % | computed k tok "
    "| adm. waited (mean s) |"
)


def fmt(v: float | None, nd: int = 0) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def row(name: str, r: dict) -> str:
    prom = (r.get("prometheus") or {}).get("total") or {}
    pd = prom.get("pdstack") or {}
    by_src = prom.get("prompt_tokens_by_source") or {}
    computed = by_src.get("local_compute")
    waited = pd.get("pdstack_proxy_admission_waited_total")
    wait_s = pd.get("pdstack_proxy_admission_wait_seconds_total")
    if waited is None:
        adm = "-"
    else:
        adm = f"{waited:.0f} ({(wait_s or 0) / waited:.2f})" if waited else "0"
    hit = prom.get("prefix_cache_hit_ratio")
    ext = prom.get("external_prefix_cache_hit_ratio")
    kv = r.get("peak_kv_cache_usage")
    running = max(
        ((e.get("gauges") or {}).get("num_requests_running") or {}).get("peak") or 0
        for e in ((r.get("prometheus") or {}).get("endpoints") or {"-": {}}).values()
    )
    return (
        f"| {name} | {fmt(r['request_rate'])} | {fmt(r['sent_rate'], 1)} "
        f"| {fmt(r['served_rate'], 1)} | {r['completed']}/{r['failed']} "
        f"| {fmt(r['p50_ttft_ms'])} | {fmt(r['p99_ttft_ms'])} "
        f"| {fmt(r['p50_itl_ms'], 1)} | {fmt(r['p99_itl_ms'], 1)} "
        f"| {fmt(r.get('preemptions'))} | {fmt(kv * 100 if kv is not None else None)} "
        f"| {fmt(running)} "
        f"| {fmt(hit * 100 if hit is not None else None)} "
        f"| {fmt(ext * 100 if ext is not None else None)} "
        f"| {fmt(computed / 1000 if computed is not None else None)} | {adm} |"
    )


def main(folder: str) -> int:
    base = Path(folder)
    for title, variants in GROUPS.items():
        print(f"\n### {title}\n")
        print(HEAD)
        print("|---" * 16 + "|")
        for stem, name in variants:
            f = base / f"{stem}.json"
            if not f.is_file():
                print(f"| {name} | not run |" + " |" * 14)
                continue
            for r in json.loads(f.read_text())["results"]:
                print(row(name, r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "results/h200x1"))
