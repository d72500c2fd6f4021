"""Test support (not a test double): real vLLM CPU engines and an LMCache MP server
for the `vllm` tests.

Everything runs from the venv that `.ci/install-vllm-venv.sh` builds; a missing venv is
a test failure (never a skip). Heavy runs hold the heavy-run lock (`pdstack.testing.heavy`)
so they never overlap another heavy job on this 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdstack.plan import NUMA_SYSFS_MASK
from pdstack.plan_engine import CPU_ENGINE_ONE_PROCESS_ARGS, CPU_ENGINE_ONE_PROCESS_ENV
from pdstack.testing.heavy import heavy_lock
from pdstack.testing.ports import free_port as free_port  # ve.free_port, re-exported

REPO = Path(__file__).resolve().parents[2]  # the checkout (editable install)
VENV = Path(os.environ.get("PDSTACK_VLLM_VENV", REPO / ".venv-vllm"))
MODEL_DIR = REPO / "build" / "models" / "tiny-llama-s1"
LOG_DIR = REPO / "build" / "vllm-test-logs"
KV_BYTES = "268435456"
SERVED_NAME = "tiny"


def require_venv() -> None:
    stamp = VENV / ".pdstack-vllm-venv"
    if not (VENV / "bin" / "vllm").exists() or not stamp.exists():
        import pytest

        pytest.fail(f"vLLM venv {VENV} is missing or incomplete: run .ci/install-vllm-venv.sh")


def ensure_model() -> Path:
    if not (MODEL_DIR / "model.safetensors").exists():
        subprocess.run(
            [
                str(VENV / "bin" / "python"),
                str(REPO / "images/engine-cpu/make_tiny_model.py"),
                "--out",
                str(MODEL_DIR),
                "--seed",
                "1",
                "--arch",
                "llama",
            ],
            check=True,
        )
    return MODEL_DIR


def base_env(cpu: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(
        {
            "VLLM_CPU_OMP_THREADS_BIND": cpu,
            "VLLM_CACHE_ROOT": str(VENV / "vllm-cache"),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "NIXL_PTHR_DELAY_US": "1000",
            "LMCACHE_TRACK_USAGE": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    url: str = ""

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)  # our own process group only
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


def spawn(name: str, cmd: list[str], env: dict[str, str]) -> Proc:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{name}.log"
    handle = open(log, "w")  # noqa: SIM115 - the child owns it
    popen = subprocess.Popen(
        cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
    )
    return Proc(name, popen, log)


def start_engine(
    name: str,
    port: int,
    cpu: str,
    kv_transfer_config: dict[str, Any] | None,
    extra_env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
) -> Proc:
    """One host-native vLLM CPU engine, as the stacks' CPU engines run (one process fewer:
    pdstack.plan_engine.CPU_ENGINE_ONE_PROCESS_ARGS), eager: no torch.compile (it took ~18 s of each
    engine's start here, inductor on 2 cores, every start in CI with its fresh compile
    cache; the stacks' engines run eager too: their image has no compiler)."""
    cmd = [
        str(VENV / "bin" / "vllm"),
        "serve",
        str(ensure_model()),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        KV_BYTES,
        "--seed",
        "0",
        "--enforce-eager",
        *CPU_ENGINE_ONE_PROCESS_ARGS,
    ]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    cmd += extra_args or []
    env = base_env(cpu) | CPU_ENGINE_ONE_PROCESS_ENV | (extra_env or {})  # as the stacks' run
    if "VLLM_NIXL_SIDE_CHANNEL_PORT" in env:  # the planner's rule for CPU engines
        cmd = numa_hidden(cmd)
    # the whole engine (API server, engine core, worker) on its cores, as a container's
    # cpuset would hold it: vLLM binds only the worker's compute threads, and its API server
    # on the other core took the test client's and the proxy's core: under a tenant flood
    # that, not the proxy's queue, set tenant B's TTFT (P99 2.4-5.8x alone; pinned 1.1-1.6x)
    if not re.fullmatch(r"[0-9,-]+", cpu):
        raise ValueError(f"start_engine {name}: cpu must be a core list (0, 0-1, 0,1), not {cpu!r}")
    cmd = ["taskset", "-c", cpu, *cmd]
    proc = spawn(name, cmd, env)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def start_nixl_engine(
    name: str,
    cpu: str,
    kv_role: str,
    extra_env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
) -> Proc:
    """One engine of a NIXL P/D pair on CPU buffers (``kv_role``: kv_producer, kv_consumer),
    its side channel on a free port of its own."""
    side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    config = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
    return start_engine(name, free_port(), cpu, config, side | (extra_env or {}), extra_args)


@contextlib.contextmanager
def running(starts: Iterable[Proc]) -> Iterator[list[Proc]]:
    """The engines ``starts`` starts, all ready, under the heavy-run lock; each stopped after,
    the last started first, also when one fails to start or to become ready. ``starts`` is
    read here, inside the lock, one engine at a time (a generator: each start picks its free
    ports just before it starts)."""
    require_venv()
    with heavy_lock():
        procs: list[Proc] = []
        try:
            for proc in starts:
                procs.append(proc)
            wait_ready(procs)
            yield procs
        finally:
            for proc in reversed(procs):
                proc.stop()


def numa_hidden(cmd: list[str]) -> list[str]:
    """``cmd`` in its own mount namespace with an empty read-only tmpfs over the NUMA sysfs
    directory, as the stacks' CPU NIXL engines run (``pdstack.plan.NUMA_SYSFS_MASK``):
    otherwise vLLM's NIXL connector moves the engine's main thread, its one compute thread
    here, off the core it is bound to onto the machine's last core (all of them on core 1,
    beside the test's client and proxy). Needs root (CI runs as root: the lab needs it)."""
    if os.geteuid() != 0:
        raise RuntimeError("a NIXL test engine needs root: it hides the NUMA sysfs directory "
                           "in its own mount namespace (unshare --mount)")
    path, options = NUMA_SYSFS_MASK.split(":", 1)
    script = f'mount -t tmpfs -o {options} pdstack-numa-mask {path} && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "numa-mask",
            *cmd]


