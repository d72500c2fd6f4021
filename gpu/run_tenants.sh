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
DRAIN=30
gpu_tenant_keys alpha beta

if [ ! -f "$W/results/machine.txt" ]; then
  { echo "# h200x1-tenants machine facts, $(date -u +%FT%TZ)"; uname -a; nproc; free -g
    gpu_facts
    echo "ulimit -n $(ulimit -n)"
    "${PD[@]}" plan -i "$INV" --json | "$PY" -c \
      "import json,sys; p=json.load(sys.stdin); [print(s['name'], ' '.join(s['command'])) for n in p['nodes'].values() for s in n['services']]"
  } > "$W/results/machine.txt" 2>&1
fi

gpu_launch t "$INV" engine-0,proxy --secrets-env "$GPU_SECRETS"
case " $VARIANTS " in *" vllm-"*|*" turn-"*) gpu_launch v inventory/h200x1-vllm engine-0 ;; esac
gpu_wait_up t || exit 1
E=http://127.0.0.1:8162 P=http://127.0.0.1:8062 F=http://127.0.0.1:8063 E1=""
[ -f "$W/state/launched-v" ] && gpu_wait_up v && E1=http://127.0.0.1:8170
# the planned proxy's command on other ports, other flags (the later flag wins)
PLANNED=$(gpu_proxy_args t)
# shellcheck disable=SC2086
gpu_proxy fifo 8063 "$REPO" $PLANNED --admission-fairness off
# a fair proxy with a lower running cap: A's batch beside B is smaller
# shellcheck disable=SC2086
gpu_proxy cap64 8064 "$REPO" $PLANNED --admission-max-running 64
C=http://127.0.0.1:8064

sweep() { gpu_sweep "$@" || exit 0; }  # no time left: call again
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
