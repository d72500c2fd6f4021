"""The proxy's admin API, as ``pdstack upgrade`` uses it."""

from __future__ import annotations

import urllib.error
from typing import Any

from pdstack.upgrade.common import UpgradeError, _http


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
