"""The engine feed's policies (sequencing, repair, restarts, undecodable messages) with its
I/O as plain functions: what it emits and dead-letters for a given stream of messages.
The same paths run on real sockets in tests/integration/test_ingest_edges.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec

from foretoken.adapters.engines.decoders import DecodedBatch, decode_engine_frames
from foretoken.adapters.engines.decoders import decode_engine_payload as decode_payload
from foretoken.adapters.engines.feed import EngineFeed, FeedIO
from foretoken.adapters.engines.health import EngineHealth
from foretoken.adapters.engines.sequence import SeqTracker
from foretoken.core.types import ModelName, WorkerId
from foretoken.sim.live.vllm_wire import encode_vllm_frames, seq_bytes
from foretoken.wire.records import BlockStored, IndexReset, KvEventBatch

W, M, BS = WorkerId("w"), ModelName("m"), 16


class Stream:
    """A feed whose replay socket holds ``replay`` and whose output is recorded."""

    def __init__(self, max_run: int = 16) -> None:
        self.replay: dict[int, bytes] = {}
        self.out: list[KvEventBatch] = []
        self.dead: list[str] = []
        self.health = EngineHealth(str(W))
        kw = {"engine": "vllm", "worker_id": W, "model": M, "default_block_size": BS}

        async def frames(f: Sequence[bytes]) -> DecodedBatch:
            return decode_engine_frames(f, **kw)  # type: ignore[arg-type]

        async def payload(seq: int, p: bytes) -> DecodedBatch:
            return decode_payload(p, seq=seq, **kw)  # type: ignore[arg-type]

        async def emit(batch: KvEventBatch) -> bool:
            self.out.append(batch)
            return True

        async def backfill(start: int) -> list[tuple[int, bytes]]:
            return sorted((s, p) for s, p in self.replay.items() if s >= start)

        async def dead_letter(reason: str, raw: bytes) -> None:
            self.dead.append(reason)

        io = FeedIO(frames, payload, emit, backfill, dead_letter)
        self.feed = EngineFeed(W, M, SeqTracker(), io, self.health, max_run)

    def batch(self, seq: int, *, publish: bool = True, replay: bool = True) -> None:
        event = BlockStored(block_hashes=(seq,), token_ids=tuple(range(BS)), block_size=BS)
        frames = encode_vllm_frames(b"", seq, 1.0, [event], block_size=BS)
        if replay:
            self.replay[seq] = frames[2]
        if publish:
            self.send(frames)

    def garbage(self, seq: int, *, replay: bool = True) -> None:
        if replay:
            self.replay[seq] = b"\xc1garbage"
        self.send([b"", seq_bytes(seq), b"\xc1garbage"])

    def send(self, frames: Sequence[bytes]) -> None:
        asyncio.run(self.feed.on_message(list(frames)))

    def seqs(self) -> list[int | str]:
        """What went out: data batches by seq, resets as 'R' (exact) / 'r' (approximate)."""
        out: list[int | str] = []
        for b in self.out:
            reset = next((e for e in b.events if isinstance(e, IndexReset)), None)
            out.append(b.seq if reset is None else ("r" if reset.approximate else "R"))
        return out


def test_garbage_at_the_expected_seq_is_a_lost_batch_not_a_reset() -> None:
    s = Stream()
    for seq in range(3):
        s.batch(seq)
    for seq in range(3, 8):
        s.garbage(seq)
    s.batch(8)
    assert s.seqs() == [0, 1, 2, 8]
    assert s.health.skipped == 5 and s.health.resets == 0 and len(s.dead) == 5


def test_garbage_whose_seq_cannot_be_trusted_changes_nothing() -> None:
    s = Stream()
    s.batch(0)
    s.send([b"", seq_bytes(10**15), b"\xc1"])  # a seq far ahead: no gap, no jump
    s.send([b"only one frame"])
    s.send([b"", b"\x00\x01", b"\xc1"])
    s.send([b"", seq_bytes(0), b"\xc1"])  # a seq gone back: no restart
    s.batch(1)
    assert s.seqs() == [0, 1] and s.health.gaps == 0 and s.health.engine_restarts == 0
    assert s.health.undecodable == 4 and s.health.skipped == 0


def test_a_gap_over_an_unreadable_batch_is_closed_by_the_replay_without_a_reset() -> None:
    s = Stream()
    s.batch(0)
    s.replay[1] = b"\xc1garbage"  # lost on the PUB socket, and unreadable in the replay too
    s.batch(2, publish=False)
    s.batch(3)
    assert s.seqs() == [0, 2, 3] and s.health.resets == 0
    assert s.health.backfilled == 1 and s.health.skipped == 1 and s.health.gaps == 1


def test_a_run_of_undecodable_batches_resets_once() -> None:
    s = Stream(max_run=3)
    s.batch(0)
    for seq in range(1, 10):
        s.garbage(seq)
    s.batch(10)
    assert s.seqs() == [0, "r", 10] and s.health.resets == 1


def test_a_run_of_undecodable_batches_after_a_lost_one_resets() -> None:
    s = Stream(max_run=3)
    for seq in range(10):
        s.batch(seq)
    for seq in range(11, 20):  # batch 10 was lost; every later one is unreadable
        s.garbage(seq, replay=False)
    assert s.seqs() == [*range(10), "r"] and s.health.skipped == 0


def test_an_engine_restarted_into_an_unreadable_format_is_reset() -> None:
    s = Stream(max_run=3)
    s.feed.tracker.restore({str(W): 1_000_000})  # a long-running engine restarts...
    for seq in range(10):  # ...and none of its new messages can be read
        s.garbage(seq)
    assert s.seqs() == ["r"] and s.health.resets == 1
    s.send([b"", seq_bytes((1 << 64) - 1), b"\xc1"])  # a garbage seq never breaks a reset
    assert s.health.undecodable == 11


def test_an_unrepairable_gap_resets_approximately() -> None:
    s = Stream()
    s.batch(0)
    s.batch(1, publish=False, replay=False)
    s.batch(2)
    assert s.seqs() == [0, "r", 2] and s.health.gaps == 1


def test_a_restart_seen_at_seq_0_is_an_exact_reset() -> None:
    s = Stream()
    for seq in range(5):
        s.batch(seq)
    s.replay.clear()
    s.batch(0)
    s.batch(1)
    assert s.seqs() == [0, 1, 2, 3, 4, "R", 0, 1] and s.health.engine_restarts == 1


def test_a_restart_whose_seq_0_was_lost_is_repaired_and_exact() -> None:
    """Finding 3: its later batches were dropped as duplicates until the old seq."""
    s = Stream()
    for seq in range(50):
        s.batch(seq)
    s.replay.clear()
    s.batch(0, publish=False)
    for seq in range(1, 4):
        s.batch(seq)
    assert s.seqs()[50:] == ["R", 0, 1, 2, 3] and s.health.backfilled == 1


def test_a_restart_whose_first_batches_are_gone_is_an_approximate_reset() -> None:
    s = Stream()
    for seq in range(50):
        s.batch(seq)
    s.replay.clear()
    s.batch(0, publish=False, replay=False)
    s.batch(1)
    s.batch(2)
    assert s.seqs()[50:] == ["r", 1, 2]


def test_a_restart_with_an_unreadable_first_batch_is_not_exact() -> None:
    s = Stream()
    for seq in range(5):
        s.batch(seq)
    s.replay = {0: b"\xc1"}
    s.batch(1)
    assert s.seqs()[5:] == ["r", 1] and s.health.skipped == 1


def test_a_bad_event_is_dead_lettered_and_the_rest_of_its_batch_goes_out() -> None:
    s = Stream()
    s.batch(0)
    removed = ["BlockRemoved", [0], "GPU"]
    bad = {"type": "BlockStored", "block_hashes": [5], "token_ids": [-1] * BS}
    payload = msgspec.msgpack.encode([2.0, [bad, removed], 0])
    s.send([b"", seq_bytes(1), payload])
    s.batch(2)
    assert s.seqs() == [0, 1, 2]  # no lost batch, no gap, no reset
    assert [type(e).__name__ for e in s.out[1].events] == ["BlockRemoved"]
    assert len(s.dead) == 1 and s.dead[0].startswith("seq 1 event 0: token ids")
    assert s.health.bad_events == 1 and s.health.undecodable == 0


def test_a_new_sglang_epoch_is_a_restart_even_above_the_old_seq() -> None:
    """SGLang's topic names its publisher's epoch: a new one is a new process, whose missed
    first batches come through its replay, whatever seq the old one had reached."""
    s = Stream()
    old, new = b"kv\x00sgl-kv-epoch=aaaa", b"kv\x00sgl-kv-epoch=bbbb\x00sgl-kv-snapshot=1"

    def frames(topic: bytes, seq: int) -> list[bytes]:
        event = BlockStored(block_hashes=(seq,), token_ids=tuple(range(BS)), block_size=BS)
        return encode_vllm_frames(topic, seq, 1.0, [event], block_size=BS)

    for seq in range(5):
        s.send(frames(old, seq))
    s.replay = {seq: frames(new, seq)[2] for seq in range(9)}  # 0..7 missed live
    s.send(frames(new, 8))
    s.send(frames(new, 9))
    assert s.seqs() == [0, 1, 2, 3, 4, "R", *range(10)] and s.health.engine_restarts == 1
