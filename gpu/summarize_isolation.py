"""Issue 37's table and acceptance from a gpu/run_isolation.sh results folder.

    python3 gpu/summarize_isolation.py DIR [--alone chat-alone] [--batch-alone batch-alone]
                                           [--json DIR/acceptance.json]

For each NAME.json (chat) beside NAME-batch.json (batch, when batch ran): chat's TTFT P50 /
P99, served and failed; batch's served req/s, its 429s and 5xx; the chat ITL P90 (how long the
engine steps chat shared were); the proxy's holds by reason (chat queue wait per request).
Acceptance (issue 37) against ``--alone`` (chat alone on the same stack) and
``--batch-alone`` (the batch tenant alone at capacity): ``flood*``: chat P99 <= 3x alone,
P50 <= 2x, every chat request served; ``over*``: chat P99 <= 2x alone; batch under a flood
served >= 50 % of alone, no 5xx. A ``-chunk`` variant (another engine) is judged against
``chat-alone-chunk`` / ``batch-alone-chunk`` when those ran, a ``-split`` one (the batch tenant
on a second engine) against ``chat-alone`` / ``batch-alone-chunk``; each check names its
yardsticks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def result(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    rs = json.loads(path.read_text())["results"]
    return max(rs, key=lambda r: r.get("request_rate") or 0) if rs else None


def _pd(r: dict[str, Any]) -> dict[str, float]:
    return (r.get("prometheus") or {}).get("total", {}).get("pdstack", {}) or {}


def statuses(r: dict[str, Any]) -> tuple[int, int]:
    """(429s, 5xx) among a run's errors (keys like ``http_429`` or ``429``)."""
    t429 = t5xx = 0
    for key, n in (r.get("errors") or {}).items():
        digits = "".join(c for c in str(key) if c.isdigit())
        if digits == "429":
            t429 += n
        elif digits.startswith("5") and len(digits) == 3:
            t5xx += n
    return t429, t5xx


def row(d: Path, name: str) -> dict[str, Any] | None:
    chat = result(d / f"{name}.json")
    if chat is None:
        return None
    batch = result(d / f"{name}-batch.json")
    pd = _pd(chat)
    waits = pd.get("pdstack_proxy_tenant_queue_wait_seconds_sum{tenant=chat}")
    waited = pd.get("pdstack_proxy_tenant_queue_wait_seconds_count{tenant=chat}")
    out: dict[str, Any] = {
        "name": name,
        "chat_p50_ms": chat["p50_ttft_ms"],
        "chat_p99_ms": chat["p99_ttft_ms"],
        "chat_served": chat["request_throughput"],
        "chat_failed": chat["failed"],
        "chat_itl_p90_ms": chat.get("p90_itl_ms"),
        "chat_queue_ms": (1000 * waits / waited) if waits is not None and waited else None,
        "held": {k.split("reason=")[1].rstrip("}"): v for k, v in pd.items()
                 if k.startswith("pdstack_proxy_admission_held_total") and v},
    }
    if batch is not None:
        t429, t5xx = statuses(batch)
        out.update(batch_served=batch["request_throughput"], batch_429=t429, batch_5xx=t5xx,
                   batch_errors=batch.get("errors") or {})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--alone", default="chat-alone")
    ap.add_argument("--batch-alone", default="batch-alone")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    names = sorted(p.stem for p in a.dir.glob("*.json")
                   if not p.stem.endswith("-batch") and p.stem != "acceptance")
    rows = [r for r in (row(a.dir, n) for n in names) if r is not None]
    print("| variant | chat P50 ms | chat P99 ms | chat served/s | chat failed | chat ITL P90 ms "
          "| chat queue ms/req | batch served/s | batch 429 / 5xx | held |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = (f"{r['batch_served']:.2f}", f"{r['batch_429']} / {r['batch_5xx']}") \
            if "batch_served" in r else ("-", "-")
        q = "-" if r["chat_queue_ms"] is None else f"{r['chat_queue_ms']:.1f}"
        itl = "-" if r["chat_itl_p90_ms"] is None else f"{r['chat_itl_p90_ms']:.0f}"
        print(f"| {r['name']} | {r['chat_p50_ms']:.0f} | {r['chat_p99_ms']:.0f} | "
              f"{r['chat_served']:.2f} | {r['chat_failed']} | {itl} | {q} | {b[0]} | {b[1]} | "
              f"{r['held'] or ''} |")
    by_name = {r["name"]: r for r in rows}
    # each variant against the alone runs of its own engine (a -chunk variant against
    # chat-alone-chunk / batch-alone-chunk when those ran), else the plain ones
    # (a -split variant: chat on the plain engine, the batch tenant alone on the second one,
    # batch-alone-chunk)
    yardsticks = {}
    for suffix, chat_suffix in (("", ""), ("-chunk", "-chunk"), ("-split", "")):
        b_name = a.batch_alone + ("-chunk" if suffix else "")
        batch_alone = result(a.dir / f"{b_name}.json")
        if batch_alone is None:
            b_name, batch_alone = a.batch_alone, result(a.dir / f"{a.batch_alone}.json")
        yardsticks[suffix] = (by_name.get(a.alone + chat_suffix) or by_name.get(a.alone),
                              b_name, batch_alone)
    checks: dict[str, Any] = {}
    for r in rows:
        kind = next((k for k in ("-chunk", "-split") if k in r["name"]), "")
        alone, b_name, batch_alone = yardsticks[kind]
        if alone is None:
            continue
        if r["name"].startswith("flood"):
            checks[r["name"]] = {
                "p99_x_alone": r["chat_p99_ms"] / alone["chat_p99_ms"],
                "p50_x_alone": r["chat_p50_ms"] / alone["chat_p50_ms"],
                "chat_all_served": r["chat_failed"] == 0,
                "batch_x_alone": (r.get("batch_served", 0) / batch_alone["request_throughput"]
                                  if batch_alone else None),
                "batch_5xx": r.get("batch_5xx"),
                "against": f"{alone['name']}, {b_name if batch_alone else '-'}",
            }
            c = checks[r["name"]]
            c["met"] = (c["p99_x_alone"] <= 3 and c["p50_x_alone"] <= 2
                        and c["chat_all_served"] and not c["batch_5xx"]
                        and c["batch_x_alone"] is not None and c["batch_x_alone"] >= 0.5)
        elif r["name"].startswith("over"):
            x = r["chat_p99_ms"] / alone["chat_p99_ms"]
            checks[r["name"]] = {"p99_x_alone": x, "met": x <= 2, "against": alone["name"]}
    for name, c in checks.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in c.items()))
    if a.json:
        a.json.write_text(json.dumps({"alone": a.alone, "rows": rows, "checks": checks},
                                     indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
