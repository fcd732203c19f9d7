"""Engine KV-event decoding, checked against vectors written by hand from the formats.

Every payload here is ``msgspec.msgpack.encode`` of a hand-written list/dict shaped like
what vLLM (``vllm/distributed/kv_events.py``) or SGLang
(``python/sglang/srt/disaggregation/kv_events.py``) publishes; none comes from
``fleet/vllm_wire.py``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foretoken.adapters.engines.decoders import (
    DecodedBatch,
    backfill_request_frames,
    decode_sglang_frames,
    decode_vllm_frames,
    split_backfill_reply,
)
from foretoken.core.index.protocol import make_index
from foretoken.core.types import ModelName, WorkerId
from foretoken.wire.codec import DecodeError
from foretoken.wire.records import AllCleared, BlockRemoved, BlockStored

W = WorkerId("w1")
M = ModelName("m")
BS = 16
U64 = (1 << 64) - 1


def frames(batch: Any, seq: int = 0, topic: bytes = b"kv-events") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def vllm(batch: Any, seq: int = 0) -> DecodedBatch:
    return decode_vllm_frames(frames(batch, seq), worker_id=W, model=M, default_block_size=BS)


def sglang(batch: Any, seq: int = 0) -> DecodedBatch:
    return decode_sglang_frames(frames(batch, seq), worker_id=W, model=M, default_block_size=BS)


def stored_map(**overrides: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [11],
        "parent_block_hash": None,
        "token_ids": list(range(BS)),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    event.update(overrides)
    return event


# --------------------------------------------------------------------------- vLLM


def test_vllm_map_event_as_published_by_a_current_engine() -> None:
    # Shape of a vLLM 0.26 batch: outer array, events as maps, optional nils omitted.
    tokens = [151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198] + [1] * 4
    event = stored_map(
        block_hashes=[15760518052499183552],
        token_ids=tokens,
        extra_keys=[None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    decoded = vllm([1789095808.8378847, [event], 0], seq=41)
    assert decoded.seq == 41 and decoded.topic == b"kv-events"
    batch = decoded.batch
    assert (batch.worker_id, batch.model, batch.seq, batch.dp_rank) == (W, M, 41, 0)
    assert batch.ts == pytest.approx(1789095808.8378847)
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (15760518052499183552,)  # > 2**63 kept as is
    assert stored.token_id_list() == tokens and not stored.token_ids  # packed
    assert (stored.medium, stored.group_idx, stored.full_attention) == ("GPU", 0, True)
    assert stored.extra_keys == () and stored.parent_block_hash is None


def test_vllm_oldest_array_format_without_dp_rank_or_medium() -> None:
    # First release: batch [ts, events]; BlockStored [tag, hashes, parent, tokens, bs, lora_id].
    event = ["BlockStored", [1, 2], 7, list(range(2 * BS)), BS, None]
    decoded = vllm([5.0, [event, ["BlockRemoved", [1]], ["AllBlocksCleared"]]])
    stored, removed, cleared = decoded.batch.events
    assert decoded.batch.dp_rank == 0
    assert isinstance(stored, BlockStored) and stored.parent_block_hash == 7
    assert stored.block_hashes == (1, 2) and stored.medium == "GPU"
    assert removed == BlockRemoved(block_hashes=(1,), medium="GPU", group_idx=0)
    assert cleared == AllCleared(medium=None)


def test_vllm_array_with_every_field_and_nil_trailing_fields() -> None:
    event = ["BlockStored", [3], None, list(range(BS)), BS, None, "CPU", None]
    event += [None, None, None, None]  # extra_keys, group_idx, kind, sliding window: nil
    (stored,) = vllm([1.0, [event], 2]).batch.events
    assert isinstance(stored, BlockStored)
    assert (stored.medium, stored.group_idx, stored.full_attention) == ("CPU", 0, True)
    assert stored.lora_name is None


def test_vllm_array_lora_name_and_deprecated_lora_id() -> None:
    named = ["BlockStored", [3], None, list(range(BS)), BS, None, "GPU", "my-adapter"]
    by_id = ["BlockStored", [4], None, list(range(BS)), BS, 5, "GPU", None]
    first, second = vllm([1.0, [named, by_id], 0]).batch.events
    assert isinstance(first, BlockStored) and first.lora_name == "my-adapter"
    # A LoRA block known only by id must not alias a base-model block.
    assert isinstance(second, BlockStored) and second.lora_name is not None
    assert "5" in second.lora_name


def test_uint64_hashes_above_int64_and_parent() -> None:
    top = U64
    event = stored_map(block_hashes=[top, (1 << 63) + 1], token_ids=[0] * (2 * BS))
    event["parent_block_hash"] = 1 << 63
    (stored,) = vllm([1.0, [event], 0]).batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (top, (1 << 63) + 1)
    assert stored.parent_block_hash == 1 << 63


def test_raw_digest_hash_matches_vllms_integer_form() -> None:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes the digest; =1 publishes
    # int.from_bytes(digest, "big") & (2**64 - 1) (kv_cache_utils.maybe_convert_block_hash).
    digest = hashlib.sha256(b"block").digest()
    as_int = int.from_bytes(digest, "big") & U64
    event_bytes = stored_map(block_hashes=[digest], parent_block_hash=digest)
    event_int = stored_map(block_hashes=[as_int], parent_block_hash=as_int)
    by_bytes, by_int = vllm([1.0, [event_bytes, event_int], 0]).batch.events
    assert isinstance(by_bytes, BlockStored) and isinstance(by_int, BlockStored)
    assert by_bytes.block_hashes == by_int.block_hashes == (as_int,)
    assert by_bytes.parent_block_hash == as_int


def test_unknown_tags_are_skipped_and_counted() -> None:
    events = [
        {"type": "CacheStoreCommitted", "keys": [1]},
        ["TransferInitiated", 1, 2],
        {"type": "CacheStoreCommitted"},
        ["BlockRemoved", [9], "GPU"],
    ]
    decoded = vllm([1.0, events, 0])
    assert decoded.unknown_tags == {"CacheStoreCommitted": 2, "TransferInitiated": 1}
    assert decoded.batch.events == (BlockRemoved(block_hashes=(9,)),)


def test_offload_store_with_empty_tokens_and_block_size_zero() -> None:
    # vLLM offloading_connector.take_events: parent nil, token_ids [], block_size 0.
    event = stored_map(block_hashes=[1, 2, 3], token_ids=[], block_size=0, medium="CPU")
    (stored,) = vllm([1.0, [event], 0]).batch.events
    assert isinstance(stored, BlockStored)
    assert stored.token_count == 0 and stored.block_hashes == (1, 2, 3)
    assert stored.block_size == BS and stored.medium == "CPU"


@pytest.mark.parametrize("backend", ["native", "python"])
def test_lmcache_chunks_through_vllms_connector_credit_the_cpu_tier(backend: str) -> None:
    """LMCache (``cache_engine.store``, forwarded by vLLM's ``LMCacheConnectorV1``) stores
    one event per 256-token chunk: its chunk hash, the previous chunk's as parent, the
    chunk's token ids, ``block_size`` = the chunk's token count (less for a prompt's last
    chunk) and medium ``cpu``. They decode as they come and the index files them as the
    engine's 16-token blocks, so a prompt the GPU dropped is still credited from CPU."""
    prompt = [(7 * i + 3) % 50_000 for i in range(600)]
    events = [
        stored_map(block_hashes=[1 << 63 | 5], token_ids=prompt[:256], block_size=256,
                   medium="cpu"),
        stored_map(block_hashes=[77], parent_block_hash=1 << 63 | 5, token_ids=prompt[256:512],
                   block_size=256, medium="cpu"),
        stored_map(block_hashes=[78], parent_block_hash=77, token_ids=prompt[512:],
                   block_size=88, medium="cpu"),
    ]  # fmt: skip
    batch = vllm([1.0, events, 0]).batch
    assert [e.block_size for e in batch.events if isinstance(e, BlockStored)] == [256, 256, 88]
    index = make_index(backend)  # type: ignore[arg-type]
    index.register_worker(W, M, BS)
    applied = index.apply(batch, 0.0)
    assert applied.stored_blocks == 16 + 16 + 5 and applied.block_size_mismatch_blocks == 0
    hit = index.lookup(M, prompt)[W]
    assert hit.by_tier()["CPU"] == 592 and hit.tokens == 592
    removal = vllm([2.0, [{"type": "BlockRemoved", "block_hashes": [77], "medium": "cpu"}], 0])
    assert index.apply(removal.batch, 0.0).removed_blocks == 16
    assert index.lookup(M, prompt)[W].tokens == 256


def test_groups_and_kv_cache_spec_kinds() -> None:
    def ev(group: int, kind: str | None) -> dict[str, Any]:
        return stored_map(group_idx=group, kv_cache_spec_kind=kind)

    events = [
        ev(0, "full_attention"),
        ev(1, "sliding_window"),
        ev(2, "mamba"),
        ev(3, "mla_attention"),
        ev(4, None),
        ev(5, "sliding_window_mla"),
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 1},
    ]
    decoded = vllm([1.0, events, 0]).batch.events
    stores = [e for e in decoded if isinstance(e, BlockStored)]
    assert [(s.group_idx, s.full_attention) for s in stores] == [
        (0, True),
        (1, False),
        (2, False),
        (3, True),
        (4, True),
        (5, False),
    ]
    assert decoded[-1] == BlockRemoved(block_hashes=(11,), group_idx=1)


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        ("GPU", "GPU"),
        ("DEVICE", "GPU"),
        (None, "GPU"),
        ("CPU", "CPU"),
        ("CPU_PINNED", "CPU"),
        ("cpu_tier1", "CPU"),
        ("CPU_TIER2", "DISK"),
        ("DISK", "DISK"),
        ("NVME", "DISK"),
        ("STORAGE", "DISK"),
        ("EXTERNAL", "SHARED"),
        ("NETWORK", "SHARED"),
        ("REMOTE", "SHARED"),
        ("SHARED", "SHARED"),
        ("LMCACHE", "SHARED"),
    ],
)
def test_tier_mapping(medium: str | None, tier: str) -> None:
    events = [stored_map(medium=medium), ["BlockRemoved", [11], medium]]
    stored, removed = vllm([1.0, events, 0]).batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.medium == removed.medium == tier


