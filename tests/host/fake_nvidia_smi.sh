#!/bin/sh
# TEST DOUBLE of the nvidia-smi binary (tests/host): replays the recorded outputs in
# $FAKE_NVIDIA_SMI_FIXTURES (default tests/fixtures/h200) for the exact argv that the
# gpu_host role and the probe use; anything else exits 64, loudly.
# Installed as "nvidia-smi" in a PATH directory by the tests; never used on a real host.
d=${FAKE_NVIDIA_SMI_FIXTURES:-$(dirname "$(readlink -f "$0")")/../fixtures/h200}
query=$(sed -n 2p "$d/nvidia-smi-query-gpu.argv")     # --query-gpu=FIELDS
format=$(sed -n 3p "$d/nvidia-smi-query-gpu.argv")    # --format=csv,noheader,nounits
case "$*" in
  "$query $format") exec cat "$d/nvidia-smi-query-gpu.csv" ;;
  "topo -m") exec cat "$d/nvidia-smi-topo-m.txt" ;;
esac
echo "fake nvidia-smi (test double): no recording for: $*" >&2
exit 64
