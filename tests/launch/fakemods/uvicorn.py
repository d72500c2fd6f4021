"""Stand-in for ``uvicorn`` in launch tests: only ``Config``, whose keyword arguments the
LMCache API shim (``pdstack.sidecars.lmcache_socket``) rewrites."""

from __future__ import annotations

from typing import Any


class Config:
    def __init__(self, app: Any = None, host: str = "127.0.0.1", port: int = 8000,
                 uds: str | None = None, **kw: Any) -> None:
        self.app, self.host, self.port, self.uds = app, host, port, uds
