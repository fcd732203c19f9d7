"""A ``/v1/completions`` prompt that is a batch (a list of several strings or token-id
lists: lm-eval's and other harnesses' shape): each prompt is its own request — tokenized,
routed (its own grant, prediction and request id: the first prompt's id, then ``ID.1``,
``ID.2``, … taken as client ids so that a later request naming one gets another), forwarded
to its engine and measured — and the client gets one answer, as OpenAI's API gives it:
prompt ``i``'s ``n`` choices are indices ``i·n … i·n+n-1``, the usage is the sum. Streamed,
the prompts' events interleave as their engines send them, each with its choices' indices
moved, and one ``[DONE]`` (and one usage event, when asked) ends it.

The prompts are routed one after another, each one's tokens counted on its engine before
the next is placed (so the fallback spreads them as it spreads separate requests). If any
prompt is turned away (429, or too large for every engine) the whole batch is: the prompts
already granted are closed as cancelled (their engines never got them) and the client gets
the refusal that waiting cannot cure first, else the longest wait. Once sent, the first
prompt that fails (its engine refuses it, or breaks) stops the others: their engines'
requests are closed (cancelled) and the client gets the failure — the engine's own status
when nothing was streamed yet, else an error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    ClientGone,
    Collected,
    Measured,
    event_docs,
    fill_cached,
    is_error_doc,
    prepare,
    sse_error,
    write,
)
from foretoken.adapters.http.router.requests import Decoded
from foretoken.adapters.http.router.routing import Placement
from foretoken.wire.records import Grant

_encoder = msgspec.json.Encoder()
Routed = tuple[Grant, str, Placement]


async def completions(request: web.Request, state: RouterState, d: Decoded,
                      arrived: float) -> web.StreamResponse:  # fmt: skip
    """Answer a batch request (``d.batch`` holds its prompts)."""
    placements: list[Placement] = []
    for i, (text, ids, _) in enumerate(d.batch):
        tokens = await tokens_of(state, d.body.model, text, ids, f"prompt[{i}]",
                                 d.special_tokens)  # fmt: skip
        if not placements:
            placements.append(await place(state, request, d.body, tokens, d.max_output_tokens))
            continue
        first = placements[0]
        rid, _ = state.routing.attempt(f"{first.request_id}.{i}", 0.0)
        placements.append(dataclasses.replace(first, request_id=rid, token_ids=tokens))
    granted, refusal = await _route_all(state, placements, arrived)
    if refusal is not None:
        return refusal
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
        failed = next((m for m in measured if m is not None and _failure(m)), None)
        if not stream.opened:  # nothing streamed yet: the failure's own answer
            assert failed is not None  # (every prompt's engine answered 200 otherwise)
            return edge.engine_refusal(failed, False, request_id)
        with contextlib.suppress(ClientGone):  # the client left before [DONE]
            await stream.finish(None if failed is None else _failure(failed))
        return response
    collected = [Collected(False, state.reports_cached(g)) for g, _, _ in granted]
    measured = await _run(state, request, d, granted, collected, arrived)
    if measured is None:
        return web.Response(status=499)  # the client went away: nobody reads this
    for m, c in zip(measured, collected, strict=True):
        if m is None:
            continue  # cancelled: another prompt failed (it is answered below)
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


async def _route_all(state: RouterState, placements: list[Placement], arrived: float
                     ) -> tuple[list[Routed], web.Response | None]:  # fmt: skip
    """Route the prompts one after another, each counted on its engine before the next is
    placed; all granted, or the batch's refusal (the granted ones closed as cancelled, as
    they are when routing fails or the client goes away)."""
    granted: list[Routed] = []
    refusals: list[web.Response] = []
    try:
        for p in placements:
            decided = await route(state, p, False)
            if isinstance(decided, web.Response):
                refusals.append(decided)
                break
            granted.append(decided)
            state.routing.sent(str(decided[0].worker_id), len(p.token_ids))
    except BaseException:
        _cancel_granted(state, granted, arrived, "the batch could not be routed")
        raise
    finally:
        for grant, _, p in granted:  # the engine calls count them again while they run
            state.routing.sent(str(grant.worker_id), -len(p.token_ids))
    if refusals:
        _cancel_granted(state, granted, arrived, "another prompt of its batch was turned away")
        return granted, refusals[0]
    return granted, None


def _cancel_granted(state: RouterState, granted: list[Routed], arrived: float,
                    why: str) -> None:  # fmt: skip
    for grant, _, p in granted:  # never sent: the queue models let them go
        assert grant.worker_id is not None
        publish_completion(state, p, grant.worker_id, state.engines.get(grant.worker_id),
                           arrived, None, "cancelled", why)  # fmt: skip
        state.metrics.outcome["cancelled"].inc()


async def _run(state: RouterState, request: web.Request, d: Decoded, granted: list[Routed],
               relays: list[Any], arrived: float) -> list[Measured | None] | None:  # fmt: skip
    """Forward every prompt to its engine at once. The first that fails stops the others
    (None in their place: cancelled, each closed as such); None when the client went away."""
    tasks = [
        asyncio.ensure_future(relay_to_engine(state, request, p, grant, url + "/v1/completions",
                                              d.batch_body(i), relays[i], arrived))
        for i, (grant, url, p) in enumerate(granted)
    ]  # fmt: skip
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            results = [t.result() for t in done]  # (a task's own error is raised here)
            if any(m is None for m in results):
                return None  # the client went away (the others are cancelled below)
            if any(m is not None and _failure(m) for m in results):
                break
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [None if t.cancelled() or t.exception() else t.result() for t in tasks]


def _failure(m: Measured) -> str | None:
    """What went wrong with one prompt, if anything."""
    if m.engine_status != 200:
        return m.error or f"engine answered {m.engine_status}"
    return (m.error or "engine error") if m.status != "ok" else None


def merge(answers: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The prompts' answers as one: choices in prompt order (prompt ``i``'s at ``i·n +``
    its own index), the usage summed."""
    choices = []
    for i, answer in enumerate(answers):
        for choice in answer.get("choices") or ():
            choices.append(choice | {"index": i * n + _index(choice)})
    return answers[0] | {"choices": choices,
                         "usage": sum_usage([a.get("usage") for a in answers])}  # fmt: skip


