#!/bin/bash
# Rehearse gpu/run_sweeps.sh (or DRIVER=run_seeds.sh FAKE_MODEL=deepseek-v2-mini) on a machine
# without GPUs: `vllm` is pdstack's FakeEngine
# (pdstack.testing.fake_engine, a test double that serves the OpenAI API and the NIXL
# kv_transfer_params protocol), `lmcache` a TCP/HTTP listener; the proxy, launch and
# bench are the real ones.  Only checks the script's flow (start, probe, sweeps, skip
# proxy, stop, packing); the numbers mean nothing.
#   bash gpu/dry_run.sh   (from the repo root; uses ports 8000-8003, 8100-8121, 6000-6001)
set -euo pipefail
REPO=$(pwd); D=${DRY_DIR:-/tmp/pd-dry}; rm -rf "$D"; mkdir -p "$D/site" "$D/bin" "$D/out"
PYBIN=$(dirname "$(command -v "${PYTHON:-$REPO/.venv/bin/python3}")")
cat > "$D/bin/vllm" <<EOS
#!/bin/sh
exec "$PYBIN/python3" - "\$@" <<'PY'
import os, sys
a = sys.argv[1:]
host, port = a[a.index("--host") + 1], a[a.index("--port") + 1]
os.execvp(sys.executable, [sys.executable, "-m", "pdstack.testing.fake_engine", "--host", host,
          "--port", port, "--model", "${FAKE_MODEL:-deepseek-v2-lite}", "--ttft-ms", "20", "--itl-ms", "5",
          "--output-tokens", "64", "--no-record"])
PY
EOS
cat > "$D/bin/lmcache" <<EOS
#!/bin/sh
exec "$PYBIN/python3" "$REPO/tests/launch/fakesvc.py" lmcache "\$@"
EOS
chmod +x "$D/bin/vllm" "$D/bin/lmcache"
echo "export PATH=$D/bin:$PYBIN:\$PATH FAKE_RECORD_DIR=$D" > "$D/site/env.sh"
DRY_RUN=1 SITE="$D/site" W="$D/run" OUT="$D/out" RATES=${RATES:-2,4} DURATION=${DURATION:-4} \
  WARMUP=1 bash "$REPO/gpu/${DRIVER:-run_sweeps.sh}" "${BUDGET:-300}"
ls -la "$D/out"; tar -tzf "$D/out/results.tar.gz" | sed -n 1,40p  # (head: SIGPIPE, rc 141 under pipefail)
