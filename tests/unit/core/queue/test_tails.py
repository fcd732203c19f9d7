"""Decoders whose answer length is a distribution (core/queue/tails.py): a replay gives
each its residual length at the step it reached, where a fixed estimate retires the ones
that outlived it at the next step."""

from __future__ import annotations

from foretoken.core.queue.inflight import InFlightEstimate
from foretoken.core.queue.scheduler import NewRequest, _Seq
from foretoken.core.queue.tails import tail_done
from foretoken.core.queue.worker_queue import WorkerQueue
from foretoken.core.types import RequestId, SchedulerSettings
from tests.unit.core.queue.test_scheduler import COST, NOW


class Recorded:
    """A tail that answers ``left`` and remembers what it was asked."""

    def __init__(self, left: int) -> None:
        self.asked: list[tuple[int, float]] = []
        self._left = left

    def left(self, produced: int, u: float) -> int:
        self.asked.append((produced, u))
        return self._left


def decoder(expected: int, tail: Recorded | None) -> _Seq:
    seq = _Seq(0, 10, 10, expected)
    seq.tail = tail
    return seq


def test_tailed_decoders_take_their_residual_length_the_others_keep_theirs() -> None:
    long, short = Recorded(40), Recorded(3)
    seqs = [decoder(10, long), decoder(10, None), decoder(20, short)]
    done = [95, 104, 130]  # at step 100: the first outlived its estimate (ended at 95)
    out = tail_done(seqs, done, 100)
    assert out == [140, 104, 103]
    # produced: 10 - (95 - 100), and at least one; quantiles spread over the tailed ones
    assert long.asked == [(15, 0.25)] and short.asked == [(1, 0.75)]
    assert done == [95, 104, 130]  # the source's list is not touched


def test_no_tail_no_copy() -> None:
    done = [5, 6]
    assert tail_done([decoder(4, None), decoder(4, None)], done, 3) is done


def _outlived_prediction(tail: Recorded | None) -> float:
    """Two decoders expected to answer 5 tokens, still running 200 steps later, fill a
    two-seat engine: how long does a new prompt wait for its first token?"""
    settings = SchedulerSettings(max_num_batched_tokens=512, max_num_seqs=2)
    queue = WorkerQueue(settings)
    for i in range(2):
        queue.add(RequestId(f"r{i}"), NOW, 100, 0, 5, tail=tail)
        queue.first_token(RequestId(f"r{i}"), NOW + 0.05)
    later = NOW + 2.0  # ~180 steps of 11 ms: far past the 5 tokens expected
    return queue.predict(NewRequest(100, 0, 5), later, COST).ttft_s


def test_a_tail_keeps_outlived_decoders_seated() -> None:
    fixed = _outlived_prediction(None)  # they leave at the next step: no wait
    tailed = _outlived_prediction(Recorded(300))  # 300 more tokens each: a 3 s wait
    assert fixed < 0.5
    assert tailed > 2.5


def test_an_estimate_counts_its_tailed_sequences() -> None:
    estimate = InFlightEstimate(SchedulerSettings(max_num_batched_tokens=64, max_num_seqs=4))
    estimate.arrive("a", NOW, 10, 0, 4, tail=Recorded(2))
    estimate.arrive("b", NOW, 10, 0, 4)
    assert estimate._tails == 1
    estimate.remove("b")
    assert estimate._tails == 1
    estimate.remove("a")
    assert estimate._tails == 0
