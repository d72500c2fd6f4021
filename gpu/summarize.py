"""Markdown table of the h200x2 sweeps: one row per topology and asked rate.

    python gpu/summarize.py results/h200x2            # prints the table
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ORDER = ("colocated", "nixl", "shared-l1", "shared-l1-skip")
NAMES = {
    "colocated": "2 independent engines",
    "nixl": "1P1D NIXL",
    "shared-l1": "1P1D shared L1",
    "shared-l1-skip": "1P1D shared L1 + skip-prefill",
}


def fmt(v: float | None, nd: int = 0) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def rows(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    out = []
    for r in d["results"]:
        prom = (r.get("prometheus") or {}).get("total") or {}
        pd = prom.get("pdstack") or {}
        skipped = pd.get("pdstack_proxy_skip_prefill_total")
        hit = prom.get("prefix_cache_hit_ratio")
        ext = prom.get("external_prefix_cache_hit_ratio")
        out.append(
            f"| {NAMES.get(d['label'], d['label'])} | {fmt(r['request_rate'])} "
            f"| {fmt(r['served_rate'], 1)} | {r['completed']}/{r['failed']} "
            f"| {fmt(r['p50_ttft_ms'])} | {fmt(r['p99_ttft_ms'])} "
            f"| {fmt(r.get('median_ttft_shared_prefix_ms'))} "
            f"| {fmt(r.get('median_ttft_unique_prefix_ms'))} "
            f"| {fmt(r['p50_itl_ms'], 1)} | {fmt(r['output_throughput'])} "
            f"| {fmt(hit * 100 if hit is not None else None)} "
            f"| {fmt(ext * 100 if ext is not None else None)} "
            f"| {fmt(skipped)} |"
        )
    return out


def main(folder: str) -> int:
    base = Path(folder)
    print("| topology | asked req/s | served req/s | ok/failed | TTFT p50 ms | TTFT p99 ms "
          "| TTFT p50 shared-prefix ms | TTFT p50 unique-prefix ms | ITL p50 ms | out tok/s "
          "| GPU prefix hit % | external (LMCache/NIXL) hit % | skip-prefill requests |")
    print("|---" * 13 + "|")
    for name in ORDER:
        f = base / f"{name}.json"
        if f.is_file():
            print("\n".join(rows(f)))
        else:
            print(f"| {NAMES[name]} | not run | | | | | | | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "results/h200x2"))
