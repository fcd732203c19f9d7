"""How each KV event changes the index (used by :class:`~foretoken.core.index.prefix.PrefixIndex`).

Functions over one worker's state (:class:`~foretoken.core.index.state.Worker`, whose space
holds the per-tier mask tables). The per-block work runs in C loops: ``map`` over
``dict.setdefault`` (stores: one pass per map, the entries it inserted are the table's last
ones) and ``dict.pop`` (removals: pop optimistically, put back if anything is unusual).
Python-level loops only run for the rare cases: duplicate copies, re-mapped engine hashes,
removals of blocks that are absent, copied, or unknown; and to file the blocks a removal
takes from the worker among its recently removed ones (the cross-tier rule,
:mod:`foretoken.core.index.recent`), in the order the native backend files them.

Engine hashes are map keys as they are (all 64 bits), like the native backend's.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice, repeat
from typing import cast

from foretoken.core.index import content_hash, spans
from foretoken.core.index.state import ApplyStats, Worker, tier_index
from foretoken.core.types import BlockRemoved, BlockStored


def store(worker: Worker, event: BlockStored, now_s: float, stats: ApplyStats) -> None:
    tokens = event.tokens
    # a tokenless store (an offload placeholder: no kind, no tokens) of a group the worker's
    # stores showed not to be full attention is that group's too: it credits no prefix
    if not event.full_attention or (not tokens and event.group_idx in worker.nonfull_groups):
        worker.nonfull_groups.add(event.group_idx)
        stats.ignored_blocks += len(event.block_hashes)
        return
    hashes: Sequence[int] = event.block_hashes
    tier = tier_index(event.medium)
    if not tokens:
        move(worker, spans.expand(worker.spans, hashes) if worker.spans else hashes, tier,
             now_s, stats)  # fmt: skip
        return
    extra_keys: Sequence[str] = event.extra_keys
    if event.block_size != worker.block_size:
        span = spans.span_of(event.block_size, worker.block_size, len(hashes))
        if not span:
            stats.block_size_mismatch_blocks += len(hashes)
            return
        if span > 1:  # LMCache's chunks: filed as the worker's blocks they span
            worker.spans.update(zip(hashes, repeat(span)))
            hashes, extra_keys = spans.split(hashes, span, extra_keys)
    seed = None
    parent = event.parent_block_hash
    if parent is not None:
        seed = worker.emap.get(parent)
        if seed is None:
            seed = worker.resolve_removed(parent)
            if seed is None:
                stats.unknown_parents += 1
            else:
                stats.recovered_parents += 1
    if seed is None:
        seed = worker.space.seed(event.lora_name)
    owns = content_hash.chain(seed, tokens, worker.block_size, extra_keys)
    if len(owns) != len(hashes):
        stats.malformed_blocks += abs(len(hashes) - len(owns))
        hashes = hashes[: len(owns)]
        owns = owns[: len(hashes)]
    add(worker, hashes, owns, tier, now_s, stats)


def move(worker: Worker, hashes: Sequence[int], tier: int, now_s: float, stats: ApplyStats) -> None:
    """A store without token ids (offload connectors): the block moved or copied tiers."""
    found = list(map(worker.emap.get, hashes))
    if None in found:
        pairs = []
        for engine_hash, own in zip(hashes, found, strict=True):
            if own is None:
                own = worker.resolve_removed(engine_hash)
                if own is None:
                    stats.unknown_moves += 1
                    continue
                stats.recovered_moves += 1
            pairs.append((engine_hash, own))
        hashes = [e for e, _ in pairs]
        found = [o for _, o in pairs]
    add(worker, hashes, cast(list[int], found), tier, now_s, stats)


def add(
    worker: Worker,
    hashes: Sequence[int],
    owns: list[int],
    tier: int,
    now_s: float,
    stats: ApplyStats,
) -> None:
    """File stored blocks: engine map, then this worker's bit in the tier's table."""
    olds = list(map(worker.emap.setdefault, hashes, owns))
    if olds != owns:
        remap(worker, hashes, owns, olds, stats)
    worker.tiers.add(tier)
    table = worker.space.masks[tier][worker.word]
    stats.stored_blocks += len(owns)
    before = len(table)
    masks = list(map(table.setdefault, owns, repeat(worker.bit)))
    added = len(table) - before
    worker.counts[tier] += added
    if added != len(owns):  # some blocks were known: other holders, or copies of ours
        add_known(worker, owns, masks, added, tier, table, stats)
    if worker.lru is not None:
        worker.touch(hashes, owns, now_s)
    if len(worker.emap) > worker.peak:
        worker.peak = len(worker.emap)


def add_known(
    worker: Worker,
    owns: list[int],
    masks: list[int],
    added: int,
    tier: int,
    table: dict[int, int],
    stats: ApplyStats,
) -> None:
    """Finish a store whose ``setdefault`` pass found existing entries. The entries
    it inserted are the table's last ``added`` keys (dicts keep insertion order)."""
    bit, dups = worker.bit, worker.dups[tier]
    inserted = set(islice(reversed(table), added))
    for own, mask in zip(owns, masks, strict=True):
        if mask is bit and own in inserted:
            inserted.discard(own)  # a second copy within this event is a duplicate
            continue
        mask = table[own]  # fresh: an earlier block of this event may have changed it
        if mask & bit:
            dups[own] = dups.get(own, 0) + 1
            stats.duplicate_stores += 1
        else:
            table[own] = mask | bit
            worker.counts[tier] += 1


