"""Stand-in for ``lmcache.cli.main`` in launch tests: ``lmcache server ...`` becomes the
fake LMCache of ``tests/launch/fakesvc.py``, with its HTTP API where uvicorn was told to put
it (LMCache 0.5.6 builds ``uvicorn.Config(app=..., host=--http-host, port=--http-port)``)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import uvicorn


def main() -> None:
    config = uvicorn.Config(app=None, host="127.0.0.1", port=8080)
    os.environ["FAKE_LMCACHE_API"] = config.uds or f"{config.host}:{config.port}"
    fake = Path(__file__).resolve().parents[3] / "fakesvc.py"
    sys.argv = [str(fake), "lmcache", *sys.argv[1:]]
    runpy.run_path(str(fake), run_name="__main__")
