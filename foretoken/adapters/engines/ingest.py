"""``foretoken ingest``: engines' ZMQ KV-event publishers → normalized batches on ``kv-events``.

Per engine: a SUB socket on its publisher, the decoder of ``foretoken.adapters.engines.decoders``
and a
``SeqTracker``. A gap (or a first contact after seq 0) is repaired through the engine's
replay ROUTER socket; if replay cannot close it, an ``IndexReset`` batch tells the index to
forget that worker, and ingest carries on from the batch in hand. An engine restart (seq
back to 0) is a reset too. Undecodable messages go to ``dead-letter`` with the reason.
Every engine is registered on ``workers`` when ingest starts.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, start_http_server

from foretoken.adapters.engines.decoders import (
    DecodedBatch,
    backfill_request_frames,
    decode_engine_frames,
    decode_engine_payload,
    split_backfill_reply,
)
from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.adapters.engines.sequence import SeqTracker
from foretoken.adapters.kafka.producer import RecordProducer
from foretoken.adapters.kafka.readiness import StartupError, wait_for_topics
from foretoken.core.types import ModelName, WorkerId
from foretoken.settings import Settings
from foretoken.wire.codec import DecodeError
from foretoken.wire.records import DeadLetter, IndexReset, KvEventBatch

log = logging.getLogger(__name__)

BACKFILL_TIMEOUT_S = 2.0
# What ingest writes: registrations, KV batches, undecodable frames.
INGEST_TOPICS = ("workers", "kv_events", "dead_letter")
METRICS_TIMEOUT_S = 2.0
BLOCK_SIZE_RE = re.compile(r'cache_config_info\{[^}]*block_size="(\d+)"')


class IngestMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["worker"]

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, labels + (extra or []), registry=self.registry)

        self.batches = counter("foretoken_ingest_batches", "Engine batches produced to kv-events.")
        self.events = counter("foretoken_ingest_events", "KV events produced.")
        self.dead = counter("foretoken_ingest_dead_letter", "Undecodable engine messages.")
        self.gaps = counter("foretoken_ingest_gaps", "Sequence gaps detected.")
        self.restarts = counter("foretoken_ingest_restarts", "Engine restarts (seq back to 0).")
        self.backfilled = counter(
            "foretoken_ingest_backfilled",
            "Batches recovered through the engine's replay socket (backfill).",
        )
        self.resets = counter("foretoken_ingest_resets", "Index resets sent (gap not closed).")
        self.duplicates = counter("foretoken_ingest_duplicates", "Batches dropped as seen.")
        self.unknown = counter("foretoken_ingest_unknown_tags", "Events of unknown tags.")
        self.unknown_media = counter(
            "foretoken_ingest_unknown_media", "Events on a medium (tier) name we cannot map."
        )
        self.block_size_mismatch = counter(
            "foretoken_ingest_block_size_mismatch", "Configured block size != engine's."
        )


Emit = Callable[[KvEventBatch], Awaitable[None]]
Backfill = Callable[[int], Awaitable[list[tuple[int, bytes]]]]


@dataclass
class EngineFeed:
    """Sequencing and repair for one engine; I/O comes in as callables."""

    engine: EngineConfig
    tracker: SeqTracker
    emit: Emit
    backfill: Backfill
    metrics: IngestMetrics

    @property
    def worker(self) -> WorkerId:
        return WorkerId(self.engine.worker_id)

    def decode_payload(self, seq: int, payload: bytes) -> DecodedBatch:
        return decode_engine_payload(
            payload,
            engine="sglang" if self.engine.engine == "sglang" else "vllm",
            seq=seq,
            worker_id=self.worker,
            model=ModelName(self.engine.model),
            default_block_size=self.engine.block_size,
        )

    async def on_batch(self, decoded: DecodedBatch) -> None:
        decision = self.tracker.observe(self.worker, decoded.seq)
        if decision.verdict == "duplicate":
            self.metrics.duplicates.labels(self.worker).inc()
            return
        if decision.reset_index:
            self.metrics.restarts.labels(self.worker).inc()
            await self._reset("engine restarted (sequence went back)", decoded)
        if decision.missing is not None:
            self.metrics.gaps.labels(self.worker).inc()
            await self._repair(decision.missing[0], decoded)
            return
        await self._emit(decoded)

    async def _repair(self, start: int, decoded: DecodedBatch) -> None:
        for seq, payload in await self.backfill(start):
            if seq > decoded.seq:
                break
            try:
                backfilled = self.decode_payload(seq, payload)
            except DecodeError as exc:
                log.warning("backfilled batch %s of %s undecodable: %s", seq, self.worker, exc)
                break
            if self.tracker.observe(self.worker, seq).apply:
                self.metrics.backfilled.labels(self.worker).inc()
                await self._emit(backfilled)
        after = self.tracker.observe(self.worker, decoded.seq)
        if after.verdict == "duplicate":  # the backfill delivered this batch too
            return
        if after.apply:
            await self._emit(decoded)
            return
        # The backfill could not close the gap: the index can no longer trust this worker's state.
        self.tracker.force(self.worker, decoded.seq)
        await self._reset(f"gap before seq {decoded.seq} not repaired by backfill", decoded)
        await self._emit(decoded)

    async def _reset(self, reason: str, decoded: DecodedBatch) -> None:
        self.metrics.resets.labels(self.worker).inc()
        marker = KvEventBatch(
            worker_id=self.worker,
            model=ModelName(self.engine.model),
            seq=decoded.seq,
            ts=time.time(),
            events=(IndexReset(reason=reason),),
        )
        await self.emit(marker)

    async def _emit(self, decoded: DecodedBatch) -> None:
        self.metrics.batches.labels(self.worker).inc()
        self.metrics.events.labels(self.worker).inc(len(decoded.batch.events))
        if decoded.unknown_tags:
            self.metrics.unknown.labels(self.worker).inc(sum(decoded.unknown_tags.values()))
        if decoded.unknown_media:
            self.metrics.unknown_media.labels(self.worker).inc(sum(decoded.unknown_media.values()))
        await self.emit(decoded.batch)


async def zmq_backfill(
    ctx: zmq.asyncio.Context, url: str | None, start: int
) -> list[tuple[int, bytes]]:
    """Ask an engine's replay ROUTER for every batch from ``start``; [] if it cannot answer."""
    if url is None:
        return []
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    out: list[tuple[int, bytes]] = []
    try:
        await sock.send_multipart(backfill_request_frames(start))
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), BACKFILL_TIMEOUT_S)
            reply = split_backfill_reply(frames)
            if reply is None:
                return out
            _topic, seq, payload = reply
            out.append((seq, payload))
    except (TimeoutError, DecodeError, zmq.ZMQError) as exc:
        log.warning("backfill from %s at seq %s failed: %s", url, start, exc)
        return out
    finally:
        sock.close()


