"""Forwarding a request to its engine and measuring what the client sees.

The engine is always asked to stream (with ``include_usage``): the first SSE chunk with
non-empty content marks the first token. A streaming client gets the engine's chunks as they
come (minus the usage-only chunk if it did not ask for usage); a non-streaming client gets
the chunks assembled into one OpenAI answer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web


@dataclass
class Measured:
    """What the router measured of one forwarded request."""

    first_token_s: float | None = None  # monotonic time of the first content token
    done_s: float | None = None
    output_tokens: int = 0
    usage_seen: bool = False  # the engine sent a usage object (else tokens are counted)
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    status: str = "ok"
    error: str | None = None
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    engine_status: int = 200
    engine_body: bytes = b""


def _content(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    if "text" in first:
        return str(first.get("text") or "")
    delta = first.get("delta") or {}
    return str(delta.get("content") or "")


def _note_usage(measured: Measured, chunk: dict[str, Any]) -> None:
    usage = chunk.get("usage")
    if not isinstance(usage, dict):
        return
    measured.usage_seen = True
    measured.prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    # Absent = the engine did not say; whether that means 0 depends on the engine (the caller
    # knows): vLLM with prompt-token details omits the field on a miss.
    measured.cached_tokens = int(cached) if isinstance(cached, int) else None
    if isinstance(usage.get("completion_tokens"), int):
        measured.output_tokens = usage["completion_tokens"]


async def forward(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    client: web.StreamResponse | None,
    on_first_token: Any,
    timeout_s: float,
) -> Measured:
    """POST ``body`` (made streaming) to ``url``; relay to ``client`` if it streams."""
    wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    upstream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    measured = Measured()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(url, json=upstream, timeout=timeout) as resp:
        measured.engine_status = resp.status
        if resp.status != 200:
            measured.status = "error"
            measured.engine_body = await resp.read()
            measured.error = f"engine answered {resp.status}"
            return measured
        buffer = b""
        async for data in resp.content.iter_any():
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                await _on_event(event, measured, client, wants_usage, on_first_token)
    measured.done_s = time.monotonic()
    if not measured.usage_seen:  # llama-cpp-python streams no usage: one chunk, one token
        measured.output_tokens = len(measured.texts)
    return measured


async def _on_event(
    event: bytes, measured: Measured, client: web.StreamResponse | None, wants_usage: bool,
    on_first_token: Any,
) -> None:  # fmt: skip
    line = event.strip()
    if not line.startswith(b"data:"):
        return
    payload = line[5:].strip()
    if payload == b"[DONE]":
        if client is not None:
            await client.write(b"data: [DONE]\n\n")
        return
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError:
        return
    usage_only = not chunk.get("choices") and "usage" in chunk
    _note_usage(measured, chunk)
    text = _content(chunk)
    if text:
        measured.texts.append(text)
        if measured.first_token_s is None:
            measured.first_token_s = time.monotonic()
            on_first_token(measured.first_token_s)
    choices = chunk.get("choices") or []
    if choices and choices[0].get("finish_reason"):
        measured.finish_reason = choices[0]["finish_reason"]
    if client is not None and (wants_usage or not usage_only):
        if not wants_usage:
            chunk.pop("usage", None)
        await client.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


def assembled(measured: Measured, model: str, request_id: str, chat: bool) -> dict[str, Any]:
    """A non-streaming OpenAI answer from the streamed chunks."""
    text = "".join(measured.texts)
    choice: dict[str, Any] = {"index": 0, "finish_reason": measured.finish_reason or "stop"}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    usage: dict[str, Any] = {
        "prompt_tokens": measured.prompt_tokens or 0,
        "completion_tokens": measured.output_tokens,
        "total_tokens": (measured.prompt_tokens or 0) + measured.output_tokens,
    }
    if measured.cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": measured.cached_tokens}
    return {
        "id": f"cmpl-{request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
