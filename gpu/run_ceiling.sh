#!/bin/bash
# gpu/'s one driver: every open GPU experiment is data here (gpu/README.md says which, and how
# to run and rehearse them). On the lent GPU machine, from the repo root:
#   bash gpu/run_ceiling.sh [BUDGET_S]       (default 560)
# The data: STACKS (name, engine URL(s), target URL, launch key, inventory, services),
# EXTRA_PROXIES (a second proxy with other flags in front of a stack's engine), ROUTERS
# (vllm-router's fronts), the workloads WL_* (by a sweep name's prefix) and their rates, and
# SWEEPS: names [WORKLOAD-]STACK[-rN] in priority order (-rN: a repeat, into NAME-rN.json).
# Resumable (state in $W, default /tmp/pdceil): call it again until the log says "all sweeps
# done". Each call: the payload from /tmp/chunks (once) and the machine's facts; the engines
# SWEEPS need, launched at once on GPU 0 and supervised; the sweeps as the budget allows, each
# alone on quiet engines with cold caches (its own salt), seed 1, the engines' and the front's
# counters in its JSON (a sweep that does not fit waits for the next call, a shorter one may
# run first); once all are done, the engines stopped but KEEP's (default "v p"; STOP_ONLY=1
# KEEP= only stops them); always, results and log tails packed into $OUT/results.tar.gz.
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
PD_INV=${PD_INV:-inventory/h200x1}
# issue 37: the isolation stack (ISO_INV: :8160 + proxy :8066, the same engine as PD_INV's) and
# the second engine INV_CHUNK (:8190 + :8067): h200x1-isolation-step (2,048-token steps,
# 1,024-token chunks), -chunk (--long-prefill-token-threshold 1024) or -split (a plain engine)
ISO_INV=${ISO_INV:-inventory/h200x1-isolation}
INV_CHUNK=${INV_CHUNK:-inventory/h200x1-isolation-step}
CHAT_RATE=${CHAT_RATE:-4}
BATCH_RATES=${BATCH_RATES:-4,8,16,32}
# shellcheck disable=SC2034  # read as ${!rv} (WL_RATES[batch])
BATCH_SWEEP=${BATCH_CAP:-$BATCH_RATES}   # BATCH_CAP set: batch-STACK at it only, and CAP = it
P1_TOKENS=${P1_TOKENS:-2048}
# issue 55: heal-STACK's flood (WEDGE_S: the supervisor's, lib.sh)
FLOOD_RATE=${FLOOD_RATE:-300}
FLOOD_S=${FLOOD_S:-15}
# a flood straight to vLLM holds one connection per queued request: descriptors
ulimit -n 1048576 2>/dev/null || ulimit -n 65536 2>/dev/null
SWEEPS=${SWEEPS:-vllm-default vllm-native pdstack-default pdstack-default-before \
turn-vllm-default turn-pdstack-default seed-vllm-default seed-pdstack-default \
turn-pdstack-default-before turn-vllm-native}

# issue 56: three engines of one model on GPU 0 (RT_INV: V2-Lite, 10 GiB KV each, on an H200;
# on an H100, which holds one V2-Lite engine, V2-Lite's first 12 layers with the same KV in
# tokens) behind, one front at a time, on the same engines: pdstack (KV events), its hash ring, vllm-router
RATES_RT=${RATES_RT:-12,24,36,48}
RT_ENGINES=http://127.0.0.1:8290,http://127.0.0.1:8291,http://127.0.0.1:8292
RT_SUB=tcp://127.0.0.1:5590  # RT_INV's kv_events listen address (pdstack's proxy's SUB)

# shellcheck source=gpu/lib.sh
source "$(pwd)/gpu/lib.sh"
gpu_start ceiling /tmp/pdceil "${1:-}" || exit 1
if [ -z "${RT_INV-}" ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)" in
    *H200*) RT_INV=inventory/h200x1-3e ;;
    *) RT_INV=inventory/h100x1-3e ;;
  esac
