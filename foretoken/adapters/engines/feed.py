"""One engine's stream of KV-event messages → the batches ingest writes (sequencing, gap
repair, restarts, resets, undecodable messages). I/O comes in as callables (:class:`FeedIO`),
so this is tested with real sockets or without any.

**Gaps.** A gap is repaired through the engine's replay socket; if the replay cannot close
it, an ``IndexReset`` (approximate) tells the index to forget the worker, and the feed goes on
from the batch in hand.

**Restarts.** A live seq that goes back is a new engine process (a PUB socket never repeats
a message). Its batches from seq 0 up to the one in hand are fetched from the new process's
replay when the seq-0 batch was lost; then one ``IndexReset`` is sent — *exact*
(``approximate=False``: a new process starts with an empty cache, so an index that forgets
the worker and applies the new stream from seq 0 is right) when that stream is complete and
readable, approximate otherwise — followed by the new stream's batches. The old code dropped
every batch below the old seq as a duplicate when seq 0 was lost, and flagged a restarted
worker approximate for good.

**Undecodable messages** (the policy; docs/ARCHITECTURE.md "Edges that hold" has the
trade-off). Each
goes to ``dead-letter`` with the reason. What it means for the stream depends on what can
be trusted of it: a message whose seq frame is readable *and is exactly the next expected
seq* is taken as that batch, lost: the stream moves past it (no gap, no repair — the replay
would return the same bytes — and no reset). Any other undecodable message is *seq unknown*:
nothing about the stream is learnt from it (a garbage seq must not make a gap, a restart or
later batches look like duplicates). A lost batch can under-credit (its stores) or
over-credit (its removals) a few blocks; a reset forgets every block of the worker. Only a
run of more than ``max_undecodable_run`` unreadable batches in a row — an engine whose
format we cannot read at all — resets the worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from foretoken.adapters.engines.decoders import DecodedBatch, frame_seq, topic_epoch
from foretoken.adapters.engines.health import EngineHealth
from foretoken.adapters.engines.sequence import SeqDecision, SeqTracker
from foretoken.core.types import MAX_SEQ, ModelName, WorkerId
from foretoken.wire.codec import DecodeError
from foretoken.wire.records import IndexReset, KvEventBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FeedIO:
    """What the feed does to the world: decode (perhaps off the loop), produce, backfill,
    dead-letter. Each raises nothing but :class:`DecodeError` from the decoders."""

    decode_frames: Callable[[Sequence[bytes]], Awaitable[DecodedBatch]]
    decode_payload: Callable[[int, bytes], Awaitable[DecodedBatch]]
    emit: Callable[[KvEventBatch], Awaitable[bool]]
    backfill: Callable[[int], Awaitable[list[tuple[int, bytes]]]]
    dead_letter: Callable[[str, bytes], Awaitable[None]]


class EngineFeed:
    def __init__(
        self,
        worker_id: WorkerId,
        model: ModelName,
        tracker: SeqTracker,
        io: FeedIO,
        health: EngineHealth,
        max_undecodable_run: int,
    ) -> None:
        self.worker, self.model = worker_id, model
        self.tracker, self.io, self.health = tracker, io, health
        self.max_undecodable_run = max_undecodable_run
        self.undecodable_run = 0
        self.epoch: bytes | None = None  # the publisher's lifecycle token, when its topic has one

    # ------------------------------------------------------------------ input

    async def on_message(self, frames: Sequence[bytes]) -> None:
        """One message from the engine's PUB socket."""
        try:
            decoded = await self.io.decode_frames(frames)
        except DecodeError as exc:
            await self._unreadable(frame_seq(frames), exc.reason, b"".join(frames))
            return
        except Exception as exc:  # a decoder bug must not end the listener: log it loudly
            log.exception("%s: decoder failed on a message", self.worker)
            reason = f"decoder error {type(exc).__name__}: {exc}"
            await self._unreadable(frame_seq(frames), reason, b"".join(frames))
            return
        await self.on_batch(decoded)

    async def on_batch(self, decoded: DecodedBatch) -> None:
        epoch = topic_epoch(decoded.topic)
        if epoch is not None and self.epoch not in (None, epoch):
            # a new publisher (SGLang's epoch): a restart even when its seq is not below ours
            decision = self.tracker.restarted(self.worker, decoded.seq)
        else:
            decision = self.tracker.observe(self.worker, decoded.seq)
        if epoch is not None:
            self.epoch = epoch
        self.health.expected_seq = self.tracker.expected(self.worker)
        if decision.verdict == "restart":
            self.health.engine_restarts += 1
            log.warning("%s restarted (seq %s after %s)", self.worker, decoded.seq,
                        decision.expected)  # fmt: skip
        elif decision.verdict == "gap":
            self.health.gaps += 1
        if decision.missing is None:
            if decision.reset_index:
                await self._reset("engine restarted (sequence went back to 0)", decoded.seq,
                                  approximate=False)  # fmt: skip
            await self._emit(decoded)
            return
        await self._repair(decision, decoded)

    # ------------------------------------------------------------------ repair

    async def _repair(self, decision: SeqDecision, decoded: DecodedBatch) -> None:
        assert decision.missing is not None
        start = decision.missing[0]
        got: list[DecodedBatch] = []
        unreadable = 0
        for seq, payload in await self.io.backfill(start):
            if seq >= decoded.seq:
                break  # the batch in hand (or later ones, which the PUB socket brings)
            verdict = self.tracker.observe_replayed(self.worker, seq)
            if verdict.verdict == "duplicate":
                self.health.duplicates += 1
                continue
            if not verdict.apply:
                break  # the replay's answer has a hole
            try:
                got.append(await self.io.decode_payload(seq, payload))
            except DecodeError as exc:
                unreadable += 1
                await self._unreadable(seq, f"backfilled seq {seq}: {exc.reason}", payload,
                                       replayed=True)  # fmt: skip
        closed = self.tracker.expected(self.worker) == decoded.seq
        if decision.reset_index:
            exact = closed and not unreadable
            await self._reset("engine restarted (its first batches came through replay)"
                              if exact else "engine restarted; its new stream is incomplete",
                              decoded.seq, approximate=not exact)  # fmt: skip
        elif not closed:
            await self._reset(f"gap before seq {decoded.seq} not repaired by backfill",
                              decoded.seq, approximate=True)  # fmt: skip
        if closed:
            for batch in got:
                self.health.backfilled += 1
                await self._emit(batch)
            self.tracker.observe_replayed(self.worker, decoded.seq)
        else:
            self.tracker.force(self.worker, decoded.seq)
        self.health.expected_seq = self.tracker.expected(self.worker)
        await self._emit(decoded)

    # ------------------------------------------------------------------ output

    async def _unreadable(
        self, seq: int | None, reason: str, raw: bytes, *, replayed: bool = False
    ) -> None:
        """An undecodable message (module doc): dead-letter it; move past it only when its seq
        is exactly the next expected one (a replayed one: the replay's order says it is);
        reset after too many in a row."""
        self.health.undecodable += 1
        await self.io.dead_letter(reason, raw)
        if replayed or (seq is not None and self.tracker.skip(self.worker, seq)):
            self.health.skipped += 1
            self.health.expected_seq = self.tracker.expected(self.worker)
        # else seq unknown: nothing is learnt about the stream, but the message still counts
        # in the run (a restarted engine whose new format we cannot read sends seqs below
        # the expected one; after a gap, every later seq is above it)
        self.undecodable_run += 1
        if self.undecodable_run == self.max_undecodable_run + 1:
            at = seq if seq is not None and seq <= MAX_SEQ else self.tracker.expected(self.worker)
            await self._reset(f"{self.undecodable_run} undecodable batches in a row",
                              min(at or 0, MAX_SEQ), approximate=True)  # fmt: skip

    async def _reset(self, reason: str, seq: int, *, approximate: bool) -> None:
        self.health.resets += 1
        marker = KvEventBatch(
            worker_id=self.worker, model=self.model, seq=seq, ts=time.time(),
            events=(IndexReset(reason=reason, approximate=approximate),),
        )  # fmt: skip
        await self.io.emit(marker)

    async def _emit(self, decoded: DecodedBatch) -> None:
        self.undecodable_run = 0
        self.health.batch_out(len(decoded.batch.events))
        if decoded.unknown_tags:
            self.health.unknown_tags += sum(decoded.unknown_tags.values())
        if decoded.unknown_media:
            self.health.unknown_media += sum(decoded.unknown_media.values())
        self.health.other_components += decoded.other_components
        for bad in decoded.bad_events:  # the batch's other events still go out
            self.health.bad_events += 1
            await self.io.dead_letter(f"seq {decoded.seq} event {bad.index}: {bad.reason}",
                                      bad.raw)  # fmt: skip
        await self.io.emit(decoded.batch)
