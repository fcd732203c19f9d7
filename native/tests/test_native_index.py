"""NativeIndex through its Python binding: event forms (tuples with packed bytes or ints,
msgspec structs like the reference's records), lookups from every input form, stats keys,
snapshots, and errors. The index's semantics are tested in Rust (tests/*.rs); this checks
the binding."""

from __future__ import annotations

import array

import foretoken_native as fn
import msgspec
import numpy as np
import pytest

M, BS = "m", 2
CACHE_HIT_FIELDS = ("block_size", "tokens", "gpu_tokens", "cpu_tokens", "disk_tokens",
                    "shared_tokens", "approximate")  # fmt: skip

# The keys of the Python reference's PrefixIndex.stats() (predictor/index.py at cf2e55d).
WORKER_KEYS = {"model", "block_size", "eagle", "store_only", "approximate", "resets",
               "last_reset_reason", "last_seq", "blocks", "engine_hashes", "duplicate_copies",
               "recently_removed"}  # fmt: skip
APPLY_STATS = ("batches", "stored_blocks", "removed_blocks", "duplicate_stores",
               "unknown_parents", "unknown_removals", "absent_removals", "unknown_moves",
               "remapped_blocks", "ignored_blocks", "block_size_mismatch_blocks",
               "malformed_blocks", "clears", "resets", "expired_blocks", "trimmed_blocks",
               "unknown_worker_batches", "model_mismatch_batches", "recovered_parents",
               "recovered_moves")  # fmt: skip


# The reference's records (streams/records.py), reduced to what the index reads.
class BlockStored(msgspec.Struct, kw_only=True, frozen=True, tag="stored"):
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int
    lora_name: str | None = None
    medium: str = "GPU"
    group_idx: int = 0
    full_attention: bool = True
    extra_keys: tuple[str, ...] = ()


class BlockRemoved(msgspec.Struct, kw_only=True, frozen=True, tag="removed"):
    block_hashes: tuple[int, ...]
    medium: str = "GPU"
    group_idx: int = 0


class AllCleared(msgspec.Struct, kw_only=True, frozen=True, tag="cleared"):
    medium: str | None = None


class IndexReset(msgspec.Struct, kw_only=True, frozen=True, tag="reset"):
    reason: str


class KvEventBatch(msgspec.Struct, kw_only=True, frozen=True):
    worker_id: str
    model: str
    seq: int
    ts: float
    dp_rank: int = 0
    events: tuple[object, ...]


def packed(ids: list[int]) -> bytes:
    return array.array("I", ids).tobytes()


def u64s(hashes: list[int]) -> bytes:
    return array.array("Q", hashes).tobytes()


def toks(blocks: int, start: int = 100) -> list[int]:
    return list(range(start, start + blocks * BS))


def fresh(*workers: str, **flags: object) -> fn.NativeIndex:
    index = fn.NativeIndex()
    for w in workers:
        index.register_worker(w, M, BS, **flags)
    return index


def hit(index: fn.NativeIndex, worker: str, tokens: object, **kw: object) -> dict[str, object]:
    values = index.lookup(M, tokens, **kw)[worker]
    return dict(zip(CACHE_HIT_FIELDS, values, strict=True))


def test_module_constants() -> None:
    assert fn.APPLY_STATS_FIELDS == APPLY_STATS
    assert fn.TIERS == ("GPU", "CPU", "DISK", "SHARED")
    assert fn.HASH_SPEC == 2


def test_tuples_with_bytes_or_ints_and_msgspec_batches_agree() -> None:
    prompt = toks(5)
    by_bytes, by_ints, by_structs = fresh("a"), fresh("a"), fresh("a")
    by_bytes.apply_batch("a", M, 3, 0, [
        ("stored", u64s([1, 2]), None, packed(prompt[:4]), BS),
        ("stored", u64s([3, 4]), 2, packed(prompt[4:8]), BS, None, "CPU"),
        ("stored", u64s([5]), 4, packed(prompt[8:]), BS, None, "DISK", 0, True, ()),
        ("removed", u64s([1]), "GPU", 0),
    ], 0.0)  # fmt: skip
    by_ints.apply_batch("a", M, 3, 0, [
        ("stored", [1, 2], None, tuple(prompt[:4]), BS),
        ("stored", (3, 4), 2, prompt[4:8], BS, None, "CPU"),
        ("stored", [5], 4, np.array(prompt[8:], dtype=np.int64), BS, None, "DISK", 0, True),
        ("removed", [1]),
    ], 0.0)  # fmt: skip
    stats = by_structs.apply(KvEventBatch(worker_id="a", model=M, seq=3, ts=0.0, events=(
        BlockStored(block_hashes=(1, 2), token_ids=tuple(prompt[:4]), block_size=BS),
        BlockStored(block_hashes=(3, 4), parent_block_hash=2, token_ids=tuple(prompt[4:8]),
                    block_size=BS, medium="CPU"),
        BlockStored(block_hashes=(5,), parent_block_hash=4, token_ids=tuple(prompt[8:]),
                    block_size=BS, medium="DISK"),
        BlockRemoved(block_hashes=(1,)),
    )), 0.0)  # fmt: skip
    counters = dict(zip(fn.APPLY_STATS_FIELDS, stats, strict=True))
    assert counters["stored_blocks"] == 5 and counters["removed_blocks"] == 1
    results = [(i.lookup(M, packed(prompt)), i.stats(), i.last_seq("a")) for i in
               (by_bytes, by_ints, by_structs)]  # fmt: skip
    assert results[0] == results[1] == results[2]
    # block 1 left the GPU: the prefix ends before it
    assert hit(by_bytes, "a", packed(prompt))["tokens"] == 0
    assert by_bytes.last_seq("a") == {0: 3}


