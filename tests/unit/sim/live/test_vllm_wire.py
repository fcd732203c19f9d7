"""The fleet simulator's vLLM publisher encoding: byte-exact vectors and round trips."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foretoken.adapters.engines.decoders import decode_vllm_frames, split_backfill_reply
from foretoken.core.types import EngineBlockHash, ModelName, WorkerId
from foretoken.sim.live.vllm_wire import (
    decode_replay_request,
    encode_replay_end,
    encode_replay_reply,
    encode_replay_stream,
    encode_vllm_frames,
)
from foretoken.wire.codec import DecodeError
from foretoken.wire.records import AllCleared, BlockRemoved, BlockStored, IndexReset, KvEvent

W = WorkerId("w")
M = ModelName("m")
BS = 4
END = b"\xff" * 8
H1, H2 = EngineBlockHash((1 << 64) - 2), EngineBlockHash(3)

FIXED_EVENTS: list[KvEvent] = [
    BlockStored(
        block_hashes=(H1, H2),
        parent_block_hash=EngineBlockHash(9),
        token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
        block_size=BS,
        lora_name="adapter",
        medium="CPU",
        group_idx=1,
    ),
    BlockRemoved(block_hashes=(H2,), medium="GPU"),
    AllCleared(),
]


def test_map_encoding_matches_a_hand_built_vllm_message_byte_for_byte() -> None:
    # Written from vLLM's structs: tag key "type" first, fields in declaration order,
    # nil optional fields after lora_name omitted (omit_defaults), batch stays an array.
    stored = {
        "type": "BlockStored",
        "block_hashes": [H1, H2],
        "parent_block_hash": 9,
        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "block_size": 4,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": "adapter",
        "extra_keys": [["adapter"], ["adapter"]],  # vLLM keys a LoRA's blocks with its name
        "group_idx": 1,
        "kv_cache_spec_kind": "full_attention",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [H2], "medium": "GPU", "group_idx": 0}
    expected = msgspec.msgpack.encode([12.5, [stored, removed, {"type": "AllBlocksCleared"}], 2])
    out = encode_vllm_frames(b"kv", 7, 12.5, FIXED_EVENTS, dp_rank=2, block_size=BS)
    assert out == [b"kv", b"\x00\x00\x00\x00\x00\x00\x00\x07", expected]


def test_array_encoding_matches_a_hand_built_legacy_message_byte_for_byte() -> None:
    # array_like events: the tag then every field positionally, nils written out.
    stored = ["BlockStored", [H1, H2], 9, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU"]
    stored += ["adapter", [["adapter"], ["adapter"]], 1, "full_attention", None]
    removed = ["BlockRemoved", [H2], "GPU", 0]
    expected = msgspec.msgpack.encode([12.5, [stored, removed, ["AllBlocksCleared"]], 0])
    out = encode_vllm_frames(b"", 1 << 40, 12.5, FIXED_EVENTS, encoding="array", block_size=BS)
    assert out == [b"", (1 << 40).to_bytes(8, "big"), expected]


def test_an_index_reset_is_not_an_engine_event() -> None:
    with pytest.raises(ValueError):
        encode_vllm_frames(b"", 0, 1.0, [IndexReset(reason="x")], block_size=BS)


_hashes = st.integers(min_value=0, max_value=(1 << 64) - 1).map(EngineBlockHash)
_tiers = st.sampled_from(["GPU", "CPU", "DISK", "SHARED"])
_extra_entry = st.lists(st.text(max_size=5) | st.integers(0, 1000), min_size=1, max_size=3)


@st.composite
def _stores(draw: st.DrawFn) -> BlockStored:
    blocks = draw(st.integers(0, 4))
    hashes = tuple(draw(st.lists(_hashes, min_size=blocks, max_size=blocks)))
    offload = draw(st.booleans())
    tokens = (
        ()
        if offload
        else tuple(
            draw(st.lists(st.integers(0, 1 << 20), min_size=blocks * BS, max_size=blocks * BS))
        )
    )
    extra: tuple[str, ...] = ()
    if blocks and draw(st.booleans()):
        entries = draw(st.lists(st.none() | _extra_entry, min_size=blocks, max_size=blocks))
        if any(e is not None for e in entries):
            extra = tuple("" if e is None else msgspec.json.encode(e).decode() for e in entries)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | _hashes),
        token_ids=tokens,
        block_size=BS,
        lora_name=draw(st.none() | st.text(min_size=1, max_size=8)),
        medium=draw(_tiers),
        group_idx=draw(st.integers(0, 3)),
        full_attention=draw(st.booleans()),
        extra_keys=extra,
    )


_removes = st.builds(
    BlockRemoved,
    block_hashes=st.lists(_hashes, max_size=4).map(tuple),
    medium=_tiers,
    group_idx=st.integers(0, 3),
)
_events = st.lists(_stores() | _removes | st.just(AllCleared()), max_size=6)


def _ints(event: KvEvent) -> KvEvent:
    """A store with its token ids as ints (the decoder packs them)."""
    if not isinstance(event, BlockStored):
        return event
    return msgspec.structs.replace(event, token_ids=tuple(event.token_id_list()),
                                   packed_token_ids=b"")  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    _events,
    st.integers(0, (1 << 63) - 1),
    st.floats(0, 4e9, allow_nan=False),
    st.integers(0, 7),
    st.sampled_from(["map", "array"]),
)
def test_round_trip_through_the_ingest_decoder(
    events: list[KvEvent], seq: int, ts: float, dp_rank: int, encoding: Any
) -> None:
    out = encode_vllm_frames(
        b"topic", seq, ts, events, dp_rank=dp_rank, encoding=encoding, block_size=BS
    )
    decoded = decode_vllm_frames(out, worker_id=W, model=M, default_block_size=BS)
    assert decoded.seq == seq and decoded.topic == b"topic"
    assert decoded.batch.ts == ts and decoded.batch.dp_rank == dp_rank
    assert [_ints(e) for e in decoded.batch.events] == [_ints(e) for e in events]
    assert decoded.unknown_tags == {} and decoded.unknown_media == {}


def test_offload_store_with_block_size_zero_gets_the_engine_block_size() -> None:
    store = BlockStored(block_hashes=(H2,), block_size=0, medium="CPU")
    out = encode_vllm_frames(b"", 0, 1.0, [store], block_size=BS)
    (wire,) = msgspec.msgpack.decode(out[2])[1]
    assert wire["block_size"] == BS and wire["token_ids"] == []


# --------------------------------------------------------------------------- replay


def test_replay_request_and_reply_frames() -> None:
    identity = b"client-1"
    assert decode_replay_request([identity, b"", (5).to_bytes(8, "big")]) == (identity, 5)
    for bad in ([identity, b""], [identity, b"x", b"\x00" * 8], [identity, b"", b"\x05"]):
        with pytest.raises(DecodeError):
            decode_replay_request(bad)
    assert encode_replay_reply(identity, 6, b"p") == [identity, b"", b"\x00" * 7 + b"\x06", b"p"]
    assert encode_replay_reply(identity, 6, b"p", topic=b"t")[2] == b"t"
    assert encode_replay_end(identity) == [identity, b"", END, b""]
    assert encode_replay_end(identity, topic=True) == [identity, b"", b"", END, b""]


@pytest.mark.parametrize("topic", [None, b"kv@pod@model"])
def test_replay_stream_is_read_back_by_the_ingest(topic: bytes | None) -> None:
    buffer = [(seq, f"payload-{seq}".encode()) for seq in range(3, 9)]
    replies = encode_replay_stream(b"id", buffer, 5, topic=topic)
    # A DEALER receives each reply without the identity frame the ROUTER addressed it by.
    read = [split_backfill_reply(reply[1:]) for reply in replies]
    assert read[-1] is None
    expected_topic = topic or b""
    assert read[:-1] == [(expected_topic, seq, f"payload-{seq}".encode()) for seq in range(5, 9)]
