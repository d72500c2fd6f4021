#!/bin/bash
# Drive the KV-tier measurements (issue 23) on the lent 1xH200 machine, from the repo root there.
#
#   bash gpu/run_tiers.sh [BUDGET_S]
#
# Idempotent and resumable (state in /tmp/pdtiers): call it again in the next device call.
#   1. install the payload from /tmp/chunks (once) -> /tmp/site
#   2. machine facts
#   3. start three V2-Lite engines at once on GPU 0 with `pdstack launch` (the plans' commands):
#        E1 = inventory/h200x1-vllm         engine-0 :8170  vLLM with its own defaults, no tier
#        E3 = inventory/h200x1-vllm-native  engine-0 :8180  vLLM + --kv-offloading-size 32
#        E2 = inventory/h200x1              engine-0 :8160  + proxy :8060: pdstack's default
#             single-node GPU stack (native tier 32 GiB from host memory, admission kv + cap)
#   4. one `pdstack bench` sweep per variant (VARIANTS order = priority). Cold caches per
#      variant: the engine's GPU prefix cache reset, and a per-variant vLLM cache_salt on every
#      request, so the same requests miss both the GPU cache and the native tier (which keeps
#      its blocks across /reset_prefix_cache; vLLM keys every cached block by the salt)
#   5. pack results + logs into $OUT/results.tar.gz (always)
#
# PHASES (default "single two-engine pd") picks what runs, in this order:
#   single      E1/E2/E3 above, every single-engine sweep
#   two-engine  two engines on the one GPU: a native tier each (inventory/h200x1-2e) vs one
#               shared LMCache L1 (inventory/h200x1-2e-l1), both behind the planned proxy
#   pd          1P1D on the one GPU, both behind the planned proxy (admission): NIXL alone
#               (inventory/h200x1-nixl) vs NIXL + the native tier on the prefiller
#               (inventory/h200x1-nixl-native: MultiConnector[Nixl, Offloading])
# A phase stops the engines of the phases before it (three V2-Lite engines fit the GPU at most).
set -uo pipefail
T0=$(date +%s)
BUDGET=${1:-560}
REPO=$(pwd)
W=${W:-/tmp/pdtiers}
SITE=${SITE:-/tmp/site}
OUTDIR=${OUT:-$W/out}
mkdir -p "$W/results" "$W/logs" "$W/state" "$OUTDIR"
DURATION=${DURATION:-20}
WARMUP=${WARMUP:-5}
RATES_MT=${RATES_MT:-8,16,24,32}
RATES_TURN=${RATES_TURN:-8,16}
RATES_SEED=${RATES_SEED:-8,16,24}
PHASES=${PHASES:-single two-engine pd}
want() { case " $PHASES " in *" $1 "*) return 0;; esac; return 1; }

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }
log() { echo "[tiers +$(elapsed)s] $*" | tee -a "$W/run.log"; }
pack() {
  for d in "$W"/logs/*/; do
    [ -d "$d" ] || continue
    for f in "$d"*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$f.tail"; done
  done
  tar -C "$W" -czf "$OUTDIR/results.tar.gz" --exclude='*.log' results logs run.log state 2>/dev/null
  cp "$W/run.log" "$OUTDIR/run.log" 2>/dev/null
  log "packed $(du -h "$OUTDIR/results.tar.gz" | cut -f1)"
}
trap pack EXIT

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

if [ ! -f "$W/results/machine.txt" ]; then
  {
    echo "# h200x1-tiers machine facts, $(date -u +%FT%TZ)"
    uname -a; nproc; free -g; df -h /tmp | tail -1
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
    "$PY" - <<'EOF'
import sys
from importlib.metadata import version
print("python", sys.version.split()[0])
for p in ("torch", "vllm", "lmcache", "nixl", "aiohttp"):
    try:
        print(p, version(p))
    except Exception as e:
        print(p, "missing", e)
EOF
    invs=""
    want single && invs="$invs h200x1-vllm h200x1-vllm-native h200x1"
    want two-engine && invs="$invs h200x1-2e h200x1-2e-l1"
    want pd && invs="$invs h200x1-nixl h200x1-nixl-native"
    for inv in $invs; do
      echo "## $inv"; "${PD[@]}" plan -i "inventory/$inv" --json | "$PY" -c \
        "import json,sys; p=json.load(sys.stdin); [print(s['name'], ' '.join(s['command'])) for n in p['nodes'].values() for s in n['services']]"
    done
  } > "$W/results/machine.txt" 2>&1
  grep -E "H200|^vllm|^torch|missing|vllm serve" "$W/results/machine.txt" | cut -c1-220 | tee -a "$W/run.log"
fi

# sweeps already brought back from an earlier machine (their JSONs are in the repo)
for d in ${DONE:-}; do touch "$W/state/swept-$d"; done
# UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: NIXL's READ over cuda_ipc on a GPU without active NVLinks
# (UCX turns it off there and falls back to TCP: gpu/run_h200x1.sh, results/h200x1)
ENV=(--env VLLM_SERVER_DEV_MODE=1 --env VLLM_DISABLE_COMPILE_CACHE=1 --env UCX_TLS=
     --env UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y)
start() {  # key inventory services
  local key=$1 inv=$2 svcs=$3
  [ -f "$W/state/launched-$key" ] && return
  touch "$W/state/launched-$key"
  log "launch $key: $inv $svcs"
  setsid bash -c "'${PD[0]}' ${PD[*]:1} launch -i $inv start --services $svcs --log-dir $W/logs/$key \
    --timeout 900 ${ENV[*]} ; echo \$? > $W/state/launch-$key.rc" > "$W/logs/launch-$key.out" 2>&1 < /dev/null &
}
stop() {  # key inventory (no-op unless it was launched)
  [ -f "$W/state/launched-$1" ] || return 0
  [ -f "$W/state/stopped-$1" ] && return
  "${PD[@]}" launch -i "$2" stop --log-dir "$W/logs/$1" --grace 15 2>&1 | tail -2 >> "$W/run.log"
  touch "$W/state/stopped-$1"
}
wait_up() {  # key...: 0 when all healthy, 1 when one failed, 2 when the budget ran out
  local k
  for k in "$@"; do
    while [ ! -f "$W/state/launch-$k.rc" ]; do
      [ "$(left)" -lt 20 ] && return 2
      sleep 5
    done
    if [ "$(cat "$W/state/launch-$k.rc")" != 0 ]; then
      log "$k failed to start:"; tail -40 "$W/logs/launch-$k.out" | tee -a "$W/run.log"
      return 1
    fi
  done
  return 0
}
post() {
  "$PY" - "$1" <<'EOF' 2>&1 | tee -a "$W/run.log"
import sys, urllib.request
try:
    with urllib.request.urlopen(urllib.request.Request(sys.argv[1], b"", method="POST"), timeout=30) as r:
        print("POST", sys.argv[1], r.status)
except Exception as e:
    print("POST", sys.argv[1], "FAILED", e)
EOF
}
E1=http://127.0.0.1:8170 E3=http://127.0.0.1:8180 E2=http://127.0.0.1:8160 P2=http://127.0.0.1:8060
MODEL=deepseek-v2-lite
# the issue-23 many-tenants workload: 200 shared prompts of 1.5-5 k tokens (~1.9x one engine's
# 345 k-token GPU KV), 85 % reuse, user 64-512, answers 48-160
MT=(--scenario many-tenants --system-prompts 200 --system-len uniform:1500:5000 --shared-share 0.85
    --user-len uniform:64:512 --output-len uniform:48:160)
TURN=(--scenario multi-turn)
SEED=(--scenario seed)

# variant: name rates engine target workload...
run_variant() {
  local name=$1 rates=$2 engine=$3 target=$4; shift 4
  local out="$W/results/$name.json"
  [ -f "$W/state/swept-$name" ] || [ -f "$W/state/failed-$name" ] && return 0
  local n; n=$(echo "$rates" | tr ',' '\n' | wc -l)
  local est=$(( n * (DURATION + 14) + WARMUP + 20 ))
  if [ "$(left)" -lt "$est" ]; then log "left $(left)s < ${est}s for $name: call again"; exit 0; fi
  local e metrics=()
  for e in ${engine//,/ }; do post "$e/reset_prefix_cache"; metrics+=(--metrics-url "$e/metrics"); done
  [ "$target" != "$engine" ] && metrics+=(--metrics-url "$target/metrics")
  log "sweep $name: rates $rates x ${DURATION}s via $target $*"
  "${PD[@]}" bench --target "$target" --token-ids --model "$MODEL" "$@" \
    --rates "$rates" --duration "$DURATION" --warmup "$WARMUP" --drain-timeout 12 \
    --seed 1 --gpus 1 --request-timeout 120 --cache-salt "$name" "${metrics[@]}" \
    --label "$name" --output "$out" --no-progress > "$W/logs/bench-$name.out" 2>&1
  local rc=$?
  tail -8 "$W/logs/bench-$name.out" | tee -a "$W/run.log"
  log "sweep $name rc=$rc"
  if [ -f "$out" ]; then touch "$W/state/swept-$name"; else touch "$W/state/failed-$name"; fi
}

if want single; then
start e1 inventory/h200x1-vllm engine-0
start e3 inventory/h200x1-vllm-native engine-0
start e2 inventory/h200x1 engine-0,proxy
wait_up e1 e3 e2 || exit 0
# a direct probe of the native-tier metric names (the KV dashboard's panel reads them)
"$PY" - "$E2/metrics" > "$W/results/e2-metric-names.txt" 2>&1 <<'EOF'
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
print("\n".join(sorted({l.split("{")[0].split(" ")[0] for l in text.splitlines()
                        if l.startswith("vllm:kv_offload") or l.startswith("vllm:external")})))
EOF

# priority order: the acceptance's comparisons first, repeats and extras after
run_variant mt-vllm "$RATES_MT" $E1 $E1 "${MT[@]}"
run_variant mt-native "$RATES_MT" $E3 $E3 "${MT[@]}"
run_variant mt-pdstack "$RATES_MT" $E2 $P2 "${MT[@]}"
run_variant turn-vllm "$RATES_TURN" $E1 $E1 "${TURN[@]}"
run_variant turn-pdstack "$RATES_TURN" $E2 $P2 "${TURN[@]}"
run_variant seed-vllm "$RATES_SEED" $E1 $E1 "${SEED[@]}"
run_variant seed-pdstack "$RATES_SEED" $E2 $P2 "${SEED[@]}"
run_variant mt-pdstack-rep "$RATES_MT" $E2 $P2 "${MT[@]}"
# where the default stack's multi-turn / seed TTFT goes: the tier alone (E3) and the proxy
# with admission alone (E1 behind h200x1-vllm's planned proxy, :8070)
start e1p inventory/h200x1-vllm proxy
P1=http://127.0.0.1:8070; wait_up e1p || P1=""
run_variant turn-native "$RATES_TURN" $E3 $E3 "${TURN[@]}"
[ -n "$P1" ] && run_variant turn-vllm-proxy "$RATES_TURN" $E1 $P1 "${TURN[@]}"
run_variant mt-vllm-rep "$RATES_MT" $E1 $E1 "${MT[@]}"
run_variant seed-native "$RATES_SEED" $E3 $E3 "${SEED[@]}"
[ -n "$P1" ] && run_variant seed-vllm-proxy "$RATES_SEED" $E1 $P1 "${SEED[@]}"
fi

# two engines on the one GPU: a native tier each vs one shared LMCache L1 (same 32 GiB of host
# RAM), both behind the planned proxy (prefix/session affinity + admission)
RATES_2E=${RATES_2E:-16,32,48}
if want two-engine && { [ ! -f "$W/state/swept-mt2-native${REP:-}" ] || [ ! -f "$W/state/swept-mt2-l1${REP:-}" ]; }; then
  stop e1p inventory/h200x1-vllm; stop e1 inventory/h200x1-vllm; stop e3 inventory/h200x1-vllm-native
  stop e2 inventory/h200x1
  start b1 inventory/h200x1-2e engine-0,engine-1,proxy
  wait_up b1 || exit 0
  run_variant "mt2-native${REP:-}" "$RATES_2E" http://127.0.0.1:8190,http://127.0.0.1:8191 http://127.0.0.1:8090 "${MT[@]}"
  stop b1 inventory/h200x1-2e
  start b2 inventory/h200x1-2e-l1 lmcache,engine-0,engine-1,proxy
  wait_up b2 || exit 0
  run_variant "mt2-l1${REP:-}" "$RATES_2E" http://127.0.0.1:8195,http://127.0.0.1:8196 http://127.0.0.1:8095 "${MT[@]}" \
    --metrics-url http://127.0.0.1:6091/metrics
fi
stop b2 inventory/h200x1-2e-l1

# 1P1D on the one GPU (a prefiller and a decoder, 10 GiB KV each), the planned proxy in front
RATES_PD=${RATES_PD:-8,16,24}
if want pd && { [ ! -f "$W/state/swept-mtpd-nixl" ] || [ ! -f "$W/state/swept-mtpd-native" ]; }; then
  stop e1p inventory/h200x1-vllm; stop e1 inventory/h200x1-vllm; stop e3 inventory/h200x1-vllm-native
  stop e2 inventory/h200x1; stop b1 inventory/h200x1-2e; stop b2 inventory/h200x1-2e-l1
  start d1 inventory/h200x1-nixl prefill-0,decode-0,proxy
  wait_up d1 || exit 0
  run_variant mtpd-nixl "$RATES_PD" http://127.0.0.1:8111,http://127.0.0.1:8112 http://127.0.0.1:8011 "${MT[@]}"
  stop d1 inventory/h200x1-nixl
  start d2 inventory/h200x1-nixl-native prefill-0,decode-0,proxy
  wait_up d2 || exit 0
  run_variant mtpd-native "$RATES_PD" http://127.0.0.1:8115,http://127.0.0.1:8116 http://127.0.0.1:8013 "${MT[@]}"
  stop d2 inventory/h200x1-nixl-native
fi
log "status: $(ls "$W/state" | tr '\n' ' ')"
touch "$W/state/all-done"
