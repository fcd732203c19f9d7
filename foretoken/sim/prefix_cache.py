"""A vLLM-v1-like prefix cache of hashed KV blocks over GPU and offload tiers.

* **Hashes.** A prompt's full blocks are hashed in a chain (each block's digest covers its
  parent's digest and its own token ids); the chain is seeded per engine, the way vLLM
  seeds ``NONE_HASH``, so two engines publish different hashes for the same content. The
  published hash is the low 8 bytes of the digest, an unsigned 64-bit int (as vLLM's).
  ``kv_hash_algo`` picks the digest family (SHA-256 or xxh3-128); the byte layout is the
  simulator's own, not CBOR.
* **GPU pool.** ``gpu_blocks`` slots with reference counts and a free queue ordered for
  eviction (vLLM's ``BlockPool``): a finished request's blocks go to the tail, last block
  first (so a prefix outlives its suffix), blocks without a hash go to the head. A freed
  block keeps its hash — it can still be hit — until its slot is taken for new content;
  only then is ``BlockRemoved`` emitted (lazy eviction; the slots taken in one allocation
  share one event, where vLLM sends one per block). Two requests computing the same block
  at once make two physical copies of one hash, each stored and removed on its own.
* **Offload tiers** (optional CPU, then SHARED): when the last GPU copy of a hash is
  evicted it is copied to the first offload tier (``BlockStored`` with that medium, one
  per block); each tier is an LRU whose evictions spill to the next tier. A tier's
  evictions during one allocation share one ``BlockRemoved``, sent after that
  allocation's stores (before, if one of its hashes is stored into the tier again). An
  offload hit is loaded back into fresh GPU slots (a GPU ``BlockStored``) and its offload
  copy stays.
* **Lookup.** The longest run of GPU blocks, continued through offload tiers, capped at
  ``(num_tokens − 1) // block_size`` blocks (a hit on the whole prompt still recomputes
  the last token, hence its whole block) and, with EAGLE, minus the last matched block.
  The hit's token count is what vLLM reports as ``cached_tokens``.
* **No preemption.** A request reserves, when admitted, every block it will ever need
  (prompt + output); blocks are taken from the free queue lazily as tokens are computed.
  A request that does not fit waits; no running request is ever preempted.
* Only prompt blocks are hashed and published; blocks that hold generated tokens occupy
  slots but are never cached (the simulator's outputs are synthetic).

Events accumulate in a list that the caller drains with :meth:`PrefixCache.drain_events`.
How much they say is ``kv_events`` (:data:`KvEventDetail`): ``"full"`` (vLLM's payload,
token ids included), ``"hashes"`` (the same events with no token ids and, for offload
stores, no parent) or ``"off"`` (none: for a consumer that ignores them; the cache's
behaviour is the same at every level, only what it reports differs).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import xxhash

from foretoken.core.checks import U64_MASK
from foretoken.core.types import EngineBlockHash, RequestId
from foretoken.sim.spec import LowerTier
from foretoken.wire.records import AllCleared, BlockRemoved, BlockStored, Tier

HASH_BYTES = 8
_U64 = struct.Struct(">Q")
TOKEN_DTYPE = np.int64
KvCacheEvent = BlockStored | BlockRemoved | AllCleared
KvEventDetail = Literal["full", "hashes", "off"]
# A prompt's token ids: any sequence of ints, or a numpy integer array (kept as is).
TokenIds = Sequence[int] | np.ndarray
GPU: Tier = "GPU"


def _packed(token_ids: TokenIds) -> bytes:
    """Token ids as an event's ``packed_token_ids`` (u32 little-endian)."""
    return np.ascontiguousarray(token_ids, dtype="<u4").tobytes()


# A digest family as a hash-object constructor (``constructor(data).digest()``).
DIGESTS: dict[str, Callable[[bytes], Any]] = {
    "sha256": hashlib.sha256,
    "sha256_cbor": hashlib.sha256,
    "xxhash": xxhash.xxh3_128,
    "xxhash_cbor": xxhash.xxh3_128,
}


