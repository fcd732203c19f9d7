"""The processor as a Faust application: one thin agent per input topic, the timers
(snapshots, join expiry, latency controls) and start-up (``foretoken worker``).

Each agent takes raw bytes, hands them to the ``Dispatcher`` (decode, validate, call the
handlers of :class:`~foretoken.adapters.kafka.processor.ProcessorState`) and produces a
dead-letter record when that fails. State lives in plain in-memory objects, never in Faust
Tables (changelog writes cap throughput).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import faust

from foretoken.adapters.files import write_atomically
from foretoken.adapters.kafka.dispatch import INPUT_TOPICS, Consumed, reason_kind
from foretoken.adapters.kafka.fits_file import fits_bytes, fits_path, load_fits, save_fits
from foretoken.adapters.kafka.index_keeper import IndexKeeper, snapshot_path
from foretoken.adapters.kafka.lake_sink import add_lake_sink
from foretoken.adapters.kafka.pages import add_pages
from foretoken.adapters.kafka.processor import ProcessorState
from foretoken.adapters.kafka.producer import record_key
from foretoken.settings import Settings
from foretoken.wire.codec import encode
from foretoken.wire.records import DeadLetter, Record

log = logging.getLogger(__name__)


def create_app(
    settings: Settings, index: IndexKeeper | None = None
) -> tuple[faust.App, ProcessorState]:
    state = ProcessorState(settings, index)
    app = faust.App(
        settings.worker.app_id,
        broker=f"kafka://{settings.kafka.bootstrap_servers}",
        store="memory://",
        topic_partitions=settings.layout.partitions,
        # Faust's web_host only names the server in URLs it builds; web_bind is the address
        # it listens on (0.0.0.0 by default): both are the one setting worker.web_host.
        web_host=settings.worker.web_host,
        web_bind=settings.worker.web_host,
        web_port=settings.worker.web_port,
        # aiohttp's own body limit (1 MiB by default): the route page's, so that a prompt of
        # route.max_prompt_tokens always fits.
        web_application_options={"client_max_size": settings.route.body_limit},
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
    add_pages(app, state)
    _add_snapshots(app, state)
    _add_join_expiry(app, state, outputs)
    _add_controls(app, state, outputs)
    return app, state


def _add_controls(app: faust.App, state: ProcessorState, outputs: dict[str, Any]) -> None:
    @app.timer(interval=state.settings.controls.evaluate_every_s)
    async def evaluate_controls() -> None:
        for event in state.control_events():
            log.warning(
                "controls: %s on %s %s -> %s (%s)", event.workload_class, event.worker_id,
                event.from_stage, event.to_stage, event.reason,
            )  # fmt: skip
            await _emit(outputs, "controls", event, state.settings.wire_format)


def _add_join_expiry(app: faust.App, state: ProcessorState, outputs: dict[str, Any]) -> None:
    @app.timer(interval=state.settings.join.expiry_interval_s)
    async def expire_join() -> None:
        for graded in state.expire():
            await _emit(outputs, "graded", graded, state.settings.wire_format)
        await state.held_acks.release_settled()


def _add_snapshots(app: faust.App, state: ProcessorState) -> None:
    @app.timer(interval=state.settings.worker.snapshot_interval_s)
    async def snapshot_index() -> None:
        loop = asyncio.get_running_loop()
        # small: sample windows of a few hundred points per worker
        data = fits_bytes(state.settings, state.fits)
        try:
            await loop.run_in_executor(None, write_atomically, fits_path(state.settings), data)
        except OSError as exc:
            log.warning("could not save the fits: %s", exc)
        await loop.run_in_executor(None, state.index.save)

    @app.on_before_shutdown.connect  # type: ignore[arg-type]
    def snapshot_on_shutdown(app: faust.App, **kwargs: Any) -> None:
        save_fits(state.settings, state.fits)
        state.index.save()


async def _emit(outputs: dict[str, Any], logical: str, record: Record, wire_format: Any) -> None:
    await outputs[logical].send(key=record_key(logical, record), value=encode(record, wire_format))


def _add_consumer(
    app: faust.App, state: ProcessorState, logical: str, outputs: dict[str, Any]
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
        manual = stream.noack()  # acked once the join settles the request (held_acks.py)
        async for event in manual.events():
            result = dispatch(event)
            await after(event, result)
            request_id = getattr(result.record, "request_id", None)
            await held.after(manual, event, event.message.partition, request_id)

    consume.__name__ = f"consume_{logical}"
    app.agent(topic, name=f"foretoken.consume.{logical}")(consume)


def _event_handlers(
    state: ProcessorState, logical: str, outputs: dict[str, Any]
) -> tuple[Any, Any]:
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


def _dead_letter_of(state: ProcessorState, outputs: dict[str, Any]) -> Any:
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


def run_worker(settings: Settings) -> None:
    """Run the processor in the foreground (``foretoken worker``).

    Start-up cannot race a fresh broker or fresh topics: the topics are created when
    ``worker.create_topics`` says so, then waited for (they exist, every partition has a
    leader: ``foretoken.adapters.kafka.readiness``), and only then is the group rewound and Faust
    started.
    A failure says what it waited for and exits with status 1."""

    from foretoken.adapters.kafka.offsets import rewind_group
    from foretoken.adapters.kafka.readiness import StartupError, wait_for_topics
    from foretoken.adapters.kafka.topics import ensure_topics

    if not settings.binds_loopback_only and not settings.route.token:
        print(f"error: the processor would listen on {settings.worker.web_host}, which is not "
              "loopback, and POST /v1/route changes its state: set route.token "
              "(FORETOKEN_ROUTE_TOKEN), which the router sends, or bind 127.0.0.1",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    settings.worker_data_path.mkdir(parents=True, exist_ok=True)
    try:
        if settings.worker.create_topics:
            asyncio.run(ensure_topics(settings, settings.kafka.startup_timeout_s))
        topics = (*INPUT_TOPICS, "dead_letter", "controls")
        partitions = asyncio.run(wait_for_topics(settings, topics, service="the processor"))
        keeper = IndexKeeper.load(
            settings.topic("kv_events"), snapshot_path(settings), settings.index
        )
        group = settings.worker.app_id
        # Rebuild in-memory state: every registration, and the KV batches the snapshot lacks.
        for logical, offsets in (("workers", None), ("kv_events", keeper.next_offsets())):
            name = settings.topic(logical)
            asyncio.run(rewind_group(settings, group, name, partitions[name], offsets))
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    app, state = create_app(settings, keeper)
    if load_fits(settings, state.fits):
        log.info("restored the fits from %s", fits_path(settings))
    worker = faust.Worker(app, loglevel=settings.worker.log_level)
    worker.execute_from_commandline()
