"""The native backend of :class:`~foretoken.core.index.protocol.Index`: the Rust crate in
``native/`` (module ``foretoken_native``, built by ``make setup``), wrapped into the core's
values (:class:`~foretoken.core.index.state.CacheHit`,
:class:`~foretoken.core.index.state.ApplyStats`).

Why this lives in the core: ``foretoken_native`` is a pure library, like numpy — no I/O, no
clock, no threads; it computes on what it is given and returns values. The core's rule is
about what a module *does* (no Kafka, HTTP, ZMQ, files, clock reads), and this module keeps
it; ``make lint`` checks that nothing else in the package imports the extension directly
(only this module and :mod:`foretoken.core.queue.native_walk`: an import-linter contract in
``pyproject.toml``). The crate implements the same semantics as the Python reference
(:class:`~foretoken.core.index.prefix.PrefixIndex`): content hash spec v2, the cross-tier
rule with the same bound, the same counters; ``tests/contract`` runs both.

It also hands out the crate's ``HeldChains`` (:func:`held_chains`): the own-hash chains of
the prompts each worker holds, for :mod:`foretoken.core.routing.sent_prefixes`.

Token ids may be packed u32 bytes (what the router sends; zero-copy), a numpy array, or a
sequence of ints; block hashes come from the wire records as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, TypeVar

import foretoken_native as _native
import numpy as np

from foretoken.core.index import content_hash
from foretoken.core.index.protocol import IndexBackend
from foretoken.core.index.recent import RecentPolicy
from foretoken.core.index.state import ApplyStats, CacheHit
from foretoken.core.types import KvBatch, ModelName, WorkerId

if tuple(_native.APPLY_STATS_FIELDS) != ApplyStats.__struct_fields__:
    raise ImportError(
        "foretoken_native is out of date (its counters differ from ApplyStats): "
        "rebuild it with `make setup` (pip install ./native)"
    )

# Token ids as u32 LE in a contiguous array (the route path's np.frombuffer of the packed
# ids) go to the crate as bytes: one copy, then its fast path (no conversion per block).
_U32_LE = np.dtype("<u4")


_H = TypeVar("_H")
# Own hashes the crate reads as they are (8-byte little-endian integers).
_U64_AS_IS = (np.dtype("<u8"), np.dtype("<i8"))


def _tokens(token_ids: object) -> object:
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype == _U32_LE and token_ids.flags.c_contiguous:
            return token_ids.tobytes()
        # Any other array is converted as the reference converts it (the crate would read a
        # uint8 array as packed bytes, a big-endian one unswapped, and refuse 16-bit ids).
        return content_hash.packed(token_ids)
    return token_ids


def _hashes(values: _H) -> _H | np.ndarray:
    """Own hashes as the reference reads them (``astype(uint64)``) when the crate would not."""
    if isinstance(values, np.ndarray) and values.dtype not in _U64_AS_IS:
        return values.astype(np.uint64)
    return values


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


# Equal hits are shared (CacheHit is frozen): building a dataclass costs more than a lookup.
HIT_CACHE_SIZE = 4096
_HITS: dict[tuple[int | bool, ...], CacheHit] = {}


def _hit(values: tuple[int | bool, ...]) -> CacheHit:
    hit = _HITS.get(values)
    if hit is None:
        if len(_HITS) >= HIT_CACHE_SIZE:
            _HITS.clear()
        hit = _HITS[values] = CacheHit(*values)  # type: ignore[arg-type]
    return hit


class NativeIndex:
    """Which workers hold which prefix of a prompt, in which tier (native)."""

    __slots__ = ("_core",)
    backend: Final[IndexBackend] = "native"

    def __init__(self, *, salt: bytes = b"", recent: RecentPolicy | None = None) -> None:
        recent = recent or RecentPolicy()
        self._core = _native.NativeIndex(
            salt=salt,
            recent_min_blocks=recent.min_blocks,
            recent_peak_factor=recent.peak_factor,
        )

    # ------------------------------------------------------------------ workers

    def register_worker(
        self,
        worker_id: WorkerId,
        model: ModelName,
        block_size: int,
        *,
        eagle: bool = False,
        store_only_ttl_s: float | None = None,
        capacity_blocks: int | None = None,
    ) -> None:
        self._core.register_worker(
            worker_id,
            model,
            block_size,
            eagle=eagle,
            store_only_ttl_s=store_only_ttl_s,
            capacity_blocks=capacity_blocks,
        )

    def remove_worker(self, worker_id: WorkerId) -> None:
        self._core.remove_worker(worker_id)

    def reset_worker(self, worker_id: WorkerId, reason: str) -> None:
        self._core.reset_worker(worker_id, reason)

    # ------------------------------------------------------------------ events

    def apply(self, batch: KvBatch, now_s: float) -> ApplyStats:
        return ApplyStats(*self._core.apply(batch, now_s))

    def observe_served(self, worker_id: WorkerId, own_hashes: Sequence[int], now_s: float) -> int:
        result: int = self._core.observe_served(worker_id, _hashes(own_hashes), now_s)
        return result

    def age(self, now_s: float) -> None:
        self._core.age(now_s)

    def maintain(self, now_s: float) -> ApplyStats:
        return ApplyStats(*self._core.maintain(now_s))

    # ------------------------------------------------------------------ lookups

    def hash_prompt(
        self,
        model: ModelName,
        block_size: int,
        token_ids: Sequence[int] | np.ndarray,
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[str] = (),
    ) -> np.ndarray:
        _check_block_size(block_size)
        owns: np.ndarray = self._core.hash_prompt(
            model, block_size, _tokens(token_ids), lora_name=lora_name,
            extra_keys=extra_keys or None,
        )  # fmt: skip
        return owns

    def lookup(
        self,
        model: ModelName,
        token_ids: Sequence[int] | np.ndarray | None = None,
        *,
        own_hashes: Mapping[int, Sequence[int] | np.ndarray] | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[str] = (),
        now_s: float | None = None,
    ) -> dict[WorkerId, CacheHit]:
        if own_hashes is not None and any(
            isinstance(v, np.ndarray) and v.dtype not in _U64_AS_IS for v in own_hashes.values()
        ):
            own_hashes = {size: _hashes(v) for size, v in own_hashes.items()}
        found = self._core.lookup(
            model,
            _tokens(token_ids),
            own_hashes=own_hashes,
            lora_name=lora_name,
            extra_keys=extra_keys or None,
            now_s=now_s,
        )
        return {WorkerId(w): _hit(values) for w, values in found.items()}

    # ------------------------------------------------------------------ state

    def stats(self) -> dict[str, object]:
        stats: dict[str, object] = self._core.stats()
        return stats

    @property
    def totals(self) -> ApplyStats:
        return ApplyStats(**self._core.totals)

    def last_seq(self, worker_id: WorkerId) -> dict[int, int]:
        seqs: dict[int, int] = self._core.last_seq(worker_id)
        return seqs

    def worker_ids(self) -> list[WorkerId]:
        return [WorkerId(w) for w in self._core.worker_ids()]

    def snapshot(self) -> bytes:
        data: bytes = self._core.snapshot()
        return data

    @classmethod
    def restore(cls, data: bytes) -> NativeIndex:
        """The index of a :meth:`snapshot`; ``ValueError`` (saying which) for a snapshot of
        the python backend, of another format version or of another hash spec."""
        index = cls.__new__(cls)
        try:
            index._core = _native.NativeIndex.restore(data)
        except ValueError as exc:
            raise ValueError(
                f"{exc} (the native backend restores native snapshots only; a python "
                'snapshot needs [index] backend = "python", or a rebuild from the events)'
            ) from None
        return index


def held_chains() -> _native.HeldChains:
    """Per worker, the own block hashes of the prompts it holds, counted (the native side
    of :mod:`foretoken.core.routing.sent_prefixes`)."""
    return _native.HeldChains()
