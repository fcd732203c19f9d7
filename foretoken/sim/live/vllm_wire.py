"""What a vLLM KV-event publisher puts on the wire, for the fleet simulator (pure).

The inverse of :mod:`foretoken.adapters.engines.decoders` for vLLM. Written from the format as read
in
vLLM's ``vllm/distributed/kv_events.py`` (no code copied):

* PUB message: ``[topic, seq.to_bytes(8, "big"), msgpack(batch)]``, seq from 0 per process.
* Batch: ``EventBatch`` is ``array_like`` → ``[ts, events, data_parallel_rank]`` (the rank
  is filled in by the publisher, so it is always present).
* Events, ``encoding="map"`` (vLLM after PR #42892): ``{"type": "BlockStored",
  "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"[, "kv_cache_spec_sliding_
  window"]}`` in that order; ``omit_defaults`` drops the optional fields (from
  ``extra_keys`` on) that are nil; the required ones are written even when nil.
  ``BlockRemoved``: ``block_hashes, medium, group_idx``; ``AllBlocksCleared``: the tag only.
  ``encoding="array"`` (before PR #42892): the same fields positionally after the tag,
  nil optionals written as nil (msgspec ignores ``omit_defaults`` for ``array_like``).
* The block manager (``vllm/v1/core/block_pool.py``) writes ``lora_id`` nil when a
  ``lora_name`` is known, ``extra_keys`` as one entry per block (nil when none), and on
  current versions ``group_idx`` and ``kv_cache_spec_kind`` on every GPU event.
* Replay ROUTER: a request is ``[identity, b"", start_seq (8 bytes BE)]``; each buffered
  batch with ``seq >= start_seq`` goes back as ``[identity, b"", seq, payload]`` and the
  stream ends with ``[identity, b"", (-1).to_bytes(8, "big", signed=True), b""]``.
  vLLM PR #45177 added the topic: ``[identity, b"", topic, seq, payload]``, ended by
  ``[identity, b"", b"", END_SEQ, b""]`` — pass ``topic=`` to get that form.

Our tiers are written as vLLM's medium names (GPU, CPU, STORAGE) and SHARED; a record with
``full_attention=False`` is written as kind ``sliding_window``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final, Literal

import msgspec

from foretoken.wire.codec import DecodeError
from foretoken.wire.records import AllCleared, BlockRemoved, BlockStored, KvEvent, Tier

Encoding = Literal["map", "array"]

SEQ_BYTES: Final = 8
END_SEQ: Final = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
MEDIUM_NAMES: Final[dict[Tier, str]] = {
    "GPU": "GPU",
    "CPU": "CPU",
    "DISK": "STORAGE",
    "SHARED": "SHARED",
}
KIND_FULL: Final = "full_attention"
KIND_PARTIAL: Final = "sliding_window"


# The map form (tag and field names); the array form is the same fields, positionally.
class _MapStored(msgspec.Struct, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _MapRemoved(msgspec.Struct, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _MapCleared(msgspec.Struct, omit_defaults=True, tag="AllBlocksCleared"):
    pass


class _ArrayStored(_MapStored, array_like=True):
    pass


class _ArrayRemoved(_MapRemoved, array_like=True):
    pass


class _ArrayCleared(_MapCleared, array_like=True):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_vllm_frames(
    topic: bytes,
    seq: int,
    ts: float,
    events: Sequence[KvEvent],
    *,
    dp_rank: int = 0,
    encoding: Encoding = "map",
    block_size: int,
) -> list[bytes]:
    """``[topic, seq, payload]`` as vLLM's ``ZmqEventPublisher`` sends it.

    ``block_size`` is the engine's block size, written for stores whose record says 0.
    """
    return [
        topic,
        seq_bytes(seq),
        encode_vllm_payload(ts, events, dp_rank=dp_rank, encoding=encoding, block_size=block_size),
    ]


def encode_vllm_payload(
    ts: float,
    events: Sequence[KvEvent],
    *,
    dp_rank: int = 0,
    encoding: Encoding = "map",
    block_size: int,
) -> bytes:
    """The msgpack batch ``[ts, events, data_parallel_rank]``."""
    if encoding not in ("map", "array"):
        raise ValueError(f"encoding must be 'map' or 'array', got {encoding!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    wire = [_wire_event(event, encoding, block_size) for event in events]
    return _encoder.encode(_Batch(ts=float(ts), events=wire, data_parallel_rank=dp_rank))


def seq_bytes(seq: int) -> bytes:
    if not 0 <= seq < 1 << 64:
        raise ValueError(f"seq must be an unsigned 64-bit int, got {seq}")
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """``[identity, b"", start_seq]`` as the ROUTER receives it → ``(identity, start_seq)``."""
    if len(frames) != 3:
        raise DecodeError(f"a replay request has 3 frames, got {len(frames)}")
    identity, delimiter, start = (bytes(frame) for frame in frames)
    if delimiter:
        raise DecodeError("a replay request has an empty delimiter frame")
    if len(start) != SEQ_BYTES:
        raise DecodeError(f"start_seq must be {SEQ_BYTES} bytes, got {len(start)}")
    return identity, int.from_bytes(start, "big")


def encode_replay_reply(
    identity: bytes, seq: int, payload: bytes, *, topic: bytes | None = None
) -> list[bytes]:
    """One replayed batch; with ``topic`` the post-PR-#45177 five-frame form."""
    if topic is None:
        return [identity, b"", seq_bytes(seq), payload]
    return [identity, b"", topic, seq_bytes(seq), payload]


