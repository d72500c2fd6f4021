"""pdstack.sidecars.lmcache_socket as a program: LMCache's HTTP API on a unix socket (its
``uvicorn.Config`` rewritten) and, when the environment names one, its data port on a socket
too (the ZMQ bind rewritten, with real ZMQ sockets here). The whole program around a stand-in
``lmcache`` (a subprocess) is in tests/spine/test_lmcache_data_socket.py, around the real
LMCache server there too (marker vllm)."""

from __future__ import annotations

import os
import stat
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import zmq

from pdstack.sidecars import lmcache_socket


class _Config:
    """``uvicorn.Config``'s signature as LMCache calls it (keyword arguments)."""

    def __init__(self, app: Any = None, host: str = "127.0.0.1", port: int = 8000,
                 uds: str | None = None, **kw: Any) -> None:
        self.app, self.host, self.port, self.uds, self.kw = app, host, port, uds, kw


def test_the_api_listens_on_the_socket_whatever_host_and_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    uvicorn = types.ModuleType("uvicorn")
    uvicorn.Config = _Config  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "uvicorn", uvicorn)
    undo = lmcache_socket.api_on_socket("/run/x/api.sock")
    config = _Config(app="lmcache-api", host="0.0.0.0", port=8080, log_level="info")
    assert (config.app, config.uds, config.kw) == ("lmcache-api", "/run/x/api.sock",
                                                  {"log_level": "info"})
    assert (config.host, config.port) == ("127.0.0.1", 8000)  # uvicorn's defaults: unused
    undo()
    assert _Config(host="0.0.0.0", port=8080).uds is None


def test_the_data_port_binds_the_socket_and_nothing_else_moves(tmp_path: Path) -> None:
    data = str(tmp_path / "mp.sock")
    ctx = zmq.Context()
    undo = lmcache_socket.data_on_socket(
        data, ["server", "--host", "127.0.0.1", "--port", "6000", "--chunk-size", "256"])
    server, other, client = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        server.bind("tcp://127.0.0.1:6000")  # LMCache's data endpoint
        assert server.getsockopt(zmq.LAST_ENDPOINT).decode() == f"ipc://{data}:6000"
        assert Path(f"{data}:6000").exists()
        port = other.bind_to_random_port("tcp://127.0.0.1")  # anything else: as asked
        assert other.getsockopt(zmq.LAST_ENDPOINT).decode() == f"tcp://127.0.0.1:{port}"
        client.connect(f"ipc://{data}:6000")  # what the engines' lmcache.mp.host joins to
        client.send(b"STORE")
        assert server.poll(5000) and server.recv() == b"STORE"
    finally:
        undo()
        for s in (server, other, client):
            s.close(linger=0)
        ctx.term()
    assert zmq.Socket.bind.__name__ == "bind"  # undone


def test_the_socket_folders_are_private(tmp_path: Path) -> None:
    folder = tmp_path / "api"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    lmcache_socket.private_folder(str(folder / "api.sock"))
    lmcache_socket.private_folder(str(tmp_path / "new" / "deep" / "mp.sock"))
    for path in (folder, tmp_path / "new" / "deep"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


def test_wrong_arguments_print_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert lmcache_socket.main(["/run/x/api.sock"]) == 2
    assert "SOCKET server ARGS" in capsys.readouterr().err
