#!/bin/bash
# gpu/lib.sh: the steps a gpu/run_*.sh driver shares (sourced). Needs W (its state folder),
# SITE (the payload's install folder), OUTDIR ($OUT), T0 and BUDGET, and a `log` function.
# (run_sweeps.sh, run_tiers.sh and run_h200x1.sh predate it and keep their own copies.)

# the issue-23 many-tenants workload (results/h200x1-tiers): 200 shared prompts of 1.5-5 k
# tokens (~1.9x one engine's GPU KV), 85 % reuse, user 64-512, answers 48-160
GPU_MT=(--scenario many-tenants --system-prompts 200 --system-len uniform:1500:5000
        --shared-share 0.85 --user-len uniform:64:512 --output-len uniform:48:160)

# the driver's seconds so far, and those left of its BUDGET (from its T0)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }

# pack results + log tails into $OUTDIR/results.tar.gz (what comes back from the machine)
gpu_pack() {
  local d f
  for d in "$W"/logs/*/; do
    [ -d "$d" ] || continue
    for f in "$d"*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$f.tail"; done
  done
  for f in "$W"/logs/*.out; do [ -f "$f" ] && tail -c 200000 "$f" > "$f.tail"; done
  tar -C "$W" -czf "$OUTDIR/results.tar.gz" --exclude='*.log' --exclude='*.out' \
    results logs run.log state 2>/dev/null
  cp "$W/run.log" "$OUTDIR/run.log" 2>/dev/null
  log "packed $(du -h "$OUTDIR/results.tar.gz" | cut -f1)"
}

# install the payload from /tmp/chunks once, then its environment and this repo on the path
gpu_install() {
  if [ ! -f "$SITE/env.sh" ]; then
    log "installing payload from /tmp/chunks ($(ls /tmp/chunks 2>/dev/null | wc -l) files)"
    SKIP_CHECK=1 bash /tmp/chunks/install.sh /tmp/chunks > "$W/install.log" 2>&1
    local rc=$?
    tail -5 "$W/install.log" | tee -a "$W/run.log"
    [ $rc -eq 0 ] || { log "install failed rc=$rc"; return 1; }
  fi
  # shellcheck disable=SC1091
  source "$SITE/env.sh"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
}

# GET a URL, print the body; exit status 0 only for a 2xx answer within 3 s (no curl there)
http_get() {
  python3 -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=3).read().decode())" \
    "$1" 2>/dev/null
}