def remap(
    worker: Worker,
    hashes: Sequence[int],
    owns: list[int],
    olds: list[int],
    stats: ApplyStats,
) -> None:
    """An engine hash now names other content (e.g. its parent was unknown before):
    what was filed under the old own hash is dropped for this worker."""
    for engine_hash, own, old in zip(hashes, owns, olds, strict=True):
        if old != own:
            stats.remapped_blocks += 1
            forget(worker, old)
            worker.emap[engine_hash] = own


def remove(worker: Worker, event: BlockRemoved, stats: ApplyStats) -> None:
    if event.group_idx in worker.nonfull_groups:
        stats.ignored_blocks += len(event.block_hashes)
        return
    hashes: Sequence[int] = event.block_hashes
    if worker.spans:
        hashes = spans.expand(worker.spans, hashes)
    tier = tier_index(event.medium)
    table = worker.space.masks[tier][worker.word]
    bit = worker.bit
    # Optimistic: pop from both maps in C loops, undo if anything is unusual.
    found = list(map(worker.emap.pop, hashes, repeat(None)))
    owns = cast(list[int], found)  # a None (unknown hash) pops mask 0: the undo path
    masks = list(map(table.pop, owns, repeat(0)))
    dups = worker.dups[tier]
    if all(map(bit.__and__, masks)) and (not dups or dups.keys().isdisjoint(owns)):
        if masks.count(bit) != len(masks):  # blocks other workers hold too
            table.update([(o, m ^ bit) for o, m in zip(owns, masks, strict=True) if m != bit])
        worker.counts[tier] -= len(owns)
        stats.removed_blocks += len(owns)
        gone: list[tuple[int, int]] = list(zip(hashes, owns, strict=True))
        if len(worker.tiers) > 1:
            gone = refile_held(worker, gone)
        for engine_hash, own in gone:
            worker.forget_engine(engine_hash, own)
        if worker.lru is not None:
            worker.untouch([own for _, own in gone])
        return
    for own, mask in zip(owns, masks, strict=True):
        if mask:
            table[own] = mask
    worker.emap.update((e, o) for e, o in zip(hashes, found, strict=True) if o is not None)
    remove_each(worker, hashes, tier, table, stats)


