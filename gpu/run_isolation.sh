#!/bin/bash
# Issue 37: an interactive tenant stays fast while another floods, on the lent 1xH200, from the
# repo root there.
#
#   bash gpu/run_isolation.sh [BUDGET_S]
#
# Idempotent and resumable (state in /tmp/pdiso): call it again in the next device call.
#   1. install the payload from /tmp/chunks (once); machine facts
#   2. a 0600 secrets file with a random key for tenants chat and batch (PDSTACK_TENANT_KEYS);
#      the bench reads them from PDSTACK_BENCH_KEY_CHAT / _BATCH (never argv)
#   3. `pdstack launch` inventory/h200x1-isolation (the default one-GPU stack, 10 GiB KV on
#      GPU 0, chat interactive + batch priority batch; :8160 + proxy :8066) and vLLM with its
#      defaults (inventory/h200x1-vllm :8170). Both engines are the ones gpu/run_ceiling.sh
#      leaves running (KEEP="v p"): then only the isolation proxy starts. Each starts only when
#      a variant needs it (on an H100, which holds one engine, the vllm-* variants run in a call
#      of their own: W=/tmp/pdiso-v BATCH_CAP=N)
#   4. VARIANTS (data, priority order), one under load at a time, each on a quiet engine with
#      its own vLLM cache_salt; chat and batch are two `pdstack bench --tenant` runs started
#      together (each tenant its own workload: the bench gives all of one run's tenants the
#      same one): NAME.json = chat, NAME-batch.json = batch
#        chat  CHAT_RATE req/s, 4 shared 2 k-token system prompts, 64-token answers
#        batch unique 4-6 k-token prompts, answers 64-256 tokens, at a multiple of CAP
#      batch-alone runs first: BATCH_RATES (or BATCH_CAP alone); CAP = its highest served
#      req/s (the batch tenant's throughput yardstick)
#      batch-alone-chunk: the same on the -chunk engine, whose variants then take its own CAP
#      *-chunk variants (chat-alone-chunk over-chunk flood-chunk batch-alone-chunk): the same on
#      INV_CHUNK's engine (:8190 + :8067; h200x1-isolation-step: vLLM --max-num-batched-tokens
#      2048 --long-prefill-token-threshold 1024)
#      *-p1 variants (over-p1 flood-p1): the same engine behind a proxy with a small prefill
#      budget (--admission-prefill-tokens P1_TOKENS, :8068): batch prefills one prompt at a time
#      *-nofirst variants (over-nofirst flood-nofirst): the same engine behind a proxy with
#      --admission-interactive-first off (:8070): the A/B of interactive first
#      *-split variants (over-split flood-split): two engines on the one GPU (an H200 holds
#      both): chat on the isolation stack's, the batch tenant on INV_CHUNK's, each through its
#      own proxy; with INV_CHUNK=inventory/h200x1-isolation-split (a plain second engine, its
#      CAP from batch-alone-chunk) they ask whether the card interleaves chat with batch
#      prefill better than one engine's steps do
#   5. when every variant is done: its engines stopped; pack results + logs into
#      $OUT/results.tar.gz (always)
#
# Budget (DURATION=30, WARMUP=5, DRAIN=20: <= 90 s a variant, batch-alone 4 rates x 20 s
# ~230 s, a vLLM flood's aftermath up to 90 s of quiescing):
#   start: payload ~40 s + two engines in parallel ~170 s (V2-Lite)                    ~210 s
#          (after run_ceiling.sh in the same session: the proxy only,                 ~5 s)
#   batch-alone ~230 s; chat-alone, over, flood ~270 s; the vllm-* three ~270 s + ~90 s
#   => two ~9.5 min calls (560 s each): batch-alone, chat-alone, flood in the first; over and
#      the vllm-* three in the second
set -uo pipefail
DURATION=${DURATION:-30}
WARMUP=${WARMUP:-5}
DRAIN=${DRAIN:-20}
CHAT_RATE=${CHAT_RATE:-4}
BATCH_RATES=${BATCH_RATES:-4,8,16,32}
BATCH_CAP=${BATCH_CAP:-}   # set: batch-alone at this rate only, and CAP = it
OVER_X=${OVER_X:-1.5}
FLOOD_X=${FLOOD_X:-6}
VARIANTS=${VARIANTS:-batch-alone chat-alone flood over vllm-chat-alone vllm-flood vllm-over}
# a flood straight to vLLM holds one connection per queued request: descriptors
ulimit -n 1048576 2>/dev/null || ulimit -n 65536 2>/dev/null

