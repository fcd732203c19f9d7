"""foretoken's own chained content hash of KV blocks (PRODUCT.md §3 "Cache index"), spec v2.

Engine hashes are opaque (seeds and hash functions differ per engine), so the index names
a block by its own hash: ``own[k] = H(own[k-1], tokens of block k[, extra key of block k])``
with ``own[-1]`` a root seed derived from (salt, model, block size, LoRA name). Equal
prefixes get equal hashes however the engine split them into events, on every engine.

Spec v2, computed bit for bit the same by this module (PyPI's ``xxhash``) and by the native
backend (``native/``, crate ``xxhash-rust``; ``native/README.md`` states the same spec):

* ``root_seed = xxh3_64(b"foretoken-root-v2" 1F salt 1F model 1F str(block_size) 1F lora)``
  with ``lora`` = ``00`` for no adapter, else ``01`` + the adapter's name (UTF-8);
* ``extra_key_mix(key) = xxh3_64(b"extra" 1F key)`` for a non-empty key, 0 for ``""``;
* per **full** block ``i`` (a trailing partial block is ignored): ``data`` = the block's
  token ids as u32 little-endian, followed by ``extra_key_mix(extra_keys[i])`` as u64
  little-endian when the block has a non-empty extra key;
  ``h[i] = xxh3_64(data, seed=h[i-1])``, ``h[-1]`` = the root seed. All 64 bits are kept.

v1 (until issue 17) was CPython's tuple hash masked to 60 bits: fast from Python ints, but
tied to one Python implementation and impossible to share with a native index. Snapshots
name the spec (:data:`HASH_SPEC`) and refuse another one.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Final

import msgspec
import numpy as np
import xxhash

HASH_SPEC: Final = 2
HASH_BITS: Final = 64
ROOT_TAG: Final = b"foretoken-root-v2"
_SEP: Final = b"\x1f"
_LITTLE: Final = sys.byteorder == "little"


def _text_hash(*parts: bytes) -> int:
    return xxhash.xxh3_64_intdigest(_SEP.join(parts))


def root_seed(salt: bytes, model: str, block_size: int, lora_name: str | None) -> int:
    """The chain's starting value for one hash space and LoRA adapter."""
    lora = b"\x00" if lora_name is None else b"\x01" + lora_name.encode()
    return _text_hash(ROOT_TAG, salt, model.encode(), str(block_size).encode(), lora)


def salt_key(salt: str) -> str:
    """The extra key of a salted prompt's first block, in the canonical form the ingest
    decoder writes an engine's per-block entry (vLLM's ``extra_keys`` of a request with a
    ``cache_salt`` and nothing else to key: ``["<salt>"]``; SGLang's the same)."""
    return msgspec.json.encode([salt]).decode()


def extra_key_mix(key: str) -> int:
    """A block's extra key (multimodal hashes, cache salt …) as an int; 0 for none."""
    return _text_hash(b"extra", key.encode()) if key else 0


def packed(token_ids: Sequence[int] | np.ndarray | bytes) -> bytes:
    """Token ids as u32 little-endian bytes (bytes are taken as already packed)."""
    if isinstance(token_ids, bytes | bytearray | memoryview):
        data = bytes(token_ids)
        if len(data) % 4:
            raise ValueError(
                "packed token ids must be u32 little-endian (a multiple of 4 bytes), "
                f"got {len(data)} bytes"
            )
        return data
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype != np.uint32 and (
            token_ids.dtype.kind not in "ui"
            or (len(token_ids) and (int(token_ids.min()) < 0 or int(token_ids.max()) >> 32))
        ):
            raise ValueError("token ids must be integers in 0..2^32")
        return token_ids.astype("<u4", copy=False).tobytes()
    try:
        ids32 = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError(f"a token id is outside 0..2^32 ({exc})") from None
    if ids32.itemsize != 4:  # pragma: no cover - no such platform here
        return np.asarray(token_ids, dtype="<u4").tobytes()
    if not _LITTLE:  # pragma: no cover
        ids32.byteswap()
    return ids32.tobytes()


def chain(
    seed: int,
    token_ids: Sequence[int] | np.ndarray | bytes,
    block_size: int,
    extra_keys: Sequence[str] = (),
    max_blocks: int | None = None,
) -> list[int]:
    """Own hashes of the full blocks of ``token_ids`` chained from ``seed``.

    ``extra_keys`` holds one entry per block (``""`` for none) in the canonical form the
    ingest decoder writes; a shorter sequence leaves the remaining blocks without keys.
    """
    data = memoryview(packed(token_ids))
    width = 4 * block_size
    blocks = len(data) // width
    if max_blocks is not None:
        blocks = min(blocks, max_blocks)
    digest = xxhash.xxh3_64_intdigest
    out: list[int] = []
    append = out.append
    h = seed
    if not any(extra_keys):
        for start in range(0, blocks * width, width):
            h = digest(data[start : start + width], h)
            append(h)
        return out
    mixes = [extra_key_mix(key) for key in extra_keys]
    for i in range(blocks):
        block = data[i * width : (i + 1) * width]
        x = mixes[i] if i < len(mixes) else 0
        h = digest(bytes(block) + x.to_bytes(8, "little"), h) if x else digest(block, h)
        append(h)
    return out


def scheme_fingerprint() -> int:
    """The hash of a fixed input (stored in snapshots next to :data:`HASH_SPEC`)."""
    seed = root_seed(b"fingerprint", "m", 4, "lora")
    return chain(seed, tuple(range(1000, 1012)), 4, ("", "x"))[-1]
