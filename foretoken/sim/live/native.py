"""SGLang's native ``POST /generate`` on a simulated engine, in SGLang's shapes: ``text``
or ``input_ids``, ``sampling_params.max_new_tokens`` (default 128), ``stream``. Streamed,
one event per token whose ``text`` and ``output_ids`` are cumulative (SGLang's default) and
whose ``meta_info`` counts the prompt, cached and output tokens so far, then a last event
with the finish reason as an object, and ``[DONE]``; otherwise that last event as one JSON
answer. Generated text is the simulator's stand-ins, as on its OpenAI endpoints."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from foretoken.sim.engine import RequestTooLarge

if TYPE_CHECKING:
    from foretoken.sim.live.server import SimEngine

DEFAULT_MAX_NEW_TOKENS: Final = 128


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def generate(engine: SimEngine, request: web.Request) -> web.StreamResponse:
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
            token_ids = list(ids)
        elif isinstance(text, str) and text:
            token_ids = engine.tokenizer.encode(text)
        else:
            raise ValueError("one prompt is required: text (a string) or input_ids")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise ValueError("sampling_params must be an object")
        max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if not isinstance(max_new, int) or max_new < 0:
            raise ValueError("sampling_params.max_new_tokens must be a non-negative integer")
        rid, pending = await engine.generate(token_ids, max(1, max_new))
    except RequestTooLarge as exc:
        return _error(400, str(exc))
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        return _error(400, str(exc))
    pieces: list[str] = []
    output_ids: list[int] = []

    def event(finish: dict[str, Any] | None) -> dict[str, Any]:
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": pending.prompt_tokens,
            "completion_tokens": len(output_ids),
            "cached_tokens": pending.cached_tokens,
        }
        return {"text": "".join(pieces), "output_ids": list(output_ids), "meta_info": meta}

    def line(doc: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

    resp: web.StreamResponse | None = None
    if body.get("stream"):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
    async for token in engine.stream_tokens(rid, pending):
        pieces.append(engine.tokenizer.decode_one(token))
        output_ids.append(token)
        if resp is not None:
            await resp.write(line(event(None)))
    final = event({"type": "length", "length": len(output_ids)})
    engine.served += 1
    if resp is None:
        return web.json_response(final)
    await resp.write(line(final) + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
