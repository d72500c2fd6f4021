"""Canary secrets against a running stack (issue 27): no secret in any HTTP answer of any
service, in any process's arguments, nor in the environment of the services that use none
(the LMCache server and its metrics gate). Used by the heavy tests on a real stack."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdstack.compose_up import service_states
from pdstack.quickstart import stack_ports
from pdstack.testing.heavy import container_pids

SECRET_NAMES = ("HF_TOKEN", "PDSTACK_ADMIN_TOKEN", "PDSTACK_API_KEYS", "VLLM_API_KEY")
# every GET a curious neighbour on the private network would try (LMCache's /env first)
PATHS = ("/env", "/metrics", "/health", "/v1/models", "/version", "/server_info",
         "/openapi.json", "/config", "/info", "/")
# services that get no secret at all: not even in their environment
NO_SECRET_PREFIX = "lmcache"


def canaries(tag: str = "5f3a9c") -> dict[str, str]:
    """One recognisable value per secret the stack reads."""
    return {name: f"canary-{name.lower()}-{tag}" for name in SECRET_NAMES}


@dataclass
class CanaryReport:
    ports: list[int]
    answered: int = 0  # HTTP answers read (any status)
    processes: dict[str, int] = field(default_factory=dict)  # service -> processes checked
    leaks: list[str] = field(default_factory=list)


def check_stack(stack_dir: Path, secrets: dict[str, str], *, project: str | None = None,
                host: str = "127.0.0.1", bearer: str = "",
                docker_host: str = "") -> CanaryReport:
    """Look for every value of ``secrets`` where no secret belongs; the report lists leaks.
    ``docker_host``: the engine that runs the stack (DOCKER_HOST), when not this machine's."""
    denv = {**os.environ, "DOCKER_HOST": docker_host} if docker_host else None
    report = CanaryReport(ports=stack_ports(stack_dir))  # every port a service listens on
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}

    def scan(where: str, text: str) -> None:
        report.leaks += [f"{name} in {where}" for name, value in secrets.items()
                         if value in text]

    for port in report.ports:
        for path in PATHS:
            req = urllib.request.Request(f"http://{host}:{port}{path}", headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    body = r.read().decode(errors="replace")
            except urllib.error.HTTPError as exc:
                body = exc.read().decode(errors="replace")
            except OSError:
                break  # a port that speaks no HTTP (LMCache's ZMQ holds the request: 10 s)
            report.answered += 1
            scan(f"GET :{port}{path}", body)
    states = service_states(stack_dir, project, env=denv)
    for s in states:
        for pid in container_pids(s.container, env=denv):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            except OSError:
                continue  # gone meanwhile
            report.processes[s.service] = report.processes.get(s.service, 0) + 1
            scan(f"the arguments of {s.service} pid {pid}", args)
            if s.service.startswith(NO_SECRET_PREFIX):
                scan(f"the environment of {s.service} pid {pid}", env)
    inspect = json.loads(subprocess.run(
        ["docker", "inspect", *(s.container for s in states)],
        capture_output=True, text=True, check=True, env=denv).stdout)
    for c in inspect:
        service = c["Config"]["Labels"].get("com.docker.compose.service", c["Name"])
        scan(f"docker inspect's Args of {service}", " ".join(c.get("Args") or []))
        if service.startswith(NO_SECRET_PREFIX):
            scan(f"docker inspect's Env of {service}", " ".join(c["Config"]["Env"] or []))
    return report
