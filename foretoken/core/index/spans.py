"""Engine blocks that span several of the worker's blocks (LMCache's chunks).

LMCache publishes its stores (through vLLM's connector, on the same ZMQ stream as the
engine's own) one event per *chunk*: ``block_hashes=[chunk_hash]``, the previous chunk's
hash as parent, the chunk's token ids, ``block_size`` = the chunk's token count (256 by
default; less for a prompt's last, partial chunk) and medium ``cpu``; its removals name
the chunk hashes. The worker's GPU blocks are the engine's (16 tokens, say), and the index
credits prefixes in those. A store whose ``block_size`` is a multiple of the worker's is
therefore filed as the blocks it spans: their own hashes chained over its tokens at the
worker's block size, the last one under the chunk's engine hash (so that the next chunk's
parent names the chain's end) and the others under engine hashes derived from it
(:func:`inner_hash`). A single partial chunk keeps its full blocks. The worker remembers
how many blocks each such engine hash spans (``Worker.spans``), so that a removal or a
tier move of the chunk takes every one of them; the memory goes when the engine hash
leaves the map, and is rebuilt from the map itself after a restore (:func:`rebuild`).

The same rules run in the native backend (``native/src/spans.rs``); the differential
suite holds the two equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

_MASK: Final = (1 << 64) - 1
_GOLDEN: Final = 0x9E3779B97F4A7C15
# A chunk spans at most this many of the worker's blocks (256-token chunks over 1-token
# pages): a larger one is a block-size mismatch, and a rebuild stops probing there.
MAX_SPAN: Final = 4096


def inner_hash(engine_hash: int, i: int) -> int:
    """The engine hash filed for the ``i``-th (0-based) block of a span before its last
    (splitmix64 of the span's engine hash and the position)."""
    z = (engine_hash + (i + 1) * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def span_of(event_block_size: int, worker_block_size: int, events: int) -> int:
    """How many of the worker's blocks each of a store's ``events`` engine blocks spans;
    0 when the store cannot be filed in the worker's blocks (smaller blocks, or several
    blocks that are not a multiple of the worker's)."""
    if event_block_size <= worker_block_size:
        return 0
    span = event_block_size // worker_block_size
    if span > MAX_SPAN or (event_block_size % worker_block_size and events != 1):
        return 0
    return span


def split(
    hashes: Sequence[int], span: int, extra_keys: Sequence[str]
) -> tuple[list[int], tuple[str, ...]]:
    """The engine hashes of the blocks a store's engine blocks span (each span's inner
    blocks, then its own hash) and its extra keys, each on its span's first block (the
    chain over its tokens at the worker's block size keeps whole blocks only: a partial
    last chunk keeps its full blocks)."""
    out: list[int] = []
    for engine_hash in hashes:
        out.extend(inner_hash(engine_hash, i) for i in range(span - 1))
        out.append(engine_hash)
    keys: tuple[str, ...] = ()
    if any(extra_keys):
        keys = tuple(k for key in extra_keys for k in (key, *("",) * (span - 1)))
    return out, keys


def expand(spans: dict[int, int], hashes: Iterable[int]) -> list[int]:
    """A removal's or a tier move's engine hashes with every spanned block named."""
    out: list[int] = []
    for engine_hash in hashes:
        span = spans.get(engine_hash, 1)
        out.extend(inner_hash(engine_hash, i) for i in range(span - 1))
        out.append(engine_hash)
    return out


def rebuild(emap: dict[int, int]) -> dict[int, int]:
    """The spans of a restored engine map: an engine hash whose first inner hash is mapped
    too spans as many blocks as its inner hashes that are."""
    spans: dict[int, int] = {}
    for engine_hash in emap:
        if inner_hash(engine_hash, 0) not in emap:
            continue
        n = 1
        while n < MAX_SPAN and inner_hash(engine_hash, n) in emap:
            n += 1
        spans[engine_hash] = n + 1
    return spans
