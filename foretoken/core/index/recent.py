"""The cross-tier rule: each worker remembers its recently removed blocks (engine hash →
own hash), bounded.

Engines publish a block's store in a slower tier (an offload) and its removal from the GPU
in either order, within one batch or across batches. Without this rule the index would
forget an engine hash as soon as the worker holds no copy of it, so a CPU store after the
GPU removal would be an unknown move, and a store naming that block as its parent would
restart from the root seed. With it, whenever an engine hash leaves a worker's engine map
(its last copy removed, a per-tier clear, a store-only block aged out or trimmed), its
mapping is filed here; a store naming an unknown parent, or a store without token ids
naming an unknown engine hash, looks here before giving up (counted as
``recovered_parents`` / ``recovered_moves``). A full clear or a reset empties it.

The layout is the native backend's, reproduced exactly so that both backends remember and
forget the same blocks (``native/src/recent.rs``): a 4-way set-associative cache; an
engine hash has one set (picked by the same 64-bit mix as the native tables), an insert
goes first in its set and the oldest pair of a full set falls out. Its capacity is
``max(min_blocks, ceil(peak_factor × the most engine hashes the worker ever held))`` slots,
grown (to the capacity + 1/8, re-filing what it holds, oldest first) when that exceeds the
slots it has, never shrunk; so a block is remembered for about ``capacity`` later removals.
The pair (engine 0, own 0) is never filed (the native cache's empty marker).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

WAYS: Final = 4
_M64: Final = (1 << 64) - 1
_K0: Final = 0x243F_6A88_85A3_08D3
_K1: Final = 0x9E37_79B9_7F4A_7C15


def mix(x: int) -> int:
    """The native tables' key mix: a folded 64×64→128-bit multiply."""
    p = (x ^ _K0) * _K1
    return (p & _M64) ^ (p >> 64)


@dataclass(frozen=True, slots=True)
class RecentPolicy:
    """How many recently removed blocks a worker remembers (settings: ``[index]``)."""

    min_blocks: int = 4096
    peak_factor: float = 0.125

    def __post_init__(self) -> None:
        if self.min_blocks < 0:
            raise ValueError("recent_min_blocks must be >= 0")
        if not (math.isfinite(self.peak_factor) and self.peak_factor >= 0):
            raise ValueError("recent_peak_factor must be finite and >= 0")

    def capacity(self, peak: int) -> int:
        return max(self.min_blocks, math.ceil(peak * self.peak_factor))


class Recent:
    """One worker's recently removed blocks: ``sets[i]`` holds up to four (engine, own)
    pairs, newest first."""

    __slots__ = ("count", "sets")

    def __init__(self, sets: list[list[tuple[int, int]]] | None = None) -> None:
        self.sets: list[list[tuple[int, int]]] = sets or []
        self.count = sum(map(len, self.sets))

    def __len__(self) -> int:
        return self.count

    @property
    def capacity(self) -> int:
        return len(self.sets) * WAYS

    def clear(self) -> None:
        """Forget everything (keeping the sets: where a hash goes does not change)."""
        self.sets = [[] for _ in self.sets]
        self.count = 0

    def _set_of(self, engine: int) -> list[tuple[int, int]]:
        return self.sets[(mix(engine) * len(self.sets)) >> 64]

    def get(self, engine: int) -> int | None:
        if not self.sets:
            return None
        for e, own in self._set_of(engine):
            if e == engine:
                return own
        return None

    def insert(self, engine: int, own: int, capacity: int) -> None:
        """File a removed block as the newest of its set (``capacity``: the slots wanted;
        0 remembers nothing)."""
        if capacity == 0:
            return
        if len(self.sets) * WAYS < capacity:
            self._reserve(capacity + capacity // 8)
        if engine or own:
            self._file(engine, own)

    def _reserve(self, capacity: int) -> None:
        sets = max(-(-capacity // WAYS), 1)
        if sets <= len(self.sets):
            return
        old, self.sets, self.count = self.sets, [[] for _ in range(sets)], 0
        for pairs in old:
            for engine, own in reversed(pairs):  # oldest first
                self._file(engine, own)

    def _file(self, engine: int, own: int) -> None:
        pairs = self._set_of(engine)
        for i, (e, _) in enumerate(pairs):
            if e == engine:
                del pairs[i]
                break
        else:
            if len(pairs) == WAYS:
                pairs.pop()
            else:
                self.count += 1
        pairs.insert(0, (engine, own))

    def state(self) -> list[list[tuple[int, int]]]:
        return self.sets
