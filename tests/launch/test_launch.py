"""``pdstack launch`` with real processes: the planned commands run as stand-in programs
(tests/launch/fakesvc.py as ``vllm``, ``lmcache`` and ``pdstack`` on PATH; the LMCache
server's API shim, ``python3 -c ...``, imports ``tests/launch/fakemods``' ``lmcache`` and
``uvicorn``) that listen on the planned ports and check what must hold when they start."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdstack.launch import _alive, group_members, read_env_file
from pdstack.plan import make_plan
from pdstack.topology import load_topology

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FAKE = HERE / "fakesvc.py"
FAKEMODS = HERE / "fakemods"
SECRET = "hf_s3cr3t-VALUE-never-logged"
# the other secrets of the node's file, and one in launch's own environment (issue 38)
OTHER_SECRETS = {"PDSTACK_ADMIN_TOKEN": "adm-s3cr3t", "VLLM_API_KEY": "engine-s3cr3t"}
INHERITED = {"PDSTACK_API_KEYS": "client-s3cr3t"}


def free_block(n: int) -> int:
    """A base port such that base..base+n-1 are free on 127.0.0.1."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


@dataclass
class Stack:
    inv: Path
    logs: Path
    records: Path
    env: dict[str, str]
    ports: dict[str, int]

    def launch(self, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pdstack.cli", "launch", "-i", str(self.inv),
             "--log-dir", str(self.logs), *args],
            env={**self.env, **env}, capture_output=True, text=True, timeout=timeout,
            cwd=REPO,
        )

    def record(self, prog: str, port: int) -> dict:
        return json.loads((self.records / f"{prog}-{port}.json").read_text())

    def pids(self) -> dict[str, dict]:
        return {p.stem: json.loads(p.read_text()) for p in self.logs.glob("*.pid")}


def make_stack(tmp: Path, kv_mode: str, fake_proxy: bool = True) -> Stack:
    base = free_block(12)
    ports = {"proxy": base, "engine": base + 2, "nixl": base + 5, "zmq": base + 8,
             "lmhttp": base + 9}
    inv = tmp / "inv"
    (inv / "group_vars").mkdir(parents=True)
    roles = ("colocated", "colocated") if kv_mode == "colocated" else ("prefill", "decode")
    (inv / "hosts.yml").write_text(f"""
all:
  children:
    pdstack_nodes:
      hosts:
        n1:
          ansible_connection: local
          pdstack_private_address: 127.0.0.1
          pdstack_gpu_count: 2
          pdstack_host_memory_gb: 64
          pdstack_proxy: true
          pdstack_engines:
            - {{role: {roles[0]}, gpus: [0]}}
            - {{role: {roles[1]}, gpus: [1]}}
""")
    (inv / "group_vars" / "all.yml").write_text(f"""
pdstack_kv_mode: {kv_mode}
pdstack_engine_image: test/engine:1
pdstack_model: {{name: /models/m, served_name: m, max_model_len: 1024, load_format: dummy,
                skip_tokenizer_init: true}}
pdstack_ports: {{proxy: {ports['proxy']}, engine_http_base: {ports['engine']},
                nixl_side_channel_base: {ports['nixl']}, lmcache_zmq: {ports['zmq']},
                lmcache_http: {ports['lmhttp']}}}
""")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    progs = ["vllm", "lmcache"] + (["pdstack"] if fake_proxy else [])
    for prog in progs:
        exe = bin_dir / prog
        exe.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} {prog} \"$@\"\n")
        exe.chmod(0o755)
    records = tmp / "records"
    records.mkdir()
    secrets = tmp / "secrets.env"
    secrets.write_text(f"# secrets\nHF_TOKEN={SECRET}\n"
                       + "".join(f"{k}={v}\n" for k, v in OTHER_SECRETS.items()))
    secrets.chmod(0o600)
    path = f"{bin_dir}:{os.environ['PATH']}"
    if not fake_proxy:  # the real proxy: `pdstack` must not resolve to anything but it
        path = f"{bin_dir}:/usr/bin:/bin"
    env = {**os.environ, **INHERITED, "PATH": path, "FAKE_RECORD_DIR": str(records),
           "PYTHONPATH": f"{REPO}:{FAKEMODS}"}
    stack = Stack(inv=inv, logs=tmp / "logs", records=records, env=env, ports=ports)
    stack.env["PDSTACK_TEST_SECRETS"] = str(secrets)
    return stack


