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

``start --foreground`` stays and supervises, as the Compose stack's restart policy and engine
healthcheck do: a service that dies is started again (backoff 1 s doubling to 60 s), and an
engine that the engine watchdog (``pdstack.sidecars.ENGINE_WATCHDOG``) finds wedged has its
process group killed and is started again; the others keep running (``--restart no``: the
first death stops all). A detached ``start`` supervises nothing: run ``--foreground`` under
systemd, a Slurm step or tmux.

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
import subprocess
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

from pdstack import sidecars
from pdstack.argtypes import seconds
from pdstack.commands import load_or_exit
from pdstack.plan import NodePlan, Plan, Service, make_plan
from pdstack.secrets import NODE_SECRETS_FILE as SECRETS_ENV_FILE

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
        # UTC time of day: a supervisor's log is read as a timeline (died, restarted, healthy)
        stamp = time.strftime("%H:%M:%S", time.gmtime())
        print(f"[launch {self.node.name} {stamp}] {msg}", file=self.out, flush=True)

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

    def watch(self, prepared: list[Prepared], grace: float, restart: str = "unless-stopped",
              wedge_s: float | None = None) -> int:
        """Foreground: stay until SIGINT/SIGTERM, then stop everything. Like the Compose
        stack's ``restart: unless-stopped`` and engine healthcheck: a service that dies is
        started again after a backoff (``RESTART_BACKOFF_S``), and so is an engine that the
        engine watchdog (``pdstack.sidecars.ENGINE_WATCHDOG``, run here in its ``dry`` mode)
        finds wedged -- requests held with no progress, or ``/health`` failing once it had
        answered, for ``wedge_s`` -- after its process group is killed; the other services
        keep running. ``restart="no"``: the first death stops everything (exit 1)."""
        stop_now = {"signal": 0}

        def handler(signum: int, _frame: object) -> None:
            stop_now["signal"] = signum

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        wedge = wedge_s if wedge_s is not None else sidecars.engine_wedge_s(self.plan.profile)
        interval = min(10.0, max(0.5, wedge / 2))  # the Compose healthcheck's 10 s at most
        now = time.monotonic()
        watched = [_Supervised(p, started=now, next_check=now + interval) for p in prepared]
        for w in watched:
            w.state_file.unlink(missing_ok=True)
        rc = EXIT_OK
        while not stop_now["signal"] and rc == EXIT_OK:
            self._reap()
            now = time.monotonic()
            for w in watched:
                name = w.prepared.name
                if w.restart_at is not None:
                    if now >= w.restart_at and self.running(name) is None:
                        self._respawn(w)
                    continue
                if self.running(name) is None:
                    proc = self.children.get(name)  # None: started by an earlier launch
                    code = proc.poll() if proc is not None else None
                    self.say(f"{name} died (exit code {code}); last lines of "
                             f"{w.prepared.log}:\n{tail(w.prepared.log)}")
                    if restart == "no":
                        rc = EXIT_FAILED
                        break
                    self._schedule_restart(w, now)
                    continue
                if now - w.started >= RESTART_BACKOFF_S[1]:
                    w.delay = RESTART_BACKOFF_S[0]  # it ran long enough: back to a short delay
                if w.prepared.service.kind == "engine":
                    self._check_engine(w, now, wedge, interval)
            time.sleep(0.2)
        for w in watched:
            w.end_check()
        self.say("stopping")
        return max(rc, self.stop([w.prepared.name for w in watched], grace))

    def _check_engine(self, w: _Supervised, now: float, wedge_s: float,
                      interval: float) -> None:
        """Run the engine watchdog (dry: it reports, this launcher restarts) every
        ``interval``, in the background: a hung engine's check takes seconds (its own
        /health, /metrics and probe timeouts) and must not hold up the other services'."""
        if w.check is None:
            if now >= w.next_check:
                w.next_check = now + interval
                w.check_started = now
                w.check = self._start_watchdog(w, wedge_s)
            return
        if w.check.poll() is None:
            if now - w.check_started > WATCHDOG_CHECK_TIMEOUT_S:
                w.end_check()
            return
        out = w.check.stdout.read() if w.check.stdout else ""
        w.end_check()
        why = sidecars.watchdog_verdict(out)
        rec = self.record(w.prepared.name)
        if why and rec is not None:
            self.say(f"{w.prepared.name} wedged: {why}; killing its process group {rec.pgid}")
            self._signal(rec, signal.SIGKILL)
            self._schedule_restart(w, now)

    def _start_watchdog(self, w: _Supervised, wedge_s: float) -> Popen[str]:
        svc = w.prepared.service
        url = (svc.healthcheck_url or "").removesuffix("/health")
        args = sidecars.engine_watchdog_args(url, wedge_s, str(w.state_file), svc.name,
                                             self.plan.backend_table.served_model_name)
        return Popen([sys.executable, "-c", sidecars.ENGINE_WATCHDOG, *args, "dry"],
                     env=w.prepared.env, stdin=DEVNULL, stdout=subprocess.PIPE,
                     stderr=DEVNULL, text=True)

    def _schedule_restart(self, w: _Supervised, now: float) -> None:
        w.end_check()
        w.restart_at = now + w.delay
        self.say(f"restarting {w.prepared.name} in {w.delay:.0f} s (restart "
                 f"{w.restarts + 1})")
        w.delay = min(w.delay * 2, RESTART_BACKOFF_S[1])

    def _respawn(self, w: _Supervised) -> None:
        w.state_file.unlink(missing_ok=True)
        proc = self.spawn(w.prepared)
        now = time.monotonic()
        w.restart_at, w.started, w.next_check = None, now, now
        w.restarts += 1
        self.say(f"started {w.prepared.name} again, pid {proc.pid} (restart {w.restarts})")