def test_tiers_eagle_clear_and_reset_through_the_binding() -> None:
    index = fresh("plain")
    index.register_worker("eagle", M, BS, eagle=True)
    prompt = toks(3)
    for w in ("plain", "eagle"):
        index.apply_batch(w, M, 0, 0, [
            ("stored", [1, 2], None, packed(prompt[:4]), BS),
            ("stored", [3], 2, packed(prompt[4:]), BS, None, "CPU"),
        ], 0.0)  # fmt: skip
    plain = hit(index, "plain", packed(prompt))
    assert (plain["tokens"], plain["gpu_tokens"], plain["cpu_tokens"]) == (6, 4, 2)
    eagle = hit(index, "eagle", packed(prompt))
    assert (eagle["tokens"], eagle["gpu_tokens"], eagle["cpu_tokens"]) == (4, 4, 0)
    index.apply_batch("plain", M, 1, 0, [("cleared", "CPU")], 0.0)
    assert hit(index, "plain", packed(prompt))["tokens"] == 4
    index.apply_batch("plain", M, 2, 0, [("reset", "gap 3..9")], 0.0)
    fields = (BS, 0, 0, 0, 0, 0, True)
    assert hit(index, "plain", packed(prompt)) == dict(zip(CACHE_HIT_FIELDS, fields, strict=True))
    index.apply_batch("plain", M, 3, 0, [("cleared", None)], 0.0)
    assert hit(index, "plain", packed(prompt))["approximate"] is False
    assert index.totals["resets"] == 1 and index.totals["clears"] == 2


def test_lookup_inputs_agree_and_cover_every_worker() -> None:
    index = fresh("a", "b")
    index.register_worker("other", "n", BS)
    prompt = toks(40)
    index.apply_batch("a", M, 0, 0, [("stored", list(range(1, 41)), None, packed(prompt), BS)], 0.0)
    own = index.hash_prompt(M, BS, packed(prompt))
    assert own.dtype == np.uint64 and len(own) == 40
    assert own.tolist() == fn.chain(fn.root_seed(b"", M, BS, None), prompt, BS).tolist()
    expected = index.lookup(M, packed(prompt))
    assert set(expected) == {"a", "b"}
    assert expected["a"][1] == 80 and expected["b"][1] == 0
    for form in (prompt, np.array(prompt, dtype=np.uint32), np.array(prompt)):
        assert index.lookup(M, form) == expected
    for hashes in (own, own.tobytes(), own.tolist()):
        assert index.lookup(M, own_hashes={BS: hashes}) == expected
    assert index.lookup(M, own_hashes={BS + 1: own}) == {w: (BS, 0, 0, 0, 0, 0, False)
                                                          for w in ("a", "b")}  # fmt: skip
    assert index.lookup("nobody", packed(prompt)) == {}


def test_stats_have_the_reference_keys() -> None:
    index = fresh("a", store_only_ttl_s=30.0, capacity_blocks=10)
    index.apply_batch("a", M, 4, 1, [("stored", [1], None, packed(toks(1)), BS)], 1.0)
    stats = index.stats()
    assert set(stats) == {"workers", "spaces", "counters"}
    worker = stats["workers"]["a"]
    assert set(worker) == WORKER_KEYS
    assert worker["store_only"] and worker["last_seq"] == {1: 4}
    assert worker["blocks"] == {"GPU": 1, "CPU": 0, "DISK": 0, "SHARED": 0}
    entries = {"GPU": 1, "CPU": 0, "DISK": 0, "SHARED": 0}
    assert stats["spaces"] == [{"model": M, "block_size": BS, "workers": 1, "entries": entries}]
    assert tuple(stats["counters"]) == APPLY_STATS
    assert index.totals == stats["counters"]
    assert index.native_stats()["counters"] == {"recovered_parents": 0, "recovered_moves": 0}


def test_observe_served_age_and_maintain() -> None:
    index = fn.NativeIndex()
    index.register_worker("a", M, 16, store_only_ttl_s=60.0, capacity_blocks=100)
    prompt = list(range(64))
    own = index.hash_prompt(M, 16, prompt)
    assert index.observe_served("a", own, 0.0) == 4
    assert index.observe_served("ghost", own, 0.0) == 0
    assert index.lookup(M, prompt, now_s=1.0)["a"][1:3] == (64, 64)
    index.age(30.0)
    assert index.lookup(M, prompt)["a"][1] == 64
    expired = dict(zip(fn.APPLY_STATS_FIELDS, index.maintain(200.0), strict=True))
    assert expired["expired_blocks"] == 4
    assert index.lookup(M, prompt)["a"][1] == 0


