"""The e2e monitoring check (called from test_compose_cpu.py, which owns the running CPU
stack): a real Prometheus (Debian's package, .ci/install.sh) with the scrape config and
rules that `pdstack render` writes for compose/cpu (scrape and rule interval 1 s instead of
the inventory's), every target up, a short burst of traffic through the proxy, then every
expression of every rule and dashboard panel against it: recording rules and panels return
data, alerts are empty on this healthy stack (TTFT ones: exactly when under the SLO)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from pdstack.monitoring import render_monitoring
from pdstack.plan import make_plan
from pdstack.testing.ports import free_port as _free_port
from pdstack.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _query(base: str, expr: str) -> list[dict]:
    doc = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert doc["status"] == "success", (expr, doc)
    return doc["data"]["result"]


def _traffic(proxy: str, model: str, n: int) -> list[float]:
    """n streamed chats, 2 at a time; each prompt has its own ~600-token head (so the
    prefiller computes it and the decoders load it from LMCache) and a shared tail."""
    from .conftest import chat_stream

    shared = " ".join(f"Shared rule {i}: decoders read the prefix from the store."
                      for i in range(20))

    def one(i: int) -> float:
        head = " ".join(f"Request {i} fact {j}: the number {i * 97 + j} is unique."
                        for j in range(40))
        _, chunks, ttft = chat_stream(proxy, model, [
            {"role": "system", "content": head + " " + shared},
            {"role": "user", "content": f"question {i}"}], max_tokens=8)
        assert chunks >= 1
        return ttft

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(n)))


def check_prometheus_against_stack(proxy: str, model: str, tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus is missing: run .ci/install.sh (.ci/install-prometheus.sh)"
    topo = load_topology(ROOT / "inventory" / "local-cpu")
    plan = make_plan(topo)
    files = render_monitoring(topo.deployment, plan, scrape_interval_s=1)
    conf = tmp_path / "prom"
    conf.mkdir()
    for name in ("prometheus.yml", "rules.yml"):
        (conf / name).write_text(files[f"monitoring/{name}"])
    rules = yaml.safe_load(files["monitoring/rules.yml"])
    records = [r for g in rules["groups"] for r in g["rules"] if "record" in r]
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    panels = {
        (name, p["title"], t["expr"])
        for name, text in files.items() if name.endswith(".json")
        for p in json.loads(text)["panels"] if p["type"] != "row"
        for t in p.get("targets", [])
    }
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "prometheus.log").open("w")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [prometheus, f"--config.file={conf / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        jobs = yaml.safe_load(files["monitoring/prometheus.yml"])["scrape_configs"]
        assert len(jobs) == 3  # proxy, engines, LMCache
        deadline = time.monotonic() + 30
        targets: list[dict] = []
        while time.monotonic() < deadline:
            try:
                targets = _get(f"{base}/api/v1/targets")["data"]["activeTargets"]
            except OSError:
                targets = []
            if targets and all(t["health"] == "up" for t in targets):
                break
            time.sleep(0.5)
        configured = {s.name for n in plan.nodes.values() for s in n.services}
        assert {t["labels"]["service"] for t in targets} == configured, targets
        assert all(t["health"] == "up" for t in targets), [
            (t["labels"]["service"], t["health"], t.get("lastError")) for t in targets]
        print(f"[e2e] prometheus: {len(targets)} targets up after {time.monotonic() - t0:.1f} s")

        t1 = time.monotonic()
        ttfts = _traffic(proxy, model, 8)
        print(f"[e2e] monitoring traffic: 8 chats in {time.monotonic() - t1:.1f} s, "
              f"TTFT max {max(ttfts) * 1000:.0f} ms")
        time.sleep(4)  # a few scrapes and rule evaluations after the last request

        empty: list[str] = []
        for r in records:
            for expr in (r["expr"], r["record"]):
                if not _query(base, expr):
                    empty.append(f"recording rule {r['record']}: {expr}")
        for board, title, expr in sorted(panels):
            if not _query(base, expr):
                empty.append(f"{board} / {title}: {expr}")
        assert not empty, "no data for:\n" + "\n".join(empty)
        print(f"[e2e] {len(records)} recording rules and {len(panels)} panel queries return data")

        def value(expr: str) -> float:
            (res,) = _query(base, expr)
            return float(res["value"][1])

        o = topo.deployment.observability
        expected = {
            "PdstackTtftP50OverSlo": value("pdstack:ttft_seconds:p50") > o.ttft_p50_slo_ms / 1000,
            "PdstackTtftP99OverSlo": value("pdstack:ttft_seconds:p99") > o.ttft_p99_slo_ms / 1000,
        }
        outcomes = {r["metric"]["outcome"]: float(r["value"][1]) for r in _query(
            base, "sum by (outcome) (pdstack_proxy_requests_total)") if float(r["value"][1])}
        print(f"[e2e] proxy outcomes: {outcomes}")
        for a in alerts:
            got = _query(base, a["expr"])
            assert bool(got) == expected.get(a["alert"], False), (a["alert"], a["expr"], got)
        print(f"[e2e] {len(alerts)} alert expressions as expected on a healthy stack "
              f"(TTFT P50 {value('pdstack:ttft_seconds:p50') * 1000:.0f} ms, "
              f"P99 {value('pdstack:ttft_seconds:p99') * 1000:.0f} ms)")
        firing = [x["labels"] for x in _query(base, 'ALERTS{alertstate="firing"}')]
        assert not firing, firing
        print(f"[e2e] monitoring check: {time.monotonic() - t0:.1f} s")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
