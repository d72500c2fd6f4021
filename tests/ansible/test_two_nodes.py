"""Two real nodes (issue 25): ``site.yml`` deploys the cross-node P/D stack of
``inventory/lab-2node`` onto two lab hosts, each with its own Docker engine in its own
network namespace.

Shape (the seed's cross-node runbook scaled to CPU, kv_mode ``shared-l1+nixl``):
  node1 10.77.0.1: proxy, prefill-0, decode-0, LMCache MP server (+ metrics gate)
  node2 10.77.0.2: decode-0, its LMCache MP server (+ metrics gate)
Each node runs ``dockerd`` inside its own network, mount and UTS namespaces
(``Lab.start_docker``: the machine's images cloned by hard links, ~3 s a node), so every
container (``network_mode: host``) lives on its node's eth0 and traffic between nodes
crosses the lab bridge.  Ansible reaches the nodes over real SSH and finds each node's own
``/run/docker.sock``: the inventory points it nowhere else (no DOCKER_HOST, no
in-container health check, unlike a lab node driving the machine's daemon).

The tests run in file order on one module-wide lab (pytest keeps a module's order; each
later test needs the earlier state):

1. node1 drops node2's packets to the NIXL side channel: ``site.yml`` stops at
   the preflight, naming host, port and purpose; no container exists on either node;
2. check mode on the fresh nodes shows a diff and writes nothing; site.yml deploys both
   nodes (compose files equal ``pdstack render``, secrets file 0600, each node's engine
   runs exactly its planned services, every engine serves, the proxy is healthy); a second
   run changes nothing; each service's own secrets file (0600) holds exactly the secrets it
   reads; no canary secret shows up in any HTTP answer, process argument or container log on
   node1, and each is in the environment of exactly the services that read it (issues 27, 38);
3. streamed answers come back through the proxy from both decoders with the tokens of a
   single engine; node2's decoder takes the prompt from ``external_kv_transfer`` (NIXL), its
   NIXL byte counter and node2's eth0 ``rx_bytes`` show at least the KV's bytes arriving,
   while node1's pair (shared LMCache store) moves nothing across;
4. ``upgrade.yml -e model_revision=rev2`` under steady traffic: 0 failed requests, no
   request served by a mixed-generation pair (the proxy's per-pair counter), a bounded wait,
   every engine on rev2 after; no LMCache hit crossed revisions on node1;
5. node2's link goes down in the middle of a KV pull (issue 38, item 5: node2's decoder
   holds the request, its pull from node1's prefiller held open by node2's firewall, when
   the link goes down): the proxy ejects node2's decoder as unreachable at its first failed
   probe after the wedge budget and the request is answered (re-routed to node1's decoder)
   or ends with an OpenAI error, node1's pair (a client process of its own at real-time
   priority, as on a machine of its own) answers every request within 2 s (issue 38;
   0.84-1.50 s measured in 9 rounds; 1.2-2.7 s with the client a thread of this process,
   which waited for a core ~1 s a request) throughout node1's
   prefiller's 30 s KV lease, nothing hangs; link up:
   node2 serves again (``PDSTACK_LINK_LOSS_ROUNDS=5`` repeats it). After the upgrade: a
   decoder that lost its NIXL peer may die at a later request (once in CI it took the
   upgrade's only other decoder's place and failed it); test 6 redeploys every engine;
6. the inventory switched to kv_mode ``nixl`` (and rev2, as a user records the upgrade):
   ``site.yml`` redeploys both nodes, the LMCache services go, and both pairs move KV over
   NIXL: node2's across the bridge, node1's within node1 (nothing of its size on node2).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import stat
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from anshelpers import REPO, VENV_BIN, Lab, node_path, playbook

from pdstack.testing.canaries import canaries, check_stack
from pdstack.testing.heavy import CPU_STACK_IMAGES, heavy_lock, http_json, require_docker
from pdstack.testing.proxy_harness import metric_value
from pdstack.testing.steady import SteadyClient, SteadyClientProcess

pytestmark = [pytest.mark.netns, pytest.mark.docker]

INVENTORY = REPO / "inventory" / "lab-2node"
PREFIX = "pdlab2"
SECRETS = canaries("2n7c1d")
ADMIN = SECRETS["PDSTACK_ADMIN_TOKEN"]
CLIENT_KEY = SECRETS["PDSTACK_API_KEYS"]
ENGINE_KEY = SECRETS["VLLM_API_KEY"]
PROXY = "http://10.77.0.1:8000"
ENGINES = {"node1/prefill-0": "http://10.77.0.1:8100", "node1/decode-0": "http://10.77.0.1:8101",
           "node2/decode-0": "http://10.77.0.2:8100"}
ENGINE_PORT = {name: int(url.rsplit(":", 1)[1]) for name, url in ENGINES.items()}
DECODERS = ("node1/decode-0", "node2/decode-0")
REV = {"rev1": "/models/tiny-llama/rev1", "rev2": "/models/tiny-llama/rev2"}
FIXED_PROMPT = "the proxy sends the request to the decoder and the cache"
KV_BYTES_PER_TOKEN = 2048  # tiny-llama: 2 layers x 4 KV heads x 64 x (K+V) x bf16
# Steady, never saturating: a vLLM CPU engine's worker spins for 1 s after every step, so
# more traffic slows every restart on 2 cores (the sizing notes of the single-node rolling
# upgrade test this module replaced: tests/upgrade/test_rolling_upgrade.py in git history).
STEADY_PAUSE_S = 3.0
# link loss mid-KV-pull (issue 38, item 5): the prompt whose KV node2's decoder pulls when its
# link goes down (~3 MB), the answer's length, how long node1's pair is watched after the
# link went down (past node1's prefiller's 30 s lease on the cut pull's KV) and the slowest
# answer allowed to it meanwhile: issue 38 asks 2 s; measured 1.21-2.70 s in 13 runs with the
# pair a thread of this process, which waited ~1 s for a core at each request (run-queue wait,
# node1's engines spinning on the same 2 cores); in a process of its own at SCHED_FIFO 1
# (SteadyClientProcess): 1.31 / 0.88 / 1.34 / 1.04 / 0.98 s (5 rounds in one run) and 0.84 /
# 1.50 / 0.88 / 1.24 s; the stall it guards against: 10.8-12.9 s and 503s.
# PDSTACK_LINK_LOSS_ROUNDS repeats the test (issue 38: 5)
PULL_PROMPT_TOKENS = 1500
PULL_ANSWER_TOKENS = 32
PAIR_WATCH_S = 35.0
PAIR_ANSWER_S = 2.0
LINK_LOSS_ROUNDS = int(os.environ.get("PDSTACK_LINK_LOSS_ROUNDS", "1"))
# tries a round may take when node2's decoder answered before its link went down (then the
# try cut nothing: test_link_lost_mid_kv_pull_and_readmitted)
LINK_LOSS_TRIES = 3
KV_EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
UNREACHABLE = f"ejected backend node2/decode-0 ({ENGINES['node2/decode-0']}): unreachable:"


# --------------------------------------------------------------------------- helpers


def engine(name: str, method: str, path: str, body: Any = None) -> Any:
    return http_json(method, ENGINES[name] + path, body, key=ENGINE_KEY)


def proxy(method: str, path: str, body: Any = None, timeout: float = 120.0) -> Any:
    key = ADMIN if path.startswith("/admin") else CLIENT_KEY
    return http_json(method, PROXY + path, body, key=key, timeout=timeout)


def signature(via: str, prompt: str = FIXED_PROMPT) -> list[int]:
    """Greedy token ids of a fixed prompt, from an engine (``node/service``) or the proxy
    (``proxy``): a fingerprint of the weights."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}
    answer = proxy("POST", "/v1/completions", body) if via == "proxy" else engine(
        via, "POST", "/v1/completions", body)
    return list(answer["choices"][0]["token_ids"])