@pytest.mark.parametrize(
    ("medium", "locality", "tier"),
    [
        ("STORAGE", None, "DISK"),
        ("STORAGE", "LOCAL", "DISK"),
        ("STORAGE", "REMOTE", "SHARED"),
        ("FS", None, "DISK"),
        ("FS", "remote", "SHARED"),
        ("OBJ", "REMOTE", "SHARED"),
        ("CPU", "REMOTE", "SHARED"),
        ("GPU", "REMOTE", "GPU"),
    ],
)
def test_secondary_tier_locality_places_the_copy(
    medium: str, locality: str | None, tier: str
) -> None:
    """vLLM PR #48281: FS/OBJ/STORAGE events say LOCAL or REMOTE; a remote copy loads at the
    shared tier's cost, and its removal must hit that tier, not local disk."""
    extra = {} if locality is None else {"locality": locality}
    store = stored_map(medium=medium, ownership="fs-tier-0", **extra)
    removal = {"type": "BlockRemoved", "block_hashes": [11], "medium": medium, **extra}
    decoded = vllm([1.0, [store, removal], 0])
    assert [e.medium for e in decoded.batch.events] == [tier, tier]  # type: ignore[union-attr]


def test_unknown_medium_skips_the_event_and_counts_it() -> None:
    events = [stored_map(medium="HOLOGRAPHIC"), ["BlockRemoved", [1], "HOLOGRAPHIC"]]
    decoded = vllm([1.0, [*events, ["BlockRemoved", [2], "GPU"]], 0])
    assert decoded.unknown_media == {"HOLOGRAPHIC": 2}
    assert decoded.batch.events == (BlockRemoved(block_hashes=(2,)),)


