"""Self-healing in the rendered stacks: restart policies, each service only its own secrets
(issue 38), LMCache's management API on a unix socket only its /metrics-only gate shares, and
the engine watchdog healthcheck (run for real against the FakeEngine test double, in its
report-only ``dry`` mode)."""

from __future__ import annotations

import asyncio
import sys
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from pdstack import secrets, sidecars
from pdstack.plan import make_plan
from pdstack.render import render_all
from pdstack.testing.fake_engine import FakeEngine, Faults
from pdstack.testing.ports import free_port as _free_port
from pdstack.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
# a CPU and a GPU stack that run an LMCache server (compose/gpu, the measured default, runs none)
STACKS = ["local-cpu", "a100x3"]


def _rendered(inventory: str) -> dict[str, str]:
    topo = load_topology(REPO / "inventory" / inventory)
    (files,) = render_all(topo, make_plan(topo)).values()
    return files


def _services(inventory: str) -> dict[str, dict]:
    return yaml.safe_load(_rendered(inventory)["compose.yaml"])["services"]


@pytest.mark.parametrize("stack", STACKS)
def test_services_restart_and_each_reads_only_its_own_secrets_file(stack: str) -> None:
    services = _services(stack)
    engines = [n for n in services if n.startswith(("prefill-", "decode-", "engine-"))]
    assert engines
    for name in [*engines, "lmcache", "lmcache-metrics", "proxy"]:
        assert services[name]["restart"] == "unless-stopped", name
    files = {"proxy": "proxy", "grafana": "grafana", **dict.fromkeys(engines, "engine")}
    for name, kind in files.items():
        assert [f["path"] for f in services[name]["env_file"]] == [secrets.service_file(kind)]
    assert len({secrets.service_file(k) for k in files.values()}) == 3
    for name in ("lmcache", "lmcache-metrics", "prometheus"):
        assert "env_file" not in services[name], f"{name} is given secrets"
    for name in engines:
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python3", "-m", sidecars.WATCHDOG], name


@pytest.mark.parametrize("stack", [*STACKS, "one-gpu"])
def test_a_starting_engine_is_checked_every_second_then_every_ten(stack: str) -> None:
    """While an engine starts (a restart too) Docker runs its check every second, so it is
    "healthy" within ~1 s of its /health, not up to 5 s later (issue 38 item 6; Docker >= 25:
    20.10, Debian 12's docker.io, ignores start_interval and checks every interval); once
    healthy, every 10 s as before (each run is a Python process)."""
    services = _services(stack)
    engines = [n for n in services if n.startswith(("prefill-", "decode-", "engine-"))]
    assert engines
    for name in engines:
        check = services[name]["healthcheck"]
        assert (check["start_interval"], check["interval"]) == ("1s", "10s"), name


def test_each_kind_gets_only_the_secrets_it_reads() -> None:
    engine, proxy = set(secrets.names_for("engine")), set(secrets.names_for("proxy"))
    assert engine == {"HF_TOKEN", "VLLM_API_KEY"}
    assert "HF_TOKEN" not in proxy and {"PDSTACK_ADMIN_TOKEN", "PDSTACK_API_KEYS",
                                         "PDSTACK_TENANT_KEYS", "VLLM_API_KEY"} <= proxy
    assert secrets.names_for("lmcache") == () and secrets.service_file("lmcache") is None
    node = (
        "# the operator's file\nHF_TOKEN=hf-1\nexport VLLM_API_KEY='k 2'\n"
        "PDSTACK_ADMIN_TOKEN=adm\nGF_SECURITY_ADMIN_PASSWORD=pw\nOTHER=x\nHF_TOKENX=no\n"
    )
    assert secrets.split_lines(node, "engine") == "HF_TOKEN=hf-1\nexport VLLM_API_KEY='k 2'\n"
    assert secrets.split_lines(node, "proxy") == (
        "export VLLM_API_KEY='k 2'\nPDSTACK_ADMIN_TOKEN=adm\n")
    assert secrets.split_lines(node, "grafana") == "GF_SECURITY_ADMIN_PASSWORD=pw\n"
    assert secrets.split_lines(node, "lmcache") == ""
    parsed = {"HF_TOKEN": "a", "PDSTACK_API_KEYS": "b", "VLLM_API_KEY": "c"}
    assert secrets.for_kind("engine", parsed) == {"HF_TOKEN": "a", "VLLM_API_KEY": "c"}
    assert secrets.for_kind("lmcache", parsed) == {}


