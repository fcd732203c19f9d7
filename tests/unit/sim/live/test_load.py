"""The load generator against a small real OpenAI-like SSE server on 127.0.0.1
(fleet/load.py). The server runs on its own event loop in a thread, so the blocking
``run_load`` the CLI calls is what is tested."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from foretoken.sim.live.load import (
    MAX_QUEUE_WAIT_HEADER,
    NOT_SENT_ERROR,
    REQUEST_ID_HEADER,
    completions_url,
    parse_retry_after,
    results_frame,
    run_load,
    write_results_parquet,
)
from foretoken.sim.traces import LengthDistribution, TraceRequest, synthetic_requests

FIRST_TOKEN_DELAY_S = 0.05
TOKEN_GAP_S = 0.01
HANG_S = 5.0
TIMEOUT_S = 2.0
RETRY_AFTER_MS = "1500"
RETRY_AFTER_S = "3"
START_TIMEOUT_S = 10.0


@dataclass
class ServerLog:
    bodies: dict[str, dict[str, Any]] = field(default_factory=dict)
    headers: dict[str, CIMultiDictProxy[str]] = field(default_factory=dict)
    in_flight: int = 0
    max_in_flight: int = 0


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def make_app(log: ServerLog) -> web.Application:
    """Behaviour by request id: '*reject-ms' / '*reject-s' → 429, '*boom' → 500, '*hang'
    → never answers in time, '*nodetails' → usage without prompt token details."""

    async def completions(request: web.Request) -> web.StreamResponse:
        rid = request.headers[REQUEST_ID_HEADER]
        log.headers[rid] = request.headers
        body = await request.json()
        log.bodies[rid] = body
        log.in_flight += 1
        log.max_in_flight = max(log.max_in_flight, log.in_flight)
        try:
            if rid.endswith("reject-ms"):
                headers = {"Retry-After": RETRY_AFTER_S, "retry-after-ms": RETRY_AFTER_MS}
                error = {"error": {"message": "over capacity", "type": "rate_limit", "code": 429}}
                return web.json_response(error, status=429, headers=headers)
            if rid.endswith("reject-s"):
                return web.json_response({}, status=429, headers={"Retry-After": RETRY_AFTER_S})
            if rid.endswith("boom"):
                return web.json_response({"error": {"message": "engine died"}}, status=500)
            if rid.endswith("hang"):
                await asyncio.sleep(HANG_S)
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            await response.write(sse({"choices": [{"index": 0, "text": ""}]}))
            await asyncio.sleep(FIRST_TOKEN_DELAY_S)
            for _ in range(body["max_tokens"]):
                await response.write(sse({"choices": [{"index": 0, "text": "tok"}]}))
                await asyncio.sleep(TOKEN_GAP_S)
            prompt_tokens = len(body["prompt"])
            usage: dict[str, Any] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": body["max_tokens"],
            }
            if not rid.endswith("nodetails"):
                usage["prompt_tokens_details"] = {"cached_tokens": prompt_tokens // 2}
            await response.write(sse({"choices": [], "usage": usage}))
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            log.in_flight -= 1

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


@dataclass
class Server:
    url: str
    log: ServerLog


@pytest.fixture
def server() -> Iterator[Server]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    log = ServerLog()
    runner = web.AppRunner(make_app(log), shutdown_timeout=0.1)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return int(runner.addresses[0][1])

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(START_TIMEOUT_S)
    yield Server(f"http://127.0.0.1:{port}", log)
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(START_TIMEOUT_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(START_TIMEOUT_S)
    loop.close()


def make_requests(
    suffixes: list[str], *, arrivals: list[float] | None = None
) -> list[TraceRequest]:
    base = synthetic_requests(
        len(suffixes),
        rate_rps=float("inf"),
        prompt=LengthDistribution(median=40, sigma=0.5, min_tokens=8),
        output=LengthDistribution(median=4),
        seed=5,
    )
    out = []
    for i, (request, suffix) in enumerate(zip(base, suffixes, strict=True)):
        arrival = arrivals[i] if arrivals else 0.0
        rid = f"{request.request_id}-{suffix}"
        out.append(
            TraceRequest(
                request_id=rid,
                arrival_s=arrival,
                prompt_tokens=request.prompt_tokens,
                output_tokens=request.output_tokens,
                segment_keys=request.segment_keys,
                segment_lengths=request.segment_lengths,
                conversation_id=request.conversation_id,
            )
        )
    return out


def test_ttft_e2e_tokens_and_cached_tokens(server: Server) -> None:
    requests = make_requests(["a", "b", "nodetails"])
    summary = run_load(
        server.url, "m", requests, concurrency=4, timeout_s=TIMEOUT_S, progress=False
    )
    assert (summary.total, summary.ok, summary.rejected, summary.failed) == (3, 3, 0, 0)
    by_id = {r.request_id: r for r in summary.results}
    for request in requests:
        result = by_id[request.request_id]
        assert result.status == 200 and result.error is None
        assert result.ttft_s is not None and result.e2e_s is not None
        # The empty first chunk does not count: the first token comes after the delay.
        assert FIRST_TOKEN_DELAY_S <= result.ttft_s <= result.e2e_s
        assert result.e2e_s - result.ttft_s >= (request.output_tokens - 1) * TOKEN_GAP_S
        assert result.output_tokens == request.output_tokens
        if request.request_id.endswith("nodetails"):
            assert result.cached_tokens is None
        else:
            assert result.cached_tokens == request.prompt_tokens // 2
    assert summary.ttft_p50_s is not None and summary.ttft_p99_s is not None
    assert FIRST_TOKEN_DELAY_S <= summary.ttft_p50_s <= summary.ttft_p99_s


def test_request_body_and_headers(server: Server) -> None:
    requests = make_requests(["a", "b"])
    requests[0] = requests[0].with_bound(30.0)
    run_load(
        server.url + "/v1/",
        "my-model",
        requests,
        concurrency=2,
        timeout_s=TIMEOUT_S,
        max_output_tokens=2,
        progress=False,
    )
    for request in requests:
        body = server.log.bodies[request.request_id]
        assert body["model"] == "my-model"
        assert body["prompt"] == request.token_ids.tolist()
        assert body["max_tokens"] == min(request.output_tokens, 2)
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    bounded, unbounded = (server.log.headers[r.request_id] for r in requests)
    assert float(bounded[MAX_QUEUE_WAIT_HEADER]) == 30.0
    assert MAX_QUEUE_WAIT_HEADER not in unbounded


def test_429s_are_counted_with_their_retry_after(server: Server) -> None:
    requests = make_requests(["a", "reject-ms", "reject-s", "b"])
    summary = run_load(
        server.url, "m", requests, concurrency=4, timeout_s=TIMEOUT_S, progress=False
    )
    assert (summary.ok, summary.rejected, summary.failed) == (2, 2, 0)
    by_id = {r.request_id.rsplit("-", 1)[-1]: r for r in summary.results}
    # retry-after-ms wins over Retry-After, as the OpenAI client reads them.
    assert by_id["ms"].retry_after_s == pytest.approx(float(RETRY_AFTER_MS) / 1000)
    assert by_id["s"].retry_after_s == pytest.approx(float(RETRY_AFTER_S))
    assert by_id["ms"].error is not None and "over capacity" in by_id["ms"].error
    assert by_id["ms"].ttft_s is None and by_id["ms"].status == 429


def test_errors_are_recorded_not_raised(server: Server) -> None:
    requests = make_requests(["boom", "hang", "a"])
    summary = run_load(server.url, "m", requests, concurrency=4, timeout_s=0.5, progress=False)
    assert (summary.ok, summary.rejected, summary.failed) == (1, 0, 2)
    by_suffix = {r.request_id.rsplit("-", 1)[-1]: r for r in summary.results}
    assert by_suffix["boom"].status == 500 and "engine died" in (by_suffix["boom"].error or "")
    assert by_suffix["hang"].error == "timeout"


def test_connection_refused_is_recorded() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    summary = run_load(
        f"http://127.0.0.1:{port}",
        "m",
        make_requests(["a", "b"]),
        concurrency=2,
        timeout_s=TIMEOUT_S,
        progress=False,
    )
    assert summary.failed == 2 and summary.ok == 0
    assert all(r.status is None and r.error for r in summary.results)


def test_arrival_times_concurrency_cap_and_deadline(server: Server) -> None:
    arrivals = [0.0, 0.0, 0.0, 0.0, 0.3, 5.0]
    requests = make_requests(["a", "b", "c", "d", "late", "after"], arrivals=arrivals)
    summary = run_load(
        server.url,
        "m",
        requests,
        concurrency=2,
        timeout_s=TIMEOUT_S,
        max_duration_s=1.0,
        progress=False,
    )
    assert server.log.max_in_flight <= 2
    assert (summary.ok, summary.not_sent) == (5, 1)
    by_suffix = {r.request_id.rsplit("-", 1)[-1]: r for r in summary.results}
    for result in summary.results:
        if result.sent_s is not None:
            assert result.sent_s >= result.scheduled_s
    late = by_suffix["late"].sent_s
    assert late is not None and late >= 0.3
    assert by_suffix["after"].error == NOT_SENT_ERROR
    assert "-after" not in "".join(server.log.bodies)


def test_results_parquet_round_trip(server: Server, tmp_path: Path) -> None:
    requests = make_requests(["a", "reject-ms", "b"])
    summary = run_load(
        server.url, "m", requests, concurrency=2, timeout_s=TIMEOUT_S, progress=False
    )
    path = write_results_parquet(summary.results, tmp_path / "out" / "load.parquet")
    frame = pl.read_parquet(path)
    assert frame.height == 3
    assert frame.equals(results_frame(summary.results))
    assert frame.filter(pl.col("status") == 429).height == summary.rejected
    empty = pl.read_parquet(write_results_parquet([], tmp_path / "empty.parquet"))
    assert empty.height == 0 and empty.columns == frame.columns


def test_parse_retry_after_forms() -> None:
    now = datetime(2025, 1, 1, tzinfo=UTC)

    def headers(**values: str) -> CIMultiDictProxy[str]:
        return CIMultiDictProxy(CIMultiDict({k.replace("_", "-"): v for k, v in values.items()}))

    assert parse_retry_after(headers(retry_after="2.5")) == 2.5
    assert parse_retry_after(headers(retry_after_ms="250", retry_after="9")) == 0.25
    assert parse_retry_after(headers(retry_after_ms="x", retry_after="9")) == 9.0
    date = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(headers(retry_after=date), now=now) == pytest.approx(30.0)
    assert parse_retry_after(headers(retry_after="soon")) is None
    assert parse_retry_after(headers()) is None


def test_completions_url_and_argument_checks() -> None:
    assert completions_url("http://h:1") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/v1/") == "http://h:1/v1/completions"
    with pytest.raises(ValueError, match="concurrency"):
        run_load("http://127.0.0.1:9", "m", [], concurrency=0, timeout_s=1.0, progress=False)
