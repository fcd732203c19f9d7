"""The cache index's values and state containers (used by :mod:`foretoken.core.index.prefix`).

``Space``: one (model, block size) hash space with its per-tier, per-64-slot mask tables.
``Worker``: one worker's engine-hash map, duplicate copies, counters, store-only LRU and
recently removed blocks (:mod:`foretoken.core.index.recent`).
The msgspec Structs at the end are the snapshot format.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Final

import msgspec
from msgspec.structs import astuple

from foretoken.core.index import content_hash, spans
from foretoken.core.index.recent import Recent, RecentPolicy
from foretoken.core.types import ModelName, Tier, WorkerId

TIERS: Final[tuple[Tier, ...]] = ("GPU", "CPU", "DISK", "SHARED")  # fastest first
TIER_INDEX: Final[dict[str, int]] = {tier: i for i, tier in enumerate(TIERS)}
WORD_BITS: Final = 64
# Lookups hash and walk a prompt in chunks that grow from FIRST to MAX blocks, so a prompt
# nobody holds costs one small chunk, not the whole prompt.
FIRST_CHUNK_BLOCKS: Final = 64
MAX_CHUNK_BLOCKS: Final = 1024
# Store-only producers are swept at most this often per TTL (entries live ≤ TTL·(1+1/8)) …
SWEEPS_PER_TTL: Final = 8
# … and trimmed (down to capacity exactly) once they exceed capacity by this fraction.
CAPACITY_SLACK: Final = 1 / 16


def tier_index(tier: str) -> int:
    return TIER_INDEX[tier]


@dataclass(frozen=True, slots=True)
class CacheHit:
    """One worker's cached prefix of a prompt: tokens per best tier (fastest holding tier
    of each block), their sum, and whether the index's view of the worker is approximate
    (reset after lost events, or a store-only producer aged by TTL/capacity)."""

    block_size: int
    tokens: int = 0
    gpu_tokens: int = 0
    cpu_tokens: int = 0
    disk_tokens: int = 0
    shared_tokens: int = 0
    approximate: bool = False

    def by_tier(self) -> dict[Tier, int]:
        return {
            "GPU": self.gpu_tokens,
            "CPU": self.cpu_tokens,
            "DISK": self.disk_tokens,
            "SHARED": self.shared_tokens,
        }

    @property
    def slowest_tier(self) -> Tier | None:
        """The slowest tier the hit reads from (what bounds its load time); None on a miss."""
        slowest = None
        for tier, tokens in self.by_tier().items():
            if tokens:
                slowest = tier
        return slowest


class ApplyStats(msgspec.Struct, gc=False):
    """What one ``apply`` did (and, summed, what the index did since it started)."""

    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    duplicate_stores: int = 0
    unknown_parents: int = 0
    unknown_removals: int = 0
    absent_removals: int = 0
    unknown_moves: int = 0
    remapped_blocks: int = 0
    ignored_blocks: int = 0
    block_size_mismatch_blocks: int = 0
    malformed_blocks: int = 0
    clears: int = 0
    resets: int = 0
    expired_blocks: int = 0
    trimmed_blocks: int = 0
    unknown_worker_batches: int = 0
    model_mismatch_batches: int = 0
    # The cross-tier rule (foretoken.core.index.recent): stores whose parent, and blocks of
    # stores without token ids whose engine hash, were found among the recently removed.
    recovered_parents: int = 0
    recovered_moves: int = 0

    @classmethod
    def total(cls, many: Sequence[ApplyStats]) -> ApplyStats:
        return cls(*map(sum, zip(*map(astuple, many), strict=True)))


# --------------------------------------------------------------------------- snapshot


class WorkerState(msgspec.Struct, array_like=True, gc=False):
    worker_id: WorkerId
    model: ModelName
    block_size: int
    slot: int
    eagle: bool
    ttl_s: float | None
    capacity: int | None
    approximate: bool
    resets: int
    reset_reason: str | None
    last_seq: dict[int, int]
    nonfull_groups: list[int]
    tiers: list[int]
    counts: list[int]
    emap: dict[int, int]
    dups: list[tuple[int, int, int]]
    lru: dict[int, float] | None
    rev: dict[int, int] | None
    next_sweep_s: float
    peak: int
    recent: list[list[tuple[int, int]]]


class SpaceState(msgspec.Struct, array_like=True, gc=False):
    model: str
    block_size: int
    tables: list[tuple[int, int, dict[int, int]]]  # (tier, word, own hash → mask)


class IndexState(msgspec.Struct, array_like=True, gc=False):
    version: int
    hash_spec: int
    fingerprint: int
    salt: bytes
    recent_min_blocks: int
    recent_peak_factor: float
    workers: list[WorkerState]
    spaces: list[SpaceState]
    totals: ApplyStats


# --------------------------------------------------------------------------- containers


class Space:
    """One (model, block size) hash space: slots (one bit per worker) and mask tables."""

    __slots__ = ("block_size", "masks", "model", "occupied", "salt", "seeds", "slots", "zero_hits")

    def __init__(self, model: str, block_size: int, salt: bytes) -> None:
        self.model = model
        self.block_size = block_size
        self.salt = salt
        # masks[tier][word]: own hash → bits of the workers (slots word*64 …) holding it.
        self.masks: list[list[dict[int, int]]] = [[] for _ in TIERS]
        self.slots: list[Worker | None] = []
        self.occupied: list[int] = []  # per word: bits of the slots in use
        self.seeds: dict[str | None, int] = {}
        self.zero_hits = (CacheHit(block_size), CacheHit(block_size, approximate=True))

    def take_slot(self) -> int:
        for slot, worker in enumerate(self.slots):
            if worker is None:
                return slot
        self.slots.append(None)
        self._grow(len(self.slots) - 1)
        return len(self.slots) - 1

    def _grow(self, slot: int) -> None:
        words = slot // WORD_BITS + 1
        for tables in self.masks:
            tables.extend({} for _ in range(words - len(tables)))
        self.occupied.extend(0 for _ in range(words - len(self.occupied)))

    def place(self, worker: Worker) -> None:
        while len(self.slots) <= worker.slot:
            self.slots.append(None)
        self._grow(worker.slot)
        self.slots[worker.slot] = worker
        self.occupied[worker.word] |= worker.bit

    def free(self, worker: Worker) -> None:
        self.slots[worker.slot] = None
        self.occupied[worker.word] &= ~worker.bit

    def table(self, tier: int, word: int) -> dict[int, int]:
        return self.masks[tier][word]

    def workers(self) -> Iterator[Worker]:
        return (w for w in self.slots if w is not None)

    def seed(self, lora_name: str | None) -> int:
        seed = self.seeds.get(lora_name)
        if seed is None:
            seed = content_hash.root_seed(self.salt, self.model, self.block_size, lora_name)
            self.seeds[lora_name] = seed
        return seed

    def hash_chunks(
        self, tokens: bytes, lora_name: str | None, extra_keys: Sequence[str]
    ) -> Iterator[list[int]]:
        """The prompt's own hashes (from packed u32 token ids), lazily, in growing chunks."""
        size = self.block_size
        width = 4 * size
        total = len(tokens) // width
        start, step, prev = 0, FIRST_CHUNK_BLOCKS, self.seed(lora_name)
        while start < total:
            stop = min(total, start + step)
            keys = extra_keys[start:stop] if extra_keys else ()
            chunk = content_hash.chain(prev, tokens[start * width : stop * width], size, keys)
            yield chunk
            start, step, prev = stop, min(step * 4, MAX_CHUNK_BLOCKS), chunk[-1]

    def tables_state(self) -> list[tuple[int, int, dict[int, int]]]:
        return [
            (tier, word, table)
            for tier, tables in enumerate(self.masks)
            for word, table in enumerate(tables)
            if table
        ]

    def load_tables(self, tables: list[tuple[int, int, dict[int, int]]]) -> None:
        for tier, word, table in tables:
            self._grow(word * WORD_BITS)
            self.masks[tier][word] = table


