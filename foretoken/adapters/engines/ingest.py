"""``foretoken ingest``: engines' ZMQ KV-event publishers → normalized batches on ``kv-events``.

Per engine: a SUB socket on its publisher (``ZMQ_MAXMSGSIZE`` = ``ingest.max_message_bytes``:
ZMQ drops a bigger message and the connection with it, so it never reaches memory; ZMQ does
not reconnect after that protocol error, so the listener opens a new socket; the resulting
gap is repaired or reset), the decoders of :mod:`foretoken.adapters.engines.decoders`, and
an ``EngineFeed`` (:mod:`foretoken.adapters.engines.feed`: sequencing, gap repair through
the engine's replay socket, restarts, resets, undecodable messages). Big messages are
decoded and encoded off the event loop, so one engine's huge batch never holds up the
others. What is produced, and what happens when Kafka refuses it,
is :mod:`foretoken.adapters.engines.emitter`. Each listener runs under a supervisor that
logs and restarts it (with backoff) if it ever dies; ``/healthz`` and ``/metrics``
(:mod:`foretoken.adapters.engines.health`, on ``ingest.host:ingest.port``) show every
engine's state. Every engine is registered on ``workers`` when ingest starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
import time
import urllib.request
from collections.abc import Sequence
from functools import partial

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from foretoken.adapters.engines.decoders import (
    DecodedBatch,
    Engine,
    backfill_request_frames,
    decode_engine_frames,
    decode_engine_payload,
    split_backfill_reply,
)
from foretoken.adapters.engines.emitter import KvEmitter
from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.adapters.engines.feed import EngineFeed, FeedIO
from foretoken.adapters.engines.health import EngineHealth, IngestHealth, serve_health
from foretoken.adapters.engines.sequence import SeqTracker
from foretoken.adapters.kafka.producer import RecordProducer
from foretoken.adapters.kafka.readiness import StartupError, wait_for_topics
from foretoken.core.types import ModelName, WorkerId
from foretoken.settings import IngestSettings, Settings
from foretoken.wire.codec import DecodeError

log = logging.getLogger(__name__)

# What ingest writes: registrations, KV batches, undecodable frames.
INGEST_TOPICS = ("workers", "kv_events", "dead_letter")
METRICS_TIMEOUT_S = 2.0
BLOCK_SIZE_RE = re.compile(r'cache_config_info\{[^}]*block_size="(\d+)"')
MONITORED = (
    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_CONNECT_DELAYED
)  # fmt: skip
POLL_MS = 500  # how often a quiet listener looks at its socket's state
DRAIN_BURST = 256  # messages taken at once before other listeners get a turn


def configure_socket(sock: zmq.asyncio.Socket, cfg: IngestSettings) -> None:
    """Limits every socket ingest reads engine messages from."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
    sock.setsockopt(zmq.RCVHWM, cfg.receive_hwm)


async def zmq_backfill(
    ctx: zmq.asyncio.Context, url: str | None, start: int, cfg: IngestSettings
) -> list[tuple[int, bytes]]:
    """Ask an engine's replay ROUTER for every batch from ``start``; what came, or [] if it
    cannot answer (each reply within ``cfg.backfill_timeout_s``)."""
    if url is None:
        return []
    out: list[tuple[int, bytes]] = []
    try:
        sock = ctx.socket(zmq.DEALER)
        configure_socket(sock, cfg)
        sock.connect(url)
    except zmq.ZMQError as exc:
        log.warning("backfill from %s impossible: %s", url, exc)
        return out
    try:
        await sock.send_multipart(backfill_request_frames(start))
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), cfg.backfill_timeout_s)
            reply = split_backfill_reply(frames)
            if reply is None:
                return out
            _topic, seq, payload = reply
            out.append((seq, payload))
    except (TimeoutError, DecodeError, zmq.ZMQError) as exc:
        log.warning("backfill from %s at seq %s ended: %s", url, start, exc)
        return out
    finally:
        sock.close()