def refile_held(worker: Worker, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """After removing from one tier: (engine, own) pairs of blocks still held in another
    tier go back into the map. Returns the pairs of the blocks gone from the worker."""
    owns = [own for _, own in pairs]
    bit, held = worker.bit, [False] * len(owns)
    for tier in worker.tiers:
        masks = map(worker.space.masks[tier][worker.word].get, owns, repeat(0))
        held = [h or bool(m & bit) for h, m in zip(held, masks, strict=True)]
    if not any(held):
        return pairs
    worker.emap.update(pair for pair, h in zip(pairs, held, strict=True) if h)
    return [pair for pair, h in zip(pairs, held, strict=True) if not h]


def remove_each(
    worker: Worker,
    hashes: Sequence[int],
    tier: int,
    table: dict[int, int],
    stats: ApplyStats,
) -> None:
    bit, dups, emap = worker.bit, worker.dups[tier], worker.emap
    for engine_hash in hashes:
        own = emap.get(engine_hash)
        if own is None:
            stats.unknown_removals += 1
            continue
        extra = dups.get(own)
        if extra:
            if extra > 1:
                dups[own] = extra - 1
            else:
                del dups[own]
            stats.removed_blocks += 1
            continue
        mask = table.get(own, 0)
        if not mask & bit:
            stats.absent_removals += 1
            continue
        mask ^= bit
        if mask:
            table[own] = mask
        else:
            del table[own]
        worker.counts[tier] -= 1
        stats.removed_blocks += 1
        if not worker.holds(own):
            del emap[engine_hash]
            worker.forget_engine(engine_hash, own)
            if worker.lru is not None:
                worker.untouch([own])


def _unset(table: dict[int, int], own: int, bit: int) -> bool:
    """Clear the worker's ``bit`` in a block's mask (the entry goes with its last bit);
    whether it was set."""
    mask = table.get(own, 0)
    if not mask & bit:
        return False
    mask ^= bit
    if mask:
        table[own] = mask
    else:
        del table[own]
    return True


def forget(worker: Worker, own: int) -> None:
    """Drop every copy of one block on one worker, in every tier."""
    bit = worker.bit
    for tier in worker.tiers:
        if _unset(worker.space.masks[tier][worker.word], own, bit):
            worker.counts[tier] -= 1
        worker.dups[tier].pop(own, None)
    if worker.lru is not None:
        engine_hash = worker.untouch([own])
        if engine_hash is not None and worker.emap.get(engine_hash) == own:
            del worker.emap[engine_hash]
            worker.forget_engine(engine_hash, own)


def clear(worker: Worker, tier: int | None) -> None:
    """Clear-all, for one tier or all of them."""
    tiers = list(worker.tiers) if tier is None else [tier]
    owns = set(worker.emap.values())
    bit = worker.bit
    for t in tiers:
        table = worker.space.masks[t][worker.word]
        for own in owns:
            _unset(table, own, bit)
        worker.counts[t] = 0
        worker.dups[t].clear()
    if tier is None:
        worker.emap.clear()
        worker.spans.clear()
        worker.tiers.clear()
        worker.recent.clear()
        worker.approximate = False
        if worker.lru is not None:
            worker.lru.clear()
            worker.rev.clear()
        return
    worker.tiers.discard(tier)
    # remembered by engine hash (the order both backends can give)
    gone = sorted((e, o) for e, o in worker.emap.items() if not worker.holds(o))
    for engine_hash, own in gone:
        del worker.emap[engine_hash]
        worker.forget_engine(engine_hash, own)
        if worker.lru is not None:
            worker.untouch([own])


def reset(worker: Worker, reason: str, stats: ApplyStats, approximate: bool = True) -> None:
    """Forget the worker's blocks; its view stays flagged ``approximate`` unless the caller
    knows the engine's cache is empty too (a restarted engine)."""
    clear(worker, None)
    worker.approximate = approximate
    worker.resets += 1
    worker.reset_reason = reason
    stats.resets += 1


# ------------------------------------------------------------------ store-only


def sweep(worker: Worker, now_s: float, stats: ApplyStats) -> None:
    """Age out (TTL) and trim (capacity, least recently stored or looked up first)."""
    expired, trimmed = worker.victims(now_s)
    for own in expired + trimmed:
        forget(worker, own)
    stats.expired_blocks += len(expired)
    stats.trimmed_blocks += len(trimmed)
    worker.schedule_sweep(now_s)
