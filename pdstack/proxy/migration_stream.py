"""Stream migration's bookkeeping of one client stream (:mod:`pdstack.proxy.migration`):
which requests can be migrated, the token ids the client has received, and the rewrite of
the events on their way to the client.

The leg asks the engine for the token ids of its output (vLLM's ``return_token_ids``: each
event's choice carries ``token_ids``, the first one ``prompt_token_ids``, the prompt as the
engine tokenized it, chat template applied). The tracker reads them off each event written
to the client, on the bytes (no JSON parse on the hot path), and sets them back to ``null``
(what vLLM sends when they were not asked for) unless the client asked for them itself.
A continuation is a ``/v1/completions`` stream whose prompt is those prompt token ids plus
the output token ids so far, with ``max_tokens`` reduced by as many: the next engine
computes exactly the sequence the failed one had (greedy decoding gives the same tokens).
Its events are rewritten to the client's stream: the first stream's ``id``, ``created`` and
``model``; for a chat request, ``text`` becomes ``delta.content`` in
``chat.completion.chunk`` events; ``usage`` counts what the client received (its prompt,
and every output token of every engine)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pdstack.proxy.errors import error_event_status

SSE_END = b"\n\n"
DONE = b"data: [DONE]"

_IDS = b'"token_ids":['  # an event's own (a "prompt_token_ids" key has "_" before it)
_PROMPT_IDS = re.compile(rb'"prompt_token_ids":\[([0-9, ]*)\]')

# chat-only fields, left out of a chat request's continuation on /v1/completions
_CHAT_ONLY = frozenset({
    "messages", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "reasoning_effort", "include_reasoning", "max_completion_tokens",
    "mm_processor_kwargs", "add_special_tokens", "modalities", "audio", "metadata", "store",
    "prediction", "web_search_options", "service_tier", "top_logprobs", "logprobs",
})
# what a continuation must not carry over
_DROPPED = frozenset({"kv_transfer_params", "echo", "suffix", "prompt", "n", "best_of"})


def cannot_migrate(path: str, body: dict[str, Any]) -> str | None:
    """Why the stream of this request cannot be continued on another engine (None: it can).
    Only streamed n=1 requests whose output is the token sequence alone: logprobs, tools,
    structured output, stop strings (text vLLM holds back), echo, ... are not."""
    if not body.get("stream"):
        return "not streamed (retried whole instead)"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n > 1"
    if body.get("use_beam_search"):
        return "beam search"
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        return "logprobs"
    if body.get("prompt_logprobs") is not None:
        return "prompt logprobs"
    if body.get("echo"):
        return "echo"
    if body.get("suffix"):
        return "suffix"
    if body.get("tools") or body.get("functions"):
        return "tools (a tool-call parser mid-call)"
    if any(body.get(k) for k in ("response_format", "structured_outputs", "guided_json",
                                 "guided_regex", "guided_choice", "guided_grammar")):
        return "structured output"
    if body.get("stop"):
        return "stop strings (text held back)"
    if path.endswith("/chat/completions"):
        return None if isinstance(body.get("messages"), list) else "no messages"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list | tuple):
        prompt = prompt[0]
    if isinstance(prompt, str) or (
        isinstance(prompt, list | tuple) and set(map(type, prompt)) <= {int, bool}
    ):
        return None
    return "several prompts"


def with_token_ids(payload: bytes) -> bytes:
    """A request body (JSON object) that also asks for the output's token ids (the last
    key wins over the client's own)."""
    body = payload.rstrip()
    if not body.endswith(b"}"):
        return payload
    return body[:-1] + (b',"return_token_ids":true}' if body[:-1].strip() != b"{"
                        else b'"return_token_ids":true}')


def _has_text(event: bytes, chat: bool) -> bool:
    """An event (vLLM's compact JSON) whose choice carries text."""
    if chat:
        return b'"content":"' in event and b'"content":""' not in event
    return b'"text":"' in event and b'"text":""' not in event


