"""Markdown tables of the KV-tier sweeps (results/h200x1-tiers, gpu/run_tiers.sh), and the
issue-23 acceptance checks computed from them.

    python gpu/summarize_tiers.py results/h200x1-tiers [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# label -> what ran (same engines, seed and rates for every variant of a workload)
VARIANTS = {
    "vllm": "`vllm serve`, its own defaults (no proxy)",
    "vllm-rep": "  repeat (a fresh machine)",
    "native": "vLLM + `--kv-offloading-size 32` (its native tier, no proxy)",
    "vllm-proxy": "vLLM defaults behind the planned proxy (admission, cap 512)",
    "pdstack": "**pdstack default** (`inventory/h200x1`: native tier 32 GiB + admission)",
    "pdstack-rep": "  repeat (new cache salt)",
}
WORKLOADS = ("mt", "turn", "seed")
# the phases after the single-engine one: their own variants, many-tenants workload
PAIRS = {
    "mt2": ("many-tenants, two engines on the one GPU (10 GiB KV each), the planned proxy in "
            "front (prefix/session affinity + admission)", {
        "native": "a native tier each (`inventory/h200x1-2e`: 16 GiB each)",
        "l1": "one shared LMCache L1 (`inventory/h200x1-2e-l1`: 32 GiB, `colocated+l1`)",
        "native-rep": "  native tier each, repeat",
        "l1-rep": "  shared LMCache L1, repeat",
    }),
    "mtpd": ("many-tenants, 1P1D on the one GPU (10 GiB KV each), the planned proxy in front "
             "(admission)", {
        "nixl": "NIXL alone (`inventory/h200x1-nixl`)",
        "native": "NIXL + the native tier on the prefiller (`inventory/h200x1-nixl-native`: "
                  "MultiConnector[Nixl, Offloading], 32 GiB)",
    }),
}


def load(d: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))}


def rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in run["results"]:
        tot = r.get("prometheus", {}).get("total", {})
        src = tot.get("prompt_tokens_by_source", {})
        out.append({
            "rate": r["request_rate"], "served": r["served_rate"], "failed": r["failed"],
            "p50": r["p50_ttft_ms"], "p99": r["p99_ttft_ms"],
            "ext": r.get("external_prefix_cache_hit_ratio"),
            "preempt": r.get("preemptions"), "computed": src.get("local_compute"),
            "itl": r.get("p50_itl_ms"), "out": r.get("output_throughput"),
        })
    return out


def fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def table(runs: dict[str, dict[str, Any]], wl: str, variants: dict[str, str] = VARIANTS) -> str:
    lines = ["| variant | asked req/s | served req/s | TTFT P50 ms | TTFT P99 ms | external hits "
             "| prompt tokens computed | preemptions | JSON |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, what in variants.items():
        name = f"{wl}-{key}"
        if name not in runs:
            continue
        rs = rows(runs[name])

        def j(f: str, s: str = ".0f", rs: list[dict[str, Any]] = rs) -> str:
            return " / ".join(fmt(r[f], s) for r in rs)
        ext = " / ".join("-" if r["ext"] is None else f"{r['ext']:.0%}" for r in rs)
        comp = " / ".join("-" if r["computed"] is None else f"{r['computed'] / 1e3:.0f} k"
                          for r in rs)
        lines.append(f"| {what} | {j('rate')} | {j('served', '.1f')} | {j('p50')} | {j('p99')} "
                     f"| {ext} | {comp} | {j('preempt')} | `{name}.json` |")
    return "\n".join(lines)


def acceptance(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 23: at the lowest rate where vLLM-with-defaults misses TTFT P50 <= 2 s or
    P99 <= 3.5 s, pdstack serves >= 1.25x its req/s with <= half its P99, and >= vLLM's native
    tier alone; on multi-turn within 5 % of vLLM's served load and TTFT P50."""
    out: dict[str, Any] = {}
    base = rows(runs["mt-vllm"])
    miss = next((r for r in base if r["p50"] > 2000 or r["p99"] > 3500), None)
    if miss is not None:
        rate = miss["rate"]
        pd = {r["rate"]: r for r in rows(runs["mt-pdstack"])}[rate]
        nat = {r["rate"]: r for r in rows(runs["mt-native"])}[rate]
        out["many_tenants"] = {
            "rate": rate, "vllm_served": miss["served"], "pdstack_served": pd["served"],
            "native_served": nat["served"], "served_ratio": pd["served"] / miss["served"],
            "vllm_p99_ms": miss["p99"], "pdstack_p99_ms": pd["p99"],
            "p99_ratio": pd["p99"] / miss["p99"],
            "ok": pd["served"] >= 1.25 * miss["served"] and pd["p99"] <= miss["p99"] / 2
            and pd["served"] >= nat["served"],
        }
    turn = []
    for b, p in zip(rows(runs["turn-vllm"]), rows(runs["turn-pdstack"]), strict=True):
        turn.append({"rate": b["rate"], "served_ratio": p["served"] / b["served"],
                     "p50_ratio": p["p50"] / b["p50"], "p50_ms": [b["p50"], p["p50"]],
                     "served_ok": p["served"] >= 0.95 * b["served"],
                     "p50_ok": p["p50"] <= 1.05 * b["p50"]})
    out["multi_turn"] = turn
    return out


def cli() -> tuple[dict[str, dict[str, Any]], Path | None]:
    """A summarize script's command line: DIR [--json OUT] -> (DIR's runs, OUT)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    return load(a.dir), a.json


def report(acc: dict[str, Any], out: Path | None) -> None:
    """Print the acceptance as a JSON block; also write it to ``out`` when given."""
    print("\n```\n" + json.dumps(acc, indent=1) + "\n```")
    if out:
        out.write_text(json.dumps(acc, indent=1) + "\n")


def main() -> None:
    runs, out = cli()
    for wl, title in zip(WORKLOADS, ("many-tenants", "multi-turn", "seed"), strict=True):
        print(f"\n### {title}\n\n{table(runs, wl)}")
    for wl, (title, variants) in PAIRS.items():
        if any(f"{wl}-{k}" in runs for k in variants):
            print(f"\n### {title}\n\n{table(runs, wl, variants)}")
    report(acceptance(runs), out)


if __name__ == "__main__":
    main()
