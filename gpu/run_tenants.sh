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
#      and what a user without pdstack runs: vLLM with its own defaults (inventory/h200x1-vllm
#      engine-0, :8170, started beside the first engine when a vllm-* or turn-* variant is asked),
#      every tenant's requests sent straight to it (no proxy, no 429s: vLLM queues them all):
#        vllm-b-alone  beta alone          vllm-flood  alpha at ALPHA_RATE + beta
#        vllm-over     alpha at SHARED_RATE + beta
#        engine-flood  the flood straight to the first engine (pdstack's, without its proxy)
#      and a multi-turn repeat (issue 23's missed TTFT P50), one tenant, RATES_TURN x 20 s:
#        turn-vllm     vLLM with its defaults   turn-pdstack  pdstack's default stack (:8062)
#   5. pack results + logs into $OUT/results.tar.gz (always)
set -uo pipefail
DURATION=${DURATION:-30}
WARMUP=${WARMUP:-5}
BETA_RATE=${BETA_RATE:-4}
ALPHA_RATE=${ALPHA_RATE:-300}   # ~10x the engine's many-tenants capacity (results/h200x1-tiers)
SHARED_RATE=${SHARED_RATE:-30}  # alpha at about the engine's capacity: sharing, no flood
VARIANTS=${VARIANTS:-b-alone fair fifo shared cap64}
RATES_TURN=${RATES_TURN:-8,16}
# a flood straight to vLLM holds one connection per queued request (~10 k): the client and the
# engine's API server need the descriptors
ulimit -n 1048576 2>/dev/null || ulimit -n 65536 2>/dev/null

# shellcheck source=gpu/lib.sh
source "$(pwd)/gpu/lib.sh"
gpu_start tenants /tmp/pdten "${1:-}" || exit 1
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
    echo "ulimit -n $(ulimit -n)"
    "${PD[@]}" plan -i "$INV" --json | "$PY" -c \
      "import json,sys; p=json.load(sys.stdin); [print(s['name'], ' '.join(s['command'])) for n in p['nodes'].values() for s in n['services']]"
  } > "$W/results/machine.txt" 2>&1
fi

ENV=(--env VLLM_SERVER_DEV_MODE=1 --env VLLM_DISABLE_COMPILE_CACHE=1)
LOGD=$W/logs/t
launch() {  # key inventory services: detached, its exit code in state/launch-<key>.rc
  local key=$1 inv=$2 svcs=$3
  [ -f "$W/state/launched-$key" ] && return 0
  touch "$W/state/launched-$key"
  log "launch $key: $inv $svcs"
  setsid bash -c "'${PD[0]}' ${PD[*]:1} launch -i $inv start --services $svcs \
    --log-dir $W/logs/$key --timeout 900 --secrets-env $SECRETS ${ENV[*]} ; \
    echo \$? > $W/state/launch-$key.rc" > "$W/logs/launch-$key.out" 2>&1 < /dev/null &
}
wait_up() {  # key: 0 up, 1 failed; exits (call again) when the budget runs out
  while [ ! -f "$W/state/launch-$1.rc" ]; do
    [ "$(left)" -lt 30 ] && { log "$1 not up yet: call again"; exit 0; }
    sleep 5
  done
  [ "$(cat "$W/state/launch-$1.rc")" = 0 ] && return 0
  log "$1 failed to start:"; tail -40 "$W/logs/launch-$1.out" | tee -a "$W/run.log"; return 1
}
launch t "$INV" engine-0,proxy
case " $VARIANTS " in *" vllm-"*|*" turn-"*) launch v inventory/h200x1-vllm engine-0 ;; esac
wait_up t || exit 1
E=http://127.0.0.1:8162 P=http://127.0.0.1:8062 F=http://127.0.0.1:8063 E1=""
[ -f "$W/state/launched-v" ] && wait_up v && E1=http://127.0.0.1:8170
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