# shellcheck source=gpu/lib.sh
source "$(pwd)/gpu/lib.sh"
gpu_start isolation /tmp/pdiso "${1:-}" || exit 1
# ISO_INV / PD_PORTS (ENGINE:PROXY) put another inventory in the plain stack's place, e.g. on a
# card that holds one engine: ISO_INV=inventory/h200x1-isolation-step PD_PORTS=8190:8067
INV=${ISO_INV:-inventory/h200x1-isolation}
PD_PORTS=${PD_PORTS:-8160:8066}
gpu_tenant_keys chat batch
CHAT=(--system-prompts 4 --system-len 2000 --shared-share 1 --user-len uniform:32:128 --output-len 64)
BATCH=(--system-prompts 1 --shared-share 0 --system-len uniform:4096:6144 --user-len uniform:64:256
       --output-len uniform:64:256)

# the stacks (data): name, engine URL, target URL
# pdc: the same stack on INV_CHUNK's engine, started only when a *-chunk variant is asked
# pdp: the isolation engine behind a second proxy (:8068) with the isolation proxy's own
# arguments and --admission-prefill-tokens P1_TOKENS (2048: two active tenants' share is 1,024
# tokens, so the batch tenant prefills one prompt at a time while chat is active)
# pdcp: the INV_CHUNK engine behind a second proxy (:8069) with its proxy's arguments and
# --admission-prefill-tokens P1_TOKENS (*-chunk-p1 variants)
# pdo: the isolation engine behind a second proxy (:8070) with --admission-interactive-first
# off (*-nofirst variants: the proxy before interactive first, same run)
# pds: two engines on the one GPU, chat on the isolation stack's, the batch tenant on INV_CHUNK's
# (*-split variants with INV_CHUNK=inventory/h200x1-isolation-split: a plain second engine)
declare -A ENGINE=([pd]=http://127.0.0.1:${PD_PORTS%:*} [vllm]=http://127.0.0.1:8170
                   [pdc]=http://127.0.0.1:8190 [pdp]=http://127.0.0.1:${PD_PORTS%:*}
                   [pdcp]=http://127.0.0.1:8190 [pdo]=http://127.0.0.1:${PD_PORTS%:*}
                   [pds]=http://127.0.0.1:${PD_PORTS%:*})
declare -A TARGET=([pd]=http://127.0.0.1:${PD_PORTS#*:} [vllm]=http://127.0.0.1:8170 [pdc]=http://127.0.0.1:8067
                   [pdp]=http://127.0.0.1:8068 [pdcp]=http://127.0.0.1:8069 [pdo]=http://127.0.0.1:8070
                   [pds]=http://127.0.0.1:${PD_PORTS#*:})
# the stacks whose batch tenant goes elsewhere than chat: the stack it goes to (its CAP too)
declare -A BATCH_TO=([pds]=pdc)
# the stacks whose proxy is a second one of a launch's (pdp, pdcp, pdo): its name and the
# launch whose proxy arguments it takes (its port is the stack's TARGET), and what it adds
declare -A P1_PROXY=([pdp]="p1 iso" [pdcp]="p1c isoc" [pdo]="nofirst iso")
P1_TOKENS=${P1_TOKENS:-2048}
declare -A P1_ARGS=([pdp]="--admission-prefill-tokens $P1_TOKENS"
                    [pdcp]="--admission-prefill-tokens $P1_TOKENS"
                    [pdo]="--admission-interactive-first off")
# the -chunk engine's inventory: h200x1-isolation-step (2,048-token steps, 1,024-token chunks),
# or -chunk (--long-prefill-token-threshold 1024), or -split (a plain second engine: *-split).
# 1,024-token steps with 256-token chunks ran once (isolation run 6, H100) and were not judged:
# the prefill share's fault of that day (fixed since) filled the engine's queue
INV_CHUNK=${INV_CHUNK:-inventory/h200x1-isolation-step}
# the variants (data): name, stack, batch beside chat (- none, else a multiple of CAP)
VARIANT_TABLE=(
  "chat-alone pd -"
  "over pd $OVER_X"
  "flood pd $FLOOD_X"
  "vllm-chat-alone vllm -"
  "vllm-over vllm $OVER_X"
  "vllm-flood vllm $FLOOD_X"
  "chat-alone-chunk pdc -"
  "over-chunk pdc $OVER_X"
  "flood-chunk pdc $FLOOD_X"
  "over-p1 pdp $OVER_X"
  "flood-p1 pdp $FLOOD_X"
  "over-chunk-p1 pdcp $OVER_X"
  "flood-chunk-p1 pdcp $FLOOD_X"
  "over-nofirst pdo $OVER_X"
  "flood-nofirst pdo $FLOOD_X"
  "over-split pds $OVER_X"
  "flood-split pds $FLOOD_X"
)

if [ ! -f "$W/results/machine.txt" ]; then
  { echo "# h200x1-isolation machine facts, $(date -u +%FT%TZ)"; uname -a; nproc; free -g
    gpu_facts
    echo "ulimit -n $(ulimit -n)"
  } > "$W/results/machine.txt" 2>&1
fi

# the isolation stack starts only for its own variants. Its engine is inventory/h200x1's (same
# command, :8160): when gpu/run_ceiling.sh left it running, only this inventory's proxy is
# started (no engine start: ~170 s saved)
need_iso=0
for v in $VARIANTS; do case $v in vllm-*|*-chunk|*-chunk-p1) ;; *) need_iso=1 ;; esac; done
if [ $need_iso = 0 ]; then :
elif [ -f "$W/state/launched-iso" ] || ! http_get "${ENGINE[pd]}/health" > /dev/null; then
  gpu_launch iso "$INV" engine-0,proxy --secrets-env "$GPU_SECRETS" "${GPU_SUPERVISE[@]}"