def test_clear_of_an_unknown_medium_is_skipped_not_a_clear_of_every_tier() -> None:
    batch = [1.0, [{"type": "AllBlocksCleared", "medium": "HOLOGRAPHIC"},
                   {"type": "AllBlocksCleared", "medium": "cpu"}], 0]  # fmt: skip
    decoded = vllm(batch)
    assert decoded.unknown_media == {"HOLOGRAPHIC": 1}
    assert decoded.batch.events == (AllCleared(medium="CPU"),)


@pytest.mark.parametrize(
    ("batch", "field"),
    [
        ([1.0, [stored_map(group_idx=1 << 63)], 0], "group_idx"),
        ([1.0, [["BlockRemoved", [1], "GPU", (1 << 64) - 1]], 0], "group_idx"),
        ([1.0, [stored_map(token_ids=[], block_size=1 << 63)], 0], "block_size"),
        ([1.0, [], 1 << 63], "dp_rank"),
    ],
)
def test_ints_past_their_bounds_are_refused_naming_the_field(batch: Any, field: str) -> None:
    """Before: ints of 2^63 and more went to Kafka and the processor dead-lettered the whole
    batch with an OverflowError that named nothing."""
    with pytest.raises(DecodeError, match=field):
        vllm(batch)


def test_batch_as_a_map_and_dp_rank() -> None:
    batch = {"ts": 2.5, "events": [["AllBlocksCleared"]], "data_parallel_rank": 3}
    decoded = vllm(batch)
    assert decoded.batch.dp_rank == 3 and decoded.batch.events == (AllCleared(),)


