"""The index contract (house rule 5): the behaviour every backend of
:class:`~foretoken.core.index.protocol.Index` must show, run against each of them
(``INDEX_BACKENDS``), by hand here and against a brute-force model in
``test_index_model.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from foretoken.core.index.protocol import (
    INDEX_BACKENDS,
    Index,
    IndexBackend,
    make_index,
    restore_index,
)
from foretoken.core.index.state import CacheHit
from foretoken.core.types import EngineBlockHash, ModelName, WorkerId
from foretoken.wire.records import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    IndexReset,
    KvEvent,
    KvEventBatch,
    Tier,
)


@pytest.fixture(autouse=True, params=INDEX_BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[IndexBackend]:
    """Every test here runs against every backend of the index."""
    global _BACKEND
    _BACKEND = request.param
    yield request.param
    _BACKEND = INDEX_BACKENDS[0]


_BACKEND: IndexBackend = INDEX_BACKENDS[0]


def new_index() -> Index:
    return make_index(_BACKEND)


M = ModelName("m")
BS = 2


def batch(worker: str, *events: KvEvent, seq: int = 0, model: str = M) -> KvEventBatch:
    return KvEventBatch(
        worker_id=WorkerId(worker), model=ModelName(model), seq=seq, ts=0.0, events=events
    )


def stored(
    hashes: Sequence[int],
    tokens: Sequence[int],
    *,
    parent: int | None = None,
    medium: Tier = "GPU",
    block_size: int = BS,
    **extra: object,
) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(EngineBlockHash(h) for h in hashes),
        parent_block_hash=None if parent is None else EngineBlockHash(parent),
        token_ids=tuple(tokens),
        block_size=block_size,
        medium=medium,
        **extra,
    )


def removed(hashes: Sequence[int], medium: Tier = "GPU", group_idx: int = 0) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=tuple(EngineBlockHash(h) for h in hashes), medium=medium, group_idx=group_idx
    )


def toks(blocks: int, start: int = 100, size: int = BS) -> list[int]:
    return list(range(start, start + blocks * size))


def tokens_of(hit: CacheHit) -> dict[str, int]:
    return {tier: n for tier, n in hit.by_tier().items() if n}


def fresh(*workers: str, block_size: int = BS, **flags: object) -> Index:
    index = new_index()
    for worker in workers:
        index.register_worker(WorkerId(worker), M, block_size, **flags)
    return index


# --------------------------------------------------------------------------- by hand


def test_each_worker_gets_its_longest_prefix_in_one_lookup() -> None:
    index = fresh("a", "b", "c")
    prompt = toks(4)
    index.apply(batch("a", stored([1, 2, 3, 4], prompt)), 0.0)
    index.apply(batch("b", stored([5], prompt[:2]), stored([6], prompt[2:4], parent=5)), 0.0)
    hits = index.lookup(M, [*prompt, 7])  # a trailing partial block is never credited
    assert {w: h.tokens for w, h in hits.items()} == {"a": 8, "b": 4, "c": 0}
    assert tokens_of(hits[WorkerId("a")]) == {"GPU": 8}


def test_a_chain_split_across_events_hashes_like_one_event() -> None:
    index = fresh("a", "b")
    prompt = toks(3)
    index.apply(batch("a", stored([1, 2, 3], prompt)), 0.0)
    index.apply(batch("b", stored([9], prompt[:2])), 0.0)
    index.apply(batch("b", stored([8], prompt[2:4], parent=9)), 0.0)
    index.apply(batch("b", stored([7], prompt[4:6], parent=8)), 0.0)
    assert index.lookup(M, prompt)[WorkerId("b")].tokens == 6
    own = index.hash_prompt(M, BS, prompt)
    assert own.dtype == np.uint64 and len(own) == 3
    assert index.lookup(M, own_hashes={BS: own}) == index.lookup(M, prompt)


def test_eviction_ends_the_prefix_at_the_evicted_block() -> None:
    index = fresh("a")
    prompt = toks(4)
    index.apply(batch("a", stored([1, 2, 3, 4], prompt)), 0.0)
    stats = index.apply(batch("a", removed([3])), 0.0)
    assert stats.removed_blocks == 1
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 4
    assert index.stats()["workers"]["a"]["blocks"]["GPU"] == 3  # type: ignore[index]


def test_a_duplicate_copy_needs_two_removals() -> None:
    index = fresh("a")
    prompt = toks(1)
    index.apply(batch("a", stored([1], prompt), stored([1], prompt)), 0.0)
    index.apply(batch("a", removed([1])), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 2
    index.apply(batch("a", removed([1])), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 0
    assert index.totals.duplicate_stores == 1
    third = index.apply(batch("a", removed([1])), 0.0)
    assert third.unknown_removals == 1


def test_clear_all_per_medium_then_all() -> None:
    index = fresh("a", "b")
    prompt = toks(2)
    index.apply(
        batch("a", stored([1], prompt[:2]), stored([2], prompt[2:], parent=1, medium="CPU")), 0.0
    )
    index.apply(batch("b", stored([1, 2], prompt)), 0.0)
    index.apply(batch("a", AllCleared(medium="CPU")), 0.0)
    hits = index.lookup(M, prompt)
    assert hits[WorkerId("a")].tokens == 2 and hits[WorkerId("b")].tokens == 4
    index.apply(batch("a", AllCleared()), 0.0)
    hits = index.lookup(M, prompt)
    assert hits[WorkerId("a")].tokens == 0 and hits[WorkerId("b")].tokens == 4


def test_a_store_without_tokens_moves_the_block_to_another_tier() -> None:
    index = fresh("a")
    prompt = toks(2)
    index.apply(batch("a", stored([1, 2], prompt)), 0.0)
    empty = BlockStored(
        block_hashes=(EngineBlockHash(1), EngineBlockHash(2)), block_size=BS, medium="CPU"
    )
    index.apply(batch("a", empty), 0.0)
    assert tokens_of(index.lookup(M, prompt)[WorkerId("a")]) == {"GPU": 4}  # best tier wins
    index.apply(batch("a", removed([1, 2])), 0.0)
    assert tokens_of(index.lookup(M, prompt)[WorkerId("a")]) == {"CPU": 4}
    index.apply(batch("a", removed([1, 2], medium="CPU")), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 0
    unknown = BlockStored(block_hashes=(EngineBlockHash(77),), block_size=BS, medium="CPU")
    assert index.apply(batch("a", unknown), 0.0).unknown_moves == 1


def test_a_prefix_continuing_in_a_slower_tier_is_split_per_tier() -> None:
    index = fresh("a")
    prompt = toks(5)
    index.apply(batch("a", stored([1, 2], prompt[:4])), 0.0)
    index.apply(batch("a", stored([3, 4], prompt[4:8], parent=2, medium="CPU")), 0.0)
    index.apply(batch("a", stored([5], prompt[8:], parent=4, medium="DISK")), 0.0)
    hit = index.lookup(M, prompt)[WorkerId("a")]
    assert tokens_of(hit) == {"GPU": 4, "CPU": 4, "DISK": 2}
    assert hit.tokens == 10 and hit.slowest_tier == "DISK"


def test_a_prefix_held_only_in_slower_tiers_is_credited_to_them() -> None:
    index = fresh("a")
    prompt = toks(2)
    index.apply(batch("a", stored([1], prompt[:2], medium="DISK")), 0.0)
    index.apply(batch("a", stored([2], prompt[2:], parent=1, medium="DISK")), 0.0)
    moved = BlockStored(block_hashes=(EngineBlockHash(2),), block_size=BS, medium="CPU")
    index.apply(batch("a", moved), 0.0)
    assert tokens_of(index.lookup(M, prompt)[WorkerId("a")]) == {"DISK": 2, "CPU": 2}


def test_eagle_does_not_credit_the_last_matched_block() -> None:
    index = fresh("plain")
    index.register_worker(WorkerId("eagle"), M, BS, eagle=True)
    prompt = toks(3)
    for worker in ("plain", "eagle"):
        index.apply(
            batch(
                worker, stored([1, 2], prompt[:4]), stored([3], prompt[4:], parent=2, medium="CPU")
            ),
            0.0,
        )
    hits = index.lookup(M, prompt)
    assert tokens_of(hits[WorkerId("plain")]) == {"GPU": 4, "CPU": 2}
    assert tokens_of(hits[WorkerId("eagle")]) == {"GPU": 4}
    assert index.lookup(M, prompt[:2])[WorkerId("eagle")].tokens == 0


def test_only_full_attention_groups_count() -> None:
    index = fresh("a")
    prompt = toks(2)
    window = stored([1, 2], prompt, group_idx=1, full_attention=False)
    stats = index.apply(batch("a", window), 0.0)
    assert stats.ignored_blocks == 2 and index.lookup(M, prompt)[WorkerId("a")].tokens == 0
    index.apply(batch("a", stored([1, 2], prompt)), 0.0)
    # the sliding-window group evicts its copy of the same hashes: the prefix stays
    index.apply(batch("a", removed([1, 2], group_idx=1)), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 4


def test_a_kindless_store_of_a_group_known_not_to_be_full_attention_is_ignored() -> None:
    """vLLM's offload connector stores placeholders (no tokens, no kind) for every group,
    sliding-window ones too; the GPU stores told us that group is not full attention.
    Before: the placeholder was taken as a full-attention CPU copy and outlived the GPU one."""
    index = fresh("a")
    prompt = toks(2)
    index.apply(batch("a", stored([1, 2], prompt),
                      stored([1, 2], prompt, group_idx=1, full_attention=False)), 0.0)  # fmt: skip
    placeholder = stored([1, 2], [], medium="CPU", group_idx=1)
    stats = index.apply(batch("a", placeholder, seq=1), 0.0)
    assert stats.ignored_blocks == 2
    assert tokens_of(index.lookup(M, prompt)[WorkerId("a")]) == {"GPU": 4}
    index.apply(batch("a", removed([1, 2]), seq=2), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 0
    # a store with its tokens and no kind (older engines) is still a prefix, whatever the
    # group was said to be before (a garbled event must not blind the worker for good)
    index.apply(batch("a", stored([1, 2], prompt, group_idx=1), seq=3), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 4


def test_two_full_attention_groups_hold_two_copies() -> None:
    index = fresh("a")
    prompt = toks(2)
    index.apply(
        batch("a", stored([1, 2], prompt, group_idx=0), stored([1, 2], prompt, group_idx=1)), 0.0
    )
    index.apply(batch("a", removed([1, 2], group_idx=1)), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 4
    index.apply(batch("a", removed([1, 2], group_idx=0)), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 0


def test_an_engine_hash_stored_again_with_its_parent_replaces_the_root_guess() -> None:
    index = fresh("a")
    prompt = toks(2)
    index.apply(batch("a", stored([2], prompt[2:], parent=1)), 0.0)  # parent unknown yet
    assert index.lookup(M, prompt[2:])[WorkerId("a")].tokens == 2
    stats = index.apply(batch("a", stored([1, 2], prompt)), 0.0)
    assert stats.remapped_blocks == 1
    assert index.lookup(M, prompt[2:])[WorkerId("a")].tokens == 0
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 4
    index.apply(batch("a", removed([2])), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 2


def test_every_worker_of_the_model_is_reported() -> None:
    index = fresh("a", "b")
    index.register_worker(WorkerId("other-model"), ModelName("n"), BS)
    index.apply(batch("a", stored([1], toks(1))), 0.0)
    assert index.lookup(M) == {WorkerId("a"): CacheHit(BS), WorkerId("b"): CacheHit(BS)}
    assert set(index.lookup(M, toks(3))) == {WorkerId("a"), WorkerId("b")}


def test_several_block_sizes_in_one_model() -> None:
    index = new_index()
    index.register_worker(WorkerId("small"), M, 2)
    index.register_worker(WorkerId("large"), M, 4)
    prompt = toks(4, size=2)
    index.apply(batch("small", stored([1, 2, 3], prompt[:6], block_size=2)), 0.0)
    index.apply(batch("large", stored([9, 8], prompt, block_size=4)), 0.0)
    hits = index.lookup(M, prompt)
    assert hits[WorkerId("small")] == CacheHit(2, 6, gpu_tokens=6)
    assert hits[WorkerId("large")] == CacheHit(4, 8, gpu_tokens=8)
    wrong = index.apply(batch("large", stored([7], prompt[:2], block_size=2)), 0.0)
    assert wrong.block_size_mismatch_blocks == 1


def test_lmcache_chunks_are_credited_as_the_blocks_they_span() -> None:
    """LMCache stores one event per chunk of several engine blocks (its own chunk hashes, the
    previous chunk as parent, a partial last chunk); the GPU holds the engine's blocks.
    The chunks' blocks continue the GPU prefix in the CPU tier; a chunk's removal, or its
    move to another tier, takes all its blocks; a snapshot keeps that."""
    index = fresh("w")
    prompt = [*toks(12), 7]  # 25 tokens: chunks of 8 (4 blocks), 8, then 9 (4 blocks)
    index.apply(batch("w", stored([1, 2], prompt[:4])), 0.0)
    lmcache = [
        stored([901], prompt[:8], block_size=8, medium="CPU"),
        stored([902], prompt[8:16], parent=901, block_size=8, medium="CPU"),
        stored([903], prompt[16:], parent=902, block_size=9, medium="CPU"),
    ]
    applied = index.apply(batch("w", *lmcache), 0.0)
    assert applied.stored_blocks == 12 and applied.block_size_mismatch_blocks == 0
    assert tokens_of(index.lookup(M, prompt)[WorkerId("w")]) == {"GPU": 4, "CPU": 20}
    gone = index.apply(batch("w", removed([902], medium="CPU")), 0.0)
    assert gone.removed_blocks == 4 and gone.unknown_removals == 0
    assert tokens_of(index.lookup(M, prompt)[WorkerId("w")]) == {"GPU": 4, "CPU": 4}
    copy = restore_index(index.snapshot(), _BACKEND)
    for ix in (index, copy):
        moved = ix.apply(batch("w", BlockStored(block_hashes=(EngineBlockHash(901),),
                                                block_size=8, medium="DISK")), 0.0)  # fmt: skip
        assert moved.stored_blocks == 4 and moved.unknown_moves == 0
        assert ix.apply(batch("w", removed([901], medium="CPU")), 0.0).removed_blocks == 4
        assert tokens_of(ix.lookup(M, prompt)[WorkerId("w")]) == {"GPU": 4, "DISK": 4}
    # several chunks in one event, and chunks no multiple of the worker's blocks
    two = index.apply(batch("w", stored([905, 906], prompt[:16], block_size=8)), 0.0)
    assert two.stored_blocks == 8
    odd = index.apply(batch("w", stored([907, 908], prompt[:18], block_size=9)), 0.0)
    assert odd.stored_blocks == 0 and odd.block_size_mismatch_blocks == 2
    huge = index.apply(batch("w", stored([909], range(2 * 4097), block_size=2 * 4097)), 0.0)
    assert huge.stored_blocks == 0 and huge.block_size_mismatch_blocks == 1  # past MAX_SPAN


def test_an_unknown_parent_starts_a_new_root_and_is_counted() -> None:
    index = fresh("a")
    prompt = toks(2)
    stats = index.apply(batch("a", stored([2], prompt[2:], parent=1)), 0.0)
    assert stats.unknown_parents == 1
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 0
    assert index.lookup(M, prompt[2:])[WorkerId("a")].tokens == 2


def test_lora_and_extra_keys_make_blocks_distinct() -> None:
    index = fresh("a")
    prompt = toks(2)
    index.apply(batch("a", stored([1, 2], prompt, lora_name="sql")), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 0
    assert index.lookup(M, prompt, lora_name="sql")[WorkerId("a")].tokens == 4
    index.apply(batch("a", stored([3, 4], prompt, extra_keys=('["salt"]', ""))), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 0
    assert index.lookup(M, prompt, extra_keys=['["salt"]'])[WorkerId("a")].tokens == 4


def test_store_only_entries_age_out_after_the_ttl() -> None:
    index = fresh("a", store_only_ttl_s=10.0)
    prompt = toks(2)
    index.apply(batch("a", stored([1, 2], prompt)), 0.0)
    hit = index.lookup(M, prompt)[WorkerId("a")]
    assert hit.tokens == 4 and hit.approximate
    assert index.maintain(9.0).expired_blocks == 0
    assert index.maintain(10.5).expired_blocks == 2
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 0
    assert index.stats()["workers"]["a"]["engine_hashes"] == 0  # type: ignore[index]


def test_store_only_capacity_trims_the_least_recently_used() -> None:
    index = fresh("a", capacity_blocks=2)
    first, second, third = toks(1, 100), toks(1, 200), toks(1, 300)
    index.apply(batch("a", stored([1], first)), 0.0)
    index.apply(batch("a", stored([2], second)), 1.0)
    index.lookup(M, first, now_s=2.0)  # a lookup makes `first` the most recent
    stats = index.apply(batch("a", stored([3], third)), 3.0)
    assert stats.trimmed_blocks == 1
    hits = [index.lookup(M, p)[WorkerId("a")].tokens for p in (first, second, third)]
    assert hits == [2, 0, 2]


def test_a_refresh_is_not_replayed_after_the_worker_is_registered_again() -> None:
    """A lookup refreshes the store-only blocks it matched when it is made; a worker
    registered with events and then again without (its LRU rebuilt, its blocks the oldest)
    does not get that refresh back."""
    index = fresh("a", store_only_ttl_s=10.0, capacity_blocks=100)
    prompt = toks(4)
    index.observe_served(WorkerId("a"), index.hash_prompt(M, BS, prompt), 0.0)
    index.lookup(M, prompt, now_s=9.0)
    index.register_worker(WorkerId("a"), M, BS)
    index.register_worker(WorkerId("a"), M, BS, store_only_ttl_s=10.0, capacity_blocks=100)
    assert index.maintain(12.0).expired_blocks == 4
    assert index.lookup(M, prompt)[WorkerId("a")].tokens == 0


@pytest.mark.parametrize(
    "dtype", ["<u4", "<i4", "<i8", "<u8", "<u2", "<i2", "u1", "i1", ">u4", ">i8"]
)
def test_token_ids_in_any_integer_array_hash_as_their_values(dtype: str) -> None:
    index = fresh("a")
    prompt = toks(3)  # ids 100..105: every dtype holds them
    index.apply(batch("a", stored([1, 2, 3], prompt)), 0.0)
    ids = np.array(prompt, dtype=dtype)
    own = index.hash_prompt(M, BS, prompt)
    assert index.hash_prompt(M, BS, ids).tolist() == own.tolist()
    assert index.lookup(M, ids)[WorkerId("a")].tokens == 6
    for hashes in (own.astype(">u8"), own.astype(np.int64), own.tolist()):
        assert index.lookup(M, own_hashes={BS: hashes})[WorkerId("a")].tokens == 6


@pytest.mark.parametrize("bad", [0, -1])
def test_hash_prompt_rejects_bad_block_sizes(bad: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        new_index().hash_prompt(M, bad, toks(2))


def test_packed_token_ids_are_whole_u32s() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        fresh("a").lookup(M, b"\x01\x00\x00\x00\x02")


def test_reset_forgets_and_flags_the_worker_until_it_clears() -> None:
    index = fresh("a", "b")
    prompt = toks(2)
    for worker in ("a", "b"):
        index.apply(batch(worker, stored([1, 2], prompt)), 0.0)
    index.apply(batch("a", IndexReset(reason="gap 5..9")), 0.0)
    index.reset_worker(WorkerId("b"), "restart")
    hits = index.lookup(M, prompt)
    assert all(h.tokens == 0 and h.approximate for h in hits.values())
    assert index.stats()["workers"]["b"]["last_reset_reason"] == "restart"  # type: ignore[index]
    assert index.totals.resets == 2
    index.apply(batch("a", AllCleared(), stored([1, 2], prompt)), 0.0)
    assert index.lookup(M, prompt)[WorkerId("a")] == CacheHit(BS, 4, gpu_tokens=4)


def test_a_restart_reset_forgets_without_flagging_the_new_stream_approximate() -> None:
    """A restarted engine starts empty: the reset it causes is exact (issue 16, finding 3)."""
    index = fresh("a")
    old, new = toks(2), toks(3, start=5000)
    index.apply(batch("a", stored([1, 2], old)), 0.0)
    index.apply(batch("a", IndexReset(reason="gap"), stored([7, 8], old)), 0.0)
    assert index.lookup(M, old)[WorkerId("a")].approximate
    restarted = IndexReset(reason="engine restarted", approximate=False)
    index.apply(batch("a", restarted, stored([4, 5, 6], new)), 1.0)
    hits = index.lookup(M, new)[WorkerId("a")]
    assert hits.tokens == 3 * BS and not hits.approximate
    assert index.lookup(M, old)[WorkerId("a")].tokens == 0
    assert index.stats()["workers"]["a"]["resets"] == 2  # type: ignore[index]


def test_unknown_workers_and_models_are_counted_and_ignored() -> None:
    index = fresh("a")
    assert index.apply(batch("ghost", stored([1], toks(1))), 0.0).unknown_worker_batches == 1
    assert (
        index.apply(batch("a", stored([1], toks(1)), model="other"), 0.0).model_mismatch_batches
        == 1
    )
    assert index.lookup(M, toks(1))[WorkerId("a")].tokens == 0
    assert index.lookup(ModelName("other"), toks(1)) == {}


def test_more_than_64_workers() -> None:
    workers = [f"w{i}" for i in range(70)]
    index = fresh(*workers)
    prompt = toks(70)
    for i, worker in enumerate(workers):
        index.apply(batch(worker, stored(range(1, i + 1), prompt[: 2 * i])), 0.0)
    hits = index.lookup(M, prompt)
    assert [hits[WorkerId(w)].tokens for w in workers] == [2 * i for i in range(70)]
    index.remove_worker(WorkerId("w69"))
    assert WorkerId("w69") not in index.lookup(M, prompt)


def test_hashes_do_not_depend_on_the_process_hash_seed(backend: IndexBackend) -> None:
    code = (
        "from foretoken.core.index.protocol import make_index; "
        f"print(make_index({backend!r}).hash_prompt('m', 4, list(range(64)), lora_name='x')"
        ".tolist())"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(proc.stdout)
    assert len(outputs) == 1


def test_snapshot_restore_round_trip() -> None:
    index = fresh("a")
    index.register_worker(
        WorkerId("b"), M, BS, eagle=True, store_only_ttl_s=30.0, capacity_blocks=10
    )
    prompt = toks(3)
    events = [
        stored([1, 2], prompt[:4]),
        stored([1], prompt[:2]),
        stored([3], prompt[4:], parent=2, medium="CPU"),
    ]
    for worker in ("a", "b"):
        index.apply(batch(worker, *events, seq=7), 1.0)
    index.apply(
        batch("a", stored([5], toks(1, 900), group_idx=2, full_attention=False), seq=8), 1.0
    )
    index.lookup(M, prompt, now_s=1.5)  # a pending LRU refresh of store-only worker b
    data = index.snapshot()
    copy = restore_index(data, _BACKEND)
    assert copy.snapshot() == data
    assert copy.lookup(M, prompt) == index.lookup(M, prompt)
    assert copy.stats() == index.stats()
    assert copy.last_seq(WorkerId("a")) == {0: 8}
    later = [removed([1]), removed([1]), removed([5], group_idx=2), removed([3], medium="CPU")]
    for target in (index, copy):
        target.apply(batch("a", *later), 2.0)
    assert copy.snapshot() == index.snapshot()


@pytest.mark.parametrize("bad", [0, -1])
def test_register_rejects_bad_block_sizes(bad: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        new_index().register_worker(WorkerId("a"), M, bad)
