"""``pdstack upgrade``: rolling model / image upgrade of one node's engines.

One engine at a time, never dropping the node to zero serving capacity and never
pairing a prefiller with a decoder of another generation:

1. order: one decoder first, then the prefillers, then the other decoders (the new
   generation gets a decoder before it gets a prefiller, so its first complete pair
   exists while the old generation still serves); ``colocated``: plain order.
2. per engine: if taking it out would leave *no* generation with a usable
   prefiller/decoder pair, and the node's pairs share the LMCache store (``shared-l1``),
   register a *stand-in* at the proxy: a backend of the missing role whose URL is a
   same-node engine of the same generation (in shared-l1 every engine runs
   ``LMCacheMPConnector`` with ``kv_role: kv_both``, so a decoder can also run a
   prefill leg); it is removed once the upgraded engine serves again.
3. drain the engine at the proxy, wait for its in-flight count to reach 0;
4. edit that engine's ``<SERVICE>_IMAGE / _MODEL / _REVISION`` lines in the stack's
   ``.env`` (and its generation in ``backends.json``) and recreate only that service:
   ``docker compose up -d --no-deps --wait <service>``;
5. check the engine really runs the new model (``/v1/models`` ``root``), warm it with
   one real request straight to it, re-register it at the proxy with the new
   generation (drained), wait until the proxy's health check admits it, undrain.
On any failure the engine's old ``.env`` lines are restored, the old container is
brought back and re-registered with the old generation, and the command stops with
an error that says which engine and which step.

KV cache isolation across revisions (the LMCache store is shared by every engine of
a node): LMCache's MP connector keys every chunk by ``model_config.model``, i.e. the
model argument of ``vllm serve``. pdstack's inventories put the revision in that path
(``/models/tiny-llama/{revision}``), so two revisions never share a cache key. When
the model argument would *not* change (a hub id with ``--revision``), the upgrade
refuses to run on a node with an LMCache store, because old and new engines would
read each other's KV.

The admin token comes from ``PDSTACK_ADMIN_TOKEN`` (or ``--admin-token-file``), never
from argv, and is never printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    from pdstack import kvmodes, naming
except ImportError:  # standalone on a node: the engine_upgrade role puts both files beside it
    import kvmodes  # type: ignore[no-redef,import-not-found]
    import naming  # type: ignore[no-redef,import-not-found]

ADMIN_TOKEN_ENV = "PDSTACK_ADMIN_TOKEN"
ENGINE_KEY_ENV = "VLLM_API_KEY"
# the node's secrets file (pdstack.secrets.NODE_SECRETS_FILE; not imported: the engine_upgrade
# role runs this file on the node without the planner's dependencies)
SECRETS_ENV_FILE = "/etc/pdstack/secrets.env"
STANDIN_TAG = "-standin-"


class UpgradeError(RuntimeError):
    """A step failed; the message names the engine and the step."""


def log(message: str) -> None:
    print(f"[upgrade {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- HTTP


def _http(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        status = exc.code
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


class AdminClient:
    """The proxy's admin API (``/admin/backends``)."""

    def __init__(self, base_url: str, token: str) -> None:
        self.base = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}

    def __repr__(self) -> str:  # never show the token
        return f"AdminClient({self.base!r})"

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            status, data = _http(method, self.base + path, body, self._headers)
        except (urllib.error.URLError, OSError) as exc:
            raise UpgradeError(f"proxy admin API {method} {path}: {exc}") from exc
        if status >= 400:
            message = data.get("error", {}).get("message") if isinstance(data, dict) else data
            raise UpgradeError(f"proxy admin API {method} {path} answered {status}: {message}")
        return data

    def listing(self) -> dict[str, Any]:
        return self._call("GET", "/admin/backends")

    def backend(self, name: str) -> dict[str, Any] | None:
        return next((b for b in self.listing()["backends"] if b["name"] == name), None)

    def drain(self, name: str) -> None:
        self._call("POST", f"/admin/backends/{name}/drain")

    def undrain(self, name: str) -> None:
        self._call("POST", f"/admin/backends/{name}/undrain")

    def upsert(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/admin/backends", spec)

    def remove(self, name: str) -> None:
        self._call("DELETE", f"/admin/backends/{name}")


def wait_for(
    what: str, check: Callable[[], bool], timeout_s: float, interval_s: float = 0.25
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            raise UpgradeError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def engine_busy(metrics_text: str) -> float:
    """Requests the engine itself still runs or queues (vLLM's ``num_requests_running`` +
    ``num_requests_waiting`` gauges): the proxy's in-flight count misses work that reached
    the engine under another backend name (an upgrade stand-in) or from another client."""
    busy = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            try:
                busy += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return busy


# --------------------------------------------------------------------------- stack files


env_prefix = naming.env_prefix  # ``decode-1`` -> ``DECODE_1``, as the renderer names it


class StackEnv:
    """The stack's ``.env``: read and edit ``KEY=VALUE`` lines in place, atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in self.path.read_text().splitlines():
            if line and not line.startswith("#") and "=" in line:
                key, value = line.split("=", 1)
                out[key.strip()] = value.strip()
        return out

    def update(self, values: dict[str, str], comments: dict[str, str] | None = None) -> None:
        """Replace the lines of ``values``' keys (they must exist); ``comments`` maps a
        comment line's prefix to its new text (the renderer's ``# svc: ...`` lines)."""
        lines = self.path.read_text().splitlines()
        seen: set[str] = set()
        for i, line in enumerate(lines):
            if "=" in line and not line.startswith("#"):
                key = line.split("=", 1)[0].strip()
                if key in values:
                    lines[i] = f"{key}={values[key]}"
                    seen.add(key)
            elif comments:
                for prefix, text in comments.items():
                    if line.startswith(prefix):
                        lines[i] = text
        missing = set(values) - seen
        if missing:
            raise UpgradeError(f"{self.path}: no line for {', '.join(sorted(missing))}")
        atomic_write(self.path, "\n".join(lines) + "\n")


def atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def set_backends_json_generation(path: Path, backend: str, generation: str) -> None:
    """Keep the rendered ``backends.json`` in step, so a proxy restart mid-upgrade (or
    after it) starts with each engine's real generation."""
    if not path.exists():
        return
    data = json.loads(path.read_text())
    for b in data.get("backends", []):
        if b.get("name") == backend:
            b["generation"] = generation
    atomic_write(path, json.dumps(data, indent=2) + "\n")


def new_model_arg(old_model: str, old_rev: str, new_rev: str, template: str | None) -> str:
    """The model argument for ``new_rev``: from ``template`` (``{revision}``) when given,
    else the old path with its revision path segment replaced."""
    if template:
        return template.replace("{revision}", new_rev)
    parts = old_model.split("/")
    if old_rev and old_rev in parts:
        return "/".join(new_rev if p == old_rev else p for p in parts)
    return old_model


generation = naming.generation  # ``<revision>@<image>``, as the planner names it


# --------------------------------------------------------------------------- compose


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


# --------------------------------------------------------------------------- planning


@dataclass
class Engine:
    service: str
    backend: str  # the proxy's name, "<node>/<service>"
    role: str
    node: str
    url: str


def upgrade_order(engines: list[Engine]) -> list[Engine]:
    """One decoder, then every prefiller, then the other decoders (colocated: as is)."""
    return naming.upgrade_order(engines, lambda e: e.role)


def serving_generations(listing: dict[str, Any], excluded: Iterable[str] = ()) -> set[str]:
    """Generations that still have a usable path for a request, ignoring ``excluded``
    backends and any backend whose URL is an excluded backend's URL (its stand-ins)."""
    skip = set(excluded)
    backends = {b["name"]: b for b in listing["backends"]}
    skip_urls = {backends[n]["url"] for n in skip if n in backends}

    def usable(name: str) -> bool:
        b = backends.get(name)
        return (
            b is not None and b["state"] == "healthy" and name not in skip
            and b["url"] not in skip_urls
        )

    if not kvmodes.get(listing["kv_mode"]).disaggregated:
        return {b["generation"] for n, b in backends.items() if usable(n)}
    out: set[str] = set()
    for pair in listing.get("pairings", []):
        p, d = pair["prefill"], pair["decode"]
        if usable(p) and usable(d) and backends[p]["generation"] == backends[d]["generation"]:
            out.add(backends[p]["generation"])
    return out


def standin_for(
    listing: dict[str, Any], engine: Engine, prefer_generation: str
) -> dict[str, Any] | None:
    """A stand-in backend that keeps one generation serving while ``engine`` is out, or
    None when none is possible (not shared-l1, or no same-node partner)."""
    mode = kvmodes.get(listing["kv_mode"])
    if mode.same_node_path != kvmodes.SHARED_L1 or engine.role not in ("prefill", "decode"):
        return None
    other = "decode" if engine.role == "prefill" else "prefill"
    candidates = [
        b for b in listing["backends"]
        if b["role"] == other and b["state"] == "healthy" and b["node"] == engine.node
        and b["url"] != engine.url and STANDIN_TAG not in b["name"]
    ]
    if not candidates:
        return None
    candidates.sort(key=lambda b: (b["generation"] != prefer_generation, b["name"]))
    target = candidates[0]
    # pair only with same-node engines of the target's generation (shared-l1 path)
    partners = [
        b["name"] for b in listing["backends"]
        if b["role"] == other and b["node"] == engine.node
        and b["generation"] == target["generation"] and b["state"] == "healthy"
        and STANDIN_TAG not in b["name"]
    ]
    short = target["name"].split("/", 1)[-1]
    return {
        "name": f"{engine.node}/{engine.role}{STANDIN_TAG}{short}",
        "role": engine.role,
        "node": engine.node,
        "url": target["url"],
        "generation": target["generation"],
        "pairs_with": partners,
    }


# --------------------------------------------------------------------------- upgrade


@dataclass
class Upgrader:
    admin: AdminClient
    compose: Compose
    stack_dir: Path
    model_revision: str | None
    engine_image: str | None = None
    model_template: str | None = None
    node: str | None = None
    only: list[str] | None = None
    drain_timeout_s: float = 600.0
    health_timeout_s: float = 120.0
    allow_capacity_gap: bool = False
    standins: list[str] = field(default_factory=list)
    engine_key: str | None = field(default=None, repr=False)  # the engines' VLLM_API_KEY

    @property
    def env(self) -> StackEnv:
        return StackEnv(self.stack_dir / ".env")

    # ---------------------------------------------------------------- discovery
    def engines(self) -> list[Engine]:
        listing = self.admin.listing()
        values = self.env.read()
        backends = [b for b in listing["backends"] if STANDIN_TAG not in b["name"]]
        nodes = sorted({b["node"] for b in backends})
        node = self.node
        if node is None:
            if len(nodes) != 1:
                raise UpgradeError(
                    f"the proxy knows several nodes ({', '.join(nodes)}): pass --node"
                )
            node = nodes[0]
        out = []
        for b in backends:
            if b["node"] != node:
                continue
            service = b["name"].split("/", 1)[-1]
            if f"{env_prefix(service)}_MODEL" not in values:
                raise UpgradeError(
                    f"backend {b['name']}: no {env_prefix(service)}_MODEL line in "
                    f"{self.stack_dir / '.env'} (is --stack-dir the stack of node {node}?)"
                )
            if self.only and service not in self.only:
                continue
            out.append(Engine(service, b["name"], b["role"], b["node"], b["url"]))
        if not out:
            raise UpgradeError(f"no engines of node {node} at the proxy")
        return upgrade_order(out)

    def target(self, engine: Engine) -> tuple[dict[str, str], str]:
        """The new .env values of ``engine`` and its new generation."""
        values = self.env.read()
        p = env_prefix(engine.service)
        old_model, old_rev = values[f"{p}_MODEL"], values.get(f"{p}_REVISION", "")
        image = self.engine_image or values[f"{p}_IMAGE"]
        rev = self.model_revision or old_rev
        model = new_model_arg(old_model, old_rev, rev, self.model_template)
        new = {f"{p}_IMAGE": image, f"{p}_MODEL": model, f"{p}_REVISION": rev}
        return new, generation(rev, image)

    def check_cache_isolation(self, engines: list[Engine]) -> None:
        """Refuse a revision change that keeps the LMCache namespace (the model arg)."""
        mode = kvmodes.get(self.admin.listing()["kv_mode"])
        if not (mode.lmcache_server or mode.lmcache_push):
            return
        values = self.env.read()
        for e in engines:
            p = env_prefix(e.service)
            new, _ = self.target(e)
            if (
                values.get(f"{p}_REVISION", "") != new[f"{p}_REVISION"]
                and new[f"{p}_MODEL"] == values[f"{p}_MODEL"]
            ):
                raise UpgradeError(
                    f"{e.service}: the model argument stays {values[f'{p}_MODEL']!r} across "
                    f"revisions {values.get(f'{p}_REVISION')!r} -> {new[f'{p}_REVISION']!r}, so "
                    "the node's LMCache store would hand KV of one revision to the other "
                    "(its cache key is the model argument). Use a per-revision model path "
                    "(model name with '{revision}') or pass --model with one."
                )

    # ---------------------------------------------------------------- steps
    def run(self) -> list[str]:
        engines = self.engines()
        self.check_cache_isolation(engines)
        started = time.monotonic()
        done: list[str] = []
        log("order: " + ", ".join(e.service for e in engines))
        for engine in engines:
            new_values, new_gen = self.target(engine)
            current = self.admin.backend(engine.backend)
            if current is not None and current["generation"] == new_gen and all(
                self.env.read().get(k) == v for k, v in new_values.items()
            ):
                log(f"{engine.service}: already at {new_gen}, skipped")
                continue
            self.upgrade_one(engine, new_values, new_gen)
            done.append(engine.service)
        log(f"upgraded {len(done)} engine(s) in {time.monotonic() - started:.1f}s")
        return done

    def ensure_capacity(self, engine: Engine, old_gen: str) -> None:
        listing = self.admin.listing()
        if serving_generations(listing, [engine.backend]):
            return
        spec = standin_for(listing, engine, old_gen)
        if spec is None:
            unit = (
                "prefiller/decoder pair"
                if kvmodes.get(listing["kv_mode"]).disaggregated
                else "engine"
            )
            message = (
                f"{engine.service}: taking it out leaves no generation with a usable {unit}"
            )
            if not self.allow_capacity_gap:
                raise UpgradeError(message + " (pass --allow-capacity-gap to accept that)")
            log("WARNING: " + message)
            return
        log(f"{engine.service}: stand-in {spec['name']} -> {spec['url']} ({spec['generation']})")
        self.admin.upsert(spec)
        self.standins.append(spec["name"])
        wait_for(
            f"stand-in {spec['name']} healthy at the proxy",
            lambda: (self.admin.backend(spec["name"]) or {}).get("state") == "healthy",
            self.health_timeout_s,
        )

    def retire_standins(self, only_url: str | None = None) -> None:
        for name in list(self.standins):
            b = self.admin.backend(name)
            if b is None:
                self.standins.remove(name)
                continue
            if only_url is not None and b["url"] != only_url:
                continue
            self.admin.drain(name)
            self.wait_idle(name)
            self.admin.remove(name)
            self.standins.remove(name)
            log(f"stand-in {name} removed")

    def wait_idle(self, name: str) -> None:
        def idle() -> bool:
            b = self.admin.backend(name)
            return b is None or b["in_flight"] == 0

        wait_for(f"{name} to finish its in-flight requests", idle, self.drain_timeout_s)

    def wait_engine_idle(self, engine: Engine) -> None:
        """Wait until the engine's own metrics show nothing running or queued, twice in a
        row: stopping an engine mid-request (e.g. a stand-in's last prefill, whose KV store
        into the node's LMCache server was still under way) is what the proxy-side count
        cannot rule out. An engine without readable metrics is not waited for."""
        quiet = 0

        def idle() -> bool:
            nonlocal quiet
            try:
                status, text = _http("GET", f"{engine.url}/metrics", timeout=10)
            except OSError:
                return True
            if status != 200 or not isinstance(text, str):
                return True
            quiet = quiet + 1 if engine_busy(text) == 0 else 0
            return quiet >= 2

        wait_for(f"{engine.service} to finish its own running requests", idle,
                 self.drain_timeout_s, interval_s=1.0)

    def upgrade_one(self, engine: Engine, new_values: dict[str, str], new_gen: str) -> None:
        t0 = time.monotonic()
        old_values = {k: self.env.read()[k] for k in new_values}
        before = self.admin.backend(engine.backend) or {}
        old_gen = before.get("generation", "")
        old_spec = {
            "name": engine.backend, "role": engine.role, "node": engine.node,
            "url": engine.url, "generation": old_gen,
        }
        log(f"{engine.service}: {old_gen} -> {new_gen}")
        # stand-ins that point at this engine must go before it is drained
        for name in list(self.standins):
            b = self.admin.backend(name)
            if b is not None and b["url"] == engine.url:
                self.retire_standins(only_url=engine.url)
        self.ensure_capacity(engine, old_gen)
        self.admin.drain(engine.backend)
        touched = False
        try:
            self.wait_idle(engine.backend)
            self.wait_engine_idle(engine)
            log(f"{engine.service}: drained and idle")
            touched = True  # from here on, a rollback recreates the old container
            self.compose.stop(engine.service)
            self.apply(engine, new_values, new_gen)
            self.compose.up(engine.service)
            self.verify_and_warm(engine, new_values[f"{env_prefix(engine.service)}_MODEL"])
            self.admin.upsert({**old_spec, "generation": new_gen, "drained": True})
            self.wait_admitted(engine)
            self.admin.undrain(engine.backend)
        except (UpgradeError, OSError, subprocess.SubprocessError) as exc:
            if self.rollback(engine, old_values, old_spec, touched):
                outcome = f"rolled back to {old_gen}"
            else:
                outcome = f"ROLLBACK FAILED ({engine.service} left drained; .env restored)"
            raise UpgradeError(
                f"{engine.service}: upgrade to {new_gen} failed, {outcome}: {exc}"
            ) from exc
        self.retire_standins()
        log(f"{engine.service}: serving {new_gen} ({time.monotonic() - t0:.1f}s)")

    def apply(self, engine: Engine, values: dict[str, str], gen: str) -> None:
        role = engine.role
        self.env.update(values, {f"# {engine.service}:": f"# {engine.service}: {role}, "
                                                         f"generation {gen}"})
        set_backends_json_generation(self.stack_dir / "backends.json", engine.backend, gen)

    def verify_and_warm(self, engine: Engine, model: str) -> None:
        auth = {"Authorization": f"Bearer {self.engine_key}"} if self.engine_key else {}
        status, models = _http("GET", f"{engine.url}/v1/models", headers=auth, timeout=30)
        if status != 200 or not isinstance(models, dict) or not models.get("data"):
            raise UpgradeError(f"{engine.service}: /v1/models answered {status}: {models}")
        entry = models["data"][0]
        root = entry.get("root") or entry.get("id")
        if root != model:
            raise UpgradeError(f"{engine.service}: serves {root!r}, expected {model!r}")
        body = {"model": entry["id"], "prompt": "pdstack warm-up", "max_tokens": 2,
                "temperature": 0}
        status, answer = _http(
            "POST", f"{engine.url}/v1/completions", body, headers=auth, timeout=300
        )
        if status != 200:
            raise UpgradeError(f"{engine.service}: warm-up request answered {status}: {answer}")
        log(f"{engine.service}: serves {model}, warm")

    def wait_admitted(self, engine: Engine) -> None:
        wait_for(
            f"the proxy to admit {engine.backend}",
            lambda: (self.admin.backend(engine.backend) or {}).get("healthy") is True,
            self.health_timeout_s,
        )

    def rollback(
        self, engine: Engine, old_values: dict[str, str], old_spec: dict[str, Any], touched: bool
    ) -> bool:
        log(f"{engine.service}: rolling back")
        try:
            if touched:
                self.apply(engine, old_values, old_spec["generation"])
                self.compose.stop(engine.service)
                self.compose.up(engine.service)
                self.admin.upsert({**old_spec, "drained": True})
                self.wait_admitted(engine)
            self.admin.undrain(engine.backend)
        except (UpgradeError, OSError, subprocess.SubprocessError) as exc:
            # stand-ins stay registered: they may be all that serves now
            log(f"{engine.service}: ROLLBACK FAILED, left drained: {exc}")
            return False
        try:
            self.retire_standins()
        except UpgradeError as exc:
            log(f"stand-ins not retired: {exc}")
        return True


# --------------------------------------------------------------------------- CLI


def read_admin_token(token_file: str | None) -> str:
    if token_file:
        for line in Path(token_file).read_text().splitlines():
            if line.strip().startswith(f"{ADMIN_TOKEN_ENV}="):
                return line.split("=", 1)[1].strip().strip("'\"")
        text = Path(token_file).read_text().strip()
        if text and "=" not in text:
            return text
        raise UpgradeError(f"{token_file}: no {ADMIN_TOKEN_ENV}= line")
    token = os.environ.get(ADMIN_TOKEN_ENV, "")
    if not token:
        raise UpgradeError(f"set {ADMIN_TOKEN_ENV} (or --admin-token-file) for the proxy admin API")
    return token


def read_engine_key(secrets_file: str | None) -> str | None:
    """The engines' ``VLLM_API_KEY``: the environment's, else the node's secrets file's
    (the engines read it from there; without one they take requests without a key)."""
    key = os.environ.get(ENGINE_KEY_ENV)
    if key:
        return key
    path = Path(secrets_file) if secrets_file else None
    if path is None or not path.is_file() or not os.access(path, os.R_OK):
        return None
    for line in path.read_text().splitlines():
        line = line.strip().removeprefix("export ").strip()
        if line.startswith(f"{ENGINE_KEY_ENV}="):
            return line.split("=", 1)[1].strip().strip("'\"") or None
    return None


def register(subparsers: Any, name: str, help_text: str) -> None:
    p = subparsers.add_parser(name, help=help_text, description=__doc__.splitlines()[0])
    add_arguments(p)
    p.set_defaults(func=main)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stack-dir", required=True, type=Path,
                   help="the node's rendered stack (compose.yaml + .env)")
    p.add_argument("--model-revision", help="the revision to run (default: keep)")
    p.add_argument("--engine-image", help="the engine image to run (default: keep)")
    p.add_argument("--model", dest="model_template",
                   help="model argument for the new revision; '{revision}' is filled in "
                        "(default: the old path with its revision segment replaced)")
    p.add_argument("--proxy", required=True, help="the proxy's base URL (admin API)")
    p.add_argument("--node", help="node name at the proxy (needed with several nodes)")
    p.add_argument("--project-name", help="docker compose project name (-p)")
    p.add_argument("--only", action="append", metavar="SERVICE",
                   help="upgrade only this service (repeatable)")
    p.add_argument("--admin-token-file",
                   help=f"file with {ADMIN_TOKEN_ENV}=... (default: the environment)")
    p.add_argument("--secrets-env", default=SECRETS_ENV_FILE,
                   help=f"the node's secrets file, for the engines' {ENGINE_KEY_ENV} when the "
                        "environment has none (default %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=600.0)
    p.add_argument("--health-timeout", type=float, default=120.0)
    p.add_argument("--wait-timeout", type=int, default=900,
                   help="seconds for docker compose --wait")
    p.add_argument("--allow-capacity-gap", action="store_true",
                   help="proceed when an engine's restart leaves nothing serving")


def main(args: argparse.Namespace) -> int:
    try:
        if not args.model_revision and not args.engine_image:
            raise UpgradeError("nothing to do: give --model-revision and/or --engine-image")
        token = read_admin_token(args.admin_token_file)
        stack = args.stack_dir.resolve()
        if not (stack / ".env").is_file() or not (stack / "compose.yaml").is_file():
            raise UpgradeError(f"{stack}: not a rendered stack (compose.yaml + .env)")
        upgrader = Upgrader(
            admin=AdminClient(args.proxy, token),
            compose=Compose(stack, args.project_name, args.wait_timeout),
            stack_dir=stack,
            model_revision=args.model_revision,
            engine_image=args.engine_image,
            model_template=args.model_template,
            node=args.node,
            only=args.only,
            drain_timeout_s=args.drain_timeout,
            health_timeout_s=args.health_timeout,
            allow_capacity_gap=args.allow_capacity_gap,
            engine_key=read_engine_key(args.secrets_env),
        )
        t0 = time.monotonic()
        done = upgrader.run()
        print(json.dumps({"upgraded": done, "model_revision": args.model_revision,
                          "seconds": round(time.monotonic() - t0, 1)}))
        return 0
    except UpgradeError as exc:
        log(f"ERROR: {exc}")
        return 1


if __name__ == "__main__":
    # Standalone on a node (stdlib only): the engine_upgrade Ansible role copies this
    # file to the node and runs it there, next to the node's Docker Compose.
    parser = argparse.ArgumentParser(prog="pdstack-upgrade", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