def classify(ids: list[int], refs: dict[str, list[int]]) -> str:
    matches = [rev for rev, ref in refs.items() if ids == ref]
    return matches[0] if len(matches) == 1 else f"unknown ({ids})"


def token_count(prompt: str) -> int:
    return int(engine("node1/decode-0", "POST", "/tokenize",
                      {"model": "tiny", "prompt": prompt})["count"])


def long_prompt(tag: str, tokens: int = 700) -> str:
    words = ["prefill", "decode", "cache", "token", "model",
             "server", "request", "stream", "node", "engine"]
    text = f"{tag}: " + " ".join(f"{words[i % len(words)]} {tag}{i}" for i in range(tokens))
    count = token_count(text)
    while count > tokens * 1.2:
        text = text[: int(len(text) * tokens / count)]
        count = token_count(text)
    assert count >= 600, count
    return text


def external_hits_after(name: str, prompt: str) -> float:
    before = metric_value(engine(name, "GET", "/metrics"), "vllm:external_prefix_cache_hits_total")
    engine(name, "POST", "/v1/completions",
           {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    time.sleep(1.0)
    after = metric_value(engine(name, "GET", "/metrics"), "vllm:external_prefix_cache_hits_total")
    return after - before


def containers(lab: Lab, node: str) -> set[str]:
    """The compose service of every container on the node's own Docker engine, running or
    not."""
    ps = lab.ssh(node, "docker ps -a --format '{{.Label \"com.docker.compose.service\"}}'")
    assert ps.returncode == 0, (node, ps.stderr)
    return set(ps.stdout.split())


def planned_services(plan: dict[str, Any], node: str) -> set[str]:
    want = {s["name"] for s in plan["nodes"][node]["services"]}
    return want | ({"lmcache-metrics"} if "lmcache" in want else set())  # its metrics gate


def rx_bytes(lab: Lab, node: str) -> int:
    return int(lab.node_run(node, ["cat", "/sys/class/net/eth0/statistics/rx_bytes"]).stdout)


def backend(name: str) -> dict[str, Any]:
    listing = proxy("GET", "/admin/backends")
    return next(b for b in listing["backends"] if b["name"] == name)


def wait_for(what: str, check, timeout: float, every: float = 0.5) -> float:
    t0 = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - t0
        except (AssertionError, OSError):
            pass
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(every)


def stream(prompt: str, max_tokens: int, timeout: float = 120.0,
           first: threading.Event | None = None,
           times: list[float] | None = None) -> tuple[list[dict], float]:
    """One streamed completion through the proxy: its SSE events and seconds taken
    (``first`` is set when the first event arrives; ``times`` gets each event's arrival)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(PROXY + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {CLIENT_KEY}"})
    t0 = time.monotonic()
    events: list[dict] = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if times is not None:
                    times.append(time.monotonic())
                if first is not None:
                    first.set()
    return events, time.monotonic() - t0


def stream_tokens(events: list[dict]) -> list[int]:
    return [t for e in events if "choices" in e for t in e["choices"][0].get("token_ids") or []]


# --------------------------------------------------------------------------- the lab


@dataclass
class TwoNodes:
    lab: Lab
    inv: Path
    plan: dict[str, Any]
    state: dict[str, Any]


def _inventory(lab: Lab, dest: Path, **group_vars: Any) -> Path:
    return lab.write_inventory(dest, source=INVENTORY, group_vars={
        "stack_secrets": SECRETS, "stack_pull": "never", **group_vars})


def _plan(inv: Path) -> dict[str, Any]:
    out = subprocess.run([str(VENV_BIN / "pdstack"), "plan", "-i", str(inv), "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    require_docker(CPU_STACK_IMAGES)
    lab = Lab(prefix=PREFIX, n=2)
    with heavy_lock():
        lab.up()
        try:
            took = {node: lab.start_docker(node) for node in lab.nodes}
            print("\nnode Docker engines up: "
                  + ", ".join(f"{n} {s:.1f}s" for n, s in took.items()))
            inv = _inventory(lab, tmp_path_factory.mktemp("inv2") / "lab-2node")
            with lab.in_ctl():
                yield TwoNodes(lab, inv, _plan(inv), {})
        finally:
            if os.environ.get("PDSTACK_KEEP_LAB") == "1":  # for a developer's look
                print(f"\nPDSTACK_KEEP_LAB=1: lab {PREFIX} left up; DOCKER_HOST per node: "
                      + ", ".join(lab.docker_host(n) for n in lab.nodes))
            else:
                for node in lab.nodes:
                    lab.stop_docker(node)
                lab.down()


def logs(lab: Lab, node: str, service: str, tail: int | str = 400,
         since: float | None = None) -> str:
    """A service's container log, from the node's own Docker engine (the last `tail` lines;
    with `since`, a Unix time, only what was logged from then on)."""
    dh = ["docker", "-H", lab.docker_host(node)]
    ids = subprocess.run([*dh, "ps", "-aq", "--filter",
                          f"label=com.docker.compose.service={service}"],
                         capture_output=True, text=True, timeout=60).stdout.split()
    if not ids:
        return f"(no {service} container on {node})"
    window = ["--since", f"{since:.3f}"] if since is not None else []
    out = subprocess.run([*dh, "logs", "--tail", str(tail), *window, ids[0]],
                         capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


@pytest.fixture
def nodes(two_nodes: TwoNodes, request: pytest.FixtureRequest) -> Iterator[TwoNodes]:
    failed_before = request.session.testsfailed
    two_nodes.lab.clear_faults()
    try:
        yield two_nodes
    finally:
        two_nodes.lab.clear_faults()
        if request.session.testsfailed > failed_before and two_nodes.state.get("deployed"):
            lines = [ln for ln in logs(two_nodes.lab, "node1", "proxy").splitlines()
                     if " INFO " not in ln]
            print("\n--- node1/proxy log, all but INFO (last 60):\n" + "\n".join(lines[-60:]))
            # an engine that failed (e.g. vLLM's "EngineCore encountered an issue"): its own
            # words, the stack trace included
            for node in ("node1", "node2"):
                text = logs(two_nodes.lab, node, "decode-0", tail=2000)
                bad = [ln for ln in text.splitlines()
                       if any(w in ln for w in ("ERROR", "Error", "Traceback", "  File ", "raise"))]
                print(f"\n--- {node}/decode-0 log, its errors (last 60):\n" + "\n".join(bad[-60:]))


def _need(two: TwoNodes, step: str) -> None:
    if not two.state.get(step):
        pytest.fail(f"an earlier test of this module did not get to {step!r}", pytrace=False)


# --------------------------------------------------------------------------- 1. preflight


def test_blocked_nixl_side_channel_stops_site_yml_at_preflight(nodes: TwoNodes) -> None:
    lab = nodes.lab
    edge = next(e for e in nodes.plan["edges"] if "nixl side channel" in e["purpose"])
    assert (edge["src_node"], edge["dst_node"]) == ("node2", "node1"), edge
    lab.drop("node1", edge["port"], src="node2")
    run = playbook(lab, "site.yml", nodes.inv, timeout=600)
    assert run.rc != 0, run.tail()
    line = (f"node2 -> node1 {edge['dst_address']}:{edge['port']} ({edge['purpose']}): "
            "no answer within 3s: packets are dropped")
    assert line in run.out, run.tail(200)
    assert "private network preflight failed:" in run.out
    assert "TASK [stack" not in run.out  # the play stopped at the preflight
    for node in lab.nodes:  # nothing started on either node
        ps = lab.ssh(node, "docker ps -aq")
        assert ps.returncode == 0 and ps.stdout.strip() == "", (node, ps.stdout, ps.stderr)
    print(f"\nblocked side channel: site.yml stopped at preflight in {run.seconds:.1f}s")


# --------------------------------------------------------------------------- 2. deploy


def test_site_yml_deploys_both_nodes_idempotently(nodes: TwoNodes, tmp_path: Path) -> None:
    lab, inv = nodes.lab, nodes.inv
    stack_dir = f"/opt/pdstack/{nodes.plan['deployment']}"
    check = playbook(lab, "site.yml", inv, "--check", "--diff", timeout=900)
    assert check.rc == 0, check.tail(150)
    assert check.changed() > 0, check.tail(150)
    assert "+++ after" in check.out  # --diff shows what would change
    for node in lab.nodes:  # ... and nothing was written
        assert not node_path(lab, node, stack_dir).exists(), node
        assert not node_path(lab, node, "/etc/pdstack/secrets.env").exists(), node
    up = playbook(lab, "site.yml", inv, timeout=1500)
    assert up.rc == 0, up.tail(150)
    assert up.changed() > 0
    rendered = tmp_path / "r"
    subprocess.run([str(VENV_BIN / "pdstack"), "render", "-i", str(inv), "-o", str(rendered)],
                   capture_output=True, text=True, check=True)
    for node in lab.nodes:
        got = node_path(lab, node, f"{stack_dir}/compose.yaml").read_text()
        assert got == (rendered / node / "compose.yaml").read_text(), node
        secrets = node_path(lab, node, "/etc/pdstack/secrets.env")
        assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
        # each service's own file holds exactly the secrets it reads (issue 38)
        files = nodes.plan["nodes"][node]["secret_files"]
        assert {Path(f).name for f in files} == (
            {"engine.env", "proxy.env", "grafana.env"} if node == "node1" else {"engine.env"})
        for path, names in files.items():
            own = node_path(lab, node, path)
            assert stat.S_IMODE(own.stat().st_mode) == 0o600, path
            text = own.read_text()
            held = {name for name, value in SECRETS.items() if value in text}
            assert held == set(names) & set(SECRETS), (node, path, held)
        # each node's containers run on the node's own engine
        assert containers(lab, node) == planned_services(nodes.plan, node), node
    for name in ENGINES:  # each engine serves (with its own key)
        root = engine(name, "GET", "/v1/models")["data"][0]["root"]
        assert root == REV["rev1"], (name, root)
    health = proxy("GET", "/health", timeout=10)
    assert health["status"] == "ok", health
    # node1's own pair answers through the proxy (shared L1 on node1, no NIXL hop: node2's
    # decoder drained meanwhile; the NIXL hop is test 3's)
    proxy("POST", "/admin/backends/node2/decode-0/drain")
    try:
        answer = proxy("POST", "/v1/completions",
                       {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    finally:
        proxy("POST", "/admin/backends/node2/decode-0/undrain")
    assert answer["usage"]["completion_tokens"] == 4, answer
    nodes.state["deployed"] = True
    again = playbook(lab, "site.yml", inv, timeout=900)
    assert again.rc == 0, again.tail(150)
    assert again.changed() == 0, again.tail(150)
    # no canary in any HTTP answer, process argument or log on node1 (proxy, engines,
    # LMCache, its gate), and each in the environment of the services that read it only
    wants = {s["name"]: s["secrets"] for s in nodes.plan["nodes"]["node1"]["services"]}
    report = check_stack(node_path(lab, "node1", stack_dir), SECRETS, host="10.77.0.1",
                         bearer=ENGINE_KEY, docker_host=lab.docker_host("node1"), wants=wants)
    print(f"\ncheck mode (fresh) {check.seconds:.0f}s, site.yml {up.seconds:.0f}s, again "
          f"{again.seconds:.0f}s (changed=0); canaries: {report.answered} HTTP answers on "
          f"ports {report.ports}, processes {report.processes}, log characters "
          f"{report.logs}, secrets by environment {report.environments}: "
          f"{report.leaks or 'clean'}")
    assert not report.leaks, report.leaks
    assert report.answered >= 20, f"only {report.answered} HTTP answers: nothing checked"
    assert set(report.processes) == {"prefill-0", "decode-0", "lmcache", "lmcache-metrics",
                                     "proxy"}, report.processes
    assert report.environments == {
        "prefill-0": ["HF_TOKEN", "VLLM_API_KEY"], "decode-0": ["HF_TOKEN", "VLLM_API_KEY"],
        "proxy": ["PDSTACK_ADMIN_TOKEN", "PDSTACK_API_KEYS", "VLLM_API_KEY"],
        "lmcache": [], "lmcache-metrics": []}, report.environments


# --------------------------------------------------------------------------- 3. KV crosses


def kv_through_each_decoder(lab: Lab, prompt: str) -> dict[str, tuple]:
    """``prompt`` streamed through the proxy once to each decoder (the other drained): the
    tokens, and what the decoder's metrics and each node's eth0 counted meanwhile."""
    results = {}
    for target in DECODERS:
        other = next(d for d in DECODERS if d != target)
        proxy("POST", f"/admin/backends/{other}/drain")
        try:
            d_before = engine(target, "GET", "/metrics")
            rx_before = {n: rx_bytes(lab, n) for n in lab.nodes}
            events, _ = stream(prompt + f" {target}", 8)
            rx = {n: rx_bytes(lab, n) - rx_before[n] for n in lab.nodes}
            d_after = engine(target, "GET", "/metrics")
        finally:
            proxy("POST", f"/admin/backends/{other}/undrain")
        ext = (metric_value(d_after, TOKENS_BY_SOURCE, source="external_kv_transfer")
               - metric_value(d_before, TOKENS_BY_SOURCE, source="external_kv_transfer"))
        nixl = (metric_value(d_after, "vllm:nixl_bytes_transferred_sum")
                - metric_value(d_before, "vllm:nixl_bytes_transferred_sum"))
        results[target] = (stream_tokens(events), ext, nixl, rx)
    print("\n" + "\n".join(f"{t}: tokens {r[0]}, decoder external_kv_transfer +{r[1]:g}, "
                           f"nixl bytes +{r[2]:g}, rx bytes {r[3]}" for t, r in results.items()))
    # greedy tokens equal one engine's serving the prompt whole (node1's prefiller, direct)
    for target, (tokens, *_rest) in results.items():
        assert len(tokens) == 8, (target, tokens)
        assert tokens == signature("node1/prefill-0", prompt + f" {target}"), target
    return results


def assert_nixl_across(results: dict[str, tuple], n_tokens: int) -> None:
    """node2's decoder got the prompt over NIXL, not recomputed; the bytes crossed eth0."""
    _tokens, ext2, nixl2, rx2 = results["node2/decode-0"]
    assert ext2 >= n_tokens - 16, (ext2, n_tokens)
    assert nixl2 >= KV_BYTES_PER_TOKEN * (n_tokens - 16), nixl2
    assert rx2["node2"] >= KV_BYTES_PER_TOKEN * (n_tokens - 16), rx2


def test_kv_crosses_nodes_and_tokens_match_a_single_engine(nodes: TwoNodes) -> None:
    _need(nodes, "deployed")
    prompt = long_prompt("cross")  # ~700 tokens: ~1.4 MB of KV
    n_tokens = token_count(prompt)
    results = kv_through_each_decoder(nodes.lab, prompt)
    assert_nixl_across(results, n_tokens)
    # node1's pair shares node1's LMCache store: its decoder read every full 256-token chunk
    # from there (tokens as computed whole, above), nothing of that size crossed to node2
    _tokens, ext1, nixl1, rx1 = results["node1/decode-0"]
    assert ext1 >= max(256, (n_tokens // 256) * 256 - 256), (ext1, n_tokens)
    assert nixl1 == 0, nixl1
    assert rx1["node2"] < KV_BYTES_PER_TOKEN * n_tokens / 4, rx1


# --------------------------------------------------------------------------- 4. upgrade


def test_upgrade_yml_rolls_both_nodes_under_traffic(nodes: TwoNodes) -> None:
    _need(nodes, "deployed")
    lab = nodes.lab
    ref1 = signature("node1/decode-0")
    assert classify(signature("proxy"), {"rev1": ref1}) == "rev1"
    x_prompt = long_prompt("xrev")
    engine("node1/prefill-0", "POST", "/v1/completions",
           {"model": "tiny", "prompt": x_prompt, "max_tokens": 1, "temperature": 0})
    time.sleep(2.0)  # LMCache stores asynchronously
    assert external_hits_after("node1/decode-0", x_prompt) > 0, "the probe cannot see a hit"

    client = SteadyClient(PROXY, workers=1, pause_s=STEADY_PAUSE_S, api_key=CLIENT_KEY)
    client.start()
    time.sleep(5)
    t0 = time.monotonic()
    run = playbook(lab, "upgrade.yml", nodes.inv, "-e", "model_revision=rev2", timeout=1800)
    upgrade_s = time.monotonic() - t0
    time.sleep(5)
    client.stop()
    print(f"\nupgrade.yml {upgrade_s:.0f}s; requests {client.sent}, failed "
          f"{len(client.failed)}; slowest request {max(o.seconds for o in client.outcomes):.1f}s")
    assert run.rc == 0, run.tail(150)
    assert ADMIN not in run.out
    assert client.sent >= 20, client.sent
    assert not client.failed, "failed requests:\n" + "\n".join(
        f"{o.detail} (stream={o.stream}, id={o.request_id})" for o in client.failed[:10])
    during = [o for o in client.outcomes if t0 <= o.started <= t0 + upgrade_s]
    assert len(during) >= 10, len(during)
    # a bounded wait: no request waited longer than one engine restart's health budget
    assert max(o.seconds for o in client.outcomes) < 60, sorted(
        o.seconds for o in client.outcomes)[-5:]

    for name in ENGINES:
        root = engine(name, "GET", "/v1/models")["data"][0]["root"]
        assert root == REV["rev2"], (name, root)
    ref2 = signature("node1/decode-0")
    refs = {"rev1": ref1, "rev2": ref2}
    assert ref1 != ref2
    for name in ENGINES:
        assert classify(signature(name), refs) == "rev2", name
    for _ in range(4):
        assert classify(signature("proxy"), refs) == "rev2"

    metrics = proxy("GET", "/metrics")
    pairs = []
    for line in metrics.splitlines():
        if line.startswith("pdstack_proxy_pairs_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            pairs.append((labels, float(line.rsplit(" ", 1)[1])))
    mixed = [(lab_, n) for lab_, n in pairs
             if lab_["prefill_generation"] != lab_["decode_generation"] and n > 0]
    assert not mixed, f"requests served by a mixed-generation pair: {mixed}"
    served = {lab_["prefill_generation"].split("@")[0] for lab_, n in pairs if n > 0}
    assert served == {"rev1", "rev2"}, pairs
    # no LMCache hit crossed revisions on node1's shared store; rev2 -> rev2 still hits
    assert external_hits_after("node1/decode-0", x_prompt) == 0
    y_prompt = long_prompt("yrev")
    engine("node1/prefill-0", "POST", "/v1/completions",
           {"model": "tiny", "prompt": y_prompt, "max_tokens": 1, "temperature": 0})
    time.sleep(2.0)
    assert external_hits_after("node1/decode-0", y_prompt) > 0
    env_text = node_path(lab, "node2", f"/opt/pdstack/{nodes.plan['deployment']}/.env").read_text()
    assert "rev1" not in env_text, env_text


# --------------------------------------------------------------------------- 5. node lost
# (after the upgrade: a decoder that lost its NIXL peer may die at a later request, and the
# prefiller keeps the cut pull's state; test 6 redeploys every engine)


@dataclass
class CutPull:
    """One try at cutting node2's link mid-KV-pull (:func:`cut_pull`): what it measured.
    ``answered_first`` says why the try did not exercise the scenario ("" when it did)."""

    answered_first: str
    outcome: dict[str, Any]
    tokens: list[int]
    errors: list[dict]
    answered: float
    unreachable: int
    expired: float
    pair: SteadyClientProcess
    slowest: float
    health_log: list[str]  # the proxy's ejections / re-admissions / wedges, last ones


@pytest.mark.parametrize("round_", range(1, LINK_LOSS_ROUNDS + 1))
def test_link_lost_mid_kv_pull_and_readmitted(nodes: TwoNodes, round_: int) -> None:
    """node2's link goes down while its decoder pulls a request's KV from node1's prefiller
    over NIXL. The proxy ejects node2's decoder as unreachable once the cut leg has waited
    past the wedge budget; the request gets its answer (re-routed to node1's decoder, no byte
    having reached the client) or an OpenAI error;
    node1's pair answers every request meanwhile within PAIR_ANSWER_S; link up: node2 is
    readmitted and serves again.
    A try in which node2's decoder answered the request before its link went down (its
    answer, an error or tokens, came back through the proxy: nothing of node2's crosses
    once the link is down) did not cut anything: it is told and done again, up to
    LINK_LOSS_TRIES in all; the assertions hold for the try that cut the pull."""
    _need(nodes, "deployed")
    why = []
    for attempt in range(1, LINK_LOSS_TRIES + 1):
        cut = cut_pull(nodes.lab, round_, attempt)
        if not cut.answered_first:
            break
        why.append(f"try {attempt}: {cut.answered_first}")
    else:
        pytest.fail(f"in {LINK_LOSS_TRIES} tries node2's decoder answered the request before "
                    f"its link went down every time (its KV pull was not held, or the link "
                    f"went down late):\n" + "\n".join(why), pytrace=False)
    # the KV never reached node2: node1's prefiller let the cut pull's lease expire
    assert cut.expired >= 1, cut.expired
    assert len(cut.tokens) == PULL_ANSWER_TOKENS or cut.errors or "error" in cut.outcome, (
        cut.outcome)
    # node2's decoder ejected as unreachable (its /health timed out with the cut leg waiting
    # past the wedge budget: ~7 s), not by three failed probes (12 s) or a wedge probe
    assert cut.unreachable > 0, ("node2's decoder not ejected as unreachable; the proxy's "
                                 "health events:\n" + "\n".join(cut.health_log))
    # then the request's own work on node1 (its prompt and answer on 2 busy cores)
    assert cut.answered < 40, f"the request ended {cut.answered:.0f} s after the link went down"
    pair = cut.pair
    assert pair.sent >= 10, pair.sent
    assert not pair.failed, "node1's pair failed:\n" + "\n".join(
        f"{o.detail} (stream={o.stream}, id={o.request_id})" for o in pair.failed[:10])
    assert cut.slowest < PAIR_ANSWER_S, sorted(o.seconds for o in pair.outcomes)[-5:]


def cut_pull(lab: Lab, round_: int, attempt: int) -> CutPull:
    """One try of the link-loss test: hold node2's KV pull, cut node2's link while its
    decoder holds the request, watch node1's pair, bring the link up and wait until node2
    serves again; prints what it saw."""
    prompt = long_prompt(f"pull{round_}.{attempt}", tokens=PULL_PROMPT_TOKENS)
    n_tokens = token_count(prompt)
    expired_before = metric_value(engine("node1/prefill-0", "GET", "/metrics"), KV_EXPIRED)
    restarts_before = decoder_restarts(lab)
    served_before = backend("node2/decode-0")["served"]
    # read before the link goes down: node2's decoder is ejected ~7 s after it, and on 2 busy
    # cores a read after it (node1's decoder spinning) took longer than that once in CI, so
    # the ejection fell before a "before" count of the log and the test saw none; the log is
    # read from this moment on instead (a tail of N lines also slides past old lines)
    decoder1_before = engine("node1/decode-0", "GET", "/metrics")
    log_from = time.time()
    outcome: dict[str, Any] = {}
    started = threading.Event()

    def pulled_stream() -> None:
        try:
            outcome["events"], outcome["seconds"] = stream(
                prompt, PULL_ANSWER_TOKENS, timeout=180, first=started)
        except Exception as exc:  # recorded and asserted below
            outcome["error"] = repr(exc)

    # The pull is held open: node2 drops every packet from node1 but the proxy's to its
    # decoder, so the KV (~PULL_PROMPT_TOKENS x 2 KiB) cannot arrive (a 1.5 MB pull takes
    # ~0.1 s here, less than `ip` takes on 2 busy cores: unheld, the link went down after
    # the answer in 2 of 5 tries). node1's decoder is drained, so the decode leg can only
    # go to node2's; the proxy counts it in node2's in_flight once the prefill answered.
    # Once node2's decoder holds the request (no first token: its KV has not come), the
    # link goes down, through a socket opened in node2's namespace beforehand
    # (Lab.link_down_armed: ~0.3 ms; an `ip` armed beforehand took 5.7 s once in CI, and
    # node2's decoder answered first). It must go down within seconds: a decoder that
    # has to handshake with node1's prefiller first (NIXL's side channel, e.g. its first
    # pull from a restarted prefiller) gives up after 5 s (vLLM's handshake receive
    # timeout) and answers with an error, which is then node2's answer.
    fire = lab.link_down_armed("node2")
    lab.hold_from("node2", "node1", but_port=ENGINE_PORT["node2/decode-0"])
    # node2 is another machine: its decoder, spinning on a KV that never comes (vLLM steps
    # without pause while a request waits for remote KV), must not take node1's cores; in
    # the lab both decoders run on this machine's core 0, and it stalled node1's decoder for
    # ~25 s (until the link came back) in 5 of 8 tries. node2 gets what node1 leaves.
    lab.cpu_shares("node2", 2)
    proxy("POST", "/admin/backends/node1/decode-0/drain")
    try:
        t = threading.Thread(target=pulled_stream, daemon=True)  # in the controller's netns,
        t.start()                                                 # like this thread
        t_sent = time.monotonic()
        while backend("node2/decode-0")["in_flight"] < 1:
            assert t.is_alive() and time.monotonic() - t_sent < 60, (
                f"the decode leg never went to node2: {outcome}")
            time.sleep(0.01)
        t_leg = time.monotonic() - t_sent
        try:  # vLLM's gauges follow its steps: a moment late, or not at all while it waits
            held = f"{wait_for('', lambda: engine_queue('node2/decode-0') >= 1, 2, 0.1):.2f} s"
        except AssertionError:
            held = "not in its metrics within 2 s"
        fired_in = fire()
        t_down = time.monotonic()
        # node2's answer already here: it came before the link went down
        answered_first = ("its answer had reached the client when the link went down"
                          if started.is_set() or not t.is_alive() else "")
    finally:
        proxy("POST", "/admin/backends/node1/decode-0/undrain")
    lab.unhold("node2")  # the link is down: nothing passes either way
    # node1's pair under steady traffic while node2 is lost and node1's prefiller holds the
    # cut pull's KV (its lease: 30 s, no heartbeat renews it)
    # its own process at real-time priority: a client on a machine of its own (a thread of
    # this process waited ~1 s for a core at every request while node1's engines spun)
    pair = SteadyClientProcess(PROXY, workers=1, max_tokens=4, pause_s=0.25, timeout_s=30,
                               api_key=CLIENT_KEY)
    pair.start()
    try:
        t.join(timeout=90)
        assert not t.is_alive(), "the request whose KV pull was cut hangs"
        answered = time.monotonic() - t_down
        time.sleep(max(0.0, PAIR_WATCH_S - (time.monotonic() - t_down)))
        pair.stop()
    finally:
        pair.kill()  # only where stop did not end it
    events = outcome.get("events", [])
    errors = [e for e in events if "error" in e]
    tokens = stream_tokens(events)
    saw = (f"{len(tokens)} tokens" if not errors and "error" not in outcome
           else f"{len(tokens)} tokens, then {errors[-1] if errors else outcome['error']}")
    lab.cpu_shares("node2", 1024)
    # the re-routed request on node1's decoder: its prompt's full 256-token chunks come from
    # node1's LMCache store (node1's prefiller stored them), not recomputed
    from_store = (metric_value(engine("node1/decode-0", "GET", "/metrics"), TOKENS_BY_SOURCE,
                               source="external_kv_transfer")
                  - metric_value(decoder1_before, TOKENS_BY_SOURCE, source="external_kv_transfer"))
    proxy_log = logs(lab, "node1", "proxy", tail="all", since=log_from)
    unreachable = proxy_log.count(UNREACHABLE)
    # what decided node2's fate (a flake once: ejected, but not as unreachable; which way
    # and why is in these lines)
    health_log = [line for line in proxy_log.splitlines()
                  if any(w in line for w in ("ejected", "re-admitted", "wedge", "/health"))][-20:]
    node2 = backend("node2/decode-0")
    # node2 served the request through the proxy: its answer crossed before the link went
    # down (nothing of node2's crosses after; the proxy counts an answer streamed to its end,
    # an error event of the engine's included)
    if node2["served"] > served_before and not answered_first:
        answered_first = (f"node2's decoder served it (served +{node2['served'] - served_before}"
                          f") before the link went down")
    assert node2["healthy"] is False
    expired = metric_value(engine("node1/prefill-0", "GET", "/metrics"), KV_EXPIRED)
    lab.link_up("node2")
    # vLLM's decoder may not survive its NIXL peer's loss (its EngineCore fails, at once or
    # at its next request): then its container restarts (restart policy, engine watchdog)
    # and the proxy readmits it once /health passes. Back = node2 serves through the proxy.
    proxy("POST", "/admin/backends/node1/decode-0/drain")
    try:
        back = wait_for("node2's decoder serving through the proxy",
                        lambda: bool(signature("proxy")), timeout=240, every=2)
    finally:
        proxy("POST", "/admin/backends/node1/decode-0/undrain")
    restarts = decoder_restarts(lab) - restarts_before
    slowest_one = max(pair.outcomes, key=lambda o: o.seconds, default=None)
    slowest = slowest_one.seconds if slowest_one is not None else 0.0
    slowest_at = slowest_one.started - t_down if slowest_one is not None else 0.0
    tried = f" (try {attempt})" if attempt > 1 else ""
    print(f"\nlink loss mid-KV-pull, round {round_}{tried}: the decode leg went to node2 "
          f"{t_leg:.2f} s after the request ({n_tokens} prompt tokens), node2's decoder held "
          f"it (its KV pull held open) {held} later, the link down {fired_in * 1000:.1f} "
          f"ms after that; the request ended {answered:.1f} s after the link went down ({saw};"
          f" node1's decoder +{from_store:g} prompt tokens from node1's LMCache store); "
          f"node1's pair: {pair.sent} requests, {len(pair.failed)} failed, slowest "
          f"{slowest:.2f} s (sent {slowest_at:.1f} s after the link went down); node1's "
          f"prefiller expired KV leases +{expired - expired_before:g};"
          f" node2 serving again {back:.1f} s after link up (decoder restarts +{restarts})"
          + (f"; NOT EXERCISED: {answered_first}, trying again" if answered_first else ""))
    return CutPull(answered_first, outcome, tokens, errors, answered,
                   unreachable, expired - expired_before, pair,
                   slowest, health_log)


def decoder_restarts(lab: Lab) -> int:
    out = lab.ssh("node2", "docker inspect -f '{{.RestartCount}}' "
                  "$(docker ps -aq --filter label=com.docker.compose.service=decode-0)")
    return int(out.stdout.strip() or 0)


def engine_queue(name: str) -> float:
    """Requests an engine holds (waiting, e.g. for remote KV, or running)."""
    text = engine(name, "GET", "/metrics")
    return (metric_value(text, "vllm:num_requests_waiting")
            + metric_value(text, "vllm:num_requests_running"))


MIDSTREAM = 4  # streams on node2's decoder when its link goes down
# long enough to be still streaming when the link goes down (96 tokens were over before it
# once in CI, and one of 4 600-token streams once: the tiny model makes hundreds of tokens a
# second, and the 4 first events can come seconds apart on 2 cores)
MIDSTREAM_TOKENS = 1000
MIDSTREAM_MIN_RUNNING = 2  # streams still on node2's decoder when the link goes down
MIDSTREAM_GAP_S = 5.0  # the proxy's: ~1.3 s (silence 0.25 s + an unanswered 1 s probe)


def test_link_lost_mid_stream_streams_go_on_on_node1(nodes: TwoNodes) -> None:
    """MIDSTREAM greedy streams decode on node2's decoder (node1's drained until each has
    its first tokens); node2's link goes down: node2's silent streams have its /health
    probed, which nothing answers, so each goes on on node1's decoder (stream migration,
    reason frozen): every stream completes with the tokens node1's decoder makes alone,
    one id, no error, and no client waits more than MIDSTREAM_GAP_S across the loss. Link
    up: node2 serves again (issue 55)."""
    _need(nodes, "deployed")
    lab = nodes.lab
    prompts = [f"mid-stream {i}: {FIXED_PROMPT}" for i in range(MIDSTREAM)]
    body = {"model": "tiny", "max_tokens": MIDSTREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    reference = [engine("node1/decode-0", "POST", "/v1/completions",
                        {**body, "prompt": p})["choices"][0]["token_ids"] for p in prompts]
    migrated_before = metric_value(proxy("GET", "/metrics"), "pdstack_proxy_migrations_total",
                                   outcome="continued")
    results: list[tuple[list[dict], float] | BaseException] = [ValueError("not run")] * MIDSTREAM
    times: list[list[float]] = [[] for _ in prompts]
    started = [threading.Event() for _ in prompts]

    def run(i: int) -> None:
        try:
            results[i] = stream(prompts[i], MIDSTREAM_TOKENS, timeout=180, first=started[i],
                                times=times[i])
        except Exception as exc:  # asserted below
            results[i] = exc

    fire = lab.link_down_armed("node2")  # armed first: the fault follows the first events
    proxy("POST", "/admin/backends/node1/decode-0/drain")
    try:
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(MIDSTREAM)]
        for t in threads:
            t.start()
        for flag in started:
            assert flag.wait(60), "a stream got no first event from node2's decoder"
    finally:
        proxy("POST", "/admin/backends/node1/decode-0/undrain")
    running = sum(t.is_alive() for t in threads)
    fired_in = fire()
    down = time.monotonic()
    # node2 is another machine: its decoder, still making the lost streams' tokens, must not
    # take node1's cores (in the lab both decoders share core 0: with 1,200-token streams it
    # held node1's decoder back and the clients waited 6.1-6.2 s instead of ~1.3)
    lab.cpu_shares("node2", 2)
    try:
        for t in threads:
            t.join(timeout=180)
    finally:
        lab.cpu_shares("node2", 1024)
    ended = time.monotonic() - down
    migrated = metric_value(proxy("GET", "/metrics"), "pdstack_proxy_migrations_total",
                            outcome="continued") - migrated_before
    lab.link_up("node2")
    gaps = [max((b - a for a, b in itertools.pairwise(ts) if b > down), default=0.0)
            for ts in times]
    print(f"\nlink lost mid-stream: {running} of {MIDSTREAM} streams still on node2's decoder, "
          f"the link down in {fired_in * 1000:.1f} ms; migrated {migrated:g}; every stream "
          f"ended {ended:.1f} s after; the clients' gaps across the loss "
          f"{[round(g, 2) for g in gaps]} s")
    for i, res in enumerate(results):
        assert not isinstance(res, BaseException), f"stream {i}: {res!r}"
        events, _ = res
        assert not [e for e in events if "error" in e], events[-2:]
        assert len({e["id"] for e in events}) == 1
        # float32 engines (inventory/lab-2node): node2's tokens decoded beside 3 others, then
        # node1's, equal node1's decoded alone
        assert stream_tokens(events) == reference[i], f"stream {i}: not node1's tokens"
    # a stream that ended before the fault is not the proxy's doing (it is checked above like
    # the others); each one the fault caught must have moved
    assert running >= MIDSTREAM_MIN_RUNNING, (
        f"{MIDSTREAM - running} stream(s) ended before the link went down: not exercised")
    assert migrated == running, f"{migrated:g} of the {running} streams the fault caught moved"
    assert max(gaps) <= MIDSTREAM_GAP_S, f"a client waited {max(gaps):.1f} s"
    proxy("POST", "/admin/backends/node1/decode-0/drain")
    try:  # node2 back: it serves through the proxy (its decoder may have restarted)
        back = wait_for("node2's decoder serving through the proxy",
                        lambda: bool(signature("proxy")), timeout=240, every=2)
    finally:
        proxy("POST", "/admin/backends/node1/decode-0/undrain")
    print(f"node2 serving again {back:.1f} s after link up")


# --------------------------------------------------------------------------- 6. kv_mode nixl


def test_site_yml_switches_to_kv_mode_nixl_and_both_pairs_use_it(nodes: TwoNodes,
                                                                 tmp_path: Path) -> None:
    _need(nodes, "deployed")
    lab = nodes.lab
    model = yaml.safe_load((INVENTORY / "group_vars" / "all.yml").read_text())["pdstack_model"]
    inv = _inventory(lab, tmp_path / "lab-2node", pdstack_kv_mode="nixl",
                     pdstack_model={**model, "revision": "rev2"})
    plan = _plan(inv)
    pairings = plan["backend_table"]["pairings"]
    assert {p["kv_path"] for p in pairings} == {"nixl"} and len(pairings) == 2, pairings
    run = playbook(lab, "site.yml", inv, timeout=1500)
    assert run.rc == 0, run.tail(150)
    for node in lab.nodes:  # exactly the planned services: the LMCache ones are gone
        assert "lmcache" not in planned_services(plan, node)
        assert containers(lab, node) == planned_services(plan, node), node
    took = wait_for("every backend healthy in the proxy", lambda: all(
        b["healthy"] for b in proxy("GET", "/admin/backends")["backends"]), timeout=60)
    prompt = long_prompt("nixl")
    n_tokens = token_count(prompt)
    results = kv_through_each_decoder(lab, prompt)
    print(f"kv_mode nixl: site.yml {run.seconds:.0f}s, backends healthy {took:.1f}s later")
    assert_nixl_across(results, n_tokens)
    # node1's pair: its prefiller's KV over NIXL within node1, not recomputed, not via node2
    _tokens, ext1, nixl1, rx1 = results["node1/decode-0"]
    assert ext1 >= n_tokens - 16, (ext1, n_tokens)
    assert nixl1 >= KV_BYTES_PER_TOKEN * (n_tokens - 16), nixl1
    assert rx1["node2"] < KV_BYTES_PER_TOKEN * n_tokens / 4, rx1
