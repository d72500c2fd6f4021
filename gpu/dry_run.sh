#!/bin/bash
# Rehearse gpu/run_ceiling.sh (or DRIVER=other.sh) on a machine without GPUs: `vllm` is
# pdstack's FakeEngine (pdstack.testing.fake_engine, a test double that serves the OpenAI API
# and the NIXL kv_transfer_params protocol), `lmcache` a TCP/HTTP listener; the proxy, launch
# and bench are the real ones.  Only checks the driver's flow (start, sweeps, extra proxies,
# stop, packing); the numbers mean nothing.  From the repo root, e.g.
#   SWEEPS="pdstack-default pdstack-nomigr long-vllm-native" RATES=2,4 RATES_LONG=1 RATES_MAX=0 \
#     KEEP= BUDGET=400 bash gpu/dry_run.sh        (gpu/README.md lists one per experiment)
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
  WARMUP=1 bash "$REPO/gpu/${DRIVER:-run_ceiling.sh}" "${BUDGET:-300}"
ls -la "$D/out"; tar -tzf "$D/out/results.tar.gz" | sed -n 1,40p  # (head: SIGPIPE, rc 141 under pipefail)
