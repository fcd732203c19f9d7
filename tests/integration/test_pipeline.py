"""Every record type through the real broker into the running Faust worker; malformed bytes
on every input topic land on dead-letter with a reason, and the worker keeps consuming."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer

from foretoken.adapters.kafka.dispatch import INPUT_TOPICS
from foretoken.adapters.kafka.producer import RecordProducer
from foretoken.adapters.kafka.samples import sample_records
from foretoken.adapters.processes import get_json
from foretoken.wire.codec import decode
from foretoken.wire.records import DeadLetter
from tests.conftest import RunningWorker

pytestmark = pytest.mark.integration
CONSUME_TIMEOUT_S = 60.0


def _wait_for(url: str, predicate, timeout_s: float = CONSUME_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout_s
    stats: dict = {}
    while time.monotonic() < deadline:
        stats = get_json(url)
        if predicate(stats):
            return stats
        time.sleep(0.3)
    raise AssertionError(f"condition not reached within {timeout_s} s; last stats {stats}")


async def _produce(worker: RunningWorker, run: str, malformed: bool) -> dict[str, int]:
    records = sample_records(4, run)
    counts: dict[str, int] = {}
    json_settings = worker.settings
    mp_settings = type(json_settings)(**{
        **{f: getattr(json_settings, f) for f in json_settings.__struct_fields__},
        "wire_format": "msgpack",
    })  # fmt: skip
    async with RecordProducer(json_settings) as pj, RecordProducer(mp_settings) as pm:
        for i, (logical, record) in enumerate(records):
            await (pj if i % 2 else pm).send(logical, record)  # both encodings on the wire
            counts[logical] = counts.get(logical, 0) + 1
        if malformed:
            for logical in INPUT_TOPICS:
                await pj.send_raw(logical, b"\x00not a record " + logical.encode(), key=b"bad")
        await pj.flush()
        await pm.flush()
    return counts


async def _dead_letters(worker: RunningWorker, n: int) -> list[DeadLetter]:
    consumer = AIOKafkaConsumer(
        worker.settings.topic("dead_letter"),
        bootstrap_servers=worker.settings.kafka.bootstrap_servers,
        auto_offset_reset="earliest",
        group_id=f"test-dl-{uuid.uuid4().hex[:6]}",
    )
    await consumer.start()
    out: list[DeadLetter] = []
    try:
        deadline = time.monotonic() + CONSUME_TIMEOUT_S
        while len(out) < n and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=1000)
            for messages in batch.values():
                out.extend(decode(m.value, DeadLetter) for m in messages)
    finally:
        await consumer.stop()
    return out


def test_every_record_type_is_consumed_and_decoded(faust_worker: RunningWorker) -> None:
    before = get_json(f"{faust_worker.url}/v1/stats")["consumed"]
    sent = asyncio.run(_produce(faust_worker, f"ok-{uuid.uuid4().hex[:6]}", malformed=False))
    assert set(sent) == set(INPUT_TOPICS)

    def all_in(stats: dict) -> bool:
        got = stats["consumed"]
        return all(got.get(k, 0) - before.get(k, 0) >= v for k, v in sent.items())

    stats = _wait_for(f"{faust_worker.url}/v1/stats", all_in)
    for logical, n in sent.items():
        assert stats["consumed"][logical] - before.get(logical, 0) == n


def test_malformed_bytes_go_to_dead_letter_and_the_worker_keeps_running(
    faust_worker: RunningWorker,
) -> None:
    before = get_json(f"{faust_worker.url}/v1/stats")
    sent = asyncio.run(_produce(faust_worker, f"mixed-{uuid.uuid4().hex[:6]}", malformed=True))
    letters = asyncio.run(_dead_letters(faust_worker, len(INPUT_TOPICS)))
    sources = {dl.source for dl in letters}
    assert sources == {faust_worker.settings.topic(t) for t in INPUT_TOPICS}
    for dl in letters:
        assert dl.reason and dl.payload.startswith(b"\x00not a record")
        assert dl.offset is not None and dl.key == b"bad"

    def good_ones_too(stats: dict) -> bool:
        got, was = stats["consumed"], before["consumed"]
        return all(got.get(k, 0) - was.get(k, 0) >= v for k, v in sent.items())

    stats = _wait_for(f"{faust_worker.url}/v1/stats", good_ones_too)
    health = get_json(f"{faust_worker.url}/healthz")
    assert health["status"] == "ok"
    assert health["event_loop"] == "uvloop"  # worker.event_loop's default
    dead_by_topic = _dead_letter_metric(_metrics(faust_worker.url))
    assert set(dead_by_topic) >= set(INPUT_TOPICS)
    assert all(v >= 1 for v in dead_by_topic.values())
    assert sum(stats["dead_lettered"].values()) >= len(INPUT_TOPICS)


def _dead_letter_metric(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("foretoken_dead_letter_total{"):
            labels, value = line.rsplit(" ", 1)
            topic = labels.split('topic="', 1)[1].split('"', 1)[0]
            out[topic] = out.get(topic, 0.0) + float(value)
    return out


def _metrics(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_a_workers_tombstone_retires_the_worker_and_is_not_dead_lettered(
    faust_worker: RunningWorker,
) -> None:
    """``workers`` is compacted and keyed by worker id: a null value is how Kafka deletes a
    key, so it means the worker is gone (before: a dead letter "empty record")."""
    run = f"tomb-{uuid.uuid4().hex[:6]}"
    worker = f"{run}-w0"
    cache_url = f"{faust_worker.url}/v1/cache/sample-model"

    async def send(tombstone: bool) -> None:
        async with RecordProducer(faust_worker.settings) as producer:
            if tombstone:
                await producer.send_tombstone("workers", worker.encode())
                await producer.send_raw("workers", b"\x00not a record", key=b"after")
            else:
                for logical, record in sample_records(1, run)[:2]:
                    await producer.send(logical, record)
            await producer.flush()

    asyncio.run(send(tombstone=False))
    _wait_for(cache_url, lambda page: worker in page["workers"])
    dead_before = get_json(f"{faust_worker.url}/v1/stats")["dead_lettered"]
    asyncio.run(send(tombstone=True))
    _wait_for(cache_url, lambda page: worker not in page["workers"])
    # the malformed record sent after the tombstone is the only new dead letter
    was = sum(dead_before.values())
    stats = _wait_for(f"{faust_worker.url}/v1/stats",
                      lambda s: sum(s["dead_lettered"].values()) > was)  # fmt: skip
    assert sum(stats["dead_lettered"].values()) == was + 1


def test_staleness_since_must_be_a_finite_time(faust_worker: RunningWorker) -> None:
    import urllib.error
    import urllib.request

    for since in ("nan", "inf", "soon"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{faust_worker.url}/v1/staleness?since={since}", timeout=5)
        assert info.value.code == 400
        assert b'"param":"since"' in info.value.read()


def test_the_started_worker_freezes_its_heap(faust_worker: RunningWorker) -> None:
    """``worker.freeze_heap_after_s`` after start, what the worker holds leaves the garbage
    collector's full passes (foretoken/adapters/heap.py): its stats say how much."""
    _wait_for(f"{faust_worker.url}/v1/stats",
              lambda s: s["memory"]["gc_frozen_objects"] > 10_000)  # fmt: skip


