"""``pdstack launch start`` / ``status``, and the foreground stay: :class:`Launcher`."""

from __future__ import annotations

from typing import Any

from pdstack import sidecars
from pdstack.launch.health import check_health, wait_healthy
from pdstack.launch.prepare import Prepared
from pdstack.launch.services import EXIT_FAILED, EXIT_OK, Services
from pdstack.launch.supervise import Supervisor

# start's order: each stage healthy before the next starts (the compose stack's depends_on)
STAGES: tuple[str, ...] = ("lmcache", "engine", "proxy")


class Launcher(Services):
    """Starts a node's services stage by stage, reports their status, and supervises them
    in the foreground; finding, signalling and stopping them is :class:`Services`'."""

    def wait_healthy(self, stage: list[Prepared], timeout: float) -> Prepared | None:
        """Wait until every service of ``stage`` is healthy; the first that exits or times
        out is returned (None = all healthy)."""
        return wait_healthy(stage, self.children, timeout, self.say)

    def start(self, prepared: list[Prepared], timeout: float, keep_on_failure: bool) -> int:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if any(p.service.kind == "proxy" for p in prepared):
            path = self.log_dir / "backends.json"
            path.write_text(self.plan.backend_table.model_dump_json(indent=2) + "\n")
        started: list[str] = []
        for kind in STAGES:
            to_start = self._to_start([p for p in prepared if p.service.kind == kind])
            if to_start is None:
                return self._fail(started, keep_on_failure)
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

    def _to_start(self, stage: list[Prepared]) -> list[Prepared] | None:
        """Those of ``stage`` not running already; None when one runs but is not healthy."""
        to_start = []
        for p in stage:
            if self.running(p.name):
                if check_health(p.service.healthcheck_url):
                    self.say(f"{p.name} already running and healthy; left as is")
                    continue
                self.say(f"{p.name} is running (pid file {p.pidfile}) but not healthy; "
                         f"stop it first")
                return None
            to_start.append(p)
        return to_start

    def _fail(self, started: list[str], keep: bool) -> int:
        if started and not keep:
            self.say("stopping what this start began")
            self.stop([n for n in reversed(started)], grace=10.0)
        return EXIT_FAILED

    def status(self, names: list[str]) -> tuple[int, list[dict[str, Any]]]:
        rows = []
        ok = True
        for svc in self.node.services:
            if svc.name not in names:
                continue
            rec = self.record(svc.name)
            running = bool(rec and rec.alive())
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
        engine watchdog (``pdstack.sidecars.watchdog``, run here in its ``dry`` mode)
        finds wedged -- requests held with no progress, or ``/health`` failing once it had
        answered, for ``wedge_s`` -- after its process group is killed; the other services
        keep running. ``restart="no"``: the first death stops everything (exit 1)."""
        wedge = wedge_s if wedge_s is not None else sidecars.engine_wedge_s(self.plan.profile)
        return Supervisor(self, restart, wedge).run(prepared, grace)
