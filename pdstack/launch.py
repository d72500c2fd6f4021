"""``pdstack launch``: run one node's planned services as plain processes.

For hosts without Docker (a lent GPU machine, a Slurm allocation).  The services are
exactly ``Plan.nodes[N].services`` -- the same ``command``, ``env`` and ports as the
node's rendered ``compose.yaml`` -- started in the compose stack's order:

1. the LMCache MP server (healthy once its ZMQ port accepts connections);
2. every engine at once, ``CUDA_VISIBLE_DEVICES`` from the service's ``gpu_ids``
   (healthy once ``/health`` answers 200);
3. the proxy, with ``--backends`` pointing at ``<log-dir>/backends.json``
   (``plan.backend_table.model_dump_json()``).

Each service runs in its own process group (``setsid``), writes ``<log-dir>/<svc>.log``
and has a pid file ``<log-dir>/<svc>.pid``.  While waiting for health the server process
is watched: a crash fails the start at once and prints the last lines of its log.
``stop`` sends SIGTERM to each process group (proxy, engines, LMCache in that order),
then SIGKILL after ``--grace`` seconds.

Secrets (HF token, API keys) come from ``/etc/pdstack/secrets.env`` when readable --
the compose stack's ``env_file`` -- into the services' environment only; they are
never printed, logged or put on a command line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import DEVNULL, STDOUT, Popen
from typing import Any, TextIO
from urllib.parse import urlparse

from pdstack.commands import load_or_exit
from pdstack.plan import SECRETS_ENV_FILE, NodePlan, Plan, Service, make_plan

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
BACKENDS_IN_COMPOSE = "/etc/pdstack/backends.json"
STAGES: tuple[str, ...] = ("lmcache", "engine", "proxy")
TAIL_LINES = 40


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, start time in clock ticks) of a live process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    rest = raw[raw.rindex(")") + 2 :].split()
    state, pgrp, start = rest[0], int(rest[2]), int(rest[19])
    return state, pgrp, start


def _alive(pid: int, start_ticks: int | None = None) -> bool:
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return start_ticks is None or st[2] == start_ticks


def group_members(pgid: int, not_before_ticks: int = 0) -> list[int]:
    """Live processes of process group ``pgid`` started no earlier than the leader was."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        st = _proc_stat(int(entry.name))
        if st and st[0] not in ("Z", "X") and st[1] == pgid and st[2] >= not_before_ticks:
            out.append(int(entry.name))
    return out


@dataclass
class PidRecord:
    """What ``<svc>.pid`` holds: enough to find the process group again, safely."""

    service: str
    pid: int
    pgid: int
    start_ticks: int
    started_at: float
    log: str

    @classmethod
    def read(cls, path: Path) -> PidRecord | None:
        try:
            data = json.loads(path.read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".pid.tmp")
        tmp.write_text(json.dumps(self.__dict__) + "\n")
        os.replace(tmp, path)

    def leader_alive(self) -> bool:
        return _alive(self.pid, self.start_ticks)

    def members(self) -> list[int]:
        return group_members(self.pgid, self.start_ticks)


# --------------------------------------------------------------------------- health


def check_health(url: str | None, timeout: float = 3.0) -> bool:
    """``tcp://host:port``: the port accepts connections; ``http(s)://``: answers 200."""
    if not url:
        return True
    parsed = urlparse(url)
    if parsed.scheme == "tcp":
        try:
            with socket.create_connection((parsed.hostname or "", parsed.port or 0), timeout):
                return True
        except OSError:
            return False
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(data.splitlines()[-lines:])


# --------------------------------------------------------------------------- preparation


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (compose ``env_file`` syntax: ``#`` comments, optional quotes)."""
    out: dict[str, str] = {}
    try:
        text = path.read_text()
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        key = key.removeprefix("export ").strip()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key] = value
    return out


def parse_overrides(items: Iterable[str]) -> dict[str, str | None]:
    """``KEY=VALUE`` sets, ``KEY=`` unsets."""
    out: dict[str, str | None] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {item!r}: use KEY=VALUE (KEY= unsets)")
        out[key] = value or None
    return out


@dataclass
class Prepared:
    """One service, ready to run here: argv, environment, files."""

    service: Service
    argv: list[str]
    env: dict[str, str]
    log: Path
    pidfile: Path
    secret_keys: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.service.name


