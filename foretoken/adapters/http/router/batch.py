"""A ``/v1/completions`` prompt that is a batch (a list of several strings or token-id
lists: lm-eval's and other harnesses' shape): each prompt is its own request — tokenized,
routed (its own grant, prediction and request id: the first prompt's id, then ``ID.1``,
``ID.2``, …), forwarded to its engine and measured — and the client gets one answer, as
OpenAI's API gives it: prompt ``i``'s ``n`` choices are indices ``i·n … i·n+n-1``, the usage
is the sum. Streamed, the prompts' events interleave as their engines send them, each with
its choices' indices moved, and one ``[DONE]`` (and one usage event, when asked) ends it.

If any prompt is turned away (429, or too large for every engine) the whole batch is: the
prompts already granted are closed as cancelled (their engines never got them) and the
client gets the refusal that cannot be cured by waiting first, else the longest wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import msgspec
from aiohttp import web

from foretoken.adapters.http.router import edge, errors
from foretoken.adapters.http.router.path import (
    SSE_HEADERS,
    EventStream,
    RouterState,
    place,
    publish_completion,
    relay_to_engine,
    route,
    tokens_of,
)
from foretoken.adapters.http.router.proxy import (
    Chunk,
    Collected,
    Measured,
    fill_cached,
    prepare,
    sse_error,
    write,
)
from foretoken.adapters.http.router.requests import Decoded, RequestError
from foretoken.adapters.http.router.routing import Placement
from foretoken.core.types import RequestId
from foretoken.wire.records import Grant

_json = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
Routed = tuple[Grant, str, Placement]


async def completions(request: web.Request, state: RouterState, d: Decoded,
                      arrived: float) -> web.StreamResponse:  # fmt: skip
    """Answer a batch request (``d.batch`` holds its prompts)."""
    limit = state.settings.router.max_batch_prompts
    if len(d.batch) > limit:
        raise RequestError(f"prompt is a batch of {len(d.batch)} prompts, more than this router "
                           f"takes in one request ({limit}: router.max_batch_prompts)",
                           param="prompt")  # fmt: skip
    placements: list[Placement] = []
    for i, (text, ids, _) in enumerate(d.batch):
        tokens = await tokens_of(state, d.body.model, text, ids, f"prompt[{i}]",
                                 d.special_tokens)  # fmt: skip
        if not placements:
            placements.append(await place(state, request, d.body, tokens, d.max_output_tokens))
        else:
            rid = RequestId(f"{placements[0].request_id}.{i}")
            placements.append(dataclasses.replace(placements[0], request_id=rid, token_ids=tokens))
    decided = await asyncio.gather(*(route(state, p, False) for p in placements))
    refusals = [r for r in decided if isinstance(r, web.Response)]
    granted = [r for r in decided if not isinstance(r, web.Response)]
    if refusals:
        for grant, _, p in granted:  # never sent: the queue models let them go
            assert grant.worker_id is not None
            publish_completion(state, p, grant.worker_id, state.engines.get(grant.worker_id),
                               arrived, None, "cancelled",
                               "another prompt of its batch was turned away")  # fmt: skip
        return _worst(refusals)
    request_id = granted[0][2].request_id
    n = d.body.n or 1
    if d.body.stream:
        response = EventStream(headers={**SSE_HEADERS, "x-request-id": request_id})
        stream = _BatchStream(request, response, d.wants_usage,
                              all(state.reports_cached(g) for g, _, _ in granted))  # fmt: skip
        parts = [_Part(stream, i * n) for i in range(len(granted))]
        measured = await _run(state, request, d, granted, parts, arrived)
        if measured is None:  # the client went away
            return response
        if not stream.opened:  # no engine took its prompt: the first one's refusal
            return edge.engine_refusal(measured[0], False, request_id)
        await stream.finish([_failure(m) for m in measured])
        return response
    collected = [Collected(False, state.reports_cached(g)) for g, _, _ in granted]
    measured = await _run(state, request, d, granted, collected, arrived)
    if measured is None:
        return web.Response(status=499)  # the client went away: nobody reads this
    for m, c in zip(measured, collected, strict=True):
        if m.engine_status != 200:
            return edge.engine_refusal(m, False, request_id)
        if m.status != "ok" or c.error is not None:
            return errors.openai_error(504 if m.timed_out else 502,
                                       c.error or m.error or "engine error", "api_error",
                                       headers={"x-request-id": request_id})  # fmt: skip
    answers = [c.answer(p.model, p.request_id) for c, (_, _, p) in zip(collected, granted,
                                                                          strict=True)]  # fmt: skip
    return web.Response(body=_encoder.encode(merge(answers, n)), content_type="application/json",
                        headers={"x-request-id": request_id})  # fmt: skip


def _worst(refusals: list[web.Response]) -> web.Response:
    """The refusal to give for the whole batch: one waiting cannot cure, else the longest
    wait (a client that waits that long finds room for every prompt, as predicted)."""
    final = [r for r in refusals if r.status != 429]
    if final:
        return final[0]

    def wait(r: web.Response) -> float:
        try:
            return float(r.headers.get("Retry-After", "0"))
        except ValueError:
            return 0.0

    return max(refusals, key=wait)


async def _run(state: RouterState, request: web.Request, d: Decoded, granted: list[Routed],
               relays: list[Any], arrived: float) -> list[Measured] | None:  # fmt: skip
    """Forward every prompt to its engine at once; None when the client went away (the
    prompts still running are cancelled, each closed as such)."""
    tasks = [
        asyncio.ensure_future(relay_to_engine(state, request, p, grant, url + "/v1/completions",
                                              d.batch[i][2], relays[i], arrived))
        for i, (grant, url, p) in enumerate(granted)
    ]  # fmt: skip
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(t.result() is None for t in done):
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return None
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return [t.result() for t in tasks]  # type: ignore[misc]


def _failure(m: Measured) -> str | None:
    """What went wrong with one prompt's stream, if anything."""
    if m.engine_status != 200:
        return m.error or f"engine answered {m.engine_status}"
    return m.error if m.status != "ok" else None


