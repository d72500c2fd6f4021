"""Self-healing in the rendered stacks: restart policies, secrets only where used, LMCache's
management API behind a /metrics-only gate, and the engine watchdog healthcheck (run for
real against the FakeEngine test double, in its report-only ``dry`` mode)."""

from __future__ import annotations

import asyncio
import sys
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import yaml

from pdstack import sidecars
from pdstack.plan import make_plan
from pdstack.render import render_all
from pdstack.testing.fake_engine import FakeEngine, Faults
from pdstack.testing.ports import free_port as _free_port
from pdstack.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
SECRETS = "/etc/pdstack/secrets.env"


# a CPU and a GPU stack that run an LMCache server (compose/gpu, the measured default, runs none)
STACKS = ["local-cpu", "a100x3"]


def _rendered(inventory: str) -> dict[str, str]:
    topo = load_topology(REPO / "inventory" / inventory)
    (files,) = render_all(topo, make_plan(topo)).values()
    return files


def _services(inventory: str) -> dict[str, dict]:
    return yaml.safe_load(_rendered(inventory)["compose.yaml"])["services"]


@pytest.mark.parametrize("stack", STACKS)
def test_engines_and_lmcache_restart_and_only_engines_and_proxy_get_secrets(stack: str) -> None:
    services = _services(stack)
    engines = [n for n in services if n.startswith(("prefill-", "decode-", "engine-"))]
    assert engines
    for name in [*engines, "lmcache", "lmcache-metrics", "proxy"]:
        assert services[name]["restart"] == "unless-stopped", name
    for name in [*engines, "proxy"]:
        assert [f["path"] for f in services[name]["env_file"]] == [SECRETS], name
    for name in ("lmcache", "lmcache-metrics", "prometheus"):
        assert "env_file" not in services[name], f"{name} is given the node's secrets"
    for name in engines:
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python3", "-c"] and test[3] == sidecars.ENGINE_WATCHDOG


@pytest.mark.parametrize("stack", STACKS)
def test_lmcache_api_on_loopback_and_its_metrics_gate_on_the_private_address(stack: str) -> None:
    services = _services(stack)
    cmd = services["lmcache"]["command"]
    assert cmd[cmd.index("--http-host") + 1] == "127.0.0.1"
    api_port = cmd[cmd.index("--http-port") + 1]
    zmq_host = cmd[cmd.index("--host") + 1]
    gate = services["lmcache-metrics"]["command"]
    assert gate[:3] == ["python3", "-c", sidecars.METRICS_GATE]
    host, port, upstream = gate[3:]
    assert host == zmq_host  # the node's private address: Prometheus scrapes it
    assert port != api_port and upstream == f"http://127.0.0.1:{api_port}"
    assert f"{host}:{port}" in _rendered(stack)["monitoring/prometheus.yml"]


async def _run(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


async def test_metrics_gate_serves_get_metrics_and_nothing_else() -> None:
    async with FakeEngine(name="lmc") as upstream:
        port = _free_port()
        cmd = sidecars.metrics_gate_command("127.0.0.1", port, upstream.url)
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
            assert status == 200 and "vllm:prompt_tokens_total" in text
            for path in ("/env", "/cache/clear", "/reconfigure/l1", "/metrics/reset", "/"):
                assert (await asyncio.to_thread(get, path))[0] == 404, path
            assert (await asyncio.to_thread(get, "/metrics/reset", "POST"))[0] == 501
            assert (await asyncio.to_thread(get, "/cache/clear", "POST"))[0] == 501
        finally:
            proc.terminate()
            await proc.wait()


async def test_engine_watchdog_fails_an_engine_that_holds_requests_without_progress(
    tmp_path: Path,
) -> None:
    state = str(tmp_path / "state.json")
    async with FakeEngine(name="d0", output_tokens=4) as engine:

        async def watchdog(wedge_s: float) -> tuple[int, str]:
            return await _run(
                sys.executable,
                "-c",
                sidecars.ENGINE_WATCHDOG,
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
        rc, out = await _run(sys.executable, "-c", sidecars.ENGINE_WATCHDOG,
                             f"http://127.0.0.1:{port}", "0.1", state, "decode-0", "m", "dry")
        assert rc == 1 and "wedged" not in out, out
        await asyncio.sleep(0.2)
