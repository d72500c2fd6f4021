"""What each engine holds, by tier, from its vLLM KV events; and the engine's own block
hashes of a request, so "how many of this prompt's blocks does engine X hold" is a lookup.

**Block hashes.** vLLM hashes a prompt in full blocks of ``block_size`` tokens as a chain:
``h_i = sha256(pickle((h_{i-1}, tuple(tokens_i), extra_keys_i)))`` with ``h_{-1} = NONE_HASH
= sha256(pickle(seed))`` (``prefix_caching_hash_algo`` sha256, the default in 0.26 and 0.32;
``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``, ``init_none_hash``). The seed is
``PYTHONHASHSEED`` (the planner sets it on every engine: 0.26 draws NONE_HASH at random
without it); 0.32 without it uses ``"vllm-none-hash"``. ``cache_salt`` is the first block's
extra key: ``(salt,)`` in 0.26, ``(("cache_salt", salt),)`` in 0.32. Events carry the low 64
bits of each hash as an int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, default on; raw bytes
are folded to the same int here).

**Calibration.** A ``BlockStored`` that starts a chain (no parent) carries its tokens and
extra keys: the index recomputes its hash under each candidate scheme (seed, salt tagging)
and keeps the one that matches, per engine. An engine none matches is *unverified*: routing
never trusts a lookup on it (llm-d-router #2513: hash parity is checked, not assumed).

**Index.** Per engine and medium (``GPU``; ``CPU``: vLLM's native tier), a set of block
hashes in insertion order, at most ``capacity`` per engine (oldest dropped first: vLLM's
own ``BlockRemoved`` normally keeps it far below). Pure data, no I/O, no locks.

**Routed, not yet stored.** An engine's events tell of a prompt's blocks only once its
prefill has computed them: until then a second request with the same prefix would see no
holder anywhere and be sent elsewhere, to compute the prefix again (under a burst, every
request of a new prefix does). :meth:`KvIndex.route` marks a routed request's blocks as
*pending* on its engine for ``ttl`` seconds; a lookup counts them as held in its GPU cache,
the engine's ``BlockStored`` (or ``BlockRemoved``) for a block replaces the mark, and an
unconfirmed one (the request failed, or the engine evicted it at once) lapses.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

HASH_MASK = (1 << 64) - 1
# vLLM >= 0.3x: the seed of NONE_HASH for sha256 when PYTHONHASHSEED is unset
VLLM_DEFAULT_SEED = "vllm-none-hash"
GPU = "GPU"
CPU = "CPU"
# a BlockStored or BlockRemoved without a medium is the GPU prefix cache (older vLLM)
DEFAULT_MEDIUM = GPU
# first-block events that matched no scheme before an engine counts as unverified
MISMATCHES_TO_GIVE_UP = 3


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's ``sha256`` (``vllm/utils/hashing.py``): pickle protocol 5, then SHA-256."""
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def external_hash(value: bytes | int) -> int:
    """A block hash as events carry it (``maybe_convert_block_hash``): the low 64 bits."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big") & HASH_MASK
    return int(value) & HASH_MASK


@lru_cache(maxsize=16)
def none_hash(seed: str) -> bytes:
    return sha256_pickle(seed)


@dataclass(frozen=True)
class HashScheme:
    """How an engine hashes: NONE_HASH's seed and the form of its cache_salt key."""

    seed: str
    salt_tagged: bool = True  # vLLM > 0.26: ("cache_salt", salt); 0.26: the bare salt

    def salt_key(self, salt: str) -> tuple[Any, ...]:
        return (("cache_salt", salt),) if self.salt_tagged else (salt,)


def block_hashes(
    tokens: Sequence[int], block_size: int, scheme: HashScheme, cache_salt: str | None = None
) -> list[int]:
    """The engine's hash of every full block of ``tokens`` (64-bit, as its events carry)."""
    out: list[int] = []
    parent = none_hash(scheme.seed)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = scheme.salt_key(cache_salt) if start == 0 and cache_salt else None
        parent = sha256_pickle((parent, tuple(tokens[start : start + block_size]), extra))
        out.append(external_hash(parent))
    return out