def engine_block_size(metrics_url: str) -> int | None:
    """The block size an engine reports in vLLM's ``cache_config_info`` metric, if any."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=METRICS_TIMEOUT_S) as resp:
            text = resp.read().decode(errors="replace")
    except OSError:
        return None
    match = BLOCK_SIZE_RE.search(text)
    return int(match.group(1)) if match else None


class Ingest:
    def __init__(self, settings: Settings, engines: list[EngineConfig]) -> None:
        self.settings = settings
        self.engines = [e for e in engines if e.kv_events_url and e.kv_events]
        self.all_engines = engines
        self.metrics = IngestMetrics()
        self.tracker = SeqTracker()
        self.ctx = zmq.asyncio.Context()
        self.ready = asyncio.Event()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        await wait_for_topics(self.settings, INGEST_TOPICS, service="ingest")
        async with RecordProducer(self.settings) as producer:
            for engine in self.all_engines:
                self._check_block_size(engine)
                await producer.send("workers", engine.registration())
            await producer.flush()
            tasks = [asyncio.create_task(self._listen(e, producer)) for e in self.engines]
            self.ready.set()
            try:
                await stop.wait()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await producer.flush()
        self.ctx.term()

    def _check_block_size(self, engine: EngineConfig) -> None:
        if engine.metrics_url is None:
            return
        reported = engine_block_size(engine.metrics_url)
        if reported is not None and reported != engine.block_size:
            self.metrics.block_size_mismatch.labels(engine.worker_id).inc()
            log.error(
                "%s: engines file says block_size %s, the engine reports %s; fix the file",
                engine.worker_id, engine.block_size, reported,
            )  # fmt: skip

    async def _listen(self, engine: EngineConfig, producer: RecordProducer) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, engine.kv_topic.encode())
        assert engine.kv_events_url is not None
        sub.connect(engine.kv_events_url)

        async def emit(batch: KvEventBatch) -> None:
            await producer.send("kv_events", batch)

        async def backfill(start: int) -> list[tuple[int, bytes]]:
            return await zmq_backfill(self.ctx, engine.replay_url, start)

        feed = EngineFeed(engine, self.tracker, emit, backfill, self.metrics)
        source = f"zmq:{engine.worker_id}"
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    decoded = decode_engine_frames(
                        frames,
                        engine="sglang" if engine.engine == "sglang" else "vllm",
                        worker_id=WorkerId(engine.worker_id),
                        model=ModelName(engine.model),
                        default_block_size=engine.block_size,
                    )
                except DecodeError as exc:
                    self.metrics.dead.labels(engine.worker_id).inc()
                    letter = DeadLetter(
                        source=source, reason=exc.reason, ts=time.time(), payload=b"".join(frames)
                    )
                    await producer.send("dead_letter", letter)
                    continue
                await feed.on_batch(decoded)
        finally:
            sub.close()


def run_ingest(settings: Settings, engines: list[EngineConfig], metrics_port: int | None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    ingest = Ingest(settings, engines)
    if metrics_port:
        start_http_server(metrics_port, addr="127.0.0.1", registry=ingest.metrics.registry)
    try:
        asyncio.run(ingest.run())
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
