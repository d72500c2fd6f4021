"""benchmarks/proxy_overhead.py runs end to end (tiny: direct vs pdstack proxy, also
started through benchmarks/gc_tuned.py, at 1 and 2 streams) and writes the ratio table
and its JSON. Numbers come from real runs; this only checks the plumbing and shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_script_writes_ratio_table(tmp_path: Path) -> None:
    out = tmp_path / "po.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/proxy_overhead.py", "--streams", "1,2",
         "--targets", "direct,pdstack,pdstack-gc", "--duration", "1", "--rounds", "1",
         "--warmup", "0.5",
         "--prefill-ttft-ms", "20", "--decode-ttft-ms", "5", "--itl-ms", "5",
         "--output-tokens", "4", "--nice", "0", "--no-uvloop", "--output", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    runs = {(r["target"], r["streams"]): r for r in doc["runs"]}
    assert set(runs) == {(t, n) for t in ("direct", "pdstack", "pdstack-gc") for n in (1, 2)}
    for (target, _), r in runs.items():
        assert r["failed"] == 0 and r["completed"] > 0
        # direct: prefill 20 ms then decode 5 ms, always; through the proxy a prefill leg that
        # is slow on a loaded machine may fall back to the decoder alone (its own 5 ms)
        assert r["median_ttft_ms"] >= (25 if target == "direct" else 5)
        assert "load generator" in r["cpu_cores_used"]
        if target != "direct":
            assert r["cpu_cores_used"][target] > 0
            assert r["delta_p50_ttft_ms"] == r["median_ttft_ms"] - runs[
                ("direct", r["streams"])]["median_ttft_ms"]
    assert doc["target"]["pdstack"]["streams"] == 2
    assert set(doc["target"]) == {"pdstack", "pdstack-gc"}
    assert "loadavg_before" in doc["load_conditions"]
    assert "dP50" in proc.stdout and (tmp_path / "po.txt").read_text().startswith("streams")


def test_script_writes_the_gate_table(tmp_path: Path) -> None:
    """Target pdstack-gate (--admission kv) beside pdstack (admission off): the gate-vs-off
    table and its JSON rows are written (the numbers come from real runs)."""
    out = tmp_path / "gate.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/proxy_overhead.py", "--streams", "1,2",
         "--targets", "direct,pdstack,pdstack-gate", "--duration", "1", "--rounds", "1",
         "--warmup", "0.5", "--prefill-ttft-ms", "20", "--decode-ttft-ms", "5",
         "--itl-ms", "5", "--output-tokens", "4", "--nice", "0", "--no-uvloop",
         "--output", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    gates = {g["streams"]: g for g in doc["gate_vs_off"]}
    assert set(gates) == {1, 2}
    for g in gates.values():
        assert g["gate_failed"] == 0
        assert g["gate_minus_off_p50_ms"] == g["gate_p50_ttft_ms"] - g["off_p50_ttft_ms"]
    text = (tmp_path / "gate.txt").read_text()
    assert "KV gate (--admission kv) against admission off" in text and "gate-off" in text
