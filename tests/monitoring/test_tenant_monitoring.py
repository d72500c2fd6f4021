"""Per-tenant monitoring: the Tenants row of the proxy dashboard and the
PdstackTenantThrottled alert exist only with ``pdstack_tenants``; promtool parses every
panel query and fires the alert on synthetic series (and not on a tenant that is fine)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from pdstack.monitoring import render_monitoring
from pdstack.plan import make_plan
from pdstack.topology import load_topology

from .test_monitoring import panel_queries, promtool

REPO = Path(__file__).resolve().parents[2]


def _files(tmp_path: Path, tenants: bool) -> dict[str, str]:
    inv = tmp_path / "inv"
    shutil.copytree(REPO / "inventory" / "local-cpu", inv)
    if tenants:
        with (inv / "group_vars" / "all.yml").open("a") as f:
            f.write("pdstack_tenants: {acme: {weight: 3}, nightly: {priority: batch}}\n")
    topo = load_topology(inv)
    return render_monitoring(topo.deployment, make_plan(topo))


def test_tenant_panels_and_alert_only_with_tenants(tmp_path):
    without = _files(tmp_path / "a", tenants=False)
    files = _files(tmp_path / "b", tenants=True)
    for f, want in ((without, False), (files, True)):
        board = json.loads(f["monitoring/grafana/dashboards/proxy.json"])
        titles = {p["title"] for p in board["panels"]}
        assert ("Tenants: refused by limit" in titles) == want
        assert ("PdstackTenantThrottled" in f["monitoring/rules.yml"]) == want
    board = json.loads(files["monitoring/grafana/dashboards/proxy.json"])
    exprs = [t["expr"] for title, _, t in panel_queries(board) if title.startswith("Tenants")]
    assert len(exprs) == 7  # the share of engine time among them
    doc = {"groups": [{"name": "panels", "rules": [
        {"record": f"panel:q{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    (tmp_path / "panels.yml").write_text(yaml.safe_dump(doc))
    r = subprocess.run([promtool(), "check", "rules", str(tmp_path / "panels.yml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

    # acme: 6 of 10 requests a minute refused (fires); nightly: 1 of 100 (does not)
    (tmp_path / "rules.yml").write_text(files["monitoring/rules.yml"])
    series = [
        ('pdstack_proxy_tenant_requests_total{tenant="acme",outcome="ok"}', "0+4x40"),
        ('pdstack_proxy_tenant_requests_total{tenant="acme",outcome="rejected"}', "0+6x40"),
        ('pdstack_proxy_tenant_rejected_total{tenant="acme",limit="rpm"}', "0+6x40"),
        ('pdstack_proxy_tenant_requests_total{tenant="nightly",outcome="ok"}', "0+99x40"),
        ('pdstack_proxy_tenant_rejected_total{tenant="nightly",limit="max_queued"}', "0+1x40"),
    ]
    test = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": [
            {"eval_time": "25m", "alertname": "PdstackTenantThrottled", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "tenant": "acme"},
                "exp_annotations": {"summary": "tenant acme: 0.10 requests/s refused by its "
                                    "limits or by admission (over 10 % of what it sends)"}}]},
            {"eval_time": "5m", "alertname": "PdstackTenantThrottled", "exp_alerts": []},
        ],
    }]}
    (tmp_path / "rules.test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    r = subprocess.run([promtool(), "test", "rules", "rules.test.yml"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
