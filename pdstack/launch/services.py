"""One node's services as process groups under a log folder: find, start, signal, stop.

The base of :class:`pdstack.launch.launcher.Launcher` and what the supervisor
(:mod:`pdstack.launch.supervise`) works through.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from subprocess import Popen
from typing import TextIO

from pdstack.launch.prepare import Prepared
from pdstack.launch.procs import PidRecord, kill_group, start_process
from pdstack.plan import NodePlan, Plan

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
# stop's order: the proxy first, so that no request is sent to an engine that stops
STOP_ORDER = ("proxy", "engine", "lmcache")
# after SIGKILL, how long a process group may take to be gone
KILL_WAIT_S = 10.0


class Services:
    """The services of ``node``, their logs and pid files in ``log_dir``; ``children``
    holds the processes this object started (others are found by their pid files)."""

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
        if rec and rec.alive():
            return rec
        return None

    def spawn(self, p: Prepared) -> Popen[bytes]:
        proc = start_process(p)
        self.children[p.name] = proc
        return proc

    def signal_group(self, rec: PidRecord, sig: signal.Signals) -> None:
        kill_group(rec, sig)

    def reap(self) -> None:
        for proc in self.children.values():
            proc.poll()

    def stop(self, names: list[str], grace: float) -> int:
        """SIGTERM each service's process group, stage by stage (in ``names`` order of
        kinds: proxy, engines, LMCache), then SIGKILL after ``grace`` seconds."""
        kinds = {s.name: s.kind for s in self.node.services}
        for kind in STOP_ORDER:
            if not self._stop_batch([n for n in names if kinds.get(n) == kind], grace):
                return EXIT_FAILED
        return EXIT_OK

    def _stop_batch(self, batch: list[str], grace: float) -> bool:
        """Stop the services ``batch`` together; False (and their pid files kept) when some
        could not be stopped."""
        recs = [(n, r) for n in batch if (r := self.record(n)) is not None]
        live = [(n, r) for n, r in recs if r.alive()]
        for n, r in live:
            self.say(f"stopping {n} (process group {r.pgid})")
            self.signal_group(r, signal.SIGTERM)
        live = self._wait_gone(live, grace, poll=0.2)
        for n, r in live:
            self.say(f"{n} still running after {grace:.0f} s: SIGKILL")
            self.signal_group(r, signal.SIGKILL)
        live = self._wait_gone(live, KILL_WAIT_S, poll=0.1)
        still = {n for n, _ in live}
        for n, _ in recs:
            if n not in still:  # keep the pid file of what could not be stopped
                (self.log_dir / f"{n}.pid").unlink(missing_ok=True)
                self.children.pop(n, None)
        if live:
            self.say(f"could not stop: {', '.join(n for n, _ in live)}")
            return False
        return True

    def _wait_gone(self, live: list[tuple[str, PidRecord]], seconds: float,
                   poll: float) -> list[tuple[str, PidRecord]]:
        """Those of ``live`` still running after at most ``seconds``."""
        deadline = time.monotonic() + seconds
        while live and time.monotonic() < deadline:
            self.reap()
            live = [(n, r) for n, r in live if r.alive()]
            if live:
                time.sleep(poll)
        return live
