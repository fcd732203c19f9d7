"""The Faust app: thin agents over the input topics, and the worker's web pages.

Each agent takes raw bytes, hands them to the ``Dispatcher`` (decode, validate, call the pure
handlers) and produces a dead-letter record when that fails. State lives in plain in-memory
objects owned by ``WorkerState``, never in Faust Tables (changelog writes cap throughput).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import faust
import msgspec
from faust.web import Request, Response, View

from foretoken import __version__
from foretoken.adapters.kafka.dispatch import (
    INPUT_TOPICS,
    Consumed,
    Dispatcher,
    Position,
    reason_kind,
)
from foretoken.adapters.kafka.held_acks import HeldAcks
from foretoken.adapters.kafka.index_keeper import IndexKeeper
from foretoken.adapters.kafka.lake_sink import LakeSink, add_lake_sink
from foretoken.adapters.kafka.metrics import PROMETHEUS_CONTENT_TYPE, WorkerMetrics
from foretoken.adapters.kafka.producer import record_key
from foretoken.core.grading.join import GradingJoin
from foretoken.core.index.approx import ApproxCacheConfig
from foretoken.core.routing.controls import LatencyControls
from foretoken.core.routing.service import Predictor
from foretoken.core.types import WorkerId
from foretoken.settings import Settings
from foretoken.wire.records import (
    ControlEvent,
    DeadLetter,
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
        approx = ApproxCacheConfig(
            settings.worker.approx_cache_ttl_s, settings.worker.approx_cache_default_tokens
        )
        self.index = index or IndexKeeper(settings.topic("kv_events"), None, approx=approx)
        self.index.approx = approx
        self.directory: dict[WorkerId, WorkerRegistration] = {}
        self.join = GradingJoin(
            block_size_of=self.block_size_of, reports_cached_of=self.reports_cached_of
        )
        self.controls = LatencyControls(settings.controls)
        self.predictor = Predictor(self.index.index, controls=self.controls)
        # Grants/outcomes are acked only once the join has settled their request.
        self.held_acks = HeldAcks(lambda: self.join.pending)
        # The graded -> Parquet lake sink, when a lake directory is configured.
        self.lake = LakeSink(settings.lake, self.metrics.registry) if settings.lake.dir else None
        self.dispatcher.on("workers", self.on_worker)
        self.dispatcher.on("workers", self.index.on_worker)
        self.dispatcher.on("kv_events", self.index.on_kv)
        self.dispatcher.on("grants", self.on_grant)
        self.dispatcher.on("outcomes", self.on_outcome)
        self.dispatcher.on("graded", self.on_graded)

    def block_size_of(self, worker: WorkerId) -> int | None:
        reg = self.directory.get(worker)
        return reg.block_size if reg is not None else None

    def reports_cached_of(self, worker: WorkerId) -> bool:
        reg = self.directory.get(worker)
        return reg.reports_cached_tokens if reg is not None else True

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
            "lake": self.lake.stats() if self.lake is not None else None,
            "controls": self.controls.snapshot(time.time()),
        }


def snapshot_path(settings: Settings) -> Path:
    return settings.worker_data_path / "index.snapshot"


def fits_path(settings: Settings) -> Path:
    return settings.worker_data_path / "fits.snapshot"


class _FitsFile(msgspec.Struct, frozen=True):
    """``fits.snapshot``: the fits and whose they are (the ``graded`` topic they learned
    from), so that a data directory reused with other topics never lends its fits."""

    scope: str
    fits: bytes


def save_fits(state: WorkerState) -> Path:
    """The prefill and step fits (their sample windows), written atomically: a restarted
    worker predicts with what it had learned instead of the defaults."""
    return write_fits(fits_path(state.settings), fits_file(state))


def fits_file(state: WorkerState) -> bytes:
    """The snapshot's bytes (taken on the event loop; writing them may go elsewhere)."""
    scope = state.settings.topic("graded")
    return msgspec.msgpack.encode(_FitsFile(scope, state.predictor.fits.snapshot()))


