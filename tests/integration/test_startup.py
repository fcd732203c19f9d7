"""Start-up that cannot race (issue 13): the worker on a broker that has just started and on
topics created a moment before; a missing topic named in the error; no dependence on the
working directory."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import IllegalStateError

from foretoken.adapters.kafka.offsets import rewind_group
from foretoken.adapters.kafka.readiness import wait_for_topics
from foretoken.adapters.kafka.topics import ensure_topics
from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop, wait_http
from foretoken.settings import Settings, load_settings
from tests.conftest import PrivateBroker, free_port, private_broker_config

pytestmark = pytest.mark.integration
FRESH_RUNS = 3
RACE_TRIES = 8


def _env(prefix: str, port: int, **extra: str) -> dict[str, str]:
    return {
        "FORETOKEN_TOPIC_PREFIX": prefix,
        "FORETOKEN_APP_ID": f"foretoken-{prefix}",
        "FORETOKEN_WEB_PORT": str(port),
        "FORETOKEN_LOG_LEVEL": "warn",
        **extra,
    }


@pytest.fixture()
def fresh_broker(tmp_path: Path) -> Iterator[PrivateBroker]:
    broker = private_broker_config(tmp_path)
    up = broker.cli("kafka", "up")
    assert up.returncode == 0 and up.stdout.strip() == "started", up.stderr
    yield broker
    broker.cli("kafka", "down")


def test_worker_starts_at_once_on_a_fresh_broker_and_fresh_topics(
    fresh_broker: PrivateBroker, tmp_path: Path
) -> None:
    """The demo's crash: a broker just started, topics just created, the worker at once
    (its start-up rewind found no partitions and committed ``{}``: ``ValueError: {}``)."""
    for run in range(FRESH_RUNS):
        prefix = f"fresh{run}{uuid.uuid4().hex[:4]}-"
        port = free_port()
        env = {**fresh_broker.env, **_env(prefix, port),
               "FORETOKEN_CONFIG": str(fresh_broker.config)}  # fmt: skip
        created = subprocess.run(foretoken_cmd("topics", "create"), env=env, capture_output=True,
                                 text=True, timeout=120, check=False)  # fmt: skip
        assert created.returncode == 0, created.stderr
        log = tmp_path / f"worker-{run}.log"
        proc = spawn(foretoken_cmd("worker"), env, log)  # at once, no pause
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz", 120.0, proc)
            stats = get_json(f"http://127.0.0.1:{port}/v1/stats")
            assert stats["version"]
        except Exception:
            print(log.read_text()[-4000:])
            raise
        finally:
            stop(proc)
        assert "ValueError" not in log.read_text()


def test_a_missing_topic_is_named_with_the_command_that_creates_it(
    kafka_broker: object, tmp_path: Path
) -> None:
    prefix = f"missing{uuid.uuid4().hex[:6]}-"
    env = {**os.environ, **_env(prefix, free_port(), FORETOKEN_CREATE_TOPICS="false",
                                FORETOKEN_STARTUP_TIMEOUT_S="3",
                                FORETOKEN_STATE_DIR=str(tmp_path / "state"))}  # fmt: skip
    started = time.monotonic()
    out = subprocess.run(foretoken_cmd("worker"), env=env, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 1
    assert time.monotonic() - started < 60
    assert f"{prefix}kv-events" in out.stderr and "foretoken topics create" in out.stderr
    engines = tmp_path / "engines.toml"
    engines.write_text(
        '[[engines]]\nworker_id = "w0"\nmodel = "m"\nhttp_url = "http://127.0.0.1:1"\n'
        'kv_events_url = "tcp://127.0.0.1:2"\nblock_size = 16\n'
    )
    ingest = subprocess.run(foretoken_cmd("ingest", "-e", str(engines), "--port", "0"), env=env,
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert ingest.returncode == 1, ingest.stderr[-2000:]
    assert f"{prefix}workers" in ingest.stderr and "foretoken topics create" in ingest.stderr


def test_worker_runs_from_any_working_directory(kafka_broker: object, tmp_path: Path) -> None:
    """No `.run/` beside it: the data directory goes under the state dir, parents created."""
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    state = tmp_path / "state" / "deep"
    prefix = f"cwd{uuid.uuid4().hex[:6]}-"
    port = free_port()
    env = _env(prefix, port, FORETOKEN_STATE_DIR=str(state), FORETOKEN_SNAPSHOT_INTERVAL_S="1")
    env.pop("FORETOKEN_WORKER_DATA_DIR", None)
    log = tmp_path / "worker.log"
    proc = subprocess.Popen(foretoken_cmd("worker"), cwd=empty, env={**os.environ, **env},
                            stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", 120.0, proc)
        data = state / "worker" / f"foretoken-{prefix}"
        deadline = time.monotonic() + 30
        while not (data / "index.snapshot").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (data / "index.snapshot").exists()
        assert not (empty / ".run").exists()
    finally:
        stop(proc)


def _fresh_settings() -> Settings:
    prefix = f"race{uuid.uuid4().hex[:6]}-"
    return load_settings(env={**os.environ, "FORETOKEN_TOPIC_PREFIX": prefix})


async def _naive_partitions(settings: Settings, topic: str) -> set[int]:
    """How the old start-up found a topic's partitions: the consumer's metadata, once."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                group_id=f"naive{uuid.uuid4().hex[:6]}",
                                enable_auto_commit=False)  # fmt: skip
    await consumer.start()
    try:
        found = consumer.partitions_for_topic(topic)
        if found is None:
            await consumer._client.force_metadata_update()
            found = consumer.partitions_for_topic(topic) or set()
        if not found:  # the crash itself: aiokafka refuses an empty offset map (ValueError;
            # IllegalStateError when the consumer's assignment is empty, as it is then)
            with pytest.raises((ValueError, IllegalStateError)):
                await consumer.commit({})
        return set(found)
    finally:
        await consumer.stop()


def test_topics_used_right_after_creation_race_the_metadata_and_start_up_waits(
    kafka_broker: Settings,
) -> None:
    """In one process, as fast as it gets: create fresh topics, then set the group's offsets.
    The old lookup saw no partitions for a topic created a moment before (measured 9 of 10);
    waiting for the topics first always finds them all."""

    async def once() -> tuple[set[int], dict[int, int]]:
        settings = _fresh_settings()
        await ensure_topics(settings)
        naive = await _naive_partitions(settings, settings.topic("workers"))
        fresh = _fresh_settings()
        await ensure_topics(fresh)
        found = await wait_for_topics(fresh, ("workers", "kv_events"), service="test")
        name = fresh.topic("kv_events")
        group = f"g{uuid.uuid4().hex[:6]}"
        return naive, await rewind_group(fresh, group, name, found[name], None)

    results = [asyncio.run(once()) for _ in range(RACE_TRIES)]
    empty = sum(1 for naive, _ in results if not naive)
    # How often the race hit here (9 of 10 and 5 of 10 measured on this machine, 0 of 8 on
    # another run: it is timing); each time it did, the old path's commit({}) raised.
    print(f"the old lookup found no partitions {empty} of {RACE_TRIES} times")
    partitions = kafka_broker.layout.partitions
    assert all(sorted(committed) == list(range(partitions)) for _, committed in results)
