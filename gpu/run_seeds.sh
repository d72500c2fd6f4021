#!/bin/bash
# Issue 35: every seed KV mode on the one lent H200, from the repo root there.
#
#   bash gpu/run_seeds.sh [BUDGET_S]
#
# Idempotent and resumable (state in /tmp/pdseeds): call it again in the next device call
# while the machine is warm. The modes are data (SEEDS below: key, inventory, extra launch
# flags); each step of each mode leaves a state file, so a call picks up where the last one
# stopped.
#   1. install the payload from /tmp/chunks (once); the mini model's config into /tmp/models
#   2. `pdstack launch` every LAUNCHES entry at once, detached (nixl-2p2d --foreground: the
#      supervisor the fault step needs); all 16 engines of the mini model share GPU 0
#   3. per mode, in SEEDS order: gpu/seeds_check.py (tokens against the colocated yardstick,
#      KV-path counters) and a short many-tenants sweep (RATES x DURATION s) via its proxy
#   4. the fault: nixl-2p2d under FAULT_RATE req/s, prefill-0's process group SIGKILLed after
#      FAULT_AT s; the launcher starts it again; then FAULT_RATE req/s for 10 s more and
#      prefill-0's counters show it serving
#   5. pack results + logs into $OUT/results.tar.gz (always)
set -uo pipefail
RATES=${RATES:-8,16}
DURATION=${DURATION:-20}
WARMUP=${WARMUP:-3}
FAULT_RATE=${FAULT_RATE:-8}
FAULT_S=${FAULT_S:-40}
FAULT_AT=${FAULT_AT:-12}
MODEL=deepseek-v2-mini

