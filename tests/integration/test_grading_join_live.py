"""Grants and outcomes on the real broker are joined by the running worker into `graded`:
one record per request, with its error, also when records are delivered twice."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer

from foretoken.adapters.kafka.producer import RecordProducer
from foretoken.wire.codec import decode
from foretoken.wire.records import Graded, Grant, Outcome, WorkerEndpoints, WorkerRegistration
from tests.conftest import RunningWorker

pytestmark = pytest.mark.integration
WAIT_S = 60.0


async def _produce(worker: RunningWorker, run: str) -> None:
    async with RecordProducer(worker.settings) as p:
        await p.send("workers", WorkerRegistration(
            worker_id=f"{run}-w", model="m", engine="vllm", engine_version="x", block_size=16,
            endpoints=WorkerEndpoints(http_url="http://127.0.0.1:9"), config_hash="c", ts=1.0,
        ))  # fmt: skip
        await p.flush()
        await asyncio.sleep(1.0)  # the registration first: the block size grades disagreement
        for i in range(3):
            rid = f"{run}-{i}"
            grant = Grant(request_id=rid, ts=time.time(), model="m", prompt_tokens=100,
                          worker_id=f"{run}-w", admitted=True, predicted_ttft_s=1.0 + i,
                          cached_tokens=32)  # fmt: skip
            first = Outcome(request_id=rid, ts=time.time(), kind="first_token",
                            worker_id=f"{run}-w", actual_ttft_s=1.5)  # fmt: skip
            done = Outcome(
                request_id=rid, ts=time.time(), kind="completion", worker_id=f"{run}-w",
                engine_cached_tokens=0 if i == 2 else 32, output_tokens=3, e2e_s=2.0,
            )  # fmt: skip
            for _ in range(2):  # every record delivered twice
                await p.send("grants", grant)
                await p.send("outcomes", first)
                await p.send("outcomes", done)
        rejected = Grant(request_id=f"{run}-rej", ts=time.time(), model="m", prompt_tokens=5,
                         admitted=False, retry_after_s=2.0)  # fmt: skip
        await p.send("grants", rejected)
        await p.flush()


async def _graded(worker: RunningWorker, run: str, n: int) -> dict[str, list[Graded]]:
    consumer = AIOKafkaConsumer(
        worker.settings.topic("graded"), bootstrap_servers=worker.settings.kafka.bootstrap_servers,
        auto_offset_reset="earliest", group_id=f"t-{uuid.uuid4().hex[:6]}",
    )  # fmt: skip
    await consumer.start()
    seen: dict[str, list[Graded]] = {}
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and sum(map(len, seen.values())) < n:
            for msgs in (await consumer.getmany(timeout_ms=500)).values():
                for m in msgs:
                    g = decode(m.value, Graded)
                    if g.request_id.startswith(run):
                        seen.setdefault(g.request_id, []).append(g)
        await asyncio.sleep(2.0)  # anything doubled would show up by now
        for msgs in (await consumer.getmany(timeout_ms=1000)).values():
            for m in msgs:
                g = decode(m.value, Graded)
                if g.request_id.startswith(run):
                    seen.setdefault(g.request_id, []).append(g)
    finally:
        await consumer.stop()
    return seen


def test_grants_and_outcomes_are_joined_once(faust_worker: RunningWorker) -> None:
    run = f"join-{uuid.uuid4().hex[:6]}"
    asyncio.run(_produce(faust_worker, run))
    seen = asyncio.run(_graded(faust_worker, run, 4))
    assert sorted(seen) == sorted([f"{run}-0", f"{run}-1", f"{run}-2", f"{run}-rej"])
    assert all(len(v) == 1 for v in seen.values()), "a request was graded twice"
    g0 = seen[f"{run}-0"][0]
    assert g0.status == "served" and g0.error_s == pytest.approx(-0.5)
    assert g0.cache_disagreement is False and g0.block_size == 16
    assert seen[f"{run}-2"][0].cache_disagreement is True
    assert seen[f"{run}-rej"][0].status == "rejected"
