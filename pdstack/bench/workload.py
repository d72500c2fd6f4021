"""The chat workload: K shared system prompts, length distributions, Poisson arrivals,
and (``turns`` set) multi-turn conversations that come back after a think time.

Everything here is deterministic for a given seed, so two runs of the same
command send the same prompts at the same offsets.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

# Short, common English words: a byte-level BPE tokenizer makes about one
# token of each (with its leading space), so N words ~ N prompt tokens.
_WORD_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new "
    "work part take get place made live where after back little only round man year came show "
    "every good me give our under name very through just form sentence great think say help "
    "low line differ turn cause much mean before move right boy old too same tell does set "
    "three want air well also play small end put home read hand port large spell add even land "
    "here must big high such follow act why ask men change went light kind off need house "
    "picture try us again animal point mother world near build self earth father head"
)
_WORDS = tuple(_WORD_TEXT.split())


class DistributionError(ValueError):
    """A length distribution spec that cannot be parsed."""


@dataclass(frozen=True)
class Distribution:
    """A distribution of positive integer lengths, parsed from a short spec.

    Specs: ``N`` (always N), ``uniform:LO:HI`` (inclusive), ``normal:MEAN:STD``,
    ``lognormal:MEAN:SIGMA`` (MEAN is the distribution's mean, SIGMA the
    underlying normal's sigma). Samples are clipped to ``[1, max]``.
    """

    kind: str
    a: float
    b: float = 0.0
    max_value: int = 1_000_000

    @classmethod
    def parse(cls, spec: str, max_value: int = 1_000_000) -> Distribution:
        parts = spec.strip().split(":")
        try:
            if len(parts) == 1:
                value = int(parts[0])
                if value < 1:
                    raise DistributionError(f"length must be >= 1, got {spec!r}")
                return cls("fixed", value, max_value=max_value)
            kind, nums = parts[0].lower(), [float(p) for p in parts[1:]]
        except ValueError as exc:
            if isinstance(exc, DistributionError):
                raise
            raise DistributionError(f"cannot parse length distribution {spec!r}") from exc
        if kind not in ("uniform", "normal", "lognormal") or len(nums) != 2:
            raise DistributionError(
                f"unknown length distribution {spec!r}: use N, uniform:LO:HI, "
                "normal:MEAN:STD or lognormal:MEAN:SIGMA"
            )
        lo, hi = nums
        if kind == "uniform" and not 1 <= lo <= hi:
            raise DistributionError(f"uniform needs 1 <= LO <= HI, got {spec!r}")
        if kind in ("normal", "lognormal") and (lo <= 0 or hi < 0):
            raise DistributionError(f"{kind} needs MEAN > 0 and a spread >= 0, got {spec!r}")
        return cls(kind, lo, hi, max_value=max_value)

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:  # lognormal with the given mean: mu = ln(mean) - sigma^2 / 2
            value = rng.lognormvariate(math.log(self.a) - self.b**2 / 2, self.b)
        return max(1, min(self.max_value, round(value)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def poisson_arrivals(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Arrival offsets (seconds from 0) of a Poisson process of ``rate``/s over ``duration``."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class WorkloadConfig:
    num_system_prompts: int = 4
    shared_share: float = 0.8
    system_len: Distribution = field(default_factory=lambda: Distribution.parse("1024"))
    user_len: Distribution = field(default_factory=lambda: Distribution.parse("uniform:32:256"))
    output_len: Distribution = field(default_factory=lambda: Distribution.parse("uniform:64:256"))
    token_ids: bool = False
    token_id_min: int = 10
    token_id_max: int = 4000
    seed: int = 0
    # multi-turn: turns per conversation (None: one request per arrival, no conversations)
    turns: Distribution | None = None
    think_time: float = 4.0  # seconds, mean of an exponential, between turns
    # leads every prompt's tag (its first token id, or first word): the same workload on cold
    # caches with no vLLM cache_salt, which a router that hashes prompts may not know
    prompt_salt: str | None = None

    def __post_init__(self) -> None:
        if self.num_system_prompts < 1:
            raise ValueError("need at least one system prompt")
        if not 0.0 <= self.shared_share <= 1.0:
            raise ValueError("shared share must be within [0, 1]")
        if not 0 <= self.token_id_min < self.token_id_max:
            raise ValueError("need 0 <= token_id_min < token_id_max")
        if self.think_time <= 0:
            raise ValueError("think time must be > 0 seconds")


@dataclass(frozen=True)
class ChatRequest:
    """One request: a system part, a user part and the answer length asked for.

    A turn of a conversation also carries the earlier turns (``history``: user,
    assistant, user, assistant, ... contents between the system part and ``user``)
    and the conversation's ``session`` id."""

    index: int
    system_prompt_id: int | None  # None: a unique system prompt (no shared prefix)
    system: str | list[int]
    user: str | list[int]
    max_tokens: int
    prompt_len: int  # tokens (token ids) or words (text, ~ tokens)
    history: tuple[str | list[int], ...] = ()
    session: str | None = None
    turn: int = 0

    @property
    def shared(self) -> bool:
        return self.system_prompt_id is not None


class Workload:
    """Draws requests: a ``shared_share`` of them start with one of K system prompts."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        rng = random.Random(f"system-prompts-{config.seed}")
        self.system_prompts: list[str | list[int]] = [
            self._text_or_ids(rng, config.system_len.sample(rng), tag=f"system prompt {i}")
            for i in range(config.num_system_prompts)
        ]
        self._rng = random.Random(f"requests-{config.seed}")
        self._count = 0
        self._conversation_count = 0

    def _text_or_ids(self, rng: random.Random, n: int, tag: str) -> str | list[int]:
        cfg = self.config
        lead = f"{cfg.prompt_salt} {tag}" if cfg.prompt_salt else tag
        if cfg.token_ids:
            # The lead's checksum makes the first ids differ between prompts (and salts).
            span = cfg.token_id_max - cfg.token_id_min
            head = [cfg.token_id_min + zlib.crc32(lead.encode()) % span]
            return head + rng.choices(range(cfg.token_id_min, cfg.token_id_max), k=n - 1)
        # The lead (a few words) always comes first, so a prompt may be a bit longer than n;
        # as many words are drawn with a salt as without (the same draw after it).
        words = rng.choices(_WORDS, k=max(0, n - len(tag.split())))
        return " ".join(lead.split() + words)

    def next_request(self) -> ChatRequest:
        cfg, rng = self.config, self._rng
        index = self._count
        self._count += 1
        if rng.random() < cfg.shared_share:
            sp_id: int | None = rng.randrange(cfg.num_system_prompts)
            system = self.system_prompts[sp_id]  # type: ignore[index]
        else:
            sp_id = None
            system = self._text_or_ids(rng, cfg.system_len.sample(rng), tag=f"unique {index}")
        user = self._text_or_ids(rng, cfg.user_len.sample(rng), tag=f"question {index}")
        prompt_len = len(system) + len(user) if cfg.token_ids else (
            len(str(system).split()) + len(str(user).split())
        )
        return ChatRequest(index, sp_id, system, user, cfg.output_len.sample(rng), prompt_len)

    def requests(self) -> Iterator[ChatRequest]:
        while True:
            yield self.next_request()

    def schedule(
        self, rate: float, total_seconds: float, seed: int
    ) -> list[tuple[float, ChatRequest]]:
        """The requests of one asked ``rate`` over ``total_seconds`` with their send
        offsets (seconds from 0), in send order. Without ``turns``: Poisson arrivals,
        one :meth:`next_request` each (the stream continues across calls)."""
        if self.config.turns is not None:
            return self._conversations(rate, total_seconds, seed)
        arrivals = poisson_arrivals(rate, total_seconds, random.Random(f"arrivals-{seed}-{rate}"))
        return [(t, self.next_request()) for t in arrivals]

    def _length(self, part: str | list[int]) -> int:
        return len(part) if isinstance(part, list) else len(part.split())

    def _conversations(
        self, rate: float, total_seconds: float, seed: int
    ) -> list[tuple[float, ChatRequest]]:
        """Open-loop conversations: they start as a Poisson process at
        ``rate / mean(turns)``; turn k is sent at start + the sum of k exponential think
        times, whatever the target does, so every target gets the same requests at the
        same offsets. Conversations also start up to a horizon before 0 (their turns
        before 0 are not sent), so the rate is ``rate`` from the first second on."""
        cfg = self.config
        assert cfg.turns is not None
        mean_turns = max(1.0, cfg.turns.mean)
        horizon = 3.0 * mean_turns * cfg.think_time
        timing = random.Random(f"conversations-{seed}-{rate}")
        starts = poisson_arrivals(rate / mean_turns, total_seconds + horizon, timing)
        rng = self._rng
        pending: list[tuple[float, int, int, int | None, str | list[int],
                           tuple[str | list[int], ...], str | list[int], int, str]] = []
        for start in starts:
            n_turns = cfg.turns.sample(rng)
            offsets = [start - horizon]
            for _ in range(n_turns - 1):
                offsets.append(offsets[-1] + timing.expovariate(1.0 / cfg.think_time))
            last = max((k for k, t in enumerate(offsets) if 0.0 <= t < total_seconds),
                       default=-1)
            if last < 0:
                continue  # nothing of it falls in the run
            conv = self._conversation_count
            self._conversation_count += 1
            session = f"conv-{cfg.seed}-{conv}"
            if rng.random() < cfg.shared_share:
                sp_id: int | None = rng.randrange(cfg.num_system_prompts)
                system = self.system_prompts[sp_id]  # type: ignore[index]
            else:
                sp_id = None
                system = self._text_or_ids(rng, cfg.system_len.sample(rng),
                                           tag=f"unique conversation {conv}")
            history: list[str | list[int]] = []
            for k in range(last + 1):
                user = self._text_or_ids(rng, cfg.user_len.sample(rng),
                                         tag=f"conversation {conv} question {k}")
                max_tokens = cfg.output_len.sample(rng)
                if offsets[k] >= 0.0:
                    pending.append((offsets[k], conv, k, sp_id, system, tuple(history), user,
                                    max_tokens, session))
                # the synthetic answer of this turn, as long as the answer asked for
                answer = self._text_or_ids(rng, max_tokens, tag=f"answer {conv} {k}")
                history += [user, answer]
        pending.sort(key=lambda p: (p[0], p[1], p[2]))
        out: list[tuple[float, ChatRequest]] = []
        for offset, _, k, sp_id, system, hist, user, max_tokens, session in pending:
            index = self._count
            self._count += 1
            prompt_len = self._length(system) + sum(map(self._length, hist)) + self._length(user)
            out.append((offset, ChatRequest(index, sp_id, system, user, max_tokens, prompt_len,
                                            history=hist, session=session, turn=k)))
        return out
