"""Small stdlib-only Python programs the rendered stacks run with ``python3 -c`` (in the
engine image, which has Python): nothing to install, nothing to mount.

- :data:`ENGINE_WATCHDOG` is an engine's container healthcheck: ``/health`` must pass, and
  the engine must make progress while it holds requests. It reads the engine's own
  ``/metrics`` and ``/load``: requests held are the scheduler's running and waiting gauges
  (``vllm:num_requests_running`` / ``vllm:num_requests_waiting*``) plus the API server's
  in-flight count (``/load``, ``--enable-server-load-tracking``; the gauges alone freeze
  when the engine core stops, so requests that reach a stopped core never show there);
  progress is the prompt and generation token and finished-request counters. A request
  held with those counters flat for ``WEDGE_S`` seconds is confirmed with one 1-token
  generation (4 s deadline); it fails = wedged. So is an engine that once answered and
  whose ``/health`` or ``/metrics`` fails for ``WEDGE_S`` (a hung API server). Every request
  it makes carries the container's ``VLLM_API_KEY`` (``/load`` needs it:
  pdstack.vllm_engine_auth). Then it writes one line naming the engine to the container's log
  (``pdstack-watchdog: NAME wedged: ...``, through PID 1's stdout) and ends every process
  of the container but its init (``kill(-1, SIGKILL)`` in the container's PID namespace):
  the container exits 137 and its restart policy starts it again, on the node, without a
  person and without the Docker socket. Its state is a small JSON file in the
  container's /tmp, reset when the container restarts (PID 1's start time).
  Arguments: ``URL WEDGE_S STATE_FILE NAME MODEL [dry]`` (``dry``: report, exit 1, kill
  nothing and write no container log).
- :data:`LMCACHE_API_ON_SOCKET` runs ``lmcache server ARGS`` with its HTTP API on a unix
  socket instead of a TCP port (issue 38): that API serves ``POST /run_script`` (runs an
  uploaded Python script), ``/cache/clear``, ``DELETE /cache/objects``, ``/metrics/reset``,
  ``/quota``, ``/env`` without authentication, and on 127.0.0.1 with host networking every
  container and process of the node reached it. The socket's folder (mode 0700) is shared
  with the metrics gate only (Compose: a volume mounted in those two services); the ZMQ port
  the engines use is untouched. It replaces the host and port LMCache gives uvicorn
  (``uvicorn.Config``), which ``lmcache server`` runs its API with
  (keyword arguments in every LMCache version seen; run with 0.5.6). With
  ``PDSTACK_LMCACHE_DATA_SOCKET=PATH`` in its environment (the Compose stacks: PATH is
  :data:`LMCACHE_DATA_SOCKET`, in a volume only LMCache and the node's engines mount) its data
  port goes there too: the ZMQ bind of ``tcp://HOST:PORT`` (``--host``/``--port``) becomes
  ``ipc://PATH:PORT`` (folder 0700), the endpoint the engines' ``lmcache.mp.host`` =
  ``ipc://PATH`` joins to (:func:`engine_on_data_socket`): that port takes STORE, RETRIEVE and
  CLEAR without credentials, and on TCP any process of the node reached it (issue 54).
  ``pdstack launch`` sets no such variable: its LMCache keeps the TCP port.
  Arguments: ``SOCKET`` then ``lmcache``'s own (``server ...``).
- :data:`METRICS_GATE` serves ``GET /metrics`` of that API on an address others reach, and
  nothing else (404), so Prometheus scrapes LMCache through it. ``UPSTREAM`` is
  ``unix:SOCKET`` (or an ``http://`` URL). Arguments: ``LISTEN_HOST LISTEN_PORT UPSTREAM``.
"""

from __future__ import annotations

import json

