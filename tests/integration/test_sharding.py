"""Sharded by model (issue 19): two route instances in one consumer group on the real
broker; Kafka (Faust's co-partitioning assignor) gives each half of the partitions, and each
holds the index of only the model whose partition it owns (its ``/v1/stats`` memory says
so); a route request for either model is answered through either instance (the non-owner
forwards it), and a router that discovers them from the ``members`` topic asks the owner
first."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from foretoken.adapters.http.route_client import RouteClient
from foretoken.adapters.kafka.producer import RecordProducer
from foretoken.adapters.kafka.topics import ensure_topics
from foretoken.adapters.processes import foretoken_cmd, get_json, spawn
from foretoken.core.types import EngineBlockHash, ModelName, RequestId, WorkerId
from foretoken.settings import Settings, load_settings
from foretoken.wire.partitioning import model_partition
from foretoken.wire.records import (
    BlockStored,
    KvEventBatch,
    SchedulerSettings,
    WorkerEndpoints,
    WorkerRegistration,
)
from foretoken.wire.route_rpc import RouteRequest, RouteResponse, pack_token_ids
from tests.conftest import free_port, worker_env
from tests.integration.stack import stop_together

pytestmark = pytest.mark.integration
START_S = 180.0
BLOCK = 16
WORKERS_PER_MODEL = 2


@pytest.fixture(scope="module")
def sharded(kafka_broker: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("sharded")
    prefix = f"sh{uuid.uuid4().hex[:8]}-"
    shared = {"FORETOKEN_TOPIC_PREFIX": prefix, "FORETOKEN_SHARDING": "model",
              "FORETOKEN_PARTITIONS": "4"}  # fmt: skip
    settings = load_settings(env={**os.environ, **shared})
    asyncio.run(ensure_topics(settings))
    procs, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            env = {**worker_env(settings, tmp / f"shard{i}", port, f"sharded-{prefix}"), **shared,
                   "FORETOKEN_ROLE": "route", "FORETOKEN_INSTANCE_ID": f"shard-{i}"}  # fmt: skip
            procs.append(spawn(foretoken_cmd("worker"), env, tmp / f"shard{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + START_S
        while True:  # both in the group, each with its half, caught up
            try:
                parts = [get_json(f"{u}/healthz") for u in urls]
                if all(p["status"] == "ok" and len(p["partitions"]) == 2 for p in parts):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the two instances never split the partitions"
            assert all(p.poll() is None for p in procs)
            time.sleep(0.5)
        yield settings, urls, [set(p["partitions"]) for p in parts], procs, tmp
    finally:
        stop_together(procs)
        for log in sorted(Path(tmp).glob("*.log")):
            print(f"--- {log}\n{log.read_text()[-2500:]}")


def _model_on(partitions: set[int], total: int, tag: str) -> ModelName:
    """A model name whose partition is one of ``partitions``."""
    for n in range(1000):
        name = f"shard-{tag}-{n}"
        if model_partition(name, total) in partitions:
            return ModelName(name)
    raise AssertionError("no model name found")


def _registration(model: str, i: int) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=WorkerId(f"{model}-w{i}"), model=ModelName(model), engine="vllm",
        engine_version="test", block_size=BLOCK,
        endpoints=WorkerEndpoints(http_url=f"http://127.0.0.1:9/{model}-w{i}"),
        scheduler=SchedulerSettings(max_num_batched_tokens=8192, max_num_seqs=64),
        gpu_blocks=10_000, config_hash="test", ts=time.time(),
    )  # fmt: skip


def _prompt(model: str) -> list[int]:
    return [(len(model) * 131 + k * 17) % 30_000 + 1 for k in range(64 * BLOCK)]


async def _publish(settings: Settings, models: list[str]) -> None:
    async with RecordProducer(settings) as producer:  # places every record by its model
        for m in models:
            for i in range(WORKERS_PER_MODEL):
                await producer.send("workers", _registration(m, i))
            tokens = _prompt(m)
            hashes = tuple(EngineBlockHash(k + 1) for k in range(len(tokens) // BLOCK))
            stored = BlockStored(block_hashes=hashes, token_ids=tuple(tokens), block_size=BLOCK)
            await producer.send("kv_events", KvEventBatch(
                worker_id=WorkerId(f"{m}-w0"), model=ModelName(m), seq=0, ts=time.time(),
                events=(stored,),
            ))  # fmt: skip
        await producer.flush()
        assert producer.partitioner.unplaced == 0


async def _route(url: str, model: str) -> RouteResponse:
    body = msgspec.msgpack.encode(RouteRequest(
        request_id=RequestId(uuid.uuid4().hex), model=ModelName(model),
        packed_token_ids=pack_token_ids([*_prompt(model), 7, 8, 9]),
    ))  # fmt: skip
    headers = {"Content-Type": "application/msgpack"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/route", data=body, headers=headers) as resp,
    ):
        assert resp.status == 200, await resp.text()
        return msgspec.json.decode(await resp.read(), type=RouteResponse)


async def _owner_first(settings: Settings, models: list[str], urls: list[str]) -> list[str]:
    """What a router discovering route services from ``members`` asks first, per model,
    once its view has settled (up to 30 s): a member's record from before the partitions
    were split (one instance held all four) may be read before its newer one."""
    router_settings = msgspec.structs.replace(
        settings, router=msgspec.structs.replace(settings.router, route_members=True),
        worker=msgspec.structs.replace(settings.worker, app_id=f"sharded-{settings.topic_prefix}"),
    )  # fmt: skip
    client = RouteClient(router_settings)
    async with aiohttp.ClientSession() as session:
        await client.start(session)
        try:
            deadline = time.monotonic() + 30
            first: list[str] = []
            while time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                await client.check(session)
                if len(client.services) >= 2:
                    first = [client.order(m, None)[0].url for m in models]
                    if first == urls:
                        break
            return first
        finally:
            await client.stop()


@pytest.mark.timeout(400)
def test_each_instance_holds_its_model_and_answers_for_both(sharded: Any) -> None:
    settings, urls, owned, procs, _tmp = sharded
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == {0, 1, 2, 3}
    models = [_model_on(owned[0], 4, "a"), _model_on(owned[1], 4, "b")]
    asyncio.run(_publish(settings, models))
    deadline = time.monotonic() + 60
    while True:  # each instance learns its own model's workers and blocks (registrations
        mem = [get_json(f"{u}/v1/stats")["memory"]["index_models"] for u in urls]
        if all(  # and KV events come on two topics: either may be read first)
            m.get(models[i], {}).get("blocks", 0) > 0
            and m[models[i]]["workers"] == WORKERS_PER_MODEL
            for i, m in enumerate(mem)
        ):
            break
        assert time.monotonic() < deadline, mem
        time.sleep(0.5)
    for i, m in enumerate(mem):  # its memory says so: only its model's index
        assert set(m) == {models[i]}, (i, m)
    workers = {m: {f"{m}-w{i}" for i in range(WORKERS_PER_MODEL)} for m in models}
    for n, url in enumerate(urls):  # either instance answers for both models (a non-owner
        for model in models:  # forwards to the owner)
            decided = asyncio.run(_route(url, model)).grant
            assert decided.admitted and decided.worker_id in workers[model], decided
            assert {c.worker_id for c in decided.candidates} == workers[model]
            if n == 0:  # the first request of the model: the cached worker, from the index
                assert decided.worker_id == f"{model}-w0", decided
                assert decided.cached_tokens >= 64 * BLOCK - BLOCK
    forwarded = [get_json(f"{u}/v1/stats")["forwarded"] for u in urls]
    assert forwarded == [1, 1], forwarded
    assert asyncio.run(_owner_first(settings, models, urls)) == urls
    assert all(p.poll() is None for p in procs)
