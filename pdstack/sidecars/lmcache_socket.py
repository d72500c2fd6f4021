"""``lmcache server ARGS`` with its HTTP API on a unix socket instead of a TCP port (issue 38).

That API serves ``POST /run_script`` (runs an uploaded Python script), ``/cache/clear``,
``DELETE /cache/objects``, ``/metrics/reset``, ``/quota``, ``/env`` without authentication,
and on 127.0.0.1 with host networking every container and process of the node reached it.
The socket's folder (mode 0700) is shared with the metrics gate only
(:mod:`pdstack.sidecars.metrics_gate`; Compose: a volume mounted in those two services); the
ZMQ port the engines use is untouched. It replaces the host and port LMCache gives uvicorn
(``uvicorn.Config``), which ``lmcache server`` runs its API with (keyword arguments in every
LMCache version seen; run with 0.5.6).

With ``PDSTACK_LMCACHE_DATA_SOCKET=PATH`` in its environment (the Compose stacks: a volume
only LMCache and the node's engines mount) its data port goes there too: the ZMQ bind of
``tcp://HOST:PORT`` (``--host``/``--port``) becomes ``ipc://PATH:PORT`` (folder 0700), the
endpoint the engines' ``lmcache.mp.host`` = ``ipc://PATH`` joins to
(:func:`pdstack.sidecars.engine_on_data_socket`): that port takes STORE, RETRIEVE and CLEAR
without credentials, and on TCP any process of the node reached it (issue 54). ``pdstack
launch`` sets no such variable: its LMCache keeps the TCP port.

Usage: ``python3 -m pdstack.sidecars.lmcache_socket SOCKET server ARGS...`` (``lmcache``'s own
arguments after the socket). Standard library only, besides LMCache and what it imports.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pdstack.sidecars import LMCACHE_DATA_ENV


def private_folder(path: str) -> None:
    """``path``'s folder, made if missing, mode 0700 (whatever it was)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)


def api_on_socket(sock: str) -> Callable[[], None]:
    """Every ``uvicorn.Config`` made from now on listens on ``sock``, whatever host and port
    it is given; returns what undoes it."""
    import uvicorn  # type: ignore[import-not-found,unused-ignore]  # in LMCache's environment

    init = uvicorn.Config.__init__

    def on_socket(self: Any, *args: Any, **kw: Any) -> None:
        kw.pop("host", None)
        kw.pop("port", None)
        init(self, *args, uds=sock, **kw)

    uvicorn.Config.__init__ = on_socket

    def undo() -> None:
        uvicorn.Config.__init__ = init

    return undo


def data_on_socket(data: str, lmcache_args: Sequence[str]) -> Callable[[], None]:
    """A ZMQ bind of LMCache's data endpoint (``tcp://HOST:PORT`` of ``--host``/``--port``
    in ``lmcache_args``) binds ``ipc://DATA:PORT`` instead; other binds are untouched.
    Returns what undoes it."""
    import zmq

    args = list(lmcache_args)
    port = args[args.index("--port") + 1]
    tcp = f"tcp://{args[args.index('--host') + 1]}:{port}"
    bind = zmq.Socket.bind

    def on_data_socket(self: Any, addr: str, *a: Any, **kw: Any) -> Any:
        return bind(self, f"ipc://{data}:{port}" if addr == tcp else addr, *a, **kw)

    zmq.Socket.bind = on_data_socket  # type: ignore[method-assign]

    def undo() -> None:
        zmq.Socket.bind = bind  # type: ignore[method-assign]

    return undo


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2:
        print(__doc__.split("\n\n")[-1].strip(), file=sys.stderr)
        return 2
    sock, lmcache_args = argv[0], list(argv[1:])
    private_folder(sock)
    data = os.environ.get(LMCACHE_DATA_ENV)
    if data:
        private_folder(data)
        data_on_socket(data, lmcache_args)
    api_on_socket(sock)
    sys.argv = ["lmcache", *lmcache_args]
    from lmcache.cli.main import main as lmcache_main  # type: ignore[import-not-found,unused-ignore]

    result = lmcache_main()  # what sys.exit makes of it, as `lmcache` itself
    return result if isinstance(result, int) else 0 if result is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
