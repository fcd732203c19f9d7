"""The simulator's prefix cache against hand-worked block layouts (fleet/prefix_cache.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from foretoken.core.checks import U64_MASK
from foretoken.core.types import EngineBlockHash, RequestId
from foretoken.sim.prefix_cache import BlockHasher, CacheHit, KvCacheEvent, PrefixCache
from foretoken.sim.spec import LowerTier
from foretoken.wire.records import AllCleared, BlockRemoved, BlockStored, Tier

BLOCK = 4
SEED = 7


def make_cache(
    gpu_blocks: int = 16,
    *,
    cpu_blocks: int = 0,
    shared_blocks: int = 0,
    eagle: bool = False,
) -> PrefixCache:
    tiers: list[tuple[LowerTier, int]] = []
    if cpu_blocks:
        tiers.append(("CPU", cpu_blocks))
    if shared_blocks:
        tiers.append(("SHARED", shared_blocks))
    return PrefixCache(
        block_size=BLOCK, gpu_blocks=gpu_blocks, hash_seed=SEED, lower_tiers=tiers, eagle=eagle
    )


def serve(cache: PrefixCache, rid: str, tokens: Sequence[int], *, free: bool = True) -> CacheHit:
    """Admit a prompt, compute all of it, and (by default) finish it."""
    hashes = cache.hash_prompt(tokens)
    hit = cache.lookup(hashes, len(tokens))
    cache.allocate(RequestId(rid), tokens, hashes, hit, cache.blocks_for(len(tokens)))
    cache.commit(RequestId(rid), len(tokens))
    if free:
        cache.free(RequestId(rid))
    return hit


def removed(events: Sequence[KvCacheEvent], medium: Tier = "GPU") -> list[EngineBlockHash]:
    return [
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.medium == medium
        for h in e.block_hashes
    ]


def stored(events: Sequence[KvCacheEvent], medium: Tier = "GPU") -> list[EngineBlockHash]:
    return [
        h
        for e in events
        if isinstance(e, BlockStored) and e.medium == medium
        for h in e.block_hashes
    ]


A = list(range(100, 108))  # two full blocks
B = list(range(200, 208))
C = list(range(300, 308))


# --------------------------------------------------------------------------- hashing


def test_hashes_are_chained_unsigned_64_bit_and_seeded_per_engine() -> None:
    hasher = BlockHasher(BLOCK, seed=1)
    hashes = hasher.hashes([*A, 999])  # the trailing partial block has no hash
    assert len(hashes) == 2
    assert all(0 <= h <= U64_MASK for h in hashes)
    # Same first block, different second block: the first hash is shared, the second not.
    other = hasher.hashes([*A[:4], 1, 2, 3, 4])
    assert other[0] == hashes[0] and other[1] != hashes[1]
    # Same second block after a different first block: chaining makes it differ.
    assert hasher.hashes([9, 9, 9, 9, *A[4:]])[1] != hashes[1]
    assert BlockHasher(BLOCK, seed=2).hashes(A) != hashes
    assert BlockHasher(BLOCK, seed=1, algo="xxhash").hashes(A) != hashes
    assert BlockHasher(BLOCK, seed=1).hashes(A) == hashes


# --------------------------------------------------------------------------- lookup rules


def test_whole_prompt_hit_recomputes_the_last_block() -> None:
    cache = make_cache()
    serve(cache, "a", A)
    # 8 cached tokens, an 8-token prompt: (8 - 1) // 4 = 1 block can be credited.
    again = cache.lookup(cache.hash_prompt(A), len(A))
    assert again.tiers == ("GPU",) and again.cached_tokens == 4
    # One more token: both blocks are credited and only the new token is computed.
    longer = [*A, 1]
    assert cache.lookup(cache.hash_prompt(longer), len(longer)).cached_tokens == 8


def test_eagle_drops_the_last_matched_block() -> None:
    cache = make_cache(eagle=True)
    serve(cache, "a", [*A, *B])  # four blocks cached
    prompt = [*A, *B, 1]
    # Four blocks match; EAGLE recomputes the last one.
    assert cache.lookup(cache.hash_prompt(prompt), len(prompt)).cached_tokens == 12
    # Whole-prompt cap first (3 blocks), then EAGLE (2 blocks).
    assert cache.lookup(cache.hash_prompt([*A, *B]), 16).cached_tokens == 8


def test_hit_stops_at_the_first_missing_block() -> None:
    cache = make_cache()
    serve(cache, "a", [*A, *B])
    prompt = [*A[:4], *C, *B, 1]  # block 1 differs, so block 3's chained hash differs too
    assert cache.lookup(cache.hash_prompt(prompt), len(prompt)).cached_tokens == 4


# --------------------------------------------------------------------------- GPU pool


def test_eviction_is_lazy_and_in_lru_order_suffix_first() -> None:
    cache = make_cache(gpu_blocks=4)
    a0, a1 = cache.hash_prompt(A)
    b0, b1 = cache.hash_prompt(B)
    serve(cache, "a", A)
    serve(cache, "b", B)
    events = cache.drain_events()
    assert stored(events) == [a0, a1, b0, b1]
    assert removed(events) == []  # freed blocks keep their hashes
    assert cache.resident("GPU") == {a0, a1, b0, b1}
    # The pool is full of freed blocks; the next prompt reuses A's (freed first), and
    # A's last block goes before its first.
    serve(cache, "c", C)
    assert removed(cache.drain_events()) == [a1, a0]
    assert cache.resident("GPU") == {b0, b1, *cache.hash_prompt(C)}


def test_a_hit_refreshes_a_block_so_it_is_evicted_last() -> None:
    cache = make_cache(gpu_blocks=5)
    a0, a1 = cache.hash_prompt(A)
    b0, b1 = cache.hash_prompt(B)
    serve(cache, "a", A)
    serve(cache, "b", B)
    # A 5-token prompt hits A's first block (one slot for its 5th token is still free):
    # a0 leaves the free queue and is freed again after B's blocks.
    serve(cache, "a-again", [*A[:4], 5])
    assert removed(cache.drain_events()) == []
    serve(cache, "c", list(range(300, 312)))  # 3 blocks: the unhashed slot, a1, b1
    serve(cache, "d", list(range(400, 408)))  # 2 blocks: b0, then the refreshed a0
    assert removed(cache.drain_events()) == [a1, b1, b0, a0]


def test_a_referenced_block_is_never_evicted() -> None:
    cache = make_cache(gpu_blocks=4)
    a0, a1 = cache.hash_prompt(A)
    serve(cache, "a", A, free=False)
    assert not cache.can_allocate(cache.hash_prompt(B), CacheHit((), BLOCK), 3)
    serve(cache, "b", B)
    assert removed(cache.drain_events()) == []
    assert {a0, a1} <= cache.resident("GPU")


def test_concurrent_computation_makes_duplicate_copies() -> None:
    cache = make_cache()
    hashes = cache.hash_prompt(A)
    miss = cache.lookup(hashes, len(A))
    for rid in ("x", "y"):
        cache.allocate(RequestId(rid), A, hashes, miss, 2)
    for rid in ("x", "y"):
        cache.commit(RequestId(rid), len(A))
    assert stored(cache.drain_events()) == [*hashes, *hashes]
    assert cache.gpu_copies(hashes[0]) == 2
    assert cache.num_cached_gpu_blocks == 4


def test_blocks_without_a_hash_are_reused_first() -> None:
    cache = make_cache(gpu_blocks=4)
    serve(cache, "a", [*A[:4], 1, 2])  # one hashed block, one partial block
    order = cache.free_queue_order()
    assert cache.slot_hash(order[0]) is None  # the partial block, first to go
    assert cache.slot_hash(order[-1]) == cache.hash_prompt(A)[0]


def test_reset_clears_every_tier_only_when_nothing_is_in_use() -> None:
    cache = make_cache(gpu_blocks=2, cpu_blocks=4)
    serve(cache, "a", A)
    serve(cache, "b", B, free=False)  # evicts A into the CPU tier
    assert cache.resident("CPU")
    assert not cache.reset()
    cache.free(RequestId("b"))
    cache.drain_events()
    assert cache.reset()
    assert cache.drain_events() == [AllCleared(medium=None)]
    assert not cache.resident("GPU") and not cache.resident("CPU")
    assert cache.lookup(cache.hash_prompt([*B, 1]), 9).cached_tokens == 0


# --------------------------------------------------------------------------- offload tiers


def test_gpu_eviction_offloads_to_cpu_and_a_cpu_hit_is_loaded_back() -> None:
    cache = make_cache(gpu_blocks=3, cpu_blocks=8)
    a0, a1 = cache.hash_prompt(A)
    serve(cache, "a", A)
    cache.drain_events()
    serve(cache, "b", list(range(200, 212)))  # 3 blocks: the free one, then a1, a0
    events = cache.drain_events()
    assert removed(events) == [a1, a0]
    assert stored(events, "CPU") == [a1, a0]
    cpu_store = next(e for e in events if isinstance(e, BlockStored) and e.medium == "CPU")
    assert cpu_store.parent_block_hash == a0 and cpu_store.token_id_list() == list(A[4:])
    # A again, plus a token: both blocks come from the CPU tier and are loaded into GPU.
    hit = serve(cache, "a2", [*A, 1])
    assert hit.tiers == ("CPU", "CPU")
    assert hit.cached_tokens == 8 and hit.tokens_in("CPU") == 8
    assert {a0, a1} <= cache.resident("GPU")
    assert stored(cache.drain_events()) == [a0, a1]


def test_gpu_prefix_continues_into_cpu() -> None:
    cache = make_cache(gpu_blocks=3, cpu_blocks=4)
    a0, a1 = cache.hash_prompt(A)
    serve(cache, "a", A)
    serve(cache, "a-head", [*A[:4], 7])  # refreshes a0: a1 is now the oldest
    serve(cache, "b", B)  # two slots: a-head's unhashed one, then a1 (into CPU)
    assert a0 in cache.resident("GPU") and a1 in cache.resident("CPU")
    prompt = [*A, 1]
    assert cache.lookup(cache.hash_prompt(prompt), len(prompt)).tiers == ("GPU", "CPU")


def test_cpu_lru_spills_to_the_shared_tier_then_drops() -> None:
    cache = make_cache(gpu_blocks=2, cpu_blocks=2, shared_blocks=2)
    a0, a1 = cache.hash_prompt(A)
    b0, b1 = cache.hash_prompt(B)
    for rid, tokens in (("a", A), ("b", B), ("c", C)):
        serve(cache, rid, tokens)
    # GPU: C; CPU: B (most recent); SHARED: A.
    events = cache.drain_events()
    assert removed(events, "CPU") == [a1, a0]
    assert stored(events, "SHARED") == [a1, a0]
    assert cache.resident("CPU") == {b0, b1} and cache.resident("SHARED") == {a0, a1}
    assert cache.lookup(cache.hash_prompt([*A, 1]), 9).tiers == ("SHARED", "SHARED")
    serve(cache, "d", list(range(400, 408)))
    serve(cache, "e", list(range(500, 508)))
    assert removed(cache.drain_events(), "SHARED") == [a1, a0, b1, b0]


# --------------------------------------------------------------------------- properties


def replay(events: Sequence[KvCacheEvent]) -> dict[Tier, Counter[EngineBlockHash]]:
    """What a perfect event consumer believes each tier holds (copies per hash)."""
    held: dict[Tier, Counter[EngineBlockHash]] = {}
    for event in events:
        if isinstance(event, AllCleared):
            held.clear()
            continue
        tier = held.setdefault(event.medium, Counter())
        for block_hash in event.block_hashes:
            tier[block_hash] += 1 if isinstance(event, BlockStored) else -1
            assert tier[block_hash] >= 0, "a removal without a store"
    return held


PREFIXES = [list(range(1000 * k, 1000 * k + 12)) for k in range(4)]
prompts = st.tuples(
    st.sampled_from(range(len(PREFIXES))),
    st.integers(min_value=0, max_value=12),
    st.lists(st.integers(min_value=0, max_value=3), max_size=9),
).map(lambda t: [*PREFIXES[t[0]][: t[1]], *t[2]] or [1])
ops = st.lists(st.tuples(prompts, st.booleans()), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=ops, gpu_blocks=st.integers(6, 12), cpu_blocks=st.sampled_from([0, 3, 8]))
def test_capacity_and_event_consistency(
    ops: list[tuple[list[int], bool]], gpu_blocks: int, cpu_blocks: int
) -> None:
    cache = make_cache(gpu_blocks, cpu_blocks=cpu_blocks, shared_blocks=2 if cpu_blocks else 0)
    events: list[KvCacheEvent] = []
    held: list[RequestId] = []
    for index, (tokens, keep) in enumerate(ops):
        hashes = cache.hash_prompt(tokens)
        hit = cache.lookup(hashes, len(tokens))
        assert hit.cached_tokens <= len(tokens) - 1
        total = cache.blocks_for(len(tokens))
        while not cache.can_allocate(hashes, hit, total) and held:
            cache.free(held.pop(0))
        rid = RequestId(f"r{index}")
        cache.allocate(rid, tokens, hashes, hit, total)
        cache.commit(rid, len(tokens))
        if keep:
            held.append(rid)
        else:
            cache.free(rid)
        events += cache.drain_events()
        assert cache.num_cached_gpu_blocks <= gpu_blocks
        assert len(cache.resident("CPU")) <= cpu_blocks
        assert 0 <= cache.num_free_blocks <= gpu_blocks
    believed = replay(events)
    gpu = believed.get("GPU", Counter())
    assert {h: n for h, n in gpu.items() if n} == {
        h: cache.gpu_copies(h) for h in cache.resident("GPU")
    }
    for tier in ("CPU", "SHARED"):
        assert {h for h, n in believed.get(tier, Counter()).items() if n} == cache.resident(tier)