else
  gpu_launch iso "$INV" proxy --secrets-env "$GPU_SECRETS"
fi
case " $VARIANTS " in *" vllm-"*)
  if [ -f "$W/state/launched-v" ] || ! http_get "${ENGINE[vllm]}/health" > /dev/null; then
    gpu_launch v inventory/h200x1-vllm engine-0 "${GPU_SUPERVISE[@]}" "${GPU_STOCK[@]}"
  fi ;;
esac
case " $VARIANTS " in *"-chunk "*|*"-chunk-p1 "*|*"-split "*)
  gpu_launch isoc "$INV_CHUNK" engine-0,proxy --secrets-env "$GPU_SECRETS" "${GPU_SUPERVISE[@]}" ;;
esac
[ $need_iso = 1 ] && { gpu_wait_up iso || exit 1; }
# the -chunk engine is waited for by its first variant (the others run while it starts)
up_chunk() {
  [ -f "$W/state/launched-isoc" ] && [ -n "${ENGINE[pdc]}" ] || return 0
  gpu_wait_up isoc || { ENGINE[pdc]=""; ENGINE[pdcp]=""; }
}
[ -f "$W/state/launched-v" ] && { gpu_wait_up v || ENGINE[vllm]=""; }

cap() {  # the batch tenant's capacity on STACK's engine, req/s: BATCH_CAP, else what that
  # engine's batch-alone served (pdc/pdcp/pds: batch-alone-chunk's when it ran, else batch-alone's)
  local f="$W/state/cap"
  case ${1:-pd} in pdc|pdcp|pds) [ -f "$W/state/cap-pdc" ] && f="$W/state/cap-pdc" ;; esac
  if [ -n "$BATCH_CAP" ]; then echo "$BATCH_CAP"; else cat "$f" 2>/dev/null; fi
}
metrics_of() {  # STACK: the bench's --metrics-url flags (its engine, and its proxy when another)
  local out="--metrics-url ${ENGINE[$1]}/metrics"
  [ "${TARGET[$1]}" = "${ENGINE[$1]}" ] || out+=" --metrics-url ${TARGET[$1]}/metrics"
  echo "$out"
}
times() { python3 -c "import sys; print(max(1, round(float(sys.argv[1]) * float(sys.argv[2]))))" "$1" "$2"; }

