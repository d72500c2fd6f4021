#!/bin/bash
# Issue 36: admission that costs nothing until it saves something, and one GPU's ceiling, on
# the lent 1xH200, from the repo root there.
#
#   bash gpu/run_ceiling.sh [BUDGET_S]
#
# Idempotent and resumable (state in /tmp/pdceil): call it again in the next device call.
#   1. install the payload from /tmp/chunks (once); machine facts
#   2. `pdstack launch` three V2-Lite engines at once on GPU 0 (10 GiB KV each, the plans'
#      commands), detached: STACKS below. pdstack-default-before is the same engine as
#      pdstack-default behind the OLD proxy (commit 431b547's pdstack, from $OLD_PDSTACK) with
#      the planned proxy's exact arguments (read from the launched proxy) on :8061
#   3. the sweeps (SWEEPS, priority order; a name is [turn-|seed-]STACK[-rN], -rN a repeat
#      written to NAME-rN.json: interleave repeats to see run-to-run noise): one engine under load
#      at a time, each sweep on a quiet engine with its own vLLM cache_salt (cold caches), the
#      same seed and rates for every stack, the engine's and the proxy's counters in the JSON.
#      A sweep that does not fit what is left of this call waits for the next call; a later,
#      shorter one may run first. many-tenants: RATES; while a stack still meets the TTFT SLO
#      at its top rate, one more sweep at the next MORE rates (STACK-to<rate>.json), up to
#      RATES_MAX
#   4. when every sweep is done: the engines stopped but KEEP's (default "v p": vLLM with its
#      defaults and pdstack's default engine, which gpu/run_isolation.sh reuses; KEEP= stops
#      all). STOP_ONLY=1 KEEP= does only this, at once (no sweep resumed or extended)
#   5. pack results + logs into $OUT/results.tar.gz (always)
#
# The old proxy: the device's copy of the repo has no .git. Before the run, here:
#   mkdir -p gpu/payload/old-pdstack && git archive 431b547 pdstack | tar -x -C gpu/payload/old-pdstack
# (0.8 MB) and carry "gpu/payload/old-pdstack" in the driver's calls. Where .git is there (the
# dry run), the driver does that itself.
#
# Budget (DURATION=20, WARMUP=3, DRAIN=12: <= 40 s a rate, less below saturation):
#   start: payload ~40 s + three engines in parallel ~170 s (V2-Lite)       ~210 s
#   many-tenants, 6 rates: ~240 s each x 4 stacks                           ~960 s
#   pdstack's extension while it meets the SLO (2 rates a step)             ~100 s a step
#   multi-turn, 4 rates: ~190 s each; turn-vllm-default, turn-pdstack-default ~380 s
#   seed, 3 rates: ~150 s each; seed-vllm-default, seed-pdstack-default     ~300 s
#   => the acceptance's sweeps (mt x4 + turn x2 + one extension) in three ~9.5 min calls
#      (560 s each); the two seed sweeps and turn-*-before / turn-vllm-native in a fourth.
set -uo pipefail
DURATION=${DURATION:-20}
WARMUP=${WARMUP:-3}
DRAIN=${DRAIN:-12}
RATES=${RATES:-8,16,24,32,40,48}
MORE=${MORE:-8}            # rate step of an extension sweep (2 rates each)
RATES_MAX=${RATES_MAX:-96}
RATES_TURN=${RATES_TURN:-8,16,24,32}
RATES_SEED=${RATES_SEED:-8,16,24}
RATES_LONG=${RATES_LONG:-1,2,3}   # long-input (6-12 k token prompts): below its knee
# pdstack's stack (the p engine + proxy): inventory/h200x1, or a variant on the same ports
# (inventory/h200x1-st2: the tier's store threshold; give it its own W=/tmp/pdceil-...)
PD_INV=${PD_INV:-inventory/h200x1}
SWEEPS=${SWEEPS:-vllm-default vllm-native pdstack-default pdstack-default-before \
turn-vllm-default turn-pdstack-default seed-vllm-default seed-pdstack-default \
turn-pdstack-default-before turn-vllm-native}

# shellcheck source=gpu/lib.sh
source "$(pwd)/gpu/lib.sh"
gpu_start ceiling /tmp/pdceil "${1:-}" || exit 1
OLD_REV=${OLD_REV:-431b547}  # the -before proxy's commit (its tree: OLD_PDSTACK)
OLD_PDSTACK=${OLD_PDSTACK:-$REPO/gpu/payload/old-pdstack}

