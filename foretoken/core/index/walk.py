"""One pass over a prompt's blocks for every worker of a space (used by the cache index).

Per 64-slot word and chunk of blocks: one ``dict.get`` per block and non-empty tier table
(in C, straight into a numpy array), the union over tiers, a running AND down the prompt
(``alive[i]`` = workers holding blocks 0..i), the rows where ``alive`` loses bits (where
those workers' prefixes end), and, when the word has workers in more than one tier, per
tier the blocks whose fastest holding tier it is (bit counts with ``unpackbits``).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import reduce
from itertools import repeat

import numpy as np

from foretoken.core.index.state import TIERS, WORD_BITS, CacheHit, Space, Worker

_U64 = np.uint64
# Equal hits are shared (CacheHit is frozen): building a dataclass costs more than a lookup.
HIT_CACHE_SIZE = 4096
_HITS: dict[tuple[int | bool, ...], CacheHit] = {}
# Per-tier counts walk runs of equal masks when there are at most this many, else count bits.
MAX_RUNS = 256


class Matched:
    """The walk's result for one space: per slot, matched blocks and blocks per tier."""

    __slots__ = ("_fastest", "_hashes", "_space", "_tier_blocks", "ends")

    def __init__(self, space: Space, hashes: list[int]) -> None:
        slots = len(space.slots)
        self._space = space
        self._hashes = hashes
        self.ends = [0] * slots  # matched blocks (before the EAGLE rule)
        self._tier_blocks = [[0] * slots for _ in TIERS]
        # per word: the fastest tier with entries; its blocks are not counted, they are
        # what remains of each prefix once the slower tiers' blocks are taken out
        self._fastest = [0] * len(space.occupied)

    def end(self, word: int, bits: int, blocks: int) -> None:
        base = word * WORD_BITS
        ends = self.ends
        while bits:
            low = bits & -bits
            ends[base + low.bit_length() - 1] = blocks
            bits ^= low

    def add_tier(self, word: int, tier: int, counts: np.ndarray) -> None:
        column = self._tier_blocks[tier]
        base = word * WORD_BITS
        for bit in np.flatnonzero(counts).tolist():
            column[base + bit] += int(counts[bit])

    def blocks(self, worker: Worker) -> int:
        return self.ends[worker.slot]

    def hit(self, worker: Worker) -> CacheHit:
        matched = self.ends[worker.slot]
        approximate = worker.approximate or worker.lru is not None
        if matched == 0 or (matched == 1 and worker.eagle):
            return self._space.zero_hits[approximate]
        per_tier = [column[worker.slot] for column in self._tier_blocks]
        per_tier[self._fastest[worker.word]] = matched - sum(per_tier)
        if worker.eagle:  # the last matched block is recomputed: not credited
            matched -= 1
            per_tier[self._best_tier(worker, self._hashes[matched])] -= 1
        key = (worker.block_size, matched, *per_tier, approximate)
        hit = _HITS.get(key)
        if hit is None:
            if len(_HITS) >= HIT_CACHE_SIZE:
                _HITS.clear()
            size = worker.block_size
            gpu, cpu, disk, shared = (n * size for n in per_tier)
            hit = CacheHit(size, matched * size, gpu, cpu, disk, shared, approximate)
            _HITS[key] = hit
        return hit

    def _best_tier(self, worker: Worker, own: int) -> int:
        for tier, tables in enumerate(self._space.masks):
            if tables[worker.word].get(own, 0) & worker.bit:
                return tier
        raise AssertionError("a matched block is held in some tier")


def walk(space: Space, chunks: Iterable[list[int]]) -> tuple[Matched, list[int]]:
    """Match the prompt (its own hashes, chunk by chunk) against every worker of the space.

    Stops reading chunks once no worker still matches. Returns the matches and the hashes
    read.
    """
    words = len(space.occupied)
    alive = list(space.occupied)
    tables = [
        [(tier, space.masks[tier][word]) for tier in range(len(TIERS)) if space.masks[tier][word]]
        for word in range(words)
    ]
    hashes: list[int] = []
    matched = Matched(space, hashes)
    for word in range(words):
        if tables[word]:
            matched._fastest[word] = tables[word][0][0]
    for chunk in chunks:
        if not any(alive):
            break
        if not chunk:
            continue
        start = len(hashes)
        hashes.extend(chunk)
        for word in range(words):
            if alive[word]:
                alive[word] = _walk_word(matched, word, tables[word], chunk, start, alive[word])
    for word, bits in enumerate(alive):
        if bits:
            matched.end(word, bits, len(hashes))
    return matched, hashes


def _walk_word(
    matched: Matched,
    word: int,
    tables: list[tuple[int, dict[int, int]]],
    chunk: list[int],
    start: int,
    carry: int,
) -> int:
    """Walk one chunk for the workers of one word; returns the bits still matching."""
    if not tables:
        matched.end(word, carry, start)
        return 0
    n = len(chunk)
    grids = [np.fromiter(map(table.get, chunk, repeat(0)), _U64, n) for _, table in tables]
    union = grids[0] if len(grids) == 1 else reduce(np.bitwise_or, grids)
    alive = np.bitwise_and.accumulate(union)
    alive &= _U64(carry)
    before = np.empty_like(alive)
    before[0] = carry
    before[1:] = alive[:-1]
    for row in np.flatnonzero(before != alive).tolist():
        matched.end(word, int(before[row]) & ~int(alive[row]), start + row)
    if len(grids) > 1:
        _count_tiers(matched, word, tables, grids, alive)
    return int(alive[-1])


def _count_tiers(
    matched: Matched,
    word: int,
    tables: list[tuple[int, dict[int, int]]],
    grids: list[np.ndarray],
    alive: np.ndarray,
) -> None:
    """Per tier slower than the first: blocks of the matched prefix whose fastest holding
    tier it is (the first tier's share is what remains of each worker's prefix)."""
    faster = grids[0].copy()
    for (tier, _), grid in zip(tables[1:], grids[1:], strict=True):
        best = grid & ~faster & alive
        faster |= grid
        if best.any():
            matched.add_tier(word, tier, _bit_counts(best))


def _bit_counts(masks: np.ndarray) -> np.ndarray:
    """How many of ``masks`` have each of the 64 bits set (by runs of equal values when
    they are few, which is the usual shape: prefixes change holders a few times)."""
    starts = np.flatnonzero(masks[1:] != masks[:-1]) + 1
    if len(starts) >= MAX_RUNS:
        as_bytes = masks.astype("<u8", copy=False).view(np.uint8).reshape(-1, 8)
        return np.unpackbits(as_bytes, axis=1, bitorder="little").sum(axis=0)
    counts = np.zeros(WORD_BITS, dtype=np.int64)
    bounds = [0, *starts.tolist(), len(masks)]
    values = masks[bounds[:-1]].tolist()
    for value, lo, hi in zip(values, bounds[:-1], bounds[1:], strict=True):
        while value:
            low = value & -value
            counts[low.bit_length() - 1] += hi - lo
            value ^= low
    return counts
