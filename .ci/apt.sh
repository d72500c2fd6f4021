# Sourced by the .ci install scripts: apt-get install of the Debian packages not installed yet,
# under the machine-wide apt lock ($CI_APT_LOCK), never starting a package's service
# (policy-rc.d: e.g. sshd on 0.0.0.0:22 in the root namespace, Prometheus on :9090).
#   apt_install_missing TAG PKG...   (TAG prefixes the log line: "[TAG] apt-get install ...")

apt_install_missing() {
  local tag=$1 p missing=()
  shift
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  echo "[$tag] apt-get install ${missing[*]}"
  APT_POLICY=/usr/sbin/policy-rc.d; APT_HAD_POLICY=0
  [ -e "$APT_POLICY" ] && APT_HAD_POLICY=1
  [ $APT_HAD_POLICY = 1 ] || { printf '#!/bin/sh\nexit 101\n' > "$APT_POLICY"; chmod +x "$APT_POLICY"; }
  trap '[ $APT_HAD_POLICY = 1 ] || rm -f "$APT_POLICY"' EXIT
  local apt=(flock "${CI_APT_LOCK:-/var/tmp/ci-apt.lock}" apt-get -o DPkg::Lock::Timeout=600
             -o Acquire::Retries=3 -q)
  "${apt[@]}" update
  "${apt[@]}" install -y --no-install-recommends "${missing[@]}"
}
