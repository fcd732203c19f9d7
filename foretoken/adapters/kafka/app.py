"""The processor as a Faust application: one thin agent per input topic, the timers
(snapshots, join expiry, latency controls, members record) and start-up (``foretoken
worker``).

Each agent takes raw bytes, hands them to the ``Dispatcher`` (decode, validate, call the
handlers of :class:`~foretoken.adapters.kafka.processor.ProcessorState`) and produces a
dead-letter record when that fails. State lives in plain in-memory objects, never in Faust
Tables (changelog writes cap throughput).

``worker.role = "route"`` (``foretoken worker --role route``) runs a read replica: the same
agents and state, its own consumer group, no output but its members record — no graded, no
controls events, no dead letters (the primary sends those), no lake, no snapshots — and a
start from the primary's latest snapshot at every assignment (:mod:`.replica`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import faust

from foretoken.adapters.files import write_atomically
from foretoken.adapters.heap import freeze_startup_heap
from foretoken.adapters.kafka.dispatch import INPUT_TOPICS, Consumed, reason_kind
from foretoken.adapters.kafka.fits_file import fits_bytes, fits_path, load_fits, save_fits
from foretoken.adapters.kafka.index_keeper import IndexKeeper, snapshot_path
from foretoken.adapters.kafka.lag import refresh_lag
from foretoken.adapters.kafka.lake_sink import add_lake_sink
from foretoken.adapters.kafka.members import follow_members
from foretoken.adapters.kafka.pages import add_pages
from foretoken.adapters.kafka.processor import ProcessorState
from foretoken.adapters.kafka.producer import fitted_dead_letter, record_key
from foretoken.adapters.kafka.replica import Rebalancer
from foretoken.adapters.kafka.transport import FAUST_FETCH, BatchedFetchTransport
from foretoken.adapters.processes import port_taken
from foretoken.settings import Settings
from foretoken.wire.codec import encode
from foretoken.wire.partitioning import model_partition
from foretoken.wire.records import DeadLetter, Record

log = logging.getLogger(__name__)


class ProcessorApp(faust.App):
    """Faust's app with one hook: ``rebalancer`` runs first at every partition assignment,
    before Faust seeks the partitions to their committed offsets (a route replica commits
    where they must start there: :mod:`.replica`)."""

    rebalancer: Rebalancer | None = None
    fetch_options = FAUST_FETCH  # create_app sets the settings'

    def _new_transport(self) -> Any:
        return BatchedFetchTransport(self.conf.broker_consumer, self)

    async def _on_partitions_assigned(self, assigned: Any, generation_id: int = 0) -> None:
        if self.rebalancer is not None and not self.should_stop:
            try:
                await self.rebalancer.on_assigned(self.consumer, set(assigned))
            except Exception:  # the assignment goes on; readiness shows the lag
                log.exception("the rebalance hook failed")
        await super()._on_partitions_assigned(assigned, generation_id)


def create_app(
    settings: Settings, index: IndexKeeper | None = None
) -> tuple[faust.App, ProcessorState]:
    state = ProcessorState(settings, index)
    app = ProcessorApp(
        settings.group_id,
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
        # Faust's own debug pages: no foretoken state is in Faust tables, and /router/ and
        # /table/ answered any caller (a 500 with a traceback for /router/x/)
        web_router_enabled=False,
        web_tables_enabled=False,
        web_graph_enabled=False,
        # On stop, commit what is acked and no more: the acks held for the grading join
        # and the lake sink (join_acks.py, lake_sink.py) are simply read again next time.
        stream_wait_empty=False,
        # Faust's own default is 1,000,000: a record the topics take was refused here
        producer_max_request_size=settings.kafka.max_request_bytes,
    )
    app.rebalancer = Rebalancer(state)
    app.fetch_options = (settings.kafka.fetch_min_bytes, settings.kafka.fetch_max_wait_ms)
    outputs = {
        logical: app.topic(settings.topic(logical), key_serializer="raw", value_serializer="raw")
        for logical in ("dead_letter", "graded", "controls", "members")
    }
    for logical in INPUT_TOPICS:
        _add_consumer(app, state, logical, outputs)
    add_pages(app, state)
    if state.grading:
        _add_snapshots(app, state)
    _add_join_expiry(app, state, outputs)
    _add_controls(app, state, outputs)
    _add_membership(app, state, outputs)
    _add_heap_freeze(app, state)
    return app, state


def _add_heap_freeze(app: faust.App, state: ProcessorState) -> None:
    """Once the agents, consumers and pages are up, what they hold leaves the collector's
    full passes (foretoken.adapters.heap)."""

    @app.task
    async def freeze_heap() -> None:
        after = state.settings.worker.freeze_heap_after_s
        if after >= 0:
            await asyncio.sleep(after)
            freeze_startup_heap()


def _add_membership(app: faust.App, state: ProcessorState, outputs: dict[str, Any]) -> None:
    """The members record (every interval), the members view, the lag measurement."""

    @app.timer(interval=state.settings.worker.member_interval_s)
    async def advertise() -> None:
        member = state.member()
        await outputs["members"].send(key=record_key("members", member),
                                      value=encode(member, state.settings.wire_format))  # fmt: skip
        state.refresh_share()

    @app.task
    async def measure_lag() -> None:
        await refresh_lag(state.settings, state.lag)

    @app.task
    async def follow() -> None:
        await follow_members(state.settings, state.members, state.refresh_share)


def _add_controls(app: faust.App, state: ProcessorState, outputs: dict[str, Any]) -> None:
    @app.timer(interval=state.settings.controls.evaluate_every_s)
    async def evaluate_controls() -> None:
        try:
            events = state.control_events()
        except Exception:  # a timer that raises crashes the whole Faust app
            log.exception("the latency controls' evaluation failed")
            return
        if not state.grading:  # a replica's controls act on its decisions; the primary tells
            return
        for event in events:
            log.warning(
                "controls: %s on %s %s -> %s (%s)", event.workload_class, event.worker_id,
                event.from_stage, event.to_stage, event.reason,
            )  # fmt: skip
            await _emit(outputs, "controls", event, state.settings.wire_format)


def _add_join_expiry(app: faust.App, state: ProcessorState, outputs: dict[str, Any]) -> None:
    @app.timer(interval=state.settings.join.expiry_interval_s)
    async def expire_join() -> None:
        try:
            expired = state.expire()
        except Exception:  # a timer that raises crashes the whole Faust app
            log.exception("the join's expiry failed")
            expired = []
        for graded in expired:
            await _emit(outputs, "graded", graded, state.settings.wire_format,
                        _sharded_partitions(state))  # fmt: skip
        await state.held_acks.release_settled()


def _add_snapshots(app: faust.App, state: ProcessorState) -> None:
    @app.timer(interval=state.settings.worker.snapshot_interval_s)
    async def snapshot_index() -> None:
        loop = asyncio.get_running_loop()
        # small: sample windows of a few hundred points per worker
        data = fits_bytes(state.settings, state.fits, state.outputs)
        try:
            await loop.run_in_executor(None, write_atomically, fits_path(state.settings), data)
        except OSError as exc:
            log.warning("could not save the fits: %s", exc)
        await loop.run_in_executor(None, state.index.save)

    @app.on_before_shutdown.connect  # type: ignore[arg-type]
    def snapshot_on_shutdown(app: faust.App, **kwargs: Any) -> None:
        save_fits(state.settings, state.fits, state.outputs)
        state.index.save()


async def _emit(outputs: dict[str, Any], logical: str, record: Record, wire_format: Any,
                partitions: int | None = None) -> None:  # fmt: skip
    """Send ``record``; with ``partitions`` (sharded by model), to its model's partition."""
    model = getattr(record, "model", None)
    partition = model_partition(model, partitions) if partitions and model else None
    await outputs[logical].send(key=record_key(logical, record), partition=partition,
                                value=encode(record, wire_format))  # fmt: skip


