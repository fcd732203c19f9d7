"""What ingest knows about each engine's listener, and the HTTP page that shows it.

One :class:`EngineHealth` per engine is the single record of its state: the listener's
supervisor, the feed (sequencing, repair) and the emitter (records produced or lost) write
it; ``/healthz`` (JSON: every engine, 503 when a listener is not listening) and
``/metrics`` (Prometheus, rendered from the same objects at scrape time) read it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)
PROMETHEUS_CONTENT_TYPE = "text/plain"

# Counter fields of EngineHealth → (metric name without _total, help).
COUNTERS: dict[str, tuple[str, str]] = {
    "messages": ("foretoken_ingest_messages", "Messages received from the engine's PUB socket."),
    "batches": ("foretoken_ingest_batches", "Engine batches produced to kv-events."),
    "events": ("foretoken_ingest_events", "KV events produced."),
    "records": ("foretoken_ingest_records", "kv-events records produced (a split batch: several)."),
    "split_batches": ("foretoken_ingest_split_batches", "Batches split across several records."),
    "gaps": ("foretoken_ingest_gaps", "Sequence gaps detected."),
    "backfilled": ("foretoken_ingest_backfilled", "Batches recovered through the replay socket."),
    "resets": ("foretoken_ingest_resets", "Index resets sent (gap not closed, restart, or a run "
               "of undecodable batches)."),
    "engine_restarts": ("foretoken_ingest_engine_restarts", "Engine restarts (seq went back)."),
    "listener_restarts": ("foretoken_ingest_listener_restarts",
                          "Listeners that died and were restarted by the supervisor."),
    "duplicates": ("foretoken_ingest_duplicates", "Backfilled batches dropped as seen."),
    "undecodable": ("foretoken_ingest_undecodable", "Engine messages that could not be decoded."),
    "skipped": ("foretoken_ingest_skipped", "Undecodable batches at the expected seq, taken as "
                "lost (no gap, no reset)."),
    "dead_letters": ("foretoken_ingest_dead_letter", "Records sent to dead-letter."),
    "produce_failures": ("foretoken_ingest_produce_failures",
                         "Records Kafka refused or did not acknowledge."),
    "dropped_events": ("foretoken_ingest_dropped_events",
                       "Events too big for any record (one block above the limit)."),
    "bad_events": ("foretoken_ingest_bad_events", "Malformed events dead-lettered from batches "
                   "whose other events went out."),
    "unknown_tags": ("foretoken_ingest_unknown_tags", "Events of unknown tags."),
    "unknown_media": ("foretoken_ingest_unknown_media", "Events on a medium we cannot map."),
    "other_components": ("foretoken_ingest_other_components", "SGLang events of a cache "
                         "component other than full attention (Mamba, sliding window)."),
    "disconnects": ("foretoken_ingest_disconnects", "ZMQ disconnects of the SUB socket (an "
                    "oversized message drops the connection too)."),
    "resubscribes": ("foretoken_ingest_resubscribes", "New SUB sockets after a connection ZMQ "
                     "would not reconnect (a protocol error: an oversized message)."),
}  # fmt: skip


@dataclass
class EngineHealth:
    """One engine's listener: is it listening, when did its last batch go out, and counts."""

    worker_id: str
    listening: bool = False
    connected: bool = False
    started_s: float = field(default_factory=time.monotonic)
    last_batch_s: float | None = None  # monotonic
    last_batch_ts: float | None = None  # wall clock, for people
    expected_seq: int | None = None
    last_error: str | None = None
    block_size_mismatch: bool = False
    messages: int = 0
    batches: int = 0
    events: int = 0
    records: int = 0
    split_batches: int = 0
    gaps: int = 0
    backfilled: int = 0
    resets: int = 0
    engine_restarts: int = 0
    listener_restarts: int = 0
    duplicates: int = 0
    undecodable: int = 0
    skipped: int = 0
    dead_letters: int = 0
    produce_failures: int = 0
    dropped_events: int = 0
    bad_events: int = 0
    unknown_tags: int = 0
    unknown_media: int = 0
    other_components: int = 0
    disconnects: int = 0
    resubscribes: int = 0
    # since when a record of this engine waits for the producer to take it (monotonic; a
    # broker that is down holds a send up to the client's request timeout, and the
    # listener with it)
    send_waiting_since: float | None = None

    def batch_out(self, events: int) -> None:
        self.batches += 1
        self.events += events
        self.last_batch_s = time.monotonic()
        self.last_batch_ts = time.time()

    def last_batch_age_s(self, now_s: float | None = None) -> float | None:
        if self.last_batch_s is None:
            return None
        return (time.monotonic() if now_s is None else now_s) - self.last_batch_s

    def send_wait_s(self, now_s: float | None = None) -> float:
        """How long the record being sent has waited for the producer (0: none waits)."""
        since = self.send_waiting_since
        return 0.0 if since is None else (time.monotonic() if now_s is None else now_s) - since

    def describe(self) -> dict[str, object]:
        out = asdict(self)
        out.pop("started_s")
        out.pop("last_batch_s")
        out.pop("send_waiting_since")
        out["kafka_send_wait_s"] = round(self.send_wait_s(), 3)
        age = self.last_batch_age_s()
        out["last_batch_age_s"] = None if age is None else round(age, 3)
        out["uptime_s"] = round(time.monotonic() - self.started_s, 3)
        return out


