"""An asyncio load generator: replays :class:`~foretoken.sim.traces.TraceRequest` values against
any OpenAI-compatible server and measures what a client sees.

Each request is a streaming ``POST {base}/v1/completions`` whose ``prompt`` is the list of
token ids, sent at its ``arrival_s`` after the start (already divided by the trace's
speedup), with at most ``concurrency`` requests in flight: when the cap is reached the
dispatcher waits, so later requests go out late rather than out of order (``sent_s``
against ``scheduled_s`` shows the lag). A request with a bound carries header
``x-max-queue-wait-s``; every request carries ``x-request-id``.

Measured per request, from just before the HTTP request is sent:

* **TTFT**: the first SSE ``data:`` chunk whose ``choices[0].text`` is non-empty (role-only
  or empty chunks do not count);
* **end-to-end**: until the stream ends (``[DONE]`` or EOF);
* the HTTP status; for any non-200 answer the ``retry-after-ms`` / ``Retry-After`` delay
  (seconds or an HTTP date, read in the order the OpenAI client reads them);
* output tokens: ``usage.completion_tokens`` from the final usage chunk (asked for with
  ``stream_options.include_usage``), else the number of content chunks;
* cached tokens: ``usage.prompt_tokens_details.cached_tokens`` (None when the server
  does not report prompt token details; vLLM omits the field when it is 0).

Nothing is retried. Connection errors, timeouts and 5xx answers are recorded, never
raised. A run is bounded by the number of requests and, optionally, ``max_duration_s``:
requests due after it are recorded as not sent.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import polars as pl
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from foretoken.sim.traces import TraceRequest

COMPLETIONS_PATH = "/v1/completions"
API_PREFIX = "/v1"
MAX_QUEUE_WAIT_HEADER = "x-max-queue-wait-s"
REQUEST_ID_HEADER = "x-request-id"
RETRY_AFTER_MS_HEADER = "retry-after-ms"
RETRY_AFTER_HEADER = "retry-after"
SSE_DATA_PREFIX = b"data:"
SSE_DONE = b"[DONE]"
HTTP_OK = 200
HTTP_TOO_MANY_REQUESTS = 429
# How much of an error answer is read, and kept in the result.
ERROR_BODY_MAX_BYTES = 4096
ERROR_MESSAGE_MAX_CHARS = 300
MS_PER_S = 1000.0
PERCENTILES = (50.0, 95.0, 99.0)
NOT_SENT_ERROR = "not sent: run deadline reached"


# ---------------------------------------------------------------------------- wire


class _PromptTokensDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptTokensDetails | None = None


class _Choice(msgspec.Struct):
    text: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


class _ErrorDetail(msgspec.Struct):
    message: str = ""


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail | str | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_error_decoder = msgspec.json.Decoder(_ErrorBody)


# ---------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What the client saw for one request. Times are seconds; ``*_s`` offsets are from
    the start of the run, ``ttft_s`` / ``e2e_s`` from the moment the request was sent."""

    request_id: str
    conversation_id: str | None
    scheduled_s: float
    sent_s: float | None
    prompt_tokens: int
    max_tokens: int
    max_queue_wait_s: float | None
    status: int | None
    ttft_s: float | None
    e2e_s: float | None
    output_tokens: int
    cached_tokens: int | None
    retry_after_s: float | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.status == HTTP_OK and self.error is None

    @property
    def rejected(self) -> bool:
        return self.status == HTTP_TOO_MANY_REQUESTS


RESULT_SCHEMA: dict[str, pl.DataType] = {
    "request_id": pl.String(),
    "conversation_id": pl.String(),
    "scheduled_s": pl.Float64(),
    "sent_s": pl.Float64(),
    "prompt_tokens": pl.Int64(),
    "max_tokens": pl.Int64(),
    "max_queue_wait_s": pl.Float64(),
    "status": pl.Int32(),
    "ttft_s": pl.Float64(),
    "e2e_s": pl.Float64(),
    "output_tokens": pl.Int64(),
    "cached_tokens": pl.Int64(),
    "retry_after_s": pl.Float64(),
    "error": pl.String(),
}


def results_frame(results: Sequence[RequestResult]) -> pl.DataFrame:
    """The results as a polars frame with a fixed schema (also when empty)."""
    return pl.DataFrame([asdict(r) for r in results], schema=RESULT_SCHEMA, orient="row")


