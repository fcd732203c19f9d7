"""The ingest part of ``foretoken bench index`` (:mod:`foretoken.bench.index_bench`, whose
docstring says what is measured): simulated engines' KV event batches, applied to an index
and timed."""

from __future__ import annotations

import array
import gc
import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec

from foretoken.core.index.protocol import make_index
from foretoken.core.types import EngineBlockHash, ModelName, WorkerId
from foretoken.wire.codec import decode, encode
from foretoken.wire.records import BlockRemoved, BlockStored, KvEventBatch

MODEL = ModelName("bench-model")
BLOCK = 16
VOCAB = 150_000


def token_pool(rng: random.Random, size: int = 4096) -> list[tuple[int, ...]]:
    """Blocks of 16 random token ids."""
    return [tuple(rng.randrange(VOCAB) for _ in range(BLOCK)) for _ in range(size)]


class Engine:
    """One worker's batches: chains of stored blocks, FIFO eviction when full."""

    def __init__(
        self, worker_id: str, rng: random.Random, pool: list[tuple[int, ...]], capacity: int
    ) -> None:
        self.worker_id = WorkerId(worker_id)
        self.rng, self.pool, self.capacity = rng, pool, capacity
        self.resident: deque[tuple[EngineBlockHash, ...]] = deque()  # oldest first
        self.held = 0
        self.tails: list[EngineBlockHash] = []
        self.seq = 0

    def _stored(self) -> BlockStored:
        rng, pool = self.rng, self.pool
        n = rng.randint(16, 64)
        parent = (
            self.tails.pop(rng.randrange(len(self.tails)))
            if self.tails and rng.random() < 0.7
            else None
        )
        tokens = tuple(t for _ in range(n) for t in pool[rng.randrange(len(pool))])
        hashes = tuple(EngineBlockHash(h) for h in array.array("Q", rng.randbytes(8 * n)))
        self.resident.append(hashes)
        self.held += n
        self.tails.append(hashes[-1])
        del self.tails[:-8]
        return BlockStored(  # the ids packed, as the ingest decoder writes them
            block_hashes=hashes, parent_block_hash=parent,
            packed_token_ids=array.array("I", tokens).tobytes(), block_size=BLOCK,
        )  # fmt: skip

    def batch(self) -> KvEventBatch:
        events: list[BlockStored | BlockRemoved] = [
            self._stored() for _ in range(self.rng.randint(1, 3))
        ]
        excess = self.held - self.capacity
        if excess > 0:
            gone: list[EngineBlockHash] = []
            while excess > 0:
                chunk = self.resident.popleft()
                take = min(excess, len(chunk))
                gone += chunk[:take]
                if take < len(chunk):
                    self.resident.appendleft(chunk[take:])
                excess -= take
                self.held -= take
            dropped = set(gone)
            self.tails = [t for t in self.tails if t not in dropped]
            events.append(BlockRemoved(block_hashes=tuple(gone)))
        self.seq += 1
        return KvEventBatch(
            worker_id=self.worker_id, model=MODEL, seq=self.seq, ts=0.0, events=tuple(events)
        )


def stored_blocks(batches: Sequence[KvEventBatch]) -> int:
    return sum(len(e.block_hashes) for b in batches for e in b.events if isinstance(e, BlockStored))


def removed_blocks(batches: Sequence[KvEventBatch]) -> int:
    return sum(
        len(e.block_hashes) for b in batches for e in b.events if isinstance(e, BlockRemoved)
    )


def _int_ids(batch: KvEventBatch) -> KvEventBatch:
    """The batch with its token ids as tuples of ints (a producer that does not pack)."""
    events = tuple(
        msgspec.structs.replace(e, token_ids=tuple(e.token_id_list()), packed_token_ids=b"")
        if isinstance(e, BlockStored) else e
        for e in batch.events
    )  # fmt: skip
    return msgspec.structs.replace(batch, events=events)