def _add_consumer(
    app: faust.App, state: ProcessorState, logical: str, outputs: dict[str, Any]
) -> None:
    name = state.settings.topic(logical)
    dispatch, after = _event_handlers(state, logical, outputs)
    if logical == "graded" and state.lake is not None:  # the sink consumes it, in batches
        add_lake_sink(app, state.lake, name, dispatch, after, _dead_letter_of(state, outputs))
        return
    topic = app.topic(name, key_serializer="raw", value_serializer="raw")
    # Held for the join; a replica runs none (it re-reads from a time horizon instead).
    held = state.held_acks if logical in ("grants", "outcomes") and state.grading else None

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
    partitions = _sharded_partitions(state)

    def dispatch(event: Any) -> Consumed:
        message = event.message
        state.lag.consumed(name, message.partition, message.offset)
        return state.dispatcher.consume(
            logical, name, message.key, event.value, message.partition, message.offset
        )

    async def after(event: Any, result: Consumed) -> None:
        dl = result.dead_letter
        for out_logical, out in result.emit:
            try:
                await _emit(outputs, out_logical, out, wire_format, partitions)
            except Exception as exc:  # e.g. a record too big for the topic: say so, go on
                reason = f"could not emit {out_logical}: {type(exc).__name__}: {exc}"
                dl = dl or _letter_of(name, event, reason)
        if dl is None:
            state.metrics.consumed.labels(logical).inc()
            return
        state.metrics.dead_lettered.labels(logical, reason_kind(dl.reason)).inc()
        if not state.grading:  # the primary dead-letters it; a replica only counts it
            return
        log.warning("dead-letter from %s@%s: %s", name, event.message.offset, dl.reason[:500])
        await _send_dead_letter(state, outputs, name, dl)

    return dispatch, after


