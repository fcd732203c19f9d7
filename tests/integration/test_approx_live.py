"""A worker registered without KV events on the real broker (issue 9): the running route
service credits it approximately once a request it routed there had its first token, says
so on grants and on ``/v1/cache/{model}``, and grades its reuse as unknown."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer

from foretoken.adapters.kafka.producer import RecordProducer
from foretoken.adapters.processes import get_json
from foretoken.wire.codec import decode
from foretoken.wire.records import Graded, Grant, Outcome, WorkerEndpoints, WorkerRegistration
from foretoken.wire.route_rpc import RouteRequest, RouteResponse
from tests.conftest import RunningWorker

pytestmark = pytest.mark.integration
WAIT_S = 60.0
BLOCK = 16
PROMPT = tuple(range(100, 100 + 64 * BLOCK + 5))  # 64 full blocks and a partial one


async def _send(worker: RunningWorker, *records: tuple[str, Any]) -> None:
    async with RecordProducer(worker.settings) as producer:
        for topic, record in records:
            await producer.send(topic, record)
        await producer.flush()


def _route(worker: RunningWorker, rid: str, model: str) -> Grant:
    import urllib.request

    body = msgspec.json.encode(RouteRequest(request_id=rid, model=model, token_ids=PROMPT))
    req = urllib.request.Request(f"{worker.url}/v1/route", data=body, method="POST",
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        return msgspec.json.decode(resp.read(), type=RouteResponse).grant


def _wait_for(what: str, check: Any) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            value = check()
        except OSError:  # a slow answer under load: ask again
            value = None
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


async def _graded(worker: RunningWorker, rid: str) -> Graded:
    consumer = AIOKafkaConsumer(
        worker.settings.topic("graded"), bootstrap_servers=worker.settings.kafka.bootstrap_servers,
        auto_offset_reset="earliest", group_id=f"t-{uuid.uuid4().hex[:6]}",
    )  # fmt: skip
    await consumer.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for msgs in (await consumer.getmany(timeout_ms=500)).values():
                for m in msgs:
                    g = decode(m.value, Graded)
                    if g.request_id == rid:
                        return g
    finally:
        await consumer.stop()
    raise AssertionError(f"no graded record for {rid}")


def test_a_worker_without_kv_events_gets_approximate_credit(faust_worker: RunningWorker) -> None:
    run = uuid.uuid4().hex[:6]
    model, wid = f"m-{run}", f"llama-{run}"
    reg = WorkerRegistration(
        worker_id=wid, model=model, engine="llamacpp", engine_version="x", block_size=BLOCK,
        endpoints=WorkerEndpoints(http_url="http://127.0.0.1:9"), config_hash="c",
        ts=time.time(), has_kv_events=False, reports_cached_tokens=False, gpu_blocks=4096,
    )  # fmt: skip
    asyncio.run(_send(faust_worker, ("workers", reg)))
    page = _wait_for("the registration", lambda: get_json(
        f"{faust_worker.url}/v1/cache/{model}", 10.0)["workers"].get(wid))  # fmt: skip
    assert page["cache_source"] == "approximate" and page["capacity_blocks"] == 4096
    assert page["store_only"] and page["blocks"]["GPU"] == 0

    first = _route(faust_worker, f"{run}-1", model)
    assert first.admitted and first.worker_id == wid and first.cached_tokens == 0
    assert first.cache_source == "approximate" and first.approximate_cache
    now = time.time()
    asyncio.run(_send(
        faust_worker, ("grants", first),
        ("outcomes", Outcome(request_id=first.request_id, ts=now, kind="first_token",
                             worker_id=wid, actual_ttft_s=0.3)),
        # what a confused router might send for an engine that never reports: still unknown
        ("outcomes", Outcome(request_id=first.request_id, ts=now + 0.1, kind="completion",
                             worker_id=wid, actual_ttft_s=0.3, engine_cached_tokens=0,
                             output_tokens=2, e2e_s=0.4)),
    ))  # fmt: skip

    def credited() -> dict[str, Any] | None:
        hits = get_json(f"{faust_worker.url}/v1/cache/{model}", 10.0)["workers"][wid]
        return hits if hits["blocks"]["GPU"] == 64 else None

    _wait_for("the approximate credit", credited)
    second = _route(faust_worker, f"{run}-2", model)
    assert second.worker_id == wid and second.cached_tokens == 64 * BLOCK
    assert second.cache_source == "approximate" and second.approximate_cache
    assert second.cached_tier == "GPU"

    graded = asyncio.run(_graded(faust_worker, first.request_id))
    assert graded.cache_source == "approximate" and graded.approximate_cache
    assert graded.engine_cached_tokens is None and graded.cache_disagreement is None
    assert graded.actual_ttft_s == pytest.approx(0.3)