def encode_replay_end(identity: bytes, *, topic: bool = False) -> list[bytes]:
    """The end-of-replay marker: seq −1 (eight 0xff bytes) and an empty payload."""
    if topic:
        return [identity, b"", b"", END_SEQ, b""]
    return [identity, b"", END_SEQ, b""]


def encode_replay_stream(
    identity: bytes,
    buffer: Iterable[tuple[int, bytes]],
    start_seq: int,
    *,
    topic: bytes | None = None,
) -> list[list[bytes]]:
    """Every reply a vLLM ROUTER sends for ``start_seq``: buffered batches, then the end."""
    replies = [
        encode_replay_reply(identity, seq, payload, topic=topic)
        for seq, payload in buffer
        if seq >= start_seq
    ]
    replies.append(encode_replay_end(identity, topic=topic is not None))
    return replies


def _wire_event(event: KvEvent, encoding: Encoding, block_size: int) -> msgspec.Struct:
    as_map = encoding == "map"
    if isinstance(event, BlockStored):
        stored = _MapStored if as_map else _ArrayStored
        return stored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_id_list(),
            block_size=event.block_size if event.block_size > 0 else block_size,
            lora_id=None,
            medium=MEDIUM_NAMES[event.medium],
            lora_name=event.lora_name,
            extra_keys=_extra_keys(event),
            group_idx=event.group_idx,
            kv_cache_spec_kind=KIND_FULL if event.full_attention else KIND_PARTIAL,
        )
    if isinstance(event, BlockRemoved):
        removed = _MapRemoved if as_map else _ArrayRemoved
        return removed(
            block_hashes=list(event.block_hashes),
            medium=MEDIUM_NAMES[event.medium],
            group_idx=event.group_idx,
        )
    if isinstance(event, AllCleared):
        return _MapCleared() if as_map else _ArrayCleared()
    raise ValueError(f"{type(event).__name__} is not an engine event")


def _extra_keys(event: BlockStored) -> list[list[Any] | None]:
    """One entry per block, as vLLM's block manager writes them: a LoRA's name first in
    every block's keys (``generate_block_hash_extra_keys``), then the others."""
    if event.extra_keys and len(event.extra_keys) != len(event.block_hashes):
        raise ValueError("extra_keys has one entry per block")
    entries = [msgspec.json.decode(e) if e else None for e in event.extra_keys] or (
        [None] * len(event.block_hashes))  # fmt: skip
    if event.lora_name is not None:
        return [[event.lora_name, *(e or [])] for e in entries]
    return entries