def write_results_parquet(results: Sequence[RequestResult], path: str | Path) -> Path:
    """Write the results to a Parquet file (parents created); returns its path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    results_frame(results).write_parquet(target)
    return target


def _percentiles(values: Sequence[float]) -> tuple[float | None, ...]:
    if not values:
        return tuple(None for _ in PERCENTILES)
    return tuple(float(v) for v in np.percentile(np.asarray(values), PERCENTILES))


@dataclass(frozen=True, slots=True)
class LoadSummary:
    """Counts and client-side latency tails of one run; ``results`` in arrival order."""

    total: int
    sent: int
    ok: int
    rejected: int
    failed: int
    not_sent: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    e2e_p99_s: float | None
    wall_s: float
    results: tuple[RequestResult, ...]

    @classmethod
    def of(cls, results: Sequence[RequestResult], wall_s: float) -> LoadSummary:
        served = [r for r in results if r.ok]
        ttft = _percentiles([r.ttft_s for r in served if r.ttft_s is not None])
        e2e = _percentiles([r.e2e_s for r in served if r.e2e_s is not None])
        not_sent = sum(r.sent_s is None for r in results)
        rejected = sum(r.rejected for r in results)
        return cls(
            total=len(results),
            sent=len(results) - not_sent,
            ok=len(served),
            rejected=rejected,
            failed=len(results) - not_sent - len(served) - rejected,
            not_sent=not_sent,
            ttft_p50_s=ttft[0],
            ttft_p95_s=ttft[1],
            ttft_p99_s=ttft[2],
            e2e_p50_s=e2e[0],
            e2e_p95_s=e2e[1],
            e2e_p99_s=e2e[2],
            wall_s=wall_s,
            results=tuple(results),
        )

    def counts(self) -> dict[str, Any]:
        """Everything but the per-request results (for JSON output)."""
        return {k: v for k, v in asdict(self).items() if k != "results"}


# ---------------------------------------------------------------------------- HTTP


def parse_retry_after(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms``, else ``Retry-After`` (seconds or HTTP date).
    ``headers`` should be case-insensitive (aiohttp's are); header names are lower case."""
    millis = headers.get(RETRY_AFTER_MS_HEADER)
    if millis is not None:
        try:
            value = float(millis) / MS_PER_S
            if math.isfinite(value):
                return value
        except ValueError:
            pass
    text = headers.get(RETRY_AFTER_HEADER)
    if text is None:
        return None
    try:
        value = float(text)
        return value if math.isfinite(value) else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def completions_url(base_url: str) -> str:
    """``{base}/v1/completions``; a base that already ends in ``/v1`` is accepted."""
    base = base_url.rstrip("/")
    if base.endswith(API_PREFIX):
        base = base[: -len(API_PREFIX)]
    return base + COMPLETIONS_PATH


def _error_message(status: int, body: bytes) -> str:
    message = body.decode("utf-8", "replace")
    try:
        error = _error_decoder.decode(body).error
        if isinstance(error, _ErrorDetail) and error.message:
            message = error.message
        elif isinstance(error, str) and error:
            message = error
    except msgspec.DecodeError:
        pass
    return f"HTTP {status}: {message[:ERROR_MESSAGE_MAX_CHARS]}"


@dataclass(slots=True)
class _Attempt:
    """Mutable state of one request while it runs (kept when it fails half-way)."""

    request: TraceRequest
    max_tokens: int
    scheduled_s: float
    sent_s: float | None = None
    status: int | None = None
    first_token_at: float | None = None
    end_at: float | None = None
    content_chunks: int = 0
    usage: _Usage | None = None
    retry_after_s: float | None = None
    error: str | None = None

    def result(self, started_at: float | None) -> RequestResult:
        usage = self.usage
        details = usage.prompt_tokens_details if usage else None
        completion = usage.completion_tokens if usage else None

        def since_start(at: float | None) -> float | None:
            return None if at is None or started_at is None else at - started_at

        return RequestResult(
            request_id=self.request.request_id,
            conversation_id=self.request.conversation_id,
            scheduled_s=self.scheduled_s,
            sent_s=self.sent_s,
            prompt_tokens=self.request.prompt_tokens,
            max_tokens=self.max_tokens,
            max_queue_wait_s=self.request.max_queue_wait_s,
            status=self.status,
            ttft_s=since_start(self.first_token_at),
            e2e_s=since_start(self.end_at),
            output_tokens=completion if completion is not None else self.content_chunks,
            cached_tokens=details.cached_tokens if details else None,
            retry_after_s=self.retry_after_s,
            error=self.error,
        )


async def _read_stream(response: aiohttp.ClientResponse, attempt: _Attempt) -> None:
    loop = asyncio.get_running_loop()
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(SSE_DATA_PREFIX):
            continue
        payload = line[len(SSE_DATA_PREFIX) :].strip()
        if payload == SSE_DONE:
            break
        try:
            chunk = _chunk_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            attempt.error = attempt.error or f"malformed stream chunk: {exc}"
            continue
        if chunk.choices and chunk.choices[0].text:
            attempt.content_chunks += 1
            if attempt.first_token_at is None:
                attempt.first_token_at = loop.time()
        if chunk.usage is not None:
            attempt.usage = chunk.usage


