"""Kill the Faust worker (SIGKILL) in the middle of a stream of KV batches and restart it:
the index it rebuilds from its snapshot plus a replay of kv-events equals the index of a
worker that consumed the same stream without a kill."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from foretoken.adapters.kafka.producer import RecordProducer
from foretoken.adapters.processes import get_json, stop
from foretoken.settings import Settings
from foretoken.wire.records import (
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    WorkerEndpoints,
    WorkerRegistration,
)
from tests.conftest import RunningWorker, launch_worker

pytestmark = pytest.mark.integration
MODEL = "restart-model"
BLOCK = 16
WORKERS = [f"rs-w{i}" for i in range(3)]
BATCHES = 1500
WAIT_S = 90.0


def _stream(seed: int) -> tuple[list[KvEventBatch], list[list[int]]]:
    """Random stores and removals on a few workers, and the prompts they imply."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 50_000) for _ in range(8 * BLOCK)] for _ in range(40)]
    held: dict[str, list[int]] = {w: [] for w in WORKERS}
    seqs = dict.fromkeys(WORKERS, 0)
    batches = []
    for _ in range(BATCHES):
        w = rng.choice(WORKERS)
        p = rng.randrange(len(prompts))
        if held[w] and rng.random() < 0.3:
            victim = rng.choice(held[w])
            held[w].remove(victim)
            events: tuple = (BlockRemoved(block_hashes=(victim,)),)
        else:
            n = rng.randint(1, 8)
            hashes = tuple(hash((w, p, i)) & ((1 << 64) - 1) for i in range(n))
            held[w].extend(hashes)
            events = (BlockStored(block_hashes=hashes, token_ids=tuple(prompts[p][: n * BLOCK]),
                                  block_size=BLOCK),)  # fmt: skip
        batches.append(KvEventBatch(worker_id=w, model=MODEL, seq=seqs[w], ts=1.0, events=events))
        seqs[w] += 1
    return batches, prompts


async def _produce(settings: Settings, batches: list[KvEventBatch], pause_every: int) -> None:
    async with RecordProducer(settings) as producer:
        for w in WORKERS:
            await producer.send("workers", WorkerRegistration(
                worker_id=w, model=MODEL, engine="vllm", engine_version="x", block_size=BLOCK,
                endpoints=WorkerEndpoints(http_url="http://127.0.0.1:9"), config_hash="c", ts=1.0,
            ))  # fmt: skip
        for i, batch in enumerate(batches):
            await producer.send("kv_events", batch)
            if i % pause_every == 0:
                await producer.flush()
                await asyncio.sleep(0.02)  # a stream, not one burst
        await producer.flush()


def _lookups(worker: RunningWorker, prompts: list[list[int]]) -> list[dict]:  # type: ignore[type-arg]
    out = []
    for tokens in prompts:
        req = urllib.request.Request(
            f"{worker.url}/v1/cache/{MODEL}", data=json.dumps({"token_ids": tokens}).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=5) as resp:
            out.append(json.loads(resp.read())["hits"])
    return out


def _blocks(worker: RunningWorker) -> dict[str, dict]:  # type: ignore[type-arg]
    page = get_json(f"{worker.url}/v1/cache/{MODEL}")
    return {w: s["blocks"] for w, s in page["workers"].items()}


def _wait_all_applied(worker: RunningWorker, total: int) -> None:
    deadline = time.monotonic() + WAIT_S
    applied = 0
    while time.monotonic() < deadline:
        applied = get_json(f"{worker.url}/v1/cache/{MODEL}")["counters"]["batches"]
        if applied >= total:
            return
        time.sleep(0.3)
    raise AssertionError(f"only {applied} of {total} batches applied")


def test_killed_worker_rebuilds_the_same_index(kafka_settings: Settings, tmp_path: Path) -> None:
    batches, prompts = _stream(seed=7)
    app_id = f"restart-{kafka_settings.topic_prefix}"
    data = tmp_path / "a"
    proc, worker = launch_worker(kafka_settings, data, app_id,
                                 FORETOKEN_SNAPSHOT_INTERVAL_S="0.5")  # fmt: skip
    producing = asyncio.new_event_loop()
    asyncio.set_event_loop(producing)
    task = producing.create_task(_produce(worker.settings, batches, pause_every=10))
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # kill once a snapshot exists, mid-stream
            producing.run_until_complete(asyncio.sleep(0.1))
            applied = get_json(f"{worker.url}/v1/cache/{MODEL}")["counters"]["batches"]
            if get_json(f"{worker.url}/v1/stats")["index_snapshots"] >= 1 and applied > 100:
                break
        assert not task.done(), "the stream ended before the kill: slow it down"
        proc.send_signal(signal.SIGKILL)  # no clean shutdown, no final snapshot
        proc.wait()
        producing.run_until_complete(task)
    finally:
        producing.close()
        asyncio.set_event_loop(None)
    proc2, restarted = launch_worker(kafka_settings, data, app_id)
    fresh_proc, fresh = launch_worker(kafka_settings, tmp_path / "b")
    try:
        _wait_all_applied(fresh, BATCHES)
        deadline = time.monotonic() + WAIT_S
        while _blocks(restarted) != _blocks(fresh) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert _blocks(restarted) == _blocks(fresh)
        assert _lookups(restarted, prompts) == _lookups(fresh, prompts)
        assert any(h["tokens"] for hits in _lookups(fresh, prompts) for h in hits.values())
        page = get_json(f"{restarted.url}/v1/cache/{MODEL}")
        # the restarted worker really resumed from a snapshot, not from the start
        assert page["restored_from_snapshot"]
        assert 0 < page["applied_since_start"] < BATCHES
    finally:
        stop(proc2)
        stop(fresh_proc)