RESTART_POLICIES = ("unless-stopped", "no")
# a restart's delay: the first, doubled per restart up to the second; back to the first once
# the service ran that long (Docker's restart policy: 100 ms doubling, reset after 10 s)
RESTART_BACKOFF_S = (1.0, 60.0)
# one watchdog run's limit: its own timeouts add up to 9 s (/health 2, /metrics 2, /load 1,
# the 1-token probe 4)
WATCHDOG_CHECK_TIMEOUT_S = 30.0


@dataclass
class _Supervised:
    """One service under ``Launcher.watch``."""

    prepared: Prepared
    started: float
    next_check: float
    delay: float = RESTART_BACKOFF_S[0]
    restart_at: float | None = None
    restarts: int = 0

    check: Popen[str] | None = None  # the engine watchdog's run under way
    check_started: float = 0.0

    @property
    def state_file(self) -> Path:
        return self.prepared.log.with_name(f"{self.prepared.name}.watchdog.json")

    def end_check(self) -> None:
        if self.check is not None:
            if self.check.poll() is None:
                self.check.kill()
            self.check.wait()
            if self.check.stdout:
                self.check.stdout.close()
            self.check = None


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
    return launcher.watch(prepared, grace=args.grace, restart=args.restart,
                          wedge_s=args.wedge_s)


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
                   help="after start, stay and supervise until SIGINT/SIGTERM, then stop all: "
                   "a service that dies, or an engine the watchdog finds wedged, is started "
                   "again (see --restart)")
    p.add_argument("--restart", choices=RESTART_POLICIES, default="unless-stopped",
                   help="with --foreground: unless-stopped (default; as the Compose stack) "
                   "restarts what dies, with a backoff of 1 s doubling to 60 s; no: the "
                   "first death stops every service (exit 1)")
    p.add_argument("--wedge-s", type=seconds, default=None, metavar="S",
                   help="with --foreground: seconds an engine may hold requests with no "
                   "progress, or fail /health once up, before it is restarted (default: the "
                   "Compose watchdog's, 120 on gpu, 30 on cpu)")
    p.add_argument("--keep-on-failure", action="store_true",
                   help="leave started services running when the start fails")
    p.add_argument("--json", action="store_true", help="status as JSON")
    p.set_defaults(func=cmd_launch)