def merge(answers: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The prompts' answers as one: choices in prompt order (prompt ``i``'s at ``i·n +``
    its own index), the usage summed."""
    choices = []
    for i, answer in enumerate(answers):
        for choice in answer.get("choices") or ():
            choices.append(choice | {"index": i * n + int(choice.get("index", 0))})
    return answers[0] | {"choices": choices,
                         "usage": sum_usage([a.get("usage") for a in answers])}  # fmt: skip


def sum_usage(usages: list[Any]) -> dict[str, Any] | None:
    """The prompts' usage objects summed (token counts, and cached tokens when said)."""
    given = [u for u in usages if isinstance(u, dict)]
    if not given:
        return None
    out: dict[str, Any] = {}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        values = [u.get(key) for u in given if isinstance(u.get(key), int)]
        if values:
            out[key] = sum(values)
    details = [u.get("prompt_tokens_details") for u in given]
    cached = [x.get("cached_tokens") for x in details if isinstance(x, dict)]
    if any(isinstance(c, int) for c in cached):
        out["prompt_tokens_details"] = {
            "cached_tokens": sum(c for c in cached if isinstance(c, int))}  # fmt: skip
    return out


class _BatchStream:
    """The client's one stream, written by every prompt's :class:`_Part`."""

    def __init__(self, request: web.Request, response: web.StreamResponse, wants_usage: bool,
                 reports_cached: bool) -> None:  # fmt: skip
        self.request, self.response = request, response
        self.wants_usage, self.reports_cached = wants_usage, reports_cached
        self.opened = self.error_sent = False
        self.lock = asyncio.Lock()  # one write at a time
        self.parts: list[_Part] = []
        self.head: dict[str, Any] = {}  # the first event's id, created, model

    async def open(self) -> None:
        async with self.lock:
            if not self.opened:
                await prepare(self.response, self.request)
                self.opened = True

    async def write(self, data: bytes) -> None:
        async with self.lock:
            await write(self.response, data)

    async def finish(self, failures: list[str | None]) -> None:
        """After every prompt's stream: the first failure (unless an error event already
        went out), the summed usage when asked, ``[DONE]``."""
        tail = b""
        failure = next((f for f in failures if f is not None), None)
        if failure is not None and not self.error_sent:
            tail += sse_error(failure)
        if self.wants_usage:
            usage = sum_usage([p.usage for p in self.parts])
            event = {**self.head, "object": "text_completion", "choices": [],
                     "usage": fill_cached(usage) if self.reports_cached else usage}  # fmt: skip
            tail += b"data: " + _encoder.encode(event) + b"\n\n"
        await self.write(tail + b"data: [DONE]\n\n")


class _Part:
    """One prompt's engine events into the batch's stream: its choices' indices moved by
    ``offset``, its usage kept for the sum."""

    def __init__(self, stream: _BatchStream, offset: int) -> None:
        self.stream, self.offset = stream, offset
        self.usage: Any = None
        stream.parts.append(self)

    async def open(self) -> None:
        await self.stream.open()

    async def send(self, events: list[tuple[bytes, Chunk | None]]) -> None:
        s = self.stream
        parts: list[bytes] = []
        for payload, _ in events:
            try:
                doc = _json.decode(payload)
            except (msgspec.DecodeError, RecursionError):
                continue  # not JSON: nothing a client can parse
            if not isinstance(doc, dict):
                continue
            if doc.get("error") is not None or doc.get("object") == "error":
                if not s.error_sent:
                    s.error_sent = True
                    err = doc.get("error")
                    message = (err.get("message") if isinstance(err, dict) else err
                               ) or doc.get("message") or "engine error"  # fmt: skip
                    parts.append(sse_error(str(message)))
                continue
            for key in ("id", "created", "model"):
                if key in doc:
                    s.head.setdefault(key, doc[key])
            if doc.get("usage") is not None:
                self.usage = doc["usage"]  # the latest (a running count grows): summed at the end
            choices = doc.get("choices")
            if not choices:
                continue  # the usage event: the batch's one comes at the end
            doc["choices"] = [c | {"index": self.offset + int(c.get("index", 0))}
                              if isinstance(c, dict) else c for c in choices]  # fmt: skip
            parts.append(b"data: " + _encoder.encode(doc) + b"\n\n")
        if parts:
            await s.write(b"".join(parts))

    async def close(self, error: str | None) -> None:
        return None  # the batch's stream ends once every prompt's has (finish)
