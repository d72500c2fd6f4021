"""How the fake engine answers one generate request (a TEST DOUBLE, see
:mod:`pdstack.testing.fake_engine`): vLLM's 400 for a prompt past ``max_model_len``, the
unary JSON or the SSE stream of an :class:`Answer`, paced by the engine's TTFT and ITL, with
the fault it plays (abort, hang, vLLM's error event); the engine's counters are counted as
tokens go out."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from aiohttp import web

from pdstack.testing.fake_wire import OUTPUT_ID_BASE, Answer, Faults, error_json, prompt_text


class Pacing(Protocol):
    """What an answer reads of its engine (a :class:`FakeEngine`) while it goes out."""

    name: str
    ttft_ms: float
    itl_ms: float
    counters: dict[str, int]


def too_long(body: dict[str, Any], limit: int | None) -> web.Response | None:
    """vLLM's 400 for prompt + max_tokens past ``max_model_len`` (None: it fits)."""
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    if limit is None or not isinstance(max_tokens, int):
        return None
    prompt = len(prompt_text(body).split())
    if prompt + max_tokens <= limit:
        return None
    message = (
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
        f"model's maximum context length is {limit} tokens and your request has "
        f"{prompt} input tokens ({max_tokens} > {limit} - {prompt})."
    )
    return web.json_response(error_json(400, message), status=400)


async def unary(
    eng: Pacing, ans: Answer, fault: Faults | None, transport: asyncio.BaseTransport | None
) -> web.StreamResponse:
    if fault is not None and fault.close_after_chunks is not None:
        abort(transport)
        raise asyncio.CancelledError
    if fault is not None and fault.hang_after_chunks is not None:
        await asyncio.Event().wait()
    failed = generation_error(fault, eng.name)
    if failed is not None:
        return web.json_response(failed, status=failed["error"]["code"])
    await asyncio.sleep((eng.ttft_ms + eng.itl_ms * (ans.count - 1)) / 1000)
    text = "".join(ans.tokens)
    if ans.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
    payload: dict[str, Any] = {
        "id": ans.response_id,
        "object": "chat.completion" if ans.chat else "text_completion",
        "created": ans.created,
        "model": ans.model,
        "choices": [choice],
        "usage": ans.usage,
    }
    if ans.kv_out is not None:
        payload["kv_transfer_params"] = ans.kv_out
    eng.counters["generation_tokens"] += ans.count
    eng.counters["success"] += 1
    return web.json_response(payload, headers={"X-Request-Id": ans.request_id})


async def stream(
    eng: Pacing,
    request: web.Request,
    body: dict[str, Any],
    ans: Answer,
    fault: Faults | None,
    transport: asyncio.BaseTransport | None,
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Request-Id": ans.request_id,
        }
    )
    await response.prepare(request)
    close_after = fault.close_after_chunks if fault is not None else None
    hang_after = fault.hang_after_chunks if fault is not None else None
    error_after = fault.error_event_after_chunks if fault is not None else None
    obj = "chat.completion.chunk" if ans.chat else "text_completion"
    head = f'{{"id":"{ans.response_id}","object":"{obj}","created":{ans.created},"model":'
    head += json.dumps(ans.model) + ',"choices":[{"index":0,'
    if eng.ttft_ms > 0:
        await asyncio.sleep(eng.ttft_ms / 1000)
    ids = ans.prompt_ids
    if ans.chat:
        extra = "" if ids is None else ',"prompt_token_ids":' + json.dumps(ids)
        await response.write(
            (
                "data: " + head + '"delta":{"role":"assistant","content":""},'
                '"logprobs":null,"finish_reason":null}]' + extra + "}\n\n"
            ).encode()
        )
    for i, token in enumerate(ans.tokens):
        if close_after is not None and i >= close_after:
            abort(transport)
            raise asyncio.CancelledError
        if hang_after is not None and i >= hang_after:
            await asyncio.Event().wait()
        if error_after is not None and i >= error_after:
            failed = generation_error(fault, eng.name)
            await response.write(b"data: " + json.dumps(failed).encode() + b"\n\n")
            break
        if i > 0 and eng.itl_ms > 0:
            await asyncio.sleep(eng.itl_ms / 1000)
        last = i == ans.count - 1
        finish = '"length"' if last else "null"
        if ans.chat:
            event = head + '"delta":{"content":' + json.dumps(token) + "},"
        else:
            event = head + '"text":' + json.dumps(token) + ","
        event += '"logprobs":null,"finish_reason":' + finish
        if ids is not None:  # return_token_ids: the token's id (the prompt's, first)
            if not ans.chat and i == 0:
                event += ',"prompt_token_ids":' + json.dumps(ids)
            event += f',"token_ids":[{OUTPUT_ID_BASE + int(token[2:])}]'
        event += "}]"
        if last and ans.kv_out is not None:
            event += ',"kv_transfer_params":' + json.dumps(ans.kv_out)
        event += "}"
        await response.write(b"data: " + event.encode() + b"\n\n")
        eng.counters["generation_tokens"] += 1
    opts = body.get("stream_options") or {}
    if opts.get("include_usage") and error_after is None:
        usage_event: dict[str, Any] = {
            "id": ans.response_id,
            "object": obj,
            "created": ans.created,
            "model": ans.model,
            "choices": [],
            "usage": ans.usage,
        }
        await response.write(b"data: " + json.dumps(usage_event).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    if fault is not None and fault.end_delay_ms > 0:
        await asyncio.sleep(fault.end_delay_ms / 1000)
    await response.write_eof()
    if error_after is None:
        eng.counters["success"] += 1
    return response


def generation_error(fault: Faults | None, name: str) -> dict[str, Any] | None:
    """vLLM's error for a generation that failed (``error_event_after_chunks``)."""
    if fault is None or fault.error_event_after_chunks is None:
        return None
    status = fault.error_event_status
    message = "Internal server error" if status >= 500 else f"bad request at {name}"
    return error_json(status, message)


def abort(transport: asyncio.BaseTransport | None) -> None:
    if transport is not None:
        transport.abort()  # type: ignore[attr-defined]
