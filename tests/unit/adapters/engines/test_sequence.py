"""Sequence tracking of one engine's KV-event stream (pure)."""

from __future__ import annotations

from foretoken.adapters.engines.sequence import SeqTracker
from foretoken.core.types import WorkerId

W = WorkerId("w1")


def test_seq_in_order_is_ok() -> None:
    tracker = SeqTracker()
    verdicts = [tracker.observe(W, seq).verdict for seq in range(5)]
    assert verdicts == ["ok"] * 5
    assert tracker.expected(W) == 5 and tracker.counters.ok == 5


def test_replayed_batches_below_expected_are_duplicates() -> None:
    tracker = SeqTracker()
    for seq in range(10):
        tracker.observe(W, seq)
    for seq in (9, 4):
        decision = tracker.observe_replayed(W, seq)
        assert decision.verdict == "duplicate" and not decision.apply
    assert tracker.counters.duplicates == 2 and tracker.expected(W) == 10


def test_seq_gap_repaired_by_replay() -> None:
    tracker = SeqTracker()
    for seq in range(3):
        tracker.observe(W, seq)
    gap = tracker.observe(W, 7)
    assert gap.verdict == "gap" and gap.missing == (3, 7) and not gap.apply
    # Replay from 3 returns 3..7 (the live 7 included), then the live stream goes on.
    assert [tracker.observe_replayed(W, seq).verdict for seq in range(3, 8)] == ["ok"] * 5
    assert tracker.observe(W, 8).verdict == "ok"
    assert tracker.observe_replayed(W, 7).verdict == "duplicate"


def test_a_replay_with_a_hole_does_not_move_the_stream() -> None:
    tracker = SeqTracker()
    tracker.observe(W, 0)
    tracker.observe(W, 5)  # gap [1, 5)
    assert tracker.observe_replayed(W, 3).verdict == "gap"
    assert tracker.expected(W) == 1


def test_seq_gap_given_up_with_force() -> None:
    tracker = SeqTracker()
    tracker.observe(W, 0)
    assert tracker.observe(W, 50).missing == (1, 50)
    tracker.force(W, 50)
    assert tracker.counters.lost_batches == 49 and tracker.observe(W, 51).verdict == "ok"


def test_seq_restart_to_zero_resets() -> None:
    tracker = SeqTracker()
    for seq in range(100):
        tracker.observe(W, seq)
    decision = tracker.observe(W, 0)
    assert decision.verdict == "restart" and decision.reset_index and decision.apply
    assert tracker.observe(W, 1).verdict == "ok" and tracker.counters.restarts == 1


def test_a_restart_whose_seq_0_was_lost_is_a_restart_not_duplicates() -> None:
    """Issue 16, finding 3: the restarted engine's seq-0 batch is lost; its seq 1, 2 … are
    below the old expected seq but are a new process's batches, never duplicates."""
    tracker = SeqTracker()
    tracker.force(W, 5000)
    decision = tracker.observe(W, 1)
    assert decision.verdict == "restart" and decision.missing == (0, 1)
    assert decision.reset_index and not decision.apply
    assert tracker.observe_replayed(W, 0).verdict == "ok"  # seq 0 from the new replay
    assert tracker.observe_replayed(W, 1).verdict == "ok"
    assert [tracker.observe(W, s).verdict for s in (2, 3)] == ["ok", "ok"]
    tracker.force(W, 7000)
    assert tracker.observe(W, 12).missing == (0, 12)  # far below: a restart too


def test_skip_moves_past_only_the_expected_seq() -> None:
    tracker = SeqTracker()
    tracker.observe(W, 0)
    assert not tracker.skip(W, 7)  # not the next one: its seq cannot be trusted
    assert not tracker.skip(WorkerId("new"), 0)  # a worker never seen: nothing to move
    assert tracker.expected(W) == 1
    assert tracker.skip(W, 1)
    assert tracker.observe(W, 2).verdict == "ok" and tracker.counters.skipped == 1


def test_seq_first_sight_late_is_a_gap_from_zero_and_state_survives_restore() -> None:
    tracker = SeqTracker()
    assert tracker.observe(W, 9).missing == (0, 9)
    tracker.force(W, 9)
    restored = SeqTracker()
    restored.restore(tracker.snapshot())
    assert restored.observe(W, 10).verdict == "ok"
    assert restored.observe(WorkerId("other"), 0).verdict == "ok"


def test_a_publisher_that_says_it_restarted_restarts_the_stream_at_any_seq() -> None:
    tracker = SeqTracker()
    for seq in range(5):
        tracker.observe(W, seq)
    decision = tracker.restarted(W, 8)  # above the expected 5: observe would call it a gap
    assert decision.verdict == "restart" and decision.missing == (0, 8) and decision.reset_index
    assert tracker.expected(W) == 0 and tracker.counters.restarts == 1
    assert tracker.restarted(W, 0).apply and tracker.expected(W) == 1
