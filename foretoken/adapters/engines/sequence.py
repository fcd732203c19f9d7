"""Sequence numbers of one engine's KV-event stream: which batch to apply, which is a
duplicate, where a gap is (backfilled through the engine's replay socket, or accepted as
lost), and when the engine restarted (its sequence went back)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from foretoken.core.types import WorkerId

SeqVerdict = Literal["ok", "duplicate", "gap", "restart"]


@dataclass(frozen=True, slots=True)
class SeqDecision:
    """What to do with one batch, by its sequence number.

    ``ok``: apply it. ``duplicate``: already applied (or older): drop it (only for batches
    that come back through replay). ``gap``: batches ``missing`` = [start, stop) were not
    seen: repair them through replay (they then arrive as ``ok``, this batch included) or
    accept the loss with :meth:`SeqTracker.force`; this batch is not applied yet.
    ``restart``: the engine restarted: reset that worker's index first; apply the batch
    when ``missing`` is None, else repair or force as for a gap.
    """

    verdict: SeqVerdict
    seq: int
    expected: int | None
    missing: tuple[int, int] | None = None

    @property
    def apply(self) -> bool:
        return self.missing is None and self.verdict in ("ok", "restart")

    @property
    def reset_index(self) -> bool:
        return self.verdict == "restart"


@dataclass(slots=True)
class SeqCounters:
    ok: int = 0
    duplicates: int = 0
    gaps: int = 0
    restarts: int = 0
    forced: int = 0
    lost_batches: int = 0
    skipped: int = 0


class SeqTracker:
    """Per-worker sequence tracking for engine batches (pure, no I/O).

    Live batches (the PUB socket, :meth:`observe`): a worker seen for the first time at
    seq 0 is ``ok``; at seq N > 0 it is a ``gap`` of [0, N). A known worker: ``expected``
    is ``ok``; higher is a ``gap``; **lower is a ``restart``** — a PUB socket never repeats a
    message and backfills are asked from the next expected seq, so a live seq that goes back
    means a new process, whether its seq-0 batch arrived (then applied at once) or was lost
    (then [0, seq) is repaired through the new process's replay, or forced). Batches that
    come back through replay (:meth:`observe_replayed`): lower than expected is a
    ``duplicate``. A restart whose first batch we saw at N above the last seq is
    indistinguishable from a gap.
    """

    def __init__(self) -> None:
        self.counters = SeqCounters()
        self._expected: dict[WorkerId, int] = {}

    def expected(self, worker_id: WorkerId) -> int | None:
        return self._expected.get(worker_id)

    def observe(self, worker_id: WorkerId, seq: int) -> SeqDecision:
        """A batch from the engine's PUB socket."""
        _check(seq)
        expected = self._expected.get(worker_id)
        if expected is None:
            if seq == 0:
                return self._accept(worker_id, seq, None)
            self.counters.gaps += 1
            self._expected[worker_id] = 0
            return SeqDecision("gap", seq, None, (0, seq))
        if seq == expected:
            return self._accept(worker_id, seq, expected)
        if seq > expected:
            self.counters.gaps += 1
            return SeqDecision("gap", seq, expected, (expected, seq))
        return self.restarted(worker_id, seq)

    def restarted(self, worker_id: WorkerId, seq: int) -> SeqDecision:
        """A live batch of a new engine process (its seq went back, or its publisher said
        so: SGLang's topic epoch): its stream is [0, seq] whatever seq was expected."""
        _check(seq)
        expected = self._expected.get(worker_id)
        self.counters.restarts += 1
        self._expected[worker_id] = 0 if seq else 1
        return SeqDecision("restart", seq, expected, (0, seq) if seq else None)

    def observe_replayed(self, worker_id: WorkerId, seq: int) -> SeqDecision:
        """A batch that came back through the engine's replay socket."""
        _check(seq)
        expected = self._expected.get(worker_id, 0)
        if seq == expected:
            return self._accept(worker_id, seq, expected)
        if seq > expected:
            return SeqDecision("gap", seq, expected, (expected, seq))
        self.counters.duplicates += 1
        return SeqDecision("duplicate", seq, expected)

    def skip(self, worker_id: WorkerId, seq: int) -> bool:
        """Batch ``seq`` came but cannot be read: when it is the expected one, the stream moves
        past it (its content is lost; no gap, no repair) and True; else nothing changes."""
        if self._expected.get(worker_id) != seq:
            return False
        self.counters.skipped += 1
        self._expected[worker_id] = seq + 1
        return True

    def force(self, worker_id: WorkerId, seq: int) -> None:
        """Give up on repairing: the caller applies batch ``seq`` and continues after it."""
        expected = self._expected.get(worker_id, 0)
        self.counters.forced += 1
        self.counters.lost_batches += max(0, seq - expected)
        self._expected[worker_id] = seq + 1

    def forget(self, worker_id: WorkerId) -> None:
        self._expected.pop(worker_id, None)

    def snapshot(self) -> dict[str, int]:
        """The next expected seq per worker (counters are metrics, not state)."""
        return {str(worker): seq for worker, seq in self._expected.items()}

    def restore(self, state: Mapping[str, int]) -> None:
        self._expected = {WorkerId(k): int(v) for k, v in state.items()}

    def _accept(self, worker_id: WorkerId, seq: int, expected: int | None) -> SeqDecision:
        self.counters.ok += 1
        self._expected[worker_id] = seq + 1
        return SeqDecision("ok", seq, expected)


def _check(seq: int) -> None:
    if seq < 0:
        raise ValueError(f"seq must be >= 0, got {seq}")
