"""`docker compose up -d --wait` that says *which* service failed and why.

A bare ``up --wait`` ends with "dependency failed to start" or a timeout. ``compose_up``
runs it, watches the containers while it waits (a crash-looping container under
``restart: unless-stopped`` would otherwise keep ``--wait`` busy until its timeout), and on
failure collects ``docker compose ps -a`` plus the last log lines of every service that
exited, is unhealthy, is restarting or never became healthy, and raises
:class:`ComposeUpError` whose message shows them all.

    from pdstack.compose_up import compose_up
    compose_up("compose/cpu")              # returns the seconds it took

    python -m pdstack.compose_up compose/cpu [--timeout S] [--project NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_TIMEOUT_S = 900.0
DEFAULT_LOG_TAIL = 30


@dataclass(frozen=True)
class ServiceState:
    """One container of the stack, as ``docker compose ps -a`` reports it."""

    service: str
    container: str
    state: str  # created | running | restarting | exited | dead | paused | removing
    health: str  # "" (no healthcheck) | starting | healthy | unhealthy
    exit_code: int
    status: str  # human text, e.g. "Exited (1) 3 seconds ago"
    restarts: int = 0  # restarts by its policy while compose_up watched (a crash loop)

    @property
    def ok(self) -> bool:
        if self.state != "running":
            return False
        return self.health in ("", "healthy")

    @property
    def failed(self) -> bool:
        """Definitely broken (as opposed to still starting or never started)."""
        if self.state in ("exited", "dead"):
            return True
        if self.state == "restarting" or self.restarts > 0:
            return True
        return self.state == "running" and self.health == "unhealthy"

    def describe(self) -> str:
        if self.state in ("exited", "dead"):
            return f"{self.state} with code {self.exit_code} ({self.status})"
        if self.state == "restarting":
            return f"crash-looping ({self.status})"
        if self.restarts > 0:
            return (f"crash-looping: exited and restarted by its policy {self.restarts} "
                    f"time(s) while starting ({self.status})")
        if self.state == "created":
            return "never started (a service it depends on failed)"
        if self.health:
            return f"{self.state}, health {self.health} ({self.status})"
        return f"{self.state} ({self.status})"


@dataclass
class ComposeUpError(RuntimeError):
    """``up --wait`` failed; ``str()`` names the failing services and shows their logs."""

    stack_dir: Path
    reason: str
    services: list[ServiceState] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)
    up_output: str = ""

    @property
    def failing(self) -> list[ServiceState]:
        bad = [s for s in self.services if s.failed]
        bad = bad or [s for s in self.services if not s.ok and s.state != "created"]
        return bad or self._blamed_by_compose()

    def _blamed_by_compose(self) -> list[ServiceState]:
        """A container the daemon refused to create/start stays "created": blame the one
        compose was starting when it printed the error (e.g. an OCI runtime error)."""
        lines = self.up_output.splitlines()
        err_at = next((i for i, ln in enumerate(lines) if "Error" in ln or "error" in ln), None)
        if err_at is None:
            return []
        by_container = {s.container: s for s in self.services}
        for ln in reversed(lines[: err_at + 1]):
            words = ln.split()
            if len(words) >= 3 and words[0] == "Container" and words[1] in by_container \
                    and words[2] in ("Starting", "Error", "Creating", "Recreate"):
                return [by_container[words[1]]]
        return []

    def __str__(self) -> str:
        names = ", ".join(s.service for s in self.failing) or "(none identified)"
        lines = [f"docker compose up failed in {self.stack_dir}: {self.reason}",
                 f"failing service(s): {names}", "", "services:"]
        for s in self.services:
            failed = s in self.failing
            what = s.describe()
            if failed and s.state == "created":
                what = "could not be started (see compose's error below)"
            lines.append(f"  {'FAILED ' if failed else '       '}{s.service:<14} {what}")
        for name, text in self.logs.items():
            lines += ["", f"--- last log lines of {name} ---", text.rstrip() or "(no output)"]
        tail = "\n".join(self.up_output.strip().splitlines()[-8:])
        if tail:
            lines += ["", "--- docker compose up said ---", tail]
        return "\n".join(lines)


def compose_base(stack_dir: str | Path, project: str | None = None) -> list[str]:
    """``docker compose`` bound to a rendered stack directory (compose.yaml + .env)."""
    d = Path(stack_dir)
    cmd = ["docker", "compose", "--project-directory", str(d), "-f", str(d / "compose.yaml")]
    if project:
        cmd += ["-p", project]
    return cmd


def _run(cmd: Sequence[str], env: Mapping[str, str] | None, timeout: float = 60.0
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          env=dict(env) if env is not None else None, check=False)


def parse_ps_json(text: str) -> list[ServiceState]:
    """Parse ``docker compose ps --format json`` (a JSON array or one object per line)."""
    text = text.strip()
    if not text:
        return []
    rows: list[dict[str, object]]
    if text.startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for r in rows:
        out.append(ServiceState(
            service=str(r.get("Service", "")),
            container=str(r.get("Name", "")),
            state=str(r.get("State", "")).lower(),
            health=str(r.get("Health", "") or "").lower(),
            exit_code=int(str(r.get("ExitCode", 0) or 0)),
            status=str(r.get("Status", "")),
        ))
    return sorted(out, key=lambda s: s.service)


def service_states(stack_dir: str | Path, project: str | None = None,
                   env: Mapping[str, str] | None = None) -> list[ServiceState]:
    res = _run([*compose_base(stack_dir, project), "ps", "-a", "--format", "json"], env)
    if res.returncode != 0:
        raise RuntimeError(f"docker compose ps failed: {res.stderr.strip()}")
    return parse_ps_json(res.stdout)


def restart_counts(containers: Sequence[str], env: Mapping[str, str] | None = None
                   ) -> dict[str, tuple[str, int]]:
    """Each container's id and Docker RestartCount (restarts by its restart policy)."""
    if not containers:
        return {}
    res = _run(["docker", "inspect", "--format", "{{.Name}} {{.Id}} {{.RestartCount}}",
                *containers], env)
    counts = {}
    for line in res.stdout.splitlines():
        words = line.strip().lstrip("/").split()
        if len(words) == 3 and words[2].isdigit():
            counts[words[0]] = (words[1], int(words[2]))
    return counts