def start_lmcache(zmq_port: int, http_port: int) -> Proc:
    cmd = [
        str(VENV / "bin" / "lmcache"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(zmq_port),
        "--l1-size-gb",
        "1",
        "--eviction-policy",
        "LRU",
        "--chunk-size",
        "256",
        "--supported-transfer-mode",
        "engine_driven",
        "--http-port",
        str(http_port),
    ]
    proc = spawn("lmcache", cmd, base_env("nobind"))
    proc.url = f"http://127.0.0.1:{http_port}"
    return proc


# Lines in an engine's log after which it never becomes ready although its API process
# lives on (a background thread died): waiting out the budget would only cost minutes.
FATAL_LOG_MARKS = ("Address already in use", "Exception in thread", "Traceback (most recent")

# An engine on a 2-core machine is ready in 30-75 s (CI logs: "cold start 74s"); the budget
# leaves room for a loaded machine, not for a wedged start.
READY_BUDGET_S = 300.0


def _fatal_line(proc: Proc) -> str | None:
    try:
        text = proc.log.read_text(errors="replace")
    except OSError:
        return None
    return next((mark for mark in FATAL_LOG_MARKS if mark in text), None)


def wait_ready(procs: list[Proc], path: str = "/health", timeout: float = READY_BUDGET_S) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for proc in list(pending):
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
            try:
                with urllib.request.urlopen(proc.url + path, timeout=2) as resp:
                    if resp.status == 200:
                        pending.remove(proc)
                        continue
            except OSError:
                pass
            mark = _fatal_line(proc)
            if mark is not None:
                raise RuntimeError(f"{proc.name} will not become ready ({mark!r} in its log):\n"
                                   f"{proc.tail()}")
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise TimeoutError(f"{names} not ready after {timeout}s:\n{pending[0].tail()}")
        time.sleep(1)


def wait_port(proc: Proc, port: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{proc.name} did not open port {port}:\n{proc.tail()}")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


_VOCAB_TEXT = (
    "the of and to in is that for it as was with be by on not this are or from at "
    "which have an they you were her she there one all we their can has more when "
    "will would if so what up out about who them some into time only other could "
    "prefill decode cache token model server request stream node engine memory block "
    "layer vector tensor prefix shared store transfer kernel batch queue proxy"
)
_VOCAB = _VOCAB_TEXT.split()


def prompt_of(words: int, seed: int) -> str:
    """Deterministic English-ish text (about 1.2 tokens per word for the tiny BPE)."""
    state = seed * 7919 + 17
    out = []
    for _ in range(words):
        state = (state * 1103515245 + 12345) % (2**31)
        out.append(_VOCAB[state % len(_VOCAB)])
    return " ".join(out)