def _index(choice: dict[str, Any]) -> int:
    index = choice.get("index")
    return index if isinstance(index, int) else 0


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
        self.head: dict[str, Any] = {}  # the first event's id, created, model: the batch's

    async def open(self) -> None:
        async with self.lock:
            if not self.opened:
                await prepare(self.response, self.request)
                self.opened = True

    async def write(self, data: bytes) -> None:
        async with self.lock:
            await write(self.response, data)

    async def finish(self, failure: str | None) -> None:
        """After every prompt's stream: the failure (unless an error event already went
        out), the summed usage when asked, ``[DONE]``."""
        tail = b""
        if failure is not None and not self.error_sent:
            tail += sse_error(failure)
        if self.wants_usage and failure is None:
            usage = sum_usage([p.usage for p in self.parts])
            event = {**self.head, "object": "text_completion", "choices": [],
                     "usage": fill_cached(usage) if self.reports_cached else usage}  # fmt: skip
            tail += b"data: " + _encoder.encode(event) + b"\n\n"
        await self.write(tail + b"data: [DONE]\n\n")


class _Part:
    """One prompt's engine events into the batch's stream: its choices' indices moved by
    ``offset``, the batch's id on every event, its usage kept for the sum."""

    def __init__(self, stream: _BatchStream, offset: int) -> None:
        self.stream, self.offset = stream, offset
        self.usage: Any = None
        stream.parts.append(self)

    async def open(self) -> None:
        await self.stream.open()

    async def send(self, events: list[tuple[bytes, Chunk | None]]) -> None:
        s = self.stream
        parts: list[bytes] = []
        for _, doc in event_docs(events):
            if is_error_doc(doc):
                if not s.error_sent:
                    s.error_sent = True
                    err = doc.get("error")
                    message = (err.get("message") if isinstance(err, dict) else err
                               ) or doc.get("message") or "engine error"  # fmt: skip
                    parts.append(sse_error(str(message)))
                continue
            for key in ("id", "created", "model"):
                if key in doc:
                    doc[key] = s.head.setdefault(key, doc[key])
            if doc.get("usage") is not None:
                self.usage = doc["usage"]  # the latest (a running count grows): summed at the end
                if not s.wants_usage:  # continuous_usage_stats alone: as OpenAIStream
                    del doc["usage"]
            choices = doc.get("choices")
            if not isinstance(choices, list) or not choices:
                continue  # the usage event: the batch's one comes at the end
            doc["choices"] = [c | {"index": self.offset + _index(c)} if isinstance(c, dict)
                              else c for c in choices]  # fmt: skip
            parts.append(b"data: " + _encoder.encode(doc) + b"\n\n")
        if parts:
            await s.write(b"".join(parts))

    async def close(self, error: str | None) -> None:
        return None  # the batch's stream ends once every prompt's has (finish)
