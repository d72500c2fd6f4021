"""LMCache's data port (ZMQ: STORE, RETRIEVE, CLEAR ... no credentials) is a unix socket in the
Compose stacks, in a volume only the LMCache server and the node's engines mount: no TCP port
that another container or process of the node could reach (issue 54).

Light: the rendered stacks' placement, the engines' endpoint rewrite, and the shim's bind
redirect (with stand-in ``zmq``/``lmcache``/``uvicorn`` modules). ``vllm``: the real LMCache
server through the shim listens on no TCP port, and a real vLLM engine stores and reads its
KV through the socket."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdstack import sidecars, vllm_offload_fix
from pdstack.render import render_all

ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = os.path.dirname(sidecars.LMCACHE_DATA_SOCKET)


def _mounts(spec: dict[str, Any]) -> list[str]:
    return [str(v).split(":", 1)[0] for v in spec.get("volumes") or []]


def _lmcache_hosts(command: list[str]) -> list[str]:
    if "--kv-transfer-config" not in command:
        return []
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            extra = node.get("kv_connector_extra_config") or {}
            if isinstance(extra, dict) and "lmcache.mp.host" in extra:
                found.append(extra["lmcache.mp.host"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(command[command.index("--kv-transfer-config") + 1]))
    return found


def _stacks() -> list[tuple[str, dict[str, Any]]]:
    """Every node stack of every inventory that runs an LMCache server, rendered now."""
    from pdstack.plan import make_plan
    from pdstack.topology import load_topology

    out = []
    for inv in sorted(p for p in (ROOT / "inventory").iterdir() if p.is_dir()):
        try:
            topo = load_topology(inv)
            rendered = render_all(topo, make_plan(topo))
        except Exception:  # an inventory for another test (invalid on purpose): not a stack
            continue
        for node, files in rendered.items():
            compose = yaml.safe_load(files["compose.yaml"])
            if "lmcache" in compose["services"]:
                out.append((f"{inv.name}/{node}", compose))
    return out


def test_rendered_lmcache_data_port_is_a_socket_only_engines_mount() -> None:
    stacks = _stacks()
    assert any(name.startswith("local-cpu/") for name, _ in stacks), [n for n, _ in stacks]
    for name, compose in stacks:
        services = compose["services"]
        lm = services["lmcache"]
        port = lm["command"][lm["command"].index("--port") + 1]
        assert lm["command"][:3] == ["python3", "-m", sidecars.LMCACHE_SOCKET], name
        assert lm["environment"][sidecars.LMCACHE_DATA_ENV] == sidecars.LMCACHE_DATA_SOCKET
        assert "ports" not in lm and "lmcache-data" in _mounts(lm), name
        health = " ".join(lm["healthcheck"]["test"])
        assert "AF_UNIX" in health and f"{sidecars.LMCACHE_DATA_SOCKET}:{port}" in health, name
        assert "lmcache-data" in compose["volumes"], name
        users = set()
        for svc, spec in services.items():
            hosts = _lmcache_hosts([str(a) for a in spec.get("command") or []])
            # every engine that uses the tier reaches it through the socket, none over TCP
            assert all(h == f"ipc://{sidecars.LMCACHE_DATA_SOCKET}" for h in hosts), (name, svc)
            # YAML merge keys (<<: *engine) are resolved by safe_load
            if "lmcache-data" in _mounts(spec):
                users.add(svc)
                assert svc == "lmcache" or "vllm" in " ".join(spec.get("command") or []), (
                    f"{name}: {svc} mounts LMCache's data socket")
            if hosts:
                assert "lmcache-data" in _mounts(spec), (name, svc)
        assert {"lmcache-metrics", "proxy", "prometheus", "grafana"}.isdisjoint(users), name
        # and the committed render says the same (compose/cpu is local-cpu's)
    committed = yaml.safe_load((ROOT / "compose" / "cpu" / "compose.yaml").read_text())
    assert committed["services"]["lmcache"]["environment"][sidecars.LMCACHE_DATA_ENV] \
        == sidecars.LMCACHE_DATA_SOCKET


def test_engine_endpoint_rewrite_reaches_nested_connectors() -> None:
    lmc = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"lmcache.mp.host": "tcp://10.0.0.1",
                                         "lmcache.mp.port": 6000}}
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"connectors": [
                 {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, lmc]}}
    for config in (lmc, multi):
        cmd = ["vllm", "serve", "m", "--kv-transfer-config", json.dumps(config), "--port", "1"]
        out = sidecars.engine_on_data_socket(cmd, "/s/mp.sock")
        assert out[:4] == cmd[:4] and out[5:] == cmd[5:]
        assert _lmcache_hosts(out) == ["ipc:///s/mp.sock"]
        assert json.loads(out[4]) != config and json.loads(cmd[4]) == config  # a copy
    nixl = ["vllm", "--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector"})]
    assert sidecars.engine_on_data_socket(nixl) == nixl
    assert sidecars.engine_on_data_socket(["vllm", "serve"]) == ["vllm", "serve"]
    assert sidecars.lmcache_data_endpoint(6000, "/s/mp.sock") == "ipc:///s/mp.sock:6000"


FAKE_ZMQ = '''
import json, os
class Socket:
    def bind(self, addr):
        with open(os.environ["FAKE_BINDS"], "a") as f:
            f.write(addr + "\\n")
'''
FAKE_LMCACHE_MAIN = '''
import sys, uvicorn, zmq
def main():
    uvicorn.Config(app=None, host="127.0.0.1", port=8080)
    args = sys.argv[1:]
    host, port = args[args.index("--host") + 1], args[args.index("--port") + 1]
    zmq.Socket().bind("tcp://%s:%s" % (host, port))  # the data port
    zmq.Socket().bind("tcp://%s:%d" % (host, int(port) + 1))  # anything else: left alone
    return 0
'''


def _fake_modules(root: Path) -> Path:
    (root / "lmcache" / "cli").mkdir(parents=True)
    (root / "lmcache" / "__init__.py").write_text("")
    (root / "lmcache" / "cli" / "__init__.py").write_text("")
    (root / "lmcache" / "cli" / "main.py").write_text(FAKE_LMCACHE_MAIN)
    (root / "zmq.py").write_text(FAKE_ZMQ)
    (root / "uvicorn.py").write_text(
        "class Config:\n    def __init__(self, app=None, host='', port=0, uds=None, **kw):\n"
        "        self.uds = uds\n")
    return root


@pytest.mark.parametrize("with_socket", [True, False])
def test_shim_binds_the_data_port_on_the_socket(tmp_path: Path, with_socket: bool) -> None:
    mods = _fake_modules(tmp_path / "mods")
    binds = tmp_path / "binds.txt"
    data = tmp_path / "data" / "mp.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env |= {"PYTHONPATH": str(mods), "FAKE_BINDS": str(binds)}
    if with_socket:
        env[sidecars.LMCACHE_DATA_ENV] = str(data)
    cmd = sidecars.lmcache_on_socket_command(str(tmp_path / "api" / "api.sock"),
                                             ["server", "--host", "10.0.0.5", "--port", "6000"])
    run = subprocess.run([sys.executable, *cmd[1:]], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    got = binds.read_text().split()
    if with_socket:  # Compose: the data port on the socket, its folder 0700
        assert got == [f"ipc://{data}:6000", "tcp://10.0.0.5:6001"]
        assert stat.S_IMODE(data.parent.stat().st_mode) == 0o700
    else:  # pdstack launch (no socket named): TCP as before
        assert got == ["tcp://10.0.0.5:6000", "tcp://10.0.0.5:6001"]


@pytest.mark.vllm
def test_real_lmcache_on_the_socket_serves_an_engine_and_no_tcp(tmp_path: Path) -> None:
    from pdstack.testing import vllm_engines as ve
    from pdstack.testing.heavy import heavy_lock

    ve.require_venv()
    run = Path("/tmp") / f"pdstack-lmc-{os.getpid()}"  # short: a socket path has <= 107 bytes
    data = run / "data" / "mp.sock"
    zport, eport = ve.free_port(), ve.free_port()
    server = ["server", "--host", "127.0.0.1", "--port", str(zport), "--l1-size-gb", "1",
              "--eviction-policy", "LRU", "--chunk-size", "256",
              "--supported-transfer-mode", "engine_driven"]
    cmd = sidecars.lmcache_on_socket_command(str(run / "api" / "api.sock"), server)
    # LMCache's Python finds pdstack.sidecars where `pdstack launch` puts it
    env = ve.base_env("nobind") | {sidecars.LMCACHE_DATA_ENV: str(data),
                                   "PYTHONPATH": str(vllm_offload_fix.plugin_path(run))}
    with heavy_lock():
        lm = ve.spawn("lmcache-data-socket", [str(ve.VENV / "bin" / "python"), *cmd[1:]], env)
        try:
            path = Path(f"{data}:{zport}")
            deadline = time.monotonic() + 180
            while not path.exists():
                assert lm.popen.poll() is None and time.monotonic() < deadline, lm.tail()
                time.sleep(0.5)
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            with socket.socket() as s:  # the data port: no TCP listener at all
                assert s.connect_ex(("127.0.0.1", zport)) != 0
            ktc = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                 "lmcache.mp.port": zport}}
            ecmd = sidecars.engine_on_data_socket(
                ["--kv-transfer-config", json.dumps(ktc)], str(data))
            eng = ve.start_engine("engine-data-socket", eport, "0", json.loads(ecmd[1]))
            try:
                ve.wait_ready([eng])
                body = json.dumps({"model": ve.SERVED_NAME, "prompt": ve.prompt_of(400, 3),
                                   "max_tokens": 4}).encode()
                req = urllib.request.Request(eng.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as resp:
                    assert resp.status == 200
                deadline = time.monotonic() + 30
                while "Stored " not in lm.log.read_text(errors="replace"):
                    assert time.monotonic() < deadline, lm.tail()
                    time.sleep(0.5)
            finally:
                eng.stop()
        finally:
            lm.stop()