def test_vllm_extra_keys_one_entry_per_block() -> None:
    event = stored_map(
        block_hashes=[1, 2],
        token_ids=[0] * (2 * BS),
        extra_keys=[["mm-hash-a", 0, "salt"], None],
    )
    (stored,) = vllm([1.0, [event], 0]).batch.events
    assert isinstance(stored, BlockStored) and len(stored.extra_keys) == 2
    assert msgspec.json.decode(stored.extra_keys[0]) == ["mm-hash-a", 0, "salt"]
    assert stored.extra_keys[1] == ""


def test_vllm_lora_name_first_in_every_blocks_keys_is_the_seeds_not_a_key() -> None:
    """vLLM keys every block of a LoRA with its name (then a salt on the first): the name is
    the chain's seed already, so it is taken out of the keys (older engines without
    extra_keys and newer ones hash the adapter's blocks alike, as a LoRA lookup does)."""
    keys = [["ada", "salt"], ["ada"], ["ada", "mm", 3]]
    event = stored_map(block_hashes=[1, 2, 3], token_ids=[0] * (3 * BS), lora_name="ada",
                       extra_keys=keys)  # fmt: skip
    (stored,) = vllm([1.0, [event], 0]).batch.events
    assert isinstance(stored, BlockStored) and stored.lora_name == "ada"
    assert stored.extra_keys == ('["salt"]', "", '["mm",3]')
    only = stored_map(block_hashes=[1], token_ids=[0] * BS, lora_name="ada", extra_keys=[["ada"]])
    (plain,) = vllm([1.0, [only], 0]).batch.events
    assert isinstance(plain, BlockStored) and plain.extra_keys == ()


# --------------------------------------------------------------------------- SGLang


def test_sglang_signed_negative_int64_hashes() -> None:
    # hash_str_to_int64: first 16 hex chars of a SHA-256 hexdigest as signed int64.
    hexdigest = hashlib.sha256(b"page").hexdigest()
    unsigned = int(hexdigest[:16], 16) | (1 << 63)  # force the negative branch
    signed = unsigned - (1 << 64)
    event = ["BlockStored", [signed], -1, [5], 1, None, "GPU"]
    (stored,) = sglang([1.0, [event, ["BlockRemoved", [signed], "GPU"]], 0]).batch.events[:1]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (unsigned,) and stored.parent_block_hash == U64


def test_sglang_merged_page_size_one_stores_and_cpu_pinned() -> None:
    # KVCacheEventRecorder.enqueue merges consecutive pages of one chain.
    event = ["BlockStored", [-3, -2, -1], None, [10, 11, 12], 1, None, "CPU_PINNED"]
    decoded = sglang([1.0, [event], 1])
    (stored,) = decoded.batch.events
    assert isinstance(stored, BlockStored) and decoded.batch.dp_rank == 1
    assert stored.token_id_list() == [10, 11, 12] and stored.block_size == 1
    assert stored.medium == "CPU" and len(stored.block_hashes) == 3


def test_sglang_eagle_bigram_token_ids_keep_the_page_token() -> None:
    # EAGLE pages expose (raw[j], raw[j+1]) pairs; the page's tokens are raw[j].
    event = ["BlockStored", [1], None, [[7, 8], [8, 9]], 2, None, "GPU"]
    (stored,) = sglang([1.0, [event], 0]).batch.events
    assert isinstance(stored, BlockStored) and stored.token_id_list() == [7, 8]


