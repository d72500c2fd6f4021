#!/bin/bash
# Issue 24's noisy neighbour on a real GPU engine (the lent 1xH200), from the repo root there.
#
#   bash gpu/run_tenants.sh [BUDGET_S]
#
# Idempotent and resumable (state in /tmp/pdten): call it again in the next device call.
#   1. install the payload from /tmp/chunks (once) -> /tmp/site
#   2. a 0600 secrets file with two random tenant keys (PDSTACK_TENANT_KEYS); the bench reads
#      them from PDSTACK_BENCH_KEY_<NAME> (never argv)
#   3. `pdstack launch` inventory/h200x1-tenants: engine-0 (pdstack's default single-GPU
#      engine: V2-Lite, native tier) + its planned proxy :8062 (admission kv, fair queuing);
#      beside it the same proxy with --admission-fairness off on :8063 (one FIFO)
#   4. `pdstack bench --scenario many-tenants` sweeps (VARIANTS order), each with its own vLLM
#      cache_salt (cold caches):
#        b-alone  beta alone at BETA_RATE via the fair proxy
#        fair     alpha flooding at ALPHA_RATE + beta at BETA_RATE via the fair proxy
#        fifo     the same via the FIFO proxy (:8063)
#        shared   alpha at about the engine's capacity (SHARED_RATE) + beta: what sharing costs
#        cap64    the flood via a fair proxy with --admission-max-running 64 (:8064)
#   5. pack results + logs into $OUT/results.tar.gz (always)
set -uo pipefail
T0=$(date +%s)
BUDGET=${1:-560}
REPO=$(pwd)
W=${W:-/tmp/pdten}
SITE=${SITE:-/tmp/site}
OUTDIR=${OUT:-$W/out}
mkdir -p "$W/results" "$W/logs" "$W/state" "$OUTDIR"
DURATION=${DURATION:-30}
WARMUP=${WARMUP:-5}
BETA_RATE=${BETA_RATE:-4}
ALPHA_RATE=${ALPHA_RATE:-300}   # ~10x the engine's many-tenants capacity (results/h200x1-tiers)
SHARED_RATE=${SHARED_RATE:-30}  # alpha at about the engine's capacity: sharing, no flood
VARIANTS=${VARIANTS:-b-alone fair fifo shared cap64}

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }
log() { echo "[tenants +$(elapsed)s] $*" | tee -a "$W/run.log"; }
# shellcheck source=gpu/lib.sh
source "$REPO/gpu/lib.sh"
trap gpu_pack EXIT
gpu_install || exit 1
PY=python3
PD=("$PY" -m pdstack.cli)
INV=inventory/h200x1-tenants

SECRETS=$W/secrets.env
if [ ! -f "$SECRETS" ]; then
  (umask 077; "$PY" -c "import secrets; print('PDSTACK_TENANT_KEYS=alpha:sk-' + \
secrets.token_hex(16) + ',beta:sk-' + secrets.token_hex(16))" > "$SECRETS")
fi
KEYS=$(sed -n 's/^PDSTACK_TENANT_KEYS=//p' "$SECRETS")
PDSTACK_BENCH_KEY_ALPHA=$(echo "$KEYS" | tr ',' '\n' | sed -n 's/^alpha://p')
PDSTACK_BENCH_KEY_BETA=$(echo "$KEYS" | tr ',' '\n' | sed -n 's/^beta://p')
export PDSTACK_BENCH_KEY_ALPHA PDSTACK_BENCH_KEY_BETA

if [ ! -f "$W/results/machine.txt" ]; then
  { echo "# h200x1-tenants machine facts, $(date -u +%FT%TZ)"; uname -a; nproc; free -g
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "${PD[@]}" plan -i "$INV" --json | "$PY" -c \
      "import json,sys; p=json.load(sys.stdin); [print(s['name'], ' '.join(s['command'])) for n in p['nodes'].values() for s in n['services']]"
  } > "$W/results/machine.txt" 2>&1
fi

ENV=(--env VLLM_SERVER_DEV_MODE=1 --env VLLM_DISABLE_COMPILE_CACHE=1)
LOGD=$W/logs/t
if [ ! -f "$W/state/launched" ]; then
  touch "$W/state/launched"
  log "launch $INV engine-0,proxy"
  setsid bash -c "'${PD[0]}' ${PD[*]:1} launch -i $INV start --services engine-0,proxy \
    --log-dir $LOGD --timeout 900 --secrets-env $SECRETS ${ENV[*]} ; echo \$? > $W/state/launch.rc" \
    > "$W/logs/launch.out" 2>&1 < /dev/null &
