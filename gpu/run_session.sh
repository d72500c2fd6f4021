#!/bin/bash
# One device session's plan across gpu/run_ceiling.sh and gpu/run_isolation.sh (issues 36 and
# 37), from the repo root there, one call after another:
#
#   bash gpu/run_session.sh BUDGET_S [last]
#
# Resumable: each driver keeps its own state (/tmp/pdceil, /tmp/pdiso); this script only orders
# them and splits the call's budget. Each driver packs into its own folder of $OUT
# ($OUT/ceiling, $OUT/isolation: both would write $OUT/results.tar.gz).
#   1. the ceiling's three engines (vLLM defaults :8170, vLLM + native tier :8180, pdstack's
#      default :8160 + proxy :8060), started once, no sweep (SWEEPS=" ", KEEP all)
#   2. isolation's variants ISO_FIRST on those engines (only its proxy :8066 starts: issue 37
#      has no pdstack number yet, so it goes first)
#   3. the ceiling's sweeps CEIL_SWEEPS, as many as fit
#   4. isolation's ISO_LAST (batch-alone: the overload sweep whose end killed an engine in run
#      1) once the ceiling is done, or in the call marked `last`
set -uo pipefail
T0=$(date +%s) B=${1:-550} LAST=${2:-}
BASE=${OUT:-/tmp/pdsession}
# each driver's own state folder (never one W for both: a W in the environment would be)
CW=${CEIL_W:-/tmp/pdceil} IW=${ISO_W:-/tmp/pdiso}
left() { echo $(( B - ($(date +%s) - T0) )); }
up() { python3 -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; }
say() { echo "[session +$(( $(date +%s) - T0 ))s $(date -u +%T)] $*"; }

ISO_FIRST=${ISO_FIRST:-chat-alone flood over vllm-chat-alone}
ISO_LAST=${ISO_LAST:-batch-alone}
CEIL_SWEEPS=${CEIL_SWEEPS:-pdstack-default pdstack-default-before vllm-default vllm-native \
pdstack-kv97 turn-vllm-default turn-pdstack-default turn-pdstack-engine}
export BATCH_CAP=${BATCH_CAP:-7} RATES=${RATES:-20,24,28,32} RATES_MAX=${RATES_MAX:-48} \
  RATES_TURN=${RATES_TURN:-16,24}
ceiling() {  # BUDGET [SWEEPS [KEEP]]
  W=$CW OUT=$BASE/ceiling DURATION=${CEIL_DURATION:-20} SWEEPS=${2:-$CEIL_SWEEPS} KEEP=${3-v p} \
    bash gpu/run_ceiling.sh "$1"
}
isolation() {  # BUDGET VARIANTS
  W=$IW OUT=$BASE/isolation DURATION=${ISO_DURATION:-30} VARIANTS=$2 bash gpu/run_isolation.sh "$1"
}

if [ ! -f "$CW"/state/times-p ]; then
  say "1. the ceiling's engines"
  ceiling "$(( $(left) < 330 ? $(left) : 330 ))" " " "v n p"
  rm -f "$CW"/state/all-done
fi
for _ in $(seq 60); do up http://127.0.0.1:8160/health && break; sleep 3; done
up http://127.0.0.1:8160/health || { say "pdstack's engine :8160 is not up: call again"; exit 0; }
if [ ! -f "$IW"/state/first-done ] && [ "$(left)" -gt 90 ]; then
  say "2. isolation: $ISO_FIRST"
  isolation "$(( $(left) - 10 ))" "$ISO_FIRST" | tail -3
  all=1
  for v in $ISO_FIRST; do
    [ -f "$IW/state/swept-$v" ] || [ -f "$IW/state/failed-$v" ] || all=0
  done
  [ $all = 1 ] && touch "$IW"/state/first-done
fi
if [ ! -f "$CW"/state/all-done ] && [ "$(left)" -gt 90 ]; then
  # batch-alone's time is kept back in the last call
  keep=0; [ "$LAST" = last ] && [ ! -f "$IW"/state/swept-batch-alone ] && keep=95
  say "3. ceiling: $CEIL_SWEEPS ($keep s kept for batch-alone)"
  ceiling "$(( $(left) - 10 - keep ))"
fi
if { [ -f "$CW"/state/all-done ] || [ "$LAST" = last ]; } && [ "$(left)" -gt 70 ]; then
  say "4. isolation: $ISO_LAST"
  if [ -f "$IW"/state/stopped-iso ]; then  # step 2's end stopped its proxy: start it again
    rm -f "$IW"/state/{launched,stopped}-iso "$IW"/state/launch-iso.rc "$IW"/state/all-done
  fi
  isolation "$(( $(left) - 5 ))" "$ISO_FIRST $ISO_LAST"
fi
say "done for this call: $(left) s of $B left"
