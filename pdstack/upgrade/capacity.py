"""Taking one engine out without dropping the node's serving capacity: a stand-in where no
generation would keep a usable pair, and waiting until a drained backend -- and the engine
itself -- has no request left."""

from __future__ import annotations

from dataclasses import dataclass

from pdstack import kvmodes
from pdstack.upgrade.admin import AdminClient
from pdstack.upgrade.common import UpgradeError, _http, log, wait_for
from pdstack.upgrade.engines import Engine, engine_busy, serving_generations, standin_for


@dataclass
class Capacity:
    """``standins``: the names of the stand-ins registered at the proxy (shared with the
    caller, who may read it)."""

    admin: AdminClient
    standins: list[str]
    drain_timeout_s: float
    health_timeout_s: float
    allow_capacity_gap: bool = False

    def ensure(self, engine: Engine, old_gen: str) -> None:
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

    def retire(self, only_url: str | None = None) -> None:
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
