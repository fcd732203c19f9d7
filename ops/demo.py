"""``make demo``: broker, topics, the Faust worker, a sample of every record, and what the
worker made of them. Later issues grow this into the full story (fleet, router, lake)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

from foretoken.settings import Settings
from ops import kafka_local
from ops.procs import foretoken_cmd, spawn, stop, wait_http
from streams.produce import RecordProducer
from streams.sample import sample_records
from streams.topics import ensure_topics

WORKER_START_S = 120.0
CONSUME_WAIT_S = 60.0
MALFORMED = b'{"request_id": 42, "this is": "not a grant"'

console = Console()


def run_demo(settings: Settings, keep: bool = False) -> int:
    console.rule("[bold]foretoken demo")
    st, started_broker = kafka_local.up(settings)
    console.print(f"broker: {st.describe()}")
    created = asyncio.run(ensure_topics(settings))
    console.print(f"topics: {len(settings.all_topics())} ready ({len(created)} created now)")
    web = f"http://{settings.worker.web_host}:{settings.worker.web_port}"
    worker = spawn(foretoken_cmd("worker"), {}, Path(".run/demo-worker.log"))
    try:
        wait_http(f"{web}/healthz", WORKER_START_S, worker)
        console.print(f"worker: up, {web}/metrics")
        run = f"demo-{uuid.uuid4().hex[:6]}"
        records = sample_records(3, run)
        asyncio.run(_produce(settings, records))
        expected = _expected_counts(records)
        console.print(f"produced {len(records)} records and 1 malformed grant")
        stats = _wait_consumed(f"{web}/v1/stats", expected)
        _show(stats, expected)
        console.print(f"Prometheus metrics: {web}/metrics")
        return 0
    finally:
        if not keep:
            stop(worker)
            if started_broker:
                kafka_local.down(settings)


async def _produce(settings: Settings, records: list) -> None:
    async with RecordProducer(settings) as producer:
        await producer.send_all(records)
        await producer.send_raw("grants", MALFORMED, key=b"bad")
        await producer.flush()


def _expected_counts(records: list) -> dict[str, int]:
    counts: dict[str, int] = {}
    for logical, _ in records:
        counts[logical] = counts.get(logical, 0) + 1
    return counts


def _wait_consumed(url: str, expected: dict[str, int]) -> dict:
    deadline = time.monotonic() + CONSUME_WAIT_S
    stats = wait_http(url, CONSUME_WAIT_S)
    while time.monotonic() < deadline:
        stats = wait_http(url, CONSUME_WAIT_S)
        consumed = stats["consumed"]
        if all(consumed.get(k, 0) >= v for k, v in expected.items()) and stats["dead_lettered"]:
            break
        time.sleep(0.5)
    return dict(stats)


def _show(stats: dict, expected: dict[str, int]) -> None:
    table = Table(title="what the Faust worker consumed")
    table.add_column("topic")
    table.add_column("sent", justify="right")
    table.add_column("consumed", justify="right")
    for logical, sent in expected.items():
        table.add_row(logical, str(sent), str(stats["consumed"].get(logical, 0)))
    console.print(table)
    console.print(f"dead-lettered: {stats['dead_lettered']}")
