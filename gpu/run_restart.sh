#!/bin/bash
# Issue 38 item 6: where an H200 engine's (re)start time goes, from the repo root there.
#
#   bash gpu/run_restart.sh [BUDGET_S]
#
# Starts inventory/h200x1's engine-0 (pdstack's default one-GPU engine: V2-Lite, dummy
# weights, native tier) twice with `pdstack launch`, the second time after a stop, with one
# persisted vLLM cache folder (VLLM_CACHE_ROOT=$W/vllm-cache: torch.compile's artifacts),
# as a restarted container or a supervised restart finds it. Each start's "healthy after" and
# the engine log's phase lines (weights, torch.compile, CUDA graphs, KV cache, the whole
# engine init) go into results/restart.txt. Resumable (state in /tmp/pdrestart).
set -uo pipefail
T0=$(date +%s)
BUDGET=${1:-560}
REPO=$(pwd)
W=${W:-/tmp/pdrestart}
SITE=${SITE:-/tmp/site}
OUTDIR=${OUT:-$W/out}
mkdir -p "$W/results" "$W/logs" "$W/state" "$OUTDIR"
log() { echo "[restart +$(elapsed)s] $*" | tee -a "$W/run.log"; }
# shellcheck source=gpu/lib.sh
source "$REPO/gpu/lib.sh"
trap gpu_pack EXIT
gpu_install || exit 1
PD=(python3 -m pdstack.cli)
PHASES='Loading weights took|Model loading took|torch.compile take|Compiling a graph|Directly load|Graph capturing finished|init engine|Available KV cache|GPU KV cache size|compile cache|Cache the graph'
for n in 1 2; do
  [ -f "$W/state/start-$n" ] && continue
  [ "$(left)" -lt 240 ] && { log "no time for start $n: call again"; exit 0; }
  log "start $n (VLLM_CACHE_ROOT=$W/vllm-cache)"
  "${PD[@]}" launch -i inventory/h200x1 start --services engine-0 --log-dir "$W/logs/s$n" \
    --timeout 400 --env "VLLM_CACHE_ROOT=$W/vllm-cache" > "$W/logs/launch-$n.out" 2>&1
  log "start $n rc=$? $(grep -h 'healthy after' "$W/logs/launch-$n.out" | sed 's/.*] //')"
  { echo "== start $n: $(grep -h 'healthy after' "$W/logs/launch-$n.out" | sed 's/.*] //')"
    grep -hE "$PHASES" "$W/logs/s$n/engine-0.log" | cut -c1-300; } >> "$W/results/restart.txt"
  "${PD[@]}" launch -i inventory/h200x1 stop --log-dir "$W/logs/s$n" --grace 20 \
    >> "$W/logs/launch-$n.out" 2>&1
  touch "$W/state/start-$n"
done
du -sh "$W/vllm-cache" >> "$W/results/restart.txt" 2>&1
log "done"