def test_secrets_split_writes_each_kinds_file_private(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdstack.cli import main

    node = tmp_path / "secrets.env"
    node.write_text("HF_TOKEN=hf-1\nPDSTACK_API_KEYS=k1,k2\nVLLM_API_KEY=e\nX=1\n")
    out = tmp_path / "d" / "secrets"
    (out.parent).mkdir()
    assert main(["secrets", "split", "--node-file", str(node), "--dir", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["engine.env", "grafana.env", "proxy.env"]
    assert oct(out.stat().st_mode & 0o777) == "0o700"
    for p in out.iterdir():
        assert oct(p.stat().st_mode & 0o777) == "0o600", p
    assert (out / "engine.env").read_text() == "HF_TOKEN=hf-1\nVLLM_API_KEY=e\n"
    assert (out / "proxy.env").read_text() == "PDSTACK_API_KEYS=k1,k2\nVLLM_API_KEY=e\n"
    assert (out / "grafana.env").read_text() == ""
    printed = capsys.readouterr().out
    assert "hf-1" not in printed and "k1" not in printed and "engine.env: HF_TOKEN" in printed
    # a secret removed from the node's file goes from the service's file too
    node.write_text("VLLM_API_KEY=e\n")
    assert main(["secrets", "split", "--node-file", str(node), "--dir", str(out)]) == 0
    assert (out / "engine.env").read_text() == "VLLM_API_KEY=e\n"
    # no node file: nothing to do, nothing written
    assert main(["secrets", "split", "--node-file", str(tmp_path / "none"),
                 "--dir", str(tmp_path / "none.d")]) == 0
    assert not (tmp_path / "none.d").exists()


@pytest.mark.parametrize("stack", STACKS)
def test_lmcache_api_on_a_socket_only_its_metrics_gate_shares(stack: str) -> None:
    services = _services(stack)
    cmd = services["lmcache"]["command"]
    assert "--http-host" not in cmd and "--http-port" not in cmd  # no TCP port at all
    sock = sidecars.lmcache_api_socket(cmd)
    assert sock == sidecars.LMCACHE_API_SOCKET and cmd[4] == "server"
    zmq_host = cmd[cmd.index("--host") + 1]
    gate = services["lmcache-metrics"]["command"]
    assert gate[:3] == ["python3", "-m", sidecars.METRICS_GATE]
    host, port, upstream = gate[3:]
    assert host == zmq_host  # the node's private address: Prometheus scrapes it
    assert upstream == f"unix:{sock}"
    mount = f"lmcache-api:{Path(sock).parent}"
    holders = [n for n, s in services.items()
               if any(str(v).startswith("lmcache-api:") for v in s.get("volumes", []))]
    assert sorted(holders) == ["lmcache", "lmcache-metrics"]
    for name in holders:
        assert mount in services[name]["volumes"], name
    assert f"{host}:{port}" in _rendered(stack)["monitoring/prometheus.yml"]


async def _run(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


@pytest.mark.parametrize("over", ["tcp", "unix"])
async def test_metrics_gate_serves_get_metrics_and_nothing_else(over: str, tmp_path: Path) -> None:
    async def anything(request: web.Request) -> web.Response:
        return web.Response(text="lmcache_test_up 1\n" if request.path == "/metrics" else "ok")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = tmp_path / "api.sock"
    if over == "unix":
        site: web.BaseSite = web.UnixSite(runner, str(sock))
        upstream = f"unix:{sock}"
    else:
        upstream_port = _free_port()
        site = web.TCPSite(runner, "127.0.0.1", upstream_port)
        upstream = f"http://127.0.0.1:{upstream_port}"
    await site.start()
    port = _free_port()
    cmd = sidecars.metrics_gate_command("127.0.0.1", port, upstream)
    proc = await asyncio.create_subprocess_exec(sys.executable, *cmd[1:])
    base = f"http://127.0.0.1:{port}"

    def get(path: str, method: str = "GET") -> tuple[int, str]:
        req = urllib.request.Request(
            base + path, method=method, data=b"" if method != "GET" else None
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    try:
        for _ in range(100):
            try:
                status, text = await asyncio.to_thread(get, "/metrics")
                break
            except OSError:
                await asyncio.sleep(0.05)
        assert status == 200 and "lmcache_test_up 1" in text
        for path in ("/env", "/cache/clear", "/run_script", "/metrics/reset", "/quota", "/"):
            assert (await asyncio.to_thread(get, path))[0] == 404, path
        for path in ("/metrics/reset", "/cache/clear", "/run_script"):
            assert (await asyncio.to_thread(get, path, "POST"))[0] == 501, path
        await runner.cleanup()  # the upstream gone: 502, not a hang
        assert (await asyncio.to_thread(get, "/metrics"))[0] == 502
    finally:
        proc.terminate()
        await proc.wait()
        await runner.cleanup()


async def test_engine_watchdog_fails_an_engine_that_holds_requests_without_progress(
    tmp_path: Path,
) -> None:
    state = str(tmp_path / "state.json")
    async with FakeEngine(name="d0", output_tokens=4) as engine:

        async def watchdog(wedge_s: float) -> tuple[int, str]:
            return await _run(
                sys.executable,
                "-m",
                sidecars.WATCHDOG,
                engine.url,
                str(wedge_s),
                state,
                "decode-0",
                "fake",
                "dry",
            )

        # idle: healthy, however long it stays idle
        assert (await watchdog(0.2))[0] == 0
        await asyncio.sleep(0.3)
        assert (await watchdog(0.2))[0] == 0
        # one request that never progresses past its start: failed once past the budget,
        # when the 1-token probe fails too (the double hangs it as well)
        engine.faults = Faults(hang_after_chunks=0)
        async with aiohttp.ClientSession() as session:
            stuck = asyncio.create_task(
                session.post(
                    engine.url + "/v1/completions",
                    json={"model": "fake", "prompt": "x", "stream": True, "max_tokens": 4},
                )
            )
            for _ in range(100):
                if engine.running:
                    break
                await asyncio.sleep(0.02)
            assert engine.running == 1
            assert (await watchdog(1.0))[0] == 0  # first seen held: the budget starts
            assert (await watchdog(1.0))[0] == 0  # within the budget
            await asyncio.sleep(1.2)
            rc, out = await watchdog(1.0)
            assert rc == 1, out
            assert "pdstack-watchdog: decode-0 wedged: requests held, no progress for" in out
            assert "1-token probe failed" in out, out
            (await stuck).close()  # the client goes away: the engine aborts it
        # the engine generates again: the same held-and-flat state is cleared by a probe
        # that succeeds (a live engine is never restarted for an aborted request)
        engine.faults = Faults()
        for _ in range(100):
            if not engine.running:
                break
            await asyncio.sleep(0.02)
        rc, out = await watchdog(1.0)
        assert rc == 0, out
        assert (await watchdog(1.0))[0] == 0
        # /health failing fails the check at once, and past the budget it is a wedge (the
        # engine answered before: a hung API server, not a start)
        engine.faults = Faults(health_status=503)
        rc, out = await watchdog(1.0)
        assert rc == 1 and "wedged" not in out, out
        await asyncio.sleep(1.2)
        rc, out = await watchdog(1.0)
        assert rc == 1 and "decode-0 wedged: /health or /metrics failing for" in out, out


async def test_engine_watchdog_waits_for_a_starting_engine(tmp_path: Path) -> None:
    """An engine that never answered /health yet is starting, not wedged, however long."""
    port = _free_port()
    state = str(tmp_path / "state.json")
    for _ in range(2):
        rc, out = await _run(sys.executable, "-m", sidecars.WATCHDOG,
                             f"http://127.0.0.1:{port}", "0.1", state, "decode-0", "m", "dry")
        assert rc == 1 and "wedged" not in out, out
        await asyncio.sleep(0.2)
