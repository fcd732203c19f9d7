"""The Faust app: thin agents over the input topics, and the worker's web pages.

Each agent takes raw bytes, hands them to the ``Dispatcher`` (decode, validate, call the pure
handlers) and produces a dead-letter record when that fails. State lives in plain in-memory
objects owned by ``WorkerState``, never in Faust Tables (changelog writes cap throughput).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import faust
import msgspec
from faust.web import Request, Response, View

from foretoken import __version__
from foretoken.ids import WorkerId
from foretoken.settings import Settings
from grading.join import GradingJoin
from predictor.controls import LatencyControls
from predictor.service import Predictor
from streams.consume import INPUT_TOPICS, Dispatcher, Position, reason_kind
from streams.index_keeper import IndexKeeper
from streams.metrics import PROMETHEUS_CONTENT_TYPE, WorkerMetrics
from streams.produce import record_key
from streams.records import (
    ControlEvent,
    DecodeError,
    Graded,
    Grant,
    Outcome,
    Record,
    RouteRequest,
    WorkerRegistration,
    decode,
    encode,
)

log = logging.getLogger(__name__)


class WorkerState:
    """Everything the worker keeps in memory; later issues hang the index, fits, queues here."""

    def __init__(self, settings: Settings, index: IndexKeeper | None = None) -> None:
        self.settings = settings
        self.dispatcher = Dispatcher()
        self.metrics = WorkerMetrics()
        self.started_ts = time.time()
        self.index = index or IndexKeeper(settings.topic("kv_events"), None)
        self.directory: dict[WorkerId, WorkerRegistration] = {}
        self.join = GradingJoin(block_size_of=self.block_size_of)
        self.controls = LatencyControls(settings.controls)
        self.predictor = Predictor(self.index.index, controls=self.controls)
        self.dispatcher.on("workers", self.on_worker)
        self.dispatcher.on("workers", self.index.on_worker)
        self.dispatcher.on("kv_events", self.index.on_kv)
        self.dispatcher.on("grants", self.on_grant)
        self.dispatcher.on("outcomes", self.on_outcome)
        self.dispatcher.on("graded", self.on_graded)

    def block_size_of(self, worker: WorkerId) -> int | None:
        reg = self.directory.get(worker)
        return reg.block_size if reg is not None else None

    def on_worker(self, record: Record, pos: Position) -> None:
        assert isinstance(record, WorkerRegistration)
        if record.removed:
            self.directory.pop(record.worker_id, None)
        else:
            self.directory[record.worker_id] = record
        self.predictor.on_registration(record)

    def on_grant(self, record: Record, pos: Position) -> list[tuple[str, Record]]:
        assert isinstance(record, Grant)
        self.predictor.on_grant(record, time.time())
        return [("graded", g) for g in self.join.on_grant(record, time.time())]

    def on_outcome(self, record: Record, pos: Position) -> list[tuple[str, Record]]:
        assert isinstance(record, Outcome)
        self.predictor.on_outcome(record, time.time())
        return [("graded", g) for g in self.join.on_outcome(record, time.time())]

    def on_graded(self, record: Record, pos: Position) -> None:
        assert isinstance(record, Graded)
        self.predictor.on_graded(record, time.time())

    def route(self, body: bytes) -> bytes:
        """``POST /v1/route``: the decision, reflected at once in the queue model."""
        req = decode(body, RouteRequest)
        now = time.time()
        return msgspec.json.encode(self.predictor.route(req, now, now))

    def expire(self) -> list[Graded]:
        now = time.time()
        self.predictor.maintain(now)
        return self.join.expire(now)

    def control_events(self) -> list[ControlEvent]:
        """Evaluate the latency controls now; their stage changes, for the ``controls``
        topic (and the metrics)."""
        now = time.time()
        self.controls.tick(now)
        events = self.controls.drain()
        self.metrics.observe_controls(self.controls.snapshot(now), events)
        return events

    def stats(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started_ts, 3),
            "consumed": dict(self.dispatcher.counts),
            "dead_lettered": dict(self.dispatcher.dead),
            "index_snapshots": self.index.snapshots,
            "controls": self.controls.snapshot(time.time()),
        }


def snapshot_path(settings: Settings) -> Path:
    return Path(settings.worker.data_dir) / "index.snapshot"


def create_app(
    settings: Settings, index: IndexKeeper | None = None
) -> tuple[faust.App, WorkerState]:
    state = WorkerState(settings, index)
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
        broker_session_timeout=settings.worker.session_timeout_s,
        broker_heartbeat_interval=settings.worker.heartbeat_interval_s,
        web_enabled=True,
    )
    outputs = {
        logical: app.topic(settings.topic(logical), key_serializer="raw", value_serializer="raw")
        for logical in ("dead_letter", "graded", "controls")
    }
    for logical in INPUT_TOPICS:
        _add_consumer(app, state, logical, outputs)
    _add_pages(app, state)
    _add_snapshots(app, state)
    _add_join_expiry(app, state, outputs)
    _add_controls(app, state, outputs)
    return app, state


def _add_controls(app: faust.App, state: WorkerState, outputs: dict[str, Any]) -> None:
    @app.timer(interval=state.settings.controls.evaluate_every_s)
    async def evaluate_controls() -> None:
        for event in state.control_events():
            log.warning(
                "controls: %s on %s %s -> %s (%s)", event.workload_class, event.worker_id,
                event.from_stage, event.to_stage, event.reason,
            )  # fmt: skip
            await _emit(outputs, "controls", event, state.settings.wire_format)


JOIN_EXPIRY_INTERVAL_S = 5.0


def _add_join_expiry(app: faust.App, state: WorkerState, outputs: dict[str, Any]) -> None:
    @app.timer(interval=JOIN_EXPIRY_INTERVAL_S)
    async def expire_join() -> None:
        for graded in state.expire():
            await _emit(outputs, "graded", graded, state.settings.wire_format)


def _add_snapshots(app: faust.App, state: WorkerState) -> None:
    @app.timer(interval=state.settings.worker.snapshot_interval_s)
    async def snapshot_index() -> None:
        await asyncio.get_running_loop().run_in_executor(None, state.index.save)

    @app.on_before_shutdown.connect  # type: ignore[arg-type]
    def snapshot_on_shutdown(app: faust.App, **kwargs: Any) -> None:
        state.index.save()


async def _emit(outputs: dict[str, Any], logical: str, record: Record, wire_format: Any) -> None:
    await outputs[logical].send(key=record_key(logical, record), value=encode(record, wire_format))


def _add_consumer(
    app: faust.App, state: WorkerState, logical: str, outputs: dict[str, Any]
) -> None:
    name = state.settings.topic(logical)
    topic = app.topic(name, key_serializer="raw", value_serializer="raw")
    wire_format = state.settings.wire_format

    async def consume(stream: Any) -> None:
        async for event in stream.events():
            message = event.message
            result = state.dispatcher.consume(
                logical, name, message.key, event.value, message.partition, message.offset
            )
            for out_logical, out in result.emit:
                await _emit(outputs, out_logical, out, wire_format)
            if result.dead_letter is None:
                state.metrics.consumed.labels(logical).inc()
                continue
            dl = result.dead_letter
            state.metrics.dead_lettered.labels(logical, reason_kind(dl.reason)).inc()
            log.warning("dead-letter from %s@%s: %s", name, message.offset, dl.reason)
            await outputs["dead_letter"].send(key=name.encode(), value=encode(dl, wire_format))

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

    @app.page("/v1/route")
    class RoutePage(View):
        async def post(self, request: Request) -> Response:
            try:
                body = state.route(await request.read())
            except DecodeError as exc:
                return self.json({"error": exc.reason}, status=400)
            return self.bytes(body, content_type="application/json")

    @app.page("/v1/controls")
    async def controls(self: View, request: Request) -> Response:
        now = time.time()
        body = state.controls.snapshot(now)
        body["recent"] = [msgspec.to_builtins(e) for e in list(state.controls.history)[-50:]]
        return self.json(body)

    @app.page("/v1/fits")
    async def fits(self: View, request: Request) -> Response:
        return self.json({"fits": state.predictor.fits.describe()})

    @app.page("/v1/cache/{model}")
    class CachePage(View):
        async def get(self, request: Request, model: str) -> Response:
            return self.json(state.index.cache_page(model))

        async def post(self, request: Request, model: str) -> Response:
            """Body ``{"token_ids": [...]}``: every worker's cached prefix of that prompt."""
            body = await request.json()
            tokens = body.get("token_ids") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                return self.json({"error": "token_ids must be a list of ints"}, status=400)
            return self.json(state.index.lookup_page(model, tokens))


def run_worker(settings: Settings) -> None:
    """Run the Faust worker in the foreground (``foretoken worker``)."""

    from streams.offsets import rewind_group
    from streams.topics import ensure_topics

    asyncio.run(ensure_topics(settings))
    keeper = IndexKeeper.load(settings.topic("kv_events"), snapshot_path(settings))
    group = settings.worker.app_id
    # Rebuild in-memory state: every registration, and the KV batches the snapshot lacks.
    asyncio.run(rewind_group(settings, group, settings.topic("workers"), None))
    asyncio.run(rewind_group(settings, group, settings.topic("kv_events"), keeper.next_offsets()))
    app, _state = create_app(settings, keeper)
    worker = faust.Worker(app, loglevel=settings.worker.log_level)
    worker.execute_from_commandline()