fi
case $RT_INV in *h100x1-3e) [ -d /tmp/models/deepseek-v2-12l ] || { mkdir -p /tmp/models \
  && cp -r "$REPO/gpu/models/deepseek-v2-12l" /tmp/models/; } ;; esac
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
  # overload run 2 (H100): at the knee the gate held 187 and refused 44 where the native tier
  # met the SLO with 431 preemptions: the preemption caution off
  "pdstack-caution0 http://127.0.0.1:8160 http://127.0.0.1:8064 p $PD_INV engine-0,proxy"
  # overload run 3: below the knee the proxy added 6-35 ms P50 over its engine straight; the
  # request it sends differs by return_token_ids (stream migration): the proxy without it
  "pdstack-nomigr http://127.0.0.1:8160 http://127.0.0.1:8065 p $PD_INV engine-0,proxy"
  # issue 56: RT_INV's three engines (key t) behind pdstack's proxy (key tp: KV-event routing),
  # the hash ring (--kv-events off) and vllm-router's policies (ROUTERS); t's row first
  "rt-rr $RT_ENGINES http://127.0.0.1:8194 t $RT_INV engine-0,engine-1,engine-2"
  "rt-pdstack $RT_ENGINES http://127.0.0.1:8190 tp $RT_INV proxy"
  "rt-ring $RT_ENGINES http://127.0.0.1:8193 tp $RT_INV proxy"
  "rt-ca $RT_ENGINES http://127.0.0.1:8195 t $RT_INV engine-0,engine-1,engine-2"
  "rt-kv $RT_ENGINES http://127.0.0.1:8196 t $RT_INV engine-0,engine-1,engine-2"
  # pdstack's proxy again with other flags: each binds pdstack's SUB (SUB_TAKERS), so key t.
  # Routing run 2: every pdstack front served ~92 req/s at 120 (its gate refused 16 %) where
  # cache_aware served 108 within the SLO: pdstack's routing with the gate off
  "rt-pd-open $RT_ENGINES http://127.0.0.1:8199 t $RT_INV proxy"
  # and with its watermark above the engines' KV (the engine may preempt: cheap while the
  # preempted prompts stay in its prefix cache, as cache_aware's 448 preemptions were)
  "rt-pd-kv12 $RT_ENGINES http://127.0.0.1:8189 t $RT_INV proxy"
  # and with a watermark each engine learns from its first bytes (kv_mark.py), 0.97 to 1.5
  "rt-pd-learn $RT_ENGINES http://127.0.0.1:8187 t $RT_INV proxy"
  # routing run 3: past capacity the gate-off front's hit ratio fell to 0.46 (cache_aware
  # 0.64); since then a prompt no engine holds goes to its ring home: the old rule
  # (least queued among equals), and a stickier cost (a miss weighs 8 queued tokens)
  "rt-pd-cost $RT_ENGINES http://127.0.0.1:8186 t $RT_INV proxy"
  "rt-pd-w8 $RT_ENGINES http://127.0.0.1:8185 t $RT_INV proxy"
  # routing run 4: a miss weighing 8 gained at 90, 120 and 150 req/s, and became the
  # default: the old weight (2) as the control, and a stickier one (16)
  "rt-pd-w2 $RT_ENGINES http://127.0.0.1:8184 t $RT_INV proxy"
  "rt-pd-w16 $RT_ENGINES http://127.0.0.1:8183 t $RT_INV proxy"
  # stop 68: run 4's 120 req/s had 74 % of pdstack's requests wait in the gate, hit ratio
  # 0.58 vs cache_aware's 0.70: a holder without KV headroom costed, not filtered out
  "rt-pd-hr $RT_ENGINES http://127.0.0.1:8182 t $RT_INV proxy"
  # issue 37: tenants chat + batch on pdstack's default engine (iso) or on INV_CHUNK's (isoc);
  # -p1: a second proxy with --admission-prefill-tokens P1_TOKENS (batch prefills one prompt
  # at a time while chat is active); -nofirst: --admission-interactive-first off; iso-split:
  # chat on iso, the batch tenant on iso-chunk (BATCH_TO): does the card interleave better?
  "iso http://127.0.0.1:8160 http://127.0.0.1:8066 iso $ISO_INV engine-0,proxy"
  "iso-chunk http://127.0.0.1:8190 http://127.0.0.1:8067 isoc $INV_CHUNK engine-0,proxy"
  "iso-p1 http://127.0.0.1:8160 http://127.0.0.1:8068 iso $ISO_INV engine-0,proxy"
  "iso-chunk-p1 http://127.0.0.1:8190 http://127.0.0.1:8069 isoc $INV_CHUNK engine-0,proxy"
  "iso-nofirst http://127.0.0.1:8160 http://127.0.0.1:8070 iso $ISO_INV engine-0,proxy"
  "iso-split http://127.0.0.1:8160 http://127.0.0.1:8066 iso $ISO_INV engine-0,proxy"
)
declare -A BATCH_TO=([iso-split]=iso-chunk)  # the stack the batch tenant goes to, if not chat's
# the workloads (data): sweep-name prefix, rates variable, bench arguments
CHAT="--tenant chat:1 --system-prompts 4 --system-len 2000 --shared-share 1 --user-len uniform:32:128 --output-len 64"
BATCH="--tenant batch:1 --system-prompts 1 --shared-share 0 --system-len uniform:4096:6144 --user-len uniform:64:256 --output-len uniform:64:256"
declare -A WL_RATES=([mt]=RATES [turn]=RATES_TURN [seed]=RATES_SEED [long]=RATES_LONG
                     [batch]=BATCH_SWEEP [chat]=CHAT_RATE [over]=CHAT_RATE [flood]=CHAT_RATE)