async def _send(
    session: aiohttp.ClientSession,
    endpoint: str,
    model: str,
    attempt: _Attempt,
    run_start: float,
) -> RequestResult:
    request = attempt.request
    body = msgspec.json.encode(
        {
            "model": model,
            "prompt": request.token_ids.tolist(),
            "max_tokens": attempt.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    headers = {"content-type": "application/json", REQUEST_ID_HEADER: request.request_id}
    if request.max_queue_wait_s is not None:
        headers[MAX_QUEUE_WAIT_HEADER] = repr(request.max_queue_wait_s)
    loop = asyncio.get_running_loop()
    started_at = loop.time()
    attempt.sent_s = started_at - run_start
    try:
        async with session.post(endpoint, data=body, headers=headers) as response:
            attempt.status = response.status
            if response.status != HTTP_OK:
                attempt.retry_after_s = parse_retry_after(response.headers)
                text = await response.content.read(ERROR_BODY_MAX_BYTES)
                attempt.error = _error_message(response.status, text)
            else:
                await _read_stream(response, attempt)
            attempt.end_at = loop.time()
    except TimeoutError:
        attempt.error = "timeout"
    except aiohttp.ClientError as exc:
        attempt.error = f"{type(exc).__name__}: {exc}"[:ERROR_MESSAGE_MAX_CHARS]
    return attempt.result(started_at)


# ---------------------------------------------------------------------------- runner


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )


def _check_args(concurrency: int, timeout_s: float, max_output_tokens: int | None) -> None:
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, got {max_output_tokens}")


async def run_load_async(
    url: str,
    model: str,
    requests: Sequence[TraceRequest],
    *,
    concurrency: int,
    timeout_s: float,
    max_output_tokens: int | None = None,
    max_duration_s: float | None = None,
    progress: bool = True,
) -> LoadSummary:
    """Replay ``requests`` against ``url`` (a base URL) and summarize; never raises for
    a failed request. ``timeout_s`` bounds each request, ``max_duration_s`` the dispatch."""
    _check_args(concurrency, timeout_s, max_output_tokens)
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    endpoint = completions_url(url)
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(concurrency)
    counts = {"ok": 0, "429": 0, "failed": 0}
    slots: list[RequestResult | None] = [None] * len(ordered)
    run_start = loop.time()
    deadline = math.inf if max_duration_s is None else run_start + max_duration_s

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        with _progress(progress) as bar:
            task_id = bar.add_task("load", total=len(ordered))

            async def run_one(index: int, attempt: _Attempt) -> None:
                try:
                    result = await _send(session, endpoint, model, attempt, run_start)
                finally:
                    gate.release()
                slots[index] = result
                key = "ok" if result.ok else "429" if result.rejected else "failed"
                counts[key] += 1
                bar.update(
                    task_id,
                    advance=1,
                    description=" ".join(f"{k}={v}" for k, v in counts.items()),
                )

            tasks: list[asyncio.Task[None]] = []
            for index, request in enumerate(ordered):
                cap = request.output_tokens
                max_tokens = cap if max_output_tokens is None else min(cap, max_output_tokens)
                attempt = _Attempt(request, max_tokens, scheduled_s=request.arrival_s)
                due = run_start + request.arrival_s
                if due < deadline:
                    await asyncio.sleep(max(0.0, due - loop.time()))
                    await gate.acquire()
                    if loop.time() < deadline:
                        tasks.append(asyncio.create_task(run_one(index, attempt)))
                        continue
                    gate.release()
                attempt.error = NOT_SENT_ERROR
                slots[index] = attempt.result(None)
                bar.update(task_id, advance=1)
            await asyncio.gather(*tasks)
    wall_s = loop.time() - run_start
    return LoadSummary.of([r for r in slots if r is not None], wall_s)


def run_load(
    url: str,
    model: str,
    requests: Sequence[TraceRequest],
    *,
    concurrency: int,
    timeout_s: float,
    max_output_tokens: int | None = None,
    max_duration_s: float | None = None,
    progress: bool = True,
) -> LoadSummary:
    """Blocking :func:`run_load_async` (for the CLI): runs its own event loop."""
    return asyncio.run(
        run_load_async(
            url,
            model,
            requests,
            concurrency=concurrency,
            timeout_s=timeout_s,
            max_output_tokens=max_output_tokens,
            max_duration_s=max_duration_s,
            progress=progress,
        )
    )