def _packed(batch: KvEventBatch) -> list[tuple[Any, ...]]:
    """The batch's events as ``NativeIndex.apply_batch`` takes them, packed."""
    out: list[tuple[Any, ...]] = []
    for e in batch.events:
        assert isinstance(e, BlockStored | BlockRemoved)
        hashes = array.array("Q", e.block_hashes).tobytes()
        if isinstance(e, BlockStored):
            out.append(("stored", hashes, e.parent_block_hash, e.tokens, e.block_size))
        else:
            out.append(("removed", hashes))
    return out


def bench_ingest(backend: str, entries: int) -> dict[str, object]:
    """Run in a fresh process: fill to ``entries``, then time stores + removals."""
    rng = random.Random(7)
    pool = token_pool(rng)
    workers = 16
    engines = [Engine(f"w{i}", rng, pool, entries // workers) for i in range(workers)]
    index = make_index(backend)  # type: ignore[arg-type]
    for e in engines:
        index.register_worker(e.worker_id, MODEL, BLOCK)

    def make(n_batches: int) -> list[KvEventBatch]:
        return [e.batch() for _ in range(n_batches // workers) for e in engines]

    def apply_all(batches: list[KvEventBatch]) -> float:
        gc.collect()
        t0 = time.process_time()
        for b in batches:
            index.apply(b, 1.0)
        return time.process_time() - t0

    fill_cpu, fill_blocks = 0.0, 0
    while sum(e.held for e in engines) < entries:
        batches = make(1600)
        fill_blocks += stored_blocks(batches)
        fill_cpu += apply_all(batches)
    for _ in range(2):  # untimed: the recently-removed caches fill and page in
        apply_all(make(1600))
    rates, steady, removed = [], 0, 0
    for _ in range(5):
        batches = make(1600)
        n = stored_blocks(batches)
        steady += n
        removed += removed_blocks(batches)
        rates.append(n / apply_all(batches))
    out: dict[str, object] = {
        "backend": backend,
        "workers": workers,
        "entries": entries,
        "fill_stored_blocks_per_cpu_s": round(fill_blocks / fill_cpu),
        "steady_stored_blocks": steady,
        "steady_removed_blocks": removed,
        "stored_blocks_per_stored_event": 40,
        "steady_stored_blocks_per_cpu_s": round(statistics.median(rates)),
        "steady_segment_rates": [round(r) for r in rates],
    }
    core = getattr(index, "_core", None)
    if core is not None:  # records whose token ids are ints (the crate reads each one)
        ints = [_int_ids(b) for b in make(1600)]
        out["steady_int_ids_stored_blocks_per_cpu_s"] = round(stored_blocks(ints) / apply_all(ints))
        # the worker's path: the kv-events records as they come off Kafka, decoded, applied
        # (fresh batches each time: a batch seen before would be skipped as a re-delivery)
        for name, convert in (("decode_apply", None), ("decode_apply_int_ids", _int_ids)):
            for fmt in ("json", "msgpack"):
                group = [b if convert is None else convert(b) for b in make(1600)]
                raw = [encode(b, fmt) for b in group]
                gc.collect()
                t0 = time.process_time()
                for value in raw:
                    index.apply(decode(value, KvEventBatch), 1.0)
                out[f"steady_{name}_{fmt}_stored_blocks_per_cpu_s"] = round(
                    stored_blocks(group) / (time.process_time() - t0)
                )
    if core is not None:  # the crate alone: the hashes packed too, no struct to read
        batches = make(1600)
        packed = [(b.worker_id, b.seq, _packed(b)) for b in batches]
        gc.collect()
        t0 = time.process_time()
        for wid, seq, events in packed:
            core.apply_batch(wid, MODEL, seq, 0, events, 1.0)
        out["steady_packed_stored_blocks_per_cpu_s"] = round(
            stored_blocks(batches) / (time.process_time() - t0)
        )
    counters = index.totals
    out["counters"] = {
        k: getattr(counters, k) for k in counters.__struct_fields__ if getattr(counters, k)
    }
    return out
