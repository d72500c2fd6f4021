"""scripts/pdstack_probe.py: its JSON, run as the nodes run it (a separate python3 process),
against real sockets on the loopback interface."""

from __future__ import annotations

import ast
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pfhelpers import validate_def

from pdstack.testing.ports import free_port

PROBE = Path(__file__).resolve().parents[2] / "scripts" / "pdstack_probe.py"
# the interpreter a fresh Debian host has; the project venv's as a fallback
PY = "/usr/bin/python3" if Path("/usr/bin/python3").is_file() else sys.executable


def probe(*args: str, stdin: str | None = None, timeout: float = 30) -> tuple[int, str]:
    proc = subprocess.run([PY, str(PROBE), *args], capture_output=True, text=True,
                          input=stdin, timeout=timeout)
    return proc.returncode, proc.stdout


def test_probe_is_stdlib_only_and_python39_syntax() -> None:
    tree = ast.parse(PROBE.read_text(), feature_version=(3, 9))
    stdlib = set(sys.stdlib_module_names)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported - {"__future__"} <= stdlib, imported - stdlib
    # no runtime use of 3.10+ only syntax such as match statements or X | Y outside annotations
    assert not any(isinstance(n, ast.Match) for n in ast.walk(tree))


def test_listen_connect_throughput_json() -> None:
    port, closed = free_port(), free_port()
    listener = subprocess.Popen(
        [PY, str(PROBE), "listen", "--bind", f"127.0.0.1:{port}", "--seconds", "20",
         "--exit-on-stdin-eof"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None and listener.stdin is not None
        ready = json.loads(listener.stdout.readline())
        validate_def("probe_listen_event", ready)
        assert ready["event"] == "ready"
        assert ready["binds"] == [{"address": "127.0.0.1", "port": port, "status": "listening"}]

        rc, out = probe("connect", f"127.0.0.1:{port}", f"127.0.0.1:{closed}", "--timeout", "2")
        res = json.loads(out)["connect"]
        for r in res:
            validate_def("probe_connect", r)
        assert rc == 1  # one target failed
        assert res[0]["status"] == "ok" and res[0]["listener"] == "probe"
        assert 0 <= res[0]["rtt_ms"] < 2000
        assert res[1]["status"] == "refused"

        rc, out = probe("throughput", f"127.0.0.1:{port}", "--seconds", "0.3")
        tput = json.loads(out)
        assert rc == 0, tput
        assert tput["status"] == "ok"
        assert tput["bytes_sent"] == tput["bytes_received"] > 0
        assert tput["mbit_per_s"] > 0

        # a second listener on the same port reports in_use instead of failing
        rc, out = probe("listen", "--bind", f"127.0.0.1:{port}", "--seconds", "0.1")
        lines = [json.loads(line) for line in out.splitlines()]
        assert lines[0]["binds"][0]["status"] == "in_use"
        assert lines[-1] == {"event": "done", "reason": "nothing bound", "accepted": {},
                             "peers": {}}

        t0 = time.monotonic()
        listener.stdin.close()  # EOF on stdin stops the listener at once
        done = json.loads(listener.stdout.readline())
        assert time.monotonic() - t0 < 2
        validate_def("probe_listen_event", done)
        assert done["reason"] == "stdin closed"
        assert done["accepted"][f"127.0.0.1:{port}"] == 2  # connect + throughput
        assert done["peers"][f"127.0.0.1:{port}"] == ["127.0.0.1"]
        assert listener.wait(5) == 0
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait()


def test_connect_timeout_is_bounded() -> None:
    # a listening socket whose backlog is full never completes another handshake;
    # 127.0.0.1 only, so nothing leaves the machine
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fillers.append(c)
        time.sleep(0.2)
        t0 = time.monotonic()
        rc, out = probe("connect", f"127.0.0.1:{port}", "--timeout", "1")
        assert rc == 1
        elapsed = time.monotonic() - t0
        r = json.loads(out)["connect"][0]
        validate_def("probe_connect", r)
        assert r["status"] == "timeout", r
        assert 900 <= r["elapsed_ms"] <= 1500
        assert elapsed < 5
    finally:
        for c in fillers:
            c.close()
        srv.close()


def test_ping_df_json() -> None:
    if shutil.which("ping") is None:
        pytest.fail("ping not found: apt-get install iputils-ping", pytrace=False)
    rc, out = probe("ping", "127.0.0.1", "--size", "1472", "--timeout", "1")
    r = json.loads(out)
    validate_def("probe_ping", r)
    assert rc == 0 and r["status"] == "ok" and r["packet_bytes"] == 1500 and r["method"] == "ping"


def test_batch_runs_in_parallel_within_timeout() -> None:
    closed = free_port()
    spec = {
        "timeout": 1.0,
        "connect": [{"id": f"c{i}", "host": "127.0.0.1", "port": closed} for i in range(20)],
        "ping": [{"id": "p", "host": "127.0.0.1", "size": 56}],
    }
    t0 = time.monotonic()
    rc, out = probe("batch", stdin=json.dumps(spec))
    assert time.monotonic() - t0 < 5
    doc = json.loads(out)
    validate_def("probe_batch", doc)
    assert rc == 0
    assert [c["id"] for c in doc["connect"]] == [f"c{i}" for i in range(20)]
    assert {c["status"] for c in doc["connect"]} == {"refused"}
    assert doc["ping"][0]["status"] == "ok"


def test_info_and_facts_json() -> None:
    rc, out = probe("info")
    info = json.loads(out)
    validate_def("probe_info", info)
    assert rc == 0
    lo = next(i for i in info["interfaces"]["interfaces"] if i["name"] == "lo")
    assert {"family": "inet", "address": "127.0.0.1", "prefixlen": 8} in lo["addresses"]
    assert info["resources"]["memory"]["total_bytes"] > 0
    assert info["resources"]["disk"][0]["path"] == "/"
    assert info["gpu"]["present"] is (shutil.which("nvidia-smi") is not None)
    assert isinstance(info["rdma"]["present"], bool)

    rc, out = probe("free-ports", "--address", "127.0.0.1", "--start", "40000",
                    "--end", "40100", "--count", "3")
    fp = json.loads(out)
    assert len(fp["free"]) == 3 and all(40000 <= p <= 40100 for p in fp["free"])
    for p in fp["free"]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # really free

    rc, out = probe("resources", "--path", "/", "--path", "/nonexistent-pdstack")
    res = json.loads(out)
    assert "error" in res["disk"][1]


def test_sysfs_fallback_without_ip(tmp_path: Path) -> None:
    """Hosts without iproute2: interfaces come from /sys/class/net + ioctl."""
    env_path = tmp_path / "bin"
    env_path.mkdir()
    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('p', {str(PROBE)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(json.dumps(m.interfaces_sysfs()))\n"
    )
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": str(env_path)}).stdout
    ifaces = json.loads(out)
    lo = next(i for i in ifaces if i["name"] == "lo")
    assert lo["mtu"] == 65536
    assert {"family": "inet", "address": "127.0.0.1", "prefixlen": 8} in lo["addresses"]
    assert any(a["address"] == "::1" for a in lo["addresses"])


def test_bad_arguments_exit_2() -> None:
    rc, _ = probe("connect", "no-port-here")
    assert rc == 2
