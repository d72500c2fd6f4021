#!/bin/sh
# TEST DOUBLE of `ibv_devinfo` and `docker` (tests/host), installed under those names in a
# PATH directory: replays recorded outputs for exactly what the rdma_ucx role runs.
#   ibv_devinfo                                -> $FAKE_IBV_DEVINFO
#   docker image inspect --format ... IMAGE    -> an image id
#   docker run ... --entrypoint ucx_info IMAGE -d -> $FAKE_UCX_INFO_D
# Anything else exits 64, loudly. Never used on a real host.
name=$(basename "$0")
if [ "$name" = ibv_devinfo ] && [ $# -eq 0 ]; then exec cat "$FAKE_IBV_DEVINFO"; fi
if [ "$name" = docker ]; then
  case "$1 $2" in
    "image inspect") echo "sha256:0000000000000000000000000000000000000000000000000000000000000000"; exit 0 ;;
    "run --rm")
      last=$(eval echo "\${$#}")
      case " $* " in *" --entrypoint ucx_info "*) [ "$last" = -d ] && exec cat "$FAKE_UCX_INFO_D" ;; esac ;;
  esac
fi
echo "fake $name (test double): no recording for: $*" >&2
exit 64
