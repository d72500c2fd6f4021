"""``pdstack advise`` on the committed measurements and on synthetic curves with known answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdstack.advise import AdviseError, Slo, advise, knee, read_curves, sides
from pdstack.cli import main

from . import synth

REPO = Path(__file__).resolve().parents[2]
H200 = sorted((REPO / "results" / "h200x2").glob("*.json"))
CPU = REPO / "benchmarks" / "results" / "cpu_tiny_llama.json"
OVERHEAD = REPO / "benchmarks" / "results" / "proxy_overhead.json"
SLO = Slo(2000, 3500)


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["advise", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def advice_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    rc, out, err = run([*args, "--json"], capsys)
    assert rc == 0, err
    return dict(json.loads(out))


def by_label(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["label"]: o for o in doc["options"]}


def pdstack(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdstack.cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


# ------------------------------------------------------------------ the committed H200 results


def test_h200_seed_question(capsys: pytest.CaptureFixture[str]) -> None:
    """60 req/s at P50 <= 2 s / P99 <= 3.5 s from the 2xH200 sweeps (4 / 12 / 24 req/s)."""
    doc = advice_json(["--results", *map(str, H200), "--target-rps", "60",
                       "--gpu-hour-price", "4"], capsys)
    opts = by_label(doc)
    assert [o["label"] for o in doc["options"]] == [
        "colocated", "nixl", "shared-l1", "shared-l1-skip"]
    # colocated: 2 engines met the SLO at 24 req/s (the highest rate measured) -> 12 per engine
    col = opts["colocated"]
    assert (col["knee_rps"], col["colocated"], col["gpus"], col["nodes"]) == (24, 5, 5, 1)
    assert col["rps_per_gpu_at_knee"] == 12
    # nixl: 1P1D met it at 24 -> 3 units; 72 req/s of capacity, 20 % headroom
    nixl = opts["nixl"]
    assert (nixl["knee_rps"], nixl["prefill"], nixl["decode"], nixl["gpus"]) == (24, 3, 3, 6)
    assert nixl["headroom"] == pytest.approx(0.2, abs=1e-6)
    # shared-l1 collapsed at 24 (13.9 served) with its decoder queueing while the prefill leg
    # kept up with all 24 req/s: the decoders get the larger share
    sl1 = opts["shared-l1"]
    assert sl1["knee_rps"] == 12
    assert (sl1["prefill"], sl1["decode"], sl1["gpus"]) == (3, 5, 8)
    assert sl1["how"].startswith("decode-bound")
    assert sl1["est_ttft_p99_ms"] <= 3500
    # skip-prefill sends work past the prefillers: whole units only
    skip = opts["shared-l1-skip"]
    assert (skip["knee_rps"], skip["prefill"], skip["decode"]) == (12, 5, 5)
    assert skip["nodes"] == 2  # 10 GPUs on 8-GPU nodes, every node with a P and a D
    # the price: GPUs x price; per 1M output tokens from the knee's own tokens per request
    assert col["cost_per_hour"] == 20
    assert col["cost_per_1m_output_tokens"] == pytest.approx(
        20 / (60 * (3979.0 / 25.5) * 3600 / 1e6), rel=0.02)
    # the measured proxy overhead is in every estimate
    assert doc["proxy_overhead"]["p99_ms"] > 0
    assert col["est_ttft_p99_ms"] == pytest.approx(323.4 + doc["proxy_overhead"]["p99_ms"],
                                                   abs=1)


def test_h200_table_best_first(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--results", *map(str, H200), "--target-rps", "60"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("target 60 req/s at TTFT P50 <= 2000 ms, P99 <= 3500 ms")
    assert lines[1].split()[:5] == ["#", "topology", "KV", "mode", "knee/unit"]
    assert lines[3].split()[:2] == ["1", "colocated"]
    assert any(line.startswith("best: colocated as 5x engine on 5 GPUs") for line in lines)


def test_never_past_the_measured_curve(capsys: pytest.CaptureFixture[str]) -> None:
    """Every advised engine carries at most what its side was measured to carry."""
    for target in (5, 60, 300):
        doc = advice_json(["--results", *map(str, H200), "--target-rps", str(target)], capsys)
        for o in doc["options"]:
            top = 24.0  # the highest asked rate of every H200 curve, for a 1P1D or 2-engine unit
            if o["colocated"]:
                assert target / o["colocated"] <= top / 2 + 1e-9
            else:
                assert target / o["prefill"] <= top + 1e-9
                assert target / o["decode"] <= o["knee_rps"] + 1e-9  # no decoder ran past it
            assert o["est_ttft_p50_ms"] <= 2000 and o["est_ttft_p99_ms"] <= 3500


def test_repeats_merge_to_the_worst_point() -> None:
    s1 = REPO / "results" / "h200x2" / "shared-l1.json"
    rep = REPO / "results" / "h200x2" / "session2" / "repeat" / "shared-l1.json"
    curves, _ = read_curves([s1, rep], {}, [REPO])
    assert len(curves) == 1
    by_rate = {p.rate: p for p in curves[0].points}
    assert by_rate[24].served == pytest.approx(12.3, abs=0.05)  # the repeat's, not 13.9
    assert by_rate[12].p99 == pytest.approx(1113, abs=1)  # session 1's, not the repeat's 727
    assert curves[0].inventory == REPO / "inventory" / "h200x2-shared-l1"


def test_written_inventory_validates_and_plans(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "inventory" / "h200-60rps"
    rc, _, err = run(["--results", str(REPO / "results" / "h200x2" / "shared-l1.json"),
                      "--target-rps", "60", "--gpus-per-node", "4", "--inventory-out", str(out)],
                     capsys)
    assert rc == 0, err
    assert "wrote" in err and "3 prefill, 5 decode" in err
    v = pdstack("validate", "-i", str(out))
    assert v.returncode == 0, v.stderr
    assert "kv_mode shared-l1" in v.stdout
    p = pdstack("plan", "-i", str(out), "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    roles = [b["role"] for b in plan["backend_table"]["backends"]]
    assert (roles.count("prefill"), roles.count("decode")) == (3, 5)
    assert len(plan["nodes"]) == 2  # 8 GPUs on 4-GPU nodes
    for node in plan["nodes"].values():  # shared-L1 pairs stay inside a node
        node_roles = {s["role"] for s in node["services"] if s["kind"] == "engine"}
        assert node_roles == {"prefill", "decode"}
    assert {pr["kv_path"] for pr in plan["backend_table"]["pairings"]} == {"shared-l1"}
    # the human plan table: one row per engine, by role
    human = pdstack("plan", "-i", str(out))
    assert human.returncode == 0, human.stderr
    assert (human.stdout.count("│ prefill │"), human.stdout.count("│ decode  │")) == (3, 5)
    # not replaced without --force
    rc, _, err = run(["--results", str(REPO / "results" / "h200x2" / "nixl.json"),
                      "--target-rps", "60", "--inventory-out", str(out)], capsys)
    assert rc == 2 and "--force" in err


def test_written_single_node_inventory_keeps_the_measured_node(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nixl-60"
    rc, _, err = run(["--results", str(REPO / "results" / "h200x2" / "nixl.json"),
                      "--target-rps", "60", "--inventory-out", str(out)], capsys)
    assert rc == 0, err
    p = pdstack("plan", "-i", str(out), "--json")
    plan = json.loads(p.stdout)
    assert plan["deployment"] == "nixl-60" and plan["kv_mode"] == "nixl"
    (node,) = plan["nodes"].values()
    assert node["private_address"] == "127.0.0.1"
    engines = [s for s in node["services"] if s["kind"] == "engine"]
    assert sorted(s["name"] for s in engines) == [
        "decode-0", "decode-1", "decode-2", "prefill-0", "prefill-1", "prefill-2"]
    assert sorted(g for s in engines for g in s["gpu_ids"]) == [0, 1, 2, 3, 4, 5]


# ------------------------------------------------------------------ refusals


def test_no_point_meets_the_slo_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["--results", *map(str, H200), "--target-rps", "60",
                        "--slo-ttft-p50-ms", "95"], capsys)
    assert rc == 2 and out == ""
    assert "no topology meets the target" in err
    assert "colocated: no measured point meets the SLO (TTFT P50 <= 95 ms" in err
    assert "at 24 req/s TTFT P50 150 ms > 95 ms" in err
    # at 100 ms only skip-prefill's 4 req/s point qualifies (98 ms P50)
    doc = advice_json(["--results", *map(str, H200), "--target-rps", "60",
                       "--slo-ttft-p50-ms", "100"], capsys)
    assert [(o["label"], o["knee_rps"]) for o in doc["options"]] == [("shared-l1-skip", 4)]
    assert len(doc["not_eligible"]) == 3


def test_cpu_run_has_no_point_served(capsys: pytest.CaptureFixture[str]) -> None:
    """The committed CPU run served 73 % / 63 % / 23 % of what was asked."""
    rc, _, err = run(["--results", str(CPU), "--target-rps", "1"], capsys)
    assert rc == 2
    assert "tiny-llama-cpu: no measured point meets the SLO" in err
    assert "at 1 req/s served 0.7 < 95 % of asked 1 req/s" in err


def test_results_must_cover_the_workload(capsys: pytest.CaptureFixture[str]) -> None:
    both = [*map(str, H200), str(CPU), str(OVERHEAD)]
    rc, _, err = run(["--results", *both, "--target-rps", "60"], capsys)
    assert rc == 2 and "different workloads" in err
    assert "tiny-llama-cpu (model tiny, scenario seed, system_len 256" in err
    rc, _, err = run(["--results", *both, "--target-rps", "60", "--model", "deepseek-v3"],
                     capsys)
    assert rc == 2
    assert "do not cover the target's workload (model deepseek-v3)" in err
    rc, _, err = run(["--results", *both, "--target-rps", "60", "--scenario", "many-tenants"],
                     capsys)
    assert rc == 2 and "(scenario many-tenants): they measured" in err
    # the model picks the H200 curves; proxy_overhead.json among --results is used as such
    doc = advice_json(["--results", *both, "--target-rps", "60", "--model",
                       "deepseek-v2-lite", "--proxy-overhead", ""], capsys)
    assert doc["options"][0]["label"] == "colocated"
    assert doc["proxy_overhead"]["source"] == "a --results file"


def test_not_a_bench_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = synth.write(tmp_path / "x.json", {"hello": 1})
    rc, _, err = run(["--results", str(bad), "--target-rps", "1"], capsys)
    assert rc == 2 and f"{bad}: not a `pdstack bench` JSON" in err


def test_no_template_no_inventory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A copy of nixl.json outside results/h200x2: its 1P1D shape comes from the proxy's
    backend counters; it ranks, but writing its inventory needs --topology."""
    f = tmp_path / "elsewhere" / "nixl.json"
    f.parent.mkdir()
    f.write_text((REPO / "results" / "h200x2" / "nixl.json").read_text())
    doc = advice_json(["--results", str(f), "--target-rps", "60"], capsys)
    assert (doc["options"][0]["prefill"], doc["options"][0]["decode"]) == (3, 3)
    assert doc["options"][0]["inventory_template"] is None
    out = tmp_path / "inv"
    rc, _, err = run(["--results", str(f), "--target-rps", "60", "--inventory-out", str(out)],
                     capsys)
    assert rc == 2 and "pass --topology nixl=INVENTORY" in err
    assert not out.exists()
    rc, _, err = run(["--results", str(f), "--target-rps", "60", "--inventory-out", str(out),
                      "--topology", f"nixl={REPO / 'inventory' / 'h200x2-nixl'}"], capsys)
    assert rc == 0, err
    assert pdstack("validate", "-i", str(out)).returncode == 0


