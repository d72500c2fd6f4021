"""Rolling upgrade rev1 -> rev2 of the CPU stack under steady traffic (issue 7).

The real stack (``compose/cpu``: LMCache MP server, prefill-0, decode-0, decode-1,
proxy; images from ``.ci/install-docker.sh``) runs from a copy in a temp dir under its
own compose project. While a steady client sends completions through the proxy,
``pdstack upgrade`` moves every engine to ``/models/tiny-llama/rev2`` (random weights,
another seed). Asserted:
- zero failed requests;
- afterwards every engine reports the rev2 model, and every answer (direct and through
  the proxy) to a fixed prompt at temperature 0 carries rev2's greedy tokens, not rev1's
  (see ``signature`` for why tokens and not logprobs);
- the proxy's per-pair counter never shows a prefiller/decoder pair of two generations;
- no LMCache hit crossed revisions: a long prompt that rev1 engines stored in the
  node's LMCache store gives a rev2 engine zero external prefix-cache hits, while the
  same probe between two rev2 engines does hit (so the metric can see a hit).
  (LMCache 0.5.6's MP server serves no ``/metrics`` on its HTTP port, so hits are read
  from the engines' ``vllm:external_prefix_cache_hits`` counter.)
- traffic ran throughout: every engine's time out of service (drained and idle ->
  serving the new revision) saw requests start, and all of them succeeded.
Sizing (measured on 2 cores, see ``STEADY_PAUSE_S`` and ``start_window``): the client is
slow enough that the serving engines sleep between requests instead of spinning, and
each restart gets a start window derived from the stack's measured cold start.
Heavy: holds the heavy-run lock (``pdstack.testing.heavy``) for the whole run.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pdstack.testing.heavy import CPU_STACK_IMAGES, heavy_lock, http_json, require_docker

from .steady import SteadyClient

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
PROJECT = "pdstack-upgrade-test"
# the test renders inventory/local-cpu with its own ports, so it never meets a default
# stack (8000/8100-8102/6000) that someone else left running
PORTS = {"proxy": 18000, "engine_http_base": 18100, "lmcache_zmq": 16000, "lmcache_http": 16001}
PROXY = "http://127.0.0.1:18000"
ENGINES = {"prefill-0": "http://127.0.0.1:18100", "decode-0": "http://127.0.0.1:18101",
           "decode-1": "http://127.0.0.1:18102"}
IMAGES = CPU_STACK_IMAGES
# Steady, never saturating: one client, one request at a time, STEADY_PAUSE_S between
# them. A vLLM CPU engine's worker busy-polls its shared-memory queue (sched_yield) for
# 1 s after every step (vllm shm_broadcast SpinCondition, busy_loop_s=1, not settable), so
# an engine that gets a request more often than about once a second keeps a core busy
# doing nothing, and a restarting engine's start (three Python processes importing torch
# + vLLM, ~50 s of CPU) shares both cores with those spinners. Measured here, restarting
# decode-0 of this stack under traffic: 2 clients at 1.0 s pause (1.46 req/s) -> serving
# engines at 48-70 % CPU, restart 157 s; 1 client at 3.0 s pause (0.29 req/s) -> serving
# engines at ~2 % CPU, restart 85 s (idle machine: ~60 s).
STEADY_WORKERS = 1
STEADY_PAUSE_S = 3.0
# The start window of each restarted engine: START_FACTOR x the measured cold start of
# this stack's three engines (started together, so more contended than one restart
# under this traffic), within [START_MIN_S, START_MAX_S]. It replaces the rendered 600 s guess for
# this stack (healthcheck start_period) and is `pdstack upgrade --wait-timeout`.
START_FACTOR = 4.0
START_MIN_S = 180.0
START_MAX_S = 900.0  # the cold start's own --wait-timeout
FIXED_PROMPT = "the proxy sends the request to the decoder and the cache"
REV = {"rev1": "/models/tiny-llama/rev1", "rev2": "/models/tiny-llama/rev2"}


# --------------------------------------------------------------------------- helpers


def compose(stack: Path, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "compose", "-p", PROJECT, *args], cwd=stack,
                          capture_output=True, text=True, timeout=timeout, check=False)


def signature(url: str, prompt: str = FIXED_PROMPT) -> list[int]:
    """The greedy (temperature 0) token ids of a fixed prompt: a fingerprint of the
    weights. (Greedy token ids compare exactly, where logprobs would need a float
    tolerance. Token ids, not text: the tiny tokenizer decodes most of the vocabulary
    to nothing.)"""
    answer = http_json("POST", f"{url}/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "return_token_ids": True})
    return list(answer["choices"][0]["token_ids"])


def classify(ids: list[int], refs: dict[str, list[int]]) -> str:
    matches = [rev for rev, ref in refs.items() if ids == ref]
    return matches[0] if len(matches) == 1 else f"unknown ({ids})"


def metric_sum(url: str, name: str) -> float:
    text = http_json("GET", f"{url}/metrics")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def proxy_pairs(metrics_text: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for line in metrics_text.splitlines():
        if line.startswith("pdstack_proxy_pairs_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            out.append((labels, float(line.rsplit(" ", 1)[1])))
    return out


def long_prompt(url: str, tag: str, tokens: int = 700) -> str:
    """A prompt of about ``tokens`` tokens (several LMCache chunks of 256)."""
    words = ["prefill", "decode", "cache", "token", "model",
             "server", "request", "stream", "node", "engine"]
    text = f"{tag}: " + " ".join(f"{words[i % len(words)]} {tag}{i}" for i in range(tokens))
    count = http_json("POST", f"{url}/tokenize", {"model": "tiny", "prompt": text})["count"]
    while count > tokens * 1.2:
        text = text[: int(len(text) * tokens / count)]
        count = http_json("POST", f"{url}/tokenize", {"model": "tiny", "prompt": text})["count"]
    assert count >= 600, count
    return text


def external_hits_after(url: str, prompt: str) -> float:
    """Send ``prompt`` straight to an engine; its external (LMCache) prefix-cache hits."""
    before = metric_sum(url, "vllm:external_prefix_cache_hits_total")
    http_json("POST", f"{url}/v1/completions",
         {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    time.sleep(1.0)
    return metric_sum(url, "vllm:external_prefix_cache_hits_total") - before


def store_via(url: str, prompt: str) -> None:
    """Prefill ``prompt`` on an engine (its KV goes to the node's LMCache store)."""
    http_json("POST", f"{url}/v1/completions",
         {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    time.sleep(2.0)  # the store is asynchronous


# --------------------------------------------------------------------------- fixtures



def _ports_free() -> None:
    for port in (*PORTS.values(), 18101, 18102):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"127.0.0.1:{port} is taken (another pdstack stack running?)")


@dataclass
class Stack:
    dir: Path
    engines_up_s: float  # measured cold start of the three engines (together)
    start_window_s: float  # derived from it: each restart's start window


def start_window(engines_up_s: float) -> float:
    return min(START_MAX_S, max(START_MIN_S, START_FACTOR * engines_up_s))


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    require_docker(IMAGES)
    with heavy_lock():
        yield from _stack(tmp_path)


def _override(window_s: float | None) -> str:
    # the admin token reaches the proxy from this process's environment, never a file
    text = (
        "services:\n  proxy:\n    environment:\n"
        "      PDSTACK_ADMIN_TOKEN: ${PDSTACK_ADMIN_TOKEN:?}\n"
    )
    # the rendered stack asks for memlock: -1; where this host's hard limit is lower
    # (sandboxed VMs), runc may not raise it: ask for the host's hard limit instead
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    for svc in ("lmcache", *ENGINES):
        lines = []
        if hard != resource.RLIM_INFINITY:
            lines.append(f"    ulimits:\n      memlock: {hard}\n")
        if window_s is not None and svc in ENGINES:
            lines.append(f"    healthcheck:\n      start_period: {window_s:.0f}s\n")
        if lines:
            text += f"  {svc}:\n" + "".join(lines)
    return text


def _stack(tmp_path: Path) -> Iterator[Stack]:
    inventory = tmp_path / "inventory" / "local-cpu"
    shutil.copytree(REPO / "inventory" / "local-cpu", inventory)
    gv_file = inventory / "group_vars" / "all.yml"
    gv = yaml.safe_load(gv_file.read_text())
    gv["pdstack_ports"] = PORTS
    # eager mode: no torch.compile (needs a C++ compiler, and minutes per engine start)
    extra = gv["pdstack_model"].setdefault("extra_args", [])
    if "--enforce-eager" not in extra:
        extra.append("--enforce-eager")
    gv_file.write_text(yaml.safe_dump(gv, sort_keys=False))
    stack = tmp_path / "stack"
    render = subprocess.run(
        [str(REPO / ".venv" / "bin" / "pdstack"), "render", "-i", str(inventory), "-o", str(stack)],
        capture_output=True, text=True, check=False)
    assert render.returncode == 0, render.stderr
    override = stack / "compose.override.yaml"
    override.write_text(_override(None))
    os.environ["PDSTACK_ADMIN_TOKEN"] = secrets.token_hex(16)
    compose(stack, "down", "-v", "--timeout", "5")
    _ports_free()

    def up(*services: str, wait_s: float) -> float:
        # --no-deps: a dependency whose override changed since it started (the start
        # window) would otherwise be recreated along with the service
        t = time.monotonic()
        proc = compose(stack, "up", "-d", "--no-deps", "--wait", "--wait-timeout",
                       str(int(wait_s)), *services)
        if proc.returncode != 0:
            logs = compose(stack, "logs", "--tail", "40").stdout
            pytest.fail(f"{' '.join(services)} did not start: {proc.stderr[-2000:]}\n"
                        f"{logs[-6000:]}")
        return time.monotonic() - t

    try:
        lmcache_s = up("lmcache", wait_s=300)
        # engines before the proxy: the proxy's /health is 503 until a pair is routable
        engines_s = up(*ENGINES, wait_s=900)
        window = start_window(engines_s)
        override.write_text(_override(window))  # read by every later compose call
        proxy_s = up("proxy", wait_s=300)
        print(f"stack up: lmcache {lmcache_s:.0f}s, engines {engines_s:.0f}s, "
              f"proxy {proxy_s:.0f}s; restart window {window:.0f}s", file=sys.stderr)
        yield Stack(stack, engines_s, window)
    finally:
        if os.environ.get("PDSTACK_KEEP_STACK") != "1":
            compose(stack, "down", "-v", "--timeout", "10")
        os.environ.pop("PDSTACK_ADMIN_TOKEN", None)


_UPGRADE_LOG = re.compile(r"^\[upgrade (\d\d:\d\d:\d\d)\] ([\w-]+): (drained and idle|serving \S+ "
                          r"\(([\d.]+)s\))")


def out_of_service(stderr: str, started: float) -> dict[str, tuple[float, float, float]]:
    """engine -> (out since, back at, seconds its upgrade took), from ``pdstack upgrade``'s
    log (local HH:MM:SS): out of service from "drained and idle" until "serving <gen>";
    wall-clock seconds, for an upgrade that began at ``started`` (wall clock)."""
    t = time.localtime(started)
    day_start = time.mktime((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0, 0, 0, -1))
    out: dict[str, list[float]] = {}
    for line in stderr.splitlines():
        m = _UPGRADE_LOG.match(line)
        if not m:
            continue
        h, mi, se = (int(x) for x in m.group(1).split(":"))
        at = day_start + h * 3600 + mi * 60 + se
        if at < started - 60:  # the upgrade ran past midnight
            at += 86400
        if m.group(3) == "drained and idle":
            out[m.group(2)] = [at]
        elif m.group(2) in out:
            out[m.group(2)] += [at, float(m.group(4))]
    return {k: (v[0], v[1], v[2]) for k, v in out.items() if len(v) == 3}


# --------------------------------------------------------------------------- the test


def test_rolling_upgrade_rev1_to_rev2_under_traffic(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    # ---- before: everything is rev1; rev1's greedy tokens as the reference
    for name, url in ENGINES.items():
        root = http_json("GET", f"{url}/v1/models")["data"][0]["root"]
        assert root == REV["rev1"], f"{name} serves {root}"
    ref1 = signature(ENGINES["decode-0"])
    assert classify(signature(PROXY), {"rev1": ref1}) == "rev1"

    # LMCache probe, rev1 side: prefill-0 (rev1) stores X; decode-0 (rev1) hits it
    x_prompt = long_prompt(ENGINES["decode-0"], "xrev")
    store_via(ENGINES["prefill-0"], x_prompt)
    rev1_hits = external_hits_after(ENGINES["decode-0"], x_prompt)
    assert rev1_hits > 0, "same-revision LMCache sharing must hit (else the probe is blind)"

    # ---- steady traffic + the upgrade
    client = SteadyClient(PROXY, workers=STEADY_WORKERS, pause_s=STEADY_PAUSE_S)
    client.start()
    time.sleep(5)
    t0 = time.monotonic()
    wall_minus_mono = time.time() - t0
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [str(REPO / ".venv" / "bin" / "pdstack"), "upgrade", "--stack-dir", str(stack.dir),
         "--model-revision", "rev2", "--proxy", PROXY, "--project-name", PROJECT,
         "--wait-timeout", str(int(stack.start_window_s))],
        capture_output=True, text=True, env=env, timeout=3000, check=False,
    )
    upgrade_s = time.monotonic() - t0
    time.sleep(5)  # traffic keeps flowing on the new generation
    client.stop()
    token = os.environ["PDSTACK_ADMIN_TOKEN"]
    assert token not in proc.stdout + proc.stderr, "the admin token leaked into the output"
    windows = out_of_service(proc.stderr, t0 + wall_minus_mono)
    with capsys.disabled():
        print(f"\n[rolling upgrade] requests sent: {client.sent}, "
              f"failed: {len(client.failed)}, upgrade took {upgrade_s:.1f}s; engines' cold "
              f"start {stack.engines_up_s:.0f}s -> restart window {stack.start_window_s:.0f}s; "
              "per engine: " + ", ".join(f"{k} {v[2]:.0f}s" for k, v in windows.items()))
    assert proc.returncode == 0, f"pdstack upgrade failed:\n{proc.stderr[-4000:]}"
    assert json.loads(proc.stdout.strip().splitlines()[-1])["upgraded"] == [
        "decode-1", "prefill-0", "decode-0"]
    assert client.sent >= 20, f"too little traffic to judge: {client.sent}"
    assert not client.failed, "failed requests:\n" + "\n".join(
        f"{o.detail} (stream={o.stream}, id={o.request_id})" for o in client.failed[:10])
    # traffic really ran during the upgrade, not just around it
    during = [o for o in client.outcomes if t0 <= o.started <= t0 + upgrade_s]
    assert len(during) >= 10, f"only {len(during)} requests during the upgrade"
    # ... and while each engine was out of service (drained until serving rev2)
    assert set(windows) == set(ENGINES), proc.stderr[-3000:]
    for name, (since, back, _) in windows.items():
        out = [o for o in client.outcomes if since <= o.started + wall_minus_mono <= back]
        assert len(out) >= 3 and all(o.ok for o in out), (
            f"{name} was out {back - since:.0f}s; requests started then: {len(out)}")

    # ---- after: every engine is rev2; every answer carries rev2's greedy tokens
    for name, url in ENGINES.items():
        root = http_json("GET", f"{url}/v1/models")["data"][0]["root"]
        assert root == REV["rev2"], f"{name} serves {root}"
    ref2 = signature(ENGINES["decode-0"])
    refs = {"rev1": ref1, "rev2": ref2}
    assert ref1 != ref2, "rev1 and rev2 must be distinguishable"
    for name, url in ENGINES.items():
        assert classify(signature(url), refs) == "rev2", name
    for _ in range(6):
        assert classify(signature(PROXY), refs) == "rev2"
    env_text = (stack.dir / ".env").read_text()
    assert "rev1" not in env_text, env_text  # every engine's lines (and comments) moved
    gens = {b["generation"] for b in json.loads((stack.dir / "backends.json").read_text())[
        "backends"]}
    assert gens == {"rev2@pdstack/engine-cpu:dev"}

    # ---- the proxy never paired two generations, and served both generations' pairs
    pairs = proxy_pairs(http_json("GET", f"{PROXY}/metrics"))
    mixed = [(lab, n) for lab, n in pairs if lab["prefill_generation"] != lab["decode_generation"]
             and n > 0]
    assert not mixed, f"requests served by a mixed-generation pair: {mixed}"
    served = {lab["prefill_generation"].split("@")[0] for lab, n in pairs if n > 0}
    assert served == {"rev1", "rev2"}, pairs

    # ---- no LMCache hit crossed revisions
    # X was stored by rev1 engines; a rev2 engine must not find it ...
    assert external_hits_after(ENGINES["decode-1"], x_prompt) == 0, \
        "a rev2 engine read rev1's KV from the LMCache store"
    # ... while rev2 -> rev2 sharing still hits (the probe can see a hit)
    y_prompt = long_prompt(ENGINES["decode-0"], "yrev")
    store_via(ENGINES["prefill-0"], y_prompt)
    assert external_hits_after(ENGINES["decode-0"], y_prompt) > 0
    # The engine_upgrade Ansible role runs the same script per engine; it is exercised in
    # tests/upgrade/test_role.py (order, rescue) so that CI pays for one real upgrade only.
