"""Monitoring rendered from the plan: scrape targets = the plan's services, a config and
rules that the real ``promtool`` (Debian's prometheus package, .ci/install.sh) accepts,
every alert fired by synthetic series in ``promtool test rules``, and dashboards whose every
panel points at the rendered Prometheus with a query promtool parses."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdstack.cli import main
from pdstack.monitoring import render_monitoring
from pdstack.monitoring.dashboards import DATASOURCE_UID
from pdstack.monitoring.targets import JOBS
from pdstack.plan import make_plan
from pdstack.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
INVENTORIES = sorted(p.name for p in (REPO / "inventory").iterdir() if (p / "hosts.yml").is_file())


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: run .ci/install.sh (Debian package prometheus)")
    return path


def render_to(tmp_path: Path, inventory: str) -> Path:
    out = tmp_path / "stack"
    assert main(["render", "-i", str(REPO / "inventory" / inventory), "-o", str(out)]) == 0
    return out


def proxy_dir(out: Path) -> Path:
    (d,) = {p.parent.parent for p in out.rglob("monitoring/prometheus.yml")}
    return d


def configured_targets(prom: dict) -> set[tuple[str, str, str, tuple]]:
    return {
        (job["job_name"], job["metrics_path"], addr, tuple(sorted(sc["labels"].items())))
        for job in prom["scrape_configs"]
        for sc in job["static_configs"]
        for addr in sc["targets"]
    }


@pytest.mark.docker  # runs `docker compose config` (the Compose plugin .ci/install.sh installs)
def test_b200x2_render_writes_monitoring_whose_targets_are_the_plans_services(tmp_path):
    out = render_to(tmp_path, "b200x2")
    topo = load_topology(REPO / "inventory" / "b200x2")
    plan = make_plan(topo)
    (proxy_node,) = [n for n in plan.nodes.values() if any(s.kind == "proxy" for s in n.services)]
    stack = out / proxy_node.name
    for other in set(plan.nodes) - {proxy_node.name}:
        assert not (out / other / "monitoring").exists(), other  # only on the proxy's node
    files = {p.relative_to(stack).as_posix() for p in (stack / "monitoring").rglob("*")
             if p.is_file()}
    assert files == {
        "monitoring/prometheus.yml", "monitoring/rules.yml",
        "monitoring/grafana/provisioning/datasources/pdstack.yaml",
        "monitoring/grafana/provisioning/dashboards/pdstack.yaml",
        *(f"monitoring/grafana/dashboards/{b}.json"
          for b in ("overview", "kv", "engines", "proxy")),
    }
    prom = yaml.safe_load((stack / "monitoring/prometheus.yml").read_text())
    # the plan's services, read straight from the plan
    want = set()
    for node in plan.nodes.values():
        for s in node.services:
            port = s.ports["metrics"] if s.kind == "lmcache" else s.ports["http"]
            labels = {"node": node.name, "service": s.name, "role": s.role or s.kind}
            if s.generation:
                labels["generation"] = s.generation
            want.add((JOBS[s.kind], "/metrics", f"{node.private_address}:{port}",
                      tuple(sorted(labels.items()))))
    assert configured_targets(prom) == want
    assert len(want) == sum(len(n.services) for n in plan.nodes.values())
    # every address is a private one of the plan (no wildcard, no public)
    addrs = {n.private_address for n in plan.nodes.values()}
    assert {a.rsplit(":", 1)[0] for _, _, a, _ in want} <= addrs
    compose = yaml.safe_load((stack / "compose.yaml").read_text())
    prom_svc, graf_svc = compose["services"]["prometheus"], compose["services"]["grafana"]
    assert prom_svc["profiles"] == ["monitoring"] == graf_svc["profiles"]
    listen = f"--web.listen-address={proxy_node.private_address}:9090"
    assert listen in prom_svc["command"]
    assert graf_svc["environment"]["GF_SERVER_HTTP_ADDR"] == proxy_node.private_address
    assert "GF_SECURITY_ADMIN_PASSWORD" not in json.dumps(compose)
    # docker compose itself: the profile adds exactly Prometheus + Grafana, off by default
    def compose_services(*profile: str) -> set[str]:
        r = subprocess.run(["docker", "compose", *profile, "-f", "compose.yaml", "config",
                            "--services"], cwd=stack, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return set(r.stdout.split())

    plain = compose_services()
    assert "prometheus" not in plain and "proxy" in plain
    assert compose_services("--profile", "monitoring") == plain | {"prometheus", "grafana"}


@pytest.mark.parametrize("inventory", INVENTORIES)
def test_promtool_accepts_config_and_rules(tmp_path, inventory):
    mon = proxy_dir(render_to(tmp_path, inventory)) / "monitoring"
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "rules.yml"]):
        r = subprocess.run([promtool(), *args], cwd=mon, capture_output=True, text=True)
        assert r.returncode == 0, f"{inventory}: promtool {' '.join(args)}: {r.stdout}{r.stderr}"


def dashboards(mon: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (mon / "grafana/dashboards").glob("*.json")}


def panel_queries(board: dict) -> list[tuple[str, dict, dict]]:
    """(panel title, panel datasource, target) of every query of every panel."""
    return [(p["title"], p.get("datasource") or {}, t)
            for p in board["panels"] if p["type"] != "row" for t in p.get("targets", [])]




@pytest.mark.parametrize("inventory", ["local-cpu", "a100x3", "h200x2-nixl",
                                       "a100x2-lmcache-pd", "h200x2-colocated",
                                       "h200x2-shared-l1-skip", "h200x1-nixl-l1"])
def test_dashboards_load_back_and_point_at_the_rendered_prometheus(tmp_path, inventory):
    stack = proxy_dir(render_to(tmp_path, inventory))
    mon = stack / "monitoring"
    boards = dashboards(mon)
    assert set(boards) == {"overview", "kv", "engines", "proxy"}
    ds = yaml.safe_load((mon / "grafana/provisioning/datasources/pdstack.yaml").read_text())
    (source,) = ds["datasources"]
    compose = yaml.safe_load((stack / "compose.yaml").read_text())
    listen = next(a for a in compose["services"]["prometheus"]["command"]
                  if a.startswith("--web.listen-address="))
    assert source["url"] == "http://" + listen.split("=", 1)[1]
    assert source["uid"] == DATASOURCE_UID and source["type"] == "prometheus"
    records = {r["record"] for g in yaml.safe_load((mon / "rules.yml").read_text())["groups"]
               for r in g["rules"] if "record" in r}
    exprs = []
    for name, board in boards.items():
        assert board["uid"] == f"pdstack-{name}"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        queries = panel_queries(board)
        assert queries, name
        for title, panel_ds, target in queries:
            assert panel_ds == {"type": "prometheus", "uid": source["uid"]}, (name, title)
            assert target["datasource"] == panel_ds, (name, title)
            exprs.append(target["expr"])
            for metric in re.findall(r"\b(pdstack:[a-z0-9_:]+)", target["expr"]):
                assert metric in records, f"{name}/{title}: {metric} is no recording rule"
    # every panel query parses: promtool checks them as recording rules
    doc = {"groups": [{"name": "panels", "rules": [
        {"record": f"panel:q{i}", "expr": e} for i, e in enumerate(sorted(set(exprs)))]}]}
    (tmp_path / "panels.yml").write_text(yaml.safe_dump(doc))
    r = subprocess.run([promtool(), "check", "rules", str(tmp_path / "panels.yml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # panels follow the plan: NIXL panels only where engines run NIXL, LMCache only with it
    kv_titles = {t for t, _, _ in panel_queries(boards["kv"])}
    plan = make_plan(load_topology(REPO / "inventory" / inventory))
    services = [s for n in plan.nodes.values() for s in n.services]
    assert ("NIXL transfers" in kv_titles) == any("nixl_side_channel" in s.ports for s in services)
    assert ("LMCache L1 use" in kv_titles) == any(s.kind == "lmcache" for s in services)


@pytest.mark.parametrize(("inventory", "want"), [
    # admission: on by default on both profiles (pdstack_proxy_admission unset)
    ("local-cpu", dict(pd=True, connector=True, lmcache=True, nixl=False, lmcache_pd=False,
                       skip_prefill=False, admission=True, native_tier=False, tenants=False)),
    ("h200x2-colocated", dict(pd=False, connector=False, lmcache=False, nixl=False,
                              lmcache_pd=False, skip_prefill=False, admission=True,
                              native_tier=False, tenants=False)),
    # the default single-node GPU stack: vLLM's native tier (its vllm:kv_offload_* panels)
    ("h200x1", dict(pd=False, connector=True, lmcache=False, nixl=False, lmcache_pd=False,
                    skip_prefill=False, admission=True, native_tier=True, tenants=False)),
    ("h200x1-nixl-l1", dict(pd=True, connector=True, lmcache=True, nixl=True,
                            lmcache_pd=False, skip_prefill=False, admission=True,
                            native_tier=False, tenants=False)),
    ("h200x2-shared-l1-skip", dict(pd=True, connector=True, lmcache=True, nixl=False,
                                   lmcache_pd=False, skip_prefill=True, admission=True,
                                   native_tier=False, tenants=False)),
    ("a100x2-lmcache-pd", dict(pd=True, connector=True, lmcache=False, nixl=False,
                               lmcache_pd=True, skip_prefill=False, admission=True,
                               native_tier=False, tenants=False)),
])
def test_features_follow_the_plan(inventory, want):
    from dataclasses import asdict

    from pdstack.monitoring.prometheus import Features

    assert asdict(Features.of(make_plan(load_topology(REPO / "inventory" / inventory)))) == want


def test_admission_panels_only_with_kv_admission(tmp_path):
    inv = tmp_path / "inv"
    shutil.copytree(REPO / "inventory" / "local-cpu", inv)
    with (inv / "group_vars" / "all.yml").open("a") as f:
        f.write('pdstack_proxy_admission: "off"\n')
    for path, want in ((inv, False), (REPO / "inventory" / "local-cpu", True)):
        topo = load_topology(path)
        files = render_monitoring(topo.deployment, make_plan(topo))
        titles = {p["title"] for p in json.loads(
            files["monitoring/grafana/dashboards/proxy.json"])["panels"]}
        assert ("KV admission: queued / waited" in titles) == want, path
    board = json.loads(files["monitoring/grafana/dashboards/proxy.json"])
    doc = {"groups": [{"name": "panels", "rules": [
        {"record": f"panel:q{i}", "expr": t["expr"]}
        for i, (_, _, t) in enumerate(panel_queries(board))]}]}
    (tmp_path / "panels.yml").write_text(yaml.safe_dump(doc))
    r = subprocess.run([promtool(), "check", "rules", str(tmp_path / "panels.yml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------- promtool test rules

B = "pdstack_proxy_ttft_seconds_bucket"
DEC0 = 'node="local",service="decode-0",role="decode"'
DEC1 = 'node="local",service="decode-1",role="decode"'
DEC2 = 'node="local",service="decode-2",role="decode"'
SRC = "vllm:prompt_tokens_by_source_total"


def _case(series: list[tuple[str, str]], eval_time: str, alert: str, labels: dict,
          summary: str) -> dict:
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": [
            {"eval_time": eval_time, "alertname": alert,
             "exp_alerts": [{"exp_labels": labels, "exp_annotations": {"summary": summary}}]},
            # and not before its `for:` (or its data) says so
            {"eval_time": "0m", "alertname": alert, "exp_alerts": []},
        ],
    }


ALERT_CASES = [
    _case([('up{job="pdstack-engine",node="local",service="decode-0"}', "0x10")], "3m",
          "PdstackTargetDown",
          {"severity": "critical", "job": "pdstack-engine", "node": "local",
           "service": "decode-0"},
          "decode-0 on local does not answer /metrics"),
    # every request's TTFT in the 2.5-5 s bucket: P50 3.75 s > 2 s, P99 4.98 s > 3.5 s
    *[_case([(f'{B}{{le="1"}}', "0x20"), (f'{B}{{le="2.5"}}', "0x20"),
             (f'{B}{{le="5"}}', "0+10x20"), (f'{B}{{le="+Inf"}}', "0+10x20")], "12m",
            alert, {"severity": "warning"}, summary)
      for alert, summary in (
          ("PdstackTtftP50OverSlo", "TTFT P50 3.75s over the SLO (2 s)"),
          ("PdstackTtftP99OverSlo", "TTFT P99 4.975s over the SLO (3.5 s)"))],
    # half of what is asked is rejected (429): served 0.1/s of 0.2/s
    _case([('pdstack_proxy_requests_total{outcome="ok"}', "0+6x20"),
           ('pdstack_proxy_requests_total{outcome="rejected"}', "0+6x20"),
           ("pdstack_proxy_in_flight", "0x20")], "10m", "PdstackServedBelowAsked",
          {"severity": "warning"}, "the stack serves less than 95 % of the requests it is asked"),
    _case([('pdstack_proxy_requests_total{outcome="ok"}', "0+6x20"),
           ('pdstack_proxy_requests_total{outcome="upstream_error"}', "0+6x20")], "12m",
          "PdstackErrorRatioHigh", {"severity": "critical"},
          "50% of the requests fail (502/503 from the proxy)"),
    _case([('pdstack_proxy_ejections_total{backend="local/decode-0"}', "0 0 1 1 1 1")], "3m",
          "PdstackBackendEjected", {"severity": "warning", "backend": "local/decode-0"},
          "the proxy ejected local/decode-0 (failed health checks or legs)"),
    _case([('pdstack_proxy_backend_healthy{backend="local/decode-1"}', "0x10")], "2m",
          "PdstackBackendUnhealthy", {"severity": "critical", "backend": "local/decode-1"},
          "local/decode-1 fails the proxy's health checks"),
    _case([(f"vllm:kv_cache_usage_perc{{{DEC0}}}", "0.97x10")], "6m", "PdstackKvCacheFull",
          {"severity": "warning", "node": "local", "service": "decode-0", "role": "decode"},
          "decode-0 on local uses 97% of its KV cache"),
    # 1 GiB L1 (inventory local-cpu): 1.05e9 bytes used = 97.8 %
    _case([('lmcache_mp_l1_memory_usage_bytes{node="local",service="lmcache"}', "1.05e9x20")],
          "11m", "PdstackLmcacheL1Full", {"severity": "warning", "node": "local"},
          "LMCache L1 on local is 97.79% full (evicting: raise pdstack_lmcache.l1_size_gb)"),
    # decode-0's external hit ratio: 0.9 for 70 min, then 0.1
    _case([(f"vllm:external_prefix_cache_queries_total{{{DEC0}}}", "0+100x100"),
           (f"vllm:external_prefix_cache_hits_total{{{DEC0}}}", "0+90x70 6300+10x30")],
          "95m", "PdstackExternalPrefixHitRatioDropping",
          {"severity": "warning", "node": "local", "service": "decode-0"},
          "decode-0 on local: external prefix-cache hit ratio fell below half its last hour"),
    # decode-0 computes its prompts, no KV arrives; decode-1 receives KV and decode-2 hits
    # its own GPU prefix cache (no alert for either)
    _case([(f'{SRC}{{{DEC0},source="local_compute"}}', "0+100x30"),
           (f'{SRC}{{{DEC0},source="external_kv_transfer"}}', "0x30"),
           (f'{SRC}{{{DEC1},source="local_compute"}}', "0+5x30"),
           (f'{SRC}{{{DEC1},source="external_kv_transfer"}}', "0+100x30"),
           (f'{SRC}{{{DEC2},source="local_compute"}}', "0+5x30"),
           (f'{SRC}{{{DEC2},source="local_cache_hit"}}', "0+100x30"),
           (f'{SRC}{{{DEC2},source="external_kv_transfer"}}', "0x30")],
          "25m", "PdstackDecoderNotReceivingKv",
          {"severity": "critical", "node": "local", "service": "decode-0"},
          "decoder decode-0 on local computes prompts itself: no KV arrives from the prefillers"),
]


def test_promtool_test_rules_fires_every_alert(tmp_path):
    topo = load_topology(REPO / "inventory" / "local-cpu")
    files = render_monitoring(topo.deployment, make_plan(topo))
    (tmp_path / "rules.yml").write_text(files["monitoring/rules.yml"])
    alerts = {r["alert"] for g in yaml.safe_load(files["monitoring/rules.yml"])["groups"]
              for r in g["rules"] if "alert" in r}
    tested = {c["alert_rule_test"][0]["alertname"] for c in ALERT_CASES}
    assert tested == alerts, f"alerts without a promtool test: {sorted(alerts - tested)}"
    doc = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": ALERT_CASES}
    (tmp_path / "rules.test.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([promtool(), "test", "rules", "rules.test.yml"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") >= 1, r.stdout


def test_otlp_endpoint_reaches_engines_and_proxy(tmp_path):
    inv = tmp_path / "inv"
    shutil.copytree(REPO / "inventory" / "local-cpu", inv)
    endpoint = "http://127.0.0.1:4318/v1/traces"
    with (inv / "group_vars" / "all.yml").open("a") as f:
        f.write(f"pdstack_observability:\n  otlp_traces_endpoint: {endpoint}\n")
    plan = make_plan(load_topology(inv))
    for s in plan.nodes["local"].services:
        if s.kind == "engine":
            i = s.command.index("--otlp-traces-endpoint")
            assert s.command[i + 1] == endpoint
            assert s.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        elif s.kind == "proxy":
            assert s.env == {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}
    compose = yaml.safe_load(
        (render_to(tmp_path, "local-cpu") / "compose.yaml").read_text())  # default: off
    assert "environment" not in compose["services"]["proxy"]
    assert "--otlp-traces-endpoint" not in json.dumps(compose)


@pytest.mark.parametrize(("extra", "message"), [
    ("pdstack_observability:\n  otlp_traces_endpoint: collector:4318\n",
     "pdstack_observability.otlp_traces_endpoint"),
    ("pdstack_monitoring: true\npdstack_observability:\n  grafana_port: 8000\n",
     "port 8000 on local used by both proxy http and grafana http"),
])
def test_bad_observability_settings_name_the_field(tmp_path, capsys, extra, message):
    inv = tmp_path / "inv"
    shutil.copytree(REPO / "inventory" / "local-cpu", inv)
    with (inv / "group_vars" / "all.yml").open("a") as f:
        f.write(extra)
    assert main(["render", "-i", str(inv), "-o", str(tmp_path / "out")]) != 0
    err = capsys.readouterr()
    assert message in err.out + err.err
    assert not (tmp_path / "out").exists()
