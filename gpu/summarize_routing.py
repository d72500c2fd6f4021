"""Issue 56's routing run (gpu/run_ceiling.sh's ``rt-*`` sweeps): the table and the acceptance.

    python gpu/summarize_routing.py DIR [--json OUT]

Three engines of one model on one GPU (RT_INV), the same engines behind each front in turn,
cold caches per sweep (the bench's --prompt-salt), the same seed and rates. Goodput is the
highest asked rate whose TTFT met the SLO (P50 and P99: the bench's ``meets_ttft_slo``) with
0 failed. Per rate: served, SLO attainment, TTFT P50 / P99, output tok/s, and each engine's
prefix-cache hit ratio (hits / queries of the sweep, from its own counters). The acceptance
(issue 56, many-tenants): pdstack >= 1.5x round robin's goodput, >= 1.15x cache_aware's, >=
kv_aware's with TTFT P99 <= 1.1x its at every rate both meet, >= its own hash ring's;
multi-turn (``turn-``): P50 and P99 within 10 % of kv_aware's at every rate both meet.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

FRONTS = {
    "rt-pdstack": "**pdstack** (KV-event routing, its admission)",
    "rt-ring": "pdstack, `--kv-events off` (its hash ring + session affinity)",
    "rt-rr": "vllm-router `round_robin`",
    "rt-ca": "vllm-router `cache_aware`",
    "rt-kv": "vllm-router `kv_aware` (the engines' KV events)",
    "rt-pd-w1": "pdstack, `--kv-miss-weight 1` (a miss weighs what a queued token does)",
    "rt-pd-63": "pdstack, stop 63's cost (`--kv-miss-weight 1 --kv-pending-s 0`)",
    "rt-pd-open": "pdstack's routing, its admission off (`--admission off`)",
    "rt-pd-kv12": "pdstack, its gate's watermark at 1.2 of the KV (`--admission-kv-high 1.2`)",
    "rt-pd-learn": "pdstack, its watermark learned per engine from its first bytes, 0.97 to 1.5 "
    "(`--admission-kv-learn-max 1.5`)",
    "rt-pd-cost": "pdstack, a prompt no engine holds to the least queued "
    "(`--kv-unheld cost`)",
    "rt-pd-w8": "pdstack, a miss weighs 8 queued tokens (`--kv-miss-weight 8`)",
}
ENGINE_PORTS = ("8290", "8291", "8292")


def load(path: Path) -> list[dict[str, Any]]:
    return sorted(json.loads(path.read_text())["results"], key=lambda r: r["request_rate"])


def engine_hits(r: dict[str, Any]) -> list[float | None]:
    """Each engine's prefix-cache hit ratio in this rate's window (None: no queries)."""
    out: list[float | None] = []
    eps = (r.get("prometheus") or {}).get("endpoints") or {}
    for port in ENGINE_PORTS:
        e = next((v for k, v in eps.items() if f":{port}/" in k), {})
        out.append(e.get("prefix_cache_hit_ratio"))
    return out


def goodput(rows: list[dict[str, Any]]) -> float:
    ok = [r["request_rate"] for r in rows if r.get("meets_ttft_slo") and not r.get("failed")]
    return max(ok, default=0.0)


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def table(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["| front | asked req/s | served | SLO % | TTFT P50 / P99 ms | out tok/s | "
             "engine hit ratios (prefix cache) |", "|---|---|---|---|---|---|---|"]
    for name, rows in runs.items():
        for r in rows:
            hits = " / ".join(fmt(h, ".2f") for h in engine_hits(r))
            lines.append(
                f"| {name} | {r['request_rate']:g} | {fmt(r.get('request_throughput'), '.1f')} | "
                f"{fmt(r.get('slo_attainment_pct'))} | {fmt(r.get('p50_ttft_ms'))} / "
                f"{fmt(r.get('p99_ttft_ms'))} | {fmt(r.get('output_throughput'))} | {hits} |")
    return lines


def acceptance(mt: dict[str, list[dict]], turn: dict[str, list[dict]]) -> dict[str, Any]:
    g = {k: goodput(v) for k, v in mt.items()}
    out: dict[str, Any] = {"goodput": g}
    p = g.get("rt-pdstack")
    if p is None:
        return out

    def ratio(other: str) -> float | None:
        return None if other not in g else (p / g[other] if g[other] else float("inf"))

    out["vs_rr"] = {"ratio": ratio("rt-rr"), "met": (ratio("rt-rr") or 0) >= 1.5}
    out["vs_cache_aware"] = {"ratio": ratio("rt-ca"), "met": (ratio("rt-ca") or 0) >= 1.15}
    out["vs_ring"] = {"ratio": ratio("rt-ring"), "met": (ratio("rt-ring") or 0) >= 1.0}
    if "rt-kv" in mt:
        both = [(a, b) for a in mt["rt-pdstack"] for b in mt["rt-kv"]
                if a["request_rate"] == b["request_rate"] and a.get("meets_ttft_slo")
                and b.get("meets_ttft_slo")]
        p99 = [(a["request_rate"], a["p99_ttft_ms"] / b["p99_ttft_ms"]) for a, b in both]
        out["vs_kv_aware"] = {"ratio": ratio("rt-kv"), "p99_ratio_by_rate": p99,
                              "met": (ratio("rt-kv") or 0) >= 1.0
                              and all(x <= 1.1 for _, x in p99)}
    if "rt-pdstack" in turn and "rt-kv" in turn:
        rows = []
        for a in turn["rt-pdstack"]:
            b = next((x for x in turn["rt-kv"] if x["request_rate"] == a["request_rate"]), None)
            if b and a.get("meets_ttft_slo") and b.get("meets_ttft_slo"):
                rows.append({"rate": a["request_rate"],
                             "p50": a["p50_ttft_ms"] / b["p50_ttft_ms"],
                             "p99": a["p99_ttft_ms"] / b["p99_ttft_ms"]})
        out["multi_turn_vs_kv_aware"] = {"by_rate": rows, "met": bool(rows) and all(
            r["p50"] <= 1.1 and r["p99"] <= 1.1 for r in rows)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    mt = {k: load(args.dir / f"{k}.json") for k in FRONTS if (args.dir / f"{k}.json").exists()}
    turn = {k: load(args.dir / f"turn-{k}.json") for k in FRONTS
            if (args.dir / f"turn-{k}.json").exists()}
    for k in FRONTS:
        print(f"- `{k}`: {FRONTS[k]}")
    print("\n## many-tenants\n")
    print("\n".join(table(mt)))
    if turn:
        print("\n## multi-turn\n")
        print("\n".join(table(turn)))
    acc = acceptance(mt, turn)
    print("\n## acceptance\n")
    print(json.dumps(acc, indent=1))
    if args.json:
        args.json.write_text(json.dumps(acc, indent=1) + "\n")


if __name__ == "__main__":
    main()