def _letter_of(source: str, event: Any, reason: str) -> DeadLetter:
    message = event.message
    return DeadLetter(source=source, reason=reason, ts=time.time(), partition=message.partition,
                      offset=message.offset, key=message.key,
                      payload=event.value or b"")  # fmt: skip


async def _send_dead_letter(state: ProcessorState, outputs: dict[str, Any], source: str,
                            letter: DeadLetter) -> None:  # fmt: skip
    """Send ``letter`` cut to fit a record (its payload's first bytes and its size: a dead
    letter with a whole oversized record was refused, and the agent sending it died); a
    send that still fails is logged and counted, never raised into the agent."""
    settings = state.settings
    limit = min(settings.kafka.max_request_bytes, settings.ingest.max_record_bytes)
    value = fitted_dead_letter(letter, limit, settings.wire_format)
    try:
        if value is None:
            raise ValueError("not even an empty dead letter fits kafka.max_request_bytes")
        await outputs["dead_letter"].send(key=source.encode(), value=value)
    except Exception as exc:
        state.dead_letter_failures += 1
        log.error("could not dead-letter a record of %s@%s (%s: %s): %s", source,
                  letter.offset, type(exc).__name__, exc, letter.reason[:500])  # fmt: skip


def _sharded_partitions(state: ProcessorState) -> int | None:
    return state.settings.layout.partitions if state.sharded else None


def _dead_letter_of(state: ProcessorState, outputs: dict[str, Any]) -> Any:
    """Dead-letters a record of ``graded`` that the lake writer refused, with the reason."""

    async def dead_letter(event: Any, reason: str) -> None:
        name = state.settings.topic("graded")
        state.metrics.dead_lettered.labels("graded", reason_kind(reason)).inc()
        log.warning("dead-letter from %s@%s: %s", name, event.message.offset, reason[:500])
        await _send_dead_letter(state, outputs, name, _letter_of(name, event, reason))

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
    taken = port_taken(settings.worker.web_host, settings.worker.web_port)
    if taken is not None:
        print(f"error: the processor {taken} (worker.web_port, FORETOKEN_WEB_PORT)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(1)
    settings.worker_data_path.mkdir(parents=True, exist_ok=True)
    try:
        if settings.worker.create_topics:
            asyncio.run(ensure_topics(settings, settings.kafka.startup_timeout_s))
        topics = (*INPUT_TOPICS, "dead_letter", "controls", "members")
        partitions = asyncio.run(wait_for_topics(settings, topics, service="the processor"))
        _check_sharding(settings, partitions)
        keeper = None
        if settings.worker.role == "primary":
            keeper = IndexKeeper.load(
                settings.topic("kv_events"), snapshot_path(settings), settings.index
            )
            group = settings.group_id
            # Rebuild in-memory state: every registration, the KV batches the snapshot lacks.
            for logical, offsets in (("workers", None), ("kv_events", keeper.next_offsets())):
                name = settings.topic(logical)
                asyncio.run(rewind_group(settings, group, name, partitions[name], offsets))
        # a route replica loads the snapshot and sets its offsets at each assignment
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    if settings.worker.event_loop == "uvloop":
        import mode.loop

        mode.loop.use("uvloop")  # before Faust makes its loop (and its consumer thread's)
    app, state = create_app(settings, keeper)
    if load_fits(settings, state.fits, state.outputs):
        log.info("restored the fits from %s", fits_path(settings))
    faust_worker(app, settings.worker.log_level).execute_from_commandline()


def faust_worker(app: faust.App, log_level: str) -> faust.Worker:
    """The Faust worker that runs ``app``, logging at ``log_level`` and no lower.

    Faust's terminal spinner sets the root logger to DEBUG (its handler shows every record),
    so every library's debug call builds a record: 10% of a busy route replica's CPU went to
    aiokafka's fetcher's debug lines (py-spy, the replicas bench). Without the spinner the
    level is the one configured."""
    worker = faust.Worker(app, loglevel=log_level)
    worker.spinner = None
    return worker


def _check_sharding(settings: Settings, partitions: dict[str, set[int]]) -> None:
    """Sharded by model, every input topic must have the configured partition count (the
    producers place records by it; Faust co-partitions only topics of one count)."""
    from foretoken.adapters.kafka.readiness import StartupError

    if settings.sharding != "model":
        return
    members = settings.topic("members")
    wrong = {t: len(p) for t, p in partitions.items()
             if len(p) != settings.layout.partitions and t != members}  # fmt: skip
    if wrong:
        raise StartupError(
            f"sharding = model needs {settings.layout.partitions} partitions (layout.partitions) "
            f"on every input topic; found {wrong}", list(wrong),
        )  # fmt: skip