def test_sglang_cache_salt_in_array_metadata_and_in_map() -> None:
    salted = ["BlockStored", [1, 2], None, [1, 2], 1, None, "GPU", {"cache_salt": "tenant-a"}]
    child = ["BlockStored", [3], 2, [3], 1, None, "GPU", {"cache_salt": "tenant-a"}]
    as_map = {
        "type": "BlockStored",
        "block_hashes": [4],
        "parent_block_hash": None,
        "token_ids": [1],
        "block_size": 1,
        "lora_id": None,
        "medium": "GPU",
        "cache_salt": "tenant-b",
    }
    root, mid, mapped = sglang([1.0, [salted, child, as_map], None]).batch.events
    assert isinstance(root, BlockStored) and isinstance(mid, BlockStored)
    assert isinstance(mapped, BlockStored)
    assert root.extra_keys == (msgspec.json.encode(["tenant-a"]).decode(), "")
    assert mid.extra_keys == ()  # the salt is already in the chain through the parent
    assert msgspec.json.decode(mapped.extra_keys[0]) == ["tenant-b"]


def test_sglang_position_seven_is_not_a_lora_name() -> None:
    event = ["BlockStored", [1], None, [1], 1, None, "GPU", {"cache_salt": "s"}]
    with pytest.raises(DecodeError):
        vllm([1.0, [event], 0])  # vLLM reads position 7 as lora_name: a map is garbage
    (stored,) = sglang([1.0, [event], 0]).batch.events
    assert isinstance(stored, BlockStored) and stored.lora_name is None


# --------------------------------------------------------------------------- garbage


GOOD = frames([1.0, [stored_map()], 0])


@pytest.mark.parametrize(
    "bad",
    [
        GOOD[:2],
        [*GOOD, b""],
        [GOOD[0], b"\x00" * 7, GOOD[2]],
        [GOOD[0], b"\x00" * 9, GOOD[2]],
        [GOOD[0], b"\xff" * 8, GOOD[2]],  # seq -1 is the replay end marker, not a batch
        [GOOD[0], GOOD[1], b""],
        [GOOD[0], GOOD[1], b"\xc1"],
        [GOOD[0], GOOD[1], b"\x92\x01"],
        [GOOD[0], 5, GOOD[2]],
        "not frames",
    ],
)
def test_bad_frames_raise_decode_error(bad: Any) -> None:
    with pytest.raises(DecodeError):
        decode_vllm_frames(bad, worker_id=W, model=M, default_block_size=BS)


@pytest.mark.parametrize(
    "batch",
    [
        7,
        [1.0],
        [float("nan"), [], 0],
        [True, [], 0],
        [1.0, {"a": 1}, 0],
        [1.0, [], -1],
        {"events": []},
        [1.0, [42], 0],
        [1.0, [[]], 0],
        [1.0, [[5, [1]]], 0],
        [1.0, [{"block_hashes": [1]}], 0],
        [1.0, [stored_map(block_hashes=[1.5])], 0],
        [1.0, [stored_map(block_hashes=[True])], 0],
        [1.0, [stored_map(block_hashes=[None])], 0],
        [1.0, [stored_map(block_hashes=[b""])], 0],
        [1.0, [stored_map(block_hashes="1")], 0],
        [1.0, [stored_map(token_ids=[1, 2, 3])], 0],
        [1.0, [stored_map(token_ids=[-1] * BS)], 0],
        [1.0, [stored_map(token_ids=[[1, 2]] * BS)], 0],
        [1.0, [stored_map(block_size=-16)], 0],
        [1.0, [stored_map(medium=5)], 0],
        [1.0, [stored_map(extra_keys=[None, None])], 0],
        [1.0, [stored_map(extra_keys=["salt"])], 0],
        [1.0, [stored_map(group_idx="0")], 0],
        [1.0, [stored_map(kv_cache_spec_kind=1)], 0],
        [1.0, [stored_map(lora_id="a")], 0],
        [1.0, [stored_map(medium="STORAGE", locality=3)], 0],
        [1.0, [["BlockRemoved"]], 0],
        [1.0, [{"type": 3}, stored_map(token_ids=[1, 2, 3])], 0],
    ],
)
def test_malformed_batches_raise_decode_error(batch: Any) -> None:
    with pytest.raises(DecodeError) as info:
        vllm(batch)
    assert info.value.reason


