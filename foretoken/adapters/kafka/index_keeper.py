"""The live cache index inside the Faust worker: registrations and KV batches applied to the
pure index (the configured backend, ``[index] backend``), re-deliveries skipped by Kafka
offset, and snapshots on disk.

Restart story: the snapshot holds the index and, per ``kv-events`` partition, the offset of
the last batch it contains. Before the Faust worker starts, the group's committed offsets
for ``kv-events`` are set to the offsets after the snapshot (``foretoken.adapters.kafka.offsets``),
so the
agent replays exactly what the snapshot lacks; a batch at or below the snapshot's offset is
skipped. ``workers`` (compacted) is always read from the start, so registrations are never
missed either. A snapshot the configured backend cannot restore (another backend's, an older
format or hash spec) is logged and ignored: the topic is replayed from the start.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec

from foretoken.adapters.files import write_atomically
from foretoken.adapters.kafka.dispatch import Position
from foretoken.core.index.approx import ApproxCacheConfig, index_params
from foretoken.core.index.protocol import Index, IndexConfig
from foretoken.core.types import ModelName, WorkerId
from foretoken.settings import Settings
from foretoken.wire.records import KvEventBatch, Record, WorkerRegistration

log = logging.getLogger(__name__)
SNAPSHOT_VERSION = 1
# Batches of a worker whose registration has not been consumed yet (the two topics are read
# independently) wait here, up to this many per worker and for this many workers; past either
# bound a batch is dead-lettered with the reason (memory and snapshots stay bounded whatever
# a producer writes under made-up worker ids).
MAX_PENDING_BATCHES = 10_000
MAX_PENDING_WORKERS = 1_024


def snapshot_path(settings: Settings) -> Path:
    return settings.snapshot_path / "index.snapshot"


class _Snapshot(msgspec.Struct, frozen=True):
    version: int
    topic: str
    applied: dict[int, int]
    index: bytes
    ts: float
    pending: dict[str, list[KvEventBatch]] = {}


class IndexKeeper:
    def __init__(
        self,
        topic: str,
        path: Path | None,
        index: Index | None = None,
        approx: ApproxCacheConfig | None = None,
        config: IndexConfig | None = None,
    ) -> None:
        self.topic = topic
        self.approx = approx or ApproxCacheConfig()
        self.config = config or IndexConfig()
        self.registrations: dict[WorkerId, WorkerRegistration] = {}
        self.path = path
        self.index = index if index is not None else self.config.make()
        self.applied: dict[int, int] = {}  # partition -> offset of the last applied batch
        self.skipped = 0
        self.snapshots = 0
        self.known: set[WorkerId] = set()
        self.pending: dict[WorkerId, list[KvEventBatch]] = {}
        self.dropped_pending = 0
        self.restored_from: dict[int, int] | None = None  # snapshot offsets we resumed from
        self.applied_since_start = 0

    # ------------------------------------------------------------------ handlers

    def on_worker(self, record: Record, pos: Position) -> None:
        assert isinstance(record, WorkerRegistration)
        if record.removed:
            self.index.remove_worker(record.worker_id)
            self.known.discard(record.worker_id)
            self.registrations.pop(record.worker_id, None)
            return
        ttl_s, capacity = index_params(record, self.approx)
        self.index.register_worker(
            record.worker_id,
            record.model,
            record.block_size,
            eagle=record.eagle,
            store_only_ttl_s=ttl_s,
            capacity_blocks=capacity,
        )
        self.known.add(record.worker_id)
        self.registrations[record.worker_id] = record
        for batch in self.pending.pop(record.worker_id, []):
            self.index.apply(batch, time.time())

    def on_kv(self, record: Record, pos: Position) -> None:
        assert isinstance(record, KvEventBatch)
        if pos.partition is not None and pos.offset is not None:
            if pos.offset <= self.applied.get(pos.partition, -1):
                self.skipped += 1
                return
            self.applied[pos.partition] = pos.offset
        self.applied_since_start += 1
        if record.worker_id not in self.known:
            self._hold(record)
            return
        self.index.apply(record, time.time())

    def _hold(self, record: KvEventBatch) -> None:
        waiting = self.pending.get(record.worker_id)
        if waiting is None and len(self.pending) >= MAX_PENDING_WORKERS:
            self.dropped_pending += 1
            raise ValueError(
                f"KV batch of unregistered worker {record.worker_id!r}: batches of "
                f"{len(self.pending)} unregistered workers already wait (bound)"
            )
        if waiting is not None and len(waiting) >= MAX_PENDING_BATCHES:
            self.dropped_pending += 1
            raise ValueError(
                f"KV batch of unregistered worker {record.worker_id!r}: "
                f"{len(waiting)} of its batches already wait for its registration (bound)"
            )
        self.pending.setdefault(record.worker_id, []).append(record)

    def adopt(self, other: IndexKeeper) -> None:
        """Take ``other``'s index, offsets and waiting batches (a snapshot loaded anew by a
        route replica at a rebalance); this keeper's counters and approximate settings stay."""
        self.index = other.index
        self.applied = dict(other.applied)
        self.restored_from = other.restored_from
        self.pending = other.pending
        self.known = set(other.known)

    # ------------------------------------------------------------------ snapshots

    def next_offsets(self) -> dict[int, int]:
        return {p: off + 1 for p, off in self.applied.items()}

    def save(self) -> Path | None:
        """Write the snapshot atomically (temp file, fsync, rename)."""
        if self.path is None:
            return None
        snap = _Snapshot(
            version=SNAPSHOT_VERSION,
            topic=self.topic,
            applied=dict(self.applied),
            index=self.index.snapshot(),
            ts=time.time(),
            pending={w: list(b) for w, b in self.pending.items()},
        )
        write_atomically(self.path, msgspec.msgpack.encode(snap))
        self.snapshots += 1
        return self.path

    @classmethod
    def load(cls, topic: str, path: Path | None, config: IndexConfig | None = None) -> IndexKeeper:
        """The keeper from the snapshot at ``path``, or an empty one (a missing, foreign or
        unreadable snapshot means a full replay of the topic, never a crash)."""
        keeper = cls(topic, path, config=config)
        if path is None or not path.exists():
            return keeper
        try:
            snap = msgspec.msgpack.decode(path.read_bytes(), type=_Snapshot)
            if snap.version != SNAPSHOT_VERSION or snap.topic != topic:
                raise ValueError(f"snapshot of {snap.topic} v{snap.version}")
            keeper.index = keeper.config.restore(snap.index)
            keeper.applied = dict(snap.applied)
            keeper.restored_from = dict(snap.applied)
            keeper.pending = {WorkerId(w): list(b) for w, b in snap.pending.items()}
            keeper.known = set(keeper.index.worker_ids())
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            log.warning("ignoring index snapshot %s (%s): replaying %s from the start",
                        path, exc, topic)  # fmt: skip
            keeper = cls(topic, path, config=config)
        return keeper

    # ------------------------------------------------------------------ inspection

    def cache_page(self, model: str) -> dict[str, object]:
        stats = self.index.stats()
        workers = {
            wid: w | self._source(WorkerId(wid))
            for wid, w in stats["workers"].items()  # type: ignore[attr-defined]
            if w["model"] == model
        }
        return {
            "model": model,
            "workers": workers,
            "applied_offsets": self.applied,
            "skipped_redeliveries": self.skipped,
            "restored_from_snapshot": self.restored_from,
            "applied_since_start": self.applied_since_start,
            "pending_unregistered": {w: len(b) for w, b in self.pending.items()},
            "pending_dead_lettered": self.dropped_pending,
            "counters": stats["counters"],
        }

    def _source(self, worker: WorkerId) -> dict[str, object]:
        """How the index knows this worker's cache: ``cache_source`` "events" (the engine's
        KV events) or "approximate" (routed prompts, aged by TTL and capacity)."""
        reg = self.registrations.get(worker)
        if reg is None:
            return {"cache_source": None}
        if reg.has_kv_events:
            return {"cache_source": reg.cache_source}
        ttl_s, capacity = index_params(reg, self.approx)
        return {"cache_source": reg.cache_source, "ttl_s": ttl_s, "capacity_blocks": capacity}

    def lookup_page(self, model: str, token_ids: list[int]) -> dict[str, object]:
        self.index.age(time.time())
        hits = self.index.lookup(ModelName(model), token_ids)
        return {
            "model": model,
            "prompt_tokens": len(token_ids),
            "hits": {
                WorkerId(w): {
                    "tokens": h.tokens,
                    "by_tier": h.by_tier(),
                    "approximate": h.approximate,
                    **self._source(WorkerId(w)),
                }
                for w, h in hits.items()
            },
        }
