"""The Faust app: thin agents over the input topics, and the worker's web pages.

Each agent takes raw bytes, hands them to the ``Dispatcher`` (decode, validate, call the pure
handlers) and produces a dead-letter record when that fails. State lives in plain in-memory
objects owned by ``WorkerState``, never in Faust Tables (changelog writes cap throughput).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import faust
from faust.web import Request, Response, View

from foretoken import __version__
from foretoken.settings import Settings
from streams.consume import INPUT_TOPICS, Dispatcher, reason_kind
from streams.metrics import PROMETHEUS_CONTENT_TYPE, WorkerMetrics
from streams.records import encode

log = logging.getLogger(__name__)


class WorkerState:
    """Everything the worker keeps in memory; later issues hang the index, fits, queues here."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.dispatcher = Dispatcher()
        self.metrics = WorkerMetrics()
        self.started_ts = time.time()

    def stats(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started_ts, 3),
            "consumed": dict(self.dispatcher.counts),
            "dead_lettered": dict(self.dispatcher.dead),
        }


def create_app(settings: Settings) -> tuple[faust.App, WorkerState]:
    state = WorkerState(settings)
    app = faust.App(
        settings.worker.app_id,
        broker=f"kafka://{settings.kafka.bootstrap_servers}",
        store="memory://",
        topic_partitions=settings.layout.partitions,
        web_host=settings.worker.web_host,
        web_port=settings.worker.web_port,
        datadir=settings.worker.data_dir,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        web_enabled=True,
    )
    dead_letter = app.topic(
        settings.topic("dead_letter"), key_serializer="raw", value_serializer="raw"
    )
    for logical in INPUT_TOPICS:
        _add_consumer(app, state, logical, dead_letter)
    _add_pages(app, state)
    return app, state


def _add_consumer(app: faust.App, state: WorkerState, logical: str, dead_letter: Any) -> None:
    name = state.settings.topic(logical)
    topic = app.topic(name, key_serializer="raw", value_serializer="raw")
    wire_format = state.settings.wire_format

    async def consume(stream: Any) -> None:
        async for event in stream.events():
            message = event.message
            result = state.dispatcher.consume(
                logical, name, message.key, event.value, message.partition, message.offset
            )
            if result.dead_letter is None:
                state.metrics.consumed.labels(logical).inc()
                continue
            dl = result.dead_letter
            state.metrics.dead_lettered.labels(logical, reason_kind(dl.reason)).inc()
            log.warning("dead-letter from %s@%s: %s", name, message.offset, dl.reason)
            await dead_letter.send(key=name.encode(), value=encode(dl, wire_format))

    consume.__name__ = f"consume_{logical}"
    app.agent(topic, name=f"foretoken.consume.{logical}")(consume)


def _add_pages(app: faust.App, state: WorkerState) -> None:
    @app.page("/healthz")
    async def healthz(self: View, request: Request) -> Response:
        return self.json({"status": "ok", "version": __version__})

    @app.page("/metrics")
    async def metrics(self: View, request: Request) -> Response:
        return self.bytes(state.metrics.render(), content_type=PROMETHEUS_CONTENT_TYPE)

    @app.page("/v1/stats")
    async def stats(self: View, request: Request) -> Response:
        return self.json(state.stats())


def run_worker(settings: Settings) -> None:
    """Run the Faust worker in the foreground (``foretoken worker``)."""
    import asyncio

    from streams.topics import ensure_topics

    asyncio.run(ensure_topics(settings))
    app, _state = create_app(settings)
    worker = faust.Worker(app, loglevel=settings.worker.log_level)
    worker.execute_from_commandline()