ENGINE_WATCHDOG = """\
import json, os, sys, time, urllib.request as u
url, wedge_s, state, name, model = sys.argv[1], float(sys.argv[2]), *sys.argv[3:6]
dry = sys.argv[6:] == ['dry']
now = time.time()
boot = open('/proc/1/stat').read().rsplit(')', 1)[1].split()[19]
try:
    with open(state) as f:
        last = json.load(f)
except (OSError, ValueError):
    last = {}
if last.get('boot') != boot:
    last = {'boot': boot}
def save(**kw):
    last.update(kw)
    with open(state, 'w') as f:
        json.dump(last, f)
def restart(why):
    line = 'pdstack-watchdog: %s wedged: %s: restarting its container' % (name, why)
    print(line)
    sys.stdout.flush()
    if not dry:
        try:
            with open('/proc/1/fd/1', 'w') as log:
                log.write(line + '\\n')
        except OSError:
            pass
        os.kill(-1, 9)
    sys.exit(1)
key = os.environ.get('VLLM_API_KEY')
auth = {'Authorization': 'Bearer ' + key} if key else {}
def get(path, timeout):
    return u.urlopen(u.Request(url + path, headers=auth), timeout=timeout).read().decode()
try:
    get('/health', 2)
    text = get('/metrics', 2)
except Exception as exc:
    if last.get('up'):
        down = last.get('down') or now
        save(down=down)
        if now - down > wedge_s:
            restart('/health or /metrics failing for %.0fs (%s)' % (now - down, exc))
    else:
        save()
    raise
busy = progress = 0.0
for line in text.splitlines():
    key = line.split('{', 1)[0].split(' ', 1)[0]
    if key.startswith(('vllm:num_requests_running', 'vllm:num_requests_waiting')):
        busy += float(line.rsplit(' ', 1)[1])
    elif key in ('vllm:prompt_tokens_total', 'vllm:generation_tokens_total',
                 'vllm:request_success_total'):
        progress += float(line.rsplit(' ', 1)[1])
try:
    busy += float(json.loads(get('/load', 1)).get('server_load', 0))
except Exception:
    pass
if last.get('progress') != progress:
    save(up=True, down=None, progress=progress, since=now, held=busy > 0)
    sys.exit(0)
if busy > 0 and not last.get('held'):
    save(up=True, down=None, since=now, held=True)
    sys.exit(0)
save(up=True, down=None)
if not last.get('held') or now - last['since'] <= wedge_s:
    sys.exit(0)
body = json.dumps({'model': model, 'prompt': [1], 'max_tokens': 1}).encode()
headers = {'Content-Type': 'application/json', **auth}
try:
    u.urlopen(u.Request(url + '/v1/completions', data=body, headers=headers), timeout=4).read()
except Exception as exc:
    restart('requests held, no progress for %.0fs, a 1-token probe failed (%s)'
            % (now - last['since'], exc))
save(since=now, held=False)
"""

LMCACHE_API_ON_SOCKET = """\
import os, sys, uvicorn
sock = sys.argv[1]
folder = os.path.dirname(sock)
os.makedirs(folder, mode=0o700, exist_ok=True)
os.chmod(folder, 0o700)
data = os.environ.get('PDSTACK_LMCACHE_DATA_SOCKET')
if data:
    os.makedirs(os.path.dirname(data), mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(data), 0o700)
    args = sys.argv[2:]
    port = args[args.index('--port') + 1]
    tcp = 'tcp://%s:%s' % (args[args.index('--host') + 1], port)
    import zmq
    bind = zmq.Socket.bind
    def on_data_socket(self, addr, *a, **kw):
        return bind(self, 'ipc://%s:%s' % (data, port) if addr == tcp else addr, *a, **kw)
    zmq.Socket.bind = on_data_socket
init = uvicorn.Config.__init__
def on_socket(self, *args, **kw):
    kw.pop('host', None)
    kw.pop('port', None)
    init(self, *args, uds=sock, **kw)
uvicorn.Config.__init__ = on_socket
sys.argv = ['lmcache', *sys.argv[2:]]
from lmcache.cli.main import main
sys.exit(main())
"""

METRICS_GATE = """\
import http.client, http.server, socket, sys, urllib.request as u
host, port, upstream = sys.argv[1], int(sys.argv[2]), sys.argv[3].rstrip('/')
class OnSocket(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(upstream[len('unix:'):])
def scrape():
    if not upstream.startswith('unix:'):
        return u.urlopen(upstream + '/metrics', timeout=10).read()
    conn = OnSocket('localhost', timeout=10)
    try:
        conn.request('GET', '/metrics')
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise OSError('HTTP %d' % r.status)
        return body
    finally:
        conn.close()
class Gate(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.split('?', 1)[0] != '/metrics':
            self.send_error(404, 'only GET /metrics is served here')
            return
        try:
            body, code = scrape(), 200
        except Exception as exc:
            body, code = ('upstream: %s' % exc).encode(), 502
        self.send_response(code)
        self.send_header('Content-Type', 'text/plain; version=0.0.4')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer((host, port), Gate).serve_forever()
"""

