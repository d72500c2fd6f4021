"""Outputs: the fixed-width summary table, the JSON file and the PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# (header, JSON key, format, width)
COLUMNS: tuple[tuple[str, str, str, int], ...] = (
    ("asked/s", "request_rate", "{:.2f}", 8),
    ("sent/s", "sent_rate", "{:.2f}", 8),
    ("served/s", "request_throughput", "{:.2f}", 9),
    ("ok", "completed", "{:d}", 6),
    ("err", "failed", "{:d}", 5),
    ("good/s", "slo_goodput_rps", "{:.2f}", 7),
    ("SLO%", "slo_attainment_pct", "{:.0f}%", 5),
    ("TTFT p50", "median_ttft_ms", "{:.0f}", 9),
    ("p90", "p90_ttft_ms", "{:.0f}", 7),
    ("p99", "p99_ttft_ms", "{:.0f}", 7),
    ("ITL p50", "median_itl_ms", "{:.1f}", 8),
    ("p99", "p99_itl_ms", "{:.1f}", 7),
    ("E2E p50", "median_e2el_ms", "{:.0f}", 8),
    ("out tok/s", "output_throughput", "{:.1f}", 10),
    ("prefix hit", "prefix_cache_hit_ratio", "{:.1%}", 10),
    ("ext hit", "external_prefix_cache_hit_ratio", "{:.0%}", 7),
    ("preempt", "preemptions", "{:.0f}", 7),
    ("KV peak", "peak_kv_cache_usage", "{:.0%}", 7),
    ("$/1M out", "cost_per_1m_output_tokens", "{:.2f}", 9),
)


def _cell(value: Any, fmt: str, width: int) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        text = "-"
    else:
        try:
            text = fmt.format(value)
        except (ValueError, TypeError):
            text = str(value)
    return text.rjust(width)[:width] if len(text) <= width else text[: width - 1] + "~"


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.0f}"


def _judged(label: str, r: dict[str, Any]) -> str | None:
    """One line of refusals by HTTP status (with their time to refusal) and of the other
    failures, for a rate or a tenant; None when there were none."""
    parts = []
    if r.get("refusals"):
        parts.append(
            f"{label} refusals: " + ", ".join(f"{s} x{n}" for s, n in r["refusals"].items())
            + f" (time to refusal p50 {_ms(r.get('median_refusal_ms'))} ms, "
            f"p99 {_ms(r.get('p99_refusal_ms'))} ms)"
        )
    if r.get("other_failures"):
        parts.append(
            f"{label} other failures: "
            + ", ".join(f"{k} {n}" for k, n in r["other_failures"].items())
        )
    return "; ".join(parts) or None


def summary_table(doc: dict[str, Any]) -> str:
    """Fixed-width table, one line per asked rate; times in ms."""
    results = doc["results"]
    cols = [c for c in COLUMNS if any(c[1] in r for r in results) or c[1] == "request_rate"]
    header = " ".join(h.rjust(w) for h, _, _, w in cols)
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(" ".join(_cell(r.get(key), fmt, w) for _, key, fmt, w in cols))
    slo = doc.get("slo") or {}
    if slo:
        lines.append(
            f"SLO: TTFT p50 <= {slo['ttft_p50_ms']:.0f} ms, p99 <= {slo['ttft_p99_ms']:.0f} ms; "
            + ", ".join(
                f"{r['request_rate']:g}/s {'ok' if r.get('meets_ttft_slo') else 'MISS'}"
                for r in results
            )
            + (f"; per request: TTFT <= {slo['ttft_ms']:.0f} ms (good/s, SLO%)"
               if slo.get("ttft_ms") is not None else "")
        )
    for r in results:
        for name, t in (r.get("tenants") or {}).items():
            lines.append(
                f"  {r['request_rate']:g}/s tenant {name}: asked {t['request_rate']:.2f}/s, "
                f"served {t['request_throughput']:.2f}/s, TTFT p50 "
                f"{_ms(t.get('median_ttft_ms'))} ms, p99 {_ms(t.get('p99_ttft_ms'))} ms"
                + (f", {t['output_throughput']:.0f} tok/s" if t.get("output_throughput") else "")
                + (f", engine time {t['engine_time_share']:.0%}"
                   if t.get("engine_time_share") is not None else "")
                + (f", good {t['slo_goodput_rps']:.2f}/s, {t['slo_attainment_pct']:.0f}% in SLO"
                   if t.get("slo_attainment_pct") is not None else "")
                + (f", errors {t['errors']}" if t.get("errors") else "")
            )
            line = _judged(f"  {r['request_rate']:g}/s tenant {name}", t)
            if line:
                lines.append(line)
    for r in results:
        line = _judged(f"{r['request_rate']:g}/s", r)
        if line:
            lines.append(line)
    errors = {
        f"{r['request_rate']:g}/s": r["errors"] for r in results if r.get("errors")
    }
    if errors:
        lines.append("errors: " + "; ".join(f"{k} {v}" for k, v in errors.items()))
    return "\n".join(lines)


def plot_paths(output: Path) -> tuple[Path, Path]:
    stem = output.with_suffix("")
    return (
        stem.with_name(stem.name + "_served.png"),
        stem.with_name(stem.name + "_ttft.png"),
    )


def _label(doc: dict[str, Any], fallback: str) -> str:
    return str(doc.get("label") or fallback)


def _series(doc: dict[str, Any], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in doc["results"]:
        if r.get("request_rate") is not None and r.get(key) is not None:
            xs.append(float(r["request_rate"]))
            ys.append(float(r[key]))
    return xs, ys


def write_plots(docs: list[tuple[str, dict[str, Any]]], served_png: Path, ttft_png: Path) -> None:
    """Served vs asked (with y = x), and TTFT P50/P99 vs asked with the SLO lines.
    Several documents are overlaid (``bench compare``)."""
    all_rates = [
        float(r[k]) for _, d in docs for r in d["results"]
        for k in ("request_rate", "request_throughput") if r.get(k) is not None
    ]
    top = max(all_rates) if all_rates else 1.0

    fig, ax = plt.subplots(figsize=(7, 5))
    ax.plot([0, top * 1.05], [0, top * 1.05], "k--", linewidth=1, label="y = x (all served)")
    for name, doc in docs:
        xs, ys = _series(doc, "request_throughput")
        ax.plot(xs, ys, "o-", label=_label(doc, name))
    ax.set_xlabel("asked load (req/s)")
    ax.set_ylabel("served load (req/s)")
    ax.set_title("Served vs asked load")
    ax.set_xlim(0, top * 1.05)
    ax.set_ylim(0, top * 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(served_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    slo = docs[0][1].get("slo") or {"ttft_p50_ms": 2000.0, "ttft_p99_ms": 3500.0}
    ax.axhline(slo["ttft_p50_ms"] / 1000, color="tab:green", linestyle=":",
               label=f"SLO P50 {slo['ttft_p50_ms'] / 1000:g} s")
    ax.axhline(slo["ttft_p99_ms"] / 1000, color="tab:red", linestyle=":",
               label=f"SLO P99 {slo['ttft_p99_ms'] / 1000:g} s")
    for name, doc in docs:
        label = _label(doc, name)
        xs, p50 = _series(doc, "median_ttft_ms")
        line = ax.plot(xs, [v / 1000 for v in p50], "o-", label=f"{label} P50")[0]
        xs, p99 = _series(doc, "p99_ttft_ms")
        ax.plot(xs, [v / 1000 for v in p99], "s--", color=line.get_color(), label=f"{label} P99")
    ax.set_xlabel("asked load (req/s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Time to first token vs asked load")
    ax.set_xlim(0, top * 1.05)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(ttft_png, dpi=110)
    plt.close(fig)


def finite(value: Any) -> Any:
    """``value`` with every NaN and +/-inf float, however deep in dicts, lists and tuples,
    replaced by None: JSON has no such numbers (a proxy's gauge is NaN when it has no
    request to measure), and the file stays strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(doc: dict[str, Any]) -> str:
    """The JSON text of a bench document: strict JSON, non-finite floats as null."""
    return json.dumps(finite(doc), indent=2, sort_keys=False, allow_nan=False) + "\n"


def write_outputs(doc: dict[str, Any], output: Path) -> tuple[Path, Path, Path]:
    """The JSON file (:func:`dumps`) and, beside it, ``<stem>_served.png`` and
    ``<stem>_ttft.png``."""
    output.parent.mkdir(parents=True, exist_ok=True)
    served_png, ttft_png = plot_paths(output)
    doc.setdefault("plots", {})
    doc["plots"] = {"served_vs_asked": served_png.name, "ttft_vs_asked": ttft_png.name}
    output.write_text(dumps(doc))
    write_plots([(output.stem, doc)], served_png, ttft_png)
    return output, served_png, ttft_png


def load(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or "results" not in doc:
        raise ValueError(f"{path} is not a pdstack bench result (no 'results')")
    return doc