@pytest.fixture
def stacks(tmp_path: Path) -> Iterator[list[Stack]]:
    made: list[Stack] = []
    yield made
    for st in made:  # never leave processes behind, whatever the test did
        st.launch("stop", "--grace", "1")
        for rec in st.pids().values():
            for pid in group_members(rec["pgid"], rec["start_ticks"]):
                os.kill(pid, signal.SIGKILL)


def new_stack(stacks: list[Stack], tmp: Path, kv_mode: str, **kw: bool) -> Stack:
    st = make_stack(tmp, kv_mode, **kw)
    stacks.append(st)
    return st


def secrets_args(st: Stack) -> list[str]:
    return ["--secrets-env", st.env["PDSTACK_TEST_SECRETS"]]


# --------------------------------------------------------------------------- tests


def test_start_status_stop_shared_l1(stacks: list[Stack], tmp_path: Path) -> None:
    st = new_stack(stacks, tmp_path, "shared-l1")
    e0, e1, zmq = st.ports["engine"], st.ports["engine"] + 1, st.ports["zmq"]
    r = st.launch("start", *secrets_args(st))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all services healthy" in r.stdout

    lm, pre, dec = st.record("lmcache", zmq), st.record("vllm", e0), st.record("vllm", e1)
    proxy = st.record("pdstack", st.ports["proxy"])
    # order: LMCache listening before the engines started; engines healthy before the proxy
    assert pre["lmcache_up_at_start"] and dec["lmcache_up_at_start"]
    assert lm["listening_at"] <= min(pre["started_at"], dec["started_at"])
    assert all(proxy["backends_healthy_at_start"].values())
    # GPU ids from the plan; one process group (session) per service
    assert pre["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert dec["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    # the LMCache server takes KV over CUDA IPC: it sees every GPU of the node's engines
    assert lm["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert len({r["pgid"] for r in (lm, pre, dec, proxy)}) == 4
    assert all(r["pid"] == r["pgid"] == r["sid"] for r in (lm, pre, dec, proxy))
    # exactly the planned commands (program resolved on PATH), proxy reads our backends.json
    plan = make_plan(load_topology(st.inv))
    planned = {s.name: s for s in plan.nodes["n1"].services}
    assert pre["argv"] == planned["prefill-0"].command[1:]
    # LMCache: `lmcache server ...` with its HTTP API on a unix socket in the log folder
    # (0700), not on a TCP port (the plan's shim: pdstack.sidecars.lmcache_socket)
    assert lm["argv"] == planned["lmcache"].command[4:] and lm["argv"][0] == "server"
    assert lm["api"] == str(st.logs.resolve() / "lmcache-api" / "api.sock")
    assert lm["api_folder_mode"] == "0o700"
    api = socket.socket(socket.AF_UNIX)
    api.connect(lm["api"])
    api.close()
    backends = st.logs / "backends.json"
    assert proxy["argv"][proxy["argv"].index("--backends") + 1] == str(backends)
    assert json.loads(backends.read_text()) == json.loads(plan.backend_table.model_dump_json())
    assert proxy["backends"] == json.loads(plan.backend_table.model_dump_json())
    # each service got the secrets it reads and no other (the node's file and launch's own
    # environment alike), never in the logs or the output
    assert pre["hf_token_sha256"] == hashlib.sha256(SECRET.encode()).hexdigest()
    assert pre["secrets"] == dec["secrets"] == ["HF_TOKEN", "VLLM_API_KEY"]
    assert proxy["secrets"] == ["PDSTACK_ADMIN_TOKEN", "PDSTACK_API_KEYS", "VLLM_API_KEY"]
    assert lm["secrets"] == []
    for log in st.logs.glob("*.log"):
        for value in (SECRET, *OTHER_SECRETS.values(), *INHERITED.values()):
            assert value not in log.read_text()
    assert SECRET not in r.stdout + r.stderr
    # logs and pid files per service
    assert sorted(p.name for p in st.logs.glob("*.pid")) == [
        "decode-0.pid", "lmcache.pid", "prefill-0.pid", "proxy.pid"]
    assert "fake vllm listening" in (st.logs / "prefill-0.log").read_text()

    s = st.launch("status")
    assert s.returncode == 0, s.stdout + s.stderr
    assert s.stdout.count("running  healthy") == 4
    sj = json.loads(st.launch("status", "--json").stdout)
    assert {row["service"]: row["healthy"] for row in sj} == {
        "lmcache": True, "prefill-0": True, "decode-0": True, "proxy": True}

    everything = [r["pid"] for r in (lm, pre, dec, proxy)] + [pre["grandchild"], dec["grandchild"]]
    assert all(_alive(p) for p in everything)
    t = st.launch("stop")
    assert t.returncode == 0, t.stdout + t.stderr
    assert not [p for p in everything if _alive(p)], "a process (or grandchild) survived stop"
    assert not list(st.logs.glob("*.pid"))
    s2 = st.launch("status")
    assert s2.returncode == 1
    assert "stopped" in s2.stdout


def test_engines_start_in_parallel(stacks: list[Stack], tmp_path: Path) -> None:
    st = new_stack(stacks, tmp_path, "colocated")
    r = st.launch("start", FAKE_STARTUP_DELAY="1.5")
    assert r.returncode == 0, r.stdout + r.stderr
    a, b = st.record("vllm", st.ports["engine"]), st.record("vllm", st.ports["engine"] + 1)
    # each started before the other was listening: they overlapped, not one after the other
    assert a["started_at"] < b["listening_at"] and b["started_at"] < a["listening_at"]


def test_crash_while_starting_fails_fast_and_cleans_up(
    stacks: list[Stack], tmp_path: Path
) -> None:
    st = new_stack(stacks, tmp_path, "shared-l1")
    t0 = time.monotonic()
    r = st.launch("start", "--timeout", "120", FAKE_CRASH_PORT=str(st.ports["engine"] + 1))
    elapsed = time.monotonic() - t0
    assert r.returncode == 1
    assert elapsed < 30, f"a crash cost {elapsed:.0f} s of a 120 s timeout"
    assert "decode-0 exited with code 3" in r.stdout
    assert "boom: crashing on purpose" in r.stdout  # the log's last lines are shown
    # what this start began is stopped again: LMCache and the prefiller are gone
    lm, pre = st.record("lmcache", st.ports["zmq"]), st.record("vllm", st.ports["engine"])
    assert not _alive(lm["pid"]) and not _alive(pre["pid"]) and not _alive(pre["grandchild"])
    assert not (st.records / f"pdstack-{st.ports['proxy']}.json").exists(), "proxy started"
    assert not list(st.logs.glob("*.pid"))


def test_never_healthy_times_out(stacks: list[Stack], tmp_path: Path) -> None:
    st = new_stack(stacks, tmp_path, "colocated")
    t0 = time.monotonic()
    r = st.launch("start", "--timeout", "2", FAKE_UNHEALTHY_PORT=str(st.ports["engine"]))
    assert r.returncode == 1
    assert time.monotonic() - t0 < 20
    assert "engine-0 not healthy after 2 s" in r.stdout
    rec = st.record("vllm", st.ports["engine"])
    assert not _alive(rec["pid"])


def test_keep_on_failure_leaves_services(stacks: list[Stack], tmp_path: Path) -> None:
    st = new_stack(stacks, tmp_path, "colocated")
    r = st.launch("start", "--timeout", "2", "--keep-on-failure",
                  FAKE_UNHEALTHY_PORT=str(st.ports["engine"]))
    assert r.returncode == 1
    rec = st.record("vllm", st.ports["engine"])
    assert _alive(rec["pid"])
    assert st.launch("stop", "--grace", "2").returncode == 0
    assert not _alive(rec["pid"])


def test_stop_escalates_to_sigkill(stacks: list[Stack], tmp_path: Path) -> None:
    st = new_stack(stacks, tmp_path, "colocated")
    e0 = st.ports["engine"]
    assert st.launch("start", FAKE_IGNORE_TERM_PORT=str(e0)).returncode == 0
    rec = st.record("vllm", e0)
    t0 = time.monotonic()
    r = st.launch("stop", "--grace", "1.5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "engine-0 still running after 2 s: SIGKILL" in r.stdout
    assert time.monotonic() - t0 >= 1.5
    assert not _alive(rec["pid"]) and not _alive(rec["grandchild"])


def test_env_overrides_and_nixl_env(stacks: list[Stack], tmp_path: Path) -> None:
    st = new_stack(stacks, tmp_path, "nixl")
    r = st.launch("start", "--env", "VLLM_NO_USAGE_STATS=", "--env", "FAKE_EXTRA=x=1")
    assert r.returncode == 0, r.stdout + r.stderr
    pre = st.record("vllm", st.ports["engine"])
    assert pre["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(st.ports["nixl"])
    # the plan sets it; `--env VLLM_NO_USAGE_STATS=` unset it
    assert pre["env"]["VLLM_NO_USAGE_STATS"] is None
    assert pre["env"]["FAKE_EXTRA"] == "x=1"
    # an engine finds pdstack's vLLM plugin first on its path (pdstack.vllm_offload_fix)
    plugins = st.logs.resolve() / "vllm-plugins"
    assert pre["env"]["PYTHONPATH"] == f"{plugins}:{st.env['PYTHONPATH']}"
    assert (plugins / "pdstack_offload_fix-0.dist-info" / "entry_points.txt").is_file()
    st.launch("stop")
    r2 = st.launch("start")
    assert r2.returncode == 0
    assert st.record("vllm", st.ports["engine"])["env"]["VLLM_NO_USAGE_STATS"] == "1"


def test_subset_restart_and_already_running(stacks: list[Stack], tmp_path: Path) -> None:
    st = new_stack(stacks, tmp_path, "colocated")
    assert st.launch("start").returncode == 0
    before = st.pids()
    again = st.launch("start")
    assert again.returncode == 0
    assert again.stdout.count("already running and healthy") == 3
    assert st.pids() == before
    r = st.launch("stop", "--services", "proxy")
    assert r.returncode == 0
    assert not _alive(before["proxy"]["pid"])
    assert _alive(before["engine-0"]["pid"]) and _alive(before["engine-1"]["pid"])
    r = st.launch("start", "--services", "proxy")
    assert r.returncode == 0, r.stdout + r.stderr
    after = st.pids()
    assert after["proxy"]["pid"] != before["proxy"]["pid"]
    assert after["engine-0"] == before["engine-0"]


def test_missing_program_starts_nothing(stacks: list[Stack], tmp_path: Path) -> None:
    st = new_stack(stacks, tmp_path, "shared-l1")
    (tmp_path / "bin" / "lmcache").unlink()
    st.env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"
    r = st.launch("start")
    assert r.returncode == 1
    assert "'lmcache' not found on PATH; nothing started" in r.stderr
    assert not list(st.records.iterdir())
    assert not st.logs.exists() or not list(st.logs.glob("*.pid"))


def test_bad_arguments_exit_2(stacks: list[Stack], tmp_path: Path) -> None:
    st = new_stack(stacks, tmp_path, "colocated")
    r = st.launch("start", "--node", "nope")
    assert r.returncode == 2 and "no node 'nope'" in r.stderr
    r = st.launch("start", "--services", "engine-0,decode-7")
    assert r.returncode == 2 and "no service decode-7" in r.stderr
    r = st.launch("start", "--env", "NOEQUALS")
    assert r.returncode == 2 and "KEY=VALUE" in r.stderr


def test_real_proxy_behind_launch(stacks: list[Stack], tmp_path: Path) -> None:
    """The real ``pdstack proxy`` (this interpreter's ``-m pdstack.cli`` when no console
    script is on PATH) reads the backends.json launch wrote and reports healthy."""
    st = new_stack(stacks, tmp_path, "nixl", fake_proxy=False)
    r = st.launch("start")
    assert r.returncode == 0, r.stdout + r.stderr + (st.logs / "proxy.log").read_text()
    with socket.create_connection(("127.0.0.1", st.ports["proxy"]), 2):
        pass
    import urllib.request

    url = f"http://127.0.0.1:{st.ports['proxy']}/health"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body == {"status": "ok"}  # every backend healthy; no names without the admin token
    assert "-m pdstack.cli proxy --backends" in (st.logs / "proxy.log").read_text()


def test_read_env_file(tmp_path: Path) -> None:
    f = tmp_path / "s.env"
    f.write_text("# c\nA=1\nexport B='two words'\n\nC=\"x=y\"\nbad line\n")
    assert read_env_file(f) == {"A": "1", "B": "two words", "C": "x=y"}
    assert read_env_file(tmp_path / "missing") == {}


# --------------------------------------------------------------------------- --foreground


class Foreground:
    """``pdstack launch start --foreground`` running in the background of a test, its output
    collected line by line; ``with`` waits until every service is healthy and ends it
    (SIGTERM) after, its exit code in ``rc``."""

    def __init__(self, st: Stack, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdstack.cli", "launch", "-i", str(st.inv), "--log-dir",
             str(st.logs), "start", "--foreground", *args],
            env=st.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        )
        self.lines: list[str] = []
        self.rc: int | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None or any(text in ln for ln in self.lines), (
                f"launch exited {self.proc.returncode} before {text!r}:\n{self.output}")
            assert time.monotonic() < deadline, f"no {text!r} in {timeout} s:\n{self.output}"
            time.sleep(0.1)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def end(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.rc = self.proc.wait(timeout)
        self._reader.join(5)
        return self.rc

    def __enter__(self) -> Foreground:
        try:
            self.wait_for("all services healthy", 60)
        except BaseException:
            self.end()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_healthy_again(st: Stack, service: str, port: int, old_pid: int,
                       timeout: float = 20) -> int:
    """The new pid of ``service`` once it runs again (another pid) and answers /health."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = st.pids().get(service)
        if rec and rec["pid"] != old_pid and healthy(port):
            return int(rec["pid"])
        time.sleep(0.2)
    raise AssertionError(f"{service} not running again with a new pid in {timeout} s")


def test_foreground_restarts_a_dead_engine_and_leaves_the_rest(
    stacks: list[Stack], tmp_path: Path
) -> None:
    st = new_stack(stacks, tmp_path, "colocated")
    with Foreground(st, "--wedge-s", "30") as fg:
        before = st.pids()
        e0 = before["engine-0"]
        os.killpg(e0["pgid"], signal.SIGKILL)  # the engine and its grandchild, as an OOM kill
        fg.wait_for("engine-0 died (exit code -9)", 15)
        fg.wait_for("restarting engine-0 in 1 s (restart 1)", 5)
        new_pid = wait_healthy_again(st, "engine-0", st.ports["engine"], e0["pid"])
        assert "started engine-0 again" in fg.output
        after = st.pids()
        assert after["engine-1"] == before["engine-1"] and after["proxy"] == before["proxy"]
        assert healthy(st.ports["proxy"])
        # killed again at once: the second delay doubles
        os.killpg(after["engine-0"]["pgid"], signal.SIGKILL)
        fg.wait_for("restarting engine-0 in 2 s (restart 2)", 15)
        wait_healthy_again(st, "engine-0", st.ports["engine"], new_pid)
    assert fg.rc == 0, fg.output
    assert "stopping" in fg.output
    assert not list(st.logs.glob("*.pid")), "a SIGTERM to launch stops every service"
    for rec in before.values():
        assert not group_members(rec["pgid"], rec["start_ticks"])


def test_foreground_restarts_a_wedged_engine(stacks: list[Stack], tmp_path: Path) -> None:
    """An engine whose /health hangs once it had answered (vLLM after its EngineCore died:
    results/h200x1-tenants run 3) is killed and started again after --wedge-s; the same
    watchdog as the Compose healthcheck decides."""
    st = new_stack(stacks, tmp_path, "colocated")
    with Foreground(st, "--wedge-s", "1.5") as fg:
        before = st.pids()
        e0 = before["engine-0"]
        time.sleep(2)  # the watchdog has seen it answer (it checks every 0.75 s)
        (st.records / f"hang-{e0['pid']}").touch()
        t0 = time.monotonic()
        fg.wait_for("engine-0 wedged: /health or /metrics failing for", 40)
        took = time.monotonic() - t0
        # the budget, plus a check's own 2 s /health timeout and its interval, twice
        assert 1.5 <= took < 30, f"wedge found after {took:.1f} s (budget 1.5 s + checks)"
        fg.wait_for(f"killing its process group {e0['pgid']}", 5)
        wait_healthy_again(st, "engine-0", st.ports["engine"], e0["pid"])
        assert not _alive(e0["pid"]) and not group_members(e0["pgid"], e0["start_ticks"])
        after = st.pids()
        assert after["engine-1"] == before["engine-1"] and after["proxy"] == before["proxy"]
        assert "engine-1 wedged" not in fg.output
    assert fg.rc == 0, fg.output


def test_foreground_restart_no_stops_everything(stacks: list[Stack], tmp_path: Path) -> None:
    st = new_stack(stacks, tmp_path, "colocated")
    with Foreground(st, "--restart", "no") as fg:
        before = st.pids()
        os.killpg(before["engine-1"]["pgid"], signal.SIGKILL)
        fg.proc.wait(30)
    assert fg.rc == 1, fg.output
    assert "engine-1 died" in fg.output and "restarting" not in fg.output
    assert not _alive(before["engine-0"]["pid"]) and not _alive(before["proxy"]["pid"])


def test_foreground_bad_wedge_seconds_exit_2(stacks: list[Stack], tmp_path: Path) -> None:
    st = new_stack(stacks, tmp_path, "colocated")
    r = st.launch("start", "--foreground", "--wedge-s", "0")
    assert r.returncode == 2
    assert "--wedge-s" in r.stderr and "argument --wedge-s: must be > 0 seconds, got 0" in r.stderr
    assert not list(st.records.glob("*.json")), "nothing may start on bad input"