def _with_restarts(states: list[ServiceState], before: dict[str, int],
                   env: Mapping[str, str] | None) -> list[ServiceState]:
    """``states`` with ``restarts`` = restarts since ``before`` (container id -> count before
    ``up``; a container created since counts from 0).

    Docker's back-off between restarts starts at 0.1 s, so a poll every few seconds rarely
    sees a crash-looping container in the "restarting" state; its RestartCount says it."""
    counts = restart_counts([s.container for s in states if s.state in ("running", "restarting")],
                            env)
    out = []
    for s in states:
        if s.container in counts:
            cid, count = counts[s.container]
            s = replace(s, restarts=max(0, count - before.get(cid, 0)))
        out.append(s)
    return out


def _restarts_before(stack: Path, project: str | None, env: Mapping[str, str] | None
                     ) -> dict[str, int]:
    try:
        states = service_states(stack, project, env)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return {}
    return dict(restart_counts([s.container for s in states], env).values())


def service_logs(stack_dir: str | Path, service: str, tail: int = DEFAULT_LOG_TAIL,
                 project: str | None = None, env: Mapping[str, str] | None = None) -> str:
    res = _run([*compose_base(stack_dir, project), "logs", "--no-color", "--no-log-prefix",
                "--tail", str(tail), service], env)
    return (res.stdout + res.stderr).rstrip()


def _watch_up(proc: subprocess.Popen[str], stack: Path, project: str | None,
              env: Mapping[str, str] | None, baseline: dict[str, int], t0: float,
              timeout: float, poll_s: float) -> tuple[str, list[ServiceState]]:
    """While ``up --wait`` runs: poll the services every ``poll_s``; the reason to give up
    (a service exited, crash-loops or is unhealthy; no healthy stack in time) or "" when
    ``up`` ended by itself, and the states seen last."""
    reason = ""
    last_poll = 0.0
    watched: list[ServiceState] = []
    while True:
        try:
            proc.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - t0 > timeout + 60:
            reason = f"no healthy stack within {timeout:.0f} s"
            break
        if now - last_poll < poll_s:
            continue
        last_poll = now
        try:
            states = _with_restarts(service_states(stack, project, env), baseline, env)
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError):
            continue
        watched = states
        bad = [s for s in states if s.failed]
        if bad:
            reason = "; ".join(f"{s.service} {s.describe()}" for s in bad)
            break
    return reason, watched