fi
while [ ! -f "$W/state/launch.rc" ]; do
  [ "$(left)" -lt 30 ] && { log "engine not up yet: call again"; exit 0; }
  sleep 5
done
if [ "$(cat "$W/state/launch.rc")" != 0 ]; then
  log "launch failed:"; tail -40 "$W/logs/launch.out" | tee -a "$W/run.log"; exit 1
fi
E=http://127.0.0.1:8162 P=http://127.0.0.1:8062 F=http://127.0.0.1:8063
extra_proxy() {  # name port flags...: the planned proxy's command on another port, other flags
  local name=$1 port=$2; shift 2
  [ -f "$W/state/proxy-$name" ] && return 0
  touch "$W/state/proxy-$name"
  log "proxy $name :$port (the planned proxy's flags + $*)"
  (set -a; source "$SECRETS"; set +a
   setsid "${PD[@]}" proxy --backends "$LOGD/backends.json" --host 127.0.0.1 --port "$port" \
     --admission kv --admission-max-running 512 "$@" \
     > "$W/logs/proxy-$name.out" 2>&1 < /dev/null &)
  for _ in $(seq 30); do
    "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
      2>/dev/null && break
    sleep 1
  done
}
extra_proxy fifo 8063 --admission-fairness off
# a fair proxy with a lower running cap (the later flag wins): A's batch beside B is smaller
extra_proxy cap64 8064 --admission-max-running 64
C=http://127.0.0.1:8064

# the issue-23 many-tenants workload (results/h200x1-tiers): 200 shared prompts of 1.5-5 k
# tokens, 85 % reuse, user 64-512, answers 48-160; each tenant its own prompts
MT=(--scenario many-tenants --system-prompts 200 --system-len uniform:1500:5000 --shared-share 0.85
    --user-len uniform:64:512 --output-len uniform:48:160)
run_variant() {  # name target tenants...
  local name=$1 target=$2; shift 2
  local out="$W/results/$name.json"
  [ -f "$W/state/swept-$name" ] || [ -f "$W/state/failed-$name" ] && return 0
  local est=$(( DURATION + WARMUP + 60 ))
  if [ "$(left)" -lt "$est" ]; then log "left $(left)s < ${est}s for $name: call again"; exit 0; fi
  local rate=$BETA_RATE t args=()
  for t in "$@"; do args+=(--tenant "$t"); done
  [ $# -gt 1 ] && rate=$(( ${1#alpha:} + BETA_RATE ))
  log "sweep $name: rate $rate x ${DURATION}s via $target $*"
  "${PD[@]}" bench --target "$target" --token-ids --model deepseek-v2-lite "${MT[@]}" \
    "${args[@]}" --rates "$rate" --duration "$DURATION" --warmup "$WARMUP" --drain-timeout 30 \
    --seed 1 --gpus 1 --request-timeout 120 --cache-salt "ten-$name" \
    --metrics-url "$E/metrics" --metrics-url "$target/metrics" \
    --label "$name" --output "$out" --no-progress > "$W/logs/bench-$name.out" 2>&1
  local rc=$?
  tail -12 "$W/logs/bench-$name.out" | tee -a "$W/run.log"
  log "sweep $name rc=$rc"
  if [ -f "$out" ]; then touch "$W/state/swept-$name"; else touch "$W/state/failed-$name"; fi
}
for v in $VARIANTS; do
  case $v in
    b-alone*) run_variant "$v" "$P" beta:1 ;;  # a suffix (-rep): a repeat
    fair*) run_variant "$v" "$P" "alpha:$ALPHA_RATE" "beta:$BETA_RATE" ;;
    fifo*) run_variant "$v" "$F" "alpha:$ALPHA_RATE" "beta:$BETA_RATE" ;;
    shared*) run_variant "$v" "$P" "alpha:$SHARED_RATE" "beta:$BETA_RATE" ;;
    cap64*) run_variant "$v" "$C" "alpha:$ALPHA_RATE" "beta:$BETA_RATE" ;;
  esac
done
log "all variants done"
