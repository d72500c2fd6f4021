#!/usr/bin/env python3
"""Where does a restarted engine's time go before it serves again? (issue 38, item 6)

Brings up a rendered CPU stack (default compose/cpu, the one the e2e tests run), sends a light
stream of completions through the proxy (``--rate`` req/s), and ``--restarts`` times SIGKILLs
the main process of one engine container (default prefill-0: the only prefiller, so the proxy's
first request to the new process is unambiguous). Docker's restart policy starts it again, as
after a crash or an OOM kill (``docker kill`` would count as a manual stop). Per restart, on one
clock (epoch seconds; Docker's own timestamps for the container and its log lines):

- kill -> Docker started the new container (restart policy delay)
- the engine log's phases: first line, the API server's args parsed (imports), EngineCore
  initialised (its own process's imports), model load start (after the worker process's
  imports), weights loaded, KV cache sized, init engine done (profile + KV allocation + the
  KV connector + warmup), API server listening, application startup complete
- the engine's own ``/health`` 200 (polled from here), Docker's healthcheck ``healthy``, the
  proxy's ``pdstack_proxy_backend_healthy`` 1 (re-admitted), and the engine's first request
  (its ``vllm:request_success_total`` > 0: the proxy sends it traffic again)
- every log line naming torch.compile or a compile cache, so a cache that is (not) hit shows

Then the stack goes down. Results (one entry per ``--label``, merged into the JSON so a before
and an after run sit side by side; the text table is rewritten from every label in it):

  flock /tmp/pdstack-heavy.lock .venv/bin/python benchmarks/engine_restart.py --label before
  # benchmarks/results/engine_restart_cpu.json, benchmarks/results/engine_restart_cpu.txt
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdstack.compose_up import compose_base, compose_down, compose_up  # noqa: E402
from pdstack.testing.heavy import heavy_lock  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# phase name -> the first engine log line (of the new container) that marks its end
MARKERS: dict[str, str] = {
    "first_log": "",
    "api_args": "non-default args",
    "engine_core": "Initializing a V1 LLM engine",
    "load_start": "Starting to load model",
    "weights": "Loading weights took",
    "kv_sized": "GiB for KV cache",
    "init_done": "init engine (profile, create kv cache, warmup model) took",
    "api_listen": "Starting vLLM server on",
    "app_up": "Application startup complete",
}
COMPILE = re.compile(r"compil|dynamo|inductor|aot", re.I)
# the columns of the table: (label, from event, to event)
SPANS = (
    ("docker restart", "kill", "started"),
    ("imports (API server)", "started", "api_args"),
    ("EngineCore up", "api_args", "engine_core"),
    ("to model load", "engine_core", "load_start"),
    ("model load", "load_start", "weights"),
    ("KV + connector + warmup", "weights", "init_done"),
    ("API server up", "init_done", "app_up"),
    ("/health 200", "app_up", "health"),
    ("proxy re-admits", "health", "readmitted"),
    ("first request", "readmitted", "traffic"),
    ("kill -> traffic", "kill", "traffic"),
    ("kill -> docker healthy", "kill", "docker_healthy"),
)


def parse_ts(text: str) -> float:
    """Docker's RFC 3339 timestamp (nanoseconds, Z) -> epoch seconds."""
    text = text.strip()
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z$", text)
    if not m:
        raise ValueError(f"not a Docker timestamp: {text!r}")
    base = dt.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=dt.UTC)
    return base.timestamp() + float(m.group(2) or 0)


def log_phases(log: str) -> tuple[dict[str, float], list[str]]:
    """The first time each MARKERS line appears in ``docker logs -t`` output, and the lines
    about compilation (with their timestamps)."""
    found: dict[str, float] = {}
    compile_lines: list[str] = []
    for line in log.splitlines():
        ts, _, text = line.partition(" ")
        try:
            t = parse_ts(ts)
        except ValueError:
            continue
        for name, needle in MARKERS.items():
            if name not in found and needle in text:
                found[name] = t
        if COMPILE.search(text):
            compile_lines.append(line[:300])
    return found, compile_lines


def docker(*args: str, timeout: float = 30) -> str:
    res = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


def inspect(container: str) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(docker("inspect", "-f", "{{json .State}}", container))
    return state