# the stacks (data): name, engine URL, target URL, launch key, inventory, services
STACKS=(
  "vllm-default http://127.0.0.1:8170 http://127.0.0.1:8170 v inventory/h200x1-vllm engine-0"
  "vllm-native http://127.0.0.1:8180 http://127.0.0.1:8180 n inventory/h200x1-vllm-native engine-0"
  "pdstack-default http://127.0.0.1:8160 http://127.0.0.1:8060 p $PD_INV engine-0,proxy"
  "pdstack-default-before http://127.0.0.1:8160 http://127.0.0.1:8061 p $PD_INV engine-0,proxy"
  # where pdstack's extra latency comes from (run 1: slower at 8 req/s with nothing held): its
  # engine with no proxy (the engine's config), and its proxy with the gate off (the relay)
  "pdstack-engine http://127.0.0.1:8160 http://127.0.0.1:8160 p $PD_INV engine-0,proxy"
  "pdstack-gate-off http://127.0.0.1:8160 http://127.0.0.1:8062 p $PD_INV engine-0,proxy"
  # run 2: the gate held a queue at 24-32 req/s with the engine's KV at 0.78 mean / 0.87 peak
  # (the old gate of results/h200x1-tiers served 32 at 32 req/s): the mark, 0.9 -> 0.97
  "pdstack-kv97 http://127.0.0.1:8160 http://127.0.0.1:8063 p $PD_INV engine-0,proxy"
  # overload run 2 (H100): at the knee the gate held 187 and refused 44 where the native tier
  # met the SLO with 431 preemptions: the preemption caution off
  "pdstack-caution0 http://127.0.0.1:8160 http://127.0.0.1:8064 p $PD_INV engine-0,proxy"
  # overload run 3: below the knee the proxy added 6-35 ms P50 over its engine straight; the
  # request it sends differs by return_token_ids (stream migration): the proxy without it
  "pdstack-nomigr http://127.0.0.1:8160 http://127.0.0.1:8065 p $PD_INV engine-0,proxy"
)
# the workloads (data): sweep-name prefix, rates variable, bench arguments
declare -A WL_RATES=([mt]=RATES [turn]=RATES_TURN [seed]=RATES_SEED [long]=RATES_LONG)
declare -A WL_ARGS=([mt]="${GPU_MT[*]}" [turn]="--scenario multi-turn" [seed]="--scenario seed" [long]="--scenario long-input")

if [ ! -f "$W/results/machine.txt" ]; then
  { echo "# h200x1-ceiling machine facts, $(date -u +%FT%TZ)"; uname -a; nproc; free -g
    gpu_facts
    python3 -c "from importlib.metadata import version as v; print('vllm', v('vllm'))"
    echo "old proxy: $OLD_REV's pdstack from $OLD_PDSTACK"
  } > "$W/results/machine.txt" 2>&1
fi
if [ ! -d "$OLD_PDSTACK/pdstack" ] && git -C "$REPO" cat-file -e "$OLD_REV" 2>/dev/null; then
  mkdir -p "$OLD_PDSTACK" && git -C "$REPO" archive "$OLD_REV" pdstack | tar -x -C "$OLD_PDSTACK"
fi

stack() {  # NAME: "engine target key inventory services" of a stack, or nothing
  local s
  for s in "${STACKS[@]}"; do [ "${s%% *}" = "$1" ] && echo "${s#* }"; done
}
# the launch keys SWEEPS need: only their engines start (a card of ~78 GiB holds one V2-Lite
# engine of 10 GiB KV, an H200 three)
parse_sweep() {  # NAME ([turn-|seed-|long-]STACK[-rN]): prints "WORKLOAD STACK"
  local st=$1 wl=mt
  [[ $st =~ ^(.*)-r[0-9]+$ ]] && st=${BASH_REMATCH[1]}  # a repeat: NAME-rN.json, same stack
  case $st in turn-*|seed-*|long-*) wl=${st%%-*}; st=${st#*-} ;; esac
  echo "$wl $st"
}
# STOP_ONLY=1: no sweep (none resumed or extended), only step 4: the engines stopped but KEEP's
# (frees the GPU for another driver: one V2-Lite engine at a time on an H100)
[ -n "${STOP_ONLY-}" ] && SWEEPS="" && log "STOP_ONLY: the engines stopped but KEEP's (${KEEP-v p})"
NEED=" "
for name in $SWEEPS; do
  read -r _ st <<< "$(parse_sweep "$name")"
  read -r _ _ key _ <<< "$(stack "$st")"
  [ -n "$key" ] && NEED+="$key "
done
needed() { case "$NEED" in *" $1 "*) return 0 ;; esac; return 1; }
for s in "${STACKS[@]}"; do
  read -r _ engine _ key inv svcs <<< "$s"
  needed "$key" || continue
  stock=()
  case $key in v|n) stock=("${GPU_STOCK[@]}") ;; esac  # the baselines: stock vLLM
  # an engine already up on the stack's port (gpu/run_isolation.sh's, the same command) is
  # reused: only the rest of its services start (V2-Lite: ~150 s saved, and a fourth engine
  # would not fit on the GPU beside three)
  if [ ! -f "$W/state/launched-$key" ] && http_get "$engine/health" > /dev/null; then
    svcs=$(echo "$svcs" | tr ',' '\n' | grep -vx 'engine-0' | paste -sd, -)
    log "$key: $engine is up already: reused (starting: ${svcs:-nothing})"
    if [ -z "$svcs" ]; then
      touch "$W/state/launched-$key"
      echo "all services healthy (reused $engine)" > "$W/logs/launch-$key.out"
      continue
    fi
  fi
  gpu_launch "$key" "$inv" "$svcs" "${GPU_SUPERVISE[@]}" "${stock[@]}"
