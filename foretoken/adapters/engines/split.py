"""One engine batch as ``kv-events`` records that each fit the producer's limit (pure).

A batch whose encoding is bigger than ``limit`` bytes becomes several records of the same
worker, model, seq, time and rank whose events, in order, are the batch's: events are packed
greedily, and one event too big on its own is cut by its block hashes — a ``BlockStored``
piece keeps its share of the token ids and extra keys, and names the previous piece's last
hash as its parent, so the index chains it exactly as if it had come whole; a
``BlockRemoved`` piece is a plain slice. Applied in order (one key, one partition), the
records change the index exactly as the batch would. A single block bigger than the limit
cannot be represented: it is left out and reported (the caller dead-letters it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from foretoken.wire.codec import encode
from foretoken.wire.records import BlockRemoved, BlockStored, KvEvent, KvEventBatch, WireFormat

# Room left in every record for the separators between events.
SEPARATOR_SLACK = 64


@dataclass(slots=True)
class Records:
    """The encoded records of one batch, and what could not be put in any."""

    values: list[bytes] = field(default_factory=list)
    events: list[int] = field(default_factory=list)  # events per record (after cutting)
    dropped: list[str] = field(default_factory=list)

    @property
    def split(self) -> bool:
        return len(self.values) > 1


def encode_records(batch: KvEventBatch, limit: int, wire_format: WireFormat) -> Records:
    """``batch`` as records of at most ``limit`` encoded bytes each (see the module doc).

    Halving: a record too big is encoded again as two halves of its events (each level
    encodes the batch once, so a batch of many small events costs a few encodings); a
    single event too big is cut by its block hashes first."""
    out = Records()
    envelope = len(encode(msgspec.structs.replace(batch, events=()), wire_format))
    budget = limit - envelope - SEPARATOR_SLACK
    pending: list[tuple[KvEvent, ...]] = [batch.events]
    while pending:
        events = pending.pop()
        value = encode(msgspec.structs.replace(batch, events=events), wire_format)
        if len(value) <= limit:
            out.values.append(value)
            out.events.append(len(events))
        elif len(events) > 1:
            half = len(events) // 2
            pending += [events[half:], events[:half]]  # the first half is taken next
        elif budget < 1:
            out.dropped.append(f"a record's envelope alone ({envelope} bytes) exceeds {limit}")
        else:
            pieces = _cut(events[0], budget, wire_format, out.dropped)
            if len(pieces) > 1 or (pieces and pieces[0] is not events[0]):
                pending.append(tuple(pieces))
            elif pieces:  # fits the budget yet not the limit: the envelope estimate was off
                out.dropped.append(f"one {type(events[0]).__name__} does not fit a record")
    return out


def _cut(event: KvEvent, budget: int, fmt: WireFormat, dropped: list[str]) -> list[KvEvent]:
    """The event, or pieces of it, each encoding within ``budget`` bytes."""
    size = len(encode(event, fmt))
    if size <= budget:
        return [event]
    if not isinstance(event, BlockStored | BlockRemoved) or len(event.block_hashes) < 2:
        dropped.append(f"one {type(event).__name__} of {size} bytes exceeds the record limit")
        return []
    if isinstance(event, BlockStored) and not _cuttable(event):
        dropped.append(f"a BlockStored of {size} bytes whose token ids do not fill its blocks")
        return []
    n = len(event.block_hashes)
    parts = -(-size // max(1, budget * 9 // 10))  # ~90% full, so few pieces need a second cut
    step = max(1, -(-n // parts))
    out: list[KvEvent] = []
    for start in range(0, n, step):
        piece = _slice(event, start, min(n, start + step))
        out.extend(_cut(piece, budget, fmt, dropped))
    return out


def _cuttable(event: BlockStored) -> bool:
    n = len(event.block_hashes)
    count = event.token_count
    tokens_ok = not count or count == n * event.block_size
    return tokens_ok and (not event.extra_keys or len(event.extra_keys) == n)


def _slice(event: BlockStored | BlockRemoved, start: int, stop: int) -> KvEvent:
    hashes = event.block_hashes[start:stop]
    if isinstance(event, BlockRemoved):
        return msgspec.structs.replace(event, block_hashes=hashes)
    bs = event.block_size
    return msgspec.structs.replace(
        event,
        block_hashes=hashes,
        parent_block_hash=event.parent_block_hash if start == 0 else event.block_hashes[start - 1],
        token_ids=event.token_ids[start * bs : stop * bs] if event.token_ids else (),
        packed_token_ids=event.packed_token_ids[4 * start * bs : 4 * stop * bs],
        extra_keys=event.extra_keys[start:stop] if event.extra_keys else (),
    )
