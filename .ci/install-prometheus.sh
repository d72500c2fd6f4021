#!/usr/bin/env bash
# Debian's prometheus package: `promtool` (check config / rules, test rules) and the server
# that the e2e monitoring test runs against the CPU stack (tests/e2e, scrape config rendered
# by `pdstack render`). Idempotent: apt runs only when it is missing. The package's service
# is never started (policy-rc.d): the test starts its own Prometheus on 127.0.0.1.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if ! dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q "install ok installed"; then
  echo "[install-prometheus] apt-get install prometheus"
  policy=/usr/sbin/policy-rc.d; had_policy=0
  [ -e "$policy" ] && had_policy=1
  [ $had_policy = 1 ] || { printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; }
  trap '[ $had_policy = 1 ] || rm -f "$policy"' EXIT
  flock "${CI_APT_LOCK:-/var/tmp/ci-apt.lock}" apt-get -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3 -q update
  flock "${CI_APT_LOCK:-/var/tmp/ci-apt.lock}" apt-get -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3 -q install -y --no-install-recommends prometheus
fi
for t in prometheus promtool; do
  command -v "$t" >/dev/null || { echo "[install-prometheus] $t still missing" >&2; exit 1; }
done
echo "[install-prometheus] ok: $(prometheus --version 2>&1 | head -1)"