class IngestHealth:
    """Every engine's :class:`EngineHealth`, as ``/healthz`` and Prometheus metrics."""

    def __init__(self, worker_ids: list[str]) -> None:
        self.engines = {w: EngineHealth(w) for w in worker_ids}
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self.registration_failures = 0

    def __getitem__(self, worker_id: str) -> EngineHealth:
        return self.engines[worker_id]

    def healthy(self) -> bool:
        return all(e.listening for e in self.engines.values())

    def describe(self) -> dict[str, object]:
        return {
            "status": "ok" if self.healthy() else "degraded",
            "listening": sum(e.listening for e in self.engines.values()),
            "engines": {w: e.describe() for w, e in sorted(self.engines.items())},
            "registration_failures": self.registration_failures,
        }

    def metrics(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    def __init__(self, health: IngestHealth) -> None:
        self.health = health

    def collect(self) -> Iterator[Metric]:
        engines = sorted(self.health.engines.items())
        for attr, (name, doc) in COUNTERS.items():
            counter = CounterMetricFamily(name, doc, labels=["worker"])
            for worker, e in engines:
                counter.add_metric([worker], getattr(e, attr))
            yield counter
        listening = GaugeMetricFamily(
            "foretoken_ingest_listening", "1 while the engine's listener runs.", labels=["worker"]
        )
        connected = GaugeMetricFamily(
            "foretoken_ingest_connected", "1 while the SUB socket is connected.", labels=["worker"]
        )
        age = GaugeMetricFamily(
            "foretoken_ingest_last_batch_age_seconds",
            "Seconds since the engine's last batch was produced (absent before the first).",
            labels=["worker"],
        )
        waiting = GaugeMetricFamily(
            "foretoken_ingest_kafka_send_wait_seconds",
            "Seconds the record being sent has waited for the Kafka producer (0: none).",
            labels=["worker"],
        )
        for worker, e in engines:
            listening.add_metric([worker], float(e.listening))
            connected.add_metric([worker], float(e.connected))
            waiting.add_metric([worker], e.send_wait_s())
            seconds = e.last_batch_age_s()
            if seconds is not None:
                age.add_metric([worker], seconds)
        yield from (listening, connected, age, waiting)


def health_app(health: IngestHealth) -> web.Application:
    async def healthz(request: web.Request) -> web.Response:
        status = 200 if health.healthy() else 503
        return web.json_response(health.describe(), status=status)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=health.metrics(), content_type=PROMETHEUS_CONTENT_TYPE)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


async def serve_health(health: IngestHealth, host: str, port: int) -> web.AppRunner:
    """Start the page on ``host:port``; the caller cleans the runner up."""
    runner = web.AppRunner(health_app(health), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("ingest health page on http://%s:%s/healthz", host, port)
    return runner
