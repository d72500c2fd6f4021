#!/bin/bash
# `pdstack launch --foreground` healing a real GPU engine (the lent 1xH200), from the repo root.
#
#   bash gpu/run_heal.sh [BUDGET_S]
#
# results/h200x1-tenants run 3 saw vLLM 0.26.0's EngineCore die (native tier, a flood sent
# straight to the engine, then aborted) with its API server left up and /health hung. This
# reproduces that on pdstack's default single-GPU engine (inventory/h200x1 engine-0, :8160)
# started by `pdstack launch start --foreground --wedge-s WEDGE_S`, and records how the
# supervisor brings it back: the crash, the watchdog's verdict, the restart, healthy again,
# then a short sweep that it serves. Resumable (state in /tmp/pdheal): call it again.
set -uo pipefail
WEDGE_S=${WEDGE_S:-30}
FLOOD_RATE=${FLOOD_RATE:-300}
FLOOD_S=${FLOOD_S:-15}
ulimit -n 1048576 2>/dev/null || ulimit -n 65536 2>/dev/null

# shellcheck source=gpu/lib.sh
source "$(pwd)/gpu/lib.sh"
gpu_start heal /tmp/pdheal "${1:-}" || exit 1
PY=python3
PD=("$PY" -m pdstack.cli)
INV=inventory/h200x1
E=http://127.0.0.1:8160
LAUNCH_OUT=$W/logs/launch-foreground.out

if [ ! -f "$W/state/launched" ]; then
  touch "$W/state/launched"
  log "launch $INV engine-0 --foreground --wedge-s $WEDGE_S"
  setsid "${PD[@]}" launch -i "$INV" start --services engine-0 --foreground \
    --wedge-s "$WEDGE_S" --log-dir "$W/logs/h" --timeout 900 \
    > "$LAUNCH_OUT" 2>&1 < /dev/null &
fi
wait_line() {  # text timeout_s: 0 when the launcher printed it
  local t0; t0=$(date +%s)
  until grep -q -- "$1" "$LAUNCH_OUT" 2>/dev/null; do
    [ $(( $(date +%s) - t0 )) -ge "$2" ] && return 1
    [ "$(left)" -lt 25 ] && { log "waiting for '$1': call again"; exit 0; }
    sleep 2
  done
  log "launcher: $(grep -m1 -- "$1" "$LAUNCH_OUT" | cut -c1-200)"
}
wait_line "all services healthy" 600 || { log "engine never healthy"; tail -30 "$LAUNCH_OUT"; exit 1; }

bench() {  # name rate duration drain
  "${PD[@]}" bench --target "$E" --token-ids --model deepseek-v2-lite "${GPU_MT[@]}" --rates "$2" \
    --duration "$3" --warmup 2 --drain-timeout "$4" --seed 1 --gpus 1 --request-timeout 120 \
    --cache-salt "heal-$1" --metrics-url "$E/metrics" --label "$1" \
    --output "$W/results/$1.json" --no-progress > "$W/logs/bench-$1.out" 2>&1
  tail -6 "$W/logs/bench-$1.out" | tee -a "$W/run.log"
}
if [ ! -f "$W/state/flooded" ]; then
  touch "$W/state/flooded"
  log "flood: $FLOOD_RATE req/s x ${FLOOD_S}s straight to the engine, then the client gives up"
  bench flood "$FLOOD_RATE" "$FLOOD_S" 10
  log "flood done"
fi
wait_line "wedged:\|died" $(( WEDGE_S + 90 )) || log "no crash or wedge seen"
grep -E "wedged:|died|restarting|started engine-0 again" "$LAUNCH_OUT" | cut -c1-300 | tee -a "$W/run.log"
if grep -q "restarting" "$LAUNCH_OUT"; then
  until "$PY" -c "import urllib.request; urllib.request.urlopen('$E/health', timeout=3)" 2>/dev/null; do
    [ "$(left)" -lt 25 ] && { log "engine not healthy again yet: call again"; exit 0; }
    sleep 2
  done
  log "engine-0 healthy again"
  [ -f "$W/state/after" ] || { touch "$W/state/after"; bench after 4 10 20; }
fi
grep -h "fatal error\|AssertionError" "$W/logs/h/engine-0.log" 2>/dev/null | tr '\r' '\n' \
  | grep -v APIServer | head -3 | tee -a "$W/run.log"
log "done"
