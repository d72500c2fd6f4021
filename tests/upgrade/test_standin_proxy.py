"""The upgrade's proxy-side steps against the real proxy (``pdstack proxy``), with the
fake engine test double (``pdstack.testing.fake_engine``) as engines. No Docker."""

from __future__ import annotations

import os
import subprocess
import urllib.error
import urllib.request
from typing import Any

from pdstack.upgrade import AdminClient, Compose, Engine, Upgrader

from .conftest import PDSTACK, A, get, post


def seen(url: str) -> list[dict[str, Any]]:
    return [r for r in get(url + "/fake/requests") if r["path"].startswith("/v1/")]


def test_standin_keeps_the_old_generation_serving_while_its_prefiller_is_out(
    node: dict[str, Any],
) -> None:
    admin: AdminClient = node["admin"]
    urls = node["urls"]
    up = Upgrader(admin=admin, compose=Compose(node["dir"]), stack_dir=node["dir"],
                  model_revision="rev2", health_timeout_s=20)
    prefill = Engine("prefill-0", "local/prefill-0", "prefill", "local", urls["prefill-0"])
    decode1 = Engine("decode-1", "local/decode-1", "decode", "local", urls["decode-1"])

    # decode-1 out: rev1 still has prefill-0 + decode-0, so no stand-in is needed
    up.ensure_capacity(decode1, A)
    assert up.standins == []

    # prefill-0 out: no generation would have a pair; a rev1 stand-in takes its role
    up.ensure_capacity(prefill, A)
    assert up.standins == ["local/prefill-standin-decode-0"]
    admin.drain("local/prefill-0")
    for url in urls.values():
        urllib.request.urlopen(urllib.request.Request(url + "/fake/requests", method="DELETE"))
    for i in range(6):
        status, body = post(node["proxy"] + "/v1/completions",
                            {"model": "fake", "prompt": f"hello {i}", "max_tokens": 4})
        assert status == 200, body
    assert seen(urls["prefill-0"]) == [] and seen(urls["decode-1"]) == []
    legs = seen(urls["decode-0"])  # both legs ran on the rev1 decoder
    assert sorted(r["body"]["max_tokens"] for r in legs) == [1] * 6 + [4] * 6
    pairs = [ln for ln in get(node["proxy"] + "/metrics").splitlines()
             if ln.startswith("pdstack_proxy_pairs_total{")]
    assert pairs and all(f'prefill_generation="{A}"' in ln and f'decode_generation="{A}"' in ln
                         for ln in pairs), pairs

    # once retired, no prefiller of rev1 is left: the proxy's decode fallback has the rev1
    # decoder serve requests whole (one leg, no prefill), still never paired across
    # generations
    up.retire_standins()
    assert up.standins == []
    assert admin.backend("local/prefill-standin-decode-0") is None
    before = {name: len(seen(urls[name])) for name in ("decode-0", "decode-1")}
    status, body = post(node["proxy"] + "/v1/completions",
                        {"model": "fake", "prompt": "hello", "max_tokens": 4})
    assert status == 200, body
    # one whole-request leg on one decoder (either: decode-1 is not drained here), no prefill
    legs = [r["body"]["max_tokens"] for name, n in before.items() for r in seen(urls[name])[n:]]
    assert legs == [4]
    assert seen(urls["prefill-0"]) == []


def test_cli_refuses_a_revision_change_that_keeps_the_lmcache_namespace(
    node: dict[str, Any],
) -> None:
    stack = node["dir"]
    lines = ["PDSTACK_ENGINE_IMAGE=img"]
    for svc in ("PREFILL_0", "DECODE_0", "DECODE_1"):
        lines += [f"{svc}_IMAGE=img", f"{svc}_MODEL=deepseek-ai/DeepSeek-V2-Lite",
                  f"{svc}_REVISION=rev1"]
    (stack / ".env").write_text("\n".join(lines) + "\n")
    before = (stack / ".env").read_text()
    proc = subprocess.run(
        [PDSTACK, "upgrade", "--stack-dir", str(stack), "--model-revision", "rev2",
         "--proxy", node["proxy"]],
        env={**os.environ, "PDSTACK_ADMIN_TOKEN": node["token"]},
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "LMCache store would hand KV of one revision to the other" in proc.stderr
    assert node["token"] not in proc.stderr + proc.stdout
    assert (stack / ".env").read_text() == before  # nothing touched
    assert all(not b["drained"] for b in node["admin"].listing()["backends"])


def test_cli_needs_the_admin_token_from_the_environment(node: dict[str, Any]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PDSTACK_ADMIN_TOKEN"}
    proc = subprocess.run(
        [PDSTACK, "upgrade", "--stack-dir", str(node["dir"]), "--model-revision", "rev2",
         "--proxy", node["proxy"]], env=env, capture_output=True, text=True, timeout=60,
        check=False)
    assert proc.returncode == 1
    assert "set PDSTACK_ADMIN_TOKEN" in proc.stderr
