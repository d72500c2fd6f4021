"""`pdstack bench --tenant`: several tenants at once, each with its key (from the
environment), its share of the rate and its prompt mix, through a `pdstack proxy` with
those tenants; TTFT, served, output tokens/s and the share of engine time (the proxy's
KV admission measures it) per tenant in the JSON and the table. A plain key of
PDSTACK_API_KEYS is its own tenant: the bench finds its engine time by the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdstack.bench.tenants import parse_tenant

from .conftest import REPO, FakeFactory, free_port, wait_http


def test_bench_drives_tenants_with_their_keys(fake_engine: FakeFactory, tmp_path: Path) -> None:
    engine = fake_engine(ttft_ms=20, itl_ms=2, output_tokens=8)
    table = {"kv_mode": "colocated", "served_model_name": "fake",
             "backends": [{"name": "n1/engine-0", "role": "colocated", "node": "n1",
                           "url": engine}],
             "tenants": {"acme": {"weight": 3}, "nightly": {"weight": 1, "rpm": 3}}}
    (tmp_path / "backends.json").write_text(json.dumps(table))
    secrets = tmp_path / "secrets.env"
    secrets.write_text("PDSTACK_TENANT_KEYS=acme:sk-acme-1,nightly:sk-nightly-1\n"
                       "PDSTACK_API_KEYS=sk-plain-1\n")
    secrets.chmod(0o600)
    port = free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "pdstack.cli", "proxy", "--backends",
         str(tmp_path / "backends.json"), "--port", str(port), "--env-file", str(secrets),
         "--admission", "kv"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        out = tmp_path / "run.json"
        env = {**os.environ, "PDSTACK_BENCH_KEY_ACME": "sk-acme-1",
               "PDSTACK_BENCH_KEY_NIGHTLY": "sk-nightly-1", "PDSTACK_BENCH_KEY_PLAIN": "sk-plain-1"}
        proc = subprocess.run(
            [sys.executable, "-m", "pdstack.cli", "bench", "--no-progress", "--target", url,
             "--model", "fake", "--rates", "8", "--duration", "3", "--warmup", "0.5",
             "--system-len", "32", "--user-len", "8", "--output-len", "4",
             "--tenant", "acme:3", "--tenant", "nightly:1", "--tenant", "plain:1",
             "--output", str(out)],
            cwd=REPO, capture_output=True, text=True, timeout=120, env=env, check=False,
        )
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
    assert "sk-acme-1" not in proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    tenants = doc["results"][0]["tenants"]
    assert tenants["acme"]["request_rate"] == 4.8 and tenants["nightly"]["request_rate"] == 1.6
    assert tenants["acme"]["completed"] > 0 and not tenants["acme"]["errors"]
    assert tenants["acme"]["median_ttft_ms"] >= 20
    # nightly's rpm of 3: the proxy refused the rest of its requests (429)
    assert tenants["nightly"]["completed"] <= 3
    assert tenants["nightly"]["errors"].get("http_429", 0) > 0
    assert tenants["nightly"]["refusals"] == {"429": tenants["nightly"]["errors"]["http_429"]}
    assert tenants["nightly"]["slo_attainment_pct"] < 100.0
    assert tenants["acme"]["slo_attainment_pct"] == 100.0
    assert "8/s tenant nightly refusals: 429 x" in proc.stdout
    assert doc["config"]["tenants"] == [{"name": "acme", "share": 3.0},
                                        {"name": "nightly", "share": 1.0},
                                        {"name": "plain", "share": 1.0}]
    assert "8/s tenant acme: asked 4.80/s" in proc.stdout
    assert "8/s tenant nightly: asked 1.60/s" in proc.stdout
    # engine time: acme served the most; the shares of the three add up to 1
    shares = {n: t["engine_time_share"] for n, t in tenants.items()}
    assert shares["acme"] > shares["nightly"] and shares["plain"] > 0, shares
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)
    assert tenants["acme"]["output_throughput"] > 0
    assert "engine time" in proc.stdout


def test_tenant_flag_is_checked() -> None:
    assert parse_tenant("acme:2.5").share == 2.5
    assert parse_tenant("a-b.c:1").key_env == "PDSTACK_BENCH_KEY_A_B_C"
    for bad in ("acme", "acme:0", "acme:x", ":1"):
        try:
            parse_tenant(bad)
        except ValueError as exc:
            assert "NAME:SHARE" in str(exc)
        else:
            raise AssertionError(bad)
