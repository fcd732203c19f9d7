"""The two backends of the index, differentially: the same random streams of registrations,
KV batches and calls go through the native index and the Python reference, and every
answer must be identical — each call's counters, every lookup (from token ids and from own
hashes, with and without LoRA and extra keys, refreshing store-only workers or not), the
own hashes, ``stats()``, ``totals``, ``last_seq``, and the state after a snapshot and
restore. The streams hold stores (chained, from the root, with unknown, known or recently
removed parents, LoRA, extra keys, other tiers, non-full-attention groups, malformed ones,
duplicate copies), removals (known, unknown, recently removed, of absent copies), tier
moves, clears of one tier or all, resets (events and calls), re-deliveries of a batch,
cross-tier interleavings (a chain's GPU removals and its slower-tier stores in every order,
in one batch or across batches), LMCache's chunks (stores of several blocks each, a
partial last one), store-only workers (served prompts, TTL, capacity, aging, lookups that
refresh) and re-registrations. The cross-tier bound is small here so that the
recently removed caches overflow and grow.

Both backends are built from the same code path as the processor's
(:func:`~foretoken.core.index.protocol.make_index`)."""

from __future__ import annotations

import random
from typing import Any

import hypothesis.strategies as st
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings

from foretoken.core.index.protocol import Index, make_index, restore_index
from foretoken.core.index.recent import RecentPolicy
from foretoken.core.index.state import TIERS, ApplyStats
from foretoken.core.types import EngineBlockHash, ModelName, WorkerId
from foretoken.wire.records import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    IndexReset,
    KvEvent,
    KvEventBatch,
    Tier,
)
from foretoken.wire.route_rpc import pack_token_ids

M = ModelName("m")
# name: (block size, eagle, store-only ttl, capacity)
WORKERS: dict[str, tuple[int, bool, float | None, int | None]] = {
    "a": (2, False, None, None),
    "b": (2, True, None, None),
    "c": (4, False, None, None),
    "s": (2, False, 5.0, 6),
}
# 12 blocks of 2 tokens (6 of 4); D1 shares 2 blocks of 2 with D0, D2 shares 4.
DOCS = [
    [100 + i for i in range(24)],
    [100 + i for i in range(4)] + [300 + i for i in range(20)],
    [100 + i for i in range(8)] + [500 + i for i in range(16)],
    [700 + i for i in range(24)],
]
LORAS = [None, None, None, "sql"]
KEYS = [(), (), (), ('["salt"]',), ("", "img")]
MEDIA: tuple[Tier, ...] = ("GPU", "GPU", "CPU", "DISK", "SHARED")
# Small bound: the recently removed caches overflow (4-way sets) and grow in these streams.
RECENT = RecentPolicy(min_blocks=4, peak_factor=0.5)


def engine_hash(worker: str, doc: int, block: int, variant: int) -> int:
    """Deterministic engine hashes; variants 1 and 2 differ from 0 only in the top bits
    (an index that masked keys to 60 bits would merge them)."""
    h = xxhash.xxh3_64_intdigest(repr((worker, doc, block)).encode())
    return h ^ ((variant & 3) << 61)