def main_pid(container: str) -> int:
    """The container's main process: the child of its init (``init: true``: tini is PID 1)."""
    init = int(inspect(container)["Pid"])
    children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    return int(children[0]) if children else init


def get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def metric(text: str, name: str, label: str = "") -> float | None:
    total = None
    for line in text.splitlines():
        if line.startswith(name) and (not label or label in line):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


class Traffic:
    """Completions through the proxy at ``rate`` req/s in all, from ``streams`` senders that
    each wait for their answer: (sent, ok, detail) per request."""

    def __init__(self, proxy: str, model: str, rate: float, streams: int = 1,
                 max_tokens: int = 4) -> None:
        self.proxy, self.model, self.gap = proxy, model, streams / rate
        self.max_tokens = max_tokens
        self.results: list[tuple[float, bool, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]

    def _run(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "restart probe",
                           "max_tokens": self.max_tokens, "ignore_eos": True}).encode()
        while not self._stop.is_set():
            t0 = time.time()
            req = urllib.request.Request(self.proxy + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    self.results.append((t0, r.status == 200, str(r.status)))
            except Exception as exc:  # an HTTPError too: the request failed
                self.results.append((t0, False, str(exc)[:200]))
            self._stop.wait(max(0.0, self.gap - (time.time() - t0)))

    def __enter__(self) -> Traffic:
        for i, thread in enumerate(self._threads):
            thread.start()
            self._stop.wait(self.gap / len(self._threads) if i < len(self._threads) - 1 else 0)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=70)


def wait_for(cond: Any, what: str, budget: float, poll: float = 1.0) -> None:
    t0 = time.time()
    while not cond():
        if time.time() - t0 > budget:
            raise RuntimeError(f"{what}: not within {budget:.0f} s")
        time.sleep(poll)


def proxy_healthy(proxy: str, backend: str) -> float | None:
    try:
        return metric(get(proxy + "/metrics"), "pdstack_proxy_backend_healthy",
                      f'backend="{backend}"')
    except OSError:
        return None


def proxy_ok(proxy: str) -> bool:
    try:
        return bool(json.loads(get(proxy + "/health"))["status"] == "ok")
    except (OSError, ValueError, KeyError):
        return False


def one_restart(container: str, engine: str, proxy: str, backend: str,
                budget: float) -> dict[str, Any]:
    before = inspect(container)
    pid = main_pid(container)
    ev: dict[str, float] = {"kill": time.time()}
    os.kill(pid, signal.SIGKILL)
    started_at = before["StartedAt"]
    while "traffic" not in ev:
        now = time.time()
        if now - ev["kill"] > budget:
            raise RuntimeError(f"{container} not serving again {budget:.0f} s after the kill: {ev}")
        if "ejected" not in ev and proxy_healthy(proxy, backend) == 0:
            ev["ejected"] = now
        st = inspect(container)
        if "started" not in ev and st["StartedAt"] != started_at and st["Running"]:
            ev["started"] = parse_ts(st["StartedAt"])
            ev["exited"] = parse_ts(st["FinishedAt"])
        if "started" in ev:
            if "docker_healthy" not in ev and st.get("Health", {}).get("Status") == "healthy":
                ev["docker_healthy"] = now
            if "health" not in ev:
                try:
                    get(engine + "/health", timeout=1)
                    ev["health"] = now
                except OSError:
                    pass
            if "health" in ev and "ejected" in ev and "readmitted" not in ev \
                    and proxy_healthy(proxy, backend) == 1:
                ev["readmitted"] = now
            if "readmitted" in ev:
                try:
                    served = metric(get(engine + "/metrics"), "vllm:request_success_total")
                except OSError:
                    served = None
                if served:
                    ev["traffic"] = now
        time.sleep(0.5)
    # Docker's healthcheck may pass after the first request: wait for it (a short while)
    t_end = time.time() + 120
    while "docker_healthy" not in ev and time.time() < t_end:
        if inspect(container).get("Health", {}).get("Status") == "healthy":
            ev["docker_healthy"] = time.time()
        time.sleep(0.5)
    since = started_at_new = inspect(container)["StartedAt"]
    log = subprocess.run(["docker", "logs", "-t", "--since", since, container],
                         capture_output=True, text=True, timeout=60)
    phases, compile_lines = log_phases(log.stdout + log.stderr)
    # stderr and stdout interleave: the markers may come from either; keep them ordered
    ev.update({k: v for k, v in phases.items() if v >= ev["started"] - 1})
    return {"started_at": started_at_new, "events": ev, "spans": spans(ev),
            "missing": [m for m in MARKERS if m not in ev],
            "compile_log": compile_lines}