def test_a_malformed_batch_raises_and_changes_nothing() -> None:
    index = fresh("a")
    before = index.snapshot()
    bad_batches = [
        [("stored", [1], None, packed(toks(1)), BS), ("stored", [2], None, b"\x00" * 3, BS)],
        [("stored", [1], None, packed(toks(1)), BS), ("removed", [1], "VRAM")],
        [("stored", [1], None, packed(toks(1)), BS), ("stored", [-1], None, packed(toks(1)), BS)],
        [("stored", [1], None, packed(toks(1)), BS), ("bogus",)],
        [("stored", [1], None, packed(toks(1)))],
        [("stored", u64s([1])[:5], None, packed(toks(1)), BS)],
        [42],
    ]
    for events in bad_batches:
        with pytest.raises((ValueError, TypeError, OverflowError)):
            index.apply_batch("a", M, 0, 0, events, 0.0)
        assert index.snapshot() == before


def test_snapshot_round_trip_and_refusals() -> None:
    index = fresh("a")
    index.register_worker("b", M, BS, eagle=True, store_only_ttl_s=30.0, capacity_blocks=10)
    prompt = toks(3)
    for w in ("a", "b"):
        index.apply_batch(w, M, 7, 0, [
            ("stored", [1, 2], None, packed(prompt[:4]), BS),
            ("stored", [3], 2, packed(prompt[4:]), BS, None, "CPU"),
        ], 1.0)  # fmt: skip
    data = index.snapshot()
    copy = fn.NativeIndex.restore(data)
    assert copy.snapshot() == data
    assert copy.lookup(M, packed(prompt)) == index.lookup(M, packed(prompt))
    assert copy.stats() == index.stats()
    assert fn.NativeIndex.restore(bytearray(data)).snapshot() == data
    with pytest.raises(ValueError, match="not a foretoken native index snapshot"):
        fn.NativeIndex.restore(msgspec.msgpack.encode([1, 2, b"salt", [], [], []]))
    with pytest.raises(ValueError, match=f"version 7, this build reads {fn.SNAPSHOT_VERSION}"):
        fn.NativeIndex.restore(data[:8] + (7).to_bytes(4, "little") + data[12:])
    with pytest.raises(ValueError, match="corrupt"):
        fn.NativeIndex.restore(data[:-1])


def test_registration_errors_carry_the_reference_messages() -> None:
    index = fn.NativeIndex()
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        index.register_worker("a", M, 0)
    with pytest.raises(ValueError, match="store_only_ttl_s must be > 0"):
        index.register_worker("a", M, 2, store_only_ttl_s=0.0)
    with pytest.raises(ValueError, match="capacity_blocks must be >= 1"):
        index.register_worker("a", M, 2, capacity_blocks=0)


def test_salt_changes_every_hash() -> None:
    plain, salted = fn.NativeIndex(), fn.NativeIndex(salt=b"s")
    assert salted.salt == b"s"
    prompt = toks(2)
    assert plain.hash_prompt(M, BS, prompt).tolist() != salted.hash_prompt(M, BS, prompt).tolist()


def test_hashes_and_token_ids_as_python_ints_at_their_bounds() -> None:
    """Ints are read through a fast path for exact ints: the same values as packed bytes
    (64-bit hashes up to 2^64 − 1, token ids up to 2^32 − 1), the same refusals outside
    them, and int subclasses (bool, IntEnum-like) read the slow way alike."""

    class Hash(int):
        pass

    top = 2**64 - 1
    ids = [0, 2**32 - 1, 7, 8]
    as_bytes = fresh("a")
    as_bytes.apply_batch("a", M, 1, 0, [
        ("stored", u64s([top, 5]), top - 1, packed(ids), BS), ("removed", u64s([5])),
    ], 0.0)  # fmt: skip
    for container in (tuple, list):
        as_ints = fresh("a")
        as_ints.apply_batch("a", M, 1, 0, [
            ("stored", container([top, Hash(5)]), top - 1, container(ids), BS),
            ("removed", container([Hash(5)])),
        ], 0.0)  # fmt: skip
        assert as_ints.snapshot() == as_bytes.snapshot()
    for bad in ([-1], [2**64], [top + 1, 1]):
        for container in (tuple, list):
            with pytest.raises(OverflowError):
                fresh("a").apply_batch("a", M, 1, 0, [("removed", container(bad))], 0.0)
    with pytest.raises(OverflowError):
        fresh("a").apply_batch("a", M, 1, 0, [("stored", [1], -5, packed(ids[:2]), BS)], 0.0)
    for bad_id in (-1, 2**32):
        with pytest.raises((ValueError, OverflowError)):
            fresh("a").apply_batch("a", M, 1, 0, [("stored", (1,), None, (bad_id, 1), BS)], 0.0)
