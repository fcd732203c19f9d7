"""The index against a brute-force model of the spec, on random event streams, for every
backend. The model (``ModelWorker``) is the plain reading of the spec: per worker a dict
engine hash → prefix (the tuple of all tokens from the start of the chain), a dict
(prefix, tier) → physical copies, walked per worker at lookup, and the cross-tier rule's
recently removed engine hashes (engine hash → prefix: an engine hash that leaves the map is
remembered, and a store naming it as parent or a move naming it resolves it; the walks stay
far below the index's bound, so the model needs none). It never hashes anything, so it
checks the index's own content hash as well as its bookkeeping."""

from __future__ import annotations

import random
from collections.abc import Sequence

import hypothesis.strategies as st
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings

from foretoken.core.index.protocol import Index, IndexBackend, restore_index
from foretoken.core.index.state import TIERS
from foretoken.core.types import EngineBlockHash, WorkerId
from foretoken.wire.records import AllCleared, BlockRemoved, BlockStored, IndexReset, KvEvent, Tier
from tests.contract import test_index_contract as contract
from tests.contract.test_index_contract import (
    BS,
    M,
    backend,  # noqa: F401  (every backend)
    batch,
    new_index,
    removed,
    stored,
    tokens_of,
)

# --------------------------------------------------------------------------- model

# Documents of blocks (BS tokens each) whose tokens are unique per (document, position)
# except where documents share a prefix: D1 shares 2 blocks with D0, D2 shares 4.
DOCS = [
    [(100 + 2 * i, 101 + 2 * i) for i in range(6)],
    [(100 + 2 * i, 101 + 2 * i) for i in range(2)] + [(300 + 2 * i, 301 + 2 * i) for i in range(4)],
    [(100 + 2 * i, 101 + 2 * i) for i in range(4)] + [(500 + 2 * i, 501 + 2 * i) for i in range(2)],
    [(700 + 2 * i, 701 + 2 * i) for i in range(6)],
]
WORKERS = {"a": (0, False), "b": (1, True), "c": (0, False)}  # name: (engine hash seed, eagle)
MEDIA: tuple[Tier, ...] = ("GPU", "CPU", "DISK")
STORE_MEDIA: tuple[Tier, ...] = ("GPU", "GPU", "GPU", "CPU", "DISK")


def engine_hash(worker: str, doc: int, block: int) -> int:
    seed = WORKERS[worker][0]
    prefix = tuple(t for blk in DOCS[doc][: block + 1] for t in blk)
    return xxhash.xxh3_64_intdigest(repr((seed, prefix)).encode())


