"""The cache index's contract (house rule 5): one Protocol, a factory from config, and one
behaviour suite (``tests/contract/test_index_contract.py``) run against every backend.

Backends: ``"native"`` (:class:`~foretoken.core.index.native.NativeIndex`, the Rust crate
in ``native/``, the default) and ``"python"``
(:class:`~foretoken.core.index.prefix.PrefixIndex`, the reference). Both hash with content
hash spec v2 and apply the cross-tier rule (:mod:`foretoken.core.index.recent`), so they
give identical answers (``tests/contract/test_index_differential.py``); their snapshots are
not interchangeable, each refuses the other's with a ``ValueError`` naming it.

An engine that publishes no KV events is not a backend of its own: its worker is
registered in the same index as *store-only* (aged by a TTL and a capacity, fed by
:meth:`Index.observe_served` instead of events), so that one lookup still compares every
worker of a model in one pass; the suite runs both kinds of worker on every backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec
import numpy as np

from foretoken.core.index.recent import RecentPolicy
from foretoken.core.index.state import ApplyStats, CacheHit
from foretoken.core.types import KvBatch, ModelName, WorkerId

IndexBackend = Literal["native", "python"]
INDEX_BACKENDS: tuple[IndexBackend, ...] = ("native", "python")


class IndexConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Which backend the processor runs, and the cross-tier rule's bound (settings:
    ``[index]``; see :class:`~foretoken.core.index.recent.RecentPolicy`)."""

    backend: IndexBackend = "native"
    recent_min_blocks: int = 4096
    recent_peak_factor: float = 0.125

    def __post_init__(self) -> None:
        RecentPolicy(self.recent_min_blocks, self.recent_peak_factor)  # validates the bound

    @property
    def recent(self) -> RecentPolicy:
        return RecentPolicy(self.recent_min_blocks, self.recent_peak_factor)

    def make(self, *, salt: bytes = b"") -> Index:
        return make_index(self.backend, salt=salt, recent=self.recent)

    def restore(self, data: bytes) -> Index:
        return restore_index(data, self.backend)


@runtime_checkable
class Index(Protocol):
    """Which workers hold which prefix of a prompt, in which tier."""

    @property
    def backend(self) -> IndexBackend:
        """Which implementation this is."""
        ...

    def register_worker(
        self,
        worker_id: WorkerId,
        model: ModelName,
        block_size: int,
        *,
        eagle: bool = False,
        store_only_ttl_s: float | None = None,
        capacity_blocks: int | None = None,
    ) -> None: ...

    def remove_worker(self, worker_id: WorkerId) -> None: ...

    def reset_worker(self, worker_id: WorkerId, reason: str) -> None: ...

    def apply(self, batch: KvBatch, now_s: float) -> ApplyStats: ...

    def observe_served(
        self, worker_id: WorkerId, own_hashes: Sequence[int], now_s: float
    ) -> int: ...

    def age(self, now_s: float) -> None: ...

    def maintain(self, now_s: float) -> ApplyStats: ...

    def hash_prompt(
        self,
        model: ModelName,
        block_size: int,
        token_ids: Sequence[int] | np.ndarray,
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[str] = (),
    ) -> np.ndarray: ...

    def lookup(
        self,
        model: ModelName,
        token_ids: Sequence[int] | np.ndarray | None = None,
        *,
        own_hashes: Mapping[int, Sequence[int] | np.ndarray] | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[str] = (),
        now_s: float | None = None,
    ) -> dict[WorkerId, CacheHit]: ...

    def stats(self) -> dict[str, object]: ...

    @property
    def totals(self) -> ApplyStats: ...

    def last_seq(self, worker_id: WorkerId) -> dict[int, int]: ...

    def worker_ids(self) -> list[WorkerId]: ...

    def snapshot(self) -> bytes: ...


def make_index(
    backend: IndexBackend = "native", *, salt: bytes = b"", recent: RecentPolicy | None = None
) -> Index:
    """An empty index of the configured backend."""
    if backend == "native":
        from foretoken.core.index.native import NativeIndex

        return NativeIndex(salt=salt, recent=recent)
    if backend == "python":
        from foretoken.core.index.prefix import PrefixIndex

        return PrefixIndex(salt=salt, recent=recent)
    raise ValueError(f"unknown index backend {backend!r}; known: {', '.join(INDEX_BACKENDS)}")


def restore_index(data: bytes, backend: IndexBackend = "native") -> Index:
    """An index from :meth:`Index.snapshot` bytes (a snapshot of another backend, format
    version or hash spec raises ``ValueError`` saying so)."""
    if backend == "native":
        from foretoken.core.index.native import NativeIndex

        return NativeIndex.restore(data)
    if backend == "python":
        from foretoken.core.index.prefix import PrefixIndex

        return PrefixIndex.restore(data)
    raise ValueError(f"unknown index backend {backend!r}; known: {', '.join(INDEX_BACKENDS)}")