quiesce() {  # engine: wait (<= 90 s) until it runs and queues nothing (a flood's aborts)
  "$PY" - "$1/metrics" <<'PYEOF' 2>&1 | tee -a "$W/run.log"
import sys, time, urllib.request
for i in range(90):
    text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
    busy = sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
    if busy == 0:
        print(f"{sys.argv[1]}: idle after {i} s")
        break
    time.sleep(1)
else:
    print(f"{sys.argv[1]}: still {busy:.0f} requests after 90 s")
PYEOF
}
sweep() {  # name engine target rates duration workload/tenant args...
  local name=$1 engine=$2 target=$3 rates=$4 dur=$5; shift 5
  local out="$W/results/$name.json"
  [ -f "$W/state/swept-$name" ] || [ -f "$W/state/failed-$name" ] && return 0
  [ -n "$engine" ] || { log "no engine for $name"; touch "$W/state/failed-$name"; return 0; }
  local n; n=$(echo "$rates" | tr ',' '\n' | wc -l)
  local est=$(( n * (dur + 35) + WARMUP + 30 ))
  if [ "$(left)" -lt "$est" ]; then log "left $(left)s < ${est}s for $name: call again"; exit 0; fi
  quiesce "$engine"
  local metrics=(--metrics-url "$engine/metrics")
  [ "$target" != "$engine" ] && metrics+=(--metrics-url "$target/metrics")
  log "sweep $name: rates $rates x ${dur}s via $target $*"
  "${PD[@]}" bench --target "$target" --token-ids --model deepseek-v2-lite "$@" \
    --rates "$rates" --duration "$dur" --warmup "$WARMUP" --drain-timeout 30 \
    --seed 1 --gpus 1 --request-timeout 120 --cache-salt "ten-$name" "${metrics[@]}" \
    --label "$name" --output "$out" --no-progress > "$W/logs/bench-$name.out" 2>&1
  local rc=$?
  tail -12 "$W/logs/bench-$name.out" | tee -a "$W/run.log"
  log "sweep $name rc=$rc"
  if [ -f "$out" ]; then touch "$W/state/swept-$name"; else touch "$W/state/failed-$name"; fi
}
run_variant() {  # name engine target tenants...: GPU_MT (each tenant its own prompts), one
                 # rate = the shares' sum
  local name=$1 engine=$2 target=$3; shift 3
  local rate=$BETA_RATE t args=()
  for t in "$@"; do args+=(--tenant "$t"); done
  [ $# -gt 1 ] && rate=$(( ${1#alpha:} + BETA_RATE ))
  sweep "$name" "$engine" "$target" "$rate" "$DURATION" "${GPU_MT[@]}" "${args[@]}"
}
FLOOD=("alpha:$ALPHA_RATE" "beta:$BETA_RATE")
for v in $VARIANTS; do
  case $v in  # a suffix (-rep): a repeat
    b-alone*) run_variant "$v" "$E" "$P" beta:1 ;;
    fair*) run_variant "$v" "$E" "$P" "${FLOOD[@]}" ;;
    fifo*) run_variant "$v" "$E" "$F" "${FLOOD[@]}" ;;
    shared*) run_variant "$v" "$E" "$P" "alpha:$SHARED_RATE" "beta:$BETA_RATE" ;;
    cap64*) run_variant "$v" "$E" "$C" "${FLOOD[@]}" ;;
    vllm-b-alone*) run_variant "$v" "$E1" "$E1" beta:1 ;;
    vllm-flood*) run_variant "$v" "$E1" "$E1" "${FLOOD[@]}" ;;
    vllm-over*) run_variant "$v" "$E1" "$E1" "alpha:$SHARED_RATE" "beta:$BETA_RATE" ;;
    engine-flood*) run_variant "$v" "$E" "$E" "${FLOOD[@]}" ;;
    turn-vllm*) sweep "$v" "$E1" "$E1" "$RATES_TURN" 20 --scenario multi-turn --tenant beta:1 ;;
    turn-pdstack*) sweep "$v" "$E" "$P" "$RATES_TURN" 20 --scenario multi-turn --tenant beta:1 ;;
    *) log "unknown variant $v" ;;
  esac
done
log "all variants done"