declare -A WL_ARGS=([mt]="${GPU_MT[*]}" [turn]="--scenario multi-turn" [seed]="--scenario seed"
                    [long]="--scenario long-input" [batch]="$BATCH" [chat]="$CHAT" [over]="$CHAT"
                    [flood]="$CHAT" [heal]="${GPU_MT[*]}")
# the batch tenant beside chat: a multiple of CAP (chat- has none)
declare -A WL_X=([over]=${OVER_X:-1.5} [flood]=${FLOOD_X:-6})
# the extra proxies (data): stack, proxy name, port, code tree, flags after the own flags of
# the proxy launched for the stack's key (its engine's). Each runs only during its own sweeps
# (every proxy reads the engine's /metrics: run 1 had the old one, every 0.1 s, up through all
# of pdstack-default's sweeps)
EXTRA_PROXIES=(
  "pdstack-default-before before 8061 $OLD_PDSTACK"
  "pdstack-gate-off gate-off 8062 $REPO --admission off"
  "pdstack-caution0 caution0 8064 $REPO --admission-preempt-caution 0"
  "pdstack-nomigr nomigr 8065 $REPO --max-migrations 0"
  "rt-ring rt-ring 8193 $REPO --kv-events off"
  "rt-pd-open rt-pd-open 8199 $REPO --admission off"
  "rt-pd-kv12 rt-pd-kv12 8189 $REPO --admission-kv-high 1.2"
  "rt-pd-learn rt-pd-learn 8187 $REPO --admission-kv-learn-max 1.5"
  "rt-pd-cost rt-pd-cost 8186 $REPO --kv-unheld cost"
  "rt-pd-w8 rt-pd-w8 8185 $REPO --kv-miss-weight 8"
  "rt-pd-w2 rt-pd-w2 8184 $REPO --kv-miss-weight 2"
  "rt-pd-w16 rt-pd-w16 8183 $REPO --kv-miss-weight 16"
  "rt-pd-hr rt-pd-hr 8182 $REPO --kv-headroom cost"
  "iso-p1 p1 8068 $REPO --admission-prefill-tokens $P1_TOKENS"
  "iso-chunk-p1 p1c 8069 $REPO --admission-prefill-tokens $P1_TOKENS"
  "iso-nofirst nofirst 8070 $REPO --admission-interactive-first off"
)
# vllm-router 0.1.17 (issue 56's baselines: stack, port, policy; its defaults but the policy)
# on RT_INV's engines, its wheel in /tmp/chunks/router (unpacked once into $SITE/router), its
# metrics on port + 100. kv_aware reads the engines' KV events through gpu/kv_events_fanout.py:
# pdstack's engines publish to its proxy's SUB, which the fanout binds once that proxy (key tp)
# is stopped, so rt-kv comes after every tp sweep (rt-pdstack, rt-ring) in SWEEPS (take_sub)
ROUTERS=(
  "rt-rr 8194 round_robin"
  "rt-ca 8195 cache_aware"
  "rt-kv 8196 kv_aware"
)