def _ints(raw: bytes) -> list[int]:
    if len(raw) > 64:  # a prompt's: the C parser (digits, commas, spaces: the regex's)
        ints: list[int] = json.loads(b"[" + raw + b"]")
        return ints
    if b"," not in raw:
        return [int(raw)] if raw.strip() else []
    return [int(x) for x in raw.split(b",") if x.strip()]


class StreamTracker:
    """The rewrite (``bytes -> bytes``, event-aligned) of one client stream that may be
    migrated; ``downstream``: the rest of the rewrite chain (the error events, the usage's
    cached tokens). See the module docstring."""

    def __init__(self, chat: bool, keep_ids: bool,
                 downstream: Callable[[bytes], bytes] | None = None) -> None:
        self.chat = chat
        self.keep_ids = keep_ids  # the client asked for token ids itself
        self.downstream = downstream
        # a tuple: the collector stops walking it (pdstack.proxy.routing.settle_prompt)
        self.prompt_ids: tuple[int, ...] | None = None
        self.token_ids: list[int] = []
        # output tokens up to the last whose text reached the client: the ones after it
        # are bytes of a character not complete yet, which vLLM holds back ("" text); a
        # continuation starts after the clean ones and makes the others again (a token-id
        # prompt ending mid-character makes vLLM's DecodeStream echo the whole prompt)
        self.clean = 0
        self.head: dict[str, Any] = {}  # the first stream's id, created, model
        self.finished = False  # a finish_reason reached the client
        self.done = False  # data: [DONE] reached the client
        self.broken = ""  # why it cannot be migrated after all (found in the stream)
        self.error: tuple[int, bytes] | None = None  # a 5xx error event held back
        self.carried = 0  # output tokens already sent when the current engine began
        self.migrations = 0

    @property
    def migratable(self) -> bool:
        # a client that asked for token ids got those of the held-back tokens already
        held = self.keep_ids and self.clean < len(self.token_ids)
        return not self.broken and self.prompt_ids is not None and not self.finished and not held

    def __call__(self, data: bytes) -> bytes:
        out = []
        for event in data.split(SSE_END):
            if not event.strip():
                out.append(event)
                continue
            kept = self._event(event)
            if kept is not None:
                out.append(kept)
        result = SSE_END.join(out)
        if result and not result.endswith(SSE_END) and data.endswith(SSE_END):
            result += SSE_END
        return self.downstream(result) if self.downstream is not None and result else result

    def _event(self, event: bytes) -> bytes | None:
        if self.error is not None:
            return None  # after a held-back error event: nothing (its [DONE])
        stripped = event.lstrip(b"\r\n")
        if stripped.startswith(DONE):
            self.done = True
            return event
        if b'"error"' in event:
            payload = stripped[5:].strip() if stripped.startswith(b"data:") else b""
            status = error_event_status(payload) if payload else None
            if status is not None:
                if status >= 500 and self.migratable:
                    self.error = (status, payload)  # the leg failed: migrate, if it can
                    return None
                return event
        if self.carried or self.migrations:
            return self._continued(stripped)
        at = event.find(_IDS)
        if at >= 0:
            start = at + len(_IDS)
            end = event.find(b"]", start)
            self.token_ids += _ints(event[start:end])
            if _has_text(event, self.chat):
                self.clean = len(self.token_ids)
            if not self.keep_ids:  # as vLLM sends it when not asked
                event = event[:at] + b'"token_ids":null' + event[end + 1:]
        elif b'"choices":[]' not in event:
            self._check_untracked(stripped)
        if self.prompt_ids is None and b'"prompt_token_ids":[' in event:
            prompt = _PROMPT_IDS.search(event)
            if prompt is not None:
                self.prompt_ids = tuple(_ints(prompt.group(1)))
                if not self.keep_ids:
                    event = event[:prompt.start()] + b'"prompt_token_ids":null' + \
                        event[prompt.end():]
        if not self.head:
            self._take_head(stripped)
        if b'"reasoning' in event:
            self.broken = "reasoning output"
        if b'"finish_reason":"' in event:
            self.finished = True
        return event

    def _check_untracked(self, event: bytes) -> None:
        """An event without token ids: fine when it carries no output (a chat stream's role
        preamble); otherwise the engine hides them (a reasoning parser): not migratable."""
        try:
            doc = json.loads(event[5:]) if event.startswith(b"data:") else None
        except (ValueError, UnicodeDecodeError):
            doc = None
        if not isinstance(doc, dict):
            return
        for choice in doc.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") if self.chat else None
            text = (delta or {}).get("content") if self.chat else choice.get("text")
            if text or (self.chat and isinstance(delta, dict)
                        and any(delta.get(k) for k in delta if k not in ("role", "content"))):
                self.broken = "token ids missing from the stream"

    def _take_head(self, event: bytes) -> None:
        try:
            doc = json.loads(event[5:]) if event.startswith(b"data:") else None
        except (ValueError, UnicodeDecodeError):
            return
        if isinstance(doc, dict) and "id" in doc:
            self.head = {k: doc[k] for k in ("id", "created", "model") if k in doc}

    # ------------------------------------------------------------ a continuation
    def resume(self) -> None:
        """The next engine's stream begins: what it counts as prompt beyond the client's
        is the output already sent (held-back tokens are made again)."""
        self.migrations += 1
        del self.token_ids[self.clean:]
        self.carried = self.clean
        self.error = None

    def continuation(self, body: dict[str, Any]) -> tuple[str, bytes] | None:
        """The path and body that continue the stream on another engine (None: nothing
        left to generate)."""
        assert self.prompt_ids is not None
        sent = self.clean
        cont = {k: v for k, v in body.items()
                if k not in _DROPPED and not (self.chat and k in _CHAT_ONLY)}
        limit = body.get("max_tokens")
        if limit is None and self.chat:
            limit = body.get("max_completion_tokens")
        if isinstance(limit, int):
            if limit - sent <= 0:
                return None
            cont["max_tokens"] = limit - sent
        if isinstance(body.get("min_tokens"), int):
            cont["min_tokens"] = max(0, body["min_tokens"] - sent)
        cont["prompt"] = [*self.prompt_ids, *self.token_ids[:sent]]
        cont["stream"] = True
        cont["return_token_ids"] = True
        return "/v1/completions", json.dumps(cont, separators=(",", ":")).encode()

    def _continued(self, event: bytes) -> bytes | None:
        """An event of a continuation, as the client's stream goes on."""
        try:
            doc = json.loads(event[5:]) if event.startswith(b"data:") else None
        except (ValueError, UnicodeDecodeError):
            doc = None
        if not isinstance(doc, dict):
            return event
        doc.update(self.head)
        doc.pop("prompt_token_ids", None)
        choices = []
        for choice in doc.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.token_ids += [t for t in ids if isinstance(t, int)]
                if choice.get("text"):
                    self.clean = len(self.token_ids)
            if choice.get("finish_reason") is not None:
                self.finished = True
            choice.pop("prompt_token_ids", None)
            if not self.keep_ids:
                choice["token_ids"] = None
            if self.chat:
                choice = {"index": choice.get("index", 0),
                          "delta": {"content": choice.get("text") or ""},
                          "logprobs": None, **{k: choice[k] for k in
                          ("finish_reason", "stop_reason", "token_ids") if k in choice}}
            choices.append(choice)
        if "choices" in doc:
            doc["choices"] = choices
        if self.chat:
            doc["object"] = "chat.completion.chunk"
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode()

    def _usage(self, usage: dict[str, Any]) -> None:
        """The continuation's usage as the client's: its prompt, every output token."""
        carried = self.carried
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            usage["prompt_tokens"] = prompt - carried
            usage["completion_tokens"] = completion + carried
            usage["total_tokens"] = prompt + completion
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                details["cached_tokens"] = min(details["cached_tokens"], prompt - carried)

    def error_event(self) -> bytes:
        """The held-back error event, as vLLM sent it (the caller rewrites it)."""
        assert self.error is not None
        return b"data: " + self.error[1]
