"""Small stdlib-only Python programs the rendered stacks run with ``python3 -c`` (in the
engine image, which has Python): nothing to install, nothing to mount.

- :data:`ENGINE_WATCHDOG` is an engine's container healthcheck: ``/health`` must pass, and
  the engine must make progress while it holds requests. It reads the engine's own
  ``/metrics``: requests running or waiting (``vllm:num_requests_running`` /
  ``vllm:num_requests_waiting*``) with the progress counters (prompt and generation
  tokens, finished requests) unchanged for ``WEDGE_S`` seconds = wedged. Then it ends every
  process of the container but its init (``kill(-1, SIGKILL)`` in the container's PID
  namespace), the container exits 137 and its restart policy starts it again: the
  replacement happens on the node, without a person and without the Docker socket.
  Its state (last counters and since when) is a small JSON file in the container's /tmp.
  Arguments: ``URL WEDGE_S STATE_FILE [dry]`` (``dry``: report, exit 1, kill nothing).
- :data:`METRICS_GATE` serves ``GET /metrics`` of a loopback-only HTTP API on an address
  others reach, and nothing else (404): LMCache's HTTP server also serves ``/env`` (its
  environment), ``/cache/clear``, ``/reconfigure/*`` and ``/metrics/reset`` without
  authentication, so the server binds 127.0.0.1 and Prometheus scrapes it through this.
  Arguments: ``LISTEN_HOST LISTEN_PORT UPSTREAM_URL``.
"""

from __future__ import annotations

ENGINE_WATCHDOG = """\
import json, os, sys, time, urllib.request as u
url, wedge_s, state = sys.argv[1], float(sys.argv[2]), sys.argv[3]
u.urlopen(url + '/health', timeout=3).read()
busy = progress = 0.0
for line in u.urlopen(url + '/metrics', timeout=3).read().decode().splitlines():
    name = line.split('{', 1)[0].split(' ', 1)[0]
    if name.startswith(('vllm:num_requests_running', 'vllm:num_requests_waiting')):
        busy += float(line.rsplit(' ', 1)[1])
    elif name in ('vllm:prompt_tokens_total', 'vllm:generation_tokens_total',
                  'vllm:request_success_total'):
        progress += float(line.rsplit(' ', 1)[1])
now = time.time()
try:
    with open(state) as f:
        last = json.load(f)
except (OSError, ValueError):
    last = {}
stuck = busy > 0 and last.get('progress') == progress
since = last.get('since', now) if stuck else now
with open(state, 'w') as f:
    json.dump({'progress': progress, 'since': since}, f)
if now - since > wedge_s:
    print('wedged: %g requests held, no progress for %.0fs: restarting' % (busy, now - since))
    sys.stdout.flush()
    if sys.argv[4:] != ['dry']:
        os.kill(-1, 9)
    sys.exit(1)
"""

METRICS_GATE = """\
import sys, http.server, urllib.request as u
host, port, upstream = sys.argv[1], int(sys.argv[2]), sys.argv[3].rstrip('/')
class Gate(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.split('?', 1)[0] != '/metrics':
            self.send_error(404, 'only GET /metrics is served here')
            return
        try:
            body, code = u.urlopen(upstream + '/metrics', timeout=10).read(), 200
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

WATCHDOG_STATE = "/tmp/pdstack-watchdog.json"


def engine_healthcheck(url: str, wedge_s: float) -> list[str]:
    """The engine container's healthcheck ``test`` (exec form)."""
    return ["CMD", "python3", "-c", ENGINE_WATCHDOG, url, f"{wedge_s:g}", WATCHDOG_STATE]


def metrics_gate_command(host: str, port: int, upstream: str) -> list[str]:
    return ["python3", "-c", METRICS_GATE, host, str(port), upstream]