if [ ! -f "$W/results/machine.txt" ]; then
  { echo "# h200x1-ceiling machine facts, $(date -u +%FT%TZ)"; uname -a; nproc; free -g
    gpu_facts
    python3 -c "from importlib.metadata import version as v; print('vllm', v('vllm'))"
    echo "old proxy: $OLD_REV's pdstack from $OLD_PDSTACK"; echo "ulimit -n $(ulimit -n)"
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
parse_sweep() {  # NAME ([WORKLOAD-]STACK[-rN]): prints "WORKLOAD STACK"
  local st=$1 wl=mt
  [[ $st =~ ^(.*)-r[0-9]+$ ]] && st=${BASH_REMATCH[1]}  # a repeat: NAME-rN.json, same stack
  case $st in turn-*|seed-*|long-*|batch-*|chat-*|over-*|flood-*|heal-*|restart-*)
    wl=${st%%-*}; st=${st#*-} ;;
  esac
  echo "$wl $st"
}
# STOP_ONLY=1: no sweep (none resumed or extended), only step 4: the engines stopped but KEEP's
# (frees the GPU for another driver: one V2-Lite engine at a time on an H100)
[ -n "${STOP_ONLY-}" ] && SWEEPS="" && log "STOP_ONLY: the engines stopped but KEEP's (${KEEP-v p})"
NEED=" "
for name in $SWEEPS; do
  read -r wl st <<< "$(parse_sweep "$name")"
  [ "$wl" = restart ] && continue  # starts its own engine (step 3)
  for s in "$st" ${BATCH_TO[$st]:-}; do
    read -r _ _ key _ <<< "$(stack "$s")"
    [ -n "$key" ] && NEED+="$key "
    [ "$key" = tp ] && NEED+="t "  # pdstack's proxy of RT_INV's engines (launched apart)
  done
done
needed() { case "$NEED" in *" $1 "*) return 0 ;; esac; return 1; }
case "$NEED" in *" iso"*) gpu_tenant_keys chat batch ;; esac
UP=" "  # the engine URLs launched in this loop
for s in "${STACKS[@]}"; do
  read -r _ engine _ key inv svcs <<< "$s"
  needed "$key" || continue
  flags=()
  case $key in
    v|n) flags=("${GPU_STOCK[@]}") ;;  # the baselines: stock vLLM
    iso*) flags=(--secrets-env "$GPU_SECRETS") ;;
  esac
  # an engine already up on the stack's port (the same command: p's and iso's), or launched
  # by another key just now, is reused: only the rest of its services start (V2-Lite: ~150 s
  # saved, and a fourth engine would not fit on the GPU beside three)
  [ -f "$W/state/launched-$key" ] || case "$UP" in *" $engine "*) up=1 ;; *) up=0 ;; esac
  UP+="$engine "
  if [ ! -f "$W/state/launched-$key" ] && { [ "$up" = 1 ] || http_get "$engine/health" > /dev/null; }; then
    svcs=$(echo "$svcs" | tr ',' '\n' | grep -vx 'engine-0' | paste -sd, -)
    log "$key: $engine is up already: reused (starting: ${svcs:-nothing})"
    if [ -z "$svcs" ]; then
      touch "$W/state/launched-$key"
      echo "all services healthy (reused $engine)" > "$W/logs/launch-$key.out"
      continue
    fi
  fi
  gpu_launch "$key" "$inv" "$svcs" "${GPU_SUPERVISE[@]}" "${flags[@]}"
done
for s in "${STACKS[@]}"; do  # each launch up (one that failed: down, its sweeps failed)
  read -r _ _ _ key _ <<< "$s"
  needed "$key" || continue
  [ -f "$W/state/down-$key" ] || gpu_wait_up "$key" || touch "$W/state/down-$key"
  [ -f "$W/state/times-$key" ] && continue  # the launch's own lines: how long each engine took
  touch "$W/state/times-$key"; log "$key: $(grep -h 'healthy after' "$W/logs/launch-$key.out" | tr '\n' ';')"
