"""What ``pdstack launch`` runs: each planned service's argv, environment and files."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdstack import secrets as node_secrets
from pdstack import sidecars, vllm_offload_fix
from pdstack.plan import NodePlan, Plan, Service

# where LMCache's API socket goes, in the log folder (pdstack.sidecars.LMCACHE_API_SOCKET)
LMCACHE_API_SOCKET = "lmcache-api/api.sock"


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


def lmcache_python(path_env: str | None) -> str:
    """The interpreter for the LMCache API shim: the one of the ``lmcache`` program on PATH
    (its ``#!`` line), else ``python3`` (raises FileNotFoundError without ``lmcache``)."""
    program = shutil.which("lmcache", path=path_env)
    if program is None:
        raise FileNotFoundError("'lmcache' not found on PATH")
    try:
        with open(program, "rb") as f:
            first = f.readline(512).decode(errors="replace")
    except OSError:
        first = ""
    interpreter = first[2:].strip().split(" ")[0] if first.startswith("#!") else ""
    return interpreter if "python" in Path(interpreter).name else "python3"


def service_env(svc: Service, secrets: dict[str, str],
                overrides: dict[str, str | None]) -> dict[str, str]:
    """This process's environment, then the secrets this service reads (the plan's
    ``Service.secrets``; every other secret name dropped, even from this process's own
    environment), the service's own, its GPUs and the ``--env`` overrides, in that order
    (compose: ``env_file`` first, ``environment:`` wins)."""
    env = {k: v for k, v in os.environ.items()
           if k not in node_secrets.ALL_SECRETS or k in svc.secrets}
    env.update({k: v for k, v in secrets.items() if k in svc.secrets})
    env.update(svc.env)
    if svc.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in svc.gpu_ids)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


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
        env = service_env(svc, secrets, overrides)
        command = list(svc.command)
        sock = sidecars.lmcache_api_socket(command)
        if svc.kind == "engine" or sock is not None:
            # vLLM finds pdstack's plugins there (vllm_offload_fix.plugin_files), LMCache's
            # Python the program that puts its API on a socket (pdstack.sidecars)
            plugins = str(vllm_offload_fix.plugin_path(log_dir.resolve()))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (plugins, env.get("PYTHONPATH")) if p)
        if svc.kind == "proxy" and "--backends" in command:
            command[command.index("--backends") + 1] = str(log_dir / "backends.json")
        if sock is not None:  # its API socket in the log folder (the shim makes it 0700)
            command[command.index(sock)] = str(log_dir.resolve() / LMCACHE_API_SOCKET)
            command[0] = lmcache_python(env.get("PATH"))
        argv = resolve_argv(command, env.get("PATH"))
        out.append(
            Prepared(
                service=svc,
                argv=argv,
                env=env,
                log=log_dir / f"{svc.name}.log",
                pidfile=log_dir / f"{svc.name}.pid",
                secret_keys=set(secrets) & set(svc.secrets),
            )
        )
    return out