# ------------------------------------------------------------------ synthetic, known answers


def test_knee_at_a_known_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = synth.bench_doc("colocated", 1, [
        synth.point(5, 5, 100, 300), synth.point(10, 10, 200, 900),
        synth.point(15, 14.5, 800, 3400),  # 96.7 % served, P99 just under 3.5 s: the knee
        synth.point(20, 19.8, 1500, 3600),  # P99 over
    ])
    doc["config"]["topology"] = {"kv_mode": "colocated", "colocated": 1}
    f = synth.write(tmp_path / "c.json", doc)
    curves, _ = read_curves([f], {}, [tmp_path])
    kp = knee(curves[0], SLO)
    assert kp is not None and kp.rate == 15
    out = advice_json(["--results", str(f), "--target-rps", "40", "--proxy-overhead", ""],
                      capsys)
    o = out["options"][0]
    assert (o["knee_rps"], o["colocated"], o["gpus"]) == (15, 3, 3)
    assert o["headroom"] == pytest.approx(45 / 40 - 1)
    # 95 % served is a hard line: at 14 served the knee drops to 10
    doc["results"][2]["served_rate"] = 14.0
    synth.write(f, doc)
    assert knee(read_curves([f], {}, [tmp_path])[0][0], SLO).rate == 10  # type: ignore[union-attr]


