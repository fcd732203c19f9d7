"""foretoken's own chained content hash of KV blocks (PRODUCT.md §3 "Cache index").

Engine hashes are opaque (seeds and hash functions differ per engine), so the index names
a block by its own hash: ``own[k] = H(own[k-1], tokens of block k[, extra key of block k])``
with ``own[-1]`` a root seed derived from (salt, model, block size, LoRA name). Equal
prefixes get equal hashes however the engine split them into events, on every engine.

``H`` is CPython's tuple hash (an xxHash-style mix computed in C) masked to 60 bits.
Why not numpy: token ids reach the index as Python ints (msgspec tuples, JSON lists) and
converting them to an array costs ~35 ns per token on the reference machine, while the
C tuple hash reads them in place at ~8 ns per token; a per-block ``xxhash`` call needs
the same conversion to bytes first (measured in ``bench/index_bench.py``). 60 bits keep
every hash a two-digit Python int (32 bytes instead of 48), which matters at 10 million
entries; the collision odds stay below 1e-4 at 10^7 distinct blocks.

Int and tuple hashing do not depend on ``PYTHONHASHSEED``, so hashes are equal across
processes; they could change with the Python implementation, so :func:`scheme_fingerprint`
is stored in snapshots and checked on restore. Strings (LoRA names, extra keys, the salt)
are hashed with xxh3, never with ``hash()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Final

import numpy as np
import xxhash

HASH_BITS: Final = 60
HASH_MASK: Final = (1 << HASH_BITS) - 1
_SEP: Final = b"\x1f"


def _text_hash(*parts: bytes) -> int:
    return xxhash.xxh3_64_intdigest(_SEP.join(parts)) & HASH_MASK


def root_seed(salt: bytes, model: str, block_size: int, lora_name: str | None) -> int:
    """The chain's starting value for one hash space and LoRA adapter."""
    lora = b"\x00" if lora_name is None else b"\x01" + lora_name.encode()
    return _text_hash(b"foretoken-root-v1", salt, model.encode(), str(block_size).encode(), lora)


def extra_key_mix(key: str) -> int:
    """A block's extra key (multimodal hashes, cache salt …) as an int; 0 for none."""
    return _text_hash(b"extra", key.encode()) if key else 0


def chain(
    seed: int,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    max_blocks: int | None = None,
) -> list[int]:
    """Own hashes of the full blocks of ``token_ids`` chained from ``seed``.

    ``extra_keys`` holds one entry per block (``""`` for none) in the canonical form the
    ingest decoder writes; a shorter sequence leaves the remaining blocks without keys.
    """
    blocks: Iterator[tuple[int, ...]] = zip(*[iter(token_ids)] * block_size, strict=False)
    if max_blocks is not None:
        blocks = islice(blocks, max_blocks)
    out: list[int] = []
    append = out.append
    h = seed
    mask = HASH_MASK
    if not any(extra_keys):
        for block in blocks:
            h = hash((h, block)) & mask
            append(h)
        return out
    mixes = [extra_key_mix(key) for key in extra_keys]
    for i, block in enumerate(blocks):
        x = mixes[i] if i < len(mixes) else 0
        h = (hash((h, block, x)) if x else hash((h, block))) & mask
        append(h)
    return out


def as_python_ints(token_ids: Sequence[int] | np.ndarray) -> Sequence[int]:
    """Token ids as Python ints (a numpy array is converted once, in C)."""
    if isinstance(token_ids, np.ndarray):
        converted: list[int] = token_ids.tolist()
        return converted
    return token_ids


def scheme_fingerprint() -> int:
    """A hash of a fixed input, equal across processes on one Python implementation."""
    return chain(root_seed(b"fingerprint", "m", 4, "lora"), tuple(range(1000, 1012)), 4, ("", "x"))[
        -1
    ]