def test_a_record_too_big_to_dead_letter_whole_is_cut_and_the_agent_goes_on(
    faust_worker: RunningWorker,
) -> None:
    """Before: the dead letter carried the whole ~950 kB record, Faust's producer (its own
    1,000,000-byte limit) refused it, and the grants agent died with the record unlogged."""
    before = get_json(f"{faust_worker.url}/v1/stats")["consumed"].get("grants", 0)
    huge = b"\x00" + b"x" * 950_000

    async def send() -> None:
        async with RecordProducer(faust_worker.settings) as producer:
            await producer.send_raw("grants", huge, key=b"huge")
            for logical, record in sample_records(2, f"after-{uuid.uuid4().hex[:6]}"):
                if logical == "grants":
                    await producer.send(logical, record)
            await producer.flush()

    asyncio.run(send())
    stats = _wait_for(f"{faust_worker.url}/v1/stats",
                      lambda s: s["consumed"].get("grants", 0) > before)  # fmt: skip
    assert stats["dead_letter_failures"] == 0
    letters = asyncio.run(_dead_letters_keyed(faust_worker, b"huge"))
    assert len(letters) == 1
    assert letters[0].payload_size == len(huge) and 0 < len(letters[0].payload) < len(huge)
    assert get_json(f"{faust_worker.url}/healthz")["status"] == "ok"


async def _dead_letters_keyed(worker: RunningWorker, key: bytes) -> list[DeadLetter]:
    """The dead letters under ``key``, once one is there (all of the topic read so far)."""
    consumer = AIOKafkaConsumer(
        worker.settings.topic("dead_letter"),
        bootstrap_servers=worker.settings.kafka.bootstrap_servers,
        auto_offset_reset="earliest", group_id=f"test-dl-{uuid.uuid4().hex[:6]}",
        fetch_max_bytes=8 << 20, max_partition_fetch_bytes=4 << 20,
    )  # fmt: skip
    await consumer.start()
    out: list[DeadLetter] = []
    try:
        deadline = time.monotonic() + CONSUME_TIMEOUT_S
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=1000)
            for messages in batch.values():
                out.extend(dl for m in messages if (dl := decode(m.value, DeadLetter)).key == key)
            if out and not batch:
                break
    finally:
        await consumer.stop()
    return out
