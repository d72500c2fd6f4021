"""Canary secrets against a running stack (issues 27 and 38): no secret in any HTTP answer
of any service, any process's arguments or any container's log; and each secret in the
environment of exactly the services that read it (``pdstack.secrets``: the planned
``Service.secrets``), in no other's (``docker inspect``'s Env and every process's
``/proc/PID/environ``). Used by the heavy tests on a real stack."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pdstack.compose_up import service_logs, service_states
from pdstack.quickstart import stack_ports
from pdstack.secrets import (
    ADMIN_TOKEN_ENV,
    API_KEYS_ENV,
    ENGINE_API_KEY_ENV,
    GRAFANA_PASSWORD_ENV,
    HF_TOKEN_ENV,
)
from pdstack.testing.heavy import container_pids

# every secret a stack reads whose value is free text (tenant keys are TENANT:KEY pairs)
SECRET_NAMES = (HF_TOKEN_ENV, ADMIN_TOKEN_ENV, API_KEYS_ENV, ENGINE_API_KEY_ENV,
                GRAFANA_PASSWORD_ENV)
# every GET a curious neighbour on the private network would try (LMCache's /env first)
PATHS = ("/env", "/metrics", "/health", "/v1/models", "/version", "/server_info",
         "/openapi.json", "/config", "/info", "/")


def canaries(tag: str = "5f3a9c") -> dict[str, str]:
    """One recognisable value per secret the stack reads."""
    return {name: f"canary-{name.lower()}-{tag}" for name in SECRET_NAMES}


@dataclass
class CanaryReport:
    ports: list[int]
    answered: int = 0  # HTTP answers read (any status)
    processes: dict[str, int] = field(default_factory=dict)  # service -> processes checked
    # service -> the secrets found in its container's environment (docker inspect)
    environments: dict[str, list[str]] = field(default_factory=dict)
    logs: dict[str, int] = field(default_factory=dict)  # service -> log characters read
    leaks: list[str] = field(default_factory=list)


def check_stack(stack_dir: Path, secrets: dict[str, str], *, project: str | None = None,
                host: str = "127.0.0.1", bearer: str = "", docker_host: str = "",
                wants: Mapping[str, Collection[str]] | None = None) -> CanaryReport:
    """Look for every value of ``secrets`` where it does not belong; the report lists leaks.
    ``wants``: service -> the secrets it reads (the plan's ``Service.secrets``); a service
    not in it reads none. A secret a service reads but does not hold is a leak too (it was
    lost on the way: the check would pass for nothing). ``docker_host``: the engine that
    runs the stack (DOCKER_HOST), when not this machine's."""
    wants = wants or {}
    denv = {**os.environ, "DOCKER_HOST": docker_host} if docker_host else None
    report = CanaryReport(ports=stack_ports(stack_dir))  # every port a service listens on
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}

    def found(text: str) -> set[str]:
        return {name for name, value in secrets.items() if value in text}

    def scan(where: str, text: str, allowed: Collection[str] = ()) -> None:
        report.leaks += [f"{name} in {where}" for name in sorted(found(text) - set(allowed))]

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
        allowed = wants.get(s.service, ())
        for pid in container_pids(s.container, env=denv):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            except OSError:
                continue  # gone meanwhile
            report.processes[s.service] = report.processes.get(s.service, 0) + 1
            scan(f"the arguments of {s.service} pid {pid}", args)
            scan(f"the environment of {s.service} pid {pid}", env, allowed)
        log = service_logs(stack_dir, s.service, tail=100_000, project=project, env=denv)
        report.logs[s.service] = len(log)
        scan(f"the log of {s.service}", log)
    inspect = json.loads(subprocess.run(
        ["docker", "inspect", *(s.container for s in states)],
        capture_output=True, text=True, check=True, env=denv).stdout)
    for c in inspect:
        service = c["Config"]["Labels"].get("com.docker.compose.service", c["Name"])
        allowed = set(wants.get(service, ())) & set(secrets)
        scan(f"docker inspect's Args of {service}", " ".join(c.get("Args") or []))
        env_text = "\n".join(c["Config"]["Env"] or [])
        held = found(env_text)
        report.environments[service] = sorted(held)
        scan(f"docker inspect's Env of {service}", env_text, allowed)
        report.leaks += [f"{name} missing from docker inspect's Env of {service}, which "
                         "reads it" for name in sorted(allowed - held)]
    return report