def candidate_schemes(seed: str) -> list[HashScheme]:
    seeds = [seed] if seed == VLLM_DEFAULT_SEED else [seed, VLLM_DEFAULT_SEED]
    return [HashScheme(s, tagged) for s in seeds for tagged in (True, False)]


@dataclass
class EngineBlocks:
    """One engine's blocks by medium, and what its events taught about its hashing."""

    block_size: int = 0
    scheme: HashScheme | None = None  # verified against a first-block event
    salt_known: bool = False  # scheme.salt_tagged was verified on a salted first block
    mismatches: int = 0
    tiers: dict[str, dict[int, None]] = field(default_factory=dict)
    stored: int = 0  # BlockStored block hashes applied (for the metrics)
    removed: int = 0
    # blocks of prompts routed here that its events have not told of yet: hash -> deadline
    # (time.monotonic), in insertion order
    pending: dict[int, float] = field(default_factory=dict)

    def size(self) -> int:
        return sum(len(t) for t in self.tiers.values())

    @property
    def unverified(self) -> bool:
        return self.scheme is None and self.mismatches >= MISMATCHES_TO_GIVE_UP


@dataclass(frozen=True)
class Held:
    """How much of a request's prefix one engine holds: a GPU prefix, then (from there on)
    a run in the CPU tier, in blocks of ``block_size`` tokens."""

    gpu_blocks: int
    cpu_blocks: int
    block_size: int

    @property
    def tokens(self) -> int:
        return (self.gpu_blocks + self.cpu_blocks) * self.block_size