def resolve_argv(command: Sequence[str], path_env: str | None) -> list[str]:
    """The plan's command with its program found on PATH.  ``pdstack`` falls back to this
    interpreter's ``-m pdstack.cli`` where the console script is not installed."""
    argv = list(command)
    found = shutil.which(argv[0], path=path_env)
    if found:
        argv[0] = found
    elif argv[0] == "pdstack":
        argv[:1] = [sys.executable, "-m", "pdstack.cli"]
    else:
        raise FileNotFoundError(f"{argv[0]!r} not found on PATH")
    return argv


def prepare(
    plan: Plan,
    node: NodePlan,
    log_dir: Path,
    secrets: dict[str, str],
    overrides: dict[str, str | None],
    names: Sequence[str] | None = None,
) -> list[Prepared]:
    """The services of ``node`` (all, or those in ``names``) as this host will run them
    (raises FileNotFoundError for a program missing on PATH, before anything starts)."""
    out = []
    for svc in node.services:
        if names is not None and svc.name not in names:
            continue
        env = dict(os.environ)
        env.update(secrets)  # compose: env_file first, `environment:` wins
        env.update(svc.env)
        if svc.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in svc.gpu_ids)
        for key, value in overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        env.setdefault("PYTHONUNBUFFERED", "1")
        command = list(svc.command)
        if svc.kind == "proxy" and "--backends" in command:
            command[command.index("--backends") + 1] = str(log_dir / "backends.json")
        argv = resolve_argv(command, env.get("PATH"))
        out.append(
            Prepared(
                service=svc,
                argv=argv,
                env=env,
                log=log_dir / f"{svc.name}.log",
                pidfile=log_dir / f"{svc.name}.pid",
                secret_keys=set(secrets),
            )
        )
    return out


# --------------------------------------------------------------------------- launcher