class Stream:
    """Turns (kind, seed) ops into concrete calls, remembering what each worker was sent."""

    def __init__(self) -> None:
        self.sent: dict[str, list[int]] = {w: [] for w in WORKERS}
        self.seq: dict[str, int] = dict.fromkeys(WORKERS, 0)
        self.last: KvEventBatch | None = None
        self.now = 0.0
        self.sizes = {w: spec[0] for w, spec in WORKERS.items()}

    def batch(self, worker: str, *events: KvEvent) -> KvEventBatch:
        self.seq[worker] += 1
        self.last = KvEventBatch(
            worker_id=WorkerId(worker), model=M, seq=self.seq[worker], ts=0.0, events=events
        )
        return self.last

    def pick(self, rng: random.Random, worker: str, n: int) -> list[int]:
        sent = self.sent[worker]
        out = []
        for _ in range(n):
            roll = rng.random()
            if sent and roll < 0.9:
                out.append(rng.choice(sent[-40:]))
            else:
                out.append(rng.getrandbits(64))
        return out

    def stored(self, rng: random.Random, worker: str) -> list[BlockStored]:
        size = self.sizes[worker]
        blocks = len(DOCS[0]) // size
        doc = rng.randrange(len(DOCS))
        start = rng.randrange(blocks)
        stop = min(blocks, start + rng.randint(1, 5))
        variant = rng.choice([0, 0, 0, 1, 2])
        hashes = [engine_hash(worker, doc, b, variant) for b in range(start, stop)]
        tokens = DOCS[doc][start * size : stop * size]
        how = rng.random()
        if start and how < 0.6:
            parent: int | None = engine_hash(worker, doc, start - 1, variant)
        elif how < 0.7:
            parent = rng.getrandbits(64)  # unknown
        else:
            parent = None
        if rng.random() < 0.1 and len(tokens) > size:
            tokens = tokens[:-size] if rng.random() < 0.5 else [*tokens, 9, 9, 9]
        self.sent[worker].extend(hashes)
        lora = rng.choice(LORAS)
        keys = rng.choice(KEYS)
        medium = rng.choice(MEDIA)
        full = rng.random() > 0.05
        packed = rng.random() < 0.5  # as the ingest decoder writes them, or as ints
        event = BlockStored(
            block_hashes=tuple(map(EngineBlockHash, hashes)),
            parent_block_hash=None if parent is None else EngineBlockHash(parent),
            token_ids=() if packed else tuple(tokens),
            packed_token_ids=pack_token_ids(tokens) if packed else b"",
            block_size=size if rng.random() > 0.03 else 3,
            lora_name=lora,
            medium=medium,
            group_idx=0 if full else 1,
            full_attention=full,
            extra_keys=keys,
        )
        return [event, event] if rng.random() < 0.1 else [event]  # a duplicate copy

    def op(self, kind: str, seed: int, indexes: list[Index]) -> list[Any]:
        """Runs one op on every index; returns what each call answered."""
        rng = random.Random(seed)
        worker = rng.choice(sorted(WORKERS))
        wid = WorkerId(worker)
        self.now += rng.choice([0.0, 0.5, 1.0, 3.0])
        now = self.now
        if kind == "store":
            events: list[KvEvent] = [*self.stored(rng, worker)]
            if rng.random() < 0.3:
                events += self.stored(rng, worker)
            batch = self.batch(worker, *events)
            return [ix.apply(batch, now) for ix in indexes]
        if kind == "remove":
            hashes = self.pick(rng, worker, rng.randint(1, 4))
            event = BlockRemoved(
                block_hashes=tuple(map(EngineBlockHash, hashes)),
                medium=rng.choice(MEDIA),
                group_idx=0 if rng.random() > 0.05 else 1,
            )
            batch = self.batch(worker, event)
            return [ix.apply(batch, now) for ix in indexes]
        if kind == "move":
            hashes = self.pick(rng, worker, rng.randint(1, 4))
            moved = BlockStored(
                block_hashes=tuple(map(EngineBlockHash, hashes)),
                block_size=self.sizes[worker],
                medium=rng.choice(MEDIA[2:]),
            )
            batch = self.batch(worker, moved)
            return [ix.apply(batch, now) for ix in indexes]
        if kind == "cross":
            return self.cross(rng, worker, indexes, now)
        if kind == "chunks":
            batch = self.batch(worker, *self.chunks(rng, worker))
            return [ix.apply(batch, now) for ix in indexes]
        if kind == "clear":
            medium = rng.choice([None, *TIERS])
            batch = self.batch(worker, AllCleared(medium=medium))
            return [ix.apply(batch, now) for ix in indexes]
        if kind == "reset":
            if rng.random() < 0.5:
                batch = self.batch(worker, IndexReset(reason=f"gap {seed % 97}"))
                return [ix.apply(batch, now) for ix in indexes]
            for ix in indexes:
                ix.reset_worker(wid, "restart")
            return [None, None]
        if kind == "redeliver" and self.last is not None:
            last = self.last
            return [ix.apply(last, now) for ix in indexes]
        if kind == "serve":
            doc = DOCS[rng.randrange(len(DOCS))]
            prompt = doc[: rng.randint(2, len(doc))]
            owns = [ix.hash_prompt(M, self.sizes[worker], prompt) for ix in indexes]
            assert all(o.tolist() == owns[0].tolist() for o in owns)
            return [ix.observe_served(wid, o, now) for ix, o in zip(indexes, owns, strict=True)]
        if kind == "age":
            if rng.random() < 0.5:
                for ix in indexes:
                    ix.age(now)
                return [None, None]
            return [ix.maintain(now) for ix in indexes]
        if kind == "touch":
            doc = DOCS[rng.randrange(len(DOCS))]
            return [ix.lookup(M, doc, now_s=now) for ix in indexes]
        if kind == "register":
            size, eagle, ttl, cap = WORKERS[worker]
            roll = rng.random()
            if roll < 0.3:
                eagle = not eagle
            elif roll < 0.6:
                ttl, cap = (None, None) if ttl or cap else (4.0, rng.choice([None, 5]))
            elif roll < 0.75:
                size = 4 if size == 2 else 2  # another space: the worker starts afresh
            elif roll < 0.85:
                for ix in indexes:
                    ix.remove_worker(wid)
            self.sizes[worker] = size
            for ix in indexes:
                ix.register_worker(
                    wid, M, size, eagle=eagle, store_only_ttl_s=ttl, capacity_blocks=cap
                )
            return [None, None]
        return [None for _ in indexes]

    def chunks(self, rng: random.Random, worker: str) -> list[BlockStored]:
        """LMCache's stores: chunks of several of the worker's blocks chained by their
        parents (one event each, or several in one), a partial last chunk, now and then
        chunks that are no multiple of the worker's blocks."""
        size = self.sizes[worker]
        chunk = size * rng.choice([2, 3]) + (1 if rng.random() < 0.1 else 0)
        doc = rng.randrange(len(DOCS))
        tokens = DOCS[doc]
        count = len(tokens) // chunk
        hashes = [engine_hash(worker, doc, 1000 + chunk * 10 + j, 0) for j in range(count)]
        self.sent[worker].extend(hashes)
        medium = rng.choice(MEDIA)
        events = []
        start = rng.randrange(count)
        stop = rng.randint(start + 1, count)
        step = rng.choice([1, 1, 2])
        for j in range(start, stop, step):
            js = list(range(j, min(j + step, stop)))
            events.append(BlockStored(
                block_hashes=tuple(EngineBlockHash(hashes[k]) for k in js),
                parent_block_hash=EngineBlockHash(hashes[j - 1]) if j else None,
                token_ids=tuple(tokens[js[0] * chunk : (js[-1] + 1) * chunk]),
                block_size=chunk, medium=medium,
                extra_keys=rng.choice([(), tuple(rng.choice(["", '["img"]']) for _ in js)]),
            ))  # fmt: skip
        if stop == count and rng.random() < 0.5:  # the prompt's partial last chunk
            rest = tokens[count * chunk :] or tokens[-1:]
            events.append(BlockStored(
                block_hashes=(EngineBlockHash(engine_hash(worker, doc, 999, 0)),),
                parent_block_hash=EngineBlockHash(hashes[-1]), token_ids=tuple(rest),
                block_size=len(rest), medium=medium,
            ))  # fmt: skip
        return events

    def cross(self, rng: random.Random, worker: str, indexes: list[Index], now: float) -> list[Any]:
        """A chain stored in the GPU, then its removals from the GPU and its stores in a
        slower tier (moves, or stores with token ids and parents) in a random order, in one
        batch or several."""
        size = self.sizes[worker]
        doc = rng.randrange(len(DOCS))
        blocks = rng.randint(2, 5)
        hashes = [engine_hash(worker, doc, b, 3) for b in range(blocks)]
        tokens = DOCS[doc][: blocks * size]
        self.sent[worker].extend(hashes)
        chain = BlockStored(
            block_hashes=tuple(map(EngineBlockHash, hashes)), token_ids=tuple(tokens),
            block_size=size,
        )  # fmt: skip
        first = self.batch(worker, chain)
        answers = [[ix.apply(first, now)] for ix in indexes]
        tier: Tier = rng.choice(["CPU", "DISK"])
        steps: list[KvEvent] = [BlockRemoved(block_hashes=(EngineBlockHash(h),)) for h in hashes]
        with_tokens = rng.random() < 0.5
        for b, h in enumerate(hashes):
            if with_tokens:
                parent = None if b == 0 else EngineBlockHash(hashes[b - 1])
                steps.append(BlockStored(
                    block_hashes=(EngineBlockHash(h),), parent_block_hash=parent,
                    token_ids=tuple(tokens[b * size : (b + 1) * size]), block_size=size,
                    medium=tier,
                ))  # fmt: skip
            else:
                steps.append(
                    BlockStored(block_hashes=(EngineBlockHash(h),), block_size=size, medium=tier)
                )
        rng.shuffle(steps)
        while steps:
            cut = rng.randint(1, len(steps))
            batch = self.batch(worker, *steps[:cut])
            steps = steps[cut:]
            for answer, ix in zip(answers, indexes, strict=True):
                answer.append(ix.apply(batch, now))
        return answers


