"""The upgrade's steps, engine by engine: :class:`Upgrader`."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdstack.upgrade.admin import AdminClient
from pdstack.upgrade.capacity import Capacity
from pdstack.upgrade.common import UpgradeError, log, wait_for
from pdstack.upgrade.compose import Compose
from pdstack.upgrade.engines import Engine, verify_and_warm
from pdstack.upgrade.stackfiles import StackEnv, env_prefix, set_backends_json_generation
from pdstack.upgrade.targets import Target, node_engines


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

    @property
    def capacity(self) -> Capacity:
        return Capacity(self.admin, self.standins, self.drain_timeout_s,
                        self.health_timeout_s, self.allow_capacity_gap)

    @property
    def wanted(self) -> Target:
        return Target(self.model_revision, self.engine_image, self.model_template)

    # ---------------------------------------------------------------- discovery
    def engines(self) -> list[Engine]:
        return node_engines(self.admin.listing(), self.env.read(), self.stack_dir / ".env",
                            self.node, self.only)

    def target(self, engine: Engine) -> tuple[dict[str, str], str]:
        """The new .env values of ``engine`` and its new generation."""
        return self.wanted.values(self.env.read(), engine)

    def check_cache_isolation(self, engines: list[Engine]) -> None:
        """Refuse a revision change that keeps the LMCache namespace (the model arg)."""
        kv_mode = self.admin.listing()["kv_mode"]
        self.wanted.check_cache_isolation(kv_mode, self.env.read(), engines)

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
        self.capacity.ensure(engine, old_gen)

    def retire_standins(self, only_url: str | None = None) -> None:
        self.capacity.retire(only_url)

    def wait_idle(self, name: str) -> None:
        self.capacity.wait_idle(name)

    def wait_engine_idle(self, engine: Engine) -> None:
        self.capacity.wait_engine_idle(engine)

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
            self.replace(engine, new_values, new_gen, old_spec)
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

    def replace(self, engine: Engine, new_values: dict[str, str], new_gen: str,
                old_spec: dict[str, Any]) -> None:
        """The drained, idle engine's container recreated with ``new_values``, checked,
        warmed, registered with ``new_gen`` and undrained once the proxy admits it."""
        self.compose.stop(engine.service)
        self.apply(engine, new_values, new_gen)
        self.compose.up(engine.service)
        self.verify_and_warm(engine, new_values[f"{env_prefix(engine.service)}_MODEL"])
        self.admin.upsert({**old_spec, "generation": new_gen, "drained": True})
        self.wait_admitted(engine)
        self.admin.undrain(engine.backend)

    def apply(self, engine: Engine, values: dict[str, str], gen: str) -> None:
        role = engine.role
        self.env.update(values, {f"# {engine.service}:": f"# {engine.service}: {role}, "
                                                         f"generation {gen}"})
        set_backends_json_generation(self.stack_dir / "backends.json", engine.backend, gen)

    def verify_and_warm(self, engine: Engine, model: str) -> None:
        verify_and_warm(engine, model, self.engine_key)

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