done
[ -d "$OLD_PDSTACK/pdstack" ] || log "no $OLD_PDSTACK/pdstack: no pdstack-default-before (gpu/README.md)"
router_install() {
  [ -d "$SITE/router/vllm_router" ] && return 0
  local whl mod
  mkdir -p "$SITE/router"
  python3 -m zipfile -e /tmp/chunks/router/vllm_router-*.whl "$SITE/router" || return 1
  for mod in orjson setproctitle; do  # its two imports vLLM's venv may lack
    python3 -c "import $mod" 2>/dev/null && continue
    for whl in /tmp/chunks/router/"$mod"-*.whl; do python3 -m zipfile -e "$whl" "$SITE/router"; done
  done
  log "vllm-router unpacked into $SITE/router"
}
rt_node() { case $RT_INV in *h100x1-3e) echo h100 ;; *) echo h200 ;; esac; }
rt_block_size() {  # the engines' KV block size (vllm:cache_config_info)
  http_get "${RT_ENGINES%%,*}/metrics" \
    | sed -n 's/^vllm:cache_config_info{.*block_size="\([0-9]*\)".*/\1/p' | head -1
}
# the fronts that bind pdstack's SUB for the engines' events (tp's proxy binds it): each
# starts once every tp sweep in SWEEPS is done, stops tp for good (its flags kept first) and
# frees the port at its end
SUB_TAKERS=" rt-kv rt-pd-open rt-pd-kv12 rt-pd-learn rt-pd-cost rt-pd-w8 rt-pd-w2 rt-pd-w16 rt-pd-hr "
take_sub() {  # NAME: 0 once pdstack's SUB is free, 3 while a tp sweep is still to run
  local n s k
  for n in $SWEEPS; do
    read -r _ s <<< "$(parse_sweep "$n")"; read -r _ _ k _ <<< "$(stack "$s")"
    [ "$k" = tp ] && gpu_pending "$n" && { log "$1 waits for $n (pdstack's proxy goes for $1)"; return 3; }
  done
  [ -s "$W/state/tp-args" ] || gpu_proxy_args tp > "$W/state/tp-args" 2>/dev/null \
    || rm -f "$W/state/tp-args"
  gpu_stop tp "$RT_INV"  # pdstack's proxy: its SUB goes
  pkill -f "[k]v_events_fanout.py"  # one left by an earlier sweep
  # the port free (a proxy whose SUB cannot bind routes by hash: it would not be the front
  # this sweep measures), <= 20 s
  local port=${RT_SUB##*:} i
  for i in $(seq 40); do
    python3 -c "import socket, sys; s = socket.socket(); \
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', $port))" \
      2>/dev/null && return 0
    sleep 0.5
  done
  log "$1: port $port still taken"; return 1
}
router() {  # up|down STACK: the stack's vllm-router (2: the stack has none)
  local r name port policy i urls flags=() fan=() pid
  for r in "${ROUTERS[@]}"; do
    read -r name port policy <<< "$r"
    [ "$name" = "$2" ] || continue
    if [ "$1" = down ]; then
      for pid in "router-$name" fanout; do
        [ -f "$W/state/$pid.pid" ] && kill "$(cat "$W/state/$pid.pid")" 2>/dev/null
        rm -f "$W/state/$pid.pid"
      done
      return 0
    fi
    router_install || { log "no vllm-router in /tmp/chunks/router"; return 1; }
    IFS=, read -ra urls <<< "$RT_ENGINES"
    if [ "$policy" = kv_aware ]; then
      take_sub "$name" || return $?  # the fanout binds pdstack's SUB
      for i in "${!urls[@]}"; do
        fan+=(--pub "$(rt_node)/engine-$i=tcp://127.0.0.1:$((5601 + i))")
        flags+=(--kv-event-source "${urls[$i]}=tcp://127.0.0.1:$((5601 + i))"
                --kv-event-replay-source "${urls[$i]}=tcp://127.0.0.1:$((5591 + i))")
      done
      # the engines' block size: any other (the router's default 16 against a CPU engine's
      # 128) credits no prefix, silently (stop 63's CPU probe); the model is a label only
      local bs=${RT_BLOCK_SIZE:-$(rt_block_size)}
      [ -n "$bs" ] || { log "no block size in ${RT_ENGINES%%,*}/metrics: no $name"; return 1; }
      flags+=(--kv-event-block-size "$bs" --kv-event-model "${GPU_MODEL:-deepseek-v2-lite}")
      setsid python3 "$REPO/gpu/kv_events_fanout.py" --sub "$RT_SUB" "${fan[@]}" \
        > "$W/logs/fanout.out" 2>&1 < /dev/null &
      echo $! > "$W/state/fanout.pid"
    fi
    log "router $name :$port --policy $policy ${flags[*]}"
    # ROUTER_PYTHON: vLLM's venv has its imports (uvicorn, fastapi, aiohttp); the dry run
    # gives .venv-router's
    PYTHONPATH="$SITE/router${PYTHONPATH:+:$PYTHONPATH}" setsid "${ROUTER_PYTHON:-python3}" \
      -m vllm_router.launch_router \
      --host 127.0.0.1 --port "$port" --worker-urls "${urls[@]}" --policy "$policy" "${flags[@]}" \
      --prometheus-host 127.0.0.1 --prometheus-port $((port + 100)) \
      > "$W/logs/router-$name.out" 2>&1 < /dev/null &
    pid=$!
    echo $pid > "$W/state/router-$name.pid"
    for _ in $(seq 60); do
      http_get "http://127.0.0.1:$port/health" > /dev/null && return 0
      kill -0 $pid 2>/dev/null || break
      sleep 1
    done
    log "router $name :$port not healthy:"; tail -20 "$W/logs/router-$name.out" | tee -a "$W/run.log"
    return 1
  done
  return 2
}
target_metrics() {  # STACK TARGET: where the front's own counters are (a router's on port + 100)
  local r name port
  for r in "${ROUTERS[@]}"; do
    read -r name port _ <<< "$r"
    [ "$name" = "$1" ] && { echo "http://127.0.0.1:$((port + 100))/metrics"; return; }
  done
  echo "$2/metrics"
}
extra_proxy() {  # up|down STACK: start/stop the stack's extra proxy (0 when it has none)
  local e name port code flags key GPU_SECRETS=${GPU_SECRETS:-} rc
  router "$1" "$2"; rc=$?
  [ $rc = 2 ] || return $rc
  for e in "${EXTRA_PROXIES[@]}"; do
    [ "${e%% *}" = "$2" ] || continue
    read -r _ name port code flags <<< "$e"
    if [ "$1" = down ]; then gpu_proxy_stop "$name"; rm -f "$W/state/proxy-$name"; return 0; fi
    read -r _ _ key _ <<< "$(stack "$2")"
    case $key in iso*) ;; *) GPU_SECRETS="" ;; esac  # tenants' keys: the iso proxies only
    [ -d "$code/pdstack" ] && [ ! -f "$W/state/down-$key" ] || return 1
    if [[ $SUB_TAKERS == *" $2 "* ]]; then  # tp's proxy again, with its flags
      take_sub "$2" || return $?
      [ -s "$W/state/tp-args" ] || { log "no flags of tp's proxy kept: no $2"; return 1; }
      # shellcheck disable=SC2046,SC2086
      gpu_proxy "$name" "$port" "$code" $(cat "$W/state/tp-args") $flags
      return
    fi
    # shellcheck disable=SC2046,SC2086
    gpu_proxy "$name" "$port" "$code" $(gpu_proxy_args "$key") $flags
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
# rt_warm: once, before the first rt-* sweep, each of RT_ENGINES serves RT_WARM_RATE req/s of
# many-tenants for RT_WARM_S s straight (results/warmup-rt-N.json, not a front). The first
# sweep after the engines started had TTFT P99 927-968 ms at 60 req/s where every later front
# had 194-270 (routing runs 2 and 3: whichever front came first paid the engines' warm-up)
rt_warm() {
  [ -f "$W/state/rt-warm" ] && return 0
  gpu_fits rt-warm "${RT_WARM_RATE:-20}" "${RT_WARM_S:-10}" || return 1
  local e i=0 pids=()
  for e in ${RT_ENGINES//,/ }; do
    # shellcheck disable=SC2086
    GPU_SALT_FLAG=--prompt-salt GPU_BENCH_EXTRA=--no-return-token-ids gpu_bench \
      "warmup-rt-$i" "$e" "${RT_WARM_RATE:-20}" "${RT_WARM_S:-10}" ${WL_ARGS[mt]} &
    pids+=($!); i=$((i + 1))
  done
  wait "${pids[@]}"
  touch "$W/state/rt-warm"
  log "rt engines warmed: $i x ${RT_WARM_RATE:-20} req/s x ${RT_WARM_S:-10}s"
}
sweep() {  # NAME: [WORKLOAD-]STACK[-rN]; 3 when it does not fit the budget now
  local name=$1 wl st
  read -r wl st <<< "$(parse_sweep "$name")"
  local spec; spec=$(stack "$st")
  [ -n "$spec" ] || { log "unknown sweep $name"; return 0; }
  local engine target key inv
  read -r engine target key inv _ <<< "$spec"
  [ "$wl" = restart ] && { restart "$name" "$key" "$inv"; return; }
  [ -f "$W/state/down-$key" ] && engine=""  # gpu_sweep: "no engine", failed
  local rv=${WL_RATES[$wl]:-} dur=$DURATION
  [ "$wl" = batch ] && dur=$((DURATION * 2 / 3))
  GPU_SALT_FLAG=--cache-salt GPU_BENCH_EXTRA="" TARGET_METRICS=$(target_metrics "$st" "$target")
  # RT_INV's fronts: the same engines and the same requests for each, with only OpenAI's
  # fields: cold caches by a salt in the prompts (vllm-router's kv_aware routes a request
  # with cache_salt as a miss) and no return_token_ids (any field it does not model makes
  # 0.1.17 skip its KV lookup: results/h200x1-routing/run1-h100/README.md)
  if [[ $st == rt-* ]]; then
    GPU_SALT_FLAG=--prompt-salt GPU_BENCH_EXTRA=--no-return-token-ids
    [ "$wl" = mt ] && rv=RATES_RT
  fi
  local rc=0 ran=0
  if gpu_pending "$name"; then
    ran=1
    # a front that does not fit now is not started (rt-kv would stop pdstack's proxy for it)
    if [[ $st == rt-* ]]; then rt_warm && gpu_fits "$name" "${!rv}" "$dur" || return 3; fi
    extra_proxy up "$st" || rc=$?
    [ $rc = 3 ] && return 3  # not yet (rt-kv: pdstack's proxy has sweeps left)
    [ $rc = 0 ] || { log "no proxy for $st: skip $name"; gpu_mark "$name" 1; return 0; }
  fi
  # shellcheck disable=SC2086
  case $wl in
    chat|over|flood) pair "$name" "$st" "$engine" "$target" "$wl" || rc=$? ;;
    heal) heal "$name" "$key" "$engine" "$target" || rc=$? ;;
    *) gpu_sweep "$name" "$engine" "$target" "${!rv}" "$dur" ${WL_ARGS[$wl]} || rc=$? ;;
  esac
  if [ "$wl" = mt ] && [ $rc = 0 ]; then extend "$name" "$engine" "$target" || rc=$?; fi
  if [ "$wl" = batch ] && [ -f "$W/results/$name.json" ] && [ ! -f "$W/state/cap-$key" ]; then
    python3 -c "import json, sys; print(max(1, round(max(r.get('request_throughput') or 0
      for r in json.load(open(sys.argv[1]))['results']))))" "$W/results/$name.json" \
      > "$W/state/cap-$key" && log "CAP $(cat "$W/state/cap-$key") req/s ($name)"
  fi
  # the front's own counters at its end (vllm-router's kv_aware lookups: the bench reads
  # no router series; routing run 2 could not show that its lookups hit); only where it ran
  # in this call (routing run 3: a resumed call emptied the earlier fronts' files)
  [[ $st == rt-* ]] && [ $ran = 1 ] && [ -n "$TARGET_METRICS" ] \
    && http_get "$TARGET_METRICS" > "$W/results/front-metrics-$name.txt" 2>/dev/null
  extra_proxy down "$st"
  return $rc
}
pair() {  # NAME STACK ENGINE TARGET WORKLOAD: chat (NAME.json) and the batch tenant
  # (NAME-batch.json, a multiple of its engine's CAP) started together; 3 when it must wait
  local name=$1 st=$2 engine=$3 target=$4 x=${WL_X[$5]:-} be bt bk brate="" bpid="" rc=0 cap
  read -r be bt bk _ <<< "$(stack "${BATCH_TO[$st]:-$st}")"
  [ -f "$W/state/down-$bk" ] && engine=""  # the batch tenant's engine is down
  gpu_todo "$name" "$engine" || return 0
  gpu_fits "$name" 1 "$DURATION" || return 3
  if [ -n "$x" ]; then  # CAP: BATCH_CAP, else batch-STACK's on that engine, else batch-iso's
    cap=${BATCH_CAP:-$(cat "$W/state/cap-$bk" "$W/state/cap-iso" 2>/dev/null | head -1)}
    [ -n "$cap" ] || { log "no CAP (batch-STACK) yet: $name waits"; return 3; }
    brate=$(python3 -c "import sys; print(max(1, round($cap * $x)))")
  fi
  gpu_quiesce "$engine"; [ "$be" = "$engine" ] || gpu_quiesce "$be"
  log "$name via $target: chat $CHAT_RATE req/s, batch ${brate:-none} req/s via $bt"
  if [ -n "$brate" ]; then
    # shellcheck disable=SC2046,SC2086
    gpu_bench "$name-batch" "$bt" "$brate" "$DURATION" $(gpu_metrics "$be" "$bt") $BATCH &
    bpid=$!
  fi
  # shellcheck disable=SC2046,SC2086
  gpu_bench "$name" "$target" "$CHAT_RATE" "$DURATION" $(gpu_metrics "$engine" "$target") $CHAT || rc=1
  [ -z "$bpid" ] || wait "$bpid" || rc=1
  gpu_mark "$name" $rc
}
heal() {  # NAME KEY ENGINE TARGET: a flood to TARGET, the supervisor's verdict and restart,
  # then NAME-after.json (4 req/s, 10 s); resumable
  local name=$1 key=$2 engine=$3 target=$4 out=$W/logs/launch-$2.out t0
  gpu_todo "$name" "$engine" || return 0
  if [ ! -f "$W/state/flooded-$name" ]; then
    touch "$W/state/flooded-$name"
    log "$name: $FLOOD_RATE req/s x ${FLOOD_S}s to $target, then the client gives up"
    # shellcheck disable=SC2086
    DRAIN=10 gpu_bench "$name" "$target" "$FLOOD_RATE" "$FLOOD_S" --metrics-url "$engine/metrics" ${WL_ARGS[heal]}
    t0=$(date +%s)
    until grep -q "wedged:\|died" "$out" || [ $(( $(date +%s) - t0 )) -ge $(( ${WEDGE_S:-60} + 90 )) ]; do
      [ "$(left)" -lt 25 ] && { log "$name: no verdict yet: call again"; return 3; }
      sleep 2
    done
  fi
  grep -E "wedged:|died|restarting|started engine-0 again" "$out" | cut -c1-300 | tee -a "$W/run.log"
  grep -q "restarting" "$out" || { log "$name: no crash or wedge seen"; gpu_mark "$name" 0; return 0; }
  until http_get "$engine/health" > /dev/null; do
    [ "$(left)" -lt 25 ] && { log "$name: not healthy again yet: call again"; return 3; }
    sleep 2
  done
  log "$name: healthy again"
  # shellcheck disable=SC2086
  WARMUP=2 DRAIN=20 gpu_bench "$name-after" "$target" 4 10 --metrics-url "$engine/metrics" ${WL_ARGS[heal]}
  gpu_mark "$name" 0
}
PHASES='Loading weights took|Model loading took|torch.compile take|Compiling a graph|Directly load|Graph capturing finished|init engine|Available KV cache|GPU KV cache size|compile cache|Cache the graph'
restart() {  # NAME KEY INVENTORY: the key's launch stopped, then its engine-0 started
  # RESTART_RUNS times (default 2) with one persisted VLLM_CACHE_ROOT (a restarted container's
  # volume): the first with it empty (a first deploy), the others warm; results/restart.txt
  local name=$1 n r PD=(python3 -m pdstack.cli)
  gpu_pending "$name" || return 0
  gpu_stop "$2" "$3"
  for n in $(seq 1 "${RESTART_RUNS:-2}"); do
    [ -f "$W/state/$name-$n" ] && continue
    [ "$(left)" -lt 240 ] && { log "no time for $name start $n: call again"; return 3; }
    log "$name: start $n (VLLM_CACHE_ROOT=$W/vllm-cache)"
    "${PD[@]}" launch -i "$3" start --services engine-0 --log-dir "$W/logs/$name-$n" \
      --timeout 400 --env "VLLM_CACHE_ROOT=$W/vllm-cache" > "$W/logs/$name-$n.out" 2>&1
    r="rc=$? $(grep -h 'healthy after' "$W/logs/$name-$n.out" | sed 's/.*] //')"
    log "$name: start $n $r"
    { echo "== $name start $n: $r"; grep -hE "$PHASES" "$W/logs/$name-$n/engine-0.log" | cut -c1-300
    } >> "$W/results/restart.txt"
    "${PD[@]}" launch -i "$3" stop --log-dir "$W/logs/$name-$n" --grace 20 >> "$W/logs/$name-$n.out" 2>&1
    touch "$W/state/$name-$n"
  done
  du -sh "$W/vllm-cache" >> "$W/results/restart.txt" 2>&1
  gpu_mark "$name" 0
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
for s in "${STACKS[@]}"; do  # KEEP: launch keys left running (another W's call reuses them)
  read -r _ _ _ key inv _ <<< "$s"
  case " ${KEEP-v p} " in *" $key "*) ;; *) gpu_stop "$key" "$inv" ;; esac
done
touch "$W/state/all-done"