done
for s in "${STACKS[@]}"; do  # a stack that failed to start: its sweeps are marked failed
  read -r _ _ _ key _ <<< "$s"
  needed "$key" || continue
  [ -f "$W/state/down-$key" ] || gpu_wait_up "$key" || touch "$W/state/down-$key"
done
for s in "${STACKS[@]}"; do  # the launches' own lines: how long each engine took
  read -r _ _ _ key _ <<< "$s"
  needed "$key" || continue
  [ -f "$W/state/times-$key" ] && continue
  touch "$W/state/times-$key"; log "$key: $(grep -h 'healthy after' "$W/logs/launch-$key.out" | tr '\n' ';')"
done
[ -d "$OLD_PDSTACK/pdstack" ] || log "no $OLD_PDSTACK/pdstack: no pdstack-default-before (see the header)"
# the extra proxies in front of pdstack's engine (data): stack, proxy name, port, code tree,
# flags after the launched proxy's own. Each runs only during its own sweeps: every proxy
# reads the engine's /metrics, and run 1 had the old one (every 0.1 s) up beside the
# launched proxy through all of pdstack-default's sweeps
EXTRA_PROXIES=(
  "pdstack-default-before before 8061 $OLD_PDSTACK"
  "pdstack-gate-off gate-off 8062 $REPO --admission off"
  "pdstack-kv97 kv97 8063 $REPO --admission-kv-high 0.97"
  "pdstack-caution0 caution0 8064 $REPO --admission-preempt-caution 0"
  "pdstack-nomigr nomigr 8065 $REPO --max-migrations 0"
)
extra_proxy() {  # up|down STACK: start/stop the stack's extra proxy (0 when it has none)
  local e name port code flags
  for e in "${EXTRA_PROXIES[@]}"; do
    [ "${e%% *}" = "$2" ] || continue
    read -r _ name port code flags <<< "$e"
    if [ "$1" = down ]; then gpu_proxy_stop "$name"; rm -f "$W/state/proxy-$name"; return 0; fi
    [ -d "$code/pdstack" ] && [ ! -f "$W/state/down-p" ] || return 1
    # shellcheck disable=SC2046,SC2086
    gpu_proxy "$name" "$port" "$code" $(gpu_proxy_args p) $flags
    return
  done
}

meets_top() {  # JSON: 0 if its highest rate met the TTFT SLO; prints that rate
  python3 - "$1" <<'PYEOF'
import json, sys
r = max(json.load(open(sys.argv[1]))["results"], key=lambda x: x["request_rate"])
print(int(r["request_rate"]))
sys.exit(0 if r.get("meets_ttft_slo") else 1)
PYEOF
}
sweep() {  # NAME: [turn-|seed-]STACK[-rN]; 3 when it does not fit the budget now
  local name=$1 wl st
  read -r wl st <<< "$(parse_sweep "$name")"
  local spec; spec=$(stack "$st")
  [ -n "$spec" ] || { log "unknown sweep $name"; return 0; }
  local engine target key
  read -r engine target key _ <<< "$spec"
  [ -f "$W/state/down-$key" ] && engine=""  # gpu_sweep: "no engine", failed
  local rv=${WL_RATES[$wl]}
  [ -f "$W/state/failed-$name" ] || extra_proxy up "$st" \
    || { log "no proxy for $st: skip $name"; touch "$W/state/failed-$name"; return 0; }
  local rc=0
  # shellcheck disable=SC2086
  gpu_sweep "$name" "$engine" "$target" "${!rv}" "$DURATION" ${WL_ARGS[$wl]} || rc=$?
  if [ "$wl" = mt ] && [ $rc = 0 ]; then extend "$name" "$engine" "$target" || rc=$?; fi
  extra_proxy down "$st"
  return $rc
}
extend() {  # NAME ENGINE TARGET: the ceiling: more rates while the stack meets the SLO at its top
  local name=$1 engine=$2 target=$3 last=$1 top
  while [ -f "$W/results/$last.json" ] && top=$(meets_top "$W/results/$last.json"); do
    local next="$((top + MORE)),$((top + 2 * MORE))"
    [ $((top + MORE)) -le "$RATES_MAX" ] || break
    last=$name-to$((top + 2 * MORE))
    # shellcheck disable=SC2086
    gpu_sweep "$last" "$engine" "$target" "$next" "$DURATION" ${WL_ARGS[mt]} || return $?
  done
}
pending=0
for name in $SWEEPS; do sweep "$name" || pending=1; done
if [ $pending = 1 ]; then log "sweeps left for the next call: $(left)s left"; exit 0; fi
log "all sweeps done: $(ls "$W/state" | grep -c '^swept-') swept, $(ls "$W/state" | grep -c '^failed-') failed"
for s in "${STACKS[@]}"; do  # KEEP: launch keys left running (run_isolation.sh reuses v and p)
  read -r _ _ _ key inv _ <<< "$s"
  case " ${KEEP-v p} " in *" $key "*) ;; *) gpu_stop "$key" "$inv" ;; esac
done
touch "$W/state/all-done"
