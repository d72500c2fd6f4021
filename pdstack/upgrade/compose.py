"""``docker compose stop`` / ``up --wait`` of one service, retried on the daemon's
transient answers."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pdstack.upgrade.common import UpgradeError, log

# Docker daemon answers that mean "try again", not "this stack is broken": seen when a
# container with GBs mapped exits slower than the daemon's kill wait on a loaded host.
TRANSIENT_DOCKER_ERRORS = (
    "did not receive an exit event",
    "is already in progress",
    "is restarting, wait until the container is running",
)


@dataclass
class Compose:
    stack_dir: Path
    project: str | None = None
    wait_timeout_s: int = 900
    stop_timeout_s: int = 60  # SIGTERM grace before SIGKILL: vLLM shuts down cleanly
    attempts: int = 3  # tries of one command when the daemon answers a transient error
    retry_pause_s: float = 10.0

    def _run(self, service: str, args: list[str], timeout: float) -> None:
        base = ["docker", "compose", *(["-p", self.project] if self.project else [])]
        cmd = [*base, *args, service]
        for attempt in range(1, self.attempts + 1):
            log(f"{service}: {' '.join(cmd)}")
            proc = subprocess.run(
                cmd, cwd=self.stack_dir, capture_output=True, text=True,
                timeout=timeout, check=False,
            )
            if proc.returncode == 0:
                return
            out = (proc.stdout + proc.stderr).strip()
            tail = out.splitlines()[-15:]
            transient = next((m for m in TRANSIENT_DOCKER_ERRORS if m in out), None)
            if transient is None or attempt == self.attempts:
                raise UpgradeError(
                    f"{service}: docker compose {args[0]} failed (exit {proc.returncode}):\n  "
                    + "\n  ".join(tail)
                    + self._last_logs(base, service)
                )
            log(f"{service}: docker daemon said {transient!r}; retrying in "
                f"{self.retry_pause_s:g}s ({attempt}/{self.attempts})")
            time.sleep(self.retry_pause_s)

    def _last_logs(self, base: list[str], service: str, lines: int = 40) -> str:
        """The service's last log lines, for the error (where a start hung or died)."""
        try:
            proc = subprocess.run(
                [*base, "logs", "--no-color", "--tail", str(lines), service],
                cwd=self.stack_dir, capture_output=True, text=True, timeout=30, check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        out = (proc.stdout + proc.stderr).strip()
        return f"\n  last {lines} log lines of {service}:\n    " + "\n    ".join(
            out.splitlines()[-lines:]) if out else ""

    def stop(self, service: str) -> None:
        """Stop the (drained, idle) service with a grace period, so that the recreate
        that follows only removes a stopped container."""
        self._run(service, ["stop", "-t", str(self.stop_timeout_s)], self.stop_timeout_s + 120)

    def up(self, service: str) -> None:
        self._run(
            service,
            ["up", "-d", "--no-deps", "--wait", "--wait-timeout", str(self.wait_timeout_s)],
            self.wait_timeout_s + 120,
        )