class KvIndex:
    """Every engine's blocks, built from its events (:meth:`apply`)."""

    def __init__(self, seed: str, capacity: int = 400_000) -> None:
        self.seed = seed
        self.capacity = capacity
        self.engines: dict[str, EngineBlocks] = {}
        self._schemes = candidate_schemes(seed)

    def engine(self, name: str) -> EngineBlocks:
        eng = self.engines.get(name)
        if eng is None:
            eng = self.engines[name] = EngineBlocks()
        return eng

    def clear(self, name: str) -> None:
        """Forget what ``name`` holds (it restarted, or its events were lost); what was
        learnt about its hashing stays (the same engine image hashes the same way)."""
        eng = self.engines.get(name)
        if eng is not None:
            eng.tiers.clear()
            eng.pending.clear()

    def drop(self, name: str) -> None:
        self.engines.pop(name, None)

    # ------------------------------------------------------------------ events
    def apply(self, name: str, event: Any) -> None:
        """One decoded event (:mod:`pdstack.proxy.kv_events` structs, or any object with
        the same attributes) from engine ``name``."""
        kind = type(event).__name__
        eng = self.engine(name)
        if kind == "BlockStored":
            self._stored(eng, event)
        elif kind == "BlockRemoved":
            tier = eng.tiers.get(event.medium or DEFAULT_MEDIUM)
            for h in event.block_hashes:
                key = external_hash(h)
                eng.pending.pop(key, None)
                if tier is not None:
                    tier.pop(key, None)
                    eng.removed += 1
        elif kind == "AllBlocksCleared":
            # vLLM's reset_prefix_cache: the GPU cache only (the tier clears itself apart)
            eng.tiers.pop(GPU, None)
            eng.pending.clear()

    def _stored(self, eng: EngineBlocks, ev: Any) -> None:
        medium = ev.medium or DEFAULT_MEDIUM
        if medium == GPU and ev.block_size:
            eng.block_size = ev.block_size
        if ev.parent_block_hash is None and ev.block_size and ev.token_ids:
            self._calibrate(eng, ev)
        tier = eng.tiers.setdefault(medium, {})
        for h in ev.block_hashes:
            key = external_hash(h)
            tier[key] = None
            eng.pending.pop(key, None)
            eng.stored += 1
        excess = eng.size() - self.capacity
        while excess > 0 and tier:
            del tier[next(iter(tier))]
            excess -= 1

    def _calibrate(self, eng: EngineBlocks, ev: Any) -> None:
        if eng.scheme is not None and (eng.salt_known or not ev.extra_keys):
            return
        first = ev.token_ids[: ev.block_size]
        if len(first) < ev.block_size or not ev.block_hashes:
            return
        extra = ev.extra_keys[0] if ev.extra_keys else None
        salt: str | None = None
        if extra:
            if len(extra) != 1 or not isinstance(extra[0], str):
                return  # LoRA or multimodal keys: not a salt to check
            salt = extra[0]
        want = external_hash(ev.block_hashes[0])
        for scheme in self._schemes:
            if block_hashes(first, ev.block_size, scheme, salt) == [want]:
                eng.scheme = scheme
                eng.salt_known = eng.salt_known or salt is not None
                eng.mismatches = 0
                return
        if eng.scheme is None:
            eng.mismatches += 1

    # ------------------------------------------------------------------ lookups
    def schemes_for(self, name: str, salted: bool) -> list[HashScheme]:
        """The schemes to hash a request with for ``name``: its verified one (both salt
        forms while a salted first block has not told which), none if unverified."""
        eng = self.engines.get(name)
        if eng is None or eng.scheme is None:
            return []
        if salted and not eng.salt_known:
            return [eng.scheme, HashScheme(eng.scheme.seed, not eng.scheme.salt_tagged)]
        return [eng.scheme]

    def route(self, name: str, hashes: Sequence[int], now: float, ttl: float) -> None:
        """A request with these block hashes was routed to ``name`` at ``now``
        (``time.monotonic``): count them as held there for ``ttl`` seconds unless its events
        tell first (the module's docstring). Blocks it already holds are not marked."""
        eng = self.engines.get(name)
        if eng is None or ttl <= 0:
            return
        gpu = eng.tiers.get(GPU, {})
        pending = eng.pending
        deadline = now + ttl
        for h in hashes:
            if h not in gpu:
                pending.pop(h, None)  # re-inserted: the oldest stay first
                pending[h] = deadline
        while pending:  # lapsed ones, oldest first; and never more than the index holds
            oldest, at = next(iter(pending.items()))
            if at > now and len(pending) <= self.capacity:
                break
            del pending[oldest]

    def held(self, name: str, hashes: Sequence[int], now: float | None = None) -> Held:
        """The longest prefix of ``hashes`` in the GPU cache (or routed there before ``now``
        plus its ttl: :meth:`route`), then the run after it that the CPU tier holds (vLLM
        loads a native-tier hit after the GPU prefix)."""
        eng = self.engines.get(name)
        if eng is None:
            return Held(0, 0, 0)
        gpu = eng.tiers.get(GPU, {})
        cpu = eng.tiers.get(CPU, {})
        pending = eng.pending
        g = 0
        while g < len(hashes) and (hashes[g] in gpu or (
                now is not None and pending.get(hashes[g], 0.0) > now)):
            g += 1
        c = g
        while c < len(hashes) and (hashes[c] in cpu or hashes[c] in gpu):
            c += 1
        return Held(g, c - g, eng.block_size)

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            name: {medium.lower(): len(t) for medium, t in eng.tiers.items()}
            for name, eng in self.engines.items()
        }


def hashes_by_scheme(
    tokens: Sequence[int], block_size: int, schemes: Iterable[HashScheme], salt: str | None
) -> dict[HashScheme, list[int]]:
    """A request's hashes once per distinct scheme (engines of one image share one)."""
    return {s: block_hashes(tokens, block_size, s, salt) for s in dict.fromkeys(schemes)}