class Launcher:
    def __init__(self, plan: Plan, node: NodePlan, log_dir: Path, out: TextIO = sys.stdout):
        self.plan = plan
        self.node = node
        self.log_dir = log_dir
        self.out = out
        self.children: dict[str, Popen[bytes]] = {}

    def say(self, msg: str) -> None:
        print(f"[launch {self.node.name}] {msg}", file=self.out, flush=True)

    def record(self, name: str) -> PidRecord | None:
        return PidRecord.read(self.log_dir / f"{name}.pid")

    def running(self, name: str) -> PidRecord | None:
        rec = self.record(name)
        if rec and (rec.leader_alive() or rec.members()):
            return rec
        return None

    # ---------------------------------------------------------------- start

    def spawn(self, p: Prepared) -> Popen[bytes]:
        with p.log.open("ab") as log:
            header = (
                f"=== pdstack launch {time.strftime('%Y-%m-%dT%H:%M:%S%z')} "
                f"{p.name}: {' '.join(p.argv)}\n"
            )
            log.write(header.encode())
            log.flush()
            proc = Popen(
                p.argv,
                env=p.env,
                stdin=DEVNULL,
                stdout=log,
                stderr=STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        st = _proc_stat(proc.pid)
        PidRecord(
            service=p.name,
            pid=proc.pid,
            pgid=proc.pid,
            start_ticks=st[2] if st else 0,
            started_at=time.time(),
            log=str(p.log),
        ).write(p.pidfile)
        self.children[p.name] = proc
        return proc

    def wait_healthy(self, stage: list[Prepared], timeout: float) -> Prepared | None:
        """Wait until every service of ``stage`` is healthy; the first that exits or times
        out is returned (None = all healthy)."""
        pending = {p.name: p for p in stage}
        t0 = time.monotonic()
        while pending:
            for name, p in list(pending.items()):
                proc = self.children.get(name)
                if proc is not None and proc.poll() is not None:
                    self.say(f"{name} exited with code {proc.returncode} while starting; "
                             f"last lines of {p.log}:\n{tail(p.log)}")
                    return p
                if check_health(p.service.healthcheck_url, timeout=2.0):
                    self.say(f"{name} healthy after {time.monotonic() - t0:.1f} s "
                             f"({p.service.healthcheck_url})")
                    del pending[name]
            if not pending:
                break
            if time.monotonic() - t0 > timeout:
                p = next(iter(pending.values()))
                self.say(f"{', '.join(pending)} not healthy after {timeout:.0f} s; "
                         f"last lines of {p.log}:\n{tail(p.log)}")
                return p
            time.sleep(0.5)
        return None

    def start(self, prepared: list[Prepared], timeout: float, keep_on_failure: bool) -> int:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if any(p.service.kind == "proxy" for p in prepared):
            path = self.log_dir / "backends.json"
            path.write_text(self.plan.backend_table.model_dump_json(indent=2) + "\n")
        started: list[str] = []
        for kind in STAGES:
            stage = [p for p in prepared if p.service.kind == kind]
            to_start = []
            for p in stage:
                if self.running(p.name):
                    if check_health(p.service.healthcheck_url):
                        self.say(f"{p.name} already running and healthy; left as is")
                        continue
                    self.say(f"{p.name} is running (pid file {p.pidfile}) but not healthy; "
                             f"stop it first")
                    return self._fail(started, keep_on_failure)
                to_start.append(p)
            for p in to_start:
                proc = self.spawn(p)
                started.append(p.name)
                gpus = ",".join(map(str, p.service.gpu_ids)) or "-"
                self.say(f"started {p.name} pid {proc.pid} GPUs {gpus} log {p.log}")
            bad = self.wait_healthy(to_start, timeout)
            if bad is not None:
                return self._fail(started, keep_on_failure)
        self.say("all services healthy")
        return EXIT_OK

    def _fail(self, started: list[str], keep: bool) -> int:
        if started and not keep:
            self.say("stopping what this start began")
            self.stop([n for n in reversed(started)], grace=10.0)
        return EXIT_FAILED

    # ---------------------------------------------------------------- stop

    def stop(self, names: list[str], grace: float) -> int:
        """SIGTERM each service's process group, stage by stage (in ``names`` order of
        kinds: proxy, engines, LMCache), then SIGKILL after ``grace`` seconds."""
        kinds = {s.name: s.kind for s in self.node.services}
        order = ["proxy", "engine", "lmcache"]
        for kind in order:
            batch = [n for n in names if kinds.get(n) == kind]
            recs = [(n, r) for n in batch if (r := self.record(n)) is not None]
            live = [(n, r) for n, r in recs if r.leader_alive() or r.members()]
            for n, r in live:
                self.say(f"stopping {n} (process group {r.pgid})")
                self._signal(r, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while live and time.monotonic() < deadline:
                self._reap()
                live = [(n, r) for n, r in live if r.leader_alive() or r.members()]
                if live:
                    time.sleep(0.2)
            for n, r in live:
                self.say(f"{n} still running after {grace:.0f} s: SIGKILL")
                self._signal(r, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while live and time.monotonic() < deadline:
                self._reap()
                live = [(n, r) for n, r in live if r.leader_alive() or r.members()]
                if live:
                    time.sleep(0.1)
            still = {n for n, _ in live}
            for n, _ in recs:
                if n not in still:  # keep the pid file of what could not be stopped
                    (self.log_dir / f"{n}.pid").unlink(missing_ok=True)
                    self.children.pop(n, None)
            if live:
                self.say(f"could not stop: {', '.join(n for n, _ in live)}")
                return EXIT_FAILED
        return EXIT_OK

    def _signal(self, rec: PidRecord, sig: signal.Signals) -> None:
        if rec.leader_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rec.pgid, sig)
            return
        # leader gone (pgid may be reused only by a new session): signal our members only
        for pid in rec.members():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def _reap(self) -> None:
        for proc in self.children.values():
            proc.poll()

    # ---------------------------------------------------------------- status

    def status(self, names: list[str]) -> tuple[int, list[dict[str, Any]]]:
        rows = []
        ok = True
        for svc in self.node.services:
            if svc.name not in names:
                continue
            rec = self.record(svc.name)
            running = bool(rec and (rec.leader_alive() or rec.members()))
            healthy = running and check_health(svc.healthcheck_url)
            ok = ok and healthy
            rows.append({
                "service": svc.name,
                "kind": svc.kind,
                "state": "running" if running else ("dead" if rec else "stopped"),
                "healthy": healthy,
                "pid": rec.pid if rec else None,
                "gpus": svc.gpu_ids,
                "ports": svc.ports,
                "log": str(self.log_dir / f"{svc.name}.log"),
            })
        return (EXIT_OK if ok else EXIT_FAILED), rows

    def watch(self, names: list[str], grace: float) -> int:
        """Foreground: stay until SIGINT/SIGTERM or until a service dies, then stop all."""
        stop_now = {"signal": 0}

        def handler(signum: int, _frame: object) -> None:
            stop_now["signal"] = signum

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        rc = EXIT_OK
        while not stop_now["signal"]:
            dead = [n for n in names if self.running(n) is None]
            if dead:
                for n in dead:
                    log = self.log_dir / f"{n}.log"
                    self.say(f"{n} died; last lines of {log}:\n{tail(log)}")
                rc = EXIT_FAILED
                break
            time.sleep(1.0)
        self.say("stopping")
        return max(rc, self.stop(names, grace))


# --------------------------------------------------------------------------- CLI


def default_log_dir(plan: Plan, node: str) -> Path:
    return Path("build") / "launch" / plan.deployment / node


def pick_node(plan: Plan, wanted: str | None) -> str:
    if wanted:
        if wanted not in plan.nodes:
            raise KeyError(f"no node {wanted!r} (nodes: {', '.join(plan.nodes)})")
        return wanted
    if len(plan.nodes) == 1:
        return next(iter(plan.nodes))
    host = socket.gethostname()
    for name, node in plan.nodes.items():
        if host in (name, node.ssh.host, name.split(".")[0]):
            return name
    raise KeyError(f"several nodes ({', '.join(plan.nodes)}); pick one with --node")


def cmd_launch(args: argparse.Namespace) -> int:
    plan = make_plan(load_or_exit(args.inventory))
    try:
        node_name = pick_node(plan, args.node)
        overrides = parse_overrides(args.env)
    except (KeyError, ValueError) as err:
        print(f"pdstack launch: {err.args[0]}", file=sys.stderr)
        return EXIT_INVALID
    node = plan.nodes[node_name]
    log_dir = Path(args.log_dir) if args.log_dir else default_log_dir(plan, node_name)
    names = [s.name for s in node.services]
    if args.services:
        wanted = [n.strip() for n in args.services.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            print(f"pdstack launch: {node_name} has no service {', '.join(unknown)} "
                  f"(it has {', '.join(names)})", file=sys.stderr)
            return EXIT_INVALID
        names = [n for n in names if n in wanted]
    launcher = Launcher(plan, node, log_dir)

    if args.action == "stop":
        return launcher.stop(names, grace=args.grace)
    if args.action == "status":
        rc, rows = launcher.status(names)
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                ports = " ".join(f"{k}={v}" for k, v in r["ports"].items())
                print(f"{r['service']:<12} {r['state']:<8} "
                      f"{'healthy' if r['healthy'] else 'unhealthy':<9} "
                      f"pid={r['pid']} gpus={','.join(map(str, r['gpus'])) or '-'} {ports}")
        return rc

    secrets = read_env_file(Path(args.secrets_env))
    try:
        prepared = prepare(plan, node, log_dir, secrets, overrides, names)
    except FileNotFoundError as err:
        print(f"pdstack launch: {err.args[0]}; nothing started", file=sys.stderr)
        return EXIT_FAILED
    rc = launcher.start(prepared, timeout=args.timeout, keep_on_failure=args.keep_on_failure)
    if rc != EXIT_OK or not args.foreground:
        return rc
    return launcher.watch(names, grace=args.grace)


def register(sub: argparse._SubParsersAction, name: str, help_text: str) -> None:
    p = sub.add_parser(
        name,
        help=help_text,
        description=__doc__.split("\n", 2)[2] if __doc__ else help_text,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  pdstack launch -i inventory/h200x2-shared-l1 start --log-dir /tmp/pd\n"
        "  pdstack launch -i inventory/h200x2-shared-l1 status --log-dir /tmp/pd\n"
        "  pdstack launch -i inventory/h200x2-shared-l1 stop --log-dir /tmp/pd\n"
        "  pdstack launch -i inventory/X start --services proxy   # one service only",
    )
    p.add_argument("action", nargs="?", default="start", choices=("start", "stop", "status"))
    p.add_argument("-i", "--inventory", required=True, help="inventory directory (inventory/X)")
    p.add_argument("--node", help="which node of the plan runs here (default: the only one, "
                                  "or the one named like this host)")
    p.add_argument("--log-dir", help="logs, pid files, backends.json "
                                     "(default build/launch/<deployment>/<node>)")
    p.add_argument("--services", help="comma-separated subset of the node's services")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds each stage may take to become healthy (default 1800)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds between SIGTERM and SIGKILL on stop (default 30)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set (KEY=VALUE) or unset (KEY=) a variable for every service, "
                        "over the plan's; repeatable")
    p.add_argument("--secrets-env", default=SECRETS_ENV_FILE,
                   help=f"KEY=VALUE secrets for the services (default {SECRETS_ENV_FILE}; "
                        "skipped when absent)")
    p.add_argument("--foreground", action="store_true",
                   help="after start, stay until SIGINT/SIGTERM or a service dies, then stop")
    p.add_argument("--keep-on-failure", action="store_true",
                   help="leave started services running when the start fails")
    p.add_argument("--json", action="store_true", help="status as JSON")
    p.set_defaults(func=cmd_launch)