class ModelWorker:
    def __init__(self) -> None:
        self.emap: dict[int, tuple[int, ...]] = {}
        self.copies: dict[tuple[tuple[int, ...], str], int] = {}
        self.recent: dict[int, tuple[int, ...]] = {}

    def resolve(self, h: int) -> tuple[int, ...] | None:
        prefix = self.emap.get(h)
        return self.recent.get(h) if prefix is None else prefix

    def drop_engine(self, h: int) -> None:
        self.recent[h] = self.emap.pop(h)

    def holds(self, prefix: tuple[int, ...]) -> bool:
        return any(self.copies.get((prefix, t), 0) for t in TIERS)

    def forget(self, prefix: tuple[int, ...]) -> None:
        for tier in TIERS:
            self.copies.pop((prefix, tier), None)

    def store(self, event: BlockStored) -> None:
        if not event.token_ids:
            for h in event.block_hashes:
                known = self.resolve(h)
                if known is not None:
                    key = (known, event.medium)
                    self.copies[key] = self.copies.get(key, 0) + 1
                    self.emap[h] = known
            return
        parent = event.parent_block_hash
        prefix = (self.resolve(parent) or ()) if parent is not None else ()
        for i, h in enumerate(event.block_hashes):
            prefix = prefix + tuple(event.token_ids[i * BS : (i + 1) * BS])
            old = self.emap.get(h)
            if old is not None and old != prefix:
                self.forget(old)
            self.emap[h] = prefix
            self.copies[(prefix, event.medium)] = self.copies.get((prefix, event.medium), 0) + 1

    def remove(self, event: BlockRemoved) -> None:
        for h in event.block_hashes:
            prefix = self.emap.get(h)
            key = (prefix, event.medium)
            if prefix is None or not self.copies.get(key):
                continue
            self.copies[key] -= 1  # type: ignore[index]
            if not self.copies[key]:  # type: ignore[index]
                del self.copies[key]
            if not self.holds(prefix):
                self.drop_engine(h)

    def clear(self, medium: str | None) -> None:
        self.copies = {
            k: v for k, v in self.copies.items() if medium is not None and k[1] != medium
        }
        if medium is None:
            self.emap, self.recent = {}, {}
            return
        for h in [h for h, p in self.emap.items() if not self.holds(p)]:
            self.drop_engine(h)

    def hit(self, prompt: Sequence[int], eagle: bool) -> dict[str, int]:
        per_tier = dict.fromkeys(TIERS, 0)
        best_tiers = []
        for k in range(len(prompt) // BS):
            held = [t for t in TIERS if self.copies.get((tuple(prompt[: (k + 1) * BS]), t))]
            if not held:
                break
            best_tiers.append(held[0])
        if eagle and best_tiers:
            best_tiers.pop()
        for tier in best_tiers:
            per_tier[tier] += BS
        return {t: n for t, n in per_tier.items() if n}


store_op = st.tuples(
    st.just("store"),
    st.sampled_from(sorted(WORKERS)),
    st.integers(0, len(DOCS) - 1),
    st.integers(0, 5),
    st.integers(1, 6),
    st.sampled_from(STORE_MEDIA),
    st.sampled_from(["parent", "parent", "root"]),
)
# Removals and tier moves pick engine hashes the model knows (by rank; 41..: a recently
# removed one; -1: an unknown one).
picks = st.lists(st.integers(-1, 48), min_size=1, max_size=3, unique=True)
remove_op = st.tuples(
    st.just("remove"), st.sampled_from(sorted(WORKERS)), picks, st.integers(0, len(MEDIA))
)
move_op = st.tuples(
    st.just("move"), st.sampled_from(sorted(WORKERS)), picks, st.sampled_from(MEDIA)
)
clear_op = st.tuples(
    st.just("clear"), st.sampled_from(sorted(WORKERS)), st.sampled_from([None, *MEDIA])
)
reset_op = st.tuples(st.just("reset"), st.sampled_from(sorted(WORKERS)))
OPS = {
    "store": store_op,
    "remove": remove_op,
    "move": move_op,
    "clear": clear_op,
    "reset": reset_op,
}
KINDS = ["store"] * 6 + ["remove"] * 5 + ["move"] * 2 + ["clear", "reset"]
ops_strategy = st.lists(st.sampled_from(KINDS).flatmap(OPS.__getitem__), min_size=5, max_size=50)


def picked_hashes(model: ModelWorker, ranks: list[int]) -> list[int]:
    known, gone = sorted(model.emap), sorted(model.recent)
    out = []
    for r in ranks:
        if r >= 41 and gone:
            out.append(gone[r % len(gone)])
        elif r >= 0 and known:
            out.append(known[r % len(known)])
        else:
            out.append(12345 + r)
    return out


def to_event(op: tuple, fleet: dict[str, ModelWorker]) -> tuple[str, KvEvent]:
    kind, worker = op[0], op[1]
    model = fleet[worker]
    if kind == "store":
        _, _, doc, start, length, medium, how = op
        stop = min(6, start + length)
        hashes = [engine_hash(worker, doc, b) for b in range(start, stop)]
        parent = engine_hash(worker, doc, start - 1) if how == "parent" and start else None
        tokens = [t for blk in DOCS[doc][start:stop] for t in blk]
        return worker, stored(hashes, tokens, parent=parent, medium=medium)
    if kind == "move":
        hashes = picked_hashes(model, op[2])
        event = BlockStored(
            block_hashes=tuple(map(EngineBlockHash, hashes)), block_size=BS, medium=op[3]
        )
        return worker, event
    if kind == "remove":
        hashes = picked_hashes(model, op[2])
        prefix = model.emap.get(hashes[0])
        held = [t for t in TIERS if prefix is not None and model.copies.get((prefix, t))]
        medium = MEDIA[op[3] - 1] if op[3] or not held else held[0]
        return worker, removed(hashes, medium)
    if kind == "clear":
        return worker, AllCleared(medium=op[2])
    return worker, IndexReset(reason="test")


def check_equal(index: Index, fleet: dict[str, ModelWorker]) -> None:
    for doc in DOCS:
        prompt = [t for blk in doc for t in blk]
        for length in (len(prompt), 7, 3):
            hits = index.lookup(M, prompt[:length])
            for worker, (_, eagle) in WORKERS.items():
                assert tokens_of(hits[WorkerId(worker)]) == fleet[worker].hit(
                    prompt[:length], eagle
                )
    for worker, model in fleet.items():
        blocks = index.stats()["workers"][worker]["blocks"]  # type: ignore[index]
        for tier in TIERS:
            assert blocks[tier] == sum(1 for (_, t) in model.copies if t == tier)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy)
def test_index_agrees_with_the_brute_force_model(ops: list[tuple]) -> None:
    run_against_model(ops)


def run_against_model(ops: list[tuple]) -> None:
    index = new_index()
    for worker, (_, eagle) in WORKERS.items():
        index.register_worker(WorkerId(worker), M, BS, eagle=eagle)
    fleet = {worker: ModelWorker() for worker in WORKERS}
    for seq, op in enumerate(ops):
        worker, event = to_event(op, fleet)
        index.apply(batch(worker, event, seq=seq), float(seq))
        model = fleet[worker]
        if isinstance(event, BlockStored):
            model.store(event)
        elif isinstance(event, BlockRemoved):
            model.remove(event)
        else:
            model.clear(event.medium if isinstance(event, AllCleared) else None)
        check_equal(index, fleet)
    copy = restore_index(index.snapshot(), current_backend())
    assert copy.snapshot() == index.snapshot()
    check_equal(copy, fleet)


def random_op(rng: random.Random) -> tuple:
    """One op of the same shapes as ``ops_strategy``, for long seeded walks."""
    kind = rng.choice(["clear", "reset"]) if rng.random() < 0.03 else rng.choice(KINDS[:-2])
    worker = rng.choice(sorted(WORKERS))
    ranks = rng.sample(range(-1, 49), rng.randint(1, 3))
    if kind == "store":
        how = rng.choice(["parent", "parent", "root"])
        doc, start, length = rng.randrange(len(DOCS)), rng.randrange(6), rng.randint(1, 6)
        return (kind, worker, doc, start, length, rng.choice(STORE_MEDIA), how)
    if kind == "remove":
        return (kind, worker, ranks, rng.choice([0, 0, 0, 1, 2, 3]))
    if kind == "move":
        return (kind, worker, ranks, rng.choice(MEDIA))
    if kind == "clear":
        return (kind, worker, rng.choice([None, *MEDIA]))
    return (kind, worker)


@pytest.mark.parametrize("seed", range(4))
def test_long_random_walks_agree_with_the_model(seed: int) -> None:
    rng = random.Random(seed)
    run_against_model([random_op(rng) for _ in range(600)])


def current_backend() -> IndexBackend:
    return contract._BACKEND