class BlockHasher:
    """Chained hashes of a token sequence's full blocks, seeded per engine."""

    def __init__(self, block_size: int, seed: int, algo: str = "sha256_cbor") -> None:
        if algo not in DIGESTS:
            raise ValueError(f"unknown kv hash algorithm {algo!r}")
        self.block_size = block_size
        self._new = DIGESTS[algo]
        # Where the published hash (the digest's low 8 bytes) starts.
        self._low_bytes = self._new(b"").digest_size - HASH_BYTES
        self._root = (seed & U64_MASK).to_bytes(HASH_BYTES, "big")

    def hashes(self, token_ids: TokenIds) -> tuple[EngineBlockHash, ...]:
        """One hash per full block; a trailing partial block has none (as in vLLM)."""
        num_blocks = len(token_ids) // self.block_size
        if num_blocks == 0:
            return ()
        raw = np.asarray(token_ids[: num_blocks * self.block_size], dtype=TOKEN_DTYPE).tobytes()
        stride = self.block_size * np.dtype(TOKEN_DTYPE).itemsize
        parent, new, low_bytes, unpack = self._root, self._new, self._low_bytes, _U64.unpack_from
        out: list[int] = []
        for offset in range(0, len(raw), stride):
            parent = new(parent + raw[offset : offset + stride]).digest()
            out.append(unpack(parent, low_bytes)[0])
        return cast(tuple[EngineBlockHash, ...], tuple(out))


@dataclass(frozen=True, slots=True)
class CacheHit:
    """The cached prefix of a prompt: the tier of each hit block, in prompt order."""

    tiers: tuple[Tier, ...]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    @property
    def gpu_blocks(self) -> int:
        count = 0
        for tier in self.tiers:
            if tier != GPU:
                break
            count += 1
        return count

    @property
    def cached_tokens(self) -> int:
        """What vLLM reports as ``usage.prompt_tokens_details.cached_tokens``."""
        return len(self.tiers) * self.block_size

    def tokens_in(self, tier: Tier) -> int:
        return sum(1 for t in self.tiers if t == tier) * self.block_size

    @property
    def deepest_tier(self) -> Tier | None:
        return self.tiers[-1] if self.tiers else None


# What an offload BlockStored of a block says: its parent's hash and its token ids.
_BlockContent = tuple[EngineBlockHash | None, bytes]  # parent, packed token ids


@dataclass(slots=True)
class _Table:
    """One request's blocks: physical slots in prompt order, its prompt hashes and tokens."""

    token_ids: TokenIds
    hashes: tuple[EngineBlockHash, ...]
    slots: list[int]
    num_hashed: int
    reserved: int


class _OffloadTier:
    """An LRU set of block hashes (CPU or SHARED)."""

    def __init__(self, name: LowerTier, capacity: int) -> None:
        self.name: LowerTier = name
        self.capacity = capacity
        self.lru: OrderedDict[EngineBlockHash, None] = OrderedDict()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.lru

    def touch(self, block_hash: EngineBlockHash) -> None:
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)

    def insert(self, block_hash: EngineBlockHash) -> EngineBlockHash | None:
        """Store a hash as most recent; return the least recent one if it had to go."""
        self.lru[block_hash] = None
        if len(self.lru) > self.capacity:
            evicted, _ = self.lru.popitem(last=False)
            return evicted
        return None