KINDS = (
    ["store"] * 8
    + ["remove"] * 5
    + ["move"] * 2
    + ["cross"] * 2
    + ["chunks"] * 2
    + ["clear", "reset", "redeliver", "serve", "serve", "age", "touch", "register"]
)
ops_strategy = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 2**32)), min_size=1, max_size=40
)


def fresh() -> list[Index]:
    indexes = [make_index("native", recent=RECENT), make_index("python", recent=RECENT)]
    for ix in indexes:
        for worker, (size, eagle, ttl, cap) in WORKERS.items():
            ix.register_worker(
                WorkerId(worker), M, size, eagle=eagle, store_only_ttl_s=ttl, capacity_blocks=cap
            )
    return indexes


def answers_of(ix: Index) -> dict[str, Any]:
    """Everything observable without changing the index."""
    out: dict[str, Any] = {}
    for d, doc in enumerate(DOCS):
        for length in (len(doc), 11, 5):
            prompt = doc[:length]
            out[f"doc{d}/{length}"] = ix.lookup(M, prompt)
            out[f"doc{d}/{length}/sql"] = ix.lookup(M, prompt, lora_name="sql")
            out[f"doc{d}/{length}/keys"] = ix.lookup(M, prompt, extra_keys=['["salt"]'])
        own = {size: ix.hash_prompt(M, size, doc) for size in (2, 4)}
        out[f"doc{d}/own"] = ix.lookup(M, own_hashes=own)
        out[f"doc{d}/own-values"] = {size: h.tolist() for size, h in own.items()}
    out["stats"] = ix.stats()
    out["totals"] = ix.totals
    out["workers"] = ix.worker_ids()
    out["last_seq"] = {w: ix.last_seq(WorkerId(w)) for w in WORKERS}
    return out


