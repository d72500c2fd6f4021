"""``pdstack launch start --foreground``: supervise the started services as the Compose
stack's restart policy and engine healthcheck do.

A service that dies is started again after a backoff (``RESTART_BACKOFF_S``), and so is an
engine that the engine watchdog (``pdstack.sidecars.watchdog``, run here in its
``dry`` mode) finds wedged, after its process group is killed; the other services keep
running.  ``restart="no"``: the first death stops everything (exit 1).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from subprocess import DEVNULL, Popen

from pdstack import sidecars
from pdstack.launch.health import tail
from pdstack.launch.prepare import Prepared
from pdstack.launch.services import EXIT_FAILED, EXIT_OK, Services

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


class Supervisor:
    """Watches ``services`` until SIGINT/SIGTERM (or, with ``restart="no"``, the first
    death), restarting what dies or wedges for ``wedge_s``; then stops them all."""

    def __init__(self, services: Services, restart: str, wedge_s: float):
        self.services = services
        self.restart = restart
        self.wedge_s = wedge_s
        # how often each engine's watchdog runs: the Compose healthcheck's 10 s at most
        self.interval = min(10.0, max(0.5, wedge_s / 2))

    def run(self, prepared: list[Prepared], grace: float) -> int:
        stop_now = {"signal": 0}

        def handler(signum: int, _frame: object) -> None:
            stop_now["signal"] = signum

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        now = time.monotonic()
        watched = [_Supervised(p, started=now, next_check=now + self.interval)
                   for p in prepared]
        for w in watched:
            w.state_file.unlink(missing_ok=True)
        rc = EXIT_OK
        while not stop_now["signal"] and rc == EXIT_OK:
            self.services.reap()
            now = time.monotonic()
            for w in watched:
                if not self._tend(w, now):
                    rc = EXIT_FAILED
                    break
            time.sleep(0.2)
        for w in watched:
            w.end_check()
        self.services.say("stopping")
        return max(rc, self.services.stop([w.prepared.name for w in watched], grace))

    def _tend(self, w: _Supervised, now: float) -> bool:
        """One look at ``w``: restart it when due, note a death, check an engine; False when
        a death must stop everything (``restart="no"``)."""
        name = w.prepared.name
        if w.restart_at is not None:
            if now >= w.restart_at and self.services.running(name) is None:
                self._respawn(w)
            return True
        if self.services.running(name) is None:
            proc = self.services.children.get(name)  # None: started by an earlier launch
            code = proc.poll() if proc is not None else None
            self.services.say(f"{name} died (exit code {code}); last lines of "
                              f"{w.prepared.log}:\n{tail(w.prepared.log)}")
            if self.restart == "no":
                return False
            self._schedule_restart(w, now)
            return True
        if now - w.started >= RESTART_BACKOFF_S[1]:
            w.delay = RESTART_BACKOFF_S[0]  # it ran long enough: back to a short delay
        if w.prepared.service.kind == "engine":
            self._check_engine(w, now)
        return True

    def _check_engine(self, w: _Supervised, now: float) -> None:
        """Run the engine watchdog (dry: it reports, this launcher restarts) every
        ``interval``, in the background: a hung engine's check takes seconds (its own
        /health, /metrics and probe timeouts) and must not hold up the other services'."""
        if w.check is None:
            if now >= w.next_check:
                w.next_check = now + self.interval
                w.check_started = now
                w.check = self._start_watchdog(w)
            return
        if w.check.poll() is None:
            if now - w.check_started > WATCHDOG_CHECK_TIMEOUT_S:
                w.end_check()
            return
        out = w.check.stdout.read() if w.check.stdout else ""
        w.end_check()
        why = sidecars.watchdog_verdict(out)
        rec = self.services.record(w.prepared.name)
        if why and rec is not None:
            self.services.say(f"{w.prepared.name} wedged: {why}; killing its process group "
                              f"{rec.pgid}")
            self.services.signal_group(rec, signal.SIGKILL)
            self._schedule_restart(w, now)

    def _start_watchdog(self, w: _Supervised) -> Popen[str]:
        svc = w.prepared.service
        url = (svc.healthcheck_url or "").removesuffix("/health")
        model = self.services.plan.backend_table.served_model_name
        args = sidecars.engine_watchdog_args(url, self.wedge_s, str(w.state_file), svc.name,
                                             model)
        return Popen([sys.executable, "-m", sidecars.WATCHDOG, *args, "dry"],
                     env=w.prepared.env, stdin=DEVNULL, stdout=subprocess.PIPE,
                     stderr=DEVNULL, text=True)

    def _schedule_restart(self, w: _Supervised, now: float) -> None:
        w.end_check()
        w.restart_at = now + w.delay
        self.services.say(f"restarting {w.prepared.name} in {w.delay:.0f} s (restart "
                          f"{w.restarts + 1})")
        w.delay = min(w.delay * 2, RESTART_BACKOFF_S[1])

    def _respawn(self, w: _Supervised) -> None:
        w.state_file.unlink(missing_ok=True)
        proc = self.services.spawn(w.prepared)
        now = time.monotonic()
        w.restart_at, w.started, w.next_check = None, now, now
        w.restarts += 1
        self.services.say(f"started {w.prepared.name} again, pid {proc.pid} "
                          f"(restart {w.restarts})")