def engine_block_size(metrics_url: str) -> int | None:
    """The block size an engine reports in vLLM's ``cache_config_info`` metric, if any."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=METRICS_TIMEOUT_S) as resp:
            text = resp.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    match = BLOCK_SIZE_RE.search(text)
    return int(match.group(1)) if match else None


class Ingest:
    def __init__(self, settings: Settings, engines: list[EngineConfig]) -> None:
        self.settings = settings
        self.engines = [e for e in engines if e.kv_events_url and e.kv_events]
        self.all_engines = engines
        self.health = IngestHealth([e.worker_id for e in self.engines])
        self.tracker = SeqTracker()
        self.ctx = zmq.asyncio.Context()
        self.ready = asyncio.Event()
        self.emitter: KvEmitter | None = None
        self.http_port: int | None = None  # the health page's port, once it listens
        self._unlistened: dict[str, EngineHealth] = {}
        self._sockets = 0  # SUB sockets opened (each monitor needs its own address)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        cfg = self.settings.ingest
        runner = await serve_health(self.health, cfg.host, cfg.port) if cfg.port else None
        if runner is not None:
            self.http_port = cfg.port
        try:
            await wait_for_topics(self.settings, INGEST_TOPICS, service="ingest")
            async with RecordProducer(self.settings) as producer:
                self.emitter = emitter = KvEmitter(producer, self.settings, self._health_of)
                await self._register(emitter)
                tasks = [asyncio.create_task(self._supervise(e, emitter)) for e in self.engines]
                self.ready.set()
                try:
                    await stop.wait()
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    with contextlib.suppress(Exception):
                        await producer.flush()
        finally:
            if runner is not None:
                await runner.cleanup()
            self.ctx.term()

    def _health_of(self, worker: str) -> EngineHealth:
        found = self.health.engines.get(worker)
        if found is None:  # an engine without KV events: registered, never listened to
            found = self._unlistened.setdefault(worker, EngineHealth(worker))
        return found

    async def _register(self, emitter: KvEmitter) -> None:
        for engine in self.all_engines:
            mismatch = await asyncio.to_thread(self._block_size_mismatch, engine)
            if mismatch and engine.worker_id in self.health.engines:
                self.health[engine.worker_id].block_size_mismatch = True
            if not await emitter.register("workers", engine.registration(), engine.worker_id):
                self.health.registration_failures += 1

    @staticmethod
    def _block_size_mismatch(engine: EngineConfig) -> bool:
        if engine.metrics_url is None:
            return False
        reported = engine_block_size(engine.metrics_url)
        if reported is None or reported == engine.block_size:
            return False
        log.error(
            "%s: engines file says block_size %s, the engine reports %s; fix the file",
            engine.worker_id, engine.block_size, reported,
        )  # fmt: skip
        return True

    # ------------------------------------------------------------------ listeners

    async def _supervise(self, engine: EngineConfig, emitter: KvEmitter) -> None:
        """Run the engine's listener; if it dies, log why and start it again (backoff)."""
        cfg = self.settings.ingest
        health = self.health[engine.worker_id]
        feed = self.feed(engine, emitter)
        backoff = cfg.restart_backoff_s
        while True:
            started = time.monotonic()
            try:
                await self._listen(engine, feed, health)
                continue  # its connection was gone for good: a new socket at once
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                health.listener_restarts += 1
                health.last_error = f"listener died: {type(exc).__name__}: {exc}"[:500]
                log.exception("the listener of %s died; restarting it in %.1f s",
                              engine.worker_id, backoff)  # fmt: skip
            if time.monotonic() - started > cfg.restart_backoff_max_s:
                backoff = cfg.restart_backoff_s  # it had been running fine
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, cfg.restart_backoff_max_s)

    def feed(self, engine: EngineConfig, emitter: KvEmitter) -> EngineFeed:
        """The engine's feed, with its I/O bound to this ingest's sockets and producer."""
        cfg = self.settings.ingest
        kind: Engine = "sglang" if engine.engine == "sglang" else "vllm"
        worker, model = WorkerId(engine.worker_id), ModelName(engine.model)
        frames_of = partial(decode_engine_frames, engine=kind, worker_id=worker, model=model,
                            default_block_size=engine.block_size)  # fmt: skip
        payload_of = partial(decode_engine_payload, engine=kind, worker_id=worker, model=model,
                             default_block_size=engine.block_size)  # fmt: skip

        async def decode_frames(frames: Sequence[bytes]) -> DecodedBatch:
            if sum(len(f) for f in frames) > cfg.offload_bytes:
                return await asyncio.to_thread(frames_of, frames)
            return frames_of(frames)

        async def decode_payload(seq: int, payload: bytes) -> DecodedBatch:
            if len(payload) > cfg.offload_bytes:
                return await asyncio.to_thread(payload_of, payload, seq=seq)
            return payload_of(payload, seq=seq)

        async def backfill(start: int) -> list[tuple[int, bytes]]:
            return await zmq_backfill(self.ctx, engine.replay_url, start, cfg)

        async def dead_letter(reason: str, raw: bytes) -> None:
            await emitter.dead_letter(f"zmq:{engine.worker_id}", reason, raw, engine.worker_id)

        io = FeedIO(decode_frames, decode_payload, emitter.batch, backfill, dead_letter)
        return EngineFeed(worker, model, self.tracker, io, self.health[engine.worker_id],
                          cfg.max_undecodable_run)  # fmt: skip

    async def _listen(self, engine: EngineConfig, feed: EngineFeed, health: EngineHealth) -> None:
        """Receive until the socket's connection is lost for good (then return: the supervisor
        opens a new socket at once); raises if anything else goes wrong."""
        sub = self.ctx.socket(zmq.SUB)
        dead = asyncio.Event()
        monitor: asyncio.Task[None] | None = None
        self._sockets += 1
        try:
            configure_socket(sub, self.settings.ingest)
            sub.setsockopt(zmq.SUBSCRIBE, engine.kv_topic.encode())
            address = f"inproc://ingest-monitor-{id(self)}-{self._sockets}"
            mon = sub.get_monitor_socket(MONITORED, addr=address)
            monitor = asyncio.create_task(self._monitor(mon, health, dead))
            assert engine.kv_events_url is not None
            sub.connect(engine.kv_events_url)
            health.listening = True
            drain: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)  # same socket, no futures
            while not dead.is_set():
                if await sub.poll(POLL_MS):
                    await self._drain(drain, feed, health)
                elif monitor.done() and not dead.is_set():
                    monitor.result()  # raises what ended it
                    raise RuntimeError("the socket monitor stopped")
            health.resubscribes += 1
            log.warning("%s: the SUB connection is gone for good (ZMQ drops a connection that "
                        "sent a message above ingest.max_message_bytes); opening a new one",
                        engine.worker_id)  # fmt: skip
        finally:
            health.listening = health.connected = False
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            if monitor is not None:
                monitor.cancel()
                with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                    await monitor
            sub.close()

    @staticmethod
    async def _drain(sock: zmq.Socket[bytes], feed: EngineFeed, health: EngineHealth) -> None:
        """Every message waiting on the socket, one after the other (at most a burst's worth
        before the event loop gets a turn)."""
        for _ in range(DRAIN_BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            health.messages += 1
            await feed.on_message(frames)
        await asyncio.sleep(0)

    async def _monitor(
        self, mon: zmq.asyncio.Socket, health: EngineHealth, dead: asyncio.Event
    ) -> None:
        """The SUB socket's connects and disconnects. ZMQ reconnects by itself after a
        network error, but not after a protocol error — an oversized message is one — so a
        disconnect that no reconnect attempt follows within ``ingest.reconnect_grace_s``
        sets ``dead``."""
        grace_s = self.settings.ingest.reconnect_grace_s
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        try:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    frames = await asyncio.wait_for(mon.recv_multipart(), timeout)
                except TimeoutError:
                    dead.set()
                    return
                event = parse_monitor_message(frames)["event"]
                if event == zmq.EVENT_CONNECTED:
                    health.connected, deadline = True, None
                elif event == zmq.EVENT_DISCONNECTED:
                    health.connected = False
                    health.disconnects += 1
                    deadline = loop.time() + grace_s
                else:  # a reconnect is under way
                    deadline = None
        finally:
            mon.close(0)


def run_ingest(settings: Settings, engines: list[EngineConfig]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    ingest = Ingest(settings, engines)
    try:
        asyncio.run(ingest.run())
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    except OSError as exc:  # the health page's port
        cfg = settings.ingest
        print(f"error: ingest cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