def assert_same(indexes: list[Index], where: str) -> None:
    native, python = (answers_of(ix) for ix in indexes)
    for key in python:
        assert native[key] == python[key], f"{where}: {key} differs"


def run(ops: list[tuple[str, int]]) -> None:
    indexes = fresh()
    stream = Stream()
    for i, (kind, seed) in enumerate(ops):
        native, python = stream.op(kind, seed, indexes)
        assert native == python, f"op {i} {kind}: answers differ"
        assert_same(indexes, f"after op {i} ({kind})")
    copies = [restore_index(ix.snapshot(), backend) for ix, backend in
              zip(indexes, ("native", "python"), strict=True)]  # fmt: skip
    assert_same(copies, "after snapshot and restore")
    for later in range(5):  # the restored indexes go on as the originals would
        kind, seed = KINDS[later * 5 % len(KINDS)], later
        native, python = stream.op(kind, seed, copies)
        assert native == python
        assert_same(copies, f"restored, op {kind}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy)
def test_both_backends_answer_the_same(ops: list[tuple[str, int]]) -> None:
    run(ops)


@pytest.mark.parametrize("seed", range(3))
def test_long_streams_answer_the_same(seed: int) -> None:
    rng = random.Random(seed)
    run([(rng.choice(KINDS), rng.getrandbits(32)) for _ in range(400)])


def test_each_backend_refuses_the_others_snapshot_by_name() -> None:
    native, python = fresh()
    batch = KvEventBatch(
        worker_id=WorkerId("a"), model=M, seq=1, ts=0.0,
        events=(BlockStored(block_hashes=(EngineBlockHash(1),), token_ids=(1, 2), block_size=2),),
    )  # fmt: skip
    assert native.apply(batch, 0.0) == python.apply(batch, 0.0) == ApplyStats(1, 1)
    with pytest.raises(ValueError, match="native index snapshot"):
        restore_index(native.snapshot(), "python")
    with pytest.raises(ValueError, match="not a foretoken native index snapshot"):
        restore_index(python.snapshot(), "native")


def test_old_python_snapshots_are_refused_with_their_version() -> None:
    import msgspec

    _, python = fresh()
    state = msgspec.msgpack.decode(python.snapshot())
    state[0] = 1  # the format of content hash spec v1
    with pytest.raises(ValueError, match="format version 1, this build reads 2"):
        restore_index(msgspec.msgpack.encode(state), "python")
    with pytest.raises(ValueError, match="not a foretoken python index snapshot"):
        restore_index(b"\x00garbage", "python")