def compose_up(stack_dir: str | Path, *, project: str | None = None,
               services: Sequence[str] = (), timeout: float = DEFAULT_TIMEOUT_S,
               log_tail: int = DEFAULT_LOG_TAIL, poll_s: float = 3.0,
               env: Mapping[str, str] | None = None,
               echo: Callable[[str], None] | None = None) -> float:
    """Run ``docker compose up -d --wait`` on ``stack_dir``; return the seconds it took.

    Raises :class:`ComposeUpError` naming the failing service(s) with their last
    ``log_tail`` log lines when a container exits, crash-loops or turns unhealthy, when a
    healthcheck never passes within ``timeout``, or when compose itself fails.
    """
    stack = Path(stack_dir)
    if not (stack / "compose.yaml").is_file():
        raise FileNotFoundError(f"{stack}/compose.yaml not found (render it with `pdstack render`)")
    base = compose_base(stack, project)
    cmd = [*base, "up", "-d", "--wait", "--wait-timeout", str(int(timeout)), *services]
    t0 = time.monotonic()
    baseline = _restarts_before(stack, project, env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(env) if env is not None else None)
    out_lines: list[str] = []

    def _drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out_lines.append(line)
            if echo is not None:
                echo(line.rstrip())

    reader = threading.Thread(target=_drain, daemon=True)
    reader.start()
    reason, watched = _watch_up(proc, stack, project, env, baseline, t0, timeout, poll_s)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    up_output = "".join(out_lines)
    elapsed = time.monotonic() - t0
    if not reason and proc.returncode == 0:
        states = service_states(stack, project, env)
        not_ok = [s for s in states if not s.ok and (not services or s.service in services)]
        if not not_ok:
            return elapsed
        reason = "up --wait returned 0 but " + ", ".join(s.service for s in not_ok) + " not healthy"
    if not reason:
        reason = f"`docker compose up --wait` exited with code {proc.returncode}"
    try:
        states = _with_restarts(service_states(stack, project, env), baseline, env)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        raise ComposeUpError(stack, f"{reason} (and `ps` failed: {e})", watched, {},
                             up_output) from None
    err = ComposeUpError(stack, reason, states, {}, up_output)
    for s in err.failing:
        err.logs[s.service] = service_logs(stack, s.service, log_tail, project, env)
    raise err


def compose_down(stack_dir: str | Path, *, project: str | None = None,
                 volumes: bool = False, env: Mapping[str, str] | None = None,
                 timeout: float = 180.0) -> None:
    args = ["down", "--remove-orphans", "-t", "10"] + (["-v"] if volumes else [])
    res = _run([*compose_base(stack_dir, project), *args], env, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"docker compose down failed: {res.stdout}{res.stderr}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdstack.compose_up",
                                 description="docker compose up -d --wait, with a clear failure")
    ap.add_argument("stack_dir", type=Path)
    ap.add_argument("--project", "-p", default=None)
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    ap.add_argument("--log-tail", type=int, default=DEFAULT_LOG_TAIL)
    ap.add_argument("--quiet", "-q", action="store_true", help="don't echo compose's progress")
    ap.add_argument("services", nargs="*")
    a = ap.parse_args(argv)
    try:
        took = compose_up(a.stack_dir, project=a.project, services=a.services,
                          timeout=a.timeout, log_tail=a.log_tail,
                          echo=None if a.quiet else (lambda s: print(s, flush=True)),
                          env=os.environ)
    except ComposeUpError as e:
        print(str(e), file=sys.stderr)
        return 1
    print(f"stack {a.stack_dir} is up and healthy ({took:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