# LMCache's HTTP API socket, in the LMCache server's and its metrics gate's containers (a
# volume only those two mount); `pdstack launch` puts it in its log folder
LMCACHE_API_SOCKET = "/run/pdstack-lmcache/api.sock"
# LMCache's data (ZMQ) endpoint in the Compose stacks: ipc://SOCKET:PORT in a volume only the
# LMCache server and the node's engines mount, no TCP port (LMCACHE_API_ON_SOCKET binds it
# there when its environment names it; the engines' lmcache.mp.host points at it)
LMCACHE_DATA_SOCKET = "/run/pdstack-lmcache-data/mp.sock"
LMCACHE_DATA_ENV = "PDSTACK_LMCACHE_DATA_SOCKET"

WATCHDOG_STATE = "/tmp/pdstack-watchdog.json"

# seconds an engine may hold requests with no progress (or fail /health once it answered)
# before its watchdog restarts it, by profile: no single step of a healthy engine comes near it
ENGINE_WEDGE_S = {"gpu": 120, "cpu": 30}


def engine_wedge_s(profile: str) -> int:
    return ENGINE_WEDGE_S["gpu" if profile == "gpu" else "cpu"]


def engine_watchdog_args(url: str, wedge_s: float, state: str, name: str,
                         model: str) -> list[str]:
    """``ENGINE_WATCHDOG``'s arguments after ``python3 -c SCRIPT`` (add ``dry`` to report
    without killing: ``pdstack launch`` does the restart itself)."""
    return [url, f"{wedge_s:g}", state, name, model]


def watchdog_verdict(output: str) -> str | None:
    """Why ``ENGINE_WATCHDOG`` found its engine wedged, from its output (its ``restart``
    line: ``pdstack-watchdog: NAME wedged: WHY: restarting its container``); None if not."""
    for line in output.splitlines():
        if line.startswith("pdstack-watchdog:") and " wedged: " in line:
            return line.split(" wedged: ", 1)[1].removesuffix(": restarting its container")
    return None


def engine_healthcheck(url: str, wedge_s: float, name: str, model: str) -> list[str]:
    """The engine container's healthcheck ``test`` (exec form)."""
    return ["CMD", "python3", "-c", ENGINE_WATCHDOG,
            *engine_watchdog_args(url, wedge_s, WATCHDOG_STATE, name, model)]


def metrics_gate_command(host: str, port: int, upstream: str) -> list[str]:
    """The gate's command; ``upstream``: ``unix:SOCKET`` or an ``http://`` URL."""
    return ["python3", "-c", METRICS_GATE, host, str(port), upstream]


def lmcache_on_socket_command(socket_path: str, lmcache_args: list[str]) -> list[str]:
    """``lmcache ARGS`` (``server ...``) with its HTTP API on ``socket_path``."""
    return ["python3", "-c", LMCACHE_API_ON_SOCKET, socket_path, *lmcache_args]


def lmcache_api_socket(command: list[str]) -> str | None:
    """The API socket of an LMCache server's command (None: not one of these)."""
    if command[:3] == ["python3", "-c", LMCACHE_API_ON_SOCKET]:
        return command[3]
    return None


def lmcache_data_endpoint(port: int, socket_path: str = LMCACHE_DATA_SOCKET) -> str:
    """The ZMQ endpoint LMCache binds and its engines connect to when its data port is on
    ``socket_path`` (the connectors join ``lmcache.mp.host`` and ``lmcache.mp.port`` with
    a colon, so the socket file is named ``PATH:PORT``)."""
    return f"ipc://{socket_path}:{port}"


def engine_on_data_socket(command: list[str], socket_path: str = LMCACHE_DATA_SOCKET) -> list[str]:
    """An engine's command with every ``lmcache.mp.host`` of its ``--kv-transfer-config``
    (a MultiConnector's too) on ``ipc://socket_path``: it reaches the node's LMCache server
    through the socket, not a TCP port (a command without one is returned unchanged)."""
    if "--kv-transfer-config" not in command:
        return command
    at = command.index("--kv-transfer-config") + 1
    config = json.loads(command[at])
    changed = False

    def walk(node: object) -> None:
        nonlocal changed
        if isinstance(node, dict):
            extra = node.get("kv_connector_extra_config")
            if isinstance(extra, dict) and "lmcache.mp.host" in extra:
                extra["lmcache.mp.host"] = f"ipc://{socket_path}"
                changed = True
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    if not changed:
        return command
    out = list(command)
    out[at] = json.dumps(config, separators=(",", ":"))
    return out