def write_fits(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
    return path


def load_fits(state: WorkerState) -> bool:
    """Restore the fits saved by :func:`save_fits`; a missing or unreadable file means
    learning afresh (from the defaults), never a crash."""
    path = fits_path(state.settings)
    if not path.exists():
        return False
    try:
        saved = msgspec.msgpack.decode(path.read_bytes(), type=_FitsFile)
        if saved.scope != state.settings.topic("graded"):
            raise ValueError(f"fits learned from {saved.scope}")
        state.predictor.fits.restore(saved.fits)
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        log.warning("ignoring fits snapshot %s (%s): learning afresh", path, exc)
        return False
    return True


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
        datadir=str(settings.worker_data_path),
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        broker_session_timeout=settings.worker.session_timeout_s,
        broker_heartbeat_interval=settings.worker.heartbeat_interval_s,
        web_enabled=True,
        # On stop, commit what is acked and no more: the acks held for the grading join
        # and the lake sink (join_acks.py, lake_sink.py) are simply read again next time.
        stream_wait_empty=False,
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
        await state.held_acks.release_settled()


def _add_snapshots(app: faust.App, state: WorkerState) -> None:
    @app.timer(interval=state.settings.worker.snapshot_interval_s)
    async def snapshot_index() -> None:
        loop = asyncio.get_running_loop()
        data = fits_file(state)  # small: sample windows of a few hundred points per worker
        try:
            await loop.run_in_executor(None, write_fits, fits_path(state.settings), data)
        except OSError as exc:
            log.warning("could not save the fits: %s", exc)
        await loop.run_in_executor(None, state.index.save)

    @app.on_before_shutdown.connect  # type: ignore[arg-type]
    def snapshot_on_shutdown(app: faust.App, **kwargs: Any) -> None:
        save_fits(state)
        state.index.save()


async def _emit(outputs: dict[str, Any], logical: str, record: Record, wire_format: Any) -> None:
    await outputs[logical].send(key=record_key(logical, record), value=encode(record, wire_format))


def _add_consumer(
    app: faust.App, state: WorkerState, logical: str, outputs: dict[str, Any]
) -> None:
    name = state.settings.topic(logical)
    dispatch, after = _event_handlers(state, logical, outputs)
    if logical == "graded" and state.lake is not None:  # the sink consumes it, in batches
        add_lake_sink(app, state.lake, name, dispatch, after, _dead_letter_of(state, outputs))
        return
    topic = app.topic(name, key_serializer="raw", value_serializer="raw")
    held = state.held_acks if logical in ("grants", "outcomes") else None

    async def consume(stream: Any) -> None:
        if held is None:
            async for event in stream.events():
                await after(event, dispatch(event))
            return
        manual = stream.noack()  # acked once the join settles the request (join_acks.py)
        async for event in manual.events():
            result = dispatch(event)
            await after(event, result)
            request_id = getattr(result.record, "request_id", None)
            await held.after(manual, event, event.message.partition, request_id)

    consume.__name__ = f"consume_{logical}"
    app.agent(topic, name=f"foretoken.consume.{logical}")(consume)


def _event_handlers(state: WorkerState, logical: str, outputs: dict[str, Any]) -> tuple[Any, Any]:
    """(dispatch one event, then emit / count / dead-letter its result), for the agents."""
    name = state.settings.topic(logical)
    wire_format = state.settings.wire_format

    def dispatch(event: Any) -> Consumed:
        message = event.message
        return state.dispatcher.consume(
            logical, name, message.key, event.value, message.partition, message.offset
        )

    async def after(event: Any, result: Consumed) -> None:
        for out_logical, out in result.emit:
            await _emit(outputs, out_logical, out, wire_format)
        if result.dead_letter is None:
            state.metrics.consumed.labels(logical).inc()
            return
        dl = result.dead_letter
        state.metrics.dead_lettered.labels(logical, reason_kind(dl.reason)).inc()
        log.warning("dead-letter from %s@%s: %s", name, event.message.offset, dl.reason)
        await outputs["dead_letter"].send(key=name.encode(), value=encode(dl, wire_format))

    return dispatch, after


def _dead_letter_of(state: WorkerState, outputs: dict[str, Any]) -> Any:
    """Dead-letters a record of ``graded`` that the lake writer refused, with the reason."""

    async def dead_letter(event: Any, reason: str) -> None:
        name = state.settings.topic("graded")
        message = event.message
        dl = DeadLetter(
            source=name, reason=reason, ts=time.time(), partition=message.partition,
            offset=message.offset, key=message.key, payload=event.value or b"",
        )  # fmt: skip
        state.metrics.dead_lettered.labels("graded", reason_kind(reason)).inc()
        log.warning("dead-letter from %s@%s: %s", name, message.offset, reason)
        await outputs["dead_letter"].send(
            key=name.encode(), value=encode(dl, state.settings.wire_format)
        )

    return dead_letter


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
    """Run the Faust worker in the foreground (``foretoken worker``).

    Start-up cannot race a fresh broker or fresh topics: the topics are created when
    ``worker.create_topics`` says so, then waited for (they exist, every partition has a
    leader: ``foretoken.adapters.kafka.readiness``), and only then is the group rewound and Faust
    started.
    A failure says what it waited for and exits with status 1."""

    from foretoken.adapters.kafka.offsets import rewind_group
    from foretoken.adapters.kafka.readiness import StartupError, wait_for_topics
    from foretoken.adapters.kafka.topics import ensure_topics

    settings.worker_data_path.mkdir(parents=True, exist_ok=True)
    try:
        if settings.worker.create_topics:
            asyncio.run(ensure_topics(settings, settings.kafka.startup_timeout_s))
        topics = (*INPUT_TOPICS, "dead_letter", "controls")
        partitions = asyncio.run(wait_for_topics(settings, topics, service="the worker"))
        keeper = IndexKeeper.load(settings.topic("kv_events"), snapshot_path(settings))
        group = settings.worker.app_id
        # Rebuild in-memory state: every registration, and the KV batches the snapshot lacks.
        for logical, offsets in (("workers", None), ("kv_events", keeper.next_offsets())):
            name = settings.topic(logical)
            asyncio.run(rewind_group(settings, group, name, partitions[name], offsets))
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    app, state = create_app(settings, keeper)
    if load_fits(state):
        log.info("restored the fits from %s", fits_path(settings))
    worker = faust.Worker(app, loglevel=settings.worker.log_level)
    worker.execute_from_commandline()
