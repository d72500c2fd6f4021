#!/bin/bash
# Drive the h200x2 measurements on the lent 2xH200 machine (run from the repo root there).
#
#   bash gpu/run_sweeps.sh [BUDGET_S]
#
# Idempotent and resumable, so it can be called again in the next device call
# (each call <= 10 min; the machine and /tmp live ~30 s between calls):
#   1. install the payload from /tmp/chunks (once)          -> /tmp/site
#   2. machine facts                                         -> results/machine.txt
#   3. start every topology's services at once, detached (pdstack launch, setsid):
#      colocated, nixl, shared-l1 engines (3 per GPU); the -skip topology reuses
#      shared-l1's engines and LMCache and only adds its own proxy
#   4. one bench sweep per topology, same workload and rates, while the budget allows
#   5. pack results + logs into $OUT/results.tar.gz (always, also on failure)
# State lives in /tmp/pdrun; a finished sweep is not run again.
set -uo pipefail
T0=$(date +%s)
BUDGET=${1:-560}
REPO=$(pwd)
W=${W:-/tmp/pdrun}
SITE=${SITE:-/tmp/site}
OUTDIR=${OUT:-$W/out}
mkdir -p "$W/results" "$W/logs" "$W/state" "$OUTDIR"
RATES=${RATES:-4,12,24}
DURATION=${DURATION:-30}
WARMUP=${WARMUP:-5}
# inventory/h200x2-<t> for each; "<base>-skip" reuses <base>'s engines and LMCache
read -r -a TOPOLOGIES <<< "${TOPOLOGIES:-colocated nixl shared-l1 shared-l1-skip}"

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }
log() { echo "[run +$(elapsed)s] $*" | tee -a "$W/run.log"; }
pack() {
  for d in "$W"/logs/*/; do
    [ -d "$d" ] || continue
    for f in "$d"*.log; do [ -f "$f" ] && tail -c 400000 "$f" > "$f.tail"; done
  done
  tar -C "$W" -czf "$OUTDIR/results.tar.gz" --exclude='*.log' results logs run.log state 2>/dev/null
  cp "$W/run.log" "$OUTDIR/run.log" 2>/dev/null
  log "packed $(du -h "$OUTDIR/results.tar.gz" | cut -f1) into \$OUT/results.tar.gz"
}
trap pack EXIT

# ------------------------------------------------------------------ 1. install
if [ ! -f "$SITE/env.sh" ]; then
  log "installing payload from /tmp/chunks ($(ls /tmp/chunks 2>/dev/null | wc -l) files)"
  SKIP_CHECK=1 bash /tmp/chunks/install.sh /tmp/chunks > "$W/install.log" 2>&1
  rc=$?; tail -5 "$W/install.log" | tee -a "$W/run.log"
  [ $rc -eq 0 ] || { log "install failed rc=$rc"; exit 1; }
fi
# shellcheck disable=SC1091
source "$SITE/env.sh"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=python3
PD=("$PY" -m pdstack.cli)
declare -A PROXY_PORT ENGINE_PORTS LMCACHE_HTTP
for t in "${TOPOLOGIES[@]}"; do  # ports from the plan, the one source of numbering
  read -r pp ep lm < <("$PY" - "inventory/h200x2-$t" <<'EOF'
import sys
from pdstack.plan import make_plan
from pdstack.topology import load_topology
svcs = [s for n in make_plan(load_topology(sys.argv[1])).nodes.values() for s in n.services]
proxy = next(s.ports["http"] for s in svcs if s.kind == "proxy")
engines = ",".join(str(s.ports["http"]) for s in svcs if s.kind == "engine")
lm = next((str(s.ports["metrics"]) for s in svcs if s.kind == "lmcache"), "-")
print(proxy, engines, lm)
EOF
)
  PROXY_PORT[$t]=$pp; ENGINE_PORTS[$t]=${ep//,/ }; LMCACHE_HTTP[$t]=$lm
done

# ------------------------------------------------------------------ 2. machine facts
if [ ! -f "$W/results/machine.txt" ]; then
  {
    echo "# h200x2 machine facts, $(date -u +%FT%TZ)"
    echo "## uname"; uname -a
    echo "## cpu / memory"; nproc; free -g; df -h /tmp | tail -1
    echo "## nvidia-smi"; nvidia-smi
    echo "## nvidia-smi topo -m"; nvidia-smi topo -m
    echo "## nvidia-smi --query-gpu"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv
    echo "## versions"
    "$PY" - <<'EOF'
import sys, platform
from importlib.metadata import version
print("python", sys.version.split()[0], platform.platform())
for p in ("torch", "vllm", "lmcache", "nixl", "nixl-cu13", "pydantic", "aiohttp",
          "numpy", "matplotlib", "prometheus-client", "triton"):
    try:
        print(p, version(p))
    except Exception as e:
        print(p, "missing", e)
import torch
print("cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
import pdstack.bench.cli, pdstack.proxy.app, pdstack.launch  # noqa: F401
print("pdstack imports ok")
EOF
    echo "## environment (NCCL/UCX)"; env | grep -E '^(NCCL_|UCX_|TORCH_SYMM|NVSHMEM_)' | sort
  } > "$W/results/machine.txt" 2>&1
  log "machine facts:"; grep -E "H200|^vllm|^lmcache|^nixl|^torch|pdstack imports|missing" "$W/results/machine.txt" | head -12 | tee -a "$W/run.log"
fi

# ------------------------------------------------------------------ 3. start everything
[ -f /tmp/models/deepseek-v2-lite/config.json ] || [ -n "${DRY_RUN:-}" ] || log "WARNING: no /tmp/models/deepseek-v2-lite/config.json (install.sh puts it there)"
# VLLM_SERVER_DEV_MODE: /reset_prefix_cache, to start the -skip sweep as cold as the others
# VLLM_DISABLE_COMPILE_CACHE: six engines compile at once; none may read another's half-written cache
COMMON_ENV=(--env VLLM_SERVER_DEV_MODE=1 --env VLLM_DISABLE_COMPILE_CACHE=1)
start_topology() {  # name [extra launch args...]
  local t=$1; shift
  [ -f "$W/state/launched-$t" ] && return
  touch "$W/state/launched-$t"
  log "launch $t"
  setsid bash -c "'${PD[0]}' ${PD[*]:1} launch -i inventory/h200x2-$t start --log-dir $W/logs/$t \
    --timeout 900 $* ; echo \$? > $W/state/launch-$t.rc" > "$W/logs/launch-$t.out" 2>&1 < /dev/null &
}
for t in "${TOPOLOGIES[@]}"; do
  case $t in
    *-skip) ;;  # started with its base topology
    # the plan sets UCX_TLS=tcp,self,sm for non-RDMA nodes; GPU memory needs UCX's cuda transports
    nixl) start_topology "$t" "${COMMON_ENV[@]}" --env UCX_TLS= ;;
    *) start_topology "$t" "${COMMON_ENV[@]}" ;;
  esac
done

launched_ok() {  # 0 healthy, 1 failed, 2 still starting
  local f="$W/state/launch-$1.rc"
  [ -f "$f" ] || return 2
  [ "$(cat "$f")" = 0 ] && return 0 || return 1
}

probe() {  # one small request through a proxy: does the path work at all?
  "$PY" - "$1" <<'EOF'
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/v1/completions"
body = {"model": "deepseek-v2-lite", "prompt": list(range(100, 900)), "max_tokens": 8,
        "ignore_eos": True, "temperature": 0}
t = time.perf_counter()
try:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    print(f"probe {url}: ok {time.perf_counter() - t:.2f}s usage={out.get('usage')}")
except Exception as e:
    detail = getattr(e, "read", lambda: b"")()[:500]
    print(f"probe {url}: FAILED {e} {detail!r}")
    sys.exit(1)
EOF
}

post() {  # URL: POST with an empty body, log the answer
  "$PY" - "$1" <<'EOF' 2>&1 | tee -a "$W/run.log"
import sys, urllib.request
try:
    with urllib.request.urlopen(urllib.request.Request(sys.argv[1], b"", method="POST"), timeout=30) as r:
        print("POST", sys.argv[1], r.status, r.read()[:200])
except Exception as e:
    print("POST", sys.argv[1], "FAILED", e)
EOF
}

sweep() {  # topology
  local t=$1 port=${PROXY_PORT[$1]}
  local out="$W/results/$t.json"
  local metrics=(--metrics-url "http://127.0.0.1:$port/metrics")
  for p in ${ENGINE_PORTS[$t]}; do metrics+=(--metrics-url "http://127.0.0.1:$p/metrics"); done
  [ "${LMCACHE_HTTP[$t]}" != - ] && metrics+=(--metrics-url "http://127.0.0.1:${LMCACHE_HTTP[$t]}/metrics")
  log "sweep $t: rates $RATES x ${DURATION}s (+${WARMUP}s warm-up) via :$port"
  "${PD[@]}" bench --target "http://127.0.0.1:$port" --token-ids --model deepseek-v2-lite \
    --rates "$RATES" --duration "$DURATION" --warmup "$WARMUP" --drain-timeout 20 \
    --system-prompts 4 --shared-share 0.8 --system-len uniform:2000:6000 \
    --user-len uniform:32:256 --output-len uniform:64:256 --seed 1 --gpus 2 \
    --request-timeout 60 "${metrics[@]}" --label "$t" --output "$out" --no-progress \
    > "$W/logs/bench-$t.out" 2>&1
  local rc=$?
  tail -25 "$W/logs/bench-$t.out" | tee -a "$W/run.log"
  log "sweep $t rc=$rc"
  # the bench exits 1 when requests failed; its JSON still holds the sweep: never run it twice
  # (a second run would start with warm caches and not be comparable)
  [ -f "$out" ] && touch "$W/state/swept-$t"
}

SWEEP_EST=$(( $(echo "$RATES" | tr ',' '\n' | wc -l) * (DURATION + WARMUP + 8) + 40 ))
for t in "${TOPOLOGIES[@]}"; do
  [ -f "$W/state/swept-$t" ] && continue
  [ -f "$W/state/failed-$t" ] && continue
  base=${t%-skip}
  while launched_ok "$base"; [ $? -eq 2 ]; do
    [ "$(left)" -lt 15 ] && { log "budget spent while $base starts"; exit 0; }
    sleep 5
  done
  if ! launched_ok "$base"; then
    log "$base failed to start:"; tail -60 "$W/logs/launch-$base.out" | tee -a "$W/run.log"
    touch "$W/state/failed-$t"; continue
  fi
  if [ "$t" != "$base" ] && [ ! -f "$W/state/proxy-$t" ]; then
    # same engines and LMCache as $base, made cold again; only the proxy differs
    post "http://127.0.0.1:${LMCACHE_HTTP[$t]}/cache/clear"
    for p in ${ENGINE_PORTS[$t]}; do post "http://127.0.0.1:$p/reset_prefix_cache"; done
    "${PD[@]}" launch -i "inventory/h200x2-$t" start --services proxy \
      --log-dir "$W/logs/$t" --timeout 60 2>&1 | tee -a "$W/run.log"
    touch "$W/state/proxy-$t"
  fi
  if [ "$(left)" -lt "$SWEEP_EST" ]; then
    log "left $(left)s < ${SWEEP_EST}s for sweep $t: stop here, call again"; exit 0
  fi
  if ! probe "${PROXY_PORT[$t]}" 2>&1 | tee -a "$W/run.log" | grep -q ": ok"; then
    for f in "$W"/logs/"$base"/*.log; do echo "== $f"; tail -30 "$f"; done >> "$W/run.log"
    touch "$W/state/failed-$t"; continue
  fi
  sweep "$t"
done

all_done=1
for t in "${TOPOLOGIES[@]}"; do
  [ -f "$W/state/swept-$t" ] || [ -f "$W/state/failed-$t" ] || all_done=0
done
if [ $all_done = 1 ] && [ ! -f "$W/state/stopped" ]; then
  log "all sweeps done: stopping every service"
  for ((i=${#TOPOLOGIES[@]}-1; i>=0; i--)); do
    t=${TOPOLOGIES[$i]}
    "${PD[@]}" launch -i "inventory/h200x2-$t" stop --log-dir "$W/logs/$t" --grace 20 2>&1 | tail -3 >> "$W/run.log"
  done
  nvidia-smi --query-gpu=index,memory.used --format=csv >> "$W/run.log"
  touch "$W/state/stopped"
fi
log "status: $(ls "$W/state" | tr '\n' ' ')"
