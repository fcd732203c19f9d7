"""Pure codec for engine KV-event ZMQ messages (PRODUCT.md §3 "Engine event ingest").

Turns the multipart messages that vLLM and SGLang publish into :class:`KvEventBatch`
records, and tracks each publisher's sequence numbers. msgspec + stdlib only: no sockets.
Every fact below was read in the engines' public source (paths in their repositories):

Transport (vLLM ``vllm/distributed/kv_events.py`` ``ZmqEventPublisher``; SGLang
``python/sglang/srt/disaggregation/kv_events.py``, same design):
    PUB frames ``[topic, seq, payload]``; ``seq`` is ``seq.to_bytes(8, "big")`` from a
    counter that starts at 0 with the process; ``payload`` is the msgpack batch.
    Replay ROUTER: a client sends ``[b"", start_seq (8 bytes BE)]`` (the ROUTER sees
    ``[identity, b"", start_seq]``); every buffered batch with ``seq >= start_seq``
    (``buffer_steps``, default 10 000) comes back as ``[identity, b"", seq, payload]``, then
    ``END_SEQ = (-1).to_bytes(8, "big", signed=True)`` (eight 0xff) with an empty payload.
    vLLM PR #45177 added the topic to replies: ``[identity, b"", topic, seq, payload]``,
    ended by ``[identity, b"", b"", END_SEQ, b""]``. :func:`split_backfill_reply` takes both.

Batch (``EventBatch``): ``array_like`` → ``[ts, events]`` (first vLLM/SGLang releases),
    ``[ts, events, data_parallel_rank]`` (vLLM PR #18925; SGLang names it
    ``attn_dp_rank``). One stored vLLM snapshot (commit 0181ea3) declares ``EventBatch``
    without ``array_like``, i.e. a map ``{"ts", "events", "data_parallel_rank"}``; both
    shapes are accepted. A missing or nil rank means 0.

The events inside a batch (tags, field positions, media, hashes, components, normalization):
:mod:`foretoken.adapters.engines.event_fields`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from foretoken.adapters.engines.event_fields import Engine, EventDecoder, opt_int
from foretoken.core.types import ModelName, WorkerId
from foretoken.wire.codec import DecodeError
from foretoken.wire.records import KvEvent, KvEventBatch

SEQ_BYTES: Final = 8
REPLAY_END_SEQ: Final = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
_BATCH: Final = ("ts", "events", "data_parallel_rank")
EPOCH_MARKER: Final = b"\x00sgl-kv-epoch="
_msgpack = msgspec.msgpack.Decoder()


@dataclass(frozen=True, slots=True)
class BadEvent:
    """One malformed event of a readable batch: its position, why, and its msgpack bytes."""

    index: int
    reason: str
    raw: bytes


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """One decoded engine message: the normalized batch and what was skipped in it."""

    batch: KvEventBatch
    seq: int
    unknown_tags: Mapping[str, int] = field(default_factory=dict)
    unknown_media: Mapping[str, int] = field(default_factory=dict)
    topic: bytes = b""
    bad_events: tuple[BadEvent, ...] = ()
    other_components: int = 0  # SGLang events of a cache component that is no prefix


# --------------------------------------------------------------------------- frames


def parse_seq(frame: object) -> int:
    """An 8-byte big-endian unsigned sequence number."""
    data = _frame_bytes(frame, "seq")
    if len(data) != SEQ_BYTES:
        raise DecodeError(f"seq frame must be {SEQ_BYTES} bytes, got {len(data)}")
    return int.from_bytes(data, "big")


def frame_seq(frames: object) -> int | None:
    """The seq of a ``[topic, seq, payload]`` message whose payload may be unreadable; None
    when the message does not even have that shape (its place in the stream is unknown)."""
    if not isinstance(frames, list | tuple) or len(frames) != 3:
        return None
    seq = frames[1]
    if not isinstance(seq, bytes) or len(seq) != SEQ_BYTES:
        return None
    return int.from_bytes(seq, "big")


def topic_epoch(topic: bytes) -> bytes | None:
    """The publisher lifecycle token in a topic frame (SGLang's snapshot-enabled publisher
    appends ``\\x00sgl-kv-epoch=<uuid>``, new at every start), or None."""
    at = topic.find(EPOCH_MARKER)
    if at < 0:
        return None
    epoch = topic[at + len(EPOCH_MARKER) :]
    return epoch.split(b"\x00", 1)[0] or None


def decode_vllm_frames(
    frames: Sequence[bytes], *, worker_id: WorkerId, model: ModelName, default_block_size: int
) -> DecodedBatch:
    """Decode a vLLM PUB message ``[topic, seq, payload]``."""
    return decode_engine_frames(
        frames,
        engine="vllm",
        worker_id=worker_id,
        model=model,
        default_block_size=default_block_size,
    )


def decode_sglang_frames(
    frames: Sequence[bytes], *, worker_id: WorkerId, model: ModelName, default_block_size: int
) -> DecodedBatch:
    """Decode an SGLang PUB message (same framing; SGLang event layout and bigram tokens)."""
    return decode_engine_frames(
        frames,
        engine="sglang",
        worker_id=worker_id,
        model=model,
        default_block_size=default_block_size,
    )


def decode_engine_frames(
    frames: Sequence[bytes],
    *,
    engine: Engine,
    worker_id: WorkerId,
    model: ModelName,
    default_block_size: int,
) -> DecodedBatch:
    """Decode ``[topic, seq, payload]`` from either engine; raises only :class:`DecodeError`."""
    if not isinstance(frames, list | tuple):
        raise DecodeError(f"expected a list of frames, got {type(frames).__name__}")
    if len(frames) != 3:
        raise DecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic = _frame_bytes(frames[0], "topic")
    seq = parse_seq(frames[1])
    return decode_engine_payload(
        _frame_bytes(frames[2], "payload"),
        engine=engine,
        seq=seq,
        topic=topic,
        worker_id=worker_id,
        model=model,
        default_block_size=default_block_size,
    )


def decode_engine_payload(
    payload: bytes,
    *,
    engine: Engine,
    seq: int,
    worker_id: WorkerId,
    model: ModelName,
    default_block_size: int,
    topic: bytes = b"",
) -> DecodedBatch:
    """Decode one msgpack batch payload (from a PUB message or a replay reply)."""
    if engine not in ("vllm", "sglang"):
        raise ValueError(f"unknown engine {engine!r}")
    if default_block_size < 1:
        raise ValueError(f"default_block_size must be >= 1, got {default_block_size}")
    if not payload:
        raise DecodeError("empty payload")
    try:
        raw = _msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        raise DecodeError(f"payload is not msgpack: {exc}") from exc
    ts, raw_events, dp_rank = _batch_fields(raw)
    decoder = EventDecoder(engine, default_block_size)
    events: list[KvEvent] = []
    bad: list[BadEvent] = []
    for index, raw_event in enumerate(raw_events):
        try:
            decoder.decode(raw_event, events)
        except DecodeError as exc:
            bad.append(_bad_event(index, exc.reason, raw_event))
        except ValueError as exc:  # a record's own validation
            bad.append(_bad_event(index, f"invalid record: {exc}", raw_event))
    if bad and len(bad) == len(raw_events):
        raise DecodeError(
            f"event {bad[0].index}: {bad[0].reason}"
            + (f" (and {len(bad) - 1} more bad events)" if len(bad) > 1 else "")
        )
    try:
        batch = KvEventBatch(
            worker_id=worker_id,
            model=model,
            seq=seq,
            ts=ts,
            dp_rank=dp_rank,
            events=tuple(events),
        )
    except ValueError as exc:
        raise DecodeError(f"invalid KvEventBatch: {exc}") from exc
    return DecodedBatch(
        batch=batch,
        seq=seq,
        unknown_tags=decoder.unknown_tags,
        unknown_media=decoder.unknown_media,
        topic=topic,
        bad_events=tuple(bad),
        other_components=decoder.other_components,
    )


def _bad_event(index: int, reason: str, raw_event: Any) -> BadEvent:
    try:
        raw = msgspec.msgpack.encode(raw_event)
    except (TypeError, ValueError, OverflowError, RecursionError):
        raw = repr(raw_event)[:4096].encode()
    return BadEvent(index=index, reason=reason, raw=raw)


def backfill_request_frames(start_seq: int) -> list[bytes]:
    """What a DEALER sends to a replay ROUTER to get every batch from ``start_seq`` on."""
    if not 0 <= start_seq < 1 << 64:
        raise ValueError(f"start_seq must be an unsigned 64-bit int, got {start_seq}")
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]


def split_backfill_reply(frames: Sequence[bytes]) -> tuple[bytes, int, bytes] | None:
    """A replay reply as a DEALER receives it → ``(topic, seq, payload)``; None at the end.

    Accepts ``[b"", seq, payload]`` (before vLLM PR #45177; topic is then ``b""``) and
    ``[b"", topic, seq, payload]``; the end marker is seq ``REPLAY_END_SEQ`` (−1).
    """
    if not isinstance(frames, list | tuple) or len(frames) not in (3, 4):
        count = len(frames) if isinstance(frames, list | tuple) else type(frames).__name__
        raise DecodeError(f"a replay reply has 3 or 4 frames, got {count}")
    parts = [_frame_bytes(frame, "replay") for frame in frames]
    if parts[0]:
        raise DecodeError("a replay reply starts with an empty delimiter frame")
    topic = parts[1] if len(parts) == 4 else b""
    seq_frame, payload = parts[-2], parts[-1]
    if seq_frame == REPLAY_END_SEQ:
        return None
    return topic, parse_seq(seq_frame), payload


# --------------------------------------------------------------------------- decoding


def _frame_bytes(frame: object, what: str) -> bytes:
    if isinstance(frame, bytes):
        return frame
    if isinstance(frame, bytearray | memoryview):
        return bytes(frame)
    raise DecodeError(f"{what} frame must be bytes, got {type(frame).__name__}")


def _batch_fields(raw: Any) -> tuple[float, list[Any], int]:
    if isinstance(raw, list):
        if len(raw) < 2:
            raise DecodeError(f"a batch array has at least [ts, events], got {len(raw)} items")
        fields = dict(zip(_BATCH, raw, strict=False))
    elif isinstance(raw, dict):
        fields = dict(raw)
        if "data_parallel_rank" not in fields:
            fields["data_parallel_rank"] = fields.get("attn_dp_rank")
        if "ts" not in fields or "events" not in fields:
            raise DecodeError("a batch map needs 'ts' and 'events'")
    else:
        raise DecodeError(f"a batch is an array or a map, got {type(raw).__name__}")
    ts = fields["ts"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise DecodeError(f"batch ts must be a finite number, got {ts!r:.40}")
    events = fields["events"]
    if not isinstance(events, list):
        raise DecodeError(f"batch events must be an array, got {type(events).__name__}")
    rank = opt_int(fields.get("data_parallel_rank"), "data_parallel_rank")
    return float(ts), events, rank or 0