# shellcheck source=gpu/lib.sh
source "$(pwd)/gpu/lib.sh"
gpu_start seeds /tmp/pdseeds "${1:-}" || exit 1
mkdir -p /tmp/models && cp -r "$REPO/gpu/models/$MODEL" /tmp/models/
# LMCache's in-process connector (lmcache-pd) imports aiofile, which the payload lacks
# (run 1: "No module named 'aiofile'"): wheels carried in gpu/payload/extra (pip download
# --no-deps aiofile caio aiofiles sortedcontainers nvtx redis py-cpuinfo, cp312 manylinux),
# unpacked into the site folder when missing there
if ! python3 -c "import aiofile" 2>/dev/null; then
  for whl in "$REPO"/gpu/payload/extra/*.whl; do
    [ -f "$whl" ] && python3 -m zipfile -e "$whl" "$SITE" && log "unpacked $(basename "$whl")"
  done
fi
PY=python3
PD=("$PY" -m pdstack.cli)

# the modes (data): key inventory; the colocated yardstick first
SEEDS=(
  "colocated inventory/h200x1-seed-colocated"
  "lmcache-pd inventory/h200x1-seed-lmcache-pd"
  "nixl-2p2d inventory/h200x1-seed-nixl-2p2d"
  "shared-l1-1p2d inventory/h200x1-seed-shared-l1-1p2d"
  "shared-l1-nixl inventory/h200x1-seed-shared-l1-nixl"
  "nixl-l1 inventory/h200x1-seed-nixl-l1"
  "colocated-l1 inventory/h200x1-seed-colocated-l1"
)
# what to start (data): launch key, inventory, flags; node b of the two pretend nodes first
LAUNCHES=(
  "colocated inventory/h200x1-seed-colocated"
  "lmcache-pd inventory/h200x1-seed-lmcache-pd"
  "nixl-2p2d inventory/h200x1-seed-nixl-2p2d --foreground --wedge-s 60"
  "shared-l1-1p2d inventory/h200x1-seed-shared-l1-1p2d"
  "shared-l1-nixl-b inventory/h200x1-seed-shared-l1-nixl --node b"
  "shared-l1-nixl inventory/h200x1-seed-shared-l1-nixl --node a"
  "nixl-l1 inventory/h200x1-seed-nixl-l1"
  "colocated-l1 inventory/h200x1-seed-colocated-l1"
)
# SEEDS_ONLY="k1 k2": only these modes (and their launches, node b's included)
if [ -n "${SEEDS_ONLY:-}" ]; then
  keep() { local e; for e in "$@"; do for k in $SEEDS_ONLY; do
    case "$e" in "$k "*|"$k-b "*) echo "$e";; esac; done; done; }
  mapfile -t SEEDS < <(keep "${SEEDS[@]}"); mapfile -t LAUNCHES < <(keep "${LAUNCHES[@]}")
fi
YARDSTICK=http://127.0.0.1:8310   # inventory/h200x1-seed-colocated's engine-0

if [ ! -f "$W/results/machine.txt" ]; then
  { echo "# h200x1-seeds machine facts, $(date -u +%FT%TZ)"; uname -a; nproc; free -g
    gpu_facts
    for l in "${LAUNCHES[@]}"; do
      read -r _ inv _ <<< "$l"; echo "== $inv"
      "${PD[@]}" plan -i "$inv" --json | "$PY" -c "import json,sys; p=json.load(sys.stdin); \
[print(s['node'], s['name'], ' '.join(s['command'])) for n in p['nodes'].values() for s in n['services']]"
    done | awk '!seen[$0]++'
  } > "$W/results/machine.txt" 2>&1
fi

for l in "${LAUNCHES[@]}"; do
  read -r key inv flags <<< "$l"
  # shellcheck disable=SC2086
  gpu_launch "$key" "$inv" "" $flags ${EXTRA_ENV:-}
done

up() {  # launch key: 0 up, 1 failed, 2 still starting
  grep -q "all services healthy" "$W/logs/launch-$1.out" 2>/dev/null && return 0
  [ -f "$W/state/launch-$1.rc" ] && return 1
  return 2
}
while :; do
  pending=0
  for l in "${LAUNCHES[@]}"; do read -r key _ <<< "$l"; up "$key"; [ $? = 2 ] && pending=1; done
  [ $pending = 0 ] && break
  [ "$(left)" -lt 30 ] && { log "still starting: call again"; exit 0; }
  sleep 5
done
if [ ! -f "$W/state/started" ]; then
  touch "$W/state/started"
  for l in "${LAUNCHES[@]}"; do
    read -r key _ <<< "$l"
    up "$key"; rc=$?
    log "$key: $([ $rc = 0 ] && echo up || echo FAILED) $(grep -h 'healthy after' \
      "$W/logs/launch-$key.out" | sed 's/.*] //' | tr '\n' ';')"
    [ $rc = 1 ] && tail -30 "$W/logs/launch-$key.out" >> "$W/run.log"
  done
  { echo "# GPU memory per process after every start"; nvidia-smi
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv; } > "$W/results/gpu-memory.txt" 2>&1
fi

check() {  # key inventory
  [ -f "$W/state/check-$1" ] && return 0
  http_get "$YARDSTICK/health" > /dev/null || { log "no yardstick: no check of $1"; return 0; }
  log "check $1"
  # LMCache's API is a socket in each node's launch log folder (node b: the <key>-b launch)
  local nodes; nodes=$("$PY" -m pdstack.cli plan -i "$2" --json | "$PY" -c \
    "import json,sys; print(' '.join(json.load(sys.stdin)['nodes']))")
  local dirs=() n i=0
  for n in $nodes; do
    dirs+=(--log-dir "$n=$W/logs/$1$([ $i -gt 0 ] && echo "-$n")"); i=$((i + 1))
  done
  "$PY" gpu/seeds_check.py --inventory "$2" --yardstick "$YARDSTICK" "${dirs[@]}" \
    --output "$W/results/$1-check.json" 2>&1 | tee -a "$W/run.log"
  touch "$W/state/check-$1"
}
sweep() {  # key inventory
  [ -f "$W/state/bench-$1" ] && return 0
  [ "$(left)" -lt 75 ] && { log "no time for the $1 sweep: call again"; exit 0; }
  local urls; read -r -a urls <<< "$("$PY" gpu/seeds_check.py --inventory "$2" --urls)"
  log "sweep $1: $RATES x ${DURATION}s via ${urls[0]}"
  "${PD[@]}" bench --target "${urls[0]}" --token-ids --model "$MODEL" "${GPU_MT[@]}" \
    --rates "$RATES" --duration "$DURATION" --warmup "$WARMUP" --drain-timeout 20 --seed 1 \
    --gpus 1 --request-timeout 60 "${urls[@]:1}" --label "$1" --no-progress \
    --output "$W/results/$1-bench.json" > "$W/logs/bench-$1.out" 2>&1
  log "sweep $1 rc=$? $(tail -4 "$W/logs/bench-$1.out" | tr '\n' ' ')"
  touch "$W/state/bench-$1"
}
for s in "${SEEDS[@]}"; do
  read -r key inv <<< "$s"
  up "$key" || { log "$key did not start: no check"; continue; }
  check "$key" "$inv"
  sweep "$key" "$inv"
done

# 4. the fault: a prefiller of nixl-2p2d killed under load, supervised back by the launcher
fault() {
  local inv=inventory/h200x1-seed-nixl-2p2d logd=$W/logs/nixl-2p2d urls
  [ -f "$W/state/fault" ] && return 0
  up nixl-2p2d || { log "nixl-2p2d not up: no fault run"; return 0; }
  [ "$(left)" -lt $((FAULT_S + 60)) ] && { log "no time for the fault run: call again"; exit 0; }
  touch "$W/state/fault"
  read -r -a urls <<< "$("$PY" gpu/seeds_check.py --inventory "$inv" --urls)"
  log "fault: ${FAULT_RATE} req/s for ${FAULT_S}s, prefill-0 SIGKILLed at +${FAULT_AT}s"
  "${PD[@]}" bench --target "${urls[0]}" --token-ids --model "$MODEL" "${GPU_MT[@]}" \
    --rates "$FAULT_RATE" --duration "$FAULT_S" --warmup 0 --drain-timeout 30 --seed 2 \
    --gpus 1 --request-timeout 60 "${urls[@]:1}" --label nixl-2p2d-fault --no-progress \
    --output "$W/results/nixl-2p2d-fault-bench.json" > "$W/logs/bench-fault.out" 2>&1 &
  local bench=$!
  sleep "$FAULT_AT"
  local pg; pg=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['pgid'])" "$logd/prefill-0.pid")
  echo "killed prefill-0 pgid $pg at $(date -u +%T.%N)" | tee -a "$W/run.log"
  kill -9 -- "-$pg"
  local t0; t0=$(date +%s.%N)
  wait "$bench"
  log "fault bench rc=$? $(tail -4 "$W/logs/bench-fault.out" | tr '\n' ' ')"
  while ! http_get http://127.0.0.1:8330/health > /dev/null; do
    [ "$(left)" -lt 25 ] && { log "prefill-0 not back yet"; return 0; }
    sleep 1
  done
  echo "prefill-0 healthy again $("$PY" -c "import time; print(round(time.time() - $t0, 1))") s after the kill" \
    | tee -a "$W/run.log" > "$W/results/nixl-2p2d-fault-restart.txt"
  grep -E "prefill-0 (died|wedged)|restarting prefill-0|started prefill-0 again" \
    "$W/logs/launch-nixl-2p2d.out" >> "$W/results/nixl-2p2d-fault-restart.txt"
  http_get http://127.0.0.1:8330/metrics | grep -E "^vllm:(request_success_total|prompt_tokens_total)" \
    > "$W/state/p0-before.txt"
  "${PD[@]}" bench --target "${urls[0]}" --token-ids --model "$MODEL" "${GPU_MT[@]}" \
    --rates "$FAULT_RATE" --duration 10 --warmup 0 --drain-timeout 20 --seed 3 --gpus 1 \
    --request-timeout 60 "${urls[@]:1}" --label nixl-2p2d-after --no-progress \
    --output "$W/results/nixl-2p2d-after-bench.json" > "$W/logs/bench-after.out" 2>&1
  { echo "# prefill-0 after its restart: counters before / after 10 s at ${FAULT_RATE} req/s"
    cat "$W/state/p0-before.txt"; echo "--"
    http_get http://127.0.0.1:8330/metrics | grep -E "^vllm:(request_success_total|prompt_tokens_total)"
  } >> "$W/results/nixl-2p2d-fault-restart.txt"
  log "after the restart: $(tail -4 "$W/logs/bench-after.out" | tr '\n' ' ')"
}
fault
log "done"
