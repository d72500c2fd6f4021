"""The fake engine's vocabulary (a TEST DOUBLE, see :mod:`pdstack.testing.fake_engine`): the
faults it plays, the requests it records, how it reads a prompt and makes its tokens and
token ids, vLLM's error JSON, and what one generate request answers."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Faults:
    """Fault injection for generation requests (see :mod:`pdstack.testing.fake_engine`)."""

    status: int | None = None
    delay_ms: float = 0.0
    hang: bool = False
    hang_after_chunks: int | None = None
    close_after_chunks: int | None = None
    error_event_after_chunks: int | None = None
    error_event_status: int = 500
    times: int | None = None
    health_status: int = 200
    health_hang: bool = False
    health_delay_ms: float = 0.0
    poison: str | None = None
    poison_status: int = 500
    end_delay_ms: float = 0.0  # after a stream's data: [DONE], before its body's end

    def active(self) -> bool:
        return (
            self.status is not None
            or self.delay_ms > 0
            or self.hang
            or self.hang_after_chunks is not None
            or self.close_after_chunks is not None
            or self.error_event_after_chunks is not None
            or self.end_delay_ms > 0
        )


@dataclass
class SeenRequest:
    """One request the engine received."""

    path: str
    headers: dict[str, str]  # names lower-cased
    body: dict[str, Any] | None
    received_at: float = field(default_factory=time.time)

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# the fake's token ids (``return_token_ids``): a prompt's are its characters' code points,
# output token `` t<k>``'s is OUTPUT_ID_BASE + k
OUTPUT_ID_BASE = 2_000_000


def continued_prompt(body: dict[str, Any]) -> tuple[str, int] | None:
    """A token-id prompt that carries output ids (a stream continued elsewhere, as the
    proxy's migration sends it): (the original prompt's text, output tokens already made)."""
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return None
    done = sum(1 for t in prompt if t >= OUTPUT_ID_BASE)
    if not done:
        return None
    return "".join(chr(t) for t in prompt if t < OUTPUT_ID_BASE), done


def prompt_text(body: dict[str, Any]) -> str:
    continued = continued_prompt(body)
    if continued is not None:
        return continued[0]
    if "messages" in body:
        parts: list[str] = []
        for message in body.get("messages") or []:
            content = message.get("content", "")
            if isinstance(content, list):
                content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
            parts.append(f"{message.get('role', '')}: {content}")
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return " ".join(str(p) for p in prompt)
    return str(prompt)


# vLLM's error ``type`` per status: the names of its exception classes (vllm 0.32)
VLLM_ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_json(
    status: int, message: str, err_type: str | None = None, param: str | None = None
) -> dict[str, Any]:
    default = "BadRequestError" if status < 500 else "InternalServerError"
    kind = err_type or VLLM_ERROR_TYPES.get(status, default)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class Answer:
    """What one generate request answers (the same for the unary and the streamed form)."""

    chat: bool
    prompt_tokens: int
    count: int
    tokens: list[str]
    request_id: str
    kv_out: dict[str, Any] | None
    usage: dict[str, Any]
    model: Any
    response_id: str
    created: int
    prompt_ids: list[int] | None = None  # with return_token_ids: the prompt's token ids


def tokens_for(prompt: str, count: int, start: int = 0) -> list[str]:
    """Output tokens ``start`` .. ``start + count - 1`` of a prompt: `` t<k>``, ``k`` from the
    prompt and the index alone (every engine answers a prompt alike)."""
    seed = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
    return [f" t{(seed + 7919 * i) % 1000}" for i in range(start, start + count)]


def prompt_ids(body: dict[str, Any], prompt: str) -> list[int]:
    """The prompt's token ids: as given, else its characters' code points."""
    given = body.get("prompt")
    if isinstance(given, list) and given and all(isinstance(t, int) for t in given):
        return given
    return [ord(c) for c in prompt]