class PrefixCache:
    """Hashed KV blocks of one engine: GPU slots plus optional offload tiers."""

    def __init__(
        self,
        *,
        block_size: int,
        gpu_blocks: int,
        hash_seed: int,
        hash_algo: str = "sha256_cbor",
        lower_tiers: Sequence[tuple[LowerTier, int]] = (),
        eagle: bool = False,
        kv_events: KvEventDetail = "full",
    ) -> None:
        if block_size < 1 or gpu_blocks < 1:
            raise ValueError("block_size and gpu_blocks must be >= 1")
        self._emit = kv_events != "off"
        self._with_tokens = kv_events == "full"
        self.block_size = block_size
        self.gpu_blocks = gpu_blocks
        self.eagle = eagle
        self.hasher = BlockHasher(block_size, hash_seed, hash_algo)
        self._ref = [0] * gpu_blocks
        self._slot_hash: list[EngineBlockHash | None] = [None] * gpu_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(gpu_blocks))
        self._copies: dict[EngineBlockHash, dict[int, None]] = {}
        self._content: dict[EngineBlockHash, _BlockContent] = {}
        self._tiers = [_OffloadTier(name, capacity) for name, capacity in lower_tiers]
        # Block contents are kept only for the offload stores of "full" events.
        self._keep_content = self._with_tokens and bool(self._tiers)
        self._tables: dict[RequestId, _Table] = {}
        self._reserved = 0
        self._events: list[KvCacheEvent] = []
        # GPU evictions of the current allocation not yet spilled to the offload tiers.
        self._spilling: dict[EngineBlockHash, None] = {}

    # ------------------------------------------------------------------ queries

    def hash_prompt(self, token_ids: TokenIds) -> tuple[EngineBlockHash, ...]:
        return self.hasher.hashes(token_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup(self, block_hashes: Sequence[EngineBlockHash], num_tokens: int) -> CacheHit:
        """The longest cached prefix of a prompt of ``num_tokens`` tokens (no side effects)."""
        max_blocks = min(len(block_hashes), max(num_tokens - 1, 0) // self.block_size)
        tiers: list[Tier] = []
        index = 0
        while index < max_blocks and block_hashes[index] in self._copies:
            tiers.append(GPU)
            index += 1
        while index < max_blocks:
            tier = self._offload_tier_of(block_hashes[index])
            if tier is None:
                break
            tiers.append(tier.name)
            index += 1
        if self.eagle and tiers:
            tiers.pop()
        return CacheHit(tiers=tuple(tiers), block_size=self.block_size)

    def can_allocate(
        self, block_hashes: Sequence[EngineBlockHash], hit: CacheHit, total_blocks: int
    ) -> bool:
        """Whether a request needing ``total_blocks`` over its life fits beside the others."""
        hit_slots = [self._first_copy(h) for h in block_hashes[: hit.gpu_blocks]]
        leaving_free_queue = sum(1 for slot in set(hit_slots) if self._ref[slot] == 0)
        new_blocks = total_blocks - hit.gpu_blocks
        return len(self._free) - self._reserved - leaving_free_queue >= new_blocks

    @property
    def num_free_blocks(self) -> int:
        """GPU slots nobody references (some still hold a hash and can be hit)."""
        return len(self._free)

    @property
    def num_reserved_blocks(self) -> int:
        return self._reserved

    @property
    def num_cached_gpu_blocks(self) -> int:
        """GPU slots holding a hash (physical copies)."""
        return sum(len(copies) for copies in self._copies.values())

    def gpu_copies(self, block_hash: EngineBlockHash) -> int:
        return len(self._copies.get(block_hash, ()))

    def resident(self, tier: Tier) -> frozenset[EngineBlockHash]:
        """The hashes a tier holds now."""
        if tier == GPU:
            return frozenset(self._copies)
        for offload in self._tiers:
            if offload.name == tier:
                return frozenset(offload.lru)
        return frozenset()

    def tier_usage(self) -> dict[Tier, int]:
        """Blocks in use per tier: referenced GPU slots (as vLLM's KV usage counts them),
        entries of each offload tier."""
        usage: dict[Tier, int] = {GPU: self.gpu_blocks - len(self._free)}
        for offload in self._tiers:
            usage[offload.name] = len(offload.lru)
        return usage

    def free_queue_order(self) -> tuple[int, ...]:
        """Free GPU slots, next to be reused first."""
        return tuple(self._free)

    def slot_hash(self, slot: int) -> EngineBlockHash | None:
        return self._slot_hash[slot]

    def drain_events(self) -> list[KvCacheEvent]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ request life

    def allocate(
        self,
        request_id: RequestId,
        token_ids: TokenIds,
        block_hashes: Sequence[EngineBlockHash],
        hit: CacheHit,
        total_blocks: int,
    ) -> None:
        """Admit a request: take its GPU hit, load its offload hit into GPU slots and
        reserve the rest of the ``total_blocks`` it will need."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if not self.can_allocate(block_hashes, hit, total_blocks):
            raise ValueError(f"request {request_id!r} does not fit in the free GPU blocks")
        for block_hash in block_hashes[hit.gpu_blocks : hit.num_blocks]:
            for offload in self._tiers:
                offload.touch(block_hash)
        slots = [self._acquire(self._first_copy(h)) for h in block_hashes[: hit.gpu_blocks]]
        reserved = total_blocks - hit.gpu_blocks
        table = _Table(token_ids, tuple(block_hashes), slots, hit.gpu_blocks, reserved)
        self._tables[request_id] = table
        self._reserved += reserved
        self._fill(table, hit.num_blocks * self.block_size)

    def commit(self, request_id: RequestId, num_tokens: int) -> None:
        """KV for the first ``num_tokens`` tokens is being computed: hold the slots for them
        and publish the prompt blocks that became full (vLLM caches at scheduling time)."""
        self._fill(self._tables[request_id], num_tokens)

    def free(self, request_id: RequestId) -> None:
        """Release a request's blocks into the free queue (their hashes stay cached)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        self._reserved -= table.reserved
        ref, free, slot_hash = self._ref, self._free, self._slot_hash
        for slot in reversed(table.slots):
            ref[slot] -= 1
            if ref[slot] == 0:
                free[slot] = None
                if slot_hash[slot] is None:
                    free.move_to_end(slot, last=False)

    def holds(self, request_id: RequestId) -> bool:
        return request_id in self._tables

    def reset(self) -> bool:
        """Forget every hash in every tier (vLLM's reset_prefix_cache); refused while any
        block is in use."""
        if self._tables or any(self._ref):
            return False
        self._slot_hash = [None] * self.gpu_blocks
        self._copies.clear()
        self._content.clear()
        for offload in self._tiers:
            offload.lru.clear()
        if self._emit:
            self._events.append(AllCleared(medium=None))
        return True

    # ------------------------------------------------------------------ internals

    def _fill(self, table: _Table, num_tokens: int) -> None:
        missing = self.blocks_for(num_tokens) - len(table.slots)
        if missing > 0:
            if missing > table.reserved:
                raise RuntimeError("a request outgrew the blocks it reserved")
            table.slots += self._take_free_slots(missing)
            table.reserved -= missing
            self._reserved -= missing
        full = min(num_tokens // self.block_size, len(table.hashes))
        if full > table.num_hashed:
            self._publish(table, table.num_hashed, full)
            table.num_hashed = full

    def _publish(self, table: _Table, start: int, end: int) -> None:
        """Give slots start..end of a table their hashes and emit one GPU BlockStored."""
        size = self.block_size
        hashes, slots, slot_hash, copies = table.hashes, table.slots, self._slot_hash, self._copies
        for index in range(start, end):
            block_hash, slot = hashes[index], slots[index]
            slot_hash[slot] = block_hash
            held = copies.get(block_hash)
            if held is None:
                copies[block_hash] = {slot: None}
            else:
                held[slot] = None
        if not self._emit:
            return
        # packed, as the ingest decoder writes them (no Python int per token)
        tokens = _packed(table.token_ids[start * size : end * size]) if self._with_tokens else b""
        if self._keep_content:
            content, width = self._content, 4 * size
            for index in range(start, end):
                if hashes[index] not in content:
                    offset = (index - start) * width
                    parent = hashes[index - 1] if index > 0 else None
                    content[hashes[index]] = (parent, tokens[offset : offset + width])
        self._events.append(
            BlockStored(
                block_hashes=hashes[start:end],
                parent_block_hash=hashes[start - 1] if start > 0 else None,
                packed_token_ids=tokens,
                block_size=size,
                medium=GPU,
            )
        )

    def _first_copy(self, block_hash: EngineBlockHash) -> int:
        return next(iter(self._copies[block_hash]))

    def _acquire(self, slot: int) -> int:
        if self._ref[slot] == 0:
            del self._free[slot]
        self._ref[slot] += 1
        return slot

    def _take_free_slots(self, count: int) -> list[int]:
        """Take slots from the head of the free queue. The hashes they held are evicted
        (one GPU BlockRemoved for all of them), and those left with no GPU copy spill
        into the offload tiers."""
        slots: list[int] = []
        removed: list[EngineBlockHash] = []
        ref, slot_hash, all_copies, take = (
            self._ref,
            self._slot_hash,
            self._copies,
            self._free.popitem,
        )
        for _ in range(count):
            slot, _ = take(last=False)
            ref[slot] = 1
            slots.append(slot)
            block_hash = slot_hash[slot]
            if block_hash is None:
                continue
            slot_hash[slot] = None
            copies = all_copies[block_hash]
            del copies[slot]
            if not copies:
                del all_copies[block_hash]
            removed.append(block_hash)
        if removed:
            if self._emit:
                self._events.append(BlockRemoved(block_hashes=tuple(removed), medium=GPU))
            if self._tiers:
                self._spill_all(removed)
        return slots

    def _spill_all(self, removed: list[EngineBlockHash]) -> None:
        """Spill the blocks one allocation evicted from GPU (those left without a GPU copy),
        in eviction order. Each offload tier's evictions share one BlockRemoved, emitted
        after the spills — or before a store of one of its hashes into the same tier."""
        # A spill may push an older copy of a later one out of the last tier; its content
        # must outlive that until its own spill.
        self._spilling = {h: None for h in removed if h not in self._copies}
        dropped: list[dict[EngineBlockHash, None]] = [{} for _ in self._tiers]
        for block_hash in tuple(self._spilling):
            del self._spilling[block_hash]
            self._spill(block_hash, dropped)
        for position in range(len(self._tiers)):
            self._flush_dropped(position, dropped)

    def _flush_dropped(self, position: int, dropped: list[dict[EngineBlockHash, None]]) -> None:
        if dropped[position] and self._emit:
            medium = self._tiers[position].name
            self._events.append(BlockRemoved(block_hashes=tuple(dropped[position]), medium=medium))
            dropped[position] = {}

    def _spill(
        self, block_hash: EngineBlockHash, dropped: list[dict[EngineBlockHash, None]]
    ) -> None:
        """Copy a block evicted from GPU into the first offload tier; each tier's LRU
        victim moves one tier down (into ``dropped``), and the last tier's victim is
        dropped."""
        for position, tier in enumerate(self._tiers):
            lru = tier.lru
            if block_hash in lru:
                lru.move_to_end(block_hash)
                return
            if block_hash in dropped[position]:
                self._flush_dropped(position, dropped)
            if self._emit:
                self._store_event(block_hash, tier.name)
            lru[block_hash] = None
            if len(lru) <= tier.capacity:
                return
            block_hash, _ = lru.popitem(last=False)
            dropped[position][block_hash] = None
        if self._keep_content:
            self._forget_if_gone(block_hash)

    def _store_event(self, block_hash: EngineBlockHash, medium: Tier) -> None:
        parent, tokens = self._content[block_hash] if self._keep_content else (None, b"")
        self._events.append(
            BlockStored(
                block_hashes=(block_hash,),
                parent_block_hash=parent,
                packed_token_ids=tokens,
                block_size=self.block_size,
                medium=medium,
            )
        )

    def _offload_tier_of(self, block_hash: EngineBlockHash) -> _OffloadTier | None:
        for tier in self._tiers:
            if block_hash in tier:
                return tier
        return None

    def _forget_if_gone(self, block_hash: EngineBlockHash) -> None:
        if (
            block_hash not in self._copies
            and block_hash not in self._spilling
            and self._offload_tier_of(block_hash) is None
        ):
            self._content.pop(block_hash, None)