def test_one_bad_event_costs_only_itself_not_the_batch() -> None:
    """Before: a bad store rejected the whole batch, so the valid removal beside it was lost
    and its blocks stayed credited. LMCache's hash-based storing puts chunk hashes (> 2^32)
    where token ids go: that store is refused, the rest of the batch applies."""
    lmcache_store = stored_map(block_hashes=[21], token_ids=[1 << 40] * BS, medium="CPU")
    batch = [1.0, [["BlockRemoved", [7, 8], "GPU"], lmcache_store, stored_map(), {"type": 3}], 0]
    decoded = vllm(batch, seq=9)
    assert [type(e).__name__ for e in decoded.batch.events] == ["BlockRemoved", "BlockStored"]
    assert decoded.batch.events[0] == BlockRemoved(block_hashes=(7, 8), medium="GPU")
    assert [b.index for b in decoded.bad_events] == [1, 3]
    assert "token ids" in decoded.bad_events[0].reason
    assert msgspec.msgpack.decode(decoded.bad_events[0].raw) == lmcache_store
    assert "type" in decoded.bad_events[1].reason


def test_a_batch_of_only_bad_events_is_undecodable() -> None:
    with pytest.raises(DecodeError, match=r"event 0: .*\(and 1 more bad events\)"):
        vllm([1.0, [{"type": 3}, ["BlockRemoved"]], 0])


def test_sglang_bigram_with_three_items_is_garbage() -> None:
    with pytest.raises(DecodeError):
        sglang([1.0, [["BlockStored", [1], None, [[1, 2, 3]], 1, None, "GPU"]], 0])


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=U64)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type"])
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(
            st.sampled_from(["type", "block_hashes", "token_ids", "medium", "ts", "events"])
            | st.text(max_size=6),
            inner,
            max_size=6,
        )
    ),
    max_leaves=40,
)


def _decode_only_decode_errors(raw_frames: list[Any], engine: str = "vllm") -> None:
    decode = decode_sglang_frames if engine == "sglang" else decode_vllm_frames
    try:
        decode(raw_frames, worker_id=W, model=M, default_block_size=BS)
    except DecodeError as exc:
        assert exc.reason


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5), st.sampled_from(["vllm", "sglang"]))
def test_fuzz_arbitrary_frames(raw_frames: list[bytes], engine: str) -> None:
    _decode_only_decode_errors(raw_frames, engine)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(["vllm", "sglang"]))
def test_fuzz_arbitrary_payload_bytes(payload: bytes, engine: str) -> None:
    _decode_only_decode_errors([b"t", (0).to_bytes(8, "big"), payload], engine)


@settings(max_examples=400, deadline=None)
@given(_values, st.sampled_from(["vllm", "sglang"]))
def test_fuzz_arbitrary_msgpack_structures(value: Any, engine: str) -> None:
    _decode_only_decode_errors(frames(value), engine)


_field_values = st.dictionaries(
    st.sampled_from(
        [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "cache_salt",
            "metadata",
            "data_parallel_rank",
        ]
    ),
    _values,
    max_size=8,
)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
    _field_values,
    st.booleans(),
    st.sampled_from(["vllm", "sglang"]),
)
def test_fuzz_events_with_known_tags_and_random_fields(
    tag: str, fields: dict[str, Any], as_array: bool, engine: str
) -> None:
    event: Any = [tag, *fields.values()] if as_array else {"type": tag, **fields}
    _decode_only_decode_errors(frames([1.0, [event], 0]), engine)


# --------------------------------------------------------------------------- replay


def test_replay_request_and_both_reply_forms() -> None:
    assert backfill_request_frames(5) == [b"", b"\x00\x00\x00\x00\x00\x00\x00\x05"]
    seq7 = (7).to_bytes(8, "big")
    assert split_backfill_reply([b"", seq7, b"payload"]) == (b"", 7, b"payload")
    assert split_backfill_reply([b"", b"topic", seq7, b"p"]) == (b"topic", 7, b"p")
    end = (-1).to_bytes(8, "big", signed=True)
    assert split_backfill_reply([b"", end, b""]) is None
    assert split_backfill_reply([b"", b"", end, b""]) is None
    bad_replies: list[Any] = [[b"x", seq7, b"p"], [b"", b"\x01", b"p"], [b""], "x"]
    for bad in bad_replies:
        with pytest.raises(DecodeError):
            split_backfill_reply(bad)
