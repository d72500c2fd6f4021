"""Import hook: when NIXL_PTHR_DELAY_US > 0, nixl's progress thread sleeps that long between polls.

nixl 1.5.1's Python API hard-codes agent_config.pthrDelay = 0, so the UCX progress thread
busy-polls (~50% of a core per idle vLLM instance). Loaded from site-packages by a .pth file.
(From shared/recipes/nixl_pthr_delay.py.)
"""

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

DELAY = int(os.environ.get("NIXL_PTHR_DELAY_US", "0") or 0)
_TARGETS = ("nixl_cu12._api", "nixl_cu13._api")


def _patch(api: Any) -> None:
    real = api.nixlBind.nixlAgentConfig

    class _Cfg(real):  # type: ignore[misc, valid-type]
        def __setattr__(self, k: str, v: Any) -> None:
            if k == "pthrDelay":
                v = max(v, DELAY)
            super().__setattr__(k, v)

    class _NS:
        pass

    ns = _NS()
    ns.__dict__.update(
        {k: getattr(api.nixlBind, k) for k in dir(api.nixlBind) if not k.startswith("__")}
    )
    ns.nixlAgentConfig = _Cfg  # type: ignore[attr-defined]
    api.nixlBind = ns


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        orig = spec.loader.exec_module

        def exec_module(mod: Any, _orig: Any = orig) -> None:
            _orig(mod)
            _patch(mod)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if DELAY > 0:
    sys.meta_path.insert(0, _Finder())
