"""``pdstack upgrade``: rolling model / image upgrade of one node's engines.

One engine at a time, never dropping the node to zero serving capacity and never
pairing a prefiller with a decoder of another generation:

1. order: one decoder first, then the prefillers, then the other decoders (the new
   generation gets a decoder before it gets a prefiller, so its first complete pair
   exists while the old generation still serves); ``colocated``: plain order.
2. per engine: if taking it out would leave *no* generation with a usable
   prefiller/decoder pair, and the node's pairs share the LMCache store (``shared-l1``),
   register a *stand-in* at the proxy: a backend of the missing role whose URL is a
   same-node engine of the same generation (in shared-l1 every engine runs
   ``LMCacheMPConnector`` with ``kv_role: kv_both``, so a decoder can also run a
   prefill leg); it is removed once the upgraded engine serves again.
3. drain the engine at the proxy, wait for its in-flight count to reach 0;
4. edit that engine's ``<SERVICE>_IMAGE / _MODEL / _REVISION`` lines in the stack's
   ``.env`` (and its generation in ``backends.json``) and recreate only that service:
   ``docker compose up -d --no-deps --wait <service>``;
5. check the engine really runs the new model (``/v1/models`` ``root``), warm it with
   one real request straight to it, re-register it at the proxy with the new
   generation (drained), wait until the proxy's health check admits it, undrain.
On any failure the engine's old ``.env`` lines are restored, the old container is
brought back and re-registered with the old generation, and the command stops with
an error that says which engine and which step.

KV cache isolation across revisions (the LMCache store is shared by every engine of
a node): LMCache's MP connector keys every chunk by ``model_config.model``, i.e. the
model argument of ``vllm serve``. pdstack's inventories put the revision in that path
(``/models/tiny-llama/{revision}``), so two revisions never share a cache key. When
the model argument would *not* change (a hub id with ``--revision``), the upgrade
refuses to run on a node with an LMCache store, because old and new engines would
read each other's KV.

The admin token comes from ``PDSTACK_ADMIN_TOKEN`` (or ``--admin-token-file``), never
from argv, and is never printed.

The pieces (stdlib only: the engine_upgrade role runs them on the node, see ``__main__``):

- :mod:`.cli`: the command line, the admin token and engine key, the run;
- :mod:`.upgrader`: :class:`Upgrader`, the steps above, engine by engine, and the rollback;
- :mod:`.targets`: which engines, and each one's new ``.env`` values and generation (1);
- :mod:`.capacity`: stand-ins and waiting for a drained engine to be idle (2, 3);
- :mod:`.engines`: order, serving generations, stand-in choice, an engine's own checks (5);
- :mod:`.stackfiles`: the ``.env`` and ``backends.json`` edits (4);
- :mod:`.compose`: ``docker compose stop`` / ``up --wait`` of one service (4);
- :mod:`.admin`, :mod:`.common`: the proxy's admin API; error, log, HTTP, waiting.
"""

from __future__ import annotations

from pdstack.upgrade.admin import AdminClient
from pdstack.upgrade.capacity import Capacity
from pdstack.upgrade.cli import (
    ADMIN_TOKEN_ENV,
    ENGINE_KEY_ENV,
    SECRETS_ENV_FILE,
    add_arguments,
    main,
    read_admin_token,
    read_engine_key,
    register,
    standalone,
)
from pdstack.upgrade.common import UpgradeError, _http, log, wait_for
from pdstack.upgrade.compose import TRANSIENT_DOCKER_ERRORS, Compose
from pdstack.upgrade.engines import (
    STANDIN_TAG,
    Engine,
    engine_busy,
    serving_generations,
    standin_for,
    upgrade_order,
    verify_and_warm,
)
from pdstack.upgrade.stackfiles import (
    StackEnv,
    atomic_write,
    env_prefix,
    generation,
    new_model_arg,
    set_backends_json_generation,
)
from pdstack.upgrade.targets import Target, node_engines
from pdstack.upgrade.upgrader import Upgrader

__all__ = [
    "ADMIN_TOKEN_ENV",
    "ENGINE_KEY_ENV",
    "SECRETS_ENV_FILE",
    "STANDIN_TAG",
    "TRANSIENT_DOCKER_ERRORS",
    "AdminClient",
    "Capacity",
    "Compose",
    "Engine",
    "StackEnv",
    "Target",
    "UpgradeError",
    "Upgrader",
    "_http",
    "add_arguments",
    "atomic_write",
    "engine_busy",
    "env_prefix",
    "generation",
    "log",
    "main",
    "new_model_arg",
    "node_engines",
    "read_admin_token",
    "read_engine_key",
    "register",
    "serving_generations",
    "set_backends_json_generation",
    "standalone",
    "standin_for",
    "upgrade_order",
    "verify_and_warm",
    "wait_for",
]