def test_decode_bound_curve_gets_more_decoders(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    f = synth.write(tmp_path / "nixl.json", synth.decode_bound())
    topo = f"nixl={REPO / 'inventory' / 'h200x2-nixl'}"
    out = tmp_path / "inv"
    doc = advice_json(["--results", str(f), "--target-rps", "40", "--topology", topo,
                       "--proxy-overhead", "", "--inventory-out", str(out)], capsys)
    o = doc["options"][0]
    # decoders: the knee's 10 req/s each -> 4; prefillers were measured at 20 -> 2
    assert (o["prefill"], o["decode"], o["gpus"]) == (2, 4, 6)
    assert o["how"].startswith("decode-bound")
    # the prefill leg grew 100 -> 150 ms from 10 to 20 req/s: added to the knee's TTFT
    assert (o["est_ttft_p50_ms"], o["est_ttft_p99_ms"]) == (pytest.approx(350),
                                                            pytest.approx(650))
    plan = json.loads(pdstack("plan", "-i", str(out), "--json").stdout)
    roles = [b["role"] for b in plan["backend_table"]["backends"]]
    assert (roles.count("prefill"), roles.count("decode")) == (2, 4)
    # a tighter P99 leaves no room for the slower prefill leg: back to whole units
    doc = advice_json(["--results", str(f), "--target-rps", "40", "--topology", topo,
                       "--proxy-overhead", "", "--slo-ttft-p99-ms", "620"], capsys)
    o = doc["options"][0]
    assert (o["prefill"], o["decode"]) == (3, 4)  # 40/3 = 13.3 per prefiller: +16.7 ms


def test_prefill_bound_curve_gets_fewer_decoders(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    doc = synth.prefill_bound_1p2d()
    doc["config"]["topology"] = {"kv_mode": "nixl", "prefill": 1, "decode": 2}
    f = synth.write(tmp_path / "p.json", doc)
    out = advice_json(["--results", str(f), "--target-rps", "40", "--proxy-overhead", ""],
                      capsys)
    o = out["options"][0]
    # whole 1P2D units would be 4P+8D; the decoders were measured delivering 16/2 = 8 each
    assert (o["prefill"], o["decode"], o["gpus"]) == (4, 5, 9)
    assert o["how"].startswith("prefill-bound")


def test_skip_prefill_scales_whole_units(tmp_path: Path) -> None:
    doc = synth.decode_bound()
    for r in doc["results"]:
        r["prometheus"]["total"]["pdstack"]["pdstack_proxy_skip_prefill_total"] = 10.0
    doc["config"]["topology"] = {"kv_mode": "shared-l1", "prefill": 1, "decode": 1}
    f = synth.write(tmp_path / "s.json", doc)
    adv = advise([f], 40, SLO, proxy_overhead_file=None, roots=[tmp_path])
    assert (adv.options[0].prefill, adv.options[0].decode) == (4, 4)
    assert "skip-prefill" in adv.options[0].how


def test_no_synthetic_point_meets_the_slo(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    doc = synth.bench_doc("nixl", 2, [
        synth.point(4, 4, 2100, 3000, prefill=(4, 1900), first_byte=(4, 100)),
        synth.point(8, 8, 1800, 3900, prefill=(8, 1700), first_byte=(8, 100)),
    ])
    doc["config"]["topology"] = {"kv_mode": "nixl", "prefill": 1, "decode": 1}
    f = synth.write(tmp_path / "n.json", doc)
    rc, out, err = run(["--results", str(f), "--target-rps", "10"], capsys)
    assert rc == 2 and out == ""
    assert "at 4 req/s TTFT P50 2100 ms > 2000 ms" in err
    assert "at 8 req/s TTFT P99 3900 ms > 3500 ms" in err
    with pytest.raises(AdviseError, match="no measured point meets the SLO"):
        advise([f], 10, SLO, proxy_overhead_file=None, roots=[tmp_path])


def test_headroom_and_node_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nixl = str(REPO / "results" / "h200x2" / "nixl.json")
    doc = advice_json(["--results", nixl, "--target-rps", "60", "--headroom", "25",
                       "--gpus-per-node", "2"], capsys)
    o = doc["options"][0]
    assert (o["prefill"], o["decode"], o["nodes"]) == (4, 4, 4)  # 75 req/s -> 4 units
    assert o["headroom"] == pytest.approx(96 / 60 - 1, abs=1e-6)
    assert o["placement"] == [["prefill", "decode"]] * 4 and o["cross_node_pairs"] == 12
    assert "12 of the best option's 16 P/D pairs cross nodes" in doc["warnings"][0]
    # past the rate one proxy was measured at: said, not hidden
    doc = advice_json(["--results", nixl, "--target-rps", "100"], capsys)
    assert any("one proxy was measured up to 92.5 req/s" in w for w in doc["warnings"])
    rc, _, err = run(["--results", nixl, "--target-rps", "60", "--topology", "nixl"], capsys)
    assert rc == 2 and "LABEL=INVENTORY_DIR" in err


def test_sides_stop_where_a_side_stopped_keeping_up(tmp_path: Path) -> None:
    """Past the knee a side counts only up to its first point that did not keep up, and a
    leg's growth is interpolated between measured points, never past the last."""
    doc = synth.bench_doc("nixl", 2, [
        synth.point(10, 10, 300, 600, prefill=(10, 100), first_byte=(10, 40)),
        synth.point(20, 15, 2500, 4000, prefill=(15, 2000), first_byte=(15, 50)),
        synth.point(30, 12, 6000, 9000, prefill=(12, 5000), first_byte=(12, 60)),
    ])
    doc["config"]["topology"] = {"kv_mode": "nixl", "prefill": 1, "decode": 1}
    f = synth.write(tmp_path / "n.json", doc)
    (curve,), _ = read_curves([f], {}, [tmp_path])
    kp = knee(curve, SLO)
    assert kp is not None and kp.rate == 10
    got = sides(curve, kp)
    assert got is not None
    pre, dec = got
    assert pre.xs == [10]  # the prefiller queued at 20 (15 of 20/s handed over)
    assert dec.xs == [10, 15]  # decoders delivered the 15/s; at 30 they were handed less
    assert dec.delta(10) == 0 and dec.delta(12.5) == pytest.approx(5)
    assert dec.delta(15.01) is None and pre.delta(10.5) is None