pair() {  # NAME STACK BATCH: chat (and batch) at once; 3 when it does not fit now
  local name=$1 st=$2 mult=$3
  [ -f "$W/state/swept-$name" ] || [ -f "$W/state/failed-$name" ] && return 0
  case $st in pdc|pdcp|pds) up_chunk ;; esac
  local engine=${ENGINE[$st]} target=${TARGET[$st]} bst=${BATCH_TO[$st]:-$st}
  [ -n "$engine" ] && [ -n "${ENGINE[$bst]}" ] \
    || { log "no engine for $name"; touch "$W/state/failed-$name"; return 0; }
  gpu_fits "$name" 1 "$DURATION" || return 3
  local metrics bmetrics ok=1 brate="" bpid=""
  read -ra metrics <<< "$(metrics_of "$st")"
  read -ra bmetrics <<< "$(metrics_of "$bst")"
  if [ "$mult" != - ]; then
    [ -n "$(cap "$st")" ] || { log "no CAP (batch-alone) yet: $name waits"; return 3; }
    brate=$(times "$(cap "$st")" "$mult")
  fi
  local p1=${P1_PROXY[$st]:-}  # "NAME LAUNCH": its own proxy, up only during its sweeps
  if [ -n "$p1" ]; then
    # shellcheck disable=SC2046,SC2086
    gpu_proxy "${p1% *}" "${target##*:}" "$REPO" $(gpu_proxy_args "${p1#* }") ${P1_ARGS[$st]} \
      || { log "no proxy for $name"; touch "$W/state/failed-$name"; return 0; }
  fi
  gpu_quiesce "$engine"
  [ "$bst" != "$st" ] && gpu_quiesce "${ENGINE[$bst]}"
  log "$name via $target: chat $CHAT_RATE req/s, batch ${brate:-none} req/s via ${TARGET[$bst]}"
  if [ -n "$brate" ]; then
    gpu_bench "$name-batch" "${TARGET[$bst]}" "$brate" "$DURATION" "${bmetrics[@]}" --tenant batch:1 \
      "${BATCH[@]}" &
    bpid=$!
  fi
  gpu_bench "$name" "$target" "$CHAT_RATE" "$DURATION" "${metrics[@]}" --tenant chat:1 \
    "${CHAT[@]}" || ok=0
  [ -n "$brate" ] && { wait "$bpid" || ok=0; }
  if [ $ok = 1 ]; then touch "$W/state/swept-$name"; else touch "$W/state/failed-$name"; fi
  [ -n "$p1" ] && { gpu_proxy_stop "${p1% *}"; rm -f "$W/state/proxy-${p1% *}"; }
  return 0
}

pending=0
for v in $VARIANTS; do
  case $v in batch-alone|batch-alone-chunk)  # the batch tenant's throughput yardstick: CAP
    st=pd capf="$W/state/cap"
    [ "$v" = batch-alone-chunk ] && { st=pdc capf="$W/state/cap-pdc"; up_chunk; }
    [ -n "${ENGINE[$st]}" ] || { log "no engine for $v"; continue; }
    if ! gpu_sweep "$v" "${ENGINE[$st]}" "${TARGET[$st]}" "${BATCH_CAP:-$BATCH_RATES}" \
        $((DURATION * 2 / 3)) --tenant batch:1 "${BATCH[@]}"; then
      pending=1; [ $st = pd ] && break; continue  # the plain variants need CAP
    fi
    if [ ! -f "$W/results/$v.json" ]; then  # BATCH_CAP set (or the -chunk one): the others go on
      { [ -n "$BATCH_CAP" ] || [ $st = pdc ]; } && continue
      log "no batch-alone.json: no CAP"; break
    fi
    [ -f "$capf" ] || { python3 - "$W/results/$v.json" > "$capf" <<'PYEOF'
import json, sys
rs = json.load(open(sys.argv[1]))["results"]
print(max(1, round(max(r.get("request_throughput") or 0 for r in rs))))
PYEOF
      log "CAP $(cap "$st") req/s ($v)"; }
    continue ;;
  esac
  row=""
  for r in "${VARIANT_TABLE[@]}"; do [ "${r%% *}" = "$v" ] && row=$r; done
  [ -n "$row" ] || { log "unknown variant $v"; continue; }
  # shellcheck disable=SC2086
  pair $row || pending=1
done
[ $pending = 1 ] && { log "variants left for the next call"; exit 0; }
log "all variants done"
# its launches stopped (each only if this driver started it), but KEEP's: "iso v" leaves the
# isolation engine (:8160, inventory/h200x1's command) and vLLM (:8170) up for
# gpu/run_ceiling.sh, which reuses an engine it finds up (isoc is always stopped: GPU memory)
stop_unless_kept() { case " ${KEEP-} " in *" $1 "*) log "$1 kept running" ;; *) gpu_stop "$1" "$2" ;; esac; }
stop_unless_kept iso "$INV"; stop_unless_kept v inventory/h200x1-vllm
gpu_stop isoc "$INV_CHUNK"
touch "$W/state/all-done"
