"""The live KV-cache index (PRODUCT.md §3 "Cache index"): pure, no I/O.

Layout (chosen for ingest speed and memory; measured by ``bench/index_bench.py``):

* A *space* per (model, block size) names blocks by foretoken's own chained content hash
  (:mod:`foretoken.core.index.content_hash`). Each worker of the space owns one bit (its slot); for
  every tier and every 64 slots the space keeps one ``dict`` own hash → int bitmask of the
  workers holding that block in that tier. A lookup reads one mask per block and tier and
  walks all workers of the space at once (:mod:`foretoken.core.index.walk`).
* Per worker (:class:`~foretoken.core.index.state.Worker`), a ``dict`` engine hash → own hash, so
  removals (which carry only engine hashes) resolve, plus the rare extras: duplicate
  physical copies (copies beyond the first, per tier), and for store-only producers an LRU
  of own hash → last store/lookup time.

How each event changes that state is :mod:`foretoken.core.index.events`; the one-pass
lookup is :mod:`foretoken.core.index.walk`; the snapshot format is in
:mod:`foretoken.core.index.state`. Own hashes and single-holder masks are int objects
shared between the structures (memory per (block, worker) entry, not per structure).
This class is the Python reference backend of :class:`~foretoken.core.index.protocol.Index`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import msgspec
import numpy as np

from foretoken.core.index import content_hash, events
from foretoken.core.index.protocol import IndexBackend
from foretoken.core.index.recent import RecentPolicy
from foretoken.core.index.state import (
    TIERS,
    ApplyStats,
    CacheHit,
    IndexState,
    Space,
    SpaceState,
    Worker,
    share_ints,
    tier_index,
)
from foretoken.core.index.walk import walk
from foretoken.core.types import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    IndexReset,
    KvBatch,
    ModelName,
    WorkerId,
)

# 2: content hash spec v2 (xxh3, 64 bits), engine hashes unmasked, the cross-tier rule.
SNAPSHOT_VERSION = 2
# The native backend's snapshots start with this (foretoken_native, native/src/snapshot.rs).
NATIVE_MAGIC = b"FTKNIDX\x00"
# apply() keeps its per-call stats and sums them into the totals this often (amortized).
FOLD_STATS_EVERY = 1024

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(IndexState)
_header = msgspec.msgpack.Decoder(list[msgspec.Raw])


class PrefixIndex:
    """Which workers hold which prefix of a prompt, in which tier."""

    backend: Final[IndexBackend] = "python"

    def __init__(self, *, salt: bytes = b"", recent: RecentPolicy | None = None) -> None:
        self._salt = salt
        self._recent = recent or RecentPolicy()
        self._workers: dict[WorkerId, Worker] = {}
        self._spaces: dict[tuple[str, int], Space] = {}
        self._models: dict[str, list[Space]] = {}
        self._totals = ApplyStats()
        self._done: list[ApplyStats] = []  # per-call stats not yet folded into the totals
        self._touches: list[tuple[Worker, list[int], float]] = []

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
        """Add a worker (or update its flags; a new model or block size starts it afresh)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if store_only_ttl_s is not None and not store_only_ttl_s > 0:
            raise ValueError("store_only_ttl_s must be > 0")
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        # Lookups' pending refreshes belong to the LRU they were made against: apply them
        # before a registration may drop or rebuild it (the native backend refreshes at once).
        self._apply_touches()
        old = self._workers.get(worker_id)
        if old is not None and (old.model != model or old.block_size != block_size):
            self.remove_worker(worker_id)
            old = None
        if old is None:
            space = self._space(model, block_size)
            old = Worker(worker_id, model, space, space.take_slot(), self._recent)
            space.place(old)
            self._workers[worker_id] = old
        old.eagle = eagle
        old.configure_store_only(store_only_ttl_s, capacity_blocks)

    def remove_worker(self, worker_id: WorkerId) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        events.clear(worker, None)
        worker.space.free(worker)
        self._touches = [t for t in self._touches if t[0] is not worker]

    def reset_worker(self, worker_id: WorkerId, reason: str) -> None:
        """Forget a worker's blocks (e.g. an unrepairable sequence gap); its hits are then
        flagged approximate until the engine clears its whole cache (``AllCleared``)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            stats = ApplyStats()
            self._done.append(stats)
            events.reset(worker, reason, stats)

    def _space(self, model: str, block_size: int) -> Space:
        key = (model, block_size)
        space = self._spaces.get(key)
        if space is None:
            space = Space(model, block_size, self._salt)
            self._spaces[key] = space
            self._models.setdefault(model, []).append(space)
            self._models[model].sort(key=lambda s: s.block_size)
        return space

    # ------------------------------------------------------------------ events

    def apply(self, batch: KvBatch, now_s: float) -> ApplyStats:
        """Apply one normalized engine batch; ``now_s`` is a monotonic clock.

        The returned stats are also summed into :attr:`totals` (treat them as read-only).
        """
        stats = self._new_stats(batches=1)
        worker = self._workers.get(batch.worker_id)
        if worker is None:
            stats.unknown_worker_batches = 1
            return stats
        if worker.model != batch.model:
            stats.model_mismatch_batches = 1
            return stats
        if self._touches:
            self._apply_touches()
        for event in batch.events:
            kind = type(event)
            if kind is BlockStored:
                events.store(worker, event, now_s, stats)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                events.remove(worker, event, stats)  # type: ignore[arg-type]
            elif kind is AllCleared:
                medium = event.medium  # type: ignore[union-attr]
                events.clear(worker, None if medium is None else tier_index(medium))
                stats.clears += 1
            elif kind is IndexReset:
                reset = event  # an IndexReset
                events.reset(worker, reset.reason, stats, reset.approximate)  # type: ignore[union-attr]
        worker.last_seq[batch.dp_rank] = batch.seq
        if worker.lru is not None and worker.sweep_due(now_s):
            events.sweep(worker, now_s, stats)
        return stats

    def observe_served(self, worker_id: WorkerId, own_hashes: Sequence[int], now_s: float) -> int:
        """Approximate mode (:mod:`foretoken.core.index.approx`): a prompt (its own hashes in the
        worker's space, :meth:`hash_prompt`) was served by a worker that publishes no KV
        events, so its blocks are taken as cached there now. Only aged (store-only)
        workers learn this way; returns the number of blocks newly filed."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.lru is None or not len(own_hashes):
            return 0
        stats = self._new_stats()
        if self._touches:
            self._apply_touches()
        # Tail first: the LRU then drops a prompt's last blocks before its prefix.
        owns = _int_list(own_hashes)[::-1]
        gpu, bit = tier_index("GPU"), worker.bit
        table = worker.space.masks[gpu][worker.word]
        new = [own for own in owns if not table.get(own, 0) & bit]
        if new:
            events.add(worker, new, new, gpu, now_s, stats)
        worker.touch(owns, owns, now_s)  # refresh the blocks it held already
        if worker.sweep_due(now_s) or len(worker.lru) > (worker.capacity or len(worker.lru)):
            events.sweep(worker, now_s, stats)
        return len(new)

    def age(self, now_s: float) -> None:
        """Sweep the aged (store-only) workers whose sweep is due (cheap when none is)."""
        for worker in self._workers.values():
            if worker.lru is not None and worker.sweep_due(now_s):
                if self._touches:
                    self._apply_touches()
                events.sweep(worker, now_s, self._new_stats())

    def maintain(self, now_s: float) -> ApplyStats:
        """Age out store-only entries of every worker now (``apply`` does it lazily)."""
        stats = ApplyStats()
        self._done.append(stats)
        self._apply_touches()
        for worker in self._workers.values():
            if worker.lru is not None:
                events.sweep(worker, now_s, stats)
        return stats

    def _apply_touches(self) -> None:
        touches, self._touches = self._touches, []
        for worker, owns, now_s in touches:
            worker.refresh(owns, now_s)

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
        """Own hashes (uint64) of the prompt's full blocks in the (model, block size) space."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        seed = content_hash.root_seed(self._salt, model, block_size, lora_name)
        owns = content_hash.chain(seed, token_ids, block_size, extra_keys)
        return np.array(owns, dtype=np.uint64)

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
        """Longest cached prefix of every worker of ``model``, per tier, in one pass.

        ``own_hashes`` (block size → own hashes, e.g. from :meth:`hash_prompt`) wins over
        ``token_ids`` for the block sizes it covers. ``now_s`` refreshes the matched blocks
        of store-only workers (applied lazily with the next batch).
        """
        hits: dict[WorkerId, CacheHit] = {}
        tokens = None if token_ids is None else content_hash.packed(token_ids)
        for space in self._models.get(model, ()):
            given = None if own_hashes is None else own_hashes.get(space.block_size)
            if given is not None:
                blocks: Iterable[list[int]] = [_int_list(given)]
            elif tokens is not None:
                blocks = space.hash_chunks(tokens, lora_name, extra_keys)
            else:
                blocks = []
            matched, hashes = walk(space, blocks)
            for worker in space.workers():
                hit = matched.hit(worker)
                hits[worker.worker_id] = hit
                if now_s is not None and worker.lru is not None and hit.tokens:
                    self._touches.append((worker, hashes[: matched.blocks(worker)], now_s))
        return hits

    # ------------------------------------------------------------------ state

    def stats(self) -> dict[str, object]:
        """Blocks per tier per worker, resets and counters (the ``/v1/cache`` page)."""
        workers = {}
        for worker in self._workers.values():
            workers[worker.worker_id] = {
                "model": worker.model,
                "block_size": worker.block_size,
                "eagle": worker.eagle,
                "store_only": worker.lru is not None,
                "approximate": worker.approximate,
                "resets": worker.resets,
                "last_reset_reason": worker.reset_reason,
                "last_seq": dict(worker.last_seq),
                "blocks": {TIERS[t]: worker.counts[t] for t in range(len(TIERS))},
                "engine_hashes": len(worker.emap),
                "duplicate_copies": sum(sum(d.values()) for d in worker.dups),
                "recently_removed": len(worker.recent),
            }
        spaces = [
            {
                "model": s.model,
                "block_size": s.block_size,
                "workers": sum(1 for _ in s.workers()),
                "entries": {TIERS[t]: sum(map(len, s.masks[t])) for t in range(len(TIERS))},
            }
            for s in self._spaces.values()
        ]
        return {"workers": workers, "spaces": spaces, "counters": msgspec.to_builtins(self.totals)}

    @property
    def totals(self) -> ApplyStats:
        """Everything ``apply`` / ``maintain`` / ``reset_worker`` did since the start."""
        self._fold_stats()
        return self._totals

    def _new_stats(self, batches: int = 0) -> ApplyStats:
        """A call's stats, kept for the totals (folded before, never after, it is added)."""
        if len(self._done) >= FOLD_STATS_EVERY:
            self._fold_stats()
        stats = ApplyStats(batches=batches)
        self._done.append(stats)
        return stats

    def _fold_stats(self) -> None:
        if self._done:
            self._totals = ApplyStats.total([self._totals, *self._done])
            self._done = []

    def worker_ids(self) -> list[WorkerId]:
        return list(self._workers)

    def last_seq(self, worker_id: WorkerId) -> dict[int, int]:
        """Per data-parallel rank, the seq of the last batch applied (to resume ingest)."""
        worker = self._workers.get(worker_id)
        return {} if worker is None else dict(worker.last_seq)

    def snapshot(self) -> bytes:
        """The whole state as msgpack; ``restore`` gives back an equal index."""
        self._apply_touches()
        state = IndexState(
            version=SNAPSHOT_VERSION,
            hash_spec=content_hash.HASH_SPEC,
            fingerprint=content_hash.scheme_fingerprint(),
            salt=self._salt,
            recent_min_blocks=self._recent.min_blocks,
            recent_peak_factor=self._recent.peak_factor,
            workers=[w.to_state() for w in self._workers.values()],
            spaces=[
                SpaceState(s.model, s.block_size, s.tables_state()) for s in self._spaces.values()
            ],
            totals=self.totals,
        )
        return _encoder.encode(state)

    @classmethod
    def restore(cls, data: bytes) -> PrefixIndex:
        """The index of a :meth:`snapshot`; ``ValueError`` (saying which) for a snapshot of
        the native backend, of another format version or of another hash spec."""
        check_snapshot(data)
        state = _decoder.decode(data)
        if state.hash_spec != content_hash.HASH_SPEC or (
            state.fingerprint != content_hash.scheme_fingerprint()
        ):
            raise ValueError(
                f"python index snapshot hashed with content hash spec v{state.hash_spec}, "
                f"this build hashes with v{content_hash.HASH_SPEC}: rebuild it from the events"
            )
        recent = RecentPolicy(state.recent_min_blocks, state.recent_peak_factor)
        index = cls(salt=state.salt, recent=recent)
        for space_state in state.spaces:
            index._space(space_state.model, space_state.block_size).load_tables(space_state.tables)
        for worker_state in state.workers:
            space = index._space(worker_state.model, worker_state.block_size)
            worker = Worker.from_state(worker_state, space, recent)
            space.place(worker)
            index._workers[worker.worker_id] = worker
        for space in index._spaces.values():
            share_ints(space)
        index._totals = state.totals
        return index


def check_snapshot(data: bytes) -> None:
    """Refuse, with the reason, what is not a python index snapshot of this format."""
    if data[: len(NATIVE_MAGIC)] == NATIVE_MAGIC:
        raise ValueError(
            "a native index snapshot (FTKNIDX format), not a python one: the python backend "
            'cannot restore it (set [index] backend = "native", or rebuild from the events)'
        )
    try:
        header = _header.decode(data)
        version = msgspec.msgpack.decode(header[0], type=int)
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
        raise ValueError("not a foretoken python index snapshot (unreadable)") from None
    if version != SNAPSHOT_VERSION:
        raise ValueError(
            f"python index snapshot format version {version}, this build reads "
            f"{SNAPSHOT_VERSION} (v1 used content hash spec v1): rebuild it from the events"
        )


def _int_list(values: Sequence[int] | np.ndarray) -> list[int]:
    if isinstance(values, np.ndarray):
        converted: list[int] = values.astype(np.uint64, copy=False).tolist()
        return converted
    return list(values)


__all__ = ["TIERS", "ApplyStats", "CacheHit", "PrefixIndex"]