class Worker:
    """One worker's view: engine hash → own hash, copies, counters, store-only LRU."""

    __slots__ = (
        "approximate",
        "bit",
        "block_size",
        "capacity",
        "counts",
        "dups",
        "eagle",
        "emap",
        "last_seq",
        "limit",
        "lru",
        "model",
        "next_sweep_s",
        "nonfull_groups",
        "peak",
        "policy",
        "recent",
        "reset_reason",
        "resets",
        "rev",
        "slot",
        "space",
        "spans",
        "tiers",
        "ttl_s",
        "word",
        "worker_id",
    )

    def __init__(
        self,
        worker_id: WorkerId,
        model: ModelName,
        space: Space,
        slot: int,
        policy: RecentPolicy,
    ) -> None:
        self.worker_id = worker_id
        self.model = model
        self.space = space
        self.block_size = space.block_size
        self.slot = slot
        self.word, bit = divmod(slot, WORD_BITS)
        self.bit = 1 << bit
        self.eagle = False
        self.emap: dict[int, int] = {}
        # per tier: own → physical copies beyond the first (rare)
        self.dups: list[dict[int, int]] = [{} for _ in TIERS]
        self.counts = [0] * len(TIERS)
        self.tiers: set[int] = set()
        self.nonfull_groups: set[int] = set()
        self.last_seq: dict[int, int] = {}
        self.approximate = False
        self.resets = 0
        self.reset_reason: str | None = None
        self.ttl_s: float | None = None
        self.capacity: int | None = None
        self.lru: dict[int, float] | None = None  # own → last store/lookup, oldest first
        self.rev: dict[int, int] = {}  # store-only: own → engine hash
        self.next_sweep_s = math.inf
        self.limit: int | None = None  # sweep when the LRU grows past this
        self.policy = policy
        self.recent = Recent()  # recently removed blocks (the cross-tier rule)
        self.peak = 0  # the most engine hashes this worker has mapped at once
        self.spans: dict[int, int] = {}  # engine hash → blocks it spans, when more than one

    def configure_store_only(self, ttl_s: float | None, capacity: int | None) -> None:
        self.ttl_s, self.capacity = ttl_s, capacity
        self.limit = None if capacity is None else capacity + int(capacity * CAPACITY_SLACK)
        if ttl_s is None and capacity is None:
            self.lru, self.rev = None, {}
            self.next_sweep_s = math.inf
        elif self.lru is None:
            # Blocks already held become the oldest, by engine hash (the order both
            # backends can give: the maps' own orders differ).
            held = sorted(self.emap.items())
            self.lru = dict.fromkeys((own for _, own in held), -math.inf)
            self.rev = {own: eh for eh, own in held}
            self.next_sweep_s = -math.inf

    @property
    def store_only(self) -> bool:
        return self.lru is not None

    def forget_engine(self, engine_hash: int, own: int) -> None:
        """An engine hash left the map: remember it (the cross-tier rule)."""
        self.recent.insert(engine_hash, own, self.policy.capacity(self.peak))
        if self.spans:
            self.spans.pop(engine_hash, None)

    def resolve_removed(self, engine_hash: int) -> int | None:
        """The own hash a recently removed engine hash named (None: not remembered)."""
        return self.recent.get(engine_hash)

    def holds(self, own: int) -> bool:
        bit, word, masks = self.bit, self.word, self.space.masks
        return any(masks[tier][word].get(own, 0) & bit for tier in self.tiers)

    def touch(self, hashes: Sequence[int], owns: list[int], now_s: float) -> None:
        lru = self.lru
        assert lru is not None
        deque(map(lru.pop, owns, repeat(None)), 0)
        lru.update(dict.fromkeys(owns, now_s))
        self.rev.update(zip(owns, hashes, strict=True))

    def untouch(self, owns: Sequence[int]) -> int | None:
        """Forget store-only bookkeeping of blocks; returns the last one's engine hash."""
        lru = self.lru
        assert lru is not None
        engine_hash = None
        for own in owns:
            lru.pop(own, None)
            engine_hash = self.rev.pop(own, None)
        return engine_hash

    def refresh(self, owns: list[int], now_s: float) -> None:
        """A lookup used these blocks: they become the most recent (if still held)."""
        lru = self.lru
        if lru is None:
            return
        held = [own for own in owns if lru.pop(own, None) is not None]
        lru.update(dict.fromkeys(held, now_s))

    def sweep_due(self, now_s: float) -> bool:
        lru = self.lru
        return now_s >= self.next_sweep_s or (
            self.limit is not None and lru is not None and len(lru) > self.limit
        )

    def schedule_sweep(self, now_s: float) -> None:
        self.next_sweep_s = math.inf if self.ttl_s is None else now_s + self.ttl_s / SWEEPS_PER_TTL

    def victims(self, now_s: float) -> tuple[list[int], list[int]]:
        """Oldest first: blocks past the TTL, then the least recent beyond capacity."""
        lru = self.lru
        assert lru is not None
        cutoff = -math.inf if self.ttl_s is None else now_s - self.ttl_s
        excess = 0 if self.capacity is None else len(lru) - self.capacity
        expired: list[int] = []
        trimmed: list[int] = []
        for own, last_s in lru.items():
            if last_s < cutoff:
                expired.append(own)
            elif len(expired) + len(trimmed) < excess:
                trimmed.append(own)
            else:
                break
        return expired, trimmed

    def to_state(self) -> WorkerState:
        return WorkerState(
            worker_id=self.worker_id,
            model=self.model,
            block_size=self.block_size,
            slot=self.slot,
            eagle=self.eagle,
            ttl_s=self.ttl_s,
            capacity=self.capacity,
            approximate=self.approximate,
            resets=self.resets,
            reset_reason=self.reset_reason,
            last_seq=self.last_seq,
            nonfull_groups=sorted(self.nonfull_groups),
            tiers=sorted(self.tiers),
            counts=self.counts,
            emap=self.emap,
            dups=[(own, tier, n) for tier, d in enumerate(self.dups) for own, n in d.items()],
            lru=self.lru,
            rev=self.rev if self.lru is not None else None,
            next_sweep_s=self.next_sweep_s,
            peak=self.peak,
            recent=self.recent.state(),
        )

    @classmethod
    def from_state(cls, state: WorkerState, space: Space, policy: RecentPolicy) -> Worker:
        worker = cls(state.worker_id, state.model, space, state.slot, policy)
        worker.eagle = state.eagle
        worker.ttl_s, worker.capacity = state.ttl_s, state.capacity
        if state.capacity is not None:
            worker.limit = state.capacity + int(state.capacity * CAPACITY_SLACK)
        worker.approximate, worker.resets = state.approximate, state.resets
        worker.reset_reason = state.reset_reason
        worker.last_seq = state.last_seq
        worker.nonfull_groups = set(state.nonfull_groups)
        worker.tiers = set(state.tiers)
        worker.counts = state.counts
        worker.emap = state.emap
        worker.spans = spans.rebuild(state.emap)
        for own, tier, n in state.dups:
            worker.dups[tier][own] = n
        worker.lru = state.lru
        worker.rev = state.rev or {}
        worker.next_sweep_s = state.next_sweep_s
        worker.peak = state.peak
        worker.recent = Recent([list(pairs) for pairs in state.recent])
        return worker


def share_ints(space: Space) -> None:
    """After decoding, every int is its own object: share them again as ingest does (own
    hashes between the engine maps and the tables; one mask object per single holder)."""
    bits = {w.bit: w.bit for w in space.workers()}
    owns: dict[int, int] = {}
    for tables in space.masks:
        for word, table in enumerate(tables):
            values = map(bits.get, table.values(), table.values())
            tables[word] = shared = dict(zip(table, values, strict=True))
            owns.update(zip(shared, shared, strict=True))
    for worker in space.workers():
        emap = worker.emap
        values = map(owns.get, emap.values(), emap.values())
        worker.emap = dict(zip(emap, values, strict=True))
