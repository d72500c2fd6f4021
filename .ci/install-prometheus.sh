#!/usr/bin/env bash
# Debian's prometheus package: `promtool` (check config / rules, test rules) and the server
# that the e2e monitoring test runs against the CPU stack (tests/e2e, scrape config rendered
# by `pdstack render`). Idempotent: apt runs only when it is missing. The package's service
# is never started (policy-rc.d): the test starts its own Prometheus on 127.0.0.1.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
# shellcheck source=.ci/apt.sh
source "$(dirname "$0")/apt.sh"
apt_install_missing install-prometheus prometheus
for t in prometheus promtool; do
  command -v "$t" >/dev/null || { echo "[install-prometheus] $t still missing" >&2; exit 1; }
done
echo "[install-prometheus] ok: $(prometheus --version 2>&1 | head -1)"