def spans(ev: dict[str, float]) -> dict[str, float]:
    return {name: round(ev[b] - ev[a], 2) for name, a, b in SPANS if a in ev and b in ev}


def table(data: dict[str, Any]) -> str:
    labels = [k for k in data if isinstance(data[k], dict) and "rows" in data[k]]
    head = f"{'phase (s, median of runs [min-max])':38}" + "".join(f"{lb:>26}" for lb in labels)
    lines = [head, "-" * len(head)]
    for name, _, _ in SPANS:
        cells = []
        for lb in labels:
            vals = [s[name] for s in (spans(r["events"]) for r in data[lb]["rows"]) if name in s]
            cells.append(f"{statistics.median(vals):7.1f} [{min(vals):.1f}-{max(vals):.1f}]"
                         if vals else "-")
        lines.append(f"{name:38}" + "".join(f"{c:>26}" for c in cells))
    lines.append(f"{'failed requests / sent':38}" + "".join(
        f"{str(data[lb]['failed']) + ' / ' + str(data[lb]['sent']):>26}" for lb in labels))
    lines.append("")
    for lb in labels:
        lines.append(f"{lb}: {data[lb]['note']}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stack", type=Path, default=REPO / "compose" / "cpu")
    p.add_argument("--service", default="prefill-0")
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--rate", type=float, default=1.0, help="req/s through the proxy")
    p.add_argument("--streams", type=int, default=1, help="senders sharing --rate")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per request")
    p.add_argument("--label", required=True, help="e.g. before / after")
    p.add_argument("--note", default="", help="what this label's stack runs")
    p.add_argument("--budget", type=float, default=600, help="s from a kill to its traffic")
    p.add_argument("--out", type=Path, default=RESULTS / "engine_restart_cpu.json")
    p.add_argument("--proxy-image", default="", help="PDSTACK_PROXY_IMAGE for this run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stack = args.stack.resolve()
    env = dict(os.environ)
    if args.proxy_image:
        env["PDSTACK_PROXY_IMAGE"] = args.proxy_image
    table_ = json.loads((stack / "backends.json").read_text())
    me = next(b for b in table_["backends"] if b["name"].endswith("/" + args.service))
    text = (stack / "compose.yaml").read_text()
    m = re.search(r'"pdstack", "proxy",[^\]]*"--host", "([^"]+)", "--port", "(\d+)"', text)
    if not m:
        raise SystemExit(f"no proxy command in {stack}/compose.yaml")
    proxy = f"http://{m.group(1)}:{m.group(2)}"
    rows: list[dict[str, Any]] = []
    with heavy_lock():
        try:
            took = compose_up(stack, timeout=900, env=env, echo=print)
            print(f"up --wait: {took:.0f} s")
            wait_for(lambda: proxy_ok(proxy), "every backend routable", 60)
            container = docker(*compose_base(stack)[1:], "ps", "-q", args.service).strip()
            with Traffic(proxy, table_["served_model_name"], args.rate, args.streams,
                         args.max_tokens) as traffic:
                for i in range(args.restarts):
                    row = one_restart(container, me["url"], proxy, me["name"], args.budget)
                    rows.append(row)
                    print(f"restart {i + 1}: " + json.dumps(row["spans"]))
                    print("  compile lines: " + json.dumps(row["compile_log"][:6]))
                    wait_for(lambda: proxy_ok(proxy), "every backend routable again", 120)
            compose_file = text
        finally:
            compose_down(stack, env=env)
    sent = len(traffic.results)
    failed = [r for r in traffic.results if not r[1]]
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data[args.label] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "stack": str(args.stack), "service": args.service, "rate": args.rate,
        "streams": args.streams, "max_tokens": args.max_tokens,
        "note": args.note,
        "compose_sha256": hashlib.sha256(compose_file.encode()).hexdigest()[:16],
        "load_avg_1m": os.getloadavg()[0], "sent": sent, "failed": len(failed),
        "failures": failed[:20], "rows": rows,
    }
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    out_txt = args.out.with_suffix(".txt")
    out_txt.write_text(table(data) + "\n")
    print(out_txt.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
